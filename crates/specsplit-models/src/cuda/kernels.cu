// Fused bf16 kernels for one-token decoding (specsplit-models, feature `cuda`).
//
// build.rs compiles this file to PTX with nvcc; src/fused.rs loads and launches it. Every kernel
// accumulates in f32 and rounds to bf16 where the unfused candle ops round, so a fused step
// stays within bf16 rounding of the unfused one (tests/fused_kernels.rs checks that on a GPU).
// Nothing here synchronises with the host: positions are read from device memory, so a step
// built from these kernels can be captured into a CUDA graph and replayed.
//
// The second half holds the batch-invariant kernels (rows attention, tensor-core matmul) that
// every dense bf16 pass of up to 64 rows runs: each computes a row's result in an order that
// does not depend on the other rows of the pass.

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define WARP 32

// Programmatic dependent launch (sm_90 and later; src/fused.rs sets the launch attribute only
// where this PTX has it). A kernel launched that way may start while the kernel before it in the
// stream still runs: pdl_wait() blocks until that kernel has finished and its writes are
// visible, so every kernel calls it before touching anything an earlier kernel writes or reads
// (only constant weights may be loaded before it). pdl_release() then lets the next kernel's
// blocks be scheduled as this one's run. Both are no-ops for a kernel launched normally.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_release() {}
#endif

// The start of every kernel: wait for the kernel before, then release the one after.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_release();
}

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

// y[j][r] = W[r, :] . x[j] (+ bias[r]) for r < n and each of the R rows x[j] of x (R, k):
// matrix-vector products for steps of one to a few tokens. W is (n, k) row-major, k % 8 == 0,
// rows 16-byte aligned; x is (R, k) contiguous. One warp per row of W, four independent
// 16-byte weight loads in flight per lane, each weight word loaded once for all R rows of x.
// Row j's sums run in the same order whatever R is, so its result is the one-row product's,
// bit for bit.
// Adds four weight words (a lane's words i, i + WARP, i + 2 WARP, i + 3 WARP of one W row)
// times the same words of each of the R rows of x (k8 words a row) to that row's four sums.
template <int R>
__device__ __forceinline__ void gemv_add4(uint4 w0, uint4 w1, uint4 w2, uint4 w3,
                                          const uint4* __restrict__ xr, int k8, int i,
                                          float (&a0)[R], float (&a1)[R], float (&a2)[R],
                                          float (&a3)[R]) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const uint4* xj = xr + (size_t)j * k8;
        a0[j] += dot8(w0, __ldg(xj + i));
        a1[j] += dot8(w1, __ldg(xj + i + WARP));
        a2[j] += dot8(w2, __ldg(xj + i + 2 * WARP));
        a3[j] += dot8(w3, __ldg(xj + i + 3 * WARP));
    }
}

template <int R>
__device__ __forceinline__ void gemv_rows(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                          const bf16* __restrict__ bias, bf16* __restrict__ y,
                                          int n, int k) {
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= n) {
        pdl_enter();
        return;
    }
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const int k8 = k / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    float a0[R], a1[R], a2[R], a3[R];
#pragma unroll
    for (int j = 0; j < R; ++j) a0[j] = a1[j] = a2[j] = a3[j] = 0.f;
    int i = lane;
    // The first four words of the lane's share of the row are loaded before waiting for the
    // kernel that writes x (weights are constant), then summed exactly as the loop would.
    if (i + 3 * WARP < k8) {
        const uint4 w0 = load_stream(wr + i), w1 = load_stream(wr + i + WARP);
        const uint4 w2 = load_stream(wr + i + 2 * WARP), w3 = load_stream(wr + i + 3 * WARP);
        pdl_enter();
        gemv_add4<R>(w0, w1, w2, w3, xr, k8, i, a0, a1, a2, a3);
        i += 4 * WARP;
    } else {
        pdl_enter();
    }
    for (; i + 3 * WARP < k8; i += 4 * WARP) {
        const uint4 w0 = load_stream(wr + i), w1 = load_stream(wr + i + WARP);
        const uint4 w2 = load_stream(wr + i + 2 * WARP), w3 = load_stream(wr + i + 3 * WARP);
        gemv_add4<R>(w0, w1, w2, w3, xr, k8, i, a0, a1, a2, a3);
    }
    for (; i < k8; i += WARP) {
        const uint4 w0 = load_stream(wr + i);
#pragma unroll
        for (int j = 0; j < R; ++j) a0[j] += dot8(w0, __ldg(xr + (size_t)j * k8 + i));
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
        float acc = warp_sum((a0[j] + a1[j]) + (a2[j] + a3[j]));
        if (lane == 0) {
            // The unfused path rounds the product to bf16 before adding the bias.
            if (bias != nullptr) acc = round_bf16(acc) + __bfloat162float(bias[row]);
            y[(size_t)j * n + row] = __float2bfloat16(acc);
        }
    }
}

