//! The command line, declared with clap's derive API.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use flashattn::{AttentionParams, DType, Device, Window};

use super::{CliResult, fail};

const EXAMPLES: &str = "\
Examples:
  flashattn check                                  # the default set, forward and backward, in a few seconds
  flashattn check --bench                          # the same, then a short benchmark
  flashattn check --seqlen 1000 --causal --dtype f32,bf16
  flashattn bench --seqlens 512,1024,2048,4096 --causal both --plot speed.png --json speed.json
  flashattn run --input qkv.safetensors --output out.safetensors --causal

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

const BENCH_EXAMPLES: &str = "\
Examples:
  flashattn bench                                            # f32 forward, N = 512..4096, causal and not
  flashattn bench --seqlens 1024,4096,16384 --causal yes --pass both
  flashattn bench --seqlens 1024,4096 --pass both --no-standard --gemm --rounds 9
  flashattn bench --seqlens 1024 --seqlens-k 512,1024 --no-standard --gemm --rounds 9
  flashattn bench --dtype bf16 --head-dims 64,128 --plot docs/bench.png --json bench.json
  flashattn bench --device cuda --seqlens 1024,8192 --dtype bf16
  flashattn bench --linear --seqlens 256,1024,4096,16384 --causal yes --plot linear.png
  flashattn bench --layer --seqlens 512,2048 --heads 8 --heads-kv 2 --pass both

Times are the fastest of --repeats runs after one untimed run (with --rounds R, the median over
R rounds of that). --gemm times an f32 sgemm just before and just after each flashattn timing and
gives each flashattn rate as a percentage of the mean of the two (% GEMM: the median over the
rounds of the ratio). Extra memory is the peak of heap
bytes allocated during the call beyond its inputs and outputs (a counting allocator). The
standard attention is skipped, with a note, where its score matrix would not fit in the memory
available (MemAvailable in /proc/meminfo).
On a GPU (--device cuda, forward only): rates in TFLOP/s, each time the fastest of --repeats
batches of back-to-back calls; the standard attention is the library's cuBLAS baseline, its
device memory the planned allocation (marked *), flashattn's device memory is not measured; the
kernel variants used are printed after the table by name (fwd_wgmma_: the Hopper kernel, on
sm_90a; fwd_mma_: tensor cores; fwd_general_: CUDA cores) with their compile and cached-load
times.
--linear adds linear attention (elu+1) on the same q, k, v and mask, and after the table, per
curve, the sequence length where it overtakes flashattn (between the two lengths measured around
the crossing, with a log-log estimate); with --device cuda, the GPU's linear attention.
--layer times the fused layer (layer_forward; with --pass backward, layer_forward then
layer_backward) beside the same steps as separate calls (the projection GEMM, rotated copies of Q
and K, attention, the output GEMM; the backward's dq, dk, dv rotated back into new tensors and
concatenated), with the rotary embedding (half) over the whole head and both biases, on the CPU
or, with --device cuda, every step on the GPU. Peak = the peak of heap bytes (on a GPU, of device
memory in its memory pool) during the call beyond what it returns (y; the gradients). With
--rounds R, each figure is the median over R rounds.";

const RUN_EXAMPLES: &str = "\
Examples:
  flashattn run --input qkv.safetensors --output out.safetensors
  flashattn run --input qkv.npz --output out.npz --causal --window-left 256
  flashattn run --input packed.safetensors --output grads.safetensors --layout bhnd --softcap 30
  flashattn run --input block.safetensors --output out.safetensors --causal --diagonal -256

Input tensors (by name): q, k, v [batch, seqlen, heads, head_dim] (f32, f16 or bf16; with
--layout bhnd stored as [batch, heads, seqlen, head_dim]); optional alibi_slopes [heads] or
[batch, heads] (f32); bias, 4 dimensions broadcastable to [batch, heads, seqlen_q, seqlen_k];
rel_bias [heads, 2L - 1] (f32), a relative-position table: query i and key j add
rel_bias[h, clamp(j - (i + seqlen_k - seqlen_q), -(L-1), L-1) + L - 1] to their score
(i + D for i + seqlen_k - seqlen_q with --diagonal D); cu_seqlens_q and cu_seqlens_k (int32)
for packed [total, heads, head_dim] input; dout (shaped like q): when present the backward
runs too. An input holding NaN or inf is named in a warning.
Output tensors: out (shape and dtype of q), lse [batch, heads, seqlen_q] f32 ([heads, total_q]
with varlen); with dout: dq, dk, dv (and dbias with a bias, drel_bias with rel_bias).
Files: .safetensors (every dtype) or .npz (numpy's savez/savez_compressed; f32, f16 and int32:
numpy has no bfloat16). A .npy file holds a single array, so it cannot carry q, k and v.
The output is written to a temporary file beside OUT and renamed, so OUT is never half-written;
a run stopped by Ctrl-C, SIGTERM or SIGHUP removes the temporary file.

