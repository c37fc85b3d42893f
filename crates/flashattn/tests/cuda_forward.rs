//! The GPU forward against the f64 oracle over the CPU tests' grid (`tests/common/grid.rs`), and
//! the device-tensor API. Needs a CUDA device: run with
//! `cargo test --release --test cuda_forward -- --include-ignored` on a machine with a GPU.
//!
//! Each case draws fresh random inputs (seed printed), uploads q, k, v, the bias and the ALiBi
//! slopes, poisons the allocator's free memory with NaN, and runs flashattn's forward and the GPU
//! standard attention. Bounds: f32 relative error ≤ 1e-5; f16/bf16 within 2× the GPU standard
//! attention's error in the same precision (+`HALF_FLOOR`); the log-sum-exp as in
//! `common::lse_tolerance`. The GPU standard attention is itself checked against the CPU one, so
//! the yardstick cannot drift.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, check_gpu_cases, gpu_errors, poison, to_device};
use common::{
    Case, F32_TOL, HALF_FLOOR, Layout, assert_laid_out_like, bits, describe, grid, lse_error,
    lse_tolerance, rel, rng, tolerance,
};
use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, DType, Device, Error, Tensor};

macro_rules! grid_tests {
    ($($name:ident: $seed:expr),* $(,)?) => {$(
        #[test]
        #[ignore = "needs a CUDA device"]
        fn $name() {
            check_gpu_cases(stringify!($name), $seed, &grid::$name());
        }
    )*};
}

grid_tests! {
    sequence_lengths: 110_000,
    head_dims: 120_000,
    head_dim_v_differs: 130_000,
    batch_and_gqa: 140_000,
    options_alone: 150_000,
    options_combined: 160_000,
    dtypes_and_layouts: 170_000,
    varlen: 180_000,
    rel_bias: 190_000,
}

/// Scores of about ±1e4 (as `tests/numerics.rs`): the online softmax rescales without overflow.
/// In f32 the scores carry a rounding error of about 1e4 · 2⁻²⁴ · √d, which the standard
/// attention makes too, hence the same-precision rule for every dtype; the LSE within 1e-5.
#[test]
#[ignore = "needs a CUDA device"]
fn huge_logits() {
    for (n, dtype) in grid::DTYPES.into_iter().enumerate() {
        for causal in [false, true] {
            let mut case = Case::new(70, 90, 16).heads(2, 1).scale(2500.0).dtype(dtype);
            if causal {
                case = case.causal();
            }
            let x = case.inputs(&mut rng(190_000 + 2 * n as u64 + causal as u64));
            let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            assert!(
                o.lse.iter().any(|l| l.abs() > 5e3),
                "the test must reach huge logits"
            );
            let e = gpu_errors(&case, &x);
            println!("huge logits {dtype} causal={causal}: {e:?}");
            // f32: the bound of tests/numerics.rs, from the CPU standard attention (its scores
            // carry the same f32 rounding; cuBLAS's accumulation order can make the GPU one
            // luckier on a given draw); f16/bf16: 2× the GPU standard attention.
            let tol = match dtype {
                DType::F32 => F32_TOL.max(2.0 * e.cpu_standard + HALF_FLOOR),
                _ => tolerance(dtype, e.standard),
            };
            assert!(e.out <= tol, "{dtype} causal={causal}: {e:?} > {tol:e}");
            assert!(e.lse <= 1e-5, "lse {e:?}");
        }
    }
}

/// Rows that see no key (causal with Nq > Nk): output exactly 0 and log-sum-exp −∞, no NaN.
#[test]
#[ignore = "needs a CUDA device"]
fn rows_without_keys() {
    for dtype in grid::DTYPES {
        let case = Case::new(65, 7, 64).causal().dtype(dtype);
        let x = case.inputs(&mut rng(191_000));
        let g = to_device(&x, GPU);
        poison();
        let f = flashattn::forward(&g.q, &g.k, &g.v, &g.p).expect("gpu forward");
        let out = f.out.to_f32_vec().unwrap();
        let lse = f.lse.to_f32_vec().unwrap();
        assert!(
            out.iter().all(|v| v.is_finite()),
            "{dtype}: non-finite output"
        );
        // Query i sees keys 0..=i + 7 - 65: the first 58 rows see none.
        for i in 0..58 {
            assert_eq!(lse[i], f32::NEG_INFINITY, "{dtype}: lse[{i}]");
            assert!(
                out[i * 64..(i + 1) * 64].iter().all(|&v| v == 0.0),
                "{dtype}: row {i}"
            );
        }
        assert!(
            lse[58..].iter().all(|l| l.is_finite()),
            "{dtype}: lse of rows with keys"
        );
        let e = gpu_errors(&case, &x);
        println!("rows without keys {dtype}: {e:?}");
        assert!(e.out <= tolerance(dtype, e.standard), "{dtype}: {e:?}");
        assert!(
            e.lse <= lse_tolerance(dtype, e.standard_lse),
            "{dtype}: {e:?}"
        );
    }
}

