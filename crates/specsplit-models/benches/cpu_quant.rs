//! The cost of the batch-invariant quantized products on the CPU, side by side with candle's
//! stock `QMatMul::forward`: every projection of a GGUF model (all layers and the head) applied
//! to passes of 1 (a decode step), 5 and 17 (verify passes) and 64 rows (a prefill chunk).
//! Prints the minimum and median over repetitions of the whole set of products of one pass.
//!
//! `cargo bench -p specsplit-models --bench cpu_quant [-- <model.gguf> [repetitions]]`; the
//! model defaults to `models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`.

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use specsplit_models::cpu_quant::QuantMatrix;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROWS: [usize; 4] = [1, 5, 17, 64];

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[0]), ms(v[v.len() / 2]))
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let path = args.first().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    });
    let reps: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(7);
    let mut file = std::fs::File::open(&path).expect("open the GGUF model");
    let content = gguf_file::Content::read(&mut file).expect("read the GGUF header");
    let mut names: Vec<&String> = content
        .tensor_infos
        .iter()
        .filter(|(n, info)| {
            n.ends_with(".weight")
                && info.shape.dims().len() == 2
                && (n.starts_with("blk.") || n.as_str() == "output.weight")
        })
        .map(|(n, _)| n)
        .collect();
    // A tied head is the embedding matrix.
    if !content.tensor_infos.contains_key("output.weight") {
        names.extend(
            content
                .tensor_infos
                .keys()
                .find(|n| *n == "token_embd.weight"),
        );
    }
    names.sort();
    let mut stock = Vec::new();
    let mut invariant = Vec::new();
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for name in names {
        let q: QTensor = content.tensor(&mut file, name, &Device::Cpu).unwrap();
        *kinds.entry(format!("{:?}", q.dtype())).or_default() += 1;
        let (_, k) = q.shape().dims2().unwrap();
        let q = Arc::new(q);
        invariant.push((
            k,
            QuantMatrix::from_qtensor(q.clone())
                .unwrap()
                .expect("quantized"),
        ));
        stock.push((k, QMatMul::from_arc(q).unwrap()));
    }
    println!(
        "{}: {} products a pass ({kinds:?}), {reps} repetitions",
        path.display(),
        stock.len()
    );
    println!("| rows | stock QMatMul min / median (ms) | invariant min / median (ms) | ratio of medians |");
    println!("|---:|---:|---:|---:|");
    for m in ROWS {
        let inputs: Vec<Tensor> = stock
            .iter()
            .map(|(k, _)| Tensor::randn(0f32, 1.0, (m, *k), &Device::Cpu).unwrap())
            .collect();
        // One untimed pass each (candle repacks its tiles on first use).
        let run_stock = || {
            for ((_, w), x) in stock.iter().zip(&inputs) {
                std::hint::black_box(w.forward(x).unwrap());
            }
        };
        let run_invariant = || {
            for ((_, w), x) in invariant.iter().zip(&inputs) {
                std::hint::black_box(w.forward(x).unwrap());
            }
        };
        run_stock();
        run_invariant();
        let (mut ts, mut ti) = (Vec::new(), Vec::new());
        // Alternate the two so that load from other processes hits both alike.
        for _ in 0..reps {
            let t = Instant::now();
            run_stock();
            ts.push(t.elapsed());
            let t = Instant::now();
            run_invariant();
            ti.push(t.elapsed());
        }
        let (s_min, s_med) = stats(ts);
        let (i_min, i_med) = stats(ti);
        println!(
            "| {m} | {s_min:.1} / {s_med:.1} | {i_min:.1} / {i_med:.1} | {:.2} |",
            i_med / s_med
        );
    }
}
