//! `flashattn run` round trips: inputs written with the safetensors crate (or as a hand-made
//! .npz), outputs read back and compared with the f64 oracle, for several option combinations.

mod cli_support;

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use cli_support::*;
use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, DType, Tensor, Window};
use rand::{SeedableRng, rngs::StdRng};
use safetensors::tensor::Dtype;

/// Writes `inputs`, runs `run` with `opts`, and returns the outputs (asserting success).
fn round_trip(
    dir: &Dir,
    inputs: &[Input],
    opts: &[&str],
) -> HashMap<String, (Vec<usize>, Dtype, Vec<f64>)> {
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, inputs);
    let mut args = vec!["run", "--input", s(&input), "--output", s(&output)];
    args.extend_from_slice(opts);
    let o = flashattn(&args);
    assert!(o.status.success(), "run failed: {}", stderr(&o));
    read_safetensors(&output)
}

fn find<'a>(inputs: &'a [Input], name: &str) -> Option<&'a Input> {
    inputs.iter().find(|x| x.name == name)
}

/// q, k, v (and bias, rel_bias, alibi, dout) of `inputs` as library tensors in the logical layout.
fn library_inputs(
    inputs: &[Input],
    bhnd: bool,
    params: AttentionParams,
) -> (Vec<Tensor>, AttentionParams) {
    let view = |t: Tensor| {
        if bhnd {
            let r = t.rank();
            t.transpose(r - 3, r - 2).unwrap()
        } else {
            t
        }
    };
    let mut p = params;
    if let Some(b) = find(inputs, "bias") {
        p.bias = Some(tensor(b));
    }
    if let Some(t) = find(inputs, "rel_bias") {
        p.rel_bias = Some(tensor(t));
    }
    if let Some(a) = find(inputs, "alibi_slopes") {
        p.alibi_slopes = Some(tensor(a));
    }
    if let (Some(cq), Some(ck)) = (find(inputs, "cu_seqlens_q"), find(inputs, "cu_seqlens_k")) {
        let ints = |x: &Input| x.values.iter().map(|&v| v as i32).collect();
        p = p.varlen(ints(cq), ints(ck));
    }
    let ts = ["q", "k", "v", "dout"]
        .iter()
        .filter_map(|n| find(inputs, n))
        .map(|x| view(tensor(x)))
        .collect();
    (ts, p)
}