#define GEMV_ROWS_KERNEL(NAME, R)                                                             \
    extern "C" __global__ void NAME(const bf16* __restrict__ w, const bf16* __restrict__ x,   \
                                    const bf16* __restrict__ bias, bf16* __restrict__ y,      \
                                    int n, int k) {                                           \
        gemv_rows<R>(w, x, bias, y, n, k);                                                    \
    }
GEMV_ROWS_KERNEL(specsplit_gemv_bf16, 1)
GEMV_ROWS_KERNEL(specsplit_gemv_rows2_bf16, 2)
GEMV_ROWS_KERNEL(specsplit_gemv_rows3_bf16, 3)
GEMV_ROWS_KERNEL(specsplit_gemv_rows4_bf16, 4)

// For each of `rows` rows of width d (one block per row): s = x + delta (rounded to bf16; s = x
// when delta is null), out[0][row] = s, out[1][row] = s / sqrt(mean(s^2) + eps) * w.
// out is (2, rows, d).
extern "C" __global__ void specsplit_add_rmsnorm_bf16(const bf16* __restrict__ x,
                                                      const bf16* __restrict__ delta,
                                                      const bf16* __restrict__ w,
                                                      bf16* __restrict__ out, int rows, int d,
                                                      float eps) {
    pdl_enter();
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

// The fused Q|K|V rows (heads + 2 * kv heads of hd values each) of consecutive tokens, row r
// at position *pos + r → rotary on Q and K at that position, Q written to row r of q_out
// (rows, heads * hd), K and V written into the caches (kv, cap, hd) at slot *pos + r. cos / sin
// are (positions, hd / 2) tables. `interleaved` selects the (2i, 2i + 1) pair layout instead
// of (i, i + hd / 2). Grid (heads + 2 * kv, rows), hd / 2 threads.
extern "C" __global__ void specsplit_qkv_rope_cache_bf16(
    const bf16* __restrict__ qkv, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
    const uint32_t* __restrict__ pos, bf16* __restrict__ kc, bf16* __restrict__ vc,
    bf16* __restrict__ q_out, int heads, int kv, int hd, int cap, int interleaved) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y;
    const int half = hd / 2;
    const int i = threadIdx.x;
    if (i >= half) return;
    const uint32_t p = *pos + r;
    if (p >= (uint32_t)cap) return;  // the host keeps positions below capacity; never write past it
    q_out += (size_t)r * heads * hd;
    const bf16* src = qkv + ((size_t)r * (heads + 2 * kv) + h) * hd;
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

// The n rows of one pass: row r's fused Q|K|V (heads + 2 * kv heads of hd values, rows
// contiguous) → rotary on Q and K at positions[r], Q written to q_out (heads, n, hd), K and V
// written into the caches (kv, cap, hd) at slot past + r, or at slot positions[r] when past is
// negative (a chain after the cached sequence, its slots read on the device so that a captured
// graph serves every round). Grid (heads + 2 * kv, n), hd / 2 threads. Each value is computed
// from its own row alone.
extern "C" __global__ void specsplit_qkv_rope_rows_bf16(
    const bf16* __restrict__ qkv, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
    const uint32_t* __restrict__ positions, bf16* __restrict__ kc, bf16* __restrict__ vc,
    bf16* __restrict__ q_out, int heads, int kv, int hd, int cap, int n, int past,
    int interleaved) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y;
    const int half = hd / 2;
    const int i = threadIdx.x;
    if (i >= half) return;
    const int slot = past >= 0 ? past + r : (int)positions[r];
    if (slot < 0 || slot >= cap) return;  // the host checks capacity; never write past it
    const bf16* src = qkv + ((size_t)r * (heads + 2 * kv) + h) * hd;
    if (h >= heads + kv) {
        bf16* dst = vc + ((size_t)(h - heads - kv) * cap + slot) * hd;
        dst[i] = src[i];
        dst[i + half] = src[i + half];
        return;
    }
    const uint32_t p = positions[r];
    const float c = __bfloat162float(cos_t[(size_t)p * half + i]);
    const float s = __bfloat162float(sin_t[(size_t)p * half + i]);
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = __bfloat162float(src[a]);
    const float x2 = __bfloat162float(src[b]);
    bf16* dst = h < heads ? q_out + ((size_t)h * n + r) * hd
                          : kc + ((size_t)(h - heads) * cap + slot) * hd;
    dst[a] = __float2bfloat16(x1 * c - x2 * s);
    dst[b] = __float2bfloat16(x1 * s + x2 * c);
}

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

