//! Shared helpers of the integration tests: seeded random inputs in either memory layout, the
//! case description every grid uses, and error measures against the f64 oracle.
#![allow(dead_code)]

use flashattn::reference::{oracle, standard};
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
    /// Per-sequence (query, key) lengths of a packed batch; `None`: padded `[batch, n, h, d]`.
    pub varlen: Option<Vec<(usize, usize)>>,
    pub scale: Option<f32>,
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
            varlen: None,
            scale: None,
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
    pub fn varlen(mut self, lens: &[(usize, usize)]) -> Self {
        self.varlen = Some(lens.to_vec());
        self
    }
    pub fn scale(mut self, s: f32) -> Self {
        self.scale = Some(s);
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

fn out_shape(q: &[usize], dv: usize) -> Vec<usize> {
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

/// `‖a − b‖ / ‖b‖`; 0 when both are zero, infinite when only `b` is.
pub fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if num == 0.0 {
        0.0
    } else if den == 0.0 {
        f64::INFINITY
    } else {
        (num / den).sqrt()
    }
}

/// The largest `|a − b| / max(1, |b|)` over entries where the reference is finite; panics where
/// one is −∞ and the other is not (rows that see no key must be −∞ exactly) or on NaN.
pub fn lse_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lse lengths differ");
    let mut worst = 0f64;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(!x.is_nan(), "lse[{i}] is NaN");
        if y == f64::NEG_INFINITY || x == f64::NEG_INFINITY {
            assert_eq!(x, y, "lse[{i}]: got {x}, oracle {y}");
        } else {
            worst = worst.max((x - y).abs() / y.abs().max(1.0));
        }
    }
    worst
}

/// Errors of one forward run against the oracle.
#[derive(Clone, Copy, Debug)]
pub struct ForwardErrors {
    /// ‖out − oracle‖ / ‖oracle‖ of flashattn.
    pub out: f64,
    /// The same measure for the standard attention in the same precision.
    pub standard: f64,
    /// Largest |lse − oracle| / max(1, |oracle|) of flashattn.
    pub lse: f64,
    /// The same measure for the standard attention.
    pub standard_lse: f64,
}

/// Runs flashattn's and the standard attention's forward on `x` and measures both against the
/// oracle. Checks that the outputs have no NaN.
pub fn forward_errors(x: &Inputs) -> ForwardErrors {
    let f = flashattn::forward(&x.q, &x.k, &x.v, &x.p).expect("forward");
    let s = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("standard forward");
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle forward");
    assert_eq!(
        f.out.shape(),
        out_shape(x.q.shape(), x.v.shape()[x.v.rank() - 1])
    );
    assert_eq!(f.out.dtype(), x.q.dtype());
    let out = f.out.to_f64_vec().unwrap();
    assert!(out.iter().all(|x| x.is_finite()), "non-finite output");
    ForwardErrors {
        out: rel(&out, &o.out),
        standard: rel(&s.out.to_f64_vec().unwrap(), &o.out),
        lse: lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse),
        standard_lse: lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse),
    }
}

/// The absolute floor added to "2× the standard attention's error" so that a standard error of
/// exactly 0 (an output every method gets exactly, e.g. a single visible key) does not demand an
/// error below 0. It is far below any half-precision rounding error (2⁻¹¹ ≈ 4.9e-4).
pub const HALF_FLOOR: f64 = 1e-6;

/// f32 tolerance of the relative output error.
pub const F32_TOL: f64 = 1e-5;

/// The bound flashattn's relative error must meet for `dtype`, given the standard attention's.
pub fn tolerance(dtype: DType, standard_err: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => 2.0 * standard_err + HALF_FLOOR,
    }
}

/// Worst errors seen per dtype, for the summary line of a test.
#[derive(Default)]
pub struct Worst {
    entries: Vec<(DType, f64, f64, f64)>,
}

impl Worst {
    fn add(&mut self, dtype: DType, out: f64, ratio: f64, lse: f64) {
        match self.entries.iter_mut().find(|e| e.0 == dtype) {
            Some(e) => {
                e.1 = e.1.max(out);
                e.2 = e.2.max(ratio);
                e.3 = e.3.max(lse);
            }
            None => self.entries.push((dtype, out, ratio, lse)),
        }
    }

    /// Prints one line per dtype.
    pub fn print(&self, test: &str) {
        for (t, out, ratio, lse) in &self.entries {
            println!(
                "{test}: worst {t}: out rel {out:.2e}, out / standard {ratio:.2}, lse {lse:.2e}"
            );
        }
    }
}

/// Largest acceptable `|lse − oracle| / max(1, |oracle|)`. The log-sum-exp is computed in f32
/// from the inputs for every dtype, so f32 rounding sets the bound; for f16/bf16 the
/// same-precision rule (2× the standard attention) is allowed when it is the looser one.
pub fn lse_tolerance(dtype: DType, standard_lse: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => F32_TOL.max(2.0 * standard_lse),
    }
}

/// Runs every case's forward against the oracle (seed `seed0 + index`, printed), prints a line
/// per case and the worst errors per dtype, and fails listing every case out of tolerance.
pub fn check_forward_cases(test: &str, seed0: u64, cases: &[Case]) {
    let mut failures = Vec::new();
    let mut worst = Worst::default();
    for (n, case) in cases.iter().enumerate() {
        let seed = seed0 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let e = forward_errors(&x);
        let tol = tolerance(case.dtype, e.standard);
        let lse_tol = lse_tolerance(case.dtype, e.standard_lse);
        let ok = e.out <= tol && e.lse <= lse_tol;
        println!(
            "[{}] {test} #{n} seed {seed} {}: out rel {:.2e} (standard {:.2e}, bound {:.2e}), lse {:.2e} (bound {:.2e})",
            if ok { "PASS" } else { "FAIL" },
            describe(case),
            e.out,
            e.standard,
            tol,
            e.lse,
            lse_tol
        );
        let ratio = if e.standard > 0.0 {
            e.out / e.standard
        } else {
            0.0
        };
        worst.add(case.dtype, e.out, ratio, e.lse);
        if !ok {
            failures.push(format!("#{n} seed {seed} {}: {e:?}", describe(case)));
        }
    }
    worst.print(test);
    assert!(
        failures.is_empty(),
        "{test}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
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
    if let Some(sc) = c.scale {
        s += &format!(" scale {sc}");
    }
    s
}
