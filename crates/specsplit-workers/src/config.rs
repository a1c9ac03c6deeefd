//! Worker configuration and the layered loader shared by all three programs:
//! defaults < TOML file (section `[draft]`, `[target]` or `[orchestrator]`) <
//! `SPECSPLIT_<SECTION>__<KEY>` environment variables < command-line flags.

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
pub use specsplit_proto::codec::MAX_WIRE_TREE_DEPTH;

/// Settings of a draft or target worker.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Address to serve gRPC on.
    pub listen: String,
    /// Model to load (directory, .gguf, HF repo id, `random:<preset>` or catalogue alias).
    pub model: String,
    /// Device: `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Weight/activation dtype (`f32`, `f16`, `bf16`); empty = f32 on CPU, bf16 on CUDA, and
    /// GGUF weights stay quantized (a dtype dequantizes them to it at load).
    pub dtype: String,
    /// Most sessions held at once (LRU eviction beyond).
    pub max_sessions: usize,
    /// Seconds a session may stay idle before it is dropped.
    pub session_ttl_secs: u64,
    /// KV-cache capacity of one session, in tokens (prompt + generated + draft tree).
    pub max_context: usize,
    /// Memory budget for all session caches, in MiB.
    pub memory_budget_mb: usize,
    /// Milliseconds a request for a new session waits for room when every session is busy
    /// (at `max_sessions` or `memory_budget_mb`) before RESOURCE_EXHAUSTED; 0 refuses at once.
    pub admission_wait_ms: u64,
    /// Most sessions whose work shares one model pass (target: verification rounds; draft:
    /// the levels of their trees); 1 runs each request on its own as it comes (no batching).
    pub max_batch_sessions: usize,
    /// Most rows in one shared pass (target: each session's new token and draft-tree nodes;
    /// draft: the nodes of each session's tree level); a session with more runs alone.
    pub max_batch_rows: usize,
    /// Draft: greedy chains on CUDA grow from CUDA graphs, the chains of sessions queued
    /// together in one shared pass a level (true, the default); false drafts them level by
    /// level like every other tree. The target ignores it.
    #[serde(default = "default_static_draft_chains")]
    pub static_draft_chains: bool,
    /// Most nodes of a draft tree (target: verified; draft: produced); less than `max_context`.
    pub max_tree_nodes: usize,
    /// Most tokens on a root-to-leaf path of a draft tree (target: verified; draft: produced);
    /// at most [`MAX_WIRE_TREE_DEPTH`], the deepest tree the wire format carries.
    pub max_tree_depth: usize,
    /// Most tokens one request may carry (`prompt_token_ids` or `new_token_ids`); at most
    /// `max_context`, which it defaults to (unset). The draft receives the whole sequence
    /// (prompt and generated tokens) every round, so this bounds prompt plus output there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_len: Option<usize>,
    /// Ended sessions whose KV cache and captured CUDA graphs the worker keeps for its next
    /// sessions (0 keeps none); they take memory beyond `memory_budget_mb`.
    pub spare_sessions: usize,
    /// Milliseconds the server busy-polls its sockets after each answer (0: never); unset,
    /// 20 on CUDA and 0 on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spin_ms: Option<u64>,
    /// Whether the target times each verification pass on the device with CUDA events (a
    /// diagnostic; the draft ignores it).
    pub device_timing: bool,
    /// Log format: `text` or `json`.
    pub log_format: String,
    /// PEM certificate chain to serve TLS with (with `tls_key`); unset: plaintext gRPC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates a client's certificate must chain to: mutual TLS, and a client
    /// without such a certificate fails the handshake. Needs `tls_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// File holding the bearer token every call of the worker's service must carry
    /// (`authorization: Bearer <token>`; surrounding whitespace is ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_token_file: Option<PathBuf>,
    /// The bearer token itself, for the config file or the environment
    /// (`SPECSPLIT_<SECTION>__AUTH_TOKEN`); there is no flag for it, so that it never shows in
    /// a process list. At most one of `auth_token` and `auth_token_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_token: Option<Secret>,
    /// Serve on a non-loopback address without TLS or without client authentication (a client
    /// CA or a token): an explicit choice, refused otherwise.
    pub insecure: bool,
    /// Address of the HTTP endpoints `/metrics` (Prometheus), `/health` and `/ready`; unset:
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Seconds the worker goes on serving after SIGTERM or Ctrl-C, its health reporting
    /// NOT_SERVING, before it stops taking calls and finishes those in flight.
    pub drain_secs: u64,
    /// What proposes a draft worker's trees: `model` (the draft model), or `ngram` / `suffix`
    /// (model-free: no model is loaded and `model`, `device` and `dtype` are unused). The
    /// target ignores it.
    #[serde(default)]
    pub drafter: crate::model_free::DrafterKind,
    /// With `drafter = "suffix"`: also match the sequences of the worker's earlier sessions
    /// (a shared store capped at 65,536 tokens, oldest evicted first).
    #[serde(default)]
    pub suffix_history: bool,
    /// Whether the target advises each session's next draft depth from its load (measured
    /// pass times per row count and acceptance; `VerifyResponse.max_draft_depth`). The draft
    /// ignores it.
    #[serde(default = "default_load_gate")]
    pub load_gate: bool,
}

