//! Validation: turns tensors and [`AttentionParams`] into a [`Problem`], the plain description of
//! sizes, strides and options that every backend's kernels read. Nothing runs on an input that fails
//! here, and every failure names the argument.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::mask::{Mask, Window};
use crate::params::{AttentionParams, MAX_DIAGONAL};
use crate::tensor::{Device, MAX_ELEMENTS, Tensor, contiguous_strides};

mod checks;

pub(crate) use checks::expect_shaped;
use checks::{
    expect_device, expect_dim, expect_rank, expect_unit_last_stride, head_dim_ok, seq_lengths,
};

/// The largest head dimension of Q/K and of V.
pub const MAX_HEAD_DIM: usize = 512;

/// Element strides of a `[batch, seqlen, heads, head_dim]` (or packed `[tokens, heads, head_dim]`,
/// with `batch = 0`) operand; the head dimension has stride 1.
#[derive(Clone, Copy, Debug, Default)]
pub struct RowLayout {
    pub offset: usize,
    pub batch: usize,
    pub row: usize,
    pub head: usize,
}

impl RowLayout {
    fn of(t: &Tensor) -> Self {
        RowLayout::strided(t.strides(), t.offset())
    }

    /// The layout of a view with these strides (rank 4, or 3 for packed rows) and offset.
    pub(crate) fn strided(s: &[usize], offset: usize) -> Self {
        if s.len() == 4 {
            RowLayout {
                offset,
                batch: s[0],
                row: s[1],
                head: s[2],
            }
        } else {
            RowLayout {
                offset,
                batch: 0,
                row: s[0],
                head: s[1],
            }
        }
    }
}

/// One sequence of the batch: its lengths, its diagonal and, for packed inputs, its first row.
#[derive(Clone, Copy, Debug)]
pub struct Seq {
    pub q_row0: usize,
    pub k_row0: usize,
    pub nq: usize,
    pub nk: usize,
    /// Key position of query 0's diagonal (query `i`'s is `i + diag`): the call's
    /// [`AttentionParams::diagonal`], else `nk − nq`. Every mask and position bias reads it.
    pub diag: i64,
}

impl Seq {
    fn new((q_row0, k_row0): (usize, usize), nq: usize, nk: usize, diagonal: Option<i64>) -> Self {
        Seq {
            q_row0,
            k_row0,
            nq,
            nk,
            diag: diagonal.unwrap_or(nk as i64 - nq as i64),
        }
    }

    /// True when the diagonal is the default bottom-right one.
    pub fn is_bottom_right(&self) -> bool {
        self.diag == self.nk as i64 - self.nq as i64
    }
}

/// Element strides of the bias, 0 along broadcast dimensions.
#[derive(Clone, Copy, Debug)]
pub struct BiasLayout {
    pub offset: usize,
    pub strides: [usize; 4],
}

/// The relative-position bias: its f32 table `[heads_q, 2L − 1]` (contiguous, possibly at an
/// offset in its buffer) and `radius = L − 1`.
#[derive(Clone, Debug)]
pub struct RelBias {
    pub table: Tensor,
    pub radius: usize,
}

impl RelBias {
    /// Entries of a head's row, `2L − 1`.
    pub fn width(&self) -> usize {
        2 * self.radius + 1
    }

    /// Element index of `table[h, 0]`.
    #[inline(always)]
    pub fn row_at(&self, h: usize) -> usize {
        self.table.offset() + h * self.width()
    }

    /// The column read at distance `d = j − (i + diag)` from the diagonal.
    #[inline(always)]
    pub fn column(&self, d: i64) -> usize {
        let r = self.radius as i64;
        (d.clamp(-r, r) + r) as usize
    }
}

