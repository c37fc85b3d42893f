//! The layer's steps on the GPU: cuBLAS GEMMs in the dtype with f32 accumulation, biases
//! broadcast into the output by a rank-1 GEMM (a column of ones times the bias row) that the
//! main GEMM accumulates onto (beta = 1), bias gradients as ones·dY, the rotation by
//! `kernels/rope.cu` in place, the attention backward into one packed gradient buffer; the
//! separate-calls yardstick's head copies and concatenation by 2-D device copies.

use std::borrow::Cow;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;

use crate::backend::BackwardInputs;
use crate::cuda::blas::{Gemm, blas};
use crate::cuda::device::{Gpu, gpu};
use crate::cuda::rope::{Rotation, rotate};
use crate::cuda::storage::CudaStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layer::cuda_copy::{Columns, copy_columns};
use crate::layer::params::{LayerWeights, RopeStyle};
use crate::layer::rope::inv_freq;
use crate::layer::shape::LayerShape;
use crate::layer::{LayerSteps, OutGrads, QkvGrads};
use crate::outputs::Gradients;
use crate::problem::Problem;
use crate::tensor::{CpuStorage, Device, Tensor, contiguous_strides};

pub(crate) struct CudaSteps;

/// The GPU of a validated call, its cuBLAS handle and a column of `rows` ones in the dtype
/// (for the bias broadcasts and sums).
struct Ctx {
    g: Arc<Gpu>,
    blas: Arc<std::sync::Mutex<CudaBlas>>,
    dtype: DType,
}

impl Ctx {
    fn of(s: &LayerShape) -> Result<Self> {
        let Device::Cuda(ordinal) = s.device else {
            return Err(Error::DeviceMismatch {
                arg: "x",
                expected: "a CUDA tensor".into(),
                got: s.device.to_string(),
            });
        };
        let g = gpu(ordinal)?;
        let blas = blas(&g)?;
        Ok(Ctx {
            g,
            blas,
            dtype: s.dtype,
        })
    }

    /// A new tensor of `shape` that the caller's kernels write entirely (poisoned in tests).
    fn output(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let store = CudaStorage::alloc_output(&self.g, dtype, shape.iter().product())?;
        Tensor::from_cuda_storage(store, shape, &contiguous_strides(shape), 0)
    }

    fn ones(&self, rows: usize) -> Result<CudaStorage> {
        CudaStorage::upload(
            &self.g,
            &CpuStorage::filled(self.dtype, rows.max(1), 1.0),
            0,
        )
    }

    fn run(&self, products: &[RowGemm]) -> Result<()> {
        let blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        products.iter().try_for_each(|p| p.run(&blas, self.dtype))
    }

    /// Queues the rotation of the first `heads` heads of each row of a contiguous `[rows, cols]`
    /// buffer (the q and k heads of the packed one).
    fn rotate(
        &self,
        s: &LayerShape,
        data: u64,
        (cols, heads): (usize, usize),
        inverse: bool,
    ) -> Result<()> {
        let Some(rope) = &s.rope else { return Ok(()) };
        rotate(
            &self.g,
            &Rotation {
                data,
                dtype: s.dtype,
                rows: s.rows,
                cols,
                heads,
                head_dim: s.head_dim,
                positions: &s.positions,
                inv_freq: &inv_freq(rope),
                interleaved: rope.style == RopeStyle::Interleaved,
                inverse,
            },
        )
    }
}

/// `t`, or a contiguous copy of it.
fn dense(t: &Tensor) -> Result<Cow<'_, Tensor>> {
    Ok(if t.is_contiguous() {
        Cow::Borrowed(t)
    } else {
        Cow::Owned(t.contiguous()?)
    })
}

/// The device address of `t`, a contiguous tensor of the call's dtype and rows, each row of at
/// least `n` elements (no host round trip makes a strided one contiguous).
fn rows_ptr(s: &LayerShape, t: &Tensor, arg: &'static str, n: usize) -> Result<u64> {
    if t.dtype() != s.dtype || !t.is_contiguous() || t.numel() < s.rows * n {
        let got = format!("{} {:?}, strides {:?}", t.dtype(), t.shape(), t.strides());
        let rows = s.rows;
        return Err(Error::arg(
            arg,
            format!("{rows} contiguous rows of {n}"),
            got,
        ));
    }
    ptr(t, arg)
}

/// The device address of `t`'s first element.
fn ptr(t: &Tensor, arg: &'static str) -> Result<u64> {
    t.cuda_ptr().ok_or_else(|| Error::DeviceMismatch {
        arg,
        expected: "a CUDA tensor".into(),
        got: t.device().to_string(),
    })
}

/// A row-major product `c[m×n] = op(a)·op(b) + beta·c` of contiguous device matrices: op(a) is
/// `m×k` (`a` stored `k×m` when `ta`), op(b) `k×n` (`b` stored `n×k` when `tb`).
struct RowGemm {
    m: usize,
    n: usize,
    k: usize,
    a: (u64, bool),
    b: (u64, bool),
    c: u64,
    beta: f32,
}

