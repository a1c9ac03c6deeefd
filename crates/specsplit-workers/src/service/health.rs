//! The standard gRPC health service (`grpc.health.v1.Health`) of a worker.

use std::sync::Arc;

use specsplit_proto::health::health_check_response::ServingStatus;
use specsplit_proto::health::{HealthCheckRequest, HealthCheckResponse};
use tonic::{Request, Response, Status};

use super::Lifecycle;

/// How often a `Watch` call looks whether the worker started draining.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(100);

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
        // The status as it is when asked; once the worker drains, NOT_SERVING (to a watcher
        // of a serving status) and the end of the stream, which would otherwise hold the
        // server's graceful shutdown open.
        let first = self
            .status(&request.into_inner().service)
            .unwrap_or(HealthCheckResponse {
                status: ServingStatus::ServiceUnknown as i32,
            });
        let serving = first.status == ServingStatus::Serving as i32;
        let lifecycle = self.lifecycle.clone();
        let tick = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(DRAIN_POLL));
        let drained = tokio_stream::StreamExt::take(
            tokio_stream::StreamExt::filter(tick, move |_| lifecycle.is_draining()),
            1,
        );
        let last = tokio_stream::StreamExt::filter_map(drained, move |_| {
            serving.then_some(Ok(HealthCheckResponse {
                status: ServingStatus::NotServing as i32,
            }))
        });
        let stream = tokio_stream::StreamExt::chain(tokio_stream::once(Ok(first)), last);
        Ok(Response::new(Box::pin(stream)))
    }
}