// Batch-invariant attention of the n rows of one pass, in two kernels. Row r attends to slots
// 0..meta[2r], then to the meta[2r + 1] slots listed in extra[r * max_extra ..]; its key list is
// cut into chunks of RA_CHUNK keys by list index. The first kernel computes, per (KV head, row,
// chunk), every query head's chunk maximum, exp-sum and exp-weighted V sum; the second merges a
// row's chunks in chunk order. Every reduction is ordered by list index alone, so a row gets
// the same bits whether it is decoded alone or verified among tree nodes.

#define RA_CHUNK 64   // keys a chunk (= threads of a partial block, two warps)
#define RA_MAX_REP 8  // query heads a KV head serves, at most
#define RA_MERGE 64   // chunks the merge stages in shared memory at a time (<= its threads)

// Waits for the RA_CHUNK threads of named barrier `id` (0 is the whole block of a
// RA_CHUNK-thread launch; 1.. are the row groups of rows_attention_staged).
__device__ __forceinline__ void ra_sync(int id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(RA_CHUNK) : "memory");
}

// K rows of a staged chunk sit HD + RA_KPAD values apart in shared memory (16-byte loads of
// consecutive rows then fall in different banks).
#define RA_KPAD 8

// One row's chunk c of the rows attention, computed by the RA_CHUNK threads t = 0.. of barrier
// `bar` (block-uniform early return past the row's keys). The block staged the K and V rows of
// slots c * RA_CHUNK + k, k < staged, in shared memory (ksh, vsh; staged = 0: none): a key of
// the chunk that lies in the row's leading run (list index = slot) and was staged is read
// there, every other key from the caches. The values and the order of every operation are the
// same either way, so the row gets the same bits. STAGING false: no block stages (staged is 0).
template <int HD, bool STAGING>
__device__ __forceinline__ void rows_attention_row(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ meta, const uint32_t* __restrict__ extra,
    float* __restrict__ part, int heads, int kv, int n, int cap, int max_extra, int chunks,
    float scale, int r, int c, int t, int bar, float (*qs)[HD], float (*prob)[RA_CHUNK],
    int* slot, float (*red)[RA_MAX_REP], float (*vsum)[HD], const bf16* ksh, const bf16* vsh,
    int staged) {
    constexpr int PER = HD / WARP;  // values of a V row per lane
    const int j = blockIdx.x;
    const int rep = heads / kv;
    const int lane = t % WARP, warp = t / WARP;
    const int lead = (int)meta[2 * r];
    const ListedKeys keys{lead, lead + (int)meta[2 * r + 1], extra + (size_t)r * max_extra};
    if (c * RA_CHUNK >= keys.len) return;  // past this row's keys: the merge never reads it
    // The rep query heads' values, 8 a load, all loads issued before any is used; heads past
    // rep are zero (their scores are computed and dropped).
    constexpr int QW = RA_MAX_REP * HD / 8;  // 16-byte words of RA_MAX_REP heads
#pragma unroll
    for (int e0 = 0; e0 < QW; e0 += RA_CHUNK) {
        const int e = e0 + t;
        if (e < QW) {
            const int hh = e / (HD / 8), d0 = e % (HD / 8) * 8;
            uint4 word = make_uint4(0, 0, 0, 0);
            if (hh < rep)
                word = *reinterpret_cast<const uint4*>(
                    q + ((size_t)(j * rep + hh) * n + r) * HD + d0);
            const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __bfloat1622float2(w2[i]);
                qs[hh][d0 + 2 * i] = f.x;
                qs[hh][d0 + 2 * i + 1] = f.y;
            }
        }
    }
    const int i = c * RA_CHUNK + t;
    const bool valid = i < keys.len;
    const int sl = valid ? keys(i) : 0;
    slot[t] = sl;
    // Keys k < shared of this chunk are this row's staged ones (in its leading run and staged).
    const int shared = STAGING ? max(0, min(staged, lead - c * RA_CHUNK)) : 0;
    ra_sync(bar);
    const bf16* kh = kc + (size_t)j * cap * HD;
    const bf16* vh = vc + (size_t)j * cap * HD;
    float s[RA_MAX_REP];