impl RowGemm {
    /// cuBLAS is column-major: the row-major `c` is its `cᵀ = op(b)ᵀ·op(a)ᵀ`.
    fn run(&self, blas: &CudaBlas, dtype: DType) -> Result<()> {
        if self.m == 0 || self.n == 0 {
            return Ok(());
        }
        let dim = |what: &str, n: usize| {
            i32::try_from(n).map_err(|_| Error::Unsupported {
                device: "cuda",
                what: format!("a layer GEMM with {what} = {n} (over 2^31)"),
            })
        };
        let (m, n, k) = (dim("m", self.m)?, dim("n", self.n)?, dim("k", self.k)?);
        let ((a, ta), (b, tb)) = (self.a, self.b);
        Gemm {
            trans_a: tb,
            trans_b: ta,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            beta: self.beta,
            a: (b, if tb { k } else { n }.max(1), 0),
            b: (a, if ta { m } else { k }.max(1), 0),
            c: (self.c, n, 0),
            batch: 1,
        }
        .run(blas, dtype)
    }
}

/// `c[rows×n] = x·w (+ bias in every row)`: the bias broadcast first, the product onto it.
fn project(
    ctx: &Ctx,
    (rows, n, k): (usize, usize, usize),
    x: u64,
    w: u64,
    bias: Option<&Tensor>,
    c: u64,
) -> Result<()> {
    let bias = bias.map(dense).transpose()?;
    let mut products = Vec::with_capacity(2);
    let ones = match &bias {
        Some(_) => Some(ctx.ones(rows)?),
        None => None,
    };
    if let (Some(b), Some(ones)) = (&bias, &ones) {
        products.push(RowGemm {
            m: rows,
            n,
            k: 1,
            a: (ones.device_ptr(), false),
            b: (ptr(b, "bias")?, false),
            c,
            beta: 0.0,
        });
    }
    products.push(RowGemm {
        m: rows,
        n,
        k,
        a: (x, false),
        b: (w, false),
        c,
        beta: if bias.is_some() { 1.0 } else { 0.0 },
    });
    ctx.run(&products)?;
    drop((bias, ones));
    Ok(())
}

/// The column sums of a `rows × n` matrix (a bias gradient), as `onesᵀ·g`.
fn column_sums(ctx: &Ctx, rows: usize, n: usize, g: u64) -> Result<Tensor> {
    let sums = ctx.output(ctx.dtype, &[n])?;
    let ones = ctx.ones(rows)?;
    ctx.run(&[RowGemm {
        m: 1,
        n,
        k: rows,
        a: (ones.device_ptr(), true),
        b: (g, false),
        c: ptr(&sums, "bias gradient")?,
        beta: 0.0,
    }])?;
    Ok(sums)
}

impl LayerSteps for CudaSteps {
    fn qkv(&self, s: &LayerShape, x: &Tensor, w: &LayerWeights) -> Result<Tensor> {
        let ctx = Ctx::of(s)?;
        let (x, wq) = (dense(x)?, dense(&w.w_qkv)?);
        let qkv = ctx.output(s.dtype, &s.rows_of(s.cols))?;
        let c = ptr(&qkv, "qkv")?;
        let dims = (s.rows, s.cols, s.model_dim);
        project(
            &ctx,
            dims,
            ptr(&x, "x")?,
            ptr(&wq, "w_qkv")?,
            w.b_qkv.as_ref(),
            c,
        )?;
        ctx.rotate(s, c, (s.cols, s.heads + s.heads_kv), false)?;
        Ok(qkv)
    }

    fn output(&self, s: &LayerShape, out: &Tensor, w: &LayerWeights) -> Result<Tensor> {
        let ctx = Ctx::of(s)?;
        let (out, wo) = (dense(out)?, dense(&w.w_o)?);
        let y = ctx.output(s.dtype, &s.rows_of(s.model_dim))?;
        let dims = (s.rows, s.model_dim, s.heads * s.head_dim);
        let (o, wo) = (ptr(&out, "out")?, ptr(&wo, "w_o")?);
        project(&ctx, dims, o, wo, w.b_o.as_ref(), ptr(&y, "y")?)?;
        Ok(y)
    }

