//! `bench --linear`: linear attention's figures beside flashattn's and the standard attention's
//! (table, JSON, chart) and the line that says where it overtakes flashattn; `bench --layer`:
//! the fused layer beside the same steps as separate calls, and the options it refuses.

mod cli_support;

use cli_support::*;

#[test]
fn bench_linear_times_linear_attention_and_finds_the_crossing() {
    let dir = Dir::new();
    let (json, svg) = (dir.path("lin.json"), dir.path("lin.svg"));
    let o = flashattn(&[
        "bench",
        "--linear",
        "--seqlens",
        "32,128",
        "--causal",
        "both",
        "--pass",
        "both",
        "--head-dims",
        "8",
        "--heads",
        "2",
        "--heads-kv",
        "1",
        "--repeats",
        "1",
        "--json",
        s(&json),
        "--plot",
        s(&svg),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("lin ms") && text.contains("flash/lin"),
        "{text}"
    );
    // One verdict per curve (2 masks x 2 passes), whichever way the timings fall.
    let verdicts: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("linear vs flashattn, "))
        .collect();
    assert_eq!(verdicts.len(), 4, "{text}");
    for v in verdicts {
        let said = [
            "overtakes flashattn between",
            "faster at every N",
            "does not overtake",
        ];
        assert!(said.iter().any(|s| v.contains(s)), "{v}");
    }
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        2 * 2 * 2 * 3,
        "seqlens x masks x passes x methods"
    );
    for r in records.iter().filter(|r| r["method"] == "linear") {
        assert!(r["time_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["extra_memory_bytes"].is_u64(), "{r}");
        assert_eq!(r["heads_kv"], 1);
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    for needle in ["Time per call", "linear forward causal D=8 f32", "(dotted)"] {
        assert!(chart.contains(needle), "`{needle}` not in the chart");
    }
}

#[test]
fn bench_without_linear_has_no_linear_figures() {
    let dir = Dir::new();
    let json = dir.path("b.json");
    let o = flashattn(&[
        "bench",
        "--seqlens",
        "32",
        "--causal",
        "no",
        "--head-dims",
        "8",
        "--heads",
        "1",
        "--repeats",
        "1",
        "--json",
        s(&json),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("lin ms"));
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(records.iter().all(|r| r["method"] != "linear"));
}

#[test]
fn bench_layer_times_the_fused_layer_beside_separate_calls() {
    let o = flashattn(&[
        "bench",
        "--layer",
        "--seqlens",
        "16,40",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dims",
        "8",
        "--model-dim",
        "24",
        "--pass",
        "both",
        "--causal",
        "yes",
        "--repeats",
        "1",
        "--rounds",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("median over 2 rounds"), "{text}");
    assert!(
        text.contains("fused ms") && text.contains("sep ms"),
        "{text}"
    );
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|c: &Vec<&str>| {
            c.first()
                .is_some_and(|p| *p == "forward" || *p == "fwd+bwd")
        })
        .collect();
    assert_eq!(rows.len(), 4, "2 lengths x 2 passes\n{text}");
    for r in &rows {
        assert_eq!(
            &r[1..8],
            ["causal", "f32", "1", "4/2", r[5], "24", "8"],
            "{text}"
        );
        assert!(r.last().unwrap().ends_with('x'), "{text}");
    }
}

#[test]
fn bench_layer_refuses_what_it_does_not_take() {
    let layer = |extra: &[&str], needle: &str| {
        let mut args = vec!["bench", "--layer", "--seqlens", "16", "--heads", "2"];
        args.extend_from_slice(extra);
        let o = flashattn(&args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        let err = stderr(&o);
        assert!(err.contains(needle) && !err.contains("panicked"), "{err}");
    };
    layer(&["--linear"], "--linear");
    layer(&["--json", "x.json"], "--json");
    layer(&["--seqlens-k", "8"], "--seqlens-k");
    layer(&["--layout", "bhnd"], "--layout");
    layer(&["--model-dim", "0"], "--model-dim");
    layer(&["--heads-kv", "3"], "--heads-kv");
    let o = flashattn(&["bench", "--model-dim", "16"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--layer"), "{}", stderr(&o));
}
