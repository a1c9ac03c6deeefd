//! Bodies of ended sessions (their KV caches and the CUDA graphs captured over them), kept for
//! the next sessions: a new session then allocates no cache and captures no graph, which on a
//! GPU otherwise costs its first rounds several eager passes and captures. Caches grow with
//! use, so kept bodies have any capacity; a new session takes the smallest, and its first
//! round charges the body's bytes to the memory budget
//! ([`crate::engine_session::EngineSession::reserve`]).

use std::sync::Mutex;

use specsplit_core::cache::SessionCache;

use crate::EngineError;

/// Spare session bodies an engine keeps unless told otherwise (`spare_sessions` of the worker
/// configuration). They take memory beyond the sessions' budget.
pub const DEFAULT_SPARE_SESSIONS: usize = 1;

/// A bounded pool of spare session bodies.
#[derive(Debug)]
pub struct Spares<T> {
    max: usize,
    items: Mutex<Vec<T>>,
}

impl<T> Spares<T> {
    /// A pool keeping at most `max` bodies.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            items: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<T>> {
        // Every mutation is one push or pop: a panic cannot leave the list inconsistent.
        self.items.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most recently kept body, if any.
    pub fn take(&self) -> Option<T> {
        self.lock().pop()
    }

    /// Keeps `body` for a later session; drops it (returning false) when the pool is full.
    pub fn put(&self, body: T) -> bool {
        let mut items = self.lock();
        if items.len() >= self.max {
            return false;
        }
        items.push(body);
        true
    }

    /// Bodies kept now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no body is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a session keeps for the next one: its cache and the stepper (with the CUDA graphs
/// captured over that cache), if it made one.
pub struct SessionBody<St> {
    /// The KV cache.
    pub cache: SessionCache,
    /// The stepper made over `cache`.
    pub stepper: Option<St>,
}

impl<St> Spares<SessionBody<St>> {
    /// The kept body whose cache is smallest (the least memory a new session holds before its
    /// first round charges it), emptied; else a new body over the cache `new_cache` makes.
    pub fn body_or(
        &self,
        new_cache: impl FnOnce() -> Result<SessionCache, EngineError>,
    ) -> Result<SessionBody<St>, EngineError> {
        let smallest = {
            let mut items = self.lock();
            let at = items
                .iter()
                .enumerate()
                .rev()
                .min_by_key(|(_, b)| b.cache.capacity())
                .map(|(i, _)| i);
            at.map(|i| items.remove(i))
        };
        match smallest {
            Some(mut b) => {
                b.cache.truncate(0)?;
                Ok(b)
            }
            None => Ok(SessionBody {
                cache: new_cache()?,
                stepper: None,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_at_most_max_and_hands_back_the_latest_first() {
        let s = Spares::new(2);
        assert!(s.take().is_none());
        assert!(s.put(1) && s.put(2));
        assert!(!s.put(3), "a full pool drops the body");
        assert_eq!(s.len(), 2);
        assert_eq!(s.take(), Some(2));
        assert_eq!(s.take(), Some(1));
        assert!(s.is_empty());
        let none = Spares::new(0);
        assert!(!none.put(1));
        assert!(none.take().is_none());
    }
}
