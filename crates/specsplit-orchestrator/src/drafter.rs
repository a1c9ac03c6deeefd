//! Which drafter proposes a generation's trees: the draft model, a model-free drafter run in
//! the orchestrator (n-gram prompt lookup or suffix decoding), or the online choice among them.

use serde::{Deserialize, Serialize};

/// The drafter a generation asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DrafterChoice {
    /// The draft worker's model (needs a draft worker).
    #[default]
    Model,
    /// N-gram prompt lookup, in the orchestrator: no draft worker needed.
    Ngram,
    /// Suffix decoding over the session's tokens (and, with `suffix_history`, earlier
    /// generations), in the orchestrator: no draft worker needed.
    Suffix,
    /// Chosen per round by a bandit over the measured tokens per second of each available
    /// drafter (the model only with a draft worker) and of target-only rounds.
    Auto,
}

impl DrafterChoice {
    /// Whether it needs a draft worker.
    pub fn needs_draft_worker(self) -> bool {
        self == Self::Model
    }
}

/// The drafter that proposed one round's tree (`None`: a target-only round by choice or mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Drafter {
    /// No drafter: the target alone.
    #[default]
    None,
    /// The draft worker's model.
    Model,
    /// N-gram prompt lookup.
    Ngram,
    /// Suffix decoding.
    Suffix,
}

impl Drafter {
    /// Its name as flags and reports write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Model => "model",
            Self::Ngram => "ngram",
            Self::Suffix => "suffix",
        }
    }

    /// Whether it runs in the orchestrator without a model.
    pub fn is_model_free(self) -> bool {
        matches!(self, Self::Ngram | Self::Suffix)
    }
}
