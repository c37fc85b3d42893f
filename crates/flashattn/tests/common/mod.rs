//! Shared helpers of the integration tests: seeded random inputs in either memory layout, the
//! case description every grid uses, and error measures against the f64 oracle.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod gpu;
pub mod grid;
pub mod layer;
pub mod linear;
mod measure;

#[allow(unused_imports)] // not every test binary uses the error measures
pub use measure::*;

use flashattn::{AttentionParams, DType, Tensor, Window};
use rand::{RngExt, SeedableRng, rngs::StdRng};

/// A seeded generator; the seed is printed so a failure can be replayed.
pub fn rng(seed: u64) -> StdRng {
    println!("seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// Uniform values of unit variance (never zeros as a pattern).
pub fn values(rng: &mut StdRng, n: usize, amplitude: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-amplitude..amplitude))
        .collect()
}

/// How q/k/v are laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, seqlen, heads, dim]` contiguous (packed: `[tokens, heads, dim]`).
    Bnhd,
    /// `[batch, heads, seqlen, dim]` contiguous, passed as its `transpose(1, 2)` view (packed:
    /// `[heads, tokens, dim]` passed as `transpose(0, 1)`).
    Bhnd,
}

/// A random tensor of logical shape `shape` (`[.., seqlen, heads, dim]`) in `dtype` and `layout`.
pub fn tensor(rng: &mut StdRng, shape: &[usize], dtype: DType, layout: Layout) -> Tensor {
    let n = shape.iter().product();
    let data = values(rng, n, 1.7);
    let r = shape.len();
    match layout {
        Layout::Bnhd => Tensor::from_vec(data, shape)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
        Layout::Bhnd => {
            let mut stored = shape.to_vec();
            stored.swap(r - 3, r - 2);
            Tensor::from_vec(data, &stored)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .transpose(r - 3, r - 2)
                .unwrap()
        }
    }
}

/// ALiBi slopes per head or per (batch, head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alibi {
    None,
    PerHead,
    PerBatchHead,
}

/// One configuration of the grid.
#[derive(Clone, Debug)]
pub struct Case {
    pub batch: usize,
    pub nq: usize,
    pub nk: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub d: usize,
    pub dv: usize,
    pub dtype: DType,
    pub layout: Layout,
    pub window: Window,
    pub alibi: Alibi,
    pub softcap: Option<f32>,
    /// Which bias dimensions are full (the others are broadcast, size 1); `None`: no bias.
    pub bias: Option<[bool; 4]>,
    /// `L` of a relative-position table `[heads, 2L − 1]`; `None`: no table.
    pub rel_bias: Option<usize>,
    /// Per-sequence (query, key) lengths of a packed batch; `None`: padded `[batch, n, h, d]`.
    pub varlen: Option<Vec<(usize, usize)>>,
    pub scale: Option<f32>,
    /// Query `i`'s diagonal at key `i + d`; `None`: bottom-right.
    pub diagonal: Option<i64>,
}

impl Case {
    /// A plain case: one batch of `n × n`, one head, f32.
    pub fn new(nq: usize, nk: usize, d: usize) -> Self {
        Case {
            batch: 1,
            nq,
            nk,
            heads: 1,
            heads_kv: 1,
            d,
            dv: d,
            dtype: DType::F32,
            layout: Layout::Bnhd,
            window: Window::FULL,
            alibi: Alibi::None,
            softcap: None,
            bias: None,
            rel_bias: None,
            varlen: None,
            scale: None,
            diagonal: None,
        }
    }

