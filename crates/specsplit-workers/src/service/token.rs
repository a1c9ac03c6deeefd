//! The bearer-token check in front of a worker's gRPC service: a call without the token is
//! answered UNAUTHENTICATED before the service sees it; without a token configured, calls go
//! straight through.

use std::convert::Infallible;
use std::task::{Context, Poll};

use futures_util::future::{ready, Either, Ready};
use specsplit_proto::auth::AuthToken;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::Service;
use tonic::server::NamedService;

/// `inner` behind the check of `token` (none: no check).
#[derive(Clone)]
pub(super) struct TokenCheck<S> {
    pub(super) inner: S,
    pub(super) token: Option<AuthToken>,
}

impl<S> Service<Request<Body>> for TokenCheck<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Either<S::Future, Ready<Result<Response<Body>, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        match self
            .token
            .as_ref()
            .map(|t| t.check_headers(request.headers()))
        {
            Some(Err(status)) => Either::Right(ready(Ok(status.into_http()))),
            _ => Either::Left(self.inner.call(request)),
        }
    }
}

impl<S: NamedService> NamedService for TokenCheck<S> {
    const NAME: &'static str = S::NAME;
}
