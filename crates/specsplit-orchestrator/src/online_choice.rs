//! `--drafter auto`: a generation's choice of a drafter per round, from what each drafter's
//! rounds measure ([`DrafterBandit`]). The draft model and target-only rounds are measured
//! when played; the model-free drafters propose a tree every round whatever is played, and each
//! proposal, scored against the tokens the target emitted ([`ShadowDrafts`]) and priced by the
//! measured verify time of its rows ([`VerifyCost`]), counts as a round of its drafter. So a
//! model-free drafter is known from the first rounds without playing it, and is played only
//! while it measures faster than the target alone.

use specsplit_core::tree::TokenTree;

use crate::bandit::{DrafterBandit, DrafterMemory};
use crate::drafter::Drafter;
use crate::shadow::ShadowDrafts;
use crate::verify_cost::VerifyCost;

/// What an orchestrator's generations measured, for the next ones to start from.
#[derive(Debug, Clone, Default)]
pub struct ChoiceMemory {
    drafters: DrafterMemory,
    cost: VerifyCost,
}

/// One generation's online choice of a drafter.
#[derive(Debug, Clone)]
pub struct OnlineChoice {
    bandit: DrafterBandit,
    shadow: ShadowDrafts,
    cost: VerifyCost,
    /// This round's model-free proposals, kept for the drafter the round plays.
    proposed: Vec<(Drafter, TokenTree, f64)>,
}

impl OnlineChoice {
    /// A choice over the model-free drafters, the draft model where `with_model`, and
    /// target-only rounds, starting from `memory`.
    pub fn new(with_model: bool, memory: &ChoiceMemory) -> Self {
        let mut arms = vec![Drafter::Ngram, Drafter::Suffix];
        if with_model {
            arms.push(Drafter::Model);
        }
        Self {
            bandit: DrafterBandit::with_memory(&arms, &memory.drafters),
            shadow: ShadowDrafts::default(),
            cost: memory.cost.clone(),
            proposed: Vec::new(),
        }
    }

    /// The drafter of the next round.
    pub fn choose(&self) -> Drafter {
        self.bandit.choose()
    }

    /// Has every model-free drafter propose a tree after a sequence of `at` tokens (`draft`
    /// gives a drafter's tree and what drafting it took, ms), to be scored once the sequence
    /// shows what the target emits after it.
    pub fn propose(&mut self, at: usize, mut draft: impl FnMut(Drafter) -> (TokenTree, f64)) {
        self.proposed.clear();
        for d in [Drafter::Ngram, Drafter::Suffix] {
            let (tree, ms) = draft(d);
            self.shadow.propose(d, at, tree.clone(), ms);
            self.proposed.push((d, tree, ms));
        }
    }

    /// The tree `drafter` proposed this round and what drafting it took, if it proposed one.
    pub fn proposal(&self, drafter: Drafter) -> Option<(TokenTree, f64)> {
        self.proposed
            .iter()
            .find(|p| p.0 == drafter)
            .map(|p| (p.1.clone(), p.2))
    }

    /// Records a round played with `drafter` that sent the target `rows` rows and emitted
    /// `emitted` tokens, its verify taking `verify_ms` of its `round_ms`; `prefill` when it
    /// sent the whole sequence (a measure of the verify's cost, not of a drafter's pace). Then
    /// scores the proposals the grown `sequence` settles.
    pub fn record(&mut self, round: PlayedRound, sequence: &[u32]) {
        self.cost
            .observe(round.rows, round.verify_ms, round.draft_ms, round.round_ms);
        // A model-free drafter's rounds are counted by scoring its proposals, played or not.
        if !round.prefill && !round.drafter.is_model_free() {
            self.bandit
                .observe(round.drafter, round.emitted, round.round_ms);
        }
        for s in self.shadow.score(sequence) {
            if let Some(ms) = self.cost.round_ms(s.rows) {
                self.bandit.observe(s.drafter, s.emitted, ms + s.draft_ms);
            }
        }
    }

    /// Rounds per arm: played ones for the model and target-only, scored ones for the
    /// model-free drafters.
    pub fn plays(&self) -> Vec<(Drafter, u32)> {
        self.bandit.plays()
    }

    /// Leaves what this generation measured in `memory`.
    pub fn finish(&self, memory: &mut ChoiceMemory) {
        memory.drafters.absorb(&self.bandit);
        memory.cost = self.cost.clone();
    }
}