/// A validated attention problem.
#[derive(Clone, Debug)]
pub struct Problem {
    pub dtype: DType,
    pub device: Device,
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub seqs: Vec<Seq>,
    pub max_nq: usize,
    pub max_nk: usize,
    /// Rows of the packed query tensor (`batch · seqlen_q` when padded).
    pub total_q: usize,
    pub varlen: bool,
    pub q: RowLayout,
    pub k: RowLayout,
    pub v: RowLayout,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Window,
    /// One slope per (batch, query head), `batch · heads_q` entries.
    pub alibi: Option<Vec<f32>>,
    /// The bias converted to f32 (a view when it already was), and its strides.
    pub bias: Option<(Tensor, BiasLayout)>,
    pub rel_bias: Option<RelBias>,
    /// Bitwise-reproducible GPU gradients asked for.
    pub deterministic: bool,
}

impl Problem {
    /// Validates a forward call.
    pub fn new(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttentionParams) -> Result<Self> {
        let device = q.device();
        expect_device(k, "k", device)?;
        expect_device(v, "v", device)?;
        let dtype = q.dtype();
        for (t, arg) in [(k, "k"), (v, "v")] {
            if t.dtype() != dtype {
                return Err(Error::DType {
                    arg,
                    expected: format!("{dtype} (the dtype of q)"),
                    got: t.dtype(),
                });
            }
        }
        let varlen = params.varlen.is_some();
        let (rank, what) = if varlen {
            (3, "[total_tokens, heads, head_dim] (packed, with varlen)")
        } else {
            (4, "[batch, seqlen, heads, head_dim]")
        };
        expect_rank(q, "q", rank, what)?;
        expect_rank(k, "k", rank, what)?;
        expect_rank(v, "v", rank, what)?;
        for (t, arg) in [(q, "q"), (k, "k"), (v, "v")] {
            expect_unit_last_stride(t, arg)?;
        }
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        let h = rank - 2;
        let (heads_q, heads_kv) = (qs[h], ks[h]);
        let (head_dim, head_dim_v) = (qs[h + 1], vs[h + 1]);
        head_dim_ok("q", head_dim)?;
        expect_dim("k", "head_dim", head_dim, ks[h + 1])?;
        head_dim_ok("v", head_dim_v)?;
        expect_dim("v", "heads", heads_kv, vs[h])?;
        expect_dim("v", "seqlen", ks[h - 1], vs[h - 1])?;
        if heads_q == 0 || heads_kv == 0 || heads_q % heads_kv != 0 {
            return Err(Error::arg(
                "k",
                format!("a number of heads >= 1 that divides the query heads ({heads_q})"),
                format!("{heads_kv} heads"),
            ));
        }

        let diagonal = params.diagonal;
        if let Some(d) = diagonal
            && d.unsigned_abs() > MAX_DIAGONAL as u64
        {
            return Err(Error::arg(
                "diagonal",
                format!("a key offset of magnitude at most 2^40 = {MAX_DIAGONAL}"),
                d,
            ));
        }
        let seqs: Vec<Seq> = match &params.varlen {
            None => {
                expect_dim("k", "batch", qs[0], ks[0])?;
                expect_dim("v", "batch", qs[0], vs[0])?;
                (0..qs[0])
                    .map(|_| Seq::new((0, 0), qs[1], ks[1], diagonal))
                    .collect()
            }
            Some(vl) => {
                let lq = seq_lengths("cu_seqlens_q", &vl.cu_seqlens_q, qs[0])?;
                let lk = seq_lengths("cu_seqlens_k", &vl.cu_seqlens_k, ks[0])?;
                expect_dim(
                    "cu_seqlens_k",
                    "batch + 1 entries",
                    lq.len() + 1,
                    lk.len() + 1,
                )?;
                lq.iter()
                    .zip(&lk)
                    .enumerate()
                    .map(|(b, (&nq, &nk))| {
                        let rows = (vl.cu_seqlens_q[b], vl.cu_seqlens_k[b]);
                        Seq::new((rows.0 as usize, rows.1 as usize), nq, nk, diagonal)
                    })
                    .collect()
            }
        };
        let batch = seqs.len();
        let max_nq = seqs.iter().map(|s| s.nq).max().unwrap_or(0);
        let max_nk = seqs.iter().map(|s| s.nk).max().unwrap_or(0);
        let total_q = if varlen { qs[0] } else { batch * max_nq };
        // Outputs shaped like q with V's head dim (views of q may repeat elements with stride 0,
        // so this can exceed what any input holds).
        let out_elements = (q.numel() / head_dim).checked_mul(head_dim_v);
        if out_elements.is_none_or(|n| n > MAX_ELEMENTS) {
            return Err(Error::arg(
                "v",
                "an output (q's shape with v's head_dim) of at most 2^60 elements",
                format!("q shape {:?}, v head_dim {head_dim_v}", q.shape()),
            ));
        }

        let scale = params.scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
        if !scale.is_finite() {
            return Err(Error::arg("scale", "a finite number", scale));
        }
        if let Some(cap) = params.softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(Error::arg("softcap", "a finite number > 0", cap));
        }
        let alibi = match &params.alibi_slopes {
            None => None,
            Some(t) => Some(alibi_slopes(t, batch, heads_q)?),
        };
        let bias = match &params.bias {
            None => None,
            Some(t) => {
                expect_device(t, "bias", device)?;
                Some(bias_layout(t, [batch, heads_q, max_nq, max_nk])?)
            }
        };
        let rel_bias = match &params.rel_bias {
            None => None,
            Some(t) => {
                expect_device(t, "rel_bias", device)?;
                Some(rel_bias_table(t, heads_q)?)
            }
        };

