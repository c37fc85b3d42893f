//! `bench --linear`: linear attention's figures beside flashattn's and the standard attention's
//! (table, JSON, chart) and the line that says where it overtakes flashattn.

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
