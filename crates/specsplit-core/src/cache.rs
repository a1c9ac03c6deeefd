//! Per-session KV caches sized by use, with O(1) rollback and path compaction.
//!
//! A [`SessionCache`] owns, for every layer, one K and one V tensor of shape
//! `(1, num_kv_heads, capacity, head_dim)`. Appending writes the new entries in place (a single
//! slice write per tensor) and hands back views of the valid prefix, so a model can attend over
//! the whole cache without copying it. Rolling back ([`SessionCache::truncate`]) only moves the
//! length; keeping an accepted tree path ([`SessionCache::compact`]) moves only the entries whose
//! position changes.
//!
//! A growable cache ([`SessionCache::growable`]) starts at a small capacity and, when
//! [`SessionCache::reserve`] (or an append) needs more, moves to the next capacity class:
//! double the capacity until the entries fit, capped at its maximum. Growth allocates the
//! larger K/V tensors, copies the old buffers into them once (one device copy per tensor) and
//! drops the old ones. Doubling keeps the copying below one copy per entry of the final
//! capacity (`c/2 + c/4 + … < c`). A grown cache's buffers live at new addresses: anything
//! captured over the old ones (a CUDA graph) must be made again.

use candle_core::{DType, Device, Tensor};

/// Everything that can go wrong using a [`SessionCache`].
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Appending or advancing would go past the pre-allocated capacity.
    #[error(
        "KV cache capacity exceeded: {needed} entries needed but capacity is {capacity}; \
         create the session cache with a larger capacity or truncate it first"
    )]
    CapacityExceeded {
        /// Number of entries the operation would need.
        needed: usize,
        /// The cache's capacity.
        capacity: usize,
    },
    /// A layer index outside `0..num_layers`.
    #[error("KV cache layer {layer} out of range: the cache has {num_layers} layers")]
    BadLayer {
        /// The layer asked for.
        layer: usize,
        /// Number of layers in the cache.
        num_layers: usize,
    },
    /// A K or V tensor whose shape, dtype or device does not fit the cache.
    #[error("bad K/V tensor for the KV cache: {0}")]
    BadShape(String),
    /// `truncate` to a length beyond the current one.
    #[error("cannot truncate KV cache to {new_len}: it only holds {len} entries")]
    BadTruncate {
        /// Requested length.
        new_len: usize,
        /// Current length.
        len: usize,
    },
    /// Invalid `compact` arguments.
    #[error("bad KV cache compaction: {0}")]
    BadCompaction(String),
    /// The cache specification is unusable (zero sized dimension).
    #[error("bad KV cache spec: {0}")]
    BadSpec(String),
    /// An underlying tensor operation failed.
    #[error("tensor error in KV cache: {0}")]
    Candle(#[from] candle_core::Error),
}

/// The shape of a session KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheSpec {
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Number of key/value heads per layer.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Number of token entries the cache's buffers hold now.
    pub capacity: usize,
}

/// K/V storage for one decoding session (batch size 1).
#[derive(Debug, Clone)]
pub struct SessionCache {
    spec: CacheSpec,
    dtype: DType,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    /// The capacity growth stops at (`spec.capacity` for a cache that never grows).
    max_capacity: usize,
    /// See [`SessionCache::generation`].
    generation: u64,
}

impl SessionCache {
    /// Allocates (zero-filled) K and V tensors of `spec.capacity` entries for every layer on
    /// `device`; the cache never grows.
    pub fn new(spec: CacheSpec, dtype: DType, device: &Device) -> Result<Self, CacheError> {
        Self::growable(spec, spec.capacity, dtype, device)
    }