        Ok(Problem {
            dtype,
            device,
            batch,
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v,
            seqs,
            max_nq,
            max_nk,
            total_q,
            varlen,
            q: RowLayout::of(q),
            k: RowLayout::of(k),
            v: RowLayout::of(v),
            scale,
            softcap: params.softcap,
            window: params.window,
            alibi,
            bias,
            rel_bias,
            deterministic: params.deterministic,
        })
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// The key/value head that query head `h` reads.
    #[inline(always)]
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group()
    }

    /// The mask of sequence `b`.
    pub fn mask(&self, b: usize) -> Mask {
        let s = &self.seqs[b];
        Mask::with_diagonal(self.window, s.nq, s.nk, s.diag)
    }

    /// True when every sequence's diagonal is the default bottom-right one.
    pub fn is_bottom_right(&self) -> bool {
        self.seqs.iter().all(Seq::is_bottom_right)
    }

    /// True when the scores take a per-element step (softcap, ALiBi, a bias) before the mask and
    /// the softmax, so the kernels change to base 2 after it rather than on Q.
    pub fn has_score_mods(&self) -> bool {
        self.softcap.is_some()
            || self.alibi.is_some()
            || self.bias.is_some()
            || self.rel_bias.is_some()
    }

    /// The ALiBi slope of (batch `b`, query head `h`), 0 without ALiBi.
    #[inline(always)]
    pub fn slope(&self, b: usize, h: usize) -> f32 {
        self.alibi.as_ref().map_or(0.0, |s| s[b * self.heads_q + h])
    }

    /// Element index of `q[b, i, h, 0]` (i counted within sequence `b`).
    #[inline(always)]
    pub fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        self.query_at(&self.q, b, i, h)
    }

    /// Element index of `k[b, j, hk, 0]`.
    #[inline(always)]
    pub fn k_at(&self, b: usize, j: usize, hk: usize) -> usize {
        self.key_at(&self.k, b, j, hk)
    }

    /// Element index of `v[b, j, hk, 0]`.
    #[inline(always)]
    pub fn v_at(&self, b: usize, j: usize, hk: usize) -> usize {
        self.key_at(&self.v, b, j, hk)
    }

    /// Element index of row `i` of sequence `b`, head `h`, in a query-shaped operand (q, out, dout, dq).
    #[inline(always)]
    pub fn query_at(&self, l: &RowLayout, b: usize, i: usize, h: usize) -> usize {
        row_at(l, b, self.seqs[b].q_row0 + i, h)
    }

    /// Element index of row `j` of sequence `b`, head `hk`, in a key-shaped operand (k, v, dk, dv).
    #[inline(always)]
    pub fn key_at(&self, l: &RowLayout, b: usize, j: usize, hk: usize) -> usize {
        row_at(l, b, self.seqs[b].k_row0 + j, hk)
    }

    /// Row of query `i` of sequence `b` in the packed (or flattened `[batch · seqlen_q]`) query rows.
    #[inline(always)]
    pub fn q_row(&self, b: usize, i: usize) -> usize {
        if self.varlen {
            self.seqs[b].q_row0 + i
        } else {
            b * self.max_nq + i
        }
    }

    /// Row of key `j` of sequence `b` in the packed (or flattened) key rows.
    #[inline(always)]
    pub fn k_row(&self, b: usize, j: usize) -> usize {
        if self.varlen {
            self.seqs[b].k_row0 + j
        } else {
            b * self.max_nk + j
        }
    }

    /// Element index of `lse[b, h, i]`: `[batch, heads, seqlen_q]`, or `[heads, total_q]` when packed.
    #[inline(always)]
    pub fn lse_at(&self, b: usize, h: usize, i: usize) -> usize {
        if self.varlen {
            h * self.total_q + self.seqs[b].q_row0 + i
        } else {
            (b * self.heads_q + h) * self.max_nq + i
        }
    }

    /// Element index of `bias[b, h, i, 0]` (the key index has stride `bias.strides[3]`).
    #[inline(always)]
    pub fn bias_row_at(&self, layout: &BiasLayout, b: usize, h: usize, i: usize) -> usize {
        let s = layout.strides;
        layout.offset + b * s[0] + h * s[1] + i * s[2]
    }

    /// The shape of the log-sum-exp output.
    pub fn lse_shape(&self) -> Vec<usize> {
        if self.varlen {
            vec![self.heads_q, self.total_q]
        } else {
            vec![self.batch, self.heads_q, self.max_nq]
        }
    }

    /// Shape of a `[.., seqlen, heads, dim]` output like `like` with last dimension `dim`.
    pub fn shape_like(like: &Tensor, dim: usize) -> Vec<usize> {
        let mut shape = like.shape().to_vec();
        *shape.last_mut().expect("validated rank >= 3") = dim;
        shape
    }

    /// FLOPs of the forward pass by the usual count: `4 · seqlen_q · seqlen_k · heads · head_dim`
    /// per sequence over the visible (query, key) pairs (so causal is about half).
    pub fn forward_flops(&self) -> f64 {
        let d = (self.head_dim + self.head_dim_v) as f64;
        self.seqs
            .iter()
            .enumerate()
            .map(|(b, s)| {
                let m = self.mask(b);
                let pairs: usize = (0..s.nq).map(|i| m.key_range(i).len()).sum();
                2.0 * pairs as f64 * d * self.heads_q as f64
            })
            .sum()
    }
}

