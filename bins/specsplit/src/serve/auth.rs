//! The HTTP server's API key: every `/v1/*` request must carry `Authorization: Bearer <key>`
//! (compared in constant time), else it gets a 401 in OpenAI's shape (`invalid_api_key`).
//! `/health`, `/ready` and `/metrics` answer without it.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::openai::ApiError;

/// The key clients must present. Its `Debug` form hides it.
pub struct ApiKey(Vec<u8>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

impl ApiKey {
    /// A key from its text: 1 to 4096 visible ASCII characters (no spaces), as an HTTP header
    /// carries it unchanged.
    pub fn new(key: &str) -> Result<Self> {
        if key.is_empty() || key.len() > 4096 {
            bail!("the API key must hold 1 to 4096 characters");
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the API key holds characters other than visible ASCII (letters, digits, punctuation)");
        }
        Ok(Self(key.as_bytes().to_vec()))
    }

    /// The key in the file `path`, without surrounding whitespace (a trailing newline).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the API key file {}", path.display()))?;
        Self::new(text.trim())
    }

    /// Checks an `Authorization` header's value: `Bearer <this key>` (the scheme in any case).
    pub fn check(&self, header: Option<&[u8]>) -> Result<(), ApiError> {
        let Some(value) = header else {
            return Err(ApiError::invalid_api_key(
                "You didn't provide an API key. You need to provide your API key in an \
                 Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            ));
        };
        let key = value
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|_| value[7..].trim_ascii());
        match key {
            Some(k) if k.len() == self.0.len() && bool::from(k.ct_eq(&self.0)) => Ok(()),
            Some(_) => Err(ApiError::invalid_api_key("Incorrect API key provided.")),
            None => Err(ApiError::invalid_api_key(
                "The Authorization header must be `Bearer YOUR_KEY`.",
            )),
        }
    }
}

/// Middleware: a `/v1/*` request without the key gets a 401; others go on.
pub async fn require_key(State(key): State<Arc<ApiKey>>, req: Request, next: Next) -> Response {
    if req.uri().path().starts_with("/v1/") || req.uri().path() == "/v1" {
        let header = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
        if let Err(e) = key.check(header) {
            return e.into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_key_passes() {
        let key = ApiKey::new("s3cret-key").unwrap();
        assert!(key.check(Some(b"Bearer s3cret-key")).is_ok());
        assert!(key.check(Some(b"bearer s3cret-key")).is_ok());
        for bad in [
            &b"Bearer s3cret-kez"[..],
            b"Bearer s3cret-key2",
            b"Bearer ",
            b"Basic s3cret-key",
            b"s3cret-key",
        ] {
            let e = key.check(Some(bad)).unwrap_err();
            assert_eq!(e.status.as_u16(), 401);
            assert_eq!(e.code, Some("invalid_api_key"));
        }
        assert_eq!(key.check(None).unwrap_err().code, Some("invalid_api_key"));
        assert!(ApiKey::new("").is_err());
        assert!(ApiKey::new("has space").is_err());
        assert!(!format!("{key:?}").contains("s3cret"));
    }
}
