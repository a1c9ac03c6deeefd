//! The drafting side of a round: whether and how wide the draft may be asked, draft requests
//! (bounded by the draft deadline), pre-drafts on their own task, and draft failures.

use std::time::{Duration, Instant};

use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_proto::convert::TreeWire;
use specsplit_proto::{DraftRequest, OutcomeSet};
use tonic::Code;

use super::{DraftOutcome, Drafted, PreDraft, PreDrafts, Run};
use crate::client::error::{rpc, short};
use crate::client::tree::{fit_tree_widths, subtree};
use crate::client::worker::{known, ServerTimes};
use crate::client::{Orchestrator, OrchestratorError};
use crate::GenerateConfig;

impl Run<'_> {
    /// Whether the draft accepts a request carrying `ctx_len` tokens and drafting `nodes`
    /// nodes over at most `levels` levels.
    pub(super) fn draft_accepts(&self, ctx_len: usize, nodes: usize, levels: usize) -> bool {
        let Some(d) = &self.o.draft_limits else {
            return false;
        };
        ctx_len <= known(d.max_prompt_len)
            && ctx_len.saturating_add(nodes) <= known(d.max_context)
            && nodes <= known(d.max_tree_nodes)
            && levels <= known(d.max_tree_depth)
    }

    /// The widths of this round's tree: `widths` cut to fit the target's room after the
    /// sequence and the draft's limits (empty when no tree fits).
    pub(super) fn fit_widths(&mut self, widths: &[usize]) -> Vec<usize> {
        let (room, levels) = self.target_room();
        let mut w = fit_tree_widths(widths, room, levels);
        if let Some(d) = &self.o.draft_limits {
            if self.seq.len() > known(d.max_prompt_len) || self.seq.len() >= known(d.max_context) {
                // The sequence only grows: the draft cannot serve this generation any more.
                tracing::info!(
                    tokens = self.seq.len(),
                    "the sequence outgrew the draft worker's limits; target-only rounds from here"
                );
                self.draft_off = true;
                return Vec::new();
            }
            let room = known(d.max_context) - self.seq.len();
            w = fit_tree_widths(
                &w,
                room.min(known(d.max_tree_nodes)),
                known(d.max_tree_depth),
            );
        }
        w
    }

    /// Records a failed draft request of round `round`.
    pub(super) fn draft_failed(&mut self, round: usize, what: &str) {
        self.draft_failures += 1;
        self.backoff.fail(round);
        tracing::warn!(
            round,
            "draft worker failed ({what}); target-only rounds meanwhile"
        );
    }

    /// Records a draft error of round `round`: a refusal as invalid (an older worker's limits)
    /// turns the draft off for the rest of the generation, anything else backs off.
    pub(super) fn draft_error(&mut self, round: usize, e: &OrchestratorError) {
        match e {
            OrchestratorError::Rpc { status, .. } if status.code() == Code::InvalidArgument => {
                self.draft_failures += 1;
                self.draft_off = true;
                tracing::warn!(
                    round,
                    "draft worker refused a request ({}); target-only rounds for the rest",
                    short(status.message())
                );
            }
            e => self.draft_failed(round, &short(&e.to_string())),
        }
    }

    /// Asks the draft for a tree after the sequence, within the draft deadline.
    pub(super) async fn draft(&mut self, round: usize, widths: &[usize]) -> DraftOutcome {
        let no = self.request_no;
        self.request_no += 1;
        let t0 = Instant::now();
        let until = self.bounded(t0 + Duration::from_millis(self.cfg.draft_timeout_ms));
        let limits = self.limits();
        let call = draft_call(
            self.o,
            self.session,
            self.secret,
            self.cfg,
            (no, until),
            &self.seq,
            widths,
            &limits,
            None,
        );
        let call = async move {
            let a = call.await?;
            Ok::<_, OrchestratorError>(Drafted {
                tree: a.tree,
                ms: a.ms,
                server: a.server,
            })
        };
        let waited = || t0.elapsed().as_secs_f64() * 1e3;
        match tokio::time::timeout_at(until.into(), call).await {
            Ok(Ok(d)) => {
                self.backoff.succeed();
                DraftOutcome::Tree(Box::new(d))
            }
            Ok(Err(e)) => {
                self.draft_error(round, &e);
                DraftOutcome::Failed(waited())
            }
            Err(_) if self.past_deadline() => DraftOutcome::Deadline,
            Err(_) => {
                let ms = self.cfg.draft_timeout_ms;
                self.draft_failed(round, &format!("no answer within {ms} ms"));
                DraftOutcome::Failed(waited())
            }
        }
    }

    /// Starts pre-drafting the outcomes `set` of verifying the end of `ctx` (trees of
    /// `widths`) on its own task, bounded by the draft deadline; the task answers `Err(())`
    /// when that passed.
    ///
    /// Without an outcome set it bets on one outcome, the whole path accepted: an ordinary
    /// draft of `[1] + widths` after `ctx` (the draft's own next token as the bonus, then the
    /// tree below it), answered as that outcome's pre-draft.
    pub(super) fn spawn_predraft(
        &mut self,
        ctx: Vec<u32>,
        set: Option<OutcomeSet>,
        widths: Vec<usize>,
    ) -> PreDraft {
        let bet = set.is_none().then(|| ctx.len() - self.seq.len());
        let widths = match bet {
            Some(_) => std::iter::once(1).chain(widths).collect(),
            None => widths,
        };
        let o = self.o.clone();
        let (sess, secret, cfg, no) = (
            self.session.to_string(),
            self.secret.to_string(),
            self.cfg.clone(),
            self.request_no,
        );
        self.request_no += 1;
        let limits = self.limits();
        let until = self.bounded(Instant::now() + Duration::from_millis(cfg.draft_timeout_ms));
        tokio::spawn(async move {
            let call = async {
                let answer = draft_call(
                    &o,
                    &sess,
                    &secret,
                    &cfg,
                    (no, until),
                    &ctx,
                    &widths,
                    &limits,
                    set,
                )
                .await?;
                let trees = match (bet, answer.tree.roots().next()) {
                    (Some(accepted), Some(r)) => vec![(
                        accepted,
                        answer.tree.token(r),
                        subtree(&answer.tree, Some(r), usize::MAX),
                    )],
                    _ => answer.predrafts,
                };
                Ok(PreDrafts {
                    trees,
                    ms: answer.ms,
                    sent: answer.sent,
                    server: answer.server,
                })
            };
            tokio::time::timeout_at(until.into(), call)
                .await
                .map_err(|_| ())
        })
    }
}

