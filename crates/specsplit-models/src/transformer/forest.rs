//! Greedy chains grown below the roots of a forest, every level one pass of all the chains,
//! with no shape that depends on the cache's length: [`Transformer::grow_chains`], which a
//! captured CUDA graph replays (a draft worker pre-drafting every outcome of a round).
//!
//! Root `b` sees the cached slots `0..lead_b` (a run of the sequence) and sits at position
//! `lead_b`; the node at level `l` below it sits at position `lead_b + l` and slot `base + l·n +
//! b`, and sees its lead run, its root and the nodes above it. Every input is written in one
//! upload ([`ChainGrowth::start`]); the chains' tokens and log-probabilities come back in one
//! `(2·depth, n)` buffer.

use super::stack::RowsAttention;
use super::Transformer;
use crate::fused::{self, PassKeys};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;

/// Weights of at least this many elements go through cuBLAS in a draft pass of more than
/// [`fused::GEMV_MAX_ROWS`] rows, the smaller ones through the batch-invariant product. A draft
/// is only a proposal the target verifies, so its passes need no batch invariance. Measured
/// (`specsplit-bench forward --growth-rows 10`, Qwen2.5 0.5B shape, H200, 2026-11-27): a level
/// of 10 chains took 1.181 ms with every product batch-invariant, 1.082 ms with cuBLAS for
/// gate|up, down and the head (cuBLAS loses on the smaller Q|K|V and output products).
const GROWTH_CUBLAS_MIN: usize = 4 << 20;

/// Products of a draft pass of two rows with fewer columns than this run through the step's
/// GEMV, the wider ones through the batch-invariant product (see [`growth_product`]).
const CHAIN_GEMV_MAX_COLS: usize = 4096;

/// A draft pass's product (a growth of chains, or sessions' chains grown together), by its
/// rows. The step's GEMV reads each weight once for all rows, but its time grows with the rows
/// (each warp loads every row's input): at the Qwen2.5 0.5B shape on an H200, per launch in a
/// graph, one row's products took 2.2 (Q|K|V), 1.9 (output), 5.3 (gate|up), 4.1 (down) and 63
/// µs (head) through the GEMV against 3.0, 2.8, 7.2, 5.5 and 67 through the batch-invariant
/// product; two rows' 2.7, 2.3, 7.8, 4.9 and 94 against 3.0, 2.8, 5.4, 5.5 and 69; three and
/// four rows' every product was faster through the batch-invariant product (`specsplit-bench
/// kernels --shape qwen2.5-0.5b --rows 1,2,3,4 --contexts 256 --rows-pass --gemv-warp-rows
/// 1,2,4`, 2026-11-29). Hence one row through the GEMV, two rows through it for the narrow
/// products, up to [`fused::GEMV_MAX_ROWS`] rows through the batch-invariant product, and more
/// through cuBLAS for weights of at least [`GROWTH_CUBLAS_MIN`] elements.
pub(super) fn growth_product(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    launch: fused::Launch,
) -> candle_core::Result<Tensor> {
    match x.dim(0)? {
        1 => fused::gemv_rows(x, w, bias, launch),
        2 if w.dim(0)? < CHAIN_GEMV_MAX_COLS => fused::gemv_rows(x, w, bias, launch),
        n if n <= fused::GEMV_MAX_ROWS => fused::bi_matmul(x, w, bias, launch),
        _ if w.elem_count() >= GROWTH_CUBLAS_MIN => fused::cublas_product(x, w, bias),
        _ => fused::bi_matmul(x, w, bias, launch),
    }
}

