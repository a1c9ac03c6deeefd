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
