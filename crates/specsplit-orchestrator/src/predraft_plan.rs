//! The shape of each round under the pre-draft pipeline, chosen from a cost model: the depth d
//! of the next round's chain and how many candidates m per outcome to pre-draft beside this
//! round's verification (0: none, the next round drafts after the verdict).
//!
//! With per-token acceptance α, a chain of depth d yields E(d) = (1 − α^(d+1)) / (1 − α) tokens
//! a round. A verdict ends at accepted length j with probability α^j(1 − α) for j < d and α^d
//! for j = d, and its pre-draft holds the next round's tree with probability c_rej(m) (the
//! target's correction among the draft's m alternatives) or c_bonus(m) (the bonus among its m
//! likeliest). Per round, in steady state:
//!
//! - without pre-drafting: T = t_draft(d) + t_verify,alone;
//! - with it: T = max(t_verify,beside, t_predraft(d, m)) + (1 − hit(d, m)) · t_draft(d);
//! - with one bet (the overlapped pipeline's: an ordinary draft of d + 1 levels after the whole
//!   path, the draft's own next token as the bonus): T = max(t_verify,beside, t_bet(d + 1)) +
//!   (1 − α^d · c_bonus(1)) · t_draft(d), with t_bet the bet's measured wall time (on one GPU
//!   the bet waits for the verify, and it shows there),
//!
//! and the planner picks the (d, m) or the bet of the largest E(d) / T. Every input is measured: the
//! acceptance, an ordinary draft's time per level, a verify's time alone and beside a pre-draft
//! (both models on one GPU contend, which shows here and turns pre-drafting off), a pre-draft's
//! time per pass by rows, and each outcome kind's hit rate per m. A shape not measured yet is
//! estimated optimistically from the nearest measured one, so that it gets tried and measured.

use std::collections::BTreeMap;

/// Weight of the history in each running estimate.
const DECAY: f64 = 0.9;

/// A running mean that forgets at rate [`DECAY`].
#[derive(Debug, Clone, Copy, Default)]
struct Ema(Option<f64>);

impl Ema {
    fn observe(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |m| m * DECAY + x * (1.0 - DECAY)));
    }
}

/// The first pre-drafts of a shape that may pay for its CUDA graphs: the draft worker runs a
/// new shape once eagerly, then captures its graphs on the next run, and replays from the third.
const WARM_UP: u32 = 2;

/// Samples a row count's pass time needs before its mean alone prices it: until then it is
/// valued at no more than the optimistic estimate of a shape not measured yet, so that a few
/// slow early runs (a new shape's first replays, a neighbour's graphs captured meanwhile) do
/// not price it out for good (a shape not chosen is not measured again).
const TRIAL: u32 = 16;

/// A pre-draft's time per pass at one row count: a running mean whose first [`WARM_UP`]
/// samples are provisional. The first pre-drafts of a shape warm up and capture its CUDA graphs;
/// priced by those stalls, the shape would never be tried again, so until a replayed run has
/// been measured the estimate is the least sample seen. Later samples count at most twice the
/// mean (a one-off stall), so that no single one moves it far. Until [`TRIAL`] samples the
/// estimate is valued at no more than the optimistic one. Each row count has its own (each is a
/// shape of its own graphs).
#[derive(Debug, Clone, Copy, Default)]
struct PassTime {
    mean: Ema,
    samples: u32,
}

