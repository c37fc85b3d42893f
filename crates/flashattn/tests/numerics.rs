//! Numerical edge cases: rows that see no key, NaN inputs, huge logits, and empty problems.

mod common;

use common::{Case, F32_TOL, Layout, forward_errors, rel, rng, tolerance, values};
use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, DType, Simd, Tensor, backward, cpu_simd, forward};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Runs forward and backward and checks that the (packed) query rows listed as `masked` of
/// every head have output exactly 0, lse −∞ and dq exactly 0; every other value must be finite
/// and match the oracle.
fn check_masked_rows(case: &Case, seed: u64, masked: &[usize]) {
    let x = case.inputs(&mut rng(seed));
    let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let (h, dv, d) = (case.heads, case.dv, case.d);
    let out = f.out.to_f64_vec().unwrap();
    let lse = f.lse.to_f64_vec().unwrap();
    assert!(out.iter().all(|v| v.is_finite()), "non-finite output");
    assert!(lse.iter().all(|v| !v.is_nan()), "NaN lse");
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let rows = out.len() / (h * dv);
    // lse is [batch, heads, nq] padded and [heads, total] packed: find entry (row, head).
    let lse_at = |row: usize, head: usize| match &case.varlen {
        None => {
            let (b, i) = (row / case.nq, row % case.nq);
            (b * h + head) * case.nq + i
        }
        Some(_) => head * rows + row,
    };
    for &r in masked {
        for head in 0..h {
            let o_row = &out[(r * h + head) * dv..][..dv];
            assert!(
                o_row.iter().all(|&v| v == 0.0),
                "row {r} head {head}: {o_row:?}"
            );
            assert_eq!(
                lse[lse_at(r, head)],
                f64::NEG_INFINITY,
                "lse row {r} head {head}"
            );
            assert_eq!(o.lse[lse_at(r, head)], f64::NEG_INFINITY, "oracle agrees");
        }
    }
    let e = forward_errors(&x);
    assert!(e.out <= tolerance(case.dtype, e.standard), "{e:?}");

    let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
    let dq = g.dq.to_f64_vec().unwrap();
    for t in [&g.dq, &g.dk, &g.dv] {
        assert!(
            t.to_f64_vec().unwrap().iter().all(|v| v.is_finite()),
            "non-finite gradient"
        );
    }
    for &r in masked {
        for head in 0..h {
            assert!(
                dq[(r * h + head) * d..][..d].iter().all(|&v| v == 0.0),
                "dq row {r}"
            );
        }
    }
    if case.dtype == DType::F32 {
        let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).unwrap();
        for (name, a, b) in [
            ("dq", &g.dq, &og.dq),
            ("dk", &g.dk, &og.dk),
            ("dv", &g.dv, &og.dv),
        ] {
            let e = rel(&a.to_f64_vec().unwrap(), b);
            assert!(e <= F32_TOL, "{name}: {e:e}");
        }
    }
}

#[test]
fn causal_with_more_queries_than_keys() {
    // Bottom-right alignment: the first nq − nk = 6 queries see no key.
    for (n, &dtype) in DTYPES.iter().enumerate() {
        let case = Case::new(13, 7, 16)
            .batch(2)
            .heads(2, 1)
            .causal()
            .dtype(dtype);
        let masked: Vec<usize> = (0..2)
            .flat_map(|b| (0..6).map(move |i| b * 13 + i))
            .collect();
        check_masked_rows(&case, 100 + n as u64, &masked);
    }
}

#[test]
fn window_that_misses_every_key() {
    // diag = nk − nq = −17: query i sees keys i − 17 − 2 ..= i − 17 + 1, so queries 0..=15 see none.
    let case = Case::new(20, 3, 8).window(Some(2), Some(1));
    check_masked_rows(&case, 110, &(0..16).collect::<Vec<_>>());
    // A window of width 1 that is off the key range for the first 40 queries.
    let case = Case::new(50, 10, 32)
        .window(Some(0), Some(0))
        .layout(Layout::Bhnd)
        .dtype(DType::BF16);
    check_masked_rows(&case, 111, &(0..40).collect::<Vec<_>>());
}

