//! Launch-free greedy decoding: [`DecodeStepper`] runs [`Transformer::static_step`] over one
//! session cache, replaying it from a CUDA graph on CUDA (one launch per token instead of a few
//! hundred kernel launches) and eagerly elsewhere.
//!
//! [`ExactStepper`] does the same for [`Transformer::exact_rows`], the target's pass of one
//! token (or of a chain) with the batch-invariant kernels, one graph per row count and span of
//! keys: in a cache more than twice as large as its sequence a pass's attention is launched
//! over the least power of two from 256 slots that holds its keys ([`fused::replay_span`]),
//! not over the whole cache. [`SessionChainsStepper`] replays
//! [`Transformer::grow_session_chains`], the chains of several sessions grown together, and
//! [`SessionRowsStepper`] [`Transformer::session_rows`], several sessions' verify passes of a
//! chain each; their graphs read the caches through a table and so belong to no cache.
//!
//! The graph bakes in the addresses of the weights, of the cache's buffers and of the step's
//! own buffers, so a stepper belongs to one cache for that cache's whole life at one capacity:
//! a cache that grows ([`SessionCache::reserve`]) gets new buffers, and every stepper method
//! refuses a cache whose capacity is not the stepper's (so no graph over the old buffers is
//! ever replayed); the owner makes a new stepper after growth.

use candle_core::Tensor;
use specsplit_core::cache::SessionCache;

use crate::fused;
use crate::transformer::{
    ChainGrowth, ExactRows, SessionChain, SessionChainRows, SessionChains, SessionRows, StaticStep,
    Transformer, CHAIN_FEED_MAX,
};
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
    /// What the eager step's fused kernels allocated: the scratch the capture carves from.
    #[cfg(feature = "cuda")]
    need: Option<crate::fused::ScratchNeed>,
    /// The captured graph's intermediate outputs (see [`crate::fused::Scratch`]).
    #[cfg(feature = "cuda")]
    scratch: Option<crate::fused::Scratch>,
    /// The captured graph's nodes by kind.
    #[cfg(feature = "cuda")]
    nodes: Option<GraphNodes>,
}

/// A captured graph's nodes by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphNodes {
    /// Kernel launches.
    pub kernels: usize,
    /// Memory allocation and free nodes (stream-ordered allocations captured with the step).
    pub memory: usize,
    /// Copies and fills.
    pub copies: usize,
    /// Anything else.
    pub other: usize,
    /// Bytes of scratch the graph's intermediate outputs are carved from (0: allocated inside
    /// the graph).
    pub scratch_bytes: usize,
}

impl std::fmt::Display for GraphNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernels, {} alloc/free, {} copies, {} other; scratch {:.1} MiB",
            self.kernels,
            self.memory,
            self.copies,
            self.other,
            self.scratch_bytes as f64 / (1024.0 * 1024.0)
        )
    }
}

/// The largest scratch a captured graph gets, in bytes (64 MiB). The scratch holds every
/// intermediate output of a step at once (a graph's own allocations reuse memory as they are
/// freed), so it grows with the rows, the layers and the capacity (the rows attention's
/// per-chunk partials); a larger step is captured with its allocations inside the graph.
pub const GRAPH_SCRATCH_MAX: usize = 64 * 1024 * 1024;

