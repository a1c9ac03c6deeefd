//! Bearer-token authentication between the services: the token, the `authorization: Bearer
//! <token>` header a client adds to every call ([`BearerToken`]), and the check a worker makes
//! of it (a constant-time comparison).

use std::path::Path;

use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The metadata key the token travels in.
pub const AUTHORIZATION: &str = "authorization";

/// Why a token is unusable.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The token file could not be read.
    #[error("cannot read the auth token file {path}")]
    Read {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The token is empty or holds characters an HTTP header cannot carry.
    #[error("the auth token {0}")]
    Invalid(&'static str),
}

/// A shared secret the services authenticate each other with. Its `Debug` form hides it.
#[derive(Clone)]
pub struct AuthToken {
    /// `Bearer <token>`, as sent.
    header: AsciiMetadataValue,
}

impl std::fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthToken(<hidden>)")
    }
}

impl AuthToken {
    /// A token from its text: at least one and at most 4096 visible ASCII characters
    /// (no spaces), so that it fits an HTTP header unchanged.
    pub fn new(token: &str) -> Result<Self, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Invalid("is empty"));
        }
        if token.len() > 4096 {
            return Err(TokenError::Invalid("is longer than 4096 bytes"));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Invalid(
                "holds characters other than visible ASCII (letters, digits, punctuation)",
            ));
        }
        let header = AsciiMetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| TokenError::Invalid("cannot be sent as an HTTP header"))?;
        Ok(Self { header })
    }

    /// The token in the file `path`, without surrounding whitespace (a trailing newline).
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(text.trim())
    }

    /// Whether `metadata` carries `authorization: Bearer <this token>`; the comparison takes
    /// the same time wherever the values differ.
    pub fn admits(&self, metadata: &MetadataMap) -> bool {
        self.admits_value(metadata.get(AUTHORIZATION).map(|v| v.as_encoded_bytes()))
    }

    /// Checks a request's metadata: UNAUTHENTICATED unless it carries this token.
    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        self.check_value(metadata.get(AUTHORIZATION).map(|v| v.as_encoded_bytes()))
    }

    /// [`AuthToken::check`] on an HTTP request's headers.
    pub fn check_headers(&self, headers: &tonic::codegen::http::HeaderMap) -> Result<(), Status> {
        self.check_value(headers.get(AUTHORIZATION).map(|v| v.as_bytes()))
    }

    fn admits_value(&self, got: Option<&[u8]>) -> bool {
        let want = self.header.as_encoded_bytes();
        got.is_some_and(|got| want.len() == got.len() && bool::from(want.ct_eq(got)))
    }

    fn check_value(&self, got: Option<&[u8]>) -> Result<(), Status> {
        if self.admits_value(got) {
            Ok(())
        } else if got.is_none() {
            Err(Status::unauthenticated(
                "this worker requires `authorization: Bearer <token>`; configure the client's \
                 auth token",
            ))
        } else {
            Err(Status::unauthenticated(
                "the bearer token does not match this worker's",
            ))
        }
    }
}

/// A client interceptor adding `authorization: Bearer <token>` to every call (nothing without
/// a token).
#[derive(Debug, Clone, Default)]
pub struct BearerToken(pub Option<AuthToken>);

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            request
                .metadata_mut()
                .insert(AUTHORIZATION, t.header.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_header(v: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert(AUTHORIZATION, v.parse().unwrap());
        m
    }

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = AuthToken::new("s3cret-Token").unwrap();
        assert!(t.admits(&with_header("Bearer s3cret-Token")));
        for wrong in [
            "Bearer s3cret-Tokeo",
            "Bearer s3cret",
            "s3cret-Token",
            "Basic x",
        ] {
            assert!(!t.admits(&with_header(wrong)), "{wrong}");
        }
        let e = t.check(&MetadataMap::new()).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = t.check(&with_header("Bearer nope")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let headers = with_header("Bearer s3cret-Token").into_headers();
        assert!(t.check_headers(&headers).is_ok());
        let headers = with_header("Bearer s3cret-Tokeo").into_headers();
        assert!(t.check_headers(&headers).is_err());
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn unusable_tokens_are_refused() {
        for bad in ["", "two words", "tab\there", "é"] {
            assert!(AuthToken::new(bad).is_err(), "{bad:?}");
        }
        let dir = std::env::temp_dir().join(format!("specsplit-token-{}", std::process::id()));
        std::fs::write(&dir, "abc123\n").unwrap();
        let t = AuthToken::from_file(&dir).unwrap();
        assert!(t.admits(&with_header("Bearer abc123")));
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(
            AuthToken::from_file(&dir),
            Err(TokenError::Read { .. })
        ));
    }

    #[test]
    fn the_client_interceptor_adds_the_token() {
        let t = AuthToken::new("tok").unwrap();
        let sent = BearerToken(Some(t.clone())).call(Request::new(())).unwrap();
        assert!(t.check(sent.metadata()).is_ok());
        let bare = BearerToken(None).call(Request::new(())).unwrap();
        assert!(bare.metadata().get(AUTHORIZATION).is_none());
        assert_eq!(
            t.check(bare.metadata()).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }
}
