//! The AVX2 level's kernels (with FMA and F16C); the rest of the softmax's lane operations are
//! the portable ones, which the compiler vectorizes.

use super::{Kernels, TransposeBlock, checked};
use super::{elementwise, exp, lanes, softcap, transpose};
use crate::cpu::convert;
use crate::cpu::decode::Level;
use crate::cpu::simd::exp::LANES;
use crate::cpu::simd::microkernel::{PanelKernels, avx2 as panels};

checked! {
    exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 = exp::avx2::exp2_shifted_sum;
    exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] =
        exp::avx2::exp2_shifted_panel;
    lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] = lanes::avx2::lane_lse;
    softcap(x: &mut [f32], cap: f32, deriv: Option<&mut [f32]>) = softcap::avx2::softcap;
}

const TRANSPOSE_BLOCKS: [(usize, TransposeBlock); 1] = [(8, transpose::avx2::block8)];

pub(super) static KERNELS: Kernels = Kernels {
    exp2_shifted_sum,
    exp2_shifted_panel,
    lane_max: lanes::portable::lane_max,
    scale_lanes: lanes::portable::scale_lanes,
    lane_lse,
    softcap,
    dot: elementwise::portable::dot,
    widen_f16: convert::widen_f16_half,
    narrow_f16: convert::narrow_f16_half,
    transpose_blocks: &TRANSPOSE_BLOCKS,
    panels: PanelKernels {
        product: panels::product_panels,
        product_exp: None,
        grad: false,
    },
    decode: Level::Avx2,
};