impl Replay {
    /// The captured graph's nodes by kind, once captured.
    fn nodes(&self) -> Option<GraphNodes> {
        #[cfg(feature = "cuda")]
        return self.nodes;
        #[cfg(not(feature = "cuda"))]
        None
    }

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
            // Anything but a replay is a one-off cost of this shape.
            model.note_graph_setup();
            if self.eager_steps >= 1 && !self.capture_failed {
                let scratch = match self.need {
                    // Without room for it the graph allocates its outputs itself, as before.
                    Some(need) if need.bytes() <= GRAPH_SCRATCH_MAX => {
                        crate::fused::Scratch::new(need, model.device())
                            .inspect_err(|e| {
                                tracing::warn!("no graph scratch ({} bytes): {e}", need.bytes())
                            })
                            .ok()
                    }
                    _ => None,
                };
                match capture(d, scratch.as_ref(), &body) {
                    Ok((g, nodes)) => {
                        self.nodes = Some(nodes);
                        g.0.launch()
                            .map_err(|e| ModelError::Input(format!("CUDA graph launch: {e:?}")))?;
                        self.graph = Some(g);
                        self.scratch = scratch;
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!("CUDA graph capture failed, decoding eagerly: {e}");
                        self.capture_failed = true;
                    }
                }
            }
            // The eager step runs with the parameter cache on, so it warms it for the capture,
            // and counts the scratch its capture will carve from.
            let (done, need) = crate::fused::counting(&body);
            done?;
            self.need = Some(need);
            self.eager_steps += 1;
            return Ok(());
        }
        let _ = model;
        body()?;
        self.eager_steps += 1;
        Ok(())
    }
}

