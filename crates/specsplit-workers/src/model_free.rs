//! The model-free draft engine: a draft worker that loads no model and answers draft requests
//! with the n-gram or suffix drafter over each session's tokens (see
//! [`specsplit_core::drafter`]). Its trees carry no draft distributions, so the target verifies
//! them as point-mass proposals, exact under sampling too.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use specsplit_core::drafter::ngram::{NgramConfig, NgramDrafter};
use specsplit_core::drafter::suffix::{
    SharedSuffixStore, SuffixConfig, SuffixDrafter, SuffixStore,
};
use specsplit_core::drafter::{DraftShape, ModelFreeDrafter};
use specsplit_core::tree::TokenTree;

use crate::engine_session::SessionEngine;
use crate::EngineError;

/// What proposes a draft worker's trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DrafterKind {
    /// The draft model.
    #[default]
    Model,
    /// N-gram prompt lookup over the session's tokens (no model loaded).
    Ngram,
    /// Suffix decoding over the session's tokens and, with `suffix_history`, the worker's
    /// earlier generations (no model loaded).
    Suffix,
}

/// Bytes a model-free session is accounted for in the worker's memory budget: the suffix
/// drafter's trie at its caps (about 50 bytes a node, `max_tokens · max_depth` nodes); the
/// n-gram drafter keeps only the session's tokens.
fn session_bytes(kind: DrafterKind) -> usize {
    match kind {
        DrafterKind::Suffix => {
            let c = SuffixConfig::default();
            c.max_tokens * c.max_depth * 50
        }
        DrafterKind::Ngram | DrafterKind::Model => 64 << 10,
    }
}

/// One session: its drafter and the sequence its last request carried.
pub struct ModelFreeSession {
    drafter: ModelFreeDrafter,
    tokens: Vec<u32>,
}

impl ModelFreeSession {
    /// The sequence the session's last request carried.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Drop for ModelFreeSession {
    fn drop(&mut self) {
        // The whole sequence counts as the generation: the worker does not know the prompt.
        self.drafter.finish(&self.tokens, 0);
    }
}

/// What one draft took.
#[derive(Debug, Clone, Copy)]
pub struct ModelFreeStats {
    /// Time spent drafting.
    pub draft_time: Duration,
    /// Tokens indexed or searched.
    pub tokens: usize,
}

/// The model-free draft engine.
pub struct ModelFreeEngine {
    kind: DrafterKind,
    store: Option<SharedSuffixStore>,
}

impl ModelFreeEngine {
    /// An engine drafting with `kind` (not [`DrafterKind::Model`]), sharing a store of its
    /// sessions' sequences between them when `history` is set (suffix drafter only).
    pub fn new(kind: DrafterKind, history: bool) -> Result<Self, EngineError> {
        if kind == DrafterKind::Model {
            return Err(EngineError::InvalidArgument(
                "the model drafter needs a model: use the draft engine".into(),
            ));
        }
        let store = (history && kind == DrafterKind::Suffix)
            .then(|| SuffixStore::shared(SuffixConfig::default()));
        Ok(Self { kind, store })
    }

    /// Its drafter.
    pub fn kind(&self) -> DrafterKind {
        self.kind
    }

    /// A tree of `widths`' room after `tokens` (the whole sequence so far).
    pub fn draft(
        &self,
        s: &mut ModelFreeSession,
        tokens: &[u32],
        widths: &[usize],
    ) -> Result<(TokenTree, ModelFreeStats), EngineError> {
        let t0 = Instant::now();
        s.tokens.clear();
        s.tokens.extend_from_slice(tokens);
        let tree = s.drafter.draft(tokens, DraftShape::of_widths(widths));
        Ok((
            tree,
            ModelFreeStats {
                draft_time: t0.elapsed(),
                tokens: tokens.len(),
            },
        ))
    }
}

impl SessionEngine for ModelFreeEngine {
    type Session = ModelFreeSession;
    const WORKER_TYPE: &'static str = "draft";

    fn session_bytes(&self) -> usize {
        session_bytes(self.kind)
    }

    /// A model-free session's state has a fixed size: its charge never rises.
    fn new_charged_session(
        &self,
        _seed: u64,
        _charge: crate::session::KvCharge,
    ) -> Result<ModelFreeSession, EngineError> {
        let drafter = match self.kind {
            DrafterKind::Suffix => ModelFreeDrafter::Suffix(SuffixDrafter::new(
                SuffixConfig::default(),
                self.store.clone(),
            )),
            DrafterKind::Ngram | DrafterKind::Model => {
                ModelFreeDrafter::Ngram(NgramDrafter::new(NgramConfig::default()))
            }
        };
        Ok(ModelFreeSession {
            drafter,
            tokens: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_draft_from_their_tokens_and_share_history_when_asked() {
        assert!(ModelFreeEngine::new(DrafterKind::Model, false).is_err());
        let e = ModelFreeEngine::new(DrafterKind::Ngram, false).unwrap();
        let mut s = e.new_session(0).unwrap();
        let (t, _) = e.draft(&mut s, &[1, 2, 3, 9, 1, 2], &[1, 1]).unwrap();
        assert_eq!(t.tokens(), &[3, 9]);
        assert_eq!(s.tokens(), &[1, 2, 3, 9, 1, 2]);

        let e = ModelFreeEngine::new(DrafterKind::Suffix, true).unwrap();
        let mut first = e.new_session(0).unwrap();
        e.draft(&mut first, &[5, 6, 7, 8], &[1]).unwrap();
        drop(first);
        let mut second = e.new_session(0).unwrap();
        let (t, _) = e.draft(&mut second, &[0, 5, 6], &[1, 1]).unwrap();
        assert_eq!(t.tokens(), &[7, 8]);
    }
}
