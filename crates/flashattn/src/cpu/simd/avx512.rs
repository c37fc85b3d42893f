//! The AVX-512F level's kernels (which also run the AVX2 ones where a size wants them).

use super::{Kernels, TransposeBlock, checked};
use super::{elementwise, exp, lanes, softcap, transpose};
use half::f16;

use crate::cpu::convert;
use crate::cpu::decode::Level;
use crate::cpu::simd::exp::LANES;
use crate::cpu::simd::microkernel::{PanelKernels, avx512 as panels};

checked! {
    exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 = exp::avx512::exp2_shifted_sum;
    exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] =
        exp::avx512::exp2_shifted_panel;
    lane_max(s: &[f32]) -> [f32; LANES] = lanes::avx512::lane_max;
    scale_lanes(x: &mut [f32], f: &[f32; LANES]) = lanes::avx512::scale_lanes;
    lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] = lanes::avx512::lane_lse;
    softcap(x: &mut [f32], cap: f32, deriv: Option<&mut [f32]>) = softcap::avx512::softcap;
    dot(a: &[f32], b: &[f32]) -> f32 = elementwise::avx512::dot;
    widen_f16(src: &[f16], dst: &mut [f32]) = convert::widen_f16_avx512;
    narrow_f16(src: &[f32], dst: &mut [f16]) = convert::narrow_f16_avx512;
}

const TRANSPOSE_BLOCKS: [(usize, TransposeBlock); 2] = [
    (16, transpose::avx512::block16),
    (8, transpose::avx2::block8),
];

pub(super) static KERNELS: Kernels = Kernels {
    exp2_shifted_sum,
    exp2_shifted_panel,
    lane_max,
    scale_lanes,
    lane_lse,
    softcap,
    dot,
    widen_f16,
    narrow_f16,
    transpose_blocks: &TRANSPOSE_BLOCKS,
    panels: PanelKernels {
        product: panels::product_any,
        product_exp: Some(panels::product_exp_any),
        grad: true,
    },
    decode: Level::Avx512,
};