/// Counts `g`'s nodes by kind (all zero where the driver will not list them).
#[cfg(feature = "cuda")]
fn census(g: &Graph) -> GraphNodes {
    use candle_core::cuda_backend::cudarc::driver::sys::{self, CUgraphNodeType as T};
    let graph = g.0.cu_graph();
    let mut count = 0usize;
    // SAFETY: `graph` is the live graph `g` owns; a null array asks for the count only.
    if unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }
        .result()
        .is_err()
    {
        return GraphNodes::default();
    }
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` has room for the `count` nodes just reported.
    if unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }
        .result()
        .is_err()
    {
        return GraphNodes::default();
    }
    let mut out = GraphNodes::default();
    for &n in &nodes[..count.min(nodes.len())] {
        let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `n` is a node of the live graph.
        if unsafe { sys::cuGraphNodeGetType(n, &mut t) }
            .result()
            .is_err()
        {
            continue;
        }
        match t {
            T::CU_GRAPH_NODE_TYPE_KERNEL => out.kernels += 1,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC | T::CU_GRAPH_NODE_TYPE_MEM_FREE => out.memory += 1,
            T::CU_GRAPH_NODE_TYPE_MEMCPY | T::CU_GRAPH_NODE_TYPE_MEMSET => out.copies += 1,
            _ => out.other += 1,
        }
    }
    out
}

/// Captures one run of `body` on `d`'s stream into a CUDA graph, with the fused kernels'
/// outputs carved from `scratch` where given (else allocated inside the graph); returns it
/// with its census.
#[cfg(feature = "cuda")]
fn capture(
    d: &candle_core::CudaDevice,
    scratch: Option<&crate::fused::Scratch>,
    body: &impl Fn() -> Result<(), ModelError>,
) -> Result<(Graph, GraphNodes), ModelError> {
    let graph = match scratch {
        Some(s) => capture_stream(d, &|| crate::fused::carving(s, body))?,
        None => capture_stream(d, body)?,
    };
    let nodes = GraphNodes {
        scratch_bytes: scratch.map_or(0, |s| s.bytes()),
        ..census(&graph)
    };
    Ok((graph, nodes))
}

/// Captures one run of `body` on `d`'s stream into a CUDA graph.
#[cfg(feature = "cuda")]
fn capture_stream(
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

/// `times` runs of a body captured into one CUDA graph, with the fused kernels' outputs carved
/// from a scratch (as a step's graph is): for timing kernels as a replayed step runs them.
#[cfg(feature = "cuda")]
pub struct RepeatedGraph {
    graph: Graph,
    _scratch: crate::fused::Scratch,
    nodes: GraphNodes,
}

#[cfg(feature = "cuda")]
impl RepeatedGraph {
    /// Runs `body` once eagerly (to size the scratch), then captures `times` runs of it on
    /// `device`'s stream.
    pub fn capture(
        device: &candle_core::Device,
        times: usize,
        body: impl Fn() -> Result<(), ModelError>,
    ) -> Result<Self, ModelError> {
        let candle_core::Device::Cuda(d) = device else {
            return Err(ModelError::Unsupported("graph capture off CUDA".into()));
        };
        let _params = d.enable_cuda_graph_htod_cache();
        let (done, need) = crate::fused::counting(&body);
        done?;
        let need = crate::fused::ScratchNeed {
            bf16: need.bf16 * times,
            f32: need.f32 * times,
        };
        let scratch = crate::fused::Scratch::new(need, device)?;
        let (graph, nodes) = capture(d, Some(&scratch), &|| (0..times).try_for_each(|_| body()))?;
        Ok(Self {
            nodes,
            graph,
            _scratch: scratch,
        })
    }

    /// Launches the graph (asynchronously).
    pub fn launch(&self) -> Result<(), ModelError> {
        self.graph
            .0
            .launch()
            .map_err(|e| ModelError::Input(format!("CUDA graph launch: {e:?}")))
    }

    /// The graph's nodes by kind.
    pub fn nodes(&self) -> GraphNodes {
        self.nodes
    }
}

/// Refuses a cache whose capacity is not the one a stepper was made for: its graphs point at
/// buffers of that capacity (a cache that grew has new ones).
fn check_capacity(stepper: usize, cache: &SessionCache) -> Result<(), ModelError> {
    if cache.capacity() != stepper {
        return Err(ModelError::Input(format!(
            "the stepper was made for a cache of {stepper} slots but the cache holds {}: a \
             cache that grew needs a new stepper",
            cache.capacity()
        )));
    }
    Ok(())
}

/// A multi-row pass's buffers and its graph, one per row count and span a stepper has run.
struct RowsReplay {
    bufs: ExactRows,
    replay: Replay,
}

/// The [`RowsReplay`] in `table` for `rows` rows whose chain ends at slot `end` (exclusive)
/// of a cache of `capacity` slots, made at first use: its attention spans
/// [`fused::replay_span`] keys, and the replays of one row count share their inputs and
/// logits.
fn rows_replay<'t>(
    table: &'t mut Vec<RowsReplay>,
    model: &Transformer,
    capacity: usize,
    rows: usize,
    end: usize,
) -> Result<&'t mut RowsReplay, ModelError> {
    let span = fused::replay_span(capacity, end);
    let same = |r: &RowsReplay| r.bufs.rows() == rows;
    let at = match table.iter().position(|r| same(r) && r.bufs.span() == span) {
        Some(at) => at,
        None => {
            let bufs = match table.iter().find(|r| same(r)) {
                Some(r) => r.bufs.with_span(span)?,
                None => model.exact_rows_buffers(capacity, rows, span)?,
            };
            table.push(RowsReplay {
                bufs,
                replay: Replay::default(),
            });
            table.len() - 1
        }
    };
    Ok(&mut table[at])
}

/// A chain growth's buffers and its graph.
struct ChainsReplay {
    bufs: ChainGrowth,
    replay: Replay,
}

/// The most chain growth shapes a stepper keeps graphs of (the oldest goes first).
const MAX_CHAIN_SHAPES: usize = 8;

/// Fixed-shape greedy decode steps over one session cache (see the module docs).
pub struct DecodeStepper {
    bufs: StaticStep,
    replay: Replay,
    /// Multi-token feeds ([`DecodeStepper::feed`]), by row count and span.
    rows: Vec<RowsReplay>,
    /// Passes with every row's logits ([`DecodeStepper::exact`]), made at first use.
    exact: Option<ExactStepper>,
    /// Chain growths ([`DecodeStepper::grow_chains`]), by shape and span.
    chains: Vec<ChainsReplay>,
    /// The step that keeps its logits ([`DecodeStepper::step_logits`]), made at first use.
    logits_step: Option<(StaticStep, Replay)>,
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
            rows: Vec::new(),
            exact: None,
            chains: Vec::new(),
            logits_step: None,
        })
    }

    /// The cache capacity this stepper serves.
    pub fn capacity(&self) -> usize {
        self.bufs.capacity()
    }

    /// The batch-invariant passes over this stepper's cache that give every row's logits
    /// ([`ExactStepper::step_chain`]), where the model runs them.
    pub fn exact(&mut self, model: &Transformer) -> Result<&mut ExactStepper, ModelError> {
        match &mut self.exact {
            Some(e) => Ok(e),
            none => Ok(none.insert(ExactStepper::new(model, self.bufs.capacity())?)),
        }
    }

    /// Whether [`DecodeStepper::grow_chains`] runs `rows` chains for `model`.
    pub fn grow_chains_fit(&self, model: &Transformer, rows: usize) -> bool {
        model.grow_chains_fit(self.bufs.capacity(), rows)
    }

    /// Grows `roots.len()` greedy chains of `depth` tokens below a forest's roots on `cache`
    /// ([`Transformer::grow_chains`]; see [`ChainGrowth::start`] for `leads`, `base` and
    /// `forced`), replayed from a graph captured per shape, and returns the `(2·depth, rows)`
    /// f32 tokens and log-probabilities (the stepper's own buffer, overwritten by the next
    /// growth of that shape), and the `(depth, rows, vocab)` logits of every level
    /// ([`ChainGrowth::logits`], likewise the stepper's own).
    #[allow(clippy::too_many_arguments)]
    pub fn grow_chains(
        &mut self,
        model: &Transformer,
        cache: &SessionCache,
        roots: &[u32],
        leads: &[usize],
        base: usize,
        depth: usize,
        forced: &[Option<u32>],
    ) -> Result<(Tensor, Tensor), ModelError> {
        check_capacity(self.bufs.capacity(), cache)?;
        let rows = roots.len();
        if !self.grow_chains_fit(model, rows) {
            return Err(ModelError::Unsupported(format!(
                "no {rows}-row chain growth for this model"
            )));
        }
        specsplit_core::device::bind_to_thread(model.device())?;
        let cap = self.bufs.capacity();
        let span = fused::replay_span(cap, leads.iter().max().copied().unwrap_or(0) + depth);
        let shape = |c: &ChainsReplay| c.bufs.rows() == rows && c.bufs.depth() == depth;
        let at = match self
            .chains
            .iter()
            .position(|c| shape(c) && c.bufs.span() == span)
        {
            Some(at) => at,
            None => {
                let bufs = match self.chains.iter().find(|c| shape(c)) {
                    Some(c) => c.bufs.with_span(span)?,
                    None => model.chain_growth_buffers(cap, rows, depth, span)?,
                };
                if self.chains.len() == MAX_CHAIN_SHAPES {
                    self.chains.remove(0);
                }
                self.chains.push(ChainsReplay {
                    bufs,
                    replay: Replay::default(),
                });
                self.chains.len() - 1
            }
        };
        let ChainsReplay { bufs, replay } = &mut self.chains[at];
        bufs.start(roots, leads, base, forced)?;
        replay.run(model, || model.grow_chains(bufs, cache))?;
        Ok((bufs.out.clone(), bufs.logits.clone()))
    }

    /// Feeds `tokens` (at least one) at cache slots `position..` of `cache` (the cache this
    /// stepper is used with), leaving in the buffers what `start` and one step a token would:
    /// the greedy token after the last one in `next` / `next_logprob` / `token`, and the
    /// position past them. Where the model runs [`Transformer::static_rows_step`] (bf16 on
    /// CUDA with the fused kernels) several tokens go through
    /// in one pass, replayed from a graph per row count: up to [`crate::fused::GEMV_MAX_ROWS`]
    /// tokens through the step's own kernels, bit for bit what one step a token gives; past
    /// that through the batch-invariant rows pass, whose
    /// greedy pick may break a near-tie differently. Elsewhere one step a token. Returns the
    /// passes run.
    pub fn feed(
        &mut self,
        model: &Transformer,
        cache: &SessionCache,
        tokens: &[u32],
        position: usize,
    ) -> Result<usize, ModelError> {
        let n = tokens.len();
        let cap = self.bufs.capacity();
        check_capacity(cap, cache)?;
        if n >= 2 && model.exact_rows_fit(cap, n) {
            let RowsReplay { bufs, replay } =
                rows_replay(&mut self.rows, model, cap, n, position + n)?;
            bufs.start(tokens, position)?;
            // The head adds one to the position: it ends past the last token.
            crate::fused::write_u32(&self.bufs.position, &[(position + n - 1) as u32])?;
            let step = &self.bufs;
            replay.run(model, || model.static_rows_step(bufs, step, cache))?;
            return Ok(1);
        }
        let Some((&first, rest)) = tokens.split_first() else {
            return Err(ModelError::Input("nothing to feed".into()));
        };
        self.start(first, position)?;
        self.step(model, cache)?;
        for &t in rest {
            self.set_token(t)?;
            self.step(model, cache)?;
        }
        Ok(n)
    }

    /// Whether steps are replayed from a captured CUDA graph.
    pub fn uses_graph(&self) -> bool {
        self.replay.uses_graph()
    }

    /// The one-token step's captured graph, by kind of node, once captured.
    pub fn graph_nodes(&self) -> Option<GraphNodes> {
        self.replay.nodes()
    }

    /// Sets the next step's input: `token` at cache slot `position` (one small upload each).
    pub fn start(&self, token: u32, position: usize) -> Result<(), ModelError> {
        set_input(&self.bufs, token, position)
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

    /// One step of `token` at cache slot `position` of `cache` (the cache this stepper is used
    /// with) that also keeps the step's logits: their `(1, vocab)` buffer in the model's dtype
    /// (the stepper's own, overwritten by the next such step). A graph of its own, captured and
    /// replayed as [`DecodeStepper::step`]'s; the cache's length is left alone.
    pub fn step_logits(
        &mut self,
        model: &Transformer,
        cache: &SessionCache,
        token: u32,
        position: usize,
    ) -> Result<Tensor, ModelError> {
        let cap = self.bufs.capacity();
        check_capacity(cap, cache)?;
        let (bufs, replay) = match &mut self.logits_step {
            Some(s) => s,
            none => none.insert((
                model.static_step_buffers_with_logits(cap)?,
                Replay::default(),
            )),
        };
        set_input(bufs, token, position)?;
        let b = &*bufs;
        replay.run(model, || model.static_step(b, cache))?;
        b.logits
            .clone()
            .ok_or_else(|| ModelError::Input("a step without its logits buffer".into()))
    }

    /// Runs one step on `cache` (which must be the cache this stepper is used with): the first
    /// runs eagerly (loading kernels and cuBLAS state), the second is captured into a CUDA graph
    /// where the model allows it, and later ones replay that graph. A failed capture falls back
    /// to eager steps for good, with a warning.
    pub fn step(&mut self, model: &Transformer, cache: &SessionCache) -> Result<(), ModelError> {
        check_capacity(self.bufs.capacity(), cache)?;
        let bufs = &self.bufs;
        self.replay.run(model, || model.static_step(bufs, cache))
    }
}

/// Sets a static step's input: `token` at cache slot `position` (one small upload each).
fn set_input(b: &StaticStep, token: u32, position: usize) -> Result<(), ModelError> {
    let dev = b.token.device();
    b.token.slice_set(&Tensor::new(&[token], dev)?, 0, 0)?;
    b.position
        .slice_set(&Tensor::new(&[position as u32], dev)?, 0, 0)?;
    Ok(())
}

/// Batch-invariant decode steps over one session cache ([`Transformer::exact_rows`]: the logits
/// of a [`Transformer::forward`] of the same rows, bit for bit), replayed from a CUDA graph
/// captured once per row count: how a target decodes alone (one row), and verifies a chain
/// draft (the new token and the chain below it), with the same bits it verifies trees with.
pub struct ExactStepper {
    capacity: usize,
    /// The passes run so far, by row count and span.
    rows: Vec<RowsReplay>,
}

impl std::fmt::Debug for ExactStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExactStepper")
            .field("capacity", &self.capacity)
            .field("graphs", &self.chain_graphs())
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
            capacity,
            rows: Vec::new(),
        })
    }

    /// The cache capacity this stepper serves.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether [`ExactStepper::step_chain`] takes chains of `rows` tokens for `model`: one
    /// token always, longer chains where the model runs them.
    pub fn chain_fits(&self, model: &Transformer, rows: usize) -> bool {
        rows == 1 || model.exact_rows_fit(self.capacity, rows)
    }

    /// Row counts whose passes replay a captured graph (over any span).
    pub fn chain_graphs(&self) -> Vec<usize> {
        let mut n: Vec<usize> = self
            .rows
            .iter()
            .filter(|r| r.replay.uses_graph())
            .map(|r| r.bufs.rows())
            .collect();
        n.sort_unstable();
        n.dedup();
        n
    }

    /// [`ExactStepper::step`] for a chain: `tokens` (each the next one's parent) at the end of
    /// `cache`, with the logits bit-identical to a batch-invariant [`Transformer::forward`]
    /// of those rows ([`Transformer::exact_rows`]), replayed from a graph per chain length and
    /// span of keys ([`crate::fused::replay_span`] of the cache's length after the chain);
    /// advances the cache by the chain's length and returns the `(rows, vocab)` f32 logits
    /// (the stepper's own buffer, overwritten by its next chain of that length). Fails unless
    /// [`ExactStepper::chain_fits`] holds.
    pub fn step_chain(
        &mut self,
        model: &Transformer,
        tokens: &[u32],
        cache: &mut SessionCache,
    ) -> Result<Tensor, ModelError> {
        check_capacity(self.capacity, cache)?;
        let n = tokens.len();
        if n == 0 || !self.chain_fits(model, n) {
            return Err(ModelError::Unsupported(format!(
                "no exact {n}-row chain pass for this model"
            )));
        }
        specsplit_core::device::bind_to_thread(model.device())?;
        let end = cache.len() + n;
        let RowsReplay { bufs, replay } =
            rows_replay(&mut self.rows, model, self.capacity, n, end)?;
        bufs.start(tokens, cache.len())?;
        let store = &*cache;
        replay.run(model, || model.exact_rows(bufs, store))?;
        cache.advance(n)?;
        Ok(bufs.logits.clone())
    }

    /// The captured graph of `rows`-row passes (the first span captured), by kind of node.
    pub fn graph_nodes(&self, rows: usize) -> Option<GraphNodes> {
        self.rows
            .iter()
            .filter(|r| r.bufs.rows() == rows)
            .find_map(|r| r.replay.nodes())
    }

    /// Whether one-token steps are replayed from a captured CUDA graph.
    pub fn uses_graph(&self) -> bool {
        self.rows
            .iter()
            .any(|r| r.bufs.rows() == 1 && r.replay.uses_graph())
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
        self.step_chain(model, &[token], cache)
    }
}

/// The shape of `shapes` (least recently used first) that `fits`, moved last; else a new one
/// from `make`, the least recently used dropped first where `most` are kept. Returns it and
/// whether it was made.
fn recent_shape<B>(
    shapes: &mut Vec<(B, Replay)>,
    most: usize,
    fits: impl Fn(&B) -> bool,
    make: impl FnOnce() -> Result<B, ModelError>,
) -> Result<(&mut (B, Replay), bool), ModelError> {
    let made = match shapes.iter().position(|(b, _)| fits(b)) {
        Some(at) => {
            let used = shapes.remove(at);
            shapes.push(used);
            false
        }
        None => {
            if shapes.len() == most {
                shapes.remove(0);
            }
            shapes.push((make()?, Replay::default()));
            true
        }
    };
    Ok((shapes.last_mut().expect("the shape just used"), made))
}

/// The most shapes a [`SessionChainsStepper`] keeps graphs of (the least recently used goes
/// first).
const MAX_SESSION_CHAIN_SHAPES: usize = 32;

/// The sessions of the shape that grows `n` chains together: the power of two at or above `n`
/// (the chains past `n` are pad chains), so that a draft worker whose passes take any number
/// of sessions from 2 to 32 makes at most five shapes a depth and capacity.
pub fn chain_shape_sessions(n: usize) -> usize {
    n.next_power_of_two()
}

/// Greedy chains of several sessions grown together ([`Transformer::grow_session_chains`]),
/// replayed from a graph captured per shape (sessions rounded up by [`chain_shape_sessions`],
/// depth, largest capacity). The graph reads each session's cache addresses from the table
/// [`SessionChains::start`] writes, so one graph serves any caches of at most its capacity,
/// and a cache that grew needs no new graph. Every shape feeds [`CHAIN_FEED_MAX`] rows a
/// session (a session feeding fewer fills the rest with pad rows), so that how many of a
/// pass's chains were accepted whole makes no new shape: a new shape runs once eagerly and is
/// captured the next time, two slow growths. The sessions a shape has past the chains given
/// are pad chains over the stepper's own small cache, their tokens never read.
#[derive(Default)]
pub struct SessionChainsStepper {
    /// By use, the least recent first.
    shapes: Vec<(SessionChains, Replay)>,
    /// Shapes made so far (each one's buffers, eager run and capture).
    made: u64,
    /// The pad chains' cache (made at the first pad chain, again for a deeper one).
    pad: Option<SessionCache>,
    /// Host time of the growths that made a shape, ran it eagerly or captured it.
    making: std::time::Duration,
}

impl SessionChainsStepper {
    /// A stepper with no graphs yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Grows each of `chains`' greedy chain of `depth` tokens together (see
    /// [`SessionChains::start`]) over buffers (and a graph) for caches of `capacity` slots, at
    /// least every chain's cache's, and feeds of [`CHAIN_FEED_MAX`] rows a session; returns the
    /// `(2·depth, sessions)` f32 tokens and log-probabilities (the stepper's own buffer,
    /// overwritten by the next growth of that shape; `sessions` is
    /// [`chain_shape_sessions`] of the chains given, whose columns come first). The caches'
    /// lengths are left alone.
    pub fn grow(
        &mut self,
        model: &Transformer,
        chains: &[SessionChain<'_>],
        depth: usize,
        capacity: usize,
    ) -> Result<Tensor, ModelError> {
        let given = chains.len();
        if !model.session_chains_fit(capacity, given) {
            return Err(ModelError::Unsupported(format!(
                "no chains of {given} sessions for this model"
            )));
        }
        // Rounded up where the model takes the rounded count (it takes any count to 32).
        let n = Some(chain_shape_sessions(given))
            .filter(|&n| model.session_chains_fit(capacity, n))
            .unwrap_or(given);
        specsplit_core::device::bind_to_thread(model.device())?;
        // A pad chain feeds one token at slot 0 of the pad cache and grows after it: it
        // needs `depth + 1` slots, within the shape's capacity.
        let fits_pad = |c: &SessionCache| (depth + 1..=capacity).contains(&c.capacity());
        if n > given && !self.pad.as_ref().is_some_and(fits_pad) {
            let slots = (depth + 1).next_power_of_two().max(16).min(capacity);
            self.pad = Some(model.new_cache(slots)?);
        }
        // The chains as given where they fill the shape, else copied with pad chains after.
        let padded: Vec<SessionChain<'_>>;
        let all = match self.pad.as_ref().filter(|_| n > given) {
            None => chains,
            Some(pad) => {
                let real = chains.iter().map(|c| SessionChain {
                    cache: c.cache,
                    feed: c.feed,
                    forced: c.forced,
                });
                let pads = (chains.len()..n).map(|_| SessionChain {
                    cache: pad,
                    feed: &[0],
                    forced: &[],
                });
                padded = real.chain(pads).collect();
                &padded
            }
        };
        let t0 = std::time::Instant::now();
        // Every shape is made with the same feed width, so it is not part of the key.
        let fits =
            |b: &SessionChains| b.sessions() == n && b.depth() == depth && b.capacity() == capacity;
        let ((bufs, replay), made) =
            recent_shape(&mut self.shapes, MAX_SESSION_CHAIN_SHAPES, fits, || {
                model.session_chain_buffers(n, depth, CHAIN_FEED_MAX, capacity)
            })?;
        self.made += u64::from(made);
        bufs.start(all)?;
        let replayed = replay.uses_graph();
        replay.run(model, || model.grow_session_chains(bufs))?;
        if !replayed {
            self.making += t0.elapsed();
        }
        Ok(bufs.out.clone())
    }

    /// Whether the growth of `sessions` chains of `depth` over caches of `capacity` slots
    /// replays a captured graph (that of [`chain_shape_sessions`] sessions).
    pub fn uses_graph(&self, sessions: usize, depth: usize, capacity: usize) -> bool {
        let n = [chain_shape_sessions(sessions), sessions];
        self.shapes.iter().any(|(b, r)| {
            n.contains(&b.sessions())
                && b.depth() == depth
                && b.capacity() == capacity
                && r.uses_graph()
        })
    }

    /// Shapes made so far: each costs an eager pass and a capture.
    pub fn shapes_made(&self) -> u64 {
        self.made
    }

    /// Host time spent so far in growths that made a shape, ran it eagerly or captured it.
    pub fn making_time(&self) -> std::time::Duration {
        self.making
    }
}

/// The most shapes a [`SessionRowsStepper`] keeps graphs of (the least recently used goes
/// first).
const MAX_SESSION_ROWS_SHAPES: usize = 32;

/// Several sessions' verify passes of a chain each ([`Transformer::session_rows`]), replayed
/// from a graph captured per shape (sessions, rows a session, largest capacity). The graph
/// reads each session's cache addresses from the table [`SessionRows::start`] writes, so one
/// graph serves any caches of at most its capacity; a new shape runs once eagerly and is
/// captured the next time.
#[derive(Default)]
pub struct SessionRowsStepper {
    /// By use, the least recent first.
    shapes: Vec<(SessionRows, Replay)>,
    /// Shapes made so far (each one's buffers, eager run and capture).
    made: u64,
}

impl SessionRowsStepper {
    /// A stepper with no graphs yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `parts`' rows (every part the same number) as one pass over buffers (and a graph)
    /// for caches of `capacity` slots, at least every part's cache's; returns the
    /// `(sessions · rows, vocab)` f32 logits, session by session (the stepper's own buffer,
    /// overwritten by the next pass of that shape). Writes each row's K/V at its slot; the
    /// caches' lengths are left alone.
    pub fn pass(
        &mut self,
        model: &Transformer,
        parts: &[SessionChainRows<'_>],
        capacity: usize,
    ) -> Result<Tensor, ModelError> {
        let n = parts.len();
        let rows = parts.first().map_or(0, |p| p.tokens.len());
        if !model.session_rows_fit(capacity, n, rows) {
            return Err(ModelError::Unsupported(format!(
                "no pass of {n} sessions of {rows} rows for this model"
            )));
        }
        specsplit_core::device::bind_to_thread(model.device())?;
        let fits =
            |b: &SessionRows| b.sessions() == n && b.rows() == rows && b.capacity() == capacity;
        let ((bufs, replay), made) =
            recent_shape(&mut self.shapes, MAX_SESSION_ROWS_SHAPES, fits, || {
                model.session_rows_buffers(n, rows, capacity)
            })?;
        self.made += u64::from(made);
        bufs.start(parts)?;
        replay.run(model, || model.session_rows(bufs))?;
        Ok(bufs.logits.clone())
    }

    /// Whether a pass of `sessions` sessions of `rows` rows over caches of `capacity` slots
    /// replays a captured graph.
    pub fn uses_graph(&self, sessions: usize, rows: usize, capacity: usize) -> bool {
        self.shapes.iter().any(|(b, r)| {
            b.sessions() == sessions
                && b.rows() == rows
                && b.capacity() == capacity
                && r.uses_graph()
        })
    }

    /// Shapes made so far: each costs an eager pass and a capture.
    pub fn shapes_made(&self) -> u64 {
        self.made
    }
}
