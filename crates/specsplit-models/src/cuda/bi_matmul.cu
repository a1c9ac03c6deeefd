#pragma once
#include "common.cuh"

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
// steps, whichever rows and columns share them. bi_tile_steps: one row tile's steps of a chunk.
template <int NT>
__device__ __forceinline__ void bi_tile_steps(const uint4& lo, const uint4& hi,
                                              const uint4 (&b)[NT], float (&acc)[NT][4]) {
#pragma unroll
    for (int s = 0; s < NT; ++s) mma_bf16(acc[s], lo.x, hi.x, lo.y, hi.y, b[s].x, b[s].y);
#pragma unroll
    for (int s = 0; s < NT; ++s) mma_bf16(acc[s], lo.z, hi.z, lo.w, hi.w, b[s].z, b[s].w);
}

// A chunk for MT row tiles, each tile's x fragments loaded just before its steps.
template <int MT, int NT>
__device__ __forceinline__ void bi_chunk(const uint4* const (&xa)[4][2], int c,
                                         const uint4 (&b)[NT], float (&acc)[4][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const uint4 lo = __ldg(xa[i][0] + c * 4), hi = __ldg(xa[i][1] + c * 4);
        bi_tile_steps<NT>(lo, hi, b, acc[i]);
    }
}

// The same chunk with x's fragments already in registers (xr[i]: lo, hi of row tile i): the
// same mma steps in the same order.
template <int MT, int NT>
__device__ __forceinline__ void bi_chunk_regs(const uint4 (&xr)[MT][2], const uint4 (&b)[NT],
                                              float (&acc)[4][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) bi_tile_steps<NT>(xr[i][0], xr[i][1], b, acc[i]);
}

// Chunks [c0, c1) into acc, U weight chunks in flight per lane (U changes only how far the
// loads run ahead, never the order of the mma steps). The first group's weights are loaded
// before waiting for the kernel that writes x (weights are constant), and a last, partial
// group's loads are issued together. With XA the group's x fragments are loaded with its
// weights, before any of its steps; else each chunk loads them as its steps take them.
template <int MT, int NT, int U, bool XA>
__device__ void bi_accumulate(const uint4* const (&xa)[4][2], const uint4* const (&wb)[NT],
                              int c0, int c1, float (&acc)[4][NT][4]) {
    uint4 b[U][NT];
    uint4 xr[XA ? U : 1][MT][2];
    auto load = [&](int c) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int s = 0; s < NT; ++s)
                if (c + u < c1) b[u][s] = load_stream(wb[s] + (c + u) * 4);
    };
    auto load_x = [&](int c) {
        if constexpr (XA) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < MT; ++i)
                    if (c + u < c1) {
                        xr[u][i][0] = __ldg(xa[i][0] + (c + u) * 4);
                        xr[u][i][1] = __ldg(xa[i][1] + (c + u) * 4);
                    }
        }
    };
    load(c0);
    pdl_enter();
    load_x(c0);
    for (int c = c0; c < c1; c += U) {
        if (c != c0) {
            load(c);
            load_x(c);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c + u < c1) {
                if constexpr (XA) {
                    bi_chunk_regs<MT, NT>(xr[u], b[u], acc);
                } else {
                    bi_chunk<MT, NT>(xa, c + u, b[u], acc);
                }
            }
    }
}

// The block's tile: NT * 8 columns from n0, up to BI_ROWS rows from m0. Warp w takes chunks
// [chunks * w / splits, chunks * (w + 1) / splits); the warps' partial sums are added in warp
// order in `red` (shared, 16 * MT * NT * 8 floats).
template <int MT, int NT, int U, bool XA = false>
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
    bi_accumulate<MT, NT, U, XA>(xa, wb, c0, c1, acc);
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

// ---------------------------------------------------------------------------------------------
// The same product through one entry a row-tile count MT (1 to 4: ceil(min(m, BI_ROWS) / 16)),
// with 2 column tiles of 8 a warp and 4 weight chunks in flight: each entry takes the registers
// its tiles need (89 to 124 registers compiled for sm_90a, against 244 for the entry above, which holds every
// tiling), so more warps share an SM. Same grid as above with nt = 2, same arguments but nt and
// deep, and the same bits: an output's mma.sync steps do not depend on the entry.
// The entries named ..._lean_xa_... load a group's x fragments with its weights
// (bi_accumulate with XA): the same bits.
#define BI_LEAN(NAME, MT, XA)                                                                    \
    extern "C" __global__ void NAME(const bf16* __restrict__ x, const bf16* __restrict__ w,      \
                                    const bf16* __restrict__ bias, bf16* __restrict__ y, int m,  \
                                    int n, int k, int splits) {                                  \
        extern __shared__ float red[];                                                           \
        const int n0 = blockIdx.x * 16, m0 = blockIdx.y * BI_ROWS;                               \
        bi_tile<MT, 2, 4, XA>(x, w, bias, y, m, n, k, splits, n0, m0, min(BI_ROWS, m - m0),     \
                              red);                                                              \
    }
BI_LEAN(specsplit_bi_matmul_lean_bf16_m1, 1, false)
BI_LEAN(specsplit_bi_matmul_lean_bf16_m2, 2, false)
BI_LEAN(specsplit_bi_matmul_lean_bf16_m3, 3, false)
BI_LEAN(specsplit_bi_matmul_lean_bf16_m4, 4, false)
BI_LEAN(specsplit_bi_matmul_lean_xa_bf16_m1, 1, true)
BI_LEAN(specsplit_bi_matmul_lean_xa_bf16_m2, 2, true)
BI_LEAN(specsplit_bi_matmul_lean_xa_bf16_m3, 3, true)
BI_LEAN(specsplit_bi_matmul_lean_xa_bf16_m4, 4, true)
#undef BI_LEAN
