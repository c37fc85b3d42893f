//! Ring attention (context parallelism): the sequence is sharded over P ranks, each holding its
//! queries and one block of keys and values; the blocks travel around the ring while each rank
//! attends its queries to the block it holds, and the partial results merge exactly by their
//! log-sum-exp ([`merge_partials`]).
//!
//! Shards are zigzag ([`zigzag_shard`]): the sequence is cut into 2P chunks and rank r holds
//! chunks r and 2P − 1 − r, so that under a causal mask every rank has the same work. A chunk of
//! queries meets a chunk of keys through the core call with [`AttentionParams::diagonal`] set to
//! their distance, so causal and sliding windows, ALiBi and the soft cap see global positions;
//! pairs no query of which sees a key are skipped.
//!
//! [`ring_forward`] and [`ring_backward`] run one rank's part over a [`RingComm`]: a block is sent
//! on before the rank computes with it, and in the backward its dK and dV travel with it and reach
//! its owner after the last step. [`LocalRing`] is a ring of in-memory endpoints, one per thread;
//! [`simulate_forward`] and [`simulate_backward`] shard whole tensors, run every rank on a thread of
//! its own and gather the results: the schedule and merge a ring of GPUs runs, on the CPU.
//!
//! [`AttentionParams::diagonal`]: crate::AttentionParams::diagonal

mod comm;
mod merge;
mod rank;
mod schedule;
mod shard;
mod simulate;

pub use comm::{LocalRing, RingComm};
pub use merge::merge_partials;
pub use rank::{ring_backward, ring_forward};
pub use shard::{zigzag_gather, zigzag_shard};
pub use simulate::{simulate_backward, simulate_forward};
