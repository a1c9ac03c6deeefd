//! Downloading a model repo from the Hugging Face Hub into the local hub cache.
//!
//! [`download`] fetches the files the loader needs, and nothing else, with the `hf-hub` crate's
//! async API into the standard cache layout (`models--org--name/{blobs,refs,snapshots}`):
//!
//! - a safetensors repo (one with `config.json`): `config.json`, `tokenizer.json`,
//!   `tokenizer_config.json` and `generation_config.json` when the repo has them, and
//!   `model.safetensors`, or `model.safetensors.index.json` and every shard it names, or else
//!   every top-level `*.safetensors` file;
//! - a GGUF repo (no `config.json`): one `.gguf` file, picked by [`pick_gguf`].
//!
//! Every file's size is asked for before any weight is fetched, and a repo with more than
//! [`HubOptions::max_files`] files or [`HubOptions::max_bytes`] bytes in all is refused.
//! [`HubOptions::from_env`] reads `HF_ENDPOINT`, `HF_TOKEN` (else the token file that
//! `huggingface-cli login` writes, [`token_file`]) and `HF_HUB_OFFLINE`.

use std::future::Future;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::tokio::{Api, ApiBuilder, ApiError, ApiRepo, Progress};
use hf_hub::{Cache, Repo, RepoType};
use http::header::{CONTENT_RANGE, RANGE};
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::ModelError;

/// The public Hugging Face Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Files the loader reads beside the weights when the repo has them.
const OPTIONAL_FILES: &[&str] = &["tokenizer_config.json", "generation_config.json"];

/// How download progress is shown on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// A progress bar per file (stderr is a terminal).
    Bar,
    /// One line when a file starts and one when it is done.
    Lines,
    /// Nothing.
    Quiet,
}

/// How to reach the Hub and what a download may fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubOptions {
    /// Base URL of the Hub (`HF_ENDPOINT`), without a trailing slash.
    pub endpoint: String,
    /// Bearer token (`HF_TOKEN`, else the `huggingface-cli login` token file).
    pub token: Option<String>,
    /// Never touch the network (`HF_HUB_OFFLINE`): only the local cache is read.
    pub offline: bool,
    /// How progress is shown.
    pub progress: ProgressMode,
    /// The most files one model may consist of.
    pub max_files: usize,
    /// The most bytes one model may download in all.
    pub max_bytes: u64,
}

impl Default for HubOptions {
    /// The public Hub, no token, online, progress lines, 512 files and 1 TiB at most.
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
            offline: false,
            progress: ProgressMode::Lines,
            max_files: 512,
            max_bytes: 1 << 40,
        }
    }
}

