// Problem constants (head counts, head_dim), the portable kernel's tile sizes, and Params:
// the arguments both kernels read. Part of attention_kernel.cuh (the overview is there).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace gqa_prefill {

constexpr int kNumHeads = 32;
constexpr int kNumKvHeads = 8;
constexpr int kGroupSize = kNumHeads / kNumKvHeads;  // query head h reads KV head h / 4
constexpr int kHeadDim = 128;
constexpr int kBlockM = 128;                      // rows per CTA (token, head) pairs
constexpr int kTokensPerTile = kBlockM / kGroupSize;  // 32 query tokens per CTA
// Keys per K/V tile of the portable kernel (the Hopper kernel's: hopper_knobs.cuh).
constexpr int kPortableBlockN = 64;
constexpr int kNumWarps = 8;                      // 16 rows each
constexpr int kNumThreads = kNumWarps * 32;
// Shared-memory rows padded by 8 elements (16 bytes): the 8 row addresses of an ldmatrix
// phase then fall on distinct banks.
constexpr int kSmemStride = kHeadDim + 8;
constexpr int kChunksPerRow = kHeadDim * 2 / 16;  // 16-byte chunks per 128-element row
// The portable kernel's dynamic shared memory: Q, K, V (the Hopper kernel's: HopperSmem).
constexpr size_t kPortableSmemBytes = size_t(kBlockM + 2 * kPortableBlockN) * kSmemStride * 2;

static_assert(kBlockM == kNumWarps * 16, "each warp owns one m16 row block");
static_assert(kHeadDim % 16 == 0 && kPortableBlockN % 16 == 0,
              "fragment loops assume multiples of 16");

struct Params {
  const void* q;  // [tokens, 32, 128], tokens q_stride elements apart
  const void* k;  // [tokens, 8, 128], tokens k_stride elements apart
  const void* v;  // like k, v_stride
  int q_stride, k_stride, v_stride;
  void* out;        // [tokens, 32, 128], contiguous
  float* lse;       // [tokens, 32] base-2 log-sum-exp, or nullptr (padded definition)
  const int* qo_indptr;  // ragged only: [batch + 1]
  const int* kv_indptr;
  int batch;
  int seq_q;   // padded only: rows per sequence
  int seq_kv;
  int tiles_per_seq;  // padded only: cdiv(seq_q, kTokensPerTile)
  int total_q;   // ragged only: clamps for indptr values
  int total_kv;
  float scale_log2;  // sm_scale * log2(e): softmax runs in base 2 (exp2)
  int window_left;   // sliding-window kernels only (KeyBand): 0 <= window_left < total_kv
};

// Element offset of token `row` (>= 0) of a tensor whose tokens are `stride` elements apart:
// one 32 x 32 -> 64-bit multiply.
__device__ __forceinline__ uint64_t token_offset(int row, int stride) {
  return uint64_t(uint32_t(row)) * uint32_t(stride);
}

// Paged K/V (the gqa_paged definitions): Params' k and v are the caches [num_pages, page_size,
// 8, 128], kv_indptr indexes kv_indices (total_kv = num_kv_indices), and a sequence's keys are
// found through its pages (kv_paged.cuh).
struct PageTable {
  const int* kv_indices;     // page ids
  const int* last_page_len;  // [batch] keys on each sequence's last page; nullptr for page size 1
  int num_pages;             // ids outside [0, num_pages) are never dereferenced
  float v_scale;             // FP8 caches only (PagedFp8Kv): the output's factor (real V / cache)
  int64_t k_page_stride;     // elements from one page of k_cache to the next
  int64_t v_page_stride;
};

// The portable kernel's parameters for a paged batch.
struct PagedParams {
  Params p;
  PageTable pages;
};

}  // namespace gqa_prefill
