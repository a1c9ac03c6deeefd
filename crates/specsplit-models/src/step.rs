//! Launch-free greedy decoding: [`DecodeStepper`] runs [`Transformer::static_step`] over one
//! session cache, replaying it from a CUDA graph on CUDA (one launch per token instead of a few
//! hundred kernel launches) and eagerly elsewhere.
//!
//! The graph bakes in the addresses of the weights, of the cache's buffers and of the step's
//! own buffers, so a stepper belongs to one cache for that cache's whole life.

use candle_core::Tensor;
use specsplit_core::cache::SessionCache;

use crate::transformer::{StaticStep, Transformer};
use crate::ModelError;

/// A CUDA graph of one decode step, movable between threads.
#[cfg(feature = "cuda")]
struct Graph(candle_core::cuda_backend::cudarc::driver::CudaGraph);

// SAFETY: a CUDA graph exec may be launched from any thread as long as calls on it are
// serialised; the stepper that owns it is used through `&mut self` only.
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}

/// Fixed-shape greedy decode steps over one session cache (see the module docs).
pub struct DecodeStepper {
    bufs: StaticStep,
    eager_steps: usize,
    #[cfg(feature = "cuda")]
    graph: Option<Graph>,
    #[cfg(feature = "cuda")]
    capture_failed: bool,
}

impl std::fmt::Debug for DecodeStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStepper")
            .field("eager_steps", &self.eager_steps)
            .field("graph", &self.uses_graph())
            .finish()
    }
}

impl DecodeStepper {
    /// A stepper for `model` over caches of `capacity` entries.
    pub fn new(model: &Transformer, capacity: usize) -> Result<Self, ModelError> {
        Ok(Self {
            bufs: model.static_step_buffers(capacity)?,
            eager_steps: 0,
            #[cfg(feature = "cuda")]
            graph: None,
            #[cfg(feature = "cuda")]
            capture_failed: false,
        })
    }

    /// Whether steps are replayed from a captured CUDA graph.
    pub fn uses_graph(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.graph.is_some() {
            return true;
        }
        false
    }

    /// Sets the next step's input: `token` at cache slot `position` (one small upload each).
    pub fn start(&self, token: u32, position: usize) -> Result<(), ModelError> {
        let dev = self.bufs.token.device();
        self.bufs
            .token
            .slice_set(&Tensor::new(&[token], dev)?, 0, 0)?;
        self.bufs
            .position
            .slice_set(&Tensor::new(&[position as u32], dev)?, 0, 0)?;
        Ok(())
    }

    /// Replaces the next step's input token, keeping its position.
    pub fn set_token(&self, token: u32) -> Result<(), ModelError> {
        let dev = self.bufs.token.device();
        self.bufs
            .token
            .slice_set(&Tensor::new(&[token], dev)?, 0, 0)?;
        Ok(())
    }

    /// The step's buffers: `next` and `next_logprob` hold the last step's greedy token.
    pub fn buffers(&self) -> &StaticStep {
        &self.bufs
    }

    /// Runs one step on `cache` (which must be the cache this stepper is used with): the first
    /// runs eagerly (loading kernels and cuBLAS state), the second is captured into a CUDA graph
    /// where the model allows it, and later ones replay that graph. A failed capture falls back
    /// to eager steps for good, with a warning.
    pub fn step(&mut self, model: &Transformer, cache: &SessionCache) -> Result<(), ModelError> {
        #[cfg(feature = "cuda")]
        if model.graph_capturable() {
            if let Some(g) = &self.graph {
                g.0.launch()
                    .map_err(|e| ModelError::Input(format!("CUDA graph launch: {e:?}")))?;
                return Ok(());
            }
            let candle_core::Device::Cuda(d) = model.device() else {
                return Err(ModelError::Unsupported("graph capture off CUDA".into()));
            };
            // candle uploads small kernel parameter arrays (dims, strides) from host memory;
            // with this cache on, the eager warm-up step stores them on the device and the
            // capture reuses them, so the graph never reads host memory that is gone.
            let _params = d.enable_cuda_graph_htod_cache();
            if self.eager_steps >= 1 && !self.capture_failed {
                match self.capture(model, cache) {
                    Ok(g) => {
                        g.0.launch()
                            .map_err(|e| ModelError::Input(format!("CUDA graph launch: {e:?}")))?;
                        self.graph = Some(g);
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!("CUDA graph capture failed, decoding eagerly: {e}");
                        self.capture_failed = true;
                    }
                }
            }
            // The eager step runs with the parameter cache on, so it warms it for the capture.
            model.static_step(&self.bufs, cache)?;
            self.eager_steps += 1;
            return Ok(());
        }
        model.static_step(&self.bufs, cache)?;
        self.eager_steps += 1;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn capture(&self, model: &Transformer, cache: &SessionCache) -> Result<Graph, ModelError> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let candle_core::Device::Cuda(d) = model.device() else {
            return Err(ModelError::Unsupported("graph capture off CUDA".into()));
        };
        let err = |what: &str, e: &dyn std::fmt::Debug| ModelError::Input(format!("{what}: {e:?}"));
        let stream = d.cuda_stream();
        stream
            .synchronize()
            .map_err(|e| err("synchronize before capture", &e))?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| err("begin capture", &e))?;
        // Always end the capture, whatever the step did, so the stream leaves capture mode.
        let run = model.static_step(&self.bufs, cache);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        run?;
        match graph.map_err(|e| err("end capture", &e))? {
            Some(g) => Ok(Graph(g)),
            None => Err(ModelError::Input("the captured graph is empty".into())),
        }
    }
}