fn env_value(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Whether an environment value means "on" (`1`, `true`, `yes`, `on`), as `huggingface_hub`
/// reads its boolean variables.
pub fn env_flag(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// The token file `huggingface-cli login` writes: `HF_TOKEN_PATH`, else `$HF_HOME/token`, else
/// `$XDG_CACHE_HOME/huggingface/token`, else `~/.cache/huggingface/token`.
pub fn token_file() -> Option<PathBuf> {
    let path = |name: &str| env_value(name).map(PathBuf::from);
    path("HF_TOKEN_PATH")
        .or_else(|| path("HF_HOME").map(|h| h.join("token")))
        .or_else(|| path("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("token")))
        .or_else(|| path("HOME").map(|h| h.join(".cache").join("huggingface").join("token")))
}

impl HubOptions {
    /// Reads `HF_ENDPOINT`, `HF_TOKEN` (else `HUGGING_FACE_HUB_TOKEN`, else the token file of
    /// [`token_file`]) and `HF_HUB_OFFLINE`; a progress bar when stderr is a terminal, else
    /// progress lines.
    pub fn from_env() -> Self {
        let token = env_value("HF_TOKEN")
            .or_else(|| env_value("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let text = std::fs::read_to_string(token_file()?).ok()?;
                Some(text.trim().to_string()).filter(|t| !t.is_empty())
            });
        Self {
            endpoint: env_value("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()),
            token,
            offline: env_value("HF_HUB_OFFLINE").is_some_and(|v| env_flag(&v)),
            progress: if std::io::stderr().is_terminal() {
                ProgressMode::Bar
            } else {
                ProgressMode::Lines
            },
            ..Self::default()
        }
    }
}

/// A model repo to download: `org/name`, a revision and an optional GGUF pick.
#[derive(Debug, Clone, Copy)]
pub struct RepoRequest<'a> {
    /// `org/name`.
    pub repo: &'a str,
    /// Branch, tag or commit; `None` means `main`.
    pub revision: Option<&'a str>,
    /// A `.gguf` file name, or a quantization tag such as `Q8_0` (see [`pick_gguf`]).
    pub gguf: Option<&'a str>,
}

impl RepoRequest<'_> {
    fn revision(&self) -> &str {
        self.revision.unwrap_or("main")
    }

    fn label(&self) -> String {
        match self.revision {
            Some(rev) => format!("`{}` at revision `{rev}`", self.repo),
            None => format!("`{}`", self.repo),
        }
    }
}

/// Picks the GGUF file of a repo among `files` (repo-relative names).
///
/// With `pick` ending in `.gguf`: that file. With another `pick`: the one file whose name
/// contains it, ignoring case (a quantization tag such as `Q8_0`). Without: the only `.gguf`
/// file, else the one whose name contains `Q4_K_M`. Anything else is an error listing the
/// files to choose from.
pub fn pick_gguf(files: &[String], pick: Option<&str>) -> Result<String, String> {
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let list = || {
        if ggufs.is_empty() {
            "it has none".to_string()
        } else {
            format!(
                "it has {}",
                ggufs
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    };
    let containing = |tag: &str| -> Vec<&String> {
        let tag = tag.to_ascii_lowercase();
        ggufs
            .iter()
            .copied()
            .filter(|f| f.to_ascii_lowercase().contains(&tag))
            .collect()
    };
    match pick {
        Some(file) if file.to_ascii_lowercase().ends_with(".gguf") => ggufs
            .iter()
            .find(|f| f.as_str() == file)
            .map(|f| f.to_string())
            .ok_or_else(|| format!("no file `{file}` in the repo; {}", list())),
        Some(tag) => match containing(tag).as_slice() {
            [one] => Ok(one.to_string()),
            [] => Err(format!("no .gguf file matching `{tag}`; {}", list())),
            _ => Err(format!(
                "several .gguf files match `{tag}`; name one as org/name:<file>.gguf; {}",
                list()
            )),
        },
        None => match ggufs.as_slice() {
            [one] => Ok(one.to_string()),
            [] => Err(format!("no config.json and no .gguf file; {}", list())),
            _ => match containing("q4_k_m").as_slice() {
                [one] => Ok(one.to_string()),
                _ => Err(format!(
                    "several .gguf files and no single Q4_K_M one; name one as \
                     org/name:<file>.gguf or org/name:<quant>; {}",
                    list()
                )),
            },
        },
    }
}

/// The snapshot directory a download filled and, for a GGUF repo, the file picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Downloaded {
    /// `.../models--org--name/snapshots/<commit>`.
    pub snapshot: PathBuf,
    /// The `.gguf` file (repo-relative) for a GGUF repo.
    pub gguf: Option<String>,
}

/// Downloads what the loader needs of `req` into the hub cache at `cache`.
///
/// Runs on a runtime of its own in a scoped thread, so it may be called from inside or outside
/// a tokio runtime. Fails at once when `opts.offline` is set.
pub fn download(
    req: &RepoRequest<'_>,
    cache: &Path,
    opts: &HubOptions,
) -> Result<Downloaded, ModelError> {
    if opts.offline {
        return Err(ModelError::NotFound(format!(
            "{} is not in the local Hugging Face cache ({}) and HF_HUB_OFFLINE is set; \
             unset HF_HUB_OFFLINE to download it",
            req.label(),
            cache.display()
        )));
    }
    run_blocking(download_async(req, cache, opts))
}

fn run_blocking<F>(fut: F) -> Result<Downloaded, ModelError>
where
    F: Future<Output = Result<Downloaded, ModelError>> + Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| ModelError::Hub(format!("cannot start the download runtime: {e}")))?;
            rt.block_on(fut)
        })
        .join()
        .unwrap_or_else(|_| Err(ModelError::Hub("the download thread panicked".into())))
    })
}