#[inline(always)]
fn row_at(l: &RowLayout, b: usize, row: usize, h: usize) -> usize {
    l.offset + b * l.batch + row * l.row + h * l.head
}

/// Strides of an output shaped like `like` (same dimension order in memory), contiguous.
pub fn strides_like(like: &Tensor, shape: &[usize]) -> Vec<usize> {
    let rank = shape.len();
    let mut order: Vec<usize> = (0..rank - 1).collect();
    // Outer dimensions by decreasing stride of `like`; the head dimension stays innermost.
    order.sort_by(|&a, &b| like.strides()[b].cmp(&like.strides()[a]));
    order.push(rank - 1);
    let permuted: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
    let cs = contiguous_strides(&permuted);
    let mut strides = vec![0; rank];
    for (pos, &d) in order.iter().enumerate() {
        strides[d] = cs[pos];
    }
    strides
}

fn alibi_slopes(t: &Tensor, batch: usize, heads: usize) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return Err(Error::DType {
            arg: "alibi_slopes",
            expected: "f32".into(),
            got: t.dtype(),
        });
    }
    let per_batch = match t.shape() {
        [h] if *h == heads => false,
        [b, h] if *b == batch && *h == heads => true,
        other => {
            return Err(Error::arg(
                "alibi_slopes",
                format!("shape [{heads}] or [{batch}, {heads}] (query heads)"),
                format!("{other:?}"),
            ));
        }
    };
    let s = t.to_f32_vec()?;
    if let Some(bad) = s.iter().find(|x| !x.is_finite()) {
        return Err(Error::arg("alibi_slopes", "finite slopes", bad));
    }
    Ok(if per_batch {
        s
    } else {
        (0..batch).flat_map(|_| s.iter().copied()).collect()
    })
}

