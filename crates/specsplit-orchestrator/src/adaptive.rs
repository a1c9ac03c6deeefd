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
    fn resize_truncates_or_extends_with_chains() {
        assert_eq!(resize_widths(&[4, 2, 1], 2), vec![4, 2]);
        assert_eq!(resize_widths(&[4, 2], 4), vec![4, 2, 1, 1]);
    }
}
