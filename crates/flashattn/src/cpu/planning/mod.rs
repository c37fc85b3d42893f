//! How a call is planned before any kernel runs: the tile sizes (`tile_config`), the forward's
//! query blocks (`query_blocks`), and how the tasks reach the threads (`schedule`).

pub(crate) mod query_blocks;
pub(crate) mod schedule;
pub(crate) mod tile_config;
