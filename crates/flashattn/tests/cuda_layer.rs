//! The fused layer on the GPU (cuBLAS GEMMs, the rotation kernel, the attention reading the
//! packed buffer through strides) against the composition of f64 oracles, with the bounds of
//! `tests/cpu_layer.rs`: f32 ≤ 1e-5 relative, f16/bf16 within 2× the plain same-precision
//! composition. Needs a CUDA device: `cargo test --release --test cuda_layer -- --include-ignored`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, poison};
use common::layer::{LayerCase, LayerInputs, check, results};
use common::rng;
use flashattn::{DType, Device, LayerWeights, RopeStyle, layer_backward, layer_forward};

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

fn run_cases(test: &str, seed0: u64, cases: &[LayerCase]) {
    poison();
    let mut worst = 0f64;
    for (n, case) in cases.iter().enumerate() {
        let li = case.inputs(&mut rng(seed0 + n as u64));
        let g_in = on_gpu(&li);
        let f = layer_forward(&g_in.x, &g_in.w, &g_in.p).expect("layer forward");
        let g = layer_backward(&g_in.x, &g_in.w, &g_in.p, &f, &g_in.dy).expect("layer backward");
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
    run_cases("gpu layer sizes and rope", 680_000, &cases);
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
    run_cases("gpu layer tensor-core shapes", 681_000, &cases);
}