/// Checks `run`'s outputs against the oracle: out and lse (f32: rel ≤ 1e-5; f16/bf16: within 2×
/// the standard attention's error), and the gradients when dout was given (relative to the
/// magnitude of their terms, against the FlashAttention-2 formulation for the returned output).
fn check_against_oracle(
    inputs: &[Input],
    outputs: &HashMap<String, (Vec<usize>, Dtype, Vec<f64>)>,
    params: AttentionParams,
    bhnd: bool,
) {
    let (ts, p) = library_inputs(inputs, bhnd, params);
    let (q, k, v) = (&ts[0], &ts[1], &ts[2]);
    let o = oracle::forward(q, k, v, &p).unwrap();
    let (out_shape, out_dtype, out_vals) = &outputs["out"];
    assert_eq!(
        *out_dtype,
        find(inputs, "q").unwrap().dtype,
        "out dtype is q's"
    );
    let out_logical = if bhnd {
        swap_seq_heads(out_vals, out_shape)
    } else {
        out_vals.clone()
    };
    let err = rel(&out_logical, &o.out, norm(&o.out));
    let bound = match q.dtype() {
        DType::F32 => 1e-5,
        _ => {
            let s = standard::forward(q, k, v, &p).unwrap();
            2.0 * rel(&s.out.to_f64_vec().unwrap(), &o.out, norm(&o.out)) + 1e-6
        }
    };
    println!("out rel {err:.2e} (bound {bound:.2e})");
    assert!(err <= bound, "out rel {err} > {bound}");
    let (lse_shape, lse_dtype, lse) = &outputs["lse"];
    assert_eq!(*lse_dtype, Dtype::F32);
    assert_eq!(lse.len(), o.lse.len(), "lse shape {lse_shape:?}");
    for (a, b) in lse.iter().zip(&o.lse) {
        if *b == f64::NEG_INFINITY {
            assert_eq!(*a, f64::NEG_INFINITY, "a row that sees no key has lse -inf");
        } else {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "lse {a} vs {b}");
        }
    }
    let Some(dout) = ts.get(3) else {
        assert!(!outputs.contains_key("dq"), "no dout, no gradients");
        return;
    };
    assert_eq!(q.dtype(), DType::F32, "gradients are checked in f32 here");
    let out_t = Tensor::from_vec(
        out_logical.iter().map(|&x| x as f32).collect(),
        &o_shape(q, v),
    )
    .unwrap();
    let reference = oracle::backward_given_out(q, k, v, &out_t, dout, &p).unwrap();
    let magnitudes = oracle::backward_magnitudes(q, k, v, dout, &p).unwrap();
    let mut pairs = vec![
        ("dq", reference.dq, magnitudes.dq, true),
        ("dk", reference.dk, magnitudes.dk, true),
        ("dv", reference.dv, magnitudes.dv, true),
    ];
    if let (Some(r), Some(m)) = (reference.dbias, magnitudes.dbias) {
        pairs.push(("dbias", r, m, false));
    }
    if let (Some(r), Some(m)) = (reference.drel_bias, magnitudes.drel_bias) {
        pairs.push(("drel_bias", r, m, false));
    }
    assert_eq!(
        outputs.len(),
        2 + pairs.len(),
        "outputs: {:?}",
        outputs.keys()
    );
    for (name, want, terms, qkv_like) in pairs {
        let (shape, _, got) = &outputs[name];
        let got = if bhnd && qkv_like {
            swap_seq_heads(got, shape)
        } else {
            got.clone()
        };
        let err = rel(&got, &want, norm(&terms));
        println!("{name} rel {err:.2e}");
        assert!(err <= 1e-5, "{name} rel {err}");
    }
}

fn o_shape(q: &Tensor, v: &Tensor) -> Vec<usize> {
    let mut s = q.shape().to_vec();
    *s.last_mut().unwrap() = *v.shape().last().unwrap();
    s
}

#[test]
fn run_causal_gqa_round_trip_matches_the_oracle() {
    let mut rng = StdRng::seed_from_u64(301);
    let dir = Dir::new();
    let inputs = [
        random(&mut rng, "q", &[2, 37, 4, 16], Dtype::F32),
        random(&mut rng, "k", &[2, 53, 2, 16], Dtype::F32),
        random(&mut rng, "v", &[2, 53, 2, 24], Dtype::F32),
    ];
    let out = round_trip(&dir, &inputs, &["--causal"]);
    assert_eq!(out["out"].0, vec![2, 37, 4, 24]);
    assert_eq!(out["lse"].0, vec![2, 4, 37]);
    check_against_oracle(&inputs, &out, AttentionParams::default().causal(), false);
}

#[test]
fn run_bhnd_with_every_score_option_and_backward_matches_the_oracle() {
    let mut rng = StdRng::seed_from_u64(302);
    let dir = Dir::new();
    let (b, h, hk, nq, nk, d) = (2, 4, 2, 29, 41, 32);
    let mut slopes = random(&mut rng, "alibi_slopes", &[b, h], Dtype::F32);
    slopes.values.iter_mut().for_each(|s| *s = s.abs() * 0.1);
    let inputs = [
        random(&mut rng, "q", &[b, h, nq, d], Dtype::F32),
        random(&mut rng, "k", &[b, hk, nk, d], Dtype::F32),
        random(&mut rng, "v", &[b, hk, nk, d], Dtype::F32),
        random(&mut rng, "dout", &[b, h, nq, d], Dtype::F32),
        random(&mut rng, "bias", &[1, h, nq, nk], Dtype::F32),
        random(&mut rng, "rel_bias", &[h, 15], Dtype::F32),
        slopes,
    ];
    let opts = [
        "--layout",
        "bhnd",
        "--window-left",
        "9",
        "--window-right",
        "4",
        "--softcap",
        "7.5",
        "--scale",
        "0.3",
    ];
    let out = round_trip(&dir, &inputs, &opts);
    assert_eq!(out["out"].0, vec![b, h, nq, d], "out stored in bhnd like q");
    assert_eq!(out["dk"].0, vec![b, hk, nk, d]);
    assert_eq!(out["dbias"].0, vec![1, h, nq, nk]);
    assert_eq!(out["drel_bias"].0, vec![h, 15]);
    let p = AttentionParams::default()
        .window(9, 4)
        .softcap(7.5)
        .scale(0.3);
    check_against_oracle(&inputs, &out, p, true);
}

