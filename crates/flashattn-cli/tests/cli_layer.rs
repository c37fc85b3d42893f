//! `flashattn run` on the fused layer's tensors (issue 67's fixed interface): x, w_qkv, b_qkv,
//! w_o, b_o, positions, rel_bias and dy in; y and the gradients out, equal to the library's
//! `layer_forward`/`layer_backward` on the same tensors (which `tests/cpu_layer.rs` checks
//! against the f64 oracles); and its error paths (exit 2, the argument named, no output).

mod cli_support;

use std::collections::HashMap;

use cli_support::*;
use flashattn::{
    AttentionParams, LayerParams, LayerWeights, Rope, RopeStyle, layer_backward, layer_forward,
};
use rand::{SeedableRng, rngs::StdRng};
use safetensors::tensor::Dtype;

type Outputs = HashMap<String, (Vec<usize>, Dtype, Vec<f64>)>;

/// Runs `run` on `inputs` with `opts`, asserting success.
fn run(dir: &Dir, inputs: &[Input], opts: &[&str]) -> Outputs {
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, inputs);
    let mut args = vec!["run", "--input", s(&input), "--output", s(&output)];
    args.extend_from_slice(opts);
    let o = flashattn(&args);
    assert!(o.status.success(), "run failed: {}", stderr(&o));
    read_safetensors(&output)
}

fn find<'a>(inputs: &'a [Input], name: &str) -> Option<&'a Input> {
    inputs.iter().find(|x| x.name == name)
}

/// The layer's inputs: [2, 9, 12] x, 4 query heads on 2 key/value heads of dim 6.
fn layer_inputs(rng: &mut StdRng, dtype: Dtype, biases: bool, dy: bool) -> Vec<Input> {
    let (b, n, m, h, hk, d) = (2, 9, 12, 4, 2, 6);
    let cols = (h + 2 * hk) * d;
    let mut v = vec![
        random(rng, "x", &[b, n, m], dtype),
        random(rng, "w_qkv", &[m, cols], dtype),
        random(rng, "w_o", &[h * d, m], dtype),
    ];
    if biases {
        v.push(random(rng, "b_qkv", &[cols], dtype));
        v.push(random(rng, "b_o", &[m], dtype));
    }
    if dy {
        v.push(random(rng, "dy", &[b, n, m], dtype));
    }
    v
}

/// The library's results on the same tensors, by output name.
fn library(inputs: &[Input], p: &LayerParams) -> Vec<(&'static str, Vec<f64>)> {
    let t = |n: &str| find(inputs, n).map(tensor);
    let w = LayerWeights {
        w_qkv: t("w_qkv").unwrap(),
        b_qkv: t("b_qkv"),
        w_o: t("w_o").unwrap(),
        b_o: t("b_o"),
    };
    let x = t("x").unwrap();
    let f = layer_forward(&x, &w, p).unwrap();
    let v = |t: &flashattn::Tensor| t.to_f64_vec().unwrap();
    let mut r = vec![("y", v(&f.y))];
    if let Some(dy) = t("dy") {
        let g = layer_backward(&x, &w, p, &f, &dy).unwrap();
        r.extend([
            ("dx", v(&g.dx)),
            ("dw_qkv", v(&g.dw_qkv)),
            ("dw_o", v(&g.dw_o)),
        ]);
        r.extend(g.db_qkv.as_ref().map(|b| ("db_qkv", v(b))));
        r.extend(g.db_o.as_ref().map(|b| ("db_o", v(b))));
        r.extend(g.drel_bias.as_ref().map(|b| ("drel_bias", v(b))));
    }
    r
}