The fused layer (with tensor x instead of q, k, v; --heads needed):
  flashattn run --input layer.safetensors --output y.safetensors --heads 8 --heads-kv 2 --rope half
Inputs: x [batch, seqlen, model_dim] ([total, model_dim] with cu_seqlens), w_qkv [model_dim,
(heads + 2·heads_kv)·head_dim] (columns: q heads, k heads, v heads), optional b_qkv, w_o
[heads·head_dim, model_dim], optional b_o [model_dim], optional positions [batch, seqlen] int32
(rotary positions; default 0..seqlen-1), dy (like y) for the backward; alibi_slopes, bias,
rel_bias and cu_seqlens as above. Outputs: y [batch, seqlen, model_dim]; with dy: dx, dw_qkv,
db_qkv, dw_o, db_o (and dbias with a bias, drel_bias with rel_bias).";

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
    /// Time flashattn and the standard (materializing) attention side by side.
    #[command(after_help = BENCH_EXAMPLES)]
    Bench(BenchArgs),
    /// Run attention on tensors read from a .safetensors or .npz file and write the results.
    #[command(after_help = RUN_EXAMPLES)]
    Run(RunArgs),
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

fn parse_tighten(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        _ => Err(format!("expected a number >= 1, got `{s}`")),
    }
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

/// Options of the mask and score modifiers, shared by `check` and `run`.
#[derive(Args, Debug, Clone, Default)]
pub struct MaskArgs {
    /// Causal attention (aligned bottom-right when seqlen_q != seqlen_k, or by --diagonal).
    #[arg(long)]
    pub causal: bool,
    /// Sliding window: keys a query sees before its diagonal (unbounded if not given).
    #[arg(long, value_name = "L")]
    pub window_left: Option<usize>,
    /// Sliding window: keys a query sees after its diagonal (--causal means 0).
    #[arg(long, value_name = "R")]
    pub window_right: Option<usize>,
    /// Soft cap of the scores: cap·tanh(s/cap).
    #[arg(long, value_name = "C", allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Score scale (default 1/sqrt(head_dim)).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Query i's diagonal at key i + D (default seqlen_k - seqlen_q); the window, ALiBi and
    /// rel_bias measure from it.
    #[arg(long, value_name = "D", allow_negative_numbers = true)]
    pub diagonal: Option<i64>,
}

impl MaskArgs {
    /// The window these options describe. `--causal` is the right side 0, so `--window-right
    /// 0` beside it says the same thing; any other right side contradicts it.
    pub fn window(&self) -> CliResult<Window> {
        let right = match (self.causal, self.window_right) {
            (true, Some(r)) if r > 0 => {
                return Err(fail(format!(
                    "--window-right {r}: --causal already sets the right side of the window to \
                     0; drop one of the two"
                )));
            }
            (true, _) => Some(0),
            (false, r) => r,
        };
        Ok(Window::new(self.window_left, right))
    }

    /// Parameters with these options and nothing else.
    pub fn params(&self) -> CliResult<AttentionParams> {
        Ok(AttentionParams {
            scale: self.scale,
            window: self.window()?,
            softcap: self.softcap,
            diagonal: self.diagonal,
            ..Default::default()
        })
    }

    /// True when any option was given.
    pub fn any(&self) -> bool {
        self.causal
            || self.window_left.is_some()
            || self.window_right.is_some()
            || self.softcap.is_some()
            || self.scale.is_some()
            || self.diagonal.is_some()
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

impl Layout {
    /// `bnhd` or `bhnd`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Bnhd => "bnhd",
            Layout::Bhnd => "bhnd",
        }
    }
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
    /// A random relative-position table [heads, 2L - 1] (L >= 1).
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u64).range(1..))]
    pub rel_bias: Option<u64>,
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
    /// Divide every bound by this factor (>= 1) to see how much margin the results have.
    #[arg(long, value_name = "FACTOR", default_value_t = 1.0, value_parser = parse_tighten)]
    pub tighten: f64,
    /// After the checks, run a short benchmark (f32 forward, N = 512..2048, causal and not).
    #[arg(long)]
    pub bench: bool,
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
            || self.rel_bias.is_some()
            || self.layout != Layout::Bnhd
            || self.mask.any()
    }
}