    fn out_grads(
        &self,
        s: &LayerShape,
        out: &Tensor,
        w: &LayerWeights,
        dy: &Tensor,
    ) -> Result<OutGrads> {
        let ctx = Ctx::of(s)?;
        let (rows, hd, m) = (s.rows, s.heads * s.head_dim, s.model_dim);
        let (out, wo, dy) = (dense(out)?, dense(&w.w_o)?, dense(dy)?);
        let (o, wo_p, dy_p) = (ptr(&out, "out")?, ptr(&wo, "w_o")?, ptr(&dy, "dy")?);
        let dw_o = ctx.output(s.dtype, &[hd, m])?;
        let dout = ctx.output(s.dtype, &s.heads_of(s.heads))?;
        ctx.run(&[
            RowGemm {
                m: hd,
                n: m,
                k: rows,
                a: (o, true),
                b: (dy_p, false),
                c: ptr(&dw_o, "dw_o")?,
                beta: 0.0,
            },
            RowGemm {
                m: rows,
                n: hd,
                k: m,
                a: (dy_p, false),
                b: (wo_p, true),
                c: ptr(&dout, "dout")?,
                beta: 0.0,
            },
        ])?;
        let db_o = match &w.b_o {
            Some(_) => Some(column_sums(&ctx, rows, m, dy_p)?),
            None => None,
        };
        Ok(OutGrads { dout, dw_o, db_o })
    }

    fn attention_grads(
        &self,
        s: &LayerShape,
        p: &Problem,
        x: BackwardInputs<'_>,
    ) -> Result<(Tensor, [Option<Tensor>; 2])> {
        let ctx = Ctx::of(s)?;
        let dqkv = ctx.output(s.dtype, &s.rows_of(s.cols))?;
        let [dq, dk, dv] = s.views(&dqkv)?;
        let dbias = match &p.bias {
            Some((b, _)) => Some(ctx.output(DType::F32, b.shape())?),
            None => None,
        };
        let drel_bias = match &p.rel_bias {
            Some(r) => Some(ctx.output(DType::F32, r.table.shape())?),
            None => None,
        };
        let mut grads = Gradients {
            dq,
            dk,
            dv,
            dbias,
            drel_bias,
        };
        crate::cuda::backward::backward_into(p, x, &mut grads)?;
        Ok((dqkv, [grads.dbias, grads.drel_bias]))
    }

    fn qkv_grads(
        &self,
        s: &LayerShape,
        x: &Tensor,
        w: &LayerWeights,
        dqkv: Tensor,
    ) -> Result<QkvGrads> {
        let ctx = Ctx::of(s)?;
        let (rows, c, m) = (s.rows, s.cols, s.model_dim);
        let d = ptr(&dqkv, "dqkv")?;
        ctx.rotate(s, d, (s.cols, s.heads + s.heads_kv), true)?;
        let (x, wq) = (dense(x)?, dense(&w.w_qkv)?);
        let dx = ctx.output(s.dtype, &s.x_shape)?;
        let dw_qkv = ctx.output(s.dtype, &[m, c])?;
        ctx.run(&[
            RowGemm {
                m,
                n: c,
                k: rows,
                a: (ptr(&x, "x")?, true),
                b: (d, false),
                c: ptr(&dw_qkv, "dw_qkv")?,
                beta: 0.0,
            },
            RowGemm {
                m: rows,
                n: m,
                k: c,
                a: (d, false),
                b: (ptr(&wq, "w_qkv")?, true),
                c: ptr(&dx, "dx")?,
                beta: 0.0,
            },
        ])?;
        let db_qkv = match &w.b_qkv {
            Some(_) => Some(column_sums(&ctx, rows, c, d)?),
            None => None,
        };
        Ok(QkvGrads { dx, dw_qkv, db_qkv })
    }

    fn heads_copy(
        &self,
        s: &LayerShape,
        src: &Tensor,
        first: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        let ctx = Ctx::of(s)?;
        let row_len: usize = src.shape()[s.x_shape.len() - 1..].iter().product();
        let n = heads * s.head_dim;
        let need = row_len.max((first + heads) * s.head_dim);
        let from = Columns {
            ptr: rows_ptr(s, src, "src", need)?,
            pitch: row_len,
            first: first * s.head_dim,
        };
        let copy = ctx.output(s.dtype, &s.heads_of(heads))?;
        let to = ptr(&copy, "copy")?;
        let dst = Columns {
            ptr: to,
            pitch: n,
            first: 0,
        };
        copy_columns(&ctx.g, s.dtype, (s.rows, n), &dst, &from)?;
        ctx.rotate(s, to, (n, heads), inverse)?;
        Ok(copy)
    }

    fn concat(&self, s: &LayerShape, parts: [&Tensor; 3]) -> Result<Tensor> {
        let ctx = Ctx::of(s)?;
        let packed = ctx.output(s.dtype, &s.rows_of(s.cols))?;
        let to = ptr(&packed, "dqkv")?;
        let widths = [s.heads, s.heads_kv, s.heads_kv].map(|h| h * s.head_dim);
        let mut first = 0;
        for ((part, name), n) in parts.into_iter().zip(["dq", "dk", "dv"]).zip(widths) {
            let src = Columns {
                ptr: rows_ptr(s, part, name, n)?,
                pitch: n,
                first: 0,
            };
            let dst = Columns {
                ptr: to,
                pitch: s.cols,
                first,
            };
            copy_columns(&ctx.g, s.dtype, (s.rows, n), &dst, &src)?;
            first += n;
        }
        Ok(packed)
    }
}
