//! Device helpers.

use candle_core::Device;

/// Makes `device`'s CUDA context current on the calling thread (a no-op on the CPU). GPU work
/// that runs on pooled threads (tokio's blocking pool, gRPC handlers) must call it first:
/// allocation and copies otherwise fail with CUDA_ERROR_INVALID_CONTEXT.
pub fn bind_to_thread(device: &Device) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        // `bind_to_thread` first reports (and clears) any error recorded earlier by work the
        // context could not report synchronously — typically a buffer freed on a thread where
        // the context was not current. Log that one and bind again.
        if let Err(stale) = ctx.bind_to_thread() {
            eprintln!("warning: earlier CUDA error surfaced while binding the context: {stale:?}");
            ctx.bind_to_thread()
                .map_err(|e| candle_core::Error::Msg(format!("binding the CUDA context: {e:?}")))?;
        }
    }
    let _ = device;
    Ok(())
}

/// Lets `device`'s CUDA memory pool keep the memory freed by finished work instead of handing
/// it back to the driver at every synchronisation (the pool's default release threshold is 0,
/// so each decode round, which ends in one device→host copy, would otherwise return its
/// transient buffers and map them again on the next round). Like PyTorch's caching allocator,
/// the process keeps its peak transient memory. Returns whether the threshold was raised (false
/// on the CPU).
pub fn retain_pool_memory(device: &Device) -> candle_core::Result<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let failed = |what: &str, e: &dyn std::fmt::Debug| {
            candle_core::Error::Msg(format!("CUDA memory pool: {what}: {e:?}"))
        };
        bind_to_thread(device)?;
        let stream = d.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return Ok(false);
        }
        let mut threshold = u64::MAX;
        // SAFETY: `cu_device` is the context's own device, the pool returned for it is valid,
        // and the release threshold attribute takes a u64.
        unsafe {
            let pool = result::device::get_mem_pool(ctx.cu_device())
                .map_err(|e| failed("getting the device's pool", &e))?;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(|e| failed("setting the release threshold", &e))?;
        }
        return Ok(true);
    }
    let _ = device;
    Ok(false)
}

/// A timing event recorded now on `device`'s stream (cudarc's default flags disable timing);
/// `None` on the CPU.
#[cfg(feature = "cuda")]
fn record(
    device: &Device,
) -> candle_core::Result<Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let Device::Cuda(d) = device else {
        return Ok(None);
    };
    d.cuda_stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map(Some)
        .map_err(|e| candle_core::Error::Msg(format!("recording a CUDA event: {e:?}")))
}

/// The device time of work enqueued on a CUDA device's stream between [`DeviceSpan::start`]
/// and [`DeviceSpan::end`], from two timing events: what the GPU spent, apart from the host's
/// waits around it.
pub struct DeviceSpan {
    #[cfg(feature = "cuda")]
    start: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    #[cfg(feature = "cuda")]
    end: Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

impl DeviceSpan {
    /// Records the start on `device`'s stream; `None` on the CPU.
    pub fn start(device: &Device) -> candle_core::Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        return Ok(record(device)?.map(|start| Self { start, end: None }));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Ok(None)
        }
    }

    /// Records the end on `device`'s stream (the same device as the start).
    pub fn end(&mut self, device: &Device) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.end = record(device)?;
        }
        let _ = device;
        Ok(())
    }

    /// Milliseconds between the start and the end (waits for the end); `None` before
    /// [`DeviceSpan::end`].
    pub fn elapsed_ms(&self) -> candle_core::Result<Option<f64>> {
        #[cfg(feature = "cuda")]
        if let Some(end) = &self.end {
            let ms = self
                .start
                .elapsed_ms(end)
                .map_err(|e| candle_core::Error::Msg(format!("timing CUDA events: {e:?}")))?;
            return Ok(Some(f64::from(ms)));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_device_span() {
        assert!(DeviceSpan::start(&Device::Cpu).unwrap().is_none());
    }

    #[test]
    fn the_cpu_has_no_pool_to_keep() {
        assert!(!retain_pool_memory(&Device::Cpu).unwrap());
        bind_to_thread(&Device::Cpu).unwrap();
    }
}