/// A draft worker's answer: its tree, and the trees it pre-drafted per outcome (accepted
/// length, the target's token after it) when asked for an outcome set; with the call's timing.
pub(super) struct DraftAnswer {
    tree: TokenTree,
    predrafts: Vec<(usize, u32, TokenTree)>,
    /// The call's wall time as the orchestrator saw it, in ms.
    ms: f64,
    /// When the request was sent.
    sent: Instant,
    /// What the worker reported for it.
    server: ServerTimes,
}

/// Asks the draft worker for a tree of `widths` after `seq`, as request `request_no` of the
/// session, or for the pre-drafts of `outcomes` when given (then `seq` holds the committed
/// sequence and the path under verification), and checks the trees it sends against `limits`.
/// The request carries `until` as its deadline (`grpc-timeout`), so that a worker stops
/// drafting a tree nobody waits for any more.
#[allow(clippy::too_many_arguments)]
async fn draft_call(
    o: &Orchestrator,
    session: &str,
    secret: &str,
    cfg: &GenerateConfig,
    (request_no, until): (u64, Instant),
    seq: &[u32],
    widths: &[usize],
    limits: &TreeLimits,
    outcomes: Option<OutcomeSet>,
) -> Result<DraftAnswer, OrchestratorError> {
    let Some(draft) = &o.lane.draft else {
        return Err(OrchestratorError::Config("no draft worker".into()));
    };
    let req = DraftRequest {
        request_id: format!("{session}-{request_no}"),
        prompt_token_ids: seq.iter().map(|&t| t as i32).collect(),
        max_draft_len: widths.len() as i32,
        num_beams: widths.first().copied().unwrap_or(1) as i32,
        temperature: Some(cfg.temperature),
        reset_cache: false,
        session_id: session.to_string(),
        tree_widths: widths.iter().map(|&w| w as i32).collect(),
        sampling: Some(cfg.sampling()),
        session_secret: secret.to_string(),
        outcomes,
    };
    let t0 = Instant::now();
    let mut req = tonic::Request::new(req);
    req.set_timeout(until.saturating_duration_since(t0));
    let mut d = draft.clone();
    let r = o
        .lane
        .rt
        .in_flight(d.generate_drafts(req))
        .await
        .map_err(rpc("draft"))?
        .into_inner();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    o.lane
        .rt
        .observe_device(r.telemetry.as_ref().map(|t| t.device.as_str()));
    let server = ServerTimes::of(r.telemetry.as_ref());
    let bad = |e| OrchestratorError::Protocol(format!("draft worker sent a bad tree: {e}"));
    // An answer to an outcome set carries its trees as pre-drafts only; a pre-draft whose
    // candidate ends the sequence has none, and a model-free draft worker answers no tree
    // where it finds nothing to continue.
    let parse = |nodes: &[specsplit_proto::TokenNode], root| {
        if nodes.is_empty() {
            return Ok(TokenTree::new());
        }
        TokenTree::from_proto(nodes, root, r.siblings_without_replacement, limits).map_err(bad)
    };
    let tree = parse(&r.draft_tree, r.root_distribution.as_ref())?;
    let mut predrafts = Vec::with_capacity(r.predrafts.len());
    for p in &r.predrafts {
        let t = parse(&p.draft_tree, p.root_distribution.as_ref())?;
        if p.accepted_length < 0 || p.token_id < 0 || p.token_id as usize >= o.vocab_size {
            return Err(OrchestratorError::Protocol(format!(
                "draft worker sent a pre-draft for an impossible outcome ({}, {})",
                p.accepted_length, p.token_id
            )));
        }
        predrafts.push((p.accepted_length as usize, p.token_id as u32, t));
    }
    Ok(DraftAnswer {
        tree,
        predrafts,
        ms,
        sent: t0,
        server,
    })
}
