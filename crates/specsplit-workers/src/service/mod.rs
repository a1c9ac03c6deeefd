//! gRPC services over the engines: request validation, session lookup, status codes,
//! telemetry, metrics, the standard health service, TLS and bearer-token authentication, TTL
//! sweeping, draining and graceful shutdown.
//!
//! One generic [`Worker`] holds what the two services share (the engine, its session store,
//! the limits, how model work runs); [`DraftWorker`] and [`TargetWorker`] are its gRPC
//! services over the draft and target engines.

mod deadline;
mod draft;
mod execution;
mod health;
mod info;
mod lifecycle;
mod model_free;
mod serve;
mod target;
mod token;
mod validate;
mod worker;

pub use draft::{serve_draft, serve_draft_with, DraftWorker};
pub use execution::{on_cuda, Execution, WorkPlacement, DEFAULT_SERVER_SPIN};
pub use info::WorkerInfo;
pub use lifecycle::Lifecycle;
pub use model_free::{serve_model_free_draft, ModelFreeDraftWorker};
pub use serve::ServeOptions;
pub use target::{serve_target, serve_target_with, TargetWorker};
pub use validate::MAX_ID_BYTES;
pub use worker::{Scrape, Worker};