/// q, k, v as views of one fused `[batch, seqlen, 3, heads, dim]` buffer, uploaded once.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_qkv_views() {
    for (n, (b, len, h, d, dtype)) in [
        (2, 65, 4, 32, DType::F32),
        (1, 113, 2, 64, DType::F16),
        (3, 7, 8, 128, DType::BF16),
    ]
    .into_iter()
    .enumerate()
    {
        let mut r = rng(195_000 + n as u64);
        let buf = common::values(&mut r, b * len * 3 * h * d, 1.7);
        let host = Tensor::from_vec(buf, &[b * len * 3 * h * d])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let dev = host.to_device(GPU).unwrap();
        let view = |t: &Tensor, which: usize| {
            let data = t.clone();
            flashattn_view(
                &data,
                [b, len, h, d],
                [len * 3 * h * d, 3 * h * d, d, 1],
                which * h * d,
            )
        };
        for p in [
            AttentionParams::default(),
            AttentionParams::default().causal(),
        ] {
            let (q, k, v) = (view(&dev, 0), view(&dev, 1), view(&dev, 2));
            let (hq, hk, hv) = (view(&host, 0), view(&host, 1), view(&host, 2));
            poison();
            let f = flashattn::forward(&q, &k, &v, &p).unwrap();
            let s = standard::forward(&q, &k, &v, &p).unwrap();
            let o = oracle::forward(&hq, &hk, &hv, &p).unwrap();
            let e = rel(&f.out.to_f64_vec().unwrap(), &o.out);
            let es = rel(&s.out.to_f64_vec().unwrap(), &o.out);
            println!(
                "packed qkv B={b} N={len} H={h} D={d} {dtype}: out rel {e:.2e} (gpu standard {es:.2e})"
            );
            assert!(e <= tolerance(dtype, es), "{e:e} vs standard {es:e}");
        }
    }
}

/// A `[b, n, h, d]` view with `strides` at `offset` of the flat tensor `t` (on any device).
fn flashattn_view(t: &Tensor, shape: [usize; 4], strides: [usize; 4], offset: usize) -> Tensor {
    t.view(&shape, &strides, offset).expect("view")
}

/// Upload and download give back every element bit for bit, in every dtype, for contiguous
/// tensors, transposed views and views at an offset; the view keeps its strides on the GPU,
/// where its buffer starts at its first element (offset 0).
#[test]
#[ignore = "needs a CUDA device"]
fn upload_download_round_trip() {
    let mut r = rng(200_000);
    for dtype in grid::DTYPES {
        let t = common::tensor(&mut r, &[2, 33, 3, 40], dtype, Layout::Bhnd);
        let g = t.to_device(GPU).unwrap();
        assert_eq!(g.device(), GPU);
        assert_eq!(
            (g.shape(), g.strides(), g.offset()),
            (t.shape(), t.strides(), 0)
        );
        // A view at an offset uploads from its first element on.
        let at = t.view(&[33, 40], &[40, 1], 3 * 33 * 40 + 7).unwrap();
        let gat = at.to_device(GPU).unwrap();
        assert_eq!((gat.strides(), gat.offset()), (at.strides(), 0));
        assert_eq!(bits(&gat), bits(&at), "{dtype}: view at an offset");
        assert_eq!(g.dtype(), dtype);
        let back = g.to_device(Device::Cpu).unwrap();
        assert_eq!(back.device(), Device::Cpu);
        assert_eq!(bits(&back), bits(&t), "{dtype}: round trip");
        assert_eq!(bits(&g), bits(&t), "{dtype}: to_f32_vec of a device tensor");
        // A transposed view of the device tensor reads like the same view on the host.
        let gt = g.transpose(0, 3).unwrap();
        assert_eq!(
            bits(&gt),
            bits(&t.transpose(0, 3).unwrap()),
            "{dtype}: transposed view"
        );
        // Converting on the device keeps the result there.
        let c = g.to_dtype(DType::F32).unwrap();
        assert_eq!(c.device(), GPU);
        assert_eq!(bits(&c), bits(&t.to_dtype(DType::F32).unwrap()));
        // Same device: no copy, the same view.
        let same = g.to_device(GPU).unwrap();
        assert_eq!(same.strides(), g.strides());
    }
    let empty = Tensor::from_vec(Vec::<f32>::new(), &[0, 4]).unwrap();
    let ge = empty.to_device(GPU).unwrap();
    assert_eq!(ge.shape(), &[0, 4]);
    assert!(ge.to_vec::<f32>().unwrap().is_empty());
}