/// Which masks `bench` sweeps.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalChoice {
    /// Full attention only.
    No,
    /// Causal only.
    Yes,
    /// Both.
    Both,
}

/// Which passes `bench` times.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassChoice {
    /// The forward pass.
    Forward,
    /// The backward pass (the forward that produces its inputs is not timed).
    Backward,
    /// Both.
    Both,
}

/// Options of `flashattn bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Where flashattn runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Sequence lengths, comma separated: of the queries, and of the keys too unless
    /// --seqlens-k is given.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096")]
    pub seqlens: Vec<usize>,
    /// Key sequence lengths, comma separated, each timed with every query length of --seqlens
    /// (cross-attention, a prompt on a cache; causal masks align bottom-right). Default: keys
    /// = queries.
    #[arg(long, value_delimiter = ',')]
    pub seqlens_k: Option<Vec<usize>>,
    /// Head dimensions, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub head_dims: Vec<usize>,
    /// Causal, full attention, or both.
    #[arg(long, value_enum, default_value = "both")]
    pub causal: CausalChoice,
    /// dtypes, comma separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_dtype, default_value = "f32")]
    pub dtype: Vec<DType>,
    /// Which passes to time.
    #[arg(long, value_enum, default_value = "forward")]
    pub pass: PassChoice,
    /// Memory layouts of q, k, v (and dout), comma separated: bnhd stores [batch, seqlen,
    /// heads, head_dim] (FlashAttention's), bhnd [batch, heads, seqlen, head_dim] (PyTorch
    /// SDPA's); each is timed with every other option.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bnhd")]
    pub layout: Vec<Layout>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Key/value heads (default: --heads).
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Timed runs per measurement (the fastest is reported), after one untimed run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Do not run the standard attention.
    #[arg(long)]
    pub no_standard: bool,
    /// Write a chart of speed and memory against sequence length (.png or .svg).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Write every figure as JSON (one object per configuration and method).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 2026)]
    pub seed: u64,
    /// Time the whole sweep this many times, one configuration after the other in each round;
    /// each figure is then the median over the rounds, so that a slow spell of a shared
    /// machine weighs on every configuration alike.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Also time an f32 sgemm (1024×1024×1024, all threads) just before and just after each
    /// flashattn timing and give each flashattn rate as a percentage of the mean of the two
    /// (CPU only).
    #[arg(long)]
    pub gemm: bool,
    /// Also time linear attention (elu+1, the same q, k, v and mask) and say where it overtakes
    /// flashattn (on the CPU or the GPU, as --device says).
    #[arg(long)]
    pub linear: bool,
    /// Time the fused layer (x·w_qkv + b, rotary embedding, attention, ·w_o + b) beside the same
    /// steps as separate calls, time and peak memory; --pass backward times forward and
    /// backward (on the CPU or the GPU, as --device says).
    #[arg(long)]
    pub layer: bool,
    /// With --layer: the model dim M of x [batch, seqlen, M] (default heads·head_dim).
    #[arg(long, value_name = "M")]
    pub model_dim: Option<usize>,
}

impl BenchArgs {
    /// The short benchmark of `check --bench`.
    pub fn short(device: Device) -> Self {
        BenchArgs {
            device,
            seqlens: vec![512, 1024, 2048],
            seqlens_k: None,
            head_dims: vec![64],
            causal: CausalChoice::Both,
            dtype: vec![DType::F32],
            pass: PassChoice::Forward,
            layout: vec![Layout::Bnhd],
            batch: 1,
            heads: 8,
            heads_kv: None,
            repeats: 3,
            no_standard: false,
            plot: None,
            json: None,
            seed: 2026,
            rounds: 1,
            gemm: false,
            linear: false,
            layer: false,
            model_dim: None,
        }
    }

    /// Rejects empty lists and sizes of 0 before anything runs.
    pub fn validate(&self) -> CliResult<()> {
        let positive = |name: &str, v: &[usize]| -> CliResult<()> {
            if v.is_empty() || v.contains(&0) {
                return Err(fail(format!(
                    "--{name}: expected a comma-separated list of sizes >= 1, got {v:?}"
                )));
            }
            Ok(())
        };
        positive("seqlens", &self.seqlens)?;
        if let Some(nk) = &self.seqlens_k {
            positive("seqlens-k", nk)?;
        }
        positive("head-dims", &self.head_dims)?;
        positive("batch", &[self.batch])?;
        positive("heads", &[self.heads])?;
        if let Some(hk) = self.heads_kv {
            positive("heads-kv", &[hk])?;
        }
        if let Some(m) = self.model_dim {
            positive("model-dim", &[m])?;
        }
        if self.layer {
            super::layer_bench::validate(self)?;
        } else if self.model_dim.is_some() {
            return Err(fail("--model-dim is an option of bench --layer"));
        }
        if self.gemm && self.device != Device::Cpu {
            return Err(fail(format!(
                "--gemm: the sgemm ceiling is timed on the CPU, for --device cpu; got --device {}",
                self.device
            )));
        }
        Ok(())
    }
}

