//! Adaptive draft depth: picks the depth that maximises expected tokens per unit time from the
//! measured per-token acceptance and the measured draft and verify times.

/// Chooses the draft depth from running estimates.
///
/// With per-token acceptance α (each draft token accepted with probability α given its parent
/// was), a round of depth K yields E[tokens] = (1 − α^(K+1)) / (1 − α) and costs
/// K·T_draft + T_target; the controller picks the K in `[min, max]` maximising their ratio.
#[derive(Debug, Clone)]
pub struct DepthController {
    min: usize,
    max: usize,
    accepted: f64,
    rejected: f64,
    draft_ms_per_token: Option<f64>,
    target_ms: Option<f64>,
}

const DECAY: f64 = 0.9;

impl DepthController {
    /// A controller bounded to depths `min..=max`.
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            min: min.max(1),
            max: max.max(min.max(1)),
            accepted: 1.0,
            rejected: 1.0,
            draft_ms_per_token: None,
            target_ms: None,
        }
    }

    /// Records a round: `accepted` of `depth` drafted tokens, and the measured times.
    pub fn observe(&mut self, depth: usize, accepted: usize, draft_ms: f64, verify_ms: f64) {
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.rejected = self.rejected * DECAY + if accepted < depth { 1.0 } else { 0.0 };
        if depth > 0 && draft_ms > 0.0 {
            let per = draft_ms / depth as f64;
            self.draft_ms_per_token = Some(match self.draft_ms_per_token {
                Some(x) => x * DECAY + per * (1.0 - DECAY),
                None => per,
            });
        }
        if verify_ms > 0.0 {
            self.target_ms = Some(match self.target_ms {
                Some(x) => x * DECAY + verify_ms * (1.0 - DECAY),
                None => verify_ms,
            });
        }
    }

    /// Estimated per-token acceptance probability.
    pub fn alpha(&self) -> f64 {
        (self.accepted / (self.accepted + self.rejected)).clamp(0.0, 0.999)
    }

    /// The depth to use next, or `current` until both timings have been measured.
    pub fn depth(&self, current: usize) -> usize {
        let (Some(td), Some(tt)) = (self.draft_ms_per_token, self.target_ms) else {
            return current.clamp(self.min, self.max);
        };
        let a = self.alpha();
        let rate = |k: usize| (1.0 - a.powi(k as i32 + 1)) / (1.0 - a) / (k as f64 * td + tt);
        (self.min..=self.max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
            .unwrap_or(current)
    }
}

/// When to try a failing draft worker again, counted in rounds.
///
/// After a failure the draft is skipped for `first` rounds, then tried again; each further
/// failure in a row doubles the wait, up to `cap` rounds. A success resets the wait.
#[derive(Debug, Clone)]
pub struct DraftBackoff {
    first: usize,
    cap: usize,
    wait: usize,
    ready_at: usize,
}

impl DraftBackoff {
    /// A backoff that first waits `first` rounds and at most `cap` rounds.
    pub fn new(first: usize, cap: usize) -> Self {
        Self {
            first,
            cap: cap.max(first),
            wait: first,
            ready_at: 0,
        }
    }

    /// Whether round `round` may use the draft.
    pub fn ready(&self, round: usize) -> bool {
        round >= self.ready_at
    }

    /// Records a failed draft request in round `round`.
    pub fn fail(&mut self, round: usize) {
        self.ready_at = round + 1 + self.wait;
        self.wait = (self.wait.saturating_mul(2)).min(self.cap);
    }

    /// Records a successful draft request.
    pub fn succeed(&mut self) {
        self.wait = self.first;
    }
}

/// Decides, from measured round times, whether speculation pays: speculative rounds' tokens per
/// second against target-only rounds' (measured on such rounds where there were some, else
/// estimated as one token per verify call). When speculation is slower it stops for
/// `probe_rounds` rounds, then resumes to be measured again.
#[derive(Debug, Clone)]
pub struct SpeedGovernor {
    probe_rounds: usize,
    min_rounds: usize,
    /// Decayed sums over the current speculative stretch: tokens, round ms, verify ms, rounds.
    spec_tokens: f64,
    spec_ms: f64,
    spec_verify_ms: f64,
    spec_rounds: usize,
    /// Decayed sums over target-only rounds: tokens, round ms, rounds.
    ar_tokens: f64,
    ar_ms: f64,
    ar_rounds: usize,
    /// Speculation is off before this round.
    off_until: Option<usize>,
}

