//! Continuous batching of verification across sessions.
//!
//! Each request first prepares its round on its own ([`TargetEngine::prepare`]: its checks,
//! and a new prompt's causal prefill), where its worker's [`WorkPlacement`] says, so that a
//! bad request fails before it meets any other and a long prompt holds no other session's
//! round back. Prepared rounds of different sessions that become ready while a pass runs wait
//! in a queue; the next pass takes every queued round (up to [`BatchLimits`]), runs their rows
//! in one model call ([`TargetEngine::pass_sessions`]), then finishes each
//! ([`TargetEngine::finish`]) and answers each request on its own. A pass of one session runs
//! the one-session path ([`TargetEngine::pass`], with its captured graphs). If a shared pass
//! fails, each of its rounds runs alone, so only a bad one fails.
//!
//! There is no batching thread: the request that finds the device free runs the next pass
//! (where the placement says) and answers every request in it; the others wait for their
//! answer or for their turn to run the next pass. Each queued round holds its session's lock,
//! so one session has at most one round in a pass. A round whose caller went away before its
//! pass leaves the queue with its session cut back to the round's kept prefix
//! ([`TargetEngine::abandon`]); once in a pass, the round runs to the end (the session stays
//! whole) and the answer is discarded.
//!
//! A pass placed `Inline` runs on the thread that reads requests (a GPU worker's, so that all
//! its device work stays on one thread): no request is read while it runs, and the sessions
//! of one pass send their next rounds only after it answers them. So before a pass the batcher
//! gathers: it lets the thread read requests until as many rounds are queued as the last pass
//! held or as sessions asked for rounds within [`ACTIVE_WINDOW`], for at most
//! [`GATHER_WINDOW`], or, for sessions out of step that are due to ask again within twice the
//! last pass, until they are due (see `pass_queue`). A session alone never waits.
//!
//! The queue, the turn, the counters, the gathering and the taking of a batch are the crate's
//! pass queue (`pass_queue`, shared with [`crate::draft_batcher`]); this module holds what a
//! verification pass does with its rounds.

use std::sync::Arc;

use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::TokenTree;
use tokio::sync::{oneshot, OwnedMutexGuard};
use tonic::Status;

use crate::pass_queue::{batcher_methods, PassCounters, PassJob, PassQueue};
pub use crate::pass_queue::{BatchLimits, BatchStats, PassHold, ACTIVE_WINDOW, GATHER_WINDOW};
use crate::service::WorkPlacement;
use crate::session::SessionHandle;
use crate::target::{Prefix, PreparedRound, TargetEngine, TargetSession, VerifyOutcome};
use crate::EngineError;

/// What a verification round asks for (a `VerifyDrafts` request, checked).
#[derive(Debug, Clone)]
pub struct RoundRequest {
    /// The sequence before the tree.
    pub prefix: Prefix,
    /// The draft tree.
    pub tree: TokenTree,
    /// How the target's tokens are chosen.
    pub params: SamplingParams,
    /// Whether to return the emitted tokens' log-probabilities.
    pub logprobs: bool,
}

/// A verified round and the pass it ran in.
#[derive(Debug, Clone)]
pub struct BatchedOutcome {
    /// The round's outcome.
    pub outcome: VerifyOutcome,
    /// Sessions whose rows ran in the same model pass (1: alone).
    pub pass_sessions: usize,
    /// Rows of that pass, all its sessions' together.
    pub pass_rows: usize,
}

/// The answer channel of one queued request.
type Answer = oneshot::Sender<Result<BatchedOutcome, EngineError>>;

/// One prepared round waiting for its pass: its session (locked), what it asks, the round,
/// where its answer goes.
struct Job {
    session: OwnedMutexGuard<TargetSession>,
    request: RoundRequest,
    round: PreparedRound,
    answer: Answer,
}

impl PassJob for Job {
    type Engine = TargetEngine;
    const PASS: &'static str = "verification";

    fn rows(&self) -> usize {
        self.round.pass_rows(&self.request.tree)
    }

