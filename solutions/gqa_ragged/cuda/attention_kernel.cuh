// GQA prefill attention forward (FlashAttention-2 style) for head_dim 128, 32 query heads and
// 8 KV heads, fp16 or bf16 in, fp32 accumulate. Portable tensor-core path: mma.sync m16n8k16,
// ldmatrix and cp.async, compiled for sm_90 / sm_90a (nothing Hopper-specific yet).
//
// One CTA = one query tile of one KV head: BLOCK_M = 128 rows = 32 query tokens x the 4 query
// heads of the KV group (row r is token r / 4, head 4 * kv_head + r % 4). The 4 heads are
// contiguous in memory, so K/V tiles are loaded once for the group and a row of the tile is
// one contiguous 256-byte row of q / out. 8 warps, each owning 16 rows.
//
// K/V tiles of BLOCK_N = 64 keys stream through shared memory (one K and one V buffer): V[n]
// loads while S = Q K[n]^T is computed, K[n+1] loads while O += P V[n] is computed.
//
// Causal masks are bottom-right aligned per sequence: query i sees key j iff
// j <= i + seq_kv - seq_q. A row that sees no key ends with output 0 and lse -inf.
#pragma once

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
constexpr int kBlockN = 64;                       // keys per K/V tile
constexpr int kNumWarps = 8;                      // 16 rows each
constexpr int kNumThreads = kNumWarps * 32;
// Shared-memory rows padded by 8 elements (16 bytes): the 8 row addresses of an ldmatrix
// phase then fall on distinct banks.
constexpr int kSmemStride = kHeadDim + 8;
constexpr int kChunksPerRow = kHeadDim * 2 / 16;  // 16-byte chunks per 128-element row
constexpr size_t kSmemBytes = size_t(kBlockM + 2 * kBlockN) * kSmemStride * 2;  // Q, K, V

static_assert(kBlockM == kNumWarps * 16, "each warp owns one m16 row block");
static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "fragment loops assume multiples of 16");

struct Params {
  const void* q;  // [tokens, 32, 128]
  const void* k;  // [tokens, 8, 128]
  const void* v;
  void* out;        // like q
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
};

// ---- PTX wrappers -------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte async copy global -> shared; src_bytes = 0 writes zeros without reading global.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The element type's mma (D = A B + D, fp32 accumulate) and fp32 -> 2 x 16-bit packing.
template <typename T>
struct ElementOps;

template <>
struct ElementOps<half> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct ElementOps<__nv_bfloat16> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// ---- Tile loads ---------------------------------------------------------------------------

// One thread's share of a K or V tile: 4 of the tile's 64 rows (row_in_tile + 16 i), one
// 16-byte chunk of each. Rows at or past the sequence end are zero-filled without a global
// read (src pointing at the tensor's first row, passed from the kernel parameters so that it
// costs no register), so padding keys give 0 * 0 in P V, not garbage.
template <typename T>
struct KvTileLoader {
  const T* thread_src;  // this thread's chunk of sequence row row_in_tile
  uint32_t thread_dst;  // shared-memory byte address of the chunk in tile row row_in_tile
  int row_in_tile;

  static constexpr int64_t kRowStride = int64_t(kNumKvHeads) * kHeadDim;
  static constexpr int kRowsPerPass = kNumThreads / kChunksPerRow;

  __device__ __forceinline__ KvTileLoader(const T* tensor, int seq_start, int kv_head,
                                          const T* smem_tile, int tid) {
    row_in_tile = tid / kChunksPerRow;
    const int chunk = tid % kChunksPerRow;
    thread_src =
        tensor + int64_t(seq_start + row_in_tile) * kRowStride + kv_head * kHeadDim + chunk * 8;
    thread_dst = smem_addr(smem_tile + row_in_tile * kSmemStride + chunk * 8);
  }

  // Loads keys [key0, key0 + 64) of a sequence of seq_len keys; tensor: its first row.
  __device__ __forceinline__ void load(int key0, int seq_len, const void* tensor) const {
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int key = key0 + i * kRowsPerPass;
      const bool valid = key + row_in_tile < seq_len;
      const void* src = valid ? static_cast<const void*>(thread_src + key * kRowStride) : tensor;
      cp_async_16(thread_dst + i * kRowsPerPass * kSmemStride * 2, src, valid ? 16 : 0);
    }
  }
};

// ---- The kernel ---------------------------------------------------------------------------

