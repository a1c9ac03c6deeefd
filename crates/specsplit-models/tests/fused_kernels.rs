//! The fused bf16 CUDA kernels (`specsplit_models::fused`) against f32 references computed on
//! the host from the same bf16 inputs, and the fused one-token step against the ordinary
//! forward pass. Needs the `cuda` feature and a GPU; without a GPU every test says so and
//! returns. Tests that compare kernel paths build one model per [`fused::KernelOptions`] from
//! the same seed, so the tests share no state and may run in parallel.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, IndexOp, Tensor};
use specsplit_core::cache::SessionCache;
use specsplit_models::config::ModelConfig;
use specsplit_models::fused::{self, AttnShape, KernelOptions};
use specsplit_models::step::{
    DecodeStepper, ExactStepper, SessionChainsStepper, SessionRowsStepper,
};
use specsplit_models::transformer::{SessionChain, SessionChainRows, Transformer};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no GPU, skipping: {e}");
            None
        }
    }
}

/// Seeded standard-normal bf16 tensor of `shape` times `scale` on `dev`.
fn randn(dev: &Device, shape: &[usize], scale: f64) -> Tensor {
    Tensor::randn(0f32, 1f32, shape, dev)
        .unwrap()
        .affine(scale, 0.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

/// The tensor's values as f32 on the host, flattened.
fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Asserts `got[i]` is within `rel` of `want[i]` relative to `scale` (the magnitude the values
/// are computed at), reporting the worst index.
fn assert_close(what: &str, got: &[f32], want: &[f32], scale: f32, rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (worst, err) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold((0, 0f32), |a, (i, e)| if e > a.1 { (i, e) } else { a });
    assert!(
        err <= rel * scale,
        "{what}: worst |diff| {err} at {worst} (got {}, want {}), allowed {}",
        got[worst],
        want[worst],
        rel * scale
    );
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, b| a.max(b.abs()))
}

#[test]
fn gemv_matches_an_f32_product_with_and_without_bias() {
    let Some(dev) = gpu() else { return };
    for (n, k) in [(1, 8), (37, 264), (896, 896), (129, 4864), (1000, 3584)] {
        let x = randn(&dev, &[1, k], 1.0);
        let w = randn(&dev, &[n, k], 0.05);
        let b = randn(&dev, &[n], 0.5);
        assert!(fused::gemv_fits(&x, &w));
        let (xs, ws, bs) = (host(&x), host(&w), host(&b));
        let exact: Vec<f32> = (0..n)
            .map(|r| (0..k).map(|c| xs[c] * ws[r * k + c]).sum())
            .collect();
        let scale = max_abs(&exact).max(1e-3);
        let got = host(&fused::gemv(&x, &w, None, L).unwrap());
        // One bf16 rounding of the output (2^-8 relative) plus f32 summation-order noise.
        assert_close(&format!("gemv {n}x{k}"), &got, &exact, scale, 1.0 / 128.0);
        let with_bias: Vec<f32> = exact
            .iter()
            .zip(&bs)
            .map(|(y, b)| bf16_round(*y) + b)
            .collect();
        let got = host(&fused::gemv(&x, &w, Some(&b), L).unwrap());
        let scale = max_abs(&with_bias).max(1e-3);
        assert_close(
            &format!("gemv+bias {n}x{k}"),
            &got,
            &with_bias,
            scale,
            1.0 / 64.0,
        );
    }
}

#[test]
fn gemv_rows_give_each_row_its_one_row_product_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    // One row of the weight a warp: the reference.
    let one = fused::Launch {
        gemv_warp_rows: Some(1),
        ..L
    };
    // Shapes whose rows do not fill the last warp of 2 rows, and the 0.5B's gate|up.
    for (n, k) in [
        (37, 264),
        (896, 896),
        (129, 4864),
        (9728, 896),
        (1001, 1024),
    ] {
        let w = randn(&dev, &[n, k], 0.05);
        let b = randn(&dev, &[n], 0.5);
        for r in 1..=fused::GEMV_MAX_ROWS {
            let x = randn(&dev, &[r, k], 1.0);
            assert!(fused::gemv_rows_fits(&x, &w));
            for bias in [None, Some(&b)] {
                let alone: Vec<Vec<f32>> = (0..r)
                    .map(|j| {
                        host(&fused::gemv(&x.narrow(0, j, 1).unwrap(), &w, bias, one).unwrap())
                    })
                    .collect();
                // The built-in rule and every rows-a-warp override give the same bits.
                for warp_rows in [None, Some(1), Some(2)] {
                    let launch = fused::Launch {
                        gemv_warp_rows: warp_rows,
                        ..L
                    };
                    let got = host(&fused::gemv_rows(&x, &w, bias, launch).unwrap());
                    assert_eq!(got.len(), r * n);
                    for (j, alone) in alone.iter().enumerate() {
                        let row = &got[j * n..(j + 1) * n];
                        let same = row
                            .iter()
                            .zip(alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{r} rows of {n}x{k}, row {j}, bias {}, warp rows {warp_rows:?}",
                            bias.is_some()
                        );
                    }
                }
            }
        }
    }
    // Past the row limit, or a width that does not match: refused with a clear error.
    let w = randn(&dev, &[16, 64], 1.0);
    let five = randn(&dev, &[fused::GEMV_MAX_ROWS + 1, 64], 1.0);
    assert!(!fused::gemv_rows_fits(&five, &w));
    let e = fused::gemv_rows(&five, &w, None, L)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gemv_rows"), "{e}");
    assert!(!fused::gemv_rows_fits(&randn(&dev, &[2, 72], 1.0), &w));
}

#[test]
fn gemv_refuses_what_it_cannot_run() {
    let Some(dev) = gpu() else { return };
    let w = randn(&dev, &[16, 64], 1.0);
    // Width not a multiple of 8, mismatched widths, two rows, a misaligned view, f32.
    assert!(!fused::gemv_fits(
        &randn(&dev, &[1, 60], 1.0),
        &randn(&dev, &[16, 60], 1.0)
    ));
    assert!(!fused::gemv_fits(&randn(&dev, &[1, 72], 1.0), &w));
    assert!(!fused::gemv_fits(&randn(&dev, &[2, 64], 1.0), &w));
    let wide = randn(&dev, &[1, 72], 1.0);
    assert!(!fused::gemv_fits(&wide.narrow(1, 1, 64).unwrap(), &w));
    let f = Tensor::zeros((1, 64), DType::F32, &dev).unwrap();
    assert!(!fused::gemv_fits(&f, &w));
    let e = fused::gemv(&f, &w, None, L).unwrap_err().to_string();
    assert!(e.contains("does not apply"), "{e}");
}

#[test]
fn add_rmsnorm_matches_the_f32_formula() {
    let Some(dev) = gpu() else { return };
    for (rows, d) in [(1, 64), (3, 896), (1, 3584), (2, 100)] {
        let x = randn(&dev, &[rows, d], 1.0);
        let delta = randn(&dev, &[rows, d], 0.5);
        let w = randn(&dev, &[d], 1.0);
        let eps = 1e-6f32;
        let (xs, ds, ws) = (host(&x), host(&delta), host(&w));
        for with_delta in [false, true] {
            let (s, n) = fused::add_rmsnorm(&x, with_delta.then_some(&delta), &w, eps, L).unwrap();
            assert_eq!(s.dims(), [rows, d]);
            assert_eq!(n.dims(), [rows, d]);
            let (gs, gn) = (host(&s), host(&n));
            for r in 0..rows {
                let sum: Vec<f32> = (0..d)
                    .map(|i| {
                        let v = xs[r * d + i];
                        if with_delta {
                            bf16_round(v + ds[r * d + i])
                        } else {
                            v
                        }
                    })
                    .collect();
                assert_eq!(&gs[r * d..(r + 1) * d], &sum[..], "residual sum row {r}");
                let inv = 1.0 / ((sum.iter().map(|v| v * v).sum::<f32>() / d as f32) + eps).sqrt();
                let want: Vec<f32> = (0..d).map(|i| sum[i] * inv * ws[i]).collect();
                let scale = max_abs(&want);
                assert_close(
                    &format!("rmsnorm {rows}x{d} row {r}"),
                    &gn[r * d..(r + 1) * d],
                    &want,
                    scale,
                    1.0 / 128.0,
                );
            }
        }
    }
}

#[test]
fn silu_mul_matches_the_f32_formula() {
    let Some(dev) = gpu() else { return };
    let (rows, n) = (2, 4864);
    let gu = randn(&dev, &[rows, 2 * n], 2.0);
    let g = host(&gu);
    let got = host(&fused::silu_mul(&gu, L).unwrap());
    let want: Vec<f32> = (0..rows * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let gate = g[r * 2 * n + c];
            let up = g[r * 2 * n + n + c];
            bf16_round(gate / (1.0 + (-gate).exp())) * up
        })
        .collect();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= b.abs() / 64.0 + 1e-6,
            "silu_mul {i}: {a} vs {b}"
        );
    }
}