#pragma unroll
    for (int h = 0; h < RA_MAX_REP; ++h) s[h] = -INFINITY;
    if (valid) {
        uint4 words[HD / 8];
        if (STAGING && t < shared) {
            const uint4* kr = reinterpret_cast<const uint4*>(ksh + t * (HD + RA_KPAD));
#pragma unroll
            for (int w = 0; w < HD / 8; ++w) words[w] = kr[w];
        } else {
            const uint4* kr = reinterpret_cast<const uint4*>(kh + (size_t)sl * HD);
#pragma unroll
            for (int w = 0; w < HD / 8; ++w) words[w] = kr[w];
        }
        // Every head's dot product is the same sequence of fmaf over the values in order; the
        // heads' sequences are interleaved so that they run side by side.
        float d[RA_MAX_REP];
#pragma unroll
        for (int h = 0; h < RA_MAX_REP; ++h) d[h] = 0.f;
#pragma unroll
        for (int w = 0; w < HD / 8; ++w) {
            const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&words[w]);
            float2 f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) f[e] = __bfloat1622float2(k2[e]);
#pragma unroll
            for (int h = 0; h < RA_MAX_REP; ++h) {
                const float4 qa = *reinterpret_cast<const float4*>(&qs[h][8 * w]);
                const float4 qb = *reinterpret_cast<const float4*>(&qs[h][8 * w + 4]);
                d[h] = fmaf(qa.x, f[0].x, d[h]);
                d[h] = fmaf(qa.y, f[0].y, d[h]);
                d[h] = fmaf(qa.z, f[1].x, d[h]);
                d[h] = fmaf(qa.w, f[1].y, d[h]);
                d[h] = fmaf(qb.x, f[2].x, d[h]);
                d[h] = fmaf(qb.y, f[2].y, d[h]);
                d[h] = fmaf(qb.z, f[3].x, d[h]);
                d[h] = fmaf(qb.w, f[3].y, d[h]);
            }
        }
#pragma unroll
        for (int h = 0; h < RA_MAX_REP; ++h)
            if (h < rep) s[h] = d[h] * scale;
    }
    // Chunk maximum per head: each warp's, then warp 0's and warp 1's.
    float mx[RA_MAX_REP];
#pragma unroll
    for (int h = 0; h < RA_MAX_REP; ++h) {
        mx[h] = warp_max(s[h]);
        if (lane == 0) red[warp][h] = mx[h];
    }
    ra_sync(bar);
#pragma unroll
    for (int h = 0; h < RA_MAX_REP; ++h) mx[h] = fmaxf(red[0][h], red[1][h]);
    ra_sync(bar);
    float sum[RA_MAX_REP];
#pragma unroll
    for (int h = 0; h < RA_MAX_REP; ++h) {
        const float p = valid && h < rep ? __expf(s[h] - mx[h]) : 0.f;
        prob[h][t] = p;
        sum[h] = warp_sum(p);
        if (lane == 0) red[warp][h] = sum[h];
    }
    ra_sync(bar);
    // V: warp w takes keys w, w + 2, ...; lane owns values lane * PER .. + PER of every head.
    float acc[RA_MAX_REP][PER];
#pragma unroll
    for (int h = 0; h < RA_MAX_REP; ++h)
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[h][e] = 0.f;
    const int last = min(RA_CHUNK, keys.len - c * RA_CHUNK);
    constexpr int VU = 8;  // V rows in flight per warp
    for (int k0 = warp; k0 < last; k0 += 2 * VU) {
        float v[VU][PER];
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int k = k0 + 2 * u;
            if (k < last) {
                const bf16* vr = (STAGING && k < shared ? vsh + k * HD : vh + (size_t)slot[k] * HD) + lane * PER;
#pragma unroll
                for (int e = 0; e < PER; e += 2) {
                    const float2 f =
                        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vr + e));
                    v[u][e] = f.x;
                    v[u][e + 1] = f.y;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int k = k0 + 2 * u;
            if (k >= last) break;
#pragma unroll
            for (int h = 0; h < RA_MAX_REP; ++h) {
                if (h >= rep) break;
                const float p = prob[h][k];
#pragma unroll
                for (int e = 0; e < PER; ++e) acc[h][e] = fmaf(p, v[u][e], acc[h][e]);
            }
        }
    }
    if (warp == 1) {
#pragma unroll
        for (int h = 0; h < RA_MAX_REP; ++h)
#pragma unroll
            for (int e = 0; e < PER; ++e) vsum[h][lane * PER + e] = acc[h][e];
    }
    ra_sync(bar);
    if (warp == 0) {
#pragma unroll
        for (int h = 0; h < RA_MAX_REP; ++h) {
            if (h >= rep) break;
            float* out = part + (((size_t)r * heads + j * rep + h) * chunks + c) * (HD + 2);
#pragma unroll
            for (int e = 0; e < PER; ++e) out[lane * PER + e] = acc[h][e] + vsum[h][lane * PER + e];
            if (lane == 0) {
                out[HD] = mx[h];
                out[HD + 1] = red[0][h] + red[1][h];
            }
        }
    }
}

