//! The target's load advice as an orchestrator last heard it, kept per level of its own live
//! generations: a generation's first round, which has no answer of its own yet, follows the
//! advice heard when about as many generations ran as run now.
//!
//! One advice for all would let the last generation of a busy spell, running alone at the
//! end and advised to draft deep, send the next spell's first rounds all drafting their
//! prompts at once, on a target that is about to be busy again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use specsplit_core::load::{load_level as level, LOAD_LEVELS as LEVELS};

/// How long advice heard at a busier level also caps a first round at a quieter one. The
/// generations of a burst enter one by one: its first ones count few live generations and would
/// follow the advice of a quiet spell, each drafting its prompt while the target is about to
/// be busy again.
const BUSIER_MEMORY: Duration = Duration::from_secs(10);

/// An orchestrator's live generations and the latest advice heard at each level of them, with
/// when.
#[derive(Debug)]
pub(crate) struct AdviceMemory {
    live: AtomicUsize,
    heard: Mutex<[Option<(usize, Instant)>; LEVELS]>,
}

impl Default for AdviceMemory {
    fn default() -> Self {
        Self {
            live: AtomicUsize::new(0),
            heard: Mutex::new([None; LEVELS]),
        }
    }
}

/// A generation counted live until dropped.
#[derive(Debug)]
pub(crate) struct Live(Arc<AdviceMemory>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AdviceMemory {
    /// Counts a generation live while the returned guard lives.
    pub(crate) fn enter(self: &Arc<Self>) -> Live {
        self.live.fetch_add(1, Ordering::Relaxed);
        Live(self.clone())
    }

    /// The advice for a first round now: the advice last heard at the level of the generations
    /// live now, capped by any heard at a busier level within [`BUSIER_MEMORY`] (`None`:
    /// neither).
    pub(crate) fn for_first_round(&self) -> Option<usize> {
        self.first_round_at(Instant::now())
    }

    fn first_round_at(&self, now: Instant) -> Option<usize> {
        let at = level(self.live.load(Ordering::Relaxed));
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let own = heard[at].map(|(d, _)| d);
        let busier = heard[at + 1..]
            .iter()
            .flatten()
            .filter(|&&(_, t)| now.saturating_duration_since(t) <= BUSIER_MEMORY)
            .map(|&(d, _)| d)
            .min();
        match (own, busier) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Notes `advice` heard now (`None`: the target gave none, which forgets what was heard at
    /// this level).
    pub(crate) fn hear(&self, advice: Option<usize>) {
        self.hear_at(advice, Instant::now());
    }

    fn hear_at(&self, advice: Option<usize>, now: Instant) {
        let at = level(self.live.load(Ordering::Relaxed));
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        heard[at] = advice.map(|d| (d, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_round_follows_the_advice_heard_at_its_level_of_live_generations() {
        let m = Arc::new(AdviceMemory::default());
        let t = Instant::now();
        let one = m.enter();
        assert_eq!(m.first_round_at(t), None, "nothing heard yet");
        m.hear_at(Some(4), t);
        let four: Vec<_> = (0..3).map(|_| m.enter()).collect();
        // Four live: the advice heard alone does not stand for them.
        assert_eq!(m.first_round_at(t), None);
        m.hear_at(Some(0), t);
        assert_eq!(m.first_round_at(t), Some(0));
        // The busy spell ends; the last generation, alone, hears deep advice.
        drop(four);
        m.hear_at(Some(5), t);
        drop(one);
        // The next busy spell's first rounds start from what four generations heard.
        let again: Vec<_> = (0..4).map(|_| m.enter()).collect();
        assert_eq!(m.first_round_at(t), Some(0));
        drop(again);
        // A generation alone follows the deep advice once the busy spell is past.
        let alone = m.enter();
        assert_eq!(m.first_round_at(t + BUSIER_MEMORY * 2), Some(5));
        // No advice from the target forgets the level's.
        m.hear_at(None, t);
        assert_eq!(m.first_round_at(t + BUSIER_MEMORY * 2), None);
        drop(alone);
        assert_eq!(m.live.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_bursts_first_generations_follow_the_advice_of_its_busier_level() {
        let m = Arc::new(AdviceMemory::default());
        let t = Instant::now();
        // A spell of 32 generations was advised not to draft; its last one, alone, deep.
        let spell: Vec<_> = (0..32).map(|_| m.enter()).collect();
        m.hear_at(Some(0), t);
        drop(spell);
        let last = m.enter();
        m.hear_at(Some(4), t);
        drop(last);
        // The next burst's generations enter one by one: the first ones count few live
        // generations, and still do not draft their first rounds while the busy spell is recent.
        let burst: Vec<_> = (0..32).map(|_| m.enter()).collect();
        drop(burst);
        let soon = t + Duration::from_secs(1);
        let first = m.enter();
        assert_eq!(m.first_round_at(soon), Some(0));
        // Long after it, the quiet level's own advice stands again.
        assert_eq!(m.first_round_at(t + BUSIER_MEMORY * 2), Some(4));
        // A level with no advice of its own takes a busier level's within the memory.
        let more: Vec<_> = (0..6).map(|_| m.enter()).collect();
        assert_eq!(m.first_round_at(soon), Some(0));
        assert_eq!(m.first_round_at(t + BUSIER_MEMORY * 2), None);
        drop((first, more));
    }
}
