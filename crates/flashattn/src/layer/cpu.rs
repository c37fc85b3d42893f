//! The layer's steps on the CPU: f32 GEMMs by the `gemm` crate, the rotation in place in the
//! f32 projections, the attention backward into one packed gradient buffer; the separate-calls
//! yardstick's head copies and concatenation, in f32 too.

use std::borrow::Cow;

use crate::backend::BackwardInputs;
use crate::cpu::matmul::{Parallelism, matmul};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layer::params::LayerWeights;
use crate::layer::rope::{rotate_heads, rotate_rows};
use crate::layer::shape::LayerShape;
use crate::layer::{LayerSteps, OutGrads, QkvGrads};
use crate::outputs::poison_outputs;
use crate::problem::{Problem, row_layout};
use crate::tensor::{HostElement, Tensor};

/// How the GEMMs run: the projections are whole-batch products, run on every core.
const GEMM_PAR: Parallelism = Parallelism::Rayon(0);

pub(crate) struct CpuSteps;

/// `t`'s elements in row-major order as f32: borrowed when it is a contiguous f32 tensor.
pub(crate) fn f32_rows(t: &Tensor) -> Result<Cow<'_, [f32]>> {
    if t.dtype() == DType::F32
        && t.is_contiguous()
        && let Some(all) = t.cpu_slice::<f32>()
    {
        return Ok(Cow::Borrowed(&all[t.offset()..t.offset() + t.numel()]));
    }
    Ok(Cow::Owned(t.to_f32_vec()?))
}

/// `rows × n` zeros, or the bias in every row (what the GEMM then accumulates onto).
fn start_rows(rows: usize, n: usize, bias: Option<&Tensor>) -> Result<Vec<f32>> {
    Ok(match bias {
        None => vec![0.0; rows * n],
        Some(b) => f32_rows(b)?.repeat(rows),
    })
}

/// The sum of each column of a row-major `rows × n` matrix, accumulated in f64.
fn column_sums(g: &[f32], n: usize) -> Vec<f32> {
    let mut sums = vec![0f64; n];
    for row in g.chunks_exact(n) {
        sums.iter_mut()
            .zip(row)
            .for_each(|(s, &x)| *s += f64::from(x));
    }
    sums.into_iter().map(|s| s as f32).collect()
}

/// A tensor of `shape` holding `data` rounded to `dtype`.
pub(crate) fn tensor_of(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(data, shape)?;
    match dtype {
        DType::F32 => Ok(t),
        _ => t.to_dtype(dtype),
    }
}

impl LayerSteps for CpuSteps {
    fn qkv(&self, s: &LayerShape, x: &Tensor, w: &LayerWeights) -> Result<Tensor> {
        let (x32, w32) = (f32_rows(x)?, f32_rows(&w.w_qkv)?);
        let mut qkv = start_rows(s.rows, s.cols, w.b_qkv.as_ref())?;
        let dims = (s.rows, s.cols, s.model_dim);
        let accumulate = w.b_qkv.is_some();
        matmul(
            &mut qkv,
            dims,
            (&x32, s.model_dim, 1),
            (&w32, s.cols, 1),
            accumulate,
            GEMM_PAR,
        );
        if let Some(rope) = &s.rope {
            rotate_rows(&mut qkv, s, rope, false);
        }
        tensor_of(qkv, &s.rows_of(s.cols), s.dtype)
    }

    fn output(&self, s: &LayerShape, out: &Tensor, w: &LayerWeights) -> Result<Tensor> {
        let (hd, m) = (s.heads * s.head_dim, s.model_dim);
        let (o32, w32) = (f32_rows(out)?, f32_rows(&w.w_o)?);
        let mut y = start_rows(s.rows, m, w.b_o.as_ref())?;
        let accumulate = w.b_o.is_some();
        matmul(
            &mut y,
            (s.rows, m, hd),
            (&o32, hd, 1),
            (&w32, m, 1),
            accumulate,
            GEMM_PAR,
        );
        tensor_of(y, &s.rows_of(m), s.dtype)
    }

