//! Ring attention on threads (`flashattn::ring::simulate_forward`/`simulate_backward`): the
//! zigzag schedule, the blocks' diagonals and the log-sum-exp merge against the f64 oracle,
//! forward and backward, P ∈ {1, 2, 3, 4} ranks, full and causal, with sliding windows, ALiBi, a
//! soft cap, GQA/MQA and V's head dim differing. Bounds as the core call's: f32 ≤ 1e-5, f16/bf16
//! within 2× the standard attention. Also `merge_partials` on its own, the errors, and (on a GPU,
//! ignored without one) partials merged from the GPU and the ring on one GPU.

mod common;

use common::{
    Alibi, Case, check_backward_cases_with, describe, gradient_errors, lse_error, lse_tolerance,
    rel, rng, tolerance,
};
use flashattn::reference::{oracle, standard};
use flashattn::ring::{LocalRing, RingComm, ring_forward, simulate_backward, simulate_forward};
use flashattn::{DType, Error, Tensor, forward, merge_partials};

/// Cases of `2 · ranks · chunk` positions for `ranks` ranks.
fn cases(ranks: usize) -> Vec<Case> {
    let n = |chunk: usize| 2 * ranks * chunk;
    let mut out = Vec::new();
    for chunk in [1, 5, 16] {
        out.push(Case::new(n(chunk), n(chunk), 16));
        out.push(Case::new(n(chunk), n(chunk), 16).causal());
    }
    out.extend([
        Case::new(n(6), n(6), 24).batch(2).heads(4, 2).causal(),
        Case::new(n(6), n(6), 8).heads(3, 1).dv(12),
        Case::new(n(7), n(7), 16).window(Some(9), Some(0)),
        Case::new(n(7), n(7), 16).window(Some(4), Some(11)),
        Case::new(n(5), n(5), 16)
            .causal()
            .alibi(Alibi::PerHead)
            .heads(2, 2),
        Case::new(n(5), n(5), 16)
            .alibi(Alibi::PerBatchHead)
            .batch(2),
        Case::new(n(5), n(5), 16).causal().softcap(5.0),
        Case::new(n(8), n(8), 32)
            .causal()
            .heads(2, 1)
            .dtype(DType::BF16),
        Case::new(n(8), n(8), 32)
            .window(Some(10), Some(2))
            .dtype(DType::F16),
    ]);
    out
}

