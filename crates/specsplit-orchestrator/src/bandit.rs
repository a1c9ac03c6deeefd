//! The online choice of a drafter per round: UCB1 over the measured tokens per second of each
//! arm (each available drafter, and target-only rounds). The draft model and target-only
//! rounds are measured when played; the model-free drafters every round, by scoring what they
//! would have proposed ([`crate::shadow`]), so they need no rounds of their own to be known.

use crate::drafter::Drafter;

/// Weight of the exploration bonus against rates normalised to the best arm's (1.0). UCB1's
/// own constant (1) explores for most of a generation of a few dozen rounds; a smaller one
/// settles within a handful of rounds per arm. The model-free drafters, scored every round,
/// make the rounds counted grow fast, so an arm measured on a few rounds keeps a bonus of
/// about 0.15–0.2 here: it is tried again while its rate is within that of the best.
const EXPLORATION: f64 = 0.1;

/// Rounds of earlier generations an arm starts a generation with, at most (their measured rate
/// kept): enough that an arm known to be slow is not tried again at once, few enough that a
/// generation's own rounds soon outweigh them.
const PRIOR_PLAYS: f64 = 3.0;

/// Rounds of all generations a memory keeps per arm (older ones weigh less as newer come).
const MEMORY_PLAYS: f64 = 64.0;

/// Rounds an arm's estimate weighs at most within a generation: older rounds are scaled down
/// as new ones come, so the choice follows a generation whose text changes kind.
const WINDOW: f64 = 24.0;

/// One arm's measured rounds: the estimate's (windowed, a prior included) and the
/// generation's own.
#[derive(Debug, Clone)]
struct Arm {
    drafter: Drafter,
    /// Rounds behind the estimate (at most [`WINDOW`]).
    weight: f64,
    tokens: f64,
    ms: f64,
    /// This generation's own rounds and their totals.
    plays: u32,
    own_tokens: f64,
    own_ms: f64,
}

impl Arm {
    fn new(drafter: Drafter) -> Self {
        Self {
            drafter,
            weight: 0.0,
            tokens: 0.0,
            ms: 0.0,
            plays: 0,
            own_tokens: 0.0,
            own_ms: 0.0,
        }
    }

    /// Tokens per millisecond measured (0 before any time is measured).
    fn rate(&self) -> f64 {
        if self.ms > 0.0 {
            self.tokens / self.ms
        } else {
            0.0
        }
    }
}

/// UCB1 over drafters: every arm without a measurement is played first (in the order given),
/// then each round plays the arm maximising `rate / best rate + c · √(2 ln N / n)`, where a
/// rate is the arm's emitted tokens over its rounds' wall time (rounds that fed the prompt
/// excluded by the caller) and `n` the rounds behind it. Deterministic: ties go to the arm
/// listed first.
#[derive(Debug, Clone)]
pub struct DrafterBandit {
    arms: Vec<Arm>,
}

impl DrafterBandit {
    /// A bandit over `arms` (duplicates ignored; `Drafter::None` always included, last unless
    /// listed).
    pub fn new(arms: &[Drafter]) -> Self {
        let mut list: Vec<Drafter> = Vec::new();
        for &d in arms.iter().chain(std::iter::once(&Drafter::None)) {
            if !list.contains(&d) {
                list.push(d);
            }
        }
        Self {
            arms: list.into_iter().map(Arm::new).collect(),
        }
    }

    /// The arms, in order.
    pub fn arms(&self) -> Vec<Drafter> {
        self.arms.iter().map(|a| a.drafter).collect()
    }

    /// The arm to play next.
    pub fn choose(&self) -> Drafter {
        if let Some(a) = self.arms.iter().find(|a| a.weight == 0.0) {
            return a.drafter;
        }
        let best = self.arms.iter().map(Arm::rate).fold(0.0, f64::max);
        let n: f64 = self.arms.iter().map(|a| a.weight).sum();
        let score = |a: &Arm| {
            let mean = if best > 0.0 { a.rate() / best } else { 0.0 };
            mean + EXPLORATION * (2.0 * n.max(1.0).ln() / a.weight).sqrt()
        };
        let mut pick = &self.arms[0];
        for a in &self.arms[1..] {
            if score(a) > score(pick) {
                pick = a;
            }
        }
        pick.drafter
    }

