//! Drives the `flashattn` binary: `run` round trips through tensor files against the f64 oracle
//! (inputs written here with the safetensors crate, or as a hand-made .npz), every error path of
//! `run` (exit status 2, a message naming the tensor, no output file), `--help`, `check`'s exit
//! status and `bench --json`'s fields.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, DType, Tensor};
use half::{bf16, f16};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

fn flashattn(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_flashattn"))
        .args(args)
        .output()
        .expect("the flashattn binary runs");
    println!(
        "$ flashattn {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// One tensor to write: name, shape, dtype and values (rounded to the dtype).
struct Input {
    name: &'static str,
    shape: Vec<usize>,
    dtype: Dtype,
    values: Vec<f32>,
}

fn random(rng: &mut StdRng, name: &'static str, shape: &[usize], dtype: Dtype) -> Input {
    let n = shape.iter().product();
    Input {
        name,
        shape: shape.to_vec(),
        dtype,
        values: (0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect(),
    }
}

fn int32(name: &'static str, values: &[i32]) -> Input {
    Input {
        name,
        shape: vec![values.len()],
        dtype: Dtype::I32,
        values: values.iter().map(|&v| v as f32).collect(),
    }
}

fn le_bytes(x: &Input) -> Vec<u8> {
    let mut b = Vec::new();
    for &v in &x.values {
        match x.dtype {
            Dtype::F32 => b.extend_from_slice(&v.to_le_bytes()),
            Dtype::F16 => b.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            Dtype::BF16 => b.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            Dtype::I32 => b.extend_from_slice(&(v as i32).to_le_bytes()),
            Dtype::F64 => b.extend_from_slice(&(v as f64).to_le_bytes()),
            other => panic!("no writer for {other}"),
        }
    }
    b
}

/// The in-test safetensors writer.
fn write_safetensors(path: &Path, inputs: &[Input]) {
    let bytes: Vec<Vec<u8>> = inputs.iter().map(le_bytes).collect();
    let views: Vec<(&str, TensorView)> = inputs
        .iter()
        .zip(&bytes)
        .map(|(x, b)| {
            (
                x.name,
                TensorView::new(x.dtype, x.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

/// The tensor `x` as the library sees it, in the file's storage order.
fn tensor(x: &Input) -> Tensor {
    let t = Tensor::from_vec(x.values.clone(), &x.shape).unwrap();
    match x.dtype {
        Dtype::F16 => t.to_dtype(DType::F16).unwrap(),
        Dtype::BF16 => t.to_dtype(DType::BF16).unwrap(),
        _ => t,
    }
}

/// Every tensor of a safetensors file as (shape, dtype, values widened to f64).
fn read_safetensors(path: &Path) -> HashMap<String, (Vec<usize>, Dtype, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let d = v.data();
            let vals: Vec<f64> = match v.dtype() {
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::F16 => d
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
                    .collect(),
                Dtype::BF16 => d
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
                    .collect(),
                other => panic!("unexpected output dtype {other}"),
            };
            (name, (v.shape().to_vec(), v.dtype(), vals))
        })
        .collect()
}

/// `‖a − b‖ / denom` (0 when equal).
fn rel(a: &[f64], b: &[f64], denom: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    if d == 0.0 { 0.0 } else { d / denom }
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Swaps dims r-3 and r-2 of a row-major array of `shape` (bhnd <-> bnhd), for comparing the
/// oracle's `[.., seqlen, heads, dim]` order with a file in `bhnd`.
fn swap_seq_heads(vals: &[f64], shape: &[usize]) -> Vec<f64> {
    let t = Tensor::from_vec(vals.iter().map(|&v| v as f32).collect(), shape).unwrap();
    let r = shape.len();
    t.transpose(r - 3, r - 2).unwrap().to_f64_vec().unwrap()
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Self {
        Dir(tempfile::tempdir().unwrap())
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

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

/// q, k, v (and bias, alibi, dout) of `inputs` as library tensors in the logical layout.
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

/// A `.npy` array (format 1.0) of f32 values, as numpy writes it.
fn npy_f32(shape: &[usize], values: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    values
        .iter()
        .for_each(|v| b.extend_from_slice(&v.to_le_bytes()));
    b
}

/// The f32 data of `name` in an .npz written by `run`.
fn npz_f32(path: &Path, name: &str) -> Vec<f32> {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut entry = zip.by_name(&format!("{name}.npy")).unwrap();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
    let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
    assert!(header.contains("'<f4'"), "{header}");
    bytes[10 + len..]
        .chunks_exact(4)
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
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&input).unwrap());
    for x in &inputs {
        zip.start_file(
            format!("{}.npy", x.name),
            zip::write::SimpleFileOptions::default(),
        )
        .unwrap();
        zip.write_all(&npy_f32(&x.shape, &x.values)).unwrap();
    }
    zip.finish().unwrap();
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

/// Runs `run` on `inputs` expecting exit status 2, a message containing every `needles`, and no
/// output file.
fn expect_run_error(inputs: &[Input], opts: &[&str], needles: &[&str]) {
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, inputs);
    let mut args = vec!["run", "--input", s(&input), "--output", s(&output)];
    args.extend_from_slice(opts);
    let o = flashattn(&args);
    assert_eq!(o.status.code(), Some(2), "exit status");
    let err = stderr(&o);
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!output.exists(), "an output file was left behind");
    let leftovers: Vec<_> = std::fs::read_dir(dir.0.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "only the input remains");
}

fn qkv(rng: &mut StdRng, dtype: Dtype) -> Vec<Input> {
    vec![
        random(rng, "q", &[1, 10, 4, 8], dtype),
        random(rng, "k", &[1, 12, 2, 8], dtype),
        random(rng, "v", &[1, 12, 2, 8], dtype),
    ]
}

#[test]
fn run_errors_name_the_tensor_and_leave_no_output() {
    let mut rng = StdRng::seed_from_u64(307);
    let r = &mut rng;
    // A missing tensor.
    let mut x = qkv(r, Dtype::F32);
    x.pop();
    expect_run_error(&x, &[], &["tensor `v` is missing", "holds: k, q"]);
    // A mistyped one.
    let mut x = qkv(r, Dtype::F32);
    x[1] = random(r, "k", &[1, 12, 2, 8], Dtype::F16);
    expect_run_error(&x, &[], &["tensor `k`", "expected dtype f32", "found f16"]);
    let mut x = qkv(r, Dtype::F32);
    x[0] = random(r, "q", &[1, 10, 4, 8], Dtype::F64);
    expect_run_error(&x, &[], &["tensor `q`", "f32, f16 or bf16", "F64"]);
    // Inconsistent shapes.
    let mut x = qkv(r, Dtype::F32);
    x[1] = random(r, "k", &[1, 12, 2, 16], Dtype::F32);
    expect_run_error(&x, &[], &["tensor `k`", "head_dim = 8", "[1, 12, 2, 16]"]);
    let mut x = qkv(r, Dtype::F32);
    x[2] = random(r, "v", &[1, 11, 2, 8], Dtype::F32);
    expect_run_error(&x, &[], &["tensor `v`", "seqlen_k = 12", "[1, 11, 2, 8]"]);
    let mut x = qkv(r, Dtype::F32);
    x[0] = random(r, "q", &[10, 4, 8], Dtype::F32);
    expect_run_error(
        &x,
        &[],
        &["tensor `q`", "expected 4 dimensions", "[10, 4, 8]"],
    );
    let mut x = qkv(r, Dtype::F32);
    x[1] = random(r, "k", &[1, 12, 3, 8], Dtype::F32);
    x[2] = random(r, "v", &[1, 12, 3, 8], Dtype::F32);
    expect_run_error(&x, &[], &["`k`", "divides the query heads (4)", "3 heads"]);
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "dout", &[1, 10, 4, 9], Dtype::F32));
    expect_run_error(
        &x,
        &[],
        &["tensor `dout`", "[1, 10, 4, 8]", "found [1, 10, 4, 9]"],
    );
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "alibi_slopes", &[4], Dtype::F16));
    expect_run_error(
        &x,
        &[],
        &["tensor `alibi_slopes`", "expected dtype f32", "found f16"],
    );
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "alibi_slopes", &[3], Dtype::F32));
    expect_run_error(&x, &[], &["`alibi_slopes`"]);
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "bias", &[1, 4, 10, 7], Dtype::F32));
    expect_run_error(&x, &[], &["`bias`"]);
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "Q", &[1], Dtype::F32));
    expect_run_error(&x, &[], &["unexpected tensor `Q`"]);
    // Varlen: both offsets, int32, valid.
    let packed = |r: &mut StdRng| {
        vec![
            random(r, "q", &[10, 2, 8], Dtype::F32),
            random(r, "k", &[12, 2, 8], Dtype::F32),
            random(r, "v", &[12, 2, 8], Dtype::F32),
        ]
    };
    let mut x = packed(r);
    x.push(int32("cu_seqlens_q", &[0, 4, 10]));
    expect_run_error(&x, &[], &["tensor `cu_seqlens_k` is missing"]);
    let mut x = packed(r);
    x.push(int32("cu_seqlens_q", &[0, 4, 10]));
    x.push(random(r, "cu_seqlens_k", &[3], Dtype::F32));
    expect_run_error(&x, &[], &["tensor `cu_seqlens_k`", "int32", "found f32"]);
    let mut x = packed(r);
    x.push(int32("cu_seqlens_q", &[0, 6, 4, 10]));
    x.push(int32("cu_seqlens_k", &[0, 4, 8, 12]));
    expect_run_error(&x, &[], &["`cu_seqlens_q`", "non-decreasing"]);
    let mut x = qkv(r, Dtype::F32);
    x.push(int32("cu_seqlens_q", &[0, 10]));
    x.push(int32("cu_seqlens_k", &[0, 12]));
    expect_run_error(
        &x,
        &[],
        &["tensor `q`", "expected 3 dimensions", "packed varlen"],
    );
    // Options.
    expect_run_error(&qkv(r, Dtype::F32), &["--scale", "inf"], &["`scale`"]);
    expect_run_error(&qkv(r, Dtype::F32), &["--softcap", "-1"], &["`softcap`"]);
}

