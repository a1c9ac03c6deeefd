//! The online choice of a drafter per round: UCB1 over the measured tokens per second of each
//! arm (each available drafter, and target-only rounds).

use crate::drafter::Drafter;

/// Weight of the exploration bonus against rates normalised to the best arm's (1.0). UCB1's
/// own constant (1) explores for most of a generation of a few dozen rounds; a smaller one
/// settles within a handful of rounds per arm.
const EXPLORATION: f64 = 0.3;

/// One arm's plays and measured totals.
#[derive(Debug, Clone)]
struct Arm {
    drafter: Drafter,
    plays: u32,
    tokens: f64,
    ms: f64,
}

impl Arm {
    /// Tokens per millisecond measured (0 before any time is measured).
    fn rate(&self) -> f64 {
        if self.ms > 0.0 {
            self.tokens / self.ms
        } else {
            0.0
        }
    }
}

/// UCB1 over drafters: every arm is played once (in the order given), then each round plays
/// the arm maximising `rate / best rate + c · √(2 ln N / plays)`, where a rate is the arm's
/// emitted tokens over its rounds' wall time (rounds that fed the prompt excluded by the
/// caller). Deterministic: ties go to the arm listed first.
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
            arms: list
                .into_iter()
                .map(|drafter| Arm {
                    drafter,
                    plays: 0,
                    tokens: 0.0,
                    ms: 0.0,
                })
                .collect(),
        }
    }

    /// The arms, in order.
    pub fn arms(&self) -> Vec<Drafter> {
        self.arms.iter().map(|a| a.drafter).collect()
    }

    /// The arm to play next.
    pub fn choose(&self) -> Drafter {
        if let Some(a) = self.arms.iter().find(|a| a.plays == 0) {
            return a.drafter;
        }
        let best = self.arms.iter().map(Arm::rate).fold(0.0, f64::max);
        let n: f64 = self.arms.iter().map(|a| f64::from(a.plays)).sum();
        let score = |a: &Arm| {
            let mean = if best > 0.0 { a.rate() / best } else { 0.0 };
            mean + EXPLORATION * (2.0 * n.ln() / f64::from(a.plays)).sqrt()
        };
        let mut pick = &self.arms[0];
        for a in &self.arms[1..] {
            if score(a) > score(pick) {
                pick = a;
            }
        }
        pick.drafter
    }

    /// Records a round played with `drafter`: `tokens` emitted in `ms` milliseconds.
    pub fn observe(&mut self, drafter: Drafter, tokens: usize, ms: f64) {
        if !(ms.is_finite() && ms >= 0.0) {
            return;
        }
        if let Some(a) = self.arms.iter_mut().find(|a| a.drafter == drafter) {
            a.plays = a.plays.saturating_add(1);
            a.tokens += tokens as f64;
            a.ms += ms;
        }
    }

    /// Rounds played per arm, in order.
    pub fn plays(&self) -> Vec<(Drafter, u32)> {
        self.arms.iter().map(|a| (a.drafter, a.plays)).collect()
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
}
