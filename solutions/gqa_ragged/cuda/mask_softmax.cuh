// Masking of logits (sequence end, bottom-right causal limit, the sliding window's left edge)
// and the online softmax in base 2, on the m16n8 accumulator layout. Shared by both kernels.
#pragma once

#include "tile_schedule.cuh"

namespace gqa_prefill {

// The mask's key band, the sliding window's policy (gqa_ragged_prefill_causal_swa; FlashInfer's
// window_left): a causal row at position p = token + causal_offset sees keys
// max(0, p - window) .. p. A query tile's rows p_lo .. p_hi together see keys
// first_key() = max(0, p_lo - window) .. kv_len - 1. clip() makes the tile see its sequence from
// first_key() on (kv_start, seq_kv, causal_offset and kv_len shifted by it), so that the kernels'
// key loop, unchanged from key 0 to kv_len, visits the band's tiles and no other:
// cdiv(kv_len, kBlockN) of them after clip(), the item's weight (band_tiles). Masks apply only on
// the band's edges: the sequence end, the causal diagonal and the one tile crossing the left edge
// (the first: some row's first key lies past its first key, p_hi - window > key0); tiles wholly
// inside the band are not masked. The kernels use it only where kWindow is true: the causal
// kernels compile as they did. window: 0 <= window < total_kv (the host runs the causal kernels
// for window_left -1 and for windows as long as every sequence's keys), so no offset below
// leaves int32 (a visited tile has kv_len > 0, hence p_hi >= 0).
template <bool kWindow>
struct KeyBand {
  int window;

