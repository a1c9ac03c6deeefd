// Shared by every kernel family: the bf16 type, programmatic dependent launch, warp and block
// reductions, and bf16 loads and rounding.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define WARP 32

// Programmatic dependent launch (sm_90 and later; src/fused/cuda.rs sets the launch attribute
// only where this PTX has it). A kernel launched that way may start while the kernel before it in the
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