#[test]
fn varlen_sequence_without_keys() {
    // Sequence 1 has 5 queries and no keys; sequence 3 has 4 queries and no keys.
    let lens = [(3, 4), (5, 0), (0, 0), (4, 0), (2, 6)];
    for (n, &dtype) in DTYPES.iter().enumerate() {
        let case = Case::new(0, 0, 8).varlen(&lens).heads(2, 2).dtype(dtype);
        check_masked_rows(&case, 120 + n as u64, &[3, 4, 5, 6, 7, 8, 9, 10, 11]);
    }
}

#[test]
fn nk_zero_padded() {
    let case = Case::new(5, 0, 8).batch(2).heads(3, 1);
    check_masked_rows(&case, 130, &(0..10).collect::<Vec<_>>());
}

/// A bias of −∞ on some keys is an additive mask: the rest of the row is unaffected, and a row
/// whose every key has bias −∞ behaves like a fully masked row (output 0, lse −∞).
#[test]
fn minus_infinity_bias_entries() {
    let mut r = rng(140);
    let (nq, nk, d) = (9, 12, 8);
    let q = Tensor::from_vec(values(&mut r, nq * d, 1.7), &[1, nq, 1, d]).unwrap();
    let k = Tensor::from_vec(values(&mut r, nk * d, 1.7), &[1, nk, 1, d]).unwrap();
    let v = Tensor::from_vec(values(&mut r, nk * d, 1.7), &[1, nk, 1, d]).unwrap();
    let mut b = values(&mut r, nq * nk, 1.0);
    for i in 0..nq {
        for j in 0..nk {
            if (i + j) % 3 == 0 || i == 4 {
                b[i * nk + j] = f32::NEG_INFINITY;
            }
        }
    }
    let p = AttentionParams::default().bias(Tensor::from_vec(b, &[1, 1, nq, nk]).unwrap());
    let f = forward(&q, &k, &v, &p).unwrap();
    let o = oracle::forward(&q, &k, &v, &p).unwrap();
    let out = f.out.to_f64_vec().unwrap();
    let e = rel(&out, &o.out);
    println!("−∞ bias entries: rel {e:e}");
    assert!(e <= F32_TOL);
    assert!(
        out[4 * d..5 * d].iter().all(|&x| x == 0.0),
        "row 4 sees no key"
    );
    assert_eq!(f.lse.to_f64_vec().unwrap()[4], f64::NEG_INFINITY);
    let g = backward(&q, &k, &v, &f.out, &f.lse, &f.out, &p).unwrap();
    assert!(g.dq.to_f64_vec().unwrap().iter().all(|x| x.is_finite()));
}

/// Scores of about ±1e4: the online softmax must rescale without overflow.
#[test]
fn huge_logits() {
    for (n, &dtype) in DTYPES.iter().enumerate() {
        for causal in [false, true] {
            // Entries of q and k are uniform in ±1.7 (variance 1), so q·k has standard
            // deviation 4 for d = 16; a scale of 2500 puts the scores at about ±1e4.
            let mut case = Case::new(70, 90, 16).heads(2, 1).scale(2500.0).dtype(dtype);
            if causal {
                case = case.causal();
            }
            let seed = 150 + 2 * n as u64 + causal as u64;
            let x = case.inputs(&mut rng(seed));
            let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            assert!(
                o.lse.iter().any(|l| l.abs() > 5e3),
                "the test must reach huge logits"
            );
            let e = forward_errors(&x);
            println!("huge logits {dtype} causal={causal}: {e:?}");
            // In f32 the scores themselves carry a rounding error of about 1e4 · 2⁻²⁴ · √d, so
            // the output can be off by that much where two keys nearly tie; the standard
            // attention in f32 makes the same error, hence the same-precision rule for all dtypes.
            let tol = match dtype {
                DType::F32 => F32_TOL.max(2.0 * e.standard + common::HALF_FLOOR),
                _ => tolerance(dtype, e.standard),
            };
            assert!(e.out <= tol, "{dtype} causal={causal}: {e:?} > {tol:e}");
            assert!(e.lse <= 1e-5, "lse {e:?}");
            let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
            for t in [&g.dq, &g.dk, &g.dv] {
                assert!(t.to_f64_vec().unwrap().iter().all(|v| v.is_finite()));
            }
        }
    }
}

/// Huge negative and positive logits through a softcap stay finite and correct.
#[test]
fn huge_logits_with_softcap() {
    let case = Case::new(40, 40, 16).scale(2500.0).softcap(30.0).causal();
    let x = case.inputs(&mut rng(160));
    let e = forward_errors(&x);
    println!("huge logits with softcap: {e:?}");
    assert!(e.out <= F32_TOL && e.lse <= F32_TOL, "{e:?}");
}

