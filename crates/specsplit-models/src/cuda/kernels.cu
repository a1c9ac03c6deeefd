// Fused bf16 kernels for one-token decoding (specsplit-models, feature `cuda`).
//
// build.rs compiles this file to PTX with nvcc; src/fused/cuda.rs loads and launches it. Every
// kernel accumulates in f32 and rounds to bf16 where the unfused candle ops round, so a fused step
// stays within bf16 rounding of the unfused one (tests/fused_kernels.rs checks that on a GPU).
// Nothing here synchronises with the host: positions are read from device memory, so a step
// built from these kernels can be captured into a CUDA graph and replayed.
//
// cache.cu moves cache entries (a pre-draft keeping its selected branch's rows).
//
// draft_attention.cu holds the one-kernel attention of a draft's passes (which need no batch
// invariance). rows_attention.cu and bi_matmul.cu hold the batch-invariant kernels (rows attention,
// tensor-core matmul) that every dense bf16 pass of up to 64 rows runs: each computes a row's result in an order that
// does not depend on the other rows of the pass.
//
// The kernels live in one file per family, included here in this order so that the PTX is one
// module.

#include "common.cuh"
#include "gemv.cu"
#include "norm.cu"
#include "rope.cu"
#include "attention.cu"
#include "rows_attention.cu"
#include "draft_attention.cu"
#include "bi_matmul.cu"
#include "elementwise.cu"
#include "cache.cu"
