//! The multi-session pass on the CPU: each session's logits from `forward_sessions` are bit for
//! bit what `forward_tree` of that session alone gives, and its cache holds the same K/V,
//! whichever sessions share the pass and in whatever order; a bad part fails the call and leaves
//! every cache as it was.

mod reference_support;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use reference_support::*;
use specsplit_core::cache::SessionCache;
use specsplit_core::mask::TreeMask;
use specsplit_models::config::ModelConfig;
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::transformer::Transformer;
use specsplit_models::{ModelError, SessionPass};

fn dense(dtype: DType) -> Transformer {
    Transformer::random(small_config(), 11, dtype, &Device::Cpu).unwrap()
}

/// One session of a test: a prompt in the cache, a tree of which the first `cached` nodes are
/// already in the cache too, and the rows of the remaining nodes whose logits it wants.
struct Session {
    prompt: Vec<u32>,
    parents: Vec<Option<usize>>,
    nodes: Vec<u32>,
    cached: usize,
    rows: Vec<u32>,
    capacity: usize,
}

impl Session {
    fn new(seed: u64, prompt: usize, parents: Vec<Option<usize>>, cached: usize) -> Self {
        let vocab = small_config().vocab_size;
        let mut rng = Lcg(seed);
        let n = parents.len() - cached;
        // Every other row, the last one first: a selection in no particular order.
        let mut rows: Vec<u32> = (0..n as u32).filter(|r| r % 2 == 0).collect();
        rows.reverse();
        Self {
            prompt: rng.tokens(prompt, vocab),
            nodes: rng.tokens(parents.len(), vocab),
            capacity: prompt + parents.len() + 3,
            parents,
            cached,
            rows,
        }
    }

    fn mask(&self) -> TreeMask {
        TreeMask::from_parents(&self.parents).unwrap()
    }

    /// The new tokens and their positions.
    fn inputs(&self, mask: &TreeMask) -> (Vec<u32>, Vec<u32>) {
        let positions = mask.positions(self.prompt.len());
        (
            self.nodes[self.cached..].to_vec(),
            positions[self.cached..].to_vec(),
        )
    }

    fn tree<'a>(&self, mask: &'a TreeMask) -> TreeRows<'a> {
        TreeRows {
            mask,
            prefix: self.prompt.len(),
            first_row: self.cached,
        }
    }

    /// A cache holding the prompt and the first `cached` nodes.
    fn cache(&self, m: &Transformer) -> SessionCache {
        let dev = m.device();
        let mut cache = m.new_cache(self.capacity).unwrap();
        m.prefill(&self.prompt, &mut cache).unwrap();
        if self.cached > 0 {
            let mask = self.mask();
            let positions = mask.positions(self.prompt.len());
            let tree = TreeRows {
                mask: &mask,
                prefix: self.prompt.len(),
                first_row: 0,
            };
            m.forward_tree(
                &u32s(&self.nodes[..self.cached], dev),
                &u32s(&positions[..self.cached], dev),
                tree,
                &mut cache,
                &u32s(&[0], dev),
            )
            .unwrap();
        }
        cache
    }

    /// The session alone: its logits through `forward_tree` and its cache afterwards.
    fn alone(&self, m: &Transformer) -> (Vec<Vec<f32>>, SessionCache) {
        let dev = m.device();
        let mut cache = self.cache(m);
        let mask = self.mask();
        let (tokens, positions) = self.inputs(&mask);
        let logits = m
            .forward_tree(
                &u32s(&tokens, dev),
                &u32s(&positions, dev),
                self.tree(&mask),
                &mut cache,
                &u32s(&self.rows, dev),
            )
            .unwrap();
        (logits.to_vec2().unwrap(), cache)
    }
}

