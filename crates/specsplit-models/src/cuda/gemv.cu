// Matrix-vector products of the one-token step (one to four rows).
#pragma once
#include "common.cuh"

// y[j][r] = W[r, :] . x[j] (+ bias[r]) for r < n and each of the R rows x[j] of x (R, k):
// matrix-vector products for steps of one to a few tokens. W is (n, k) row-major, k % 8 == 0,
// rows 16-byte aligned; x is (R, k) contiguous. One warp per NR (1 or 2) rows of W; each lane
// takes a row's 16-byte words in groups of four (words i, i + WARP, i + 2 WARP, i + 3 WARP),
// every load of a group issued before any is used (the last group has the words that exist),
// each weight word loaded once for all R rows of x. Row j's sums run in the same order whatever
// R is, so its result is the one-row product's, bit for bit.

// Loads the words of the group at i that lie below k8 (the others are zero and never used).
__device__ __forceinline__ void gemv_load4(const uint4* __restrict__ wr, int i, int k8,
                                           uint4 (&w)[4]) {
#pragma unroll
    for (int u = 0; u < 4; ++u)
        w[u] = i + u * WARP < k8 ? load_stream(wr + i + u * WARP) : make_uint4(0, 0, 0, 0);
}

// Adds the group's weight words of each of the NR rows of W times the same words of each of
// the R rows of x (k8 words a row) to that pair's four sums, word u to sum u: every word where
// FULL, else those below k8. Every row's words of x are loaded before any is summed, so that
// their loads are in flight together rather than one after another.
template <int R, int NR, bool FULL>
__device__ __forceinline__ void gemv_add4(const uint4 (&w)[NR][4], const uint4* __restrict__ xr,
                                          int k8, int i, float (&a)[NR][4][R]) {
    uint4 xv[R][4];
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
        for (int u = 0; u < 4; ++u)
            xv[j][u] = FULL || i + u * WARP < k8 ? __ldg(xr + (size_t)j * k8 + i + u * WARP)
                                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < R; ++j)
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (FULL || i + u * WARP < k8) a[r][u][j] += dot8(w[r][u], xv[j][u]);
}

// NR rows of W a warp (rows warp·NR .. warp·NR + NR - 1): the warp loads each group's words of
// its NR rows of W together and each input word once for all of them. A row's sums run in the
// same order whatever NR is, so NR changes the speed only, never a bit. With NR = 1 the loads
// of the next group are issued before the group before it is summed (two groups in flight);
// with more rows a warp already has NR groups in flight.
template <int R, int NR>
__device__ __forceinline__ void gemv_rows(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                          const bf16* __restrict__ bias, bf16* __restrict__ y,
                                          int n, int k) {
    const int row0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * NR;
    const int lane = threadIdx.x % WARP;
    if (row0 >= n) {
        pdl_enter();
        return;
    }
    const int k8 = k / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    // Rows past n (the last warp's) read row n - 1 again and store nothing.
    const uint4* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = NR == 1 ? row0 : min(row0 + r, n - 1);
        wr[r] = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    }
    float a[NR][4][R];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int j = 0; j < R; ++j) a[r][u][j] = 0.f;
    // The first group's weights are loaded before waiting for the kernel that writes x
    // (weights are constant).
    uint4 wg[NR][4];
    int i = lane;
    if (i < k8)
#pragma unroll
        for (int r = 0; r < NR; ++r) gemv_load4(wr[r], i, k8, wg[r]);
    pdl_enter();
    while (i < k8) {
        const int next = i + 4 * WARP;
        uint4 wn[4];
        if constexpr (NR == 1)
            if (next < k8) gemv_load4(wr[0], next, k8, wn);
        // Whole for every lane of the warp (a warp-uniform branch): lane 31's last word exists.
        if (i - lane + 4 * WARP <= k8) {
            gemv_add4<R, NR, true>(wg, xr, k8, i, a);
        } else {
            gemv_add4<R, NR, false>(wg, xr, k8, i, a);
        }
        if (next >= k8) break;
        if constexpr (NR == 1) {
#pragma unroll
            for (int u = 0; u < 4; ++u) wg[0][u] = wn[u];
        } else {
#pragma unroll
            for (int r = 0; r < NR; ++r) gemv_load4(wr[r], next, k8, wg[r]);
        }
        i = next;
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int row = row0 + r;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            float acc = warp_sum((a[r][0][j] + a[r][1][j]) + (a[r][2][j] + a[r][3][j]));
            if (lane == 0 && (NR == 1 || row < n)) {
                // The unfused path rounds the product to bf16 before adding the bias.
                if (bias != nullptr) acc = round_bf16(acc) + __bfloat162float(bias[row]);
                y[(size_t)j * n + row] = __float2bfloat16(acc);
            }
        }
    }
}

#define GEMV_ROWS_KERNEL(NAME, R, NR)                                                         \
    extern "C" __global__ void NAME(const bf16* __restrict__ w, const bf16* __restrict__ x,   \
                                    const bf16* __restrict__ bias, bf16* __restrict__ y,      \
                                    int n, int k) {                                           \
        gemv_rows<R, NR>(w, x, bias, y, n, k);                                                \
    }
// Each row count (1 to 4) with 1 or 2 rows of W a warp (`_w2`).
#define GEMV_ROWS_KERNELS(NAME, R)                                                            \
    GEMV_ROWS_KERNEL(NAME, R, 1)                                                              \
    GEMV_ROWS_KERNEL(NAME##_w2, R, 2)
GEMV_ROWS_KERNELS(specsplit_gemv_bf16, 1)
GEMV_ROWS_KERNELS(specsplit_gemv_rows2_bf16, 2)
GEMV_ROWS_KERNELS(specsplit_gemv_rows3_bf16, 3)
GEMV_ROWS_KERNELS(specsplit_gemv_rows4_bf16, 4)
