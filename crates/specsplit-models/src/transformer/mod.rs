//! A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) whose forward pass takes explicit
//! position ids, an additive attention mask (causal or tree) and a session KV cache, and returns
//! logits only for the requested rows.
//!
//! Attention never materialises repeated K/V heads: the query heads that share a KV head are
//! folded into the row dimension (`(1, kv_heads, n_rep * n, head_dim)`) and multiplied directly
//! against the cache's strided views, which both candle's CPU gemm and cuBLAS accept without a
//! copy (the inner dimension of the K/V views is contiguous). Nothing in the forward pass reads
//! values back to the host.

mod forest;
mod graph;
mod linear;
mod load;
mod plan;
mod session_chains;
mod session_rows;
mod sessions;
mod stack;

pub use forest::ChainGrowth;
pub use graph::{ExactRows, StaticStep};
pub use plan::{ForwardPath, Pass};
pub use session_chains::{SessionChain, SessionChains, CHAIN_FEED_MAX};
pub use session_rows::{SessionChainRows, SessionRows};
pub use sessions::SessionPass;

use crate::config::ModelConfig;
use crate::cpu_attention::{RowKeys, TreeRows, Visibility};
use crate::fused::KernelOptions;
use crate::ModelError;
use candle_core::{DType, Device, Tensor};
use linear::{Embedding, Linear, Proj};
use specsplit_core::cache::{CacheSpec, SessionCache};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

#[derive(Debug, Clone)]
/// One decoder layer's weights.
struct Layer {
    attn_norm: Tensor,
    /// Q, K and V projections.
    qkv: Proj,
    o: Linear,
    mlp_norm: Tensor,
    /// Gate and up projections.
    gate_up: Proj,
    down: Linear,
}

/// The dense product `x W^T (+ b)` of a fused layer stack.
type Product<'a> = &'a dyn Fn(&Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor>;

/// How one pass computes attention.
enum AttnPath<'a> {
    /// Batched matmuls under an optional additive mask (cuBLAS or candle's CPU gemm).
    Batched(Option<&'a Tensor>),
    /// One product per row over its visible keys ([`crate::cpu_attention`]).
    PerRow(&'a RowKeys),
    /// The batch-invariant CUDA kernel over each row's visible slots.
    Fused(&'a crate::fused::PassKeys),
}

impl Layer {
    /// The SwiGLU block of the layer on the residual stream `x` (its output, before the
    /// residual add).
    fn mlp(&self, x: &Tensor, eps: f32, k: &KernelOptions) -> candle_core::Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &self.mlp_norm, eps)?;
        let gu = self.gate_up.forward(&h, k)?;
        self.down
            .forward(&(candle_nn::ops::silu(&gu[0])? * &gu[1])?, k)
    }
}

/// A Llama-family transformer with tree-capable forward over a [`SessionCache`].
pub struct Transformer {
    config: ModelConfig,
    device: Device,
    dtype: DType,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables `(max_position_embeddings, head_dim / 2)` in the model dtype.
    cos: Tensor,
    sin: Tensor,
    /// llama.cpp's llama-arch GGUFs store Q/K rows permuted for interleaved-pair rotary; applying
    /// the interleaved rotary to them is exactly the half-split rotary on the original weights.
    rope_interleaved: bool,
    /// Causal `(n, n)` triangles (0 / -inf) by `n`, built once per size.
    causal: Mutex<HashMap<usize, Tensor>>,
    /// Which fused-kernel paths the passes run.
    kernels: KernelOptions,
    /// Whether the fused layer stack takes these weights (see [`Transformer::fused_enabled`]).
    fused_fit: OnceLock<bool>,
    /// The [`ForwardPath`]s logged so far, a bit each.
    logged_paths: AtomicU16,
    /// Fixed-shape passes run eagerly or captured so far (see [`Transformer::graph_setups`]).
    graph_setups: AtomicU64,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("config", &self.config)
            .field("device", &self.device.location())
            .field("dtype", &self.dtype)
            .field("quantized", &self.lm_head.is_quantized())
            .finish()
    }
}

impl Transformer {
    /// Fixed-shape passes (a step, a chain, a growth) this model has run eagerly or captured
    /// into a CUDA graph so far: each is a one-off cost of a new shape, where a replayed pass
    /// costs its kernels only. A caller compares the count before and after its work to tell
    /// whether that work's time stands for the next's. Never counted off CUDA.
    pub fn graph_setups(&self) -> u64 {
        self.graph_setups.load(Ordering::Relaxed)
    }

