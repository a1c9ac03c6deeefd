//! Engine errors, each tied to the gRPC status code a client should see.

use specsplit_models::ModelError;

/// An error from a draft or target engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed or exceeds a configured limit (→ INVALID_ARGUMENT).
    #[error("{0}")]
    InvalidArgument(String),
    /// The request does not match the session's state (→ FAILED_PRECONDITION); the caller
    /// should resend the full prompt.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request names a session bound to a different secret (→ PERMISSION_DENIED).
    #[error("{0}")]
    PermissionDenied(String),
    /// Serving the request would exceed the memory budget or session limit (→ RESOURCE_EXHAUSTED).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The request's deadline passed before its work was done (→ DEADLINE_EXCEEDED); the work
    /// stopped at a checkpoint and the session holds what was done before it.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The model failed (→ INTERNAL).
    #[error("model failure: {0}")]
    Model(#[from] ModelError),
    /// A tensor operation failed (→ INTERNAL).
    #[error("tensor failure: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The KV cache refused an operation (→ INTERNAL; limits are checked before).
    #[error("cache failure: {0}")]
    Cache(#[from] specsplit_core::cache::CacheError),
}

/// Marker in the message of every FAILED_PRECONDITION answer after which a client should resend
/// its full context (the session is not cached here, or its cached length differs from the
/// caller's): the original SpecSplit client retries with the full prompt only when the status
/// message contains it.
pub const CACHE_EVICTED_MARKER: &str = "CACHE_EVICTED_DELTA_ONLY";

impl From<EngineError> for tonic::Status {
    fn from(e: EngineError) -> Self {
        let msg = e.to_string();
        match e {
            EngineError::InvalidArgument(_) => tonic::Status::invalid_argument(msg),
            EngineError::FailedPrecondition(_) => tonic::Status::failed_precondition(msg),
            EngineError::ResourceExhausted(_) => tonic::Status::resource_exhausted(msg),
            EngineError::PermissionDenied(_) => tonic::Status::permission_denied(msg),
            EngineError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(msg),
            _ => tonic::Status::internal(msg),
        }
    }
}
