//! The diagonal and window edges the kernels get (`FlashParams::diag`, `window_left/right`): the
//! call's [`crate::AttentionParams::diagonal`], up to 2^40 in magnitude, brought into the 32-bit
//! positions of `kernels/mask.cuh` without changing any result.
//!
//! Write `t = j − (i + d)` for query `i`, key `j` and diagonal `d`: query `i` sees key `j` iff
//! `−left ≤ t ≤ right`, the table reads column `clamp(t, −r, r) + r`, ALiBi subtracts
//! `slope·|t|`. Over every pair of every sequence, `t` lies in `[1 − nq − d, nk − 1 − d]`
//! (`nq`, `nk` the longest sequence's lengths). Then:
//! 1. If a finite edge hides that whole range, no query sees any key: the kernels get
//!    `d' = nk + 1` and `left' = 0`, under which every `t' ≤ −2` is hidden too.
//! 2. An edge the whole range passes is made unbounded (it hides nothing either way).
//! 3. Without ALiBi, `d` is clamped to `[−(nq + max(r, right)), nk + max(r, left)]` (an unbounded
//!    edge counting 0). If `d` is above that, `left` is unbounded (a finite one would hide
//!    everything, case 1), and every `t`, and every `t'` at the clamp, is `≤ −r − 1 < 0`: every
//!    key is seen and reads column 0 under both `d` and `d'`. Below it, symmetrically, every `t`
//!    and `t'` is `≥ r + 1`: all seen, column `2r`. So the scores, and every output and gradient,
//!    are those of `d`. With ALiBi the scores move with `d` (and the LSE with them), so `d` is
//!    kept.
//! 4. The result must keep `nq + nk + |d'| ≤ 2^30`, else the call is an `Error::Unsupported`:
//!    then `|i + d'|` and `|t'|` stay far inside 32 bits (padded rows and keys included), an
//!    unbounded edge (2^30 on the device) never binds, and a finite edge that binds somewhere is
//!    below `|t'|`'s bound, so 32 bits hold it exactly.

use crate::error::{Error, Result};
use crate::problem::Problem;

/// A window edge the kernels treat as unbounded (see the module's point 4).
const UNBOUNDED: i64 = 1 << 30;

/// What the kernels get: the diagonal, `None` for each sequence's own `nk − nq`, and the edges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KernelDiagonal {
    pub diag: Option<i32>,
    pub window_left: i32,
    pub window_right: i32,
}

/// A window edge in 64 bits (`usize` values past `i64::MAX / 4` are as good as unbounded).
fn edge64(w: Option<usize>) -> Option<i64> {
    w.map(|w| w.min(i64::MAX as usize / 4) as i64)
}

/// The kernels' edge: finite ones below 2^30 as they are, the rest 2^30.
fn edge32(w: Option<i64>) -> i32 {
    w.map_or(UNBOUNDED, |w| w.min(UNBOUNDED)) as i32
}

