//! The fused layer's cases, random inputs, and its two yardsticks: the composition of f64
//! oracles (projection, rotation, `oracle::forward`/`backward`, projection) and the plain
//! same-precision implementation (the same steps as separate calls, each intermediate rounded to
//! the dtype), and the check of a layer result against both.

use flashattn::reference::oracle;
use flashattn::{
    AttentionParams, DType, LayerGradients, LayerOutput, LayerParams, LayerWeights, Rope,
    RopeStyle, Tensor, backward, forward,
};
use rand::{RngExt, rngs::StdRng};

use super::{F32_TOL, HALF_FLOOR, rel, values};

/// One configuration of the layer.
#[derive(Clone, Debug)]
pub struct LayerCase {
    pub batch: usize,
    pub seqlen: usize,
    pub model_dim: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub rope: Option<Rope>,
    /// Random positions given (else 0..seqlen).
    pub positions: bool,
    /// b_qkv and b_o given.
    pub biases: bool,
    pub causal: bool,
    pub softcap: Option<f32>,
    /// Packed sequences of these lengths (instead of batch × seqlen).
    pub varlen: Option<Vec<usize>>,
    pub dtype: DType,
}

impl LayerCase {
    pub fn new(batch: usize, seqlen: usize, model_dim: usize, head_dim: usize) -> Self {
        LayerCase {
            batch,
            seqlen,
            model_dim,
            heads: 2,
            heads_kv: 2,
            head_dim,
            rope: None,
            positions: false,
            biases: true,
            causal: false,
            softcap: None,
            varlen: None,
            dtype: DType::F32,
        }
    }
    pub fn heads(mut self, h: usize, hk: usize) -> Self {
        (self.heads, self.heads_kv) = (h, hk);
        self
    }
    pub fn rope(mut self, style: RopeStyle, dim: Option<usize>) -> Self {
        let r = Rope::new(style).base(if dim.is_some() { 500.0 } else { 10000.0 });
        self.rope = Some(match dim {
            Some(d) => r.dim(d),
            None => r,
        });
        self
    }
    pub fn positions(mut self) -> Self {
        self.positions = true;
        self
    }
    pub fn no_biases(mut self) -> Self {
        self.biases = false;
        self
    }
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    pub fn varlen(mut self, lens: &[usize]) -> Self {
        self.varlen = Some(lens.to_vec());
        self
    }
    pub fn dtype(mut self, d: DType) -> Self {
        self.dtype = d;
        self
    }

    pub fn describe(&self) -> String {
        format!(
            "{} B={} N={} M={} H={}/{} D={} rope={:?} pos={} bias={} causal={} softcap={:?} varlen={:?}",
            self.dtype,
            self.batch,
            self.seqlen,
            self.model_dim,
            self.heads,
            self.heads_kv,
            self.head_dim,
            self.rope.map(|r| (r.style, r.dim)),
            self.positions,
            self.biases,
            self.causal,
            self.softcap,
            self.varlen
        )
    }

    fn rows(&self) -> usize {
        self.varlen
            .as_ref()
            .map_or(self.batch * self.seqlen, |l| l.iter().sum())
    }

    fn row_shape(&self, n: usize) -> Vec<usize> {
        match &self.varlen {
            None => vec![self.batch, self.seqlen, n],
            Some(_) => vec![self.rows(), n],
        }
    }

    /// Random x, weights, dy and the params (values never zero as a pattern).
    pub fn inputs(&self, rng: &mut StdRng) -> LayerInputs {
        let (m, d) = (self.model_dim, self.head_dim);
        let cols = (self.heads + 2 * self.heads_kv) * d;
        let hd = self.heads * d;
        let t = |rng: &mut StdRng, shape: &[usize], a: f32| {
            let n = shape.iter().product();
            Tensor::from_vec(values(rng, n, a), shape)
                .unwrap()
                .to_dtype(self.dtype)
                .unwrap()
        };
        let x = t(rng, &self.row_shape(m), 1.7);
        let w = LayerWeights {
            w_qkv: t(rng, &[m, cols], 1.7 / (m as f32).sqrt()),
            b_qkv: self.biases.then(|| t(rng, &[cols], 0.5)),
            w_o: t(rng, &[hd, m], 1.7 / (hd as f32).sqrt()),
            b_o: self.biases.then(|| t(rng, &[m], 0.5)),
        };
        let dy = t(rng, &self.row_shape(m), 1.7);
        let mut attention = AttentionParams {
            softcap: self.softcap,
            ..Default::default()
        };
        if self.causal {
            attention = attention.causal();
        }
        if let Some(lens) = &self.varlen {
            let mut cu = vec![0i32];
            for &l in lens {
                cu.push(cu.last().unwrap() + l as i32);
            }
            attention = attention.varlen(cu.clone(), cu);
        }
        let mut p = LayerParams::new(self.heads, self.heads_kv).attention(attention);
        p.rope = self.rope;
        if self.positions {
            p.positions = Some(
                (0..self.rows())
                    .map(|_| rng.random_range(0..3000))
                    .collect(),
            );
        }
        LayerInputs { x, w, p, dy }
    }
}

