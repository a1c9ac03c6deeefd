// Attention of the rows of a draft's pass in one kernel (a pre-draft's growth levels, the
// sessions' shared chains): uses attention.cu's key list and rope.cu's session table.
#pragma once
#include "attention.cu"  // ListedKeys
#include "rope.cu"       // SessionCaches

// A draft's passes propose tokens the target verifies, so they need no batch invariance
// against the exact step; what they need is a short pass. The rows attention (rows_attention.cu)
// cuts each row's keys into chunks in one kernel and merges them in a second; here one block
// takes one query head of one row, its warps walk the row's keys a tile of WARP keys at a time
// (warp w takes tiles w, w + warps, ...) with a running maximum, and the block merges its
// warps' sums at the end. A row's result depends only on its query, its keys in order and the
// block's warp count (set by the launch's span, never by the other rows), so a row gets the
// same bits in any pass of the same span.

// Warps a block, at most.
#define DA_MAX_WARPS 16

// Query head h of row r over the slots `keys` of its KV head's caches kh / vh (slot-major, HD
// values a slot): q points at the head's HD query values, out at its HD outputs (bf16).
// Static shared memory: the query, then per warp its maximum, exp-sum and HD weighted V sums.
template <int HD>
__device__ __forceinline__ void draft_attention_head(const bf16* __restrict__ q,
                                                     const bf16* __restrict__ kh,
                                                     const bf16* __restrict__ vh,
                                                     const ListedKeys keys,
                                                     bf16* __restrict__ out, float scale) {
    constexpr int PER = HD / WARP;        // values of a V row per lane
    constexpr int VU = HD == 64 ? 16 : 8;  // V rows a warp has in flight (within 128 registers)
    __shared__ __align__(16) float qs[HD];
    __shared__ float wm[DA_MAX_WARPS], wl[DA_MAX_WARPS];
    __shared__ float wacc[DA_MAX_WARPS][HD];
    const int warps = blockDim.x / WARP;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) qs[d] = __bfloat162float(q[d]);
    __syncthreads();
    float m = -INFINITY, l = 0.f, acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = 0.f;
    const int tiles = (keys.len + WARP - 1) / WARP;
    for (int tile = warp; tile < tiles; tile += warps) {
        const int i = tile * WARP + lane;
        const bool valid = i < keys.len;
        const int sl = valid ? keys(i) : 0;
        // Score: lane i's key, its K row read as 16-byte words, all loads issued first.
        float s = -INFINITY;
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(kh + (size_t)sl * HD);
            uint4 words[HD / 8];
#pragma unroll
            for (int w = 0; w < HD / 8; ++w) words[w] = kr[w];
            float dot = 0.f;
#pragma unroll
            for (int w = 0; w < HD / 8; ++w) {
                const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&words[w]);
                const float4 qa = *reinterpret_cast<const float4*>(&qs[8 * w]);
                const float4 qb = *reinterpret_cast<const float4*>(&qs[8 * w + 4]);
                float2 f[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) f[e] = __bfloat1622float2(k2[e]);
                dot = fmaf(qa.x, f[0].x, dot);
                dot = fmaf(qa.y, f[0].y, dot);
                dot = fmaf(qa.z, f[1].x, dot);
                dot = fmaf(qa.w, f[1].y, dot);
                dot = fmaf(qb.x, f[2].x, dot);
                dot = fmaf(qb.y, f[2].y, dot);
                dot = fmaf(qb.z, f[3].x, dot);
                dot = fmaf(qb.w, f[3].y, dot);
            }
            s = dot * scale;
        }
        // The running maximum and exp-sum; the sums so far rescaled to the new maximum (a tile
        // has at least one key, so the maximum is finite after it).
        const float nm = fmaxf(m, warp_max(s));
        const float corr = __expf(m - nm);
        const float p = valid ? __expf(s - nm) : 0.f;
        l = fmaf(l, corr, warp_sum(p));
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[e] *= corr;
        m = nm;
        // V: the tile's keys in order, VU rows in flight; lane owns values lane * PER ...
        const int last = min(WARP, keys.len - tile * WARP);  // warp-uniform
        for (int k0 = 0; k0 < last; k0 += VU) {
            float v[VU][PER];
#pragma unroll
            for (int u = 0; u < VU; ++u) {
                const int su = __shfl_sync(0xffffffffu, sl, k0 + u);
                if (k0 + u < last) {
                    const bf16* vr = vh + (size_t)su * HD + lane * PER;
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
                const float pk = __shfl_sync(0xffffffffu, p, k0 + u);
                if (k0 + u >= last) break;
#pragma unroll
                for (int e = 0; e < PER; ++e) acc[e] = fmaf(pk, v[u][e], acc[e]);
            }
        }
    }
    // The warps' maxima, exp-sums and V sums, merged in warp order.
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < PER; ++e) wacc[warp][lane * PER + e] = acc[e];
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float mx = -INFINITY;
        for (int w = 0; w < warps; ++w) mx = fmaxf(mx, wm[w]);
        float sum = 0.f, o = 0.f;
        for (int w = 0; w < warps; ++w) {
            if (wm[w] == -INFINITY) continue;  // a warp that had no tile
            const float c = __expf(wm[w] - mx);
            sum = fmaf(wl[w], c, sum);
            o = fmaf(wacc[w][d], c, o);
        }
        out[d] = __float2bfloat16(sum > 0.f ? o / sum : 0.f);
    }
}