fn empty_problem(q: &[usize], k: &[usize], p: AttentionParams) {
    let mut r = rng(170);
    let mk = |r: &mut _, s: &[usize]| {
        let n = s.iter().product();
        Tensor::from_vec(values(r, n, 1.0), s).unwrap()
    };
    let (q, k, v) = (mk(&mut r, q), mk(&mut r, k), mk(&mut r, k));
    let f = forward(&q, &k, &v, &p).unwrap();
    assert_eq!(f.out.shape(), q.shape());
    let out = f.out.to_f64_vec().unwrap();
    assert!(out.iter().all(|&x| x == 0.0), "a query with no key gives 0");
    assert!(
        f.lse
            .to_f64_vec()
            .unwrap()
            .iter()
            .all(|&x| x == f64::NEG_INFINITY)
    );
    let s = standard::forward(&q, &k, &v, &p).unwrap();
    assert_eq!(s.out.shape(), q.shape());
    let g = backward(&q, &k, &v, &f.out, &f.lse, &f.out, &p).unwrap();
    assert_eq!(g.dq.shape(), q.shape());
    assert_eq!(g.dk.shape(), k.shape());
    assert_eq!(g.dv.shape(), v.shape());
    for t in [&g.dq, &g.dk, &g.dv] {
        assert!(t.to_f64_vec().unwrap().iter().all(|&x| x == 0.0));
    }
}

#[test]
fn zero_length_problems() {
    let p = AttentionParams::default;
    empty_problem(&[2, 0, 2, 8], &[2, 5, 1, 8], p());
    empty_problem(&[2, 0, 2, 8], &[2, 0, 1, 8], p().causal());
    empty_problem(&[2, 4, 2, 8], &[2, 0, 1, 8], p());
    empty_problem(&[0, 4, 2, 8], &[0, 6, 2, 8], p());
    empty_problem(&[0, 0, 1, 8], &[0, 0, 1, 8], p().causal());
    empty_problem(&[0, 1, 8], &[0, 1, 8], p().varlen(vec![0], vec![0]));
    empty_problem(
        &[0, 1, 8],
        &[0, 1, 8],
        p().varlen(vec![0, 0, 0], vec![0, 0, 0]),
    );
    empty_problem(&[3, 1, 8], &[0, 1, 8], p().varlen(vec![0, 3], vec![0, 0]));
    let bias = Tensor::from_vec(Vec::<f32>::new(), &[2, 1, 0, 5]).unwrap();
    empty_problem(&[2, 0, 2, 8], &[2, 5, 1, 8], p().bias(bias));
}

/// `t` with element `at` (of its contiguous storage) replaced by NaN.
fn with_nan(t: &Tensor, at: usize) -> Tensor {
    let mut x = t.to_f32_vec().unwrap();
    x[at] = f32::NAN;
    Tensor::from_vec(x, t.shape())
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap()
}

/// Which input gets the NaN.
#[derive(Clone, Copy, Debug)]
enum NanIn {
    Q,
    K,
    V,
}

