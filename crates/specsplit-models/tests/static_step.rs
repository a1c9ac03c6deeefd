//! The fixed-shape decode step (`Transformer::static_step`, driven by `DecodeStepper`) decodes
//! like the ordinary forward pass: attending over the whole cache capacity under a device-side
//! mask, writing K/V at a device-side index, and feeding its own greedy token back.

use candle_core::{DType, Device, Tensor};
use specsplit_models::config::ModelConfig;
use specsplit_models::step::DecodeStepper;
use specsplit_models::transformer::Transformer;

fn model(preset: &str, seed: u64) -> Transformer {
    let mut cfg = ModelConfig::preset(preset).unwrap();
    cfg.max_position_embeddings = 256;
    Transformer::random(cfg, seed, DType::F32, &Device::Cpu).unwrap()
}

fn u32s(v: &[u32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// Greedy continuation of `prompt` by the ordinary forward: (token, log-prob) per step.
fn reference(m: &Transformer, prompt: &[u32], steps: usize, cap: usize) -> Vec<(u32, f32)> {
    let mut cache = m.new_cache(cap).unwrap();
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let mut logits = m
        .forward(
            &u32s(prompt),
            &u32s(&pos),
            None,
            &mut cache,
            &u32s(&[prompt.len() as u32 - 1]),
        )
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let row: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        let (best, &max) = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        let lse = max as f64
            + row
                .iter()
                .map(|&v| (v as f64 - max as f64).exp())
                .sum::<f64>()
                .ln();
        out.push((best as u32, (max as f64 - lse) as f32));
        let p = cache.len() as u32;
        logits = m
            .forward(
                &u32s(&[best as u32]),
                &u32s(&[p]),
                None,
                &mut cache,
                &u32s(&[0]),
            )
            .unwrap();
    }
    out
}

#[test]
fn static_steps_follow_the_greedy_decode() {
    for (preset, seed) in [("tiny", 7u64), ("tiny", 8)] {
        let m = model(preset, seed);
        let prompt: Vec<u32> = (0..9).map(|i| 3 + (i * 37 + seed as u32) % 400).collect();
        let cap = 64;
        let steps = 12;
        let want = reference(&m, &prompt, steps + 1, cap);

        // Prefill with the ordinary forward, then step from the prompt's greedy token.
        let mut cache = m.new_cache(cap).unwrap();
        let pos: Vec<u32> = (0..prompt.len() as u32).collect();
        m.forward(&u32s(&prompt), &u32s(&pos), None, &mut cache, &u32s(&[0]))
            .unwrap();
        let mut stepper = DecodeStepper::new(&m, cap).unwrap();
        stepper.start(want[0].0, prompt.len()).unwrap();
        for (j, &(tok, lp)) in want.iter().enumerate().skip(1) {
            stepper.step(&m, &cache).unwrap();
            let b = stepper.buffers();
            let got: u32 = b.next.to_vec1::<u32>().unwrap()[0];
            let got_lp: f32 = b.next_logprob.to_vec1::<f32>().unwrap()[0];
            assert_eq!(got, tok, "{preset}:{seed} step {j}");
            assert!((got_lp - lp).abs() < 1e-4, "step {j}: {got_lp} vs {lp}");
            // The step fed its token back and moved to the next slot.
            assert_eq!(b.token.to_vec1::<u32>().unwrap()[0], tok);
            assert_eq!(
                b.position.to_vec1::<u32>().unwrap()[0] as usize,
                prompt.len() + j
            );
        }
        assert!(!stepper.uses_graph(), "no CUDA graph on the CPU");
        // The cache length is the caller's: untouched by the steps.
        assert_eq!(cache.len(), prompt.len());
    }
}

#[test]
fn static_step_ignores_stale_cache_entries_and_restarts_anywhere() {
    let m = model("tiny", 7);
    let prompt: Vec<u32> = vec![5, 9, 40, 41, 7, 300];
    let cap = 32;
    let want = reference(&m, &prompt, 4, cap);
    let mut cache = m.new_cache(cap).unwrap();
    // Fill the whole cache with another sequence first, then roll back to nothing: the slots
    // past the prompt hold stale K/V that the mask must hide.
    let junk: Vec<u32> = (0..cap as u32).map(|i| (i * 13) % 500).collect();
    let pos: Vec<u32> = (0..cap as u32).collect();
    m.forward(&u32s(&junk), &u32s(&pos), None, &mut cache, &u32s(&[0]))
        .unwrap();
    cache.truncate(0).unwrap();
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    m.forward(&u32s(&prompt), &u32s(&pos), None, &mut cache, &u32s(&[0]))
        .unwrap();
    let mut stepper = DecodeStepper::new(&m, cap).unwrap();
    stepper.start(want[0].0, prompt.len()).unwrap();
    for &(tok, _) in &want[1..] {
        stepper.step(&m, &cache).unwrap();
        assert_eq!(stepper.buffers().next.to_vec1::<u32>().unwrap()[0], tok);
    }
    // A stepper for another capacity is refused.
    let mut other = DecodeStepper::new(&m, cap + 1).unwrap();
    assert!(other.step(&m, &cache).is_err());
}

#[test]
fn chains_grown_together_take_a_shape_of_a_power_of_two_sessions() {
    use specsplit_models::step::{chain_shape_sessions, SessionChainsStepper};
    use specsplit_models::transformer::SessionChain;
    let shapes: Vec<usize> = (1..=32).map(chain_shape_sessions).collect();
    // Every count from 2 to 32 lands on one of five shapes, none smaller than the count.
    let mut distinct = shapes[1..].to_vec();
    distinct.dedup();
    assert_eq!(distinct, [2, 4, 8, 16, 32]);
    assert!(shapes.iter().zip(1..).all(|(&s, n)| s >= n && s < 2 * n));
    // Off CUDA there is no shared growth: refused before any pad chain or shape is made.
    let m = model("tiny", 3);
    let cache = m.new_cache(64).unwrap();
    let chains: Vec<SessionChain<'_>> = (0..3)
        .map(|_| SessionChain {
            cache: &cache,
            feed: &[1],
            forced: &[],
        })
        .collect();
    let mut stepper = SessionChainsStepper::new();
    assert!(stepper.grow(&m, &chains, 3, 64).is_err());
    assert_eq!(stepper.shapes_made(), 0);
    assert!(!stepper.uses_graph(3, 3, 64));
}
