// Attention over the cache (the shared `attend` walk) and the one-token step's split attention.
#pragma once
#include "common.cuh"

#define ATT_THREADS 256
#define ATT_TILE 2048

// The cache slots one row of a pass attends to, in order: slots 0..lead, then `len - lead`
// listed slots (a tree node's ancestors among the pass's own tokens).
struct ListedKeys {
    int lead;
    int len;
    const uint32_t* extra;
    __device__ __forceinline__ int operator()(int t) const {
        return t < lead ? t : (int)extra[t - lead];
    }
};

// Attention of one query head `q` (HD values) over the slots `keys` of one KV head's caches
// kh / vh (slot-major, HD values a slot), unnormalised: `partial` gets the exp-weighted V sum
// (HD floats), then the running maximum and exp-sum (one span of decode_attention_split). One
// block of ATT_THREADS; the keys are walked in tiles of ATT_TILE scores kept in shared memory,
// merged with a running max. Every reduction is ordered by a key's index in `keys` alone, so
// the result depends only on the query and the sequence of visible keys.
template <int HD, typename Keys>
__device__ void attend(const bf16* __restrict__ q, const bf16* __restrict__ kh,
                       const bf16* __restrict__ vh, Keys keys, float scale,
                       float* __restrict__ partial) {
    constexpr int WARPS = ATT_THREADS / WARP;
    constexpr int PER = HD / WARP;  // values of a V row per lane
    __shared__ float qs[HD];
    __shared__ float score[ATT_TILE];
    __shared__ int slot[ATT_TILE];
    __shared__ float acc_part[WARPS][HD];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int len = keys.len;
    for (int d = threadIdx.x; d < HD; d += ATT_THREADS) qs[d] = __bfloat162float(q[d]);
    __syncthreads();
    float run_max = -INFINITY, run_sum = 0.f;
    float acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = 0.f;
    for (int start = 0; start < len; start += ATT_TILE) {
        const int n = min(ATT_TILE, len - start);
        // Scores: one thread per key, the whole K row read as 16-byte words.
        float local_max = -INFINITY;
        for (int t = threadIdx.x; t < n; t += ATT_THREADS) {
            const int sl = keys(start + t);
            slot[t] = sl;
            const uint4* kr = reinterpret_cast<const uint4*>(kh + (size_t)sl * HD);
            uint4 words[HD / 8];
#pragma unroll
            for (int c = 0; c < HD / 8; ++c) words[c] = kr[c];
            float s = 0.f;
#pragma unroll
            for (int c = 0; c < HD / 8; ++c) {
                const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&words[c]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(k2[e]);
                    s = fmaf(qs[8 * c + 2 * e], f.x, s);
                    s = fmaf(qs[8 * c + 2 * e + 1], f.y, s);
                }
            }
            s *= scale;
            score[t] = s;
            local_max = fmaxf(local_max, s);
        }
        const float tile_max = block_max(local_max);
        const float new_max = fmaxf(run_max, tile_max);
        const float corr = __expf(run_max - new_max);
        float local_sum = 0.f;
        for (int t = threadIdx.x; t < n; t += ATT_THREADS) {
            const float p = __expf(score[t] - new_max);
            score[t] = p;
            local_sum += p;
        }
        run_sum = run_sum * corr + block_sum(local_sum);
        run_max = new_max;
        // V: warp w takes keys w, w + WARPS, ...; lane owns values lane * PER .. + PER.
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[e] *= corr;
#pragma unroll 4
        for (int t = warp; t < n; t += WARPS) {
            const float p = score[t];
            const bf16* vr = vh + (size_t)slot[t] * HD + lane * PER;
#pragma unroll
            for (int e = 0; e < PER; e += 2) {
                const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vr + e));
                acc[e] = fmaf(p, f.x, acc[e]);
                acc[e + 1] = fmaf(p, f.y, acc[e + 1]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < PER; ++e) acc_part[warp][lane * PER + e] = acc[e];
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += ATT_THREADS) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += acc_part[w][d];
        partial[d] = s;
    }
    if (threadIdx.x == 0) {
        partial[HD] = run_max;
        partial[HD + 1] = run_sum;
    }
}

// The cache slots lo, lo + 1, ..., lo + len - 1 (one split of a decoded token's keys).
struct SpanKeys {
    int lo;
    int len;
    __device__ __forceinline__ int operator()(int t) const { return lo + t; }
};

// Attention of consecutive query tokens, row r over cache slots 0..=*pos + r, in two kernels:
// q (rows, heads * hd), caches (kv, cap, hd), query head h reads KV head h / (heads / kv). A
// row's slots are cut into `splits` spans of ceil(len / splits); block (h, s, r) of the first
// kernel (ATT_THREADS threads) writes span s's exp-weighted V sum, maximum and exp-sum for
// head h of row r to part (rows, heads, splits, hd + 2); the second merges a head's spans in
// order. More blocks than heads keep a short decode step from waiting on a few SMs.
template <int HD>
__device__ void decode_attention_split(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                       const bf16* __restrict__ vc,
                                       const uint32_t* __restrict__ pos,
                                       float* __restrict__ part, int heads, int kv, int cap,
                                       int splits, float scale) {
    const int h = blockIdx.x, s = blockIdx.y, r = blockIdx.z;
    const int j = h / (heads / kv);
    const int len = min((int)*pos + 1 + r, cap);
    q += (size_t)r * heads * HD;
    part += (size_t)r * heads * splits * (HD + 2);
    const int per = (len + splits - 1) / splits;
    const int lo = min(len, s * per);
    const SpanKeys keys{lo, min(len, lo + per) - lo};
    attend<HD>(q + (size_t)h * HD, kc + (size_t)j * cap * HD, vc + (size_t)j * cap * HD, keys,
               scale, part + ((size_t)h * splits + s) * (HD + 2));
}

extern "C" __global__ void specsplit_decode_attention_split_bf16_hd64(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ pos, float* __restrict__ part, int heads, int kv, int cap,
    int splits, float scale) {
    pdl_enter();
    decode_attention_split<64>(q, kc, vc, pos, part, heads, kv, cap, splits, scale);
}

extern "C" __global__ void specsplit_decode_attention_split_bf16_hd128(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ pos, float* __restrict__ part, int heads, int kv, int cap,
    int splits, float scale) {
    pdl_enter();
    decode_attention_split<128>(q, kc, vc, pos, part, heads, kv, cap, splits, scale);
}

// Merges head h's `splits` spans (part as written above) in span order into out[h * hd + d],
// h over every row's heads. Grid rows * heads, hd threads. Empty spans (maximum -inf) add
// nothing.
extern "C" __global__ void specsplit_decode_attention_merge_bf16(const float* __restrict__ part,
                                                                 bf16* __restrict__ out,
                                                                 int splits, int hd) {
    pdl_enter();
    const int h = blockIdx.x, d = threadIdx.x;
    const float* p = part + (size_t)h * splits * (hd + 2);
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, p[(size_t)s * (hd + 2) + hd]);
    float l = 0.f, acc = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float* ps = p + (size_t)s * (hd + 2);
        const float ms = ps[hd];
        if (ms == -INFINITY) continue;
        const float c = __expf(ms - m);
        l = fmaf(ps[hd + 1], c, l);
        acc = fmaf(ps[d], c, acc);
    }
    out[(size_t)h * hd + d] = __float2bfloat16(acc / l);
}