/// One file to fetch and its size.
struct Planned {
    name: String,
    size: u64,
    cached: bool,
}

async fn download_async(
    req: &RepoRequest<'_>,
    cache: &Path,
    opts: &HubOptions,
) -> Result<Downloaded, ModelError> {
    let api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(opts.endpoint.clone())
        .with_token(opts.token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| classify(e, req, None, opts))?;
    let repo = api.repo(Repo::with_revision(
        req.repo.to_string(),
        RepoType::Model,
        req.revision().to_string(),
    ));
    let info = repo
        .info()
        .await
        .map_err(|e| classify(e, req, None, opts))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();

    let is_gguf = req.gguf.is_some() || !files.iter().any(|f| f == "config.json");
    let (names, gguf) = if is_gguf {
        let file = pick_gguf(&files, req.gguf).map_err(|e| {
            ModelError::NotFound(format!("{} on {}: {e}", req.label(), opts.endpoint))
        })?;
        (vec![file.clone()], Some(file))
    } else {
        (safetensors_files(&repo, &files, req, opts).await?, None)
    };
    if names.len() > opts.max_files {
        return Err(ModelError::Hub(format!(
            "{} needs {} files, more than the {} allowed; refusing to download",
            req.label(),
            names.len(),
            opts.max_files
        )));
    }
    if let Some(bad) = names
        .iter()
        .find(|n| n.starts_with('/') || n.split('/').any(|c| c.is_empty() || c == ".."))
    {
        return Err(ModelError::Hub(format!(
            "{} lists a file outside the repo: `{bad}`; refusing to download",
            req.label()
        )));
    }
    let snapshot = cache
        .join(Repo::new(req.repo.to_string(), RepoType::Model).folder_name())
        .join("snapshots")
        .join(&info.sha);
    // Sizes first, from the cache or the Hub: nothing is downloaded past the limit.
    let mut plan = Vec::with_capacity(names.len());
    for name in names {
        let cached = std::fs::metadata(snapshot.join(&name))
            .ok()
            .filter(|m| m.is_file());
        let size = match &cached {
            Some(m) => m.len(),
            None => file_size(&api, &repo, &name)
                .await
                .map_err(|e| classify(e, req, Some(&name), opts))?,
        };
        plan.push(Planned {
            name,
            size,
            cached: cached.is_some(),
        });
    }
    let total: u64 = plan.iter().map(|p| p.size).sum();
    if total > opts.max_bytes {
        return Err(ModelError::Hub(format!(
            "{} is {} in {} files, more than the {} allowed; refusing to download",
            req.label(),
            HumanBytes(total),
            plan.len(),
            HumanBytes(opts.max_bytes)
        )));
    }
    for p in plan.iter().filter(|p| !p.cached) {
        let path = repo
            .download_with_progress(&p.name, FileProgress::new(opts.progress, req.repo))
            .await
            .map_err(|e| classify(e, req, Some(&p.name), opts))?;
        if !path.starts_with(&snapshot) {
            return Err(ModelError::Hub(format!(
                "{} changed while downloading: `{}` came from another commit than {}; retry",
                req.label(),
                p.name,
                info.sha
            )));
        }
    }
    Ok(Downloaded { snapshot, gguf })
}

