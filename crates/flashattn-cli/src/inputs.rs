//! Configurations of `check` and `bench` and their random inputs.

use flashattn::{AttentionParams, DType, Tensor, Window};
use rand::{RngExt, SeedableRng, rngs::StdRng};

use super::CliResult;
use super::args::Layout;

/// One attention configuration with random inputs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Sequences (padded input).
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// Queries per sequence (padded input).
    pub nq: usize,
    /// Keys per sequence (padded input).
    pub nk: usize,
    /// Head dim of q and k.
    pub d: usize,
    /// Head dim of v.
    pub dv: usize,
    /// Element type.
    pub dtype: DType,
    /// Memory layout of q, k, v, dout.
    pub layout: Layout,
    /// Which keys each query sees.
    pub window: Window,
    /// Soft cap of the scores.
    pub softcap: Option<f32>,
    /// Score scale (`None`: 1/sqrt(d)).
    pub scale: Option<f32>,
    /// Query i's diagonal at key i + d (`None`: nk − nq).
    pub diagonal: Option<i64>,
    /// Random ALiBi slopes per head.
    pub alibi: bool,
    /// A random full-shape bias.
    pub bias: bool,
    /// `L` of a random relative-position table `[heads, 2L − 1]`.
    pub rel_bias: Option<usize>,
    /// Per-sequence (query, key) lengths of a packed batch; `None`: padded.
    pub varlen: Option<Vec<(usize, usize)>>,
}

impl Config {
    /// `batch × n` queries and keys, `heads` heads of dim `d`, f32, no mask.
    pub fn new(batch: usize, heads: usize, n: usize, d: usize) -> Self {
        Config {
            batch,
            heads,
            heads_kv: heads,
            nq: n,
            nk: n,
            d,
            dv: d,
            dtype: DType::F32,
            layout: Layout::Bnhd,
            window: Window::FULL,
            softcap: None,
            scale: None,
            diagonal: None,
            alibi: false,
            bias: false,
            rel_bias: None,
            varlen: None,
        }
    }

