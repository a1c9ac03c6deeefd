//! The server's Prometheus metrics: HTTP requests by endpoint and status, errors, requests
//! running and waiting, token counts, time to first token and per output token, and the
//! speculative-decoding counters seen from the orchestrator (from each generation's round
//! records), under vLLM's names with the prefix `specsplit_` in place of `vllm:`, as the
//! workers' metrics are named.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use specsplit_orchestrator::RoundRecord;

/// The content type of [`ServerMetrics::render`]'s text (OpenMetrics, which Prometheus scrapes).
pub use specsplit_workers::metrics::CONTENT_TYPE;

/// Labels of a sample: name and value pairs.
type Labels = Vec<(&'static str, String)>;

/// A histogram constructor.
type NewHistogram = fn() -> Histogram;

/// vLLM's buckets of `time_to_first_token_seconds`.
fn ttft_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ])
}

/// vLLM's buckets of `time_per_output_token_seconds`.
fn tpot_histogram() -> Histogram {
    Histogram::new([
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ])
}

/// The server's metrics, recorded by its handlers and generations and rendered for `/metrics`.
pub struct ServerMetrics {
    registry: Registry,
    /// `model_name`, the label of every vLLM-named metric.
    model: Labels,
    http_requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    success: Family<Labels, Counter>,
    running: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    prompt_tokens: Family<Labels, Counter>,
    generation_tokens: Family<Labels, Counter>,
    ttft: Family<Labels, Histogram, NewHistogram>,
    tpot: Family<Labels, Histogram, NewHistogram>,
    drafts: Family<Labels, Counter>,
    draft_tokens: Family<Labels, Counter>,
    accepted_tokens: Family<Labels, Counter>,
    accepted_per_pos: Family<Labels, Counter>,
    drafter_rounds: Family<Labels, Counter>,
    drafter_tokens: Family<Labels, Counter>,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").finish_non_exhaustive()
    }
}

