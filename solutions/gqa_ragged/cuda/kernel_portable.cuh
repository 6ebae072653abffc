// The portable kernel (FlashAttention-2 style: mma.sync, ldmatrix, cp.async; any sm_90 build),
// over either K/V source (kv_contiguous.cuh, kv_paged.cuh). Described in attention_kernel.cuh.
#pragma once

#include <type_traits>

#include "epilogue.cuh"
#include "kernel_config.cuh"
#include "kv_contiguous.cuh"
#include "kv_paged.cuh"
#include "mask_softmax.cuh"
#include "ptx_sm80.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

// ---- The portable kernel (mma.sync) -------------------------------------------------------

// The kernel body for K/V source Kv (its Args: what the source needs beyond Params); kWindow:
// the causal mask's band is a sliding window of p.window_left keys (KeyBand): the tile's keys
// are clipped to the band, whose left edge is masked too.
template <typename T, bool kCausal, typename Kv, bool kWindow = false>
__device__ __forceinline__ void portable_attention(const Params& p, const typename Kv::Args& args) {
  constexpr bool kRagged = Kv::kRagged;
  using Ops = ElementOps<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kSmemStride;
  T* sV = sK + kPortableBlockN * kSmemStride;

  const int kv_head = blockIdx.x % kNumKvHeads;
  const int slot = blockIdx.x / kNumKvHeads;
  const int tid = threadIdx.x;
  bool batch_ok = true;
  if constexpr (kRagged) {
    batch_ok = __syncthreads_and(batch_part_ok(p, tid, kNumThreads));
    if (!batch_ok) poison_slab<T, kNumThreads>(p, slot, kv_head, tid);
  }
  TileCoords t;
  if (!Kv::template locate<kCausal>(p, args, slot, batch_ok, t)) return;
  const KeyBand<kWindow> band{p.window_left};
  if constexpr (kWindow) band.clip(t);  // keys from the band's first on
  const int num_kv_tiles = (t.kv_len + kPortableBlockN - 1) / kPortableBlockN;

  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane / 4;      // mma row within the 8-row half
  const int quad_lane = lane % 4;  // mma column pair

  // Row r of the tile is token tok0 + r / 4, head 4 * kv_head + r % 4: consecutive rows are
  // consecutive 128-element rows of q / out (stride 128 elements), tokens q_stride apart.
  const T* q_tile = static_cast<const T*>(p.q) + token_offset(t.q_row0, p.q_stride) +
                    kv_head * kGroupSize * kHeadDim;

  // Rows of the tile are (token, head) with head fastest, so they are rows of q with the
  // 4 heads' stride kHeadDim, except that a token advances 32 heads: load row by row.
  {
    static_assert((kBlockM * kChunksPerRow) % kNumThreads == 0, "whole chunks per thread");
    const int chunk = tid % kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kBlockM * kChunksPerRow / kNumThreads; ++i) {
      const int row = tid / kChunksPerRow + i * (kNumThreads / kChunksPerRow);
      const int token = row / kGroupSize;
      const bool valid = token < t.tile_tokens;
      const T* src = q_tile +
                     (valid ? token_offset(token, p.q_stride) + row % kGroupSize * kHeadDim : 0) +
                     chunk * 8;
      cp_async_16(smem_addr(sQ + row * kSmemStride + chunk * 8), src, valid ? 16 : 0);
    }
  }
  typename Kv::template RowLoader<T> kv_loader(p, args, t, kv_head, sK, tid);
  if (num_kv_tiles > 0) kv_loader.load_k(0, t.seq_kv);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Per-lane ldmatrix offsets (elements). A (Q): lanes 0-15 rows 0-15 at column 0, lanes
  // 16-31 the same rows at column 8. B (K, non-transposed): matrices (keys 0-7, d 0-7),
  // (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15). B (V, transposed):
  // matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15).
  const uint32_t q_lane = smem_addr(sQ + (warp * 16 + lane % 16) * kSmemStride + (lane / 16) * 8);
  const uint32_t k_lane =
      smem_addr(sK + (lane % 8 + (lane / 16) * 8) * kSmemStride + ((lane / 8) % 2) * 8);
  const uint32_t v_lane =
      smem_addr(sV + (lane % 8 + ((lane / 8) % 2) * 8) * kSmemStride + (lane / 16) * 8);
  constexpr uint32_t kRowBytes = kSmemStride * 2;

  float acc[kHeadDim / 8][4];  // O: 16 rows x 128, as 16 n8 blocks
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  }
  // Running max (base-2 scaled logits) and this lane's partial row sum, for rows group and
  // group + 8 of the warp's block; the row sums are reduced across the quad only at the end.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int row_token = t.tok0 + (warp * 16 + group) / kGroupSize;

  // Key tile n: S = Q K^T, mask and softmax, O += P V, with the next tile's K loading. A window's
  // left edge crosses only the band's first tile (KeyBand): that tile is peeled off the loop, so
  // the loop's tiles carry no window mask (and the first one's O, still 0, no registers).
  // t and num_kv_tiles by value: the loop's bounds then compile as they did without the lambda.
  auto kv_tile = [&, t, num_kv_tiles](int n, auto left_edge) {
    const int key0 = n * kPortableBlockN;
    if (n > 0) {
      cp_async_wait_all();  // K[n] has landed ...
      __syncthreads();      // ... for all threads, and every warp is done reading V[n - 1]
    }
    kv_loader.load_v(key0, t.seq_kv);
    cp_async_commit();

    // S = Q K^T: 16 rows x 64 keys per warp.
    float s[kPortableBlockN / 8][4];
#pragma unroll
    for (int i = 0; i < kPortableBlockN / 8; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      // Q fragments are re-read from shared memory (one ldmatrix per 4 of K): holding all
      // of them in registers would cost 32 registers and spill at 2 CTAs per SM.
      uint32_t q_frag[4];
      ldmatrix_x4(q_frag, q_lane + ks * 16 * 2);
#pragma unroll
      for (int np = 0; np < kPortableBlockN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_lane + np * 16 * kRowBytes + ks * 16 * 2);
        Ops::mma(s[2 * np], q_frag, b[0], b[1]);
        Ops::mma(s[2 * np + 1], q_frag, b[2], b[3]);
      }
    }

    if constexpr (decltype(left_edge)::value) {
      scale_and_mask<kCausal>(s, p.scale_log2, t, key0, row_token, quad_lane, band);
    } else {
      scale_and_mask<kCausal>(s, p.scale_log2, t, key0, row_token, quad_lane);
    }
    float rescale[2];
    softmax_tile</*kFtz=*/false>(s, row_max, row_sum, rescale, 1.f);
    rescale_rows(acc, rescale);

    cp_async_wait_all();  // V[n] has landed ...
    __syncthreads();      // ... for all threads, and every warp is done reading K[n]
    if (n + 1 < num_kv_tiles) {
      kv_loader.load_k(key0 + kPortableBlockN, t.seq_kv);
      cp_async_commit();
    }

    // O += P V: P's accumulator layout (two n8 blocks) is the A fragment of one k16 step.
