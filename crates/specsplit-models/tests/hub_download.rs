//! `--model org/name` downloads from a Hugging Face Hub: a local HTTP server started in each test
//! serves tiny repos in the Hub's URL layout (`/api/models/{repo}/revision/{rev}` and
//! `/{repo}/resolve/{rev}/{file}`, answering range requests with `ETag`, `X-Repo-Commit` and
//! `Content-Range` as the Hub does). Everything goes through an explicit `ResolveEnv`, so no
//! process environment variable is touched.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use candle_core::{DType, Device, Tensor};
use specsplit_models::hub::{HubOptions, ProgressMode};
use specsplit_models::loader::{load_model, load_resolved, LoadOptions};
use specsplit_models::source::{resolve_with, ModelFiles, ModelSource, ResolveEnv};
use specsplit_models::tokenizer::TextTokenizer;
use specsplit_models::transformer::Transformer;
use specsplit_models::ModelError;

const TOKEN: &str = "hf_test_token";

/// One repo of the fake Hub: its files and the commit `main` points at.
struct FakeRepo {
    files: BTreeMap<String, Vec<u8>>,
    commit: String,
    gated: bool,
}

/// The fake Hub's state: repos by id and the paths requested.
#[derive(Default)]
struct FakeHub {
    repos: HashMap<String, FakeRepo>,
    requests: Mutex<Vec<String>>,
}

impl FakeHub {
    fn add(&mut self, id: &str, commit: &str, gated: bool, files: BTreeMap<String, Vec<u8>>) {
        self.repos.insert(
            id.to_string(),
            FakeRepo {
                files,
                commit: commit.to_string(),
                gated,
            },
        );
    }
}

fn status(code: StatusCode, text: &str) -> Response {
    (code, text.to_string()).into_response()
}

