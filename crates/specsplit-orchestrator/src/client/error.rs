//! Errors of the orchestrator.

use tonic::Status;

/// Errors of the orchestrator.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// A worker could not be reached.
    #[error("{worker} worker at {addr} is unreachable: {reason}")]
    Unreachable {
        /// "draft" or "target".
        worker: &'static str,
        /// Its address.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// The draft and target cannot be paired.
    #[error("{0}")]
    Incompatible(String),
    /// A worker refused or failed a request.
    #[error("{worker} worker: {status}")]
    Rpc {
        /// "draft" or "target".
        worker: &'static str,
        /// The gRPC status.
        status: Status,
    },
    /// A worker did not answer in time.
    #[error("{worker} worker did not answer within {after_ms} ms")]
    Timeout {
        /// "draft" or "target".
        worker: &'static str,
        /// The time allowed, in ms.
        after_ms: u64,
    },
    /// The settings are invalid.
    #[error("invalid settings: {0}")]
    Config(String),
    /// A worker sent something that does not make sense.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The orchestrator's own runtime failed (it could not start, or a task of it panicked).
    #[error("orchestrator runtime: {0}")]
    Runtime(String),
}

/// Maps a worker's gRPC status to an [`OrchestratorError::Rpc`].
pub(super) fn rpc(worker: &'static str) -> impl Fn(Status) -> OrchestratorError {
    move |status| OrchestratorError::Rpc { worker, status }
}

/// `text` cut to a length fit for a log line or an error message.
pub(super) fn short(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_are_cut_for_messages() {
        let long = "x".repeat(1000);
        assert_eq!(short(&long).chars().count(), 201);
        assert_eq!(short("brief"), "brief");
    }
}