    /// A cache of `spec.capacity` entries now that [`SessionCache::reserve`] grows up to
    /// `max_capacity` entries (at least `spec.capacity`).
    pub fn growable(
        spec: CacheSpec,
        max_capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, CacheError> {
        crate::device::bind_to_thread(device)?;
        if max_capacity < spec.capacity {
            return Err(CacheError::BadSpec(format!(
                "the maximum capacity {max_capacity} is below the capacity {}",
                spec.capacity
            )));
        }
        if spec.num_layers == 0 || spec.num_kv_heads == 0 || spec.head_dim == 0 {
            return Err(CacheError::BadSpec(format!(
                "num_layers, num_kv_heads and head_dim must be positive, got {spec:?}"
            )));
        }
        if !dtype.is_float() {
            return Err(CacheError::BadSpec(format!(
                "the cache dtype must be a float type, got {dtype:?}"
            )));
        }
        let (k, v) = allocate(&spec, dtype, device, None)?;
        Ok(Self {
            spec,
            dtype,
            k,
            v,
            len: 0,
            max_capacity,
            generation: 0,
        })
    }

    /// The capacity growth stops at.
    pub fn max_capacity(&self) -> usize {
        self.max_capacity
    }

    /// The capacity [`SessionCache::reserve`] of `entries` leaves the cache at: the current
    /// one when they fit, else the current one doubled until they fit, capped at the maximum;
    /// CapacityExceeded beyond the maximum. Allocates nothing (for charging growth first).
    pub fn capacity_for(&self, entries: usize) -> Result<usize, CacheError> {
        let cap = self.spec.capacity;
        if entries <= cap {
            return Ok(cap);
        }
        if entries > self.max_capacity {
            return Err(CacheError::CapacityExceeded {
                needed: entries,
                capacity: self.max_capacity,
            });
        }
        let mut next = cap.max(1);
        while next < entries {
            next = next.saturating_mul(2);
        }
        Ok(next.min(self.max_capacity))
    }

    /// Makes room for `entries` entries in all: grows to [`SessionCache::capacity_for`] them
    /// when the buffers are smaller (every entry of the old buffers, valid or not, is copied
    /// bit for bit into the new ones). Returns whether the cache grew. On an error the cache
    /// is left as it was (no half-grown state): the new buffers are all allocated before the
    /// old ones are let go.
    pub fn reserve(&mut self, entries: usize) -> Result<bool, CacheError> {
        let capacity = self.capacity_for(entries)?;
        if capacity == self.spec.capacity {
            return Ok(false);
        }
        let spec = CacheSpec {
            capacity,
            ..self.spec
        };
        let device = self.k[0].device().clone();
        crate::device::bind_to_thread(&device)?;
        let (k, v) = allocate(&spec, self.dtype, &device, Some((&self.k, &self.v)))?;
        self.k = k;
        self.v = v;
        self.spec = spec;
        self.generation += 1;
        Ok(true)
    }

    /// Bytes a cache with this spec and dtype takes (K and V of every layer).
    pub fn bytes_for(spec: &CacheSpec, dtype: DType) -> usize {
        2 * spec.num_layers
            * spec.num_kv_heads
            * spec.capacity
            * spec.head_dim
            * dtype.size_in_bytes()
    }

    /// Bytes this cache's buffers take now (its current capacity, not its maximum).
    pub fn memory_bytes(&self) -> usize {
        Self::bytes_for(&self.spec, self.dtype)
    }

    /// A count that changes with every call through `&mut self` that writes entries or moves
    /// the length ([`SessionCache::append`], [`SessionCache::advance`],
    /// [`SessionCache::truncate`], [`SessionCache::compact`], a growing
    /// [`SessionCache::reserve`]). A fixed-shape pass writes through
    /// [`SessionCache::buffers`] and then moves the length, so a caller that remembers what it
    /// left past the length can tell from an unchanged count that no such pass ran since.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Number of valid entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the cache holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of entries the buffers hold now (see [`SessionCache::max_capacity`]).
    pub fn capacity(&self) -> usize {
        self.spec.capacity
    }

    /// The cache's shape.
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// The element type of the stored K/V tensors.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the cache lives on.
    pub fn device(&self) -> &Device {
        self.k[0].device()
    }

    fn check_layer(&self, layer: usize) -> Result<(), CacheError> {
        if layer >= self.spec.num_layers {
            return Err(CacheError::BadLayer {
                layer,
                num_layers: self.spec.num_layers,
            });
        }
        Ok(())
    }

    fn check_kv(&self, what: &str, t: &Tensor) -> Result<usize, CacheError> {
        let dims = t.dims();
        let ok = dims.len() == 4
            && dims[0] == 1
            && dims[1] == self.spec.num_kv_heads
            && dims[3] == self.spec.head_dim;
        if !ok {
            return Err(CacheError::BadShape(format!(
                "{what} has shape {dims:?}, expected (1, {}, n, {})",
                self.spec.num_kv_heads, self.spec.head_dim
            )));
        }
        if t.dtype() != self.dtype {
            return Err(CacheError::BadShape(format!(
                "{what} has dtype {:?}, the cache holds {:?}",
                t.dtype(),
                self.dtype
            )));
        }
        if !t.device().same_device(self.k[0].device()) {
            return Err(CacheError::BadShape(format!(
                "{what} is on {:?}, the cache is on {:?}",
                t.device().location(),
                self.k[0].device().location()
            )));
        }
        Ok(dims[2])
    }

    /// Writes `k`, `v` of shape `(1, kv_heads, n, head_dim)` at `[len, len+n)` of `layer` in
    /// place and returns views of entries `[0, len+n)`, growing the cache first when it is too
    /// small ([`SessionCache::reserve`]).
    ///
    /// The length itself only moves with [`SessionCache::advance`], once every layer appended.
    pub fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor), CacheError> {
        self.check_layer(layer)?;
        let n = self.check_kv("k", k)?;
        let nv = self.check_kv("v", v)?;
        if n != nv {
            return Err(CacheError::BadShape(format!(
                "k holds {n} entries but v holds {nv}"
            )));
        }
        let needed = self.len + n;
        self.reserve(needed)?;
        self.generation += 1;
        if n > 0 {
            self.k[layer].slice_set(&k.contiguous()?, 2, self.len)?;
            self.v[layer].slice_set(&v.contiguous()?, 2, self.len)?;
        }
        Ok((
            self.k[layer].narrow(2, 0, needed)?,
            self.v[layer].narrow(2, 0, needed)?,
        ))
    }