template <typename T, bool kCausal, bool kRagged>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_kernel(const Params p) {
  using Ops = ElementOps<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kSmemStride;
  T* sV = sK + kBlockN * kSmemStride;

  const int kv_head = blockIdx.x % kNumKvHeads;
  const int slot = blockIdx.x / kNumKvHeads;

  // Which sequence and which query tile of it this CTA computes.
  // Row indices fit in 32 bits (the host checks batch * seq_q and batch * seq_kv); element
  // offsets are 64-bit.
  int q_start, kv_start;
  int seq_q, seq_kv, local;
  if constexpr (kRagged) {
    // Sequence s owns slots [qo_indptr[s] / 32 + s, qo_indptr[s + 1] / 32 + s + 1): at least
    // cdiv(q_len, 32) of them, and the grid has total_q / 32 + batch slots in all. Find the
    // last sequence whose first slot is <= slot (first slots increase strictly with s).
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (__ldg(p.qo_indptr + mid) / kTokensPerTile + mid <= slot) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int qo_begin = __ldg(p.qo_indptr + lo);
    // Clamped so that an inconsistent indptr cannot address outside the tensors.
    const int q_begin = min(max(qo_begin, 0), p.total_q);
    const int q_end = min(max(__ldg(p.qo_indptr + lo + 1), q_begin), p.total_q);
    const int kv_begin = min(max(__ldg(p.kv_indptr + lo), 0), p.total_kv);
    const int kv_end = min(max(__ldg(p.kv_indptr + lo + 1), kv_begin), p.total_kv);
    q_start = q_begin;
    kv_start = kv_begin;
    seq_q = q_end - q_begin;
    seq_kv = kv_end - kv_begin;
    local = slot - (qo_begin / kTokensPerTile + lo);
  } else {
    const int seq = slot / p.tiles_per_seq;
    local = slot % p.tiles_per_seq;
    seq_q = p.seq_q;
    seq_kv = p.seq_kv;
    q_start = seq * seq_q;
    kv_start = seq * seq_kv;
  }
  const int num_q_tiles = (seq_q + kTokensPerTile - 1) / kTokensPerTile;
  if (local < 0 || local >= num_q_tiles) return;  // a spare slot (uniform over the CTA)
  // Last tiles first: under a causal mask they see the most keys, so they start earliest.
  const int tile = num_q_tiles - 1 - local;
  const int tok0 = tile * kTokensPerTile;
  const int tile_tokens = min(kTokensPerTile, seq_q - tok0);
  const int causal_offset = seq_kv - seq_q;  // bottom-right alignment
  const int q_row0 = q_start + tok0;          // the tile's first token among q's rows

  // Keys [0, kv_len) are visible to at least one row of the tile.
  int kv_len = seq_kv;
  if constexpr (kCausal) kv_len = max(0, min(seq_kv, tok0 + tile_tokens - 1 + causal_offset + 1));
  const int num_kv_tiles = (kv_len + kBlockN - 1) / kBlockN;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane / 4;      // mma row within the 8-row half
  const int quad_lane = lane % 4;  // mma column pair

  // Row r of the tile is token tok0 + r / 4, head 4 * kv_head + r % 4: consecutive rows are
  // consecutive 128-element rows of q / out (stride 128 elements), tokens 32 * 128 apart.
  const T* q_tile = static_cast<const T*>(p.q) +
                    (int64_t(q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;

  // Rows of the tile are (token, head) with head fastest, so they are rows of q with the
  // 4 heads' stride kHeadDim, except that a token advances 32 heads: load row by row.
  {
    static_assert((kBlockM * kChunksPerRow) % kNumThreads == 0, "whole chunks per thread");
    const int chunk = tid % kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kBlockM * kChunksPerRow / kNumThreads; ++i) {
      const int row = tid / kChunksPerRow + i * (kNumThreads / kChunksPerRow);
      const int token = row / kGroupSize;
      const bool valid = token < tile_tokens;
      const T* src = q_tile +
                     (valid ? (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim : 0) +
                     chunk * 8;
      cp_async_16(smem_addr(sQ + row * kSmemStride + chunk * 8), src, valid ? 16 : 0);
    }
  }
  const KvTileLoader<T> k_loader(static_cast<const T*>(p.k), kv_start, kv_head, sK, tid);
  const KvTileLoader<T> v_loader(static_cast<const T*>(p.v), kv_start, kv_head, sV, tid);
  if (num_kv_tiles > 0) k_loader.load(0, seq_kv, p.k);
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
  // Token of this lane's first row within the sequence; its second row (8 rows further) is
  // 2 tokens later.
  const int row_token = tok0 + (warp * 16 + group) / kGroupSize;

#pragma unroll 1
  for (int n = 0; n < num_kv_tiles; ++n) {
    const int key0 = n * kBlockN;
    if (n > 0) {
      cp_async_wait_all();  // K[n] has landed ...
      __syncthreads();      // ... for all threads, and every warp is done reading V[n - 1]
    }
    v_loader.load(key0, seq_kv, p.v);
    cp_async_commit();

    // S = Q K^T: 16 rows x 64 keys per warp.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
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
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_lane + np * 16 * kRowBytes + ks * 16 * 2);
        Ops::mma(s[2 * np], q_frag, b[0], b[1]);
        Ops::mma(s[2 * np + 1], q_frag, b[2], b[3]);
      }
    }

    // Scale into base 2, then mask (after scaling, so that any finite sm_scale is safe).
    // Only tiles crossing the end of the sequence or the tile's first causal limit need it.
    const bool needs_mask =
        key0 + kBlockN > seq_kv || (kCausal && key0 + kBlockN - 1 > tok0 + causal_offset);
#pragma unroll
    for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
      for (int j = 0; j < 4; ++j) s[nb][j] *= p.scale_log2;
    }
    if (needs_mask) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Last visible key of this row, relative to key0.
        int limit = seq_kv - 1 - key0;
        if constexpr (kCausal) {
          limit = min(limit, row_token + h * (8 / kGroupSize) + causal_offset - key0);
        }
