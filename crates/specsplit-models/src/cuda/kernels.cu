// Fused bf16 kernels for one-token decoding (specsplit-models, feature `cuda`).
//
// build.rs compiles this file to PTX with nvcc; src/fused.rs loads and launches it. Every kernel
// accumulates in f32 and rounds to bf16 where the unfused candle ops round, so a fused step
// stays within bf16 rounding of the unfused one (tests/fused_kernels.rs checks that on a GPU).
// Nothing here synchronises with the host: positions are read from device memory, so a step
// built from these kernels can be captured into a CUDA graph and replayed.

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Largest (v, i) over the warp, the lowest i among equal v; every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

struct SumOp {
    static __device__ __forceinline__ float identity() { return 0.f; }
    static __device__ __forceinline__ float warp(float v) { return warp_sum(v); }
};

struct MaxOp {
    static __device__ __forceinline__ float identity() { return -INFINITY; }
    static __device__ __forceinline__ float warp(float v) { return warp_max(v); }
};

// Reduction over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. Called by every thread of the block.
template <typename Op>
__device__ float block_reduce(float v) {
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = Op::warp(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x / WARP) ? part[lane] : Op::identity();
        s = Op::warp(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<SumOp>(v); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<MaxOp>(v); }

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Dot product of 8 bf16 pairs packed in two 16-byte words, in f32.
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fa = __bfloat1622float2(a2[i]);
        const float2 fb = __bfloat1622float2(b2[i]);
        s = fmaf(fa.x, fb.x, s);
        s = fmaf(fa.y, fb.y, s);
    }
    return s;
}

// Streaming 16-byte load of weights (read once per step: do not keep them in L1).
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// y[r] = W[r, :] . x (+ bias[r]) for r < n: a matrix-vector product for one-token steps.
// W is (n, k) row-major, k % 8 == 0, rows 16-byte aligned; x has k entries. One warp per row,
// four independent 16-byte loads in flight per lane.
extern "C" __global__ void specsplit_gemv_bf16(const bf16* __restrict__ w,
                                               const bf16* __restrict__ x,
                                               const bf16* __restrict__ bias,
                                               bf16* __restrict__ y, int n, int k) {
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= n) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    const int k8 = k / 8;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int i = lane;
    for (; i + 3 * WARP < k8; i += 4 * WARP) {
        const uint4 w0 = load_stream(wr + i), w1 = load_stream(wr + i + WARP);
        const uint4 w2 = load_stream(wr + i + 2 * WARP), w3 = load_stream(wr + i + 3 * WARP);
        a0 += dot8(w0, __ldg(xr + i));
        a1 += dot8(w1, __ldg(xr + i + WARP));
        a2 += dot8(w2, __ldg(xr + i + 2 * WARP));
        a3 += dot8(w3, __ldg(xr + i + 3 * WARP));
    }
    for (; i < k8; i += WARP) a0 += dot8(load_stream(wr + i), __ldg(xr + i));
    float acc = warp_sum((a0 + a1) + (a2 + a3));
    if (lane == 0) {
        // The unfused path rounds the product to bf16 before adding the bias.
        if (bias != nullptr) acc = round_bf16(acc) + __bfloat162float(bias[row]);
        y[row] = __float2bfloat16(acc);
    }
}

// For each of `rows` rows of width d (one block per row): s = x + delta (rounded to bf16; s = x
// when delta is null), out[0][row] = s, out[1][row] = s / sqrt(mean(s^2) + eps) * w.
// out is (2, rows, d).
extern "C" __global__ void specsplit_add_rmsnorm_bf16(const bf16* __restrict__ x,
                                                      const bf16* __restrict__ delta,
                                                      const bf16* __restrict__ w,
                                                      bf16* __restrict__ out, int rows, int d,
                                                      float eps) {
    const int row = blockIdx.x;
    const bf16* xr = x + (size_t)row * d;
    bf16* sum_out = out + (size_t)row * d;
    bf16* norm_out = out + ((size_t)rows + row) * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = __bfloat162float(xr[i]);
        if (delta != nullptr) v = round_bf16(v + __bfloat162float(delta[(size_t)row * d + i]));
        sum_out[i] = __float2bfloat16(v);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = __bfloat162float(sum_out[i]);
        norm_out[i] = __float2bfloat16(v * inv * __bfloat162float(w[i]));
    }
}

// One token's fused Q|K|V row (heads + 2 * kv heads of hd values) → rotary on Q and K at the
// position *pos, Q written to q_out (heads * hd), K and V written into the caches
// (kv, cap, hd) at slot *pos. cos / sin are (positions, hd / 2) tables. `interleaved` selects
// the (2i, 2i + 1) pair layout instead of (i, i + hd / 2). One block per head, hd / 2 threads.
extern "C" __global__ void specsplit_qkv_rope_cache_bf16(
    const bf16* __restrict__ qkv, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
    const uint32_t* __restrict__ pos, bf16* __restrict__ kc, bf16* __restrict__ vc,
    bf16* __restrict__ q_out, int heads, int kv, int hd, int cap, int interleaved) {
    const int h = blockIdx.x;
    const int half = hd / 2;
    const int i = threadIdx.x;
    if (i >= half) return;
    const uint32_t p = *pos;
    if (p >= (uint32_t)cap) return;  // the host keeps positions below capacity; never write past it
    const bf16* src = qkv + (size_t)h * hd;
    if (h >= heads + kv) {
        bf16* dst = vc + ((size_t)(h - heads - kv) * cap + p) * hd;
        dst[i] = src[i];
        dst[i + half] = src[i + half];
        return;
    }
    const float c = __bfloat162float(cos_t[(size_t)p * half + i]);
    const float s = __bfloat162float(sin_t[(size_t)p * half + i]);
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = __bfloat162float(src[a]);
    const float x2 = __bfloat162float(src[b]);
    bf16* dst = h < heads ? q_out + (size_t)h * hd : kc + ((size_t)(h - heads) * cap + p) * hd;
    dst[a] = __float2bfloat16(x1 * c - x2 * s);
    dst[b] = __float2bfloat16(x1 * s + x2 * c);
}