fn bias_layout(t: &Tensor, full: [usize; 4]) -> Result<(Tensor, BiasLayout)> {
    let expected = || {
        format!("4 dimensions, each 1 or equal to {full:?} ([batch, heads, seqlen_q, seqlen_k])")
    };
    if t.rank() != 4 || t.shape().iter().zip(full).any(|(&d, f)| d != 1 && d != f) {
        return Err(Error::arg(
            "bias",
            expected(),
            format!("shape {:?}", t.shape()),
        ));
    }
    let t = if t.dtype() == DType::F32 {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    let strides: [usize; 4] =
        std::array::from_fn(|d| if t.shape()[d] == 1 { 0 } else { t.strides()[d] });
    let layout = BiasLayout {
        offset: t.offset(),
        strides,
    };
    Ok((t, layout))
}

fn rel_bias_table(t: &Tensor, heads: usize) -> Result<RelBias> {
    if t.dtype() != DType::F32 {
        return Err(Error::DType {
            arg: "rel_bias",
            expected: "f32".into(),
            got: t.dtype(),
        });
    }
    match t.shape() {
        [h, w] if *h == heads && w % 2 == 1 && *w <= i32::MAX as usize => Ok(RelBias {
            table: if t.is_contiguous() {
                t.clone()
            } else {
                t.contiguous()?
            },
            radius: w / 2,
        }),
        other => Err(Error::arg(
            "rel_bias",
            format!("shape [{heads}, 2L - 1] (query heads, an odd number of columns below 2^31)"),
            format!("{other:?}"),
        )),
    }
}

/// Validates a backward call (flashattn's and the standard attention's): the forward's problem,
/// then out, lse and dout against it.
pub(crate) fn backward_problem(
    [q, k, v, out, lse, dout]: [&Tensor; 6],
    params: &AttentionParams,
) -> Result<Problem> {
    let p = Problem::new(q, k, v, params)?;
    let out_shape = Problem::shape_like(q, p.head_dim_v);
    for (t, arg) in [(out, "out"), (dout, "dout")] {
        expect_shaped(t, arg, &out_shape, (p.dtype, " (the dtype of q)"), p.device)?;
    }
    if lse.shape() != p.lse_shape().as_slice() {
        return Err(Error::arg(
            "lse",
            format!("shape {:?}", p.lse_shape()),
            format!("shape {:?}", lse.shape()),
        ));
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            arg: "lse",
            expected: "f32".into(),
            got: lse.dtype(),
        });
    }
    if lse.device() != p.device {
        return Err(Error::DeviceMismatch {
            arg: "lse",
            expected: p.device.to_string(),
            got: lse.device().to_string(),
        });
    }
    Ok(p)
}

/// The layout of a validated `out`/`dout` operand.
pub fn row_layout(t: &Tensor) -> RowLayout {
    RowLayout::of(t)
}