/// The outputs are exactly the library's names, each within 1e-6 of its values (the same
/// computation in another process).
fn assert_matches(out: &Outputs, want: &[(&'static str, Vec<f64>)]) {
    let mut names: Vec<&str> = out.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = want.iter().map(|w| w.0).collect();
    expected.sort_unstable();
    assert_eq!(names, expected);
    for (name, vals) in want {
        let err = rel(&out[*name].2, vals, norm(vals));
        assert!(err <= 1e-6, "{name}: {err:.3e} from the library's");
    }
}

#[test]
fn layer_forward_and_backward_through_the_file() {
    let mut rng = StdRng::seed_from_u64(6701);
    let dir = Dir::new();
    let mut inputs = layer_inputs(&mut rng, Dtype::F32, true, true);
    let pos: Vec<i32> = (0..18).map(|i| (i * 37) % 101).collect();
    let mut positions = int32("positions", &pos);
    positions.shape = vec![2, 9];
    inputs.push(positions);
    let out = run(
        &dir,
        &inputs,
        &[
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--rope",
            "half",
            "--rope-base",
            "500",
            "--causal",
        ],
    );
    assert_eq!(out["y"].0, vec![2, 9, 12]);
    assert_eq!(out["dw_qkv"].0, vec![12, 48]);
    let p = LayerParams::new(4, 2)
        .rope(Rope::new(RopeStyle::Half).base(500.0))
        .positions(pos)
        .attention(AttentionParams::default().causal());
    assert_matches(&out, &library(&inputs, &p));

    // A relative-position table [heads, 2L - 1] with L = 4 (shorter than the sequences, so the
    // clamp is exercised): drel_bias comes out beside the other gradients.
    let mut inputs = layer_inputs(&mut rng, Dtype::F32, true, true);
    inputs.push(random(&mut rng, "rel_bias", &[4, 7], Dtype::F32));
    let out = run(&dir, &inputs, &["--heads", "4", "--heads-kv", "2"]);
    assert_eq!(out["drel_bias"].0, vec![4, 7]);
    assert!(out["drel_bias"].2.iter().any(|&g| g != 0.0));
    let att = AttentionParams {
        rel_bias: find(&inputs, "rel_bias").map(tensor),
        ..Default::default()
    };
    let p = LayerParams::new(4, 2).attention(att);
    assert_matches(&out, &library(&inputs, &p));

    // bf16, interleaved over 4 of the 6 dims, no biases, forward only.
    let inputs = layer_inputs(&mut rng, Dtype::BF16, false, false);
    let out = run(
        &dir,
        &inputs,
        &[
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--rope",
            "interleaved",
            "--rope-dim",
            "4",
        ],
    );
    assert_eq!(out["y"].1, Dtype::BF16);
    let p = LayerParams::new(4, 2).rope(Rope::new(RopeStyle::Interleaved).dim(4));
    assert_matches(&out, &library(&inputs, &p));
}

/// Exit status 2, every needle in the message, nothing written.
fn expect_error(inputs: &[Input], opts: &[&str], needles: &[&str]) {
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, inputs);
    let mut args = vec!["run", "--input", s(&input), "--output", s(&output)];
    args.extend_from_slice(opts);
    let o = flashattn(&args);
    assert_eq!(o.status.code(), Some(2), "exit status");
    let err = stderr(&o);
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!output.exists(), "an output file was left behind");
}

#[test]
fn layer_errors_name_the_argument_and_leave_no_output() {
    let mut rng = StdRng::seed_from_u64(6702);
    let good = layer_inputs(&mut rng, Dtype::F32, true, true);
    let heads = ["--heads", "4", "--heads-kv", "2"];
    expect_error(&good, &[], &["--heads"]);
    expect_error(
        &good,
        &["--heads", "4", "--heads-kv", "2", "--rope-dim", "4"],
        &["--rope-dim", "--rope"],
    );
    expect_error(&good, &["--heads", "4", "--heads-kv", "3"], &["heads_kv"]);
    expect_error(
        &good,
        &["--heads", "4", "--diagonal", "2"],
        &["--diagonal", "`x`"],
    );
    expect_error(
        &good,
        &[
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--rope",
            "half",
            "--rope-dim",
            "5",
        ],
        &["rope_dim"],
    );
    expect_error(
        &good,
        &["--heads", "4", "--heads-kv", "2", "--layout", "bhnd"],
        &["--layout"],
    );
    let q = vec![random(&mut rng, "q", &[1, 4, 2, 8], Dtype::F32)];
    expect_error(&q, &["--heads", "2"], &["--heads", "`x`"]);
    let with = |name: &'static str, shape: &[usize], dtype: Dtype, rng: &mut StdRng| {
        let mut v: Vec<Input> = good
            .iter()
            .filter(|x| x.name != name)
            .map(|x| Input {
                name: x.name,
                shape: x.shape.clone(),
                dtype: x.dtype,
                values: x.values.clone(),
            })
            .collect();
        v.push(random(rng, name, shape, dtype));
        v
    };
    expect_error(
        &with("w_qkv", &[12, 47], Dtype::F32, &mut rng),
        &heads,
        &["w_qkv"],
    );
    expect_error(
        &with("w_o", &[24, 11], Dtype::F32, &mut rng),
        &heads,
        &["w_o"],
    );
    expect_error(
        &with("b_qkv", &[47], Dtype::F32, &mut rng),
        &heads,
        &["b_qkv"],
    );
    expect_error(
        &with("b_o", &[12], Dtype::F16, &mut rng),
        &heads,
        &["b_o", "f16"],
    );
    expect_error(
        &with("dy", &[2, 9, 11], Dtype::F32, &mut rng),
        &heads,
        &["dy"],
    );
    expect_error(
        &with("positions", &[2, 9], Dtype::F32, &mut rng),
        &heads,
        &["positions", "int32"],
    );
    expect_error(
        &with("q", &[2, 9, 4, 6], Dtype::F32, &mut rng),
        &heads,
        &["unexpected tensor `q`"],
    );
    expect_error(
        &with("rel_bias", &[4, 7], Dtype::F16, &mut rng),
        &heads,
        &["rel_bias", "f32"],
    );
    expect_error(
        &with("rel_bias", &[3, 7], Dtype::F32, &mut rng),
        &heads,
        &["rel_bias"],
    );
    let mut short = with("dy", &[2, 9, 12], Dtype::F32, &mut rng);
    short.push(int32("positions", &[0, 1, 2]));
    expect_error(&short, &heads, &["positions", "[2, 9]"]);
}
