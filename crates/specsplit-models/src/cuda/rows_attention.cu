// Batch-invariant attention of the rows of one pass (uses attention.cu's key walk).
#pragma once
#include "attention.cu"
#include "rope.cu"  // SessionCaches

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

// One row's chunk c of the rows attention for HB of the query heads of a KV head (block x =
// KV head j times ceil(rep / HB) plus the head group), computed by the RA_CHUNK threads t = 0..
// of barrier `bar` (block-uniform early return past the row's keys). The block staged the K
// and V rows of slots c * RA_CHUNK + k, k < staged, in shared memory (ksh, vsh; staged = 0:
// none): a key of the chunk that lies in the row's leading run (list index = slot) and was
// staged is read there, every other key from the caches. The values and the order of every
// operation are the same either way, so the row gets the same bits. STAGING false: no block
// stages (staged is 0).
// Each head's arithmetic is the same whichever heads share its block, so HB changes no bits.
template <int HD, int HB, bool STAGING>
__device__ __forceinline__ void rows_attention_row(
    const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
    const uint32_t* __restrict__ meta, const uint32_t* __restrict__ extra,
    float* __restrict__ part, int heads, int kv, int n, int cap, int max_extra, int chunks,
    float scale, int r, int c, int t, int bar, float (*qs)[HD], float (*prob)[RA_CHUNK],
    int* slot, float (*red)[RA_MAX_REP], float (*vsum)[HD], const bf16* ksh, const bf16* vsh,
    int staged) {
    constexpr int PER = HD / WARP;  // values of a V row per lane
    const int rep = heads / kv;
    const int groups = (rep + HB - 1) / HB;
    const int j = blockIdx.x / groups, h0 = blockIdx.x % groups * HB;
    const int nh = min(HB, rep - h0);
    const int lane = t % WARP, warp = t / WARP;
    const int lead = (int)meta[2 * r];
    const ListedKeys keys{lead, lead + (int)meta[2 * r + 1], extra + (size_t)r * max_extra};
    if (c * RA_CHUNK >= keys.len) return;  // past this row's keys: the merge never reads it
    // The block's query heads' values, 8 a load, all loads issued before any is used; heads
    // past nh are zero (their scores are computed and dropped).
    constexpr int QW = HB * HD / 8;  // 16-byte words of HB heads
#pragma unroll
    for (int e0 = 0; e0 < QW; e0 += RA_CHUNK) {
        const int e = e0 + t;
        if (e < QW) {
            const int hh = e / (HD / 8), d0 = e % (HD / 8) * 8;
            uint4 word = make_uint4(0, 0, 0, 0);
            if (hh < nh)
                word = *reinterpret_cast<const uint4*>(
                    q + ((size_t)(j * rep + h0 + hh) * n + r) * HD + d0);
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
    float s[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) s[h] = -INFINITY;
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
        float d[HB];
#pragma unroll
        for (int h = 0; h < HB; ++h) d[h] = 0.f;
#pragma unroll
        for (int w = 0; w < HD / 8; ++w) {
            const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&words[w]);
            float2 f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) f[e] = __bfloat1622float2(k2[e]);
#pragma unroll
            for (int h = 0; h < HB; ++h) {
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
        for (int h = 0; h < HB; ++h)
            if (h < nh) s[h] = d[h] * scale;
    }
    // Chunk maximum per head: each warp's, then warp 0's and warp 1's.
    float mx[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        mx[h] = warp_max(s[h]);
        if (lane == 0) red[warp][h] = mx[h];
    }
    ra_sync(bar);
#pragma unroll
    for (int h = 0; h < HB; ++h) mx[h] = fmaxf(red[0][h], red[1][h]);
    ra_sync(bar);
    float sum[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        const float p = valid && h < nh ? __expf(s[h] - mx[h]) : 0.f;
        prob[h][t] = p;
        sum[h] = warp_sum(p);
        if (lane == 0) red[warp][h] = sum[h];
    }
    ra_sync(bar);
    // V: warp w takes keys w, w + 2, ...; lane owns values lane * PER .. + PER of every head.
    float acc[HB][PER];
#pragma unroll
    for (int h = 0; h < HB; ++h)
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
            for (int h = 0; h < HB; ++h) {
                if (h >= nh) break;
                const float p = prob[h][k];
#pragma unroll
                for (int e = 0; e < PER; ++e) acc[h][e] = fmaf(p, v[u][e], acc[h][e]);
            }
        }
    }
    if (warp == 1) {
#pragma unroll
        for (int h = 0; h < HB; ++h)
#pragma unroll
            for (int e = 0; e < PER; ++e) vsum[h][lane * PER + e] = acc[h][e];
    }
    ra_sync(bar);
    if (warp == 0) {
#pragma unroll
        for (int h = 0; h < HB; ++h) {
            if (h >= nh) break;
            float* out = part + (((size_t)r * heads + j * rep + h0 + h) * chunks + c) * (HD + 2);
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
template <int HD, int HB>
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
    rows_attention_row<HD, HB, false>(q, kc, vc, meta, extra, part, heads, kv, n, cap,
                                      max_extra, chunks, scale, blockIdx.y, blockIdx.z,
                                      threadIdx.x, 0, qs, prob, slot, red, vsum, nullptr, nullptr,
                                      0);
}

// rows_attention_part for the stacked rows of several sessions: row r reads the K/V caches
// of its session rows[2r] at layer `layer` from the session table (caches, caps; see
// session_caches in rope.cu); meta / extra are the stacked rows' PassKeys, q (heads, n, HD)
// and part (n, heads, chunks, HD + 2) as there. Each row runs rows_attention_row exactly as
// rows_attention_part does for its session alone. Grid (kv, n, chunks), RA_CHUNK threads.
template <int HD, int HB>
__device__ void sessions_attention_part(const bf16* __restrict__ q,
                                        const uint32_t* __restrict__ rows,
                                        const unsigned long long* __restrict__ caches,
                                        const uint32_t* __restrict__ caps,
                                        const uint32_t* __restrict__ meta,
                                        const uint32_t* __restrict__ extra,
                                        float* __restrict__ part, int heads, int kv, int n,
                                        int max_extra, int chunks, float scale, int layer,
                                        int sessions) {
    __shared__ __align__(16) float qs[RA_MAX_REP][HD];
    __shared__ float prob[RA_MAX_REP][RA_CHUNK];
    __shared__ int slot[RA_CHUNK];
    __shared__ float red[2][RA_MAX_REP];
    __shared__ float vsum[RA_MAX_REP][HD];
    const int r = blockIdx.y;
    const SessionCaches sc = session_caches(caches, caps, layer, sessions, (int)rows[2 * r]);
    rows_attention_row<HD, HB, false>(q, sc.k, sc.v, meta, extra, part, heads, kv, n, sc.cap,
                                      max_extra, chunks, scale, r, blockIdx.z, threadIdx.x, 0,
                                      qs, prob, slot, red, vsum, nullptr, nullptr, 0);
}

#define SA_PART_ARGS                                                                            \
    const bf16 *__restrict__ q, const uint32_t *__restrict__ rows,                              \
        const unsigned long long *__restrict__ caches, const uint32_t *__restrict__ caps,       \
        const uint32_t *__restrict__ meta, const uint32_t *__restrict__ extra,                  \
        float *__restrict__ part, int heads, int kv, int n, int max_extra, int chunks,          \
        float scale, int layer, int sessions, int hb

// Calls F<HB> for the heads a block hb (1, 2, 4 or 8; block-uniform).
#define RA_HEADS(F, ...)                  \
    switch (hb) {                         \
        case 1: F<1>(__VA_ARGS__); break; \
        case 2: F<2>(__VA_ARGS__); break; \
        case 4: F<4>(__VA_ARGS__); break; \
        default: F<8>(__VA_ARGS__); break; \
    }

#define SA_PART_CALL q, rows, caches, caps, meta, extra, part, heads, kv, n, max_extra, chunks, \
                     scale, layer, sessions
template <int HB>
__device__ void sa_part64(SA_PART_ARGS) { sessions_attention_part<64, HB>(SA_PART_CALL); }
template <int HB>
__device__ void sa_part128(SA_PART_ARGS) { sessions_attention_part<128, HB>(SA_PART_CALL); }

extern "C" __global__ void specsplit_sessions_attention_part_bf16_hd64(SA_PART_ARGS) {
    pdl_enter();
    RA_HEADS(sa_part64, SA_PART_CALL, hb)
}

extern "C" __global__ void specsplit_sessions_attention_part_bf16_hd128(SA_PART_ARGS) {
    pdl_enter();
    RA_HEADS(sa_part128, SA_PART_CALL, hb)
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
template <int HD, int HB>
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
    const int j = blockIdx.x / ((heads / kv + HB - 1) / HB), c = blockIdx.z;
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
    rows_attention_row<HD, HB, true>(q, kc, vc, meta, extra, part, heads, kv, n, cap,
                                     max_extra, chunks, scale, r0 + g, c, t, 1 + g, sc.qs,
                                     sc.prob, sc.slot, sc.red, vsum, ksh, vsh, staged);
}

#define RA_PART_ARGS                                                                             \
    const bf16 *__restrict__ q, const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,        \
        const uint32_t *__restrict__ meta, const uint32_t *__restrict__ extra,                   \
        float *__restrict__ part, int heads, int kv, int n, int cap, int max_extra, int chunks, \
        float scale

#define RA_PART_CALL q, kc, vc, meta, extra, part, heads, kv, n, cap, max_extra, chunks, scale
template <int HB>
__device__ void ra_part64(RA_PART_ARGS, int) { rows_attention_part<64, HB>(RA_PART_CALL); }
template <int HB>
__device__ void ra_part128(RA_PART_ARGS, int) { rows_attention_part<128, HB>(RA_PART_CALL); }
template <int HB>
__device__ void ra_staged64(RA_PART_ARGS, int group) {
    rows_attention_staged<64, HB>(RA_PART_CALL, group);
}
template <int HB>
__device__ void ra_staged128(RA_PART_ARGS, int group) {
    rows_attention_staged<128, HB>(RA_PART_CALL, group);
}

extern "C" __global__ void specsplit_rows_attention_part_bf16_hd64(RA_PART_ARGS, int hb) {
    pdl_enter();
    RA_HEADS(ra_part64, RA_PART_CALL, 1)
}

extern "C" __global__ void specsplit_rows_attention_part_bf16_hd128(RA_PART_ARGS, int hb) {
    pdl_enter();
    RA_HEADS(ra_part128, RA_PART_CALL, 1)
}

extern "C" __global__ void specsplit_rows_attention_staged_bf16_hd64(RA_PART_ARGS, int group,
                                                                     int hb) {
    pdl_enter();
    RA_HEADS(ra_staged64, RA_PART_CALL, group)
}

extern "C" __global__ void specsplit_rows_attention_staged_bf16_hd128(RA_PART_ARGS, int group,
                                                                      int hb) {
    pdl_enter();
    RA_HEADS(ra_staged128, RA_PART_CALL, group)
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