    /// Records a round of `drafter` (played, or scored without playing it): `tokens` emitted
    /// in `ms` milliseconds.
    pub fn observe(&mut self, drafter: Drafter, tokens: usize, ms: f64) {
        if !(ms.is_finite() && ms >= 0.0) {
            return;
        }
        if let Some(a) = self.arms.iter_mut().find(|a| a.drafter == drafter) {
            a.plays = a.plays.saturating_add(1);
            a.own_tokens += tokens as f64;
            a.own_ms += ms;
            a.weight += 1.0;
            a.tokens += tokens as f64;
            a.ms += ms;
            if a.weight > WINDOW {
                let keep = WINDOW / a.weight;
                a.weight *= keep;
                a.tokens *= keep;
                a.ms *= keep;
            }
        }
    }

    /// This generation's rounds per arm (played, or scored without playing), in order.
    pub fn plays(&self) -> Vec<(Drafter, u32)> {
        self.arms.iter().map(|a| (a.drafter, a.plays)).collect()
    }

    /// [`DrafterBandit::new`] starting from what earlier generations measured (`memory`): each
    /// arm measured there starts with up to [`PRIOR_PLAYS`] rounds at its measured rate, so a
    /// generation does not try again at once an arm that was slow before (a draft model whose
    /// every first round feeds it the whole prompt, on a CPU).
    pub fn with_memory(arms: &[Drafter], memory: &DrafterMemory) -> Self {
        let mut b = Self::new(arms);
        for a in &mut b.arms {
            if let Some(m) = memory
                .arms
                .iter()
                .find(|m| m.drafter == a.drafter && m.ms > 0.0)
            {
                let plays = m.plays.min(PRIOR_PLAYS);
                a.weight = plays;
                a.tokens = m.tokens * plays / m.plays;
                a.ms = m.ms * plays / m.plays;
            }
        }
        b
    }
}

/// What the generations of one orchestrator measured of each drafter, for the next ones
/// ([`DrafterBandit::with_memory`]): at most [`MEMORY_PLAYS`] rounds an arm, older rounds
/// scaled down as new ones come.
#[derive(Debug, Clone, Default)]
pub struct DrafterMemory {
    arms: Vec<MemoryArm>,
}

#[derive(Debug, Clone)]
struct MemoryArm {
    drafter: Drafter,
    plays: f64,
    tokens: f64,
    ms: f64,
}

