//! SessionCache: random append/truncate/compact sequences against a rebuilt-from-scratch model,
//! capacity and argument errors, O(1) truncation.

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
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..6).prop_map(Op::Append),
        1 => any::<u16>().prop_map(Op::Truncate),
        2 => (any::<u16>(), proptest::collection::vec(any::<bool>(), 0..24))
            .prop_map(|(b, k)| Op::Compact(b, k)),
    ]
}

fn run_ops(ops: &[Op], dtype: DType) {
    const CAP: usize = 20;
    let mut cache = SessionCache::new(spec(CAP), dtype, &Device::Cpu).unwrap();
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
        }
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
        run_ops(&ops, DType::F32);
    }

    #[test]
    fn random_ops_match_rebuilt_cache_f16(ops in proptest::collection::vec(op_strategy(), 1..30)) {
        run_ops(&ops, DType::F16);
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
