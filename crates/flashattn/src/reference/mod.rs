//! Yardsticks: the f64 oracle (the truth for tests), the standard attention baseline, and the
//! machine's f32 GEMM rate (the ceiling of the CPU benchmarks).

pub mod ceiling;
pub mod oracle;
pub mod standard;
