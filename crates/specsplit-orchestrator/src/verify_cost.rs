//! What a round costs by the rows it sends the target: the verify's measured wall time per row
//! count, and the round's time beside the verify. The online choice of a drafter prices the
//! rounds a model-free drafter would have played from it ([`crate::shadow`]).

use std::collections::BTreeMap;

/// Weight of a new measurement in a row count's running mean.
const NEW_WEIGHT: f64 = 0.25;

/// Row counts measured at most; beyond, a pass is priced by extrapolation.
const MAX_ROWS: usize = 4096;

/// Measured verify wall times by rows, and the mean time a round spends beside its verify and
/// its drafting.
#[derive(Debug, Clone, Default)]
pub struct VerifyCost {
    /// Rows → running mean of the verify's wall time (ms).
    by_rows: BTreeMap<usize, f64>,
    /// Running mean of a round's time outside its verify (ms).
    overhead_ms: Option<f64>,
}

/// A running mean that starts at its first value.
fn blend(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + NEW_WEIGHT * (new - o))
}

impl VerifyCost {
    /// Records a round that sent `rows` rows: its verify took `verify_ms` and its drafting
    /// `draft_ms` of the whole round's `round_ms`. Non-finite or negative times and rows beyond
    /// the table are ignored.
    pub fn observe(&mut self, rows: usize, verify_ms: f64, draft_ms: f64, round_ms: f64) {
        let finite = |x: f64| x.is_finite() && x >= 0.0;
        if rows == 0
            || rows > MAX_ROWS
            || !finite(verify_ms)
            || !finite(draft_ms)
            || !finite(round_ms)
        {
            return;
        }
        let v = blend(self.by_rows.get(&rows).copied(), verify_ms);
        self.by_rows.insert(rows, v);
        // What a round spends beside its verify and its drafter's work: the same for every
        // drafter.
        let beside = (round_ms - verify_ms - draft_ms).max(0.0);
        self.overhead_ms = Some(blend(self.overhead_ms, beside));
    }

    /// Whether anything was measured.
    pub fn is_empty(&self) -> bool {
        self.by_rows.is_empty()
    }

    /// The expected wall time of a round sending `rows` rows (its verify and the time beside
    /// it, without drafting): the measured mean at that row count, else interpolated between the nearest
    /// measured counts, else extrapolated along the slope between the smallest and the largest
    /// measured counts (flat from one measurement). `None` before any measurement.
    pub fn round_ms(&self, rows: usize) -> Option<f64> {
        let verify = self.verify_ms(rows)?;
        Some(verify + self.overhead_ms.unwrap_or(0.0))
    }

    /// The expected verify wall time at `rows` rows (see [`VerifyCost::round_ms`]).
    pub fn verify_ms(&self, rows: usize) -> Option<f64> {
        if let Some(&t) = self.by_rows.get(&rows) {
            return Some(t);
        }
        let below = self.by_rows.range(..rows).next_back();
        let above = self.by_rows.range(rows..).next();
        match (below, above) {
            (Some((&r0, &t0)), Some((&r1, &t1))) => {
                let f = (rows - r0) as f64 / (r1 - r0) as f64;
                Some(t0 + f * (t1 - t0))
            }
            (None, Some((_, &t))) => Some(t),
            (Some((&r_max, &t_max)), None) => {
                let (&r_min, &t_min) = self.by_rows.iter().next()?;
                let slope = if r_max > r_min {
                    ((t_max - t_min) / (r_max - r_min) as f64).max(0.0)
                } else {
                    0.0
                };
                Some(t_max + slope * (rows - r_max) as f64)
            }
            (None, None) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_counts_are_kept_and_others_interpolated_or_extrapolated() {
        let mut c = VerifyCost::default();
        assert_eq!(c.round_ms(1), None);
        c.observe(1, 10.0, 0.5, 12.5);
        // One measurement: flat everywhere, plus the time beside the verify.
        assert_eq!(c.verify_ms(5), Some(10.0));
        assert_eq!(c.round_ms(5), Some(12.0));
        c.observe(5, 30.0, 0.0, 32.0);
        assert_eq!(c.verify_ms(5), Some(30.0));
        assert_eq!(c.verify_ms(3), Some(20.0));
        // Beyond the largest count: the slope from 1 to 5 rows (5 ms a row).
        assert_eq!(c.verify_ms(9), Some(50.0));
        // A running mean: a new measurement moves the estimate a quarter of the way.
        c.observe(1, 14.0, 0.0, 16.0);
        assert_eq!(c.verify_ms(1), Some(11.0));
    }

    #[test]
    fn bad_measurements_are_ignored() {
        let mut c = VerifyCost::default();
        c.observe(0, 1.0, 0.0, 1.0);
        c.observe(2, f64::NAN, 0.0, 1.0);
        c.observe(2, 1.0, 0.0, -1.0);
        c.observe(2, 1.0, f64::INFINITY, 1.0);
        c.observe(MAX_ROWS + 1, 1.0, 0.0, 1.0);
        assert!(c.is_empty());
        // A round no longer than its verify has no time beside it.
        c.observe(2, 5.0, 0.0, 4.0);
        assert_eq!(c.round_ms(2), Some(5.0));
    }

    #[test]
    fn a_falling_measurement_never_makes_larger_passes_cheaper() {
        let mut c = VerifyCost::default();
        c.observe(1, 10.0, 0.0, 10.0);
        c.observe(4, 8.0, 0.0, 8.0);
        assert_eq!(c.verify_ms(10), Some(8.0));
    }
}