/// Rotary tables `(positions, half)` for base 10000, rounded to bf16 like the model's.
fn rope_tables(dev: &Device, positions: usize, hd: usize) -> (Tensor, Tensor, Vec<f32>, Vec<f32>) {
    let half = hd / 2;
    let mut c = Vec::with_capacity(positions * half);
    let mut s = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for i in 0..half {
            let inv = 1.0 / 10_000f64.powf(2.0 * i as f64 / hd as f64);
            let a = p as f64 * inv;
            c.push(bf16_round(a.cos() as f32));
            s.push(bf16_round(a.sin() as f32));
        }
    }
    let t = |v: &Vec<f32>| {
        Tensor::from_vec(v.clone(), (positions, half), dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    (t(&c), t(&s), c, s)
}

#[test]
fn qkv_rope_cache_rotates_q_and_k_and_writes_only_slot_pos() {
    let Some(dev) = gpu() else { return };
    for interleaved in [false, true] {
        let shape = AttnShape {
            heads: 14,
            kv: 2,
            head_dim: 64,
            capacity: 40,
        };
        let (h, kv, hd, cap) = (shape.heads, shape.kv, shape.head_dim, shape.capacity);
        let half = hd / 2;
        let (cos, sin, cs, ss) = rope_tables(&dev, 64, hd);
        let qkv = randn(&dev, &[1, (h + 2 * kv) * hd], 1.0);
        let kc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let vc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let (k_before, v_before) = (host(&kc), host(&vc));
        let p = 23usize;
        let pos = Tensor::new(&[p as u32], &dev).unwrap();
        let q =
            fused::qkv_rope_cache(&qkv, &cos, &sin, &pos, &kc, &vc, shape, interleaved, L).unwrap();
        let src = host(&qkv);
        let rotate = |head: &[f32]| -> Vec<f32> {
            let mut out = head.to_vec();
            for i in 0..half {
                let (a, b) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (c, s) = (cs[p * half + i], ss[p * half + i]);
                out[a] = head[a] * c - head[b] * s;
                out[b] = head[a] * s + head[b] * c;
            }
            out
        };
        let gq = host(&q);
        for head in 0..h {
            let want = rotate(&src[head * hd..(head + 1) * hd]);
            assert_close(
                &format!("q head {head}"),
                &gq[head * hd..(head + 1) * hd],
                &want,
                max_abs(&want),
                1.0 / 128.0,
            );
        }
        let (k_after, v_after) = (host(&kc), host(&vc));
        for j in 0..kv {
            for slot in 0..cap {
                let at = (j * cap + slot) * hd;
                let (k, v) = (&k_after[at..at + hd], &v_after[at..at + hd]);
                if slot != p {
                    assert_eq!(k, &k_before[at..at + hd], "K slot {slot} touched");
                    assert_eq!(v, &v_before[at..at + hd], "V slot {slot} touched");
                    continue;
                }
                let kh = (h + j) * hd;
                let want = rotate(&src[kh..kh + hd]);
                assert_close(
                    &format!("k head {j}"),
                    k,
                    &want,
                    max_abs(&want),
                    1.0 / 128.0,
                );
                let vh = (h + kv + j) * hd;
                assert_eq!(v, &src[vh..vh + hd], "V head {j} copied as is");
            }
        }
    }
}

/// The attention tests' shape: 8 query heads over 2 KV heads, a 4200-slot cache (past two
/// tiles of 2048 scores).
fn test_attn_shape(head_dim: usize) -> AttnShape {
    AttnShape {
        heads: 8,
        kv: 2,
        head_dim,
        capacity: 4200,
    }
}

#[test]
fn decode_attention_matches_naive_softmax_attention() {
    let Some(dev) = gpu() else { return };
    for hd in [64, 128] {
        let shape = test_attn_shape(hd);
        let (h, kv, cap) = (shape.heads, shape.kv, shape.capacity);
        let q = randn(&dev, &[1, h * hd], 1.0);
        let kc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let vc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let (qs, ks, vs) = (host(&q), host(&kc), host(&vc));
        let scale = 1.0 / (hd as f32).sqrt();
        // Across one tile, several tiles of 2048 scores and a tile boundary (2049).
        for len in [1usize, 7, 300, 2048, 2049, 4100] {
            let pos = Tensor::new(&[len as u32 - 1], &dev).unwrap();
            let got = host(&fused::decode_attention(&q, &kc, &vc, &pos, shape, scale, L).unwrap());
            for head in 0..h {
                let j = head / (h / kv);
                let qh = &qs[head * hd..(head + 1) * hd];
                let at = |t: usize| (j * cap + t) * hd..(j * cap + t + 1) * hd;
                let kr: Vec<&[f32]> = (0..len).map(|t| &ks[at(t)]).collect();
                let vr: Vec<&[f32]> = (0..len).map(|t| &vs[at(t)]).collect();
                let want = naive_attention(qh, &kr, &vr, scale);
                assert_close(
                    &format!("attention hd {hd} len {len} head {head}"),
                    &got[head * hd..(head + 1) * hd],
                    &want,
                    max_abs(&want).max(0.05),
                    1.0 / 64.0,
                );
            }
        }
    }
}

#[test]
fn greedy_head_picks_the_lowest_argmax_and_advances_the_position() {
    let Some(dev) = gpu() else { return };
    let vocab = 151_936;
    let mut logits: Vec<f32> = (0..vocab)
        .map(|i| ((i as f32 * 0.618).fract() - 0.5) * 8.0)
        .collect();
    // A tie at the maximum: the lower index wins.
    logits[90_001] = 9.0;
    logits[12_345] = 9.0;
    let l = Tensor::from_vec(logits.clone(), (1, vocab), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let lb = host(&l);
    let next = Tensor::zeros(1, DType::U32, &dev).unwrap();
    let logprob = Tensor::zeros(1, DType::F32, &dev).unwrap();
    let token = Tensor::zeros(1, DType::U32, &dev).unwrap();
    let pos = Tensor::new(&[41u32], &dev).unwrap();
    fused::greedy_head(&l, &next, &logprob, &token, &pos, L).unwrap();
    assert_eq!(next.to_vec1::<u32>().unwrap(), [12_345]);
    assert_eq!(token.to_vec1::<u32>().unwrap(), [12_345]);
    assert_eq!(pos.to_vec1::<u32>().unwrap(), [42]);
    let lse = 9.0
        + lb.iter()
            .map(|&v| ((v - 9.0) as f64).exp())
            .sum::<f64>()
            .ln();
    let got = logprob.to_vec1::<f32>().unwrap()[0] as f64;
    assert!((got - (9.0 - lse)).abs() < 1e-3, "{got} vs {}", 9.0 - lse);
    // Small vocabularies (one block) and widths that leave the last block short, with the
    // maximum at the very end.
    for v in [100usize, 4096, 4097, 70_001] {
        let mut row: Vec<f32> = (0..v)
            .map(|i| ((i as f32 * 0.37).fract() - 0.5) * 4.0)
            .collect();
        row[v - 1] = 5.0;
        let l = Tensor::from_vec(row, (1, v), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let lb = host(&l);
        fused::greedy_head(&l, &next, &logprob, &token, &pos, L).unwrap();
        assert_eq!(
            next.to_vec1::<u32>().unwrap(),
            [v as u32 - 1],
            "vocabulary {v}"
        );
        let lse = 5.0
            + lb.iter()
                .map(|&x| ((x - 5.0) as f64).exp())
                .sum::<f64>()
                .ln();
        let got = logprob.to_vec1::<f32>().unwrap()[0] as f64;
        assert!(
            (got - (5.0 - lse)).abs() < 1e-3,
            "vocabulary {v}: {got} vs {}",
            5.0 - lse
        );
    }
    assert_eq!(pos.to_vec1::<u32>().unwrap(), [46]);
}

#[test]
fn greedy_rows_pick_each_rows_lowest_argmax_or_its_forced_token() {
    let Some(dev) = gpu() else { return };
    for (rows, vocab) in [(1usize, 151_936usize), (3, 4097), (10, 151_936), (16, 100)] {
        let mut data: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as f32 * 0.618).fract() - 0.5) * 8.0)
            .collect();
        // Row r: a tie at its maximum (the lower index wins), placed differently per row.
        for r in 0..rows {
            let (a, b) = ((r * 37) % vocab, vocab - 1 - (r * 11) % (vocab / 2));
            data[r * vocab + a] = 9.0;
            data[r * vocab + b] = 9.0;
        }
        let l = Tensor::from_vec(data, (rows, vocab), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let lb = host(&l);
        // Odd rows forced to token 7 (even rows' forced token is ignored); the last row's
        // forced token lies outside the vocabulary and is ignored too.
        let forced: Vec<u32> = (0..rows)
            .map(|r| {
                if r + 1 == rows && rows > 1 {
                    vocab as u32
                } else {
                    7
                }
            })
            .collect();
        let on: Vec<u32> = (0..rows).map(|r| (r % 2) as u32).collect();
        let forced = Tensor::new(forced.as_slice(), &dev).unwrap();
        let on_t = Tensor::new(on.as_slice(), &dev).unwrap();
        let out = Tensor::zeros((2, rows), DType::F32, &dev).unwrap();
        let ids = fused::greedy_rows(
            &l,
            &forced,
            &on_t,
            &out.get(0).unwrap(),
            &out.get(1).unwrap(),
            L,
        )
        .unwrap();
        let ids: Vec<u32> = ids.to_vec1().unwrap();
        let got: Vec<Vec<f32>> = out.to_vec2().unwrap();
        for r in 0..rows {
            let row = &lb[r * vocab..(r + 1) * vocab];
            let forced_here = on[r] == 1 && !(r + 1 == rows && rows > 1);
            let want = if forced_here { 7 } else { argmax(row) };
            assert_eq!(ids[r], want, "{rows} rows of {vocab}: row {r}");
            assert_eq!(got[0][r], want as f32, "row {r}: the token as f32");
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
            let lp = row[want as usize] as f64 - lse;
            assert!(
                (got[1][r] as f64 - lp).abs() < 1e-3,
                "{rows} rows of {vocab}: row {r}: log-prob {} vs {lp}",
                got[1][r]
            );
        }
    }
    // Buffers that do not hold one value a row are refused.
    let l = randn(&dev, &[3, 64], 1.0);
    let two = Tensor::zeros(2, DType::U32, &dev).unwrap();
    let three = Tensor::zeros(3, DType::F32, &dev).unwrap();
    assert!(fused::greedy_rows(&l, &two, &two, &three, &three, L).is_err());
}

#[test]
fn top_rows_give_each_rows_largest_logits_best_first_with_the_logsumexp() {
    let Some(dev) = gpu() else { return };
    for (rows, vocab, width) in [(1usize, 151_936usize, 3usize), (5, 151_936, 5), (3, 100, 4)] {
        let mut data: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as f32 * 0.618).fract() - 0.5) * 8.0)
            .collect();
        // Row r: a tie at its maximum (the lower index first), then a clear third.
        for r in 0..rows {
            data[r * vocab + (r * 37) % vocab] = 9.0;
            data[r * vocab + vocab - 1 - r] = 9.0;
            data[r * vocab + (r * 13 + 5) % vocab] = 8.5;
        }
        for dtype in [DType::F32, DType::BF16] {
            let l = Tensor::from_vec(data.clone(), (rows, vocab), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let lh = host(&l);
            let got: Vec<Vec<f32>> = fused::top_rows(&l, width, L).unwrap().to_vec2().unwrap();
            for r in 0..rows {
                let row = &lh[r * vocab..(r + 1) * vocab];
                // Host reference: indices by logit, descending, the lower index first on ties.
                let mut order: Vec<usize> = (0..vocab).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                let mx = row[order[0]] as f64;
                let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
                for j in 0..width {
                    assert_eq!(got[r][j], order[j] as f32, "{dtype:?} row {r} pick {j}");
                    assert_eq!(
                        got[r][width + j],
                        row[order[j]],
                        "{dtype:?} row {r} value {j}"
                    );
                }
                let g = got[r][2 * width] as f64;
                assert!(
                    (g - lse).abs() < 1e-3,
                    "{dtype:?} row {r}: logsumexp {g} vs {lse}"
                );
            }
            // The input is left alone.
            assert_eq!(host(&l), lh);
        }
    }
    // Fewer finite logits than the width: the rest come back as -1 / -inf.
    let l = Tensor::from_vec(
        vec![1f32, f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY],
        (1, 4),
        &dev,
    )
    .unwrap();
    let got: Vec<Vec<f32>> = fused::top_rows(&l, 3, L).unwrap().to_vec2().unwrap();
    assert_eq!(&got[0][..3], &[2.0, 0.0, -1.0]);
    assert_eq!(&got[0][3..6], &[3.0, 1.0, f32::NEG_INFINITY]);
    // A width past the vocabulary is refused.
    assert!(fused::top_rows(&l, 5, L).is_err());
}

