//! `--model` value resolution: every kind, a fake populated Hugging Face cache, and errors.
//!
//! Everything goes through `resolve_with` and an explicit `ResolveEnv`, so no test touches
//! process-global environment variables.

use std::fs;
use std::path::{Path, PathBuf};

use specsplit_models::hub::HubOptions;
use specsplit_models::source::{
    catalogue, hf_snapshot_dir, resolve_with, ModelFiles, ModelSource, ResolveEnv,
};
use specsplit_models::ModelError;

/// A fresh scratch directory unique to this process and test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specsplit-source-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn touch(path: &Path, content: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

fn env(root: &Path) -> ResolveEnv {
    ResolveEnv {
        models_dir: root.join("models"),
        hf_cache: root.join("hub"),
        fetch_script: None,
        allow_fetch: false,
        hub: HubOptions {
            offline: true,
            ..HubOptions::default()
        },
    }
}

fn not_found(r: Result<impl std::fmt::Debug, ModelError>) -> String {
    match r {
        Err(ModelError::NotFound(msg)) => msg,
        other => panic!("expected NotFound, got {other:?}"),
    }
}

#[test]
fn random_specs() {
    let root = scratch("random");
    let m = resolve_with("random:tiny", &env(&root)).unwrap();
    assert_eq!(
        m.source,
        ModelSource::Random {
            preset: "tiny".into(),
            seed: 0
        }
    );
    let m = resolve_with("random:qwen2.5-0.5b:42", &env(&root)).unwrap();
    assert_eq!(
        m.files,
        ModelFiles::Random {
            preset: "qwen2.5-0.5b".into(),
            seed: 42
        }
    );
    assert_eq!(m.name, "random:qwen2.5-0.5b:42");
    assert!(not_found(resolve_with("random:", &env(&root))).contains("preset"));
    assert!(not_found(resolve_with("random:tiny:x", &env(&root))).contains("seed"));
}

