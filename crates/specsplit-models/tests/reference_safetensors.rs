//! Random-weight safetensors checkpoints with Hugging Face tensor names, loaded both by us and by
//! candle-transformers' `llama` / `qwen2` (CPU, f32): prompt and decode logits agree, including a
//! Llama-3.1-style `rope_scaling`. Also covers config.json parsing and shard discovery.

mod reference_support;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2};
use reference_support::*;
use specsplit_models::config::{ModelConfig, RopeScaling};
use specsplit_models::transformer::Transformer;
use specsplit_models::weights::{random_tensors, safetensors_files};
use std::path::PathBuf;

/// f32 on CPU: only float reduction order (and a last-bit difference in Qwen2's rotary
/// frequencies, computed in f64 there) separates the two implementations.
const TOL: f32 = 1e-4;

const LLAMA31_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": false,
  "bos_token_id": 1, "eos_token_id": [2, 3],
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_type": "llama3"}
}"#;

const SMOL_STYLE_JSON: &str = r#"{
  "model_type": "llama", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
  "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 128,
  "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": null
}"#;

const QWEN2_JSON: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
  "rope_theta": 1000000.0, "max_position_embeddings": 256, "sliding_window": 4096,
  "max_window_layers": 2, "use_sliding_window": false, "tie_word_embeddings": true,
  "bos_token_id": 151643, "eos_token_id": 151645
}"#;

/// Writes seeded random weights for `cfg` to a fresh temporary safetensors file.
fn write_random(cfg: &ModelConfig, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specsplit-ref-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let tensors = random_tensors(cfg, 42, DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

/// Prompt logits then `steps` single-token decode steps; returns the max abs diff.
fn compare(
    ours: &Transformer,
    mut reference: impl FnMut(&Tensor, usize) -> Tensor,
    steps: usize,
) -> f32 {
    let dev = Device::Cpu;
    let vocab = ours.config().vocab_size;
    let prompt = Lcg(3).tokens(11, vocab);
    let n = prompt.len();
    let mut cache = ours.new_cache(n + steps).unwrap();
    let mut a = ours
        .forward(
            &u32s(&prompt, &dev),
            &span(0, n, &dev),
            None,
            &mut cache,
            &u32s(&[n as u32 - 1], &dev),
        )
        .unwrap();
    let mut b = reference(&u32s(&prompt, &dev).unsqueeze(0).unwrap(), 0);
    let mut max_diff = 0f32;
    for step in 0..=steps {
        let b2 = b.reshape(a.dims()).unwrap();
        max_diff = max_diff.max(max_abs_diff(&a, &b2));
        assert_eq!(argmax_rows(&a), argmax_rows(&b2), "argmax at step {step}");
        if step == steps {
            break;
        }
        let t = argmax_rows(&b2)[0];
        a = ours
            .forward(
                &u32s(&[t], &dev),
                &span(n + step, 1, &dev),
                None,
                &mut cache,
                &u32s(&[0], &dev),
            )
            .unwrap();
        b = reference(&u32s(&[t], &dev).unsqueeze(0).unwrap(), n + step);
    }
    max_diff
}

fn check_llama(json: &str, name: &str) -> f32 {
    let cfg = ModelConfig::from_hf_json(json).unwrap();
    let path = write_random(&cfg, name);
    let dev = Device::Cpu;
    let ours =
        Transformer::from_safetensors(cfg, std::slice::from_ref(&path), DType::F32, &dev).unwrap();
    let ref_cfg = serde_json::from_str::<llama::LlamaConfig>(json)
        .unwrap()
        .into_config(false);
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &dev) }.unwrap();
    let model = llama::Llama::load(vb, &ref_cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &ref_cfg, &dev).unwrap();
    let d = compare(
        &ours,
        |x, pos| model.forward(x, pos, &mut cache).unwrap(),
        6,
    );
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    d
}

#[test]
fn llama31_rope_scaling_matches_candle_llama() {
    let d = check_llama(LLAMA31_JSON, "llama31");
    eprintln!("llama-3.1-style random model: max abs logit diff {d:e}");
    assert!(d <= TOL, "max abs diff {d} > {TOL}");
}

#[test]
fn smollm_style_tied_llama_matches_candle_llama() {
    let d = check_llama(SMOL_STYLE_JSON, "smol");
    eprintln!("SmolLM-style (tied, MQA) random model: max abs logit diff {d:e}");
    assert!(d <= TOL, "max abs diff {d} > {TOL}");
}