#[test]
fn argmax_rows_pick_what_the_host_argmax_picks_across_several_matrices() {
    let Some(dev) = gpu() else { return };
    let vocab = 151_936usize;
    // Three matrices of 1, 5 and 2 rows: ties at the maximum (the lower index wins), a maximum
    // in the last and in the first slot, NaN beside it, and rows with no logit above -inf.
    let mut mats: Vec<Vec<f32>> = Vec::new();
    for (m, rows) in [1usize, 5, 2].into_iter().enumerate() {
        let mut data: Vec<f32> = (0..rows * vocab)
            .map(|i| (((i + 7919 * m) as f32 * 0.618).fract() - 0.5) * 8.0)
            .collect();
        for r in 0..rows {
            let row = &mut data[r * vocab..(r + 1) * vocab];
            match (m + r) % 5 {
                0 => {
                    row[vocab - 3] = 9.0;
                    row[(r * 37 + 11) % (vocab - 3)] = 9.0;
                }
                1 => row[vocab - 1] = 9.5,
                2 => {
                    row[0] = 9.0;
                    row[1] = f32::NAN;
                }
                3 => row.fill(f32::NEG_INFINITY),
                _ => {
                    row.fill(f32::NEG_INFINITY);
                    row[vocab / 2] = f32::NAN;
                }
            }
        }
        mats.push(data);
    }
    for dtype in [DType::F32, DType::BF16] {
        let ts: Vec<Tensor> = mats
            .iter()
            .map(|d| {
                Tensor::from_vec(d.clone(), (d.len() / vocab, vocab), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            })
            .collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        let got: Vec<u32> = fused::argmax_rows(&refs, L).unwrap().to_vec1().unwrap();
        let want: Vec<u32> = ts
            .iter()
            .flat_map(|t| {
                let h = host(t);
                h.chunks(vocab)
                    .map(specsplit_core::sampling::argmax)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(got, want, "{dtype:?}");
        assert_eq!(got.len(), 8);
    }
    // Matrices of different vocabularies, or none, are refused.
    let a = Tensor::zeros((1, 10), DType::F32, &dev).unwrap();
    let b = Tensor::zeros((1, 11), DType::F32, &dev).unwrap();
    assert!(fused::argmax_rows(&[&a, &b], L).is_err());
    assert!(fused::argmax_rows(&[], L).is_err());
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A bf16 model of `preset`'s shape with random weights (`seed`), cut to 3 layers, a vocabulary
/// of 8192 and 2048 positions.
fn small_model(preset: &str, seed: u64, dev: &Device) -> Transformer {
    let mut cfg = ModelConfig::preset(preset).unwrap();
    cfg.num_hidden_layers = 3;
    cfg.vocab_size = 8192;
    cfg.max_position_embeddings = 2048;
    Transformer::random(cfg, seed, DType::BF16, dev).unwrap()
}

/// [`small_model`] running the kernel paths `options` allows.
fn small_model_with(preset: &str, seed: u64, dev: &Device, options: KernelOptions) -> Transformer {
    let mut m = small_model(preset, seed, dev);
    m.set_kernel_options(options);
    m
}

/// How the kernel tests launch: the default.
const L: fused::Launch = fused::Launch::DEFAULT;

/// The ordinary forward of `tokens` at `start..` on `cache`: f32 logits of the last one.
fn forward_last(m: &Transformer, cache: &mut SessionCache, tokens: &[u32]) -> Vec<f32> {
    let dev = m.device();
    let u = |v: &[u32]| Tensor::new(v, dev).unwrap();
    let start = cache.len() as u32;
    let pos: Vec<u32> = (start..start + tokens.len() as u32).collect();
    let last = tokens.len() as u32 - 1;
    m.forward(&u(tokens), &u(&pos), None, cache, &u(&[last]))
        .unwrap()
        .i(0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn fused_static_step_decodes_like_the_forward_pass() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 11, &dev);
        let unfused = KernelOptions {
            fused: false,
            ..KernelOptions::default()
        };
        let r = small_model_with(preset, 11, &dev, unfused);
        let prompt: Vec<u32> = (0..300).map(|i| (i * 97 + 13) % 8192).collect();
        let (cap, steps) = (512, 24);

        // The stepper decodes greedily with the fused kernels on its own cache; a reference
        // cache follows the stepper's tokens with candle's ops (the same weights with the
        // fused kernels off), so every step is compared on the same sequence even after a
        // near-tie went the other way.
        let mut reference = r.new_cache(cap).unwrap();
        let mut row = forward_last(&r, &mut reference, &prompt);
        let mut cache = m.new_cache(cap).unwrap();
        forward_last(&r, &mut cache, &prompt);
        let mut stepper = DecodeStepper::new(&m, cap).unwrap();
        let mut token = argmax(&row);
        stepper.start(token, prompt.len()).unwrap();
        let mut same = 0;
        for j in 1..=steps {
            stepper.step(&m, &cache).unwrap();
            row = forward_last(&r, &mut reference, &[token]);
            let b = stepper.buffers();
            let got = b.next.to_vec1::<u32>().unwrap()[0];
            let lp = b.next_logprob.to_vec1::<f32>().unwrap()[0];
            let best = argmax(&row);
            let spread = row[best as usize] - row.iter().cloned().fold(f32::INFINITY, f32::min);
            // bf16 arithmetic in another order may break a near-tie the other way; anything
            // else is a wrong kernel.
            assert!(
                row[best as usize] - row[got as usize] <= 0.02 * spread,
                "{preset} step {j}: fused picked {got} ({}), forward {best} ({})",
                row[got as usize],
                row[best as usize]
            );
            let top = row[best as usize] as f64;
            let lse = top
                + row
                    .iter()
                    .map(|&v| (v as f64 - top).exp())
                    .sum::<f64>()
                    .ln();
            let want_lp = (row[got as usize] as f64 - lse) as f32;
            assert!(
                (lp - want_lp).abs() < 0.05 + 0.02 * want_lp.abs(),
                "{preset} step {j}: log-prob {lp} vs {want_lp}"
            );
            same += usize::from(got == best);
            // The step fed its token back and moved to the next slot.
            assert_eq!(b.token.to_vec1::<u32>().unwrap()[0], got);
            assert_eq!(
                b.position.to_vec1::<u32>().unwrap()[0] as usize,
                prompt.len() + j
            );
            token = got;
        }
        eprintln!(
            "{preset}: {same}/{steps} fused greedy picks equal to the forward pass's (graph: {})",
            stepper.uses_graph()
        );
        assert!(same * 4 >= steps * 3, "{preset}: only {same}/{steps} equal");
        assert!(
            stepper.uses_graph(),
            "{preset}: the fused step was not captured"
        );
    }
}

#[test]
fn exact_stepper_replays_the_one_token_forward_bit_for_bit_across_rollbacks() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 23, &dev);
        let cap = 512;
        assert!(m.exact_step_fits(cap), "{preset}: no exact step");
        assert!(
            !m.exact_step_fits(4096),
            "{preset}: rotary tables end at 2048"
        );
        let prompt: Vec<u32> = (0..300).map(|i| (i * 89 + 3) % 8192).collect();

        // The reference decodes one token a forward pass on its own cache; the stepper
        // follows the same tokens on another. Their logits must be the same bits.
        let mut reference = m.new_cache(cap).unwrap();
        let mut row = forward_last(&m, &mut reference, &prompt);
        let mut cache = m.new_cache(cap).unwrap();
        forward_last(&m, &mut cache, &prompt);
        let mut stepper = ExactStepper::new(&m, cap).unwrap();
        let mut step = |token: u32,
                        reference: &mut SessionCache,
                        cache: &mut SessionCache,
                        what: &str|
         -> Vec<f32> {
            let got: Vec<f32> = stepper
                .step(&m, token, cache)
                .unwrap()
                .i(0)
                .unwrap()
                .to_vec1()
                .unwrap();
            let want = forward_last(&m, reference, &[token]);
            assert!(got == want, "{preset} {what}: stepper logits differ");
            assert_eq!(cache.len(), reference.len());
            want
        };
        for j in 0..12 {
            row = step(
                argmax(&row),
                &mut reference,
                &mut cache,
                &format!("step {j}"),
            );
        }
        // A rejected draft: both caches drop their last five entries and go on from there
        // with another token.
        let back = reference.len() - 5;
        reference.truncate(back).unwrap();
        cache.truncate(back).unwrap();
        for j in 0..6 {
            let t = (argmax(&row) + 1 + j) % 8192;
            row = step(
                t,
                &mut reference,
                &mut cache,
                &format!("after truncate {j}"),
            );
        }
        // An accepted tree path: entries moved down next to the prefix.
        let base = reference.len() - 6;
        let kept = [base + 1, base + 3, base + 4];
        reference.compact(base, &kept).unwrap();
        cache.compact(base, &kept).unwrap();
        for j in 0..6 {
            row = step(
                argmax(&row),
                &mut reference,
                &mut cache,
                &format!("after compact {j}"),
            );
        }
        assert!(
            stepper.uses_graph(),
            "{preset}: the exact step was not captured"
        );
        // The buffers end at the capacity.
        let mut full = m.new_cache(cap).unwrap();
        forward_last(&m, &mut full, &vec![7u32; cap]);
        assert!(ExactStepper::new(&m, cap)
            .unwrap()
            .step(&m, 7, &mut full)
            .is_err());
        eprintln!("{preset}: 24 exact steps equal the one-token forward (graph: true)");
    }
}

/// The row-major f32 product `x[r] . w[c] (+ b[c])` for the listed rows, from bf16 inputs, with
/// the product rounded to bf16 before the bias like the kernels.
fn matmul_rows(x: &[f32], w: &[f32], b: Option<&[f32]>, k: usize, rows: &[usize]) -> Vec<f32> {
    let n = w.len() / k;
    let mut out = Vec::with_capacity(rows.len() * n);
    for &r in rows {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let dot: f64 = xr
                .iter()
                .zip(&w[c * k..(c + 1) * k])
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            out.push(match b {
                Some(b) => bf16_round(dot as f32) + b[c],
                None => dot as f32,
            });
        }
    }
    out
}

#[test]
fn bi_matmul_matches_an_f32_product_and_no_row_depends_on_the_batch() {
    let Some(dev) = gpu() else { return };
    for (n, k, bias) in [
        (16, 32, false),
        (37, 96, true),
        (1152, 896, true),
        (200, 4864, false),
        (4608, 3584, true),
        // Split two ways (2 column tiles a warp past one row tile), a partial last block; no
        // bias (its second rounding would exceed the tolerance at this many large outputs).
        (17000, 2048, false),
    ] {
        let m = 100;
        let x = randn(&dev, &[m, k], 1.0);
        let w = randn(&dev, &[n, k], 0.05);
        let b = bias.then(|| randn(&dev, &[n], 0.5));
        let full = fused::bi_matmul(&x, &w, b.as_ref(), L).unwrap();
        assert_eq!(full.dims(), [m, n]);
        let fh = host(&full);
        let (xs, ws) = (host(&x), host(&w));
        let bs = b.as_ref().map(host);
        let check_rows = [0usize, 1, 15, 16, 17, 63, 64, 99];
        let want = matmul_rows(&xs, &ws, bs.as_deref(), k, &check_rows);
        let got: Vec<f32> = check_rows
            .iter()
            .flat_map(|&r| fh[r * n..(r + 1) * n].to_vec())
            .collect();
        let scale = (k as f32).sqrt() * 0.05;
        assert_close(
            &format!("bi_matmul {n}x{k}"),
            &got,
            &want,
            scale,
            1.0 / 64.0,
        );
        // The leading m rows of the pass, and any row alone, give the same bits.
        for rows in [1usize, 2, 15, 16, 17, 33, 64, 65] {
            let part =
                host(&fused::bi_matmul(&x.narrow(0, 0, rows).unwrap(), &w, b.as_ref(), L).unwrap());
            assert_eq!(
                part[..],
                fh[..rows * n],
                "{n}x{k}: first {rows} rows differ"
            );
        }
        for r in [0usize, 5, 16, 47, 64, 99] {
            let alone =
                host(&fused::bi_matmul(&x.narrow(0, r, 1).unwrap(), &w, b.as_ref(), L).unwrap());
            assert_eq!(
                alone[..],
                fh[r * n..(r + 1) * n],
                "{n}x{k}: row {r} alone differs"
            );
        }
        // Every load depth and column tiling gives the same bits, alone or in the pass (one to
        // four row tiles).
        let tilings = [(1u8, 4usize), (2, 2), (1, 2), (2, 4)]
            .map(|(d, t)| (Some(d), Some(t), None))
            .into_iter()
            // The lean entries with the input loaded ahead and chunk by chunk, at every row tile
            // count (the built-in rule takes each for some).
            .chain([(None, None, Some(true)), (None, None, Some(false))]);
        for (depth, tiles, x_ahead) in tilings {
            let tuned = fused::Launch {
                bi_tuning: fused::BiTuning {
                    depth,
                    col_tiles: tiles,
                    splits: None,
                    x_ahead,
                },
                ..L
            };
            for rows in [1usize, 17, 33, 49, 100] {
                let part = host(
                    &fused::bi_matmul(&x.narrow(0, 0, rows).unwrap(), &w, b.as_ref(), tuned)
                        .unwrap(),
                );
                assert_eq!(
                    part[..],
                    fh[..rows * n],
                    "{n}x{k}: depth {depth:?}, {tiles:?} column tiles, x ahead {x_ahead:?}, first {rows} rows differ"
                );
            }
        }
    }
}

