//! The CPU backward (FlashAttention-2 with recomputation) against the f64 oracle's analytic
//! gradient, aimed at the kernel's own edges: key blocks and query tiles of 64 (sizes just
//! below, at and above), boundary tiles of every mask, the partial sums of tasks that split a
//! key/value head's work (dQ over chunks of its key blocks, dK/dV over runs of its query heads)
//! under several thread counts, GQA/MQA sums of dK/dV, the bias gradient's broadcast folds; and, on tiny problems,
//! finite differences of `L = Σ dout·out` (oracle forward in f64) against the oracle's gradient
//! and ours. Bounds: f32 relative error ≤ 1e-5, f16/bf16 within 2× the standard attention.

mod common;

use common::{Alibi, Case, F32_TOL, Layout, check_backward_cases, rel};
use flashattn::reference::oracle;
use flashattn::{AttentionParams, DType, Tensor, backward, forward};
use rand::{SeedableRng, rngs::StdRng};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Sequence lengths around the 64-row tiles, Nq ≠ Nk, unmasked and under each mask.
#[test]
fn tile_edges_and_masks() {
    let pairs = [
        (7, 63),
        (63, 64),
        (64, 65),
        (65, 7),
        (113, 203),
        (203, 113),
        (1, 65),
        (64, 64),
    ];
    let mut cases = Vec::new();
    for (n, &(nq, nk)) in pairs.iter().enumerate() {
        let base = Case::new(nq, nk, 16).dtype(DTYPES[n % 3]);
        cases.push(base.clone());
        cases.push(base.clone().causal().dtype(DTYPES[(n + 1) % 3]));
        cases.push(base.clone().window(Some(20), Some(3)));
        cases.push(base.clone().window(Some(0), Some(70)).layout(Layout::Bhnd));
        cases.push(base.window(Some(64), Some(0)).dtype(DType::F32));
    }
    check_backward_cases("cpu backward tile edges", 210_000, &cases);
}

/// Head dims 1..512, V's head dim different, GQA ratios, both layouts.
#[test]
fn head_dims_and_groups() {
    let dims = [1, 8, 64, 80, 512];
    let mut cases = Vec::new();
    for (n, &d) in dims.iter().enumerate() {
        let dv = dims[(n + 2) % dims.len()];
        cases.push(
            Case::new(65, 113, d)
                .dv(dv)
                .heads(4, 2)
                .dtype(DTYPES[n % 3]),
        );
        cases.push(
            Case::new(113, 65, d)
                .heads(3, 1)
                .causal()
                .layout(Layout::Bhnd)
                .dtype(DTYPES[(n + 1) % 3]),
        );
        cases.push(Case::new(64, 129, d).dv(dv.max(2) - 1).batch(2).heads(2, 2));
    }
    check_backward_cases("cpu backward head dims", 220_000, &cases);
}

/// Score options alone and combined, on tiles that cross the mask boundary; every bias
/// broadcast pattern (the gradient is folded over the broadcast dimensions).
#[test]
fn options_and_bias_folds() {
    let base = |n: usize| {
        Case::new(70, 130, 24)
            .heads(4, 2)
            .batch(2)
            .dtype(DTYPES[n % 3])
    };
    let mut cases = vec![
        base(0).softcap(3.0),
        base(1).softcap(0.7).causal(),
        base(2).alibi(Alibi::PerHead).window(Some(40), Some(10)),
        base(3)
            .alibi(Alibi::PerBatchHead)
            .causal()
            .layout(Layout::Bhnd),
        base(4).scale(0.9).softcap(5.0).alibi(Alibi::PerHead),
    ];
    for (n, full) in (0..16u8)
        .map(|m| [m & 8 != 0, m & 4 != 0, m & 2 != 0, m & 1 != 0])
        .enumerate()
    {
        let mut c = base(n).bias(full).dtype(DType::F32);
        if n % 2 == 1 {
            c = c.causal().softcap(4.0);
        }
        cases.push(c);
    }
    check_backward_cases("cpu backward options", 230_000, &cases);
}

