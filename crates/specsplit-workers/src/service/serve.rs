//! Serving a worker's gRPC service: on a server thread of its own, with the health service,
//! TLS and bearer-token authentication where configured, TCP_NODELAY connections, the TTL
//! sweeper, draining and graceful shutdown, and oversized requests answered INVALID_ARGUMENT
//! naming the limit.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use specsplit_proto::auth::AuthToken;
use specsplit_proto::health::health_server::HealthServer;
use tokio::net::TcpListener;
use tonic::transport::ServerTlsConfig;

use super::health::{Health, MAX_HEALTH_MESSAGE_BYTES};
use super::token::TokenCheck;
use super::Lifecycle;
use crate::session::SessionStore;

/// How a worker serves: transport security, authentication, its lifecycle and draining.
/// The default serves plaintext to anyone, without draining.
#[derive(Clone, Default)]
pub struct ServeOptions {
    /// TLS, mutual where the config names client CAs; `None` serves plaintext.
    pub tls: Option<ServerTlsConfig>,
    /// The bearer token every call of the worker's service must carry (UNAUTHENTICATED
    /// without it); the health service needs none.
    pub token: Option<AuthToken>,
    /// The worker's lifecycle, shared with its HTTP health endpoints: set ready when serving
    /// starts, draining when shutdown is asked.
    pub lifecycle: Arc<Lifecycle>,
    /// How long the worker goes on serving after shutdown is asked, reporting NOT_SERVING,
    /// before it stops taking calls.
    pub drain: Duration,
}

/// Sweeps expired sessions of `store` every few seconds until the returned task is aborted.
fn spawn_sweeper<S: Send + 'static>(store: Arc<SessionStore<S>>) -> tokio::task::JoinHandle<()> {
    let period = (store.limits().ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let n = store.sweep_expired();
            if n > 0 {
                tracing::info!(expired = n, "dropped idle sessions");
            }
        }
    })
}

/// What `serve` needs of a gRPC service.
pub(super) trait GrpcService:
    tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + tonic::server::NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves `svc` (plus gRPC health) on `listener` as `opts` say until `shutdown` resolves,
/// sweeping `store`'s expired sessions meanwhile; then drains for `opts.drain`, health
/// reporting NOT_SERVING, and stops, in-flight requests finishing first.
///
/// The server runs on a current-thread runtime on a thread of its own (the model runs on that
/// runtime's blocking pool, see `with_session`): on a multi-thread runtime each request's
/// connection task, stream task and handler are spread over worker threads, and every hand-off
/// between them is a wake-up of a parked thread, measured at about 0.03 ms per RPC on loopback.
/// If that thread cannot be started, it serves on the caller's
/// runtime instead. Dropping the returned future shuts the server down as `shutdown` would.
pub(super) async fn serve<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    opts: ServeOptions,
) -> Result<(), tonic::transport::Error> {
    let svc = TokenCheck {
        inner: svc,
        token: opts.token.clone(),
    };
    let (lifecycle, drain) = (opts.lifecycle.clone(), opts.drain);
    let shutdown = async move {
        shutdown.await;
        lifecycle.start_draining();
        if !drain.is_zero() {
            tracing::info!(
                secs = drain.as_secs_f64(),
                "draining: health reports NOT_SERVING"
            );
            tokio::time::sleep(drain).await;
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done =
        match serve_on_own_thread(svc.clone(), store.clone(), &listener, stopped, opts.clone()) {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(
                    "serving on the caller's runtime: cannot start a server thread: {e}"
                );
                return serve_here(svc, store, listener, shutdown, opts).await;
            }
        };
    // The thread serves a duplicate of the listening socket.
    drop(listener);
    tokio::pin!(shutdown, done);
    tokio::select! {
        r = &mut done => return finished(r),
        () = &mut shutdown => {}
    }
    // Dropping `stop` would do as well; the thread finishes in-flight requests first.
    let _ = stop.send(());
    finished(done.await)
}

/// The server thread's result; a thread that died without one is logged.
fn finished(
    r: Result<Result<(), tonic::transport::Error>, tokio::sync::oneshot::error::RecvError>,
) -> Result<(), tonic::transport::Error> {
    r.unwrap_or_else(|_| {
        tracing::error!("the server thread ended without a result");
        Ok(())
    })
}

/// Starts `serve_here` on a duplicate of `listener` on a current-thread runtime on a new thread,
/// until `stopped` resolves (or its sender is dropped); the receiver gets its result.
fn serve_on_own_thread<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: &TcpListener,
    stopped: tokio::sync::oneshot::Receiver<()>,
    opts: ServeOptions,
) -> std::io::Result<tokio::sync::oneshot::Receiver<Result<(), tonic::transport::Error>>> {
    use std::os::fd::AsFd;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let dup = std::net::TcpListener::from(listener.as_fd().try_clone_to_owned()?);
    dup.set_nonblocking(true)?;
    let dup = {
        let _in_rt = rt.enter();
        TcpListener::from_std(dup)?
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("specsplit-{}", S::NAME))
        .spawn(move || {
            let r = rt.block_on(serve_here(
                svc,
                store,
                dup,
                async {
                    let _ = stopped.await;
                },
                opts,
            ));
            let _ = tx.send(r);
        })?;
    Ok(rx)
}