  // The first key a row of query tile t sees.
  __host__ __device__ __forceinline__ int first_key(const TileCoords& t) const {
    const int p_lo = t.tok0 + t.causal_offset;  // the tile's first row's position
    return p_lo > window ? p_lo - window : 0;
  }
  // t's keys from first_key() on: the key loop starts at the band.
  __host__ __device__ __forceinline__ void clip(TileCoords& t) const {
    const int first = first_key(t);  // <= p_lo < kv_len where kv_len > 0, else 0
    t.kv_start += first;
    t.seq_kv -= first;
    t.causal_offset -= first;
    t.kv_len -= first;
  }
  // Key tiles of kBlockN keys that a clipped tile visits (the schedule's weight of its item:
  // items go last query tile first, which is heaviest first under the band too, see
  // tests/test_cuda_window.py).
  template <int kBlockN>
  __host__ __device__ __forceinline__ static int band_tiles(const TileCoords& clipped) {
    return (clipped.kv_len + kBlockN - 1) / kBlockN;
  }
  // Whether keys key0 .. of a visited (clipped) tile cross the band's left edge.
  __host__ __device__ __forceinline__ bool crosses_left_edge(const TileCoords& t,
                                                             int key0) const {
    return t.tok0 + t.tile_tokens - 1 + t.causal_offset - key0 > window;
  }
};

// Split-KV for decode-like paged batches (entry_launch.cuh plans `shares` > 1): share `share`
// of an item takes an equal run of its query tile's key tiles, and the item is clipped to it
// as KeyBand::clip clips a window's: the keys before the run are skipped (kv_start moves by
// whole K/V entries: kBlockN is a multiple of the keys an entry holds), the run ends at
// kv_len. seq_kv stays the sequence's end, so a run that stops before it is not masked there;
// only the run holding the causal diagonal (the last) is. A share past the tile's keys gets
// kv_len 0: its rows come out 0 with lse -inf and weigh nothing in the merge (merge_shares).
template <int kBlockN, int kKeysPerEntry>
__host__ __device__ __forceinline__ void clip_to_share(TileCoords& t, int share, int shares) {
  static_assert(kBlockN % kKeysPerEntry == 0, "a run starts at an entry");
  const int tiles = (t.kv_len + kBlockN - 1) / kBlockN;
  const int run = (tiles + shares - 1) / shares * kBlockN;  // keys a share takes
  const int first = share * run;
  if (first >= t.kv_len) {
    t.kv_len = 0;
    return;
  }
  t.kv_start += first / kKeysPerEntry;
  t.seq_kv -= first;
  t.causal_offset -= first;
  t.kv_len = t.kv_len - first < run ? t.kv_len - first : run;
}

// S (this lane's part of 16 rows x kNB * 8 keys from key0, accumulator layout): logits of
// keys a row does not see become -inf. Only tiles crossing the end of the sequence, the
// tile's first causal limit or (a window) the band's left edge need it. row_token: the lane's
// first row's token; its second row (8 rows further) is 2 tokens later.
template <bool kCausal, int kNB, bool kWindow = false>
__device__ __forceinline__ void mask_tile(float (&s)[kNB][4], const TileCoords& t, int key0,
                                          int row_token, int quad_lane,
                                          const KeyBand<kWindow>& band = {}) {
  static_assert(kCausal || !kWindow, "the window is a causal mask's band");
  bool needs_mask = key0 + kNB * 8 > t.seq_kv ||
                    (kCausal && key0 + kNB * 8 - 1 > t.tok0 + t.causal_offset);
  if constexpr (kWindow) needs_mask = needs_mask || band.crosses_left_edge(t, key0);
  if (needs_mask) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Last visible key of this row, relative to key0.
      int limit = t.seq_kv - 1 - key0;
      int first = 0;  // first visible key of this row, relative to key0 (a window's)
      if constexpr (kCausal) {
        const int causal_limit = row_token + h * (8 / kGroupSize) + t.causal_offset - key0;
        limit = min(limit, causal_limit);
        // <= 0 where the tile lies right of the band's left edge.
        if constexpr (kWindow) first = causal_limit - band.window;
      }
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = nb * 8 + quad_lane * 2 + e;
          if (key > limit || (kWindow && key < first)) s[nb][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

// The portable kernel's logits: scaled to base 2 first, then masked, so that any finite
// sm_scale (negative too) is safe; its softmax then runs with scale 1.
template <bool kCausal, int kNB, bool kWindow = false>
__device__ __forceinline__ void scale_and_mask(float (&s)[kNB][4], float scale_log2,
                                               const TileCoords& t, int key0, int row_token,
                                               int quad_lane, const KeyBand<kWindow>& band = {}) {
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[nb][j] *= scale_log2;
  }
  mask_tile<kCausal>(s, t, key0, row_token, quad_lane, band);
}

// 2^x. exp2f compiles (without --use_fast_math, as flashinfer-bench's builder compiles) to
// ex2.approx.f32, which ptxas wraps in a subnormal range test and two FMULs: 3 more issue slots
// per logit beside the one MUFU.EX2 (cuda/TUNING.md). kFtz: ex2.approx.ftz, the MUFU alone; it
// flushes subnormal inputs and results to 0 (probabilities below 2^-126 of the row's max;
// exp2(-inf) is still 0). The portable kernel keeps exp2f: at its 128-register cap the denser
// schedule spilled.
template <bool kFtz>
__device__ __forceinline__ float exp2_base2(float x) {
  if constexpr (kFtz) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return exp2f(x);
  }
}

// Online softmax over one tile of masked logits s, per row h (lane holds columns 2q, 2q+1 of
// each n8 block), with the base-2 scale folded into one FFMA per element:
// p = exp2(s * scale - max * scale), which needs scale > 0 (the max of the raw logits is then
// the max of the scaled ones). s becomes P (unnormalized probabilities), the running max
// (scaled) and this lane's partial row sums are updated, and rescale[h] is the factor by
// which O's row h must be scaled. kFtz: see exp2_base2. scale: one for both rows, or each
// row's own (float[2]: the FP8 kernel's e4m3 Q K^T, whose rows carry a power of two each).
__device__ __forceinline__ float row_scale(float scale, int) { return scale; }
__device__ __forceinline__ float row_scale(const float (&scale)[2], int h) { return scale[h]; }

template <bool kFtz = true, int kNB, typename Scale>
__device__ __forceinline__ void softmax_tile(float (&s)[kNB][4], float (&row_max)[2],
                                             float (&row_sum)[2], float (&rescale)[2],
                                             const Scale& scales) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float scale = row_scale(scales, h);
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
    rescale[h] = exp2_base2<kFtz>(row_max[h] - base);
    row_max[h] = new_max;
    float tile_sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float prob = exp2_base2<kFtz>(fmaf(s[nb][2 * h + e], scale, -base));
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
