//! `flashattn run --kind linear` (issue 67's fixed interface): q, k, v and dout in; out, dq, dk,
//! dv out (no lse), equal to the library's `linear_forward`/`linear_backward` on the same tensors
//! (which `tests/linear.rs` checks against the f64 oracle), in either layout; and its error
//! paths (exit 2, the option or tensor named, no output).

mod cli_support;

use cli_support::*;
use flashattn::{FeatureMap, LinearParams, linear_backward, linear_forward};
use rand::{SeedableRng, rngs::StdRng};
use safetensors::tensor::Dtype;

/// q [2, 11, 4, 6], k [2, 13, 2, 6], v [2, 13, 2, 5], dout like the output, stored as `[b, n, h, d]`.
fn inputs(rng: &mut StdRng) -> Vec<Input> {
    vec![
        random(rng, "q", &[2, 11, 4, 6], Dtype::F32),
        random(rng, "k", &[2, 13, 2, 6], Dtype::F32),
        random(rng, "v", &[2, 13, 2, 5], Dtype::F32),
        random(rng, "dout", &[2, 11, 4, 5], Dtype::F32),
    ]
}

#[test]
fn run_kind_linear_gives_the_library_results() {
    let mut rng = StdRng::seed_from_u64(6701);
    let x = inputs(&mut rng);
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, &x);
    for (opts, p) in [
        (vec![], LinearParams::default()),
        (
            vec!["--causal", "--feature-map", "relu", "--linear-eps", "0.01"],
            LinearParams {
                causal: true,
                feature_map: FeatureMap::Relu,
                eps: 0.01,
            },
        ),
    ] {
        let mut args = vec![
            "run",
            "--kind",
            "linear",
            "--input",
            s(&input),
            "--output",
            s(&output),
        ];
        args.extend_from_slice(&opts);
        let o = flashattn(&args);
        assert!(o.status.success(), "run failed: {}", stderr(&o));
        let got = read_safetensors(&output);
        assert!(!got.contains_key("lse"), "linear attention writes no lse");
        let t: Vec<_> = x.iter().map(tensor).collect();
        let out = linear_forward(&t[0], &t[1], &t[2], &p).unwrap();
        let g = linear_backward(&t[0], &t[1], &t[2], &t[3], &p).unwrap();
        for (name, want) in [("out", &out), ("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)] {
            let (shape, _, vals) = &got[name];
            assert_eq!(shape.as_slice(), want.shape(), "{name}");
            assert_eq!(vals, &want.to_f64_vec().unwrap(), "{name} {opts:?}");
        }
    }
}

#[test]
fn run_kind_linear_rejects_softmax_options_and_tensors() {
    let mut rng = StdRng::seed_from_u64(6702);
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let mut x = inputs(&mut rng);
    write_safetensors(&input, &x);
    let base = ["run", "--input", s(&input), "--output", s(&output)];
    for (extra, named) in [
        (vec!["--kind", "linear", "--softcap", "5"], "--softcap"),
        (
            vec!["--kind", "linear", "--window-left", "3"],
            "--window-left",
        ),
        (vec!["--kind", "linear", "--heads", "4"], "--heads"),
        (vec!["--kind", "linear", "--diagonal", "-2"], "--diagonal"),
        (vec!["--kind", "linear", "--linear-eps", "0"], "eps"),
        (vec!["--feature-map", "relu"], "--kind linear"),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let o = flashattn(&args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(named), "{extra:?}: {}", stderr(&o));
        assert!(!output.exists(), "{extra:?} wrote an output");
    }
    x.push(random(&mut rng, "bias", &[1, 4, 11, 13], Dtype::F32));
    write_safetensors(&input, &x);
    let o = flashattn(&[&base[..], &["--kind", "linear"]].concat());
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("`bias`"), "{}", stderr(&o));
    assert!(!output.exists());
}