/// The default of [`WorkerConfig::static_draft_chains`]: on.
fn default_static_draft_chains() -> bool {
    true
}

/// The default of [`WorkerConfig::load_gate`]: on.
fn default_load_gate() -> bool {
    true
}

/// A secret setting: its `Debug` form hides it (the effective configuration is logged).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret text.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<hidden>")
    }
}

/// Whether `listen` (`host:port`) is a loopback address: an IP address such as 127.0.0.1 or
/// [::1], or `localhost`.
pub fn is_loopback(listen: &str) -> bool {
    if let Ok(addr) = listen.parse::<std::net::SocketAddr>() {
        return addr.ip().is_loopback();
    }
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    host.eq_ignore_ascii_case("localhost")
}

impl WorkerConfig {
    /// Defaults for the draft worker.
    pub fn draft_defaults() -> Self {
        Self {
            listen: "127.0.0.1:50051".into(),
            model: "qwen-coder-0.5b".into(),
            ..Self::target_defaults()
        }
    }

    /// Defaults for the target worker.
    pub fn target_defaults() -> Self {
        Self {
            listen: "127.0.0.1:50052".into(),
            model: "qwen-coder-1.5b".into(),
            device: "cpu".into(),
            dtype: String::new(),
            max_sessions: 64,
            session_ttl_secs: 300,
            max_context: 4096,
            memory_budget_mb: 8192,
            admission_wait_ms: 1000,
            max_batch_sessions: 64,
            max_batch_rows: 2048,
            static_draft_chains: true,
            max_tree_nodes: 128,
            max_tree_depth: 64,
            max_prompt_len: None,
            spare_sessions: crate::spare::DEFAULT_SPARE_SESSIONS,
            spin_ms: None,
            device_timing: false,
            log_format: "text".into(),
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            auth_token_file: None,
            auth_token: None,
            insecure: false,
            metrics_listen: None,
            drain_secs: 0,
            drafter: crate::model_free::DrafterKind::Model,
            suffix_history: false,
            load_gate: true,
        }
    }
}

impl WorkerConfig {
    /// Most tokens one request may carry: `max_prompt_len`, or `max_context` when unset.
    pub fn prompt_limit(&self) -> usize {
        self.max_prompt_len.unwrap_or(self.max_context)
    }

