//! The kernels of a multi-session pass: the stacked rows of several sessions, each with its own
//! K/V caches (of its own capacity), through rotary with the cache write
//! ([`qkv_rope_sessions`]) and attention ([`sessions_attention`]) in one launch each a layer.
//!
//! A [`SessionTable`] is uploaded once per pass: per row its session and cache slot, per
//! session its capacity, per (layer, session) the device addresses of its K and V caches, and
//! the stacked rows' [`PassKeys`]. Each row then runs the same per-row kernel body as
//! [`qkv_rope_rows`](super::qkv_rope_rows) and [`rows_attention`](super::rows_attention) for
//! its session alone, so its bits are the same.

use super::{applies, imp, unfit, AttnShape, Launch, PassKeys};
use candle_core::{Device, Error, Result, Tensor};

/// One session of a [`SessionTable`].
pub struct TableSession<'a> {
    /// The session's K and V caches `(1, kv, capacity, head_dim)` of each layer, in order.
    pub layers: Vec<(&'a Tensor, &'a Tensor)>,
    /// Slots of each of its caches.
    pub capacity: usize,
    /// Entries already cached: its new rows go to slots `past..`.
    pub past: usize,
    /// Per new row: the leading run of visible slots and the listed slots after it (as
    /// [`PassKeys::new`] takes them).
    pub keys: Vec<(usize, &'a [u32])>,
}

/// The visible keys of a session's new rows, as [`PassKeys::new`] takes them.
pub type RowKeyList<'a> = [(usize, &'a [u32])];

/// The host side of a [`SessionTable`]: what is uploaded, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRows {
    /// Per stacked row: `[session, slot]`.
    pub rows: Vec<u32>,
    /// Per session: its capacity.
    pub capacities: Vec<u32>,
}

