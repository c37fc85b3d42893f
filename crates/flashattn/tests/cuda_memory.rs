//! Device memory of the GPU forward, read from the GPU's memory pool (which serves every flashattn
//! allocation): flashattn's forward holds nothing beyond its output and log-sum-exp, while the
//! standard attention materializes its score matrix. A test binary of its own, so no other test
//! allocates on the GPU while it measures. Needs a CUDA device:
//! `cargo test --release --test cuda_memory -- --include-ignored`.
#![cfg(feature = "cuda")]

mod common;

use common::{Case, rng};
use flashattn::reference::standard;
use flashattn::{DType, Device, Tensor};

const ORDINAL: usize = 0;

fn bytes(t: &Tensor) -> u64 {
    (t.numel() * t.dtype().size_in_bytes()) as u64
}

/// Runs `f` after a fresh peak; returns its results, the pool's peak beyond what they hold, and
/// how much more the pool holds than before (the results' footprint).
fn measured(f: impl FnOnce() -> Vec<Tensor>) -> (Vec<Tensor>, u64, u64) {
    flashattn::cuda::synchronize(ORDINAL).unwrap();
    let before = flashattn::cuda::memory_use(ORDINAL).unwrap().current;
    flashattn::cuda::reset_memory_peak(ORDINAL).unwrap();
    let outs = f();
    flashattn::cuda::synchronize(ORDINAL).unwrap();
    let m = flashattn::cuda::memory_use(ORDINAL).unwrap();
    (outs, m.peak - m.current, m.current - before)
}

#[test]
#[ignore = "needs a CUDA device"]
fn forward_memory_stays_linear() {
    let gpu = Device::Cuda(ORDINAL);
    for (dtype, n) in [(DType::BF16, 4096), (DType::F32, 2048)] {
        let case = Case::new(n, n, 64).heads(8, 8).dtype(dtype);
        let x = case.inputs(&mut rng(195_000 + n as u64));
        let (q, k, v) = (
            x.q.to_device(gpu).unwrap(),
            x.k.to_device(gpu).unwrap(),
            x.v.to_device(gpu).unwrap(),
        );
        let (outs, flash_extra, held) = measured(|| {
            let f = flashattn::forward(&q, &k, &v, &x.p).expect("gpu forward");
            vec![f.out, f.lse]
        });
        let out_bytes: u64 = outs.iter().map(bytes).sum();
        drop(outs);
        let (std_outs, std_extra, _) = measured(|| {
            let s = standard::forward(&q, &k, &v, &x.p).expect("gpu standard forward");
            vec![s.out, s.lse]
        });
        drop(std_outs);
        let scores = (8 * n * n * dtype.size_in_bytes()) as u64;
        println!(
            "{dtype} B=1 H=8 N={n} D=64: flashattn extra {flash_extra} B (results hold {held} B, \
             their size {out_bytes} B); standard extra {std_extra} B (score matrix {scores} B)"
        );
        assert!(
            held >= out_bytes,
            "the pool must account for the results: {held} < {out_bytes}"
        );
        assert_eq!(
            flash_extra, 0,
            "{dtype}: flashattn allocated beyond its results"
        );
        assert!(
            std_extra >= scores,
            "{dtype}: the standard attention's extra {std_extra} < its score matrix {scores}"
        );
    }
}