#[test]
fn bi_matmul_refuses_what_it_cannot_run() {
    let Some(dev) = gpu() else { return };
    let w = randn(&dev, &[64, 48], 1.0);
    let x = randn(&dev, &[3, 48], 1.0);
    // 48 is not a multiple of 32.
    assert!(!fused::bi_matmul_fits(&x, &w));
    let e = fused::bi_matmul(&x, &w, None, L).unwrap_err().to_string();
    assert!(e.contains("bi_matmul"), "{e}");
    let w = randn(&dev, &[64, 64], 1.0);
    assert!(!fused::bi_matmul_fits(&randn(&dev, &[3, 32], 1.0), &w));
}

/// Naive softmax attention of one query over the listed key/value rows (f32 host data).
fn naive_attention(q: &[f32], ks: &[&[f32]], vs: &[&[f32]], scale: f32) -> Vec<f32> {
    let s: Vec<f64> = ks
        .iter()
        .map(|k| q.iter().zip(*k).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale as f64)
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..q.len())
        .map(|d| (e.iter().zip(vs).map(|(w, v)| w * v[d] as f64).sum::<f64>() / z) as f32)
        .collect()
}

/// Asserts that row `r` of a rows pass's attention output `got` `(n, heads * head_dim)`
/// matches [`naive_attention`] of every head's query (`qs` `(heads, n, head_dim)`) over the
/// cached K/V values (host copies of `(1, kv, capacity, head_dim)` caches) at `slots`, within
/// bf16 rounding; `what` names the row in failures.
fn assert_row_matches_naive(
    what: &str,
    got: &[f32],
    (qs, n, r): (&[f32], usize, usize),
    (ks, vs): (&[f32], &[f32]),
    slots: &[usize],
    shape: AttnShape,
    scale: f32,
) {
    let (h, kv, cap, hd) = (shape.heads, shape.kv, shape.capacity, shape.head_dim);
    for head in 0..h {
        let j = head / (h / kv);
        let at_slot = |s: usize| (j * cap + s) * hd..(j * cap + s + 1) * hd;
        let kr: Vec<&[f32]> = slots.iter().map(|&s| &ks[at_slot(s)]).collect();
        let vr: Vec<&[f32]> = slots.iter().map(|&s| &vs[at_slot(s)]).collect();
        let qh = &qs[(head * n + r) * hd..(head * n + r + 1) * hd];
        let want = naive_attention(qh, &kr, &vr, scale);
        let at = (r * h + head) * hd;
        assert_close(
            &format!("{what} head {head}"),
            &got[at..at + hd],
            &want,
            max_abs(&want).max(0.05),
            1.0 / 64.0,
        );
    }
}

#[test]
fn rows_attention_matches_naive_attention_and_a_row_decoded_alone() {
    let Some(dev) = gpu() else { return };
    for hd in [64, 128] {
        let shape = test_attn_shape(hd);
        let (h, kv, cap) = (shape.heads, shape.kv, shape.capacity);
        let kc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let vc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let (ks, vs) = (host(&kc), host(&vc));
        let scale = 1.0 / (hd as f32).sqrt();
        // Rows: leading runs (one tile, across the 2048 tile boundary) and tree-like rows with
        // listed slots after their run; then the nodes of a tree after a shared 1000-token
        // prefix, which the staged kernel reads once per group of rows (the group holding the
        // 4090-token row stages only the chunks inside every lead).
        let extras: [Vec<u32>; 12] = [
            vec![],
            vec![2100, 2105],
            vec![3, 10, 4000],
            vec![],
            vec![4100, 4101, 4150],
            vec![1000],
            vec![1001],
            vec![1000, 1002],
            vec![1000, 1003],
            vec![1001, 1004],
            vec![1000, 1002, 1005],
            vec![1000, 1003, 1006],
        ];
        let leads = [
            300usize, 2049, 0, 1, 4090, 1000, 1000, 1000, 1000, 1000, 1000, 1000,
        ];
        let rows: Vec<(usize, &[u32])> = leads
            .iter()
            .zip(&extras)
            .map(|(l, e)| (*l, e.as_slice()))
            .collect();
        let n = rows.len();
        let keys = fused::PassKeys::new(&rows, &dev).unwrap();
        let q = randn(&dev, &[1, h, n, hd], 1.0);
        let qs = host(&q);
        let got = host(&fused::rows_attention(&q, &kc, &vc, &keys, shape, scale, L).unwrap());
        // However many query heads a block takes, every head gets the same bits, in the staged
        // kernel (the whole pass) and the one-row kernel (its first row).
        let q0 = q.narrow(2, 0, 1).unwrap().contiguous().unwrap();
        let keys0 = fused::PassKeys::new(&rows[..1], &dev).unwrap();
        let first = host(&fused::rows_attention(&q0, &kc, &vc, &keys0, shape, scale, L).unwrap());
        let caches = (&kc, &vc);
        let what = format!("hd {hd}, the pass");
        assert_every_heads_grouping(&q, caches, &keys, shape, scale, &got, &what);
        let what = format!("hd {hd}, one row");
        assert_every_heads_grouping(&q0, caches, &keys0, shape, scale, &first, &what);
        for (r, (lead, ex)) in rows.iter().enumerate() {
            let slots: Vec<usize> = (0..*lead).chain(ex.iter().map(|&e| e as usize)).collect();
            // The same keys laid out contiguously from slot 0, as when the row's token is
            // decoded after exactly these tokens: the row alone must give the same bits.
            let idx = Tensor::new(
                slots
                    .iter()
                    .map(|&s| s as u32)
                    .collect::<Vec<_>>()
                    .as_slice(),
                &dev,
            )
            .unwrap();
            let pad = cap - slots.len();
            let lay = |c: &Tensor| {
                let g = c.index_select(&idx, 2).unwrap();
                let z = Tensor::zeros((1, kv, pad, hd), DType::BF16, &dev).unwrap();
                Tensor::cat(&[&g, &z], 2).unwrap().contiguous().unwrap()
            };
            let (kc1, vc1) = (lay(&kc), lay(&vc));
            let q1 = q.narrow(2, r, 1).unwrap().contiguous().unwrap();
            let alone_keys = fused::PassKeys::new(&[(slots.len(), &[][..])], &dev).unwrap();
            let alone = host(
                &fused::rows_attention(&q1, &kc1, &vc1, &alone_keys, shape, scale, L).unwrap(),
            );
            assert_eq!(
                alone[..],
                got[r * h * hd..(r + 1) * h * hd],
                "hd {hd} row {r}: decoded alone differs from the batch"
            );
            let what = format!("rows attention hd {hd} row {r}");
            let pass = (qs.as_slice(), n, r);
            assert_row_matches_naive(&what, &got, pass, (&ks, &vs), &slots, shape, scale);
        }
    }
    // Rows that see nothing, or slots out of order, are refused.
    assert!(fused::PassKeys::new(&[(0, &[][..])], &dev).is_err());
    assert!(fused::PassKeys::new(&[(5, &[3u32][..])], &dev).is_err());
    assert!(fused::PassKeys::new(&[(0, &[7u32, 7][..])], &dev).is_err());
}

#[test]
fn draft_attention_matches_naive_attention_whatever_rows_share_its_pass() {
    use fused::{SessionTable, TableSession};
    let Some(dev) = gpu() else { return };
    for hd in [64, 128] {
        let shape = test_attn_shape(hd);
        let (h, kv, cap) = (shape.heads, shape.kv, shape.capacity);
        let kc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let vc = randn(&dev, &[1, kv, cap, hd], 1.0);
        let (ks, vs) = (host(&kc), host(&vc));
        let scale = 1.0 / (hd as f32).sqrt();
        // Leading runs of one key to past 4000 (16 warps a block), listed slots after them,
        // and the nodes of a tree after a shared 1000-token prefix.
        let extras: [Vec<u32>; 9] = [
            vec![],
            vec![2100, 2105],
            vec![3, 10, 4000],
            vec![],
            vec![4100, 4101, 4150],
            vec![1000],
            vec![1000, 1002],
            vec![1001, 1004],
            vec![],
        ];
        let leads = [300usize, 2049, 0, 1, 4090, 1000, 1000, 1000, 33];
        let rows: Vec<(usize, &[u32])> = leads
            .iter()
            .zip(&extras)
            .map(|(l, e)| (*l, e.as_slice()))
            .collect();
        let n = rows.len();
        let keys = fused::PassKeys::new(&rows, &dev).unwrap();
        let q = randn(&dev, &[1, h, n, hd], 1.0);
        let qs = host(&q);
        let got = host(&fused::draft_attention(&q, &kc, &vc, &keys, shape, scale, L).unwrap());
        for (r, (lead, ex)) in rows.iter().enumerate() {
            let slots: Vec<usize> = (0..*lead).chain(ex.iter().map(|&e| e as usize)).collect();
            let what = format!("draft attention hd {hd} row {r}");
            let pass = (qs.as_slice(), n, r);
            assert_row_matches_naive(&what, &got, pass, (&ks, &vs), &slots, shape, scale);
        }
        // A row beside only the longest row (the same span, so the same warps a block) gets
        // the bits it gets in the whole pass.
        let long = 4;
        for r in 0..n {
            let pair = [rows[r], rows[long]];
            let keys2 = fused::PassKeys::new(&pair, &dev).unwrap();
            let q2 = Tensor::cat(
                &[q.narrow(2, r, 1).unwrap(), q.narrow(2, long, 1).unwrap()],
                2,
            )
            .unwrap()
            .contiguous()
            .unwrap();
            let two =
                host(&fused::draft_attention(&q2, &kc, &vc, &keys2, shape, scale, L).unwrap());
            assert_eq!(
                two[..h * hd],
                got[r * h * hd..(r + 1) * h * hd],
                "hd {hd} row {r}: its bits depend on the rows beside it"
            );
        }
        // The same rows as three sessions of one cache each: the sessions' kernel reads each
        // row's keys through the table and gives every row the same bits.
        let layers = vec![(&kc, &vc)];
        let table_sessions: Vec<TableSession<'_>> = [0..3, 3..6, 6..9]
            .into_iter()
            .map(|span| TableSession {
                layers: layers.clone(),
                capacity: cap,
                past: 0,
                keys: rows[span].to_vec(),
            })
            .collect();
        let table = SessionTable::new(&table_sessions, kv, hd, &dev).unwrap();
        let stacked =
            host(&fused::draft_sessions_attention(&q, &table, 0, shape, scale, L).unwrap());
        assert_eq!(stacked, got, "hd {hd}: the sessions' kernel differs");
    }
}

/// Asserts that [`fused::rows_attention`] of `q` over the caches `kv` gives `want` however many
/// query heads a block takes (1, 2, 4 or 8); `what` names the case in failures.
fn assert_every_heads_grouping(
    q: &Tensor,
    (kc, vc): (&Tensor, &Tensor),
    keys: &fused::PassKeys,
    shape: AttnShape,
    scale: f32,
    want: &[f32],
    what: &str,
) {
    for hb in [1, 2, 4, 8] {
        let tuned = fused::Launch {
            rows_heads: Some(hb),
            ..L
        };
        let y = fused::rows_attention(q, kc, vc, keys, shape, scale, tuned).unwrap();
        assert_eq!(host(&y), want, "{what}: {hb} heads a block change the bits");
    }
}

