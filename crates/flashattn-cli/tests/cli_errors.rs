//! `flashattn run`'s error paths: exit status 2, a message naming the tensor with the expected
//! and the found shape or dtype, and no output file (an existing one is left as it was).

mod cli_support;

use cli_support::*;
use rand::{SeedableRng, rngs::StdRng};
use safetensors::tensor::Dtype;

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
    x.push(random(r, "rel_bias", &[4, 9], Dtype::F16));
    expect_run_error(
        &x,
        &[],
        &["tensor `rel_bias`", "expected dtype f32", "found f16"],
    );
    let mut x = qkv(r, Dtype::F32);
    x.push(random(r, "rel_bias", &[4, 8], Dtype::F32));
    expect_run_error(&x, &[], &["`rel_bias`", "2L - 1"]);
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
    let past = (flashattn::MAX_DIAGONAL + 1).to_string();
    let below = format!("--diagonal=-{past}");
    expect_run_error(
        &qkv(r, Dtype::F32),
        &["--diagonal", &past],
        &["`diagonal`", "2^40"],
    );
    expect_run_error(&qkv(r, Dtype::F32), &[&below], &["`diagonal`", "2^40"]);
    expect_run_error(&qkv(r, Dtype::F32), &["--diagonal", "1.5"], &["--diagonal"]);
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

/// A safetensors file of `header` (the JSON) and `data_len` zero bytes of data.
fn raw_safetensors(path: &std::path::Path, header: &str, data_len: usize) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_bad_safetensors_header_is_reported_by_tensor() {
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    // k: 12·2·8 f32 = 768 bytes, q: 10·4·8 f32 = 1280, v: 768, so 2816 bytes of data.
    let header = |q_shape: &str, v_offsets: &str| {
        format!(
            r#"{{"k":{{"dtype":"F32","shape":[1,12,2,8],"data_offsets":[0,768]}},
            "q":{{"dtype":"F32","shape":{q_shape},"data_offsets":[768,2048]}},
            "v":{{"dtype":"F32","shape":[1,12,2,8],"data_offsets":{v_offsets}}}}}"#
        )
    };
    let cases: [(String, usize, &[&str]); 4] = [
        (
            header("[1,10,4,9]", "[2048,2816]"),
            2816,
            &[
                "tensor `q`",
                "[1, 10, 4, 9]",
                "needs 1440 bytes",
                "hold 1280",
            ],
        ),
        (
            header("[1,10,4,8]", "[2048,2816]"),
            2500,
            &["tensor `v`", "past the end of the data (2500 bytes)"],
        ),
        (
            header("[1,10,4,8]", "[2048,2816]"),
            3000,
            &["tensor `v`", "the last", "ends at byte 2816", "3000 bytes"],
        ),
        (
            header("[1,10,4,8]", "[2000,2768]"),
            2768,
            &["tensor `v`", "[2000, 2768]"],
        ),
    ];
    for (header, data_len, needles) in cases {
        raw_safetensors(&input, &header, data_len);
        let o = flashattn(&["run", "--input", s(&input), "--output", s(&output)]);
        assert_eq!(o.status.code(), Some(2), "exit status");
        let err = stderr(&o);
        assert!(err.contains("not a valid safetensors file"), "{err}");
        for n in needles {
            assert!(err.contains(n), "`{n}` not in: {err}");
        }
        assert!(!output.exists());
    }
}

#[test]
fn causal_takes_a_right_window_of_zero_and_refuses_any_other() {
    let mut rng = StdRng::seed_from_u64(309);
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    write_safetensors(&input, &qkv(&mut rng, Dtype::F32));
    let run = |name: &str, opts: &[&str]| {
        let output = dir.path(name);
        let mut args = vec!["run", "--input", s(&input), "--output", s(&output)];
        args.extend_from_slice(opts);
        (flashattn(&args), output)
    };
    let (o, causal) = run("causal.safetensors", &["--causal"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (o, with_zero) = run("zero.safetensors", &["--causal", "--window-right", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&causal).unwrap(),
        std::fs::read(&with_zero).unwrap(),
        "--window-right 0 beside --causal changes nothing"
    );
    let (o, refused) = run("three.safetensors", &["--causal", "--window-right", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--window-right 3"), "{}", stderr(&o));
    assert!(stderr(&o).contains("--causal"), "{}", stderr(&o));
    assert!(!refused.exists());
    let o = flashattn(&["check", "--seqlen", "16", "--causal", "--window-right", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--window-right 1"), "{}", stderr(&o));
}

#[test]
fn non_finite_inputs_are_named_in_a_warning() {
    let mut rng = StdRng::seed_from_u64(311);
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let mut x = qkv(&mut rng, Dtype::F16);
    let o = {
        write_safetensors(&input, &x);
        flashattn(&["run", "--input", s(&input), "--output", s(&output)])
    };
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    x[0].values[5] = f32::NAN;
    x[0].values[17] = f32::NAN;
    x[2].values[3] = f32::NEG_INFINITY;
    write_safetensors(&input, &x);
    let err = stderr(&flashattn(&[
        "run",
        "--input",
        s(&input),
        "--output",
        s(&output),
    ]));
    assert!(
        err.contains("warning: tensor `q` holds 2 NaN and 0 infinite values (of 320)"),
        "{err}"
    );
    assert!(
        err.contains("warning: tensor `v` holds 0 NaN and 1 infinite values (of 192)"),
        "{err}"
    );
    assert!(!err.contains("tensor `k`"), "{err}");
}
