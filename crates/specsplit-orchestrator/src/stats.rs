//! Per-round records and the summary statistics of a generation.

use serde::Serialize;

use crate::drafter::Drafter;

/// Why a round verified no draft tree.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NoDraft {
    /// The generation is target-only (`Mode::Ar`).
    Mode,
    /// The first round: the draft drafted beside the target's prefill instead.
    FirstRound,
    /// Only one token was left to generate.
    LastToken,
    /// The draft request failed (transport error, error status, or no answer in time).
    DraftFailed,
    /// Waiting, after a failed draft request, before the draft is tried again.
    Backoff,
    /// Speculative rounds measured slower than target-only rounds.
    Slow,
    /// The sequence plus a tree would exceed what the draft or the target accepts.
    Limit,
    /// The online choice picked a target-only round.
    Chosen,
    /// The drafter proposed no tree (a model-free drafter found nothing to continue).
    NoMatch,
    /// The target advised no draft for its current load (`max_draft_depth` 0).
    Load,
}

/// What happened in one round.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct RoundRecord {
    /// Depth of the draft tree (the most tokens it could get accepted); 0 for a target-only step.
    pub drafted: usize,
    /// Nodes in the draft tree.
    pub tree_nodes: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens emitted this round (accepted + the target's next token, cut at a stop).
    pub emitted: Vec<u32>,
    /// Wall time of the draft call that produced this round's tree, in ms (0 when it was
    /// drafted during the previous round's verification).
    pub draft_ms: f64,
    /// Wall time the draft worker reported spending on that call, in ms (0 when pre-drafted).
    pub draft_server_ms: f64,
    /// Wall time of the verify call, in ms.
    pub verify_ms: f64,
    /// Time the target reported spending on the request, in ms.
    pub verify_server_ms: f64,
    /// Of that, the time the draft worker reported in its model (forward passes and the copy
    /// of their result), in ms (0 when pre-drafted).
    pub draft_model_ms: f64,
    /// Of the target's time, the time it reported in its model (the verify pass and the copy of
    /// its verdict), in ms.
    pub verify_model_ms: f64,
    /// Wall time of the whole round in the orchestrator (draft call, verify call, bookkeeping
    /// and streaming of the emitted tokens), in ms.
    pub round_ms: f64,
    /// Whether this round's tree came from the overlapped pre-draft (None when not attempted).
    pub overlap_hit: Option<bool>,
    /// Time the round waited, after its verify call returned, for the pre-draft of the next
    /// round that ran beside it, in ms (0 when none ran).
    pub predraft_wait_ms: f64,
    /// Wall time of that pre-draft's call as the orchestrator saw it, from its request to its
    /// answer, in ms (0 when none ran).
    pub predraft_ms: f64,
    /// When that pre-draft's call started after the round's verify call started, in ms
    /// (negative: before; 0 when none ran).
    pub predraft_lag_ms: f64,
    /// Wall time the draft worker reported for that pre-draft, in ms (0 when none ran).
    pub predraft_server_ms: f64,
    /// Of that, its model time, in ms (0 when none ran).
    pub predraft_model_ms: f64,
    /// Candidates per outcome pre-drafted beside this round's verify call (0: no pre-draft;
    /// the overlapped pipeline's single bet counts 1).
    pub predraft_candidates: usize,
    /// Whether that pre-draft held a tree for the verdict's outcome (`accepted` tokens and the
    /// target's next); `None` when none ran or it failed.
    pub predraft_hit: Option<bool>,
    /// Why the round verified no tree (None when it verified one).
    pub no_draft: Option<NoDraft>,
    /// The drafter chosen for the round (`none` for a target-only round by mode or choice,
    /// the online choice's rounds made target-only by the target's load advice included).
    pub drafter: Drafter,
    /// The deepest draft the target advised for this round from its load (the cap in force;
    /// `None`: no advice).
    pub advised_depth: Option<usize>,
}

impl RoundRecord {
    /// The round's time outside the workers' reported handling (transport, serialization,
    /// scheduling, the orchestrator's own work), in ms: its wall time less the two workers'
    /// server times and the wait for a pre-draft.
    pub fn overhead_ms(&self) -> f64 {
        (self.round_ms - self.draft_server_ms - self.verify_server_ms - self.predraft_wait_ms)
            .max(0.0)
    }
}

/// A change between speculative and target-only rounds made on measured speed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SpeedSwitch {
    /// Index of the first round the change applies to.
    pub round: usize,
    /// True when speculation resumes (a probe), false when it stops.
    pub speculate: bool,
    /// Measured tokens per second of the recent speculative rounds.
    pub spec_tokens_per_s: f64,
    /// Tokens per second of target-only rounds: measured on such rounds where there were
    /// some, else estimated as one token per verify call.
    pub target_only_tokens_per_s: f64,
}

