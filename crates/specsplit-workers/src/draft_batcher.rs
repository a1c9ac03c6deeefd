//! Batching of the draft worker's level passes across sessions.
//!
//! A draft request first prepares its round on its own ([`DraftEngine::prepare`]: its checks,
//! the causal prefill of its prompt or accepted tokens, and its tree's first level picked),
//! where its worker's [`WorkPlacement`] says, so that a bad request fails before it meets any
//! other and a long prompt holds no other session's draft back. A tree that needs no level
//! pass (depth 1, or every first pick an end of sequence) is answered at once, and so is a
//! greedy chain on the fixed-shape path ([`DraftEngine::with_static_chains`], on by default on
//! CUDA): it is drafted whole, alone, in its preparation, exactly as without batching.
//!
//! The other rounds wait in a queue with their next level's nodes. Each pass takes queued
//! rounds (up to [`BatchLimits`]: sessions, and the rows of their pending levels together),
//! runs their pending levels in one model call ([`DraftEngine::level_pass_sessions`]), and
//! picks each round's next level from its own logits with its own session's random stream. A
//! round whose tree is complete (its depth reached, or an end of sequence on every branch)
//! is answered at once; the others go back to the front of the queue, where the next pass
//! takes them together with rounds that arrived meanwhile: sessions join and leave the lock
//! step at any level. A pass of one round runs the one-session path
//! ([`DraftEngine::level_pass`]). Each session's tree is the one it drafts alone:
//! [`specsplit_models::transformer::Transformer::forward_sessions`] gives each session's
//! logits bit for bit as its pass alone does.
//!
//! As in [`crate::batcher`], there is no batching thread: the request that finds the device
//! free runs the next pass (where the placement says) and answers every round it completes;
//! each queued round holds its session's lock. A round whose caller went away leaves the queue
//! at the next pass (or when its caller's request is dropped), its session's cache cut back to
//! the round's tokens. If a shared pass fails, each of its rounds runs that level alone, so
//! only a bad one fails. Before a pass placed `Inline` that would start only new rounds, the
//! batcher gathers as [`crate::batcher::VerifyBatcher`] does (for
//! [`crate::batcher::GATHER_WINDOW`], or until sessions out of step are due); a round in the
//! middle of its tree never waits.
//!
//! The queue, the turn, the counters, the gathering and the taking of a batch are the crate's
//! pass queue (`pass_queue`, shared with [`crate::batcher`]); this module holds what a level
//! pass does with its rounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use specsplit_core::tree::TokenTree;
use specsplit_models::transformer::CHAIN_FEED_MAX;
use tokio::sync::{oneshot, OwnedMutexGuard};
use tonic::Status;

use crate::batcher::BatchLimits;
use crate::draft::{DraftEngine, DraftParams, DraftRound, DraftSession, DraftStats, Prepared};
use crate::draft_chain::ChainRound;
use crate::pass_queue::{batcher_methods, PassCounters, PassJob, PassQueue};
use crate::service::WorkPlacement;
use crate::session::SessionHandle;
use crate::EngineError;

/// A drafted tree and the passes it grew in.
#[derive(Debug, Clone)]
pub struct BatchedDraft {
    /// The tree.
    pub tree: TokenTree,
    /// What drafting it cost (a shared pass's time counts in full for each of its sessions).
    pub stats: DraftStats,
    /// Sessions in the largest level pass the tree grew in (1: alone, or no level pass).
    pub pass_sessions: usize,
}

/// The answer channel of one queued round.
type Answer = oneshot::Sender<Result<BatchedDraft, EngineError>>;

/// What a queued round waits for.
enum Work {
    /// Its tree's next level pass.
    Levels(DraftRound),
    /// Its greedy chain, grown whole (alone, or with other sessions' chains).
    Chain(ChainRound),
}

/// One round waiting for its next pass: its session (locked), the round, where its answer
/// goes, and the passes it ran in so far.
struct Job {
    session: OwnedMutexGuard<DraftSession>,
    work: Work,
    answer: Answer,
    /// Level passes run so far.
    passes: usize,
    /// Sessions in the largest of them.
    pass_sessions: usize,
}