// part is (n, heads, chunks, HD + 2) f32: the exp-weighted V sum, then the max and the exp-sum.
// Grid (kv, n, chunks), RA_CHUNK threads: one row's chunk a block, keys read from the caches.
template <int HD>
__device__ void rows_attention_part(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                    const bf16* __restrict__ vc, const uint32_t* __restrict__ meta,
                                    const uint32_t* __restrict__ extra, float* __restrict__ part,
                                    int heads, int kv, int n, int cap, int max_extra, int chunks,
                                    float scale) {
    __shared__ __align__(16) float qs[RA_MAX_REP][HD];
    __shared__ float prob[RA_MAX_REP][RA_CHUNK];
    __shared__ int slot[RA_CHUNK];
    __shared__ float red[2][RA_MAX_REP];
    __shared__ float vsum[RA_MAX_REP][HD];
    rows_attention_row<HD, false>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra,
                                  chunks, scale, blockIdx.y, blockIdx.z, threadIdx.x, 0, qs, prob,
                                  slot, red, vsum, nullptr, nullptr, 0);
}

// Shared memory of one row group of rows_attention_staged: its heads' query values (reused
// for warp 1's V sums once the scores are done), probabilities, slots and warp results.
template <int HD>
struct RowScratch {
    float qs[RA_MAX_REP][HD];
    float prob[RA_MAX_REP][RA_CHUNK];
    int slot[RA_CHUNK];
    float red[2][RA_MAX_REP];
};

// The same partial results as rows_attention_part, with `group` rows of a chunk in one block
// of group * RA_CHUNK threads (row group g = threadIdx.x / RA_CHUNK takes row blockIdx.y *
// group + g). The block first stages, with coalesced loads, the K and V rows of the chunk's
// slots that lie below the longest leading run of its rows (the prefix the rows of a verify
// pass share, up to the chunk's end), and every row group reads there the keys of its own
// leading run: the prefix is read from memory once per `group` rows instead of once per row,
// also in the chunk where the prefix ends. Each row's arithmetic is that of
// rows_attention_row, so the bits are those of the row alone. Dynamic shared memory: the staged
// K (RA_CHUNK x (HD + RA_KPAD)) and V (RA_CHUNK x HD) bf16, then one RowScratch per row group.
template <int HD>
__device__ void rows_attention_staged(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                      const bf16* __restrict__ vc,
                                      const uint32_t* __restrict__ meta,
                                      const uint32_t* __restrict__ extra, float* __restrict__ part,
                                      int heads, int kv, int n, int cap, int max_extra,
                                      int chunks, float scale, int group) {
    extern __shared__ __align__(16) unsigned char ra_smem[];
    bf16* ksh = reinterpret_cast<bf16*>(ra_smem);
    bf16* vsh = ksh + RA_CHUNK * (HD + RA_KPAD);
    RowScratch<HD>* scratch = reinterpret_cast<RowScratch<HD>*>(vsh + RA_CHUNK * HD);
    const int j = blockIdx.x, c = blockIdx.z;
    const int g = threadIdx.x / RA_CHUNK, t = threadIdx.x % RA_CHUNK;
    const int r0 = blockIdx.y * group, rows = min(group, n - r0);
    // Block-uniform: every thread reads the same leads. Slots below a lead are below the
    // capacity, so every staged slot is inside the caches.
    int top = 0;
    for (int i = 0; i < rows; ++i) top = max(top, (int)meta[2 * (r0 + i)]);
    const int staged = max(0, min(RA_CHUNK, top - c * RA_CHUNK));
    if (staged > 0) {
        constexpr int W = HD / 8;  // 16-byte words a row
        const uint4* kg = reinterpret_cast<const uint4*>(kc + ((size_t)j * cap + (size_t)c * RA_CHUNK) * HD);
        const uint4* vg = reinterpret_cast<const uint4*>(vc + ((size_t)j * cap + (size_t)c * RA_CHUNK) * HD);
        for (int e = threadIdx.x; e < staged * W; e += blockDim.x) {
            const int k = e / W, w = e % W;
            *reinterpret_cast<uint4*>(ksh + k * (HD + RA_KPAD) + w * 8) = kg[e];
            reinterpret_cast<uint4*>(vsh)[e] = vg[e];
        }
        __syncthreads();
    }
    if (g >= rows) return;
    RowScratch<HD>& sc = scratch[g];
    float(*vsum)[HD] = sc.qs;  // written only after every score is computed
    rows_attention_row<HD, true>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra,
                                 chunks, scale, r0 + g, c, t, 1 + g, sc.qs, sc.prob, sc.slot,
                                 sc.red, vsum, ksh, vsh, staged);
}