/// Summary of a generation.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct GenerationStats {
    /// New tokens generated.
    pub tokens: usize,
    /// Wall time from the first request to the last token, in seconds.
    pub elapsed_s: f64,
    /// Tokens per second over the whole generation.
    pub tokens_per_s: f64,
    /// Time to the first generated token, in ms.
    pub ttft_ms: f64,
    /// Mean time per output token after the first, in ms.
    pub tpot_ms: f64,
    /// Accepted ÷ drafted, where drafted counts the depth of each round's tree.
    pub acceptance_rate: f64,
    /// 1 + accepted ÷ rounds over speculative rounds.
    pub mean_accepted_len: f64,
    /// Number of rounds.
    pub rounds: usize,
    /// Overlapped pre-drafts used ÷ attempted (0 when none was attempted).
    pub overlap_hit_rate: f64,
    /// Pre-drafts attempted.
    pub overlap_attempts: usize,
    /// Share of verify wall time spent outside the target's own handling (network, serialization).
    pub network_share: f64,
    /// Mean per-round time outside the workers' own handling of their requests (gRPC,
    /// serialization, scheduling, the orchestrator's bookkeeping), in ms: round wall time minus
    /// the draft and target workers' reported wall times. Exact for the sequential pipeline; in
    /// the overlapped one a pre-draft still running when the verdict arrives adds to it.
    pub round_overhead_ms: f64,
    /// Draft requests that failed (error, no answer in time, or refused), pre-drafts included.
    pub draft_failures: usize,
    /// Rounds that verified no draft tree (every round of a target-only generation).
    pub target_only_rounds: usize,
    /// Switches between speculative and target-only rounds made on measured speed.
    pub speed_switches: Vec<SpeedSwitch>,
    /// The rounds of each drafter that was chosen for some, in order of first use.
    pub per_drafter: Vec<DrafterStats>,
}

/// The rounds one drafter was chosen for, summarised.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct DrafterStats {
    /// The drafter.
    pub drafter: Drafter,
    /// Rounds it was chosen for.
    pub rounds: usize,
    /// Tokens those rounds emitted.
    pub tokens: usize,
    /// Draft tokens accepted in them.
    pub accepted: usize,
    /// Their wall time, in ms.
    pub round_ms: f64,
    /// Tokens per second over those rounds.
    pub tokens_per_s: f64,
}

impl DrafterStats {
    /// The summary per drafter of `rounds`, in order of first use.
    pub fn of_rounds(rounds: &[RoundRecord]) -> Vec<Self> {
        let mut out: Vec<Self> = Vec::new();
        for r in rounds {
            let i = match out.iter().position(|s| s.drafter == r.drafter) {
                Some(i) => i,
                None => {
                    out.push(Self {
                        drafter: r.drafter,
                        ..Self::default()
                    });
                    out.len() - 1
                }
            };
            let s = &mut out[i];
            s.rounds += 1;
            s.tokens += r.emitted.len();
            s.accepted += r.accepted;
            s.round_ms += r.round_ms;
        }
        for s in &mut out {
            s.tokens_per_s = if s.round_ms > 0.0 {
                s.tokens as f64 * 1e3 / s.round_ms
            } else {
                0.0
            };
        }
        out
    }
}

