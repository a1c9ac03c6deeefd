// Matrix-vector products of the one-token step (one to four rows).
#pragma once
#include "common.cuh"

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