    pub fn batch(mut self, b: usize) -> Self {
        self.batch = b;
        self
    }
    pub fn heads(mut self, h: usize, hk: usize) -> Self {
        self.heads = h;
        self.heads_kv = hk;
        self
    }
    pub fn dv(mut self, dv: usize) -> Self {
        self.dv = dv;
        self
    }
    pub fn dtype(mut self, t: DType) -> Self {
        self.dtype = t;
        self
    }
    pub fn layout(mut self, l: Layout) -> Self {
        self.layout = l;
        self
    }
    pub fn causal(mut self) -> Self {
        self.window = Window::CAUSAL;
        self
    }
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Window::new(left, right);
        self
    }
    pub fn alibi(mut self, a: Alibi) -> Self {
        self.alibi = a;
        self
    }
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    pub fn bias(mut self, full: [bool; 4]) -> Self {
        self.bias = Some(full);
        self
    }
    pub fn rel_bias(mut self, l: usize) -> Self {
        self.rel_bias = Some(l);
        self
    }
    pub fn varlen(mut self, lens: &[(usize, usize)]) -> Self {
        self.varlen = Some(lens.to_vec());
        self
    }
    pub fn scale(mut self, s: f32) -> Self {
        self.scale = Some(s);
        self
    }
    pub fn diagonal(mut self, d: i64) -> Self {
        self.diagonal = Some(d);
        self
    }

    /// Random q, k, v and the matching params.
    pub fn inputs(&self, rng: &mut StdRng) -> Inputs {
        let (qs, ks, vs, bq, bk) = match &self.varlen {
            None => (
                vec![self.batch, self.nq, self.heads, self.d],
                vec![self.batch, self.nk, self.heads_kv, self.d],
                vec![self.batch, self.nk, self.heads_kv, self.dv],
                self.nq,
                self.nk,
            ),
            Some(lens) => {
                let tq = lens.iter().map(|l| l.0).sum();
                let tk = lens.iter().map(|l| l.1).sum();
                (
                    vec![tq, self.heads, self.d],
                    vec![tk, self.heads_kv, self.d],
                    vec![tk, self.heads_kv, self.dv],
                    lens.iter().map(|l| l.0).max().unwrap_or(0),
                    lens.iter().map(|l| l.1).max().unwrap_or(0),
                )
            }
        };
        let batch = self.varlen.as_ref().map_or(self.batch, |l| l.len());
        let q = tensor(rng, &qs, self.dtype, self.layout);
        let k = tensor(rng, &ks, self.dtype, self.layout);
        let v = tensor(rng, &vs, self.dtype, self.layout);
        let dout = tensor(rng, &out_shape(&qs, self.dv), self.dtype, self.layout);
        let mut p = AttentionParams {
            scale: self.scale,
            window: self.window,
            softcap: self.softcap,
            diagonal: self.diagonal,
            ..Default::default()
        };
        let mut slopes = |shape: &[usize]| {
            let n = shape.iter().product();
            let s: Vec<f32> = (0..n).map(|_| rng.random_range(0.01f32..0.3)).collect();
            Tensor::from_vec(s, shape).unwrap()
        };
        p.alibi_slopes = match self.alibi {
            Alibi::None => None,
            Alibi::PerHead => Some(slopes(&[self.heads])),
            Alibi::PerBatchHead => Some(slopes(&[batch, self.heads])),
        };
        if let Some(full) = self.bias {
            let dims = [batch, self.heads, bq, bk];
            let shape: Vec<usize> = (0..4).map(|a| if full[a] { dims[a] } else { 1 }).collect();
            let n = shape.iter().product();
            let b = Tensor::from_vec(values(rng, n, 1.0), &shape).unwrap();
            p.bias = Some(b.to_dtype(self.dtype).unwrap());
        }
        if let Some(l) = self.rel_bias {
            let shape = [self.heads, 2 * l - 1];
            let table = values(rng, shape.iter().product(), 1.0);
            p.rel_bias = Some(Tensor::from_vec(table, &shape).unwrap());
        }
        if let Some(lens) = &self.varlen {
            let cu = |f: fn(&(usize, usize)) -> usize| {
                let mut c = vec![0i32];
                for l in lens {
                    c.push(c.last().unwrap() + f(l) as i32);
                }
                c
            };
            p = p.varlen(cu(|l| l.0), cu(|l| l.1));
        }
        Inputs { q, k, v, dout, p }
    }
}

pub fn out_shape(q: &[usize], dv: usize) -> Vec<usize> {
    let mut s = q.to_vec();
    *s.last_mut().unwrap() = dv;
    s
}

/// The tensors and params of one case.
pub struct Inputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub dout: Tensor,
    pub p: AttentionParams,
}

/// A one-line description of a case.
pub fn describe(c: &Case) -> String {
    let mut s = match &c.varlen {
        None => format!("B={} Nq={} Nk={}", c.batch, c.nq, c.nk),
        Some(l) => format!("varlen {l:?}"),
    };
    s += &format!(
        " H={}/{} D={}/{} {} {:?}",
        c.heads, c.heads_kv, c.d, c.dv, c.dtype, c.layout
    );
    if c.window != Window::FULL {
        s += &format!(" window({:?},{:?})", c.window.left, c.window.right);
    }
    if c.alibi != Alibi::None {
        s += &format!(" alibi {:?}", c.alibi);
    }
    if let Some(cap) = c.softcap {
        s += &format!(" softcap {cap}");
    }
    if let Some(b) = c.bias {
        s += &format!(" bias {b:?}");
    }
    if let Some(l) = c.rel_bias {
        s += &format!(" rel_bias L={l}");
    }
    if let Some(sc) = c.scale {
        s += &format!(" scale {sc}");
    }
    if let Some(d) = c.diagonal {
        s += &format!(" diagonal {d}");
    }
    s
}

/// A NaN-filled tensor of `shape` and `dtype` whose rows are padded (three spare elements after
/// each row of the last dimension) and whose first element sits at offset 5 of its buffer, no
/// other tensor sharing the buffer.
pub fn padded(shape: &[usize], dtype: DType) -> Tensor {
    let mut stored = shape.to_vec();
    *stored.last_mut().unwrap() += 3;
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        strides[d] = strides[d + 1] * stored[d + 1];
    }
    let len = 5 + stored.iter().product::<usize>();
    Tensor::full(&[len], dtype, f32::NAN)
        .unwrap()
        .view(shape, &strides, 5)
        .unwrap()
}

/// The bits of every element as f32, in logical order: equal exactly when the values are.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Cases of `forward_into` and `backward_into` tests: GQA with causal, bf16 `[B, H, N, D]` with a
/// window, ALiBi and a full bias, f16 packed variable lengths (empty sequences too) with softcap,
/// a broadcast bias and a relative-position table.
pub fn output_cases() -> Vec<Case> {
    vec![
        Case::new(203, 113, 64).batch(2).heads(4, 2).causal(),
        Case::new(65, 65, 80)
            .heads(2, 1)
            .dtype(DType::BF16)
            .layout(Layout::Bhnd)
            .window(Some(7), Some(3))
            .alibi(Alibi::PerHead)
            .bias([true, true, true, true]),
        Case::new(0, 0, 32)
            .heads(3, 1)
            .dtype(DType::F16)
            .softcap(20.0)
            .bias([false, true, false, true])
            .rel_bias(5)
            .varlen(&[(5, 9), (0, 4), (17, 0), (33, 33)]),
    ]
}
