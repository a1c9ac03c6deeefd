//! specsplit-core: the exact math of speculative decoding, free of any networking.
//!
//! - [`tree`]: flattened breadth-first token trees, conversion and validation.
//! - [`mask`]: tree-attention masks and position ids.
//! - [`sampling`]: temperature / top-k / top-p transforms shared by draft and target.
//! - [`verify`]: greedy and lossless stochastic verification of a tree.
//! - [`device`]: binding a GPU context to the calling thread.
//! - [`drafter`]: model-free drafters (n-gram prompt lookup, suffix decoding).
//! - [`cache`]: pre-allocated per-session KV caches with O(1) rollback and path compaction.
//! - [`load`]: load levels, batches of concurrent sessions grouped by doubling size.

pub mod cache;
pub mod device;
pub mod drafter;
pub mod load;
pub mod mask;
pub mod sampling;
pub mod tree;
pub mod verify;
