//! How the orchestrator connects to its workers: the client runtime's busy-polling, TLS (the
//! CA the workers' certificates chain to, a client certificate for mutual TLS) and the bearer
//! token sent with every call.

use std::path::Path;

pub use specsplit_proto::auth::AuthToken;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use super::{ClientSpin, OrchestratorError};

/// TLS towards the workers.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// PEM CA certificates the workers' certificates must chain to.
    pub ca_pem: Vec<u8>,
    /// PEM client certificate chain and private key, for workers that require mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the workers' certificates must carry; unset, the host of each address.
    pub domain: Option<String>,
}

impl ClientTls {
    /// TLS trusting the CA certificates in the PEM file `ca`, presenting the client
    /// certificate `cert` with its key `key` when given (both or neither).
    pub fn from_files(
        ca: &Path,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Self, OrchestratorError> {
        let read = |what: &str, p: &Path| {
            std::fs::read(p).map_err(|e| {
                OrchestratorError::Config(format!("cannot read the {what} {}: {e}", p.display()))
            })
        };
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some((
                read("TLS client certificate", c)?,
                read("TLS client key", k)?,
            )),
            (None, None) => None,
            _ => {
                return Err(OrchestratorError::Config(
                    "a TLS client certificate and its key go together: give both or neither".into(),
                ))
            }
        };
        Ok(Self {
            ca_pem: read("TLS CA file", ca)?,
            identity,
            domain: None,
        })
    }

    /// tonic's configuration for a worker whose address has host `host`.
    pub(super) fn config(&self, host: &str) -> ClientTlsConfig {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .domain_name(self.domain.as_deref().unwrap_or(host));
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(cert, key));
        }
        c
    }
}

/// How [`super::Orchestrator::connect_with_options`] connects: the defaults are plaintext
/// without a token, the client runtimes as [`ClientSpin::default`], as many as
/// [`default_client_threads`].
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// How the client runtimes busy-poll.
    pub spin: ClientSpin,
    /// Client runtimes (threads), each with its own connections to the workers; a generation
    /// runs on the one with the fewest live generations. 0: [`default_client_threads`]; at
    /// most [`super::MAX_CLIENT_THREADS`] (more are refused at connect).
    pub client_threads: usize,
    /// TLS towards both workers; addresses without a scheme then use `https://`.
    pub tls: Option<ClientTls>,
    /// The bearer token sent with every call to both workers.
    pub token: Option<AuthToken>,
}

/// The client runtimes an orchestrator starts where [`ConnectOptions::client_threads`] is 0:
/// one for every four cores this process may use, 1 to 8. One runtime carries every round of
/// its generations (their requests, answers and round logic) on one thread, which bounds how
/// many concurrent generations it serves at the workers' pace.
pub fn default_client_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() / 4)
        .clamp(1, 8)
}
