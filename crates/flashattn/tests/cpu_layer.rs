//! The fused layer on the CPU against the composition of f64 oracles (projection, rotation,
//! attention, projection) for y and all five gradients: awkward small sizes, GQA, both rotary
//! conventions, a rotary dim below head_dim, given positions, causal, softcap, varlen and every
//! dtype; and a typed error naming the argument for every mismatch.

mod common;

use common::layer::{LayerCase, check, results};
use common::rng;
use flashattn::internals::set_poison_outputs;
use flashattn::reference::unfused_layer;
use flashattn::{
    AttentionParams, DType, LayerOutput, LayerParams, LayerWeights, Rope, RopeStyle, Tensor,
    layer_backward, layer_forward,
};

fn run_cases(test: &str, seed0: u64, cases: &[LayerCase]) {
    set_poison_outputs(true);
    let mut worst = 0f64;
    for (n, case) in cases.iter().enumerate() {
        let li = case.inputs(&mut rng(seed0 + n as u64));
        let f = layer_forward(&li.x, &li.w, &li.p).expect("layer forward");
        let g = layer_backward(&li.x, &li.w, &li.p, &f, &li.dy).expect("layer backward");
        worst = worst.max(check(case, &li, &results(&f, &g)));
    }
    println!(
        "{test}: {} cases, worst error / bound {worst:.3}",
        cases.len()
    );
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Sizes of one and odd sizes, GQA/MQA, with and without biases.
#[test]
fn awkward_sizes_and_groups() {
    let shapes = [
        (1, 1, 3, 2, (1, 1)),
        (2, 7, 5, 6, (2, 1)),
        (1, 13, 24, 8, (4, 2)),
        (3, 5, 17, 4, (3, 3)),
        (2, 33, 40, 16, (6, 2)),
    ];
    let mut cases = Vec::new();
    for (n, &(b, len, m, d, (h, hk))) in shapes.iter().enumerate() {
        let c = LayerCase::new(b, len, m, d).heads(h, hk);
        cases.push(c.clone().dtype(DTYPES[n % 3]));
        cases.push(c.no_biases().causal().dtype(DTYPES[(n + 1) % 3]));
    }
    cases.push(LayerCase::new(2, 9, 7, 1).heads(3, 1));
    run_cases("layer sizes", 670_000, &cases);
}

/// Both conventions, the whole head or part of it, positions given or counted, causal or not.
#[test]
fn rotary_conventions_dims_and_positions() {
    let mut cases = Vec::new();
    for (n, style) in [RopeStyle::Half, RopeStyle::Interleaved]
        .into_iter()
        .enumerate()
    {
        for (i, dim) in [None, Some(4), Some(2)].into_iter().enumerate() {
            let c = LayerCase::new(2, 11, 20, 8)
                .heads(4, 2)
                .rope(style, dim)
                .dtype(DTYPES[(n + i) % 3]);
            cases.push(c.clone());
            cases.push(c.clone().positions().causal());
            cases.push(c.positions().heads(2, 1).dtype(DType::F32));
        }
    }
    run_cases("layer rope", 671_000, &cases);
}

/// The attention's options pass through: softcap, causal, packed sequences (positions counted
/// from each sequence's start).
#[test]
fn attention_options_and_varlen() {
    let cases = vec![
        LayerCase::new(2, 9, 12, 8)
            .softcap(2.0)
            .rope(RopeStyle::Half, None),
        LayerCase::new(1, 1, 12, 8)
            .varlen(&[5, 1, 12])
            .heads(4, 1)
            .causal()
            .rope(RopeStyle::Interleaved, Some(6)),
        LayerCase::new(1, 1, 10, 4)
            .varlen(&[3, 8])
            .positions()
            .rope(RopeStyle::Half, None)
            .dtype(DType::BF16),
    ];
    run_cases("layer options", 672_000, &cases);
}

/// The bench's yardstick, the same steps as separate calls (`reference::unfused_layer`), meets
/// the same bounds against the oracle composition.
#[test]
fn separate_calls_meet_the_same_bounds() {
    set_poison_outputs(true);
    let cases = [
        LayerCase::new(2, 11, 20, 8)
            .heads(4, 2)
            .rope(RopeStyle::Half, None)
            .causal(),
        LayerCase::new(1, 9, 12, 6)
            .heads(3, 1)
            .rope(RopeStyle::Interleaved, Some(4))
            .positions()
            .dtype(DType::BF16),
        LayerCase::new(1, 1, 12, 8)
            .varlen(&[5, 1, 12])
            .rope(RopeStyle::Half, Some(6))
            .no_biases(),
        LayerCase::new(2, 7, 10, 4).dtype(DType::F16),
    ];
    for (n, case) in cases.iter().enumerate() {
        let li = case.inputs(&mut rng(673_000 + n as u64));
        let u = unfused_layer::forward(&li.x, &li.w, &li.p).expect("unfused forward");
        let g = unfused_layer::backward(&li.x, &li.w, &li.p, &u, &li.dy).expect("unfused backward");
        let f = LayerOutput {
            y: u.y,
            qkv: u.qkv,
            attention: u.attention,
        };
        check(case, &li, &results(&f, &g));
    }
}

/// Every mismatch is a typed error naming the argument; nothing panics.
#[test]
fn every_mismatch_names_its_argument() {
    let t = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        Tensor::from_vec(
            (0..n).map(|i| (i as f32 * 0.61).sin()).collect::<Vec<_>>(),
            shape,
        )
        .unwrap()
    };
    let (m, h, hk, d) = (6, 2, 1, 4);
    let cols = (h + 2 * hk) * d;
    let x = t(&[2, 3, m]);
    let w = LayerWeights {
        w_qkv: t(&[m, cols]),
        b_qkv: Some(t(&[cols])),
        w_o: t(&[h * d, m]),
        b_o: Some(t(&[m])),
    };
    let p = LayerParams::new(h, hk);
    let arg = |x: &Tensor, w: &LayerWeights, p: &LayerParams| {
        layer_forward(x, w, p).unwrap_err().argument()
    };
    assert_eq!(arg(&t(&[6, m]), &w, &p), Some("x"));
    assert_eq!(arg(&x, &w, &LayerParams::new(0, 1)), Some("heads"));
    assert_eq!(arg(&x, &w, &LayerParams::new(2, 0)), Some("heads_kv"));
    assert_eq!(arg(&x, &w, &LayerParams::new(3, 2)), Some("heads_kv"));
    let with = |f: &dyn Fn(&mut LayerWeights)| {
        let mut w2 = w.clone();
        f(&mut w2);
        arg(&x, &w2, &p)
    };
    assert_eq!(with(&|w| w.w_qkv = t(&[m + 1, cols])), Some("w_qkv"));
    assert_eq!(with(&|w| w.w_qkv = t(&[m, cols + 1])), Some("w_qkv"));
    assert_eq!(with(&|w| w.b_qkv = Some(t(&[cols - 1]))), Some("b_qkv"));
    assert_eq!(with(&|w| w.w_o = t(&[h * d, m + 1])), Some("w_o"));
    assert_eq!(with(&|w| w.w_o = t(&[h * d + 1, m])), Some("w_o"));
    assert_eq!(with(&|w| w.b_o = Some(t(&[1, m]))), Some("b_o"));
    let half = |t: Tensor| t.to_dtype(DType::F16).unwrap();
    assert_eq!(with(&|w| w.w_o = half(t(&[h * d, m]))), Some("w_o"));
    assert_eq!(with(&|w| w.b_qkv = Some(half(t(&[cols])))), Some("b_qkv"));
    for dim in [3, 6, 0] {
        let p = LayerParams::new(h, hk).rope(Rope::new(RopeStyle::Half).dim(dim));
        assert_eq!(arg(&x, &w, &p), Some("rope_dim"));
    }
    let p_base = LayerParams::new(h, hk).rope(Rope::new(RopeStyle::Half).base(-1.0));
    assert_eq!(arg(&x, &w, &p_base), Some("rope_base"));
    let p_pos = LayerParams::new(h, hk).positions(vec![0; 5]);
    assert_eq!(arg(&x, &w, &p_pos), Some("positions"));
    let p_var = LayerParams::new(h, hk)
        .attention(AttentionParams::default().varlen(vec![0, 6], vec![0, 6]));
    assert_eq!(arg(&x, &w, &p_var), Some("x"));
    let p_var = LayerParams::new(h, hk)
        .attention(AttentionParams::default().varlen(vec![0, 6], vec![0, 2, 6]));
    assert_eq!(arg(&t(&[6, m]), &w, &p_var), Some("cu_seqlens_k"));

    let f = layer_forward(&x, &w, &p).unwrap();
    let back = |dy: &Tensor, f: &flashattn::LayerOutput| {
        layer_backward(&x, &w, &p, f, dy).unwrap_err().argument()
    };
    assert_eq!(back(&t(&[2, 3, m + 1]), &f), Some("dy"));
    assert_eq!(back(&half(t(&[2, 3, m])), &f), Some("dy"));
    let mut bad = f.clone();
    bad.qkv = t(&[2, 3, cols - 1]);
    assert_eq!(back(&f.y, &bad), Some("qkv"));
    let mut bad = f.clone();
    bad.attention.out = t(&[2, 3, h + 1, d]);
    assert_eq!(back(&f.y, &bad), Some("out"));
    let mut bad = f.clone();
    bad.attention.lse = t(&[2, h, 4]);
    assert_eq!(back(&f.y, &bad), Some("lse"));
}
