//! `load_model`: catalogue GGUFs, random presets and a safetensors directory load with a
//! tokenizer that fits the model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use specsplit_models::hub::HubOptions;
use specsplit_models::loader::{load_model, load_tokenizer, LoadOptions};
use specsplit_models::source::{self, resolve_with, ModelFiles, ResolveEnv};
use specsplit_models::tokenizer::TextTokenizer;
use specsplit_models::ModelError;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specsplit-loader-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn catalogue_ggufs_load_with_consistent_tokenizers() {
    let opts = LoadOptions::default();
    let m = load_model("smollm2", &opts).expect("load smollm2");
    assert_eq!(m.name, "smollm2");
    let cfg = m.model.config();
    assert_eq!(cfg.vocab_size, 49152);
    assert!(m.tokenizer.vocab_size() <= cfg.vocab_size);
    assert_eq!(
        m.tokenizer.encode("Hello, world!", false).unwrap(),
        vec![19556, 28, 905, 17]
    );
    assert!(m.tokenizer.is_eos(2));
    assert_eq!(m.tokenizer.bos_token_id(), Some(1));
    for id in &cfg.eos_token_ids {
        assert!(m.tokenizer.is_eos(*id));
    }

    let m = load_model("qwen-coder-0.5b", &opts).expect("load qwen-coder-0.5b");
    let cfg = m.model.config();
    assert!(m.tokenizer.vocab_size() <= cfg.vocab_size);
    let ids = m.tokenizer.encode("def main():", false).unwrap();
    assert!(ids.iter().all(|&i| (i as usize) < cfg.vocab_size));
    assert!(m.tokenizer.is_eos(151645) && m.tokenizer.is_eos(151643));
}

#[test]
fn random_presets() {
    let m = load_model("random:tiny:3", &LoadOptions::default()).unwrap();
    assert_eq!(m.name, "random:tiny:3");
    assert_eq!(m.model.config().vocab_size, 512);
    assert_eq!(m.tokenizer.vocab_size(), 512);
    assert_eq!(m.tokenizer.eos_token_ids(), &[256]);
    assert_eq!(m.tokenizer.encode("ab", false).unwrap(), vec![97, 98]);
    match load_model("random:no-such-preset", &LoadOptions::default()) {
        Err(ModelError::NotFound(msg)) => assert!(msg.contains("tiny"), "{msg}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("unknown preset loaded"),
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
    let rand = |shape: &[usize]| Tensor::randn(0f32, 0.02, shape, &dev).unwrap();
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
    // The byte-level tokenizer, saved as tokenizer.json (its EOS comes from config.json).
    TextTokenizer::byte_level(vocab)
        .unwrap()
        .inner()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
}

#[test]
fn safetensors_directory_loads() {
    let dir = scratch("hfdir");
    write_tiny_hf_dir(&dir);
    let m = load_model(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert_eq!(m.model.config().vocab_size, 512);
    assert!(m.tokenizer.vocab_size() <= 512);
    assert!(m.tokenizer.is_eos(256));
    assert_eq!(m.tokenizer.decode(&[104, 105], false).unwrap(), "hi");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn tokenizer_json_beside_a_gguf_is_used_only_when_it_matches() {
    let qwen = match source::resolve("qwen-coder-0.5b").unwrap().files {
        ModelFiles::Gguf { path, .. } => path,
        other => panic!("{other:?}"),
    };
    let reference = source::models_dir().join("qwen2.5-tokenizer.json");
    let dir = scratch("beside");
    let gguf = dir.join("qwen.gguf");
    std::os::unix::fs::symlink(&qwen, &gguf).unwrap();
    let env = ResolveEnv {
        models_dir: dir.clone(),
        hf_cache: dir.join("hub"),
        fetch_script: None,
        allow_fetch: false,
        hub: HubOptions {
            offline: true,
            ..HubOptions::default()
        },
    };
    let expected = TextTokenizer::from_gguf_file(&qwen)
        .unwrap()
        .encode("def main():", false)
        .unwrap();

    // A mismatching tokenizer.json (byte-level) beside the file: the GGUF metadata wins.
    TextTokenizer::byte_level(512)
        .unwrap()
        .inner()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let resolved = resolve_with(gguf.to_str().unwrap(), &env).unwrap();
    let tok = load_tokenizer(&resolved).unwrap();
    assert_eq!(tok.encode("def main():", false).unwrap(), expected);
    assert_eq!(tok.vocab_size(), 151936, "the GGUF token table is used");

    // The matching reference tokenizer.json is used, with the GGUF's special ids.
    if reference.is_file() {
        std::fs::copy(&reference, dir.join("qwen.tokenizer.json")).unwrap();
        let resolved = resolve_with(gguf.to_str().unwrap(), &env).unwrap();
        let ModelFiles::Gguf { tokenizer, .. } = &resolved.files else {
            panic!()
        };
        assert_eq!(
            tokenizer.as_deref(),
            Some(dir.join("qwen.tokenizer.json").as_path())
        );
        let tok = load_tokenizer(&resolved).unwrap();
        assert_eq!(tok.encode("def main():", false).unwrap(), expected);
        assert_eq!(tok.vocab_size(), 151665, "the tokenizer.json is used");
        assert!(tok.is_eos(151645));
        assert!(tok.uses_chatml());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_explicit_dtype_dequantizes_a_gguf_into_the_same_model() {
    let quant = load_model("smollm2", &LoadOptions::default())
        .unwrap()
        .model;
    let opts = LoadOptions {
        dtype: Some(DType::F32),
        ..LoadOptions::default()
    };
    let dense = load_model("smollm2", &opts).unwrap().model;
    assert!(quant.is_quantized());
    assert!(!dense.is_quantized());
    assert_eq!(dense.dtype(), DType::F32);
    // Same weights: the next-token logits agree up to the quantized kernels' 8-bit activation
    // rounding, and the greedy pick is the same.
    let dev = Device::Cpu;
    let tokens = [1u32, 19556, 28, 905, 17, 1073, 314];
    let logits = |m: &specsplit_models::transformer::Transformer| -> Vec<f32> {
        let mut cache = m.new_cache(16).unwrap();
        let pos: Vec<u32> = (0..tokens.len() as u32).collect();
        m.forward(
            &Tensor::new(&tokens[..], &dev).unwrap(),
            &Tensor::new(pos.as_slice(), &dev).unwrap(),
            None,
            &mut cache,
            &Tensor::new(&[tokens.len() as u32 - 1], &dev).unwrap(),
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
    };
    let (a, b) = (logits(&quant), logits(&dense));
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(&a), argmax(&b));
    let spread =
        a.iter().cloned().fold(f32::MIN, f32::max) - a.iter().cloned().fold(f32::MAX, f32::min);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 0.05 * spread,
        "max logit difference {worst} of spread {spread}"
    );
    assert!(
        worst > 0.0,
        "the dense model computes without 8-bit activation rounding"
    );
}