    fn out_grads(
        &self,
        s: &LayerShape,
        out: &Tensor,
        w: &LayerWeights,
        dy: &Tensor,
    ) -> Result<OutGrads> {
        let (rows, hd, m) = (s.rows, s.heads * s.head_dim, s.model_dim);
        let (o32, w32, dy32) = (f32_rows(out)?, f32_rows(&w.w_o)?, f32_rows(dy)?);
        let mut dw_o = vec![0.0; hd * m];
        matmul(
            &mut dw_o,
            (hd, m, rows),
            (&o32, 1, hd),
            (&dy32, m, 1),
            false,
            GEMM_PAR,
        );
        let mut dout = vec![0.0; rows * hd];
        matmul(
            &mut dout,
            (rows, hd, m),
            (&dy32, m, 1),
            (&w32, 1, m),
            false,
            GEMM_PAR,
        );
        let db_o = match &w.b_o {
            Some(_) => Some(tensor_of(column_sums(&dy32, m), &[m], s.dtype)?),
            None => None,
        };
        Ok(OutGrads {
            dout: tensor_of(dout, &s.heads_of(s.heads), s.dtype)?,
            dw_o: tensor_of(dw_o, &[hd, m], s.dtype)?,
            db_o,
        })
    }

    fn attention_grads(
        &self,
        s: &LayerShape,
        p: &Problem,
        x: BackwardInputs<'_>,
    ) -> Result<(Tensor, [Option<Tensor>; 2])> {
        let fill = if poison_outputs() { f32::NAN } else { 0.0 };
        let mut dqkv = Tensor::full(&s.rows_of(s.cols), s.dtype, fill)?;
        let layouts = s.views(&dqkv)?.map(|v| row_layout(&v));
        let biases = crate::cpu::backward_packed(p, x, &mut dqkv, layouts)?;
        Ok((dqkv, biases))
    }

    fn qkv_grads(
        &self,
        s: &LayerShape,
        x: &Tensor,
        w: &LayerWeights,
        mut dqkv: Tensor,
    ) -> Result<QkvGrads> {
        let (rows, c, m) = (s.rows, s.cols, s.model_dim);
        // f32: the inverse rotation runs in the buffer the attention wrote; else in its widening.
        let mut widened;
        let at = dqkv.offset()..dqkv.offset() + dqkv.numel();
        let d32: &mut [f32] = match s.dtype {
            DType::F32 => dqkv
                .cpu_storage_mut()
                .and_then(<f32 as HostElement>::slice_mut)
                .map(|all| &mut all[at])
                .ok_or_else(|| Error::arg("dqkv", "an f32 host buffer of its own", "another"))?,
            _ => {
                widened = dqkv.to_f32_vec()?;
                &mut widened
            }
        };
        if let Some(rope) = &s.rope {
            rotate_rows(d32, s, rope, true);
        }
        let (x32, w32) = (f32_rows(x)?, f32_rows(&w.w_qkv)?);
        let mut dw_qkv = vec![0.0; m * c];
        matmul(
            &mut dw_qkv,
            (m, c, rows),
            (&x32, 1, m),
            (d32, c, 1),
            false,
            GEMM_PAR,
        );
        let mut dx = vec![0.0; rows * m];
        matmul(
            &mut dx,
            (rows, m, c),
            (d32, c, 1),
            (&w32, 1, c),
            false,
            GEMM_PAR,
        );
        let db_qkv = match &w.b_qkv {
            Some(_) => Some(tensor_of(column_sums(d32, c), &[c], s.dtype)?),
            None => None,
        };
        Ok(QkvGrads {
            dx: tensor_of(dx, &s.x_shape, s.dtype)?,
            dw_qkv: tensor_of(dw_qkv, &[m, c], s.dtype)?,
            db_qkv,
        })
    }

    fn heads_copy(
        &self,
        s: &LayerShape,
        src: &Tensor,
        first: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        let row_len: usize = src.shape()[s.x_shape.len() - 1..].iter().product();
        let (n, from) = (heads * s.head_dim, first * s.head_dim);
        let mut v = Vec::with_capacity(s.rows * n);
        for row in f32_rows(src)?.chunks_exact(row_len.max(1)) {
            v.extend_from_slice(&row[from..from + n]);
        }
        if let Some(rope) = &s.rope {
            rotate_heads(&mut v, n, heads, s, rope, inverse);
        }
        tensor_of(v, &s.heads_of(heads), s.dtype)
    }

    fn concat(&self, s: &LayerShape, [dq, dk, dv]: [&Tensor; 3]) -> Result<Tensor> {
        let (dq, dk, dv) = (f32_rows(dq)?, f32_rows(dk)?, f32_rows(dv)?);
        let (qd, kd) = (s.heads * s.head_dim, s.heads_kv * s.head_dim);
        let mut packed = Vec::with_capacity(s.rows * s.cols);
        for r in 0..s.rows {
            packed.extend_from_slice(&dq[r * qd..][..qd]);
            packed.extend_from_slice(&dk[r * kd..][..kd]);
            packed.extend_from_slice(&dv[r * kd..][..kd]);
        }
        tensor_of(packed, &s.rows_of(s.cols), s.dtype)
    }
}