/// Tensors of one call on different devices (the backward's too) and a missing GPU give typed
/// errors naming the argument (the outputs of `forward_into`: `forward_into_on_the_gpu`).
#[test]
#[ignore = "needs a CUDA device"]
fn device_errors() {
    let x = Case::new(9, 11, 16).inputs(&mut rng(210_000));
    let g = to_device(&x, GPU);
    let p = AttentionParams::default();
    for (q, k, v, arg) in [
        (&g.q, &x.k, &g.v, "k"),
        (&g.q, &g.k, &x.v, "v"),
        (&x.q, &g.k, &g.v, "k"),
    ] {
        match flashattn::forward(q, k, v, &p) {
            Err(Error::DeviceMismatch { arg: a, .. }) => assert_eq!(a, arg),
            other => panic!("expected a device mismatch on `{arg}`, got {other:?}"),
        }
    }
    let host_bias = Tensor::from_vec(vec![0.25f32; 9 * 11], &[1, 1, 9, 11]).unwrap();
    match flashattn::forward(&g.q, &g.k, &g.v, &p.clone().bias(host_bias)) {
        Err(Error::DeviceMismatch { arg, .. }) => assert_eq!(arg, "bias"),
        other => panic!("expected a device mismatch on `bias`, got {other:?}"),
    }
    match x.q.to_device(Device::Cuda(4096)) {
        Err(Error::NoCudaDevice { ordinal, count }) => {
            assert_eq!(ordinal, 4096);
            assert!(count >= 1);
        }
        other => panic!("expected NoCudaDevice, got {other:?}"),
    }
    // The backward with dout, or a gradient to write, on the host.
    let f = flashattn::forward(&g.q, &g.k, &g.v, &p).unwrap();
    let (q, k, v) = (&g.q, &g.k, &g.v);
    let host_dout = f.out.to_device(Device::Cpu).unwrap();
    match flashattn::backward(q, k, v, &f.out, &f.lse, &host_dout, &p) {
        Err(Error::DeviceMismatch { arg, .. }) => assert_eq!(arg, "dout"),
        other => panic!("expected a device mismatch on `dout`, got {other:?}"),
    }
    let mut grads = flashattn::Gradients {
        dq: x.q.clone(),
        dk: x.k.to_device(GPU).unwrap(),
        dv: x.v.to_device(GPU).unwrap(),
        dbias: None,
        drel_bias: None,
    };
    match flashattn::backward_into(q, k, v, &f.out, &f.lse, &f.out, &p, &mut grads) {
        Err(Error::DeviceMismatch { arg, .. }) => assert_eq!(arg, "dq"),
        other => panic!("expected a device mismatch on `dq`, got {other:?}"),
    }
}

/// A NaN-filled GPU tensor of `shape` and `dtype`, its buffer its own.
fn gpu_nan(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::full(shape, dtype, f32::NAN)
        .unwrap()
        .to_device(GPU)
        .unwrap()
}