#[test]
fn qwen2_matches_candle_qwen2() {
    let cfg = ModelConfig::from_hf_json(QWEN2_JSON).unwrap();
    assert!(cfg.attention_bias && cfg.tie_word_embeddings);
    let path = write_random(&cfg, "qwen2");
    let dev = Device::Cpu;
    let ours =
        Transformer::from_safetensors(cfg, std::slice::from_ref(&path), DType::F32, &dev).unwrap();
    let ref_cfg: qwen2::Config = serde_json::from_str(QWEN2_JSON).unwrap();
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &dev) }.unwrap();
    let mut model = qwen2::ModelForCausalLM::new(&ref_cfg, vb).unwrap();
    let d = compare(&ours, |x, pos| model.forward(x, pos).unwrap(), 6);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    eprintln!("qwen2 random model: max abs logit diff {d:e}");
    assert!(d <= TOL, "max abs diff {d} > {TOL}");
}

#[test]
fn hf_config_parsing() {
    let c = ModelConfig::from_hf_json(LLAMA31_JSON).unwrap();
    assert_eq!(c.architecture, "llama");
    assert_eq!((c.head_dim, c.num_key_value_heads), (16, 2));
    assert_eq!(c.eos_token_ids, vec![2, 3]);
    assert_eq!(c.bos_token_id, Some(1));
    assert!(!c.attention_bias && !c.tie_word_embeddings);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64
        })
    );
    let s = ModelConfig::from_hf_json(SMOL_STYLE_JSON).unwrap();
    assert_eq!((s.eos_token_ids.clone(), s.rope_scaling), (vec![2], None));
    let q = ModelConfig::from_hf_json(QWEN2_JSON).unwrap();
    assert!(q.attention_bias);
    // Mistral: defaults for absent fields.
    let m = ModelConfig::from_hf_json(
        r#"{"model_type":"mistral","vocab_size":32000,"hidden_size":4096,
            "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
            "num_key_value_heads":8,"rope_theta":1000000.0,"max_position_embeddings":32768}"#,
    )
    .unwrap();
    assert_eq!((m.head_dim, m.eos_token_ids.len()), (128, 0));
    for bad in [
        r#"{"model_type":"gpt2"}"#,
        r#"{"model_type":"llama","vocab_size":10}"#,
        r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,
            "num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"type":"yarn"}}"#,
        "not json",
    ] {
        assert!(ModelConfig::from_hf_json(bad).is_err(), "{bad}");
    }
    for name in ModelConfig::PRESETS {
        let p = ModelConfig::preset(name).unwrap();
        p.validate().unwrap();
    }
    let q7 = ModelConfig::preset("qwen2.5-7b").unwrap();
    assert_eq!(
        (q7.num_hidden_layers, q7.hidden_size, q7.num_attention_heads),
        (28, 3584, 28)
    );
    assert_eq!((q7.num_key_value_heads, q7.intermediate_size), (4, 18944));
    assert_eq!((q7.vocab_size, q7.rope_theta), (152064, 1e6));
    assert!(ModelConfig::preset("nope").is_none());
}

#[test]
fn shard_discovery_and_sharded_loading() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = std::env::temp_dir().join(format!("specsplit-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tensors = random_tensors(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    // Split into two shards with an index, as HF does for large checkpoints.
    let (mut a, mut b) = (
        std::collections::HashMap::new(),
        std::collections::HashMap::new(),
    );
    let mut map = serde_json::Map::new();
    for (name, t) in &tensors {
        let shard = if name.contains("layers.0.") || name.contains("embed") {
            a.insert(name.clone(), t.clone());
            "model-00001-of-00002.safetensors"
        } else {
            b.insert(name.clone(), t.clone());
            "model-00002-of-00002.safetensors"
        };
        map.insert(name.clone(), shard.into());
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let files = safetensors_files(&dir).unwrap();
    assert_eq!(files.len(), 2);
    let dev = Device::Cpu;
    let sharded = Transformer::from_safetensors(cfg.clone(), &files, DType::F32, &dev).unwrap();
    let direct = Transformer::random(cfg.clone(), 5, DType::F32, &dev).unwrap();
    let toks = u32s(&[1, 2, 3, 4], &dev);
    let run = |m: &Transformer| {
        let mut c = m.new_cache(8).unwrap();
        m.forward(&toks, &span(0, 4, &dev), None, &mut c, &u32s(&[0, 3], &dev))
            .unwrap()
    };
    assert_eq!(max_abs_diff(&run(&sharded), &run(&direct)), 0.0);
    // f16 load of the same shards works and stays close.
    let half = Transformer::from_safetensors(cfg, &files, DType::F16, &dev).unwrap();
    let d = max_abs_diff(&run(&half), &run(&direct));
    eprintln!("tiny f16 vs f32 max abs logit diff {d:e}");
    assert!(d < 0.1, "f16 diff {d}");
    std::fs::remove_dir_all(&dir).ok();
    assert!(safetensors_files(&dir).is_err());
}
