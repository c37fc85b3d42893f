//! The portable level's kernels: plain Rust, any CPU.

use super::Kernels;
use super::{elementwise, exp, lanes, softcap};
use crate::cpu::convert;
#[cfg(target_arch = "x86_64")]
use crate::cpu::decode::Level;
use crate::cpu::simd::microkernel::{PanelKernels, portable as panels};

pub(super) static KERNELS: Kernels = Kernels {
    exp2_shifted_sum: exp::portable::exp2_shifted_sum,
    exp2_shifted_panel: exp::portable::exp2_shifted_panel,
    lane_max: lanes::portable::lane_max,
    scale_lanes: lanes::portable::scale_lanes,
    lane_lse: lanes::portable::lane_lse,
    softcap: softcap::portable::softcap,
    dot: elementwise::portable::dot,
    widen_f16: convert::widen_f16_half,
    narrow_f16: convert::narrow_f16_half,
    transpose_blocks: &[],
    panels: PanelKernels {
        product: panels::product,
        product_exp: None,
        grad: false,
    },
    #[cfg(target_arch = "x86_64")]
    decode: Level::Panels,
};
