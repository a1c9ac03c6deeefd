// The SwiGLU gate and the greedy head.
#pragma once
#include "common.cuh"

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
// it (as int bits) and the sum of exp(x - its maximum). Block of 256; bf16 or f32 logits.
// Several rows: grid (blocks, rows), row y's logits at y * v and its parts at 3 * blocks * y.
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ void greedy_head_part(const T* __restrict__ logits, int v, int chunk,
                                                 float* __restrict__ part) {
    pdl_enter();
    logits += (size_t)blockIdx.y * v;
    part += (size_t)3 * gridDim.x * blockIdx.y;
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int lo = blockIdx.x * chunk, hi = min(v, lo + chunk);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float x = to_float(logits[i]);
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
            s += __expf(to_float(logits[i]) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        part[3 * blockIdx.x] = m;
        part[3 * blockIdx.x + 1] = __int_as_float(arg);
        part[3 * blockIdx.x + 2] = s;
    }
}

extern "C" __global__ void specsplit_greedy_head_part_bf16(const bf16* __restrict__ logits, int v,
                                                           int chunk, float* __restrict__ part) {
    greedy_head_part(logits, v, chunk, part);
}

extern "C" __global__ void specsplit_greedy_head_part_f32(const float* __restrict__ logits, int v,
                                                          int chunk, float* __restrict__ part) {
    greedy_head_part(logits, v, chunk, part);
}

// Combines a row's `blocks` parts of greedy_head_part (one warp; every lane gets the results):
// bv = the maximum, bi = the lowest index holding it, and where `with_sum` s = the sum of
// exp(x - bv) over the row (else 0).
__device__ __forceinline__ void head_combine(const float* __restrict__ part, int blocks,
                                             bool with_sum, float& bv, int& bi, float& s) {
    const int lane = threadIdx.x % WARP;
    bv = -INFINITY;
    bi = 0x7fffffff;
    for (int b = lane; b < blocks; b += WARP) {
        const float m = part[3 * b];
        const int i = __float_as_int(part[3 * b + 1]);
        if (m > bv || (m == bv && i < bi)) {
            bv = m;
            bi = i;
        }
    }
    warp_argmax(bv, bi);
    s = 0.f;
    if (with_sum)
        for (int b = lane; b < blocks; b += WARP) {
            const float m = part[3 * b];
            if (m > -INFINITY) s += part[3 * b + 2] * __expf(m - bv);
        }
    s = warp_sum(s);
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
    float bv, s;
    int bi;
    head_combine(part, blocks, true, bv, bi, s);
    if (lane == 0) {
        *next = (uint32_t)bi;
        *logprob = -logf(s);
        *token = (uint32_t)bi;
        *pos = *pos + 1;
    }
}

// Combines the parts of specsplit_greedy_head_part_bf16 for each of the rows of a chain growth
// level (one warp a row, grid rows): the row's token is forced[r] where forced_on[r], else the
// lowest index holding its maximum; writes it to ids[r] (the next level's input) and, as f32,
// to tok[r], and its log-probability (logit - logsumexp) to lp[r].
extern "C" __global__ void specsplit_greedy_rows_finish(
    const float* __restrict__ part, int blocks, const bf16* __restrict__ logits, int v,
    const uint32_t* __restrict__ forced, const uint32_t* __restrict__ forced_on,
    uint32_t* __restrict__ ids, float* __restrict__ tok, float* __restrict__ lp) {
    pdl_enter();
    const int r = blockIdx.x, lane = threadIdx.x;
    part += (size_t)3 * blocks * r;
    float bv, s;
    int bi;
    head_combine(part, blocks, true, bv, bi, s);
    if (lane == 0) {
        const bool f = forced_on[r] != 0 && forced[r] < (uint32_t)v;
        const uint32_t t = f ? forced[r] : (uint32_t)bi;
        const float x = f ? __bfloat162float(logits[(size_t)r * v + t]) : bv;
        ids[r] = t;
        tok[r] = (float)t;
        lp[r] = x - bv - logf(s);
    }
}

// Combines the parts of specsplit_greedy_head_part_* for each row (one warp a row, grid rows):
// ids[r] = the lowest index holding the row's maximum, or 0 where no logit of the row exceeds
// -inf (NaN never wins), as the host's `sampling::argmax` picks.
extern "C" __global__ void specsplit_argmax_rows_finish(const float* __restrict__ part,
                                                        int blocks, int v,
                                                        uint32_t* __restrict__ ids) {
    pdl_enter();
    const int r = blockIdx.x;
    part += (size_t)3 * blocks * r;
    float bv, s;
    int bi;
    head_combine(part, blocks, false, bv, bi, s);
    if (threadIdx.x == 0) ids[r] = bi < v ? (uint32_t)bi : 0u;
}

// One round of the top-w of each row (one warp a row, grid rows), after a round of
// specsplit_greedy_head_part_f32 over the same logits: writes the row's maximum's lowest index
// (as f32) to out[r * (2 w + 1) + j] and the maximum to out[.. + w + j]; in round 0 also the
// row's logsumexp to out[.. + 2 w]; then masks the picked logit to -inf, so that the next round
// picks the next largest. A row whose logits are all -inf writes -inf and masks nothing.
extern "C" __global__ void specsplit_top_rows_round_f32(const float* __restrict__ part, int blocks,
                                                       float* __restrict__ logits, int v, int w,
                                                       int j, float* __restrict__ out) {
    pdl_enter();
    const int r = blockIdx.x, lane = threadIdx.x;
    part += (size_t)3 * blocks * r;
    float bv, s;
    int bi;
    head_combine(part, blocks, j == 0, bv, bi, s);
    if (lane == 0) {
        float* o = out + (size_t)r * (2 * w + 1);
        const bool found = bv > -INFINITY && bi < v;
        o[j] = found ? (float)bi : -1.f;
        o[w + j] = found ? bv : -INFINITY;
        if (j == 0) o[2 * w] = found ? bv + logf(s) : -INFINITY;
        if (found) logits[(size_t)r * v + bi] = -INFINITY;
    }
}