#[test]
fn forward_equals_the_oracle() {
    let mut failures = Vec::new();
    for ranks in 1..=4 {
        for (i, case) in cases(ranks).iter().enumerate() {
            let seed = 100 * ranks as u64 + i as u64;
            let x = case.inputs(&mut rng(seed));
            let f = simulate_forward(&x.q, &x.k, &x.v, &x.p, ranks).expect("ring forward");
            let s = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("standard");
            let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle");
            assert_eq!(f.out.shape(), &*common::out_shape(x.q.shape(), case.dv));
            assert_eq!(f.out.dtype(), case.dtype);
            let out = f.out.to_f64_vec().unwrap();
            let (err, std_err) = (rel(&out, &o.out), rel(&s.out.to_f64_vec().unwrap(), &o.out));
            let lse = lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse);
            let std_lse = lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse);
            let ok =
                err <= tolerance(case.dtype, std_err) && lse <= lse_tolerance(case.dtype, std_lse);
            println!(
                "[{}] ranks {ranks} seed {seed} {}: out rel {err:.2e} (standard {std_err:.2e}), lse {lse:.2e}",
                if ok { "PASS" } else { "FAIL" },
                describe(case)
            );
            if !ok {
                failures.push(format!("ranks {ranks} seed {seed} {}", describe(case)));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn backward_equals_the_oracle() {
    for ranks in 1..=4 {
        check_backward_cases_with(
            &format!("ring of {ranks}"),
            500 + 50 * ranks as u64,
            &cases(ranks),
            |case, x| {
                let f = simulate_forward(&x.q, &x.k, &x.v, &x.p, ranks).expect("ring forward");
                let g = simulate_backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p, ranks)
                    .expect("ring backward");
                gradient_errors(case, x, &f.out, &g, [&x.q, &x.k, &x.v])
            },
        );
    }
}

/// Keys cut into three runs, each attended with its diagonal, merged: the whole call's result.
#[test]
fn merged_parts_equal_one_call() {
    for case in [
        Case::new(13, 29, 8).causal(),
        Case::new(9, 20, 8).alibi(Alibi::PerHead),
        Case::new(11, 11, 8),
    ] {
        let x = case.inputs(&mut rng(7));
        let whole = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let (nq, nk) = (case.nq as i64, case.nk as i64);
        let cuts = [0, 4, 17.min(case.nk), case.nk];
        let parts: Vec<_> = cuts
            .windows(2)
            .map(|w| {
                let keys = |t: &Tensor| {
                    let mut shape = t.shape().to_vec();
                    shape[1] = w[1] - w[0];
                    t.view(&shape, t.strides(), t.offset() + w[0] * t.strides()[1])
                        .unwrap()
                };
                // Query i sits at key i + nk − nq of the whole, i + nk − nq − start of a run.
                let p = x.p.clone().diagonal(nk - nq - w[0] as i64);
                forward(&x.q, &keys(&x.k), &keys(&x.v), &p).unwrap()
            })
            .collect();
        let merged = merge_partials(&parts).unwrap();
        let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let err = rel(&merged.out.to_f64_vec().unwrap(), &o.out);
        let whole_err = rel(&whole.out.to_f64_vec().unwrap(), &o.out);
        println!(
            "{}: merged {err:.2e}, one call {whole_err:.2e}",
            describe(&case)
        );
        assert!(err <= common::F32_TOL, "{err}");
        assert!(lse_error(&merged.lse.to_f64_vec().unwrap(), &o.lse) <= common::F32_TOL);
    }
}

/// Packed parts (`[total, heads, dv]`, lse `[heads, total]`) merge as their padded form does.
#[test]
fn packed_parts_merge_like_padded_ones() {
    let x = Case::new(12, 20, 8).heads(2, 1).inputs(&mut rng(11));
    let keys = |t: &Tensor, a: usize| {
        t.view(&[1, 10, 1, 8], t.strides(), t.offset() + a * t.strides()[1])
            .unwrap()
    };
    let parts: Vec<_> = [0, 10]
        .iter()
        .map(|&a| {
            forward(
                &x.q,
                &keys(&x.k, a),
                &keys(&x.v, a),
                &x.p.clone().diagonal(8 - a as i64),
            )
            .unwrap()
        })
        .collect();
    let packed: Vec<_> = parts
        .iter()
        .map(|p| flashattn::ForwardOutput {
            out: p
                .out
                .view(&[12, 2, 8], &p.out.strides()[1..], p.out.offset())
                .unwrap(),
            lse: p
                .lse
                .view(&[2, 12], &p.lse.strides()[1..], p.lse.offset())
                .unwrap(),
        })
        .collect();
    let (a, b) = (
        merge_partials(&parts).unwrap(),
        merge_partials(&packed).unwrap(),
    );
    assert_eq!(b.out.shape(), &[12, 2, 8]);
    assert_eq!(b.lse.shape(), &[2, 12]);
    assert_eq!(
        a.out.to_vec::<f32>().unwrap(),
        b.out.to_vec::<f32>().unwrap()
    );
    assert_eq!(
        a.lse.to_vec::<f32>().unwrap(),
        b.lse.to_vec::<f32>().unwrap()
    );
}

#[test]
fn merge_rejects_unlike_parts() {
    let x = Case::new(6, 6, 4).inputs(&mut rng(1));
    let a = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let y = Case::new(5, 6, 4).inputs(&mut rng(2));
    let b = forward(&y.q, &y.k, &y.v, &y.p).unwrap();
    let e = merge_partials(&[a, b]).unwrap_err();
    assert_eq!(e.argument(), Some("parts"), "{e}");
    assert_eq!(merge_partials(&[]).unwrap_err().argument(), Some("parts"));
}

#[test]
fn options_a_ring_cannot_shard_and_bad_lengths_are_typed_errors() {
    let x = Case::new(8, 8, 4).bias([true; 4]).inputs(&mut rng(3));
    let e = simulate_forward(&x.q, &x.k, &x.v, &x.p, 2).unwrap_err();
    assert_eq!(e.argument(), Some("bias"), "{e}");
    let y = Case::new(10, 10, 4).inputs(&mut rng(4));
    assert_eq!(
        simulate_forward(&y.q, &y.k, &y.v, &y.p, 2)
            .unwrap_err()
            .argument(),
        Some("x")
    );
    assert_eq!(
        simulate_forward(&y.q, &y.k, &y.v, &y.p, 0)
            .unwrap_err()
            .argument(),
        Some("ranks")
    );
    let p = y.p.clone().diagonal(0);
    assert_eq!(
        simulate_forward(&y.q, &y.k, &y.v, &p, 1)
            .unwrap_err()
            .argument(),
        Some("diagonal")
    );
}

/// A rank that fails stops the ring: its neighbours get a communication error, nobody hangs.
#[test]
fn a_failing_rank_stops_the_ring() {
    let x = Case::new(8, 8, 4).inputs(&mut rng(5));
    let shard = |t: &Tensor, r| flashattn::ring::zigzag_shard(t, 1, 2, r).unwrap();
    let comms = LocalRing::new(2).unwrap();
    let results: Vec<Result<_, Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let x = &x;
                s.spawn(move || {
                    let r = c.rank();
                    // Rank 1 fails before it sends anything.
                    let bias = Tensor::full(&[1, 1, 8, 8], DType::F32, 0.5).unwrap();
                    let p = if r == 1 {
                        x.p.clone().bias(bias)
                    } else {
                        x.p.clone()
                    };
                    ring_forward(&c, &shard(&x.q, r), &shard(&x.k, r), &shard(&x.v, r), &p)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        matches!(results[0], Err(Error::Comm(_))),
        "{:?}",
        results[0].as_ref().err()
    );
    let e = results[1].as_ref().unwrap_err();
    assert_eq!(e.argument(), Some("bias"), "{e}");
}

/// On a GPU: partials computed there merge (non-causal, where the keys' split needs no diagonal),
/// and the ring runs there (`LocalRing` of one rank, each pair of chunks a call with its diagonal):
/// forward and backward against the oracle with the core call's bounds, results on the GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_partials_merge_and_the_gpu_ring_matches_the_oracle() {
    use common::gpu::{GPU, to_device};
    use flashattn::Device;
    use flashattn::ring::ring_backward;
    let x = Case::new(40, 64, 64)
        .heads(4, 2)
        .dtype(DType::BF16)
        .inputs(&mut rng(9));
    let g = to_device(&x, GPU);
    let keys = |t: &Tensor, a: usize, n: usize| {
        let mut shape = t.shape().to_vec();
        shape[1] = n;
        t.view(&shape, t.strides(), t.offset() + a * t.strides()[1])
            .unwrap()
    };
    let parts: Vec<_> = [(0, 24), (24, 40)]
        .iter()
        .map(|&(a, n)| forward(&g.q, &keys(&g.k, a, n), &keys(&g.v, a, n), &x.p).unwrap())
        .collect();
    let merged = merge_partials(&parts).unwrap();
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let s = standard::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let err = rel(&merged.out.to_f64_vec().unwrap(), &o.out);
    let std_err = rel(&s.out.to_f64_vec().unwrap(), &o.out);
    assert!(
        err <= tolerance(DType::BF16, std_err),
        "{err} (standard {std_err})"
    );

    let cases = [
        Case::new(96, 96, 64)
            .heads(4, 2)
            .dtype(DType::BF16)
            .causal()
            .alibi(Alibi::PerHead),
        Case::new(40, 40, 64)
            .dtype(DType::F16)
            .window(Some(9), Some(0))
            .softcap(5.0),
        Case::new(48, 48, 32).causal(),
    ];
    check_backward_cases_with("gpu ring", 60_000, &cases, |case, x| {
        let g = to_device(x, GPU);
        let comm = LocalRing::new(1).unwrap().pop().unwrap();
        let f = ring_forward(&comm, &g.q, &g.k, &g.v, &g.p).expect("ring forward");
        assert_eq!((f.out.device(), f.lse.device()), (GPU, GPU));
        let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let s = standard::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let (err, std_err) = (
            rel(&f.out.to_f64_vec().unwrap(), &o.out),
            rel(&s.out.to_f64_vec().unwrap(), &o.out),
        );
        let (lse, std_lse) = (
            lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse),
            lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse),
        );
        assert!(
            err <= tolerance(case.dtype, std_err) && lse <= lse_tolerance(case.dtype, std_lse),
            "{}: out {err} (standard {std_err}), lse {lse} (standard {std_lse})",
            describe(case)
        );
        let grads = ring_backward(&comm, &g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p)
            .expect("ring backward");
        for t in [&grads.dq, &grads.dk, &grads.dv] {
            assert_eq!(t.device(), GPU);
        }
        let out = f.out.to_device(Device::Cpu).unwrap();
        gradient_errors(case, x, &out, &grads, [&g.q, &g.k, &g.v])
    });
}
