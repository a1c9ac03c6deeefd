//! Where a model comes from: one `--model` value names a local directory, a `.gguf` file, a
//! Hugging Face repo in the local hub cache, random weights of a preset shape, or an alias from
//! a small built-in catalogue. [`resolve`] turns it into concrete files.
//!
//! specsplit never downloads from the Hugging Face Hub: repos must already be in the local cache
//! (`HF_HUB_CACHE`, `HF_HOME/hub` or `~/.cache/huggingface/hub`). Catalogue GGUFs are fetched
//! into the models directory by `scripts/fetch-models.sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use hf_hub::{Repo, RepoType};

use crate::ModelError;

/// What a `--model` value names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory with `config.json`, `tokenizer.json` and safetensors weights.
    LocalDir(PathBuf),
    /// A single GGUF file.
    Gguf(PathBuf),
    /// A Hugging Face repo resolved through the local hub cache.
    HfRepo {
        /// `org/name`.
        repo: String,
        /// Branch, tag or commit; `None` means `main`.
        revision: Option<String>,
    },
    /// Random weights of a named preset shape (see `config::preset`), byte-level tokenizer.
    Random {
        /// Preset name, e.g. `tiny`.
        preset: String,
        /// Seed of the weight generator.
        seed: u64,
    },
}

/// The concrete files a model is loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFiles {
    /// Hugging Face layout: configuration, tokenizer and one or more safetensors files.
    Safetensors {
        /// The directory holding the files.
        dir: PathBuf,
        /// `config.json`.
        config: PathBuf,
        /// `tokenizer.json`.
        tokenizer: PathBuf,
        /// The weight files (a single file or every shard of the index), sorted.
        weights: Vec<PathBuf>,
    },
    /// A GGUF file, with an optional `tokenizer.json` found beside it.
    Gguf {
        /// The `.gguf` file.
        path: PathBuf,
        /// `<stem>.tokenizer.json` or `tokenizer.json` in the same directory, if present.
        tokenizer: Option<PathBuf>,
    },
    /// Nothing to read: random weights.
    Random {
        /// Preset name.
        preset: String,
        /// Weight seed.
        seed: u64,
    },
}

/// A resolved `--model` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModel {
    /// A short display name (alias, file stem, directory or repo name).
    pub name: String,
    /// What the value named.
    pub source: ModelSource,
    /// The files to load.
    pub files: ModelFiles,
}

/// Where a catalogue alias points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatalogueTarget {
    /// A GGUF file in the models directory that `scripts/fetch-models.sh <fetch_name>` fetches.
    Fetchable {
        /// File name inside the models directory.
        file: &'static str,
        /// Argument of `scripts/fetch-models.sh`.
        fetch_name: &'static str,
    },
    /// A Hugging Face repo that must already be in the local hub cache.
    HfRepo(&'static str),
}

/// One entry of the built-in model catalogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogueEntry {
    /// The alias accepted by `--model`.
    pub alias: &'static str,
    /// What it resolves to.
    pub target: CatalogueTarget,
    /// One-line description.
    pub description: &'static str,
}

const SMOLLM2: CatalogueTarget = CatalogueTarget::Fetchable {
    file: "smollm2-135m-instruct-q4_1.gguf",
    fetch_name: "smollm2",
};
const QWEN_05: CatalogueTarget = CatalogueTarget::Fetchable {
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    fetch_name: "qwen-0.5b",
};
const QWEN_15: CatalogueTarget = CatalogueTarget::Fetchable {
    file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    fetch_name: "qwen-1.5b",
};

const CATALOGUE: &[CatalogueEntry] = &[
    CatalogueEntry {
        alias: "smollm2",
        target: SMOLLM2,
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture, 49152 tokens)",
    },
    CatalogueEntry {
        alias: "smollm2-135m",
        target: SMOLLM2,
        description: "same as smollm2",
    },
    CatalogueEntry {
        alias: "llama",
        target: SMOLLM2,
        description: "same as smollm2: the smallest fetchable llama-architecture model",
    },
    CatalogueEntry {
        alias: "qwen-coder-0.5b",
        target: QWEN_05,
        description: "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2 architecture)",
    },
    CatalogueEntry {
        alias: "qwen-0.5b",
        target: QWEN_05,
        description: "same as qwen-coder-0.5b",
    },
    CatalogueEntry {
        alias: "qwen-coder-1.5b",
        target: QWEN_15,
        description: "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2 architecture)",
    },
    CatalogueEntry {
        alias: "qwen-1.5b",
        target: QWEN_15,
        description: "same as qwen-coder-1.5b",
    },
    CatalogueEntry {
        alias: "llama-3.2-1b",
        target: CatalogueTarget::HfRepo("meta-llama/Llama-3.2-1B-Instruct"),
        description: "meta-llama/Llama-3.2-1B-Instruct from the local Hugging Face cache",
    },
];

