//! specsplit-workers: the draft and target engines and the gRPC services that expose them.
//!
//! The engines ([`draft::DraftEngine`], [`target::TargetEngine`]) own the per-session KV caches
//! and call into `specsplit-core` for the math; the services ([`service`]) translate the wire
//! protocol, enforce limits and map errors to gRPC status codes. No math lives in the services.

pub mod batcher;
pub mod cli;
pub mod config;
pub mod draft;
pub mod draft_batcher;
pub mod draft_chain;
pub mod endpoints;
pub mod engine_session;
pub mod error;
pub mod launch;
pub mod load_gate;
pub mod metrics;
pub mod model_free;
mod pass_queue;
pub mod predraft;
pub mod service;
pub mod session;
pub mod spare;
pub mod target;
#[cfg(test)]
pub(crate) mod test_models;

pub use error::EngineError;