#[test]
fn local_safetensors_dir() {
    let root = scratch("localdir");
    let dir = root.join("my-model");
    touch(&dir.join("config.json"), "{}");
    touch(&dir.join("tokenizer.json"), "{}");
    touch(&dir.join("model.safetensors"), "");
    let m = resolve_with(dir.to_str().unwrap(), &env(&root)).unwrap();
    assert_eq!(m.source, ModelSource::LocalDir(dir.clone()));
    assert_eq!(m.name, "my-model");
    match m.files {
        ModelFiles::Safetensors {
            config,
            tokenizer,
            weights,
            ..
        } => {
            assert_eq!(config, dir.join("config.json"));
            assert_eq!(tokenizer, dir.join("tokenizer.json"));
            assert_eq!(weights, vec![dir.join("model.safetensors")]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn local_sharded_dir_and_missing_pieces() {
    let root = scratch("sharded");
    let dir = root.join("sharded");
    touch(&dir.join("config.json"), "{}");
    let index = r#"{"metadata": {}, "weight_map": {
        "a": "model-00002-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors"}}"#;
    touch(&dir.join("model.safetensors.index.json"), index);
    touch(&dir.join("model-00001-of-00002.safetensors"), "");
    let spec = dir.to_str().unwrap();
    // No tokenizer.json yet.
    assert!(not_found(resolve_with(spec, &env(&root))).contains("tokenizer.json"));
    touch(&dir.join("tokenizer.json"), "{}");
    // A shard is missing.
    assert!(not_found(resolve_with(spec, &env(&root))).contains("model-00002-of-00002"));
    touch(&dir.join("model-00002-of-00002.safetensors"), "");
    match resolve_with(spec, &env(&root)).unwrap().files {
        ModelFiles::Safetensors { weights, .. } => assert_eq!(
            weights,
            vec![
                dir.join("model-00001-of-00002.safetensors"),
                dir.join("model-00002-of-00002.safetensors")
            ]
        ),
        other => panic!("{other:?}"),
    }
    // A directory with nothing usable.
    let empty = root.join("empty");
    fs::create_dir_all(&empty).unwrap();
    assert!(not_found(resolve_with(empty.to_str().unwrap(), &env(&root))).contains("config.json"));
}

#[test]
fn gguf_file_with_and_without_tokenizer() {
    let root = scratch("gguf");
    let file = root.join("ggufs/some-model.Q4_0.gguf");
    touch(&file, "GGUF");
    let m = resolve_with(file.to_str().unwrap(), &env(&root)).unwrap();
    assert_eq!(m.source, ModelSource::Gguf(file.clone()));
    assert_eq!(m.name, "some-model.Q4_0");
    assert_eq!(
        m.files,
        ModelFiles::Gguf {
            path: file.clone(),
            tokenizer: None
        }
    );
    let tok = root.join("ggufs/some-model.Q4_0.tokenizer.json");
    touch(&tok, "{}");
    let m = resolve_with(file.to_str().unwrap(), &env(&root)).unwrap();
    assert_eq!(
        m.files,
        ModelFiles::Gguf {
            path: file.clone(),
            tokenizer: Some(tok)
        }
    );
    // A directory holding exactly one .gguf resolves to it.
    let m = resolve_with(root.join("ggufs").to_str().unwrap(), &env(&root)).unwrap();
    assert_eq!(m.source, ModelSource::Gguf(file));
    // A missing .gguf path, and a file that is not a GGUF.
    let missing = root.join("nope.gguf");
    assert!(
        not_found(resolve_with(missing.to_str().unwrap(), &env(&root))).contains("does not exist")
    );
    let txt = root.join("notes.txt");
    touch(&txt, "hi");
    assert!(not_found(resolve_with(txt.to_str().unwrap(), &env(&root))).contains(".gguf"));
}

/// Lays out `models--org--name` the way huggingface_hub does: blobs, refs/main, snapshots.
fn fake_hf_repo(cache: &Path, repo: &str, commit: &str, files: &[(&str, &str)]) -> PathBuf {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    touch(&repo_dir.join("refs/main"), commit);
    let snap = repo_dir.join("snapshots").join(commit);
    for (i, (name, content)) in files.iter().enumerate() {
        let blob = repo_dir.join("blobs").join(format!("blob{i}"));
        touch(&blob, content);
        fs::create_dir_all(snap.join(name).parent().unwrap()).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&blob, snap.join(name)).unwrap();
        #[cfg(not(unix))]
        fs::copy(&blob, snap.join(name)).unwrap();
    }
    snap
}

#[test]
fn hf_repo_from_offline_cache() {
    let root = scratch("hf");
    let cache = root.join("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snap = fake_hf_repo(
        &cache,
        "SomeOrg/Tiny-Model",
        commit,
        &[
            ("config.json", "{}"),
            ("tokenizer.json", "{}"),
            (
                "model.safetensors.index.json",
                r#"{"weight_map": {"x": "model-00001-of-00001.safetensors"}}"#,
            ),
            ("model-00001-of-00001.safetensors", ""),
        ],
    );
    let e = env(&root);
    let m = resolve_with("SomeOrg/Tiny-Model", &e).unwrap();
    assert_eq!(
        m.source,
        ModelSource::HfRepo {
            repo: "SomeOrg/Tiny-Model".into(),
            revision: None,
            file: None,
        }
    );
    match &m.files {
        ModelFiles::Safetensors { dir, weights, .. } => {
            assert_eq!(dir, &snap);
            assert_eq!(
                weights,
                &vec![snap.join("model-00001-of-00001.safetensors")]
            );
        }
        other => panic!("{other:?}"),
    }
    // Explicit branch and commit revisions.
    let m = resolve_with("SomeOrg/Tiny-Model@main", &e).unwrap();
    assert!(matches!(m.files, ModelFiles::Safetensors { ref dir, .. } if dir == &snap));
    let m = resolve_with(&format!("SomeOrg/Tiny-Model@{commit}"), &e).unwrap();
    assert!(matches!(m.files, ModelFiles::Safetensors { ref dir, .. } if dir == &snap));
    assert_eq!(
        hf_snapshot_dir(&cache, "SomeOrg/Tiny-Model", None).unwrap(),
        snap
    );
    // Unknown revision and unknown repo.
    let msg = not_found(resolve_with("SomeOrg/Tiny-Model@v9", &e));
    assert!(
        msg.contains("v9") && msg.contains("huggingface-cli download"),
        "{msg}"
    );
    let msg = not_found(resolve_with("SomeOrg/Other", &e));
    assert!(msg.contains("not in the local cache"), "{msg}");
    assert!(msg.contains(&cache.display().to_string()), "{msg}");
}

#[test]
fn hf_repo_with_gguf_and_incomplete_cache() {
    let root = scratch("hfgguf");
    let cache = root.join("hub");
    let snap = fake_hf_repo(
        &cache,
        "org/model-GGUF",
        "abc",
        &[("model-q4.gguf", "GGUF")],
    );
    let m = resolve_with("org/model-GGUF", &env(&root)).unwrap();
    assert_eq!(
        m.files,
        ModelFiles::Gguf {
            path: snap.join("model-q4.gguf"),
            tokenizer: None
        }
    );
    assert!(matches!(m.source, ModelSource::HfRepo { .. }));
    // Several GGUFs cached: the Q4_K_M one, else the one `:file` or `:tag` names.
    let snap = fake_hf_repo(
        &cache,
        "org/multi-GGUF",
        "abd",
        &[("m-Q8_0.gguf", "GGUF"), ("m-Q4_K_M.gguf", "GGUF")],
    );
    let gguf = |spec: &str| match resolve_with(spec, &env(&root)).unwrap().files {
        ModelFiles::Gguf { path, .. } => path,
        other => panic!("{other:?}"),
    };
    assert_eq!(gguf("org/multi-GGUF"), snap.join("m-Q4_K_M.gguf"));
    assert_eq!(gguf("org/multi-GGUF:Q8_0"), snap.join("m-Q8_0.gguf"));
    assert_eq!(
        gguf("org/multi-GGUF@main:m-Q8_0.gguf"),
        snap.join("m-Q8_0.gguf")
    );
    let msg = not_found(resolve_with("org/multi-GGUF:Q2_K", &env(&root)));
    assert!(msg.contains("Q2_K") && msg.contains("m-Q8_0.gguf"), "{msg}");
    // config.json present but weights never downloaded.
    fake_hf_repo(
        &cache,
        "org/partial",
        "def",
        &[("config.json", "{}"), ("tokenizer.json", "{}")],
    );
    let msg = not_found(resolve_with("org/partial", &env(&root)));
    assert!(msg.contains("incomplete"), "{msg}");
}

#[test]
fn catalogue_aliases() {
    let root = scratch("catalogue");
    let mut e = env(&root);
    for alias in ["smollm2", "llama", "qwen-coder-0.5b", "qwen-coder-1.5b"] {
        assert!(catalogue().iter().any(|c| c.alias == alias), "{alias}");
    }
    // Missing and fetching disabled: the error names the exact command.
    let msg = not_found(resolve_with("smollm2", &e));
    assert!(msg.contains("fetch-models.sh smollm2"), "{msg}");
    assert!(msg.contains(&e.models_dir.display().to_string()), "{msg}");
    // Present: resolves to the file in the models directory.
    let file = e.models_dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    touch(&file, "GGUF");
    let m = resolve_with("qwen-coder-0.5b", &e).unwrap();
    assert_eq!(m.name, "qwen-coder-0.5b");
    assert_eq!(m.source, ModelSource::Gguf(file.clone()));
    // Fetching runs the script with SPECSPLIT_MODELS_DIR pointing at the models directory.
    let script = root.join("fake-fetch.sh");
    touch(
        &script,
        "#!/usr/bin/env bash\nset -e\n[ \"$1\" = qwen-1.5b ]\n\
         echo GGUF > \"$SPECSPLIT_MODELS_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf\"\n",
    );
    e.fetch_script = Some(script);
    e.allow_fetch = true;
    let m = resolve_with("qwen-coder-1.5b", &e).unwrap();
    assert_eq!(
        m.source,
        ModelSource::Gguf(e.models_dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    );
    // A failing fetch reports the command to run by hand.
    let msg = not_found(resolve_with("smollm2", &e));
    assert!(msg.contains("failed") && msg.contains("smollm2"), "{msg}");
    // An alias pointing at the HF cache.
    let msg = not_found(resolve_with("llama-3.2-1b", &e));
    assert!(msg.contains("meta-llama/Llama-3.2-1B-Instruct"), "{msg}");
}

#[test]
fn nonsense_specs() {
    let root = scratch("nonsense");
    for spec in [
        "",
        "   ",
        "no-such-model",
        "a/b/c",
        "org/",
        "/name",
        "org/name@",
        "x y",
        "org/name:",
        "org/name@:q8_0",
    ] {
        let msg = not_found(resolve_with(spec, &env(&root)));
        assert!(
            msg.contains("smollm2") && msg.contains("qwen-coder-0.5b"),
            "{spec}: {msg}"
        );
        assert!(
            msg.contains("config.json") && msg.contains(".gguf"),
            "{spec}: {msg}"
        );
    }
    // A file outside the repo is no repo file: a missing GGUF path.
    for spec in ["org/name:/etc/x.gguf", "org/name:a/../b.gguf"] {
        let msg = not_found(resolve_with(spec, &env(&root)));
        assert!(msg.contains("does not exist"), "{spec}: {msg}");
    }
}
