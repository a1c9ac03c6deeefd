//! Speculation gated by load: the draft depth that maximises a target's aggregate throughput at
//! its current batch, from measured pass times per row count and the measured acceptance.
//!
//! A pass of `B` sessions each verifying a draft chain of depth `d` runs `B·(d+1)` rows and
//! yields `B·E(d)` tokens in expectation, `E(d) = 1 + α + … + α^d` with α the per-token
//! acceptance. [`LoadGate::advise`] picks the `d` in `0..=max` that maximises
//! `B·E(d) / T(B·(d+1))`, `T` the pass time the gate has measured at that row count. Where
//! `T` is flat in the rows (a latency-bound pass) the deepest draft wins; where it grows
//! linearly from the first row (compute-bound) no draft pays; in between the depth falls as
//! the batch grows.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Row buckets of the pass-time table: bucket `k` holds passes of `2^k..2^(k+1)` rows.
const BUCKETS: usize = 24;

/// Weight of a new pass in its bucket's running means.
const PASS_WEIGHT: f64 = 0.2;

/// Passes the gate must have measured before it advises.
const MIN_PASSES: u64 = 4;

/// Draft tokens the gate must have seen tried before it advises.
const MIN_TRIED: u64 = 8;

/// The acceptance estimate is kept below 1 so that deeper drafts always cost something.
const MAX_ACCEPTANCE: f64 = 0.999;

/// Running means of the passes of one row bucket.
#[derive(Debug, Clone, Copy)]
struct Point {
    /// Mean rows of the bucket's passes.
    rows: f64,
    /// Mean pass time, in seconds.
    secs: f64,
}

/// The cost model behind load-gated speculation: a bounded table of measured pass times per
/// row count and the running acceptance of the verified drafts.
#[derive(Debug, Clone)]
pub struct LoadGate {
    /// Deepest draft the gate advises.
    max_depth: usize,
    /// Running means per row bucket (`None`: no pass of that size yet).
    table: [Option<Point>; BUCKETS],
    /// Passes measured.
    passes: u64,
    /// Draft tokens tried (every accepted one, and the first rejected one of each verdict)
    /// and accepted.
    tried: u64,
    accepted: u64,
}

impl LoadGate {
    /// A gate that advises depths up to `max_depth`, with nothing measured yet.
    pub fn new(max_depth: usize) -> Self {
        Self {
            max_depth,
            table: [None; BUCKETS],
            passes: 0,
            tried: 0,
            accepted: 0,
        }
    }

    /// Records one target pass of `rows` rows (all sessions' tokens) that took `time` in the
    /// model. A pass of no rows is ignored.
    pub fn observe_pass(&mut self, rows: usize, time: Duration) {
        if rows == 0 {
            return;
        }
        let k = (usize::BITS - 1 - rows.leading_zeros()) as usize;
        let k = k.min(BUCKETS - 1);
        let (r, s) = (rows as f64, time.as_secs_f64());
        self.table[k] = Some(match self.table[k] {
            None => Point { rows: r, secs: s },
            Some(p) => Point {
                rows: p.rows + PASS_WEIGHT * (r - p.rows),
                secs: p.secs + PASS_WEIGHT * (s - p.secs),
            },
        });
        self.passes += 1;
    }

    /// Records one verdict: `accepted` of the `drafted` tokens on the draft's longest path.
    /// A draft token is tried when every token before it was accepted: the accepted ones, and
    /// the first rejected one if any.
    pub fn observe_verdict(&mut self, drafted: usize, accepted: usize) {
        let accepted = accepted.min(drafted);
        self.accepted += accepted as u64;
        self.tried += (accepted + usize::from(accepted < drafted)) as u64;
    }

    /// The running per-token acceptance estimate α: accepted ÷ tried draft tokens (the
    /// geometric model's maximum-likelihood estimate, unbiased by the chains' depth); `None`
    /// before enough tries.
    pub fn acceptance(&self) -> Option<f64> {
        (self.tried >= MIN_TRIED)
            .then(|| (self.accepted as f64 / self.tried as f64).min(MAX_ACCEPTANCE))
    }