/// The Hub's answer to one request.
async fn answer(State(hub): State<Arc<FakeHub>>, headers: HeaderMap, uri: Uri) -> Response {
    let path = uri.path().to_string();
    hub.requests.lock().unwrap().push(path.clone());
    let (api, rest) = match path.strip_prefix("/api/models/") {
        Some(rest) => (true, rest.to_string()),
        None => (false, path.trim_start_matches('/').to_string()),
    };
    let parts: Vec<&str> = rest.splitn(5, '/').collect();
    let (id, kind, rev) = match parts.as_slice() {
        [org, name, kind, rev, ..] => (format!("{org}/{name}"), *kind, *rev),
        _ => return status(StatusCode::NOT_FOUND, "Not Found"),
    };
    let Some(repo) = hub.repos.get(&id) else {
        return status(StatusCode::NOT_FOUND, "Repository not found");
    };
    let bearer = format!("Bearer {TOKEN}");
    let authorized = headers
        .get(header::AUTHORIZATION)
        .is_some_and(|v| v.to_str().ok() == Some(bearer.as_str()));
    if repo.gated && !authorized {
        return status(
            StatusCode::UNAUTHORIZED,
            "Access to this repo is restricted",
        );
    }
    if rev != "main" && rev != repo.commit {
        return status(StatusCode::NOT_FOUND, "Revision not found");
    }
    if api && kind == "revision" && parts.len() == 4 {
        let siblings: Vec<_> = repo
            .files
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({ "sha": repo.commit, "siblings": siblings });
        return (
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    if api || kind != "resolve" || parts.len() != 5 {
        return status(StatusCode::NOT_FOUND, "Not Found");
    }
    let Some(data) = repo.files.get(parts[4]) else {
        return status(StatusCode::NOT_FOUND, "Entry not found");
    };
    let etag = format!("\"{:016x}{}\"", fnv(data), data.len());
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
    let mut response = match range {
        Some((start, stop)) if start < data.len() => {
            let stop = stop.min(data.len() - 1);
            let mut r = Response::new(Body::from(data[start..=stop].to_vec()));
            *r.status_mut() = StatusCode::PARTIAL_CONTENT;
            r.headers_mut().insert(
                header::CONTENT_RANGE,
                format!("bytes {start}-{stop}/{}", data.len())
                    .parse()
                    .unwrap(),
            );
            r
        }
        _ => Response::new(Body::from(data.clone())),
    };
    let h = response.headers_mut();
    h.insert(header::ETAG, etag.parse().unwrap());
    h.insert("x-repo-commit", repo.commit.parse().unwrap());
    response
}

/// FNV-1a: a content hash for the fake ETag.
fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A running fake Hub; dropping it stops the server.
struct Server {
    addr: SocketAddr,
    hub: Arc<FakeHub>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    fn start(hub: FakeHub) -> Self {
        let hub = Arc::new(hub);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(answer).with_state(hub.clone());
        runtime.spawn(async move { axum::serve(listener, app).await });
        Self {
            addr,
            hub,
            runtime: Some(runtime),
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requested(&self, needle: &str) -> usize {
        let requests = self.hub.requests.lock().unwrap();
        requests.iter().filter(|p| p.contains(needle)).count()
    }

    fn stop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specsplit-hub-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn env(root: &Path, endpoint: &str) -> ResolveEnv {
    ResolveEnv {
        models_dir: root.join("models"),
        hf_cache: root.join("hub"),
        fetch_script: None,
        allow_fetch: false,
        hub: HubOptions {
            endpoint: endpoint.to_string(),
            progress: ProgressMode::Lines,
            ..HubOptions::default()
        },
    }
}

/// Writes a tiny Llama model in the Hugging Face layout.
fn write_tiny_hf_dir(dir: &Path) {
    let (vocab, hidden, inter, layers, heads, kv) =
        (512usize, 64usize, 128usize, 2, 4usize, 2usize);
    let hd = hidden / heads;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": false, "eos_token_id": 256
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let dev = Device::Cpu;
    let rand = |shape: &[usize]| Tensor::randn(0f32, 0.5, shape, &dev).unwrap();
    let ones = |n: usize| Tensor::ones(n, DType::F32, &dev).unwrap();
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert("model.embed_tokens.weight".into(), rand(&[vocab, hidden]));
    t.insert("lm_head.weight".into(), rand(&[vocab, hidden]));
    t.insert("model.norm.weight".into(), ones(hidden));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t.insert(
            format!("{p}.self_attn.q_proj.weight"),
            rand(&[heads * hd, hidden]),
        );
        t.insert(
            format!("{p}.self_attn.k_proj.weight"),
            rand(&[kv * hd, hidden]),
        );
        t.insert(
            format!("{p}.self_attn.v_proj.weight"),
            rand(&[kv * hd, hidden]),
        );
        t.insert(
            format!("{p}.self_attn.o_proj.weight"),
            rand(&[hidden, heads * hd]),
        );
        t.insert(format!("{p}.mlp.gate_proj.weight"), rand(&[inter, hidden]));
        t.insert(format!("{p}.mlp.up_proj.weight"), rand(&[inter, hidden]));
        t.insert(format!("{p}.mlp.down_proj.weight"), rand(&[hidden, inter]));
        t.insert(format!("{p}.input_layernorm.weight"), ones(hidden));
        t.insert(format!("{p}.post_attention_layernorm.weight"), ones(hidden));
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    TextTokenizer::byte_level(vocab)
        .unwrap()
        .inner()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
}

/// The files of a directory by name.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Greedy continuation of `prompt` by `n` tokens.
fn greedy(model: &Transformer, prompt: &[u32], n: usize) -> Vec<u32> {
    let dev = Device::Cpu;
    let mut cache = model.new_cache(64).unwrap();
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let start = cache.len() as u32;
        let pos: Vec<u32> = (start..start + input.len() as u32).collect();
        let logits: Vec<f32> = model
            .forward(
                &Tensor::new(input.as_slice(), &dev).unwrap(),
                &Tensor::new(pos.as_slice(), &dev).unwrap(),
                None,
                &mut cache,
                &Tensor::new(&[input.len() as u32 - 1], &dev).unwrap(),
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        out.push(next);
        input = vec![next];
    }
    out
}

fn err_text(r: Result<impl std::fmt::Debug, ModelError>) -> String {
    match r {
        Err(e) => e.to_string(),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

const COMMIT: &str = "1111111111111111111111111111111111111111";

#[test]
fn a_safetensors_repo_downloads_loads_and_is_then_read_from_the_cache() {
    let root = scratch("safetensors");
    let local = root.join("local-model");
    std::fs::create_dir_all(&local).unwrap();
    write_tiny_hf_dir(&local);
    let mut files = files_of(&local);
    files.insert("README.md".into(), b"not needed".to_vec());
    let mut hub = FakeHub::default();
    hub.add("test-org/tiny-model", COMMIT, false, files);
    let mut server = Server::start(hub);
    let mut e = env(&root, &server.endpoint());

    // Offline with an empty cache: nothing is fetched and the error says why and what to do.
    e.hub.offline = true;
    let msg = err_text(resolve_with("test-org/tiny-model", &e));
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
    assert!(msg.contains("test-org/tiny-model"), "{msg}");
    assert_eq!(server.requested("/"), 0, "offline touched the network");
    e.hub.offline = false;

    let m = resolve_with("test-org/tiny-model", &e).unwrap();
    let snapshot = e
        .hf_cache
        .join("models--test-org--tiny-model/snapshots")
        .join(COMMIT);
    match &m.files {
        ModelFiles::Safetensors { dir, weights, .. } => {
            assert_eq!(dir, &snapshot);
            assert_eq!(weights, &vec![snapshot.join("model.safetensors")]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        m.source,
        ModelSource::HfRepo {
            repo: "test-org/tiny-model".into(),
            revision: None,
            file: None
        }
    );
    assert!(snapshot.join("tokenizer_config.json").is_file());
    assert!(!snapshot.join("README.md").exists(), "only needed files");
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        std::fs::read(local.join("model.safetensors")).unwrap()
    );
    let main_ref = e.hf_cache.join("models--test-org--tiny-model/refs/main");
    assert_eq!(std::fs::read_to_string(main_ref).unwrap(), COMMIT);

    // The downloaded model generates what the local directory does.
    let downloaded = load_resolved(&m, &LoadOptions::default()).unwrap();
    let reference = load_model(local.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let prompt = downloaded.tokenizer.encode("hello", false).unwrap();
    let got = greedy(&downloaded.model, &prompt, 8);
    assert_eq!(got, greedy(&reference.model, &prompt, 8));

    // A partial cache: only the missing file is fetched again.
    std::fs::remove_file(snapshot.join("tokenizer.json")).unwrap();
    let before = server.requested("/resolve/main/model.safetensors");
    e.hub.offline = true;
    let msg = err_text(resolve_with("test-org/tiny-model", &e));
    assert!(
        msg.contains("tokenizer.json") && msg.contains("HF_HUB_OFFLINE"),
        "{msg}"
    );
    e.hub.offline = false;
    resolve_with("test-org/tiny-model", &e).unwrap();
    assert!(snapshot.join("tokenizer.json").is_file());
    assert_eq!(
        server.requested("/resolve/main/model.safetensors"),
        before,
        "the cached weights were fetched again"
    );

    // Server gone: the cache answers, by branch and by commit.
    server.stop();
    let again = resolve_with("test-org/tiny-model", &e).unwrap();
    assert_eq!(again.files, m.files);
    let by_commit = resolve_with(&format!("test-org/tiny-model@{COMMIT}"), &e).unwrap();
    assert!(matches!(by_commit.files, ModelFiles::Safetensors { ref dir, .. } if dir == &snapshot));
    e.hub.offline = true;
    assert_eq!(
        resolve_with("test-org/tiny-model", &e).unwrap().files,
        m.files
    );

    // Not cached and the Hub unreachable: the error names the endpoint.
    e.hub.offline = false;
    let msg = err_text(resolve_with("test-org/other-model", &e));
    assert!(msg.contains("cannot reach"), "{msg}");
    assert!(msg.contains(&server.endpoint()), "{msg}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn missing_repos_revisions_and_gated_repos_give_actionable_errors() {
    let root = scratch("errors");
    let mut files = BTreeMap::new();
    files.insert("config.json".to_string(), b"{}".to_vec());
    files.insert("tokenizer.json".to_string(), b"{}".to_vec());
    files.insert("model.safetensors".to_string(), b"weights".to_vec());
    let mut hub = FakeHub::default();
    hub.add("test-org/gated", COMMIT, true, files.clone());
    files.remove("tokenizer.json");
    hub.add("test-org/no-tokenizer", COMMIT, false, files);
    let server = Server::start(hub);
    let mut e = env(&root, &server.endpoint());

    let msg = err_text(resolve_with("test-org/absent", &e));
    assert!(msg.contains("not found") && msg.contains("404"), "{msg}");
    assert!(msg.contains("test-org/absent"), "{msg}");
    let msg = err_text(resolve_with("test-org/gated@v9", &e));
    assert!(
        msg.contains("HF_TOKEN"),
        "401 before the revision is checked: {msg}"
    );

    let msg = err_text(resolve_with("test-org/gated", &e));
    assert!(msg.contains("401") && msg.contains("set HF_TOKEN"), "{msg}");
    e.hub.token = Some("hf_wrong".into());
    let msg = err_text(resolve_with("test-org/gated", &e));
    assert!(msg.contains("HF_TOKEN is set but was refused"), "{msg}");
    e.hub.token = Some(TOKEN.into());
    let m = resolve_with("test-org/gated", &e).unwrap();
    assert!(matches!(m.files, ModelFiles::Safetensors { .. }));
    let msg = err_text(resolve_with("test-org/gated@v9", &e));
    assert!(msg.contains("404") && msg.contains("revision"), "{msg}");

    let msg = err_text(resolve_with("test-org/no-tokenizer", &e));
    assert!(msg.contains("tokenizer.json"), "{msg}");

    // Nothing listening: the endpoint and the cause are named.
    let msg = err_text(resolve_with(
        "test-org/x",
        &env(&root, "http://127.0.0.1:9"),
    ));
    assert!(
        msg.contains("cannot reach") && msg.contains("http://127.0.0.1:9"),
        "{msg}"
    );
    assert!(msg.to_lowercase().contains("refused"), "{msg}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn sizes_and_file_counts_are_bounded_before_any_weight_is_fetched() {
    let root = scratch("bounds");
    let mut hub = FakeHub::default();
    let mut files = BTreeMap::new();
    files.insert("config.json".to_string(), b"{}".to_vec());
    files.insert("tokenizer.json".to_string(), b"{}".to_vec());
    files.insert("model.safetensors".to_string(), vec![7u8; 4096]);
    hub.add("test-org/big", COMMIT, false, files.clone());
    files.remove("model.safetensors");
    let shards: serde_json::Map<String, serde_json::Value> = (0..1000)
        .map(|i| {
            (
                format!("w{i}"),
                format!("model-{i:05}-of-01000.safetensors").into(),
            )
        })
        .collect();
    let index = serde_json::json!({ "metadata": { "total_size": 1000 }, "weight_map": shards });
    files.insert(
        "model.safetensors.index.json".to_string(),
        index.to_string().into_bytes(),
    );
    hub.add("test-org/many-shards", COMMIT, false, files.clone());
    let huge = serde_json::json!({
        "metadata": { "total_size": 1u64 << 50 },
        "weight_map": { "w": "model-00001-of-00001.safetensors" }
    });
    files.insert(
        "model.safetensors.index.json".to_string(),
        huge.to_string().into_bytes(),
    );
    hub.add("test-org/huge", COMMIT, false, files);
    let server = Server::start(hub);
    let mut e = env(&root, &server.endpoint());

    let msg = err_text(resolve_with("test-org/many-shards", &e));
    assert!(
        msg.contains("1000 shards") && msg.contains("refusing"),
        "{msg}"
    );
    let msg = err_text(resolve_with("test-org/huge", &e));
    assert!(
        msg.contains("total size") && msg.contains("refusing"),
        "{msg}"
    );
    e.hub.max_bytes = 1024;
    let msg = err_text(resolve_with("test-org/big", &e));
    assert!(msg.contains("refusing"), "{msg}");
    assert_eq!(server.requested("-of-0"), 0, "a shard was requested");
    assert!(
        !e.hf_cache
            .join("models--test-org--big/snapshots")
            .join(COMMIT)
            .join("config.json")
            .exists(),
        "files were downloaded before the size check"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_gguf_repo_downloads_one_file_by_the_pick_rule() {
    let root = scratch("gguf");
    let mut files = BTreeMap::new();
    for f in ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-F16.gguf"] {
        files.insert(f.to_string(), format!("GGUF {f}").into_bytes());
    }
    files.insert("README.md".into(), b"readme".to_vec());
    let mut hub = FakeHub::default();
    hub.add("test-org/tiny-GGUF", COMMIT, false, files.clone());
    files.remove("tiny-Q4_K_M.gguf");
    hub.add("test-org/no-default-GGUF", COMMIT, false, files);
    let server = Server::start(hub);
    let e = env(&root, &server.endpoint());
    let snapshot = e
        .hf_cache
        .join("models--test-org--tiny-GGUF/snapshots")
        .join(COMMIT);

    let gguf_path = |spec: &str| match resolve_with(spec, &e).unwrap().files {
        ModelFiles::Gguf { path, .. } => path,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        gguf_path("test-org/tiny-GGUF"),
        snapshot.join("tiny-Q4_K_M.gguf")
    );
    assert_eq!(
        server.requested("Q8_0"),
        0,
        "only the picked file is fetched"
    );
    assert_eq!(
        gguf_path("test-org/tiny-GGUF:q8_0"),
        snapshot.join("tiny-Q8_0.gguf")
    );
    assert_eq!(
        gguf_path("test-org/tiny-GGUF@main:tiny-F16.gguf"),
        snapshot.join("tiny-F16.gguf")
    );
    // Cached now: several GGUFs in the snapshot, the same rule picks Q4_K_M.
    assert_eq!(
        gguf_path("test-org/tiny-GGUF"),
        snapshot.join("tiny-Q4_K_M.gguf")
    );

    let msg = err_text(resolve_with("test-org/tiny-GGUF:nope.gguf", &e));
    assert!(
        msg.contains("nope.gguf") && msg.contains("tiny-Q8_0.gguf"),
        "{msg}"
    );
    let msg = err_text(resolve_with("test-org/no-default-GGUF", &e));
    assert!(msg.contains("org/name:<file>.gguf"), "{msg}");
    assert!(msg.contains("tiny-F16.gguf"), "{msg}");
    let _ = std::fs::remove_dir_all(&root);
}