/// The diagonal and edges of `p` for the kernels, or `Error::Unsupported` where 32-bit positions
/// cannot hold them exactly (the module's point 4).
pub(crate) fn kernel_diagonal(p: &Problem) -> Result<KernelDiagonal> {
    let (mut left, mut right) = (edge64(p.window.left), edge64(p.window.right));
    let (nq, nk) = (p.max_nq as i64, p.max_nk as i64);
    // The default diagonal is each sequence's own (the kernels compute it); so is any with no pair.
    if p.is_bottom_right() || nq == 0 || nk == 0 {
        return Ok(KernelDiagonal {
            diag: None,
            window_left: edge32(left),
            window_right: edge32(right),
        });
    }
    let d = p.seqs[0].diag;
    let r = p.rel_bias.as_ref().map_or(0, |t| t.radius as i64);
    let (t_lo, t_hi) = (1 - nq - d, nk - 1 - d);
    let resolved = if left.is_some_and(|l| t_hi < -l) || right.is_some_and(|w| t_lo > w) {
        (nk + 1, Some(0), right)
    } else {
        left = left.filter(|&l| t_lo < -l);
        right = right.filter(|&w| t_hi > w);
        let hi = nk + r.max(left.unwrap_or(0));
        let lo = -(nq + r.max(right.unwrap_or(0)));
        let d = if p.alibi.is_some() {
            d
        } else {
            d.clamp(lo, hi)
        };
        (d, left, right)
    };
    let (d, left, right) = resolved;
    if nq + nk + d.abs() > UNBOUNDED {
        return Err(Error::Unsupported {
            device: "cuda",
            what: format!(
                "diagonal = {} with {nq} queries and {nk} keys (the kernels hold positions \
                 below 2^30: nq + nk + |diagonal| is {}{})",
                p.seqs[0].diag,
                nq + nk + d.abs(),
                if p.alibi.is_some() {
                    "; with ALiBi the diagonal is not clamped"
                } else {
                    " after clamping it where that changes nothing"
                }
            ),
        });
    }
    Ok(KernelDiagonal {
        diag: Some(d as i32),
        window_left: edge32(left),
        window_right: edge32(right),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttentionParams, Tensor};

    /// What the kernels compute for query `i`, key `j` (seen, table column, ALiBi distance), in
    /// 32 bits as `mask.cuh` does, checked to stay below 2^30 in magnitude.
    fn device(
        k: &KernelDiagonal,
        nq: usize,
        nk: usize,
        r: i32,
        i: usize,
        j: usize,
    ) -> (bool, i32, f32) {
        let diag = k.diag.map_or(nk as i64 - nq as i64, i64::from);
        let t = j as i64 - (i as i64 + diag);
        assert!(
            t.abs() < 1 << 30 && (i as i64 + diag).abs() < 1 << 30,
            "{t}"
        );
        let t = t as i32;
        let seen = -k.window_left <= t && t <= k.window_right;
        (seen, t.clamp(-r, r) + r, t.abs() as f32)
    }

    /// The same in 64 bits with the call's own diagonal and window (the CPU's rule).
    fn host(p: &Problem, b: usize, r: i64, i: usize, j: usize) -> (bool, i32, f32) {
        let t = j as i64 - (i as i64 + p.seqs[b].diag);
        let col = (t.clamp(-r, r) + r) as i32;
        (p.mask(b).visible(i, j), col, t.unsigned_abs() as f64 as f32)
    }

    /// One call's mask options: window edges, diagonal, table radius (0: no table), ALiBi.
    #[derive(Clone, Copy, Debug)]
    struct Call {
        left: Option<usize>,
        right: Option<usize>,
        d: i64,
        r: usize,
        alibi: bool,
    }

    /// The problem of `c` over packed sequences of (queries, keys) `lens`, one head of dim 8.
    fn problem(lens: &[(usize, usize)], c: Call) -> Problem {
        let (cq, ck) = lens
            .iter()
            .fold((vec![0], vec![0]), |(mut q, mut k), &(a, b)| {
                q.push(q.last().unwrap() + a as i32);
                k.push(k.last().unwrap() + b as i32);
                (q, k)
            });
        let t = |n: i32| Tensor::from_vec(vec![0f32; n as usize * 8], &[n as usize, 1, 8]).unwrap();
        let mut params = AttentionParams::default()
            .varlen(cq.clone(), ck.clone())
            .diagonal(c.d);
        params.window = crate::Window::new(c.left, c.right);
        if c.r > 0 {
            let w = 2 * c.r + 1;
            params.rel_bias = Some(Tensor::from_vec(vec![0f32; w], &[1, w]).unwrap());
        }
        if c.alibi {
            params.alibi_slopes = Some(Tensor::from_vec(vec![0.5f32], &[1]).unwrap());
        }
        let (q, k) = (t(*cq.last().unwrap()), t(*ck.last().unwrap()));
        Problem::new(&q, &k, &k, &params).unwrap()
    }

    /// Window pairs, diagonals, table radii and ALiBi off/on, with ALiBi only where the diagonal
    /// stays within 32 bits.
    fn calls() -> Vec<Call> {
        let edges = [
            None,
            Some(0),
            Some(1),
            Some(3),
            Some(9),
            Some(40),
            Some(1 << 35),
        ];
        let far = crate::MAX_DIAGONAL;
        let diags = [
            -far,
            -(1 << 31),
            -60,
            -21,
            -20,
            -13,
            -7,
            -1,
            0,
            2,
            5,
            12,
            13,
            30,
            100,
        ];
        let mut all = Vec::new();
        for left in edges {
            for right in edges {
                for d in diags.into_iter().chain([1 << 33, far]) {
                    for r in [0, 1, 4] {
                        let c = Call {
                            left,
                            right,
                            d,
                            r,
                            alibi: false,
                        };
                        all.push(c);
                        if d.abs() < 1000 {
                            all.push(Call { alibi: true, ..c });
                        }
                    }
                }
            }
        }
        all
    }

    /// Every pair of every sequence: the kernels' mask and table column equal the call's, and so
    /// does the ALiBi distance wherever a key is seen (with ALiBi the diagonal is never clamped).
    #[test]
    fn clamped_diagonals_change_nothing() {
        let lens = [(7, 12), (12, 5), (1, 1), (0, 3)];
        for c in calls() {
            let p = problem(&lens, c);
            let k = kernel_diagonal(&p).unwrap();
            if let Some(kd) = k.diag {
                assert!(kd.unsigned_abs() <= 100, "{kd} for {c:?}");
            }
            for (b, s) in p.seqs.iter().enumerate() {
                for i in 0..s.nq {
                    for j in 0..s.nk {
                        let (hs, hc, ha) = host(&p, b, c.r as i64, i, j);
                        let (ds, dc, da) = device(&k, s.nq, s.nk, c.r as i32, i, j);
                        let case = format!("{c:?} seq {b} ({i}, {j})");
                        assert_eq!(hs, ds, "seen: {case}");
                        if hs {
                            assert_eq!(hc, dc, "column: {case}");
                            if c.alibi {
                                assert_eq!(ha, da, "ALiBi distance: {case}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Positions the kernels cannot hold are a typed error naming the diagonal.
    #[test]
    fn diagonals_past_32_bits_are_unsupported() {
        let far = crate::MAX_DIAGONAL;
        let call = |left, right, d, alibi| Call {
            left,
            right,
            d,
            r: 0,
            alibi,
        };
        let p = problem(&[(4, 6)], call(None, Some(0), far, true));
        let err = kernel_diagonal(&p).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { device: "cuda", .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains(&format!("diagonal = {far}")),
            "{err}"
        );
        // A window whose edge binds far from the sequences.
        let p = problem(&[(4, 6)], call(Some(1 << 35), None, 1 << 35, false));
        assert!(kernel_diagonal(&p).is_err());
        // Every sequence's own nk − nq is the kernels' default; another is passed as it is.
        let p = problem(&[(4, 6), (3, 5)], call(None, Some(0), 2, true));
        assert_eq!(kernel_diagonal(&p).unwrap().diag, None);
        let p = problem(&[(4, 6), (7, 2)], call(None, Some(0), 2, true));
        assert_eq!(kernel_diagonal(&p).unwrap().diag, Some(2));
    }
}
