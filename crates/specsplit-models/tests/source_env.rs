//! Resolution through the process environment (`HF_HUB_CACHE`, `HF_HOME`, `HF_HUB_OFFLINE`,
//! `HF_ENDPOINT`, `HF_TOKEN`, `SPECSPLIT_MODELS_DIR`). Environment variables are process-global, so this binary holds a
//! single test.

use std::fs;
use std::path::PathBuf;

use specsplit_models::source::{self, hf_cache_dir, models_dir, ModelFiles, ResolveEnv};

#[test]
fn environment_variables_pick_the_directories() {
    let root = std::env::temp_dir().join(format!("specsplit-source-env-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    let home = root.join("hf-home");
    let hub = root.join("explicit-hub");

    std::env::remove_var("HF_HUB_CACHE");
    std::env::remove_var("HUGGINGFACE_HUB_CACHE");
    std::env::set_var("HF_HOME", &home);
    assert_eq!(hf_cache_dir(), home.join("hub"));
    std::env::set_var("HF_HUB_CACHE", &hub);
    assert_eq!(hf_cache_dir(), hub);

    // A populated cache works with the Hub marked offline.
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let repo = hub.join("models--org--cached");
    let snap = repo.join("snapshots/c0ffee");
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), "c0ffee\n").unwrap();
    fs::create_dir_all(&snap).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        fs::write(snap.join(f), "{}").unwrap();
    }
    let m = source::resolve("org/cached").unwrap();
    assert!(matches!(m.files, ModelFiles::Safetensors { ref dir, .. } if dir == &snap));

    let models = root.join("my-models");
    std::env::set_var("SPECSPLIT_MODELS_DIR", &models);
    std::env::set_var("SPECSPLIT_NO_FETCH", "1");
    assert_eq!(models_dir(), models);
    let env = ResolveEnv::from_env();
    assert_eq!(env.models_dir, models);
    assert_eq!(env.hf_cache, hub);
    assert!(!env.allow_fetch);
    assert!(env.hub.offline);
    assert_eq!(env.hub.endpoint, "https://huggingface.co");

    // The Hub's variables; the token file in HF_HOME when HF_TOKEN is unset.
    std::env::set_var("HF_HUB_OFFLINE", "0");
    std::env::set_var("HF_ENDPOINT", "http://hub.example:8080/");
    std::env::remove_var("HF_TOKEN");
    std::env::remove_var("HUGGING_FACE_HUB_TOKEN");
    fs::create_dir_all(&home).unwrap();
    fs::write(home.join("token"), "hf_from_file\n").unwrap();
    let env = ResolveEnv::from_env();
    assert!(!env.hub.offline);
    assert_eq!(env.hub.endpoint, "http://hub.example:8080");
    assert_eq!(env.hub.token.as_deref(), Some("hf_from_file"));
    std::env::set_var("HF_TOKEN", "hf_from_env");
    assert_eq!(
        ResolveEnv::from_env().hub.token.as_deref(),
        Some("hf_from_env")
    );
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let msg = source::resolve("smollm2").unwrap_err().to_string();
    assert!(msg.contains("fetch-models.sh smollm2"), "{msg}");
    let file: PathBuf = models.join("smollm2-135m-instruct-q4_1.gguf");
    fs::create_dir_all(&models).unwrap();
    fs::write(&file, "GGUF").unwrap();
    assert!(matches!(source::resolve("smollm2").unwrap().files,
        ModelFiles::Gguf { ref path, .. } if path == &file));
    let _ = fs::remove_dir_all(&root);
}
