//! SessionCache: random append/truncate/compact/reserve sequences against a rebuilt-from-scratch
//! model (fixed and growable caches), growth, capacity and argument errors, O(1) truncation.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use specsplit_core::cache::{CacheError, CacheSpec, SessionCache};

const LAYERS: usize = 2;
const KV: usize = 2;
const HD: usize = 4;

fn spec(capacity: usize) -> CacheSpec {
    CacheSpec {
        num_layers: LAYERS,
        num_kv_heads: KV,
        head_dim: HD,
        capacity,
    }
}

/// One cache entry of one layer: K and V values laid out (kv_head, head_dim).
type Entry = (Vec<f32>, Vec<f32>);

/// Deterministic values exactly representable in f16 (multiples of 1/8 in [-64, 64)).
fn entry_values(seed: u64, tag: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tag.wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..KV * HD)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 1024) as f32 - 512.0) / 8.0
        })
        .collect()
}

/// Builds a (1, KV, n, HD) tensor from n entries.
fn to_tensor(entries: &[Vec<f32>], dtype: DType) -> Tensor {
    let n = entries.len();
    let mut data = vec![0f32; KV * n * HD];
    for (t, e) in entries.iter().enumerate() {
        for h in 0..KV {
            for d in 0..HD {
                data[(h * n + t) * HD + d] = e[h * HD + d];
            }
        }
    }
    Tensor::from_vec(data, (1, KV, n, HD), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Reads a (1, KV, n, HD) view back into n entries.
fn from_tensor(t: &Tensor) -> Vec<Vec<f32>> {
    let (_, kv, n, hd) = t.dims4().unwrap();
    let data: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .permute((0, 2, 1, 3))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    data.chunks(kv * hd).map(|c| c.to_vec()).collect::<Vec<_>>()[..n].to_vec()
}

/// Appends n fresh entries to every layer and advances; returns what was written per layer.
fn append_n(cache: &mut SessionCache, n: usize, seed: u64, dtype: DType) -> Vec<Vec<Entry>> {
    let mut written = Vec::new();
    for l in 0..LAYERS {
        let ks: Vec<Vec<f32>> = (0..n)
            .map(|i| entry_values(seed, (l * 1000 + i) as u64))
            .collect();
        let vs: Vec<Vec<f32>> = (0..n)
            .map(|i| entry_values(seed ^ 0xABCD, (l * 1000 + i) as u64))
            .collect();
        let (kview, vview) = cache
            .append(l, &to_tensor(&ks, dtype), &to_tensor(&vs, dtype))
            .unwrap();
        assert_eq!(kview.dims()[2], cache.len() + n);
        assert_eq!(vview.dims()[2], cache.len() + n);
        written.push(ks.into_iter().zip(vs).collect());
    }
    cache.advance(n).unwrap();
    written
}

fn assert_matches(cache: &SessionCache, model: &[Vec<Entry>]) {
    for (l, entries) in model.iter().enumerate() {
        assert_eq!(cache.len(), entries.len());
        let (k, v) = cache.layer(l);
        let ks = from_tensor(&k);
        let vs = from_tensor(&v);
        for (i, (ek, ev)) in entries.iter().enumerate() {
            assert_eq!(&ks[i], ek, "layer {l} K entry {i}");
            assert_eq!(&vs[i], ev, "layer {l} V entry {i}");
        }
    }
}

/// Rebuilds a cache from scratch holding exactly `model`'s entries.
fn rebuild(model: &[Vec<Entry>], capacity: usize, dtype: DType) -> SessionCache {
    let mut c = SessionCache::new(spec(capacity), dtype, &Device::Cpu).unwrap();
    let n = model[0].len();
    for (l, entries) in model.iter().enumerate() {
        let ks: Vec<Vec<f32>> = entries.iter().map(|e| e.0.clone()).collect();
        let vs: Vec<Vec<f32>> = entries.iter().map(|e| e.1.clone()).collect();
        c.append(l, &to_tensor(&ks, dtype), &to_tensor(&vs, dtype))
            .unwrap();
    }
    c.advance(n).unwrap();
    c
}

#[derive(Debug, Clone)]
enum Op {
    Append(usize),
    Truncate(u16),
    Compact(u16, Vec<bool>),
    Reserve(u8),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..6).prop_map(Op::Append),
        1 => any::<u16>().prop_map(Op::Truncate),
        2 => (any::<u16>(), proptest::collection::vec(any::<bool>(), 0..24))
            .prop_map(|(b, k)| Op::Compact(b, k)),
        1 => any::<u8>().prop_map(Op::Reserve),
    ]
}