#define RA_PART_ARGS                                                                             \
    const bf16 *__restrict__ q, const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,        \
        const uint32_t *__restrict__ meta, const uint32_t *__restrict__ extra,                   \
        float *__restrict__ part, int heads, int kv, int n, int cap, int max_extra, int chunks, \
        float scale

extern "C" __global__ void specsplit_rows_attention_part_bf16_hd64(RA_PART_ARGS) {
    pdl_enter();
    rows_attention_part<64>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra, chunks,
                            scale);
}

extern "C" __global__ void specsplit_rows_attention_part_bf16_hd128(RA_PART_ARGS) {
    pdl_enter();
    rows_attention_part<128>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra, chunks,
                             scale);
}

extern "C" __global__ void specsplit_rows_attention_staged_bf16_hd64(RA_PART_ARGS, int group) {
    pdl_enter();
    rows_attention_staged<64>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra, chunks,
                              scale, group);
}

extern "C" __global__ void specsplit_rows_attention_staged_bf16_hd128(RA_PART_ARGS, int group) {
    pdl_enter();
    rows_attention_staged<128>(q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra,
                               chunks, scale, group);
}

// Merges row r's chunks of head h in chunk order into out (n, heads * hd) bf16. Grid
// (heads, n), hd threads.
extern "C" __global__ void specsplit_rows_attention_merge_bf16(
    const float* __restrict__ part, const uint32_t* __restrict__ meta, bf16* __restrict__ out,
    int heads, int chunks, int hd) {
    pdl_enter();
    // Each chunk's max and exp-sum, loaded by all threads at once; the chunks are merged in
    // order, RA_MERGE at a time from shared memory.
    __shared__ float cm[RA_MERGE], cl[RA_MERGE];
    const int h = blockIdx.x, r = blockIdx.y, d = threadIdx.x;
    const int len = (int)(meta[2 * r] + meta[2 * r + 1]);
    const int used = (len + RA_CHUNK - 1) / RA_CHUNK;
    const float* p = part + ((size_t)r * heads + h) * chunks * (hd + 2);
    float m = -INFINITY;
    for (int c0 = 0; c0 < used; c0 += RA_MERGE) {
        const int c = c0 + d;
        const float mc = c < used && d < RA_MERGE ? p[(size_t)c * (hd + 2) + hd] : -INFINITY;
        m = fmaxf(m, block_max(mc));
    }
    float l = 0.f, o = 0.f;
    for (int c0 = 0; c0 < used; c0 += RA_MERGE) {
        const int nc = min(RA_MERGE, used - c0);
        __syncthreads();
        if (d < nc) {
            const float* pc = p + (size_t)(c0 + d) * (hd + 2);
            cm[d] = __expf(pc[hd] - m);
            cl[d] = pc[hd + 1];
        }
        __syncthreads();
#pragma unroll 8
        for (int i = 0; i < nc; ++i) {
            const float w = cm[i];
            l = fmaf(cl[i], w, l);
            o = fmaf(p[(size_t)(c0 + i) * (hd + 2) + d], w, o);
        }
    }
    out[((size_t)r * heads + h) * hd + d] = __float2bfloat16(o / l);
}

// ---------------------------------------------------------------------------------------------
// Batch-invariant matrix product on tensor cores (the kernel is at the end of this section).

