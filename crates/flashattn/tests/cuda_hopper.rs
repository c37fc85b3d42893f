//! The Hopper vocabulary (`kernels/hopper.cuh`) through its test kernels (`kernels/hopper_test.cu`):
//! one warpgroup computes C[64 x N] = A[64 x K]·B[N x K]ᵀ with wgmma SS (A and B loaded by TMA, or
//! written into the swizzled layout by ordinary stores) and RS (A's fragments from registers, B by
//! TMA), bf16 and f16, N ∈ {64, 128, 256}, K ∈ {64, 128}; and the attention's O[64 x N] =
//! P[64 x K]·V[K x N] with V row-major (N contiguous) loaded by TMA as an MN-major tile
//! (imm-trans-b), by RS (P packed from the accumulator layout) and by SS (P by TMA).
//!
//! Without a GPU: every variant compiles for sm_90a and ptxas reports no serialized wgmma and no
//! spills, and (with cuobjdump on PATH) their SASS has HGMMA and no local memory (needs libnvrtc;
//! `FLASHATTN_REQUIRE_NVRTC=1` makes its absence a failure). With a GPU of
//! compute capability 9.0: `cargo test --release --test cuda_hopper -- --include-ignored` checks
//! the products against an f64 one (other GPUs: skipped with a note).
#![cfg(feature = "cuda")]

mod nvrtc_support;

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::{CudaContext, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::Ptx;
use flashattn::cuda::{self, KernelSource};
use nvrtc_support::{cuobjdump, nvrtc_here, ptxas_faults, sass_faults};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use rayon::prelude::*;

/// The 16-bit element types wgmma takes here.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Half {
    Bf16,
    F16,
}

impl Half {
    /// `x` rounded to this type: its bits and its value.
    fn round(self, x: f32) -> (u16, f64) {
        match self {
            Half::Bf16 => {
                let h = half::bf16::from_f32(x);
                (h.to_bits(), f64::from(h.to_f32()))
            }
            Half::F16 => {
                let h = half::f16::from_f32(x);
                (h.to_bits(), f64::from(h.to_f32()))
            }
        }
    }
}

const HALVES: [Half; 2] = [Half::Bf16, Half::F16];
const NS: [usize; 3] = [64, 128, 256];
const KS: [usize; 2] = [64, 128];

/// The entry points of `kernels/hopper_test.cu`, one a form of the product.
const FORMS: [&str; 5] = ["ss", "ss_stores", "rs", "rs_mn", "ss_mn"];

/// The translation unit of one (dtype, N, K): the kernels of every form (the entry recorded is
/// the first).
fn source(dtype: Half, n: usize, k: usize) -> KernelSource {
    let elem = match dtype {
        Half::Bf16 => "ELEM_BF16",
        Half::F16 => "ELEM_F16",
    };
    let code = [
        format!("#define {elem}\n#define TILE_N {n}\n#define TILE_K {k}\n"),
        include_str!("../kernels/types.cuh").to_string(),
        include_str!("../kernels/mma.cuh").to_string(),
        include_str!("../kernels/hopper.cuh").to_string(),
        include_str!("../kernels/hopper_test.cu").to_string(),
    ]
    .join("\n");
    KernelSource {
        name: format!("hopper_test_{dtype:?}_n{n}_k{k}").to_lowercase(),
        code,
        entry: "hopper_test_ss".into(),
        hopper_only: true,
    }
}

fn variants() -> Vec<(Half, usize, usize)> {
    let mut v = Vec::new();
    for h in HALVES {
        for n in NS {
            for k in KS {
                v.push((h, n, k));
            }
        }
    }
    v
}