    /// Key/value heads (GQA/MQA when fewer than the query heads).
    pub fn kv_heads(mut self, hk: usize) -> Self {
        self.heads_kv = hk;
        self
    }
    /// Query and key sequence lengths.
    pub fn seqlens(mut self, nq: usize, nk: usize) -> Self {
        self.nq = nq;
        self.nk = nk;
        self
    }
    /// The element type of q, k, v, dout (and the bias).
    pub fn dtype(mut self, t: DType) -> Self {
        self.dtype = t;
        self
    }
    /// Causal attention.
    pub fn causal(mut self) -> Self {
        self.window = Window::CAUSAL;
        self
    }
    /// A sliding window (`None`: unbounded on that side).
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Window::new(left, right);
        self
    }
    /// Soft-cap the scores at `c`.
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    /// Random ALiBi slopes per head.
    pub fn alibi(mut self) -> Self {
        self.alibi = true;
        self
    }
    /// A random bias of the full `[batch, heads, seqlen_q, seqlen_k]` shape.
    pub fn bias(mut self) -> Self {
        self.bias = true;
        self
    }
    /// A random relative-position table of `L` (≥ 1) entries each side of the diagonal.
    pub fn rel_bias(mut self, l: usize) -> Self {
        self.rel_bias = Some(l);
        self
    }
    /// The memory layout of q, k, v and dout.
    pub fn layout(mut self, l: Layout) -> Self {
        self.layout = l;
        self
    }
    /// A packed batch of these (query, key) lengths.
    pub fn varlen(mut self, lens: &[(usize, usize)]) -> Self {
        self.varlen = Some(lens.to_vec());
        self
    }

    /// Whether the mask is causal (the window (∞, 0)).
    pub fn is_causal(&self) -> bool {
        self.window == Window::CAUSAL
    }

    /// The heads as a table shows them: `8`, or `8/2` (query/key-value heads) under GQA/MQA.
    pub fn heads_label(&self) -> String {
        if self.heads == self.heads_kv {
            self.heads.to_string()
        } else {
            format!("{}/{}", self.heads, self.heads_kv)
        }
    }

    /// A short description: `causal B=2 H=8 N=1000 D=64 f32`, with whatever else is set.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.is_causal() {
            parts.push("causal".to_string());
        } else if self.window != Window::FULL {
            let side = |w: Option<usize>| w.map_or("inf".to_string(), |w| w.to_string());
            parts.push(format!(
                "window({},{})",
                side(self.window.left),
                side(self.window.right)
            ));
        }
        match &self.varlen {
            Some(lens) => {
                let l: Vec<String> = lens
                    .iter()
                    .map(|(q, k)| {
                        if q == k {
                            q.to_string()
                        } else {
                            format!("{q}/{k}")
                        }
                    })
                    .collect();
                parts.push(format!("varlen[{}]", l.join(",")));
            }
            None => parts.push(format!("B={}", self.batch)),
        }
        if self.heads_kv == self.heads {
            parts.push(format!("H={}", self.heads));
        } else {
            parts.push(format!("H={}/{}", self.heads, self.heads_kv));
        }
        if self.varlen.is_none() {
            if self.nq == self.nk {
                parts.push(format!("N={}", self.nq));
            } else {
                parts.push(format!("Nq={} Nk={}", self.nq, self.nk));
            }
        }
        if self.d == self.dv {
            parts.push(format!("D={}", self.d));
        } else {
            parts.push(format!("D={}/{}", self.d, self.dv));
        }
        parts.push(self.dtype.to_string());
        if let Some(c) = self.softcap {
            parts.push(format!("softcap={c}"));
        }
        if let Some(s) = self.scale {
            parts.push(format!("scale={s}"));
        }
        if let Some(d) = self.diagonal {
            parts.push(format!("diagonal={d}"));
        }
        if self.alibi {
            parts.push("alibi".into());
        }
        if self.bias {
            parts.push("bias".into());
        }
        if let Some(l) = self.rel_bias {
            parts.push(format!("rel_bias={l}"));
        }
        if self.layout == Layout::Bhnd {
            parts.push("bhnd".into());
        }
        parts.join(" ")
    }

    /// Random q, k, v, dout and the matching params, from `seed`.
    pub fn inputs(&self, seed: u64) -> CliResult<Inputs> {
        let mut rng = StdRng::seed_from_u64(seed);
        let (qs, ks, vs, os, bq, bk, batch) = match &self.varlen {
            None => (
                vec![self.batch, self.nq, self.heads, self.d],
                vec![self.batch, self.nk, self.heads_kv, self.d],
                vec![self.batch, self.nk, self.heads_kv, self.dv],
                vec![self.batch, self.nq, self.heads, self.dv],
                self.nq,
                self.nk,
                self.batch,
            ),
            Some(lens) => {
                let tq = lens.iter().map(|l| l.0).sum();
                let tk = lens.iter().map(|l| l.1).sum();
                (
                    vec![tq, self.heads, self.d],
                    vec![tk, self.heads_kv, self.d],
                    vec![tk, self.heads_kv, self.dv],
                    vec![tq, self.heads, self.dv],
                    lens.iter().map(|l| l.0).max().unwrap_or(0),
                    lens.iter().map(|l| l.1).max().unwrap_or(0),
                    lens.len(),
                )
            }
        };
        let q = random_tensor(&mut rng, &qs, self.dtype, self.layout)?;
        let k = random_tensor(&mut rng, &ks, self.dtype, self.layout)?;
        let v = random_tensor(&mut rng, &vs, self.dtype, self.layout)?;
        let dout = random_tensor(&mut rng, &os, self.dtype, self.layout)?;
        let mut p = AttentionParams {
            scale: self.scale,
            window: self.window,
            softcap: self.softcap,
            diagonal: self.diagonal,
            ..Default::default()
        };
        if self.alibi {
            let s: Vec<f32> = (0..self.heads)
                .map(|_| rng.random_range(0.01f32..0.3))
                .collect();
            p.alibi_slopes = Some(Tensor::from_vec(s, &[self.heads])?);
        }
        if self.bias {
            let shape = [batch, self.heads, bq, bk];
            let b = Tensor::from_vec(uniform(&mut rng, shape.iter().product(), 1.0), &shape)?;
            p.bias = Some(b.to_dtype(self.dtype)?);
        }
        if let Some(l) = self.rel_bias {
            let shape = [self.heads, (2 * l).max(1) - 1];
            let t = uniform(&mut rng, shape.iter().product(), 1.0);
            p.rel_bias = Some(Tensor::from_vec(t, &shape)?);
        }
        if let Some(lens) = &self.varlen {
            let cu = |f: fn(&(usize, usize)) -> usize| {
                let mut c = vec![0i32];
                for l in lens {
                    c.push(c[c.len() - 1] + f(l) as i32);
                }
                c
            };
            p = p.varlen(cu(|l| l.0), cu(|l| l.1));
        }
        Ok(Inputs { q, k, v, dout, p })
    }
}

/// The tensors and params of one configuration.
#[derive(Clone)]
pub struct Inputs {
    /// Queries.
    pub q: Tensor,
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// Upstream gradient, shaped like the output.
    pub dout: Tensor,
    /// Options (ALiBi, bias, varlen, mask...).
    pub p: AttentionParams,
}

/// `n` values uniform in `(-amplitude, amplitude)`.
fn uniform(rng: &mut StdRng, n: usize, amplitude: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-amplitude..amplitude))
        .collect()
}

/// A random tensor of logical shape `[.., seqlen, heads, dim]` stored in `layout`.
fn random_tensor(
    rng: &mut StdRng,
    shape: &[usize],
    dtype: DType,
    layout: Layout,
) -> CliResult<Tensor> {
    let data = uniform(rng, shape.iter().product(), 1.7);
    let r = shape.len();
    Ok(match layout {
        Layout::Bnhd => Tensor::from_vec(data, shape)?.to_dtype(dtype)?,
        Layout::Bhnd => {
            let mut stored = shape.to_vec();
            stored.swap(r - 3, r - 2);
            Tensor::from_vec(data, &stored)?
                .to_dtype(dtype)?
                .transpose(r - 3, r - 2)?
        }
    })
}