impl GenerationStats {
    /// Summarises `rounds`, given the total and first-token times.
    pub fn from_rounds(rounds: &[RoundRecord], elapsed_s: f64, ttft_ms: f64) -> Self {
        let tokens: usize = rounds.iter().map(|r| r.emitted.len()).sum();
        let drafted: usize = rounds.iter().map(|r| r.drafted).sum();
        let accepted: usize = rounds.iter().map(|r| r.accepted).sum();
        let spec_rounds = rounds.iter().filter(|r| r.drafted > 0).count();
        let attempts = rounds.iter().filter(|r| r.overlap_hit.is_some()).count();
        let hits = rounds
            .iter()
            .filter(|r| r.overlap_hit == Some(true))
            .count();
        let verify: f64 = rounds.iter().map(|r| r.verify_ms).sum();
        let server: f64 = rounds.iter().map(|r| r.verify_server_ms).sum();
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let overhead: f64 = rounds.iter().map(RoundRecord::overhead_ms).sum();
        Self {
            tokens,
            elapsed_s,
            tokens_per_s: ratio(tokens as f64, elapsed_s),
            ttft_ms,
            tpot_ms: if tokens > 1 {
                (elapsed_s * 1e3 - ttft_ms) / (tokens - 1) as f64
            } else {
                0.0
            },
            acceptance_rate: ratio(accepted as f64, drafted as f64),
            mean_accepted_len: if spec_rounds > 0 {
                1.0 + accepted as f64 / spec_rounds as f64
            } else {
                1.0
            },
            rounds: rounds.len(),
            overlap_hit_rate: ratio(hits as f64, attempts as f64),
            overlap_attempts: attempts,
            network_share: ratio((verify - server).max(0.0), verify),
            round_overhead_ms: ratio(overhead, rounds.len() as f64),
            draft_failures: 0,
            target_only_rounds: rounds.iter().filter(|r| r.tree_nodes == 0).count(),
            speed_switches: Vec::new(),
            per_drafter: DrafterStats::of_rounds(rounds),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(drafted: usize, accepted: usize, hit: Option<bool>) -> RoundRecord {
        RoundRecord {
            drafted,
            tree_nodes: drafted,
            accepted,
            emitted: vec![7; accepted + 1],
            draft_ms: 1.0,
            draft_server_ms: 0.5,
            verify_ms: 10.0,
            verify_server_ms: 8.0,
            draft_model_ms: 0.4,
            verify_model_ms: 7.5,
            round_ms: 12.0,
            overlap_hit: hit,
            predraft_wait_ms: 0.0,
            predraft_ms: 0.0,
            predraft_lag_ms: 0.0,
            predraft_server_ms: 0.0,
            predraft_model_ms: 0.0,
            no_draft: None,
            ..RoundRecord::default()
        }
    }

    #[test]
    fn summary_follows_the_documented_definitions() {
        let rounds = vec![
            round(4, 4, None),
            round(4, 1, Some(true)),
            round(4, 0, Some(false)),
        ];
        let s = GenerationStats::from_rounds(&rounds, 2.0, 100.0);
        assert_eq!(s.tokens, 5 + 2 + 1);
        assert_eq!(s.rounds, 3);
        assert!((s.acceptance_rate - 5.0 / 12.0).abs() < 1e-12);
        assert!((s.mean_accepted_len - (1.0 + 5.0 / 3.0)).abs() < 1e-12);
        assert!((s.overlap_hit_rate - 0.5).abs() < 1e-12);
        assert!((s.round_overhead_ms - (12.0 - 0.5 - 8.0)).abs() < 1e-12);
        assert!((s.tokens_per_s - 4.0).abs() < 1e-12);
        assert!((s.tpot_ms - 1900.0 / 7.0).abs() < 1e-9);
        assert!((s.network_share - 0.2).abs() < 1e-12);
        assert_eq!(s.target_only_rounds, 0);
        let plain = RoundRecord {
            no_draft: Some(NoDraft::DraftFailed),
            ..round(0, 0, None)
        };
        let s = GenerationStats::from_rounds(&[plain, round(4, 1, None)], 1.0, 1.0);
        assert_eq!(s.target_only_rounds, 1);
        assert!(
            (s.mean_accepted_len - 2.0).abs() < 1e-12,
            "speculative rounds only"
        );
    }

    #[test]
    fn rounds_are_summarised_per_drafter() {
        let with = |d: Drafter, r: RoundRecord| RoundRecord { drafter: d, ..r };
        let rounds = vec![
            with(Drafter::Ngram, round(4, 3, None)),
            with(Drafter::None, round(0, 0, None)),
            with(Drafter::Ngram, round(4, 1, None)),
        ];
        let per = DrafterStats::of_rounds(&rounds);
        assert_eq!(
            per.iter().map(|s| s.drafter).collect::<Vec<_>>(),
            vec![Drafter::Ngram, Drafter::None]
        );
        assert_eq!((per[0].rounds, per[0].tokens, per[0].accepted), (2, 6, 4));
        assert!((per[0].tokens_per_s - 6.0 / 24.0 * 1e3).abs() < 1e-9);
        assert_eq!((per[1].rounds, per[1].tokens), (1, 1));
    }

    #[test]
    fn overhead_leaves_out_the_wait_for_a_pre_draft() {
        let waited = RoundRecord {
            predraft_wait_ms: 2.0,
            ..round(4, 4, None)
        };
        assert!((waited.overhead_ms() - (12.0 - 0.5 - 8.0 - 2.0)).abs() < 1e-12);
        let s = GenerationStats::from_rounds(&[waited.clone(), round(4, 4, None)], 1.0, 1.0);
        assert!((s.round_overhead_ms - (1.5 + 3.5) / 2.0).abs() < 1e-12);
        // Never negative, even when the reported server times exceed the round's wall time.
        let odd = RoundRecord {
            predraft_wait_ms: 20.0,
            ..waited
        };
        assert_eq!(odd.overhead_ms(), 0.0);
    }
}
