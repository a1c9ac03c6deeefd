//! Generations for HTTP requests: a request's settings checked against the defaults and the
//! target's limits, and the generation run in a task of its own that streams text pieces,
//! cut at stop strings, and ends with the finish reason and token counts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use specsplit_models::tokenizer::TextTokenizer;
use specsplit_orchestrator::{GenerateConfig, Orchestrator, OrchestratorError, StopReason};
use tokio::sync::{mpsc, Semaphore};
use tonic::Code;

use super::metrics::ServerMetrics;
use super::openai::{ApiError, Sampling, Usage};
use crate::stop::StopText;

/// Most stop strings a request may give (as OpenAI's API).
const MAX_STOPS: usize = 4;
/// Longest stop string, in bytes.
const MAX_STOP_BYTES: usize = 1024;
/// Most new tokens a request may ask for where the target reports no context size.
const MAX_TOKENS_UNBOUNDED: usize = 1 << 20;

/// What every request shares: the orchestrator, the tokenizer and the default settings.
pub struct Server {
    /// The orchestrator (its clones share the channels to the workers).
    pub orch: Orchestrator,
    /// The tokenizer of the target's model.
    pub tokenizer: TextTokenizer,
    /// Settings of a generation where a request does not say.
    pub defaults: GenerateConfig,
    /// The model id clients name.
    pub model: String,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// The server's metrics.
    pub metrics: Arc<ServerMetrics>,
    /// Generations that may run at once.
    permits: Arc<Semaphore>,
    /// Numbers request ids.
    next_id: AtomicU64,
}

/// A request ready to run: its prompt's tokens, settings and stop strings.
pub struct Job {
    prompt: Vec<u32>,
    cfg: GenerateConfig,
    stops: Vec<String>,
}

/// A generated token's text and the target's log-probability of it.
#[derive(Debug, Clone)]
pub struct Scored {
    /// The token decoded on its own.
    pub token: String,
    /// Its natural-log probability under the target model.
    pub logprob: f32,
}

/// What a running generation sends.
pub enum Event {
    /// The next piece of text and, when asked for, the scores of the tokens generated since the
    /// last piece (the text may lag behind them while a possible stop string is held back).
    Piece {
        /// Text safe to send.
        text: String,
        /// The tokens' scores.
        scored: Vec<Scored>,
    },
    /// The generation ended.
    Done {
        /// `stop` (an end token or a stop string) or `length`.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed.
    Failed(ApiError),
}

impl Server {
    /// A server for `orch`, allowing `max_concurrent` generations at once.
    pub fn new(
        orch: Orchestrator,
        tokenizer: TextTokenizer,
        defaults: GenerateConfig,
        model: String,
        max_concurrent: usize,
        max_body_bytes: usize,
    ) -> Self {
        let metrics = Arc::new(ServerMetrics::new(&model));
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        Self {
            orch,
            tokenizer,
            defaults,
            model,
            created,
            max_body_bytes,
            metrics,
            permits: Arc::new(Semaphore::new(max_concurrent.max(1))),
            next_id: AtomicU64::new(0),
        }
    }

    /// A fresh response id with `prefix`, e.g. `cmpl-…`.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }

    /// Refuses a model other than the one served.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.model {
            Ok(())
        } else {
            Err(ApiError::unknown_model(model, &self.model))
        }
    }

    /// Tokenizes `text` (`special`: add the model's BOS where its tokenizer asks for one).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text, special)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}"), None))
    }

    /// Checks a request's prompt and settings against the defaults and the target's limits.
    pub fn job(
        &self,
        prompt: Vec<u32>,
        sampling: &mut Sampling,
        prompt_param: &'static str,
        logprobs: bool,
    ) -> Result<Job, ApiError> {
        if sampling.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
        }
        if prompt.is_empty() {
            return Err(ApiError::bad_request(
                "the prompt holds no tokens",
                Some(prompt_param),
            ));
        }
        let vocab = self.orch.vocab_size();
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(
                format!("token id {bad} is outside the vocabulary of {vocab} tokens"),
                Some(prompt_param),
            ));
        }
        if let Some(limit) = self.orch.max_prompt_len() {
            if prompt.len() > limit {
                return Err(ApiError::bad_request(
                    format!(
                        "the prompt has {} tokens; this model accepts at most {limit}",
                        prompt.len()
                    ),
                    Some(prompt_param),
                ));
            }
        }
        let mut cfg = self.defaults.clone();
        cfg.logprobs = logprobs;
        let asked = sampling.max_completion_tokens.or(sampling.max_tokens);
        let max_tokens = match asked {
            Some(0) => {
                return Err(ApiError::bad_request(
                    "max_tokens must be at least 1",
                    Some("max_tokens"),
                ))
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => cfg.max_tokens,
        };
        let context = self.orch.max_context().unwrap_or(MAX_TOKENS_UNBOUNDED);
        if prompt.len().saturating_add(max_tokens) > context {
            // Without an explicit max_tokens, the default is cut to what the context holds.
            if asked.is_some() || prompt.len() >= context {
                return Err(ApiError::bad_request(
                    format!(
                        "This model's maximum context length is {context} tokens. However, you \
                         requested {} tokens ({} in the prompt, {max_tokens} in the completion).",
                        prompt.len().saturating_add(max_tokens),
                        prompt.len()
                    ),
                    Some("max_tokens"),
                ));
            }
            cfg.max_tokens = context - prompt.len();
        } else {
            cfg.max_tokens = max_tokens;
        }
        if let Some(t) = sampling.temperature {
            cfg.temperature = t;
        }
        if let Some(p) = sampling.top_p {
            cfg.top_p = p;
        }
        if let Some(k) = sampling.top_k {
            cfg.top_k = usize::try_from(k).unwrap_or(0);
        }
        if let Some(seed) = sampling.seed {
            // 0 means "random" to the orchestrator; a request's seed 0 is a seed like any.
            cfg.seed = match seed as u64 {
                0 => 0x9e37_79b9_7f4a_7c15,
                s => s,
            };
        }
        cfg.validate().map_err(|e| ApiError::bad_request(e, None))?;
        let stops = sampling
            .stop
            .take()
            .map(|s| s.into_vec())
            .unwrap_or_default();
        if stops.len() > MAX_STOPS {
            return Err(ApiError::bad_request(
                format!("at most {MAX_STOPS} stop strings are accepted"),
                Some("stop"),
            ));
        }
        if stops
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::bad_request(
                format!("a stop string must hold 1 to {MAX_STOP_BYTES} bytes"),
                Some("stop"),
            ));
        }
        Ok(Job { prompt, cfg, stops })
    }

    /// Starts `job` in a task of its own, which waits its turn among the generations that may
    /// run at once and sends its text pieces, then its end, to the receiver. A receiver that
    /// goes away stops the generation (its sessions are ended).
    pub fn start(self: &Arc<Self>, job: Job) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        let server = self.clone();
        let arrived = Instant::now();
        tokio::spawn(async move {
            let waiting = server.metrics.waiting();
            let Ok(_permit) = server.permits.clone().acquire_owned().await else {
                return;
            };
            drop(waiting);
            if tx.is_closed() {
                return;
            }
            let _running = server.metrics.running();
            let end = server.run(&job, &tx, arrived).await;
            let _ = tx.send(end);
        });
        rx
    }

    /// Runs `job`, which `arrived` then, sending its text pieces to `tx`; returns its last
    /// event.
    async fn run(&self, job: &Job, tx: &mpsc::UnboundedSender<Event>, arrived: Instant) -> Event {
        let tok = &self.tokenizer;
        let mut first_token: Option<Instant> = None;
        let mut decoder = tok.stream_decoder(true);
        let mut stop = StopText::new(&job.stops);
        let on_tokens = |ids: &[u32], logprobs: &[f32]| {
            if first_token.is_none() && !ids.is_empty() {
                let now = Instant::now();
                self.metrics.observe_first_token(now - arrived);
                first_token = Some(now);
            }
            let text = match decoder.push(tok, ids) {
                Ok(piece) => stop.push(&piece),
                Err(_) => String::new(),
            };
            let scored: Vec<Scored> = ids
                .iter()
                .zip(logprobs)
                .map(|(&id, &logprob)| Scored {
                    token: tok.decode(&[id], false).unwrap_or_default(),
                    logprob,
                })
                .collect();
            if !text.is_empty() || !scored.is_empty() {
                let _ = tx.send(Event::Piece { text, scored });
            }
            !stop.stopped() && !tx.is_closed()
        };
        let gen = match self
            .orch
            .generate_scored(&job.prompt, &job.cfg, on_tokens)
            .await
        {
            Ok(g) => g,
            Err(e) => return Event::Failed(api_error(e)),
        };
        if !stop.stopped() {
            let rest = decoder.finish(tok).unwrap_or_default();
            let mut text = stop.push(&rest);
            text.push_str(&stop.finish());
            if !text.is_empty() {
                let _ = tx.send(Event::Piece {
                    text,
                    scored: Vec::new(),
                });
            }
        }
        let finish_reason = match gen.stop_reason {
            StopReason::Eos | StopReason::Stopped => "stop",
            _ if stop.stopped() => "stop",
            StopReason::MaxTokens | StopReason::Context | StopReason::Deadline => "length",
        };
        self.metrics.observe_generation(
            finish_reason,
            job.prompt.len(),
            gen.token_ids.len(),
            first_token.map(|t| t.elapsed()).unwrap_or_default(),
            &gen.rounds,
        );
        Event::Done {
            finish_reason,
            usage: Usage::new(job.prompt.len(), gen.token_ids.len()),
        }
    }
}

/// The HTTP answer to an orchestrator's error: 503 where the workers cannot serve now, 400
/// where the request was refused, 500 otherwise.
fn api_error(e: OrchestratorError) -> ApiError {
    let message = e.to_string();
    match &e {
        OrchestratorError::Unreachable { .. } | OrchestratorError::Timeout { .. } => {
            ApiError::unavailable(message)
        }
        OrchestratorError::Rpc { status, .. } => match status.code() {
            Code::Unavailable | Code::ResourceExhausted | Code::DeadlineExceeded => {
                ApiError::unavailable(message)
            }
            Code::InvalidArgument | Code::OutOfRange => ApiError::bad_request(message, None),
            _ => ApiError::internal(message),
        },
        OrchestratorError::Config(_) => ApiError::bad_request(message, None),
        _ => ApiError::internal(message),
    }
}