impl SessionRows {
    /// Stacks the rows of `sessions` (`(capacity, past, keys)` each, keys as in
    /// [`TableSession::keys`]) in order: row `i` of session `s` writes slot `past + i`. Fails
    /// where a session's rows do not fit its capacity or a row reads a slot past it.
    pub fn new(sessions: &[(usize, usize, &RowKeyList<'_>)]) -> Result<Self> {
        let mut rows = Vec::new();
        let mut capacities = Vec::with_capacity(sessions.len());
        for (s, &(capacity, past, keys)) in sessions.iter().enumerate() {
            let n = keys.len();
            if n == 0 {
                return Err(Error::Msg(format!("session {s} has no rows")));
            }
            if capacity > i32::MAX as usize || past + n > capacity {
                return Err(Error::Msg(format!(
                    "session {s}: {n} rows after {past} do not fit {capacity} slots"
                )));
            }
            for (i, (lead, extra)) in keys.iter().enumerate() {
                let end = extra.last().map_or(*lead, |&e| e as usize + 1).max(*lead);
                if end > capacity {
                    return Err(Error::Msg(format!(
                        "session {s} row {i} reads slot {} of {capacity}",
                        end - 1
                    )));
                }
                rows.extend([s as u32, (past + i) as u32]);
            }
            capacities.push(capacity as u32);
        }
        Ok(Self { rows, capacities })
    }
}

/// Splits device addresses into the u32 words (low, then high) the kernels read as u64.
pub fn address_words(addresses: &[u64]) -> Vec<u32> {
    addresses
        .iter()
        .flat_map(|&a| [a as u32, (a >> 32) as u32])
        .collect()
}

/// The cache words of a [`SessionTable`] for `sessions` (each its capacity and its layers' K
/// and V caches, in order): per (layer, session) the K and V addresses, low word first. Fails
/// unless every cache is a contiguous `(1, kv, capacity, head_dim)` bf16 CUDA buffer and every
/// session has the same number of layers.
pub fn cache_words(
    sessions: &[(usize, &[(&Tensor, &Tensor)])],
    kv: usize,
    head_dim: usize,
) -> Result<Vec<u32>> {
    let layers = sessions.first().map_or(0, |s| s.1.len());
    if layers == 0 {
        return Err(Error::Msg(
            "a session table needs sessions and layers".into(),
        ));
    }
    let mut tensors = Vec::with_capacity(layers * sessions.len() * 2);
    for l in 0..layers {
        for (i, &(capacity, caches)) in sessions.iter().enumerate() {
            let &(k, v) = caches.get(l).ok_or_else(|| {
                Error::Msg(format!(
                    "session {i} has {} layers, not {layers}",
                    caches.len()
                ))
            })?;
            for c in [k, v] {
                if !applies(c) || c.dims() != [1, kv, capacity, head_dim] || !c.is_contiguous() {
                    return Err(Error::Msg(format!(
                        "session {i} layer {l}: cache {:?} {:?} is not a contiguous \
                         (1, {kv}, {capacity}, {head_dim}) bf16 CUDA buffer",
                        c.dims(),
                        c.dtype(),
                    )));
                }
                tensors.push(c);
            }
        }
    }
    Ok(address_words(&imp::addresses(&tensors)?))
}

/// A multi-session pass's table on the device (see the module doc).
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct SessionTable {
    /// `(rows, 2)` u32: per row its session and slot.
    pub(super) rows: Tensor,
    /// `(layers * sessions * 4,)` u32: per (layer, session) the K and V cache addresses.
    pub(super) caches: Tensor,
    /// `(sessions,)` u32: per session its capacity.
    pub(super) capacities: Tensor,
    /// The stacked rows' visible keys.
    pub(super) keys: PassKeys,
    pub(super) layers: usize,
    pub(super) sessions: usize,
    /// KV heads and head size every cache has.
    pub(super) kv: usize,
    pub(super) head_dim: usize,
}

impl SessionTable {
    /// Checks `sessions` (every cache `(1, kv, capacity, head_dim)` bf16 on CUDA, every
    /// session with the same number of layers) and uploads their table to `dev`: four small
    /// copies for the whole pass.
    pub fn new(
        sessions: &[TableSession<'_>],
        kv: usize,
        head_dim: usize,
        dev: &Device,
    ) -> Result<Self> {
        let layers = sessions.first().map_or(0, |s| s.layers.len());
        if layers == 0 {
            return Err(Error::Msg(
                "a session table needs sessions and layers".into(),
            ));
        }
        let shaped: Vec<_> = sessions
            .iter()
            .map(|s| (s.capacity, s.past, s.keys.as_slice()))
            .collect();
        let host = SessionRows::new(&shaped)?;
        let caches: Vec<_> = sessions
            .iter()
            .map(|s| (s.capacity, s.layers.as_slice()))
            .collect();
        let words = cache_words(&caches, kv, head_dim)?;
        let all: Vec<(usize, &[u32])> = sessions.iter().flat_map(|s| s.keys.clone()).collect();
        let n = all.len();
        Ok(Self {
            rows: Tensor::from_vec(host.rows, (n, 2), dev)?,
            caches: Tensor::new(words.as_slice(), dev)?,
            capacities: Tensor::new(host.capacities.as_slice(), dev)?,
            keys: PassKeys::new(&all, dev)?,
            layers,
            sessions: sessions.len(),
            kv,
            head_dim,
        })
    }

    /// A table whose contents the caller writes on the device before each launch (what a
    /// captured graph replays): `rows` `(n, 2)` u32 (per row its session and slot), `caches`
    /// `(layers · sessions · 4,)` u32 (the words [`cache_words`] gives, starting at an even word
    /// of their buffer: the kernels read them as u64), `capacities`
    /// `(sessions,)` u32 and device-written `keys` ([`PassKeys::device_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_device(
        rows: Tensor,
        caches: Tensor,
        capacities: Tensor,
        keys: PassKeys,
        layers: usize,
        sessions: usize,
        kv: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let n = keys.rows;
        let u32s = [&rows, &caches, &capacities]
            .iter()
            .all(|t| t.dtype() == candle_core::DType::U32);
        if !u32s
            || rows.dims() != [n, 2]
            || caches.dims() != [layers * sessions * 4]
            || capacities.dims() != [sessions]
            || layers == 0
            || sessions == 0
            // The kernels read the addresses as u64: 8-byte aligned in their buffer.
            || !caches.layout().start_offset().is_multiple_of(2)
        {
            return Err(Error::Msg(format!(
                "a device session table of {n} rows, {layers} layers and {sessions} sessions \
                 was given rows {:?}, caches {:?} and capacities {:?}",
                rows.dims(),
                caches.dims(),
                capacities.dims()
            )));
        }
        Ok(Self {
            rows,
            caches,
            capacities,
            keys,
            layers,
            sessions,
            kv,
            head_dim,
        })
    }

    /// Stacked rows of the pass.
    pub fn rows(&self) -> usize {
        self.keys.rows
    }

    /// The most keys a row of the pass sees: the keys the attention is launched over.
    pub fn span(&self) -> usize {
        self.keys.span()
    }
}

/// [`qkv_rope_rows`](super::qkv_rope_rows) over the stacked rows of a pass's sessions in one
/// launch: the fused Q|K|V rows `(n, (heads + 2 kv) * head_dim)`, rotary at the positions `(n,)`
/// u32, each row's K and V written into its session's caches of `layer` at its slot (see
/// [`SessionTable`]); returns the rotated Q `(1, heads, n, head_dim)`. `shape.capacity` is not
/// used (each session's is in the table).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_sessions(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    table: &SessionTable,
    layer: usize,
    shape: AttnShape,
    interleaved: bool,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(qkv) {
        return Err(unfit("qkv_rope_sessions", &[qkv]));
    }
    imp::qkv_rope_sessions(
        qkv,
        cos,
        sin,
        positions,
        table,
        layer,
        shape,
        interleaved,
        launch,
    )
}

/// [`rows_attention`](super::rows_attention) over the stacked rows of a pass's sessions in one
/// launch (and one merge): `q` `(1, heads, n, head_dim)`, row `r` over the visible slots of
/// its session's caches of `layer`: `(n, heads * head_dim)` bf16, each row's bits those of its
/// session alone. `head_dim` must be 64 or 128.
pub fn sessions_attention(
    q: &Tensor,
    table: &SessionTable,
    layer: usize,
    shape: AttnShape,
    scale: f32,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("sessions_attention", &[q]));
    }
    imp::sessions_attention(q, table, layer, shape, scale, launch)
}