#[test]
fn rows_attention_gives_every_head_its_bits_however_many_heads_a_block_takes() {
    let Some(dev) = gpu() else { return };
    // Seven query heads a KV head (Qwen2.5's 0.5B and 7B), so blocks of 2, 4 and 8 heads
    // leave a partial group.
    let shape = AttnShape {
        heads: 14,
        kv: 2,
        head_dim: 64,
        capacity: 700,
    };
    let (h, kv, cap, hd) = (shape.heads, shape.kv, shape.capacity, shape.head_dim);
    let kc = randn(&dev, &[1, kv, cap, hd], 1.0);
    let vc = randn(&dev, &[1, kv, cap, hd], 1.0);
    let scale = 1.0 / (hd as f32).sqrt();
    for n in [1usize, 6, 11] {
        let rows: Vec<(usize, &[u32])> = (0..n).map(|r| (300 + 35 * r, &[][..])).collect();
        let keys = fused::PassKeys::new(&rows, &dev).unwrap();
        let q = randn(&dev, &[1, h, n, hd], 1.0);
        let base = host(&fused::rows_attention(&q, &kc, &vc, &keys, shape, scale, L).unwrap());
        let what = format!("{n} rows");
        assert_every_heads_grouping(&q, (&kc, &vc), &keys, shape, scale, &base, &what);
    }
}

/// Logits rows as f32 on the host.
fn rows_of(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

#[test]
fn a_token_decoded_alone_and_verified_in_a_tree_get_identical_logits() {
    let Some(dev) = gpu() else { return };
    assert!(
        KernelOptions::default().batch_invariant,
        "batch invariance is on by default"
    );
    // With the fused kernels (the default scope: about 10 launches a layer) and without them
    // (candle's ops around the batch-invariant products and attention); both must be exact,
    // and they agree within bf16 rounding.
    let mut first_decoded: Vec<Vec<Vec<f32>>> = Vec::new();
    for (si, fused_on) in [true, false].into_iter().enumerate() {
        let options = KernelOptions {
            fused: fused_on,
            ..KernelOptions::default()
        };
        for (pi, preset) in ["qwen2.5-0.5b", "qwen2.5-7b"].into_iter().enumerate() {
            let m = small_model_with(preset, 5, &dev, options);
            let u = |v: &[u32]| Tensor::new(v, &dev).unwrap();
            // A prompt longer than the batch-invariant limit (prefilled with cuBLAS, the same way
            // in both runs) and five tokens after it.
            let prompt: Vec<u32> = (0..200).map(|i| (i * 31 + 7) % 8192).collect();
            let next = [11u32, 4000, 77, 8000, 5];
            let p = prompt.len();

            // Target alone: the prompt, then one token a pass.
            let mut alone = m.new_cache(256).unwrap();
            forward_last(&m, &mut alone, &prompt);
            let decoded: Vec<Vec<f32>> = next
                .iter()
                .map(|&t| forward_last(&m, &mut alone, &[t]))
                .collect();

            // Speculation: the prompt, then one pass over a tree holding the first four tokens as a
            // path with a sibling at each level (pass order t1 y1 t2 y2 t3 t4), then the path
            // kept and the fifth token decoded.
            let mut spec = m.new_cache(256).unwrap();
            forward_last(&m, &mut spec, &prompt);
            let tokens = [next[0], 900, next[1], 901, next[2], next[3]];
            let parent: [Option<usize>; 6] = [None, None, Some(0), Some(0), Some(2), Some(4)];
            let depth = |mut i: usize| {
                let mut d = 0;
                while let Some(q) = parent[i] {
                    i = q;
                    d += 1;
                }
                d
            };
            let total = p + tokens.len();
            let mut mask = vec![f32::NEG_INFINITY; tokens.len() * total];
            for i in 0..tokens.len() {
                mask[i * total..i * total + p].fill(0.0);
                let mut a = Some(i);
                while let Some(j) = a {
                    mask[i * total + p + j] = 0.0;
                    a = parent[j];
                }
            }
            let mask = Tensor::from_vec(mask, (tokens.len(), total), &dev).unwrap();
            let pos: Vec<u32> = (0..tokens.len()).map(|i| (p + depth(i)) as u32).collect();
            let all: Vec<u32> = (0..tokens.len() as u32).collect();
            let tree = rows_of(
                &m.forward(&u(&tokens), &u(&pos), Some(&mask), &mut spec, &u(&all))
                    .unwrap(),
            );
            for (t, row) in [0usize, 2, 4, 5].iter().enumerate() {
                assert!(
                tree[*row] == decoded[t],
                "{preset}: tree node {row} (token {t} of the path) differs from decoding it alone"
            );
            }
            spec.compact(p, &[p, p + 2, p + 4, p + 5]).unwrap();
            let after = forward_last(&m, &mut spec, &[next[4]]);
            assert!(
                after == decoded[4],
                "{preset}: the token after the kept path differs"
            );

            // A chain of four tokens in one causal pass, as a verified chain.
            let mut chain = m.new_cache(256).unwrap();
            forward_last(&m, &mut chain, &prompt);
            let cpos: Vec<u32> = (p as u32..p as u32 + 4).collect();
            let rows = rows_of(
                &m.forward(
                    &u(&next[..4]),
                    &u(&cpos),
                    None,
                    &mut chain,
                    &u(&[0, 1, 2, 3]),
                )
                .unwrap(),
            );
            for t in 0..4 {
                assert!(rows[t] == decoded[t], "{preset}: chain row {t} differs");
            }
            eprintln!(
                "{preset} (fused {fused_on}): tree, chain and compacted rows equal decoding alone"
            );
            if si == 0 {
                first_decoded.push(decoded);
            } else {
                for (t, (a, b)) in first_decoded[pi].iter().zip(&decoded).enumerate() {
                    assert_close(
                        &format!("{preset} token {t}: fused vs unfused rows"),
                        a,
                        b,
                        max_abs(b),
                        1.0 / 16.0,
                    );
                }
            }
        }
    }
}

/// The causal forward of `tokens` after `cache`'s sequence: every row's f32 logits.
fn forward_rows(m: &Transformer, cache: &mut SessionCache, tokens: &[u32]) -> Vec<Vec<f32>> {
    let dev = m.device();
    let u = |v: &[u32]| Tensor::new(v, dev).unwrap();
    let start = cache.len() as u32;
    let pos: Vec<u32> = (start..start + tokens.len() as u32).collect();
    let all: Vec<u32> = (0..tokens.len() as u32).collect();
    rows_of(
        &m.forward(&u(tokens), &u(&pos), None, cache, &u(&all))
            .unwrap(),
    )
}

#[test]
fn exact_chains_replay_the_rows_forward_bit_for_bit_across_rollbacks() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 29, &dev);
        let cap = 1024;
        assert!(m.exact_rows_fit(cap, 5), "{preset}: no exact rows pass");
        assert!(!m.exact_rows_fit(cap, fused::BI_MAX_ROWS + 1));
        // The chains cross slot 256, where the stepper's passes go from launching their
        // attention over 256 keys to 512 (of the 1024 slots).
        let prompt: Vec<u32> = (0..246).map(|i| (i * 71 + 5) % 8192).collect();

        // The reference runs each chain as one causal forward on its own cache (the eager
        // verify of a chain); the stepper replays a graph per chain length on another. Every
        // row's logits must be the same bits, round after round, across rollbacks.
        let mut reference = m.new_cache(cap).unwrap();
        let mut cache = m.new_cache(cap).unwrap();
        forward_last(&m, &mut reference, &prompt);
        forward_last(&m, &mut cache, &prompt);
        let mut stepper = ExactStepper::new(&m, cap).unwrap();
        let mut seed = 17u32;
        let lengths = [4usize, 4, 2, 4, 4, 3, 4, 1, 4, 2, 4, 4];
        for (round, &n) in lengths.iter().enumerate() {
            let chain: Vec<u32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (seed >> 8) % 8192
                })
                .collect();
            assert!(stepper.chain_fits(&m, n));
            let got = rows_of(&stepper.step_chain(&m, &chain, &mut cache).unwrap());
            let want = forward_rows(&m, &mut reference, &chain);
            assert!(
                got == want,
                "{preset} round {round}: a {n}-token chain's logits differ from the forward's"
            );
            assert_eq!(cache.len(), reference.len());
            // Keep a random part of the chain, as a verify does.
            let keep = (seed as usize >> 3) % (n + 1);
            let back = reference.len() - n + keep;
            reference.truncate(back).unwrap();
            cache.truncate(back).unwrap();
        }
        let graphs = stepper.chain_graphs();
        assert!(
            graphs.contains(&4),
            "{preset}: the 4-row chain was not captured ({graphs:?})"
        );
        // The buffers end at the capacity.
        let mut full = m.new_cache(cap).unwrap();
        forward_last(&m, &mut full, &vec![7u32; cap - 2]);
        assert!(stepper.step_chain(&m, &[1, 2, 3], &mut full).is_err());
        assert_eq!(
            full.len(),
            cap - 2,
            "a refused chain leaves the cache alone"
        );
        eprintln!(
            "{preset}: {} chains equal the rows forward (graphs for {graphs:?})",
            lengths.len()
        );
    }
}

#[test]
fn a_decode_stepper_feeds_several_tokens_in_one_pass_like_one_step_each() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 31, &dev);
        let cap = 512;
        let prompt: Vec<u32> = (0..250).map(|i| (i * 53 + 9) % 8192).collect();
        // The stepper feeds 1-3 tokens in one pass, then takes two greedy steps of its own; the
        // reference follows the same tokens with the ordinary forward.
        let mut reference = m.new_cache(cap).unwrap();
        let mut cache = m.new_cache(cap).unwrap();
        let mut row = forward_last(&m, &mut reference, &prompt);
        forward_last(&m, &mut cache, &prompt);
        let mut stepper = DecodeStepper::new(&m, cap).unwrap();
        let (mut same, mut picks) = (0, 0);
        let mut check = |row: &[f32], stepper: &DecodeStepper, what: &str| -> u32 {
            let b = stepper.buffers();
            let got = b.next.to_vec1::<u32>().unwrap()[0];
            let best = argmax(row);
            let spread = row[best as usize] - row.iter().cloned().fold(f32::INFINITY, f32::min);
            assert!(
                row[best as usize] - row[got as usize] <= 0.02 * spread,
                "{preset} {what}: picked {got} ({}), forward {best} ({})",
                row[got as usize],
                row[best as usize]
            );
            assert_eq!(
                b.token.to_vec1::<u32>().unwrap()[0],
                got,
                "{what}: token fed back"
            );
            picks += 1;
            same += usize::from(got == best);
            got
        };
        let mut passes = 0;
        for (round, n) in [2usize, 3, 1, 2, 2, 3, 2].into_iter().enumerate() {
            let feed: Vec<u32> = (0..n as u32)
                .map(|i| (row.len() as u32 / 3 + 101 * (round as u32 + i)) % 8192)
                .collect();
            let at = cache.len();
            passes += stepper.feed(&m, &cache, &feed, at).unwrap();
            cache.advance(n).unwrap();
            row = forward_rows(&m, &mut reference, &feed).pop().unwrap();
            let mut token = check(&row, &stepper, &format!("round {round} feed of {n}"));
            assert_eq!(
                stepper.buffers().position.to_vec1::<u32>().unwrap()[0] as usize,
                at + n,
                "{preset} round {round}: the position after the feed"
            );
            for j in 0..2 {
                stepper.step(&m, &cache).unwrap();
                cache.advance(1).unwrap();
                row = forward_last(&m, &mut reference, &[token]);
                token = check(&row, &stepper, &format!("round {round} step {j}"));
            }
            // Drop the last step's token, as a rejected draft.
            cache.truncate(cache.len() - 1).unwrap();
            reference.truncate(reference.len() - 1).unwrap();
        }
        eprintln!(
            "{preset}: {same}/{picks} greedy picks equal the forward's, {passes} feed passes"
        );
        assert!(same * 4 >= picks * 3, "{preset}: only {same}/{picks} equal");
        assert_eq!(passes, 7, "{preset}: every feed took one pass");
    }
}

