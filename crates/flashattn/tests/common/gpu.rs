//! The GPU side of the forward and backward tests: inputs moved to the device, poisoned outputs,
//! and one case's errors (flashattn's forward and the GPU standard attention; flashattn's
//! gradients) against the f64 oracle, with the bounds of `tests/cuda_forward.rs` and
//! `tests/backward_grid.rs`.

use super::{
    Case, F32_TOL, GradientError, HALF_FLOOR, Inputs, Worst, assert_laid_out_like,
    check_backward_cases_with, describe, gradient_errors, lse_error, lse_tolerance, rel, rng,
    tolerance,
};
use flashattn::reference::{oracle, standard};
use flashattn::{DType, Device, Tensor};

pub const GPU: Device = Device::Cuda(0);

/// q, k, v and every tensor of the params moved to `device`.
pub fn to_device(x: &Inputs, device: Device) -> Inputs {
    let up = |t: &Tensor| t.to_device(device).expect("upload");
    let mut p = x.p.clone();
    p.bias = p.bias.as_ref().map(up);
    p.rel_bias = p.rel_bias.as_ref().map(up);
    p.alibi_slopes = p.alibi_slopes.as_ref().map(up);
    Inputs {
        q: up(&x.q),
        k: up(&x.k),
        v: up(&x.v),
        dout: up(&x.dout),
        p,
    }
}

/// Errors of one case on the GPU.
#[derive(Debug)]
pub struct GpuErrors {
    pub out: f64,
    pub lse: f64,
    pub standard: f64,
    pub standard_lse: f64,
    pub cpu_standard: f64,
}

/// Outputs are allocated filled with NaN, and the allocator's free memory is poisoned too.
pub fn poison() {
    flashattn::internals::set_poison_outputs(true);
    flashattn::cuda::poison_free_memory(0, 64 << 20).expect("poisoning free GPU memory");
}

pub fn gpu_errors(case: &Case, x: &Inputs) -> GpuErrors {
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle forward");
    let cpu_std = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("cpu standard forward");
    let g = to_device(x, GPU);
    poison();
    let s = standard::forward(&g.q, &g.k, &g.v, &g.p).expect("gpu standard forward");
    poison();
    let f = flashattn::forward(&g.q, &g.k, &g.v, &g.p).expect("gpu forward");
    for (t, what) in [(&f.out, "out"), (&f.lse, "lse"), (&s.out, "standard out")] {
        assert_eq!(t.device(), GPU, "{what} is not on the GPU");
    }
    assert_eq!(f.out.shape(), cpu_std.out.shape(), "out shape");
    assert_eq!(f.lse.shape(), cpu_std.lse.shape(), "lse shape");
    assert_eq!(f.lse.dtype(), DType::F32);
    assert_laid_out_like(&f.out, &g.q, "out");
    assert_laid_out_like(&s.out, &g.q, "standard out");
    let out = f.out.to_f64_vec().unwrap();
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        panic!(
            "{}: out[{i}] = {} (unwritten or NaN)",
            describe(case),
            out[i]
        );
    }
    let std_out = s.out.to_f64_vec().unwrap();
    assert!(
        std_out.iter().all(|v| v.is_finite()),
        "standard: non-finite output"
    );
    GpuErrors {
        out: rel(&out, &o.out),
        lse: lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse),
        standard: rel(&std_out, &o.out),
        standard_lse: lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse),
        cpu_standard: rel(&cpu_std.out.to_f64_vec().unwrap(), &o.out),
    }
}

/// The GPU standard attention is a fair yardstick: f32 within the f32 bound, f16/bf16 no worse
/// than twice the CPU standard attention in the same precision.
pub fn standard_ok(dtype: DType, e: &GpuErrors) -> bool {
    match dtype {
        DType::F32 => e.standard <= F32_TOL,
        _ => e.standard <= 2.0 * e.cpu_standard + HALF_FLOOR,
    }
}

pub fn check_gpu_cases(test: &str, seed0: u64, cases: &[Case]) {
    let mut failures = Vec::new();
    let mut worst = Worst::default();
    for (n, case) in cases.iter().enumerate() {
        let seed = seed0 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let e = gpu_errors(case, &x);
        let tol = tolerance(case.dtype, e.standard);
        let lse_tol = lse_tolerance(case.dtype, e.standard_lse);
        let ok = e.out <= tol && e.lse <= lse_tol && standard_ok(case.dtype, &e);
        println!(
            "[{}] gpu {test} #{n} seed {seed} {}: out rel {:.2e} (gpu standard {:.2e}, cpu standard {:.2e}, bound {:.2e}), lse {:.2e} (bound {:.2e})",
            if ok { "PASS" } else { "FAIL" },
            describe(case),
            e.out,
            e.standard,
            e.cpu_standard,
            tol,
            e.lse,
            lse_tol
        );
        let ratio = if e.standard > 0.0 {
            e.out / e.standard
        } else {
            0.0
        };
        worst.add(case.dtype, e.out, ratio, e.lse);
        if !ok {
            failures.push(format!("#{n} seed {seed} {}: {e:?}", describe(case)));
        }
    }
    worst.print(&format!("gpu {test}"), "out");
    assert!(
        failures.is_empty(),
        "gpu {test}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The gradients of flashattn's GPU forward and backward on `x` (uploaded; outputs poisoned),
/// measured on the host as `backward_errors` measures the CPU's. Checks that every gradient is
/// on the GPU.
pub fn gpu_backward_errors(case: &Case, x: &Inputs) -> Vec<GradientError> {
    let g = to_device(x, GPU);
    poison();
    let f = flashattn::forward(&g.q, &g.k, &g.v, &g.p).expect("gpu forward");
    poison();
    let grads =
        flashattn::backward(&g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p).expect("gpu backward");
    let on_gpu = [&grads.dq, &grads.dk, &grads.dv]
        .into_iter()
        .chain(grads.dbias.as_ref())
        .chain(grads.drel_bias.as_ref())
        .all(|t| t.device() == GPU);
    assert!(on_gpu, "a gradient is not on the GPU");
    let out = f.out.to_device(Device::Cpu).expect("download out");
    gradient_errors(case, x, &out, &grads, [&g.q, &g.k, &g.v])
}

pub fn check_gpu_backward_cases(test: &str, seed0: u64, cases: &[Case]) {
    check_backward_cases_with(&format!("gpu {test}"), seed0, cases, gpu_backward_errors);
}
