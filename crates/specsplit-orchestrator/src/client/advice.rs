//! The target's load advice as an orchestrator last heard it, kept per level of its own live
//! generations: a generation's first round, which has no answer of its own yet, follows the
//! advice heard when about as many generations ran as run now.
//!
//! One advice for all would let the last generation of a busy spell, running alone at the
//! end and advised to draft deep, send the next spell's first rounds all drafting their
//! prompts at once, on a target that is about to be busy again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use specsplit_core::load::{load_level as level, LOAD_LEVELS as LEVELS};

/// No advice heard at a level.
const UNHEARD: usize = usize::MAX;

/// An orchestrator's live generations and the latest advice heard at each level of them.
#[derive(Debug)]
pub(crate) struct AdviceMemory {
    live: AtomicUsize,
    heard: [AtomicUsize; LEVELS],
}

impl Default for AdviceMemory {
    fn default() -> Self {
        Self {
            live: AtomicUsize::new(0),
            heard: std::array::from_fn(|_| AtomicUsize::new(UNHEARD)),
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

    /// The advice last heard at the level of the generations live now (`None`: none heard
    /// there).
    pub(crate) fn for_first_round(&self) -> Option<usize> {
        let at = level(self.live.load(Ordering::Relaxed));
        match self.heard[at].load(Ordering::Relaxed) {
            UNHEARD => None,
            d => Some(d),
        }
    }

    /// Notes `advice` heard now (`None`: the target gave none, which forgets what was heard at
    /// this level).
    pub(crate) fn hear(&self, advice: Option<usize>) {
        let at = level(self.live.load(Ordering::Relaxed));
        self.heard[at].store(advice.unwrap_or(UNHEARD), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_round_follows_the_advice_heard_at_its_level_of_live_generations() {
        let m = Arc::new(AdviceMemory::default());
        let one = m.enter();
        assert_eq!(m.for_first_round(), None, "nothing heard yet");
        m.hear(Some(4));
        let four: Vec<_> = (0..3).map(|_| m.enter()).collect();
        // Four live: the advice heard alone does not stand for them.
        assert_eq!(m.for_first_round(), None);
        m.hear(Some(0));
        assert_eq!(m.for_first_round(), Some(0));
        // The busy spell ends; the last generation, alone, hears deep advice.
        drop(four);
        assert_eq!(m.for_first_round(), Some(4));
        m.hear(Some(5));
        drop(one);
        // The next busy spell's first rounds start from what four generations heard.
        let again: Vec<_> = (0..4).map(|_| m.enter()).collect();
        assert_eq!(m.for_first_round(), Some(0));
        drop(again);
        let alone = m.enter();
        assert_eq!(m.for_first_round(), Some(5));
        // No advice from the target forgets the level's.
        m.hear(None);
        assert_eq!(m.for_first_round(), None);
        drop(alone);
        assert_eq!(m.live.load(Ordering::Relaxed), 0);
    }
}