#define ATT_THREADS 256
#define ATT_TILE 2048

// Attention of one query token over cache slots 0..=*pos: q (heads * hd), caches (kv, cap, hd),
// query head h reads KV head h / (heads / kv). One block of ATT_THREADS per head; the context
// is walked in tiles of ATT_TILE scores kept in shared memory, merged with a running max.
template <int HD>
__device__ void decode_attention(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                 const bf16* __restrict__ vc, const uint32_t* __restrict__ pos,
                                 bf16* __restrict__ out, int heads, int kv, int cap, float scale) {
    constexpr int WARPS = ATT_THREADS / WARP;
    constexpr int PER = HD / WARP;  // values of a V row per lane
    __shared__ float qs[HD];
    __shared__ float score[ATT_TILE];
    __shared__ float acc_part[WARPS][HD];
    const int h = blockIdx.x;
    const int j = h / (heads / kv);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int len = min((int)*pos + 1, cap);
    const bf16* kh = kc + (size_t)j * cap * HD;
    const bf16* vh = vc + (size_t)j * cap * HD;
    for (int d = threadIdx.x; d < HD; d += ATT_THREADS) qs[d] = __bfloat162float(q[(size_t)h * HD + d]);
    __syncthreads();
    float run_max = -INFINITY, run_sum = 0.f;
    float acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = 0.f;
    for (int start = 0; start < len; start += ATT_TILE) {
        const int n = min(ATT_TILE, len - start);
        // Scores: one thread per slot, the whole K row read as 16-byte words.
        float local_max = -INFINITY;
        for (int t = threadIdx.x; t < n; t += ATT_THREADS) {
            const uint4* kr = reinterpret_cast<const uint4*>(kh + (size_t)(start + t) * HD);
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
        // V: warp w takes slots w, w + WARPS, ...; lane owns values lane * PER .. + PER.
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[e] *= corr;
#pragma unroll 4
        for (int t = warp; t < n; t += WARPS) {
            const float p = score[t];
            const bf16* vr = vh + (size_t)(start + t) * HD + lane * PER;
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
    const float inv = 1.f / run_sum;
    for (int d = threadIdx.x; d < HD; d += ATT_THREADS) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += acc_part[w][d];
        out[(size_t)h * HD + d] = __float2bfloat16(s * inv);
    }
}

extern "C" __global__ void specsplit_decode_attention_bf16_hd64(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ pos, bf16* __restrict__ out, int heads, int kv, int cap,
    float scale) {
    decode_attention<64>(q, kc, vc, pos, out, heads, kv, cap, scale);
}

extern "C" __global__ void specsplit_decode_attention_bf16_hd128(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ pos, bf16* __restrict__ out, int heads, int kv, int cap,
    float scale) {
    decode_attention<128>(q, kc, vc, pos, out, heads, kv, cap, scale);
}

// SwiGLU gate: gu is (rows, 2 * n) = [gate | up]; out (rows, n) = silu(gate) * up, rounded to
// bf16 after the silu and after the product like the unfused ops.
extern "C" __global__ void specsplit_silu_mul_bf16(const bf16* __restrict__ gu,
                                                   bf16* __restrict__ out, int rows, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * n) return;
    const size_t r = i / n, c = i % n;
    const float g = __bfloat162float(gu[r * 2 * n + c]);
    const float u = __bfloat162float(gu[r * 2 * n + n + c]);
    const float s = round_bf16(g / (1.f + __expf(-g)));
    out[i] = __float2bfloat16(s * u);
}

// Greedy head of one token: next = argmax(logits) (the lowest index among equal maxima),
// logprob = logits[next] - logsumexp(logits); then token = next and *pos += 1, so the next
// replay of a captured step decodes the following token. One block.
extern "C" __global__ void specsplit_greedy_head_bf16(const bf16* __restrict__ logits, int v,
                                                      uint32_t* __restrict__ next,
                                                      float* __restrict__ logprob,
                                                      uint32_t* __restrict__ token,
                                                      uint32_t* __restrict__ pos) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float x = __bfloat162float(logits[i]);
        if (x > bv) {
            bv = x;
            bi = i;
        }
    }
    warp_argmax(bv, bi);
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < (int)(blockDim.x / WARP) ? best_v[lane] : -INFINITY;
        bi = lane < (int)(blockDim.x / WARP) ? best_i[lane] : 0x7fffffff;
        warp_argmax(bv, bi);
        if (lane == 0) {
            best_v[0] = bv;
            best_i[0] = bi;
        }
    }
    __syncthreads();
    const float m = best_v[0];
    const int arg = best_i[0];
    float s = 0.f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) s += __expf(__bfloat162float(logits[i]) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        *next = (uint32_t)arg;
        *logprob = -logf(s);
        *token = (uint32_t)arg;
        *pos = *pos + 1;
    }
}