#[test]
fn a_feed_of_a_few_tokens_is_bit_identical_to_one_step_each() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 7, &dev);
        let cap = 300;
        let prompt: Vec<u32> = (0..130).map(|i| (i * 71 + 5) % 8192).collect();
        let (mut one_pass, mut stepped) = (m.new_cache(cap).unwrap(), m.new_cache(cap).unwrap());
        forward_last(&m, &mut one_pass, &prompt);
        forward_last(&m, &mut stepped, &prompt);
        let (mut a, mut b) = (
            DecodeStepper::new(&m, cap).unwrap(),
            DecodeStepper::new(&m, cap).unwrap(),
        );
        // Rounds of 2 to 4 tokens (graphs captured from the second round of a length on).
        for (round, n) in [2usize, 4, 3, 2, 4, 3, 2].into_iter().enumerate() {
            let feed: Vec<u32> = (0..n as u32)
                .map(|i| (round as u32 * 977 + i * 31) % 8192)
                .collect();
            let at = one_pass.len();
            assert_eq!(
                a.feed(&m, &one_pass, &feed, at).unwrap(),
                1,
                "{preset}: one pass"
            );
            one_pass.advance(n).unwrap();
            for (i, &t) in feed.iter().enumerate() {
                b.feed(&m, &stepped, &[t], at + i).unwrap();
                stepped.advance(1).unwrap();
            }
            let bits = |s: &DecodeStepper| {
                let x = s.buffers();
                (
                    x.next.to_vec1::<u32>().unwrap()[0],
                    x.next_logprob.to_vec1::<f32>().unwrap()[0].to_bits(),
                    x.position.to_vec1::<u32>().unwrap()[0],
                )
            };
            assert_eq!(
                bits(&a),
                bits(&b),
                "{preset} round {round}: pick, log-probability, position"
            );
            for layer in 0..3 {
                let (ka, va) = one_pass.buffers(layer).unwrap();
                let (kb, vb) = stepped.buffers(layer).unwrap();
                assert_eq!(
                    host(ka),
                    host(kb),
                    "{preset} round {round} layer {layer}: K"
                );
                assert_eq!(
                    host(va),
                    host(vb),
                    "{preset} round {round} layer {layer}: V"
                );
            }
        }
        eprintln!("{preset}: feeds of 2-4 tokens in one pass equal one step each, bit for bit");
    }
}

/// Every round's chain logits, the draft's (pick, log-probability bits) a round, and a
/// description of the graphs.
type Rounds = (Vec<Vec<Vec<f32>>>, Vec<(u32, u32)>, String);

#[test]
fn programmatic_launch_and_graph_scratch_change_no_bit() {
    let Some(dev) = gpu() else { return };
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let cap = 512;
        let prompt: Vec<u32> = (0..280).map(|i| (i * 61 + 7) % 8192).collect();
        let lengths = [1usize, 4, 4, 2, 1, 4, 3, 4, 1, 1];
        // The same rounds twice, kernels launched normally then with programmatic dependent
        // launch, each on its own cache and steppers: target chains (exact rows graphs) and
        // the draft's greedy steps must give the same bits.
        let run = |pdl: bool| -> Rounds {
            let options = KernelOptions {
                pdl,
                ..KernelOptions::default()
            };
            let m = small_model_with(preset, 37, &dev, options);
            let mut cache = m.new_cache(cap).unwrap();
            forward_last(&m, &mut cache, &prompt);
            let mut draft_cache = m.new_cache(cap).unwrap();
            forward_last(&m, &mut draft_cache, &prompt);
            let mut stepper = ExactStepper::new(&m, cap).unwrap();
            let mut drafter = DecodeStepper::new(&m, cap).unwrap();
            drafter.start(5, prompt.len()).unwrap();
            let (mut logits, mut picks) = (Vec::new(), Vec::new());
            let mut seed = 3u32;
            for &n in &lengths {
                let chain: Vec<u32> = (0..n)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                        (seed >> 8) % 8192
                    })
                    .collect();
                logits.push(rows_of(
                    &stepper.step_chain(&m, &chain, &mut cache).unwrap(),
                ));
                cache.truncate(cache.len() - n / 2).unwrap();
                drafter.step(&m, &draft_cache).unwrap();
                draft_cache.advance(1).unwrap();
                let b = drafter.buffers();
                picks.push((
                    b.next.to_vec1::<u32>().unwrap()[0],
                    b.next_logprob.to_vec1::<f32>().unwrap()[0].to_bits(),
                ));
            }
            assert!(stepper.chain_graphs().contains(&4) && drafter.uses_graph());
            let (chain, step) = (
                stepper.graph_nodes(4).unwrap(),
                drafter.graph_nodes().unwrap(),
            );
            // Only candle's own ops (embedding, casts) allocate inside the graphs.
            for g in [chain, step] {
                assert!(g.kernels > 20 && g.memory * 8 < g.kernels, "{preset}: {g}");
            }
            let nodes = format!("chain-4 graph: {chain}; step graph: {step}");
            (logits, picks, nodes)
        };
        let (plain, plain_picks, _) = run(false);
        let (pdl, pdl_picks, nodes) = run(true);
        assert!(
            plain == pdl,
            "{preset}: chain logits differ with programmatic launch"
        );
        assert_eq!(plain_picks, pdl_picks, "{preset}: draft picks differ");
        eprintln!(
            "{preset}: {} rounds identical with programmatic launch {} ({nodes})",
            lengths.len(),
            if fused::PDL_AVAILABLE {
                "on"
            } else {
                "unavailable"
            }
        );
    }
}

/// Every layer's K and V cache entries of slots `0..n`, as f32.
fn cache_entries(m: &Transformer, cache: &SessionCache, n: usize) -> Vec<Vec<f32>> {
    (0..m.config().num_hidden_layers)
        .flat_map(|layer| {
            let (k, v) = cache.buffers(layer).unwrap();
            [k, v].map(|t| host(&t.narrow(2, 0, n).unwrap()))
        })
        .collect()
}

#[test]
fn a_wide_pass_computes_what_the_batched_pass_computes() {
    let Some(dev) = gpu() else { return };
    assert!(
        KernelOptions::default().wide_rows,
        "wide passes are on by default"
    );
    for preset in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        let m = small_model(preset, 37, &dev);
        let narrow = KernelOptions {
            wide_rows: false,
            ..KernelOptions::default()
        };
        let flat = small_model_with(preset, 37, &dev, narrow);
        let cap = 512;
        // A prompt of more rows than the batch-invariant passes take: one wide pass, against
        // candle's batched ops (wide passes off) over the same rows; then 30 tokens after a
        // cached prefix, so that rows see cached slots as well as their own.
        let prompt: Vec<u32> = (0..200).map(|i| (i * 53 + 11) % 8192).collect();
        let (head, tail) = prompt.split_at(130);
        let mut wide = m.new_cache(cap).unwrap();
        let mut batched = m.new_cache(cap).unwrap();
        let got = forward_rows(&m, &mut wide, head);
        let want = forward_rows(&flat, &mut batched, head);
        let scale = want.iter().map(|r| max_abs(r)).fold(0f32, f32::max);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{preset} row {r}"), g, w, scale, 1.0 / 16.0);
        }
        // Row picks agree where the batched pass's best is clear of its runner-up.
        let clear = want
            .iter()
            .zip(&got)
            .filter(|(w, _)| {
                let mut s = (*w).clone();
                s.sort_by(|a, b| b.total_cmp(a));
                s[0] - s[1] > scale / 16.0
            })
            .collect::<Vec<_>>();
        assert!(
            clear.iter().all(|(w, g)| argmax(w) == argmax(g)),
            "{preset}: a clear pick differs"
        );
        for (e, (g, w)) in cache_entries(&m, &wide, head.len())
            .iter()
            .zip(&cache_entries(&m, &batched, head.len()))
            .enumerate()
        {
            assert_close(&format!("{preset} cache {e}"), g, w, max_abs(w), 1.0 / 32.0);
        }
        // 70 more rows after the 130 cached ones: a wide pass over a cached prefix.
        let (mut wide2, mut batched2) = (m.new_cache(cap).unwrap(), m.new_cache(cap).unwrap());
        forward_last(&m, &mut wide2, head);
        forward_last(&flat, &mut batched2, head);
        let got = forward_rows(&m, &mut wide2, tail);
        let want = forward_rows(&flat, &mut batched2, tail);
        assert_eq!(wide2.len(), prompt.len());
        let scale = want.iter().map(|r| max_abs(r)).fold(0f32, f32::max);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{preset} tail row {r}"), g, w, scale, 1.0 / 16.0);
        }
        // A draft's prefill of the whole prompt (a wide pass, then the rest) fills the cache as
        // one pass per token range would: the same entries as the batched passes, within bf16.
        let mut pre = m.new_cache(cap).unwrap();
        m.prefill(&prompt, &mut pre).unwrap();
        assert_eq!(pre.len(), prompt.len());
        for (e, (g, w)) in cache_entries(&m, &pre, prompt.len())
            .iter()
            .zip(&cache_entries(&m, &batched2, prompt.len()))
            .enumerate()
        {
            assert_close(
                &format!("{preset} prefill cache {e}"),
                g,
                w,
                max_abs(w),
                1.0 / 32.0,
            );
        }
        eprintln!(
            "{preset}: wide passes equal the batched ones within bf16 ({} clear picks equal)",
            clear.len()
        );
    }
}

#[test]
fn grown_chains_replay_each_chain_decoded_alone_up_to_rounding() {
    let Some(dev) = gpu() else { return };
    let m = small_model("qwen2.5-0.5b", 29, &dev);
    let cap = 512;
    let prompt: Vec<u32> = (0..120).map(|i| (i * 37 + 11) % 8192).collect();
    let mut cache = m.new_cache(cap).unwrap();
    forward_last(&m, &mut cache, &prompt);
    let mut stepper = DecodeStepper::new(&m, cap).unwrap();
    // Three roots: after 118, 120 and 120 of the cached tokens; chains of 4 from slot 120.
    let (roots, leads, depth) = ([5u32, 6, 7], [118usize, 120, 120], 4);
    // Each chain decoded alone, one token a forward pass on a cache of its own run.
    // A growth pass runs some products through cuBLAS: its picks are the chain's where the
    // pick alone is clear (a margin of 0.05 over the runner-up), and a chain is compared up to
    // its first near-tie.
    let mut want_tokens = vec![vec![0u32; roots.len()]; depth];
    let mut want_lps = vec![vec![0f32; roots.len()]; depth];
    let mut clear = vec![depth; roots.len()];
    for (b, (&root, &lead)) in roots.iter().zip(&leads).enumerate() {
        let mut alone = m.new_cache(cap).unwrap();
        forward_last(&m, &mut alone, &prompt[..lead]);
        let mut token = root;
        for l in 0..depth {
            let row = forward_last(&m, &mut alone, &[token]);
            token = argmax(&row);
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] < 0.05 {
                clear[b] = clear[b].min(l);
            }
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
            want_tokens[l][b] = token;
            want_lps[l][b] = (row[token as usize] as f64 - lse) as f32;
        }
    }
    assert!(
        clear.iter().any(|&c| c >= 2),
        "every chain meets a near-tie early: {clear:?}"
    );
    // Eager, captured, replayed; then again with the middle chain's second token forced.
    for run in 0..4 {
        let forced: Vec<Option<u32>> = if run == 3 {
            (0..depth * roots.len())
                .map(|i| (i == roots.len() + 1).then_some(4321))
                .collect()
        } else {
            Vec::new()
        };
        let (out, logits) = stepper
            .grow_chains(&m, &cache, &roots, &leads, prompt.len(), depth, &forced)
            .unwrap();
        let got: Vec<Vec<f32>> = out.to_vec2().unwrap();
        let logits = logits.to_dtype(DType::F32).unwrap();
        for l in 0..depth {
            for b in 0..roots.len() {
                let tok = got[l][b] as u32;
                if run == 3 && l == 1 && b == 1 {
                    assert_eq!(tok, 4321, "the forced token replaces the greedy one");
                    continue;
                }
                // Each level's logits stay: the greedy token is their best.
                let row: Vec<f32> = logits.i((l, b)).unwrap().to_vec1().unwrap();
                assert_eq!(
                    tok,
                    argmax(&row),
                    "run {run}: logits of chain {b}, level {l}"
                );
                if (run == 3 && b == 1 && l > 1) || l > clear[b] {
                    continue; // that chain went on from the forced token or a near-tie
                }
                let lp = got[depth + l][b];
                if l == clear[b] {
                    continue;
                }
                assert_eq!(tok, want_tokens[l][b], "run {run}: chain {b}, level {l}");
                assert!(
                    (lp - want_lps[l][b]).abs() < 3e-2,
                    "run {run}: chain {b}, level {l}: log-prob {lp} vs {}",
                    want_lps[l][b]
                );
            }
        }
        // The cache's length is left alone.
        assert_eq!(cache.len(), prompt.len());
    }
}

