// Residual add with RMSNorm.
#pragma once
#include "common.cuh"

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
