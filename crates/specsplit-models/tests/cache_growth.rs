//! Forward passes over a KV cache that grew: every logit and every cached K/V entry is bit for
//! bit what the same passes give over a cache allocated at full size up front (dense f32 and a
//! quantized model, one session's passes and the multi-session pass).

mod reference_support;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use reference_support::*;
use specsplit_core::cache::{CacheError, SessionCache};
use specsplit_core::mask::TreeMask;
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::transformer::Transformer;
use specsplit_models::{ModelError, SessionPass};

/// Every valid entry of every layer, as bits.
fn kv_bits(cache: &SessionCache, layers: usize) -> Vec<Vec<u32>> {
    (0..layers)
        .flat_map(|l| {
            let (k, v) = cache.layer(l);
            [k, v]
        })
        .map(|t| {
            let x: Vec<f32> = t
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            x.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

fn bits(rows: Vec<Vec<f32>>) -> Vec<Vec<u32>> {
    rows.into_iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// One round as an engine runs it: a causal chunk of `new` tokens, then a tree of `parents`
/// below it verified in one pass, then the cache keeps the tree's first path; `reserve` first
/// when `grow`. Returns every logit of the round, as bits.
fn round(
    m: &Transformer,
    cache: &mut SessionCache,
    new: &[u32],
    parents: &[Option<usize>],
    grow: bool,
) -> Vec<Vec<u32>> {
    let dev = m.device();
    let past = cache.len();
    if grow {
        cache.reserve(past + new.len() + parents.len()).unwrap();
    }
    let rows: Vec<u32> = (0..new.len() as u32).collect();
    let causal = m
        .forward(
            &u32s(new, dev),
            &span(past, new.len(), dev),
            None,
            cache,
            &u32s(&rows, dev),
        )
        .unwrap();
    let mut out = bits(causal.to_vec2().unwrap());
    let prefix = cache.len();
    let mask = TreeMask::from_parents(parents).unwrap();
    let tokens: Vec<u32> = (0..parents.len() as u32)
        .map(|i| (i * 29 + prefix as u32) % 512)
        .collect();
    let want: Vec<u32> = (0..parents.len() as u32).collect();
    let tree = TreeRows {
        mask: &mask,
        prefix,
        first_row: 0,
    };
    let logits = m
        .forward_tree(
            &u32s(&tokens, dev),
            &u32s(&mask.positions(prefix), dev),
            tree,
            cache,
            &u32s(&want, dev),
        )
        .unwrap();
    out.extend(bits(logits.to_vec2().unwrap()));
    // Keep the root and its first child.
    let child = parents.iter().position(|p| *p == Some(0)).unwrap();
    cache.compact(prefix, &[prefix, prefix + child]).unwrap();
    out
}

/// Rounds over a cache that starts at 4 entries and doubles up to 128, against a 128-entry
/// cache: same logits, same K/V, round by round.
fn check_growth_matches_full_size(m: &Transformer, what: &str) {
    let layers = m.config().num_hidden_layers;
    let mut grown = m.new_growable_cache(4, 128).unwrap();
    let mut full = m.new_cache(128).unwrap();
    let tree = [None, Some(0), Some(0), Some(1), Some(2), Some(3)];
    let mut capacities = vec![grown.capacity()];
    for r in 0..8u32 {
        let new: Vec<u32> = (0..3 + 2 * r)
            .map(|i| (i * 37 + r * 11 + 5) % 512)
            .collect();
        let a = round(m, &mut grown, &new, &tree, true);
        let b = round(m, &mut full, &new, &tree, false);
        assert_eq!(a, b, "{what}: round {r} logits");
        assert_eq!(
            kv_bits(&grown, layers),
            kv_bits(&full, layers),
            "{what}: round {r} K/V"
        );
        capacities.push(grown.capacity());
    }
    capacities.dedup();
    assert_eq!(
        capacities,
        [4, 16, 32, 64, 128],
        "{what}: the classes it went through"
    );
    assert_eq!(grown.memory_bytes(), full.memory_bytes());
}

#[test]
fn f32_passes_over_a_grown_cache_equal_a_full_size_cache() {
    let m = Transformer::random(small_config(), 11, DType::F32, &Device::Cpu).unwrap();
    check_growth_matches_full_size(&m, "f32");
}

#[test]
fn q8_0_passes_over_a_grown_cache_equal_a_full_size_cache() {
    check_growth_matches_full_size(&small_quantized(GgmlDType::Q8_0), "Q8_0");
}

#[test]
fn a_pass_past_the_capacity_is_refused_until_the_cache_reserves() {
    let m = Transformer::random(small_config(), 11, DType::F32, &Device::Cpu).unwrap();
    let dev = m.device();
    let mut cache = m.new_growable_cache(4, 16).unwrap();
    let tokens: Vec<u32> = (1..=6).collect();
    let err = m
        .forward(
            &u32s(&tokens, dev),
            &span(0, 6, dev),
            None,
            &mut cache,
            &u32s(&[5], dev),
        )
        .unwrap_err();
    // A pass never grows the cache itself: growth is the caller's reserve, before the pass.
    assert!(
        matches!(
            err,
            ModelError::Cache(CacheError::CapacityExceeded {
                needed: 6,
                capacity: 4
            })
        ),
        "{err}"
    );
    assert_eq!((cache.len(), cache.capacity()), (0, 4));
    cache.reserve(6).unwrap();
    m.forward(
        &u32s(&tokens, dev),
        &span(0, 6, dev),
        None,
        &mut cache,
        &u32s(&[5], dev),
    )
    .unwrap();
    assert_eq!((cache.len(), cache.capacity()), (6, 8));
}

#[test]
fn a_multi_session_pass_over_grown_and_full_size_caches_equals_each_alone() {
    let m = Transformer::random(small_config(), 11, DType::F32, &Device::Cpu).unwrap();
    let dev = m.device();
    let layers = m.config().num_hidden_layers;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 13 + 3) % 512).collect();
    let tree = [None, Some(0), Some(1), Some(0)];
    let mask = TreeMask::from_parents(&tree).unwrap();
    let tokens = [7u32, 8, 9, 10];
    let positions = mask.positions(prompt.len());
    let rows = [0u32, 1, 2, 3];
    let prefilled = |mut c: SessionCache| {
        c.reserve(prompt.len() + tree.len()).unwrap();
        m.prefill(&prompt, &mut c).unwrap();
        c
    };
    let mut caches = [
        prefilled(m.new_growable_cache(2, 64).unwrap()),
        prefilled(m.new_cache(64).unwrap()),
    ];
    assert_eq!((caches[0].capacity(), caches[1].capacity()), (16, 64));
    let logits = {
        let [a, b] = &mut caches;
        let mut parts: Vec<SessionPass<'_>> = [a, b]
            .into_iter()
            .map(|cache| SessionPass {
                tokens: &tokens,
                positions: &positions,
                tree: TreeRows {
                    mask: &mask,
                    prefix: prompt.len(),
                    first_row: 0,
                },
                cache,
                rows: &rows,
            })
            .collect();
        m.forward_sessions(&mut parts).unwrap()
    };
    let mut alone = prefilled(m.new_cache(64).unwrap());
    let expect = m
        .forward_tree(
            &u32s(&tokens, dev),
            &u32s(&positions, dev),
            TreeRows {
                mask: &mask,
                prefix: prompt.len(),
                first_row: 0,
            },
            &mut alone,
            &u32s(&rows, dev),
        )
        .unwrap();
    let expect = bits(expect.to_vec2().unwrap());
    for (l, c) in logits.into_iter().zip(&caches) {
        assert_eq!(bits(l.to_vec2().unwrap()), expect);
        assert_eq!(kv_bits(c, layers), kv_bits(&alone, layers));
    }
}

#[test]
fn a_stepper_refuses_a_cache_that_grew_past_its_capacity() {
    use specsplit_models::step::DecodeStepper;
    let m = Transformer::random(small_config(), 11, DType::F32, &Device::Cpu).unwrap();
    let mut cache = m.new_growable_cache(8, 64).unwrap();
    let mut stepper = DecodeStepper::new(&m, cache.capacity()).unwrap();
    stepper.start(5, 0).unwrap();
    stepper.step(&m, &cache).unwrap();
    cache.advance(1).unwrap();
    cache.reserve(9).unwrap();
    // Its buffers (and any graph over them) are for the old capacity: refused, not replayed.
    let err = stepper.step(&m, &cache).unwrap_err();
    assert!(err.to_string().contains("needs a new stepper"), "{err}");
    let mut again = DecodeStepper::new(&m, cache.capacity()).unwrap();
    again.start(5, 1).unwrap();
    again.step(&m, &cache).unwrap();
}
