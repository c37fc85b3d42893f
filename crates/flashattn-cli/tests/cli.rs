//! The `flashattn` binary's `--help`, usage errors, `check`'s exit status, `--device cuda`
//! without a GPU, and the fields of `bench --json` and its charts.

mod cli_support;

use cli_support::*;

/// The sizes that keep a `bench` test short: two heads of dim 16, one timed run.
const SMALL: [&str; 6] = ["--head-dims", "16", "--heads", "2", "--repeats", "1"];

#[test]
fn help_lists_the_subcommands_with_examples() {
    let o = flashattn(&["--help"]);
    assert!(o.status.success());
    let text = stdout(&o);
    for needle in ["check", "bench", "run", "Examples:", "Exit status"] {
        assert!(text.contains(needle), "`{needle}` not in --help");
    }
    for (sub, needle) in [
        ("check", "--seqlen"),
        ("bench", "--plot"),
        ("run", "cu_seqlens_q"),
    ] {
        let o = flashattn(&[sub, "--help"]);
        assert!(o.status.success());
        let text = stdout(&o);
        assert!(
            text.contains("Examples:") && text.contains(needle),
            "{sub} --help"
        );
    }
    let o = flashattn(&["check", "--no-such-option"]);
    assert_eq!(o.status.code(), Some(2), "usage errors exit 2");
    let o = flashattn(&["bench", "--seqlens", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn check_exit_status_follows_the_results() {
    let o = flashattn(&[
        "check", "--seqlen", "50", "--heads", "2", "--causal", "--dtype", "f32,bf16",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    assert_eq!(text.matches("[PASS] forward").count(), 2, "{text}");
    assert_eq!(text.matches("[PASS] backward").count(), 2, "{text}");
    assert!(text.contains("max abs error") && text.contains("4 passed, 0 failed"));
    // Bounds 1e9 times tighter than any rounding allows: every line fails, exit status 1.
    let o = flashattn(&[
        "check",
        "--seqlen",
        "50",
        "--heads",
        "2",
        "--tighten",
        "1e9",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o).matches("[FAIL]").count(), 2);
    // An invalid configuration is bad input.
    let o = flashattn(&["check", "--heads", "3", "--heads-kv", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("`k`"));
}

#[test]
fn check_takes_a_diagonal() {
    let o = flashattn(&[
        "check",
        "--seqlen-q",
        "40",
        "--seqlen-k",
        "60",
        "--heads",
        "2",
        "--causal",
        "--alibi",
        "--diagonal",
        "-5",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert_eq!(text.matches("[PASS]").count(), 2, "{text}");
    assert!(text.contains("diagonal=-5"), "{text}");
}

#[test]
fn cuda_device_is_an_error_not_a_panic_without_a_gpu() {
    let o = flashattn(&[
        "check",
        "--device",
        "cuda",
        "--seqlen",
        "16",
        "--heads",
        "1",
        "--forward-only",
    ]);
    if !o.status.success() {
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains("cuda"), "{}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"));
    }
}

#[test]
fn bench_json_has_every_field() {
    let dir = Dir::new();
    let (json, svg, png) = (dir.path("b.json"), dir.path("b.svg"), dir.path("b.png"));
    let mut args = vec![
        "bench",
        "--seqlens",
        "64,128",
        "--causal",
        "both",
        "--pass",
        "both",
    ];
    args.extend(SMALL);
    let mut a = args.clone();
    a.extend(["--json", s(&json), "--plot", s(&svg)]);
    let o = flashattn(&a);
    assert!(o.status.success());
    assert!(stdout(&o).contains("speedup"));
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        2 * 2 * 2 * 2,
        "seqlens x masks x passes x methods"
    );
    for r in &records {
        for f in ["device", "dtype", "pass", "method"] {
            assert!(r[f].is_string(), "{f} in {r}");
        }
        for f in [
            "batch",
            "heads",
            "seqlen_q",
            "seqlen_k",
            "head_dim",
            "extra_memory_bytes",
        ] {
            assert!(r[f].is_u64(), "{f} in {r}");
        }
        assert!(r["causal"].is_boolean());
        assert!(r["time_ms"].as_f64().unwrap() > 0.0);
        assert!(r["gflops"].as_f64().unwrap() > 0.0);
        assert_eq!(r["dtype"], "f32");
        assert_eq!(r["device"], "cpu");
    }
    let pick = |method: &str, pass: &str, n: u64| {
        records
            .iter()
            .find(|r| {
                r["method"] == method
                    && r["pass"] == pass
                    && r["seqlen_q"] == n
                    && r["causal"] == false
            })
            .unwrap()["extra_memory_bytes"]
            .as_u64()
            .unwrap()
    };
    // The standard attention holds the scores: 2 heads x 128 x 128 f32 at least.
    assert!(pick("standard", "forward", 128) >= 2 * 128 * 128 * 4);
    assert!(pick("flashattn", "forward", 128) < pick("standard", "forward", 128));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let mut a = args.to_vec();
    a.extend(["--plot", s(&png), "--no-standard"]);
    let o = flashattn(&a);
    assert!(o.status.success());
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    let o = flashattn(&["bench", "--plot", s(&dir.path("chart.gif"))]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn bench_rounds_and_the_gemm_ceiling() {
    let dir = Dir::new();
    let json = dir.path("g.json");
    let run = |rounds: &str| {
        let mut args = vec!["bench", "--seqlens", "64", "--rounds", rounds, "--gemm"];
        args.extend(SMALL);
        args.extend(["--json", s(&json)]);
        let o = flashattn(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let records: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (stdout(&o), records)
    };
    let (text, records) = run("3");
    for needle in ["% GEMM", "median over 3 rounds", "sgemm 1024x1024x1024 f32"] {
        assert!(text.contains(needle), "`{needle}` not in\n{text}");
    }
    assert_eq!(records.len(), 2 * 2, "masks x methods");
    for r in &records {
        if r["method"] == "flashattn" {
            let share = r["gemm_percent"].as_f64().unwrap();
            assert!(share.is_finite() && share > 0.0, "{r}");
            assert!(r["gemm_gflops"].as_f64().unwrap() > 0.0, "{r}");
        } else {
            assert!(
                r["gemm_percent"].is_null() && r["gemm_gflops"].is_null(),
                "{r}"
            );
        }
    }
    // One round: the share is this round's rate over the sgemm rate timed around it.
    let (_, records) = run("1");
    for r in records.iter().filter(|r| r["method"] == "flashattn") {
        let (rate, gemm) = (
            r["gflops"].as_f64().unwrap(),
            r["gemm_gflops"].as_f64().unwrap(),
        );
        let share = r["gemm_percent"].as_f64().unwrap();
        assert!((share - 100.0 * rate / gemm).abs() <= 1e-9 * share, "{r}");
    }
    let o = flashattn(&["bench", "--gemm", "--device", "cuda"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--gemm"), "{}", stderr(&o));
    let o = flashattn(&["bench", "--rounds", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn bench_times_each_layout() {
    let dir = Dir::new();
    let json = dir.path("l.json");
    let mut args = vec!["bench", "--seqlens", "64", "--layout", "bnhd,bhnd"];
    args.extend(["--causal", "no", "--no-standard"]);
    args.extend(SMALL);
    args.extend(["--json", s(&json)]);
    let o = flashattn(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    // The table names the layout of each row: `forward full f32 bhnd 1 2 64 ..`.
    for layout in ["bnhd", "bhnd"] {
        let row = format!("forward full f32 {layout} 1 2 64 ");
        let found = text.lines().any(|l| {
            l.split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .starts_with(&row)
        });
        assert!(found, "no `{row}` row in\n{text}");
    }
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // (With --no-standard the standard attention's records say it was skipped.)
    let layouts: Vec<(&str, &str)> = records
        .iter()
        .filter(|r| r["method"] != "standard")
        .map(|r| (r["method"].as_str().unwrap(), r["layout"].as_str().unwrap()))
        .collect();
    assert_eq!(layouts, [("flashattn", "bnhd"), ("flashattn", "bhnd")]);
    // The default is FlashAttention's layout alone, with no column for it.
    let mut args = vec![
        "bench",
        "--seqlens",
        "64",
        "--causal",
        "no",
        "--no-standard",
    ];
    args.extend(SMALL);
    let o = flashattn(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("layout"), "{}", stdout(&o));
    let o = flashattn(&["bench", "--layout", "nhd"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--layout"), "{}", stderr(&o));
}

#[test]
fn bench_times_key_lengths_apart_from_query_lengths() {
    let dir = Dir::new();
    let json = dir.path("k.json");
    let (nq, d, h) = (48u64, 16u64, 2u64);
    let mut args = vec![
        "bench",
        "--seqlens",
        "48",
        "--seqlens-k",
        "16,48",
        "--causal",
        "both",
    ];
    args.extend(SMALL);
    args.extend(["--json", s(&json)]);
    let o = flashattn(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.lines().any(|l| l.contains(" Nk ")), "{text}");
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(records.len(), 2 * 2 * 2, "key lengths x masks x methods");
    for r in &records {
        assert_eq!(r["seqlen_q"], nq, "{r}");
        let nk = r["seqlen_k"].as_u64().unwrap();
        assert!(nk == 16 || nk == 48, "{r}");
        // Query i sees keys up to i + nk − nq when causal (bottom-right): 1 + 2 + … + nk of
        // them in all for nk ≤ nq; every key otherwise.
        let pairs = if r["causal"] == true {
            nk * (nk + 1) / 2
        } else {
            nq * nk
        };
        let flops = 4.0 * (h * pairs * d) as f64;
        let counted = r["gflops"].as_f64().unwrap() * r["time_ms"].as_f64().unwrap() * 1e6;
        assert!(
            (counted - flops).abs() <= 1e-6 * flops,
            "{counted} vs {flops} in {r}"
        );
    }
    let o = flashattn(&["bench", "--seqlens-k", "64,0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--seqlens-k"), "{}", stderr(&o));
}
