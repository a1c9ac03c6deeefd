//! The workers a command talks to: remote ones at the configured addresses, or a draft and a
//! target started inside this process; the orchestrator connected to them and the tokenizer
//! of the target's model.

use anyhow::{bail, Context, Result};
use specsplit_models::tokenizer::TextTokenizer;
use specsplit_orchestrator::{DrafterChoice, Mode, Orchestrator};
use specsplit_workers::config::WorkerConfig;
use specsplit_workers::launch;

use crate::notice;
use crate::settings::Settings;

/// An orchestrator connected to its workers, with the tokenizer of the target's model.
pub struct Connected {
    /// Workers started in this process (None with remote workers).
    pub in_process: Option<InProcess>,
    /// The orchestrator.
    pub orch: Orchestrator,
    /// The tokenizer of the target's model.
    pub tokenizer: TextTokenizer,
}

/// Connects to the workers `s` names, starting them in this process where it names none.
pub async fn connect(s: &Settings) -> Result<Connected> {
    let c = connect_unchecked(s).await?;
    // Token ids the tokenizer makes must mean the same on the target: a model's vocabulary
    // may be padded past its tokenizer's, never the other way round.
    if c.tokenizer.vocab_size() > c.orch.vocab_size() {
        if let Some(ip) = c.in_process {
            ip.shutdown().await;
        }
        bail!(
            "the tokenizer has {} tokens but the target serves a vocabulary of {}: set \
             --tokenizer to the target's model",
            c.tokenizer.vocab_size(),
            c.orch.vocab_size()
        );
    }
    Ok(c)
}

async fn connect_unchecked(s: &Settings) -> Result<Connected> {
    let spec = s.mode == Mode::Spec;
    // The model drafter needs a draft worker; the online choice uses one where there is one.
    let needs_draft = spec && s.drafter == DrafterChoice::Model;
    let uses_draft = needs_draft || (spec && s.drafter == DrafterChoice::Auto);
    if s.target_addr.is_empty() && (s.draft_addr.is_empty() || !uses_draft) {
        // In-process workers on a CPU: the online choice starts no draft model there. A draft
        // model's first round feeds it the whole prompt on the cores the target decodes on,
        // and the 0.5B draft measured 0.27× the 1.5B target alone on 2 cores
        // (docs/benchmarks.md §7); loading it costs memory and time for no gain.
        let on_gpu = s.device.starts_with("cuda");
        let uses_draft = needs_draft || (uses_draft && on_gpu);
        let (ip, d, t, tokenizer) = start_in_process(s, uses_draft).await?;
        let orch =
            Orchestrator::connect_with_options(d.as_deref(), &t, &s.client_options()).await?;
        return Ok(Connected {
            in_process: Some(ip),
            orch,
            tokenizer,
        });
    }
    if s.target_addr.is_empty() || (needs_draft && s.draft_addr.is_empty()) {
        bail!("give both --draft-addr and --target-addr (or neither, to start both in-process); --mode ar and the ngram, suffix and auto drafters need only --target-addr");
    }
    let d = (uses_draft && !s.draft_addr.is_empty()).then(|| s.draft_addr.clone());
    let opts = s.connect_options()?;
    let orch = Orchestrator::connect_with_options(d.as_deref(), &s.target_addr, &opts).await?;
    let tokenizer = remote_tokenizer(s, orch.target_model()).await?;
    Ok(Connected {
        in_process: None,
        orch,
        tokenizer,
    })
}

/// Workers started inside this process, stopped by [`InProcess::shutdown`].
pub struct InProcess {
    stop: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl InProcess {
    /// Stops the workers and waits for them.
    pub async fn shutdown(self) {
        for s in self.stop {
            let _ = s.send(());
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

async fn start_in_process(
    s: &Settings,
    with_draft: bool,
) -> Result<(InProcess, Option<String>, String, TextTokenizer)> {
    let mut ip = InProcess {
        stop: vec![],
        tasks: vec![],
    };
    let mut tokenizer = None;
    let mut addrs = Vec::new();
    let mut kinds = vec![("target", s.target_model.clone())];
    if with_draft {
        kinds.push(("draft", s.draft_model.clone()));
    }
    for (kind, model) in kinds {
        let base = if kind == "draft" {
            WorkerConfig::draft_defaults()
        } else {
            WorkerConfig::target_defaults()
        };
        let cfg = WorkerConfig {
            listen: "127.0.0.1:0".into(),
            model: model.clone(),
            device: s.device.clone(),
            dtype: s.dtype.clone(),
            max_sessions: s.max_concurrent.max(4),
            ..base
        };
        notice(
            &s.log_format,
            &format!("loading {kind} model '{model}' ..."),
            serde_json::json!({"event": "loading", "kind": kind, "model": model}),
        );
        let c2 = cfg.clone();
        let m = tokio::task::spawn_blocking(move || launch::load(&c2))
            .await?
            .with_context(|| format!("starting the in-process {kind} worker"))?;
        if kind == "target" {
            tokenizer = Some(m.tokenizer.clone());
        }
        let (listener, addr) = launch::bind(&cfg).await?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let task = if kind == "draft" {
            tokio::spawn(async move {
                if let Err(e) = launch::run_draft(&cfg, m, listener, shutdown).await {
                    tracing::error!("in-process draft worker failed: {e}");
                }
            })
        } else {
            tokio::spawn(async move {
                if let Err(e) = launch::run_target(&cfg, m, listener, shutdown).await {
                    tracing::error!("in-process target worker failed: {e}");
                }
            })
        };
        ip.stop.push(tx);
        ip.tasks.push(task);
        addrs.push(format!("http://{addr}"));
    }
    let target = addrs[0].clone();
    let draft = addrs.get(1).cloned();
    let tok = tokenizer.context("no tokenizer")?;
    Ok((ip, draft, target, tok))
}

/// The tokenizer for remote workers: `tokenizer` when set, else the model the target reports
/// serving where it names one known here, else `target_model`.
async fn remote_tokenizer(s: &Settings, served: &str) -> Result<TextTokenizer> {
    let load = |spec: String| {
        tokio::task::spawn_blocking(move || {
            specsplit_models::source::resolve(&spec)
                .and_then(|r| specsplit_models::loader::load_tokenizer(&r))
        })
    };
    if s.tokenizer.is_empty() && !served.is_empty() {
        if let Ok(tok) = load(served.to_string()).await? {
            return Ok(tok);
        }
    }
    let spec = if s.tokenizer.is_empty() {
        s.target_model.clone()
    } else {
        s.tokenizer.clone()
    };
    load(spec)
        .await?
        .context("loading the tokenizer (set --tokenizer to the target's model)")
}