#[test]
fn run_file_errors_exit_2_and_keep_existing_outputs() {
    let mut rng = StdRng::seed_from_u64(308);
    let dir = Dir::new();
    let good = dir.path("good.safetensors");
    write_safetensors(&good, &qkv(&mut rng, Dtype::BF16));
    let garbage = dir.path("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a tensor file").unwrap();
    let existing = dir.path("existing.safetensors");
    std::fs::write(&existing, b"keep me").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![s(&garbage).into(), s(&existing).into()],
            "not a valid safetensors file",
        ),
        (
            vec![
                s(&dir.path("missing.safetensors")).into(),
                s(&existing).into(),
            ],
            "missing.safetensors",
        ),
        (
            vec![s(&good).into(), s(&dir.path("out.npy")).into()],
            "single array",
        ),
        (
            vec![s(&dir.path("x.npy")).into(), s(&existing).into()],
            "single array",
        ),
        (
            vec![s(&good).into(), s(&dir.path("out.txt")).into()],
            "unknown file type",
        ),
        (
            vec![s(&good).into(), s(&dir.path("out.npz")).into()],
            "numpy has no bfloat16",
        ),
        (
            vec![
                s(&good).into(),
                s(&dir.path("no/such/out.safetensors")).into(),
            ],
            "does not exist",
        ),
    ];
    for (files, needle) in cases {
        let o = flashattn(&["run", "--input", &files[0], "--output", &files[1]]);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            stderr(&o).contains(needle),
            "`{needle}` not in {}",
            stderr(&o)
        );
    }
    // A failing run leaves an existing output as it was.
    let mut bad = qkv(&mut rng, Dtype::F32);
    bad.pop();
    let bad_in = dir.path("bad.safetensors");
    write_safetensors(&bad_in, &bad);
    let o = flashattn(&["run", "--input", s(&bad_in), "--output", s(&existing)]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me");
    let names: Vec<String> = std::fs::read_dir(dir.0.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with(".tmp")),
        "temporary files left: {names:?}"
    );
    assert!(!dir.path("out.npz").exists() && !dir.path("out.txt").exists());
}

