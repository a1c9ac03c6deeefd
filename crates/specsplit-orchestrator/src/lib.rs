//! specsplit-orchestrator: runs speculative decoding against a draft and a target worker.
//!
//! Each round drafts a token tree, has the target verify it in one pass, and emits the accepted
//! tokens plus the target's own next token. In the overlapped pipeline the next round's tree is
//! drafted while the current one is verified, on the guess that the tree's first-child path is
//! accepted. Sessions are ended on both workers on every exit path.
//!
//! A generation survives its draft: a draft that fails, answers too late, outgrows its limits or
//! measures slower than the target alone is replaced by target-only rounds (the target verifies
//! an empty tree), which emit exactly what speculation would; a failing draft is tried again
//! after a backoff in rounds. Every request has a deadline, the generation's own deadline holds
//! against a frozen worker, and a generation runs to the target's context and stops there.

mod adaptive;
mod bandit;
mod client;
mod drafter;
mod online_choice;
mod predraft_plan;
mod shadow;
mod stats;
mod verify_cost;

pub use adaptive::{DepthController, DraftBackoff, SpeedGovernor};
pub use bandit::DrafterBandit;
pub use client::{
    default_client_threads, AuthToken, ClientSpin, ClientTls, ConnectOptions, Orchestrator,
    OrchestratorError, MAX_CLIENT_THREADS,
};
pub use drafter::{Drafter, DrafterChoice};
pub use online_choice::{ChoiceMemory, OnlineChoice, PlayedRound};
pub use predraft_plan::{PreDraftPlanner, Shape, MAX_CANDIDATES};
pub use shadow::{ShadowDrafts, ShadowRound};
pub use stats::{DrafterStats, GenerationStats, NoDraft, RoundRecord, SpeedSwitch};
pub use verify_cost::VerifyCost;

use serde::{Deserialize, Serialize};

/// Whether a draft model is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Speculative decoding with the draft worker.
    #[default]
    Spec,
    /// The target alone, one token per round (the reference speculation must match).
    Ar,
}

/// How drafting and verification are scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Pipeline {
    /// Draft, then verify, then draft again.
    Sequential,
    /// Draft round N+1 while round N is verified, for one outcome: the whole first-child
    /// path accepted and the draft's own next token as the bonus; redraft on a miss.
    #[default]
    Overlapped,
    /// Draft round N+1 while round N is verified, for every likely outcome (each accepted
    /// length and the draft's likeliest tokens for the target's next), in shared passes of the
    /// draft worker; the depth and the candidates per outcome come from a cost model of
    /// measured times and hit rates, which falls back to the overlapped pipeline's one bet, or
    /// to drafting after the verdict, where pre-drafting every outcome does not pay.
    Predraft,
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-sequence token was generated.
    Eos,
    /// `max_tokens` new tokens were generated.
    MaxTokens,
    /// The deadline passed.
    Deadline,
    /// The target's context is full: the sequence holds every token its sessions can hold
    /// (the last token is the target's prediction after a full cache).
    Context,
    /// The caller stopped it (see [`Orchestrator::generate_until`]), e.g. on a stop string.
    Stopped,
}

