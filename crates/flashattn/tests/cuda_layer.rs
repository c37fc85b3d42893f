//! The fused layer on the GPU (cuBLAS GEMMs, the rotation kernel, the attention reading the
//! packed buffer through strides), and the bench's separate-calls yardstick on the GPU
//! (`reference::unfused_layer`: the 2-D copies, rotated copies, concatenation), against the
//! composition of f64 oracles, with the bounds of `tests/cpu_layer.rs`: f32 ≤ 1e-5 relative,
//! f16/bf16 within 2× the plain same-precision composition. Needs a CUDA device:
//! `cargo test --release --test cuda_layer -- --include-ignored`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, poison};
use common::layer::{LayerCase, LayerInputs, check, results};
use common::rng;
use flashattn::reference::unfused_layer;
use flashattn::{
    DType, Device, LayerGradients, LayerOutput, LayerWeights, RopeStyle, layer_backward,
    layer_forward,
};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn on_gpu(li: &LayerInputs) -> LayerInputs {
    let up = |t: &flashattn::Tensor| t.to_device(GPU).expect("upload");
    LayerInputs {
        x: up(&li.x),
        w: LayerWeights {
            w_qkv: up(&li.w.w_qkv),
            b_qkv: li.w.b_qkv.as_ref().map(up),
            w_o: up(&li.w.w_o),
            b_o: li.w.b_o.as_ref().map(up),
        },
        p: li.p.clone(),
        dy: up(&li.dy),
    }
}

/// One way to run the layer's forward and backward.
type Layer = fn(&LayerInputs) -> (LayerOutput, LayerGradients);

/// The fused layer.
fn fused(i: &LayerInputs) -> (LayerOutput, LayerGradients) {
    let f = layer_forward(&i.x, &i.w, &i.p).expect("layer forward");
    let g = layer_backward(&i.x, &i.w, &i.p, &f, &i.dy).expect("layer backward");
    (f, g)
}

/// The same steps as separate calls, their saved Q and K on the GPU too, as the fused results.
fn separate(i: &LayerInputs) -> (LayerOutput, LayerGradients) {
    let u = unfused_layer::forward(&i.x, &i.w, &i.p).expect("unfused forward");
    let g = unfused_layer::backward(&i.x, &i.w, &i.p, &u, &i.dy).expect("unfused backward");
    assert!([&u.qkv, &u.q, &u.k].iter().all(|t| t.device() == GPU));
    let f = LayerOutput {
        y: u.y,
        qkv: u.qkv,
        attention: u.attention,
    };
    (f, g)
}

fn run_cases(test: &str, seed0: u64, cases: &[LayerCase], layer: Layer) {
    poison();
    let mut worst = 0f64;
    for (n, case) in cases.iter().enumerate() {
        let li = case.inputs(&mut rng(seed0 + n as u64));
        let (f, g) = layer(&on_gpu(&li));
        assert_eq!(f.y.device(), GPU);
        assert_eq!(g.dx.device(), GPU);
        let got = results(&f, &g);
        let ratio = check(case, &li, &got);
        worst = worst.max(ratio);
        assert_eq!(f.qkv.to_device(Device::Cpu).unwrap().device(), Device::Cpu);
    }
    println!(
        "{test}: {} cases, worst error / bound {worst:.3}",
        cases.len()
    );
}

