// Moving cache entries: the rows a pre-draft's growth computed for the branch a verdict
// selected, moved into the sequence.
#pragma once
#include "common.cuh"

#define MOVE_MAX 8

// Copies entry moves[i] to entry moves[n + i] (i < n <= MOVE_MAX) of each of the nbufs
// (1, kv, capacity, head_dim) bf16 buffers whose addresses `bufs` lists (two u32 words each, low
// first). A thread takes one bf16 pair of one head of one buffer and reads it at every source
// before it writes any destination, so sources and destinations may overlap.
extern "C" __global__ void specsplit_move_entries_bf16(const uint32_t* __restrict__ bufs,
                                                       int nbufs,
                                                       const uint32_t* __restrict__ moves, int n,
                                                       int kv, int capacity, int head_dim) {
    pdl_enter();
    const int pairs = head_dim / 2;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)nbufs * kv * pairs || n > MOVE_MAX) return;
    const int b = (int)(i / ((size_t)kv * pairs));
    const int h = (int)((i / pairs) % kv);
    const int c = (int)(i % pairs);
    const uint64_t addr = (uint64_t)bufs[2 * b] | ((uint64_t)bufs[2 * b + 1] << 32);
    uint32_t* head = reinterpret_cast<uint32_t*>(addr) + (size_t)h * capacity * pairs + c;
    uint32_t vals[MOVE_MAX];
    for (int m = 0; m < n; ++m) vals[m] = head[(size_t)moves[m] * pairs];
    for (int m = 0; m < n; ++m) head[(size_t)moves[n + m] * pairs] = vals[m];
}