    /// The pass time the table predicts for `rows` rows, in seconds: piecewise linear between
    /// the measured buckets, flat below the smallest, extended along the last two buckets'
    /// slope (never falling) above the largest. `None` with fewer than two buckets measured.
    pub fn pass_secs(&self, rows: f64) -> Option<f64> {
        let pts: Vec<Point> = self.table.iter().flatten().copied().collect();
        if pts.len() < 2 {
            return None;
        }
        let first = pts[0];
        if rows <= first.rows {
            return Some(first.secs);
        }
        for w in pts.windows(2) {
            let (a, b) = (w[0], w[1]);
            if rows <= b.rows {
                return Some(a.secs + (b.secs - a.secs) * (rows - a.rows) / (b.rows - a.rows));
            }
        }
        let (a, b) = (pts[pts.len() - 2], pts[pts.len() - 1]);
        let slope = ((b.secs - a.secs) / (b.rows - a.rows)).max(0.0);
        Some(b.secs + slope * (rows - b.rows))
    }

    /// The draft depth in `0..=max_depth` that maximises the aggregate expected tokens per
    /// second of `batch_sessions` sessions sharing each pass (the shallowest of equals);
    /// `None` before the gate has measured enough passes and verdicts to say.
    pub fn advise(&self, batch_sessions: usize) -> Option<usize> {
        if self.passes < MIN_PASSES {
            return None;
        }
        let alpha = self.acceptance()?;
        let b = batch_sessions.max(1) as f64;
        let mut best = (0, f64::NEG_INFINITY);
        let mut expected = 0.0;
        let mut term = 1.0;
        for d in 0..=self.max_depth {
            expected += term;
            term *= alpha;
            let secs = self.pass_secs(b * (d + 1) as f64)?;
            let rate = b * expected / secs.max(f64::MIN_POSITIVE);
            if rate > best.1 {
                best = (d, rate);
            }
        }
        Some(best.0)
    }
}

/// A [`LoadGate`] shared by a target's concurrent requests, with the count of verify requests
/// in flight that stands for the batch.
#[derive(Debug)]
pub struct LoadAdvisor {
    gate: Mutex<LoadGate>,
    in_flight: AtomicUsize,
}