/// `serve` on the current runtime.
async fn serve_here<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    opts: ServeOptions,
) -> Result<(), tonic::transport::Error> {
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = opts.tls {
        server = server.tls_config(tls)?;
    }
    let sweeper = spawn_sweeper(store);
    let health = HealthServer::new(Health {
        service: S::NAME,
        lifecycle: opts.lifecycle.clone(),
    })
    .max_decoding_message_size(MAX_HEALTH_MESSAGE_BYTES);
    // Accepted connections get TCP_NODELAY: with Nagle's algorithm on, a small response
    // written in pieces waits for the peer's delayed ACK (about 40 ms on Linux) — measured as
    // 40+ ms rounds on loopback before this.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |conn| {
            if let Ok(c) = &conn {
                if let Err(e) = c.set_nodelay(true) {
                    tracing::warn!("could not set TCP_NODELAY on a connection: {e}");
                }
            }
            conn
        },
    );
    opts.lifecycle.set_ready();
    let r = server
        .layer(tower::util::MapResponseLayer::new(explain_oversized))
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    sweeper.abort();
    r
}

/// Answers a request refused for its length (tonic's OUT_OF_RANGE "decoded message length
/// too large", decided from the length prefix before the message is read) INVALID_ARGUMENT,
/// saying which limit it is derived from. Other responses pass unchanged.
fn explain_oversized(
    mut resp: tonic::codegen::http::Response<tonic::body::Body>,
) -> tonic::codegen::http::Response<tonic::body::Body> {
    use tonic::codegen::http::HeaderValue;
    let headers = resp.headers_mut();
    if headers.get("grpc-status").is_none_or(|v| v != "11") {
        return resp;
    }
    let msg = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    let Some(rest) = msg.strip_prefix("Error, decoded message length too large: found ") else {
        return resp;
    };
    // "<found> bytes, the limit is: <limit> bytes"
    let mut numbers = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty());
    let (Some(found), Some(limit)) = (numbers.next(), numbers.next()) else {
        return resp;
    };
    let text = format!(
        "the request is {found} bytes; this worker accepts at most {limit} (derived from \
         max_prompt_len, max_tree_nodes, max_tree_depth and the vocabulary size)"
    );
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&text)) {
        headers.insert("grpc-status", HeaderValue::from_static("3"));
        headers.insert("grpc-message", v);
    }
    resp
}

/// Decodes gRPC's percent-encoded status message.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len())
            .then(|| std::str::from_utf8(&b[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encodes a status message for the `grpc-message` header.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == b' ' {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    #[test]
    fn oversized_requests_become_invalid_argument_naming_the_limit() {
        use tonic::codegen::http::Response;
        let tonic_status = Status::out_of_range(
            "Error, decoded message length too large: found 125829120 bytes, the limit is: \
             76416 bytes",
        );
        let resp = explain_oversized(tonic_status.into_http());
        let got = Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(got.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            got.message(),
            "the request is 125829120 bytes; this worker accepts at most 76416 (derived from \
             max_prompt_len, max_tree_nodes, max_tree_depth and the vocabulary size)"
        );
        // Everything else passes unchanged.
        let other = Status::out_of_range("something else").into_http();
        let resp = explain_oversized(other);
        assert_eq!(resp.headers()["grpc-status"], "11");
        let ok = explain_oversized(Response::new(tonic::body::Body::empty()));
        assert!(ok.headers().get("grpc-status").is_none());
        assert_eq!(percent_decode(&percent_encode("a%b: é(1)")), "a%b: é(1)");
        assert_eq!(percent_decode("50%"), "50%");
    }
}
