//! Yardsticks: the f64 oracles of softmax and linear attention (the truth for tests), the standard attention baseline, the
//! fused layer as separate calls, and the machine's f32 GEMM rate (the ceiling of the CPU benchmarks).

pub mod ceiling;
pub mod linear;
pub mod oracle;
pub mod standard;
pub mod unfused_layer;
