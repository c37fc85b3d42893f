//! The command line, declared with clap's derive API.

use clap::{Args, Parser, Subcommand, ValueEnum};
use flashattn::{DType, Device, Window};

const EXAMPLES: &str = "\
Examples:
  flashattn check                                  # the default set, forward and backward, in a few seconds
  flashattn check --seqlen 1000 --causal --dtype f32,bf16

Exit status: 0 success, 1 a check failed, 2 bad usage or bad input.";

const CHECK_EXAMPLES: &str = "\
Examples:
  flashattn check                                   # masks, GQA, varlen, f32/f16/bf16, forward and backward
  flashattn check --dtype bf16                      # the default set in bf16 only
  flashattn check --seqlen 1000 --causal            # one configuration (B=2 H=8 D=64), every listed dtype
  flashattn check --seqlen-q 100 --seqlen-k 300 --heads 8 --heads-kv 2 --window-left 32 --softcap 30
  flashattn check --device cuda --forward-only

Bounds (the test suite's): f32 relative error <= 1e-5; f16/bf16 within 2x the error of the
standard attention computed in the same precision. Gradient errors are relative to the magnitude
of the terms each gradient sums. Exit status 1 when any configuration is out of bounds.";

/// Exact attention by FlashAttention: check it, benchmark it, run it on tensor files.
#[derive(Parser, Debug)]
#[command(name = "flashattn", version, after_help = EXAMPLES)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Check configurations against the f64 oracle, forward and backward: one PASS/FAIL line each.
    #[command(after_help = CHECK_EXAMPLES)]
    Check(CheckArgs),
}

/// Parses `cpu`, `cuda` or `cuda:N`.
fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => Ok(Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("unknown device `{s}` (expected cpu, cuda or cuda:N)")),
    }
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

/// Options of the mask and score modifiers, shared by `check` and `run`.
#[derive(Args, Debug, Clone, Default)]
pub struct MaskArgs {
    /// Causal attention (aligned bottom-right when seqlen_q != seqlen_k).
    #[arg(long)]
    pub causal: bool,
    /// Sliding window: keys a query sees before its diagonal (unbounded if not given).
    #[arg(long, value_name = "L")]
    pub window_left: Option<usize>,
    /// Sliding window: keys a query sees after its diagonal (0 with --causal).
    #[arg(long, value_name = "R", conflicts_with = "causal")]
    pub window_right: Option<usize>,
    /// Soft cap of the scores: cap·tanh(s/cap).
    #[arg(long, value_name = "C")]
    pub softcap: Option<f32>,
    /// Score scale (default 1/sqrt(head_dim)).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f32>,
}

impl MaskArgs {
    /// The window these options describe.
    pub fn window(&self) -> Window {
        let right = if self.causal {
            Some(0)
        } else {
            self.window_right
        };
        Window::new(self.window_left, right)
    }

    /// True when any option was given.
    pub fn any(&self) -> bool {
        self.causal
            || self.window_left.is_some()
            || self.window_right.is_some()
            || self.softcap.is_some()
            || self.scale.is_some()
    }
}

/// How q, k, v are stored in memory.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// [batch, seqlen, heads, head_dim] (packed: [total, heads, head_dim]).
    #[default]
    Bnhd,
    /// [batch, heads, seqlen, head_dim] (packed: [heads, total, head_dim]).
    Bhnd,
}

/// Options of `flashattn check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Where flashattn runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// dtypes to check, comma separated (default: all three; f32 for a single configuration).
    #[arg(long, value_delimiter = ',', value_parser = parse_dtype)]
    pub dtype: Vec<DType>,
    /// Check one configuration of this batch size instead of the default set.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Query heads of the single configuration.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (a divisor of --heads: GQA/MQA).
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Sequence length of queries and keys.
    #[arg(long, value_name = "N")]
    pub seqlen: Option<usize>,
    /// Query sequence length (overrides --seqlen).
    #[arg(long, value_name = "N")]
    pub seqlen_q: Option<usize>,
    /// Key sequence length (overrides --seqlen).
    #[arg(long, value_name = "N")]
    pub seqlen_k: Option<usize>,
    /// Head dimension of q and k (1..=512).
    #[arg(long, value_name = "D")]
    pub head_dim: Option<usize>,
    /// Head dimension of v (default: --head-dim).
    #[arg(long, value_name = "D")]
    pub head_dim_v: Option<usize>,
    /// Random ALiBi slopes per head.
    #[arg(long)]
    pub alibi: bool,
    /// A random additive bias of shape [batch, heads, seqlen_q, seqlen_k].
    #[arg(long)]
    pub bias: bool,
    /// Memory layout of q, k, v.
    #[arg(long, value_enum, default_value_t)]
    pub layout: Layout,
    /// Mask and score options.
    #[command(flatten)]
    pub mask: MaskArgs,
    /// Skip the backward checks.
    #[arg(long)]
    pub forward_only: bool,
    /// Seed of the random inputs (each configuration adds its index).
    #[arg(long, default_value_t = 2026)]
    pub seed: u64,
}

impl CheckArgs {
    /// True when a single configuration was asked for instead of the default set.
    pub fn is_single(&self) -> bool {
        self.batch.is_some()
            || self.heads.is_some()
            || self.heads_kv.is_some()
            || self.seqlen.is_some()
            || self.seqlen_q.is_some()
            || self.seqlen_k.is_some()
            || self.head_dim.is_some()
            || self.head_dim_v.is_some()
            || self.alibi
            || self.bias
            || self.layout != Layout::Bnhd
            || self.mask.any()
    }
}