/// Packed batches with uneven lengths, empty sequences and sequences without keys or queries.
#[test]
fn varlen_uneven() {
    let lens: [&[(usize, usize)]; 3] = [
        &[(0, 5), (65, 130), (7, 0), (1, 1), (64, 63)],
        &[(203, 7), (0, 0), (3, 200)],
        &[(130, 130), (5, 70)],
    ];
    let mut cases = Vec::new();
    for (n, l) in lens.iter().enumerate() {
        let base = Case::new(0, 0, 40).varlen(l).heads(6, 2).dtype(DTYPES[n]);
        cases.push(base.clone().causal());
        cases.push(base.clone().window(Some(3), Some(9)).dv(17));
        cases.push(
            base.alibi(Alibi::PerBatchHead)
                .bias([false, true, true, true])
                .layout(Layout::Bhnd)
                .dtype(DType::F32),
        );
    }
    check_backward_cases("cpu backward varlen", 240_000, &cases);
}

/// With fewer (sequence, key/value head) pairs than the threads want, GQA/MQA split the query
/// heads of a group into runs whose dK/dV partials are summed afterwards, and single-head groups
/// split the key blocks into chunks whose dQ partials are; which split, and into how many,
/// follows the thread count, so the same cases run on pools of 1, 2 and 3 threads.
#[test]
fn partials_under_thread_counts() {
    let cases = vec![
        Case::new(203, 203, 32).heads(8, 1),
        Case::new(130, 260, 64).heads(2, 1).causal(),
        Case::new(150, 300, 24).heads(1, 1).causal(),
        Case::new(9, 0, 16).heads(4, 1),
        Case::new(0, 0, 40)
            .varlen(&[(65, 130), (7, 0), (30, 31)])
            .heads(4, 1)
            .causal()
            .dv(24),
        Case::new(65, 300, 16)
            .heads(4, 2)
            .window(Some(100), Some(20))
            .bias([false, false, false, true]),
        Case::new(100, 129, 8)
            .batch(3)
            .heads(2, 1)
            .dtype(DType::BF16),
    ];
    for threads in [1, 2, 3] {
        println!("{threads} threads");
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        pool.install(|| {
            check_backward_cases(&format!("cpu backward {threads} threads"), 250_000, &cases)
        });
    }
}

/// Each thread keeps its tile buffers (the packed Q and dO rows among them) from one call to
/// the next: consecutive calls of the same shape on other data must not reuse them. Three
/// problems of one shape (one head: a thread's next call starts where its last ended; four:
/// another head), run in turn on one and two threads, give bit for bit the results each gives
/// alone in a fresh pool.
#[test]
fn consecutive_calls_of_one_shape_do_not_share_packed_rows() {
    let mut rng = StdRng::seed_from_u64(250_100);
    println!("seed 250100");
    let params = AttentionParams::default().causal();
    let grads = |[q, k, v, dout]: &[Tensor; 4]| {
        let f = forward(q, k, v, &params).expect("forward");
        let g = backward(q, k, v, &f.out, &f.lse, dout, &params).expect("backward");
        [g.dq, g.dk, g.dv].map(|t| t.to_vec::<f32>().expect("f32"))
    };
    let pool = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
        pool.expect("thread pool")
    };
    for heads in [1, 4] {
        let shape = [1, 130, heads, 32];
        let problems: Vec<[Tensor; 4]> = (0..3)
            .map(|_| {
                std::array::from_fn(|_| common::tensor(&mut rng, &shape, DType::F32, Layout::Bnhd))
            })
            .collect();
        for threads in [1, 2] {
            let alone: Vec<_> = problems
                .iter()
                .map(|x| pool(threads).install(|| grads(x)))
                .collect();
            pool(threads).install(|| {
                for round in 0..2 {
                    for (i, x) in problems.iter().enumerate() {
                        let same = grads(x) == alone[i];
                        assert!(
                            same,
                            "H={heads}, {threads} threads, round {round}, problem {i}"
                        );
                    }
                }
            });
        }
    }
}