/// Awkward sizes, GQA, every dtype, causal; the rotary conventions and dims, given positions.
#[test]
#[ignore = "needs a CUDA device"]
fn sizes_groups_and_rope() {
    let mut cases = Vec::new();
    let shapes = [
        (1, 1, 3, 2, (1, 1)),
        (2, 7, 5, 6, (2, 1)),
        (3, 5, 17, 8, (3, 3)),
        (2, 33, 40, 16, (6, 2)),
    ];
    for (n, &(b, len, m, d, (h, hk))) in shapes.iter().enumerate() {
        let c = LayerCase::new(b, len, m, d).heads(h, hk);
        cases.push(c.clone().dtype(DTYPES[n % 3]));
        cases.push(c.no_biases().causal().dtype(DTYPES[(n + 1) % 3]));
    }
    for (n, style) in [RopeStyle::Half, RopeStyle::Interleaved]
        .into_iter()
        .enumerate()
    {
        for (i, dim) in [None, Some(4)].into_iter().enumerate() {
            let c = LayerCase::new(2, 11, 20, 8)
                .heads(4, 2)
                .rope(style, dim)
                .dtype(DTYPES[(n + i) % 3]);
            cases.push(c.clone().positions().causal());
            cases.push(c.dtype(DTYPES[(n + i + 1) % 3]));
        }
    }
    run_cases("gpu layer sizes and rope", 680_000, &cases, fused);
}

/// Head dims the tensor-core kernels take (64, 128), longer sequences, softcap, varlen.
#[test]
#[ignore = "needs a CUDA device"]
fn tensor_core_shapes_and_options() {
    let cases = vec![
        LayerCase::new(2, 130, 96, 64)
            .heads(4, 2)
            .rope(RopeStyle::Half, None)
            .causal()
            .dtype(DType::BF16),
        LayerCase::new(1, 77, 128, 128)
            .heads(2, 1)
            .rope(RopeStyle::Interleaved, Some(64))
            .positions()
            .dtype(DType::F16),
        LayerCase::new(2, 65, 64, 64)
            .heads(2, 2)
            .rope(RopeStyle::Half, None)
            .softcap(3.0),
        LayerCase::new(1, 1, 48, 32)
            .varlen(&[40, 1, 77])
            .heads(4, 1)
            .causal()
            .rope(RopeStyle::Half, Some(16))
            .dtype(DType::BF16),
    ];
    run_cases("gpu layer tensor-core shapes", 681_000, &cases, fused);
}

/// The bench's yardstick on the GPU meets the same bounds: both rotary conventions and dims,
/// biases or none, GQA, f32, f16 and bf16, no rotary embedding (Q and K read through strides),
/// tensor-core head dims, varlen; a saved tensor of the wrong shape is a typed error.
#[test]
#[ignore = "needs a CUDA device"]
fn separate_calls_on_the_gpu() {
    let cases = vec![
        LayerCase::new(2, 11, 20, 8)
            .heads(4, 2)
            .rope(RopeStyle::Half, None)
            .causal(),
        LayerCase::new(2, 11, 20, 8)
            .heads(4, 2)
            .rope(RopeStyle::Interleaved, Some(4))
            .positions()
            .dtype(DType::BF16),
        LayerCase::new(1, 9, 12, 6)
            .heads(3, 1)
            .rope(RopeStyle::Interleaved, None)
            .no_biases(),
        LayerCase::new(2, 7, 10, 4).dtype(DType::F16),
        LayerCase::new(2, 130, 96, 64)
            .heads(4, 2)
            .rope(RopeStyle::Half, None)
            .causal()
            .dtype(DType::BF16),
        LayerCase::new(1, 77, 128, 128)
            .heads(2, 1)
            .rope(RopeStyle::Interleaved, Some(64))
            .positions(),
        LayerCase::new(1, 1, 48, 32)
            .varlen(&[40, 1, 77])
            .heads(4, 1)
            .rope(RopeStyle::Half, Some(16))
            .causal()
            .dtype(DType::BF16),
    ];
    run_cases("gpu separate calls", 682_000, &cases, separate);
    let li = on_gpu(&cases[0].inputs(&mut rng(682_100)));
    let mut bad = unfused_layer::forward(&li.x, &li.w, &li.p).expect("unfused forward");
    bad.q = bad.attention.lse.clone();
    let e = unfused_layer::backward(&li.x, &li.w, &li.p, &bad, &li.dy).unwrap_err();
    assert!(e.argument().is_some(), "{e}");
}
