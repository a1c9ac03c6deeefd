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

/// Whether [`retain_pool_memory`] raises the threshold: unless `SPECSPLIT_CUDA_POOL_RETAIN=0`.
pub fn pool_retain_wanted() -> bool {
    std::env::var("SPECSPLIT_CUDA_POOL_RETAIN").map_or(true, |v| v.trim() != "0")
}

/// Lets `device`'s CUDA memory pool keep the memory freed by finished work instead of handing
/// it back to the driver at every synchronisation (the pool's default release threshold is 0,
/// so each decode round, which ends in one device→host copy, would otherwise return its
/// transient buffers and map them again on the next round). Like PyTorch's caching allocator,
/// the process keeps its peak transient memory. `SPECSPLIT_CUDA_POOL_RETAIN=0` leaves the
/// driver's default. Returns whether the threshold was raised (false on the CPU).
pub fn retain_pool_memory(device: &Device) -> candle_core::Result<bool> {
    if !pool_retain_wanted() {
        return Ok(false);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_pool_to_keep() {
        assert!(!retain_pool_memory(&Device::Cpu).unwrap());
        bind_to_thread(&Device::Cpu).unwrap();
    }
}