/// `forward_into` on the GPU, call after call into the same NaN-filled tensors: into outputs laid
/// out like `forward`'s, the same bits as `forward` (the same kernel runs); into padded rows at an
/// odd offset, results within the grid's bounds of the oracle (the CUDA-core kernel, as such rows
/// require). Invalid outputs are typed errors naming them, with nothing written.
#[test]
#[ignore = "needs a CUDA device"]
fn forward_into_on_the_gpu() {
    for (n, case) in common::output_cases().iter().enumerate() {
        let seed = 220_000 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let e = gpu_errors(case, &x);
        let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle forward");
        let g = to_device(&x, GPU);
        let want = flashattn::forward(&g.q, &g.k, &g.v, &g.p).unwrap();
        let nan = |t: &Tensor| gpu_nan(t.shape(), t.dtype());
        let (mut out, mut lse) = (nan(&want.out), nan(&want.lse));
        // Rows that do not start on 16-byte boundaries: the tensor-core kernel cannot write them.
        let mut padded = common::padded(want.out.shape(), case.dtype)
            .to_device(GPU)
            .unwrap();
        for call in 0..2 {
            let what = format!("{} call {call}", describe(case));
            flashattn::forward_into(&g.q, &g.k, &g.v, &g.p, &mut out, &mut lse).unwrap();
            assert_eq!(bits(&out), bits(&want.out), "{what}: out");
            assert_eq!(bits(&lse), bits(&want.lse), "{what}: lse");
            let mut lse2 = nan(&want.lse);
            flashattn::forward_into(&g.q, &g.k, &g.v, &g.p, &mut padded, &mut lse2).unwrap();
            let got = padded.to_f64_vec().unwrap();
            assert!(got.iter().all(|v| v.is_finite()), "{what}: unwritten out");
            let (err, lse_err) = (
                rel(&got, &o.out),
                lse_error(&lse2.to_f64_vec().unwrap(), &o.lse),
            );
            let (tol, lse_tol) = (
                tolerance(case.dtype, e.standard),
                lse_tolerance(case.dtype, e.standard_lse),
            );
            println!(
                "gpu forward_into {what} seed {seed}: padded out rel {err:.2e} (bound {tol:.2e}), lse {lse_err:.2e} (bound {lse_tol:.2e})"
            );
            assert!(err <= tol && lse_err <= lse_tol, "{what}: padded out");
        }
    }

    let x = Case::new(9, 11, 16).inputs(&mut rng(221_000));
    let g = to_device(&x, GPU);
    let (q, k, v, p) = (&g.q, &g.k, &g.v, &g.p);
    let nan = |shape: &[usize]| gpu_nan(shape, DType::F32);
    let (mut out, mut lse) = (nan(&[1, 9, 1, 16]), nan(&[1, 1, 9]));
    let mut host_out = Tensor::full(&[1, 9, 1, 16], DType::F32, f32::NAN).unwrap();
    match flashattn::forward_into(q, k, v, p, &mut host_out, &mut lse) {
        Err(Error::DeviceMismatch { arg, .. }) => assert_eq!(arg, "out"),
        other => panic!("expected a device mismatch on `out`, got {other:?}"),
    }
    let shared = lse.clone();
    let e = flashattn::forward_into(q, k, v, p, &mut out, &mut lse).unwrap_err();
    assert_eq!(e.argument(), Some("lse"), "{e}");
    assert!(e.to_string().contains("shared"), "{e}");
    drop(shared);
    let mut wrong = nan(&[1, 9, 1, 15]);
    let e = flashattn::forward_into(q, k, v, p, &mut wrong, &mut lse).unwrap_err();
    assert_eq!(e.argument(), Some("out"), "{e}");
    assert!(
        [&out, &lse, &wrong]
            .iter()
            .all(|t| t.to_f32_vec().unwrap().iter().all(|v| v.is_nan())),
        "an invalid call wrote its outputs"
    );
}

/// The GPU standard attention alone over the whole grid (its own correctness, and the
/// yardstick's), so a broken baseline is reported apart from the kernels.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_standard_attention_grid() {
    let mut failures = Vec::new();
    for (test, seed0, cases) in grid::all() {
        for (n, case) in cases.iter().enumerate() {
            let seed = seed0 + 500_000 + n as u64;
            let x = case.inputs(&mut rng(seed));
            let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            let cpu = standard::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            let g = to_device(&x, GPU);
            poison();
            let s = standard::forward(&g.q, &g.k, &g.v, &g.p).unwrap();
            assert_laid_out_like(&s.out, &g.q, "standard out");
            let es = rel(&s.out.to_f64_vec().unwrap(), &o.out);
            let ec = rel(&cpu.out.to_f64_vec().unwrap(), &o.out);
            let el = lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse);
            let ecl = lse_error(&cpu.lse.to_f64_vec().unwrap(), &o.lse);
            let ok = match case.dtype {
                DType::F32 => es <= F32_TOL && el <= F32_TOL,
                _ => es <= 2.0 * ec + HALF_FLOOR && el <= lse_tolerance(case.dtype, ecl),
            };
            println!(
                "[{}] gpu standard {test} #{n} seed {seed} {}: out rel {es:.2e} (cpu standard {ec:.2e}), lse {el:.2e} (cpu {ecl:.2e})",
                if ok { "PASS" } else { "FAIL" },
                describe(case)
            );
            if !ok {
                failures.push(format!("{test} #{n} seed {seed} {}", describe(case)));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
