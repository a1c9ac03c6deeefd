//! Where a worker is in its life: loading its model, ready, or draining before it stops. The
//! gRPC health service and the HTTP `/ready` endpoint report it.

use std::sync::atomic::{AtomicBool, Ordering};

/// A worker's state as its health endpoints report it: live from the start, ready once its
/// model is loaded and it serves, not ready again while it drains.
#[derive(Debug, Default)]
pub struct Lifecycle {
    ready: AtomicBool,
    draining: AtomicBool,
}

impl Lifecycle {
    /// Marks the model loaded and the service serving.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// Marks the worker draining: it still answers calls but asks for no more.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the worker is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Whether the worker takes calls: ready and not draining.
    pub fn is_serving(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.is_draining()
    }
}
