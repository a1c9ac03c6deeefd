//! The multi-session pass: the new rows of several sessions, each with its own positions, tree
//! visibility and KV cache, through the model together, so that every product reads the
//! weights once for all of them.
//!
//! The pass concatenates the sessions' rows for everything that computes a row from that row
//! alone (the embedding, the norms, the residual adds, the SwiGLU gate and every product: Q|K|V,
//! output, gate|up, down and the head); what depends on the session (rotary at its positions,
//! the K/V write into its cache and attention over its visible slots) runs per session, or on
//! the fused path in one launch a layer for all sessions, each row reading its session's caches
//! from a [`SessionTable`](crate::fused::SessionTable). On the paths whose every kernel is batch-invariant (the per-row CPU path, and
//! on CUDA the batch-invariant rows passes, fused or not), a session's logits and K/V are then
//! bit for bit what [`Transformer::forward_tree`] of that session alone gives.

use super::{AttnPath, ForwardPath, Pass, Product, Transformer};
use crate::cpu_attention::{RowKeys, TreeRows, Visibility};
use crate::fused::{PassKeys, SessionTable, TableSession, BI_MAX_ROWS};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;
use std::ops::Range;

/// One session's share of a multi-session pass: what [`Transformer::forward_tree`] takes for it.
pub struct SessionPass<'a> {
    /// The session's new tokens.
    pub tokens: &'a [u32],
    /// Their rotary positions (each below `max_position_embeddings`).
    pub positions: &'a [u32],
    /// Their visibility, exactly as for [`Transformer::forward_tree`] (`tree.prefix +
    /// tree.first_row == cache.len()`).
    pub tree: TreeRows<'a>,
    /// The session's own cache; its length grows by `tokens.len()`.
    pub cache: &'a mut SessionCache,
    /// The rows (indices into `tokens`) whose logits the session wants.
    pub rows: &'a [u32],
}

