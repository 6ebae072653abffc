// Masking of logits (sequence end, bottom-right causal limit) and the online softmax in base 2,
// on the m16n8 accumulator layout. Shared by both kernels.
#pragma once

#include "tile_schedule.cuh"

namespace gqa_prefill {

// S (this lane's part of 16 rows x kNB * 8 keys from key0, accumulator layout): logits of
// keys a row does not see become -inf. Only tiles crossing the end of the sequence or the
// tile's first causal limit need it. row_token: the lane's first row's token; its second row
// (8 rows further) is 2 tokens later.
template <bool kCausal, int kNB>
__device__ __forceinline__ void mask_tile(float (&s)[kNB][4], const TileCoords& t, int key0,
                                          int row_token, int quad_lane) {
  const bool needs_mask = key0 + kNB * 8 > t.seq_kv ||
                          (kCausal && key0 + kNB * 8 - 1 > t.tok0 + t.causal_offset);
  if (needs_mask) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Last visible key of this row, relative to key0.
      int limit = t.seq_kv - 1 - key0;
      if constexpr (kCausal) {
        limit = min(limit, row_token + h * (8 / kGroupSize) + t.causal_offset - key0);
      }
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (nb * 8 + quad_lane * 2 + e > limit) s[nb][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

// The portable kernel's logits: scaled to base 2 first, then masked, so that any finite
// sm_scale (negative too) is safe; its softmax then runs with scale 1.
template <bool kCausal, int kNB>
__device__ __forceinline__ void scale_and_mask(float (&s)[kNB][4], float scale_log2,
                                               const TileCoords& t, int key0, int row_token,
                                               int quad_lane) {
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[nb][j] *= scale_log2;
  }
  mask_tile<kCausal>(s, t, key0, row_token, quad_lane);
}

// Online softmax over one tile of masked logits s, per row h (lane holds columns 2q, 2q+1 of
// each n8 block), with the base-2 scale folded into one FFMA per element:
// p = exp2(s * scale - max * scale), which needs scale > 0 (the max of the raw logits is then
// the max of the scaled ones). s becomes P (unnormalized probabilities), the running max
// (scaled) and this lane's partial row sums are updated, and rescale[h] is the factor by
// which O's row h must be scaled.
template <int kNB>
__device__ __forceinline__ void softmax_tile(float (&s)[kNB][4], float (&row_max)[2],
                                             float (&row_sum)[2], float (&rescale)[2],
                                             float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
      tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max[h], tile_max * scale);
    // A row with nothing visible yet keeps max -inf: subtract 0 instead, so that
    // exp2(-inf - -inf) never makes a NaN (exp2(-inf) = 0 for the masked logits).
    const float base = new_max == -INFINITY ? 0.f : new_max;
    rescale[h] = exp2f(row_max[h] - base);
    row_max[h] = new_max;
    float tile_sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float prob = exp2f(fmaf(s[nb][2 * h + e], scale, -base));
        s[nb][2 * h + e] = prob;
        tile_sum += prob;
      }
    }
    row_sum[h] = row_sum[h] * rescale[h] + tile_sum;
  }
}

template <int kDB>
__device__ __forceinline__ void rescale_rows(float (&acc)[kDB][4], const float (&rescale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int db = 0; db < kDB; ++db) {
      acc[db][2 * h] *= rescale[h];
      acc[db][2 * h + 1] *= rescale[h];
    }
  }
}

}  // namespace gqa_prefill
