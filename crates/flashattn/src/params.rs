//! Every option of an attention call, in one struct.
//!
//! The order of operations is fixed (as in FlashAttention-2), for query `i` and key `j` of a
//! sequence with `nq` queries and `nk` keys, query `i`'s diagonal at key `i + d` (`d` the
//! [`AttentionParams::diagonal`], by default `nk − nq`):
//!
//! 1. `s = (q_i · k_j) · scale`
//! 2. softcap: `s = cap · tanh(s / cap)`
//! 3. ALiBi and biases: `s = s − slope · |i + d − j| + bias[b, h, i, j] + rel_bias[h, r]`,
//!    `r = clamp(j − (i + d), −(L − 1), L − 1) + L − 1`
//! 4. mask: `s = −∞` where the [`Window`] around the diagonal hides key `j` from query `i`
//! 5. `p = softmax_j(s)`, `out_i = Σ_j p_ij · v_j`, `lse_i = log Σ_j exp(s_ij)`
//!
//! A row that sees no key gets output 0 and log-sum-exp −∞.

use crate::mask::Window;
use crate::tensor::Tensor;

/// The largest magnitude of [`AttentionParams::diagonal`], 2^40: every position stays far inside
/// 64-bit integers.
pub const MAX_DIAGONAL: i64 = 1 << 40;

/// Packed variable-length batches: sequence `b` holds rows `cu_seqlens[b]..cu_seqlens[b + 1]` of
/// the packed `[total_tokens, heads, head_dim]` tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VarLen {
    /// Cumulative query lengths, `batch + 1` entries starting at 0.
    pub cu_seqlens_q: Vec<i32>,
    /// Cumulative key/value lengths, `batch + 1` entries starting at 0.
    pub cu_seqlens_k: Vec<i32>,
}

/// Options of a forward or backward call. Build with the chained setters:
///
/// ```
/// use flashattn::{AttentionParams, Window};
/// let p = AttentionParams::default().causal().softcap(30.0);
/// assert_eq!(p.window, Window::CAUSAL);
/// let p = AttentionParams::default().window(128, 0).scale(0.125);
/// assert_eq!(p.window, Window::new(Some(128), Some(0)));
/// ```
#[derive(Clone, Debug, Default)]
pub struct AttentionParams {
    /// Multiplier of `q · k`; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Which keys each query sees; [`Window::CAUSAL`] is causal attention.
    pub window: Window,
    /// ALiBi slopes, f32, shape `[heads]` or `[batch, heads]` (query heads).
    pub alibi_slopes: Option<Tensor>,
    /// Soft cap applied to the scaled scores: `cap · tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// Additive bias of 4 dimensions broadcastable to `[batch, heads, seqlen_q, seqlen_k]` (each
    /// dimension either full or 1). With [`VarLen`] the last two are the longest sequence lengths and
    /// sequence `b` reads its top-left corner. Any dtype; read in f32.
    pub bias: Option<Tensor>,
    /// Relative-position bias table, f32 `[heads, 2L − 1]` (query heads): key `j` of query `i`
    /// reads column `clamp(j − (i + d), −(L − 1), L − 1) + L − 1` of its head's row (`d` the
    /// diagonal), read in place, never expanded to `seqlen_q × seqlen_k`.
    pub rel_bias: Option<Tensor>,
    /// Query `i`'s diagonal sits at key position `i + d`: the window, ALiBi and the
    /// relative-position bias measure from it. `None`: `nk − nq` (aligned bottom-right). With
    /// [`VarLen`] the same `d` applies to every sequence. For blocks of a longer sequence (ring
    /// attention), queries from global position `qo` against keys from `ko`: `d = qo − ko`.
    /// At most [`MAX_DIAGONAL`] in magnitude. On CUDA tensors, one that the kernels' 32-bit
    /// positions cannot hold exactly even clamped (ALiBi with `nq + nk + |d|` over 2^30, a window
    /// edge that binds that far) is an [`crate::Error::Unsupported`].
    pub diagonal: Option<i64>,
    /// Packed variable-length batches; `None` for padded `[batch, seqlen, heads, head_dim]` inputs.
    pub varlen: Option<VarLen>,
    /// Bitwise-reproducible gradients on the GPU (see [`AttentionParams::deterministic`]).
    pub deterministic: bool,
}

impl AttentionParams {
    /// Set the score scale (default `1 / sqrt(head_dim)`).
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Causal attention: keys up to the diagonal (bottom-right aligned by default).
    pub fn causal(mut self) -> Self {
        self.window = Window::CAUSAL;
        self
    }

    /// A sliding window of `left` keys before and `right` keys after the diagonal.
    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Window::new(Some(left), Some(right));
        self
    }

    /// Soft-cap the scores at `cap`.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// ALiBi slopes (`[heads]` or `[batch, heads]`, f32).
    pub fn alibi(mut self, slopes: Tensor) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }

    /// An additive bias broadcastable to `[batch, heads, seqlen_q, seqlen_k]`.
    pub fn bias(mut self, bias: Tensor) -> Self {
        self.bias = Some(bias);
        self
    }

    /// A relative-position bias table `[heads, 2L − 1]` (f32).
    pub fn rel_bias(mut self, table: Tensor) -> Self {
        self.rel_bias = Some(table);
        self
    }

    /// Query `i`'s diagonal at key `i + d` (see [`AttentionParams::diagonal`]).
    ///
    /// ```
    /// use flashattn::AttentionParams;
    /// // Queries at global positions 512.. against keys at 256..: query i sits at key i + 256.
    /// let p = AttentionParams::default().causal().diagonal(512 - 256);
    /// assert_eq!(p.diagonal, Some(256));
    /// ```
    pub fn diagonal(mut self, d: i64) -> Self {
        self.diagonal = Some(d);
        self
    }

    /// Packed variable-length batches.
    pub fn varlen(mut self, cu_seqlens_q: Vec<i32>, cu_seqlens_k: Vec<i32>) -> Self {
        self.varlen = Some(VarLen {
            cu_seqlens_q,
            cu_seqlens_k,
        });
        self
    }

    /// Gradients bitwise identical from run to run on the GPU. By default the GPU backward sums
    /// dQ (and the bias gradient) with f32 atomics, whose order varies between runs (results
    /// differ in the last bits). Deterministic, a second pass over the keys computes dQ (and the
    /// bias gradient) per query block in a fixed order: about 1.5–2× the backward's time, and
    /// with a bias broadcast over batch or heads, that pass loops over them in each block (less
    /// parallel). The CPU backward is deterministic for a given thread count either way, except
    /// the gradient of a broadcast bias, whose tiles it adds in the order threads finish them.
    pub fn deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }

    /// True when the call masks at all (causal or a bounded window).
    pub fn is_masked(&self) -> bool {
        !self.window.is_full()
    }
}