impl ServerMetrics {
    /// The metrics of a server serving `model`.
    pub fn new(model: &str) -> Self {
        let mut r = Registry::with_prefix("specsplit");
        let http_requests = Family::<Labels, Counter>::default();
        r.register(
            "http_requests",
            "HTTP requests answered, by endpoint and status code",
            http_requests.clone(),
        );
        let errors = Family::<Labels, Counter>::default();
        r.register(
            "http_request_errors",
            "HTTP requests that failed, by endpoint and status code: answered with 4xx or 5xx, \
             or failed after a stream began (then the status the error would have had)",
            errors.clone(),
        );
        let success = Family::<Labels, Counter>::default();
        r.register(
            "request_success",
            "Generations finished, by finish reason (vLLM: vllm:request_success)",
            success.clone(),
        );
        let running = Family::<Labels, Gauge>::default();
        r.register(
            "num_requests_running",
            "Generations running (vLLM: vllm:num_requests_running)",
            running.clone(),
        );
        let waiting = Family::<Labels, Gauge>::default();
        r.register(
            "num_requests_waiting",
            "Generations waiting for one of max_concurrent to end (vLLM: vllm:num_requests_waiting)",
            waiting.clone(),
        );
        let prompt_tokens = Family::<Labels, Counter>::default();
        r.register(
            "prompt_tokens",
            "Prompt tokens of the generations run (vLLM: vllm:prompt_tokens)",
            prompt_tokens.clone(),
        );
        let generation_tokens = Family::<Labels, Counter>::default();
        r.register(
            "generation_tokens",
            "Tokens generated, as the responses' usage counts them (vLLM: vllm:generation_tokens)",
            generation_tokens.clone(),
        );
        let ttft = Family::<Labels, Histogram, NewHistogram>::new_with_constructor(ttft_histogram);
        r.register(
            "time_to_first_token_seconds",
            "Time from a request's arrival, its wait for a turn included, to its first generated \
             token (vLLM: vllm:time_to_first_token_seconds)",
            ttft.clone(),
        );
        let tpot = Family::<Labels, Histogram, NewHistogram>::new_with_constructor(tpot_histogram);
        r.register(
            "time_per_output_token_seconds",
            "Mean time per generated token after the first, one sample per generation of two \
             tokens or more (vLLM: vllm:time_per_output_token_seconds)",
            tpot.clone(),
        );
        let drafts = Family::<Labels, Counter>::default();
        r.register(
            "spec_decode_num_drafts",
            "Draft trees verified (vLLM: vllm:spec_decode_num_drafts)",
            drafts.clone(),
        );
        let draft_tokens = Family::<Labels, Counter>::default();
        r.register(
            "spec_decode_num_draft_tokens",
            "Draft tokens verified, every node of a tree (vLLM: vllm:spec_decode_num_draft_tokens)",
            draft_tokens.clone(),
        );
        let accepted_tokens = Family::<Labels, Counter>::default();
        r.register(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted (vLLM: vllm:spec_decode_num_accepted_tokens)",
            accepted_tokens.clone(),
        );
        let accepted_per_pos = Family::<Labels, Counter>::default();
        r.register(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each depth of the accepted path, from 0 (vLLM: \
             vllm:spec_decode_num_accepted_tokens_per_pos)",
            accepted_per_pos.clone(),
        );
        let drafter_rounds = Family::<Labels, Counter>::default();
        r.register(
            "drafter_rounds",
            "Rounds by the drafter that proposed their tree (`none`: target-only rounds), the \
             online choice's picks among them",
            drafter_rounds.clone(),
        );
        let drafter_tokens = Family::<Labels, Counter>::default();
        r.register(
            "drafter_emitted_tokens",
            "Tokens emitted by the rounds of each drafter (accepted and the target's own)",
            drafter_tokens.clone(),
        );
        let model = vec![("model_name", model.to_string())];
        // The gauges show 0 before the first request.
        let _ = running.get_or_create(&model);
        let _ = waiting.get_or_create(&model);
        Self {
            registry: r,
            model,
            http_requests,
            errors,
            success,
            running,
            waiting,
            prompt_tokens,
            generation_tokens,
            ttft,
            tpot,
            drafts,
            draft_tokens,
            accepted_tokens,
            accepted_per_pos,
            drafter_rounds,
            drafter_tokens,
        }
    }

    /// Records an HTTP answer of `status` to a request for `endpoint`.
    pub fn observe_http(&self, endpoint: &'static str, status: u16) {
        let labels = vec![
            ("endpoint", endpoint.to_string()),
            ("status", status.to_string()),
        ];
        self.http_requests.get_or_create(&labels).inc();
        if status >= 400 {
            self.errors.get_or_create(&labels).inc();
        }
    }

    /// Records a generation that failed after its stream began (its HTTP status was 200).
    pub fn observe_stream_error(&self, endpoint: &'static str, status: u16) {
        let labels = vec![
            ("endpoint", endpoint.to_string()),
            ("status", status.to_string()),
        ];
        self.errors.get_or_create(&labels).inc();
    }

    /// A generation now waits for its turn; it counts as waiting until the guard is dropped.
    pub fn waiting(&self) -> GaugeGuard {
        GaugeGuard::new(self.waiting.get_or_create(&self.model).clone())
    }

    /// A generation now runs; it counts as running until the guard is dropped.
    pub fn running(&self) -> GaugeGuard {
        GaugeGuard::new(self.running.get_or_create(&self.model).clone())
    }

    /// Records the first token of a generation, `since` its request arrived.
    pub fn observe_first_token(&self, since: Duration) {
        self.ttft
            .get_or_create(&self.model)
            .observe(since.as_secs_f64());
    }

