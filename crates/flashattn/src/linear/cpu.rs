//! Linear attention on the CPU: the chunked scan described in [`super`], one (batch, kv head) a
//! task, each product a GEMM of the `gemm` crate. Per chunk of [`CHUNK`] sources, the rows that
//! end in it take the running state's product plus the masked product within the chunk; then the
//! chunk is added to the state. Sums are in f64 (see [`super`] for why f32 would not do).

use rayon::prelude::*;

use super::{FeatureMap, LinearParams, LinearShape};
use crate::cpu::matmul::{Parallelism, matmul};

/// How the GEMMs run: each task is already one of rayon's, so its products run on its thread.
const GEMM_PAR: Parallelism = Parallelism::None;

/// Sources a chunk (and rows a block): large enough for the GEMMs to run near their peak, small
/// enough that the in-chunk product (CHUNK² a block) stays below the state's.
const CHUNK: usize = 64;

/// A row-major matrix: rows `ld` apart, of which the first `width` columns are used.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f64],
    ld: usize,
    width: usize,
}

impl<'a> Mat<'a> {
    fn all(data: &'a [f64], width: usize) -> Self {
        Mat {
            data,
            ld: width,
            width,
        }
    }
}

/// One task's scan: row (r, t) at `r·gr + t` of `x` and `y`, source (s, t') at `s·gs + t'` of
/// `u` and `w`; causal (`Some(off)`) row r sees the sources s < r + 1 + off, else all. Returns
/// `y` `[rows·gr × w.width]`.
fn scan(
    (x, u, w): (Mat<'_>, Mat<'_>, Mat<'_>),
    (rows, gr): (usize, usize),
    (sources, gs): (usize, usize),
    causal: Option<i64>,
) -> Vec<f64> {
    let (du, dw) = (x.width, w.width);
    let mut y = vec![0.0; rows * gr * dw];
    let mut state = vec![0.0; du * dw];
    let chunks = sources.div_ceil(CHUNK);
    // The sources of chunk c: their first vector and count.
    let span = |c: usize| {
        (
            c * CHUNK * gs,
            (sources.min(c * CHUNK + CHUNK) - c * CHUNK) * gs,
        )
    };
    let add_chunk = |state: &mut Vec<f64>, c: usize| {
        let (s0, n) = span(c);
        let ut = (&u.data[s0 * u.ld..], 1, u.ld);
        matmul(
            state,
            (du, dw, n),
            ut,
            (&w.data[s0 * w.ld..], w.ld, 1),
            true,
            GEMM_PAR,
        );
    };
    let Some(off) = causal else {
        (0..chunks).for_each(|c| add_chunk(&mut state, c));
        matmul(
            &mut y,
            (rows * gr, dw, du),
            (x.data, x.ld, 1),
            (&state, dw, 1),
            false,
            GEMM_PAR,
        );
        return y;
    };
    let cc = CHUNK as i64;
    let (lo, hi) = (off.div_euclid(cc), (rows as i64 - 1 + off).div_euclid(cc));
    let mut added = 0;
    let mut scores = vec![0.0; CHUNK * gr * CHUNK * gs];
    for c in lo..=hi {
        // Rows r with r + 1 + off in [cC + 1, cC + C]: they see all of chunks < c and part of c.
        let r0 = (c * cc - off).max(0) as usize;
        let r1 = ((c * cc + cc - off).max(0) as usize).min(rows);
        while (added as i64) < c.min(chunks as i64) {
            add_chunk(&mut state, added);
            added += 1;
        }
        if r0 >= r1 {
            continue;
        }
        let m = (r1 - r0) * gr;
        let xb = (&x.data[r0 * gr * x.ld..], x.ld, 1);
        let yb = &mut y[r0 * gr * dw..];
        matmul(yb, (m, dw, du), xb, (&state, dw, 1), false, GEMM_PAR);
        if c < 0 || c as usize >= chunks {
            continue;
        }
        let (s0, n) = span(c as usize);
        let ut = (&u.data[s0 * u.ld..], 1, u.ld);
        matmul(&mut scores, (m, n, du), xb, ut, false, GEMM_PAR);
        for (i, row) in scores[..m * n].chunks_exact_mut(n).enumerate() {
            // Row position r0 + i / gr sees source positions < its r + 1 + off, from s0 / gs on.
            let seen = (r0 + i / gr) as i64 + 1 + off - c * cc;
            row[(seen.max(0) as usize * gs).min(n)..].fill(0.0);
        }
        let wb = (&w.data[s0 * w.ld..], w.ld, 1);
        matmul(yb, (m, dw, n), (&scores, n, 1), wb, true, GEMM_PAR);
    }
    y
}

/// φ and φ' of the task's rows of a contiguous `[b, n, heads, dim]` input: positions 0..n of
/// batch `b`, heads `h0..h0 + per`, as `[n·per × dim]`; without a map the values themselves (and
/// no φ'), with `ones` a column of ones after each row.
fn features(
    map: Option<FeatureMap>,
    src: &[f32],
    (b, n, heads, dim): (usize, usize, usize, usize),
    (h0, per): (usize, usize),
    ones: bool,
) -> (Vec<f64>, Vec<f64>) {
    let ld = dim + usize::from(ones);
    let (mut phi, mut dphi) = (Vec::with_capacity(n * per * ld), Vec::new());
    for i in 0..n {
        let rows = &src[((b * n + i) * heads + h0) * dim..][..per * dim];
        for row in rows.chunks_exact(dim) {
            match map {
                Some(m) => row.iter().for_each(|&x| {
                    let (f, df) = m.apply(f64::from(x));
                    phi.push(f);
                    dphi.push(df);
                }),
                None => phi.extend(row.iter().map(|&x| f64::from(x))),
            }
            if ones {
                phi.push(1.0);
            }
        }
    }
    (phi, dphi)
}

/// The vectors of `m` (`per` values a position) in reverse order of position.
fn reversed(m: &[f64], per: usize) -> Vec<f64> {
    m.chunks_exact(per).rev().flatten().copied().collect()
}

/// The query heads of kv head `kh`.
fn group(sh: &LinearShape, kh: usize) -> std::ops::Range<usize> {
    let g = sh.h / sh.hk;
    kh * g..(kh + 1) * g
}

/// One task's φ(q), φ'(q), φ(k), φ'(k), [v, 1] and forward scan (numerators, denominators − eps).
struct Task {
    fq: (Vec<f64>, Vec<f64>),
    fk: (Vec<f64>, Vec<f64>),
    v1: Vec<f64>,
    y: Vec<f64>,
}

fn task(sh: &LinearShape, (q, k, v): (&[f32], &[f32], &[f32]), p: &LinearParams, t: usize) -> Task {
    let (b, kh) = (t / sh.hk, t % sh.hk);
    let g = sh.h / sh.hk;
    let map = Some(p.feature_map);
    let fq = features(map, q, (b, sh.nq, sh.h, sh.d), (kh * g, g), false);
    let fk = features(map, k, (b, sh.nk, sh.hk, sh.d), (kh, 1), false);
    let v1 = features(None, v, (b, sh.nk, sh.hk, sh.dv), (kh, 1), true).0;
    let y = scan(
        (
            Mat::all(&fq.0, sh.d),
            Mat::all(&fk.0, sh.d),
            Mat::all(&v1, sh.dv + 1),
        ),
        (sh.nq, g),
        (sh.nk, 1),
        p.causal.then_some(sh.nk as i64 - sh.nq as i64),
    );
    Task { fq, fk, v1, y }
}

/// The output `[b, nq, h, dv]` of contiguous q, k and v.
pub(super) fn forward(
    sh: &LinearShape,
    qkv: (&[f32], &[f32], &[f32]),
    p: &LinearParams,
) -> Vec<f32> {
    let parts: Vec<Vec<f32>> = (0..sh.b * sh.hk)
        .into_par_iter()
        .map(|t| {
            let y = task(sh, qkv, p, t).y;
            let w = sh.dv + 1;
            y.chunks_exact(w)
                .flat_map(|r| {
                    let den = r[sh.dv] + p.eps;
                    r[..sh.dv].iter().map(move |n| (n / den) as f32)
                })
                .collect()
        })
        .collect();
    let mut out = vec![0.0f32; sh.b * sh.nq * sh.h * sh.dv];
    for (t, part) in parts.iter().enumerate() {
        let (b, kh) = (t / sh.hk, t % sh.hk);
        place(&mut out, part, (b, sh.nq, sh.h), group(sh, kh).start, sh.dv);
    }
    out
}

/// Copies a task's rows `part` (`rows` of them, consecutive heads of `width` each) into `dst`
/// `[batch, rows, heads, width]` of batch `b`, from head `head0` on.
fn place(
    dst: &mut [f32],
    part: &[f32],
    (b, rows, heads): (usize, usize, usize),
    head0: usize,
    width: usize,
) {
    if rows == 0 {
        return;
    }
    let len = part.len() / rows;
    for (i, src) in part.chunks_exact(len).enumerate() {
        dst[((b * rows + i) * heads + head0) * width..][..len].copy_from_slice(src);
    }
}

/// dq `[b, nq, h, d]`, dk `[b, nk, hk, d]` and dv `[b, nk, hk, dv]` of contiguous inputs.
pub(super) fn backward(
    sh: &LinearShape,
    qkv: (&[f32], &[f32], &[f32]),
    dout: &[f32],
    p: &LinearParams,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let parts: Vec<_> = (0..sh.b * sh.hk)
        .into_par_iter()
        .map(|t| backward_task(sh, qkv, dout, p, t))
        .collect();
    let mut dq = vec![0.0f32; sh.b * sh.nq * sh.h * sh.d];
    let mut dk = vec![0.0f32; sh.b * sh.nk * sh.hk * sh.d];
    let mut dv = vec![0.0f32; sh.b * sh.nk * sh.hk * sh.dv];
    for (task, (pq, pk, pv)) in parts.into_iter().enumerate() {
        let (b, kh) = (task / sh.hk, task % sh.hk);
        place(&mut dq, &pq, (b, sh.nq, sh.h), group(sh, kh).start, sh.d);
        place(&mut dk, &pk, (b, sh.nk, sh.hk), kh, sh.d);
        place(&mut dv, &pv, (b, sh.nk, sh.hk), kh, sh.dv);
    }
    (dq, dk, dv)
}

/// One (batch, kv head): the scans of [`super`]'s table for dq, dk and dv, the key side on
/// copies reversed in position.
fn backward_task(
    sh: &LinearShape,
    qkv: (&[f32], &[f32], &[f32]),
    dout: &[f32],
    p: &LinearParams,
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (b, kh) = (t / sh.hk, t % sh.hk);
    let g = sh.h / sh.hk;
    let Task { fq, fk, v1, y } = task(sh, qkv, p, t);
    let w = sh.dv + 1;
    // [g, c] per query vector: g = dout / den, c = −g·out.
    let mut gc = Vec::with_capacity(sh.nq * g * w);
    for (r, yr) in y.chunks_exact(w).enumerate() {
        let (i, hg) = (r / g, r % g);
        let den = yr[sh.dv] + p.eps;
        let d = &dout[((b * sh.nq + i) * sh.h + kh * g + hg) * sh.dv..][..sh.dv];
        let mut c = 0.0;
        for (&x, n) in d.iter().zip(&yr[..sh.dv]) {
            let gv = f64::from(x) / den;
            gc.push(gv);
            c -= gv * n / den;
        }
        gc.push(c);
    }
    let by_query = |x, u, wm| {
        let off = sh.nk as i64 - sh.nq as i64;
        scan((x, u, wm), (sh.nq, g), (sh.nk, 1), p.causal.then_some(off))
    };
    let by_key = |x, u, wm| scan((x, u, wm), (sh.nk, 1), (sh.nq, g), p.causal.then_some(0));
    let ydq = by_query(Mat::all(&gc, w), Mat::all(&v1, w), Mat::all(&fk.0, sh.d));
    let (gc_r, v1_r) = (reversed(&gc, g * w), reversed(&v1, w));
    let (fq_r, fk_r) = (reversed(&fq.0, g * sh.d), reversed(&fk.0, sh.d));
    let g_only = Mat {
        data: &gc_r,
        ld: w,
        width: sh.dv,
    };
    let ydk = by_key(
        Mat::all(&v1_r, w),
        Mat::all(&gc_r, w),
        Mat::all(&fq_r, sh.d),
    );
    let ydv = by_key(Mat::all(&fk_r, sh.d), Mat::all(&fq_r, sh.d), g_only);
    let times = |y: &[f64], dphi: &[f64]| -> Vec<f32> {
        y.iter().zip(dphi).map(|(a, b)| (a * b) as f32).collect()
    };
    let dk_r: Vec<f64> = reversed(&ydk, sh.d);
    (
        times(&ydq, &fq.1),
        times(&dk_r, &fk.1),
        reversed(&ydv, sh.dv).iter().map(|&x| x as f32).collect(),
    )
}
