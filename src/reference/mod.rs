//! Yardsticks: the f64 oracle (the truth for tests) and the standard attention baseline.

pub mod oracle;
pub mod standard;