/// Every valid entry of every layer of `cache`, as bits.
fn kv_bits(cache: &SessionCache, layers: usize) -> KvBits {
    (0..layers)
        .flat_map(|l| {
            let (k, v) = cache.layer(l);
            [k, v]
        })
        .map(|t| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// The whole K/V buffers of `cache` (written or not), as bits.
fn buffer_bits(cache: &SessionCache, layers: usize) -> KvBits {
    (0..layers)
        .flat_map(|l| {
            let (k, v) = cache.buffers(l).unwrap();
            [k.clone(), v.clone()]
        })
        .map(|t: Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// A session's logits, row by row.
type Logits = Vec<Vec<f32>>;

/// A cache's K/V, buffer by buffer, as bits.
type KvBits = Vec<Vec<u32>>;

/// Runs `sessions` through one `forward_sessions` call: each one's logits, and the caches.
fn together(
    m: &Transformer,
    sessions: &[&Session],
) -> (Result<Vec<Logits>, ModelError>, Vec<SessionCache>) {
    let masks: Vec<TreeMask> = sessions.iter().map(|s| s.mask()).collect();
    let inputs: Vec<(Vec<u32>, Vec<u32>)> = sessions
        .iter()
        .zip(&masks)
        .map(|(s, mask)| s.inputs(mask))
        .collect();
    let mut caches: Vec<SessionCache> = sessions.iter().map(|s| s.cache(m)).collect();
    let mut parts: Vec<SessionPass<'_>> = sessions
        .iter()
        .zip(&masks)
        .zip(&inputs)
        .zip(caches.iter_mut())
        .map(|(((s, mask), (tokens, positions)), cache)| SessionPass {
            tokens,
            positions,
            tree: s.tree(mask),
            cache,
            rows: &s.rows,
        })
        .collect();
    let out = m.forward_sessions(&mut parts);
    drop(parts);
    let logits = out.map(|ts| ts.iter().map(|t| t.to_vec2().unwrap()).collect());
    (logits, caches)
}

/// Sessions of different cache lengths: a one-token decode, a chain, a branching tree, and the
/// second level of a tree whose first level is cached.
fn sessions() -> Vec<Session> {
    let chain = |n: usize| (0..n).map(|i| i.checked_sub(1)).collect::<Vec<_>>();
    vec![
        Session::new(1, 7, chain(5), 0),
        Session::new(2, 12, random_tree(9, 3, 5), 0),
        Session::new(3, 3, random_tree(7, 2, 8), 3),
        Session::new(4, 20, chain(1), 0),
    ]
}

/// For 1, 2, 3 and 4 sessions, in order and reversed: each session's logits and K/V equal the
/// session alone, bit for bit.
fn check_sessions_match_alone(m: &Transformer, what: &str) {
    let all = sessions();
    let layers = m.config().num_hidden_layers;
    let alone: Vec<(Logits, KvBits)> = all
        .iter()
        .map(|s| {
            let (logits, cache) = s.alone(m);
            (logits, kv_bits(&cache, layers))
        })
        .collect();
    for k in 1..=all.len() {
        let mut order: Vec<usize> = (0..k).collect();
        for pass in 0..2 {
            if pass == 1 {
                order.reverse();
            }
            let group: Vec<&Session> = order.iter().map(|&i| &all[i]).collect();
            let (logits, caches) = together(m, &group);
            let logits = logits.unwrap();
            for (j, &i) in order.iter().enumerate() {
                assert_eq!(
                    logits[j], alone[i].0,
                    "{what}: session {i} of {order:?}: logits differ from the session alone"
                );
                assert_eq!(
                    kv_bits(&caches[j], layers),
                    alone[i].1,
                    "{what}: session {i} of {order:?}: K/V differ from the session alone"
                );
                let s = &all[i];
                assert_eq!(caches[j].len(), s.prompt.len() + s.parents.len());
            }
        }
    }
}

#[test]
fn dense_f32_sessions_match_each_session_alone() {
    check_sessions_match_alone(&dense(DType::F32), "dense f32");
}

#[test]
fn dense_f16_sessions_match_each_session_alone() {
    check_sessions_match_alone(&dense(DType::F16), "dense f16");
}

#[test]
fn q4k_sessions_match_each_session_alone() {
    check_sessions_match_alone(&small_quantized(GgmlDType::Q4K), "Q4K");
}

#[test]
fn q8_0_sessions_match_each_session_alone() {
    check_sessions_match_alone(&small_quantized(GgmlDType::Q8_0), "Q8_0");
}

/// A bad part `bad` among good ones: the call fails naming the part, and no cache changes.
fn check_rejected(m: &Transformer, bad: Session, expect: &str) {
    let all = sessions();
    let layers = m.config().num_hidden_layers;
    let group = [&all[0], &all[1], &bad];
    let before: Vec<(usize, KvBits)> = group
        .iter()
        .map(|s| {
            let c = s.cache(m);
            (c.len(), buffer_bits(&c, layers))
        })
        .collect();
    let (out, caches) = together(m, &group);
    let Err(e) = out else {
        panic!("a bad part ({expect}) was accepted");
    };
    let e = e.to_string();
    assert!(
        e.contains("session part 2") && e.contains(expect),
        "error {e:?} should name part 2 and say {expect:?}"
    );
    for (c, (len, bits)) in caches.iter().zip(&before) {
        assert_eq!(c.len(), *len, "a cache's length changed");
        assert_eq!(&buffer_bits(c, layers), bits, "a cache's K/V changed");
    }
}

#[test]
fn a_bad_part_fails_the_call_and_changes_no_cache() {
    let cfg = ModelConfig {
        max_position_embeddings: 64,
        ..small_config()
    };
    let m = Transformer::random(cfg, 11, DType::F32, &Device::Cpu).unwrap();
    let chain = |n: usize| (0..n).map(|i| i.checked_sub(1)).collect::<Vec<_>>();
    // A row past the part's tokens.
    let mut s = Session::new(5, 4, chain(3), 0);
    s.rows = vec![0, 3];
    check_rejected(&m, s, "row 3 of a 3-token pass");
    // More tokens than the cache holds.
    let mut s = Session::new(6, 4, chain(3), 0);
    s.capacity = 6;
    check_rejected(&m, s, "the cache has 6");
    // A position past the rotary tables.
    let limit = m.config().max_position_embeddings;
    let mut s = Session::new(7, limit - 2, chain(3), 0);
    s.capacity = limit + 2;
    check_rejected(&m, s, "max_position_embeddings");
}

#[test]
fn a_tree_that_does_not_start_at_the_cache_end_is_rejected() {
    let m = dense(DType::F32);
    let all = sessions();
    let layers = m.config().num_hidden_layers;
    let s = &all[1];
    let mask = s.mask();
    let (tokens, positions) = s.inputs(&mask);
    let mut good = all[0].cache(&m);
    let mut cache = s.cache(&m);
    let before = [buffer_bits(&good, layers), buffer_bits(&cache, layers)];
    let (good_len, len) = (good.len(), cache.len());
    let g = &all[0];
    let gmask = g.mask();
    let (gt, gp) = g.inputs(&gmask);
    let mut tree = s.tree(&mask);
    tree.prefix -= 1;
    let mut parts = [
        SessionPass {
            tokens: &gt,
            positions: &gp,
            tree: g.tree(&gmask),
            cache: &mut good,
            rows: &g.rows,
        },
        SessionPass {
            tokens: &tokens,
            positions: &positions,
            tree,
            cache: &mut cache,
            rows: &s.rows,
        },
    ];
    let e = m.forward_sessions(&mut parts).unwrap_err().to_string();
    assert!(
        e.contains("session part 1") && e.contains("cache holds"),
        "{e}"
    );
    assert_eq!((good.len(), cache.len()), (good_len, len));
    assert_eq!(
        [buffer_bits(&good, layers), buffer_bits(&cache, layers)],
        before
    );
}

#[test]
fn no_parts_give_no_logits() {
    let m = dense(DType::F32);
    assert!(m.forward_sessions(&mut []).unwrap().is_empty());
}

#[test]
fn a_session_that_wants_no_rows_still_gets_its_kv() {
    let m = dense(DType::F32);
    let layers = m.config().num_hidden_layers;
    let all = sessions();
    let mut quiet = Session::new(2, 12, random_tree(9, 3, 5), 0);
    let (_, alone) = quiet.alone(&m);
    quiet.rows.clear();
    let (logits, caches) = together(&m, &[&all[0], &quiet, &all[3]]);
    let logits = logits.unwrap();
    assert!(logits[1].is_empty());
    assert_eq!(logits[0], all[0].alone(&m).0);
    assert_eq!(logits[2], all[3].alone(&m).0);
    assert_eq!(kv_bits(&caches[1], layers), kv_bits(&alone, layers));
}