impl Job {
    /// Answers the caller with the complete tree.
    fn complete(mut self, engine: &DraftEngine) {
        let Work::Levels(round) = self.work else {
            return;
        };
        let (tree, stats) = engine.finish(&mut self.session, round);
        let _ = self.answer.send(Ok(BatchedDraft {
            tree,
            stats,
            pass_sessions: self.pass_sessions.max(1),
        }));
    }

    /// Answers the caller with `e`; the session's cache holds the round's tokens again.
    fn fail(mut self, engine: &DraftEngine, e: EngineError) {
        if let Work::Levels(round) = &self.work {
            engine.abandon(&mut self.session, round);
        }
        let _ = self.answer.send(Err(e));
    }

    /// The round, where it waits for a level pass.
    fn round(&self) -> Option<&DraftRound> {
        match &self.work {
            Work::Levels(r) => Some(r),
            Work::Chain(_) => None,
        }
    }

    /// The session and round of a job waiting for a level pass ([`run_levels`] takes no
    /// other).
    fn levels(&mut self) -> (&mut DraftSession, &mut DraftRound) {
        match &mut self.work {
            Work::Levels(r) => (&mut self.session, r),
            Work::Chain(_) => unreachable!("a chain's job in a level pass"),
        }
    }
}

impl PassJob for Job {
    type Engine = DraftEngine;
    const PASS: &'static str = "draft";

    fn rows(&self) -> usize {
        match &self.work {
            Work::Levels(r) => r.pass_rows(),
            Work::Chain(c) => c.feed_rows(),
        }
    }

    fn is_abandoned(&self) -> bool {
        self.answer.is_closed()
    }

    fn abandon(mut self, engine: &DraftEngine) {
        // A chain not grown yet wrote nothing past the sequence.
        if let Work::Levels(round) = &self.work {
            engine.abandon(&mut self.session, round);
        }
    }

    fn in_progress(&self) -> bool {
        self.passes > 0
    }

    fn run_pass(engine: &DraftEngine, counters: &PassCounters, members: Vec<Job>) -> Vec<Job> {
        let (chains, levels): (Vec<Job>, Vec<Job>) = members
            .into_iter()
            .partition(|m| matches!(m.work, Work::Chain(_)));
        run_chains(engine, counters, chains);
        if levels.is_empty() {
            return Vec::new();
        }
        run_levels(engine, counters, levels)
    }
}

/// Runs the draft rounds of concurrent sessions' requests with their levels in shared model
/// passes (see the module documentation).
pub struct DraftBatcher {
    queue: PassQueue<Job>,
}

impl DraftBatcher {
    /// A batcher over `engine`, its passes bounded by `limits`, its model work placed as
    /// `placement` says.
    pub fn new(engine: Arc<DraftEngine>, limits: BatchLimits, placement: WorkPlacement) -> Self {
        Self {
            queue: PassQueue::new(engine, limits, placement),
        }
    }

    /// A batcher like this one whose model work is placed as `placement` says (a new queue).
    pub fn placed(&self, placement: WorkPlacement) -> Self {
        Self {
            queue: self.queue.placed(placement),
        }
    }

    batcher_methods!(DraftEngine);

    /// Drafts a tree continuing `tokens` for `session` as `params` say: prepares the round
    /// alone, then runs its levels in the passes that take them.
    pub async fn draft(
        &self,
        session: SessionHandle<DraftSession>,
        tokens: Vec<u32>,
        params: DraftParams,
    ) -> Result<BatchedDraft, Status> {
        let (session, prepared) = self
            .queue
            .prepare(session, move |engine, session| {
                engine.prepare(session, &tokens, params)
            })
            .await?;
        let work = match prepared.map_err(Status::from)? {
            Prepared::Chain(round) => Work::Chain(round),
            Prepared::Levels(round) => Work::Levels(round),
        };
        // Declared before the answer's receiver, so dropped after it: a request dropped while
        // its round waits takes the round out of the queue, freeing its session.
        let _sweep = Sweep(&self.queue);
        let (answer, mut answered) = oneshot::channel();
        let job = Job {
            session,
            work,
            answer,
            passes: 0,
            pass_sessions: 0,
        };
        if job.round().is_some_and(DraftRound::is_complete) {
            job.complete(self.engine());
        } else {
            self.queue.push(job);
        }
        self.queue.await_answer(&mut answered).await
    }
}

