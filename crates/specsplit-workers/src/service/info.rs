//! What a worker reports and enforces: its model's identity, its limits, and the largest
//! messages those limits allow.

use std::time::{Duration, Instant};

use specsplit_proto::{PingResponse, TelemetryMetadata};

/// Wire bytes allowed for a message's fields beyond its tokens and tree (ids, sampling
/// parameters, tags and length prefixes).
const MESSAGE_SLACK_BYTES: usize = 64 << 10;

/// Wire bytes of one token id at most (an `int32` varint; negative ones take 10).
const TOKEN_WIRE_BYTES: usize = 10;

/// Wire bytes of one tree node besides its distribution (token, log-probability, nesting).
const NODE_WIRE_BYTES: usize = 64;

/// Identity and limits a worker reports and enforces.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// Name of the loaded model.
    pub model_name: String,
    /// Vocabulary size (logit rows); 0 for a model-free draft worker, which takes any token
    /// id (the orchestrator checks its trees against the target's vocabulary).
    pub vocab_size: usize,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// Tokens one session may hold.
    pub max_context: usize,
    /// Most nodes of a draft tree.
    pub max_tree_nodes: usize,
    /// Most tokens on a root-to-leaf path of a draft tree (at most
    /// [`specsplit_proto::codec::MAX_WIRE_TREE_DEPTH`]).
    pub max_tree_depth: usize,
    /// Most tokens one request may carry.
    pub max_prompt_len: usize,
    /// Device label for telemetry, e.g. "cpu" or "cuda:0".
    pub device: String,
}

impl WorkerInfo {
    /// The `Ping` answer of a worker of type `worker_type` (`draft`, `target`).
    pub(super) fn ping(&self, worker_type: &str) -> PingResponse {
        PingResponse {
            status: "ok".into(),
            worker_type: worker_type.into(),
            model_name: self.model_name.clone(),
            vocab_size: self.vocab_size as i32,
            eos_token_ids: self.eos_token_ids.iter().map(|&t| t as i32).collect(),
            max_context: self.max_context as i32,
            max_prompt_len: self.max_prompt_len as i32,
            max_tree_nodes: self.max_tree_nodes as i32,
            max_tree_depth: self.tree_depth() as i32,
        }
    }

    /// The deepest tree drafted or verified: `max_tree_depth`, within the wire's limit and
    /// the tree's node count.
    pub fn tree_depth(&self) -> usize {
        self.max_tree_depth
            .min(specsplit_proto::codec::MAX_WIRE_TREE_DEPTH)
            .min(self.max_tree_nodes)
    }

    /// Wire bytes of the largest draft tree allowed: `max_tree_nodes` nodes and a root, each
    /// with a distribution over the whole vocabulary (sparse at full support: 8 bytes an entry).
    fn tree_wire_bytes(&self) -> usize {
        (self.max_tree_nodes.saturating_add(1)).saturating_mul(
            self.vocab_size
                .saturating_mul(8)
                .saturating_add(NODE_WIRE_BYTES),
        )
    }

    /// The largest `DraftRequest` a draft worker decodes (a longer message is refused from its
    /// length prefix, before it is read): `max_prompt_len` tokens and `max_tree_depth` widths at
    /// 10 bytes each, plus 64 KiB.
    pub fn max_draft_request_bytes(&self) -> usize {
        self.max_prompt_len
            .saturating_add(self.tree_depth())
            .saturating_mul(TOKEN_WIRE_BYTES)
            .saturating_add(MESSAGE_SLACK_BYTES)
    }

    /// The largest `VerifyRequest` a target worker decodes (a longer message is refused from
    /// its length prefix, before it is read): two token lists of `max_prompt_len` (prompt and
    /// new tokens) at 10 bytes a token, `max_tree_nodes + 1` nodes of 8 bytes per vocabulary
    /// entry plus 64 each, plus 64 KiB. The largest `DraftResponse` a draft worker sends is
    /// bounded the same way.
    pub fn max_verify_request_bytes(&self) -> usize {
        self.max_prompt_len
            .saturating_mul(2 * TOKEN_WIRE_BYTES)
            .saturating_add(self.tree_wire_bytes())
            .saturating_add(MESSAGE_SLACK_BYTES)
    }

    /// The telemetry of a request that started at `start` and spent `model` in the model on
    /// `tokens` tokens (no one-off setup: the caller sets that).
    pub(super) fn telemetry(
        &self,
        start: Instant,
        model: Duration,
        tokens: usize,
    ) -> TelemetryMetadata {
        TelemetryMetadata {
            span_id: format!("{:016x}", rand::random::<u64>()),
            wall_time_ms: start.elapsed().as_secs_f64() * 1e3,
            model_time_ms: model.as_secs_f64() * 1e3,
            tokens_processed: tokens as i32,
            device: self.device.clone(),
            one_off_setup: false,
        }
    }
}