/// Speculative rounds measured before speculation is judged.
const MIN_SPEC_ROUNDS: usize = 8;

impl SpeedGovernor {
    /// A governor that turns speculation off for `probe_rounds` rounds at a time when it is
    /// measured slower (0 = never).
    pub fn new(probe_rounds: usize) -> Self {
        Self {
            probe_rounds,
            min_rounds: MIN_SPEC_ROUNDS,
            spec_tokens: 0.0,
            spec_ms: 0.0,
            spec_verify_ms: 0.0,
            spec_rounds: 0,
            ar_tokens: 0.0,
            ar_ms: 0.0,
            ar_rounds: 0,
            off_until: None,
        }
    }

    /// Whether round `round` may speculate.
    pub fn speculate(&self, round: usize) -> bool {
        self.off_until.is_none_or(|u| round >= u)
    }

    /// Records a speculative round: `tokens` emitted in `round_ms`, of which `verify_ms` in the
    /// verify call.
    pub fn observe_spec(&mut self, tokens: usize, round_ms: f64, verify_ms: f64) {
        self.spec_tokens = self.spec_tokens * DECAY + tokens as f64;
        self.spec_ms = self.spec_ms * DECAY + round_ms;
        self.spec_verify_ms = self.spec_verify_ms * DECAY + verify_ms;
        self.spec_rounds += 1;
    }

    /// Records a target-only round: `tokens` emitted in `round_ms`.
    pub fn observe_target_only(&mut self, tokens: usize, round_ms: f64) {
        self.ar_tokens = self.ar_tokens * DECAY + tokens as f64;
        self.ar_ms = self.ar_ms * DECAY + round_ms;
        self.ar_rounds += 1;
    }

    /// Tokens per second of the recent speculative rounds, and of target-only rounds.
    pub fn rates(&self) -> (f64, f64) {
        let per_s = |t: f64, ms: f64| if ms > 0.0 { t * 1e3 / ms } else { 0.0 };
        let spec = per_s(self.spec_tokens, self.spec_ms);
        let ar = if self.ar_rounds >= 2 {
            per_s(self.ar_tokens, self.ar_ms)
        } else {
            // One token per verify call: verifying a tree costs at least a plain step.
            let calls: f64 = (0..self.spec_rounds.min(200))
                .map(|i| DECAY.powi(i as i32))
                .sum();
            per_s(calls, self.spec_verify_ms)
        };
        (spec, ar)
    }

    /// Reviews the measurements after round `round`; returns the switch it makes, if any.
    pub fn review(&mut self, round: usize) -> Option<crate::SpeedSwitch> {
        if self.probe_rounds == 0 {
            return None;
        }
        let (spec, ar) = self.rates();
        let switch = |speculate| crate::SpeedSwitch {
            round: round + 1,
            speculate,
            spec_tokens_per_s: spec,
            target_only_tokens_per_s: ar,
        };
        match self.off_until {
            Some(u) if round + 1 >= u => {
                // Probe: speculate again and measure afresh.
                self.off_until = None;
                (
                    self.spec_tokens,
                    self.spec_ms,
                    self.spec_verify_ms,
                    self.spec_rounds,
                ) = (0.0, 0.0, 0.0, 0);
                Some(switch(true))
            }
            Some(_) => None,
            None if self.spec_rounds >= self.min_rounds && spec < ar => {
                self.off_until = Some(round + 1 + self.probe_rounds);
                Some(switch(false))
            }
            None => None,
        }
    }
}

