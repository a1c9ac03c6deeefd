//! Worker configuration and the layered loader shared by all three programs:
//! defaults < TOML file (section `[draft]`, `[target]` or `[orchestrator]`) <
//! `SPECSPLIT_<SECTION>__<KEY>` environment variables < command-line flags.

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

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
    /// Most nodes of a draft tree (target: verified; draft: produced).
    pub max_tree_nodes: usize,
    /// Longest prompt accepted, in tokens.
    pub max_prompt_len: usize,
    /// Log format: `text` or `json`.
    pub log_format: String,
}

impl WorkerConfig {
    /// Defaults for the draft worker.
    pub fn draft_defaults() -> Self {
        Self {
            listen: "0.0.0.0:50051".into(),
            model: "qwen-coder-0.5b".into(),
            ..Self::target_defaults()
        }
    }

    /// Defaults for the target worker.
    pub fn target_defaults() -> Self {
        Self {
            listen: "0.0.0.0:50052".into(),
            model: "qwen-coder-1.5b".into(),
            device: "cpu".into(),
            dtype: String::new(),
            max_sessions: 64,
            session_ttl_secs: 300,
            max_context: 4096,
            memory_budget_mb: 8192,
            max_tree_nodes: 128,
            max_prompt_len: 3072,
            log_format: "text".into(),
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
        fig = fig.merge(Figment::from(Toml::file(path)).focus(section));
    }
    let env_prefix = format!("SPECSPLIT_{}__", section.to_ascii_uppercase());
    fig = fig
        .merge(Env::prefixed(&env_prefix).map(|k| k.as_str().to_ascii_lowercase().into()))
        .merge(Serialized::defaults(overrides));
    fig.extract().map_err(|e| ConfigError(e.to_string()))
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
    fn precedence_is_defaults_file_env_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "c.toml",
                "[target]\nmodel = \"from-file\"\nmax_sessions = 7\nmax_context = 99\n\
                 [draft]\nmodel = \"draft-file\"\n",
            )?;
            jail.set_env("SPECSPLIT_TARGET__MAX_CONTEXT", "1234");
            jail.set_env("SPECSPLIT_TARGET__MODEL", "from-env");
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
            assert_eq!(c.listen, "0.0.0.0:50052");
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
}
