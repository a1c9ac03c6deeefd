//! Where a model comes from: one `--model` value names a local directory, a `.gguf` file, a
//! Hugging Face repo, random weights of a preset shape, or an alias from a small built-in
//! catalogue. [`resolve`] turns it into concrete files.
//!
//! A Hugging Face repo is named `org/name[@revision][:file]`. It is read from the local hub
//! cache (`HF_HUB_CACHE`, `HF_HOME/hub` or `~/.cache/huggingface/hub`) when the files the loader
//! needs are there, with no network access; otherwise they are downloaded into that cache from
//! the Hub (`HF_ENDPOINT`, `HF_TOKEN`), which `HF_HUB_OFFLINE=1` forbids. What is downloaded,
//! and how the `.gguf` file of a GGUF repo is picked (`:file` names a file or a quantization
//! tag), is described in [`crate::hub`]. Catalogue GGUFs are fetched into the models directory
//! by `scripts/fetch-models.sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use hf_hub::{Repo, RepoType};

use crate::hub::{self, HubOptions, RepoRequest};
use crate::ModelError;

/// What a `--model` value names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory with `config.json`, `tokenizer.json` and safetensors weights.
    LocalDir(PathBuf),
    /// A single GGUF file.
    Gguf(PathBuf),
    /// A Hugging Face repo, from the local hub cache or downloaded into it.
    HfRepo {
        /// `org/name`.
        repo: String,
        /// Branch, tag or commit; `None` means `main`.
        revision: Option<String>,
        /// For a GGUF repo, the `.gguf` file or quantization tag given after `:`.
        file: Option<String>,
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
    /// A Hugging Face repo, downloaded into the hub cache when missing.
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
        description:
            "meta-llama/Llama-3.2-1B-Instruct from the Hugging Face Hub (gated: needs HF_TOKEN)",
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

/// The environment resolution reads: directories, whether fetching is allowed and how to reach
/// the Hub. Built from process environment variables by [`ResolveEnv::from_env`]; tests build it
/// explicitly.
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
    /// How Hugging Face repos missing from `hf_cache` are downloaded.
    pub hub: HubOptions,
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
    /// Reads `SPECSPLIT_MODELS_DIR`, `SPECSPLIT_HOME`, `SPECSPLIT_NO_FETCH`, the HF cache
    /// variables and the Hub's (see [`HubOptions::from_env`]).
    pub fn from_env() -> Self {
        let fetch_script = workspace_root()
            .map(|w| w.join("scripts").join("fetch-models.sh"))
            .filter(|p| p.is_file());
        let no_fetch = std::env::var("SPECSPLIT_NO_FETCH").is_ok_and(|v| !v.is_empty() && v != "0");
        Self {
            models_dir: models_dir(),
            hf_cache: hf_cache_dir(),
            hub: HubOptions::from_env(),
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

/// A Hugging Face repo id with its optional revision and GGUF file.
struct RepoId {
    repo: String,
    revision: Option<String>,
    file: Option<String>,
}

/// Parses `org/name[@revision][:file]`, or `None` if the value does not look like a repo id.
/// Git refs cannot hold `:`, so the first `:` starts the file.
fn parse_repo_id(spec: &str) -> Option<RepoId> {
    let (spec, file) = match spec.split_once(':') {
        Some((s, f))
            if !f.is_empty()
                && !f.starts_with('/')
                && !f.split('/').any(|c| c.is_empty() || c == "..") =>
        {
            (s, Some(f.to_string()))
        }
        Some(_) => return None,
        None => (spec, None),
    };
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
    (ok(org) && ok(name) && !name.contains("..")).then(|| RepoId {
        repo: repo.to_string(),
        revision,
        file,
    })
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
         *.safetensors, a .gguf file, a Hugging Face repo id org/name[@revision][:file.gguf], \
         random:<preset>[:seed], or one of: {}",
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
    let repo_id = parse_repo_id(spec);
    if has_gguf_ext(path) && repo_id.as_ref().is_none_or(|id| id.file.is_none()) {
        return Err(ModelError::NotFound(format!(
            "GGUF file `{spec}` does not exist"
        )));
    }
    if let Some(entry) = catalogue_entry(spec) {
        return resolve_catalogue(entry, env);
    }
    if let Some(id) = repo_id {
        return resolve_hf(&id, env, spec.to_string()).map_err(|e| match e {
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
            let id = RepoId {
                repo: repo.to_string(),
                revision: None,
                file: None,
            };
            let mut m = resolve_hf(&id, env, entry.alias.to_string())?;
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
        "populate it with `huggingface-cli download {repo}{}` (cache: {}; set HF_HUB_CACHE or \
         HF_HOME to use another)",
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

/// A repo from the cache when complete there, else downloaded into it (unless offline).
fn resolve_hf(id: &RepoId, env: &ResolveEnv, name: String) -> Result<ResolvedModel, ModelError> {
    let cached = resolve_hf_cached(id, &env.hf_cache, name.clone());
    let missing = match cached {
        Err(ModelError::NotFound(msg)) => msg,
        other => return other,
    };
    if env.hub.offline {
        return Err(ModelError::NotFound(format!(
            "{missing}; HF_HUB_OFFLINE is set, so nothing is downloaded: unset it to fetch `{}` \
             from {}",
            id.repo, env.hub.endpoint
        )));
    }
    tracing::info!(repo = %id.repo, "not in the Hugging Face cache ({missing}); downloading");
    let req = RepoRequest {
        repo: &id.repo,
        revision: id.revision.as_deref(),
        gguf: id.file.as_deref(),
    };
    let got = hub::download(&req, &env.hf_cache, &env.hub)?;
    let source = hf_source(id);
    match got.gguf {
        Some(file) => {
            let mut m = gguf_model(&got.snapshot.join(file), name);
            m.source = source;
            Ok(m)
        }
        None => resolve_dir(&got.snapshot, source, name),
    }
}

fn hf_source(id: &RepoId) -> ModelSource {
    ModelSource::HfRepo {
        repo: id.repo.clone(),
        revision: id.revision.clone(),
        file: id.file.clone(),
    }
}

/// Relative names of the `.gguf` files under `dir`, at most one directory deep.
fn gguf_names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = gguf_files_in(dir)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let subdirs = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir());
    for sub in subdirs {
        let prefix = sub.file_name().to_string_lossy().into_owned();
        names.extend(gguf_files_in(&sub.path()).iter().filter_map(|p| {
            p.file_name()
                .map(|n| format!("{prefix}/{}", n.to_string_lossy()))
        }));
    }
    names.sort();
    names
}

fn resolve_hf_cached(id: &RepoId, cache: &Path, name: String) -> Result<ResolvedModel, ModelError> {
    let repo = id.repo.as_str();
    let snapshot = hf_snapshot_dir(cache, repo, id.revision.as_deref())?;
    let source = hf_source(id);
    let incomplete = |msg: String| {
        ModelError::NotFound(format!(
            "`{repo}` in the local Hugging Face cache is incomplete: {msg}"
        ))
    };
    if id.file.is_some() || !snapshot.join("config.json").is_file() {
        let names = gguf_names_in(&snapshot);
        if id.file.is_some() || !names.is_empty() {
            let file = hub::pick_gguf(&names, id.file.as_deref()).map_err(incomplete)?;
            let mut m = gguf_model(&snapshot.join(file), name);
            m.source = source;
            return Ok(m);
        }
    }
    resolve_dir(&snapshot, source, name).map_err(|e| match e {
        ModelError::NotFound(msg) => incomplete(msg),
        other => other,
    })
}