/// With one visible key per query the softmax is constant, so dQ and dK vanish exactly; the
/// FlashAttention backward computes them from `dP − D` where both are `dO·V` rounded in different
/// orders, so they come out at rounding level (a relative error against an exact 0 is not
/// defined): bounded here by 1e-7 of `scale · |dO| · |V| · |K or Q|`, the size of the terms that
/// cancel. dV is checked against the oracle as usual.
#[test]
fn single_visible_key_gives_rounding_level_dq_dk() {
    let cases = [
        Case::new(1, 1, 32),
        Case::new(70, 1, 16).heads(4, 2),
        Case::new(65, 65, 8).window(Some(0), Some(0)),
        Case::new(100, 130, 8).window(Some(0), Some(0)).heads(2, 1),
    ];
    for (n, case) in cases.iter().enumerate() {
        let seed = 260_000 + n as u64;
        let x = case.inputs(&mut common::rng(seed));
        let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
        let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).unwrap();
        let norm = |t: &Tensor| common::norm(&t.to_f64_vec().unwrap());
        let scale = 1.0 / (case.d as f64).sqrt();
        let (ndo, nv, nq, nk) = (norm(&x.dout), norm(&x.v), norm(&x.q), norm(&x.k));
        let got = common::grads(&g);
        let dq = common::norm(&got[0].1);
        let dk = common::norm(&got[1].1);
        let dv_err = rel(&got[2].1, &og.dv);
        let (dq_bound, dk_bound) = (1e-7 * scale * ndo * nv * nk, 1e-7 * scale * ndo * nv * nq);
        println!(
            "#{n} seed {seed} {}: |dq| {dq:.2e} (bound {dq_bound:.2e}), |dk| {dk:.2e} (bound {dk_bound:.2e}), dv rel {dv_err:.2e}",
            common::describe(case)
        );
        assert!(og.dq.iter().chain(&og.dk).all(|&v| v == 0.0));
        assert!(dq <= dq_bound && dk <= dk_bound && dv_err <= F32_TOL);
    }
}

/// A tiny problem for finite differences: shapes (logical, contiguous) and options.
struct Tiny {
    q: Vec<usize>,
    k: Vec<usize>,
    v: Vec<usize>,
    bias: Option<Vec<usize>>,
    /// The shape of a relative-position table.
    rel: Option<Vec<usize>>,
    params: AttentionParams,
}