    /// Checks that the limits fit together: every one at least 1, `max_prompt_len <=
    /// max_context`, `max_tree_nodes < max_context` and `max_tree_depth <=`
    /// [`MAX_WIRE_TREE_DEPTH`]. Workers call it once at start-up.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_log_format(&self.log_format)?;
        let positive = [
            ("max_sessions", self.max_sessions),
            ("max_context", self.max_context),
            ("memory_budget_mb", self.memory_budget_mb),
            ("max_batch_sessions", self.max_batch_sessions),
            ("max_batch_rows", self.max_batch_rows),
            ("max_tree_nodes", self.max_tree_nodes),
            ("max_tree_depth", self.max_tree_depth),
            ("max_prompt_len", self.prompt_limit()),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError(format!("{name} must be at least 1")));
        }
        if self.prompt_limit() > self.max_context {
            return Err(ConfigError(format!(
                "max_prompt_len ({}) must not exceed max_context ({}): a session cannot hold \
                 more tokens than its cache",
                self.prompt_limit(),
                self.max_context
            )));
        }
        if self.max_tree_nodes >= self.max_context {
            return Err(ConfigError(format!(
                "max_tree_nodes ({}) must be less than max_context ({}): a tree is verified \
                 after at least one token of context",
                self.max_tree_nodes, self.max_context
            )));
        }
        if self.max_tree_depth > MAX_WIRE_TREE_DEPTH {
            return Err(ConfigError(format!(
                "max_tree_depth ({}) must be at most {MAX_WIRE_TREE_DEPTH}, the deepest draft \
                 tree the wire format carries",
                self.max_tree_depth
            )));
        }
        self.validate_security()
    }

    /// Checks the TLS and token settings: a key with its certificate, a client CA only with
    /// TLS, one token source, and on a non-loopback address TLS with client authentication
    /// unless `insecure`.
    fn validate_security(&self) -> Result<(), ConfigError> {
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(ConfigError(
                "tls_cert and tls_key go together: set both to serve TLS, or neither".into(),
            ));
        }
        let tls = self.tls_cert.is_some();
        if self.tls_client_ca.is_some() && !tls {
            return Err(ConfigError(
                "tls_client_ca (mutual TLS) needs tls_cert and tls_key".into(),
            ));
        }
        if self.auth_token.is_some() && self.auth_token_file.is_some() {
            return Err(ConfigError(
                "auth_token and auth_token_file are both set; set one".into(),
            ));
        }
        if self.insecure || is_loopback(&self.listen) {
            return Ok(());
        }
        let authenticated = self.tls_client_ca.is_some()
            || self.auth_token.is_some()
            || self.auth_token_file.is_some();
        match (tls, authenticated) {
            (true, true) => Ok(()),
            (false, _) => Err(ConfigError(format!(
                "listen address {} is not loopback and the worker has no TLS: set tls_cert and \
                 tls_key with tls_client_ca or an auth token (see docs/configuration.md), or \
                 pass --insecure to serve plaintext gRPC",
                self.listen
            ))),
            (true, false) => Err(ConfigError(format!(
                "listen address {} is not loopback and the worker authenticates no client: set \
                 tls_client_ca (mutual TLS) or an auth token (auth_token_file), or pass \
                 --insecure to serve anyone who connects",
                self.listen
            ))),
        }
    }
}

/// Error loading configuration.
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct ConfigError(String);

/// Loads section `section` of type `T`: `defaults` < the TOML `file` (if given) < environment
/// variables `SPECSPLIT_<SECTION>__<KEY>` < `overrides` (flags that were set; serialize `None`
/// fields as absent with `#[serde(skip_serializing_if = "Option::is_none")]`).
pub fn load_section<T, O>(
    section: &str,
    defaults: &T,
    file: Option<&Path>,
    overrides: &O,
) -> Result<T, ConfigError>
where
    T: Serialize + DeserializeOwned,
    O: Serialize,
{
    let mut fig = Figment::from(Serialized::defaults(defaults));
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        check_sections(path)?;
        fig = fig.merge(Figment::from(Toml::file(path)).focus(section));
    }
    let env_prefix = format!("SPECSPLIT_{}__", section.to_ascii_uppercase());
    fig = fig.merge(Env::prefixed(&env_prefix).map(|k| k.as_str().to_ascii_lowercase().into()));
    // A secret is taken as written: the environment layer would read `12345` as a number.
    for key in VERBATIM_KEYS {
        let var = format!("{env_prefix}{}", key.to_ascii_uppercase());
        if let Ok(value) = std::env::var(var) {
            fig = fig.merge(Serialized::default(key, value));
        }
    }
    fig = fig.merge(Serialized::defaults(overrides));
    fig.extract().map_err(|e| ConfigError(e.to_string()))
}

