//! Verification of a round's tree by the target: by delta while the target holds the session,
//! with the full sequence otherwise, retried while the target is unreachable.

use std::time::{Duration, Instant};

use specsplit_core::tree::TokenTree;
use specsplit_proto::convert::TreeWire;
use specsplit_proto::VerifyRequest;
use tonic::Code;

use super::Run;
use crate::client::error::{rpc, short};
use crate::client::tree::path_of_tokens;
use crate::client::worker::ServerTimes;
use crate::client::OrchestratorError;

/// How long to keep retrying a worker that is unreachable mid-generation (e.g. restarting).
const RECONNECT_WINDOW: Duration = Duration::from_secs(30);

/// The target's answer to a round's verify request, and how long the request took.
pub(super) struct Verdict {
    /// The answer.
    pub(super) verified: Verified,
    /// The request's wall time as the client saw it.
    pub(super) ms: f64,
    /// When the request was sent.
    pub(super) sent: Instant,
    /// The times the target reported for it.
    pub(super) server: ServerTimes,
}

impl Run<'_> {
    /// Verifies `tree`, by delta when the target holds the session, else with the full
    /// sequence; a lost session or a restarted target gets the full sequence again. `None`
    /// when the generation's deadline passed first. `draft_one_off_setup`: drafting the tree
    /// included one-off setup (told to the target's load gate).
    pub(super) async fn verify(
        &mut self,
        tree: &TokenTree,
        draft_one_off_setup: bool,
    ) -> Result<Option<Verdict>, OrchestratorError> {
        // Built once; only a retry builds it again.
        let mut wire = Some(tree.to_proto());
        let give_up = Instant::now() + RECONNECT_WINDOW;
        let mut backoff = Duration::from_millis(50);
        let rpc_timeout = Duration::from_millis(self.cfg.rpc_timeout_ms);
        loop {
            let (draft_tree, root_distribution) = wire.take().unwrap_or_else(|| tree.to_proto());
            let mut req = VerifyRequest {
                request_id: format!("{}-{}", self.session, self.request_no),
                session_id: self.session.to_string(),
                draft_tree,
                root_distribution,
                siblings_without_replacement: tree.siblings_without_replacement(),
                temperature: self.cfg.temperature,
                sampling: Some(self.cfg.sampling()),
                session_secret: self.secret.to_string(),
                return_logprobs: self.cfg.logprobs,
                draft_one_off_setup,
                draft_depth_limit: self.depth_limit(),
                ..Default::default()
            };
            self.request_no += 1;
            match self.target_cached {
                Some(len) => {
                    req.new_token_ids = self.pending.iter().map(|&t| t as i32).collect();
                    req.expected_prefix_length = len as i32;
                }
                None => req.prompt_token_ids = self.seq.iter().map(|&t| t as i32).collect(),
            }
            let t0 = Instant::now();
            let mut target = self.o.lane.target.clone();
            let until = self.bounded(t0 + rpc_timeout);
            let call = self.o.lane.rt.in_flight(target.verify_drafts(req));
            let answer = match tokio::time::timeout_at(until.into(), call).await {
                Ok(a) => a,
                Err(_) if self.past_deadline() => return Ok(None),
                Err(_) if Instant::now() < give_up => {
                    tracing::warn!(
                        addr = %self.o.target_addr,
                        "target did not answer within {} ms; retrying",
                        self.cfg.rpc_timeout_ms
                    );
                    // The request may or may not have reached the session.
                    self.target_cached = None;
                    continue;
                }
                Err(_) => {
                    return Err(OrchestratorError::Timeout {
                        worker: "target",
                        after_ms: self.cfg.rpc_timeout_ms,
                    })
                }
            };
            match answer {
                Ok(r) => {
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    let r = r.into_inner();
                    self.o
                        .lane
                        .rt
                        .observe_device(r.telemetry.as_ref().map(|t| t.device.as_str()));
                    let server = ServerTimes::of(r.telemetry.as_ref());
                    return Ok(Some(Verdict {
                        verified: Verified::from_response(&r, tree, self.cfg.logprobs)?,
                        ms,
                        sent: t0,
                        server,
                    }));
                }
                Err(s) if s.code() == Code::FailedPrecondition && self.target_cached.is_some() => {
                    tracing::warn!(
                        "target lost the session ({}); resending the full context",
                        short(s.message())
                    );
                    tracing::debug!(session = self.session, "session lost on the target");
                    self.target_cached = None;
                }
                Err(s)
                    if matches!(s.code(), Code::Unavailable | Code::Unknown)
                        && Instant::now() < give_up =>
                {
                    tracing::warn!(addr = %self.o.target_addr, "target unavailable ({}); retrying", short(s.message()));
                    tokio::time::sleep_until(self.bounded(Instant::now() + backoff).into()).await;
                    if self.past_deadline() {
                        return Ok(None);
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    // A restarted target holds no session: start over with the full context.
                    self.target_cached = None;
                }
                Err(s) => return Err(rpc("target")(s)),
            }
        }
    }
}

/// A verdict as received.
pub(super) struct Verified {
    /// The accepted tokens of the tree, root first.
    pub(super) accepted: Vec<u32>,
    /// Their nodes in the tree.
    pub(super) accepted_nodes: Vec<usize>,
    /// The target's own token after them.
    pub(super) next: u32,
    /// How many tokens of the sequence the target's session now caches.
    pub(super) cached_len: usize,
    /// The target's log-probability of each accepted token, then of `next` (when asked for).
    pub(super) logprobs: Vec<f32>,
    /// The deepest draft the target asks the next round to use, from its load (`None`: no
    /// advice).
    pub(super) advised_depth: Option<usize>,
}

impl Verified {
    /// The verdict in `r` on `tree`; the accepted path is recovered from the tokens where the
    /// target sent no node indices. With `logprobs` the target must have sent one per token.
    fn from_response(
        r: &specsplit_proto::VerifyResponse,
        tree: &TokenTree,
        logprobs: bool,
    ) -> Result<Self, OrchestratorError> {
        let accepted: Vec<u32> = r.accepted_token_ids.iter().map(|&t| t as u32).collect();
        let accepted_nodes: Vec<usize> = if r.accepted_node_indices.len() == accepted.len() {
            r.accepted_node_indices
                .iter()
                .map(|&i| i as usize)
                .collect()
        } else {
            // A peer without node indices: recover the path by walking the tree.
            path_of_tokens(tree, &accepted).ok_or_else(|| {
                OrchestratorError::Protocol("accepted tokens are not a path of the tree".into())
            })?
        };
        if !r.has_correction {
            return Err(OrchestratorError::Protocol(
                "the target returned no next token".into(),
            ));
        }
        if logprobs && r.token_logprobs.len() != accepted.len() + 1 {
            return Err(OrchestratorError::Protocol(format!(
                "the target sent {} token log-probabilities for {} tokens (a target that \
                 predates them sends none)",
                r.token_logprobs.len(),
                accepted.len() + 1
            )));
        }
        Ok(Self {
            accepted,
            accepted_nodes,
            next: r.correction_token_id as u32,
            cached_len: r.cached_length.max(0) as usize,
            logprobs: r.token_logprobs.clone(),
            advised_depth: r.max_draft_depth.map(|d| d.max(0) as usize),
        })
    }
}
