//! The fused layer on the CPU against the composition of f64 oracles (projection, rotation,
//! attention, projection) for y and all five gradients: awkward small sizes, GQA, both rotary
//! conventions, a rotary dim below head_dim, given positions, causal, softcap, varlen and every
//! dtype; the six gradients (with the relative-position table's) against central differences;
//! the separate-calls yardstick of `bench --layer` against the same oracles; and a typed error
//! naming the argument for every mismatch.

mod common;

use common::layer::{LayerCase, LayerInputs, check, results};
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
        // Saved tensors of the wrong shape are typed errors, not panics.
        let mut bad = u.clone();
        bad.q = bad.attention.lse.clone();
        let e = unfused_layer::backward(&li.x, &li.w, &li.p, &bad, &li.dy).unwrap_err();
        assert!(e.argument().is_some(), "{e}");
        let f = LayerOutput {
            y: u.y,
            qkv: u.qkv,
            attention: u.attention,
        };
        check(case, &li, &results(&f, &g));
    }
}

/// The tensor of `li` that gradient `NAMES_FD[i]` is of.
fn slot(li: &mut LayerInputs, i: usize) -> &mut Tensor {
    match i {
        0 => &mut li.x,
        1 => &mut li.w.w_qkv,
        2 => li.w.b_qkv.as_mut().expect("b_qkv"),
        3 => &mut li.w.w_o,
        4 => li.w.b_o.as_mut().expect("b_o"),
        _ => li.p.attention.rel_bias.as_mut().expect("rel_bias"),
    }
}

const NAMES_FD: [&str; 6] = ["dx", "dw_qkv", "db_qkv", "dw_o", "db_o", "drel_bias"];

/// `Σ dy·y` in f64.
fn loss(li: &LayerInputs) -> f64 {
    let y = layer_forward(&li.x, &li.w, &li.p).expect("layer forward");
    let (y, dy) = (y.y.to_f64_vec().unwrap(), li.dy.to_f64_vec().unwrap());
    y.iter().zip(&dy).map(|(a, b)| a * b).sum()
}

/// Central differences of `Σ dy·y` in every element of every input, with step `h`.
fn central_differences(li: &mut LayerInputs, h: f32) -> Vec<Vec<f64>> {
    (0..NAMES_FD.len())
        .map(|i| {
            let t = slot(li, i).clone();
            let (shape, base) = (t.shape().to_vec(), t.to_f32_vec().unwrap());
            let mut at = |j: usize, step: f32| {
                let mut v = base.clone();
                v[j] += step;
                *slot(li, i) = Tensor::from_vec(v, &shape).unwrap();
                loss(li)
            };
            let fd = (0..base.len())
                .map(|j| (at(j, h) - at(j, -h)) / (2.0 * f64::from(h)))
                .collect();
            *slot(li, i) = t;
            fd
        })
        .collect()
}

/// The step of the central differences: in f32 the truncation error (~h²) and the forward's
/// rounding over 2h (~1e-7/h) are both near 1e-5 of the gradients' norms at h = 1e-2, the best
/// of 3e-2, 1e-2, 3e-3 and 1e-3 tried (worst seen 4.4e-5 for the nonlinear inputs, 3e-6 for
/// w_o and b_o, in which the loss is linear).
const FD_STEP: f32 = 1e-2;
/// A wrong term of a gradient shows as an error of order 0.1-1; this is ~4.5x the worst seen.
const FD_TOL: f64 = 2e-4;

/// layer_backward's six gradients against central differences of `Σ dy·y` on tiny f32 shapes
/// with random inputs: GQA, both rotary conventions, given positions, causal, softcap, and a
/// relative-position table shorter than the sequences.
#[test]
fn gradients_match_central_differences() {
    set_poison_outputs(true);
    let cases = [
        LayerCase::new(1, 5, 6, 4)
            .heads(2, 1)
            .rope(RopeStyle::Half, None),
        LayerCase::new(2, 4, 5, 6)
            .heads(2, 2)
            .rope(RopeStyle::Interleaved, Some(4))
            .positions()
            .causal()
            .softcap(3.0),
        LayerCase::new(1, 1, 6, 4)
            .varlen(&[3, 5])
            .heads(2, 1)
            .rope(RopeStyle::Half, Some(2))
            .positions(),
    ];
    let mut worst = 0f64;
    for (n, case) in cases.iter().enumerate() {
        let mut rng = rng(674_000 + n as u64);
        let mut li = case.inputs(&mut rng);
        let l = 3;
        let table = common::values(&mut rng, case.heads * (2 * l - 1), 1.0);
        li.p.attention.rel_bias = Some(Tensor::from_vec(table, &[case.heads, 2 * l - 1]).unwrap());
        let f = layer_forward(&li.x, &li.w, &li.p).unwrap();
        let g = layer_backward(&li.x, &li.w, &li.p, &f, &li.dy).unwrap();
        let got = [
            Some(&g.dx),
            Some(&g.dw_qkv),
            g.db_qkv.as_ref(),
            Some(&g.dw_o),
            g.db_o.as_ref(),
            g.drel_bias.as_ref(),
        ];
        let fd = central_differences(&mut li, FD_STEP);
        for (i, (t, fd)) in got.iter().zip(&fd).enumerate() {
            let t = t.expect("every gradient").to_f64_vec().unwrap();
            let err = common::rel(&t, fd);
            assert!(
                err <= FD_TOL,
                "{}: {} {err:.3e} from central differences",
                case.describe(),
                NAMES_FD[i]
            );
            worst = worst.max(err);
        }
    }
    println!("layer central differences: worst relative error {worst:.3e}");
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