/// A played round, as [`OnlineChoice::record`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct PlayedRound {
    /// The drafter that proposed the round's tree.
    pub drafter: Drafter,
    /// Rows the verify sent (the uncached tokens and the tree's nodes).
    pub rows: usize,
    /// Tokens the round emitted.
    pub emitted: usize,
    /// The verify's wall time (ms).
    pub verify_ms: f64,
    /// What drafting the round's tree took on the round's path (ms).
    pub draft_ms: f64,
    /// The round's wall time (ms).
    pub round_ms: f64,
    /// Whether the round sent the whole sequence.
    pub prefill: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use specsplit_core::drafter::ngram::NgramDrafter;
    use specsplit_core::drafter::suffix::{SuffixConfig, SuffixDrafter};
    use specsplit_core::drafter::DraftShape;

    /// A generation of `text` (after `prompt`) under the online choice, on a target whose
    /// verify costs `base + per_row · rows` ms (and 1 ms beside it). Returns the drafter each
    /// round played and the generation's time (ms).
    fn generate(
        prompt: &[u32],
        text: &[u32],
        base: f64,
        per_row: f64,
        memory: &mut ChoiceMemory,
    ) -> (Vec<Drafter>, f64) {
        let depth = 4;
        let mut total = 0.0;
        let mut c = OnlineChoice::new(false, memory);
        let ngram = NgramDrafter::default();
        let mut suffix = SuffixDrafter::new(SuffixConfig::default(), None);
        let mut seq = prompt.to_vec();
        let mut played = Vec::new();
        let mut first = true;
        while seq.len() < prompt.len() + text.len() {
            let d = c.choose();
            let shape = DraftShape::of_widths(&[1; 4][..depth]);
            c.propose(seq.len(), |d| match d {
                Drafter::Ngram => (ngram.draft(&seq, shape), 0.0),
                _ => (suffix.draft(&seq, shape), 0.0),
            });
            let tree = c.proposal(d).map(|p| p.0).unwrap_or_default();
            // Greedy verification against the known continuation.
            let next = &text[seq.len() - prompt.len()..];
            let mut accepted = 0;
            let mut level = tree.roots();
            while let (Some(i), Some(&t)) = (
                level
                    .clone()
                    .find(|&i| next.get(accepted) == Some(&tree.token(i))),
                next.get(accepted),
            ) {
                debug_assert_eq!(tree.token(i), t);
                accepted += 1;
                level = tree.children(i);
            }
            let emitted = (accepted + 1).min(next.len());
            let rows = if first { seq.len() } else { 1 } + tree.len();
            let verify_ms = base + per_row * rows as f64;
            total += verify_ms + 1.0;
            seq.extend_from_slice(&next[..emitted]);
            c.record(
                PlayedRound {
                    drafter: d,
                    rows,
                    emitted,
                    verify_ms,
                    draft_ms: 0.0,
                    round_ms: verify_ms + 1.0,
                    prefill: first,
                },
                &seq,
            );
            played.push(d);
            first = false;
        }
        c.finish(memory);
        (played, total)
    }

    /// The time of the target alone on the same generation.
    fn target_only_ms(prompt: &[u32], text: &[u32], base: f64, per_row: f64) -> f64 {
        let prefill = base + per_row * prompt.len() as f64 + 1.0;
        prefill + (text.len() - 1) as f64 * (base + per_row + 1.0)
    }

    fn count(played: &[Drafter], d: Drafter) -> usize {
        played.iter().filter(|&&p| p == d).count()
    }

    /// A prompt that the continuation copies: an n-gram drafter's best case.
    fn repetitive() -> (Vec<u32>, Vec<u32>) {
        let prompt: Vec<u32> = (0..200).map(|i| 10 + (i * 7 % 97)).collect();
        let text = prompt[20..180].to_vec();
        (prompt, text)
    }

    /// A continuation of three-token pieces of the prompt from scattered places: an n-gram
    /// drafter proposes four tokens and about one holds.
    fn jumpy() -> (Vec<u32>, Vec<u32>) {
        let prompt: Vec<u32> = (0..200).map(|i| 10 + (i * 7 % 97)).collect();
        let mut text = Vec::new();
        let mut x: usize = 12345;
        while text.len() < 160 {
            x = (x * 1103515245 + 12345) % (1 << 31);
            let at = x % 190;
            text.extend_from_slice(&prompt[at..at + 3]);
        }
        (prompt, text)
    }

    /// A continuation that never repeats: no drafter proposes anything that holds.
    fn novel() -> (Vec<u32>, Vec<u32>) {
        let prompt: Vec<u32> = (0..50).map(|i| 1000 + i).collect();
        let text: Vec<u32> = (0..160).map(|i| 5000 + i).collect();
        (prompt, text)
    }

    #[test]
    fn a_drafter_whose_drafts_hold_is_played_where_rows_are_cheap() {
        let (prompt, text) = repetitive();
        let (played, ms) = generate(&prompt, &text, 10.0, 0.1, &mut ChoiceMemory::default());
        let spec = count(&played, Drafter::Ngram) + count(&played, Drafter::Suffix);
        assert!(spec * 10 >= played.len() * 8, "{played:?}");
        assert!(ms < 0.5 * target_only_ms(&prompt, &text, 10.0, 0.1), "{ms}");
    }

    #[test]
    fn never_much_slower_than_the_target_alone() {
        // Nothing repeats: target-only rounds, after a few that measure the target.
        let (prompt, text) = novel();
        let (played, ms) = generate(&prompt, &text, 10.0, 0.1, &mut ChoiceMemory::default());
        assert!(
            count(&played, Drafter::None) * 10 >= played.len() * 8,
            "{played:?}"
        );
        assert!(
            ms <= 1.05 * target_only_ms(&prompt, &text, 10.0, 0.1),
            "{ms}"
        );
        // Rows cost as much as the pass (a compute-bound CPU) and drafts mostly fail: a
        // drafter played every round would take about twice the target's time.
        let (prompt, text) = jumpy();
        let (played, ms) = generate(&prompt, &text, 1.0, 10.0, &mut ChoiceMemory::default());
        assert!(
            ms <= 1.05 * target_only_ms(&prompt, &text, 1.0, 10.0),
            "{ms} {played:?}"
        );
    }

    #[test]
    fn a_generation_starts_from_what_earlier_ones_measured() {
        let (prompt, text) = novel();
        let mut memory = ChoiceMemory::default();
        generate(&prompt, &text, 10.0, 0.1, &mut memory);
        // The verify's cost is known: a new generation's first rounds do not play the drafters
        // to measure it.
        let (played, _) = generate(&prompt, &text, 10.0, 0.1, &mut memory);
        assert!(
            played[1..4].iter().all(|&d| d == Drafter::None),
            "{played:?}"
        );
    }
}