/// The safetensors layout's files, reading the shard index when there is one.
async fn safetensors_files(
    repo: &ApiRepo,
    files: &[String],
    req: &RepoRequest<'_>,
    opts: &HubOptions,
) -> Result<Vec<String>, ModelError> {
    let has = |f: &str| files.iter().any(|x| x == f);
    if !has("tokenizer.json") {
        return Err(ModelError::NotFound(format!(
            "{} on {} has config.json but no tokenizer.json, which specsplit needs",
            req.label(),
            opts.endpoint
        )));
    }
    let mut names: Vec<String> = ["config.json", "tokenizer.json"]
        .into_iter()
        .chain(OPTIONAL_FILES.iter().copied().filter(|f| has(f)))
        .map(String::from)
        .collect();
    const INDEX: &str = "model.safetensors.index.json";
    if has("model.safetensors") {
        names.push("model.safetensors".into());
    } else if has(INDEX) {
        let index = repo
            .get(INDEX)
            .await
            .map_err(|e| classify(e, req, Some(INDEX), opts))?;
        names.push(INDEX.into());
        names.extend(index_shards(&index, opts)?);
    } else {
        let mut weights: Vec<String> = files
            .iter()
            .filter(|f| !f.contains('/') && f.ends_with(".safetensors"))
            .cloned()
            .collect();
        if weights.is_empty() {
            return Err(ModelError::NotFound(format!(
                "{} on {} has config.json but no model.safetensors, {INDEX} or *.safetensors",
                req.label(),
                opts.endpoint
            )));
        }
        weights.sort();
        names.extend(weights);
    }
    Ok(names)
}

/// The shards a safetensors index names, refused when too many or too large.
fn index_shards(index: &Path, opts: &HubOptions) -> Result<Vec<String>, ModelError> {
    let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
        path: index.display().to_string(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
    let mut shards: Vec<String> = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Weights(format!("{} has no weight_map", index.display())))?
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    shards.sort();
    shards.dedup();
    if let Some(bad) = shards
        .iter()
        .find(|s| s.starts_with('/') || s.split('/').any(|c| c == ".."))
    {
        return Err(ModelError::Weights(format!(
            "{} names a shard outside the repo: {bad}",
            index.display()
        )));
    }
    if shards.len() > opts.max_files {
        return Err(ModelError::Hub(format!(
            "{} names {} shards, more than the {} allowed; refusing to download",
            index.display(),
            shards.len(),
            opts.max_files
        )));
    }
    let total = json
        .pointer("/metadata/total_size")
        .and_then(|v| v.as_u64());
    if let Some(total) = total.filter(|&t| t > opts.max_bytes) {
        return Err(ModelError::Hub(format!(
            "{} gives a total size of {}, more than the {} allowed; refusing to download",
            index.display(),
            HumanBytes(total),
            HumanBytes(opts.max_bytes)
        )));
    }
    Ok(shards)
}

/// A file's size from a one-byte range request, as the Hub answers it (`Content-Range`).
async fn file_size(api: &Api, repo: &ApiRepo, name: &str) -> Result<u64, ApiError> {
    let response = api
        .client()
        .get(repo.url(name))
        .header(RANGE, "bytes=0-0")
        .send()
        .await?
        .error_for_status()?;
    let range = response
        .headers()
        .get(CONTENT_RANGE)
        .ok_or(ApiError::MissingHeader(CONTENT_RANGE))?
        .to_str()?;
    Ok(range
        .rsplit('/')
        .next()
        .ok_or(ApiError::InvalidHeader(CONTENT_RANGE))?
        .parse()?)
}