#[test]
fn run_varlen_with_an_empty_sequence_and_backward_matches_the_oracle() {
    let mut rng = StdRng::seed_from_u64(303);
    let dir = Dir::new();
    let (cq, ck) = ([0, 13, 13, 40], [0, 20, 31, 31]);
    let inputs = [
        random(&mut rng, "q", &[40, 4, 8], Dtype::F32),
        random(&mut rng, "k", &[31, 1, 8], Dtype::F32),
        random(&mut rng, "v", &[31, 1, 8], Dtype::F32),
        random(&mut rng, "dout", &[40, 4, 8], Dtype::F32),
        int32("cu_seqlens_q", &cq),
        int32("cu_seqlens_k", &ck),
    ];
    let out = round_trip(&dir, &inputs, &["--causal"]);
    assert_eq!(out["lse"].0, vec![4, 40], "varlen lse is [heads, total_q]");
    check_against_oracle(&inputs, &out, AttentionParams::default().causal(), false);
}

#[test]
fn run_half_precision_is_within_twice_the_standard_error() {
    for (seed, dtype) in [(304, Dtype::F16), (305, Dtype::BF16)] {
        let mut rng = StdRng::seed_from_u64(seed);
        let dir = Dir::new();
        let inputs = [
            random(&mut rng, "q", &[1, 70, 2, 64], dtype),
            random(&mut rng, "k", &[1, 70, 2, 64], dtype),
            random(&mut rng, "v", &[1, 70, 2, 64], dtype),
        ];
        let out = round_trip(&dir, &inputs, &["--window-left", "20"]);
        let p = AttentionParams {
            window: flashattn::Window::new(Some(20), None),
            ..Default::default()
        };
        check_against_oracle(&inputs, &out, p, false);
    }
}

#[test]
fn run_diagonal_matches_the_library_and_the_oracle() {
    let mut rng = StdRng::seed_from_u64(313);
    let dir = Dir::new();
    let mut slopes = random(&mut rng, "alibi_slopes", &[4], Dtype::F32);
    slopes.values.iter_mut().for_each(|s| *s = s.abs() * 0.1);
    let inputs = [
        random(&mut rng, "q", &[2, 23, 4, 16], Dtype::F32),
        random(&mut rng, "k", &[2, 31, 2, 16], Dtype::F32),
        random(&mut rng, "v", &[2, 31, 2, 16], Dtype::F32),
        random(&mut rng, "dout", &[2, 23, 4, 16], Dtype::F32),
        slopes,
    ];
    // Before the first key for the first rows; past the default (8) with a window.
    let cases = [
        (vec!["--causal", "--diagonal", "-3"], Window::CAUSAL, -3),
        (
            vec!["--window-left", "5", "--window-right", "2", "--diagonal=20"],
            Window::new(Some(5), Some(2)),
            20,
        ),
    ];
    for (opts, window, d) in cases {
        let out = round_trip(&dir, &inputs, &opts);
        let p = AttentionParams {
            window,
            ..Default::default()
        }
        .diagonal(d);
        check_against_oracle(&inputs, &out, p.clone(), false);
        let (ts, p) = library_inputs(&inputs, false, p);
        let want = flashattn::forward(&ts[0], &ts[1], &ts[2], &p).unwrap();
        assert_eq!(out["out"].2, want.out.to_f64_vec().unwrap(), "{opts:?}");
    }
}