// Grid (heads, n), warps * WARP threads: query head h = blockIdx.x of row r = blockIdx.y
// (q (heads, n, HD)) over the slots its PassKeys give it (meta[2r] leading slots, then
// meta[2r + 1] listed in extra[r * max_extra ..]); out is (n, heads * HD).
template <int HD>
__device__ void draft_attention(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                const bf16* __restrict__ vc, const uint32_t* __restrict__ meta,
                                const uint32_t* __restrict__ extra, bf16* __restrict__ out,
                                int heads, int kv, int n, int cap, int max_extra, float scale) {
    const int h = blockIdx.x, r = blockIdx.y, j = h / (heads / kv);
    const int lead = (int)meta[2 * r];
    const ListedKeys keys{lead, lead + (int)meta[2 * r + 1], extra + (size_t)r * max_extra};
    draft_attention_head<HD>(q + ((size_t)h * n + r) * HD, kc + (size_t)j * cap * HD,
                             vc + (size_t)j * cap * HD, keys, out + ((size_t)r * heads + h) * HD,
                             scale);
}

// draft_attention for the stacked rows of several sessions: row r reads the caches of its
// session rows[2r] at layer `layer` from the session table (see session_caches in rope.cu).
// Each row's arithmetic is draft_attention's for its session alone.
template <int HD>
__device__ void draft_sessions_attention(const bf16* __restrict__ q,
                                         const uint32_t* __restrict__ rows,
                                         const unsigned long long* __restrict__ caches,
                                         const uint32_t* __restrict__ caps,
                                         const uint32_t* __restrict__ meta,
                                         const uint32_t* __restrict__ extra,
                                         bf16* __restrict__ out, int heads, int kv, int n,
                                         int max_extra, float scale, int layer, int sessions) {
    const int h = blockIdx.x, r = blockIdx.y, j = h / (heads / kv);
    const SessionCaches sc = session_caches(caches, caps, layer, sessions, (int)rows[2 * r]);
    const int lead = (int)meta[2 * r];
    const ListedKeys keys{lead, lead + (int)meta[2 * r + 1], extra + (size_t)r * max_extra};
    draft_attention_head<HD>(q + ((size_t)h * n + r) * HD, sc.k + (size_t)j * sc.cap * HD,
                             sc.v + (size_t)j * sc.cap * HD, keys,
                             out + ((size_t)r * heads + h) * HD, scale);
}

#define DA_ARGS                                                                                \
    const bf16 *__restrict__ q, const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,      \
        const uint32_t *__restrict__ meta, const uint32_t *__restrict__ extra,                 \
        bf16 *__restrict__ out, int heads, int kv, int n, int cap, int max_extra, float scale
#define DA_CALL q, kc, vc, meta, extra, out, heads, kv, n, cap, max_extra, scale

extern "C" __global__ void __launch_bounds__(DA_MAX_WARPS * WARP, 1)
    specsplit_draft_attention_bf16_hd64(DA_ARGS) {
    pdl_enter();
    draft_attention<64>(DA_CALL);
}

extern "C" __global__ void __launch_bounds__(DA_MAX_WARPS * WARP, 1)
    specsplit_draft_attention_bf16_hd128(DA_ARGS) {
    pdl_enter();
    draft_attention<128>(DA_CALL);
}

#define DSA_ARGS                                                                               \
    const bf16 *__restrict__ q, const uint32_t *__restrict__ rows,                             \
        const unsigned long long *__restrict__ caches, const uint32_t *__restrict__ caps,      \
        const uint32_t *__restrict__ meta, const uint32_t *__restrict__ extra,                 \
        bf16 *__restrict__ out, int heads, int kv, int n, int max_extra, float scale,          \
        int layer, int sessions
#define DSA_CALL q, rows, caches, caps, meta, extra, out, heads, kv, n, max_extra, scale, layer, \
                 sessions

extern "C" __global__ void __launch_bounds__(DA_MAX_WARPS * WARP, 1)
    specsplit_draft_sessions_attention_bf16_hd64(DSA_ARGS) {
    pdl_enter();
    draft_sessions_attention<64>(DSA_CALL);
}

extern "C" __global__ void __launch_bounds__(DA_MAX_WARPS * WARP, 1)
    specsplit_draft_sessions_attention_bf16_hd128(DSA_ARGS) {
    pdl_enter();
    draft_sessions_attention<128>(DSA_CALL);
}
