//! Load levels: batches of concurrent sessions grouped by doubling size, the unit in which a
//! target's load gate keeps its measurements and an orchestrator remembers the target's advice.

/// Load levels: level `k` holds batches of `2^k..2^(k+1)` sessions, the last one every larger
/// batch.
pub const LOAD_LEVELS: usize = 8;

/// The load level of a batch of `sessions` (no session counts as one).
pub fn load_level(sessions: usize) -> usize {
    let k = (usize::BITS - 1 - sessions.max(1).leading_zeros()) as usize;
    k.min(LOAD_LEVELS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_levels_double() {
        let levels: Vec<usize> = [0, 1, 2, 3, 4, 7, 8, 127, 128, 200, 10_000]
            .iter()
            .map(|&b| load_level(b))
            .collect();
        assert_eq!(levels, [0, 0, 1, 1, 2, 2, 3, 6, 7, 7, 7]);
    }
}