#pragma unroll
        for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (nb * 8 + quad_lane * 2 + e > limit) s[nb][2 * h + e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax, per row h (lane holds columns 2q, 2q+1 of each n8 block).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < kBlockN / 8; ++nb) {
        tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[h], tile_max);
      // A row with nothing visible yet keeps max -inf: subtract 0 instead, so that
      // exp2(-inf - -inf) never makes a NaN (exp2(-inf) = 0 for the masked logits).
      const float base = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[h] - base);
      row_max[h] = new_max;
      float tile_sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float prob = exp2f(s[nb][2 * h + e] - base);
          s[nb][2 * h + e] = prob;
          tile_sum += prob;
        }
      }
      row_sum[h] = row_sum[h] * rescale + tile_sum;
#pragma unroll
      for (int db = 0; db < kHeadDim / 8; ++db) {
        acc[db][2 * h] *= rescale;
        acc[db][2 * h + 1] *= rescale;
      }
    }

    cp_async_wait_all();  // V[n] has landed ...
    __syncthreads();      // ... for all threads, and every warp is done reading K[n]
    if (n + 1 < num_kv_tiles) {
      k_loader.load(key0 + kBlockN, seq_kv, p.k);
      cp_async_commit();
    }

    // O += P V: P's accumulator layout (two n8 blocks) is the A fragment of one k16 step.
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
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
  }

  // Epilogue: normalize, stage the warp's 16 rows in its own rows of sQ (only this warp ever
  // reads them, and it is past its last read), then write them out in 16-byte coalesced
  // stores.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = row_sum[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a row with no visible key -> 0
    const int row = warp * 16 + group + 8 * h;
    T* srow = sQ + row * kSmemStride + quad_lane * 2;
#pragma unroll
    for (int db = 0; db < kHeadDim / 8; ++db) {
      *reinterpret_cast<uint32_t*>(srow + db * 8) =
          Ops::pack(acc[db][2 * h] * inv, acc[db][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && quad_lane == 0) {
      const int token = row / kGroupSize;
      if (token < tile_tokens) {
        p.lse[int64_t(q_row0 + token) * kNumHeads + kv_head * kGroupSize + row % kGroupSize] =
            total > 0.f ? row_max[h] + log2f(total) : -INFINITY;
      }
    }
  }
  __syncwarp();
  T* out_tile = static_cast<T*>(p.out) +
                (int64_t(q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int idx = lane + i * 32;
    const int row = warp * 16 + idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const int token = row / kGroupSize;
    if (token < tile_tokens) {
      const uint4 value = *reinterpret_cast<const uint4*>(sQ + row * kSmemStride + chunk * 8);
      *reinterpret_cast<uint4*>(out_tile +
                                (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim +
                                chunk * 8) = value;
    }
  }
}

}  // namespace gqa_prefill
