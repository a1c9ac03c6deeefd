//! Forward latency over a 256-token cached prefix: 1 token, an 8-token chain and a 32-node tree,
//! for the tiny random model and SmolLM2-135M (Q4_1 GGUF), on CPU (or CUDA with
//! `--features cuda` and `SPECSPLIT_BENCH_CUDA=1`). Each iteration rolls the cache back (O(1)).

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use specsplit_core::cache::SessionCache;
use specsplit_models::config::ModelConfig;
use specsplit_models::transformer::Transformer;
use std::path::PathBuf;

const PREFIX: usize = 256;

fn device() -> Device {
    if std::env::var_os("SPECSPLIT_BENCH_CUDA").is_some() {
        Device::new_cuda(0).expect("CUDA device")
    } else {
        Device::Cpu
    }
}

fn u32s(v: &[u32], dev: &Device) -> Tensor {
    Tensor::new(v, dev).unwrap()
}

/// A 32-node tree: 4 branches of depth 8 under the prefix (node i's parent is i - 4, roots 0..4).
fn tree(dev: &Device, dtype: DType) -> (Tensor, Tensor) {
    let n = 32;
    let mut mask = vec![f32::NEG_INFINITY; n * (PREFIX + n)];
    let mut pos = Vec::with_capacity(n);
    for i in 0..n {
        let row = &mut mask[i * (PREFIX + n)..(i + 1) * (PREFIX + n)];
        row[..PREFIX].iter_mut().for_each(|x| *x = 0.0);
        let mut j = i as isize;
        while j >= 0 {
            row[PREFIX + j as usize] = 0.0;
            j -= 4;
        }
        pos.push((PREFIX + i / 4) as u32);
    }
    let mask = Tensor::from_vec(mask, (n, PREFIX + n), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    (mask, u32s(&pos, dev))
}

fn bench_model(c: &mut Criterion, name: &str, model: &Transformer) {
    let dev = model.device().clone();
    let vocab = model.config().vocab_size as u32;
    let toks: Vec<u32> = (0..PREFIX as u32 + 32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut cache: SessionCache = model.new_cache(PREFIX + 32).unwrap();
    let prefix_pos: Vec<u32> = (0..PREFIX as u32).collect();
    model
        .forward(
            &u32s(&toks[..PREFIX], &dev),
            &u32s(&prefix_pos, &dev),
            None,
            &mut cache,
            &u32s(&[PREFIX as u32 - 1], &dev),
        )
        .unwrap();
    let sync = |t: &Tensor| {
        // Reading one value back forces completion on asynchronous devices.
        t.flatten_all()
            .unwrap()
            .get(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
    };
    let mut group = c.benchmark_group(format!("forward/{name}"));
    group.sample_size(10);
    for n in [1usize, 8] {
        let t = u32s(&toks[PREFIX..PREFIX + n], &dev);
        let p: Vec<u32> = (PREFIX as u32..(PREFIX + n) as u32).collect();
        let p = u32s(&p, &dev);
        let rows: Vec<u32> = (0..n as u32).collect();
        let rows = u32s(&rows, &dev);
        group.bench_function(format!("chain{n}_over_{PREFIX}"), |b| {
            b.iter(|| {
                let out = model.forward(&t, &p, None, &mut cache, &rows).unwrap();
                sync(&out);
                cache.truncate(PREFIX).unwrap();
            })
        });
    }
    let (mask, pos) = tree(&dev, model.dtype());
    let t = u32s(&toks[PREFIX..PREFIX + 32], &dev);
    let rows: Vec<u32> = (0..32).collect();
    let rows = u32s(&rows, &dev);
    group.bench_function(format!("tree32_over_{PREFIX}"), |b| {
        b.iter(|| {
            let out = model
                .forward(&t, &pos, Some(&mask), &mut cache, &rows)
                .unwrap();
            sync(&out);
            cache.truncate(PREFIX).unwrap();
        })
    });
    group.finish();
}

/// candle-transformers' `quantized_llama` single-token decode after the same 256-token prefix,
/// for comparison (its cache cannot roll back, so it grows by one entry per iteration).
fn bench_reference_decode(c: &mut Criterion, path: &std::path::Path, dev: &Device) {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let mut file = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, dev).unwrap();
    let toks: Vec<u32> = (0..PREFIX as u32 + 1)
        .map(|i| (i * 7919 + 13) % 49_152)
        .collect();
    let prompt = u32s(&toks[..PREFIX], dev).unsqueeze(0).unwrap();
    model.forward(&prompt, 0).unwrap();
    let next = u32s(&toks[PREFIX..], dev).unsqueeze(0).unwrap();
    let mut pos = PREFIX;
    let mut group = c.benchmark_group("forward/reference-quantized_llama-smollm2");
    group.sample_size(10);
    group.bench_function(format!("chain1_over_{PREFIX}+"), |b| {
        b.iter(|| {
            let out = model.forward(&next, pos).unwrap();
            out.flatten_all()
                .unwrap()
                .get(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            pos += 1;
        })
    });
    group.finish();
}

fn smollm2_path() -> Option<PathBuf> {
    let dir = std::env::var_os("SPECSPLIT_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let p = dir.join("smollm2-135m-instruct-q4_1.gguf");
    p.is_file().then_some(p)
}

fn forward(c: &mut Criterion) {
    let dev = device();
    let tiny =
        Transformer::random(ModelConfig::preset("tiny").unwrap(), 1, DType::F32, &dev).unwrap();
    bench_model(c, "tiny", &tiny);
    match smollm2_path() {
        Some(p) => {
            let smol = Transformer::from_gguf(&p, &dev).unwrap();
            bench_model(c, "smollm2-135m-q4_1", &smol);
            bench_reference_decode(c, &p, &dev);
        }
        None => eprintln!("SmolLM2 GGUF not found; run scripts/fetch-models.sh smollm2"),
    }
}

criterion_group!(benches, forward);
criterion_main!(benches);