/// Takes the rounds of its queue's dropped requests out of the queue when dropped.
struct Sweep<'a>(&'a PassQueue<Job>);

impl Drop for Sweep<'_> {
    fn drop(&mut self) {
        self.0.drop_abandoned();
    }
}

/// The most sessions whose chains grow together: their first level's rows within the
/// batch-invariant kernels' limit.
const MAX_CHAIN_SESSIONS: usize = specsplit_models::fused::BI_MAX_ROWS / CHAIN_FEED_MAX;

/// Grows the members' greedy chains and answers each: those that can grow together
/// ([`DraftEngine::joins_chains`] at the deepest of their depths) in one shared growth (one
/// pass counted) where there are two or more and the engine grows chains together, every
/// other one alone.
fn run_chains(engine: &DraftEngine, counters: &PassCounters, members: Vec<Job>) {
    type Chain = (OwnedMutexGuard<DraftSession>, ChainRound, Answer);
    let chains: Vec<Chain> = members
        .into_iter()
        .filter_map(|m| match m.work {
            Work::Chain(round) => Some((m.session, round, m.answer)),
            Work::Levels(_) => None,
        })
        .collect();
    let depth = chains.iter().map(|(_, r, _)| r.depth()).max().unwrap_or(0);
    let (mut together, alone): (Vec<Chain>, Vec<Chain>) = chains
        .into_iter()
        .partition(|(s, r, _)| engine.joins_chains(s, r, depth));
    // At most as many as one growth takes, the others alone.
    let mut alone = alone;
    alone.extend(together.drain(together.len().min(MAX_CHAIN_SESSIONS)..));
    let capacity = together.iter().map(|(s, _, _)| s.cache.capacity()).max();
    let shared = engine.chains_together_fit(together.len(), capacity.unwrap_or(0));
    let answer = |a: Answer, r: Result<(TokenTree, DraftStats), EngineError>, n: usize| {
        let _ = a.send(r.map(|(tree, stats)| BatchedDraft {
            tree,
            stats,
            pass_sessions: n,
        }));
    };
    if shared {
        let n = together.len();
        counters.pass(n);
        let (mut sessions, mut rounds, mut answers) = (Vec::new(), Vec::new(), Vec::new());
        for (s, r, a) in together.drain(..) {
            sessions.push(s);
            rounds.push(r);
            answers.push(a);
        }
        let members = sessions.iter_mut().map(|s| &mut **s).zip(rounds).collect();
        let results = engine.chains_together(members);
        for (a, r) in answers.into_iter().zip(results) {
            answer(a, r, n);
        }
    }
    for (mut s, round, a) in together.into_iter().chain(alone) {
        counters.pass(1);
        answer(a, engine.chain_alone(&mut s, round), 1);
    }
}

