//! Calls from several threads at once, from outside the rayon pool and from inside one of the
//! same size, give the same bits as each call made alone: a call's tasks run on the rayon
//! pool, so concurrent calls share the pool's threads.

mod common;

use common::{Case, Inputs, bits, rng};
use flashattn::{DType, backward, forward};

/// Every result of `x` (output, log-sum-exp, gradients) as bits.
fn results(x: &Inputs) -> Vec<Vec<u32>> {
    let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
    vec![
        bits(&f.out),
        bits(&f.lse),
        bits(&g.dq),
        bits(&g.dk),
        bits(&g.dv),
    ]
}

fn cases() -> Vec<Case> {
    vec![
        Case::new(300, 300, 64).heads(4, 4).causal(),
        Case::new(1, 700, 64).batch(3).heads(8, 2),
        Case::new(96, 130, 32)
            .batch(2)
            .heads(2, 1)
            .dtype(DType::BF16)
            .window(Some(20), Some(5)),
        Case::new(0, 0, 16)
            .heads(2, 2)
            .varlen(&[(40, 50), (0, 3), (64, 64)]),
    ]
}

#[test]
fn concurrent_calls_match_calls_made_alone() {
    let inputs: Vec<Inputs> = cases()
        .iter()
        .enumerate()
        .map(|(i, c)| c.inputs(&mut rng(7300 + i as u64)))
        .collect();
    let alone: Vec<Vec<Vec<u32>>> = inputs.iter().map(results).collect();
    // As many threads as the global pool: the tiles and the split of the work depend on it.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .build()
        .unwrap();
    std::thread::scope(|s| {
        for caller in 0..4 {
            let (inputs, alone, pool) = (&inputs, &alone, &pool);
            s.spawn(move || {
                for round in 0..6 {
                    let i = (caller + round) % inputs.len();
                    // Odd callers call from inside the pool, even ones from outside it.
                    let got = if caller % 2 == 1 {
                        pool.install(|| results(&inputs[i]))
                    } else {
                        results(&inputs[i])
                    };
                    assert!(got == alone[i], "caller {caller}, round {round}, case {i}");
                }
            });
        }
    });
}