/// `widths` resized to `depth` levels: truncated, or extended with chains (width 1).
pub fn resize_widths(widths: &[usize], depth: usize) -> Vec<usize> {
    let mut w: Vec<usize> = widths.iter().copied().take(depth).collect();
    w.resize(depth, 1);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn high_acceptance_and_cheap_drafts_push_depth_up() {
        let mut c = DepthController::new(1, 12);
        for _ in 0..50 {
            c.observe(4, 4, 4.0, 30.0);
        }
        assert!(c.alpha() > 0.9);
        assert!(c.depth(4) > 4, "depth {}", c.depth(4));
    }

    #[test]
    fn low_acceptance_pulls_depth_down_within_bounds() {
        let mut c = DepthController::new(2, 12);
        for _ in 0..50 {
            c.observe(8, 0, 8.0, 30.0);
        }
        assert!(c.alpha() < 0.1);
        assert_eq!(c.depth(8), 2);
    }

    #[test]
    fn chooses_the_brute_force_optimum() {
        let mut c = DepthController::new(1, 10);
        for _ in 0..30 {
            c.observe(4, 2, 8.0, 20.0);
        }
        let a = c.alpha();
        let td = c.draft_ms_per_token.unwrap();
        let tt = c.target_ms.unwrap();
        let best = (1..=10)
            .map(|k| ((1.0 - a.powi(k + 1)) / (1.0 - a) / (k as f64 * td + tt), k))
            .fold((f64::MIN, 0), |acc, x| if x.0 > acc.0 { x } else { acc });
        assert_eq!(c.depth(3), best.1 as usize);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets_on_success() {
        let mut b = DraftBackoff::new(2, 5);
        assert!(b.ready(0));
        b.fail(0);
        assert!(!b.ready(1) && !b.ready(2) && b.ready(3));
        b.fail(3);
        assert!(!b.ready(7) && b.ready(8), "the wait doubled to 4 rounds");
        b.fail(8);
        assert!(!b.ready(13) && b.ready(14), "capped at 5 rounds");
        b.succeed();
        b.fail(14);
        assert!(!b.ready(16) && b.ready(17), "a success resets the wait");
    }

    #[test]
    fn slow_speculation_switches_to_target_only_and_probes_again() {
        let mut g = SpeedGovernor::new(10);
        // Target-only rounds: 1 token in 10 ms = 100 tok/s.
        g.observe_target_only(1, 10.0);
        g.observe_target_only(1, 10.0);
        // Speculative rounds: 2 tokens in 40 ms = 50 tok/s.
        for r in 2..2 + MIN_SPEC_ROUNDS - 1 {
            g.observe_spec(2, 40.0, 12.0);
            assert_eq!(
                g.review(r),
                None,
                "judged only after {MIN_SPEC_ROUNDS} rounds"
            );
        }
        g.observe_spec(2, 40.0, 12.0);
        let sw = g.review(20).expect("slower speculation stops");
        assert!(!sw.speculate);
        assert_eq!(sw.round, 21);
        assert!((sw.spec_tokens_per_s - 50.0).abs() < 1e-9, "{sw:?}");
        assert!((sw.target_only_tokens_per_s - 100.0).abs() < 1e-9, "{sw:?}");
        assert!(!g.speculate(21) && !g.speculate(30) && g.speculate(31));
        for r in 21..29 {
            g.observe_target_only(1, 10.0);
            assert_eq!(g.review(r), None);
        }
        g.observe_target_only(1, 10.0);
        let probe = g.review(30).expect("speculation is probed again");
        assert!(probe.speculate && probe.round == 31);
        assert!(g.speculate(31));
        // Faster speculation now: 5 tokens in 20 ms = 250 tok/s keeps speculating.
        for r in 31..31 + 2 * MIN_SPEC_ROUNDS {
            g.observe_spec(5, 20.0, 12.0);
            assert_eq!(g.review(r), None);
        }
    }

    #[test]
    fn without_target_only_rounds_the_rate_is_estimated_from_verify_times() {
        let mut g = SpeedGovernor::new(4);
        // 1.5 tokens per 30 ms round (50 tok/s) against one token per 10 ms verify (100 tok/s).
        for r in 0..MIN_SPEC_ROUNDS / 2 {
            g.observe_spec(1, 20.0, 10.0);
            g.observe_spec(2, 40.0, 10.0);
            let _ = g.review(r);
        }
        assert!(!g.speculate(MIN_SPEC_ROUNDS / 2));
        let (spec, ar) = g.rates();
        assert!(spec < ar, "{spec} {ar}");
        assert!((ar - 100.0).abs() < 1e-6, "{ar}");
        // A governor with probing off never switches.
        let mut off = SpeedGovernor::new(0);
        for r in 0..50 {
            off.observe_spec(1, 100.0, 1.0);
            assert_eq!(off.review(r), None);
        }
        assert!(off.speculate(50));
    }

    #[test]
    fn resize_truncates_or_extends_with_chains() {
        assert_eq!(resize_widths(&[4, 2, 1], 2), vec![4, 2]);
        assert_eq!(resize_widths(&[4, 2], 4), vec![4, 2, 1, 1]);
    }
}