#[test]
fn session_chains_grow_each_sessions_chain_as_alone_up_to_rounding() {
    let Some(dev) = gpu() else { return };
    let m = small_model("qwen2.5-0.5b", 31, &dev);
    let depth = 4;
    // Three sessions: caches of different capacities, one or two tokens to feed.
    let shapes = [(100usize, 1usize, 256usize), (150, 2, 512), (60, 1, 384)];
    let prompts: Vec<Vec<u32>> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(len, _, _))| {
            (0..len as u32)
                .map(|t| (t * 41 + 13 * i as u32 + 3) % 8192)
                .collect()
        })
        .collect();
    // Each chain decoded alone, one token a forward pass, with its first near-tie (a margin
    // under 0.05: the shared pass's products round differently).
    let mut want = Vec::new();
    let mut clear = Vec::new();
    for (p, &(len, _, cap)) in prompts.iter().zip(&shapes) {
        let mut alone = m.new_cache(cap).unwrap();
        let mut row = forward_last(&m, &mut alone, &p[..len]);
        let (mut chain, mut tie) = (Vec::new(), depth);
        for l in 0..depth {
            let token = argmax(&row);
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] < 0.05 {
                tie = tie.min(l);
            }
            let mx = sorted[0] as f64;
            let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
            chain.push((token, (row[token as usize] as f64 - lse) as f32));
            row = forward_last(&m, &mut alone, &[token]);
        }
        want.push(chain);
        clear.push(tie);
    }
    assert!(
        clear.iter().any(|&c| c >= 2),
        "every chain meets a near-tie early: {clear:?}"
    );
    let mut caches: Vec<SessionCache> = shapes
        .iter()
        .zip(&prompts)
        .map(|(&(len, feed, cap), p)| {
            let mut c = m.new_cache(cap).unwrap();
            forward_last(&m, &mut c, &p[..len - feed]);
            c
        })
        .collect();
    let mut stepper = SessionChainsStepper::new();
    // Eager, captured, replayed; then the sessions in another order (the same graph over
    // other caches); then with session 1's second token forced; then the two sessions that
    // feed one token each (a pad row before each), eager, captured and replayed.
    let setups_before = m.graph_setups();
    for run in 0..8 {
        let order: Vec<usize> = match run {
            3 => vec![2, 0, 1],
            5.. => vec![0, 2],
            _ => vec![0, 1, 2],
        };
        let forced: Vec<Option<u32>> = (0..depth).map(|l| (l == 1).then_some(4321)).collect();
        let chains: Vec<SessionChain<'_>> = order
            .iter()
            .map(|&i| SessionChain {
                cache: &caches[i],
                feed: &prompts[i][shapes[i].0 - shapes[i].1..],
                forced: if run == 4 && i == 1 { &forced } else { &[] },
            })
            .collect();
        let out = stepper.grow(&m, &chains, depth, 512).unwrap();
        let got: Vec<Vec<f32>> = out.to_vec2().unwrap();
        for (col, &i) in order.iter().enumerate() {
            for l in 0..depth {
                let tok = got[l][col] as u32;
                if run == 4 && i == 1 && l >= 1 {
                    if l == 1 {
                        assert_eq!(tok, 4321, "the forced token replaces the greedy one");
                    }
                    continue; // the chain went on from the forced token
                }
                if l >= clear[i] {
                    continue; // a near-tie may break either way
                }
                assert_eq!(tok, want[i][l].0, "run {run}: session {i}, level {l}");
                let lp = got[depth + l][col];
                assert!(
                    (lp - want[i][l].1).abs() < 3e-2,
                    "run {run}: session {i}, level {l}: log-prob {lp} vs {}",
                    want[i][l].1
                );
            }
        }
        // A new shape runs eagerly (runs 0 and 5, each counted as a graph setup of the
        // model), is captured the next time (runs 1 and 6, counted too) and replayed after.
        let setups = m.graph_setups() - setups_before;
        assert_eq!(setups, [1, 2, 2, 2, 2, 3, 4, 4][run], "run {run}");
        if run == 7 {
            assert!(stepper.uses_graph(2, depth, 512), "run 7 replays a graph");
        }
        if (2..5).contains(&run) {
            assert!(
                stepper.uses_graph(3, depth, 512),
                "run {run} replays a graph"
            );
            // Three chains grow in the shape of four (one pad chain).
            assert!(stepper.uses_graph(4, depth, 512), "run {run}");
        }
        drop(chains);
        // One shape a session count: feeds of one token take the same shape as feeds of two.
        assert_eq!(
            stepper.shapes_made(),
            if run < 5 { 1 } else { 2 },
            "run {run}"
        );
        // The caches' lengths are left alone.
        for (c, &(len, feed, _)) in caches.iter_mut().zip(&shapes) {
            assert_eq!(c.len(), len - feed);
        }
    }
    // A cache too small for its chain is refused before anything runs.
    let small = m.new_cache(100).unwrap();
    let chains = [
        SessionChain {
            cache: &caches[0],
            feed: &[1],
            forced: &[],
        },
        SessionChain {
            cache: &small,
            feed: &[1],
            forced: &[],
        },
    ];
    let mut full = m.new_cache(100).unwrap();
    forward_last(&m, &mut full, &prompts[0][..97]);
    let chains2 = [
        SessionChain {
            cache: &caches[0],
            feed: &[1],
            forced: &[],
        },
        SessionChain {
            cache: &full,
            feed: &[1],
            forced: &[],
        },
    ];
    assert!(stepper.grow(&m, &chains, depth, 512).is_ok());
    let e = stepper.grow(&m, &chains2, depth, 512).unwrap_err();
    assert!(e.to_string().contains("session chain 1"), "{e}");
}

/// One session of [`sessions_pass_matches_each_session_alone_bit_for_bit`]: a prompt in its
/// cache (of `slack` free slots past its tree, so that sessions have caches of different
/// capacities), a tree whose first `cached` nodes are in the cache too, and the rows it wants
/// of the nodes after them.
struct GpuSession {
    slack: usize,
    prompt: Vec<u32>,
    parents: Vec<Option<usize>>,
    nodes: Vec<u32>,
    cached: usize,
    rows: Vec<u32>,
}

impl GpuSession {
    fn new(seed: u32, prompt: usize, parents: Vec<Option<usize>>, cached: usize) -> Self {
        let token = |i: usize| (i as u32 * 97 + seed * 31 + 7) % 8192;
        let n = parents.len() - cached;
        Self {
            slack: 8 + (seed as usize * 37) % 61,
            prompt: (0..prompt).map(token).collect(),
            nodes: (prompt..prompt + parents.len()).map(token).collect(),
            rows: (0..n as u32).rev().filter(|r| r % 2 == 0).collect(),
            parents,
            cached,
        }
    }

    fn mask(&self) -> specsplit_core::mask::TreeMask {
        specsplit_core::mask::TreeMask::from_parents(&self.parents).unwrap()
    }

    fn tree<'a>(
        &self,
        mask: &'a specsplit_core::mask::TreeMask,
        first_row: usize,
    ) -> specsplit_models::cpu_attention::TreeRows<'a> {
        specsplit_models::cpu_attention::TreeRows {
            mask,
            prefix: self.prompt.len(),
            first_row,
        }
    }

    /// The new tokens and their positions.
    fn inputs(&self) -> (Vec<u32>, Vec<u32>) {
        let positions = self.mask().positions(self.prompt.len());
        (
            self.nodes[self.cached..].to_vec(),
            positions[self.cached..].to_vec(),
        )
    }

    /// A cache (of a capacity of its own) holding the prompt and the first `cached` nodes.
    fn cache(&self, m: &Transformer) -> SessionCache {
        let u = |v: &[u32]| Tensor::new(v, m.device()).unwrap();
        let mut cache = m
            .new_cache(self.prompt.len() + self.parents.len() + self.slack)
            .unwrap();
        m.prefill(&self.prompt, &mut cache).unwrap();
        if self.cached > 0 {
            let mask = self.mask();
            let positions = mask.positions(self.prompt.len());
            m.forward_tree(
                &u(&self.nodes[..self.cached]),
                &u(&positions[..self.cached]),
                self.tree(&mask, 0),
                &mut cache,
                &u(&[0]),
            )
            .unwrap();
        }
        cache
    }
}

/// A cache's valid K/V entries, buffer by buffer, as bits.
type CacheBits = Vec<Vec<u32>>;