#define BI_ROWS 64

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide k chunk for MT row tiles and NT column tiles of 8: lane (g = lane / 4,
// t = lane % 4) holds elements t * 8 .. t * 8 + 8 of the chunk for rows g and g + 8 of each
// row tile (lo / hi) and for column g of each column tile (b[s]). The k order inside the chunk
// is permuted identically for x and W: an output's sum is the same fixed sequence of mma
// steps, whichever rows and columns share them.
template <int MT, int NT>
__device__ __forceinline__ void bi_chunk(const uint4* const (&xa)[4][2], int c,
                                         const uint4 (&b)[NT], float (&acc)[4][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const uint4 lo = __ldg(xa[i][0] + c * 4), hi = __ldg(xa[i][1] + c * 4);
#pragma unroll
        for (int s = 0; s < NT; ++s) mma_bf16(acc[i][s], lo.x, hi.x, lo.y, hi.y, b[s].x, b[s].y);
#pragma unroll
        for (int s = 0; s < NT; ++s) mma_bf16(acc[i][s], lo.z, hi.z, lo.w, hi.w, b[s].z, b[s].w);
    }
}

// Chunks [c0, c1) into acc, U weight chunks in flight per lane (U changes only how far the
// loads run ahead, never the order of the mma steps).
template <int MT, int NT, int U>
__device__ void bi_accumulate(const uint4* const (&xa)[4][2], const uint4* const (&wb)[NT],
                              int c0, int c1, float (&acc)[4][NT][4]) {
    int c = c0;
    for (; c + U - 1 < c1; c += U) {
        uint4 b[U][NT];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int s = 0; s < NT; ++s) b[u][s] = load_stream(wb[s] + (c + u) * 4);
#pragma unroll
        for (int u = 0; u < U; ++u) bi_chunk<MT, NT>(xa, c + u, b[u], acc);
    }
    for (; c < c1; ++c) {
        uint4 b[NT];
#pragma unroll
        for (int s = 0; s < NT; ++s) b[s] = load_stream(wb[s] + c * 4);
        bi_chunk<MT, NT>(xa, c, b, acc);
    }
}

// The block's tile: NT * 8 columns from n0, up to BI_ROWS rows from m0. Warp w takes chunks
// [chunks * w / splits, chunks * (w + 1) / splits); the warps' partial sums are added in warp
// order in `red` (shared, 16 * MT * NT * 8 floats).
template <int MT, int NT, int U>
__device__ void bi_tile(const bf16* __restrict__ x, const bf16* __restrict__ w,
                        const bf16* __restrict__ bias, bf16* __restrict__ y, int m, int n, int k,
                        int splits, int n0, int m0, int rows, float* __restrict__ red) {
    constexpr int COLS = NT * 8;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane / 4, t = lane % 4;
    const int chunks = k / 32;
    const int c0 = (int)((long long)chunks * warp / splits);
    const int c1 = (int)((long long)chunks * (warp + 1) / splits);
    // Rows past m and columns past n read a valid row (rows and columns never mix in an mma)
    // and are not stored.
    const uint4* wb[NT];
#pragma unroll
    for (int s = 0; s < NT; ++s)
        wb[s] = reinterpret_cast<const uint4*>(w + (size_t)min(n0 + 8 * s + g, n - 1) * k) + t;
    const uint4* xa[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        xa[i][0] = reinterpret_cast<const uint4*>(x + (size_t)min(m0 + 16 * i + g, m - 1) * k) + t;
        xa[i][1] = reinterpret_cast<const uint4*>(x + (size_t)min(m0 + 16 * i + 8 + g, m - 1) * k) + t;
    }
    float acc[4][NT][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int s = 0; s < NT; ++s)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][s][e] = 0.f;
    bi_accumulate<MT, NT, U>(xa, wb, c0, c1, acc);
    for (int p = 0; p < splits; ++p) {
        if (warp == p) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int s = 0; s < NT; ++s)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = 16 * i + g + (e >= 2 ? 8 : 0);
                        const int col = s * 8 + t * 2 + (e & 1);
                        float& dst = red[row * COLS + col];
                        dst = p == 0 ? acc[i][s][e] : dst + acc[i][s][e];
                    }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < rows * COLS; e += blockDim.x) {
        const int r = e / COLS, col = e % COLS;
        if (n0 + col >= n) continue;
        float v = red[r * COLS + col];
        // The unfused path rounds the product to bf16 before adding the bias.
        if (bias != nullptr) v = round_bf16(v) + __bfloat162float(bias[n0 + col]);
        y[(size_t)(m0 + r) * n + n0 + col] = __float2bfloat16(v);
    }
}