    /// Marks `n` more entries valid, after every layer appended them. Never grows the cache:
    /// entries written through [`SessionCache::buffers`] are already within the capacity, and
    /// past it there is nothing to mark.
    pub fn advance(&mut self, n: usize) -> Result<(), CacheError> {
        let needed = self.len + n;
        if needed > self.spec.capacity {
            return Err(CacheError::CapacityExceeded {
                needed,
                capacity: self.spec.capacity,
            });
        }
        self.len = needed;
        self.generation += 1;
        Ok(())
    }

    /// Rolls back to `new_len` entries in O(1): only the length changes, no data moves.
    pub fn truncate(&mut self, new_len: usize) -> Result<(), CacheError> {
        if new_len > self.len {
            return Err(CacheError::BadTruncate {
                new_len,
                len: self.len,
            });
        }
        self.len = new_len;
        self.generation += 1;
        Ok(())
    }

    /// Keeps the tree entries at absolute positions `keep` (strictly increasing, each in
    /// `[base, len)`), moving them down to `base..base + keep.len()`; entries below `base` are
    /// never touched and entries already in place are not moved. Then `len = base + keep.len()`.
    pub fn compact(&mut self, base: usize, keep: &[usize]) -> Result<(), CacheError> {
        if base > self.len {
            return Err(CacheError::BadCompaction(format!(
                "base {base} is beyond the cache length {}",
                self.len
            )));
        }
        for (i, &p) in keep.iter().enumerate() {
            if p < base || p >= self.len {
                return Err(CacheError::BadCompaction(format!(
                    "keep[{i}] = {p} is outside the tree range [{base}, {})",
                    self.len
                )));
            }
            if i > 0 && keep[i - 1] >= p {
                return Err(CacheError::BadCompaction(format!(
                    "keep must be strictly increasing, but keep[{}] = {} >= keep[{i}] = {p}",
                    i - 1,
                    keep[i - 1]
                )));
            }
        }
        // Entries before the first one that moves are already in place.
        let first_moved = keep
            .iter()
            .enumerate()
            .position(|(i, &p)| p != base + i)
            .unwrap_or(keep.len());
        let moved = &keep[first_moved..];
        if !moved.is_empty() {
            let dst = base + first_moved;
            let device = self.k[0].device().clone();
            if let Some(start) = single_run(moved) {
                // One contiguous run: narrow + copy per tensor, no index upload.
                // `force_contiguous` always copies just the view, so the source never shares
                // the destination's storage.
                for t in self.k.iter().chain(self.v.iter()) {
                    let src = t.narrow(2, start, moved.len())?.force_contiguous()?;
                    t.slice_set(&src, 2, dst)?;
                }
            } else {
                let idx: Vec<u32> = moved.iter().map(|&p| p as u32).collect();
                let idx = Tensor::from_vec(idx, moved.len(), &device)?;
                for t in self.k.iter().chain(self.v.iter()) {
                    let src = t.index_select(&idx, 2)?;
                    t.slice_set(&src, 2, dst)?;
                }
            }
        }
        self.len = base + keep.len();
        self.generation += 1;
        Ok(())
    }