/// Central differences (h = 1e-3 on the f32 inputs) of `L = Σ dout·out` through the oracle's
/// f64 forward, against the oracle's analytic gradient (≤ 1e-5) and flashattn's (≤ 1e-5 + the
/// f32 tolerance), for q, k, v and the biases.
fn check_finite_differences(name: &str, seed: u64, tiny: &Tiny) {
    let mut rng = common::rng(seed);
    let mut mk = |s: &[usize]| common::values(&mut rng, s.iter().product(), 1.7);
    let mut inputs = vec![mk(&tiny.q), mk(&tiny.k), mk(&tiny.v)];
    let mut shapes = vec![tiny.q.clone(), tiny.k.clone(), tiny.v.clone()];
    if let Some(b) = &tiny.bias {
        inputs.push(mk(b));
        shapes.push(b.clone());
    }
    if let Some(r) = &tiny.rel {
        inputs.push(mk(r));
        shapes.push(r.clone());
    }
    let mut out_shape = tiny.q.clone();
    *out_shape.last_mut().unwrap() = *tiny.v.last().unwrap();
    let dout = mk(&out_shape);
    let tensor = |d: &[f32], s: &[usize]| Tensor::from_vec(d.to_vec(), s).unwrap();
    let dout_t = tensor(&dout, &out_shape);
    let build = |xs: &[Vec<f32>]| {
        let t: Vec<Tensor> = xs.iter().zip(&shapes).map(|(d, s)| tensor(d, s)).collect();
        let mut p = tiny.params.clone();
        let mut extra = t[3..].iter();
        if tiny.bias.is_some() {
            p.bias = extra.next().cloned();
        }
        if tiny.rel.is_some() {
            p.rel_bias = extra.next().cloned();
        }
        (t, p)
    };
    let loss = |xs: &[Vec<f32>]| -> f64 {
        let (t, p) = build(xs);
        let o = oracle::forward(&t[0], &t[1], &t[2], &p).unwrap();
        o.out.iter().zip(&dout).map(|(a, b)| a * *b as f64).sum()
    };
    let h = 1e-3f32;
    let (t, p) = build(&inputs);
    let og = oracle::backward(&t[0], &t[1], &t[2], &dout_t, &p).unwrap();
    let f = forward(&t[0], &t[1], &t[2], &p).unwrap();
    let g = backward(&t[0], &t[1], &t[2], &f.out, &f.lse, &dout_t, &p).unwrap();
    let ours = common::grads(&g);
    let mut analytic = vec![og.dq, og.dk, og.dv];
    analytic.extend(og.dbias);
    analytic.extend(og.drel_bias);
    for (which, want) in analytic.iter().enumerate() {
        let numeric: Vec<f64> = (0..inputs[which].len())
            .map(|i| {
                let mut xs = inputs.clone();
                let x0 = inputs[which][i];
                xs[which][i] = x0 + h;
                let (lp, xp) = (loss(&xs), xs[which][i] as f64);
                xs[which][i] = x0 - h;
                (lp - loss(&xs)) / (xp - xs[which][i] as f64)
            })
            .collect();
        let (e_oracle, e_ours) = (rel(want, &numeric), rel(&ours[which].1, &numeric));
        println!(
            "{name} {}: oracle vs finite differences {e_oracle:.2e}, flashattn {e_ours:.2e}",
            ours[which].0
        );
        assert!(e_oracle <= 1e-5, "{name}: oracle {e_oracle:e}");
        assert!(e_ours <= 1e-5 + F32_TOL, "{name}: flashattn {e_ours:e}");
    }
}

#[test]
fn finite_differences_gqa_causal() {
    let tiny = Tiny {
        q: vec![2, 4, 4, 3],
        k: vec![2, 6, 2, 3],
        v: vec![2, 6, 2, 2],
        bias: None,
        rel: None,
        params: AttentionParams::default().causal(),
    };
    check_finite_differences("gqa causal", 270_001, &tiny);
}

#[test]
fn finite_differences_varlen_options() {
    let tiny = Tiny {
        q: vec![6, 2, 2],
        k: vec![7, 1, 2],
        v: vec![7, 1, 3],
        bias: Some(vec![1, 2, 3, 3]),
        rel: None,
        params: AttentionParams::default()
            .varlen(vec![0, 2, 2, 5, 6], vec![0, 3, 4, 4, 7])
            .window(1, 1)
            .softcap(0.9)
            .scale(0.8)
            .alibi(Tensor::from_vec(vec![0.2f32, 0.05], &[2]).unwrap()),
    };
    check_finite_differences("varlen options", 270_002, &tiny);
}

#[test]
fn finite_differences_rel_bias() {
    // L = 3 on 5 queries × 7 keys: the clamped entries at both ends take several pairs each.
    let tiny = Tiny {
        q: vec![2, 5, 2, 3],
        k: vec![2, 7, 1, 3],
        v: vec![2, 7, 1, 2],
        bias: Some(vec![1, 2, 1, 7]),
        rel: Some(vec![2, 5]),
        params: AttentionParams::default()
            .window(4, 1)
            .softcap(1.1)
            .alibi(Tensor::from_vec(vec![0.15f32, 0.3], &[2]).unwrap()),
    };
    check_finite_differences("rel_bias", 270_003, &tiny);
}
