//! Launch-free greedy decoding: [`DecodeStepper`] runs [`Transformer::static_step`] over one
//! session cache, replaying it from a CUDA graph on CUDA (one launch per token instead of a few
//! hundred kernel launches) and eagerly elsewhere.
//!
//! [`ExactStepper`] does the same for [`Transformer::exact_step`], the target's one-token
//! pass with the batch-invariant kernels.
//!
//! The graph bakes in the addresses of the weights, of the cache's buffers and of the step's
//! own buffers, so a stepper belongs to one cache for that cache's whole life.

use candle_core::Tensor;
use specsplit_core::cache::SessionCache;

use crate::transformer::{ExactStep, StaticStep, Transformer};
use crate::ModelError;

/// A CUDA graph of one decode step, movable between threads.
#[cfg(feature = "cuda")]
struct Graph(candle_core::cuda_backend::cudarc::driver::CudaGraph);

// SAFETY: a CUDA graph exec may be launched from any thread as long as calls on it are
// serialised; the stepper that owns it is used through `&mut self` only.
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}

/// Runs a fixed-shape step body: eagerly the first time (loading kernels and warming candle's
/// parameter cache), captured into a CUDA graph the second time where the model allows it,
/// and replayed from that graph afterwards. A failed capture falls back to eager steps for
/// good, with a warning.
#[derive(Default)]
struct Replay {
    eager_steps: usize,
    #[cfg(feature = "cuda")]
    graph: Option<Graph>,
    #[cfg(feature = "cuda")]
    capture_failed: bool,
}

impl Replay {
    fn uses_graph(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.graph.is_some() {
            return true;
        }
        false
    }

    fn run(
        &mut self,
        model: &Transformer,
        body: impl Fn() -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
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
                match capture(d, &body) {
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
            body()?;
            self.eager_steps += 1;
            return Ok(());
        }
        let _ = model;
        body()?;
        self.eager_steps += 1;
        Ok(())
    }
}

/// Captures one run of `body` on `d`'s stream into a CUDA graph.
#[cfg(feature = "cuda")]
fn capture(
    d: &candle_core::CudaDevice,
    body: &impl Fn() -> Result<(), ModelError>,
) -> Result<Graph, ModelError> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let err = |what: &str, e: &dyn std::fmt::Debug| ModelError::Input(format!("{what}: {e:?}"));
    let stream = d.cuda_stream();
    stream
        .synchronize()
        .map_err(|e| err("synchronize before capture", &e))?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| err("begin capture", &e))?;
    // Always end the capture, whatever the step did, so the stream leaves capture mode.
    let run = body();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    run?;
    match graph.map_err(|e| err("end capture", &e))? {
        Some(g) => Ok(Graph(g)),
        None => Err(ModelError::Input("the captured graph is empty".into())),
    }
}

/// Fixed-shape greedy decode steps over one session cache (see the module docs).
pub struct DecodeStepper {
    bufs: StaticStep,
    replay: Replay,
}

impl std::fmt::Debug for DecodeStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStepper")
            .field("eager_steps", &self.replay.eager_steps)
            .field("graph", &self.uses_graph())
            .finish()
    }
}

impl DecodeStepper {
    /// A stepper for `model` over caches of `capacity` entries.
    pub fn new(model: &Transformer, capacity: usize) -> Result<Self, ModelError> {
        Ok(Self {
            bufs: model.static_step_buffers(capacity)?,
            replay: Replay::default(),
        })
    }

    /// Whether steps are replayed from a captured CUDA graph.
    pub fn uses_graph(&self) -> bool {
        self.replay.uses_graph()
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
        let bufs = &self.bufs;
        self.replay.run(model, || model.static_step(bufs, cache))
    }
}

/// Batch-invariant one-token decode steps over one session cache ([`Transformer::exact_step`]:
/// the logits of a one-token [`Transformer::forward`], bit for bit), replayed from a CUDA
/// graph: how a target decodes alone with the same bits it verifies trees with.
pub struct ExactStepper {
    bufs: ExactStep,
    replay: Replay,
}

impl std::fmt::Debug for ExactStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExactStepper")
            .field("capacity", &self.bufs.capacity())
            .field("eager_steps", &self.replay.eager_steps)
            .field("graph", &self.uses_graph())
            .finish()
    }
}

impl ExactStepper {
    /// A stepper for `model` over caches of `capacity` slots; fails unless
    /// [`Transformer::exact_step_fits`] holds.
    pub fn new(model: &Transformer, capacity: usize) -> Result<Self, ModelError> {
        if !model.exact_step_fits(capacity) {
            return Err(ModelError::Unsupported(format!(
                "no exact step for this model over {capacity} slots (needs bf16 on CUDA with \
                 the fused batch-invariant kernels and rotary tables covering the capacity)"
            )));
        }
        Ok(Self {
            bufs: model.exact_step_buffers(capacity)?,
            replay: Replay::default(),
        })
    }

    /// Whether steps are replayed from a captured CUDA graph.
    pub fn uses_graph(&self) -> bool {
        self.replay.uses_graph()
    }

    /// Decodes `token` at the end of `cache` (the cache this stepper is used with, every
    /// time): writes its K/V at slot `cache.len()`, advances the cache by one and returns the
    /// `(1, vocab)` f32 logits. The returned tensor is the stepper's own buffer: the next step
    /// overwrites it.
    pub fn step(
        &mut self,
        model: &Transformer,
        token: u32,
        cache: &mut SessionCache,
    ) -> Result<Tensor, ModelError> {
        specsplit_core::device::bind_to_thread(model.device())?;
        self.bufs.start(token, cache.len())?;
        let (bufs, store) = (&self.bufs, &*cache);
        self.replay.run(model, || model.exact_step(bufs, store))?;
        cache.advance(1)?;
        Ok(self.bufs.logits.clone())
    }
}