impl PassTime {
    fn observe(&mut self, x: f64) {
        match self.mean.0 {
            Some(least) if self.samples <= WARM_UP => self.mean = Ema(Some(x.min(least))),
            Some(mean) => self.mean.observe(x.min(2.0 * mean)),
            None => self.mean.observe(x),
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// Whether enough runs have been measured for the mean alone to price the shape.
    fn tried(&self) -> bool {
        self.samples >= TRIAL
    }
}

/// Hits over tries, decayed, starting from a prior of `prior` in two tries.
#[derive(Debug, Clone, Copy)]
struct Rate {
    hits: f64,
    tries: f64,
}

impl Rate {
    fn prior(p: f64) -> Self {
        Self {
            hits: 2.0 * p,
            tries: 2.0,
        }
    }

    fn observe(&mut self, hit: bool) {
        self.hits = self.hits * DECAY + f64::from(u8::from(hit));
        self.tries = self.tries * DECAY + 1.0;
    }

    fn value(&self) -> f64 {
        self.hits / self.tries
    }
}

/// A round's shape: the next round's depth and the candidates per outcome pre-drafted beside
/// this round's verification (0: no pre-draft).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Levels of the next round's chain.
    pub depth: usize,
    /// Candidates per accepted length (0: none pre-drafted).
    pub candidates: usize,
    /// With no candidates: whether the next round's tree is drafted beside the verify for one
    /// outcome (the whole path accepted, the draft's own next token as the bonus).
    pub bet: bool,
}

impl Shape {
    /// Whether anything is drafted beside the verify: an outcome set or one bet.
    pub fn beside(&self) -> bool {
        self.candidates > 0 || self.bet
    }
}

/// Most candidates per outcome a planner considers.
pub const MAX_CANDIDATES: usize = 4;

/// The cost model's measurements and its choice of [`Shape`]. One planner serves all the
/// generations of an orchestrator: what one measures, the next starts from.
#[derive(Debug, Clone)]
pub struct PreDraftPlanner {
    accepted: f64,
    rejected: f64,
    draft_ms_per_level: Ema,
    /// A bet's wall time per level, from the verify's start to its answer.
    bet_ms_per_level: Ema,
    verify_alone_ms: Ema,
    verify_beside_ms: Ema,
    /// A pre-draft's wall time per pass, by the pass's rows.
    pass_ms: BTreeMap<usize, PassTime>,
    /// Hit rates of outcomes that reject a path token and of the full-acceptance outcome, by m.
    reject_hits: Vec<Rate>,
    bonus_hits: Vec<Rate>,
}

impl PreDraftPlanner {
    /// A planner with nothing measured yet.
    pub fn new() -> Self {
        Self {
            accepted: 1.0,
            rejected: 1.0,
            draft_ms_per_level: Ema::default(),
            bet_ms_per_level: Ema::default(),
            verify_alone_ms: Ema::default(),
            verify_beside_ms: Ema::default(),
            pass_ms: BTreeMap::new(),
            reject_hits: (1..=MAX_CANDIDATES)
                .map(|m| Rate::prior(1.0 - 0.5f64.powi(m as i32)))
                .collect(),
            bonus_hits: (1..=MAX_CANDIDATES)
                .map(|m| Rate::prior(1.0 - 0.5f64.powi(m as i32)))
                .collect(),
        }
    }

    /// Estimated per-token acceptance.
    pub fn alpha(&self) -> f64 {
        (self.accepted / (self.accepted + self.rejected)).clamp(0.0, 0.999)
    }

    /// Records a verified chain: `accepted` of `depth` tokens, the verify call's time and
    /// whether a pre-draft ran beside it.
    pub fn observe_verify(&mut self, depth: usize, accepted: usize, verify_ms: f64, beside: bool) {
        if depth > 0 {
            self.accepted = self.accepted * DECAY + accepted as f64;
            self.rejected = self.rejected * DECAY + f64::from(u8::from(accepted < depth));
        }
        if verify_ms > 0.0 {
            if beside {
                self.verify_beside_ms.observe(verify_ms);
            } else {
                self.verify_alone_ms.observe(verify_ms);
            }
        }
    }

    /// Records an ordinary draft of `depth` levels that took `ms`.
    pub fn observe_draft(&mut self, depth: usize, ms: f64) {
        if depth > 0 && ms > 0.0 {
            self.draft_ms_per_level.observe(ms / depth as f64);
        }
    }

