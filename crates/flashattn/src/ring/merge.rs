//! The exact merge of attention results over disjoint sets of keys by their log-sum-exp.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::ForwardOutput;
use crate::tensor::Tensor;

/// Running merge of partial results for the rows of `[batch, n, heads, dv]` (f32), each row's
/// log-sum-exp `[batch, heads, n]` alongside (−∞ while no partial has seen a key).
pub(crate) struct Accumulator {
    dims: [usize; 4],
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl Accumulator {
    pub fn new(dims: [usize; 4]) -> Self {
        let [b, n, h, dv] = dims;
        Accumulator {
            dims,
            out: vec![0.0; b * n * h * dv],
            lse: vec![f32::NEG_INFINITY; b * h * n],
        }
    }

    /// Merges `part` (out `[batch, len, heads, dv]`, lse `[batch, heads, len]`) into rows
    /// `start..start + len`.
    pub fn add(&mut self, part: &ForwardOutput, start: usize) -> Result<()> {
        let [b, n, h, dv] = self.dims;
        let len = part.out.shape().get(1).copied().unwrap_or(0);
        let want = [b, len, h, dv];
        if part.out.shape() != want || start + len > n {
            return Err(Error::arg(
                "out",
                format!("shape {want:?} within {n} rows"),
                format!("{:?}", part.out.shape()),
            ));
        }
        if part.lse.shape() != [b, h, len] {
            return Err(Error::arg(
                "lse",
                format!("shape {:?}", [b, h, len]),
                format!("{:?}", part.lse.shape()),
            ));
        }
        let (out, lse) = (part.out.to_f32_vec()?, part.lse.to_f32_vec()?);
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..len {
                    let lp = lse[(bi * h + hi) * len + i] as f64;
                    if lp == f64::NEG_INFINITY {
                        continue; // this part saw no key for the row
                    }
                    let at = (bi * h + hi) * n + start + i;
                    let la = self.lse[at] as f64;
                    let (wa, wp, l) = weights(la, lp);
                    self.lse[at] = l as f32;
                    let acc = &mut self.out[((bi * n + start + i) * h + hi) * dv..][..dv];
                    let src = &out[((bi * len + i) * h + hi) * dv..][..dv];
                    for (o, &x) in acc.iter_mut().zip(src) {
                        *o = (wa * *o as f64 + wp * x as f64) as f32;
                    }
                }
            }
        }
        Ok(())
    }

    /// The merged output in `dtype`, and the log-sum-exp.
    pub fn finish(self, dtype: DType) -> Result<ForwardOutput> {
        let [b, n, h, dv] = self.dims;
        Ok(ForwardOutput {
            out: Tensor::from_vec(self.out, &[b, n, h, dv])?.to_dtype(dtype)?,
            lse: Tensor::from_vec(self.lse, &[b, h, n])?,
        })
    }
}

/// The weights of the accumulated row (log-sum-exp `la`, −∞ for none yet) and the new part's
/// (`lp`), and the merged log-sum-exp; NaN in either propagates.
fn weights(la: f64, lp: f64) -> (f64, f64, f64) {
    if la == f64::NEG_INFINITY {
        return (0.0, 1.0, lp);
    }
    let m = if la > lp { la } else { lp };
    let l = m + ((la - m).exp() + (lp - m).exp()).ln();
    ((la - l).exp(), (lp - l).exp(), l)
}

/// The attention of queries over the union of disjoint key sets, from the results over each
/// (as [`forward`](crate::forward) returns them, e.g. computed on different devices or over
/// the blocks of a ring): `out = Σ exp(lse_p − lse)·out_p` with `lse = log Σ exp(lse_p)`. Each
/// part is `[batch, seqlen, heads, dv]` with lse `[batch, heads, seqlen]`, or packed
/// `[total, heads, dv]` with lse `[heads, total]`, all alike; a row no part saw a key for gets
/// out 0 and lse −∞. The output is in the first part's dtype and on the CPU (accumulated in f32).
///
/// ```
/// use flashattn::{AttentionParams, Tensor, forward, merge_partials};
/// let x: Vec<f32> = (0..6 * 4).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = Tensor::from_vec(x, &[1, 6, 1, 4])?;
/// let p = AttentionParams::default();
/// let whole = forward(&t, &t, &t, &p)?;
/// // Keys 0..3 and 3..6 apart (the queries' diagonals move with the keys' first position).
/// let keys = |a: usize| t.view(&[1, 3, 1, 4], t.strides(), 4 * a);
/// let left = forward(&t, &keys(0)?, &keys(0)?, &p.clone().diagonal(0))?;
/// let right = forward(&t, &keys(3)?, &keys(3)?, &p.clone().diagonal(-3))?;
/// let merged = merge_partials(&[left, right])?;
/// let (a, b) = (merged.out.to_vec::<f32>()?, whole.out.to_vec::<f32>()?);
/// assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn merge_partials(parts: &[ForwardOutput]) -> Result<ForwardOutput> {
    let first = parts
        .first()
        .ok_or_else(|| Error::arg("parts", "at least one part", "none"))?;
    let (dims, packed) = match (first.out.shape(), first.lse.shape()) {
        (&[b, n, h, dv], &[lb, lh, ln]) if [lb, lh, ln] == [b, h, n] => ([b, n, h, dv], false),
        (&[n, h, dv], &[lh, ln]) if [lh, ln] == [h, n] => ([1, n, h, dv], true),
        (o, l) => {
            return Err(Error::arg(
                "parts",
                "out [batch, seqlen, heads, dv] with lse [batch, heads, seqlen], or out [total, heads, dv] with lse [heads, total]",
                format!("out {o:?}, lse {l:?}"),
            ));
        }
    };
    let mut acc = Accumulator::new(dims);
    for (i, p) in parts.iter().enumerate() {
        if p.out.shape() != first.out.shape() || p.lse.shape() != first.lse.shape() {
            return Err(Error::arg(
                "parts",
                format!(
                    "every part shaped like the first (out {:?}, lse {:?})",
                    first.out.shape(),
                    first.lse.shape()
                ),
                format!("part {i}: out {:?}, lse {:?}", p.out.shape(), p.lse.shape()),
            ));
        }
        if p.lse.dtype() != DType::F32 {
            return Err(Error::DType {
                arg: "parts",
                expected: "an f32 lse".into(),
                got: p.lse.dtype(),
            });
        }
        let [b, n, h, dv] = dims;
        let part = ForwardOutput {
            out: p.out.view(
                &[b, n, h, dv],
                &batch_strides(p.out.strides(), packed),
                p.out.offset(),
            )?,
            lse: p.lse.view(
                &[b, h, n],
                &batch_strides(p.lse.strides(), packed),
                p.lse.offset(),
            )?,
        };
        acc.add(&part, 0)?;
    }
    let merged = acc.finish(first.out.dtype())?;
    if !packed {
        return Ok(merged);
    }
    let [_, n, h, dv] = dims;
    Ok(ForwardOutput {
        out: merged.out.view(&[n, h, dv], &[h * dv, dv, 1], 0)?,
        lse: merged.lse.view(&[h, n], &[n, 1], 0)?,
    })
}

/// A packed tensor's strides with a batch dimension of 1 in front.
fn batch_strides(strides: &[usize], packed: bool) -> Vec<usize> {
    if packed {
        std::iter::once(0).chain(strides.iter().copied()).collect()
    } else {
        strides.to_vec()
    }
}