/// Options of `flashattn run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Input tensors: .safetensors or .npz.
    #[arg(long, value_name = "IN")]
    pub input: PathBuf,
    /// Output file: .safetensors or .npz (written atomically).
    #[arg(long, value_name = "OUT")]
    pub output: PathBuf,
    /// Mask and score options.
    #[command(flatten)]
    pub mask: MaskArgs,
    /// Where to compute: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// How q, k, v (and dout, out, gradients) are stored in the files.
    #[arg(long, value_enum, default_value_t)]
    pub layout: Layout,
    /// The fused layer's options (with tensor `x`).
    #[command(flatten)]
    pub layer: LayerArgs,
    /// Which attention: softmax (flash) or linear.
    #[command(flatten)]
    pub linear: LinearArgs,
}

/// The attention `flashattn run` computes.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KindArg {
    /// Exact softmax attention (FlashAttention).
    #[default]
    Flash,
    /// Linear attention: φ(q)·Σφ(k)vᵀ / (φ(q)·Σφ(k) + eps).
    Linear,
}

/// Linear attention's feature map φ.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FeatureMapArg {
    /// elu(x) + 1.
    #[default]
    Elu1,
    /// max(x, 0).
    Relu,
}

/// Options of `flashattn run` for linear attention.
#[derive(Args, Debug, Clone, Default)]
pub struct LinearArgs {
    /// flash (softmax attention) or linear (q, k, v, dout in; out, dq, dk, dv out; no lse).
    #[arg(long, value_enum, default_value_t)]
    pub kind: KindArg,
    /// Linear attention: the feature map (default elu1).
    #[arg(long, value_enum)]
    pub feature_map: Option<FeatureMapArg>,
    /// Linear attention: added to each denominator (default 1e-6; finite and > 0).
    #[arg(long, value_name = "E")]
    pub linear_eps: Option<f64>,
}

impl LinearArgs {
    /// The first linear-attention option given, as the command line spells it.
    pub fn first_given(&self) -> Option<&'static str> {
        [
            (self.feature_map.is_some(), "--feature-map"),
            (self.linear_eps.is_some(), "--linear-eps"),
        ]
        .into_iter()
        .find_map(|(given, name)| given.then_some(name))
    }
}

/// The rotary embedding conventions.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeArg {
    /// Half-split (GPT-NeoX): dim p pairs with p + R/2.
    Half,
    /// Interleaved (GPT-J): dim 2p pairs with 2p + 1.
    Interleaved,
}

/// Options of `flashattn run` for the fused layer (input tensor `x`).
#[derive(Args, Debug, Clone, Default)]
pub struct LayerArgs {
    /// Fused layer: query heads (head_dim = w_qkv's columns / (heads + 2·heads_kv)).
    #[arg(long, value_name = "H")]
    pub heads: Option<usize>,
    /// Fused layer: key/value heads (default: --heads).
    #[arg(long, value_name = "HK")]
    pub heads_kv: Option<usize>,
    /// Fused layer: rotary embedding of Q and K (none if not given).
    #[arg(long, value_enum)]
    pub rope: Option<RopeArg>,
    /// Fused layer: rotary frequency base (default 10000): pair p at position t turns by
    /// t·B^(−2p/R).
    #[arg(long, value_name = "B")]
    pub rope_base: Option<f64>,
    /// Fused layer: rotary dim R, even, at most head_dim (default head_dim).
    #[arg(long, value_name = "R")]
    pub rope_dim: Option<usize>,
}

impl LayerArgs {
    /// The first option given, as the command line spells it.
    pub fn first_given(&self) -> Option<&'static str> {
        [
            (self.heads.is_some(), "--heads"),
            (self.heads_kv.is_some(), "--heads-kv"),
            (self.rope.is_some(), "--rope"),
            (self.rope_base.is_some(), "--rope-base"),
            (self.rope_dim.is_some(), "--rope-dim"),
        ]
        .into_iter()
        .find_map(|(given, name)| given.then_some(name))
    }
}