#[test]
fn help_lists_the_subcommands_with_examples() {
    let o = flashattn(&["--help"]);
    assert!(o.status.success());
    let text = stdout(&o);
    for needle in ["check", "bench", "run", "Examples:", "Exit status"] {
        assert!(text.contains(needle), "`{needle}` not in --help");
    }
    for (sub, needle) in [
        ("check", "--seqlen"),
        ("bench", "--plot"),
        ("run", "cu_seqlens_q"),
    ] {
        let o = flashattn(&[sub, "--help"]);
        assert!(o.status.success());
        let text = stdout(&o);
        assert!(
            text.contains("Examples:") && text.contains(needle),
            "{sub} --help"
        );
    }
    let o = flashattn(&["check", "--no-such-option"]);
    assert_eq!(o.status.code(), Some(2), "usage errors exit 2");
    let o = flashattn(&["bench", "--seqlens", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn check_exit_status_follows_the_results() {
    let o = flashattn(&[
        "check", "--seqlen", "50", "--heads", "2", "--causal", "--dtype", "f32,bf16",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    assert_eq!(text.matches("[PASS] forward").count(), 2, "{text}");
    assert_eq!(text.matches("[PASS] backward").count(), 2, "{text}");
    assert!(text.contains("max abs error") && text.contains("4 passed, 0 failed"));
    // Bounds 1e9 times tighter than any rounding allows: every line fails, exit status 1.
    let o = flashattn(&[
        "check",
        "--seqlen",
        "50",
        "--heads",
        "2",
        "--tighten",
        "1e9",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o).matches("[FAIL]").count(), 2);
    // An invalid configuration is bad input.
    let o = flashattn(&["check", "--heads", "3", "--heads-kv", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("`k`"));
}

#[test]
fn cuda_device_is_an_error_not_a_panic_without_a_gpu() {
    let o = flashattn(&[
        "check",
        "--device",
        "cuda",
        "--seqlen",
        "16",
        "--heads",
        "1",
        "--forward-only",
    ]);
    if !o.status.success() {
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains("cuda"), "{}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"));
    }
}

#[test]
fn bench_json_has_every_field() {
    let dir = Dir::new();
    let (json, svg, png) = (dir.path("b.json"), dir.path("b.svg"), dir.path("b.png"));
    let args = [
        "bench",
        "--seqlens",
        "64,128",
        "--head-dims",
        "16",
        "--heads",
        "2",
        "--causal",
        "both",
        "--pass",
        "both",
        "--repeats",
        "1",
    ];
    let mut a = args.to_vec();
    a.extend(["--json", s(&json), "--plot", s(&svg)]);
    let o = flashattn(&a);
    assert!(o.status.success());
    assert!(stdout(&o).contains("speedup"));
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        2 * 2 * 2 * 2,
        "seqlens x masks x passes x methods"
    );
    for r in &records {
        for f in ["device", "dtype", "pass", "method"] {
            assert!(r[f].is_string(), "{f} in {r}");
        }
        for f in [
            "batch",
            "heads",
            "seqlen_q",
            "seqlen_k",
            "head_dim",
            "extra_memory_bytes",
        ] {
            assert!(r[f].is_u64(), "{f} in {r}");
        }
        assert!(r["causal"].is_boolean());
        assert!(r["time_ms"].as_f64().unwrap() > 0.0);
        assert!(r["gflops"].as_f64().unwrap() > 0.0);
        assert_eq!(r["dtype"], "f32");
        assert_eq!(r["device"], "cpu");
    }
    let pick = |method: &str, pass: &str, n: u64| {
        records
            .iter()
            .find(|r| {
                r["method"] == method
                    && r["pass"] == pass
                    && r["seqlen_q"] == n
                    && r["causal"] == false
            })
            .unwrap()["extra_memory_bytes"]
            .as_u64()
            .unwrap()
    };
    // The standard attention holds the scores: 2 heads x 128 x 128 f32 at least.
    assert!(pick("standard", "forward", 128) >= 2 * 128 * 128 * 4);
    assert!(pick("flashattn", "forward", 128) < pick("standard", "forward", 128));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let mut a = args.to_vec();
    a.extend(["--plot", s(&png), "--no-standard"]);
    let o = flashattn(&a);
    assert!(o.status.success());
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    let o = flashattn(&["bench", "--plot", s(&dir.path("chart.gif"))]);
    assert_eq!(o.status.code(), Some(2));
}