    /// Counts one fixed-shape pass run eagerly or captured.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn note_graph_setup(&self) {
        self.graph_setups.fetch_add(1, Ordering::Relaxed);
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Which fused-kernel paths the passes run ([`KernelOptions::default`] at load).
    pub fn kernel_options(&self) -> KernelOptions {
        self.kernels
    }

    /// Sets which fused-kernel paths the passes run from here on; those the build lacks stay
    /// off ([`KernelOptions::available`]).
    pub fn set_kernel_options(&mut self, options: KernelOptions) {
        self.kernels = options.available();
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The activation (and KV cache) dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The KV cache shape this model needs for `capacity` entries.
    pub fn cache_spec(&self, capacity: usize) -> CacheSpec {
        CacheSpec {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            capacity,
        }
    }

    /// Allocates a session KV cache for this model holding up to `capacity` entries.
    pub fn new_cache(&self, capacity: usize) -> Result<SessionCache, ModelError> {
        Ok(SessionCache::new(
            self.cache_spec(capacity),
            self.dtype,
            &self.device,
        )?)
    }

    /// Allocates a session KV cache for this model holding `capacity` entries now that
    /// [`SessionCache::reserve`] grows up to `max_capacity` entries.
    pub fn new_growable_cache(
        &self,
        capacity: usize,
        max_capacity: usize,
    ) -> Result<SessionCache, ModelError> {
        Ok(SessionCache::growable(
            self.cache_spec(capacity),
            max_capacity,
            self.dtype,
            &self.device,
        )?)
    }

    /// The causal mask over `n` new tokens after `past` cached ones: `(n, past + n)`.
    fn causal_mask(&self, n: usize, past: usize) -> Result<Tensor, ModelError> {
        let tri = {
            let mut masks = self.causal.lock().unwrap_or_else(|e| e.into_inner());
            match masks.get(&n) {
                Some(t) => t.clone(),
                None => {
                    let data: Vec<f32> = (0..n)
                        .flat_map(|i| {
                            (0..n).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })
                        })
                        .collect();
                    let t = Tensor::from_vec(data, (n, n), &self.device)?.to_dtype(self.dtype)?;
                    masks.insert(n, t.clone());
                    t
                }
            }
        };
        if past == 0 {
            return Ok(tri);
        }
        let zeros = Tensor::zeros((n, past), self.dtype, &self.device)?;
        Ok(Tensor::cat(&[&zeros, &tri], 1)?)
    }

    /// Appends `tokens` to the end of `cache` (causal, positions following the cached ones),
    /// computing no logits a caller needs: a draft's prefill. Where the model runs wide fused
    /// passes (bf16 on CUDA, [`KernelOptions::wide_rows`]), the tokens go through in passes of
    /// up to [`crate::fused::WIDE_MAX_ROWS`] rows; else, where it runs the batch-invariant rows
    /// kernels, in passes of [`crate::fused::BI_MAX_ROWS`] rows, about ten launches a layer
    /// each, instead of one pass of candle's batched ops (several times the launches): faster
    /// for a small, launch-bound model (0.5B shape, 127 tokens: 9.8–10.6 → 7.2 ms with the
    /// draft's first chain).
    pub fn prefill(&self, tokens: &[u32], cache: &mut SessionCache) -> Result<(), ModelError> {
        let (wide, rows) = (crate::fused::WIDE_MAX_ROWS, crate::fused::BI_MAX_ROWS);
        let first = Pass::Forward {
            rows: tokens.len().min(wide),
        };
        let size = match self.plan(first) {
            ForwardPath::FusedWide | ForwardPath::WideUnfused => wide,
            _ if self.exact_rows_fit(cache.capacity(), rows) => rows,
            _ => tokens.len().max(1),
        };
        for part in tokens.chunks(size) {
            let at = cache.len() as u32;
            let pos: Vec<u32> = (at..at + part.len() as u32).collect();
            self.forward(
                &Tensor::new(part, &self.device)?,
                &Tensor::new(pos.as_slice(), &self.device)?,
                None,
                cache,
                &Tensor::new(&[part.len() as u32 - 1], &self.device)?,
            )?;
        }
        Ok(())
    }

    /// Runs `n` new tokens through the model.
    ///
    /// - `tokens`: u32 `(n,)`; `positions`: u32 `(n,)` rotary position ids (any order, any values
    ///   below `max_position_embeddings`);
    /// - `mask`: additive `(n, cache.len() + n)` in the model dtype (0 = visible, -inf = hidden),
    ///   or `None` for causal attention over the new tokens with the whole cached prefix visible;
    /// - appends the tokens' K/V to `cache` (its length grows by `n`);
    /// - returns f32 logits `(rows.len(), vocab)` for the row indices `rows` (u32, in `0..n`).
    pub fn forward(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let vis = mask.map_or(Visibility::Causal { past: cache.len() }, Visibility::Mask);
        self.forward_pass(tokens, positions, vis, cache, rows)
    }

    /// [`Transformer::forward`] of the rows of a token tree described on the host (`tree`'s
    /// prefix must be the cached slots before its first node, `tree.prefix + tree.first_row ==
    /// cache.len()`): what `forward` computes with `tree.to_tensor` as the mask, without reading
    /// a device mask back to the host; the mask is only built on the device for the passes that
    /// use one.
    pub fn forward_tree(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        tree: TreeRows<'_>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        if tree.prefix + tree.first_row != cache.len() {
            return Err(ModelError::Input(format!(
                "the tree's rows start after {} + {} slots but the cache holds {}",
                tree.prefix,
                tree.first_row,
                cache.len()
            )));
        }
        self.forward_pass(tokens, positions, Visibility::Tree(tree), cache, rows)
    }

    fn forward_pass(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        vis: Visibility<'_>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let c = &self.config;
        let n = tokens.dims1().map_err(|_| {
            ModelError::Input(format!("tokens must be 1-D, got {:?}", tokens.dims()))
        })?;
        if n == 0 {
            return Err(ModelError::Input("no tokens given".into()));
        }
        if positions.dims() != [n] {
            return Err(ModelError::Input(format!(
                "positions have shape {:?}, expected ({n},)",
                positions.dims()
            )));
        }
        if rows.rank() != 1 {
            return Err(ModelError::Input(format!(
                "rows must be 1-D, got {:?}",
                rows.dims()
            )));
        }
        for (what, t) in [("tokens", tokens), ("positions", positions), ("rows", rows)] {
            if t.dtype() != DType::U32 {
                return Err(ModelError::Input(format!(
                    "{what} must be u32, got {:?}",
                    t.dtype()
                )));
            }
        }
        let spec = cache.spec();
        if *spec != self.cache_spec(spec.capacity) || cache.dtype() != self.dtype {
            return Err(ModelError::Input(format!(
                "cache {spec:?} ({:?}) does not fit this model ({:?}, {:?}); create it with \
                 Transformer::new_cache",
                cache.dtype(),
                self.cache_spec(spec.capacity),
                self.dtype
            )));
        }
        let past = cache.len();
        let total = past + n;
        let plan = self.plan(Pass::Forward { rows: n });
        if total > cache.capacity() {
            return Err(specsplit_core::cache::CacheError::CapacityExceeded {
                needed: total,
                capacity: cache.capacity(),
            }
            .into());
        }
        if let Visibility::Mask(m) = &vis {
            if m.dims() != [n, total] {
                return Err(ModelError::Input(format!(
                    "mask has shape {:?}, expected ({n}, {total}) = (new tokens, cached + new)",
                    m.dims()
                )));
            }
        }
        // The batch-invariant paths need each row's visible keys (computed once per pass) and
        // no device mask; the batched path needs the mask.
        let per_row = plan != ForwardPath::Batched;
        let rows_kernels = matches!(
            plan,
            ForwardPath::FusedExact
                | ForwardPath::ExactUnfused
                | ForwardPath::FusedWide
                | ForwardPath::WideUnfused
        );
        let mask = match vis {
            _ if per_row => None,
            Visibility::Mask(m) => Some(m.to_dtype(self.dtype)?),
            Visibility::Tree(t) => Some(t.to_tensor(n, self.dtype, &self.device)?),
            Visibility::Causal { .. } if n == 1 => None,
            Visibility::Causal { .. } => Some(self.causal_mask(n, past)?),
        };
        let eps = c.rms_norm_eps as f32;
        let row_keys = if per_row {
            Some(RowKeys::new(vis, n)?)
        } else {
            None
        };
        let pass_keys = match &row_keys {
            Some(keys) if rows_kernels => Some(crate::fused::PassKeys::new(
                &keys.split_rows(),
                &self.device,
            )?),
            _ => None,
        };
        if let (Some(keys), ForwardPath::FusedExact | ForwardPath::FusedWide) = (&pass_keys, plan) {
            let layers = self.fused_layers()?;
            // A wide pass (a prompt's prefill) needs no batch invariance: cuBLAS products.
            let launch = self.kernels.launch();
            let bi = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
                crate::fused::bi_matmul(x, w, b, launch)
            };
            let product: Product<'_> = if plan == ForwardPath::FusedExact {
                &bi
            } else {
                &crate::fused::cublas_product
            };
            return self.forward_fused_rows(&layers, product, tokens, positions, keys, cache, rows);
        }
        let cos = self.cos.index_select(positions, 0)?;
        let sin = self.sin.index_select(positions, 0)?;
        let path = match (&pass_keys, &row_keys) {
            (Some(keys), _) => AttnPath::Fused(keys),
            (None, Some(keys)) => AttnPath::PerRow(keys),
            (None, None) => AttnPath::Batched(mask.as_ref()),
        };
        let mut x = self.embed.forward(tokens, self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let a = self.attention(i, layer, &h, (&cos, &sin), &path, cache)?;
            x = (x + a)?;
            x = (&x + layer.mlp(&x, eps, &self.kernels)?)?;
        }
        cache.advance(n)?;
        let x = x.index_select(rows, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self
            .lm_head
            .forward(&x, &self.kernels)?
            .to_dtype(DType::F32)?)
    }

    /// Rotary embedding of `x` `(1, heads, n, head_dim)` with gathered `(n, head_dim / 2)`
    /// tables, in the pair layout the weights were stored in.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        if self.rope_interleaved {
            candle_nn::rotary_emb::rope_i(x, cos, sin)
        } else {
            candle_nn::rotary_emb::rope(x, cos, sin)
        }
    }

    /// Whether any projection keeps quantized (GGUF) weights.
    pub fn is_quantized(&self) -> bool {
        let quant = |l: &Linear| l.is_quantized();
        let proj = |p: &Proj| match p {
            Proj::Fused { lin, .. } => quant(lin),
            Proj::Split(ls) => ls.iter().any(quant),
        };
        quant(&self.lm_head)
            || self
                .layers
                .iter()
                .any(|l| proj(&l.qkv) || proj(&l.gate_up) || quant(&l.o) || quant(&l.down))
    }

    fn attention(
        &self,
        index: usize,
        layer: &Layer,
        h: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        path: &AttnPath<'_>,
        cache: &mut SessionCache,
    ) -> Result<Tensor, ModelError> {
        let qkv = layer.qkv.forward(h, &self.kernels)?;
        let y = self.attend(index, (&qkv[0], &qkv[1], &qkv[2]), (cos, sin), path, cache)?;
        Ok(layer.o.forward(&y, &self.kernels)?)
    }

    /// Rotary, the K/V cache write and attention of layer `index` for the `n` rows of one
    /// session: `q`, `k`, `v` `(n, heads * head_dim)`, `(n, kv * head_dim)` twice, rotary
    /// tables gathered at the rows' positions. Returns the attention output `(n, heads *
    /// head_dim)`, before the output projection.
    fn attend(
        &self,
        index: usize,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (cos, sin): (&Tensor, &Tensor),
        path: &AttnPath<'_>,
        cache: &mut SessionCache,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let n = q.dim(0)?;
        let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rep = heads / kv;
        let q = q
            .reshape((1, n, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k.reshape((1, n, kv, hd))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((1, n, kv, hd))?.transpose(1, 2)?;
        let (q, k) = (self.rope(&q, cos, sin)?, self.rope(&k, cos, sin)?);
        let (k_all, v_all) = cache.append(index, &k, &v)?;
        let total = k_all.dim(2)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let (mask, row_keys) = match path {
            AttnPath::Fused(keys) => {
                let (kb, vb) = cache.buffers(index)?;
                let shape = crate::fused::AttnShape {
                    heads,
                    kv,
                    head_dim: hd,
                    capacity: cache.capacity(),
                };
                return Ok(crate::fused::rows_attention(
                    &q.contiguous()?,
                    kb,
                    vb,
                    keys,
                    shape,
                    scale as f32,
                    self.kernels.launch(),
                )?);
            }
            AttnPath::PerRow(keys) => (None, Some(*keys)),
            AttnPath::Batched(mask) => (*mask, None),
        };
        let k_t = k_all.t()?;
        let y = if let Some(keys) = row_keys {
            // Batch-invariant attention (CPU; quantized models on CUDA): a token is computed
            // bit-identically whether it is decoded alone or verified inside a tree (see
            // `cpu_attention`). Causal and chain rows read the cache in place; a tree node
            // gathers its prefix and ancestors.
            crate::cpu_attention::attention(&q, &k_all, &v_all, keys, scale)?
        } else {
            // Fold the query heads sharing a KV head into rows: (1, kv, rep * n, hd).
            let q = q.reshape((1, kv, rep * n, hd))?;
            let att = (q.matmul(&k_t)? * scale)?;
            let att = match mask {
                Some(m) => att.reshape((1, heads, n, total))?.broadcast_add(m)?,
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            att.reshape((1, kv, rep * n, total))?.matmul(&v_all)?
        };
        Ok(y.reshape((1, heads, n, hd))?
            .transpose(1, 2)?
            .reshape((n, heads * hd))?)
    }
}