    /// Records a pre-draft of a `path`-token path, `candidates` per outcome and trees of
    /// `depth` levels that took `ms` of wall time.
    pub fn observe_predraft(&mut self, path: usize, candidates: usize, depth: usize, ms: f64) {
        if ms > 0.0 && candidates > 0 {
            let rows = (path + 1) * candidates;
            self.pass_ms
                .entry(rows)
                .or_default()
                .observe(ms / passes(depth) as f64);
        }
    }

    /// Records the wall time of one bet: an ordinary draft of `depth` levels after the path
    /// (the bonus and the tree below it), started beside a verify.
    pub fn observe_bet(&mut self, depth: usize, ms: f64) {
        if ms > 0.0 && depth > 0 {
            self.bet_ms_per_level.observe(ms / depth as f64);
        }
    }

    /// Records whether the pre-draft held the verdict's outcome: one that rejected a path
    /// token (`bonus` false) or accepted the whole path.
    pub fn observe_outcome(&mut self, candidates: usize, bonus: bool, hit: bool) {
        let rates = if bonus {
            &mut self.bonus_hits
        } else {
            &mut self.reject_hits
        };
        if let Some(r) = candidates.checked_sub(1).and_then(|i| rates.get_mut(i)) {
            r.observe(hit);
        }
    }

    /// The measured hit rate of an outcome kind with `candidates` candidates (with its prior).
    pub fn hit_rate(&self, candidates: usize, bonus: bool) -> f64 {
        let rates = if bonus {
            &self.bonus_hits
        } else {
            &self.reject_hits
        };
        candidates
            .checked_sub(1)
            .and_then(|i| rates.get(i))
            .map_or(0.0, Rate::value)
    }

    /// The shape of the largest expected tokens per millisecond among `depths` and up to
    /// [`MAX_CANDIDATES`] candidates (exactly `fixed` when given); without pre-drafting (and at
    /// the smallest depth) until an ordinary draft and a verify alone have been measured.
    pub fn choose(&self, depths: std::ops::RangeInclusive<usize>, fixed: Option<usize>) -> Shape {
        let depth = *depths.start();
        let (Some(per_level), Some(alone)) = (self.draft_ms_per_level.0, self.verify_alone_ms.0)
        else {
            return Shape {
                depth,
                candidates: fixed.unwrap_or(0),
                bet: false,
            };
        };
        let beside = self.verify_beside_ms.0.unwrap_or(alone);
        let a = self.alpha();
        let mut best = (
            f64::MIN,
            Shape {
                depth,
                candidates: 0,
                bet: false,
            },
        );
        for d in depths {
            let tokens = (1.0 - a.powi(d as i32 + 1)) / (1.0 - a);
            let draft = per_level * d as f64;
            let ms: Vec<usize> = match fixed {
                Some(m) => vec![m],
                None => (0..=MAX_CANDIDATES).collect(),
            };
            let mut consider = |rate: f64, shape: Shape| {
                if rate > best.0 {
                    best = (rate, shape);
                }
            };
            for m in ms {
                let ms = if m == 0 {
                    draft + alone
                } else {
                    let hit = self.hit(d, m, a);
                    beside.max(self.predraft_ms(d, m)) + (1.0 - hit) * draft
                };
                let shape = Shape {
                    depth: d,
                    candidates: m,
                    bet: false,
                };
                consider(tokens / ms.max(1e-6), shape);
            }
            if fixed.is_none() {
                let hit = a.powi(d as i32) * self.hit_rate(1, true);
                let bet = self.bet_ms_per_level.0.unwrap_or(per_level) * (d + 1) as f64;
                let ms = beside.max(bet) + (1.0 - hit) * draft;
                let shape = Shape {
                    depth: d,
                    candidates: 0,
                    bet: true,
                };
                consider(tokens / ms.max(1e-6), shape);
            }
        }
        best.1
    }

    /// Probability that a pre-draft with `m` candidates per outcome holds the next round's
    /// tree after a chain of depth `d`.
    fn hit(&self, d: usize, m: usize, a: f64) -> f64 {
        let reject: f64 = (0..d).map(|j| a.powi(j as i32) * (1.0 - a)).sum();
        reject * self.hit_rate(m, false) + a.powi(d as i32) * self.hit_rate(m, true)
    }