// ---------------------------------------------------------------------------------------------
// y = x W^T (+ bias) on tensor cores for x (m, k), W (n, k), k % 32 == 0, x and W 16-byte
// aligned. Grid (ceil(n / (8 * nt)), ceil(m / BI_ROWS)), 32 * splits threads (splits <= k / 32),
// dynamic shared memory for 16 * ceil(min(m, BI_ROWS) / 16) * 8 * nt floats; nt is 2 or 4
// column tiles of 8 a warp; deep (1 or 2) multiplies the weight chunks each lane keeps in
// flight (4 / 2 for nt 2 / 4). An output is the same sequence of mma.sync steps over its warp's
// share of k whatever m, nt and deep are and wherever its row and column sit in the tile, and
// splits depends on (n, k) only, so a row's result does not depend on the batch: one token
// decoded alone and the same token verified among tree nodes get bit-identical products.
extern "C" __global__ void specsplit_bi_matmul_bf16(const bf16* __restrict__ x,
                                                    const bf16* __restrict__ w,
                                                    const bf16* __restrict__ bias,
                                                    bf16* __restrict__ y, int m, int n, int k,
                                                    int splits, int nt, int deep) {
    pdl_enter();
    extern __shared__ float red[];
    const int n0 = blockIdx.x * 8 * nt, m0 = blockIdx.y * BI_ROWS;
    const int rows = min(BI_ROWS, m - m0);
    const int tiles = (rows + 15) / 16;
#define BI_CASE(MT, NT, U) bi_tile<MT, NT, U>(x, w, bias, y, m, n, k, splits, n0, m0, rows, red)
#define BI_TILES(NT, U)                    \
    switch (tiles) {                       \
        case 1: BI_CASE(1, NT, U); break;  \
        case 2: BI_CASE(2, NT, U); break;  \
        case 3: BI_CASE(3, NT, U); break;  \
        default: BI_CASE(4, NT, U); break; \
    }
    if (nt == 2) {
        if (deep == 2) {
            BI_TILES(2, 8)
        } else {
            BI_TILES(2, 4)
        }
    } else {
        if (deep == 2) {
            BI_TILES(4, 4)
        } else {
            BI_TILES(4, 2)
        }
    }
#undef BI_TILES
#undef BI_CASE
}

// SwiGLU gate: gu is (rows, 2 * n) = [gate | up]; out (rows, n) = silu(gate) * up, rounded to
// bf16 after the silu and after the product like the unfused ops.
extern "C" __global__ void specsplit_silu_mul_bf16(const bf16* __restrict__ gu,
                                                   bf16* __restrict__ out, int rows, int n) {
    pdl_enter();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * n) return;
    const size_t r = i / n, c = i % n;
    const float g = __bfloat162float(gu[r * 2 * n + c]);
    const float u = __bfloat162float(gu[r * 2 * n + n + c]);
    const float s = round_bf16(g / (1.f + __expf(-g)));
    out[i] = __float2bfloat16(s * u);
}

// Greedy head of one token, in two kernels: next = argmax(logits) (the lowest index among
// equal maxima), logprob = logits[next] - logsumexp(logits); then token = next and *pos += 1,
// so the next replay of a captured step decodes the following token. Split over blocks (one
// block took ~52 us over a 150k vocabulary on an H100): block b takes logits
// [b * chunk, (b + 1) * chunk) and writes part[3 b ..] = its maximum, the lowest index holding
// it (as int bits) and the sum of exp(x - its maximum). Block of 256.
extern "C" __global__ void specsplit_greedy_head_part_bf16(const bf16* __restrict__ logits, int v,
                                                           int chunk, float* __restrict__ part) {
    pdl_enter();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int lo = blockIdx.x * chunk, hi = min(v, lo + chunk);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
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
    if (m > -INFINITY)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
            s += __expf(__bfloat162float(logits[i]) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        part[3 * blockIdx.x] = m;
        part[3 * blockIdx.x + 1] = __int_as_float(arg);
        part[3 * blockIdx.x + 2] = s;
    }
}

// Combines the `blocks` parts of specsplit_greedy_head_part_bf16 (one warp): next = token = the
// lowest index holding the maximum, logprob = -log(sum of exp(x - maximum)), *pos += 1.
extern "C" __global__ void specsplit_greedy_head_finish(const float* __restrict__ part, int blocks,
                                                        uint32_t* __restrict__ next,
                                                        float* __restrict__ logprob,
                                                        uint32_t* __restrict__ token,
                                                        uint32_t* __restrict__ pos) {
    pdl_enter();
    const int lane = threadIdx.x;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int b = lane; b < blocks; b += WARP) {
        const float m = part[3 * b];
        const int i = __float_as_int(part[3 * b + 1]);
        if (m > bv || (m == bv && i < bi)) {
            bv = m;
            bi = i;
        }
    }
    warp_argmax(bv, bi);
    float s = 0.f;
    for (int b = lane; b < blocks; b += WARP) {
        const float m = part[3 * b];
        if (m > -INFINITY) s += part[3 * b + 2] * __expf(m - bv);
    }
    s = warp_sum(s);
    if (lane == 0) {
        *next = (uint32_t)bi;
        *logprob = -logf(s);
        *token = (uint32_t)bi;
        *pos = *pos + 1;
    }
}
