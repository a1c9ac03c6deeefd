//! A bounded store of per-session state: LRU eviction at a session count, a memory budget and
//! idle-time (TTL) expiry.
//!
//! The budget is charged with what each session's KV cache holds now, not what it could grow
//! to: every session (and every sessionless request) has a [`KvCharge`], an atomic the store
//! sums without locking any session. A new session is charged its cache's first capacity; a
//! cache that grows raises its charge first ([`KvCharge::raise_to`]), which evicts idle
//! sessions as admission does, else fails with RESOURCE_EXHAUSTED and leaves the session at
//! its old size. A session in use is never evicted; each session is behind its own
//! async mutex so one session's requests are serialized while different sessions run
//! concurrently. A request without a session holds an anonymous reservation
//! ([`SessionStore::reserve_anonymous`]) for its duration, counted against the same limits.
//!
//! A session created with a [`SessionSecret`] is bound to it: every later lookup of that id
//! through the `*_owned` methods must present the same secret, or is refused with
//! [`EngineError::PermissionDenied`] without touching the session. A session created without a
//! secret is open to any request that names its id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::EngineError;

/// Limits of a [`SessionStore`].
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    /// Most sessions held at once.
    pub max_sessions: usize,
    /// Most bytes of session state held at once.
    pub memory_budget_bytes: usize,
    /// Sessions idle longer than this are dropped by [`SessionStore::sweep_expired`].
    pub ttl: Duration,
}

/// How often a request waiting for room looks again without being woken (a busy session going
/// idle wakes nobody unless its worker says so).
const ADMISSION_RECHECK: Duration = Duration::from_millis(20);

/// A shared handle to one session's state.
pub type SessionHandle<S> = Arc<tokio::sync::Mutex<S>>;

struct Entry<S> {
    session: SessionHandle<S>,
    last_used: Instant,
    /// The session's cache bytes, raised by the session as its cache grows.
    charge: Arc<AtomicUsize>,
    secret: Option<SessionSecret>,
}

/// One session's share of a [`SessionStore`]'s memory budget: the bytes its KV cache holds
/// now. The store reads it without locking the session; the session raises it before its
/// cache grows. Clones share the charge.
#[derive(Clone)]
pub struct KvCharge {
    bytes: Arc<AtomicUsize>,
    /// The store that grants growth (none: every raise is granted).
    store: Option<Weak<dyn GrowthRoom>>,
}

impl std::fmt::Debug for KvCharge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCharge")
            .field("bytes", &self.bytes())
            .field("limited", &self.store.is_some())
            .finish()
    }
}

impl KvCharge {
    /// A charge of `bytes` no store limits (a session made outside a worker): every raise is
    /// granted.
    pub fn unlimited(bytes: usize) -> Self {
        Self {
            bytes: Arc::new(AtomicUsize::new(bytes)),
            store: None,
        }
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Raises the charge to `bytes` (nothing when it is that high already) before the cache
    /// grows to them: the store evicts least-recently-used idle sessions to make room, else
    /// refuses with RESOURCE_EXHAUSTED and the charge stays as it was.
    pub fn raise_to(&self, bytes: usize) -> Result<(), EngineError> {
        if bytes <= self.bytes() {
            return Ok(());
        }
        match self.store.as_ref().and_then(Weak::upgrade) {
            Some(store) => store.grow(&self.bytes, bytes),
            None => {
                self.bytes.store(bytes, Ordering::Release);
                Ok(())
            }
        }
    }

    /// Lowers the charge to `bytes` (nothing when it is that low already): a growth that was
    /// charged but failed gives its room back.
    pub fn lower_to(&self, bytes: usize) {
        self.bytes.fetch_min(bytes, Ordering::AcqRel);
        if let Some(store) = self.store.as_ref().and_then(Weak::upgrade) {
            store.freed();
        }
    }
}

/// What a [`KvCharge`] asks of its store.
trait GrowthRoom: Send + Sync {
    /// Raises `charge` to `bytes` if the budget has room for the difference once idle
    /// sessions are evicted; else RESOURCE_EXHAUSTED, `charge` unchanged.
    fn grow(&self, charge: &AtomicUsize, bytes: usize) -> Result<(), EngineError>;
    /// Room may have come free.
    fn freed(&self);
}

/// Shortest non-empty session secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Longest session secret accepted, in bytes.
pub const MAX_SECRET_BYTES: usize = 256;

/// The secret a client binds its session to (`session_secret` on the wire), compared in
/// constant time (the comparison always covers [`MAX_SECRET_BYTES`] bytes, so neither the
/// content nor the length of a stored secret shows in its timing).
#[derive(Clone)]
pub struct SessionSecret {
    bytes: Box<[u8; MAX_SECRET_BYTES]>,
    len: usize,
}

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionSecret(..)")
    }
}