/// Runs `ops` on a cache of `first` entries growable to `CAP`, checking it against the model of
/// its entries after each.
fn run_ops(ops: &[Op], dtype: DType, first: usize) {
    const CAP: usize = 20;
    let mut cache = SessionCache::growable(spec(first), CAP, dtype, &Device::Cpu).unwrap();
    // The capacities growth may leave the cache at: `first` doubled, capped at CAP.
    let classes: Vec<usize> = std::iter::successors(Some(first), |&c| (c < CAP).then_some(c * 2))
        .map(|c| c.min(CAP))
        .collect();
    let mut model: Vec<Vec<Entry>> = vec![Vec::new(); LAYERS];
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Append(n) => {
                let n = *n;
                if cache.len() + n > CAP {
                    let k = to_tensor(&vec![vec![0.0; KV * HD]; n], dtype);
                    match cache.append(0, &k, &k) {
                        Err(CacheError::CapacityExceeded { needed, capacity }) => {
                            assert_eq!((needed, capacity), (cache.len() + n, CAP))
                        }
                        other => panic!("expected CapacityExceeded, got {other:?}"),
                    }
                    assert!(matches!(
                        cache.advance(n),
                        Err(CacheError::CapacityExceeded { .. })
                    ));
                } else {
                    let written = append_n(&mut cache, n, step as u64 + 1, dtype);
                    for (l, w) in written.into_iter().enumerate() {
                        model[l].extend(w);
                    }
                }
            }
            Op::Truncate(x) => {
                let new_len = *x as usize % (cache.len() + 1);
                cache.truncate(new_len).unwrap();
                for m in model.iter_mut() {
                    m.truncate(new_len);
                }
            }
            Op::Compact(b, mask) => {
                let len = cache.len();
                let base = *b as usize % (len + 1);
                let keep: Vec<usize> = (base..len)
                    .filter(|&p| mask.get(p - base).copied().unwrap_or(false))
                    .collect();
                cache.compact(base, &keep).unwrap();
                for m in model.iter_mut() {
                    let kept: Vec<Entry> = keep.iter().map(|&p| m[p].clone()).collect();
                    m.truncate(base);
                    m.extend(kept);
                }
            }
            Op::Reserve(x) => {
                let entries = *x as usize % (CAP + 4);
                let before = cache.capacity();
                match cache.reserve(entries) {
                    Ok(grew) => {
                        assert!(entries <= CAP);
                        assert!(cache.capacity() >= entries);
                        assert_eq!(grew, cache.capacity() > before);
                    }
                    Err(CacheError::CapacityExceeded { needed, capacity }) => {
                        assert_eq!((needed, capacity), (entries, CAP));
                        assert_eq!(cache.capacity(), before, "a refused growth changes nothing");
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
            }
        }
        assert!(classes.contains(&cache.capacity()), "{}", cache.capacity());
        assert_eq!(
            cache.memory_bytes(),
            SessionCache::bytes_for(&spec(cache.capacity()), dtype)
        );
        assert_matches(&cache, &model);
    }
    if !model[0].is_empty() {
        // The surviving entries equal a cache rebuilt from scratch.
        let fresh = rebuild(&model, CAP, dtype);
        for l in 0..LAYERS {
            let (a, b) = (cache.layer(l), fresh.layer(l));
            assert_eq!(from_tensor(&a.0), from_tensor(&b.0));
            assert_eq!(from_tensor(&a.1), from_tensor(&b.1));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_ops_match_rebuilt_cache_f32(ops in proptest::collection::vec(op_strategy(), 1..30)) {
        run_ops(&ops, DType::F32, 20);
    }

    #[test]
    fn random_ops_match_rebuilt_cache_f16(ops in proptest::collection::vec(op_strategy(), 1..30)) {
        run_ops(&ops, DType::F16, 20);
    }

    #[test]
    fn random_ops_on_a_growing_cache_match_rebuilt_cache(
        ops in proptest::collection::vec(op_strategy(), 1..30),
        first in 1usize..8,
    ) {
        run_ops(&ops, DType::F16, first);
    }
}

#[test]
fn sizes_and_accessors() {
    let s = spec(16);
    let c = SessionCache::new(s, DType::F16, &Device::Cpu).unwrap();
    assert_eq!(
        SessionCache::bytes_for(&s, DType::F16),
        2 * LAYERS * KV * 16 * HD * 2
    );
    assert_eq!(c.memory_bytes(), SessionCache::bytes_for(&s, DType::F16));
    assert_eq!(c.capacity(), 16);
    assert_eq!(c.spec(), &s);
    assert!(c.is_empty());
    assert_eq!(c.len(), 0);
    assert_eq!(c.layer(1).0.dims(), &[1, KV, 0, HD]);
}

#[test]
fn truncate_is_o1_and_later_append_overwrites() {
    for dtype in [DType::F32, DType::F16] {
        let mut cache = SessionCache::new(spec(32), dtype, &Device::Cpu).unwrap();
        let first = append_n(&mut cache, 10, 7, dtype);
        cache.truncate(4).unwrap();
        assert_eq!(cache.len(), 4);
        let prefix: Vec<Vec<Entry>> = first.iter().map(|w| w[..4].to_vec()).collect();
        assert_matches(&cache, &prefix);
        // No data moved or cleared: re-advancing exposes the old entries 4..10 unchanged.
        cache.advance(6).unwrap();
        assert_matches(&cache, &first);
        // A later append after rollback overwrites [4, 7) and leaves the prefix untouched.
        cache.truncate(4).unwrap();
        let second = append_n(&mut cache, 3, 99, dtype);
        let expected: Vec<Vec<Entry>> = (0..LAYERS)
            .map(|l| {
                let mut e = first[l][..4].to_vec();
                e.extend(second[l].clone());
                e
            })
            .collect();
        assert_matches(&cache, &expected);
        assert!(matches!(
            cache.truncate(8),
            Err(CacheError::BadTruncate { new_len: 8, len: 7 })
        ));
    }
}

#[test]
fn every_write_or_length_change_moves_the_generation() {
    let dtype = DType::F32;
    let mut cache = SessionCache::growable(spec(4), 16, dtype, &Device::Cpu).unwrap();
    let mut seen = vec![cache.generation()];
    let mut moved = |c: &SessionCache| {
        assert!(!seen.contains(&c.generation()), "{} again", c.generation());
        seen.push(c.generation());
    };
    append_n(&mut cache, 3, 1, dtype);
    moved(&cache);
    cache.truncate(3).unwrap(); // to the same length: a pass may have written past it
    moved(&cache);
    cache.truncate(1).unwrap();
    moved(&cache);
    cache.advance(2).unwrap();
    moved(&cache);
    cache.compact(1, &[2]).unwrap();
    moved(&cache);
    let before = cache.generation();
    assert!(!cache.reserve(4).unwrap());
    assert_eq!(
        cache.generation(),
        before,
        "a reserve that fits writes nothing"
    );
    assert!(cache.reserve(9).unwrap());
    moved(&cache);
    // Reads leave it alone.
    let g = cache.generation();
    let _ = (cache.layer(0), cache.buffers(1).unwrap(), cache.len());
    assert_eq!(cache.generation(), g);
}

#[test]
fn compact_keeps_prefix_and_moves_path() {
    let dtype = DType::F32;
    let mut cache = SessionCache::new(spec(32), dtype, &Device::Cpu).unwrap();
    let w = append_n(&mut cache, 12, 3, dtype);
    // Prefix 0..5, tree 5..12; keep a path 5, 7, 8, 11 (first entry already in place).
    cache.compact(5, &[5, 7, 8, 11]).unwrap();
    let expected: Vec<Vec<Entry>> = w
        .iter()
        .map(|e| {
            let mut v = e[..5].to_vec();
            v.extend([7, 8, 11].iter().map(|&p| e[p].clone()));
            v.insert(5, e[5].clone());
            v
        })
        .collect();
    assert_matches(&cache, &expected);
    // Keeping nothing rolls back to the base; one contiguous run is also fine.
    let mut c2 = rebuild(&w, 32, dtype);
    c2.compact(3, &[6, 7, 8]).unwrap();
    let exp2: Vec<Vec<Entry>> = w
        .iter()
        .map(|e| {
            let mut v = e[..3].to_vec();
            v.extend(e[6..9].iter().cloned());
            v
        })
        .collect();
    assert_matches(&c2, &exp2);
    c2.compact(6, &[]).unwrap();
    assert_eq!(c2.len(), 6);
}

#[test]
fn errors_are_reported() {
    let dtype = DType::F32;
    let mut cache = SessionCache::new(spec(8), dtype, &Device::Cpu).unwrap();
    append_n(&mut cache, 6, 1, dtype);
    let three = to_tensor(&vec![vec![1.0; KV * HD]; 3], dtype);
    let err = cache.append(0, &three, &three).unwrap_err();
    assert!(matches!(
        err,
        CacheError::CapacityExceeded {
            needed: 9,
            capacity: 8
        }
    ));
    assert!(err.to_string().contains("capacity"), "{err}");
    assert!(matches!(
        cache.advance(3),
        Err(CacheError::CapacityExceeded { .. })
    ));
    assert!(matches!(
        cache.append(LAYERS, &three, &three),
        Err(CacheError::BadLayer {
            layer: 2,
            num_layers: 2
        })
    ));
    let wrong = Tensor::zeros((1, KV + 1, 1, HD), dtype, &Device::Cpu).unwrap();
    assert!(matches!(
        cache.append(0, &wrong, &wrong),
        Err(CacheError::BadShape(_))
    ));
    let wrong_dtype = Tensor::zeros((1, KV, 1, HD), DType::F16, &Device::Cpu).unwrap();
    assert!(matches!(
        cache.append(0, &wrong_dtype, &wrong_dtype),
        Err(CacheError::BadShape(_))
    ));
    let one = to_tensor(&[vec![1.0; KV * HD]], dtype);
    let two = to_tensor(&vec![vec![1.0; KV * HD]; 2], dtype);
    assert!(matches!(
        cache.append(0, &one, &two),
        Err(CacheError::BadShape(_))
    ));
    for (base, keep) in [
        (2usize, vec![3usize, 3]),
        (2, vec![1]),
        (2, vec![6]),
        (7, vec![]),
    ] {
        assert!(
            matches!(
                cache.compact(base, &keep),
                Err(CacheError::BadCompaction(_))
            ),
            "compact({base}, {keep:?}) should fail"
        );
    }
    assert_eq!(cache.len(), 6);
    assert!(matches!(
        SessionCache::new(spec(4), DType::U32, &Device::Cpu),
        Err(CacheError::BadSpec(_))
    ));
}

/// Every slot of every buffer, K then V, layer by layer.
fn all_slots(c: &SessionCache) -> Vec<Vec<Vec<f32>>> {
    (0..LAYERS)
        .flat_map(|l| {
            let (k, v) = c.buffers(l).unwrap();
            [from_tensor(k), from_tensor(v)]
        })
        .collect()
}

#[test]
fn growth_keeps_every_entry_bit_for_bit() {
    for dtype in [DType::F32, DType::F16] {
        let mut grown = SessionCache::growable(spec(4), 64, dtype, &Device::Cpu).unwrap();
        let mut full = SessionCache::new(spec(64), dtype, &Device::Cpu).unwrap();
        let mut seed = 1;
        // Appends of 3: the cache grows 4 -> 8 -> 16 -> 32 on the way to 30 entries, and a
        // truncation in between leaves stale slots past the length that growth keeps too.
        while grown.len() < 30 {
            append_n(&mut grown, 3, seed, dtype);
            append_n(&mut full, 3, seed, dtype);
            seed += 1;
            if seed == 4 {
                grown.truncate(7).unwrap();
                full.truncate(7).unwrap();
            }
        }
        assert_eq!(grown.capacity(), 32);
        assert_eq!(grown.len(), full.len());
        for l in 0..LAYERS {
            let (a, b) = (grown.layer(l), full.layer(l));
            assert_eq!(
                from_tensor(&a.0),
                from_tensor(&b.0),
                "{dtype:?} layer {l} K"
            );
            assert_eq!(
                from_tensor(&a.1),
                from_tensor(&b.1),
                "{dtype:?} layer {l} V"
            );
        }
        // Growing again copies every slot of the old buffers, valid or not, and zero-fills
        // the rest.
        let before = all_slots(&grown);
        assert!(grown.reserve(33).unwrap());
        assert_eq!(grown.capacity(), 64);
        assert_eq!(
            grown.memory_bytes(),
            SessionCache::bytes_for(&spec(64), dtype)
        );
        for (old, new) in before.iter().zip(all_slots(&grown)) {
            assert_eq!(&new[..32], &old[..]);
            assert!(new[32..].iter().flatten().all(|&x| x == 0.0));
        }
        // Tree compaction on the grown cache moves entries as on the never-grown one.
        grown.compact(10, &[12, 20, 29]).unwrap();
        full.compact(10, &[12, 20, 29]).unwrap();
        for l in 0..LAYERS {
            assert_eq!(
                from_tensor(&grown.layer(l).0),
                from_tensor(&full.layer(l).0)
            );
        }
    }
}

#[test]
fn growth_follows_capacity_classes_up_to_the_maximum() {
    let mut c = SessionCache::growable(spec(3), 20, DType::F32, &Device::Cpu).unwrap();
    assert_eq!((c.capacity(), c.max_capacity()), (3, 20));
    assert_eq!(c.capacity_for(3).unwrap(), 3);
    assert_eq!(c.capacity_for(4).unwrap(), 6);
    assert_eq!(c.capacity_for(7).unwrap(), 12);
    assert_eq!(c.capacity_for(13).unwrap(), 20, "capped at the maximum");
    assert!(!c.reserve(2).unwrap(), "room already");
    assert!(c.reserve(5).unwrap());
    assert_eq!(c.capacity(), 6);
    // Past the maximum: the existing CapacityExceeded error, and the cache is unchanged.
    let Err(CacheError::CapacityExceeded { needed, capacity }) = c.reserve(21) else {
        panic!("growth past the maximum must be refused");
    };
    assert_eq!((needed, capacity, c.capacity()), (21, 20, 6));
    append_n(&mut c, 6, 1, DType::F32);
    // Appending past the capacity grows; advancing past it does not.
    append_n(&mut c, 1, 2, DType::F32);
    assert_eq!((c.len(), c.capacity()), (7, 12));
    assert!(matches!(
        c.advance(6),
        Err(CacheError::CapacityExceeded {
            needed: 13,
            capacity: 12
        })
    ));
    // A fixed cache never grows, and a maximum below the capacity is refused.
    let mut fixed = SessionCache::new(spec(4), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        fixed.reserve(5),
        Err(CacheError::CapacityExceeded {
            needed: 5,
            capacity: 4
        })
    ));
    assert!(matches!(
        SessionCache::growable(spec(8), 4, DType::F32, &Device::Cpu),
        Err(CacheError::BadSpec(_))
    ));
}
