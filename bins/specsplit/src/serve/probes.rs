//! `/health` (200 while the process runs) and `/ready` (200 while the workers answer a ping,
//! 503 otherwise). A ping's result is kept for [`READY_TTL`], so that probes, however often
//! they come, ping the workers at most once in that time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use specsplit_orchestrator::Orchestrator;
use tokio::sync::Mutex;

/// How long a ping's result answers `/ready`.
pub const READY_TTL: Duration = Duration::from_secs(1);
/// Longest wait for the workers' answer to a ping.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// The workers' readiness, checked by pinging them at most once per [`READY_TTL`].
pub struct Readiness {
    orch: Orchestrator,
    /// When the last ping ended and what it found (`Err`: why the workers are not ready).
    last: Mutex<Option<(Instant, Result<(), String>)>>,
}

impl Readiness {
    /// The readiness of `orch`'s workers.
    pub fn new(orch: Orchestrator) -> Self {
        Self {
            orch,
            last: Mutex::new(None),
        }
    }

    /// Whether the workers answer: the last ping's result where it is recent, else a new
    /// ping's (probes arriving during a ping wait for its result).
    pub async fn check(&self) -> Result<(), String> {
        let mut last = self.last.lock().await;
        if let Some((at, result)) = last.as_ref() {
            if at.elapsed() < READY_TTL {
                return result.clone();
            }
        }
        let result = match tokio::time::timeout(PING_TIMEOUT, self.orch.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "the workers did not answer a ping within {} s",
                PING_TIMEOUT.as_secs()
            )),
        };
        *last = Some((Instant::now(), result.clone()));
        result
    }
}

/// `GET /health`: the process is live.
pub async fn health() -> &'static str {
    "live\n"
}

/// `GET /ready`: 200 `ready` while the workers answer a ping, else 503 with the reason.
pub async fn ready(State(r): State<Arc<Readiness>>) -> impl IntoResponse {
    match r.check().await {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}
