// The epilogue shared by both kernels: normalize rows and write lse (normalize_rows), then
// 16-byte coalesced stores of staged rows (copy_rows_out); the portable kernel's staging.
#pragma once

#include "ptx_sm80.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

// Rows that must come back NaN (a paged item that met a page id out of range): normalize_rows
// then writes NaN outputs (NaN x 1 / 4) and NaN lse (NaN + log2 4).
template <int kDB>
__device__ __forceinline__ void poison_rows(float (&acc)[kDB][4], float (&row_max)[2],
                                            float (&row_sum)[2]) {
  const float nan = __int_as_float(0x7fffffff);
#pragma unroll
  for (int db = 0; db < kDB; ++db) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[db][j] = nan;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_max[h] = nan;
    row_sum[h] = 1.f;
  }
}

// A K/V source with scaled values (FP8 caches: V = v_cache x v_scale) scales O by its factor
// before the epilogue; lse is not affected.
template <int kDB>
__device__ __forceinline__ void scale_output(float (&acc)[kDB][4], float factor) {
#pragma unroll
  for (int db = 0; db < kDB; ++db) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[db][j] *= factor;
  }
}

// Epilogue, first half: normalizes the lane's two rows (16 warp + group + 8 h of the tile),
// writes their lse and hands each packed pair of outputs (row, n8 block db) to `stage`, which
// puts it where the second half (copy_rows_out) reads it.
template <typename T, typename StagePair>
__device__ __forceinline__ void normalize_rows(const Params& p, const TileCoords& t, int kv_head,
                                               const float (&acc)[kHeadDim / 8][4],
                                               const float (&row_max)[2],
                                               const float (&row_sum)[2], int warp, int lane,
                                               StagePair stage) {
  using Ops = ElementOps<T>;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = row_sum[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    // A row with no visible key -> 0; a NaN sum (a NaN key: page size 1's gathered bad page)
    // -> NaN, output and lse (!= 0, not > 0).
    const float inv = total != 0.f ? 1.f / total : 0.f;
    const int row = warp * 16 + group + 8 * h;
#pragma unroll
    for (int db = 0; db < kHeadDim / 8; ++db) {
      stage(row, db, Ops::pack(acc[db][2 * h] * inv, acc[db][2 * h + 1] * inv));
    }
    if (p.lse != nullptr && quad_lane == 0) {
      const int token = row / kGroupSize;
      if (token < t.tile_tokens) {
        p.lse[int64_t(t.q_row0 + token) * kNumHeads + kv_head * kGroupSize + row % kGroupSize] =
            total != 0.f ? row_max[h] + log2f(total) : -INFINITY;
      }
    }
  }
}

// Epilogue, second half: kThreads threads copy staged rows [row0, row0 + kRows) of the tile
// to out in 16-byte coalesced stores (load(row, chunk) reads 16-byte chunk `chunk` of a
// staged row); rows of tokens past the tile's end are not written.
template <typename T, int kRows, int kThreads, typename LoadChunk>
__device__ __forceinline__ void copy_rows_out(const Params& p, const TileCoords& t, int kv_head,
                                              int row0, int thread, LoadChunk load) {
  T* out_tile = static_cast<T*>(p.out) +
                (int64_t(t.q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
    const int idx = thread + i * kThreads;
    const int row = row0 + idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const int token = row / kGroupSize;
    if (token < t.tile_tokens) {
      *reinterpret_cast<uint4*>(out_tile +
                                (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim +
                                chunk * 8) = load(row, chunk);
    }
  }
}

// The portable kernel's epilogue for warp `warp`: stages its 16 rows in its own rows of
// `stage` (128 rows of kSmemStride elements, free for it).
template <typename T>
__device__ __forceinline__ void write_output(const Params& p, const TileCoords& t, int kv_head,
                                             const float (&acc)[kHeadDim / 8][4],
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             T* stage, int warp, int lane) {
  const int quad_lane = lane % 4;
  normalize_rows<T>(p, t, kv_head, acc, row_max, row_sum, warp, lane,
                    [&](int row, int db, uint32_t pair) {
                      *reinterpret_cast<uint32_t*>(stage + row * kSmemStride + db * 8 +
                                                   quad_lane * 2) = pair;
                    });
  __syncwarp();
  copy_rows_out<T, 16, 32>(p, t, kv_head, warp * 16, lane, [&](int row, int chunk) {
    return *reinterpret_cast<const uint4*>(stage + row * kSmemStride + chunk * 8);
  });
}

}  // namespace gqa_prefill
