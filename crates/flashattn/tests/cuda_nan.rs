//! NaN inputs on the GPU: a NaN in q or k reaches exactly the rows whose visible scores hold it
//! (output and log-sum-exp NaN, in flashattn's kernels and the GPU standard attention alike), as on
//! the CPU (`tests/numerics.rs`). Needs a CUDA device: run with
//! `cargo test --release --test cuda_nan -- --include-ignored` on a machine with a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::{Case, rng};
use flashattn::reference::standard;
use flashattn::{AttentionParams, DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);

/// Outputs are allocated filled with NaN, and the allocator's free memory is poisoned too.
fn poison() {
    flashattn::internals::set_poison_outputs(true);
    flashattn::cuda::poison_free_memory(0, 64 << 20).expect("poisoning free GPU memory");
}

/// `t` (contiguous, `[batch, seqlen, heads, dim]`) with element `(0, row, head, col)` set to NaN.
fn with_nan(t: &Tensor, row: usize, head: usize, col: usize) -> Tensor {
    let s = t.shape();
    let mut data = t.to_f32_vec().unwrap();
    data[(row * s[2] + head) * s[3] + col] = f32::NAN;
    Tensor::from_vec(data, s)
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap()
}

/// Out (`[1, nq, heads, dv]`) and LSE (`[1, heads, nq]`) of flashattn's and the standard
/// attention's forward on the GPU.
fn gpu_outputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttentionParams,
) -> [(Vec<f32>, Vec<f32>); 2] {
    let (q, k, v) = (
        q.to_device(GPU).unwrap(),
        k.to_device(GPU).unwrap(),
        v.to_device(GPU).unwrap(),
    );
    poison();
    let f = flashattn::forward(&q, &k, &v, p).expect("gpu forward");
    poison();
    let s = standard::forward(&q, &k, &v, p).expect("gpu standard forward");
    [f, s].map(|r| (r.out.to_f32_vec().unwrap(), r.lse.to_f32_vec().unwrap()))
}

/// A NaN in q (one row of one head) or in k (one key) makes every row whose visible scores hold
/// it NaN, output and log-sum-exp, in flashattn's kernels and the GPU standard attention alike
/// (as peers do); every other row keeps the bits of the run without the NaN, and rows that see no
/// key stay 0 and −∞ even with a NaN in their own query.
#[test]
#[ignore = "needs a CUDA device"]
fn nan_inputs_propagate() {
    // Causal with nq - nk = 10: rows 0..10 see no key, row i sees keys 0..=i - 10.
    let (nq, nk, heads) = (80, 70, 2);
    let (q_row, masked_q_row, key) = (50, 3, 40);
    let configs = [
        (DType::F32, 64, false),
        (DType::F32, 64, true),
        (DType::F16, 64, true),
        (DType::BF16, 128, false),
        (DType::BF16, 128, true),
        (DType::BF16, 256, true),
        (DType::F16, 512, true),
    ];
    for (n, (dtype, d, causal)) in configs.into_iter().enumerate() {
        let mut case = Case::new(nq, nk, d).heads(heads, 1).dtype(dtype);
        if causal {
            case = case.causal();
        }
        let x = case.inputs(&mut rng(240_000 + n as u64));
        let sees_no_key = |i: usize| causal && i < nq - nk;
        let sees = |i: usize, j: usize| !causal || j + nq - nk <= i;
        let clean = gpu_outputs(&x.q, &x.k, &x.v, &x.p);
        let q_nan = with_nan(&with_nan(&x.q, q_row, 0, 3), masked_q_row, 0, d - 1);
        let k_nan = with_nan(&x.k, key, 0, 5);
        let runs = [
            ("NaN in q", gpu_outputs(&q_nan, &x.k, &x.v, &x.p)),
            ("NaN in k", gpu_outputs(&x.q, &k_nan, &x.v, &x.p)),
        ];
        for (what, outputs) in runs {
            let nan_row = |h: usize, i: usize| match what {
                "NaN in q" => h == 0 && (i == q_row || i == masked_q_row) && !sees_no_key(i),
                _ => sees(i, key),
            };
            for (kernel, (out, lse), (clean_out, clean_lse)) in [
                ("flashattn", &outputs[0], &clean[0]),
                ("standard", &outputs[1], &clean[1]),
            ] {
                let at = format!("{kernel} {dtype} D={d} causal={causal} {what}");
                for h in 0..heads {
                    for i in 0..nq {
                        let row = |o: &[f32]| {
                            (0..d)
                                .map(|c| o[(i * heads + h) * d + c])
                                .collect::<Vec<f32>>()
                        };
                        let (o, l) = (row(out), lse[h * nq + i]);
                        if sees_no_key(i) {
                            assert!(o.iter().all(|&v| v == 0.0), "{at}: row {i} head {h}: {o:?}");
                            assert_eq!(l, f32::NEG_INFINITY, "{at}: lse of row {i} head {h}");
                        } else if nan_row(h, i) {
                            assert!(
                                o.iter().all(|v| v.is_nan()),
                                "{at}: row {i} head {h}: {o:?}"
                            );
                            assert!(l.is_nan(), "{at}: lse of row {i} head {h} = {l}");
                        } else {
                            assert!(o.iter().all(|v| v.is_finite()), "{at}: row {i} head {h}");
                            let to_bits =
                                |r: Vec<f32>| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                to_bits(o),
                                to_bits(row(clean_out)),
                                "{at}: row {i} head {h}"
                            );
                            assert_eq!(
                                l.to_bits(),
                                clean_lse[h * nq + i].to_bits(),
                                "{at}: lse {i}"
                            );
                        }
                    }
                }
            }
        }
        println!("NaN inputs {dtype} D={d} causal={causal}: propagated");
    }
}
