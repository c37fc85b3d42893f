//! The portable level's kernels: plain Rust, any CPU.

use super::Kernels;
use super::{elementwise, exp, lanes, softcap};
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
    transpose_blocks: &[],
    panels: PanelKernels {
        product: panels::product,
        product_exp: None,
        grad: false,
    },
    #[cfg(target_arch = "x86_64")]
    decode: Level::Panels,
};
