//! The standard gRPC health service (`grpc.health.v1.Health`) of a worker.

use std::sync::Arc;

use specsplit_proto::health::health_check_response::ServingStatus;
use specsplit_proto::health::{HealthCheckRequest, HealthCheckResponse};
use tonic::{Request, Response, Status};

use super::Lifecycle;

/// Largest health-check message accepted (a service name).
pub(super) const MAX_HEALTH_MESSAGE_BYTES: usize = 4 << 10;

/// The standard gRPC health service (`grpc.health.v1.Health`): the worker's service and the
/// server as a whole (`""`) are SERVING while the server runs and NOT_SERVING while it drains
/// (see [`Lifecycle`]); other names are NOT_FOUND.
/// Generated with [`specsplit_proto::codec::SpecCodec`], so an undecodable request is
/// INVALID_ARGUMENT like on the worker's own service.
#[derive(Debug, Clone)]
pub(super) struct Health {
    /// The worker's own service name.
    pub(super) service: &'static str,
    /// Whether the worker serves or drains.
    pub(super) lifecycle: Arc<Lifecycle>,
}

impl Health {
    fn status(&self, service: &str) -> Option<HealthCheckResponse> {
        let status = if self.lifecycle.is_serving() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        (service.is_empty() || service == self.service).then_some(HealthCheckResponse {
            status: status as i32,
        })
    }
}

#[tonic::async_trait]
impl specsplit_proto::health::health_server::Health for Health {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.status(&request.into_inner().service)
            .map(Response::new)
            .ok_or_else(|| Status::not_found("no such service on this worker"))
    }

    type WatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>,
    >;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        // The status as it is when asked, then the call stays open until the server stops
        // (a watcher learns of draining from a new check).
        let first = self
            .status(&request.into_inner().service)
            .unwrap_or(HealthCheckResponse {
                status: ServingStatus::ServiceUnknown as i32,
            });
        let stream =
            tokio_stream::StreamExt::chain(tokio_stream::once(Ok(first)), tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }
}