    /// The whole K and V buffers of `layer`, `(1, kv_heads, capacity, head_dim)`, valid entries
    /// or not, for fixed-shape steps that write at a device-side index and mask what is not
    /// valid. Unwritten entries hold zeros, never NaN. Growth replaces them (new addresses).
    pub fn buffers(&self, layer: usize) -> Result<(&Tensor, &Tensor), CacheError> {
        self.check_layer(layer)?;
        Ok((&self.k[layer], &self.v[layer]))
    }

    /// Views of entries `[0, len)` of `layer` (K, V). Panics if `layer` is out of range.
    pub fn layer(&self, layer: usize) -> (Tensor, Tensor) {
        self.check_layer(layer).expect("layer index in range");
        // narrow within bounds cannot fail.
        let k = self.k[layer].narrow(2, 0, self.len).expect("narrow k");
        let v = self.v[layer].narrow(2, 0, self.len).expect("narrow v");
        (k, v)
    }
}

/// Zero-filled K and V tensors of `spec` for every layer on `device`, with `old`'s buffers
/// (of a smaller capacity) copied into their first slots when given.
#[allow(clippy::type_complexity)]
fn allocate(
    spec: &CacheSpec,
    dtype: DType,
    device: &Device,
    old: Option<(&[Tensor], &[Tensor])>,
) -> Result<(Vec<Tensor>, Vec<Tensor>), CacheError> {
    let shape = (1, spec.num_kv_heads, spec.capacity, spec.head_dim);
    let mut k = Vec::with_capacity(spec.num_layers);
    let mut v = Vec::with_capacity(spec.num_layers);
    for layer in 0..spec.num_layers {
        let (nk, nv) = (
            Tensor::zeros(shape, dtype, device)?,
            Tensor::zeros(shape, dtype, device)?,
        );
        if let Some((ok, ov)) = old {
            // The old buffers are whole contiguous tensors: one copy each.
            nk.slice_set(&ok[layer], 2, 0)?;
            nv.slice_set(&ov[layer], 2, 0)?;
        }
        k.push(nk);
        v.push(nv);
    }
    Ok((k, v))
}

/// If `positions` (strictly increasing) form one contiguous run, its first position.
fn single_run(positions: &[usize]) -> Option<usize> {
    let first = *positions.first()?;
    let last = *positions.last()?;
    (last - first + 1 == positions.len()).then_some(first)
}