/// Every valid K/V entry of `cache`, as bits.
fn cache_bits(cache: &SessionCache, layers: usize) -> CacheBits {
    (0..layers)
        .flat_map(|l| {
            let (k, v) = cache.layer(l);
            [k, v]
        })
        .map(|t| host(&t).iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn sessions_pass_matches_each_session_alone_bit_for_bit() {
    use specsplit_models::transformer::{ForwardPath, Pass};
    use specsplit_models::SessionPass;
    let Some(dev) = gpu() else { return };
    let unfused = KernelOptions {
        fused: false,
        ..KernelOptions::default()
    };
    let chain = |n: usize| (0..n).map(|i| i.checked_sub(1)).collect::<Vec<_>>();
    let binary = |n: usize| (0..n).map(|i| i.checked_sub(1).map(|p| p / 2)).collect();
    // One shared pass (19 rows); groups of a pass past BI_MAX_ROWS (81 rows); a session too
    // long for the batch-invariant pass (70 rows) beside a short one.
    let sets = [
        vec![
            GpuSession::new(1, 40, chain(5), 0),
            GpuSession::new(2, 17, binary(9), 0),
            GpuSession::new(3, 30, binary(7), 3),
            GpuSession::new(4, 50, chain(1), 0),
        ],
        vec![
            GpuSession::new(5, 20, chain(30), 0),
            GpuSession::new(6, 33, binary(30), 0),
            GpuSession::new(7, 10, chain(20), 0),
            GpuSession::new(8, 5, chain(1), 0),
        ],
        vec![
            GpuSession::new(9, 10, chain(70), 0),
            GpuSession::new(10, 12, binary(3), 0),
        ],
    ];
    for (name, m) in [
        ("fused", small_model("qwen2.5-0.5b", 31, &dev)),
        (
            "unfused",
            small_model_with("qwen2.5-0.5b", 31, &dev, unfused),
        ),
    ] {
        let want = if name == "fused" {
            ForwardPath::FusedExact
        } else {
            ForwardPath::ExactUnfused
        };
        assert_eq!(m.plan(Pass::Forward { rows: 19 }), want, "{name}");
        let layers = m.config().num_hidden_layers;
        let u = |v: &[u32]| Tensor::new(v, &dev).unwrap();
        for (k, set) in sets.iter().enumerate() {
            let alone: Vec<(Vec<Vec<f32>>, CacheBits)> = set
                .iter()
                .map(|s| {
                    let mut cache = s.cache(&m);
                    let mask = s.mask();
                    let (tokens, positions) = s.inputs();
                    let logits = m
                        .forward_tree(
                            &u(&tokens),
                            &u(&positions),
                            s.tree(&mask, s.cached),
                            &mut cache,
                            &u(&s.rows),
                        )
                        .unwrap();
                    (logits.to_vec2().unwrap(), cache_bits(&cache, layers))
                })
                .collect();
            for reversed in [false, true] {
                let mut order: Vec<usize> = (0..set.len()).collect();
                if reversed {
                    order.reverse();
                }
                let masks: Vec<_> = order.iter().map(|&i| set[i].mask()).collect();
                let inputs: Vec<_> = order.iter().map(|&i| set[i].inputs()).collect();
                let mut caches: Vec<_> = order.iter().map(|&i| set[i].cache(&m)).collect();
                let mut parts: Vec<SessionPass<'_>> = order
                    .iter()
                    .zip(&masks)
                    .zip(&inputs)
                    .zip(caches.iter_mut())
                    .map(|(((&i, mask), (tokens, positions)), cache)| SessionPass {
                        tokens,
                        positions,
                        tree: set[i].tree(mask, set[i].cached),
                        cache,
                        rows: &set[i].rows,
                    })
                    .collect();
                let out = m.forward_sessions(&mut parts).unwrap();
                drop(parts);
                for (j, &i) in order.iter().enumerate() {
                    let what = format!("{name}: set {k}, session {i} of {order:?}");
                    let got: Vec<Vec<f32>> = out[j].to_vec2().unwrap();
                    assert_eq!(got, alone[i].0, "{what}: logits");
                    assert_eq!(cache_bits(&caches[j], layers), alone[i].1, "{what}: K/V");
                }
            }
        }
    }
}

#[test]
fn session_rows_replay_each_sessions_chain_as_alone_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    let m = small_model("qwen2.5-0.5b", 31, &dev);
    let layers = m.config().num_hidden_layers;
    let u = |v: &[u32]| Tensor::new(v, &dev).unwrap();
    let chain = |n: usize| (0..n).map(|i| i.checked_sub(1)).collect::<Vec<_>>();
    // Caches of different lengths and capacities; one shape of five rows a session, and one of
    // a row a session (plain decoding steps).
    let mut stepper = SessionRowsStepper::new();
    for rows in [5usize, 1] {
        let set: Vec<GpuSession> = [(1, 40), (2, 17), (3, 230)]
            .iter()
            .map(|&(seed, prompt)| GpuSession::new(seed, prompt, chain(rows), 0))
            .collect();
        let every: Vec<u32> = (0..rows as u32).collect();
        let alone: Vec<(Vec<Vec<f32>>, CacheBits)> = set
            .iter()
            .map(|s| {
                let mut cache = s.cache(&m);
                let mask = s.mask();
                let (tokens, positions) = s.inputs();
                let logits = m
                    .forward_tree(
                        &u(&tokens),
                        &u(&positions),
                        s.tree(&mask, 0),
                        &mut cache,
                        &u(&every),
                    )
                    .unwrap();
                (logits.to_vec2().unwrap(), cache_bits(&cache, layers))
            })
            .collect();
        // Fresh caches every pass (new addresses), in three orders: the first pass runs
        // eagerly, the second is captured, the third replays the graph.
        for (k, order) in [[0usize, 1, 2], [2, 1, 0], [1, 2, 0]].iter().enumerate() {
            let mut caches: Vec<SessionCache> = order.iter().map(|&i| set[i].cache(&m)).collect();
            let capacity = caches.iter().map(|c| c.capacity()).max().unwrap();
            let inputs: Vec<_> = order.iter().map(|&i| set[i].inputs().0).collect();
            let parts: Vec<SessionChainRows<'_>> = caches
                .iter()
                .zip(&inputs)
                .map(|(cache, tokens)| SessionChainRows { cache, tokens })
                .collect();
            let logits = stepper.pass(&m, &parts, capacity).unwrap();
            drop(parts);
            assert_eq!(stepper.uses_graph(3, rows, capacity), k >= 1, "pass {k}");
            let got: Vec<Vec<f32>> = logits.to_vec2().unwrap();
            for (j, &i) in order.iter().enumerate() {
                let what = format!("{rows} rows, pass {k}, session {i} of {order:?}");
                assert_eq!(
                    got[j * rows..(j + 1) * rows],
                    alone[i].0[..],
                    "{what}: logits"
                );
                caches[j].advance(rows).unwrap();
                assert_eq!(cache_bits(&caches[j], layers), alone[i].1, "{what}: K/V");
            }
        }
    }
    assert_eq!(stepper.shapes_made(), 2);
    // A part of the wrong length is refused.
    let cache = GpuSession::new(4, 20, chain(5), 0).cache(&m);
    let parts = [
        SessionChainRows {
            cache: &cache,
            tokens: &[1, 2, 3],
        },
        SessionChainRows {
            cache: &cache,
            tokens: &[1, 2],
        },
    ];
    let e = stepper.pass(&m, &parts, cache.capacity()).unwrap_err();
    assert!(e.to_string().contains("session rows 1"), "{e}");
}

#[test]
fn sessions_kernels_match_each_session_alone_bit_for_bit() {
    use fused::{PassKeys, RowSlots, SessionTable, TableSession};
    let Some(dev) = gpu() else { return };
    let (heads, kv, layers) = (14usize, 2usize, 2usize);
    // Per session: capacity, cached entries, and per new row its leading run and listed slots
    // (row i writes slot past + i): a tree, a one-row decode in a long cache, a chain that
    // ends at its capacity and a tree whose rows list slots apart from their lead.
    type Rows = Vec<(usize, Vec<u32>)>;
    let sessions: Vec<(usize, usize, Rows)> = vec![
        (37, 20, vec![(21, vec![]), (22, vec![]), (20, vec![22])]),
        (200, 130, vec![(131, vec![])]),
        (68, 64, (0..4).map(|i| (65 + i, vec![])).collect()),
        (
            150,
            70,
            vec![
                (71, vec![]),
                (70, vec![72]),
                (71, vec![73]),
                (70, vec![72, 74]),
                (3, vec![40, 71, 75]),
            ],
        ),
    ];
    let n: usize = sessions.iter().map(|s| s.2.len()).sum();
    let positions: Vec<u32> = (0..n as u32).map(|i| (i * 29 + 5) % 300).collect();
    for hd in [64usize, 128] {
        let shape = |capacity| AttnShape {
            heads,
            kv,
            head_dim: hd,
            capacity,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let cos = randn(&dev, &[300, hd / 2], 1.0);
        let sin = randn(&dev, &[300, hd / 2], 1.0);
        let qkv: Vec<Tensor> = (0..layers)
            .map(|_| randn(&dev, &[n, (heads + 2 * kv) * hd], 1.0))
            .collect();
        // Every slot holds a value before the pass, so that every listed key reads one.
        let caches: Vec<Vec<(Tensor, Tensor)>> = sessions
            .iter()
            .map(|(cap, _, _)| {
                (0..layers)
                    .map(|_| {
                        (
                            randn(&dev, &[1, kv, *cap, hd], 1.0),
                            randn(&dev, &[1, kv, *cap, hd], 1.0),
                        )
                    })
                    .collect()
            })
            .collect();
        let copies = |c: &Vec<Vec<(Tensor, Tensor)>>| -> Vec<Vec<(Tensor, Tensor)>> {
            c.iter()
                .map(|s| {
                    s.iter()
                        .map(|(k, v)| (k.copy().unwrap(), v.copy().unwrap()))
                        .collect()
                })
                .collect()
        };
        let (alone, joint) = (copies(&caches), copies(&caches));
        // Each session alone, layer by layer.
        let mut want: Vec<Vec<Vec<u16>>> = vec![Vec::new(); layers];
        let mut at = 0;
        for ((cap, past, rows), c) in sessions.iter().zip(&alone) {
            let m = rows.len();
            let split: Vec<(usize, &[u32])> = rows.iter().map(|(l, e)| (*l, &e[..])).collect();
            let keys = PassKeys::new(&split, &dev).unwrap();
            let pos = Tensor::new(&positions[at..at + m], &dev).unwrap();
            for (l, (k, v)) in c.iter().enumerate() {
                let q = fused::qkv_rope_rows(
                    &qkv[l].narrow(0, at, m).unwrap(),
                    &cos,
                    &sin,
                    &pos,
                    k,
                    v,
                    RowSlots::After(*past),
                    shape(*cap),
                    false,
                    fused::Launch::DEFAULT,
                )
                .unwrap();
                let y = fused::rows_attention(
                    &q,
                    k,
                    v,
                    &keys,
                    shape(*cap),
                    scale,
                    fused::Launch::DEFAULT,
                )
                .unwrap();
                want[l].extend(bits16(&y));
            }
            at += m;
        }
        // All sessions together, one launch of each kernel a layer.
        let table_sessions: Vec<TableSession<'_>> = sessions
            .iter()
            .zip(&joint)
            .map(|((cap, past, rows), c)| TableSession {
                layers: c.iter().map(|(k, v)| (k, v)).collect(),
                capacity: *cap,
                past: *past,
                keys: rows.iter().map(|(l, e)| (*l, &e[..])).collect(),
            })
            .collect();
        let table = SessionTable::new(&table_sessions, kv, hd, &dev).unwrap();
        assert_eq!(table.rows(), n);
        let pos = Tensor::new(positions.as_slice(), &dev).unwrap();
        for (l, qkv) in qkv.iter().enumerate() {
            let q = fused::qkv_rope_sessions(
                qkv,
                &cos,
                &sin,
                &pos,
                &table,
                l,
                shape(0),
                false,
                fused::Launch::DEFAULT,
            )
            .unwrap();
            let y =
                fused::sessions_attention(&q, &table, l, shape(0), scale, fused::Launch::DEFAULT)
                    .unwrap();
            assert_eq!(bits16(&y), want[l], "hd {hd} layer {l}: attention rows");
        }
        for (s, (a, j)) in alone.iter().zip(&joint).enumerate() {
            for (l, ((ka, va), (kj, vj))) in a.iter().zip(j).enumerate() {
                assert_eq!(
                    bits16_all(ka),
                    bits16_all(kj),
                    "hd {hd} session {s} layer {l}: K"
                );
                assert_eq!(
                    bits16_all(va),
                    bits16_all(vj),
                    "hd {hd} session {s} layer {l}: V"
                );
            }
        }
    }
}

/// The rows of a 2-D bf16 tensor, as bits.
fn bits16(t: &Tensor) -> Vec<Vec<u16>> {
    t.to_dtype(DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|x| half::bf16::from_f32(x).to_bits())
                .collect()
        })
        .collect()
}

/// Every value of a bf16 tensor, as bits.
fn bits16_all(t: &Tensor) -> Vec<u16> {
    host(t)
        .into_iter()
        .map(|x| half::bf16::from_f32(x).to_bits())
        .collect()
}

#[test]
fn moved_cache_entries_read_every_source_before_writing() {
    let Some(dev) = gpu() else { return };
    let (kv, cap, hd) = (2, 16, 64);
    let bufs: Vec<Tensor> = (0..6)
        .map(|_| randn(&dev, &[1, kv, cap, hd], 1.0))
        .collect();
    let before: Vec<Vec<f32>> = bufs.iter().map(host).collect();
    // Slot 9 is a destination and a source; so is 3.
    let moves = [(3, 9), (9, 10), (15, 3), (4, 0)];
    let refs: Vec<&Tensor> = bufs.iter().collect();
    fused::move_entries(&refs, &moves, KernelOptions::default().launch()).unwrap();
    for (b, t) in bufs.iter().enumerate() {
        let got = host(t);
        for (e, &value) in got.iter().enumerate() {
            let (head, slot, x) = (e / (cap * hd), (e / hd) % cap, e % hd);
            let from = moves.iter().find(|m| m.1 == slot).map_or(slot, |m| m.0);
            assert_eq!(
                value,
                before[b][(head * cap + from) * hd + x],
                "buffer {b} {e}"
            );
        }
    }
}