/// Keys whose environment variable is read as the string it is, never as a number or a boolean.
const VERBATIM_KEYS: [&str; 2] = ["auth_token", "api_key"];

/// The sections a configuration file may hold, one per program.
pub const SECTIONS: [&str; 3] = ["orchestrator", "draft", "target"];

/// The log formats the programs write.
pub const LOG_FORMATS: [&str; 2] = ["text", "json"];

/// Checks that `format` is a log format the programs write.
pub fn check_log_format(format: &str) -> Result<(), ConfigError> {
    if LOG_FORMATS.contains(&format) {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "log_format is \"{format}\"; it must be \"text\" or \"json\""
        )))
    }
}

/// Refuses a configuration file whose top level holds anything but the known sections (a
/// misspelt `[orchestrater]` would otherwise be ignored without a word).
fn check_sections(path: &Path) -> Result<(), ConfigError> {
    let top: std::collections::BTreeMap<String, figment::value::Value> =
        Figment::from(Toml::file(path))
            .extract()
            .map_err(|e| ConfigError(format!("config file {}: {e}", path.display())))?;
    for (key, value) in &top {
        let table = matches!(value, figment::value::Value::Dict(..));
        if !table || !SECTIONS.contains(&key.as_str()) {
            return Err(ConfigError(format!(
                "config file {} has {} `{key}`; it may hold only the sections [orchestrator], \
                 [draft] and [target]",
                path.display(),
                if table {
                    "an unknown section"
                } else {
                    "a key outside any section:"
                }
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure error type is figment's own.
mod tests {
    use super::*;

    #[derive(Serialize, Default)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        max_sessions: Option<usize>,
        #[serde(skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    }

    #[test]
    fn unknown_sections_and_stray_keys_are_refused() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("typo.toml", "[targte]\nmodel = \"x\"\n")?;
            jail.create_file("stray.toml", "model = \"x\"\n[target]\nmax_sessions = 2\n")?;
            jail.create_file(
                "ok.toml",
                "[draft]\nmax_sessions = 3\n[target]\nmax_sessions = 2\n",
            )?;
            let load = |f: &str| {
                load_section(
                    "target",
                    &WorkerConfig::target_defaults(),
                    Some(Path::new(f)),
                    &Flags::default(),
                )
            };
            let e = load("typo.toml").unwrap_err().to_string();
            assert!(e.contains("unknown section `targte`"), "{e}");
            let e = load("stray.toml").unwrap_err().to_string();
            assert!(e.contains("outside any section: `model`"), "{e}");
            assert_eq!(load("ok.toml").unwrap().max_sessions, 2);
            Ok(())
        });
    }

    #[test]
    fn only_text_and_json_logs() {
        assert!(check_log_format("text").is_ok() && check_log_format("json").is_ok());
        let e = check_log_format("yaml").unwrap_err().to_string();
        assert!(e.contains("\"yaml\""), "{e}");
    }

    #[test]
    fn precedence_is_defaults_file_env_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "c.toml",
                "[target]\nmodel = \"from-file\"\nmax_sessions = 7\nmax_context = 99\n\
                 device_timing = true\nspare_sessions = 0\n[draft]\nmodel = \"draft-file\"\n",
            )?;
            jail.set_env("SPECSPLIT_TARGET__MAX_CONTEXT", "1234");
            jail.set_env("SPECSPLIT_TARGET__MODEL", "from-env");
            jail.set_env("SPECSPLIT_TARGET__SPIN_MS", "5");
            jail.set_env("SPECSPLIT_TARGET__ADMISSION_WAIT_MS", "250");
            jail.set_env("SPECSPLIT_TARGET__MAX_BATCH_SESSIONS", "8");
            let flags = Flags {
                max_sessions: None,
                model: Some("from-flag".into()),
            };
            let c: WorkerConfig = load_section(
                "target",
                &WorkerConfig::target_defaults(),
                Some(Path::new("c.toml")),
                &flags,
            )
            .map_err(|e| e.to_string())?;
            assert_eq!(c.model, "from-flag");
            assert_eq!(c.max_context, 1234);
            assert_eq!(c.max_sessions, 7);
            assert_eq!(c.listen, "127.0.0.1:50052");
            assert_eq!(c.spin_ms, Some(5));
            assert_eq!(c.admission_wait_ms, 250);
            assert_eq!(c.max_batch_sessions, 8);
            assert_eq!(c.max_batch_rows, 2048);
            assert!(c.device_timing);
            assert_eq!(c.spare_sessions, 0);
            Ok(())
        });
    }

    #[test]
    fn defaults_are_valid_and_limits_must_fit_together() {
        WorkerConfig::target_defaults().validate().unwrap();
        WorkerConfig::draft_defaults().validate().unwrap();
        let d = WorkerConfig::target_defaults();
        assert_eq!(d.spare_sessions, 1);
        assert_eq!(d.spin_ms, None, "unset: the device decides");
        assert!(!d.device_timing);
        assert_eq!(d.prompt_limit(), 4096, "one request may fill the context");
        let small = WorkerConfig {
            max_context: 1024,
            ..d.clone()
        };
        small.validate().unwrap();
        assert_eq!(small.prompt_limit(), 1024, "unset, it follows max_context");
        let bad = |c: WorkerConfig, needle: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        bad(
            WorkerConfig {
                max_prompt_len: Some(4097),
                ..d.clone()
            },
            "max_prompt_len (4097) must not exceed max_context (4096)",
        );
        bad(
            WorkerConfig {
                max_tree_nodes: 4096,
                ..d.clone()
            },
            "max_tree_nodes (4096) must be less than max_context",
        );
        bad(
            WorkerConfig {
                max_tree_depth: MAX_WIRE_TREE_DEPTH + 1,
                ..d.clone()
            },
            "max_tree_depth (100) must be at most 99",
        );
        bad(
            WorkerConfig {
                max_tree_depth: 0,
                ..d.clone()
            },
            "max_tree_depth must be at least 1",
        );
        bad(
            WorkerConfig {
                max_batch_sessions: 0,
                ..d.clone()
            },
            "max_batch_sessions must be at least 1",
        );
        WorkerConfig {
            max_tree_depth: MAX_WIRE_TREE_DEPTH,
            ..d
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn non_loopback_plaintext_or_unauthenticated_listening_is_an_explicit_choice() {
        let d = WorkerConfig::target_defaults();
        assert!(is_loopback(&d.listen) && is_loopback("[::1]:1") && is_loopback("localhost:9"));
        assert!(!is_loopback("0.0.0.0:1") && !is_loopback("10.0.0.1:1") && !is_loopback("a:1"));
        let open = WorkerConfig {
            listen: "0.0.0.0:50052".into(),
            ..d.clone()
        };
        let e = open.validate().unwrap_err().to_string();
        assert!(e.contains("has no TLS") && e.contains("--insecure"), "{e}");
        let tls = WorkerConfig {
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            ..open.clone()
        };
        let e = tls.validate().unwrap_err().to_string();
        assert!(e.contains("authenticates no client"), "{e}");
        for ok in [
            WorkerConfig {
                tls_client_ca: Some("ca.pem".into()),
                ..tls.clone()
            },
            WorkerConfig {
                auth_token: Some(Secret::new("t")),
                ..tls.clone()
            },
            WorkerConfig {
                insecure: true,
                ..open.clone()
            },
        ] {
            ok.validate().unwrap();
        }
        let bad = |c: WorkerConfig, needle: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        bad(
            WorkerConfig {
                tls_key: None,
                ..tls.clone()
            },
            "go together",
        );
        bad(
            WorkerConfig {
                tls_client_ca: Some("ca.pem".into()),
                ..d.clone()
            },
            "needs tls_cert",
        );
        bad(
            WorkerConfig {
                auth_token: Some(Secret::new("t")),
                auth_token_file: Some("t.txt".into()),
                ..d.clone()
            },
            "both set",
        );
        let shown = format!(
            "{:?}",
            WorkerConfig {
                auth_token: Some(Secret::new("hunter2")),
                ..d
            }
        );
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn the_token_comes_from_the_environment_whatever_it_looks_like() {
        figment::Jail::expect_with(|jail| {
            for token in ["12345", "true", "s3cret-Token"] {
                jail.set_env("SPECSPLIT_TARGET__AUTH_TOKEN", token);
                let c: WorkerConfig = load_section(
                    "target",
                    &WorkerConfig::target_defaults(),
                    None,
                    &Flags::default(),
                )
                .map_err(|e| e.to_string())?;
                assert_eq!(c.auth_token.as_ref().map(Secret::expose), Some(token));
            }
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_and_missing_files_are_errors() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[draft]\nmodle = \"typo\"\n")?;
            let r: Result<WorkerConfig, _> = load_section(
                "draft",
                &WorkerConfig::draft_defaults(),
                Some(Path::new("c.toml")),
                &Flags::default(),
            );
            assert!(r.unwrap_err().to_string().contains("modle"));
            let r: Result<WorkerConfig, _> = load_section(
                "draft",
                &WorkerConfig::draft_defaults(),
                Some(Path::new("missing.toml")),
                &Flags::default(),
            );
            assert!(r.unwrap_err().to_string().contains("does not exist"));
            Ok(())
        });
    }

    #[test]
    fn static_draft_chains_are_on_by_default_and_the_file_or_the_flag_turns_them_off() {
        use crate::cli::{WorkerArgs, WorkerKind};
        figment::Jail::expect_with(|jail| {
            let on = WorkerArgs::default().resolve(WorkerKind::Draft).unwrap();
            assert!(on.static_draft_chains);
            jail.create_file("c.toml", "[draft]\nstatic_draft_chains = false\n")?;
            let file = WorkerArgs {
                config: Some("c.toml".into()),
                ..Default::default()
            };
            assert!(!file.resolve(WorkerKind::Draft).unwrap().static_draft_chains);
            let flag = WorkerArgs {
                static_draft_chains: Some(false),
                ..Default::default()
            };
            assert!(!flag.resolve(WorkerKind::Draft).unwrap().static_draft_chains);
            Ok(())
        });
    }

    #[test]
    fn load_gate_is_on_by_default_and_the_file_or_the_flag_turns_it_off() {
        use crate::cli::{WorkerArgs, WorkerKind};
        figment::Jail::expect_with(|jail| {
            let on = WorkerArgs::default().resolve(WorkerKind::Target).unwrap();
            assert!(on.load_gate);
            jail.create_file("c.toml", "[target]\nload_gate = false\n")?;
            let file = WorkerArgs {
                config: Some("c.toml".into()),
                ..Default::default()
            };
            assert!(!file.resolve(WorkerKind::Target).unwrap().load_gate);
            let flag = WorkerArgs {
                load_gate: Some(false),
                ..Default::default()
            };
            assert!(!flag.resolve(WorkerKind::Target).unwrap().load_gate);
            Ok(())
        });
    }
}