#[test]
fn hopper_kernels_compile_for_sm90a_with_no_serialized_wgmma() {
    if !nvrtc_here() {
        return;
    }
    let tool = cuobjdump();
    let failures: Vec<String> = variants()
        .par_iter()
        .flat_map(|&(h, n, k)| {
            let src = source(h, n, k);
            assert!(!src.code.contains("#include"), "{}", src.name);
            let (cubin, log) = cuda::ptxas_report(&src, "sm_90a").expect("compiles for sm_90a");
            println!("== {}\n{}", src.name, log.trim_end());
            // ptxas -v names each entry it assembles.
            let mut failures: Vec<String> = FORMS
                .iter()
                .map(|form| format!("hopper_test_{form}"))
                .filter(|entry| !log.contains(&format!("'{entry}'")))
                .map(|entry| format!("{}: ptxas built no entry {entry}", src.name))
                .collect();
            failures.extend(ptxas_faults(&src.name, &log));
            if let Some(tool) = &tool {
                failures.extend(sass_faults(tool, &src.name, &cubin));
            }
            failures
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A CUtensorMap passed by value as a `const __grid_constant__ TmaMap` kernel parameter.
#[repr(transparent)]
struct TensorMap(sys::CUtensorMap);

// SAFETY: CUtensorMap is a plain 128-byte `repr(C)` value the kernel reads as its parameter bytes.
unsafe impl DeviceRepr for TensorMap {}

/// The tensor map of a row-major `rows x cols` 16-bit matrix at `ptr`, loaded in boxes of 64
/// columns x `rows` rows with 128-byte swizzle (the K-major layout of `hopper.cuh`).
fn tensor_map(dtype: Half, ptr: sys::CUdeviceptr, rows: usize, cols: usize) -> TensorMap {
    let data_type = match dtype {
        Half::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        Half::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let dims: [u64; 2] = [cols as u64, rows as u64];
    let strides: [u64; 1] = [cols as u64 * 2];
    let boxes: [u32; 2] = [64, rows as u32];
    let element_strides: [u32; 2] = [1, 1];
    let mut map = MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays hold rank (2) entries (strides: rank - 1); `map` is written by the call;
    // `ptr` is a live device allocation of rows x cols 16-bit elements.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            2,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .expect("cuTensorMapEncodeTiled");
    // SAFETY: the call succeeded, so it wrote the map.
    TensorMap(unsafe { map.assume_init() })
}

/// A random `rows x cols` matrix in `dtype`: bits for the GPU, values for the f64 product.
fn matrix(rng: &mut StdRng, dtype: Half, rows: usize, cols: usize) -> (Vec<u16>, Vec<f64>) {
    (0..rows * cols)
        .map(|_| dtype.round(rng.random_range(-1.0f32..1.0)))
        .unzip()
}

/// The largest error of `c` against A·Bᵀ in f64 as a fraction of its bound, or the first failure.
/// Bound: the products of 16-bit values are exact in f32; the f32 accumulation may lose up to one
/// ulp (≤ 2⁻²³ relative) of a running sum bounded by Σ|a·b| at each of its K terms and at each
/// k16 step's carried accumulator (truncating alignment as tensor cores do), K + K/16 ulps in
/// all, doubled for margin: |c − ref| ≤ K·2⁻²²·Σ|a·b|. A layout or swizzle mistake errs by O(Σ|a·b|).
fn check(c: &[f32], a: &[f64], b: &[f64], n: usize, k: usize) -> Result<f64, String> {
    let mut worst = 0.0f64;
    for i in 0..64 {
        for j in 0..n {
            let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
            for t in 0..k {
                let p = a[i * k + t] * b[j * k + t];
                exact += p;
                magnitude += p.abs();
            }
            let bound = k as f64 * 2f64.powi(-22) * magnitude + 1e-30;
            let got = f64::from(c[i * n + j]);
            let err = (got - exact).abs();
            if !err.is_finite() || err > bound {
                return Err(format!(
                    "C[{i}][{j}] = {got}, expected {exact} (error {err:.3e}, bound {bound:.3e})"
                ));
            }
            worst = worst.max(err / bound);
        }
    }
    Ok(worst)
}

#[test]
#[ignore = "needs a CUDA device"]
fn wgmma_ss_and_rs_match_an_f64_product() {
    if !cuda::is_available() {
        println!("NOTE: skipped, no CUDA device");
        return;
    }
    let ctx = CudaContext::new(0).expect("CUDA context");
    let cc = ctx.compute_capability().expect("compute capability");
    if cc != (9, 0) {
        println!("NOTE: skipped, wgmma needs compute capability 9.0 (sm_90a); this GPU is {cc:?}");
        return;
    }
    let stream = ctx.default_stream();
    let mut failures = Vec::new();
    for (seed, (h, n, k)) in variants().into_iter().enumerate() {
        let src = source(h, n, k);
        let ptx = cuda::compile_ptx(&src, "sm_90a").expect("compiles for sm_90a");
        let module = ctx.load_module(Ptx::from_src(ptx)).expect("module loads");
        let seed = 64_000 + seed as u64;
        let mut rng = StdRng::seed_from_u64(seed);
        let (a_bits, a) = matrix(&mut rng, h, 64, k);
        let (b_bits, b) = matrix(&mut rng, h, n, k);
        let a_dev = stream.clone_htod(&a_bits).expect("upload A");
        let b_dev = stream.clone_htod(&b_bits).expect("upload B");
        let a_map = tensor_map(h, a_dev.device_ptr(&stream).0, 64, k);
        let b_map = tensor_map(h, b_dev.device_ptr(&stream).0, n, k);
        // The _mn forms read B's bits as V[K][N] row-major (another random matrix) and take P = A
        // (rs_mn as f32, exact): they are checked against A·V as A·(Vᵀ)ᵀ.
        let v_map = tensor_map(h, b_dev.device_ptr(&stream).0, k, n);
        let p: Vec<f32> = a.iter().map(|&x| x as f32).collect();
        let p_dev = stream.clone_htod(&p).expect("upload P");
        let vt: Vec<f64> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let smem = (1024 + (64 + n) * k * 2) as u32;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        };
        for form in FORMS {
            let what = format!("{} {form} (seed {seed})", src.name);
            let f = module
                .load_function(&format!("hopper_test_{form}"))
                .expect("entry");
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .expect("raise the dynamic shared memory limit");
            let mut c_dev = stream
                .clone_htod(&vec![f32::NAN; 64 * n])
                .expect("poisoned C");
            let mut launch = stream.launch_builder(&f);
            match form {
                "ss" => launch.arg(&a_map).arg(&b_map),
                "ss_stores" => launch.arg(&a_dev).arg(&b_dev),
                "rs" => launch.arg(&b_map).arg(&a_dev),
                "rs_mn" => launch.arg(&v_map).arg(&p_dev),
                _ => launch.arg(&a_map).arg(&v_map),
            };
            launch.arg(&mut c_dev);
            // SAFETY: the parameters match the kernel's (tensor maps of live allocations of the
            // stated shapes, A and P of 64 x K, B of N x K = V of K x N, C of 64 x N f32); one
            // block of 128 threads with the dynamic shared memory the kernel uses.
            unsafe { launch.launch(cfg) }.unwrap_or_else(|e| panic!("{what}: launch: {e:?}"));
            stream
                .synchronize()
                .unwrap_or_else(|e| panic!("{what}: the kernel failed: {e:?}"));
            let c = stream.clone_dtoh(&c_dev).expect("download C");
            let b_t = if form.ends_with("_mn") { &vt } else { &b };
            match check(&c, &a, b_t, n, k) {
                Ok(worst) => println!("{what}: worst error {worst:.3} of the bound"),
                Err(e) => failures.push(format!("{what}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