/// The greedy head of level `level` of a growth of `depth` levels over `logits`: each row's
/// token (the synthetic proposer's where `forced_on` says so) and log-probability, written to
/// rows `level` and `depth + level` of `out`; the tokens, which feed the next level.
pub(super) fn greedy_level(
    logits: &Tensor,
    (forced, forced_on, out): (&Tensor, &Tensor, &Tensor),
    depth: usize,
    level: usize,
    launch: fused::Launch,
) -> candle_core::Result<Tensor> {
    fused::greedy_rows(
        logits,
        &forced.get(level)?,
        &forced_on.get(level)?,
        &out.get(level)?,
        &out.get(depth + level)?,
        launch,
    )
}

/// Device buffers of [`Transformer::grow_chains`] for `rows` chains of `depth` tokens whose
/// nodes see at most `span` keys each (the keys the attention is launched over).
pub struct ChainGrowth {
    /// u32: everything [`ChainGrowth::start`] writes, in one upload.
    io: Tensor,
    /// `(rows,)`: the roots' tokens.
    roots: Tensor,
    /// `(depth, rows)`: each level's positions.
    positions: Tensor,
    /// `(depth, rows)`: each level's cache slots.
    slots: Tensor,
    /// Each level's visible slots.
    keys: Vec<PassKeys>,
    /// `(depth, rows)`: a token that replaces the greedy one where `forced_on` is 1.
    forced: Tensor,
    /// `(depth, rows)`: 1 where `forced` holds.
    forced_on: Tensor,
    /// `(2 depth, rows)` f32: level `l`'s greedy tokens in row `l` (exact in f32: ids are below
    /// 2^24), their log-probabilities in row `depth + l`.
    pub out: Tensor,
    /// `(depth, rows, vocab)` in the model's dtype: each level's logits, row `b` of level `l`
    /// the distribution after chain `b`'s node at that level (17.4 MiB for 15 chains of 4 over
    /// a 151,936-token vocabulary in bf16, held by each stepper that grows that shape).
    pub logits: Tensor,
    rows: usize,
    depth: usize,
    capacity: usize,
}

impl ChainGrowth {
    /// Sets the next growth's input (one upload): the roots' tokens `roots`, the length of
    /// each root's visible run `leads` (its position), the slot `base` the first level's nodes
    /// start at, and `forced` (`depth × rows`, level-major, or empty): tokens that replace the
    /// greedy ones (a synthetic proposer's).
    pub fn start(
        &self,
        roots: &[u32],
        leads: &[usize],
        base: usize,
        forced: &[Option<u32>],
    ) -> Result<(), ModelError> {
        let (n, depth) = (self.rows, self.depth);
        if roots.len() != n || leads.len() != n || !(forced.is_empty() || forced.len() == depth * n)
        {
            return Err(ModelError::Input(format!(
                "{n} chains of {depth} were given {} roots, {} leads and {} forced tokens",
                roots.len(),
                leads.len(),
                forced.len()
            )));
        }
        let end = base + depth * n;
        let longest = leads.iter().max().copied().unwrap_or(0) + depth;
        if longest > self.span() && longest <= self.capacity {
            return Err(ModelError::Input(format!(
                "chains of {depth} after runs of up to {} tokens see more than the {} keys \
                 their buffers were made for",
                longest - depth,
                self.span()
            )));
        }
        if end > self.capacity || longest > self.capacity || leads.iter().any(|&l| l > base) {
            return Err(ModelError::Input(format!(
                "{n} chains of {depth} at slot {base} after runs of up to {} tokens do not fit \
                 {} slots",
                longest - depth,
                self.capacity
            )));
        }
        let mut io = Vec::with_capacity(self.io.elem_count());
        io.extend_from_slice(roots);
        for l in 0..depth {
            io.extend(leads.iter().map(|&lead| (lead + l) as u32));
        }
        let slot = |l: usize, b: usize| (base + l * n + b) as u32;
        for l in 0..depth {
            io.extend((0..n).map(|b| slot(l, b)));
        }
        for l in 0..depth {
            for &lead in leads {
                io.extend([lead as u32, l as u32 + 1]);
            }
        }
        for l in 0..depth {
            for b in 0..n {
                io.extend((0..depth).map(|i| if i <= l { slot(i, b) } else { 0 }));
            }
        }
        let forced_at = |i: usize| forced.get(i).copied().flatten();
        io.extend((0..depth * n).map(|i| forced_at(i).unwrap_or(0)));
        io.extend((0..depth * n).map(|i| u32::from(forced_at(i).is_some())));
        Ok(fused::write_u32(&self.io, &io)?)
    }