/// The tensors and params of one case.
pub struct LayerInputs {
    pub x: Tensor,
    pub w: LayerWeights,
    pub p: LayerParams,
    pub dy: Tensor,
}

/// The layer's output and gradients as f64, in the order [`NAMES`] gives.
pub type Results = Vec<Vec<f64>>;

/// What [`Results`] holds, in order (the biases' gradients only when the case has biases).
pub const NAMES: [&str; 6] = ["y", "dx", "dw_qkv", "dw_o", "db_qkv", "db_o"];

/// flashattn's results as f64.
pub fn results(f: &LayerOutput, g: &LayerGradients) -> Results {
    let mut r = vec![
        f.y.to_f64_vec().unwrap(),
        g.dx.to_f64_vec().unwrap(),
        g.dw_qkv.to_f64_vec().unwrap(),
        g.dw_o.to_f64_vec().unwrap(),
    ];
    for b in [&g.db_qkv, &g.db_o].into_iter().flatten() {
        r.push(b.to_f64_vec().unwrap());
    }
    r
}

/// A row-major matrix of f64 and its shape.
struct Mat {
    v: Vec<f64>,
    rows: usize,
    cols: usize,
}

impl Mat {
    fn of(t: &Tensor, rows: usize) -> Mat {
        let v = t.to_f64_vec().unwrap();
        let cols = v.len() / rows.max(1);
        Mat { v, rows, cols }
    }
    /// `self · other` (or with `ta`/`tb` the transposes).
    fn mul(&self, ta: bool, other: &Mat, tb: bool) -> Mat {
        let (m, k) = if ta {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        };
        let n = if tb { other.rows } else { other.cols };
        let a = |i: usize, l: usize| {
            if ta {
                self.v[l * self.cols + i]
            } else {
                self.v[i * self.cols + l]
            }
        };
        let b = |l: usize, j: usize| {
            if tb {
                other.v[j * other.cols + l]
            } else {
                other.v[l * other.cols + j]
            }
        };
        let mut v = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                v[i * n + j] = (0..k).map(|l| a(i, l) * b(l, j)).sum();
            }
        }
        Mat {
            v,
            rows: m,
            cols: n,
        }
    }
    fn add_row(&mut self, b: &[f64]) {
        for row in self.v.chunks_mut(self.cols) {
            row.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
    }
    fn col_sums(&self) -> Vec<f64> {
        (0..self.cols)
            .map(|j| (0..self.rows).map(|i| self.v[i * self.cols + j]).sum())
            .collect()
    }
    fn round(&mut self, dtype: Option<DType>) {
        round(&mut self.v, dtype);
    }
}

/// Rounds to `dtype` (to nearest) when given.
fn round(v: &mut [f64], dtype: Option<DType>) {
    for x in v {
        *x = match dtype {
            None => *x,
            Some(DType::F32) => *x as f32 as f64,
            Some(DType::F16) => half::f16::from_f64(*x).to_f64(),
            Some(DType::BF16) => half::bf16::from_f64(*x).to_f64(),
        }
    }
}

/// Rotates the q and k heads of packed rows `[rows, cols]` in f64 from the definition: pair p of
/// a head at position t turns by `±t · base^(−2p/R)`.
fn rotate(v: &mut [f64], cols: usize, li: &LayerInputs, d: usize, positions: &[i32], sign: f64) {
    let Some(r) = li.p.rope else { return };
    let dim = r.dim.unwrap_or(d);
    let heads = li.p.heads + li.p.heads_kv;
    for (row, &t) in v.chunks_mut(cols).zip(positions) {
        for h in 0..heads {
            for p in 0..dim / 2 {
                let (a, b) = match r.style {
                    RopeStyle::Half => (p, p + dim / 2),
                    RopeStyle::Interleaved => (2 * p, 2 * p + 1),
                };
                let angle = t as f64 * r.base.powf(-2.0 * p as f64 / dim as f64);
                let (s, c) = (sign * angle).sin_cos();
                let (x, y) = (row[h * d + a], row[h * d + b]);
                row[h * d + a] = x * c - y * s;
                row[h * d + b] = x * s + y * c;
            }
        }
    }
}