/// One NaN in q, k or v (of head 1, or of key/value head 0, at query or key `pos`): the rows
/// whose scores it reaches get NaN output and NaN log-sum-exp (a NaN in v: NaN in its column
/// of the output, a finite log-sum-exp); rows it does not reach stay finite, rows that see no
/// key stay 0 and −∞; the backward keeps NaN where it went in.
fn check_nan(case: &Case, seed: u64, which: NanIn, pos: usize) {
    let x = case.inputs(&mut rng(seed));
    let (nq, nk, h, hk, d, dv) = (case.nq, case.nk, case.heads, case.heads_kv, case.d, case.dv);
    assert_eq!((case.batch, case.layout), (1, Layout::Bnhd));
    // Which query rows see key j (bottom-right causal alignment, or every key).
    let shift = nk as isize - nq as isize;
    let causal = case.window.right == Some(0);
    let sees = |i: usize, j: usize| !causal || j as isize <= i as isize + shift;
    let sees_any = |i: usize| !causal || i as isize + shift >= 0;
    let (q, k, v) = match which {
        NanIn::Q => (
            with_nan(&x.q, (pos * h + 1) * d + 3),
            x.k.clone(),
            x.v.clone(),
        ),
        NanIn::K => (x.q.clone(), with_nan(&x.k, pos * hk * d + 2), x.v.clone()),
        NanIn::V => (x.q.clone(), x.k.clone(), with_nan(&x.v, pos * hk * dv + 1)),
    };
    let f = forward(&q, &k, &v, &x.p).unwrap();
    let out = f.out.to_f64_vec().unwrap();
    let lse = f.lse.to_f64_vec().unwrap();
    let what = format!("{which:?} at {pos}, {} {:?}", case.dtype, case.window);
    for i in 0..nq {
        for head in 0..h {
            let row = &out[(i * h + head) * dv..][..dv];
            let l = lse[head * nq + i];
            // Query heads of key/value head 0 (the first h / hk).
            let group0 = head < h / hk;
            let reached = match which {
                NanIn::Q => i == pos && head == 1,
                NanIn::K | NanIn::V => group0 && sees(i, pos),
            };
            let at = format!("{what}: row {i} head {head}");
            if !sees_any(i) {
                assert!(row.iter().all(|&o| o == 0.0), "{at}: {row:?}");
                assert_eq!(l, f64::NEG_INFINITY, "{at}");
            } else if !reached {
                // A NaN in V also reaches a query's row through a probability of 0 where the
                // product `P·V` covers its key for other queries (0 · NaN), as in every peer.
                if !matches!(which, NanIn::V) {
                    assert!(row.iter().all(|o| o.is_finite()), "{at}: {row:?}");
                }
                assert!(l.is_finite(), "{at}: lse {l}");
            } else if let NanIn::V = which {
                assert!(row[1].is_nan(), "{at}: {row:?}");
                assert!(l.is_finite(), "{at}: lse {l}");
            } else {
                assert!(row.iter().all(|o| o.is_nan()), "{at}: {row:?}");
                assert!(l.is_nan(), "{at}: lse {l}");
            }
        }
    }
    let g = backward(&q, &k, &v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
    // dV = Pᵀ·dO does not read V.
    let grads = [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)];
    let reached = if let NanIn::V = which { 2 } else { 3 };
    for (name, t) in &grads[..reached] {
        let t = t.to_f64_vec().unwrap();
        assert!(t.iter().any(|x| x.is_nan()), "{what}: {name} holds no NaN");
    }
}

/// A NaN in q, k or v propagates to the output and log-sum-exp it reaches, in the tile path
/// and the decoding path, for every dtype, at the level this process runs (CI runs this file
/// at each lower level too; [`nan_propagates_at_every_level_this_cpu_has`] does here).
#[test]
fn nan_inputs_propagate() {
    println!("level {}", cpu_simd());
    for (n, &dtype) in DTYPES.iter().enumerate() {
        let seed = 180 + 10 * n as u64;
        // Tiles, with a query block and key block boundary inside; causal with 5 queries that
        // see no key.
        let full = Case::new(70, 90, 16).heads(2, 1).dtype(dtype);
        let causal = Case::new(45, 40, 16).heads(4, 2).dtype(dtype).causal();
        // Per input, the row of the NaN; V's in the causal case is a key that queries which
        // see no key meet in their panel's product.
        for (case, rows) in [(&full, [40, 33, 33]), (&causal, [27, 20, 3])] {
            for (which, pos) in [NanIn::Q, NanIn::K, NanIn::V].into_iter().zip(rows) {
                check_nan(case, seed, which, pos);
            }
        }
        // A decoding step (one query), its keys split in runs.
        let decode = Case::new(1, 3000, 64).heads(4, 2).dtype(dtype);
        for which in [NanIn::Q, NanIn::K, NanIn::V] {
            let pos = if let NanIn::Q = which { 0 } else { 2100 };
            check_nan(&decode, seed + 1, which, pos);
        }
    }
}

/// Runs [`nan_inputs_propagate`] again in a child process at each lower level this CPU has,
/// so that a plain `cargo test` checks every level's kernels.
#[test]
fn nan_propagates_at_every_level_this_cpu_has() {
    if std::env::var_os("FLASHATTN_CPU_SIMD").is_some() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for level in [Simd::Portable, Simd::Avx2] {
        if level >= cpu_simd() {
            continue;
        }
        let status = std::process::Command::new(&exe)
            .args(["--exact", "nan_inputs_propagate", "--test-threads", "1"])
            .env("FLASHATTN_CPU_SIMD", level.name())
            .status()
            .unwrap();
        assert!(status.success(), "NaN test at level {level}");
    }
}