/// Settings of one generation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GenerateConfig {
    /// Speculative or target-only.
    pub mode: Mode,
    /// Which drafter proposes the trees of a speculative generation.
    pub drafter: DrafterChoice,
    /// The suffix drafter also matches this orchestrator's earlier generations (kept in a
    /// store capped at 65,536 tokens, oldest evicted first), not only the session's tokens.
    pub suffix_history: bool,
    /// How drafting and verification are scheduled.
    pub pipeline: Pipeline,
    /// Candidate tokens per outcome the pre-draft pipeline pre-drafts: 0 lets its cost model
    /// choose (up to [`MAX_CANDIDATES`], or none where pre-drafting does not pay), 1 to
    /// [`MAX_CANDIDATES`] fixes the number.
    pub candidates: usize,
    /// Most new tokens to generate.
    pub max_tokens: usize,
    /// Children per node at each depth of the draft tree, e.g. `[4, 2, 1, 1]`; all ones is a chain.
    pub widths: Vec<usize>,
    /// Adapt the tree depth to measured acceptance and timings.
    pub adaptive_depth: bool,
    /// Smallest depth the adaptive controller may choose.
    pub min_depth: usize,
    /// Largest depth the adaptive controller may choose.
    pub max_depth: usize,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Top-k truncation (0 = off).
    pub top_k: usize,
    /// Top-p truncation (1 = off).
    pub top_p: f32,
    /// Seed of the random choices (0 = random).
    pub seed: u64,
    /// Stop after this many milliseconds (0 = no deadline).
    pub deadline_ms: u64,
    /// Stop at these tokens (besides the workers' own EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Ask the target for the log-probability of each generated token
    /// ([`Generation::token_logprobs`]).
    pub logprobs: bool,
    /// Most milliseconds one request to the target may take (never past the deadline); a
    /// target that does not answer in time is retried until the reconnect window (30 s) ends,
    /// then the generation fails.
    pub rpc_timeout_ms: u64,
    /// Most milliseconds a round waits for the draft (never past the deadline); a draft that
    /// does not answer in time counts as failed and the round runs target-only.
    pub draft_timeout_ms: u64,
    /// Target-only rounds after a failed draft request before the draft is tried again; the
    /// wait doubles with each further failure in a row.
    pub draft_retry_rounds: usize,
    /// Longest wait, in rounds, between tries of a failing draft.
    pub draft_retry_max_rounds: usize,
    /// When speculative rounds measure fewer tokens per second than target-only rounds, run
    /// this many target-only rounds before probing speculation again (0 = never switch).
    pub spec_probe_rounds: usize,
    /// Whether a speculative generation's first round drafts beside the target's prefill
    /// (`None`: with the overlapped pipeline only); see [`GenerateConfig::overlaps_first_round`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_round_overlap: Option<bool>,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Spec,
            drafter: DrafterChoice::Model,
            suffix_history: false,
            pipeline: Pipeline::Overlapped,
            candidates: 0,
            max_tokens: 128,
            widths: vec![1, 1, 1, 1],
            adaptive_depth: false,
            min_depth: 1,
            max_depth: 12,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            deadline_ms: 0,
            stop_token_ids: Vec::new(),
            logprobs: false,
            rpc_timeout_ms: 30_000,
            draft_timeout_ms: 5_000,
            draft_retry_rounds: 2,
            draft_retry_max_rounds: 64,
            spec_probe_rounds: 32,
            first_round_overlap: None,
        }
    }
}

impl GenerateConfig {
    /// The sampling parameters in wire form.
    pub fn sampling(&self) -> specsplit_proto::SamplingParams {
        specsplit_proto::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k as i32,
            top_p: self.top_p,
            seed: self.seed,
        }
    }

    /// Whether a speculative generation's first round drafts beside the target's prefill: the
    /// target decodes the first token as a plain step while the draft drafts after the prompt,
    /// and the next round verifies the part of that tree below the target's token. Otherwise
    /// the first round drafts first and verifies the tree with the prefill, as later rounds do.
    /// By default only the overlapped and pre-draft pipelines do, those for workers on their
    /// own devices:
    /// two workers sharing one GPU slow each other's first passes about twofold (H100,
    /// 2026-11-25, `specsplit-bench e2e`).
    pub fn overlaps_first_round(&self) -> bool {
        self.first_round_overlap
            .unwrap_or(self.pipeline != Pipeline::Sequential)
    }

    /// Checks the settings, with a message naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if self.mode == Mode::Spec && (self.widths.is_empty() || self.widths.contains(&0)) {
            return Err(format!(
                "tree widths must be positive numbers, got {:?}",
                self.widths
            ));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top_p must lie in [0, 1], got {}", self.top_p));
        }
        if self.min_depth == 0 || self.min_depth > self.max_depth {
            return Err(format!(
                "adaptive depth bounds must satisfy 1 <= min_depth <= max_depth, got {}..{}",
                self.min_depth, self.max_depth
            ));
        }
        if self.candidates > MAX_CANDIDATES {
            return Err(format!(
                "candidates must lie in 0..={MAX_CANDIDATES} (0: chosen by the cost model), got {}",
                self.candidates
            ));
        }
        if self.rpc_timeout_ms == 0 || self.draft_timeout_ms == 0 {
            return Err(format!(
                "rpc_timeout_ms and draft_timeout_ms must be at least 1, got {} and {}",
                self.rpc_timeout_ms, self.draft_timeout_ms
            ));
        }
        if self.draft_retry_rounds == 0 || self.draft_retry_max_rounds < self.draft_retry_rounds {
            return Err(format!(
                "draft retry rounds must satisfy 1 <= draft_retry_rounds <= \
                 draft_retry_max_rounds, got {} and {}",
                self.draft_retry_rounds, self.draft_retry_max_rounds
            ));
        }
        Ok(())
    }
}

/// The result of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated token ids (not including the prompt).
    pub token_ids: Vec<u32>,
    /// With [`GenerateConfig::logprobs`]: the target model's natural-log probability of each
    /// token of `token_ids` (log-softmax of its logits, before temperature and truncation);
    /// empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub token_logprobs: Vec<f32>,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Summary statistics.
    pub stats: GenerationStats,
    /// One record per round.
    pub rounds: Vec<RoundRecord>,
}
