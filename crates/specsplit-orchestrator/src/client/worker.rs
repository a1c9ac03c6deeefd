//! Connections to the workers: gRPC channels, pings, and what the workers report.

use std::future::Future;
use std::time::Duration;

use specsplit_proto::auth::BearerToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use super::error::short;
use super::{ConnectOptions, OrchestratorError};

/// A channel to a worker, each call carrying the bearer token where one is configured.
pub(super) type Link = InterceptedService<Channel, BearerToken>;

/// Largest gRPC message sent or accepted (dense draft distributions are large).
pub(super) const MAX_MESSAGE_BYTES: usize = 512 << 20;
/// How long connecting to a worker and its first ping may take, each.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The request limits a worker reported in its ping (0 where it did not say).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct WorkerLimits {
    pub(super) max_context: usize,
    pub(super) max_prompt_len: usize,
    pub(super) max_tree_nodes: usize,
    pub(super) max_tree_depth: usize,
}

impl WorkerLimits {
    pub(super) fn of(p: &specsplit_proto::PingResponse) -> Self {
        let n = |v: i32| v.max(0) as usize;
        Self {
            max_context: n(p.max_context),
            max_prompt_len: n(p.max_prompt_len),
            max_tree_nodes: n(p.max_tree_nodes),
            max_tree_depth: n(p.max_tree_depth),
        }
    }
}

/// Pings a worker within [`CONNECT_TIMEOUT`].
pub(super) async fn ping<F, T>(
    worker: &'static str,
    addr: &str,
    call: F,
) -> Result<T, OrchestratorError>
where
    F: Future<Output = Result<tonic::Response<T>, Status>>,
{
    let unreachable = |reason: String| OrchestratorError::Unreachable {
        worker,
        addr: addr.to_string(),
        reason,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
            Err(OrchestratorError::Rpc { worker, status })
        }
        Ok(Err(s)) => {
            // A failed TLS handshake shows only in the status's causes.
            let reason = match std::error::Error::source(&s) {
                Some(cause) => format!("{}: {}", s.message(), causes(cause)),
                None => s.message().to_string(),
            };
            Err(unreachable(short(&reason)))
        }
        Err(_) => Err(unreachable(format!(
            "no answer to a ping within {} s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

/// Connects to the worker at `addr` as `opts` say (TLS, the bearer token).
pub(super) async fn channel(
    worker: &'static str,
    addr: &str,
    opts: &ConnectOptions,
) -> Result<Link, OrchestratorError> {
    let unreachable = |reason: String| OrchestratorError::Unreachable {
        worker,
        addr: addr.to_string(),
        reason,
    };
    let default_scheme = if opts.tls.is_some() { "https" } else { "http" };
    let uri = match addr.split_once("://") {
        Some(("http", _)) if opts.tls.is_some() => {
            return Err(unreachable(
                "the address says http:// but TLS is configured; use https:// or no scheme".into(),
            ))
        }
        Some(("https", _)) if opts.tls.is_none() => {
            return Err(unreachable(
                "the address says https:// but no TLS CA is configured (--tls-ca)".into(),
            ))
        }
        Some(("http" | "https", _)) => addr.to_string(),
        Some((scheme, _)) => {
            return Err(unreachable(format!(
                "the address has scheme `{scheme}`; workers speak gRPC over http:// (or https://)"
            )))
        }
        None => format!("{default_scheme}://{addr}"),
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|e| unreachable(format!("bad address: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    if let Some(tls) = &opts.tls {
        let host = endpoint.uri().host().unwrap_or_default().to_string();
        endpoint = endpoint
            .tls_config(tls.config(&host))
            .map_err(|e| unreachable(format!("TLS settings: {}", causes(&e))))?;
    }
    let channel = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| unreachable("no connection within 5 s".into()))?
        .map_err(|e| {
            let hint = if opts.tls.is_some() {
                "is the worker running there, serving TLS with a certificate the CA signed for \
                 this name?"
            } else {
                "is the worker running and listening there?"
            };
            unreachable(format!("{} ({hint})", causes(&e)))
        })?;
    Ok(InterceptedService::new(
        channel,
        BearerToken(opts.token.clone()),
    ))
}

/// An error and its causes, outermost first, e.g. "transport error: dns error: failed to
/// lookup address information: Name or service not known".
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        let text = c.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = c.source();
    }
    out
}

/// A limit a worker reported, `usize::MAX` where it did not say (0).
pub(super) fn known(limit: usize) -> usize {
    if limit == 0 {
        usize::MAX
    } else {
        limit
    }
}

/// The times a worker reported for one request (0 where it sent no telemetry).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ServerTimes {
    pub(super) wall_ms: f64,
    pub(super) model_ms: f64,
    /// The worker reported one-off setup in the request (a CUDA graph made).
    pub(super) one_off_setup: bool,
}

impl ServerTimes {
    pub(super) fn of(t: Option<&specsplit_proto::TelemetryMetadata>) -> Self {
        Self {
            wall_ms: t.map_or(0.0, |t| t.wall_time_ms),
            model_ms: t.map_or(0.0, |t| t.model_time_ms),
            one_off_setup: t.is_some_and(|t| t.one_off_setup),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreported_limits_are_unbounded() {
        assert_eq!(known(0), usize::MAX);
        assert_eq!(known(64), 64);
    }
}
