//! A worker's Prometheus metrics: calls and errors by RPC, their latency, the sessions and KV
//! memory held against the budget, and on the target the speculative-decoding counters under
//! vLLM's names (`spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
//! `spec_decode_num_accepted_tokens`, `spec_decode_num_accepted_tokens_per_pos`) with the
//! prefix `specsplit_` instead of `vllm:`.
//!
//! Every name starts `specsplit_`. Rendered as OpenMetrics text, which Prometheus scrapes (a
//! counter's samples end in `_total`).

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The content type of [`WorkerMetrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of a sample: name and value pairs.
type Labels = Vec<(&'static str, String)>;

/// A histogram constructor (latency buckets from 0.25 ms to about 16 s).
type NewHistogram = fn() -> Histogram;

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 17))
}

/// The speculative-decoding counters of a target, named as vLLM names them.
struct SpecCounters {
    model: Labels,
    drafts: Family<Labels, Counter>,
    draft_tokens: Family<Labels, Counter>,
    accepted_tokens: Family<Labels, Counter>,
    accepted_per_pos: Family<Labels, Counter>,
    /// Sessions in the model pass of each verification.
    pass_sessions: Histogram,
}

/// One worker's metrics, recorded by its gRPC service and rendered for `/metrics`.
pub struct WorkerMetrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    latency: Family<Labels, Histogram, NewHistogram>,
    sessions: Gauge,
    anonymous: Gauge,
    kv_used: Gauge,
    kv_budget: Gauge,
    /// A draft worker's: sessions in the largest level pass of each drafted tree.
    draft_pass_sessions: Option<Histogram>,
    spec: Option<SpecCounters>,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// The metrics of a worker serving `model`; `speculative` adds the target's
    /// speculative-decoding counters.
    pub fn new(model: &str, speculative: bool) -> Self {
        let mut registry = Registry::with_prefix("specsplit");
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "rpc_requests",
            "gRPC calls answered, by RPC",
            requests.clone(),
        );
        let errors = Family::<Labels, Counter>::default();
        registry.register(
            "rpc_errors",
            "gRPC calls answered with an error, by RPC and status code",
            errors.clone(),
        );
        let latency =
            Family::<Labels, Histogram, NewHistogram>::new_with_constructor(latency_histogram);
        registry.register(
            "rpc_duration_seconds",
            "Time to answer a gRPC call (a draft pass, a verification), by RPC",
            latency.clone(),
        );
        let sessions = Gauge::default();
        registry.register(
            "sessions",
            "Named sessions held (their KV caches kept between calls)",
            sessions.clone(),
        );
        let anonymous = Gauge::default();
        registry.register(
            "anonymous_requests",
            "Sessionless requests in flight",
            anonymous.clone(),
        );
        let kv_used = Gauge::default();
        registry.register(
            "kv_cache_used_bytes",
            "KV-cache memory held by sessions and requests in flight",
            kv_used.clone(),
        );
        let kv_budget = Gauge::default();
        registry.register(
            "kv_cache_budget_bytes",
            "The memory budget of all session caches (memory_budget_mb)",
            kv_budget.clone(),
        );
        let draft_pass_sessions = (!speculative).then(|| {
            let h = Histogram::new(exponential_buckets(1.0, 2.0, 8));
            registry.register(
                "draft_pass_sessions",
                "Sessions in the largest level pass of each drafted tree (1: alone)",
                h.clone(),
            );
            h
        });
        let spec = speculative.then(|| {
            let s = SpecCounters {
                model: vec![("model_name", model.to_string())],
                drafts: Family::default(),
                draft_tokens: Family::default(),
                accepted_tokens: Family::default(),
                accepted_per_pos: Family::default(),
                pass_sessions: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            };
            registry.register(
                "verify_pass_sessions",
                "Sessions whose rows shared the model pass of each verification (1: alone)",
                s.pass_sessions.clone(),
            );
            registry.register(
                "spec_decode_num_drafts",
                "Draft trees verified (vLLM: vllm:spec_decode_num_drafts)",
                s.drafts.clone(),
            );
            registry.register(
                "spec_decode_num_draft_tokens",
                "Draft tokens verified, every node of a tree (vLLM: \
                 vllm:spec_decode_num_draft_tokens)",
                s.draft_tokens.clone(),
            );
            registry.register(
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted (vLLM: vllm:spec_decode_num_accepted_tokens)",
                s.accepted_tokens.clone(),
            );
            registry.register(
                "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each depth of the accepted path, from 0 (vLLM: \
                 vllm:spec_decode_num_accepted_tokens_per_pos)",
                s.accepted_per_pos.clone(),
            );
            s
        });
        Self {
            registry,
            requests,
            errors,
            latency,
            sessions,
            anonymous,
            kv_used,
            kv_budget,
            draft_pass_sessions,
            spec,
        }
    }

    /// Records one answered call of `rpc` that took `elapsed`, with its error if it failed.
    pub fn observe(&self, rpc: &'static str, elapsed: Duration, error: Option<&tonic::Status>) {
        let labels = vec![("rpc", rpc.to_string())];
        self.requests.get_or_create(&labels).inc();
        self.latency
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        if let Some(status) = error {
            let labels = vec![
                ("rpc", rpc.to_string()),
                ("code", format!("{:?}", status.code())),
            ];
            self.errors.get_or_create(&labels).inc();
        }
    }

    /// Records one verified draft tree of `draft_tokens` nodes of which `accepted` were
    /// accepted (a path from the root); a call without a tree records nothing.
    pub fn observe_verification(&self, draft_tokens: usize, accepted: usize) {
        let Some(s) = &self.spec else { return };
        if draft_tokens == 0 {
            return;
        }
        s.drafts.get_or_create(&s.model).inc();
        s.draft_tokens
            .get_or_create(&s.model)
            .inc_by(draft_tokens as u64);
        s.accepted_tokens
            .get_or_create(&s.model)
            .inc_by(accepted as u64);
        for pos in 0..accepted {
            let mut labels = s.model.clone();
            labels.push(("position", pos.to_string()));
            s.accepted_per_pos.get_or_create(&labels).inc();
        }
    }

    /// Records one drafted tree whose largest level pass held `sessions` sessions (a draft
    /// worker's; others keep no such count).
    pub fn observe_draft_pass_sessions(&self, sessions: usize) {
        if let Some(h) = &self.draft_pass_sessions {
            h.observe(sessions as f64);
        }
    }

    /// Records one verification whose rows ran in a model pass of `sessions` sessions.
    pub fn observe_pass_sessions(&self, sessions: usize) {
        if let Some(s) = &self.spec {
            s.pass_sessions.observe(sessions as f64);
        }
    }

    /// The metrics as OpenMetrics text, the session gauges set to `usage`.
    pub fn render(&self, usage: StoreUsage) -> String {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.sessions.set(gauge(usage.sessions));
        self.anonymous.set(gauge(usage.anonymous));
        self.kv_used.set(gauge(usage.kv_used_bytes));
        self.kv_budget.set(gauge(usage.kv_budget_bytes));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// What a worker's session store holds, for the gauges.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreUsage {
    /// Named sessions held.
    pub sessions: usize,
    /// Sessionless requests in flight.
    pub anonymous: usize,
    /// KV-cache bytes held by both.
    pub kv_used_bytes: usize,
    /// The memory budget, in bytes.
    pub kv_budget_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifications_count_like_vllm_and_errors_by_code() {
        let m = WorkerMetrics::new("tiny", true);
        m.observe("VerifyDrafts", Duration::from_millis(3), None);
        m.observe(
            "VerifyDrafts",
            Duration::from_millis(1),
            Some(&tonic::Status::invalid_argument("x")),
        );
        m.observe_verification(5, 2);
        m.observe_verification(3, 1);
        m.observe_verification(0, 0);
        let text = m.render(StoreUsage {
            sessions: 2,
            anonymous: 0,
            kv_used_bytes: 1024,
            kv_budget_bytes: 4096,
        });
        for line in [
            "specsplit_rpc_requests_total{rpc=\"VerifyDrafts\"} 2",
            "specsplit_rpc_errors_total{rpc=\"VerifyDrafts\",code=\"InvalidArgument\"} 1",
            "specsplit_rpc_duration_seconds_count{rpc=\"VerifyDrafts\"} 2",
            "specsplit_spec_decode_num_drafts_total{model_name=\"tiny\"} 2",
            "specsplit_spec_decode_num_draft_tokens_total{model_name=\"tiny\"} 8",
            "specsplit_spec_decode_num_accepted_tokens_total{model_name=\"tiny\"} 3",
            "specsplit_spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"0\"} 2",
            "specsplit_spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"1\"} 1",
            "specsplit_sessions 2",
            "specsplit_kv_cache_used_bytes 1024",
            "specsplit_kv_cache_budget_bytes 4096",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        let draft = WorkerMetrics::new("tiny", false);
        draft.observe_verification(5, 2);
        assert!(!draft.render(StoreUsage::default()).contains("spec_decode"));
    }
}