/// One pass: runs the members' pending levels together, picks each one's next level, answers
/// those whose trees are complete (or failed); returns the others, in order.
fn run_levels(engine: &DraftEngine, counters: &PassCounters, mut members: Vec<Job>) -> Vec<Job> {
    let sessions = members.len();
    counters.pass(sessions);
    let t0 = Instant::now();
    // Each member's logits, the time of the pass that gave them and its sessions.
    let logits: Vec<(Result<Tensor, EngineError>, Duration, usize)> = if sessions == 1 {
        let m = &mut members[0];
        let l = {
            let (session, round) = m.levels();
            engine.level_pass(session, round)
        };
        vec![(l, t0.elapsed(), 1)]
    } else {
        let shared = {
            let mut parts: Vec<_> = members
                .iter_mut()
                .map(|m| {
                    let (session, round) = m.levels();
                    (session, &*round)
                })
                .collect();
            engine.level_pass_sessions(&mut parts)
        };
        match shared {
            Ok(l) => {
                let elapsed = t0.elapsed();
                l.into_iter().map(|l| (Ok(l), elapsed, sessions)).collect()
            }
            Err(e) => {
                // Which member made the shared pass fail is unknown: each runs again alone, so
                // only a bad one fails.
                tracing::warn!(
                    "a draft pass of {sessions} sessions failed ({e}); running each alone"
                );
                members
                    .iter_mut()
                    .map(|m| {
                        counters.pass(1);
                        let t0 = Instant::now();
                        let l = {
                            let (session, round) = m.levels();
                            engine.level_pass(session, round)
                        };
                        (l, t0.elapsed(), 1)
                    })
                    .collect()
            }
        }
    };
    let mut unfinished = Vec::new();
    for (mut m, (l, elapsed, shared)) in members.into_iter().zip(logits) {
        m.passes += 1;
        m.pass_sessions = m.pass_sessions.max(shared);
        match l.and_then(|l| {
            let (session, round) = m.levels();
            engine.take_level(session, round, l, elapsed)
        }) {
            Err(e) => m.fail(engine, e),
            Ok(()) if m.round().is_some_and(DraftRound::is_complete) => m.complete(engine),
            Ok(()) => unfinished.push(m),
        }
    }
    unfinished
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_session::SessionEngine;
    use specsplit_core::sampling::SamplingParams;

    /// The rounds queued in `queue`, locked.
    fn lock(queue: &PassQueue<Job>) -> std::sync::MutexGuard<'_, std::collections::VecDeque<Job>> {
        queue.lock()
    }

    fn tiny_engine(static_chains: bool) -> Arc<DraftEngine> {
        Arc::new(
            DraftEngine::new(crate::test_models::tiny_model(7), vec![], 128)
                .with_static_chains(static_chains)
                .with_spare_sessions(0),
        )
    }

    fn batcher(engine: &Arc<DraftEngine>, placement: WorkPlacement) -> Arc<DraftBatcher> {
        let limits = BatchLimits {
            max_sessions: 8,
            max_rows: 256,
        };
        Arc::new(DraftBatcher::new(engine.clone(), limits, placement))
    }

    fn handle(engine: &DraftEngine, seed: u64) -> SessionHandle<DraftSession> {
        Arc::new(tokio::sync::Mutex::new(engine.new_session(seed).unwrap()))
    }

    fn prompt(session: usize) -> Vec<u32> {
        (0..10 + 3 * session as u32)
            .map(|i| (i * 37 + 5 + 101 * session as u32) % 500)
            .collect()
    }

    /// Session `i`'s draft shape: greedy trees, a greedy chain, sampled trees (seeded by the
    /// session), of different depths and widths.
    fn params(i: usize) -> DraftParams {
        let sampled = SamplingParams {
            temperature: 0.8,
            ..SamplingParams::default()
        };
        match i % 5 {
            0 => DraftParams {
                widths: vec![2, 2, 1],
                sampling: SamplingParams::default(),
                deadline: None,
            },
            1 => DraftParams {
                widths: vec![1; 5],
                sampling: SamplingParams::default(),
                deadline: None,
            },
            2 => DraftParams {
                widths: vec![3, 1],
                sampling: sampled,
                deadline: None,
            },
            3 => DraftParams {
                widths: vec![1; 4],
                sampling: sampled,
                deadline: None,
            },
            _ => DraftParams {
                widths: vec![2, 1, 1, 1, 1, 1],
                sampling: SamplingParams::default(),
                deadline: None,
            },
        }
    }

    /// Session `i`'s sequences over `rounds` rounds: the prompt, then each round's first
    /// drafted token and a correction appended, as a verifier would.
    fn next_sequence(seq: &mut Vec<u32>, tree: &TokenTree, round: usize) {
        seq.push(tree.tokens()[0]);
        seq.push((round as u32 * 31 + 7) % 500);
    }

    /// Session `i`'s trees over `rounds` rounds drafted alone (no batcher).
    fn alone(engine: &DraftEngine, i: usize, rounds: usize) -> Vec<TokenTree> {
        let mut s = engine.new_session(i as u64 + 1).unwrap();
        let mut seq = prompt(i);
        (0..rounds)
            .map(|round| {
                let t = engine.draft(&mut s, &seq, &params(i)).unwrap().0;
                next_sequence(&mut seq, &t, round);
                t
            })
            .collect()
    }

    /// Holds the batcher's passes, sends each of `requests` from a task of its own (the next
    /// once the one before is queued or answered), then lets the passes run; their answers in
    /// order.
    async fn one_batch(
        b: &Arc<DraftBatcher>,
        requests: Vec<(SessionHandle<DraftSession>, Vec<u32>, DraftParams)>,
    ) -> Vec<Result<BatchedDraft, Status>> {
        let hold = b.hold().await;
        let mut tasks = Vec::new();
        for (s, tokens, p) in requests {
            let b2 = b.clone();
            tasks.push(tokio::spawn(async move { b2.draft(s, tokens, p).await }));
            while b.queued() + tasks.iter().filter(|t| t.is_finished()).count() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(hold);
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    /// `rounds` rounds of every session of `handles` drafting after `seqs` (each round's
    /// requests queued together, each sequence extended as a verifier would): per session its
    /// trees, and per answer the sessions its passes shared.
    async fn queued_rounds(
        b: &Arc<DraftBatcher>,
        handles: &[SessionHandle<DraftSession>],
        seqs: &mut [Vec<u32>],
        rounds: usize,
    ) -> (Vec<Vec<TokenTree>>, Vec<usize>) {
        let mut got: Vec<Vec<TokenTree>> = vec![Vec::new(); handles.len()];
        let mut shared = Vec::new();
        for round in 0..rounds {
            let requests = (0..handles.len())
                .map(|i| (handles[i].clone(), seqs[i].clone(), params(i)))
                .collect();
            for (i, out) in one_batch(b, requests).await.into_iter().enumerate() {
                let out = out.unwrap();
                next_sequence(&mut seqs[i], &out.tree, round);
                got[i].push(out.tree);
                shared.push(out.pass_sessions);
            }
        }
        (got, shared)
    }

    /// Five sessions of different shapes draft four rounds each, every round's requests
    /// queued together: each tree equals the session's tree drafted alone.
    async fn shared_levels_draft_exactly_as_alone(placement: WorkPlacement) {
        let engine = tiny_engine(false);
        let b = batcher(&engine, placement);
        const N: usize = 5;
        const ROUNDS: usize = 4;
        let handles: Vec<_> = (0..N).map(|i| handle(&engine, i as u64 + 1)).collect();
        let mut seqs: Vec<Vec<u32>> = (0..N).map(prompt).collect();
        let (got, shared) = queued_rounds(&b, &handles, &mut seqs, ROUNDS).await;
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                *g,
                alone(&engine, i, ROUNDS),
                "session {i} drafted differently in shared passes"
            );
            let s = handles[i].lock().await;
            assert_eq!(
                s.cache.len(),
                seqs[i].len() - 2,
                "the cache holds the last request's tokens"
            );
        }
        let stats = b.stats();
        assert_eq!(stats.most_sessions, N as u64, "{stats:?}");
        // Per round: levels 1..=5 of the deepest tree, the first with all five sessions.
        assert_eq!(stats.passes, 5 * ROUNDS as u64, "{stats:?}");
        assert!(shared.iter().all(|&n| n == N), "{shared:?}");
    }

    /// Greedy chains on the fixed-shape path queued with other sessions' trees: every session
    /// drafts what it drafts alone, round after round (off CUDA each chain grows alone, and
    /// the trees still share their level passes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chains_queued_with_trees_draft_exactly_as_alone() {
        let engine = tiny_engine(true);
        let b = batcher(&engine, WorkPlacement::Inline);
        const N: usize = 5;
        let handles: Vec<_> = (0..N).map(|i| handle(&engine, i as u64 + 1)).collect();
        let mut seqs: Vec<Vec<u32>> = (0..N).map(prompt).collect();
        let (got, _) = queued_rounds(&b, &handles, &mut seqs, 3).await;
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, alone(&engine, i, 3), "session {i} drafted differently");
        }
        // The greedy chain (session 1) is cached through its last fed level.
        let s = handles[1].lock().await;
        assert_eq!(s.tokens.len(), s.cache.len());
        assert!(s.cache.len() >= seqs[1].len() - 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn shared_levels_draft_exactly_as_alone_on_the_blocking_pool() {
        shared_levels_draft_exactly_as_alone(WorkPlacement::Pool).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shared_levels_draft_exactly_as_alone_inline() {
        shared_levels_draft_exactly_as_alone(WorkPlacement::Inline).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn sessions_leave_the_lock_step_when_their_trees_are_complete() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Pool);
        let chain = |depth| DraftParams {
            widths: vec![1; depth],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let handles: Vec<_> = (0..3).map(|i| handle(&engine, i + 1)).collect();
        let requests = [6, 2, 4]
            .iter()
            .enumerate()
            .map(|(i, &d)| (handles[i].clone(), prompt(i), chain(d)))
            .collect();
        let out: Vec<BatchedDraft> = one_batch(&b, requests)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for (i, (o, d)) in out.iter().zip([6, 2, 4]).enumerate() {
            assert_eq!(o.tree.len(), d);
            let mut s = engine.new_session(i as u64 + 1).unwrap();
            assert_eq!(
                o.tree,
                engine.draft(&mut s, &prompt(i), &chain(d)).unwrap().0
            );
            assert_eq!(o.pass_sessions, 3);
        }
        // Level passes: one of three sessions, two of two (the depth-2 chain has left), two of
        // the deepest chain alone.
        let stats = b.stats();
        assert_eq!(stats.passes, 5, "{stats:?}");
        assert_eq!(stats.multi_session_passes, 3, "{stats:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_session_joins_a_lock_step_in_the_middle_of_a_tree() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Pool);
        let chain = |depth| DraftParams {
            widths: vec![1; depth],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let (deep, late) = (handle(&engine, 1), handle(&engine, 2));
        let hold = b.hold().await;
        let first = {
            let (b, s) = (b.clone(), deep.clone());
            tokio::spawn(async move { b.draft(s, prompt(0), chain(6)).await })
        };
        while b.queued() < 1 {
            tokio::task::yield_now().await;
        }
        // The passes' lock is fair: the deep chain's request runs its first level pass, then
        // this hold comes before its next one.
        drop(hold);
        let hold = b.hold().await;
        assert_eq!(b.stats().passes, 1);
        assert_eq!(b.queued(), 1, "the deep chain waits for its second level");
        let second = {
            let (b, s) = (b.clone(), late.clone());
            tokio::spawn(async move { b.draft(s, prompt(1), chain(3)).await })
        };
        while b.queued() < 2 {
            tokio::task::yield_now().await;
        }
        drop(hold);
        let (a, c) = (
            first.await.unwrap().unwrap(),
            second.await.unwrap().unwrap(),
        );
        assert_eq!((a.pass_sessions, c.pass_sessions), (2, 2));
        let mut s = engine.new_session(1).unwrap();
        assert_eq!(
            a.tree,
            engine.draft(&mut s, &prompt(0), &chain(6)).unwrap().0
        );
        let mut s = engine.new_session(2).unwrap();
        assert_eq!(
            c.tree,
            engine.draft(&mut s, &prompt(1), &chain(3)).unwrap().0
        );
        // Passes: the deep chain alone, both twice, the deep chain alone twice more.
        let stats = b.stats();
        assert_eq!(
            (stats.passes, stats.multi_session_passes),
            (5, 2),
            "{stats:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_request_fails_alone_and_leaves_its_session_whole() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Pool);
        let handles: Vec<_> = (0..4).map(|i| handle(&engine, i as u64 + 1)).collect();
        // Session 1 asks for a tree beyond the context; session 2 sends a token outside the
        // vocabulary (its prefill fails).
        let mut too_big = params(1);
        too_big.widths = vec![1; 200];
        let mut bad_token = prompt(2);
        bad_token.push(1 << 20);
        let requests = vec![
            (handles[0].clone(), prompt(0), params(0)),
            (handles[1].clone(), prompt(1), too_big),
            (handles[2].clone(), bad_token, params(2)),
            (handles[3].clone(), prompt(3), params(3)),
        ];
        let out = one_batch(&b, requests).await;
        let mut out = out.into_iter();
        let good = out.next().unwrap().unwrap();
        assert_eq!(good.pass_sessions, 2, "the refused requests never met it");
        assert_eq!(good.tree, alone(&engine, 0, 1)[0]);
        assert_eq!(
            out.next().unwrap().unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert!(out.next().unwrap().is_err());
        assert_eq!(out.next().unwrap().unwrap().tree, alone(&engine, 3, 1)[0]);
        // The refused sessions draft on as if the bad requests had not come.
        let rest = (1..3)
            .map(|i| (handles[i].clone(), prompt(i), params(i)))
            .collect();
        for (i, o) in (1..3).zip(one_batch(&b, rest).await) {
            assert_eq!(o.unwrap().tree, alone(&engine, i, 1)[0], "session {i}");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_shared_pass_runs_each_session_alone_and_fails_only_the_bad_one() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Pool);
        let handles: Vec<_> = (0..3).map(|i| handle(&engine, i as u64 + 1)).collect();
        let hold = b.hold().await;
        let mut tasks = Vec::new();
        for i in [0, 1] {
            let (b2, s) = (b.clone(), handles[i].clone());
            let p = params(4 * i);
            tasks.push(tokio::spawn(async move { b2.draft(s, prompt(i), p).await }));
            while b.queued() <= i {
                tokio::task::yield_now().await;
            }
        }
        // A third round whose level holds a token outside the vocabulary: the shared pass
        // refuses it, and so does its pass alone.
        let mut s = handles[2].clone().lock_owned().await;
        let Prepared::Levels(mut round) = engine.prepare(&mut s, &prompt(2), params(0)).unwrap()
        else {
            panic!("a tree of depth 3 has level passes")
        };
        round.spoil();
        let (answer, bad) = oneshot::channel();
        lock(&b.queue).push_back(Job {
            session: s,
            work: Work::Levels(round),
            answer,
            passes: 0,
            pass_sessions: 0,
        });
        drop(hold);
        for (i, t) in [0, 1].into_iter().zip(tasks) {
            let out = t.await.unwrap().unwrap();
            let p = params(4 * i);
            let mut alone = engine.new_session(i as u64 + 1).unwrap();
            assert_eq!(
                out.tree,
                engine.draft(&mut alone, &prompt(i), &p).unwrap().0
            );
            assert_eq!(out.pass_sessions, 2, "session {i} shared its second level");
        }
        assert!(bad.await.unwrap().is_err());
        // The failed pass of three, each of them alone, the second level of both sessions
        // together, then three levels of session 1 alone.
        let stats = b.stats();
        assert_eq!(
            (stats.passes, stats.multi_session_passes),
            (8, 2),
            "{stats:?}"
        );
        // The failed session's cache holds its prompt again; it drafts as it would alone.
        assert_eq!(handles[2].lock().await.cache.len(), prompt(2).len());
        let again = b
            .draft(handles[2].clone(), prompt(2), params(0))
            .await
            .unwrap();
        let mut alone = engine.new_session(3).unwrap();
        assert_eq!(
            again.tree,
            engine.draft(&mut alone, &prompt(2), &params(0)).unwrap().0
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_request_stalls_nobody_and_leaves_its_session_whole() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Pool);
        let handles: Vec<_> = (0..2).map(|i| handle(&engine, i as u64 + 1)).collect();
        let hold = b.hold().await;
        let cancelled = {
            let (b, s) = (b.clone(), handles[0].clone());
            tokio::spawn(async move { b.draft(s, prompt(0), params(0)).await })
        };
        let other = {
            let (b, s) = (b.clone(), handles[1].clone());
            tokio::spawn(async move { b.draft(s, prompt(1), params(1)).await })
        };
        while b.queued() < 2 {
            tokio::task::yield_now().await;
        }
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        assert_eq!(b.queued(), 1, "the cancelled round left the queue");
        drop(hold);
        let out = other.await.unwrap().unwrap();
        assert_eq!(out.pass_sessions, 1, "the cancelled request ran nothing");
        assert_eq!(out.tree, alone(&engine, 1, 1)[0]);
        // Session 0 is free, its cache holds its prompt, and it drafts as it would have.
        {
            let s = handles[0].lock().await;
            assert_eq!(s.tokens(), prompt(0).as_slice());
            assert_eq!(s.cache.len(), prompt(0).len());
        }
        let again = b
            .draft(handles[0].clone(), prompt(0), params(0))
            .await
            .unwrap();
        assert_eq!(again.tree, alone(&engine, 0, 1)[0]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pass_takes_queued_rounds_within_its_limits() {
        let engine = tiny_engine(false);
        let chain = |depth| DraftParams {
            widths: vec![1; depth],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let requests = |handles: &[SessionHandle<DraftSession>]| -> Vec<_> {
            (0..3)
                .map(|i| (handles[i].clone(), prompt(i), chain(2)))
                .collect()
        };
        let two = Arc::new(DraftBatcher::new(
            engine.clone(),
            BatchLimits {
                max_sessions: 2,
                max_rows: 256,
            },
            WorkPlacement::Pool,
        ));
        let handles: Vec<_> = (0..3).map(|i| handle(&engine, i + 1)).collect();
        let shared: Vec<usize> = one_batch(&two, requests(&handles))
            .await
            .into_iter()
            .map(|o| o.unwrap().pass_sessions)
            .collect();
        assert_eq!(shared, [2, 2, 1]);
        // Trees of width 2 at their second level: two rows a pass each; three rows fit one.
        let narrow = Arc::new(DraftBatcher::new(
            engine.clone(),
            BatchLimits {
                max_sessions: 8,
                max_rows: 3,
            },
            WorkPlacement::Pool,
        ));
        let wide = DraftParams {
            widths: vec![2, 1],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let handles: Vec<_> = (0..3).map(|i| handle(&engine, i + 1)).collect();
        let requests = (0..3)
            .map(|i| {
                let p = if i == 2 { chain(2) } else { wide.clone() };
                (handles[i].clone(), prompt(i), p)
            })
            .collect();
        let shared: Vec<usize> = one_batch(&narrow, requests)
            .await
            .into_iter()
            .map(|o| o.unwrap().pass_sessions)
            .collect();
        // The first alone (2 + 2 > 3), the next two together (2 + 1).
        assert_eq!(shared, [1, 2, 2]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn static_chains_off_cuda_grow_alone_one_pass_each() {
        let engine = tiny_engine(true);
        let b = batcher(&engine, WorkPlacement::Pool);
        let reference = tiny_engine(true);
        let chain = DraftParams {
            widths: vec![1; 4],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let handles: Vec<_> = (0..3).map(|i| handle(&engine, i + 1)).collect();
        let requests = (0..3)
            .map(|i| (handles[i].clone(), prompt(i), chain.clone()))
            .collect();
        for (i, o) in one_batch(&b, requests).await.into_iter().enumerate() {
            let o = o.unwrap();
            assert_eq!(o.pass_sessions, 1);
            let mut s = reference.new_session(i as u64 + 1).unwrap();
            assert_eq!(
                o.tree,
                reference.draft(&mut s, &prompt(i), &chain).unwrap().0
            );
        }
        // Off CUDA the model grows no chains together: a pass of one session each.
        let stats = b.stats();
        assert_eq!(
            (stats.passes, stats.multi_session_passes),
            (3, 0),
            "{stats:?}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn closed_loop_sessions_share_inline_passes_without_being_held() {
        let engine = tiny_engine(false);
        let b = batcher(&engine, WorkPlacement::Inline);
        const ROUNDS: usize = 5;
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (engine, b) = (engine.clone(), b.clone());
            tasks.push(tokio::spawn(async move {
                let h = handle(&engine, i as u64 + 1);
                let mut seq = prompt(i);
                let mut got = Vec::new();
                for round in 0..ROUNDS {
                    let out = b.draft(h.clone(), seq.clone(), params(i)).await.unwrap();
                    next_sequence(&mut seq, &out.tree, round);
                    got.push(out.tree);
                    // The answer's way back to the client and the next request's way here.
                    tokio::task::yield_now().await;
                }
                got
            }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), alone(&engine, i, ROUNDS), "session {i}");
        }
        let stats = b.stats();
        assert!(stats.multi_session_passes >= 1, "{stats:?}");
    }
}