impl SessionSecret {
    /// The secret of a request: `None` for an empty string (no secret), an error
    /// (INVALID_ARGUMENT) for one shorter than [`MIN_SECRET_BYTES`] or longer than
    /// [`MAX_SECRET_BYTES`].
    pub fn parse(secret: &str) -> Result<Option<Self>, EngineError> {
        let len = secret.len();
        if len == 0 {
            return Ok(None);
        }
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&len) {
            return Err(EngineError::InvalidArgument(format!(
                "session_secret must be empty or {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes \
                 long, got {len}; use a random string of at least {MIN_SECRET_BYTES} bytes"
            )));
        }
        let mut bytes = Box::new([0u8; MAX_SECRET_BYTES]);
        bytes[..len].copy_from_slice(secret.as_bytes());
        Ok(Some(Self { bytes, len }))
    }

    /// Whether `other` is the same secret, in time independent of both secrets.
    fn matches(&self, other: &SessionSecret) -> bool {
        let mut diff = u8::from(self.len != other.len);
        for (a, b) in self.bytes.iter().zip(other.bytes.iter()) {
            diff |= a ^ b;
        }
        std::hint::black_box(diff) == 0
    }
}

/// Whether a request presenting `given` may use a session created with `stored`.
fn admits(stored: Option<&SessionSecret>, given: Option<&SessionSecret>) -> bool {
    match (stored, given) {
        (None, _) => true,
        (Some(s), Some(g)) => s.matches(g),
        (Some(_), None) => false,
    }
}

/// The refusal of a request whose secret does not match its session's; it says nothing of the
/// session.
fn permission_denied() -> EngineError {
    EngineError::PermissionDenied(
        "this session is bound to another session_secret; send the secret the session was \
         created with, or use a new session_id"
            .into(),
    )
}

/// The store's state under its lock.
struct Inner<S> {
    map: HashMap<String, Entry<S>>,
    /// The charges of the sessionless requests in flight.
    anonymous: Vec<Arc<AtomicUsize>>,
}

impl<S> Inner<S> {
    /// Sessions and sessionless requests held.
    fn held(&self) -> usize {
        self.map.len() + self.anonymous.len()
    }

    /// Bytes charged by everything held.
    fn used(&self) -> usize {
        let load = |c: &Arc<AtomicUsize>| c.load(Ordering::Acquire);
        self.map.values().map(|e| load(&e.charge)).sum::<usize>()
            + self.anonymous.iter().map(load).sum::<usize>()
    }

    /// Evicts the least recently used session nobody is using right now; whether there was one.
    fn evict_idle(&mut self) -> bool {
        let victim = self
            .map
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.session) == 1)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone());
        match victim {
            Some(k) => {
                tracing::info!("evicting the least recently used session");
                tracing::debug!(session = %k, "evicted session");
                self.map.remove(&k);
                true
            }
            None => false,
        }
    }
}

/// The part of a store its sessions' charges reach: the limits, the state and the wake-ups.
struct Shared<S> {
    limits: SessionLimits,
    entries: Mutex<Inner<S>>,
    /// Woken when room may have come free (a session ended or went idle, a reservation ended).
    room: tokio::sync::Notify,
}

impl<S> Shared<S> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<S>> {
        // A panic while holding this lock cannot leave the state inconsistent (every mutation
        // is a single insert/remove or counter update), so recover from poisoning.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<S: Send + 'static> GrowthRoom for Shared<S> {
    fn grow(&self, charge: &AtomicUsize, bytes: usize) -> Result<(), EngineError> {
        let budget = self.limits.memory_budget_bytes;
        let mut inner = self.lock();
        let now = charge.load(Ordering::Acquire);
        if bytes <= now {
            return Ok(());
        }
        let extra = bytes - now;
        if bytes > budget {
            return Err(EngineError::ResourceExhausted(format!(
                "this session's KV cache would grow to {} MiB but the memory budget is {} MiB; \
                 raise memory_budget_mb, lower max_context or send a shorter sequence",
                bytes >> 20,
                budget >> 20
            )));
        }
        loop {
            let used = inner.used();
            if used.saturating_add(extra) <= budget {
                charge.store(bytes, Ordering::Release);
                return Ok(());
            }
            if !inner.evict_idle() {
                return Err(EngineError::ResourceExhausted(format!(
                    "all {} sessions are busy ({} MiB of {} MiB used), so this session's KV \
                     cache cannot grow from {} to {} MiB; raise memory_budget_mb (or lower \
                     max_context), or retry later",
                    inner.held(),
                    used >> 20,
                    budget >> 20,
                    now >> 20,
                    bytes >> 20
                )));
            }
        }
    }

