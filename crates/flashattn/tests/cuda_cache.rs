//! The kernel disk cache on a real GPU: damaged cubin files (truncated, emptied, one byte
//! flipped) are detected, compiled again and rewritten, and the answers stay right. Needs a CUDA
//! device: `cargo test --release --test cuda_cache -- --include-ignored`.
//!
//! This binary holds one test because it points `FLASHATTN_CACHE_DIR` at a folder of its own.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};

use common::{Case, F32_TOL, lse_error, rel, rng};
use flashattn::reference::{oracle, standard};
use flashattn::{Device, Tensor, cuda};

/// The cache entries in `dir`, sorted.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("reading the cache folder")
        .map(|e| e.expect("a folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
        .collect();
    files.sort();
    files
}

/// Forgets the loaded kernels, runs flashattn's and the standard attention's forward on the GPU,
/// checks both against the oracle, and returns whether each kernel load came from the disk.
fn run_and_check(case: &Case, seed: u64) -> Vec<bool> {
    let x = case.inputs(&mut rng(seed));
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle forward");
    let up = |t: &Tensor| t.to_device(Device::Cuda(0)).expect("upload");
    let (q, k, v) = (up(&x.q), up(&x.k), up(&x.v));
    cuda::forget_loaded_kernels();
    let before = cuda::compile_records().len();
    let f = flashattn::forward(&q, &k, &v, &x.p).expect("gpu forward");
    let s = standard::forward(&q, &k, &v, &x.p).expect("gpu standard forward");
    for (what, out) in [("flashattn", &f.out), ("standard", &s.out)] {
        let e = rel(&out.to_f64_vec().unwrap(), &o.out);
        assert!(e <= F32_TOL, "{what}: relative error {e:e}");
    }
    let lse_err = lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse);
    assert!(lse_err <= F32_TOL, "lse error {lse_err:e}");
    let records = cuda::compile_records();
    records[before..].iter().map(|r| r.from_disk).collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn damaged_cache_entries_are_compiled_again_and_rewritten() {
    let dir =
        std::env::temp_dir().join(format!("flashattn-cuda-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: this binary's only test sets the variable before any thread reads the environment.
    unsafe { std::env::set_var("FLASHATTN_CACHE_DIR", &dir) };
    assert_eq!(cuda::cache_dir(), Some(dir.clone()));
    let case = Case::new(100, 130, 64).heads(2, 1).causal();

    let loads = run_and_check(&case, 200_000);
    assert!(!loads.is_empty(), "no kernel was loaded");
    assert!(
        loads.iter().all(|d| !d),
        "a fresh folder has no entries: {loads:?}"
    );
    let files = entries(&dir);
    assert_eq!(files.len(), loads.len(), "one entry per kernel: {files:?}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "cache folder mode {mode:o}");
    }
    let loads = run_and_check(&case, 200_001);
    assert!(
        loads.iter().all(|&d| d),
        "the second run reads the disk: {loads:?}"
    );
    let good: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();

    type Damage = fn(&mut Vec<u8>);
    let damages: [(&str, Damage); 5] = [
        ("truncated to half", |b| b.truncate(b.len() / 2)),
        ("truncated by one byte", |b| {
            b.pop();
        }),
        ("emptied", Vec::clear),
        ("a payload byte flipped", |b| {
            let at = b.len() / 2;
            b[at] ^= 0x40;
        }),
        ("the last byte flipped", |b| {
            let at = b.len() - 1;
            b[at] ^= 0x01;
        }),
    ];
    for (n, (what, damage)) in damages.into_iter().enumerate() {
        let mut damaged = Vec::new();
        for (file, bytes) in files.iter().zip(&good) {
            let mut b = bytes.clone();
            damage(&mut b);
            std::fs::write(file, &b).unwrap();
            damaged.push(b);
        }
        let loads = run_and_check(&case, 200_010 + n as u64);
        println!("{what}: loads from disk {loads:?}");
        assert!(loads.iter().all(|d| !d), "{what}: a damaged entry was used");
        for (file, bad) in files.iter().zip(&damaged) {
            let now = std::fs::read(file).unwrap();
            assert_ne!(&now, bad, "{what}: {} was not rewritten", file.display());
        }
        let loads = run_and_check(&case, 200_020 + n as u64);
        assert!(
            loads.iter().all(|&d| d),
            "{what}: the rewritten entries load: {loads:?}"
        );
    }
    assert_eq!(entries(&dir), files, "no entries added or lost");
    std::fs::remove_dir_all(&dir).unwrap();
}