/// The words of a device session table's cache addresses ([`crate::fused::cache_words`]) for
/// the K/V buffers of `caches`' first `layers` layers, each cache at its capacity.
pub(super) fn cache_table_words(
    caches: &[&SessionCache],
    layers: usize,
    kv: usize,
    head_dim: usize,
) -> Result<Vec<u32>, ModelError> {
    let buffers = caches
        .iter()
        .map(|c| {
            let layers = (0..layers)
                .map(|l| c.buffers(l))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((c.capacity(), layers))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let shaped: Vec<_> = buffers.iter().map(|(c, l)| (*c, l.as_slice())).collect();
    Ok(crate::fused::cache_words(&shaped, kv, head_dim)?)
}

/// How sessions go through the model.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Group {
    /// The sessions of the range share one pass where the plan for their rows is per-row
    /// (else each runs alone).
    Shared(Range<usize>),
    /// The session runs alone through [`Transformer::forward_tree`].
    Alone(usize),
}

/// Groups sessions of `rows` new tokens each for passes of at most `limit` rows: runs of
/// consecutive sessions of at most `limit` rows in all, in order, and alone every session of
/// more rows than `limit`.
fn pack(rows: &[usize], limit: usize) -> Vec<Group> {
    let mut groups = Vec::new();
    let (mut start, mut sum) = (0, 0);
    let close = |groups: &mut Vec<Group>, range: Range<usize>| {
        if !range.is_empty() {
            groups.push(Group::Shared(range));
        }
    };
    for (i, &n) in rows.iter().enumerate() {
        if n > limit {
            close(&mut groups, start..i);
            groups.push(Group::Alone(i));
            (start, sum) = (i + 1, 0);
        } else if sum + n > limit {
            close(&mut groups, start..i);
            (start, sum) = (i, n);
        } else {
            sum += n;
        }
    }
    close(&mut groups, start..rows.len());
    groups
}

/// Whether `path` computes every row from that row alone, so that sessions can share it.
fn joint_path(path: ForwardPath) -> bool {
    matches!(
        path,
        ForwardPath::PerRow | ForwardPath::ExactUnfused | ForwardPath::FusedExact
    )
}

impl Transformer {
    /// Runs every session's rows as one pass where the plan allows (every product reads the
    /// weights once for all rows); returns each session's f32 logits `(rows.len(), vocab)`, bit
    /// for bit what [`Transformer::forward_tree`] of that session alone returns, and the same
    /// K/V in its cache.
    ///
    /// The path is [`Transformer::plan`]'s for the total rows. On a per-row path (the CPU,
    /// quantized models on CUDA, and dense bf16 CUDA passes of at most [`BI_MAX_ROWS`] rows with
    /// the batch-invariant kernels) all sessions share one pass. Beyond [`BI_MAX_ROWS`] total
    /// rows on CUDA, the sessions are split, in order, into groups of at most
    /// [`BI_MAX_ROWS`] rows that each share a batch-invariant pass, and a session of more rows
    /// runs alone (a wide pass, as `forward_tree` runs it). Where the model has no
    /// batch-invariant path (batch invariance off, or a dtype the kernels do not take), every
    /// session runs alone through `forward_tree`: correct, not batched.
    ///
    /// Every part is checked before any cache changes; a bad part fails the whole call with an
    /// error naming its index. If a pass fails on the device, every cache is rolled back to its
    /// length before the call.
    pub fn forward_sessions(
        &self,
        parts: &mut [SessionPass<'_>],
    ) -> Result<Vec<Tensor>, ModelError> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        specsplit_core::device::bind_to_thread(&self.device)?;
        let keys = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                self.check_session(p)
                    .map_err(|e| ModelError::Input(format!("session part {i}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let lens: Vec<usize> = parts.iter().map(|p| p.cache.len()).collect();
        let run = self.run_sessions(parts, &keys);
        if run.is_err() {
            for (p, &len) in parts.iter_mut().zip(&lens) {
                if p.cache.len() > len {
                    p.cache.truncate(len)?;
                }
            }
        }
        run
    }

    /// Checks one part against the model and its cache; returns its rows' visible keys.
    fn check_session(&self, p: &SessionPass<'_>) -> Result<RowKeys, String> {
        let n = p.tokens.len();
        if n == 0 {
            return Err("no tokens given".into());
        }
        if p.positions.len() != n {
            return Err(format!("{} positions for {n} tokens", p.positions.len()));
        }
        let vocab = self.config.vocab_size;
        if let Some(t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!("token {t} is outside the {vocab}-token vocabulary"));
        }
        let limit = self.cos.dim(0).map_err(|e| e.to_string())?;
        if let Some(q) = p.positions.iter().find(|&&q| q as usize >= limit) {
            return Err(format!(
                "position {q} is not below max_position_embeddings ({limit})"
            ));
        }
        if let Some(r) = p.rows.iter().find(|&&r| r as usize >= n) {
            return Err(format!("row {r} of a {n}-token pass"));
        }
        let spec = p.cache.spec();
        if *spec != self.cache_spec(spec.capacity)
            || p.cache.dtype() != self.dtype
            || !p.cache.device().same_device(&self.device)
        {
            return Err(format!(
                "cache {spec:?} ({:?} on {:?}) does not fit this model ({:?}, {:?} on {:?}); \
                 create it with Transformer::new_cache",
                p.cache.dtype(),
                p.cache.device().location(),
                self.cache_spec(spec.capacity),
                self.dtype,
                self.device.location()
            ));
        }
        let past = p.cache.len();
        if past + n > p.cache.capacity() {
            return Err(format!(
                "{n} new tokens after {past} cached need {} slots, the cache has {}",
                past + n,
                p.cache.capacity()
            ));
        }
        if p.tree.prefix + p.tree.first_row != past {
            return Err(format!(
                "the tree's rows start after {} + {} slots but the cache holds {past}",
                p.tree.prefix, p.tree.first_row
            ));
        }
        RowKeys::new(Visibility::Tree(p.tree), n).map_err(|e| e.to_string())
    }

    /// The most rows sessions share one pass of: past it, [`Transformer::forward_sessions`]
    /// runs them in groups of at most this many rows, each group reading the weights again
    /// (dense CUDA passes through the batch-invariant kernels). `None` where any number of rows
    /// share one pass, or where each session runs alone.
    pub fn session_group_rows(&self) -> Option<usize> {
        // A model the batch-invariant kernels take runs more rows than they do on a path that
        // is not joint (wide or batched; the per-row path is the CPU's and quantized models').
        self.gpu_batch_invariant(1).then_some(BI_MAX_ROWS)
    }

    /// The groups the checked `parts` run in (see [`Transformer::forward_sessions`]).
    fn session_groups(&self, parts: &[SessionPass<'_>]) -> Vec<Group> {
        let rows: Vec<usize> = parts.iter().map(|p| p.tokens.len()).collect();
        let path = self.plan(Pass::Forward {
            rows: rows.iter().sum(),
        });
        if joint_path(path) {
            vec![Group::Shared(0..parts.len())]
        } else if let Some(group) = self.session_group_rows() {
            pack(&rows, group)
        } else {
            (0..parts.len()).map(Group::Alone).collect()
        }
    }

    /// Runs the checked `parts` group by group; `keys` holds each part's visible keys.
    fn run_sessions(
        &self,
        parts: &mut [SessionPass<'_>],
        keys: &[RowKeys],
    ) -> Result<Vec<Tensor>, ModelError> {
        let mut out = Vec::with_capacity(parts.len());
        for group in self.session_groups(parts) {
            let range = match group {
                Group::Shared(range) => range,
                Group::Alone(i) => i..i + 1,
            };
            let rows = parts[range.clone()].iter().map(|p| p.tokens.len()).sum();
            let path = self.plan(Pass::Forward { rows });
            if joint_path(path) {
                out.extend(self.joint_pass(&mut parts[range.clone()], &keys[range], path)?);
            } else {
                for p in &mut parts[range] {
                    out.push(self.session_alone(p)?);
                }
            }
        }
        Ok(out)
    }

    /// One part through [`Transformer::forward_tree`].
    fn session_alone(&self, p: &mut SessionPass<'_>) -> Result<Tensor, ModelError> {
        let dev = &self.device;
        self.forward_tree(
            &Tensor::new(p.tokens, dev)?,
            &Tensor::new(p.positions, dev)?,
            p.tree,
            p.cache,
            &Tensor::new(p.rows, dev)?,
        )
    }

    /// The device table of a fused pass over `parts` (checked, with visible keys `keys`):
    /// each part's K/V buffers of every layer, their slots, its cached length and its rows'
    /// keys.
    fn session_table(
        &self,
        parts: &[SessionPass<'_>],
        keys: &[RowKeys],
    ) -> Result<SessionTable, ModelError> {
        let sessions = parts
            .iter()
            .zip(keys)
            .map(|(p, k)| {
                let layers = (0..self.layers.len())
                    .map(|i| p.cache.buffers(i))
                    .collect::<Result<Vec<_>, _>>()?;
                // The slots of its buffers as allocated (the stride of a slot row), which
                // SessionTable checks for every layer.
                let capacity = match layers.first() {
                    Some((k, _)) => k.dim(2)?,
                    None => 0,
                };
                Ok(TableSession {
                    layers,
                    capacity,
                    past: p.cache.len(),
                    keys: k.split_rows(),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let c = &self.config;
        Ok(SessionTable::new(
            &sessions,
            c.num_key_value_heads,
            c.head_dim,
            &self.device,
        )?)
    }

    /// One pass of the per-row `path` over all rows of `parts`: the shared work over the
    /// concatenated rows; rotary, K/V write and attention per part (on the fused path one
    /// launch each a layer for all parts, through a [`SessionTable`] uploaded once). Returns
    /// each part's logits.
    fn joint_pass(
        &self,
        parts: &mut [SessionPass<'_>],
        keys: &[RowKeys],
        path: ForwardPath,
    ) -> Result<Vec<Tensor>, ModelError> {
        let dev = &self.device;
        let mut spans = Vec::with_capacity(parts.len());
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for p in parts.iter() {
            let at = tokens.len();
            spans.push(at..at + p.tokens.len());
            tokens.extend_from_slice(p.tokens);
            positions.extend_from_slice(p.positions);
            rows.extend(p.rows.iter().map(|&r| r + at as u32));
        }
        let tokens = Tensor::new(tokens.as_slice(), dev)?;
        let positions = Tensor::new(positions.as_slice(), dev)?;
        let pos = |s: &Range<usize>| positions.narrow(0, s.start, s.len());
        let eps = self.config.rms_norm_eps as f32;
        // The unfused per-row CUDA path reads each part's visible keys from the device.
        let pass_keys = match path {
            ForwardPath::ExactUnfused => keys
                .iter()
                .map(|k| PassKeys::new(&k.split_rows(), dev))
                .collect::<candle_core::Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let rows = match rows.is_empty() {
            true => None,
            false => Some(Tensor::new(rows.as_slice(), dev)?),
        };
        let none = || Tensor::zeros((0, self.config.vocab_size), DType::F32, dev);
        let logits = if path == ForwardPath::FusedExact {
            let layers = self.fused_layers()?;
            let launch = self.kernels.launch();
            let bi = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
                crate::fused::bi_matmul(x, w, b, launch)
            };
            let product: Product<'_> = &bi;
            let table = self.session_table(parts, keys)?;
            let (shape, scale) = self.fused_attn_shape(0);
            let (h, head) = self.fused_stack(&layers, &tokens, product, |i, qkv| {
                let q = crate::fused::qkv_rope_sessions(
                    qkv,
                    &self.cos,
                    &self.sin,
                    &positions,
                    &table,
                    i,
                    shape,
                    self.rope_interleaved,
                    launch,
                )?;
                Ok(crate::fused::sessions_attention(
                    &q, &table, i, shape, scale, launch,
                )?)
            })?;
            match &rows {
                Some(rows) => {
                    product(&h.index_select(rows, 0)?, head, None)?.to_dtype(DType::F32)?
                }
                None => none()?,
            }
        } else {
            let tables = spans
                .iter()
                .map(|s| {
                    let p = pos(s)?;
                    Ok((self.cos.index_select(&p, 0)?, self.sin.index_select(&p, 0)?))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let attn: Vec<AttnPath<'_>> = match path {
                ForwardPath::PerRow => keys.iter().map(AttnPath::PerRow).collect(),
                _ => pass_keys.iter().map(AttnPath::Fused).collect(),
            };
            let mut x = self.embed.forward(&tokens, self.dtype)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
                let qkv = layer.qkv.forward(&h, &self.kernels)?;
                let mut ys = Vec::with_capacity(spans.len());
                for (((span, p), (cos, sin)), a) in
                    spans.iter().zip(parts.iter_mut()).zip(&tables).zip(&attn)
                {
                    let part = |t: &Tensor| t.narrow(0, span.start, span.len());
                    let qkv = (&part(&qkv[0])?, &part(&qkv[1])?, &part(&qkv[2])?);
                    ys.push(self.attend(i, qkv, (cos, sin), a, p.cache)?);
                }
                let a = layer.o.forward(&Tensor::cat(&ys, 0)?, &self.kernels)?;
                x = (x + a)?;
                x = (&x + layer.mlp(&x, eps, &self.kernels)?)?;
            }
            match &rows {
                Some(rows) => {
                    let x = candle_nn::ops::rms_norm(&x.index_select(rows, 0)?, &self.norm, eps)?;
                    self.lm_head
                        .forward(&x, &self.kernels)?
                        .to_dtype(DType::F32)?
                }
                None => none()?,
            }
        };
        for p in parts.iter_mut() {
            p.cache.advance(p.tokens.len())?;
        }
        let mut out = Vec::with_capacity(parts.len());
        let mut at = 0;
        for p in parts.iter() {
            out.push(logits.narrow(0, at, p.rows.len())?);
            at += p.rows.len();
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_pack_in_order_into_passes_of_at_most_the_limit() {
        use Group::{Alone, Shared};
        assert_eq!(pack(&[30, 30, 20, 1], 64), [Shared(0..2), Shared(2..4)]);
        assert_eq!(pack(&[70, 3], 64), [Alone(0), Shared(1..2)]);
        assert_eq!(pack(&[3, 70], 64), [Shared(0..1), Alone(1)]);
        assert_eq!(
            pack(&[64, 1, 65, 63, 1, 1], 64),
            [
                Shared(0..1),
                Shared(1..2),
                Alone(2),
                Shared(3..5),
                Shared(5..6)
            ]
        );
        assert_eq!(pack(&[], 64), []);
    }

    #[test]
    fn a_cpu_model_shares_one_pass_among_all_sessions() {
        let cfg = crate::config::ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &candle_core::Device::Cpu).unwrap();
        let chain: Vec<Option<usize>> = (0..200).map(|i: usize| i.checked_sub(1)).collect();
        let mask = specsplit_core::mask::TreeMask::from_parents(&chain).unwrap();
        let mut caches: Vec<SessionCache> = (0..3).map(|_| m.new_cache(300).unwrap()).collect();
        let tokens = vec![1u32; 200];
        let positions: Vec<u32> = (0..200).collect();
        let parts: Vec<SessionPass<'_>> = caches
            .iter_mut()
            .map(|cache| SessionPass {
                tokens: &tokens,
                positions: &positions,
                tree: TreeRows {
                    mask: &mask,
                    prefix: 0,
                    first_row: 0,
                },
                cache,
                rows: &[],
            })
            .collect();
        assert_eq!(m.session_groups(&parts), [Group::Shared(0..3)]);
    }
}