/// The built-in catalogue of model aliases.
pub fn catalogue() -> &'static [CatalogueEntry] {
    CATALOGUE
}

/// Looks up a catalogue alias.
pub fn catalogue_entry(alias: &str) -> Option<&'static CatalogueEntry> {
    CATALOGUE.iter().find(|e| e.alias == alias)
}

/// The environment resolution reads: directories and whether fetching is allowed. Built from
/// process environment variables by [`ResolveEnv::from_env`]; tests build it explicitly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveEnv {
    /// Where catalogue GGUFs live (`SPECSPLIT_MODELS_DIR`).
    pub models_dir: PathBuf,
    /// The Hugging Face hub cache (`.../hub`, holding `models--org--name`).
    pub hf_cache: PathBuf,
    /// `scripts/fetch-models.sh`, if found.
    pub fetch_script: Option<PathBuf>,
    /// Whether a missing catalogue file is fetched (false with `SPECSPLIT_NO_FETCH=1`).
    pub allow_fetch: bool,
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The specsplit checkout: `SPECSPLIT_HOME`, else the workspace this crate was built in (if
/// it still exists).
pub fn workspace_root() -> Option<PathBuf> {
    if let Some(home) = env_path("SPECSPLIT_HOME") {
        return Some(home);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    built
        .join("Cargo.toml")
        .exists()
        .then(|| built.canonicalize().unwrap_or(built))
}

/// The models directory: `SPECSPLIT_MODELS_DIR`, else `<workspace>/models`, else `./models`.
pub fn models_dir() -> PathBuf {
    env_path("SPECSPLIT_MODELS_DIR")
        .or_else(|| workspace_root().map(|w| w.join("models")))
        .unwrap_or_else(|| PathBuf::from("models"))
}

/// The Hugging Face hub cache: `HF_HUB_CACHE` (or legacy `HUGGINGFACE_HUB_CACHE`), else
/// `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn hf_cache_dir() -> PathBuf {
    env_path("HF_HUB_CACHE")
        .or_else(|| env_path("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| env_path("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env_path("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| env_path("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
        .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"))
}

impl ResolveEnv {
    /// Reads `SPECSPLIT_MODELS_DIR`, `SPECSPLIT_HOME`, `SPECSPLIT_NO_FETCH` and the HF cache
    /// variables.
    pub fn from_env() -> Self {
        let fetch_script = workspace_root()
            .map(|w| w.join("scripts").join("fetch-models.sh"))
            .filter(|p| p.is_file());
        let no_fetch = std::env::var("SPECSPLIT_NO_FETCH").is_ok_and(|v| !v.is_empty() && v != "0");
        Self {
            models_dir: models_dir(),
            hf_cache: hf_cache_dir(),
            fetch_script,
            allow_fetch: !no_fetch,
        }
    }
}

/// Resolves a `--model` value using the process environment (see [`ResolveEnv::from_env`]).
pub fn resolve(spec: &str) -> Result<ResolvedModel, ModelError> {
    resolve_with(spec, &ResolveEnv::from_env())
}

/// Parses `random:<preset>[:seed]` (seed defaults to 0).
fn parse_random(rest: &str) -> Result<(String, u64), ModelError> {
    let (preset, seed) = match rest.split_once(':') {
        Some((p, s)) => {
            let seed = s.parse::<u64>().map_err(|_| {
                ModelError::NotFound(format!(
                    "bad seed `{s}` in `random:{rest}`; expected random:<preset>[:<u64 seed>]"
                ))
            })?;
            (p, seed)
        }
        None => (rest, 0),
    };
    if preset.is_empty() {
        return Err(ModelError::NotFound(
            "`random:` needs a preset name: random:<preset>[:seed], e.g. random:tiny:7".into(),
        ));
    }
    Ok((preset.to_string(), seed))
}

/// Parses `org/name[@revision]`, or `None` if the value does not look like a repo id.
fn parse_repo_id(spec: &str) -> Option<(String, Option<String>)> {
    let (repo, revision) = match spec.split_once('@') {
        Some((r, rev)) if !rev.is_empty() => (r, Some(rev.to_string())),
        Some(_) => return None,
        None => (spec, None),
    };
    let (org, name) = repo.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with(['.', '-'])
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (ok(org) && ok(name) && !name.contains("..")).then(|| (repo.to_string(), revision))
}

fn alias_list() -> String {
    CATALOGUE
        .iter()
        .map(|e| e.alias)
        .collect::<Vec<_>>()
        .join(", ")
}

fn not_found_help(spec: &str) -> ModelError {
    ModelError::NotFound(format!(
        "no model at `{spec}`; expected a directory with config.json, tokenizer.json and \
         *.safetensors, a .gguf file, a Hugging Face repo id org/name[@revision] in the local \
         cache, random:<preset>[:seed], or one of: {}",
        alias_list()
    ))
}

/// Resolves a `--model` value against an explicit environment.
///
/// Order: `random:` prefix; an existing path (directory or `.gguf` file); a catalogue alias; a
/// Hugging Face repo id.
pub fn resolve_with(spec: &str, env: &ResolveEnv) -> Result<ResolvedModel, ModelError> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(not_found_help(spec));
    }
    if let Some(rest) = spec.strip_prefix("random:") {
        let (preset, seed) = parse_random(rest)?;
        return Ok(ResolvedModel {
            name: format!("random:{preset}:{seed}"),
            source: ModelSource::Random {
                preset: preset.clone(),
                seed,
            },
            files: ModelFiles::Random { preset, seed },
        });
    }
    let path = Path::new(spec);
    if path.is_dir() {
        return resolve_dir(
            path,
            ModelSource::LocalDir(path.to_path_buf()),
            display_name(path),
        );
    }
    if path.is_file() {
        if has_gguf_ext(path) {
            return Ok(gguf_model(path, display_name(path)));
        }
        return Err(ModelError::NotFound(format!(
            "`{spec}` is a file but not a .gguf; for Hugging Face safetensors models pass the \
             directory holding config.json, tokenizer.json and *.safetensors"
        )));
    }
    if has_gguf_ext(path) {
        return Err(ModelError::NotFound(format!(
            "GGUF file `{spec}` does not exist"
        )));
    }
    if let Some(entry) = catalogue_entry(spec) {
        return resolve_catalogue(entry, env);
    }
    if let Some((repo, revision)) = parse_repo_id(spec) {
        return resolve_hf(&repo, revision, &env.hf_cache, spec.to_string()).map_err(|e| match e {
            ModelError::NotFound(msg) => ModelError::NotFound(format!(
                "{msg} (`{spec}` is not an existing local path either)"
            )),
            other => other,
        });
    }
    Err(not_found_help(spec))
}

fn has_gguf_ext(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn display_name(path: &Path) -> String {
    path.file_stem()
        .or_else(|| path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// A GGUF model, picking up `<stem>.tokenizer.json` or `tokenizer.json` beside it.
fn gguf_model(path: &Path, name: String) -> ResolvedModel {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    let tokenizer = stem
        .map(|s| dir.join(format!("{s}.tokenizer.json")))
        .into_iter()
        .chain([dir.join("tokenizer.json")])
        .find(|p| p.is_file());
    ResolvedModel {
        name,
        source: ModelSource::Gguf(path.to_path_buf()),
        files: ModelFiles::Gguf {
            path: path.to_path_buf(),
            tokenizer,
        },
    }
}

fn gguf_files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| has_gguf_ext(p) && p.is_file())
        .collect();
    v.sort();
    v
}

/// Resolves a directory (local or an HF snapshot): safetensors layout, or a single GGUF.
fn resolve_dir(dir: &Path, source: ModelSource, name: String) -> Result<ResolvedModel, ModelError> {
    let config = dir.join("config.json");
    if !config.is_file() {
        let ggufs = gguf_files_in(dir);
        return match ggufs.as_slice() {
            [one] => {
                let mut m = gguf_model(one, name);
                if !matches!(source, ModelSource::LocalDir(_)) {
                    m.source = source;
                }
                Ok(m)
            }
            [] => Err(ModelError::NotFound(format!(
                "directory {} has no config.json (and no .gguf file); expected config.json, \
                 tokenizer.json and *.safetensors",
                dir.display()
            ))),
            many => Err(ModelError::NotFound(format!(
                "directory {} holds several .gguf files ({}); pass the file you want",
                dir.display(),
                many.iter()
                    .map(|p| display_name(p))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        };
    }
    let tokenizer = dir.join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(ModelError::NotFound(format!(
            "directory {} has config.json but no tokenizer.json",
            dir.display()
        )));
    }
    let weights = safetensors_in(dir)?;
    Ok(ResolvedModel {
        name,
        source,
        files: ModelFiles::Safetensors {
            dir: dir.to_path_buf(),
            config,
            tokenizer,
            weights,
        },
    })
}

/// The safetensors files of a directory: `model.safetensors`, every shard named by
/// `model.safetensors.index.json`, or else all `*.safetensors` files; all must exist.
fn safetensors_in(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.display().to_string(),
            source,
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Weights(format!("{} has no weight_map", index.display())))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        let missing: Vec<String> = files
            .iter()
            .filter(|f| !f.is_file())
            .map(|f| display_name(f))
            .collect();
        if !missing.is_empty() {
            return Err(ModelError::NotFound(format!(
                "{} names shards that are missing: {} (incomplete download?)",
                index.display(),
                missing.join(", ")
            )));
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors") && p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::NotFound(format!(
            "directory {} has config.json but no model.safetensors, \
             model.safetensors.index.json or *.safetensors",
            dir.display()
        )));
    }
    Ok(files)
}

fn resolve_catalogue(
    entry: &CatalogueEntry,
    env: &ResolveEnv,
) -> Result<ResolvedModel, ModelError> {
    match entry.target {
        CatalogueTarget::HfRepo(repo) => {
            let mut m = resolve_hf(repo, None, &env.hf_cache, entry.alias.to_string())?;
            m.name = entry.alias.to_string();
            Ok(m)
        }
        CatalogueTarget::Fetchable { file, fetch_name } => {
            let path = env.models_dir.join(file);
            if !path.is_file() {
                fetch(fetch_name, &path, env)?;
            }
            Ok(gguf_model(&path, entry.alias.to_string()))
        }
    }
}

/// The shell command that fetches a catalogue model.
pub fn fetch_command(fetch_name: &str, models_dir: &Path, script: Option<&Path>) -> String {
    let script = script
        .map(|s| s.display().to_string())
        .unwrap_or_else(|| "scripts/fetch-models.sh".to_string());
    format!(
        "SPECSPLIT_MODELS_DIR={} {script} {fetch_name}",
        models_dir.display()
    )
}

/// Runs `scripts/fetch-models.sh <fetch_name>` (its output goes to stderr), or explains how to.
fn fetch(fetch_name: &str, path: &Path, env: &ResolveEnv) -> Result<(), ModelError> {
    let cmd = fetch_command(fetch_name, &env.models_dir, env.fetch_script.as_deref());
    let Some(script) = env.fetch_script.as_deref().filter(|_| env.allow_fetch) else {
        return Err(ModelError::NotFound(format!(
            "{} is missing; fetch it with: {cmd}",
            path.display()
        )));
    };
    tracing::info!(model = fetch_name, "fetching with {}", script.display());
    let status = Command::new("bash")
        .arg(script)
        .arg(fetch_name)
        .env("SPECSPLIT_MODELS_DIR", &env.models_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|source| ModelError::Io {
            path: script.display().to_string(),
            source,
        })?;
    if !status.success() || !path.is_file() {
        return Err(ModelError::NotFound(format!(
            "fetching {} failed ({status}); run it by hand: {cmd}",
            path.display()
        )));
    }
    Ok(())
}

/// The snapshot directory of `repo` at `revision` (branch/tag via `refs/`, or a commit hash)
/// in the hub cache at `cache`.
pub fn hf_snapshot_dir(
    cache: &Path,
    repo: &str,
    revision: Option<&str>,
) -> Result<PathBuf, ModelError> {
    let rev = revision.unwrap_or("main");
    let repo_dir = cache.join(Repo::new(repo.to_string(), RepoType::Model).folder_name());
    let download_hint = format!(
        "specsplit reads the local Hugging Face cache only; populate it with \
         `huggingface-cli download {repo}{}` (cache: {}; set HF_HUB_CACHE or HF_HOME to use \
         another)",
        revision
            .map(|r| format!(" --revision {r}"))
            .unwrap_or_default(),
        cache.display()
    );
    if !repo_dir.is_dir() {
        return Err(ModelError::NotFound(format!(
            "Hugging Face repo `{repo}` is not in the local cache; {download_hint}"
        )));
    }
    let snapshots = repo_dir.join("snapshots");
    let by_ref = std::fs::read_to_string(repo_dir.join("refs").join(rev))
        .ok()
        .map(|commit| snapshots.join(commit.trim()));
    let snapshot = by_ref
        .filter(|p| p.is_dir())
        .or_else(|| Some(snapshots.join(rev)).filter(|p| p.is_dir()));
    snapshot.ok_or_else(|| {
        ModelError::NotFound(format!(
            "revision `{rev}` of `{repo}` is not in the local cache; {download_hint}"
        ))
    })
}

fn resolve_hf(
    repo: &str,
    revision: Option<String>,
    cache: &Path,
    name: String,
) -> Result<ResolvedModel, ModelError> {
    let snapshot = hf_snapshot_dir(cache, repo, revision.as_deref())?;
    let source = ModelSource::HfRepo {
        repo: repo.to_string(),
        revision,
    };
    resolve_dir(&snapshot, source, name).map_err(|e| match e {
        ModelError::NotFound(msg) => ModelError::NotFound(format!(
            "`{repo}` in the local Hugging Face cache is incomplete: {msg}"
        )),
        other => other,
    })
}
