//! The orchestrator: gRPC clients of the two workers, on a client runtime of their own, and
//! generations run round by round against them.

mod advice;
mod error;
mod options;
mod round;
mod runtime;
mod tree;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use specsplit_core::drafter::suffix::{SharedSuffixStore, SuffixConfig, SuffixStore};
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{EndSessionRequest, PingRequest};

pub use error::OrchestratorError;
pub use options::{default_client_threads, AuthToken, ClientTls, ConnectOptions};
pub use runtime::ClientSpin;

use crate::{GenerateConfig, Generation, Mode};
use round::Run;
use runtime::ClientRuntime;
use worker::{channel, known, ping, Link, WorkerLimits, MAX_MESSAGE_BYTES};

/// The most client threads an orchestrator runs ([`ConnectOptions::client_threads`]).
pub const MAX_CLIENT_THREADS: usize = 64;

/// How long ending a session may take (best effort, after the generation's result is known).
const END_SESSION_TIMEOUT: Duration = Duration::from_millis(500);

/// One client runtime and its own channels to the workers.
struct Lane {
    draft: Option<DraftServiceClient<Link>>,
    target: TargetServiceClient<Link>,
    /// Generations running on it.
    live: std::sync::atomic::AtomicUsize,
    /// Dropped after the channels (fields drop in order), though either order is safe.
    rt: Arc<ClientRuntime>,
}

impl Lane {
    /// A new client runtime with its own channels to the workers, connected on it (so that
    /// the channels' tasks run there).
    async fn connect(
        draft_addr: Option<&str>,
        target_addr: &str,
        opts: &ConnectOptions,
    ) -> Result<Lane, OrchestratorError> {
        let rt = ClientRuntime::start(opts.spin)?;
        let (draft, target, o) = (
            draft_addr.map(str::to_string),
            target_addr.to_string(),
            opts.clone(),
        );
        let (draft, target) = rt
            .spawn(async move {
                let t = target_client(channel("target", &target, &o).await?);
                let d = match draft {
                    Some(addr) => Some(draft_client(channel("draft", &addr, &o).await?)),
                    None => None,
                };
                Ok((d, t))
            })
            .join()
            .await?;
        Ok(Lane {
            draft,
            target,
            live: Default::default(),
            rt,
        })
    }
}

/// Counts a generation live on its lane until dropped.
struct OnLane(Arc<Lane>);

