//! The options and weights of the fused attention layer ([`crate::layer_forward`]).

use crate::params::AttentionParams;
use crate::tensor::Tensor;

/// Which dims of a head a rotary pair couples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Half-split (GPT-NeoX, LLaMA): dim `p` pairs with `p + R/2`.
    Half,
    /// Interleaved (GPT-J): dim `2p` pairs with `2p + 1`.
    Interleaved,
}

/// The rotary embedding applied to Q and K: pair `p` of a head at position `t` is rotated by
/// the angle `t · base^(−2p/R)`, for the first `R` dims of each head (the rest pass through).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// How the dims pair up.
    pub style: RopeStyle,
    /// The base of the frequencies (10000 in most models).
    pub base: f64,
    /// The rotary dim `R` (even, at most head_dim); `None` rotates the whole head.
    pub dim: Option<usize>,
}

impl Rope {
    /// Base 10000 over the whole head.
    pub fn new(style: RopeStyle) -> Self {
        Rope {
            style,
            base: 10000.0,
            dim: None,
        }
    }

    /// Sets the frequency base.
    pub fn base(mut self, base: f64) -> Self {
        self.base = base;
        self
    }

    /// Rotates only the first `dim` dims of each head.
    pub fn dim(mut self, dim: usize) -> Self {
        self.dim = Some(dim);
        self
    }
}

/// The options of a layer call: the head counts (head_dim follows from `w_qkv`'s columns), the
/// rotary embedding, its positions, and the attention's own options, passed through.
///
/// ```
/// use flashattn::{AttentionParams, LayerParams, Rope, RopeStyle};
/// let p = LayerParams::new(8, 2)
///     .rope(Rope::new(RopeStyle::Half).dim(32))
///     .attention(AttentionParams::default().causal());
/// assert_eq!(p.heads_kv, 2);
/// ```
#[derive(Clone, Debug)]
pub struct LayerParams {
    /// Query heads `H`.
    pub heads: usize,
    /// Key/value heads `HK` (dividing `H`).
    pub heads_kv: usize,
    /// The rotary embedding of Q and K; `None` leaves them as projected.
    pub rope: Option<Rope>,
    /// Rotary position of each row of `x` (`batch · seqlen` values, or `total_tokens` with
    /// varlen); `None` numbers each sequence's rows 0, 1, 2, ...
    pub positions: Option<Vec<i32>>,
    /// Every option of the attention itself (scale, mask, ALiBi, softcap, bias, varlen, ...).
    pub attention: AttentionParams,
}

impl LayerParams {
    /// `heads` query heads on `heads_kv` key/value heads, no rotary embedding, default attention.
    pub fn new(heads: usize, heads_kv: usize) -> Self {
        LayerParams {
            heads,
            heads_kv,
            rope: None,
            positions: None,
            attention: AttentionParams::default(),
        }
    }

    /// Sets the rotary embedding.
    pub fn rope(mut self, rope: Rope) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Sets the rotary positions (one per row of `x`).
    pub fn positions(mut self, positions: Vec<i32>) -> Self {
        self.positions = Some(positions);
        self
    }

    /// Sets the attention's options.
    pub fn attention(mut self, attention: AttentionParams) -> Self {
        self.attention = attention;
        self
    }
}

/// The layer's weights, in `x`'s dtype and on its device.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `[model_dim, (H + 2·HK)·head_dim]`: columns of the q heads, then the k heads, then the v
    /// heads, each head's head_dim contiguous.
    pub w_qkv: Tensor,
    /// `[(H + 2·HK)·head_dim]`, optional.
    pub b_qkv: Option<Tensor>,
    /// `[H·head_dim, model_dim]`.
    pub w_o: Tensor,
    /// `[model_dim]`, optional.
    pub b_o: Option<Tensor>,
}