    /// Chains grown at once.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per chain.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The keys a node may see at most (the attention's launch).
    pub fn span(&self) -> usize {
        self.keys[0].span()
    }

    /// These buffers with the attention launched over `span` keys instead (at most the
    /// capacity): the same inputs and outputs (one upload serves both), other key bounds.
    pub fn with_span(&self, span: usize) -> Result<ChainGrowth, ModelError> {
        Ok(ChainGrowth {
            io: self.io.clone(),
            roots: self.roots.clone(),
            positions: self.positions.clone(),
            slots: self.slots.clone(),
            keys: self
                .keys
                .iter()
                .map(|k| k.with_span(span))
                .collect::<candle_core::Result<Vec<_>>>()?,
            forced: self.forced.clone(),
            forced_on: self.forced_on.clone(),
            out: self.out.clone(),
            logits: self.logits.clone(),
            rows: self.rows,
            depth: self.depth,
            capacity: self.capacity,
        })
    }
}

impl Transformer {
    /// Whether [`Transformer::grow_chains`] runs for this model with `rows` chains over caches
    /// of `capacity` slots: [`Transformer::exact_rows_fit`].
    pub fn grow_chains_fit(&self, capacity: usize, rows: usize) -> bool {
        self.exact_rows_fit(capacity, rows)
    }

