#!/usr/bin/env python3
"""Reference numbers from PyTorch + transformers for the specsplit-bench measurements.

Random-weight Qwen2.5 models built from config dicts (no weights are downloaded), bf16, eager
attention by default, on CUDA:

- device copy bandwidth (a large device-to-device copy, bytes read + written);
- ``generate`` tok/s for ``--new-tokens`` greedy tokens after a ``--context``-token prompt, and a
  hand-written decode loop over a DynamicCache (no generate() overhead);
- one forward of 1/8/64 new tokens (causal) over a ``--context``-token cache, all rows' logits,
  cache cropped back after each pass (as specsplit-bench ``forward`` times a chain);
- the memory roofline: parameter bytes / copy bandwidth.

Prints one JSON document (also written to ``--out`` when given). Usage:

    python3 scripts/bench/hf_reference.py --models qwen2.5-7b,qwen2.5-0.5b
    python3 scripts/bench/hf_reference.py --quick --models qwen2.5-0.5b
"""

import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

CONFIGS = {
    "qwen2.5-7b": dict(
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # For smoke tests only.
    "tiny": dict(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=512,
        rope_theta=1e4,
        tie_word_embeddings=False,
    ),
}

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def summary(ms):
    s = sorted(ms)

    def pct(q):
        pos = q * (len(s) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {
        "median": statistics.median(s),
        "p10": pct(0.1),
        "p90": pct(0.9),
        "mean": sum(s) / len(s),
    }


def timed(dev, iters, warmup, fn):
    for _ in range(warmup):
        fn()
    sync(dev)
    ms = []
    for _ in range(max(iters, 1)):
        t = time.perf_counter()
        fn()
        sync(dev)
        ms.append((time.perf_counter() - t) * 1e3)
    return summary(ms)


def copy_bandwidth(dev, mib, iters):
    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    s = timed(dev, max(iters, 3), 2, lambda: dst.copy_(src))
    return {
        "bytes": n,
        "copy_ms": s,
        "gb_s": 2 * n / (s["median"] / 1e3) / 1e9,
        "method": "dst.copy_(src) of a uint8 buffer, median; bytes read + written",
    }


def build(name, dtype, dev, attn):
    kw = dict(CONFIGS[name])
    kw.update(
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        use_cache=True,
        attn_implementation=attn,
    )
    cfg = Qwen2Config(**kw)
    try:
        cfg._attn_implementation = attn
    except Exception:  # noqa: BLE001 - older/newer config classes differ here
        pass
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=dev, dtype=dtype).eval()
    gc = model.generation_config
    gc.pad_token_id = 0
    gc.eos_token_id = None
    gc.bos_token_id = None
    return model


def prefill(model, ids):
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.past_key_values


@torch.inference_mode()
def bench_model(name, args, dev, dtype, bw):
    t0 = time.perf_counter()
    model = build(name, dtype, dev, args.attn)
    sync(dev)
    load_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    # A decode step streams every weight but the (untied) embedding table, which is gathered.
    streamed = pbytes - (0 if tied else emb.numel() * emb.element_size())
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * args.context
        * torch.finfo(dtype).bits // 8
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), generator=gen).to(dev)
    res = {
        "model": name,
        "config": CONFIGS[name],
        "params": params,
        "param_bytes": pbytes,
        "decode_streamed_bytes": streamed,
        "tied_embeddings": tied,
        "build_s": load_s,
        "context": args.context,
    }

    # generate(): new_tokens greedy tokens after the prompt (includes the prefill).
    def run_generate(n):
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
        )

    run_generate(8)
    g = timed(dev, args.gen_iters, 0, lambda: run_generate(args.new_tokens))
    res["generate"] = {
        "new_tokens": args.new_tokens,
        "ms": g,
        "tok_s": args.new_tokens / (g["median"] / 1e3),
        "note": "wall time of model.generate incl. the prompt prefill",
    }

    # Prefill once, then time the pieces.
    p = timed(dev, 3, 1, lambda: prefill(model, ids))
    res["prefill_ms"] = p

    def decode_loop():
        cache = prefill(model, ids)
        tok = ids[:, -1:]
        for i in range(args.new_tokens):
            pos = torch.tensor([args.context + i], device=dev)
            out = model(
                input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True
            )
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)

    d = timed(dev, args.gen_iters, 1, decode_loop)
    decode_ms = max(d["median"] - p["median"], 1e-9)
    res["decode_loop"] = {
        "new_tokens": args.new_tokens,
        "ms_incl_prefill": d,
        "tok_s_excl_prefill": args.new_tokens / (decode_ms / 1e3),
        "note": "prefill + a python loop of 1-token forwards with argmax; prefill median subtracted",
    }

    # One forward of n new tokens over the cached prefix, then crop back.
    cache = prefill(model, ids)
    fw = []
    for n in args.forward_tokens:
        new = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
        pos = torch.arange(args.context, args.context + n, device=dev)

        def one():
            model(input_ids=new, past_key_values=cache, cache_position=pos, use_cache=True)
            cache.crop(args.context)

        s = timed(dev, args.iters, args.warmup, one)
        fw.append({"tokens": n, "ms": s, "tok_s": n / (s["median"] / 1e3)})
    res["forward"] = fw
    one_tok = next((f for f in fw if f["tokens"] == 1), None)
    roof = bw["gb_s"] * 1e9 / (streamed + kv_bytes)
    res["roofline"] = {
        "kv_bytes_at_context": kv_bytes,
        "roofline_tok_s": roof,
        "roofline_weights_only_tok_s": bw["gb_s"] * 1e9 / streamed,
        "forward1_tok_s": one_tok["tok_s"] if one_tok else None,
        "forward1_roofline_pct": 100 * one_tok["tok_s"] / roof if one_tok else None,
        "decode_loop_roofline_pct": 100 * res["decode_loop"]["tok_s_excl_prefill"] / roof,
    }
    del model, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--attn", default="eager", help="attention implementation (eager, sdpa)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--forward-tokens", default="1,8,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--gen-iters", type=int, default=3)
    ap.add_argument("--bw-mib", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="fewer iterations, 32 new tokens")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    args.forward_tokens = [int(x) for x in args.forward_tokens.split(",") if x]
    if args.quick:
        args.iters, args.warmup, args.gen_iters = 5, 2, 1
        args.new_tokens = min(args.new_tokens, 32)
        args.bw_mib = min(args.bw_mib, 256)
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    bw = copy_bandwidth(dev, args.bw_mib, args.iters)
    print(f"copy bandwidth: {bw['gb_s']:.1f} GB/s", file=sys.stderr)
    doc = {
        "meta": {
            "kind": "hf_reference",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": args.dtype,
            "attn": args.attn,
            "random_weights": True,
        },
        "bandwidth": bw,
        "models": [],
    }
    for name in [m for m in args.models.split(",") if m]:
        if name not in CONFIGS:
            sys.exit(f"unknown model {name}; known: {', '.join(CONFIGS)}")
        print(f"{name} ...", file=sys.stderr)
        r = bench_model(name, args, dev, dtype, bw)
        print(
            f"  generate {r['generate']['tok_s']:.1f} tok/s, decode loop "
            f"{r['decode_loop']['tok_s_excl_prefill']:.1f} tok/s, roofline "
            f"{r['roofline']['roofline_tok_s']:.1f} tok/s; forward "
            + ", ".join(f"{f['tokens']}: {f['ms']['median']:.2f} ms" for f in r["forward"]),
            file=sys.stderr,
        )
        doc["models"].append(r)
    text = json.dumps(doc, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