    /// Records a generation that ended with `finish_reason` after `prompt` prompt tokens and
    /// `generated` new ones, the last `after_first` after the first, and its round records.
    pub fn observe_generation(
        &self,
        finish_reason: &str,
        prompt: usize,
        generated: usize,
        after_first: Duration,
        rounds: &[RoundRecord],
    ) {
        let m = &self.model;
        let mut labels = m.clone();
        labels.push(("finished_reason", finish_reason.to_string()));
        self.success.get_or_create(&labels).inc();
        self.prompt_tokens.get_or_create(m).inc_by(prompt as u64);
        self.generation_tokens
            .get_or_create(m)
            .inc_by(generated as u64);
        if generated >= 2 {
            self.tpot
                .get_or_create(m)
                .observe(after_first.as_secs_f64() / (generated - 1) as f64);
        }
        for r in rounds {
            let mut labels = m.clone();
            labels.push(("drafter", r.drafter.name().to_string()));
            self.drafter_rounds.get_or_create(&labels).inc();
            self.drafter_tokens
                .get_or_create(&labels)
                .inc_by(r.emitted.len() as u64);
        }
        for r in rounds.iter().filter(|r| r.tree_nodes > 0) {
            self.drafts.get_or_create(m).inc();
            self.draft_tokens
                .get_or_create(m)
                .inc_by(r.tree_nodes as u64);
            self.accepted_tokens
                .get_or_create(m)
                .inc_by(r.accepted as u64);
            for pos in 0..r.accepted {
                let mut labels = m.clone();
                labels.push(("position", pos.to_string()));
                self.accepted_per_pos.get_or_create(&labels).inc();
            }
        }
    }

    /// The metrics as OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Holds a gauge one higher while it lives.
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn new(g: Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specsplit_orchestrator::Drafter;

    #[test]
    fn generations_count_tokens_and_draft_trees_like_vllm() {
        let m = ServerMetrics::new("tiny");
        let round = |tree_nodes, accepted| RoundRecord {
            tree_nodes,
            accepted,
            emitted: vec![1; accepted + 1],
            drafter: if tree_nodes > 0 {
                Drafter::Ngram
            } else {
                Drafter::None
            },
            ..RoundRecord::default()
        };
        let rounds = [round(5, 2), round(0, 0), round(3, 1)];
        m.observe_generation("length", 7, 5, Duration::from_millis(40), &rounds);
        m.observe_http("/v1/completions", 200);
        m.observe_http("/v1/completions", 401);
        {
            let _running = m.running();
            assert!(m
                .render()
                .lines()
                .any(|l| l == "specsplit_num_requests_running{model_name=\"tiny\"} 1"));
        }
        let text = m.render();
        for line in [
            "specsplit_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
            "specsplit_http_requests_total{endpoint=\"/v1/completions\",status=\"401\"} 1",
            "specsplit_http_request_errors_total{endpoint=\"/v1/completions\",status=\"401\"} 1",
            "specsplit_request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1",
            "specsplit_prompt_tokens_total{model_name=\"tiny\"} 7",
            "specsplit_generation_tokens_total{model_name=\"tiny\"} 5",
            "specsplit_time_per_output_token_seconds_count{model_name=\"tiny\"} 1",
            "specsplit_num_requests_running{model_name=\"tiny\"} 0",
            "specsplit_spec_decode_num_drafts_total{model_name=\"tiny\"} 2",
            "specsplit_spec_decode_num_draft_tokens_total{model_name=\"tiny\"} 8",
            "specsplit_spec_decode_num_accepted_tokens_total{model_name=\"tiny\"} 3",
            "specsplit_spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"0\"} 2",
            "specsplit_spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"1\"} 1",
            "specsplit_drafter_rounds_total{model_name=\"tiny\",drafter=\"ngram\"} 2",
            "specsplit_drafter_rounds_total{model_name=\"tiny\",drafter=\"none\"} 1",
            "specsplit_drafter_emitted_tokens_total{model_name=\"tiny\",drafter=\"ngram\"} 5",
            "specsplit_drafter_emitted_tokens_total{model_name=\"tiny\",drafter=\"none\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }
}