impl DrafterMemory {
    /// Adds a generation's measured rounds (its own, not its prior).
    pub fn absorb(&mut self, generation: &DrafterBandit) {
        for a in &generation.arms {
            let plays = f64::from(a.plays);
            if plays <= 0.0 {
                continue;
            }
            let (tokens, ms) = (a.own_tokens, a.own_ms);
            let m = match self.arms.iter_mut().position(|m| m.drafter == a.drafter) {
                Some(i) => &mut self.arms[i],
                None => {
                    self.arms.push(MemoryArm {
                        drafter: a.drafter,
                        plays: 0.0,
                        tokens: 0.0,
                        ms: 0.0,
                    });
                    self.arms.last_mut().expect("just pushed")
                }
            };
            m.plays += plays;
            m.tokens += tokens;
            m.ms += ms;
            if m.plays > MEMORY_PLAYS {
                let keep = MEMORY_PLAYS / m.plays;
                m.plays *= keep;
                m.tokens *= keep;
                m.ms *= keep;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays `rounds` rounds where each arm emits `tokens` tokens per round costing `ms`, and
    /// returns the plays per arm.
    fn simulate(rates: &[(Drafter, usize, f64)], rounds: usize) -> Vec<(Drafter, u32)> {
        let arms: Vec<Drafter> = rates.iter().map(|r| r.0).collect();
        let mut b = DrafterBandit::new(&arms);
        for _ in 0..rounds {
            let d = b.choose();
            let &(_, tokens, ms) = rates.iter().find(|r| r.0 == d).unwrap();
            b.observe(d, tokens, ms);
        }
        b.plays()
    }

    fn plays_of(plays: &[(Drafter, u32)], d: Drafter) -> u32 {
        plays.iter().find(|p| p.0 == d).map_or(0, |p| p.1)
    }

    #[test]
    fn the_fastest_arm_gets_most_rounds() {
        // Tokens per ms: ngram 3/20, suffix 2/20, model 4/40, none 1/12.
        let rates = [
            (Drafter::Ngram, 3, 20.0),
            (Drafter::Suffix, 2, 20.0),
            (Drafter::Model, 4, 40.0),
            (Drafter::None, 1, 12.0),
        ];
        let plays = simulate(&rates, 200);
        let best = plays_of(&plays, Drafter::Ngram);
        assert!(best > 120, "{plays:?}");
        for d in [Drafter::Suffix, Drafter::Model, Drafter::None] {
            assert!(
                plays_of(&plays, d) >= 1 && plays_of(&plays, d) < best / 3,
                "{plays:?}"
            );
        }
        assert_eq!(plays.iter().map(|p| p.1).sum::<u32>(), 200);
    }

    #[test]
    fn target_only_wins_when_no_drafter_pays() {
        let rates = [
            (Drafter::Ngram, 1, 15.0),
            (Drafter::Suffix, 1, 14.0),
            (Drafter::None, 1, 10.0),
        ];
        let plays = simulate(&rates, 200);
        assert!(plays_of(&plays, Drafter::None) > 120, "{plays:?}");
    }

    #[test]
    fn arms_are_listed_once_with_none_and_bad_times_are_ignored() {
        let mut b = DrafterBandit::new(&[Drafter::Suffix, Drafter::Suffix]);
        assert_eq!(b.arms(), vec![Drafter::Suffix, Drafter::None]);
        assert_eq!(b.choose(), Drafter::Suffix);
        b.observe(Drafter::Suffix, 3, f64::NAN);
        assert_eq!(b.choose(), Drafter::Suffix);
        b.observe(Drafter::Model, 3, 1.0);
        assert_eq!(b.plays(), vec![(Drafter::Suffix, 0), (Drafter::None, 0)]);
    }

    #[test]
    fn an_arm_slow_in_earlier_generations_is_not_tried_first_again() {
        let arms = [Drafter::Ngram, Drafter::Suffix, Drafter::Model];
        // A first generation tries every arm; the model's rounds are 20 times slower.
        let first = DrafterBandit::new(&arms);
        let mut played = first.clone();
        for _ in 0..10 {
            played.observe(Drafter::Ngram, 3, 100.0);
            played.observe(Drafter::Suffix, 3, 110.0);
            played.observe(Drafter::Model, 3, 2000.0);
            played.observe(Drafter::None, 1, 90.0);
        }
        let mut memory = DrafterMemory::default();
        memory.absorb(&played);
        // The next generation starts from that: no arm is unplayed, the slow model is not picked.
        let next = DrafterBandit::with_memory(&arms, &memory);
        assert!(next.arms.iter().all(|a| a.weight > 0.0), "{next:?}");
        assert_eq!(next.choose(), Drafter::Ngram);
        // Over a generation's rounds at the same rates, the model gets none of them.
        let mut b = next.clone();
        for _ in 0..30 {
            let d = b.choose();
            assert_ne!(d, Drafter::Model);
            b.observe(d, 3, if d == Drafter::Ngram { 100.0 } else { 110.0 });
        }
        // The memory keeps a bounded number of rounds; an unplayed arm stays unknown.
        for _ in 0..20 {
            memory.absorb(&played);
        }
        assert!(memory.arms.iter().all(|m| m.plays <= MEMORY_PLAYS + 1e-9));
        let fresh = DrafterBandit::with_memory(&[Drafter::Ngram], &DrafterMemory::default());
        assert_eq!(fresh.choose(), Drafter::Ngram);
    }
}
