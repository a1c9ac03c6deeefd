// Rotary embedding of the fused Q|K|V rows with the K/V cache write.
#pragma once
#include "common.cuh"

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

// Thread i (< hd / 2) of head h of one row: the fused Q|K|V values `src` of the row (heads +
// 2 * kv heads of hd values) → rotary on Q and K at position p, the query head written to
// q_dst (its hd values), K and V written into the caches (kv, cap, hd) at `slot` (in
// 0..cap). The body both rows kernels run, so a row gets the same bits from either.
__device__ __forceinline__ void qkv_rope_row_head(const bf16* __restrict__ src,
                                                  const bf16* __restrict__ cos_t,
                                                  const bf16* __restrict__ sin_t, uint32_t p,
                                                  int slot, bf16* __restrict__ kc,
                                                  bf16* __restrict__ vc, bf16* __restrict__ q_dst,
                                                  int heads, int kv, int hd, int cap,
                                                  int interleaved, int h, int i) {
    const int half = hd / 2;
    src += (size_t)h * hd;
    if (h >= heads + kv) {
        bf16* dst = vc + ((size_t)(h - heads - kv) * cap + slot) * hd;
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
    bf16* dst = h < heads ? q_dst : kc + ((size_t)(h - heads) * cap + slot) * hd;
    dst[a] = __float2bfloat16(x1 * c - x2 * s);
    dst[b] = __float2bfloat16(x1 * s + x2 * c);
}

// The n rows of one pass: row r's fused Q|K|V (heads + 2 * kv heads of hd values, rows
// contiguous) → rotary on Q and K at positions[r], Q written to q_out (heads, n, hd), K and V
// written into the caches (kv, cap, hd) at slot past + r, or at slot slots[r] when past is
// negative (slots read on the device, so that a captured graph serves every round: a chain's
// slots are its positions, a forest's nodes sit at slots apart from their positions). Grid
// (heads + 2 * kv, n), hd / 2 threads. Each value is computed from its own row alone.
extern "C" __global__ void specsplit_qkv_rope_rows_bf16(
    const bf16* __restrict__ qkv, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
    const uint32_t* __restrict__ positions, const uint32_t* __restrict__ slots,
    bf16* __restrict__ kc, bf16* __restrict__ vc, bf16* __restrict__ q_out, int heads, int kv,
    int hd, int cap, int n, int past, int interleaved) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y;
    const int i = threadIdx.x;
    if (i >= hd / 2) return;
    const int slot = past >= 0 ? past + r : (int)slots[r];
    if (slot < 0 || slot >= cap) return;  // the host checks capacity; never write past it
    qkv_rope_row_head(qkv + (size_t)r * (heads + 2 * kv) * hd, cos_t, sin_t, positions[r], slot,
                      kc, vc, q_out + ((size_t)h * n + r) * hd, heads, kv, hd, cap, interleaved,
                      h, i);
}

// The K and V caches of session s at layer l in a pass's session table: `caches` is (layers,
// sessions, 2) device addresses (K, then V, each (kv, caps[s], hd) bf16).
struct SessionCaches {
    bf16* k;
    bf16* v;
    int cap;
};

__device__ __forceinline__ SessionCaches session_caches(const unsigned long long* __restrict__ caches,
                                                        const uint32_t* __restrict__ caps,
                                                        int layer, int sessions, int s) {
    const unsigned long long* e = caches + ((size_t)layer * sessions + s) * 2;
    return SessionCaches{reinterpret_cast<bf16*>(e[0]), reinterpret_cast<bf16*>(e[1]),
                         (int)caps[s]};
}

// The n rows of several sessions' pass, stacked: row r belongs to session rows[2r] and writes
// its K and V at slot rows[2r + 1] of that session's caches of layer `layer` (looked up in the
// session table `caches`, `caps`); otherwise as specsplit_qkv_rope_rows_bf16 (Q to q_out
// (heads, n, hd), rotary at positions[r]), with the same per-row body. Grid (heads + 2 * kv,
// n), hd / 2 threads.
extern "C" __global__ void specsplit_qkv_rope_sessions_bf16(
    const bf16* __restrict__ qkv, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
    const uint32_t* __restrict__ positions, const uint32_t* __restrict__ rows,
    const unsigned long long* __restrict__ caches, const uint32_t* __restrict__ caps,
    bf16* __restrict__ q_out, int heads, int kv, int hd, int n, int layer, int sessions,
    int interleaved) {
    pdl_enter();
    const int h = blockIdx.x, r = blockIdx.y;
    const int i = threadIdx.x;
    if (i >= hd / 2) return;
    const SessionCaches sc = session_caches(caches, caps, layer, sessions, (int)rows[2 * r]);
    const int slot = (int)rows[2 * r + 1];
    if (slot < 0 || slot >= sc.cap) return;  // the host checks capacity; never write past it
    qkv_rope_row_head(qkv + (size_t)r * (heads + 2 * kv) * hd, cos_t, sin_t, positions[r], slot,
                      sc.k, sc.v, q_out + ((size_t)h * n + r) * hd, heads, kv, hd, sc.cap,
                      interleaved, h, i);
}
