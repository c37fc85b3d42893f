//! cuBLAS on flashattn's stream: one handle a GPU and the product both the standard attention
//! baseline and the fused layer run (f32, f16 or bf16 operands, f32 accumulation).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{CudaBlas, sys as blas_sys};

use super::device::Gpu;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The cuBLAS handle of `gpu`, on its stream (made on first use).
pub(crate) fn blas(gpu: &Gpu) -> Result<Arc<Mutex<CudaBlas>>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<Mutex<CudaBlas>>>>> = OnceLock::new();
    let mut map = HANDLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(h) = map.get(&gpu.ordinal) {
        return Ok(h.clone());
    }
    // SAFETY: only tries to dlopen libcublas; no cuBLAS call is made.
    if !unsafe { blas_sys::is_culib_present() } {
        return Err(Error::Cuda(
            "libcublas could not be loaded (the standard attention baseline and the fused layer need cuBLAS)".into(),
        ));
    }
    let h = CudaBlas::new(gpu.stream.clone())
        .map_err(|e| Error::Cuda(format!("creating a cuBLAS handle: {e:?}")))?;
    let h = Arc::new(Mutex::new(h));
    map.insert(gpu.ordinal, h.clone());
    Ok(h)
}

/// One strided-batched product `C = alpha·op(A)·op(B) + beta·C` in column-major terms, in `dtype` with f32
/// accumulation.
pub(crate) struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    /// Multiplier of C's old value (0: C is only written).
    pub beta: f32,
    pub a: (u64, i32, i64),
    pub b: (u64, i32, i64),
    pub c: (u64, i32, i64),
    pub batch: i32,
}

impl Gemm {
    pub(crate) fn run(&self, blas: &CudaBlas, dtype: DType) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use blas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let ty = match dtype {
            DType::F32 => CUDA_R_32F,
            DType::F16 => CUDA_R_16F,
            DType::BF16 => CUDA_R_16BF,
        };
        let size = dtype.size_in_bytes() as i64;
        // SAFETY: the pointers are device buffers of the same context sized by the caller for
        // these dimensions, leading dimensions and batch strides; alpha and beta are f32 as the
        // compute type requires, and live across the call.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *blas.handle(),
                if self.trans_a {
                    CUBLAS_OP_T
                } else {
                    CUBLAS_OP_N
                },
                if self.trans_b {
                    CUBLAS_OP_T
                } else {
                    CUBLAS_OP_N
                },
                self.m,
                self.n,
                self.k,
                (&self.alpha as *const f32).cast::<c_void>(),
                self.a.0 as *const c_void,
                ty,
                self.a.1,
                self.a.2 / size,
                self.b.0 as *const c_void,
                ty,
                self.b.1,
                self.b.2 / size,
                (&self.beta as *const f32).cast::<c_void>(),
                self.c.0 as *mut c_void,
                ty,
                self.c.1,
                self.c.2 / size,
                self.batch,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Cuda(format!("cublasGemmStridedBatchedEx: {e:?}")))
    }
}