    fn is_abandoned(&self) -> bool {
        self.answer.is_closed()
    }

    fn abandon(mut self, engine: &TargetEngine) {
        engine.abandon(&mut self.session, &self.round);
    }

    fn run_pass(engine: &TargetEngine, counters: &PassCounters, members: Vec<Job>) -> Vec<Job> {
        run_pass(engine, counters, members);
        Vec::new()
    }
}

/// Runs the verification rounds of concurrent sessions in shared model passes (see the
/// module documentation).
pub struct VerifyBatcher {
    queue: PassQueue<Job>,
}

impl VerifyBatcher {
    /// A batcher over `engine`, its passes bounded by `limits`, its model work placed as
    /// `placement` says.
    pub fn new(engine: Arc<TargetEngine>, limits: BatchLimits, placement: WorkPlacement) -> Self {
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

    batcher_methods!(TargetEngine);

    /// Verifies one round of `session`: prepares it alone, then runs its rows in the next
    /// pass that takes it.
    pub async fn verify(
        &self,
        session: SessionHandle<TargetSession>,
        request: RoundRequest,
    ) -> Result<BatchedOutcome, Status> {
        let (session, (request, round)) = self
            .queue
            .prepare(session, move |engine, session| {
                let round = engine.prepare(session, request.prefix.clone(), &request.tree);
                (request, round)
            })
            .await?;
        let round = round.map_err(Status::from)?;
        let (answer, mut answered) = oneshot::channel();
        self.queue.push(Job {
            session,
            request,
            round,
            answer,
        });
        self.queue.await_answer(&mut answered).await
    }
}

/// One pass: runs the prepared rounds' rows together, finishes and answers each.
fn run_pass(engine: &TargetEngine, counters: &PassCounters, mut members: Vec<Job>) {
    let sessions = members.len();
    let rows: usize = members.iter().map(Job::rows).sum();
    counters.pass(sessions);
    for m in &mut members {
        engine.resume(&mut m.round, sessions == 1);
    }
    if sessions == 1 {
        let logits = {
            let m = &mut members[0];
            engine.pass(&mut m.session, &m.round, &m.request.tree)
        };
        finish(
            engine,
            members.pop().expect("one member"),
            logits,
            (1, rows),
            None,
        );
        return;
    }
    let logits = {
        let mut parts: Vec<_> = members
            .iter_mut()
            .map(|m| (&mut *m.session, &m.round, &m.request.tree))
            .collect();
        engine.pass_sessions(&mut parts)
    };
    match logits {
        Ok(logits) => {
            // The greedy members' argmaxes with one copy from the device for all of them.
            let greedy: Vec<&candle_core::Tensor> = members
                .iter()
                .zip(&logits)
                .filter(|(m, _)| m.request.params.is_greedy())
                .map(|(_, l)| l)
                .collect();
            let mut argmaxes = engine.argmaxes(&greedy).ok().map(Vec::into_iter);
            for (m, l) in members.into_iter().zip(logits) {
                let argmax = match &mut argmaxes {
                    Some(a) if m.request.params.is_greedy() => a.next(),
                    _ => None,
                };
                finish(engine, m, Ok(l), (sessions, rows), argmax);
            }
        }
        Err(e) => {
            // Which member made the shared pass fail is unknown: each runs again alone, so
            // only a bad one fails.
            tracing::warn!("a pass of {sessions} sessions failed ({e}); running each alone");
            for mut m in members {
                let logits = engine.pass(&mut m.session, &m.round, &m.request.tree);
                counters.pass(1);
                let rows = m.rows();
                finish(engine, m, logits, (1, rows), None);
            }
        }
    }
}

/// Finishes `m`'s round with the logits of its pass (of `sessions` sessions and `rows` rows)
/// and their argmaxes where already copied from the device, and answers it.
fn finish(
    engine: &TargetEngine,
    mut m: Job,
    logits: Result<candle_core::Tensor, EngineError>,
    (sessions, rows): (usize, usize),
    argmax: Option<Vec<u32>>,
) {
    let out = logits.and_then(|l| {
        engine.finish(
            &mut m.session,
            m.round,
            &m.request.tree,
            &l,
            &m.request.params,
            m.request.logprobs,
            argmax,
        )
    });
    let _ = m.answer.send(out.map(|outcome| BatchedOutcome {
        outcome,
        pass_sessions: sessions,
        pass_rows: rows,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_session::SessionEngine;
    use specsplit_core::verify::Verdict;

    fn tiny_engine() -> Arc<TargetEngine> {
        Arc::new(TargetEngine::new(crate::test_models::tiny_model(11), 128).with_spare_sessions(0))
    }

    fn batcher(engine: &Arc<TargetEngine>, placement: WorkPlacement) -> Arc<VerifyBatcher> {
        let limits = BatchLimits {
            max_sessions: 8,
            max_rows: 256,
        };
        Arc::new(VerifyBatcher::new(engine.clone(), limits, placement))
    }

    fn handle(engine: &TargetEngine, seed: u64) -> SessionHandle<TargetSession> {
        Arc::new(tokio::sync::Mutex::new(engine.new_session(seed).unwrap()))
    }

    fn prompt(session: usize) -> Vec<u32> {
        (0..12 + 5 * session as u32)
            .map(|i| (i * 37 + 5 + 101 * session as u32) % 500)
            .collect()
    }

    /// A chain of `tokens`, or a root with the rest as its children when `fork`.
    fn tree(tokens: &[u32], fork: bool) -> TokenTree {
        let mut t = TokenTree::new();
        let mut parent = None;
        for (i, &tok) in tokens.iter().enumerate() {
            let node = match parent {
                None => t.push_root(tok, 0.0),
                Some(p) => t.push_child(p, tok, 0.0),
            }
            .unwrap();
            if !(fork && i > 0) {
                parent = Some(node);
            }
        }
        t
    }

    /// What a session's verifications give: verdict, cached length, log-probabilities.
    type Seen = (Verdict, usize, Vec<u32>);

    fn seen(o: &VerifyOutcome) -> Seen {
        let bits = o.logprobs.iter().map(|x| x.to_bits()).collect();
        (o.verdict.clone(), o.cached_len, bits)
    }

    /// One session's rounds as an orchestrator sends them: the prompt, then the previous
    /// round's next token with a draft guessing the target's greedy continuation `cont` (a
    /// wrong token in some rounds, a fork in one).
    struct Script {
        session: usize,
        cont: Vec<u32>,
        next: u32,
        cached: usize,
        round: usize,
    }

    impl Script {
        fn new(engine: &TargetEngine, session: usize) -> Self {
            let cont = crate::target::greedy_continuation(engine, 1, prompt(session), 48);
            Self {
                session,
                cont,
                next: 0,
                cached: 0,
                round: 0,
            }
        }

        fn request(&self) -> RoundRequest {
            let params = SamplingParams::default();
            if self.round == 0 {
                return RoundRequest {
                    prefix: Prefix::Full(prompt(self.session)),
                    tree: TokenTree::new(),
                    params,
                    logprobs: true,
                };
            }
            let done = self.cached - prompt(self.session).len() + 1;
            let mut guess = [self.cont[done], self.cont[done + 1], self.cont[done + 2]];
            let k = self.round + self.session;
            guess[k % 3] += u32::from(k % 2 == 1);
            RoundRequest {
                prefix: Prefix::Delta {
                    new_tokens: vec![self.next],
                    expected_len: self.cached,
                },
                // Some rounds are plain steps (no tree), one has a fork.
                tree: if k % 4 == 3 {
                    TokenTree::new()
                } else {
                    tree(&guess, k % 5 == 4)
                },
                params,
                logprobs: true,
            }
        }

        fn answered(&mut self, o: &VerifyOutcome) {
            self.next = o.verdict.next_token;
            self.cached = o.cached_len;
            self.round += 1;
        }
    }

    /// `rounds` rounds of `session` run alone through the engine.
    fn alone(engine: &TargetEngine, session: usize, rounds: usize) -> Vec<Seen> {
        alone_session(engine, session, rounds).0
    }

    /// [`alone`], and the session's logits after its last round (as bits).
    fn alone_session(
        engine: &TargetEngine,
        session: usize,
        rounds: usize,
    ) -> (Vec<Seen>, Vec<u32>) {
        let mut script = Script::new(engine, session);
        let mut s = engine.new_session(1).unwrap();
        let seen = (0..rounds)
            .map(|_| {
                let r = script.request();
                let o = engine
                    .verify_scored(&mut s, r.prefix, &r.tree, &r.params, r.logprobs)
                    .unwrap();
                script.answered(&o);
                seen(&o)
            })
            .collect();
        (seen, pending_bits(&s))
    }

    /// The bits of a session's pending logits.
    fn pending_bits(s: &TargetSession) -> Vec<u32> {
        let l: Vec<f32> = s.last_logits.as_ref().unwrap().to_vec1().unwrap();
        l.iter().map(|x| x.to_bits()).collect()
    }

    /// Holds the batcher's passes, sends each of `requests` from a task of its own (the next
    /// once the one before is queued, or refused before it queued), then lets the passes run;
    /// their answers in order.
    async fn one_pass(
        b: &Arc<VerifyBatcher>,
        requests: Vec<(SessionHandle<TargetSession>, RoundRequest)>,
    ) -> Vec<Result<BatchedOutcome, Status>> {
        let hold = b.hold().await;
        let mut tasks = Vec::new();
        for (s, r) in requests {
            let b2 = b.clone();
            tasks.push(tokio::spawn(async move { b2.verify(s, r).await }));
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

    /// Sessions 0..4 run 7 rounds each through the batcher, every round's requests in one
    /// pass; session 3 joins at the third pass, session 1 leaves after its fourth round.
    async fn sessions_joining_and_leaving(placement: WorkPlacement) {
        let engine = tiny_engine();
        let b = batcher(&engine, placement);
        const ROUNDS: usize = 7;
        let mut scripts: Vec<Script> = (0..4).map(|i| Script::new(&engine, i)).collect();
        let handles: Vec<_> = (0..4).map(|_| handle(&engine, 1)).collect();
        let mut got: Vec<Vec<Seen>> = vec![Vec::new(); 4];
        let mut shared = Vec::new();
        for pass in 0..ROUNDS + 2 {
            let members: Vec<usize> = (0..4)
                .filter(|&i| {
                    let joined = i != 3 || pass >= 2;
                    let left = i == 1 && scripts[i].round >= 4;
                    joined && !left && scripts[i].round < ROUNDS
                })
                .collect();
            if members.is_empty() {
                break;
            }
            let requests = members
                .iter()
                .map(|&i| (handles[i].clone(), scripts[i].request()))
                .collect();
            for (&i, out) in members.iter().zip(one_pass(&b, requests).await) {
                let out = out.unwrap();
                scripts[i].answered(&out.outcome);
                got[i].push(seen(&out.outcome));
                shared.push(out.pass_sessions);
            }
        }
        for (i, g) in got.iter().enumerate() {
            let rounds = if i == 1 { 4 } else { ROUNDS };
            assert_eq!(g.len(), rounds, "session {i}");
            let (expected, logits) = alone_session(&engine, i, rounds);
            assert_eq!(
                *g, expected,
                "session {i} verified differently in shared passes"
            );
            assert!(
                pending_bits(&*handles[i].lock().await) == logits,
                "session {i}'s logits after its last round differ"
            );
        }
        assert!(
            got.iter()
                .flatten()
                .any(|(v, _, _)| !v.accepted_tokens.is_empty()),
            "some drafts were accepted"
        );
        let stats = b.stats();
        assert_eq!(stats.most_sessions, 4, "{stats:?}");
        assert!(stats.multi_session_passes >= ROUNDS as u64, "{stats:?}");
        // 3 sessions, 4 once session 3 joined, 3 once session 1 left, and session 3 alone at
        // the end (the one-session path).
        for n in [1, 3, 4] {
            assert!(shared.contains(&n), "{shared:?}");
        }
    }

    /// Sessions whose clients each send their next round as soon as the last is answered,
    /// with passes on the thread that reads requests (a GPU worker's placement), nothing held
    /// back: the gathering before a pass makes their rounds share passes, and each session
    /// verifies exactly as alone.
    #[tokio::test(flavor = "current_thread")]
    async fn closed_loop_sessions_share_inline_passes_without_being_held() {
        let engine = tiny_engine();
        let b = batcher(&engine, WorkPlacement::Inline);
        const ROUNDS: usize = 6;
        let scripts: Vec<Script> = (0..4).map(|i| Script::new(&engine, i)).collect();
        let mut tasks = Vec::new();
        for mut script in scripts {
            let (engine, b) = (engine.clone(), b.clone());
            tasks.push(tokio::spawn(async move {
                let h = handle(&engine, 1);
                let mut got = Vec::new();
                for _ in 0..ROUNDS {
                    let out = b.verify(h.clone(), script.request()).await.unwrap();
                    script.answered(&out.outcome);
                    got.push(seen(&out.outcome));
                    // The answer's way back to the client and the next request's way here.
                    tokio::task::yield_now().await;
                }
                got
            }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            let got = t.await.unwrap();
            let (expected, _) = alone_session(&engine, i, ROUNDS);
            assert_eq!(
                got, expected,
                "session {i} verified differently in shared passes"
            );
        }
        let stats = b.stats();
        assert!(stats.multi_session_passes >= 3, "{stats:?}");
        assert!(stats.passes < 4 * ROUNDS as u64, "{stats:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn shared_passes_verify_exactly_as_alone_on_the_blocking_pool() {
        sessions_joining_and_leaving(WorkPlacement::Pool).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shared_passes_verify_exactly_as_alone_inline() {
        sessions_joining_and_leaving(WorkPlacement::Inline).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_request_fails_alone_and_leaves_its_session_whole() {
        let engine = tiny_engine();
        let b = batcher(&engine, WorkPlacement::Pool);
        let mut scripts: Vec<Script> = (0..3).map(|i| Script::new(&engine, i)).collect();
        let handles: Vec<_> = (0..3).map(|_| handle(&engine, 1)).collect();
        let first = (0..3)
            .map(|i| (handles[i].clone(), scripts[i].request()))
            .collect();
        for (i, out) in one_pass(&b, first).await.into_iter().enumerate() {
            scripts[i].answered(&out.unwrap().outcome);
        }
        // Session 1 claims a wrong cached length; session 2 sends a tree beyond the context.
        let mut wrong_len = scripts[1].request();
        if let Prefix::Delta { expected_len, .. } = &mut wrong_len.prefix {
            *expected_len += 1;
        }
        let mut too_big = scripts[2].request();
        too_big.tree = tree(&[7; 120], false);
        let out = one_pass(
            &b,
            vec![
                (handles[0].clone(), scripts[0].request()),
                (handles[1].clone(), wrong_len),
                (handles[2].clone(), too_big),
            ],
        )
        .await;
        let mut out = out.into_iter();
        let good = out.next().unwrap().unwrap();
        assert_eq!(good.pass_sessions, 1, "the refused requests never met it");
        scripts[0].answered(&good.outcome);
        let e = out.next().unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        let e = out.next().unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        // The refused sessions go on as if the bad requests had not come.
        let rest = (0..3)
            .map(|i| (handles[i].clone(), scripts[i].request()))
            .collect();
        let got: Vec<Seen> = one_pass(&b, rest)
            .await
            .into_iter()
            .map(|out| {
                let out = out.unwrap();
                assert_eq!(out.pass_sessions, 3);
                seen(&out.outcome)
            })
            .collect();
        assert_eq!(got[0], alone(&engine, 0, 3)[2]);
        assert_eq!(got[1], alone(&engine, 1, 2)[1]);
        assert_eq!(got[2], alone(&engine, 2, 2)[1]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_request_stalls_nobody_and_leaves_its_session_whole() {
        let engine = tiny_engine();
        let b = batcher(&engine, WorkPlacement::Pool);
        let mut scripts: Vec<Script> = (0..2).map(|i| Script::new(&engine, i)).collect();
        let handles: Vec<_> = (0..2).map(|_| handle(&engine, 1)).collect();
        let first = (0..2)
            .map(|i| (handles[i].clone(), scripts[i].request()))
            .collect();
        for (i, out) in one_pass(&b, first).await.into_iter().enumerate() {
            scripts[i].answered(&out.unwrap().outcome);
        }
        let before = handles[0].lock().await.tokens().to_vec();
        // Session 0's request is queued behind a held pass, then its caller goes away.
        let hold = b.hold().await;
        let cancelled = {
            let (b, s, r) = (b.clone(), handles[0].clone(), scripts[0].request());
            tokio::spawn(async move { b.verify(s, r).await })
        };
        let other = {
            let (b, s, r) = (b.clone(), handles[1].clone(), scripts[1].request());
            tokio::spawn(async move { b.verify(s, r).await })
        };
        while b.queued() < 2 {
            tokio::task::yield_now().await;
        }
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        drop(hold);
        let out = other.await.unwrap().unwrap();
        assert_eq!(out.pass_sessions, 1, "the cancelled request ran nothing");
        assert_eq!(seen(&out.outcome), alone(&engine, 1, 2)[1]);
        assert_eq!(b.queued(), 0);
        // Session 0 is as it was, free, and its round runs as it would have.
        {
            let s = handles[0].lock().await;
            assert_eq!(s.tokens(), before.as_slice());
            assert_eq!(
                s.cache.len(),
                before.len(),
                "the cache holds the tokens, no more"
            );
        }
        let again = b
            .verify(handles[0].clone(), scripts[0].request())
            .await
            .unwrap();
        assert_eq!(seen(&again.outcome), alone(&engine, 0, 2)[1]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pass_takes_queued_requests_within_its_limits() {
        let engine = tiny_engine();
        let mut scripts: Vec<Script> = (0..3).map(|i| Script::new(&engine, i)).collect();
        let handles: Vec<_> = (0..3).map(|_| handle(&engine, 1)).collect();
        let requests = |scripts: &[Script]| -> Vec<_> {
            (0..3)
                .map(|i| (handles[i].clone(), scripts[i].request()))
                .collect()
        };
        // At most two sessions a pass: the oldest two, then the third.
        let two = Arc::new(VerifyBatcher::new(
            engine.clone(),
            BatchLimits {
                max_sessions: 2,
                max_rows: 256,
            },
            WorkPlacement::Pool,
        ));
        let shared: Vec<usize> = one_pass(&two, requests(&scripts))
            .await
            .into_iter()
            .enumerate()
            .map(|(i, o)| {
                let o = o.unwrap();
                scripts[i].answered(&o.outcome);
                o.pass_sessions
            })
            .collect();
        assert_eq!(shared, [2, 2, 1]);
        // Rows: each request's pass runs its new token and its tree's nodes; a limit of 5 rows
        // takes the oldest request, then the next ones while they fit.
        let rows: Vec<usize> = requests(&scripts)
            .iter()
            .map(|(_, r)| 1 + r.tree.len())
            .collect();
        let narrow = Arc::new(VerifyBatcher::new(
            engine.clone(),
            BatchLimits {
                max_sessions: 8,
                max_rows: 5,
            },
            WorkPlacement::Pool,
        ));
        let shared: Vec<usize> = one_pass(&narrow, requests(&scripts))
            .await
            .into_iter()
            .map(|o| o.unwrap().pass_sessions)
            .collect();
        // The first alone (4 + 4 > 5), the next two together (4 + 1).
        assert_eq!(rows, [4, 4, 1]);
        assert_eq!(shared, [1, 2, 2]);
    }
}