    fn freed(&self) {
        self.room.notify_waiters();
    }
}

impl<S> std::ops::Deref for Inner<S> {
    type Target = HashMap<String, Entry<S>>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<S> std::ops::DerefMut for Inner<S> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

/// Sessions keyed by id, bounded by [`SessionLimits`].
pub struct SessionStore<S> {
    limits: SessionLimits,
    shared: Arc<Shared<S>>,
}

/// A sessionless request's share of a [`SessionStore`]'s limits (one session slot and its
/// charge), given back when dropped.
pub struct Reservation<'a, S> {
    store: &'a SessionStore<S>,
    charge: KvCharge,
}

impl<S> Reservation<'_, S> {
    /// The request's charge, for the session it runs on.
    pub fn charge(&self) -> &KvCharge {
        &self.charge
    }
}

impl<S> Drop for Reservation<'_, S> {
    fn drop(&mut self) {
        let mut inner = self.store.lock();
        inner
            .anonymous
            .retain(|c| !Arc::ptr_eq(c, &self.charge.bytes));
        drop(inner);
        self.store.room_may_be_free();
    }
}

impl<S> SessionStore<S> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<S>> {
        self.shared.lock()
    }

    /// The store's limits.
    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    /// Wakes the requests waiting for room ([`Self::admit_owned`]): a session ended, or one
    /// went idle (its request finished) and may be evicted now.
    pub fn room_may_be_free(&self) {
        self.shared.room.notify_waiters();
    }
}