#pragma unroll
    for (int ks = 0; ks < kPortableBlockN / 16; ++ks) {
      uint32_t a[4];
      a[0] = Ops::pack(s[2 * ks][0], s[2 * ks][1]);
      a[1] = Ops::pack(s[2 * ks][2], s[2 * ks][3]);
      a[2] = Ops::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      a[3] = Ops::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_lane + ks * 16 * kRowBytes + dp * 16 * 2);
        Ops::mma(acc[2 * dp], a, b[0], b[1]);
        Ops::mma(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  };
  if constexpr (kWindow) {
    if (num_kv_tiles > 0) kv_tile(0, std::true_type{});
#pragma unroll 1
    for (int n = 1; n < num_kv_tiles; ++n) kv_tile(n, std::false_type{});
  } else {
#pragma unroll 1
    for (int n = 0; n < num_kv_tiles; ++n) kv_tile(n, std::false_type{});
  }

  // A paged item that met a page id out of range (any thread's load), or whose sequence has a
  // malformed last-page length, comes back NaN.
  if constexpr (Kv::kMayPoison) {
    if (__syncthreads_or(kv_loader.saw_bad_page()) || t.seq_kv < 0) {
      poison_rows(acc, row_max, row_sum);
    }
  }
  if constexpr (Kv::kScalesOutput) scale_output(acc, args.v_scale);
  // Epilogue: stage each warp's 16 rows in its own rows of sQ (only this warp ever reads
  // them, and it is past its last read).
  write_output<T>(p, t, kv_head, acc, row_max, row_sum, sQ, warp, lane);
}

template <typename T, bool kCausal, bool kRagged>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_kernel(const Params p) {
  portable_attention<T, kCausal, ContiguousKv<kRagged>>(p, {});
}

// Paged K/V (causal only: the paged definitions are).
template <typename T, int kPageSize>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_paged_kernel(const PagedParams pp) {
  portable_attention<T, true, PagedKv<kPageSize>>(pp.p, pp.pages);
}

// The sliding window (gqa_ragged_prefill_causal_swa): the ragged causal kernel over the band's
// key tiles only; p.window_left in [0, total_kv).
template <typename T>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_swa_kernel(const Params p) {
  portable_attention<T, true, ContiguousKv<true>, true>(p, {});
}

}  // namespace gqa_prefill