    /// Device buffers for [`Transformer::grow_chains`]: `rows` chains of `depth` tokens over
    /// caches of `capacity` slots, each node seeing at most `span` keys (see
    /// [`crate::fused::replay_span`]; at most `capacity`).
    pub fn chain_growth_buffers(
        &self,
        capacity: usize,
        rows: usize,
        depth: usize,
        span: usize,
    ) -> Result<ChainGrowth, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let (n, d) = (rows, depth);
        if n == 0 || n > fused::BI_MAX_ROWS || d == 0 || d * n > capacity {
            return Err(ModelError::Input(format!(
                "chain growth takes 1 to {} chains of at least one token within {capacity} \
                 slots, not {n} of {d}",
                fused::BI_MAX_ROWS
            )));
        }
        let len = n + 2 * d * n + 2 * d * n + d * n * d + 2 * d * n;
        let io = Tensor::zeros(len, DType::U32, &self.device)?;
        let mut at = 0;
        let mut part = |size: usize| {
            let t = io.narrow(0, at, size);
            at += size;
            t
        };
        let roots = part(n)?;
        let positions = part(d * n)?.reshape((d, n))?;
        let slots = part(d * n)?.reshape((d, n))?;
        let metas = part(2 * d * n)?.reshape((d, n, 2))?;
        let extras = part(d * n * d)?.reshape((d, n, d))?;
        let forced = part(d * n)?.reshape((d, n))?;
        let forced_on = part(d * n)?.reshape((d, n))?;
        Ok(ChainGrowth {
            roots,
            positions,
            slots,
            keys: (0..d)
                .map(|l| PassKeys::device_listed(metas.get(l)?, extras.get(l)?, capacity, span))
                .collect::<candle_core::Result<Vec<_>>>()?,
            forced,
            forced_on,
            io,
            out: Tensor::zeros((2 * d, n), DType::F32, &self.device)?,
            logits: Tensor::zeros((d, n, self.config.vocab_size), self.dtype, &self.device)?,
            rows: n,
            depth: d,
            capacity,
        })
    }

    /// Grows `b.rows()` greedy chains of `b.depth()` tokens below the roots set by
    /// [`ChainGrowth::start`], one pass a level (the fused layers, products through
    /// `growth_product`, the one-kernel draft attention up to
    /// [`fused::DRAFT_ATTENTION_MAX_SPAN`] keys: each row's logits those of a
    /// [`Transformer::forward_tree`] of the same forest up to bf16 rounding) and one greedy
    /// head for all its rows (`greedy_level`), with every input read on the device, so a
    /// captured CUDA graph serves every round: writes each node's K/V
    /// at its slot (past the cache's length, which is left alone) and the chains' tokens and
    /// log-probabilities to `b.out`, and each level's logits to `b.logits`. Fails unless
    /// [`Transformer::grow_chains_fit`] holds.
    pub fn grow_chains(&self, b: &ChainGrowth, cache: &SessionCache) -> Result<(), ModelError> {
        let layers = self.exact_rows_layers("chain growth", b.capacity, b.rows, cache)?;
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, bias: Option<&Tensor>| growth_product(x, w, bias, launch);
        let mut ids = b.roots.clone();
        for level in 0..b.depth {
            let (positions, slots) = (b.positions.get(level)?, b.slots.get(level)?);
            let keys = &b.keys[level];
            let slots = fused::RowSlots::Listed(&slots);
            let draft = RowsAttention::Draft;
            let (h, head) = self.rows_stack(
                &layers, &product, &ids, &positions, slots, keys, cache, draft,
            )?;
            let logits = product(&h, head, None)?;
            b.logits.slice_set(&logits.unsqueeze(0)?, 0, level)?;
            let head_io = (&b.forced, &b.forced_on, &b.out);
            ids = greedy_level(&logits, head_io, b.depth, level, launch)?;
        }
        Ok(())
    }

    /// Moves entry `from` to entry `to` of every layer's K and V in `cache`, for each
    /// `(from, to)` of `moves` (at most [`fused::MOVE_MAX`], destinations distinct, sources read
    /// before any destination is written): a pre-draft keeping the rows its growth computed
    /// for the branch a verdict selected. One launch on CUDA in bf16. The cache's length is
    /// left alone.
    pub fn move_cache_entries(
        &self,
        cache: &SessionCache,
        moves: &[(usize, usize)],
    ) -> Result<(), ModelError> {
        let mut buffers = Vec::with_capacity(2 * self.layers.len());
        for layer in 0..self.layers.len() {
            let (k, v) = cache.buffers(layer)?;
            buffers.extend([k, v]);
        }
        Ok(fused::move_entries(&buffers, moves, self.kernels.launch())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::Device;

    #[test]
    fn chain_inputs_place_each_level_after_the_last_and_list_each_nodes_ancestors() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let b = m.chain_growth_buffers(32, 2, 3, 32).unwrap();
        // Two roots after runs of 5 and 7 cached tokens; levels from slot 9.
        b.start(
            &[40, 41],
            &[5, 7],
            9,
            &[None, Some(3), None, None, None, Some(4)],
        )
        .unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        #[rustfmt::skip]
        let want = [
            40, 41,                             // roots
            5, 7, 6, 8, 7, 9,                   // positions by level
            9, 10, 11, 12, 13, 14,              // slots by level
            5, 1, 7, 1, 5, 2, 7, 2, 5, 3, 7, 3, // runs and listed counts by level
            9, 0, 0, 10, 0, 0,                  // level 0: each root's slot
            9, 11, 0, 10, 12, 0,                // level 1: the root's, then its own
            9, 11, 13, 10, 12, 14,              // level 2
            0, 3, 0, 0, 0, 4,                   // forced tokens
            0, 1, 0, 0, 0, 1,                   // where forced
        ];
        assert_eq!(v(&b.io), want);
        assert_eq!(v(&b.slots), [9, 10, 11, 12, 13, 14]);
        assert_eq!(v(&b.forced), [0, 3, 0, 0, 0, 4]);
        assert_eq!(v(&b.forced_on), [0, 1, 0, 0, 0, 1]);
        // Wrong counts, a run past the base and levels past the capacity are refused.
        assert!(b.start(&[1], &[5, 7], 9, &[]).is_err());
        assert!(b.start(&[1, 2], &[5, 10], 9, &[]).is_err());
        assert!(b.start(&[1, 2], &[5, 7], 27, &[]).is_err());
        b.start(&[1, 2], &[5, 7], 26, &[]).unwrap();
        assert!(m.chain_growth_buffers(32, 0, 3, 32).is_err());
        assert!(m.chain_growth_buffers(8, 3, 3, 8).is_err());
        assert!(m.chain_growth_buffers(32, 2, 3, 33).is_err());
        // Another span shares the inputs; chains whose nodes see more keys are refused.
        let short = b.with_span(9).unwrap();
        assert_eq!((short.span(), short.rows(), short.depth()), (9, 2, 3));
        short.start(&[40, 41], &[5, 6], 9, &[]).unwrap();
        assert_eq!(v(&b.roots), [40, 41]);
        let e = short
            .start(&[40, 41], &[5, 7], 9, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("9 keys"), "{e}");
        assert!(b.with_span(33).is_err());
        // Off CUDA there is no chain growth.
        let cache = m.new_cache(32).unwrap();
        assert!(!m.grow_chains_fit(32, 2));
        assert!(m.grow_chains(&b, &cache).is_err());
    }

    #[test]
    fn moved_entries_read_every_source_before_writing() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let cache = m.new_cache(8).unwrap();
        let layers = m.config().num_hidden_layers;
        // Every entry of every buffer distinct: 1000·buffer + 10·slot + element.
        for l in 0..layers {
            let (k, v) = cache.buffers(l).unwrap();
            for (i, t) in [k, v].into_iter().enumerate() {
                let (_, kv, cap, hd) = t.dims4().unwrap();
                let vals: Vec<f32> = (0..kv * cap * hd)
                    .map(|e| (1000 * (2 * l + i) + 10 * ((e / hd) % cap) + e % hd) as f32)
                    .collect();
                let src = Tensor::from_vec(vals, t.shape(), &Device::Cpu).unwrap();
                t.slice_set(&src, 0, 0).unwrap();
            }
        }
        let before: Vec<Vec<f32>> = (0..layers)
            .flat_map(|l| {
                let (k, v) = cache.buffers(l).unwrap();
                [k, v].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            })
            .collect();
        // Slot 2 is a destination and a source; so is slot 5.
        let moves = [(5, 2), (2, 3), (7, 5)];
        m.move_cache_entries(&cache, &moves).unwrap();
        for l in 0..layers {
            let (k, v) = cache.buffers(l).unwrap();
            for (i, t) in [k, v].into_iter().enumerate() {
                let (_, kv, cap, hd) = t.dims4().unwrap();
                let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let old = &before[2 * l + i];
                assert_eq!(got.len(), kv * cap * hd);
                for (e, &value) in got.iter().enumerate() {
                    let (head, slot, x) = (e / (cap * hd), (e / hd) % cap, e % hd);
                    let from = moves.iter().find(|mv| mv.1 == slot).map_or(slot, |mv| mv.0);
                    assert_eq!(
                        value,
                        old[(head * cap + from) * hd + x],
                        "buffer {} {e}",
                        2 * l + i
                    );
                }
            }
        }
        // Repeated destinations, slots past the capacity and too many moves are refused.
        assert!(m.move_cache_entries(&cache, &[(1, 2), (3, 2)]).is_err());
        assert!(m.move_cache_entries(&cache, &[(8, 2)]).is_err());
        let many: Vec<(usize, usize)> = (0..fused::MOVE_MAX + 1).map(|i| (0, i)).collect();
        let cache = m.new_cache(16).unwrap();
        assert!(m.move_cache_entries(&cache, &many).is_err());
    }
}