/// Turns an `hf-hub` error into an actionable one: what to set or check.
fn classify(
    e: ApiError,
    req: &RepoRequest<'_>,
    file: Option<&str>,
    opts: &HubOptions,
) -> ModelError {
    let what = match file {
        Some(f) => format!("`{f}` of {}", req.label()),
        None => req.label(),
    };
    let endpoint = &opts.endpoint;
    match e {
        ApiError::TooManyRetries(inner) => classify(*inner, req, file, opts),
        ApiError::RequestError(re) => match re.status().map(|s| s.as_u16()) {
            Some(code @ (401 | 403)) => {
                let hint = if opts.token.is_some() {
                    "HF_TOKEN is set but was refused: check that the token is valid and has \
                     access to this repo (accept its licence on the repo's page)"
                } else {
                    "the repo is gated, private or does not exist: set HF_TOKEN to a token \
                     with access (https://huggingface.co/settings/tokens)"
                };
                ModelError::Hub(format!("{endpoint} refused {what} (HTTP {code}); {hint}"))
            }
            Some(404) => ModelError::NotFound(match file {
                Some(f) => format!(
                    "file `{f}` not found in {} on {endpoint} (HTTP 404)",
                    req.label()
                ),
                None => format!(
                    "repo {} not found on {endpoint} (HTTP 404); check the repo id and the \
                     revision",
                    req.label()
                ),
            }),
            Some(code) => ModelError::Hub(format!("{endpoint} answered HTTP {code} for {what}")),
            None if re.is_connect() || re.is_timeout() || re.is_request() => {
                ModelError::Hub(format!(
                    "cannot reach the Hugging Face Hub at {endpoint} to fetch {what} ({}); \
                     check the network or HF_ENDPOINT, or use a model already in the cache \
                     with HF_HUB_OFFLINE=1",
                    causes(&re)
                ))
            }
            None => ModelError::Hub(format!(
                "fetching {what} from {endpoint} failed: {}",
                causes(&re)
            )),
        },
        ApiError::MissingHeader(h) | ApiError::InvalidHeader(h) => ModelError::Hub(format!(
            "{endpoint} does not answer like a Hugging Face Hub for {what}: header `{h}` is \
             missing or invalid (is HF_ENDPOINT right?)"
        )),
        ApiError::LockAcquisition(path) => ModelError::Hub(format!(
            "{} is locked by another download of {what}; wait for it or remove the lock",
            path.display()
        )),
        ApiError::IoError(source) => ModelError::Io {
            path: format!("the hub cache while fetching {what}"),
            source,
        },
        other => ModelError::Hub(format!("fetching {what} from {endpoint} failed: {other}")),
    }
}

/// An error and its chain of causes, `: `-separated (connection refused, DNS failure, TLS).
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text = format!("{text}: {line}");
        }
        source = cause.source();
    }
    text
}

/// Download progress of one file on stderr.
#[derive(Clone)]
struct FileProgress {
    mode: ProgressMode,
    repo: String,
    file: String,
    size: usize,
    bar: Option<ProgressBar>,
}

impl FileProgress {
    fn new(mode: ProgressMode, repo: &str) -> Self {
        Self {
            mode,
            repo: repo.to_string(),
            file: String::new(),
            size: 0,
            bar: None,
        }
    }
}

impl Progress for FileProgress {
    async fn init(&mut self, size: usize, filename: &str) {
        self.file = filename.to_string();
        self.size = size;
        match self.mode {
            ProgressMode::Bar => {
                let bar =
                    ProgressBar::with_draw_target(Some(size as u64), ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_message(format!("{}/{filename}", self.repo));
                self.bar = Some(bar);
            }
            ProgressMode::Lines => eprintln!(
                "downloading {}/{filename} ({})",
                self.repo,
                HumanBytes(size as u64)
            ),
            ProgressMode::Quiet => {}
        }
    }

    async fn update(&mut self, size: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(size as u64);
        }
    }

    async fn finish(&mut self) {
        match (&self.bar, self.mode) {
            (Some(bar), _) => bar.finish(),
            (None, ProgressMode::Lines) => eprintln!("downloaded {}/{}", self.repo, self.file),
            _ => {}
        }
    }
}