    /// Estimated wall time of a pre-draft after a depth-`d` path with `m` candidates and trees
    /// of `d` levels: the measured time per pass of its row count; not measured yet, the least
    /// of an ordinary draft's time per level and the measured times of fewer rows (optimistic,
    /// so that it gets tried and measured); measured fewer than [`TRIAL`] times, no more than
    /// that (see [`PassTime`]).
    fn predraft_ms(&self, d: usize, m: usize) -> f64 {
        let rows = (d + 1) * m;
        let optimistic = || {
            self.pass_ms
                .range(..rows)
                .filter_map(|(_, e)| e.mean.0)
                .chain(self.draft_ms_per_level.0)
                .fold(f64::INFINITY, f64::min)
        };
        let per_pass = match self.pass_ms.get(&rows).map(|e| (e.mean.0, e.tried())) {
            Some((Some(ms), true)) => ms,
            Some((Some(ms), false)) => ms.min(optimistic()),
            _ => optimistic(),
        };
        if per_pass.is_finite() {
            per_pass * passes(d) as f64
        } else {
            0.0
        }
    }
}

impl Default for PreDraftPlanner {
    fn default() -> Self {
        Self::new()
    }
}

/// Passes of a pre-draft whose trees have `depth` levels: the path's, the candidates', and one
/// per further level.
fn passes(depth: usize) -> usize {
    depth + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(alpha_rounds: &[(usize, usize)], draft_ms: f64, alone: f64) -> PreDraftPlanner {
        let mut p = PreDraftPlanner::new();
        for &(d, acc) in alpha_rounds {
            p.observe_verify(d, acc, alone, false);
            p.observe_draft(d, draft_ms * d as f64);
        }
        p
    }

    #[test]
    fn no_pre_draft_before_the_costs_are_measured() {
        let p = PreDraftPlanner::new();
        assert_eq!(
            p.choose(4..=8, None),
            Shape {
                depth: 4,
                candidates: 0,
                bet: false,
            }
        );
        assert_eq!(
            p.choose(4..=8, Some(2)),
            Shape {
                depth: 4,
                candidates: 2,
                bet: false,
            }
        );
    }

    #[test]
    fn a_cheap_pre_draft_beside_a_slow_verify_is_chosen() {
        // Draft 1 ms a level, verify 5 ms, a pre-draft pass 1 ms at any rows; acceptance ~0.8.
        let mut p = measured(&[(4, 4), (4, 3), (4, 4), (4, 2), (4, 4)], 1.0, 5.0);
        for m in 1..=4 {
            for _ in 0..20 {
                p.observe_predraft(4, m, 4, 5.0);
            }
        }
        let s = p.choose(4..=4, None);
        assert!(s.candidates > 0, "{s:?}");
    }

    #[test]
    fn a_shallower_depth_whose_pre_draft_fits_beside_the_verify_beats_a_deeper_one() {
        // Two H200s, 7B/0.5B shapes (2026-11-27): an ordinary draft 0.82 ms a level, a verify
        // 5.43 ms alone and beside a pre-draft; acceptance about 0.79; a pre-draft pass 1.31 ms
        // (5 passes at depth 4: 6.55 ms, longer than the verify; 4 at depth 3: 5.24 ms,
        // shorter); two candidates hold a rejection outcome 87% and the bonus 95% of the time,
        // the one bet's bonus 79%, which costs five draft levels beside the verify.
        let mut p = PreDraftPlanner::new();
        for i in 0..60 {
            let accepted = [4, 0, 4, 1, 4, 2, 3, 0, 4, 1][i % 10];
            p.observe_verify(4, accepted, 5.43, i % 2 == 0);
            p.observe_draft(4, 0.82 * 4.0);
            p.observe_bet(4, 0.8 * 5.0);
            for m in 1..=MAX_CANDIDATES {
                for d in 3..=4 {
                    p.observe_predraft(d, m, d, 1.31 * (d + 1) as f64);
                }
            }
        }
        // Each rate's hits spread evenly over the outcomes (its decayed estimate then holds it).
        let rates = [
            (1, true, 0.79),
            (1, false, 0.71),
            (2, true, 0.95),
            (2, false, 0.87),
        ];
        let more = [
            (3, true, 0.96),
            (3, false, 0.9),
            (4, true, 0.97),
            (4, false, 0.93),
        ];
        for (m, bonus, rate) in rates.into_iter().chain(more) {
            let mut owed = 0.0;
            for _ in 0..100 {
                owed += rate;
                p.observe_outcome(m, bonus, owed >= 1.0);
                if owed >= 1.0 {
                    owed -= 1.0;
                }
            }
            assert!((p.hit_rate(m, bonus) - rate).abs() < 0.1, "{m} {bonus}");
        }
        // At depth 4 two candidates' pre-draft does not fit beside the verify.
        assert!(p.predraft_ms(4, 2) > 5.43 && p.predraft_ms(3, 2) < 5.43);
        let four = p.choose(4..=4, None);
        // Free to choose the depth, it drafts 3 deep with a pre-draft beside every verify.
        let free = p.choose(1..=4, None);
        assert_eq!(free.depth, 3, "{free:?} (at depth 4: {four:?})");
        assert!(free.candidates >= 2 && !free.bet, "{free:?}");
    }

    #[test]
    fn contention_turns_pre_drafting_off() {
        // The same costs, but a verify beside a pre-draft takes twice as long (one GPU).
        let mut p = measured(&[(4, 4), (4, 3), (4, 4), (4, 2), (4, 4)], 1.0, 5.0);
        for m in 1..=4 {
            for _ in 0..20 {
                p.observe_predraft(4, m, 4, 5.0);
                p.observe_verify(4, 3, 11.0, true);
                p.observe_outcome(m, false, false);
                p.observe_outcome(m, true, false);
            }
        }
        assert_eq!(p.choose(4..=4, None).candidates, 0);
        assert_eq!(p.choose(1..=8, None).candidates, 0);
        // The one bet contends as much: drafting after the verdict is the better choice.
        assert!(!p.choose(4..=4, None).bet);
        assert_eq!(
            p.choose(4..=4, Some(3)).candidates,
            3,
            "a fixed number holds"
        );
    }

    #[test]
    fn hit_rates_follow_observations_and_more_candidates_pay_when_they_hit() {
        let mut p = measured(&[(4, 1), (4, 2), (4, 1), (4, 2)], 1.0, 5.0);
        for _ in 0..40 {
            p.observe_outcome(1, false, false);
            p.observe_outcome(3, false, true);
            p.observe_predraft(4, 1, 4, 4.0);
            p.observe_predraft(4, 3, 4, 4.0);
            p.observe_verify(4, 1, 5.0, true);
        }
        assert!(p.hit_rate(1, false) < 0.05 && p.hit_rate(3, false) > 0.95);
        assert_eq!(p.choose(4..=4, None).candidates, 3);
    }

    #[test]
    fn unmeasured_row_counts_are_estimated_optimistically() {
        // An ordinary draft: 1 ms a level.
        let mut p = measured(&[(4, 4)], 1.0, 5.0);
        for _ in 0..TRIAL {
            p.observe_predraft(1, 1, 1, 4.0); // 2 rows, 2 passes: 2 ms a pass
        }
        assert!((p.predraft_ms(1, 1) - 2.0 * 2.0).abs() < 1e-9, "measured");
        // 10 rows not measured: the least of 2 ms (2 rows) and 1 ms (a draft level).
        assert!((p.predraft_ms(4, 2) - 1.0 * 5.0).abs() < 1e-9);
        for _ in 0..TRIAL {
            p.observe_predraft(4, 2, 4, 20.0); // 10 rows, 5 passes: 4 ms a pass
        }
        assert!((p.predraft_ms(4, 2) - 4.0 * 5.0).abs() < 1e-9, "measured");
        assert!(
            (p.predraft_ms(4, 3) - 1.0 * 5.0).abs() < 1e-9,
            "15 rows: not measured"
        );
        assert!(
            (p.predraft_ms(6, 4) - 1.0 * 7.0).abs() < 1e-9,
            "28 rows: not measured"
        );
    }

    #[test]
    fn a_shapes_first_pre_draft_alone_does_not_keep_it_from_being_chosen() {
        // Draft 0.8 ms a level, verify 5.5 ms alone and beside; acceptance 0.8, the draft's
        // bonus right 9 times in 10, two candidates hit 9 times in 10. One bet costs a draft of
        // five levels (4 ms) beside the verify.
        let rounds = [(4, 4), (4, 3), (4, 4), (4, 2), (4, 4)];
        let mut p = measured(&rounds, 0.8, 5.5);
        for _ in 0..40 {
            p.observe_outcome(1, true, true);
            p.observe_outcome(2, true, true);
            p.observe_outcome(2, false, true);
            p.observe_bet(4, 4.0);
        }
        p.observe_outcome(2, false, false);
        p.observe_verify(4, 4, 5.5, true);
        // Two candidates' first two pre-drafts stalled: 20 and 18 ms for 5 passes (run
        // eagerly, then their graphs captured).
        for stall in [20.0, 18.0] {
            p.observe_predraft(4, 2, 4, stall);
            assert!(
                (p.predraft_ms(4, 2) - 0.8 * 5.0).abs() < 1e-9,
                "valued as untried"
            );
            let s = p.choose(4..=4, None);
            assert!(!s.bet && s.candidates >= 2, "{s:?}");
        }
        // Its replays take 6.5 ms: the first replaces the stalls; until TRIAL runs the shape
        // is valued at no more than the optimistic estimate, then at its mean.
        for run in 3..=TRIAL {
            p.observe_predraft(4, 2, 4, 6.5);
            let want = if run < TRIAL { 0.8 * 5.0 } else { 6.5 };
            assert!((p.predraft_ms(4, 2) - want).abs() < 1e-9, "run {run}");
        }
        // Three candidates (15 rows, a shape of its own) stall at their first pre-drafts too:
        // valued as untried, and two candidates' estimate stays.
        p.observe_predraft(4, 3, 4, 40.0);
        p.observe_predraft(4, 3, 4, 40.0);
        assert!((p.predraft_ms(4, 3) - 0.8 * 5.0).abs() < 1e-9);
        assert!((p.predraft_ms(4, 2) - 6.5).abs() < 1e-9);
        // A later stall of two candidates counts as twice their mean.
        p.observe_predraft(4, 2, 4, 40.0);
        assert!((p.predraft_ms(4, 2) - 6.5 * 1.1).abs() < 1e-9);
        let s = p.choose(4..=4, None);
        assert!(!s.bet && s.candidates >= 2, "{s:?}");
        // Pre-drafts of every shape that really take 20 ms make the bet the better choice.
        for _ in 0..40 {
            for m in 1..=MAX_CANDIDATES {
                p.observe_predraft(4, m, 4, 20.0);
            }
        }
        let s = p.choose(4..=4, None);
        assert!(s.bet && s.candidates == 0, "{s:?}");
    }

    #[test]
    fn a_shape_priced_high_by_its_first_runs_is_tried_until_its_mean_is_measured() {
        // Two H200s, 7B/0.5B shapes (2026-11-29): a draft 0.8 ms a level, a verify 4.85 ms
        // beside a pre-draft; a pass of 10 rows (two candidates) 1.016 ms over thousands of
        // runs, of 15 rows (three) 1.04 ms, but its first 13 runs came to 1.336 (stalls while
        // its graphs were made), of 20 rows (four) 1.24 ms. Three candidates hold the outcome
        // more often than two.
        let rounds = [(4, 4), (4, 3), (4, 4), (4, 2), (4, 4), (4, 4)];
        let mut p = measured(&rounds, 0.8, 4.85);
        p.observe_verify(4, 4, 4.85, true);
        for i in 0..100 {
            p.observe_outcome(2, false, i % 10 != 0);
            p.observe_outcome(2, true, i % 10 != 0);
            p.observe_outcome(3, false, true);
            p.observe_outcome(3, true, true);
            p.observe_predraft(4, 2, 4, 1.016 * 5.0);
            p.observe_outcome(4, false, true);
            p.observe_outcome(4, true, true);
            p.observe_predraft(4, 4, 4, 1.24 * 5.0);
        }
        for ms in [
            3.0, 2.5, 1.6, 1.4, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3,
        ] {
            p.observe_predraft(4, 3, 4, ms * 5.0);
        }
        // Thirteen runs are not enough to price three candidates out: they are tried again.
        assert_eq!(p.choose(4..=4, None).candidates, 3);
        // Measured at their real cost (the running mean forgets the stalls) they stay chosen.
        for _ in 0..40 {
            p.observe_predraft(4, 3, 4, 1.04 * 5.0);
        }
        assert!(p.pass_ms[&15].tried());
        assert_eq!(p.choose(4..=4, None).candidates, 3);
        // Had they really cost 1.336 ms a pass, two candidates would win.
        for _ in 0..60 {
            p.observe_predraft(4, 3, 4, 1.336 * 5.0);
        }
        assert_eq!(p.choose(4..=4, None).candidates, 2);
    }

    #[test]
    fn one_bet_is_chosen_where_pre_drafting_every_outcome_costs_more_than_a_verify() {
        // Draft 1 ms a level, verify 5 ms alone and beside; a pre-draft pass 2 ms (10 ms for
        // depth 4: twice a verify); acceptance 0.8 and the draft's bonus right 9 times in 10.
        let rounds = [(4, 4), (4, 3), (4, 4), (4, 2), (4, 4)];
        let mut p = measured(&rounds, 1.0, 5.0);
        for _ in 0..40 {
            for m in 1..=4 {
                p.observe_predraft(4, m, 4, 10.0);
            }
            p.observe_verify(4, 4, 5.0, true);
            p.observe_outcome(1, true, true);
        }
        let s = p.choose(4..=4, None);
        assert_eq!((s.candidates, s.bet), (0, true), "{s:?}");
        // A fixed number of candidates is never replaced by the bet.
        assert!(!p.choose(4..=4, Some(2)).bet);
        // When the bonus is never the draft's own token and a verify beside a draft is slower
        // than alone, the bet cannot pay.
        for _ in 0..80 {
            p.observe_outcome(1, true, false);
            p.observe_verify(4, 4, 6.0, true);
        }
        assert!(!p.choose(4..=4, None).bet);
    }

    #[test]
    fn a_bet_that_waits_for_the_verify_is_not_chosen() {
        // One GPU: the bet's draft runs after the verify's passes, so its answer comes 9.5 ms
        // after the verify starts (5 ms verify + 4.5 ms draft), though the verify itself is not
        // slower; pre-drafting every outcome takes 12 ms.
        let rounds = [(4, 4), (4, 3), (4, 4), (4, 2), (4, 4)];
        let mut p = measured(&rounds, 1.0, 5.0);
        for _ in 0..40 {
            p.observe_verify(4, 4, 5.0, true);
            p.observe_outcome(1, true, true);
            p.observe_bet(5, 9.5);
            for m in 1..=4 {
                p.observe_predraft(4, m, 4, 12.0);
            }
        }
        assert!(!p.choose(4..=4, None).bet);
        // Two GPUs: the bet is ready before the verify ends.
        for _ in 0..80 {
            p.observe_bet(5, 4.5);
        }
        assert!(p.choose(4..=4, None).bet);
    }
}