/// The composed layer: in f64 with the f64 attention oracle (`plain = None`), or the plain
/// implementation in `plain`'s dtype: every intermediate rounded to it and flashattn's attention
/// called on split, contiguous q, k, v.
pub fn compose(li: &LayerInputs, plain: Option<DType>) -> Results {
    let shape = li.x.shape().to_vec();
    let rows: usize = shape[..shape.len() - 1].iter().product();
    let (h, hk) = (li.p.heads, li.p.heads_kv);
    let cols = li.w.w_qkv.shape()[1];
    let d = cols / (h + 2 * hk);
    let positions: Vec<i32> = match (&li.p.positions, &li.p.attention.varlen) {
        (Some(p), _) => p.clone(),
        (None, None) => (0..rows).map(|r| (r % shape[1]) as i32).collect(),
        (None, Some(v)) => v
            .cu_seqlens_q
            .windows(2)
            .flat_map(|w| 0..w[1] - w[0])
            .collect(),
    };
    let x = Mat::of(&li.x, rows);
    let wq = Mat::of(&li.w.w_qkv, li.w.w_qkv.shape()[0]);
    let wo = Mat::of(&li.w.w_o, li.w.w_o.shape()[0]);
    let dy = Mat::of(&li.dy, rows);
    let mut qkv = x.mul(false, &wq, false);
    if let Some(b) = &li.w.b_qkv {
        qkv.add_row(&b.to_f64_vec().unwrap());
    }
    rotate(&mut qkv.v, cols, li, d, &positions, 1.0);
    qkv.round(plain);
    // Split q, k, v as contiguous tensors (f32 for the oracle, the dtype for the plain one).
    let lead: Vec<usize> = shape[..shape.len() - 1].to_vec();
    let part = |first: usize, n: usize| {
        let mut data = Vec::with_capacity(rows * n * d);
        for row in qkv.v.chunks(cols) {
            data.extend(row[first * d..(first + n) * d].iter().map(|&x| x as f32));
        }
        let mut s = lead.clone();
        s.extend([n, d]);
        let t = Tensor::from_vec(data, &s).unwrap();
        t.to_dtype(plain.unwrap_or(DType::F32)).unwrap()
    };
    let (q, k, v) = (part(0, h), part(h, hk), part(h + hk, hk));
    let ap = &li.p.attention;
    let mut dout = dy.mul(false, &wo, true);
    dout.round(plain);
    let mut dshape = lead.clone();
    dshape.extend([h, d]);
    let dout_t = Tensor::from_vec(
        dout.v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        &dshape,
    )
    .unwrap()
    .to_dtype(plain.unwrap_or(DType::F32))
    .unwrap();
    let (out, dq, dk, dv) = match plain {
        None => {
            let f = oracle::forward(&q, &k, &v, ap).unwrap();
            let g = oracle::backward(&q, &k, &v, &dout_t, ap).unwrap();
            (f.out, g.dq, g.dk, g.dv)
        }
        Some(_) => {
            let f = forward(&q, &k, &v, ap).unwrap();
            let g = backward(&q, &k, &v, &f.out, &f.lse, &dout_t, ap).unwrap();
            let v64 = |t: &Tensor| t.to_f64_vec().unwrap();
            (v64(&f.out), v64(&g.dq), v64(&g.dk), v64(&g.dv))
        }
    };
    let out = Mat {
        v: out,
        rows,
        cols: h * d,
    };
    let mut y = out.mul(false, &wo, false);
    if let Some(b) = &li.w.b_o {
        y.add_row(&b.to_f64_vec().unwrap());
    }
    let dw_o = out.mul(true, &dy, false);
    let mut dqkv = Mat {
        v: Vec::with_capacity(rows * cols),
        rows,
        cols,
    };
    for r in 0..rows {
        dqkv.v.extend(&dq[r * h * d..(r + 1) * h * d]);
        dqkv.v.extend(&dk[r * hk * d..(r + 1) * hk * d]);
        dqkv.v.extend(&dv[r * hk * d..(r + 1) * hk * d]);
    }
    rotate(&mut dqkv.v, cols, li, d, &positions, -1.0);
    dqkv.round(plain);
    let dx = dqkv.mul(false, &wq, true);
    let dw_qkv = x.mul(true, &dqkv, false);
    let mut r = vec![y.v, dx.v, dw_qkv.v, dw_o.v];
    if li.w.b_qkv.is_some() {
        r.push(dqkv.col_sums());
        r.push(dy.col_sums());
    }
    for x in &mut r {
        round(x, plain);
    }
    r
}

/// Checks flashattn's results against the oracle composition: relative error ≤ 1e-5 in f32, in
/// f16/bf16 at most 2× the plain implementation's (plus the floor); returns the worst ratio of
/// error to bound.
pub fn check(case: &LayerCase, li: &LayerInputs, got: &Results) -> f64 {
    let truth = compose(li, None);
    let plain = match case.dtype {
        DType::F32 => None,
        d => Some(compose(li, Some(d))),
    };
    let mut worst = 0f64;
    for (i, (g, t)) in got.iter().zip(&truth).enumerate() {
        assert!(
            g.iter().all(|x| x.is_finite()),
            "{}: {} not finite",
            case.describe(),
            NAMES[i]
        );
        let err = rel(g, t);
        let bound = match &plain {
            None => F32_TOL,
            Some(p) => 2.0 * rel(&p[i], t) + HALF_FLOOR,
        };
        assert!(
            err <= bound,
            "{}: {} error {err:.3e} over the bound {bound:.3e}",
            case.describe(),
            NAMES[i]
        );
        worst = worst.max(err / bound);
    }
    worst
}