impl<S: Send + 'static> SessionStore<S> {
    /// An empty store with the given limits.
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            shared: Arc::new(Shared {
                limits,
                entries: Mutex::new(Inner {
                    map: HashMap::new(),
                    anonymous: Vec::new(),
                }),
                room: tokio::sync::Notify::new(),
            }),
        }
    }

    /// A charge of `bytes` against this store's budget.
    fn charge(&self, bytes: usize) -> KvCharge {
        let store: Weak<dyn GrowthRoom> = Arc::downgrade(&self.shared) as Weak<dyn GrowthRoom>;
        KvCharge {
            bytes: Arc::new(AtomicUsize::new(bytes)),
            store: Some(store),
        }
    }

    /// The session with this id, refreshing its LRU position.
    pub fn get(&self, id: &str) -> Option<SessionHandle<S>> {
        let mut map = self.lock();
        let e = map.get_mut(id)?;
        e.last_used = Instant::now();
        Some(e.session.clone())
    }

    /// The session with this id, or a new one made by `create` taking `bytes` of the budget
    /// (its [`KvCharge`], handed to `create`, starts there and rises as its cache grows).
    /// Evicts least-recently-used idle sessions to make room; fails with RESOURCE_EXHAUSTED
    /// when even that is not enough. Returns whether the session was created.
    pub fn get_or_create(
        &self,
        id: &str,
        bytes: usize,
        create: impl FnOnce(KvCharge) -> Result<S, EngineError>,
    ) -> Result<(SessionHandle<S>, bool), EngineError> {
        self.get_or_create_owned(id, None, bytes, create)
    }

    /// [`get_or_create`](Self::get_or_create) for a request presenting `secret`: an existing
    /// session bound to a different secret is refused with PERMISSION_DENIED (and left as it
    /// is); a new session is bound to `secret` (open to all when `None`).
    pub fn get_or_create_owned(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
        bytes: usize,
        create: impl FnOnce(KvCharge) -> Result<S, EngineError>,
    ) -> Result<(SessionHandle<S>, bool), EngineError> {
        let mut map = self.lock();
        if let Some(e) = map.get_mut(id) {
            if !admits(e.secret.as_ref(), secret) {
                return Err(permission_denied());
            }
            e.last_used = Instant::now();
            return Ok((e.session.clone(), false));
        }
        self.make_room(&mut map, bytes)?;
        let charge = self.charge(bytes);
        let cell = charge.bytes.clone();
        // `create` must not raise the charge: the store is locked until the session is in.
        let session = Arc::new(tokio::sync::Mutex::new(create(charge)?));
        map.insert(
            id.to_string(),
            Entry {
                session: session.clone(),
                last_used: Instant::now(),
                charge: cell,
                secret: secret.cloned(),
            },
        );
        Ok((session, true))
    }

    /// Reserves room for one sessionless request taking `bytes`, as [`Self::get_or_create`]
    /// would for a new session (evicting idle sessions, else RESOURCE_EXHAUSTED); the room is
    /// given back when the returned reservation is dropped.
    pub fn reserve_anonymous(&self, bytes: usize) -> Result<Reservation<'_, S>, EngineError> {
        let mut inner = self.lock();
        self.make_room(&mut inner, bytes)?;
        let charge = self.charge(bytes);
        inner.anonymous.push(charge.bytes.clone());
        Ok(Reservation {
            store: self,
            charge,
        })
    }

    /// Evicts least-recently-used idle sessions until one more session of `bytes` fits.
    fn make_room(&self, inner: &mut Inner<S>, bytes: usize) -> Result<(), EngineError> {
        if bytes > self.limits.memory_budget_bytes {
            return Err(EngineError::ResourceExhausted(format!(
                "one session needs {} MiB of KV cache but the memory budget is {} MiB; raise \
                 the memory budget or lower max_context",
                bytes >> 20,
                self.limits.memory_budget_bytes >> 20
            )));
        }
        loop {
            let held = inner.held();
            let used = inner.used();
            let fits = held < self.limits.max_sessions
                && used.saturating_add(bytes) <= self.limits.memory_budget_bytes;
            if fits {
                return Ok(());
            }
            if !inner.evict_idle() {
                return Err(EngineError::ResourceExhausted(format!(
                    "all {held} sessions are busy ({} MiB of {} MiB used); retry later",
                    used >> 20,
                    self.limits.memory_budget_bytes >> 20
                )));
            }
        }
    }

    /// Runs `admit` until it no longer fails for want of room, waiting up to `wait` for room
    /// to come free (sessions ending, or going idle so that they can be evicted); then
    /// RESOURCE_EXHAUSTED saying which limit to raise. A request larger than the whole
    /// budget is refused at once.
    async fn admitted<T>(
        &self,
        bytes: usize,
        wait: Duration,
        mut admit: impl FnMut() -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the attempt, so that room freed during it is not missed.
            let freed = self.shared.room.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match admit() {
                Err(EngineError::ResourceExhausted(_))
                    if bytes <= self.limits.memory_budget_bytes
                        && tokio::time::Instant::now() < deadline =>
                {
                    // A session that went idle without a word is noticed at the next check.
                    let _ = tokio::time::timeout_at(
                        deadline.min(tokio::time::Instant::now() + ADMISSION_RECHECK),
                        freed,
                    )
                    .await;
                }
                Err(EngineError::ResourceExhausted(_))
                    if bytes <= self.limits.memory_budget_bytes =>
                {
                    return Err(self.no_room(wait));
                }
                other => return other,
            }
        }
    }

    /// The refusal of a request that found no room within `wait`.
    fn no_room(&self, wait: Duration) -> EngineError {
        let inner = self.lock();
        let (held, used) = (inner.held(), inner.used());
        let limit = if held >= self.limits.max_sessions {
            "max_sessions"
        } else {
            "memory_budget_mb"
        };
        EngineError::ResourceExhausted(format!(
            "all {held} sessions are busy ({} MiB of {} MiB used) and none ended within {} ms; \
             raise {limit} (or admission_wait_ms to wait longer), or retry later",
            used >> 20,
            self.limits.memory_budget_bytes >> 20,
            wait.as_millis()
        ))
    }

    /// [`Self::get_or_create_owned`], waiting up to `wait` for room when every session is
    /// busy (admission control).
    pub async fn admit_owned(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
        bytes: usize,
        wait: Duration,
        mut create: impl FnMut(KvCharge) -> Result<S, EngineError>,
    ) -> Result<(SessionHandle<S>, bool), EngineError> {
        self.admitted(bytes, wait, || {
            self.get_or_create_owned(id, secret, bytes, &mut create)
        })
        .await
    }

    /// [`Self::reserve_anonymous`], waiting up to `wait` for room when every session is busy
    /// (admission control).
    pub async fn admit_anonymous(
        &self,
        bytes: usize,
        wait: Duration,
    ) -> Result<Reservation<'_, S>, EngineError> {
        self.admitted(bytes, wait, || self.reserve_anonymous(bytes))
            .await
    }

    /// Sessionless requests in flight (each holding a [`Reservation`]).
    pub fn anonymous(&self) -> usize {
        self.lock().anonymous.len()
    }

    /// The session with this id for a request presenting `secret` (refreshing its LRU
    /// position): `Ok(None)` when there is none, PERMISSION_DENIED (leaving it untouched) when
    /// it is bound to a different secret.
    pub fn get_owned(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
    ) -> Result<Option<SessionHandle<S>>, EngineError> {
        let mut map = self.lock();
        let Some(e) = map.get_mut(id) else {
            return Ok(None);
        };
        if !admits(e.secret.as_ref(), secret) {
            return Err(permission_denied());
        }
        e.last_used = Instant::now();
        Ok(Some(e.session.clone()))
    }

    /// Drops a session for a request presenting `secret`; returns whether it existed.
    /// PERMISSION_DENIED (keeping the session) when it is bound to a different secret.
    pub fn remove_owned(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
    ) -> Result<bool, EngineError> {
        let mut map = self.lock();
        match map.get(id) {
            None => Ok(false),
            Some(e) if !admits(e.secret.as_ref(), secret) => Err(permission_denied()),
            Some(_) => {
                map.remove(id);
                drop(map);
                self.room_may_be_free();
                Ok(true)
            }
        }
    }

    /// Drops a session; returns whether it existed.
    pub fn remove(&self, id: &str) -> bool {
        let removed = self.lock().remove(id).is_some();
        self.room_may_be_free();
        removed
    }

    /// Drops every idle session unused for longer than the TTL; returns how many.
    pub fn sweep_expired(&self) -> usize {
        let ttl = self.limits.ttl;
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, e| Arc::strong_count(&e.session) > 1 || e.last_used.elapsed() <= ttl);
        let dropped = before - map.len();
        drop(map);
        self.room_may_be_free();
        dropped
    }

    /// Drops every session (as if all were evicted); returns how many there were.
    pub fn clear(&self) -> usize {
        let mut map = self.lock();
        let n = map.len();
        map.clear();
        drop(map);
        self.room_may_be_free();
        n
    }

    /// Number of sessions held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of session state held (named sessions and sessionless requests in flight): what
    /// their KV caches hold now.
    pub fn bytes(&self) -> usize {
        self.lock().used()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(max_sessions: usize, budget: usize, ttl_ms: u64) -> SessionStore<u32> {
        SessionStore::new(SessionLimits {
            max_sessions,
            memory_budget_bytes: budget,
            ttl: Duration::from_millis(ttl_ms),
        })
    }

    #[test]
    fn evicts_least_recently_used_at_the_session_limit() {
        let s = store(2, 1000, 60_000);
        s.get_or_create("a", 10, |_| Ok(1)).unwrap();
        s.get_or_create("b", 10, |_| Ok(2)).unwrap();
        s.get("a").unwrap();
        let (_, created) = s.get_or_create("c", 10, |_| Ok(3)).unwrap();
        assert!(created);
        assert!(s.get("b").is_none(), "b was least recently used");
        assert!(s.get("a").is_some() && s.get("c").is_some());
    }

    #[test]
    fn memory_budget_evicts_then_refuses_when_all_busy() {
        let s = store(10, 100, 60_000);
        let (a, _) = s.get_or_create("a", 60, |_| Ok(1)).unwrap();
        // "a" is held (busy): a second 60-byte session cannot fit and nothing can be evicted.
        let err = s.get_or_create("b", 60, |_| Ok(2)).unwrap_err();
        assert!(matches!(err, EngineError::ResourceExhausted(_)));
        drop(a);
        s.get_or_create("b", 60, |_| Ok(2)).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s.bytes(), 60);
        let err = s.get_or_create("huge", 101, |_| Ok(3)).unwrap_err();
        assert!(matches!(err, EngineError::ResourceExhausted(_)));
    }

    #[test]
    fn sessionless_reservations_count_against_both_limits() {
        // Room for 5 sessions of 12 bytes in a 64-byte budget (the count limit is higher).
        let s = store(10, 64, 60_000);
        let held: Vec<_> = (0..5).map(|_| s.reserve_anonymous(12).unwrap()).collect();
        assert_eq!(s.anonymous(), 5);
        assert_eq!(s.bytes(), 60);
        let Err(EngineError::ResourceExhausted(m)) = s.reserve_anonymous(12) else {
            panic!("the request without a session beyond five must be refused");
        };
        assert_eq!(
            m,
            "all 5 sessions are busy (0 MiB of 0 MiB used); retry later"
        );
        // A named session cannot take their room either.
        assert!(s.get_or_create("a", 12, |_| Ok(1)).is_err());
        drop(held);
        assert_eq!((s.anonymous(), s.bytes()), (0, 0));
        // Idle named sessions are evicted to make room for a sessionless request; at the
        // session count limit too.
        let s = store(2, 1000, 60_000);
        s.get_or_create("a", 10, |_| Ok(1)).unwrap();
        s.get_or_create("b", 10, |_| Ok(2)).unwrap();
        let r = s.reserve_anonymous(10).unwrap();
        assert_eq!(s.len(), 1, "one idle session was evicted");
        let _r2 = s.reserve_anonymous(10).unwrap();
        assert_eq!(s.len(), 0);
        let Err(EngineError::ResourceExhausted(m)) = s.reserve_anonymous(10) else {
            panic!("both slots are held by sessionless requests");
        };
        assert!(m.starts_with("all 2 sessions are busy"), "{m}");
        drop(r);
        s.reserve_anonymous(10).unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn admission_waits_for_room_then_refuses_naming_the_limit() {
        let s = Arc::new(store(2, 100, 60_000));
        let wait = Duration::from_secs(600);
        let first = s.admit_anonymous(40, wait).await.unwrap();
        let (busy, _) = s.admit_owned("a", None, 40, wait, |_| Ok(1)).await.unwrap();
        // Both slots are held: the next request waits until a reservation ends.
        let waiting = {
            let s = s.clone();
            tokio::spawn(async move {
                s.admit_owned("b", None, 40, wait, |_| Ok(2))
                    .await
                    .map(|(h, created)| (created, *h.try_lock().unwrap()))
            })
        };
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "admitted beyond max_sessions");
        drop(first);
        assert_eq!(waiting.await.unwrap().unwrap(), (true, 2));
        // At the memory budget (a and b hold 80 of 100 bytes, both busy), a short wait ends in
        // a refusal that names the budget.
        let _b = s.get("b").unwrap();
        let s3 = store(3, 100, 60_000);
        let _a = s3
            .admit_owned("a", None, 60, wait, |_| Ok(1))
            .await
            .unwrap();
        let Err(EngineError::ResourceExhausted(m)) = s3
            .admit_owned("b", None, 60, Duration::from_millis(5), |_| Ok(2))
            .await
        else {
            panic!("the budget has no room for b");
        };
        assert!(
            m.contains("raise memory_budget_mb") && m.contains("within 5 ms"),
            "{m}"
        );
        // A session larger than the whole budget is refused without waiting.
        let Err(EngineError::ResourceExhausted(m)) = s3.admit_anonymous(101, wait).await else {
            panic!("larger than the budget");
        };
        assert!(m.starts_with("one session needs"), "{m}");
        drop(busy);
    }

    #[test]
    fn secrets_bind_sessions() {
        let s = store(10, 1000, 60_000);
        let mine = SessionSecret::parse("0123456789abcdef-mine")
            .unwrap()
            .unwrap();
        let other = SessionSecret::parse("0123456789abcdef-othr")
            .unwrap()
            .unwrap();
        let longer = SessionSecret::parse("0123456789abcdef-mine!")
            .unwrap()
            .unwrap();
        s.get_or_create_owned("a", Some(&mine), 1, |_| Ok(1))
            .unwrap();
        for wrong in [Some(&other), Some(&longer), None] {
            let denied = |r: Result<_, EngineError>| {
                assert!(matches!(r, Err(EngineError::PermissionDenied(_))));
            };
            denied(s.get_owned("a", wrong).map(|_| ()));
            denied(s.remove_owned("a", wrong).map(|_| ()));
            denied(s.get_or_create_owned("a", wrong, 1, |_| Ok(9)).map(|_| ()));
        }
        assert_eq!(s.len(), 1, "refusals leave the session in place");
        let (h, created) = s
            .get_or_create_owned("a", Some(&mine), 1, |_| Ok(9))
            .unwrap();
        assert!(!created);
        assert_eq!(*h.try_lock().unwrap(), 1);
        drop(h);
        assert!(s.get_owned("a", Some(&mine)).unwrap().is_some());
        assert!(s.get_owned("nobody", Some(&other)).unwrap().is_none());
        assert!(s.remove_owned("a", Some(&mine)).unwrap());
        // A session created without a secret is open to every request.
        s.get_or_create_owned("open", None, 1, |_| Ok(2)).unwrap();
        assert!(s.get_owned("open", Some(&other)).unwrap().is_some());
        assert!(s.remove_owned("open", Some(&mine)).unwrap());
        // Lengths: empty is no secret; 1..16 and > 256 bytes are refused.
        assert!(SessionSecret::parse("").unwrap().is_none());
        assert!(matches!(
            SessionSecret::parse("short"),
            Err(EngineError::InvalidArgument(_))
        ));
        assert!(SessionSecret::parse(&"x".repeat(MAX_SECRET_BYTES))
            .unwrap()
            .is_some());
        assert!(matches!(
            SessionSecret::parse(&"x".repeat(MAX_SECRET_BYTES + 1)),
            Err(EngineError::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_growing_charge_evicts_idle_sessions_then_refuses_and_stays() {
        let s = store(10, 100, 60_000);
        let mut charge = None;
        let (a, _) = s
            .get_or_create("a", 20, |c| {
                charge = Some(c);
                Ok(1)
            })
            .unwrap();
        let charge = charge.unwrap();
        let (b, _) = s.get_or_create("b", 30, |_| Ok(2)).unwrap();
        s.get_or_create("idle", 30, |_| Ok(3)).unwrap();
        assert_eq!(s.bytes(), 80);
        // Growth within the budget is granted at once and counted.
        charge.raise_to(30).unwrap();
        assert_eq!((charge.bytes(), s.bytes()), (30, 90));
        // Past it, the idle session goes; "a" (growing) and "b" (busy) stay.
        charge.raise_to(60).unwrap();
        assert!(s.get("idle").is_none() && s.get("b").is_some());
        assert_eq!(s.bytes(), 90);
        // Nothing idle is left: the growth is refused, naming what to raise, and the charge
        // stays where it was.
        let Err(EngineError::ResourceExhausted(m)) = charge.raise_to(71) else {
            panic!("growth past the budget with every session busy");
        };
        assert!(m.contains("raise memory_budget_mb"), "{m}");
        assert_eq!((charge.bytes(), s.bytes()), (60, 90));
        let Err(EngineError::ResourceExhausted(m)) = charge.raise_to(101) else {
            panic!("growth past the whole budget");
        };
        assert!(m.contains("memory budget is 0 MiB"), "{m}");
        // Once "b" is idle it is evicted for the growth; a lowered charge gives room back.
        drop(b);
        charge.raise_to(71).unwrap();
        assert_eq!((s.len(), s.bytes()), (1, 71));
        charge.lower_to(40);
        assert_eq!(s.bytes(), 40);
        drop(a);
        // A sessionless request's charge grows against the same budget.
        let r = s.reserve_anonymous(10).unwrap();
        r.charge().raise_to(50).unwrap();
        assert_eq!(s.bytes(), 90);
        // Another one evicts the idle "a" to fit.
        let r2 = s.reserve_anonymous(20).unwrap();
        assert_eq!((s.len(), s.bytes()), (0, 70));
        drop((r, r2));
        assert_eq!(s.anonymous(), 0);
        // A charge no store limits grants every raise.
        let free = KvCharge::unlimited(5);
        free.raise_to(1 << 40).unwrap();
        assert_eq!(free.bytes(), 1 << 40);
    }

    #[test]
    fn ttl_sweep_drops_only_idle_expired_sessions() {
        let s = store(10, 1000, 20);
        s.get_or_create("idle", 1, |_| Ok(1)).unwrap();
        let (busy, _) = s.get_or_create("busy", 1, |_| Ok(2)).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(s.sweep_expired(), 1);
        assert!(s.get("idle").is_none());
        assert!(s.get("busy").is_some());
        drop(busy);
        assert!(s.remove("busy"));
        assert!(!s.remove("busy"));
        assert!(s.is_empty());
    }
}