impl Drop for OnLane {
    fn drop(&mut self) {
        self.0
            .live
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The index of the lane with the fewest live generations, given each lane's count (the
/// first of those tied; 0 for none).
fn least_busy(live: impl IntoIterator<Item = usize>) -> usize {
    live.into_iter()
        .enumerate()
        .min_by_key(|&(i, n)| (n, i))
        .map_or(0, |(i, _)| i)
}

/// A connection to a target worker and, for speculative decoding, a draft worker.
///
/// Its gRPC channels and its generations' round loops run on current-thread runtimes, each on
/// a thread of its own with its own channels (see [`ClientRuntime`],
/// [`ConnectOptions::client_threads`]); a generation runs on the one with the fewest live
/// generations. They stop when the last clone is dropped.
#[derive(Clone)]
pub struct Orchestrator {
    /// The client runtime and channels this clone's generations run on (one of `lanes`).
    lane: Arc<Lane>,
    target_addr: String,
    /// The draft's address (empty without a draft).
    draft_addr: String,
    /// The model the target reported serving.
    target_model: String,
    eos: Vec<u32>,
    vocab_size: usize,
    /// The limits the target reported.
    target_limits: WorkerLimits,
    /// The limits the draft reported (None without a draft).
    draft_limits: Option<WorkerLimits>,
    /// The pre-draft pipeline's cost model, shared by the generations.
    planner: Arc<std::sync::Mutex<crate::PreDraftPlanner>>,
    /// Earlier generations for the suffix drafter (used with `suffix_history`).
    suffix_store: SharedSuffixStore,
    /// What the generations measured of each drafter, for the online choice of the next ones.
    choice_memory: Arc<std::sync::Mutex<crate::ChoiceMemory>>,
    /// The target's latest load advice per level of live generations, for a generation's
    /// first round, which has no answer of its own to take it from.
    advice: Arc<advice::AdviceMemory>,
    /// Every client runtime with its channels.
    lanes: Arc<Vec<Arc<Lane>>>,
}

impl Orchestrator {
    /// The pre-draft pipeline's cost model as it stands (its measurements so far).
    pub fn predraft_planner(&self) -> crate::PreDraftPlanner {
        self.planner.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Connects to the workers (no draft for target-only decoding), pings both and checks that
    /// their vocabularies match.
    pub async fn connect(
        draft_addr: Option<&str>,
        target_addr: &str,
    ) -> Result<Self, OrchestratorError> {
        Self::connect_with(draft_addr, target_addr, ClientSpin::default()).await
    }

    /// [`Orchestrator::connect`], with the client runtime busy-polling as `spin` says.
    pub async fn connect_with(
        draft_addr: Option<&str>,
        target_addr: &str,
        spin: ClientSpin,
    ) -> Result<Self, OrchestratorError> {
        let opts = ConnectOptions {
            spin,
            ..ConnectOptions::default()
        };
        Self::connect_with_options(draft_addr, target_addr, &opts).await
    }

    /// [`Orchestrator::connect`] as `opts` say: TLS (mutual with a client certificate) and a
    /// bearer token towards both workers, and the client runtime's busy-polling. A worker
    /// that refuses the token fails with [`OrchestratorError::Rpc`], code UNAUTHENTICATED; a
    /// failed TLS handshake with [`OrchestratorError::Unreachable`], its reason naming the
    /// TLS error.
    pub async fn connect_with_options(
        draft_addr: Option<&str>,
        target_addr: &str,
        opts: &ConnectOptions,
    ) -> Result<Self, OrchestratorError> {
        let threads = match opts.client_threads {
            0 => options::default_client_threads(),
            n if n > MAX_CLIENT_THREADS => {
                return Err(OrchestratorError::Config(format!(
                    "client_threads is {n} but at most {MAX_CLIENT_THREADS} client threads may \
                     run; 0 picks one for every four cores"
                )))
            }
            n => n,
        };
        let mut lanes = Vec::with_capacity(threads);
        for _ in 0..threads {
            lanes.push(Arc::new(
                Lane::connect(draft_addr, target_addr, opts).await?,
            ));
        }
        // The first lane's channels check the workers and learn what they serve.
        let lane = lanes[0].clone();
        let (draft, target) = (draft_addr.map(str::to_string), target_addr.to_string());
        let rt = lane.rt.clone();
        let mut orch = rt
            .spawn(async move { Self::check_here(draft.as_deref(), &target, lane).await })
            .join()
            .await?;
        orch.lanes = Arc::new(lanes);
        Ok(orch)
    }

    /// Client runtimes (threads) this orchestrator runs its generations on.
    pub fn client_threads(&self) -> usize {
        self.lanes.len()
    }

    /// This orchestrator on the lane with the fewest live generations, counted live there
    /// until the returned guard is dropped.
    fn on_least_busy_lane(&self) -> (Orchestrator, OnLane) {
        let live = self
            .lanes
            .iter()
            .map(|l| l.live.load(std::sync::atomic::Ordering::Acquire));
        let lane = self.lanes[least_busy(live)].clone();
        lane.live.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let o = Orchestrator {
            lane: lane.clone(),
            ..self.clone()
        };
        (o, OnLane(lane))
    }

    /// Pings the workers over `lane`'s channels (on its runtime, the current one), checks that
    /// their vocabularies match, and makes the orchestrator of what they report.
    async fn check_here(
        draft_addr: Option<&str>,
        target_addr: &str,
        lane: Arc<Lane>,
    ) -> Result<Self, OrchestratorError> {
        let mut target = lane.target.clone();
        let tp = ping("target", target_addr, target.ping(PingRequest {})).await?;
        let mut eos: Vec<u32> = tp.eos_token_ids.iter().map(|&t| t as u32).collect();
        let draft_limits = match (draft_addr, &lane.draft) {
            (Some(addr), Some(d)) => {
                let mut d = d.clone();
                let dp = ping("draft", addr, d.ping(PingRequest {})).await?;
                // A model-free draft worker reports no vocabulary (0): it copies token ids it
                // was sent, and its trees are checked against the target's vocabulary.
                if dp.vocab_size != 0 && dp.vocab_size != tp.vocab_size {
                    return Err(OrchestratorError::Incompatible(format!(
                        "the draft model '{}' has a vocabulary of {} tokens but the target model \
                         '{}' has {}: speculative decoding needs the same tokenizer on both sides",
                        dp.model_name, dp.vocab_size, tp.model_name, tp.vocab_size
                    )));
                }
                for &t in &dp.eos_token_ids {
                    if !eos.contains(&(t as u32)) {
                        eos.push(t as u32);
                    }
                }
                Some(WorkerLimits::of(&dp))
            }
            _ => None,
        };
        Ok(Self {
            lane: lane.clone(),
            target_addr: target_addr.to_string(),
            draft_addr: draft_addr.unwrap_or_default().to_string(),
            target_model: tp.model_name.clone(),
            eos,
            vocab_size: tp.vocab_size.max(0) as usize,
            target_limits: WorkerLimits::of(&tp),
            draft_limits,
            planner: Arc::default(),
            suffix_store: SuffixStore::shared(SuffixConfig::default()),
            choice_memory: Arc::default(),
            advice: Arc::default(),
            lanes: Arc::new(vec![lane]),
        })
    }

    /// Pings the target and, where there is one, the draft over the open channels: `Ok` when
    /// both answer, each within the connect timeout (5 s).
    pub async fn ping(&self) -> Result<(), OrchestratorError> {
        let o = self.clone();
        self.lane
            .rt
            .spawn(async move {
                let mut target = o.lane.target.clone();
                ping("target", &o.target_addr, target.ping(PingRequest {})).await?;
                if let Some(d) = &o.lane.draft {
                    let mut d = d.clone();
                    ping("draft", &o.draft_addr, d.ping(PingRequest {})).await?;
                }
                Ok(())
            })
            .join()
            .await
    }

    /// End-of-sequence ids reported by the workers.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// The model the target reported serving (its name as the target resolved it: an alias,
    /// a file stem, a directory or a repo name).
    pub fn target_model(&self) -> &str {
        &self.target_model
    }

    /// Vocabulary size reported by the target.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Most tokens (prompt and generated) a target session holds, where the target reported
    /// it.
    pub fn max_context(&self) -> Option<usize> {
        (self.target_limits.max_context > 0).then_some(self.target_limits.max_context)
    }

    /// Longest prompt the target accepts, where it reported it.
    pub fn max_prompt_len(&self) -> Option<usize> {
        (self.target_limits.max_prompt_len > 0).then_some(self.target_limits.max_prompt_len)
    }

    /// Generates up to `cfg.max_tokens` tokens after `prompt`, calling `on_tokens` with each
    /// round's emitted tokens as soon as they are known (in the caller's task, in order, all
    /// before this returns; the round loop does not wait for it). Both workers' sessions are
    /// ended on every exit path.
    pub async fn generate(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, OrchestratorError> {
        self.generate_until(prompt, cfg, move |t| {
            on_tokens(t);
            true
        })
        .await
    }

    /// [`Orchestrator::generate`], where `on_tokens` says whether to go on: once it returns
    /// `false` the round loop is cancelled, both sessions are ended, and the generation holds
    /// the tokens passed so far with [`StopReason::Stopped`](crate::StopReason::Stopped) and
    /// their count as its only statistic.
    pub async fn generate_until(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        mut on_tokens: impl FnMut(&[u32]) -> bool,
    ) -> Result<Generation, OrchestratorError> {
        self.generate_scored(prompt, cfg, move |t, _| on_tokens(t))
            .await
    }

    /// [`Orchestrator::generate_until`], with each round's tokens passed together with their
    /// log-probabilities (empty without [`GenerateConfig::logprobs`]).
    pub async fn generate_scored(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        on_tokens: impl FnMut(&[u32], &[f32]) -> bool,
    ) -> Result<Generation, OrchestratorError> {
        cfg.validate().map_err(OrchestratorError::Config)?;
        if prompt.is_empty() {
            return Err(OrchestratorError::Config(
                "the prompt holds no tokens".into(),
            ));
        }
        if cfg.mode == Mode::Spec && cfg.drafter.needs_draft_worker() && self.lane.draft.is_none() {
            return Err(OrchestratorError::Config(
                "speculative mode with the model drafter needs a draft worker address \
                 (the ngram, suffix and auto drafters need none)"
                    .into(),
            ));
        }
        let t = &self.target_limits;
        if prompt.len() > known(t.max_context) || prompt.len() > known(t.max_prompt_len) {
            return Err(OrchestratorError::Config(format!(
                "the prompt has {} tokens but the target accepts at most {} (max_prompt_len) \
                 and holds at most {} in a session (max_context)",
                prompt.len(),
                t.max_prompt_len,
                t.max_context
            )));
        }
        let session = format!("gen-{:032x}", rand::random::<u128>());
        let secret = new_secret();
        // The round loop runs on the client runtime's thread, where the channels' tasks run
        // (see `ClientRuntime`), whatever polls the caller. The caller still calls `on_tokens`
        // itself, with every round's tokens, in order, before the result.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Vec<u32>, Vec<f32>)>();
        let ((o, on_lane), cfg, prompt) = (self.on_least_busy_lane(), cfg.clone(), prompt.to_vec());
        let lane = o.clone();
        let (session2, secret2) = (session.clone(), secret.clone());
        // Counted live from here, so that generations started together count each other
        // before their first rounds.
        let live = self.advice.enter();
        let body = async move {
            let _live = (live, on_lane);
            run_and_end(&o, &session2, &secret2, &cfg, &prompt, move |t, lp| {
                // The receiver is gone only when the caller was dropped (and aborts us).
                let _ = tx.send((t.to_vec(), lp.to_vec()));
            })
            .await
        };
        let task = lane.lane.rt.spawn(body);
        let mut on_tokens = on_tokens;
        let (mut passed, mut passed_logprobs) = (Vec::new(), Vec::new());
        // The channel closes when the round loop returns (the sender is dropped with it).
        while let Some((t, lp)) = rx.recv().await {
            passed.extend_from_slice(&t);
            passed_logprobs.extend_from_slice(&lp);
            if !on_tokens(&t, &lp) {
                task.cancel().await;
                let o = lane.clone();
                let _ = lane
                    .lane
                    .rt
                    .spawn(async move {
                        o.end_sessions(&session, &secret).await;
                        Ok(())
                    })
                    .join()
                    .await;
                return Ok(Generation {
                    stats: crate::GenerationStats {
                        tokens: passed.len(),
                        ..Default::default()
                    },
                    token_ids: passed,
                    token_logprobs: passed_logprobs,
                    stop_reason: crate::StopReason::Stopped,
                    rounds: Vec::new(),
                });
            }
        }
        task.join().await
    }

    /// Ends `session` on both workers at once, each within [`END_SESSION_TIMEOUT`] (best
    /// effort: a dead worker holds none anyway, and an idle one drops it after its TTL).
    async fn end_sessions(&self, session: &str, secret: &str) {
        let end = EndSessionRequest {
            session_id: session.to_string(),
            session_secret: secret.to_string(),
        };
        let mut target = self.lane.target.clone();
        let on_target = tokio::time::timeout(END_SESSION_TIMEOUT, target.end_session(end.clone()));
        let on_draft = async {
            if let Some(d) = &self.lane.draft {
                let mut d = d.clone();
                let _ = tokio::time::timeout(END_SESSION_TIMEOUT, d.end_session(end)).await;
            }
        };
        let _ = tokio::join!(on_target, on_draft);
    }
}

/// Runs a generation's round loop, then ends its sessions whatever happened.
async fn run_and_end(
    o: &Orchestrator,
    session: &str,
    secret: &str,
    cfg: &GenerateConfig,
    prompt: &[u32],
    on_tokens: impl FnMut(&[u32], &[f32]),
) -> Result<Generation, OrchestratorError> {
    let result = Run::new(o, session, secret, cfg)
        .run(prompt, on_tokens)
        .await;
    o.end_sessions(session, secret).await;
    result
}

/// A target client over `link` that sends and takes messages up to [`MAX_MESSAGE_BYTES`].
fn target_client(link: Link) -> TargetServiceClient<Link> {
    TargetServiceClient::new(link)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// A draft client over `link` that sends and takes messages up to [`MAX_MESSAGE_BYTES`].
fn draft_client(link: Link) -> DraftServiceClient<Link> {
    DraftServiceClient::new(link)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// A fresh session secret: 32 random hex digits (128 bits).
fn new_secret() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_takes_the_lane_with_the_fewest_live_generations_the_first_of_ties() {
        assert_eq!(least_busy([2, 1, 1, 3]), 1);
        assert_eq!(least_busy([2, 2, 1, 3]), 2);
        assert_eq!(least_busy([0, 0]), 0);
        assert_eq!(least_busy([4]), 0);
        assert_eq!(least_busy([]), 0);
    }

    #[test]
    fn secrets_are_fresh_128_bit_hex_strings() {
        let (a, b) = (new_secret(), new_secret());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