/// A `.npy` array (format 1.0) of the input's values in its dtype (`<f4` or `<f2`), as numpy
/// writes it.
fn npy(x: &Input) -> Vec<u8> {
    let descr = match x.dtype {
        Dtype::F32 => "<f4",
        Dtype::F16 => "<f2",
        other => panic!("no .npy writer for {other}"),
    };
    let dims: Vec<String> = x.shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&le_bytes(x));
    b
}

/// Writes `inputs` as an .npz archive (numpy's savez).
fn write_npz(path: &Path, inputs: &[Input]) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    for x in inputs {
        zip.start_file(
            format!("{}.npy", x.name),
            zip::write::SimpleFileOptions::default(),
        )
        .unwrap();
        zip.write_all(&npy(x)).unwrap();
    }
    zip.finish().unwrap();
}

/// The type string and the raw data of `name` in an .npz written by `run`.
fn npz_array(path: &Path, name: &str) -> (String, Vec<u8>) {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut entry = zip.by_name(&format!("{name}.npy")).unwrap();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00", "format 1.0");
    let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
    assert!(header.contains("'fortran_order': False"), "{header}");
    let descr = header.split('\'').nth(3).unwrap().to_string();
    (descr, bytes[10 + len..].to_vec())
}

/// The f32 data of `name` in an .npz written by `run`.
fn npz_f32(path: &Path, name: &str) -> Vec<f32> {
    let (descr, data) = npz_array(path, name);
    assert_eq!(descr, "<f4");
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn run_reads_and_writes_npz() {
    let mut rng = StdRng::seed_from_u64(306);
    let dir = Dir::new();
    let inputs = [
        random(&mut rng, "q", &[1, 33, 2, 16], Dtype::F32),
        random(&mut rng, "k", &[1, 45, 2, 16], Dtype::F32),
        random(&mut rng, "v", &[1, 45, 2, 16], Dtype::F32),
    ];
    let input = dir.path("in.npz");
    write_npz(&input, &inputs);
    let output = dir.path("out.npz");
    let o = flashattn(&[
        "run",
        "--input",
        s(&input),
        "--output",
        s(&output),
        "--causal",
    ]);
    assert!(o.status.success());
    let out: Vec<f64> = npz_f32(&output, "out").iter().map(|&x| x as f64).collect();
    let (ts, p) = library_inputs(&inputs, false, AttentionParams::default().causal());
    let want = oracle::forward(&ts[0], &ts[1], &ts[2], &p).unwrap();
    let err = rel(&out, &want.out, norm(&want.out));
    assert!(err <= 1e-5, "npz out rel {err}");
    assert_eq!(npz_f32(&output, "lse").len(), 2 * 33);
}

#[test]
fn run_keeps_f16_through_npz_as_through_safetensors() {
    let mut rng = StdRng::seed_from_u64(312);
    let dir = Dir::new();
    let inputs = [
        random(&mut rng, "q", &[2, 21, 4, 8], Dtype::F16),
        random(&mut rng, "k", &[2, 30, 2, 8], Dtype::F16),
        random(&mut rng, "v", &[2, 30, 2, 8], Dtype::F16),
    ];
    let (npz_in, npz_out) = (dir.path("in.npz"), dir.path("out.npz"));
    write_npz(&npz_in, &inputs);
    let o = flashattn(&["run", "--input", s(&npz_in), "--output", s(&npz_out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let via_safetensors = round_trip(&dir, &inputs, &[]);
    let (descr, data) = npz_array(&npz_out, "out");
    assert_eq!(descr, "<f2");
    let via_npz: Vec<f64> = data
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
        .collect();
    let (shape, dtype, want) = &via_safetensors["out"];
    assert_eq!((shape, *dtype), (&vec![2, 21, 4, 8], Dtype::F16));
    assert_eq!(&via_npz, want, "the same f16 results in either file");
    assert_eq!(npz_f32(&npz_out, "lse").len(), 2 * 4 * 21);
}