/// A verify request counted in flight until dropped.
#[derive(Debug)]
pub struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LoadAdvisor {
    /// An advisor over a fresh gate advising depths up to `max_depth`.
    pub fn new(max_depth: usize) -> Self {
        Self::with_gate(LoadGate::new(max_depth))
    }

    /// An advisor over `gate`, as it has measured so far.
    pub fn with_gate(gate: LoadGate) -> Self {
        Self {
            gate: Mutex::new(gate),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Counts a verify request in flight while the returned guard lives.
    pub fn enter(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(&self.in_flight)
    }

    /// Verify requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Records a pass of `rows` rows taking `time`, and its verdict (`accepted` of `drafted`
    /// tokens on the longest path); returns the depth advised for the sessions in flight.
    pub fn observe_and_advise(
        &self,
        rows: usize,
        time: Duration,
        drafted: usize,
        accepted: usize,
    ) -> Option<usize> {
        let batch = self.in_flight();
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        g.observe_pass(rows, time);
        if drafted > 0 {
            g.observe_verdict(drafted, accepted);
        }
        g.advise(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate fed passes of every row count in `rows` timed by `t` (seconds), and verdicts of
    /// a per-token acceptance of 0.8.
    fn gate(max: usize, rows: impl IntoIterator<Item = usize>, t: impl Fn(f64) -> f64) -> LoadGate {
        let mut g = LoadGate::new(max);
        for r in rows {
            g.observe_pass(r, Duration::from_secs_f64(t(r as f64)));
        }
        for i in 0..100 {
            g.observe_verdict(1, usize::from(i % 5 != 0));
        }
        g
    }

    #[test]
    fn acceptance_is_per_token_whatever_the_depth() {
        // Chains of depth 4 with α = 0.5: every accept/reject pattern in proportion.
        let mut g = LoadGate::new(4);
        for (accepted, times) in [(0, 8), (1, 4), (2, 2), (3, 1), (4, 1)] {
            for _ in 0..times {
                g.observe_verdict(4, accepted);
            }
        }
        let a = g.acceptance().expect("enough tries");
        assert!((a - 0.5).abs() < 1e-9, "{a}");
    }

    #[test]
    fn latency_bound_target_gets_the_deepest_draft() {
        let g = gate(8, 1..=600, |_| 0.02);
        for b in [1, 4, 16, 64] {
            assert_eq!(g.advise(b), Some(8), "batch {b}");
        }
    }

    #[test]
    fn compute_bound_target_gets_no_draft() {
        let g = gate(8, 1..=600, |r| 1e-3 * r);
        for b in [1, 4, 16, 64] {
            assert_eq!(g.advise(b), Some(0), "batch {b}");
        }
    }

    #[test]
    fn depth_falls_as_the_batch_grows_between_the_two() {
        // A roofline: weight reads cost 20 ms up to 64 rows, then each row costs 0.3 ms.
        let g = gate(8, 1..=600, |r| 0.02f64.max(3e-4 * r));
        let depths: Vec<usize> = [1, 4, 8, 16, 32, 64]
            .iter()
            .map(|&b| g.advise(b).expect("advice"))
            .collect();
        assert!(depths.windows(2).all(|w| w[0] >= w[1]), "{depths:?}");
        assert_eq!(depths[0], 8, "{depths:?}");
        assert!(depths[5] < 2, "{depths:?}");
        assert!(depths[2] > depths[5], "{depths:?}");
    }

    #[test]
    fn no_acceptance_gives_no_draft() {
        let mut g = LoadGate::new(8);
        for r in 1..=64 {
            g.observe_pass(r, Duration::from_millis(20));
        }
        for _ in 0..10 {
            g.observe_verdict(5, 0);
        }
        assert_eq!(g.acceptance(), Some(0.0));
        assert_eq!(g.advise(1), Some(0));
    }

    #[test]
    fn little_data_gives_no_advice() {
        let mut g = LoadGate::new(8);
        assert_eq!(g.advise(1), None);
        // Passes of one size only: nothing says how the time grows with the rows.
        for _ in 0..10 {
            g.observe_pass(5, Duration::from_millis(20));
        }
        g.observe_verdict(100, 80);
        assert_eq!(g.advise(1), None);
        // Pass times of two sizes, but no verdict on a draft yet.
        let mut g = LoadGate::new(8);
        for r in [1, 100, 1, 100] {
            g.observe_pass(r, Duration::from_millis(20));
        }
        assert_eq!(g.acceptance(), None);
        assert_eq!(g.advise(1), None);
        g.observe_verdict(100, 80);
        assert_eq!(g.advise(1), Some(8));
    }

    #[test]
    fn pass_time_interpolates_and_extrapolates_upwards() {
        let g = gate(4, [10, 20, 40], |r| 1e-3 * r);
        let at = |r: f64| g.pass_secs(r).expect("two buckets");
        assert!((at(30.0) - 0.03).abs() < 1e-9);
        assert!((at(80.0) - 0.08).abs() < 1e-9);
        assert!((at(1.0) - 0.01).abs() < 1e-9);
    }

    #[test]
    fn the_advisor_counts_requests_in_flight() {
        let a = LoadAdvisor::new(4);
        let g1 = a.enter();
        {
            let _g2 = a.enter();
            assert_eq!(a.in_flight(), 2);
        }
        assert_eq!(a.in_flight(), 1);
        drop(g1);
        assert_eq!(a.in_flight(), 0);
        assert_eq!(
            a.observe_and_advise(3, Duration::from_millis(5), 2, 1),
            None
        );
    }
}