/// [`draft_attention`](super::draft_attention) over the stacked rows of a pass's sessions in
/// one launch: the arguments and result of [`sessions_attention`]; each row's bits those
/// [`draft_attention`](super::draft_attention) gives its session alone at the same span.
pub fn draft_sessions_attention(
    q: &Tensor,
    table: &SessionTable,
    layer: usize,
    shape: AttnShape,
    scale: f32,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("draft_sessions_attention", &[q]));
    }
    imp::draft_sessions_attention(q, table, layer, shape, scale, launch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn session_rows_stack_each_sessions_slots_after_its_past() {
        let tree: &[(usize, &[u32])] = &[(5, &[]), (5, &[5]), (5, &[])];
        let one: &[(usize, &[u32])] = &[(3, &[])];
        let two: &[(usize, &[u32])] = &[(8, &[]), (9, &[])];
        let t = SessionRows::new(&[(16, 5, tree), (4, 2, one), (64, 7, two)]).unwrap();
        assert_eq!(t.rows, [0, 5, 0, 6, 0, 7, 1, 2, 2, 7, 2, 8]);
        assert_eq!(t.capacities, [16, 4, 64]);
    }

    #[test]
    fn session_rows_refuse_rows_past_a_sessions_capacity() {
        let two: &[(usize, &[u32])] = &[(3, &[]), (4, &[])];
        // Two rows after 3 need 5 slots.
        let e = SessionRows::new(&[(8, 0, two), (4, 3, two)]).unwrap_err();
        assert!(e.to_string().contains("session 1"), "{e}");
        // A listed slot at the capacity.
        let listed: &[(usize, &[u32])] = &[(2, &[4])];
        assert!(SessionRows::new(&[(4, 2, listed)]).is_err());
        assert!(SessionRows::new(&[(5, 2, listed)]).is_ok());
        // A leading run longer than the cache.
        let long: &[(usize, &[u32])] = &[(9, &[])];
        assert!(SessionRows::new(&[(8, 0, long)]).is_err());
        assert!(SessionRows::new(&[(8, 0, &[])]).is_err());
    }

    #[test]
    fn addresses_split_into_low_then_high_words() {
        let w = address_words(&[0x1234_5678_9abc_def0, 7]);
        assert_eq!(w, [0x9abc_def0, 0x1234_5678, 7, 0]);
    }

    #[test]
    fn a_device_table_refuses_cache_addresses_at_an_odd_word() {
        let dev = Device::Cpu;
        let io = Tensor::zeros(64, DType::U32, &dev).unwrap();
        let meta = io.narrow(0, 40, 4).unwrap().reshape((2, 2)).unwrap();
        let keys = PassKeys::device_rows(meta, 16, 16).unwrap();
        let rows = io.narrow(0, 44, 4).unwrap().reshape((2, 2)).unwrap();
        let caps = io.narrow(0, 48, 2).unwrap();
        let table = |at: usize| {
            let caches = io.narrow(0, at, 8).unwrap();
            SessionTable::on_device(
                rows.clone(),
                caches,
                caps.clone(),
                keys.clone(),
                1,
                2,
                2,
                64,
            )
        };
        assert!(table(0).is_ok());
        assert!(table(2).is_ok());
        assert!(table(1).is_err());
        assert!(table(3).is_err());
    }

    #[test]
    fn a_cpu_table_is_refused() {
        let dev = Device::Cpu;
        let k = Tensor::zeros((1, 2, 8, 64), DType::BF16, &dev).unwrap();
        let s = TableSession {
            layers: vec![(&k, &k)],
            capacity: 8,
            past: 0,
            keys: vec![(1, &[])],
        };
        let e = SessionTable::new(&[s], 2, 64, &dev).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}
