//! A bounded store of per-session state: LRU eviction at a session count, a memory budget and
//! idle-time (TTL) expiry. A session in use is never evicted; each session is behind its own
//! async mutex so one session's requests are serialized while different sessions run
//! concurrently.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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

/// A shared handle to one session's state.
pub type SessionHandle<S> = Arc<tokio::sync::Mutex<S>>;

struct Entry<S> {
    session: SessionHandle<S>,
    last_used: Instant,
    bytes: usize,
}

/// Sessions keyed by id, bounded by [`SessionLimits`].
pub struct SessionStore<S> {
    limits: SessionLimits,
    entries: Mutex<HashMap<String, Entry<S>>>,
}

impl<S> SessionStore<S> {
    /// An empty store with the given limits.
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The store's limits.
    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry<S>>> {
        // A panic while holding this lock cannot leave the map inconsistent (every mutation
        // is a single insert/remove), so recover from poisoning.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session with this id, refreshing its LRU position.
    pub fn get(&self, id: &str) -> Option<SessionHandle<S>> {
        let mut map = self.lock();
        let e = map.get_mut(id)?;
        e.last_used = Instant::now();
        Some(e.session.clone())
    }

    /// The session with this id, or a new one made by `create` taking `bytes` of the budget.
    /// Evicts least-recently-used idle sessions to make room; fails with RESOURCE_EXHAUSTED
    /// when even that is not enough. Returns whether the session was created.
    pub fn get_or_create(
        &self,
        id: &str,
        bytes: usize,
        create: impl FnOnce() -> Result<S, EngineError>,
    ) -> Result<(SessionHandle<S>, bool), EngineError> {
        let mut map = self.lock();
        if let Some(e) = map.get_mut(id) {
            e.last_used = Instant::now();
            return Ok((e.session.clone(), false));
        }
        if bytes > self.limits.memory_budget_bytes {
            return Err(EngineError::ResourceExhausted(format!(
                "one session needs {} MiB of KV cache but the memory budget is {} MiB; raise \
                 the memory budget or lower max_context",
                bytes >> 20,
                self.limits.memory_budget_bytes >> 20
            )));
        }
        loop {
            let used: usize = map.values().map(|e| e.bytes).sum();
            let fits = map.len() < self.limits.max_sessions
                && used + bytes <= self.limits.memory_budget_bytes;
            if fits {
                break;
            }
            // Evict the least recently used session nobody is using right now.
            let victim = map
                .iter()
                .filter(|(_, e)| Arc::strong_count(&e.session) == 1)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    tracing::info!(session = %k, "evicting least recently used session");
                    map.remove(&k);
                }
                None => {
                    return Err(EngineError::ResourceExhausted(format!(
                        "all {} sessions are busy ({} MiB of {} MiB used); retry later",
                        map.len(),
                        used >> 20,
                        self.limits.memory_budget_bytes >> 20
                    )))
                }
            }
        }
        let session = Arc::new(tokio::sync::Mutex::new(create()?));
        map.insert(
            id.to_string(),
            Entry {
                session: session.clone(),
                last_used: Instant::now(),
                bytes,
            },
        );
        Ok((session, true))
    }

    /// Drops a session; returns whether it existed.
    pub fn remove(&self, id: &str) -> bool {
        self.lock().remove(id).is_some()
    }

    /// Drops every idle session unused for longer than the TTL; returns how many.
    pub fn sweep_expired(&self) -> usize {
        let ttl = self.limits.ttl;
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, e| Arc::strong_count(&e.session) > 1 || e.last_used.elapsed() <= ttl);
        before - map.len()
    }

    /// Drops every session (as if all were evicted); returns how many there were.
    pub fn clear(&self) -> usize {
        let mut map = self.lock();
        let n = map.len();
        map.clear();
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

    /// Bytes of session state held.
    pub fn bytes(&self) -> usize {
        self.lock().values().map(|e| e.bytes).sum()
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
        s.get_or_create("a", 10, || Ok(1)).unwrap();
        s.get_or_create("b", 10, || Ok(2)).unwrap();
        s.get("a").unwrap();
        let (_, created) = s.get_or_create("c", 10, || Ok(3)).unwrap();
        assert!(created);
        assert!(s.get("b").is_none(), "b was least recently used");
        assert!(s.get("a").is_some() && s.get("c").is_some());
    }

    #[test]
    fn memory_budget_evicts_then_refuses_when_all_busy() {
        let s = store(10, 100, 60_000);
        let (a, _) = s.get_or_create("a", 60, || Ok(1)).unwrap();
        // "a" is held (busy): a second 60-byte session cannot fit and nothing can be evicted.
        let err = s.get_or_create("b", 60, || Ok(2)).unwrap_err();
        assert!(matches!(err, EngineError::ResourceExhausted(_)));
        drop(a);
        s.get_or_create("b", 60, || Ok(2)).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s.bytes(), 60);
        let err = s.get_or_create("huge", 101, || Ok(3)).unwrap_err();
        assert!(matches!(err, EngineError::ResourceExhausted(_)));
    }

    #[test]
    fn ttl_sweep_drops_only_idle_expired_sessions() {
        let s = store(10, 1000, 20);
        s.get_or_create("idle", 1, || Ok(1)).unwrap();
        let (busy, _) = s.get_or_create("busy", 1, || Ok(2)).unwrap();
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
