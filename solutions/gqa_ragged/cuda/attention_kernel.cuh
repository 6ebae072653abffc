// GQA prefill attention forward (FlashAttention-2 style) for head_dim 128, 32 query heads and
// 8 KV heads, fp16 or bf16 in, fp32 accumulate. Two kernels: the portable one (mma.sync
// m16n8k16, ldmatrix and cp.async; any sm_90 build), described here, and a Hopper one (wgmma,
// sm_90a builds only), described at gqa_prefill_wgmma_kernel below; the host picks one.
//
// One CTA = one query tile of one KV head (both kernels): BLOCK_M = 128 rows = 32 query tokens x the 4 query
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

// ---- Shared by both kernels: tile placement, masking, online softmax, epilogue -------------

// Where a CTA's query tile lies.
struct TileCoords {
  int q_row0;         // the tile's first token among q's rows
  int kv_start;       // the sequence's first row of k / v
  int seq_kv;         // keys in the sequence
  int tok0;           // the tile's first token within its sequence
  int tile_tokens;    // tokens in the tile (fewer than 32 only in a sequence's last tile)
  int causal_offset;  // seq_kv - seq_q: bottom-right alignment
  int kv_len;         // keys [0, kv_len) are visible to at least one row of the tile
};

// The query tile of CTA slot `slot` (blockIdx.x / 8); false for a spare slot (uniform over
// the CTA, which then returns).
template <bool kCausal, bool kRagged>
__device__ __forceinline__ bool locate_tile(const Params& p, int slot, TileCoords& t) {
  // Row indices fit in 32 bits (the host checks batch * seq_q and batch * seq_kv); element
  // offsets are 64-bit.
  int q_start, seq_q, local;
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
    t.kv_start = kv_begin;
    seq_q = q_end - q_begin;
    t.seq_kv = kv_end - kv_begin;
    local = slot - (qo_begin / kTokensPerTile + lo);
  } else {
    const int seq = slot / p.tiles_per_seq;
    local = slot % p.tiles_per_seq;
    seq_q = p.seq_q;
    t.seq_kv = p.seq_kv;
    q_start = seq * seq_q;
    t.kv_start = seq * p.seq_kv;
  }
  const int num_q_tiles = (seq_q + kTokensPerTile - 1) / kTokensPerTile;
  if (local < 0 || local >= num_q_tiles) return false;  // a spare slot
  // Last tiles first: under a causal mask they see the most keys, so they start earliest.
  const int tile = num_q_tiles - 1 - local;
  t.tok0 = tile * kTokensPerTile;
  t.tile_tokens = min(kTokensPerTile, seq_q - t.tok0);
  t.causal_offset = t.seq_kv - seq_q;
  t.q_row0 = q_start + t.tok0;
  t.kv_len = t.seq_kv;
  if constexpr (kCausal) {
    t.kv_len = max(0, min(t.seq_kv, t.tok0 + t.tile_tokens - 1 + t.causal_offset + 1));
  }
  return true;
}

// S (this lane's part of 16 rows x kNB * 8 keys from key0, accumulator layout) -> base-2
// logits, masked (after scaling, so that any finite sm_scale is safe). Only tiles crossing
// the end of the sequence or the tile's first causal limit need the mask. row_token: the
// lane's first row's token; its second row (8 rows further) is 2 tokens later.
template <bool kCausal, int kNB>
__device__ __forceinline__ void scale_and_mask(float (&s)[kNB][4], float scale_log2,
                                               const TileCoords& t, int key0, int row_token,
                                               int quad_lane) {
  const bool needs_mask = key0 + kNB * 8 > t.seq_kv ||
                          (kCausal && key0 + kNB * 8 - 1 > t.tok0 + t.causal_offset);
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[nb][j] *= scale_log2;
  }
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

// Online softmax over one key tile, per row h (lane holds columns 2q, 2q+1 of each n8
// block): s becomes P (unnormalized probabilities), the running max and this lane's partial
// row sums are updated, and rescale[h] is the factor by which O's row h must be scaled.
template <int kNB>
__device__ __forceinline__ void softmax_tile(float (&s)[kNB][4], float (&row_max)[2],
                                             float (&row_sum)[2], float (&rescale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
      tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max[h], tile_max);
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
        const float prob = exp2f(s[nb][2 * h + e] - base);
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

// Epilogue of warp `warp` (rows 16 warp .. 16 warp + 15 of the tile): normalize, write lse,
// stage the rows in `stage` (128 rows of kSmemStride elements; the warp's own rows, free for
// it), then write them out in 16-byte coalesced stores.
template <typename T>
__device__ __forceinline__ void write_output(const Params& p, const TileCoords& t, int kv_head,
                                             float (&acc)[kHeadDim / 8][4],
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             T* stage, int warp, int lane) {
  using Ops = ElementOps<T>;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = row_sum[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a row with no visible key -> 0
    const int row = warp * 16 + group + 8 * h;
    T* srow = stage + row * kSmemStride + quad_lane * 2;
#pragma unroll
    for (int db = 0; db < kHeadDim / 8; ++db) {
      *reinterpret_cast<uint32_t*>(srow + db * 8) =
          Ops::pack(acc[db][2 * h] * inv, acc[db][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && quad_lane == 0) {
      const int token = row / kGroupSize;
      if (token < t.tile_tokens) {
        p.lse[int64_t(t.q_row0 + token) * kNumHeads + kv_head * kGroupSize + row % kGroupSize] =
            total > 0.f ? row_max[h] + log2f(total) : -INFINITY;
      }
    }
  }
  __syncwarp();
  T* out_tile = static_cast<T*>(p.out) +
                (int64_t(t.q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int idx = lane + i * 32;
    const int row = warp * 16 + idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const int token = row / kGroupSize;
    if (token < t.tile_tokens) {
      const uint4 value = *reinterpret_cast<const uint4*>(stage + row * kSmemStride + chunk * 8);
      *reinterpret_cast<uint4*>(out_tile +
                                (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim +
                                chunk * 8) = value;
    }
  }
}

// ---- The portable kernel (mma.sync) -------------------------------------------------------

template <typename T, bool kCausal, bool kRagged>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_kernel(const Params p) {
  using Ops = ElementOps<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kSmemStride;
  T* sV = sK + kBlockN * kSmemStride;

  const int kv_head = blockIdx.x % kNumKvHeads;
  TileCoords t;
  if (!locate_tile<kCausal, kRagged>(p, blockIdx.x / kNumKvHeads, t)) return;
  const int num_kv_tiles = (t.kv_len + kBlockN - 1) / kBlockN;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane / 4;      // mma row within the 8-row half
  const int quad_lane = lane % 4;  // mma column pair

  // Row r of the tile is token tok0 + r / 4, head 4 * kv_head + r % 4: consecutive rows are
  // consecutive 128-element rows of q / out (stride 128 elements), tokens 32 * 128 apart.
  const T* q_tile = static_cast<const T*>(p.q) +
                    (int64_t(t.q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;

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
                     (valid ? (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim : 0) +
                     chunk * 8;
      cp_async_16(smem_addr(sQ + row * kSmemStride + chunk * 8), src, valid ? 16 : 0);
    }
  }
  const KvTileLoader<T> k_loader(static_cast<const T*>(p.k), t.kv_start, kv_head, sK, tid);
  const KvTileLoader<T> v_loader(static_cast<const T*>(p.v), t.kv_start, kv_head, sV, tid);
  if (num_kv_tiles > 0) k_loader.load(0, t.seq_kv, p.k);
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

#pragma unroll 1
  for (int n = 0; n < num_kv_tiles; ++n) {
    const int key0 = n * kBlockN;
    if (n > 0) {
      cp_async_wait_all();  // K[n] has landed ...
      __syncthreads();      // ... for all threads, and every warp is done reading V[n - 1]
    }
    v_loader.load(key0, t.seq_kv, p.v);
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

    scale_and_mask<kCausal>(s, p.scale_log2, t, key0, row_token, quad_lane);
    float rescale[2];
    softmax_tile(s, row_max, row_sum, rescale);
    rescale_rows(acc, rescale);

    cp_async_wait_all();  // V[n] has landed ...
    __syncthreads();      // ... for all threads, and every warp is done reading K[n]
    if (n + 1 < num_kv_tiles) {
      k_loader.load(key0 + kBlockN, t.seq_kv, p.k);
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

  // Epilogue: stage each warp's 16 rows in its own rows of sQ (only this warp ever reads
  // them, and it is past its last read).
  write_output<T>(p, t, kv_head, acc, row_max, row_sum, sQ, warp, lane);
}

// ---- The Hopper kernel (wgmma, sm_90a only) -----------------------------------------------
//
// Same tiles, grid and tile placement as the portable kernel, but the two matrix products run
// on Hopper's warpgroup MMA: each of the 2 warpgroups (4 warps, 128 threads) owns 64 of the
// 128 rows (warp w still owns rows 16 w .. 16 w + 15, in the same accumulator layout as
// mma.sync m16n8, so masking, softmax and the epilogue are shared with the portable kernel).
//   S = Q K^T:  wgmma m64n128k16, A = Q and B = K from shared memory (both K-major);
//   O += P V:   wgmma m64n128k16, A = P from registers, B = V from shared memory (MN-major).
// K/V tiles of 128 keys, double-buffered (2 stages each) and loaded with cp.async, which
// writes through the generic proxy: each thread fences (fence.proxy.async) after its copies
// land and before the barrier that lets wgmma read them.
//
// Shared-memory tiles (Q, each K and V stage: 128 rows x 128 elements, 32 KiB, 1024-byte
// aligned) are stored as two 64-column halves of 128 rows x 128 bytes, with the 128-byte
// swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)): the canonical layout that a wgmma
// descriptor of layout type SWIZZLE_128B describes, K-major for Q and K, MN-major for V.
//
// Only an sm_90a build compiles the body (wgmma needs the architecture-specific features);
// elsewhere the kernel is a stub that traps. The host cannot see __CUDA_ARCH_FEAT_SM90_ALL,
// so the two versions declare different maximum block sizes (__launch_bounds__): the host
// reads the loaded version's value with cudaFuncGetAttributes (maxThreadsPerBlock) and runs
// the wgmma kernel only where it is kWgmmaThreads (see prefill_entry.cu).

// Set to false to build the Hopper kernel but always run the portable one.
constexpr bool kEnableWgmmaPath = true;
constexpr int kWgmmaBlockN = 128;                     // keys per K/V tile
constexpr int kWgmmaThreads = 256;                    // 2 warpgroups
constexpr int kWgmmaStubThreads = 32;                 // the stub's bound: "not compiled"
constexpr uint32_t kTileBytes = 128 * kHeadDim * 2;   // one 128-row tile: 32 KiB
constexpr uint32_t kHalfTileBytes = kTileBytes / 2;   // its 64-column half
constexpr size_t kWgmmaSmemBytes = 5 * kTileBytes + 1024;  // Q, 2 K, 2 V, alignment slack
static_assert(kWgmmaBlockN == 128 && kBlockM == 128, "tiles are 128 rows of 128 elements");
static_assert(kWgmmaSmemBytes <= 227 * 1024, "Hopper allows 227 KiB per CTA");
static_assert(kWgmmaSmemBytes >= 2 * kTileBytes + size_t(kBlockM) * kSmemStride * 2,
              "the epilogue stages the output in the K stages");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaThreads, 1)
#else
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaStubThreads, 1)
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy (wgmma) reads; a barrier must follow for other threads' wgmma.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of wgmma accumulators across the asm statements
// that issue / wait for the asynchronous MMA.
__device__ __forceinline__ void fence_operands(float (&d)[16][4]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor, layout type SWIZZLE_128B (bits 62-63 = 1): start address
// (bits 0-13), leading-dimension byte offset (16-29) and stride-dimension byte offset (32-45),
// all in 16-byte units; base offset (49-51) 0, as the tiles are 1024-byte aligned.
//   K-major (Q, K): SBO = 1024 (8 rows of 128 bytes to the next 8); LBO unused (1).
//   MN-major (V): SBO = 1024 (8 keys to the next 8), LBO = 16 KiB (one 64-column half to
//   the next).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Byte offset of 16-byte chunk `chunk` (0-15) of row `row` in a swizzled 128-row tile.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  return (chunk / 8) * kHalfTileBytes + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

#define GQA_WGMMA_D64                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "   \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define GQA_WGMMA_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define GQA_WGMMA_ACC64(d)                                                                \
  GQA_WGMMA_ACC4(d, 0), GQA_WGMMA_ACC4(d, 1), GQA_WGMMA_ACC4(d, 2), GQA_WGMMA_ACC4(d, 3),   \
      GQA_WGMMA_ACC4(d, 4), GQA_WGMMA_ACC4(d, 5), GQA_WGMMA_ACC4(d, 6),                     \
      GQA_WGMMA_ACC4(d, 7), GQA_WGMMA_ACC4(d, 8), GQA_WGMMA_ACC4(d, 9),                     \
      GQA_WGMMA_ACC4(d, 10), GQA_WGMMA_ACC4(d, 11), GQA_WGMMA_ACC4(d, 12),                  \
      GQA_WGMMA_ACC4(d, 13), GQA_WGMMA_ACC4(d, 14), GQA_WGMMA_ACC4(d, 15)

// wgmma m64n128k16 with fp32 accumulators d (this thread's 64: d[j] is n8 block j in the
// mma.sync m16n8 accumulator layout of the thread's warp's 16 rows).
//   ss: D = A B (+ D if accumulate), A and B from shared memory, both K-major.
//   rs: D += A B, A from registers (the mma.sync m16n8k16 A fragment of the warp's 16 rows),
//       B from shared memory, MN-major (transposed: imm-trans-b = 1).
#define GQA_DEFINE_WGMMA_OPS(T, PTX_TYPE)                                                    \
  template <>                                                                               \
  struct WgmmaOps<T> {                                                                      \
    __device__ __forceinline__ static void ss(float (&d)[16][4], uint64_t a, uint64_t b,    \
                                              int accumulate) {                             \
      asm volatile(                                                                         \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                     \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "          \
          GQA_WGMMA_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                  \
          : GQA_WGMMA_ACC64(d)                                                              \
          : "l"(a), "l"(b), "r"(accumulate));                                               \
    }                                                                                       \
    __device__ __forceinline__ static void rs(float (&d)[16][4], const uint32_t (&a)[4],    \
                                              uint64_t b) {                                 \
      asm volatile(                                                                         \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                     \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "          \
          GQA_WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                    \
          : GQA_WGMMA_ACC64(d)                                                              \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                    \
    }                                                                                       \
  };

template <typename T>
struct WgmmaOps;
GQA_DEFINE_WGMMA_OPS(half, "f16")
GQA_DEFINE_WGMMA_OPS(__nv_bfloat16, "bf16")
#undef GQA_DEFINE_WGMMA_OPS
#undef GQA_WGMMA_ACC64
#undef GQA_WGMMA_ACC4
#undef GQA_WGMMA_D64

// One thread's share of a 128-key K or V tile: rows row0 + 16 i (i < 8), 16-byte chunk
// `chunk` of each; rows at or past the sequence end are zero-filled without a global read.
template <typename T>
struct SwizzledKvLoader {
  const T* thread_src;  // this thread's chunk of sequence row row0
  uint32_t thread_dst;  // its byte offset in a tile
  int row0;

  static constexpr int64_t kRowStride = int64_t(kNumKvHeads) * kHeadDim;
  static constexpr int kRowsPerPass = kWgmmaThreads / kChunksPerRow;  // 16

  __device__ __forceinline__ SwizzledKvLoader(const T* tensor, int seq_start, int kv_head,
                                              int tid) {
    row0 = tid / kChunksPerRow;
    const int chunk = tid % kChunksPerRow;
    thread_src = tensor + int64_t(seq_start + row0) * kRowStride + kv_head * kHeadDim + chunk * 8;
    // Rows row0 + 16 i share row0 % 8, so one swizzled offset serves all of them.
    thread_dst = swizzled_offset(row0, chunk);
  }

  __device__ __forceinline__ void load(uint32_t tile, int key0, int seq_len,
                                       const void* tensor) const {
#pragma unroll
    for (int i = 0; i < kWgmmaBlockN / kRowsPerPass; ++i) {
      const int key = key0 + i * kRowsPerPass;
      const bool valid = key + row0 < seq_len;
      const void* src = valid ? static_cast<const void*>(thread_src + key * kRowStride) : tensor;
      cp_async_16(tile + thread_dst + i * kRowsPerPass * 128, src, valid ? 16 : 0);
    }
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, bool kCausal, bool kRagged>
__global__ void GQA_WGMMA_BOUNDS gqa_prefill_wgmma_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Ops = ElementOps<T>;
  using Wgmma = WgmmaOps<T>;
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  // 1024-byte alignment (the swizzle pattern repeats every 8 rows of 128 bytes).
  const uint32_t raw_base = smem_addr(wgmma_smem);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  const uint32_t sQ = base;
  const uint32_t sK = base + kTileBytes;      // stage s at sK + s * kTileBytes
  const uint32_t sV = base + 3 * kTileBytes;  // stage s at sV + s * kTileBytes

  const int kv_head = blockIdx.x % kNumKvHeads;
  TileCoords t;
  if (!locate_tile<kCausal, kRagged>(p, blockIdx.x / kNumKvHeads, t)) return;
  const int num_kv_tiles = (t.kv_len + kWgmmaBlockN - 1) / kWgmmaBlockN;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int warpgroup = warp / 4;
  const int lane = tid % 32;
  const int group = lane / 4;
  const int quad_lane = lane % 4;

  // Q tile: row r = (token r / 4, head r % 4) as in the portable kernel, swizzled.
  {
    const T* q_tile = static_cast<const T*>(p.q) +
                      (int64_t(t.q_row0) * kNumHeads + kv_head * kGroupSize) * kHeadDim;
    const int chunk = tid % kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kBlockM * kChunksPerRow / kWgmmaThreads; ++i) {
      const int row = tid / kChunksPerRow + i * (kWgmmaThreads / kChunksPerRow);
      const int token = row / kGroupSize;
      const bool valid = token < t.tile_tokens;
      const T* src = q_tile +
                     (valid ? (int64_t(token) * kNumHeads + row % kGroupSize) * kHeadDim : 0) +
                     chunk * 8;
      cp_async_16(sQ + swizzled_offset(row, chunk), src, valid ? 16 : 0);
    }
  }
  const SwizzledKvLoader<T> k_loader(static_cast<const T*>(p.k), t.kv_start, kv_head, tid);
  const SwizzledKvLoader<T> v_loader(static_cast<const T*>(p.v), t.kv_start, kv_head, tid);
  // cp.async groups, in order: {Q, K[0]}, {K[1], V[0]}, then one per tile n:
  // {K[n + 2], V[n + 1]} (possibly empty). K[n] lives in K stage n % 2, V[n] in V stage n % 2.
  if (num_kv_tiles > 0) k_loader.load(sK, 0, t.seq_kv, p.k);
  cp_async_commit();
  if (num_kv_tiles > 1) k_loader.load(sK + kTileBytes, kWgmmaBlockN, t.seq_kv, p.k);
  if (num_kv_tiles > 0) v_loader.load(sV, 0, t.seq_kv, p.v);
  cp_async_commit();

  // Descriptors. A (Q): this warpgroup's 64 rows; k step ks (16 columns) is 32 bytes further
  // within a 64-column half (the hardware applies the swizzle to the computed addresses),
  // the second half 16 KiB further. B (K): all 128 keys, the same k steps. B (V): k step ks
  // = keys 16 ks .. 16 ks + 15, 16 rows of 128 bytes further.
  const uint64_t q_desc = smem_desc(sQ + warpgroup * 64 * 128, 16);
  const uint64_t k_desc = smem_desc(sK, 16);
  const uint64_t v_desc = smem_desc(sV, kHalfTileBytes);
  constexpr uint64_t kStageStep = kTileBytes >> 4;  // descriptor units (16 bytes)

  // S[n] = Q K[n]^T (64 rows x 128 keys per warpgroup), issued and committed, not waited.
  auto issue_s = [&](float (&s)[kWgmmaBlockN / 8][4], int n) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint64_t offset = ((ks / 4) * kHalfTileBytes + (ks % 4) * 32) >> 4;
      Wgmma::ss(s, q_desc + offset, k_desc + (n % 2) * kStageStep + offset, ks > 0);
    }
    wgmma_commit();
  };

  float acc[kHeadDim / 8][4];
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int row_token = t.tok0 + (warp * 16 + group) / kGroupSize;

  // P[n] as wgmma A fragments (one per 16 keys), packed from the softmax of S[n].
  uint32_t pa[kWgmmaBlockN / 16][4];
  auto pack_p = [&](const float (&s)[kWgmmaBlockN / 8][4]) {
#pragma unroll
    for (int ks = 0; ks < kWgmmaBlockN / 16; ++ks) {
      pa[ks][0] = Ops::pack(s[2 * ks][0], s[2 * ks][1]);
      pa[ks][1] = Ops::pack(s[2 * ks][2], s[2 * ks][3]);
      pa[ks][2] = Ops::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[ks][3] = Ops::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
  };

  // Prologue: P[0].
  if (num_kv_tiles > 0) {
    cp_async_wait<1>();   // Q and K[0] have landed ...
    fence_proxy_async();  // ... visible to wgmma,
    __syncthreads();      // ... for all threads
    float s[kWgmmaBlockN / 8][4];
    issue_s(s, 0);
    wgmma_wait<0>();
    fence_operands(s);
    scale_and_mask<kCausal>(s, p.scale_log2, t, 0, row_token, quad_lane);
    float rescale[2];
    softmax_tile(s, row_max, row_sum, rescale);  // O is still 0: no rescale
    pack_p(s);
  }

  // O += P[n] V[n], issued and committed, not waited.
  auto issue_pv = [&](int n) {
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kWgmmaBlockN / 16; ++ks) {
      Wgmma::rs(acc, pa[ks], v_desc + (n % 2) * kStageStep + ((ks * 16 * 128) >> 4));
    }
    wgmma_commit();
  };
  // Waits for the loads that iteration n reads (K[n + 1], V[n]) and lets wgmma see them;
  // then stage n % 2 of K and stage (n + 1) % 2 of V are free (K[n], V[n - 1] are done).
  auto sync_tile = [&](int n) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (n + 2 < num_kv_tiles) {
      k_loader.load(sK + (n % 2) * kTileBytes, (n + 2) * kWgmmaBlockN, t.seq_kv, p.k);
    }
    if (n + 1 < num_kv_tiles) {
      v_loader.load(sV + ((n + 1) % 2) * kTileBytes, (n + 1) * kWgmmaBlockN, t.seq_kv, p.v);
    }
    cp_async_commit();
  };

  // Iteration n: O += P[n] V[n] runs on the tensor cores while the softmax of S[n + 1]
  // (issued just before it) runs on the CUDA cores; O is rescaled for tile n + 1 once
  // P[n] V[n] is done. The last tile's P V runs after the loop.
#pragma unroll 1
  for (int n = 0; n + 1 < num_kv_tiles; ++n) {
    sync_tile(n);
    float s[kWgmmaBlockN / 8][4];
    issue_s(s, n + 1);
    issue_pv(n);
    wgmma_wait<1>();  // S[n + 1] is done; P[n] V[n] may still run
    fence_operands(s);
    scale_and_mask<kCausal>(s, p.scale_log2, t, (n + 1) * kWgmmaBlockN, row_token, quad_lane);
    float rescale[2];
    softmax_tile(s, row_max, row_sum, rescale);
    wgmma_wait<0>();
    fence_operands(acc);
    rescale_rows(acc, rescale);
    pack_p(s);
  }
  if (num_kv_tiles > 0) {
    sync_tile(num_kv_tiles - 1);
    issue_pv(num_kv_tiles - 1);
    wgmma_wait<0>();
    fence_operands(acc);
  }

  // Epilogue: stage the output in the K stages (padded rows), free once every warpgroup is
  // past its last wgmma (no copy is in flight: the last tile issued none).
  cp_async_wait<0>();
  __syncthreads();
  T* stage_rows = reinterpret_cast<T*>(wgmma_smem + (sK - raw_base));
  write_output<T>(p, t, kv_head, acc, row_max, row_sum, stage_rows, warp, lane);
#else
  __trap();  // never launched: the host runs the portable kernel where this stub is loaded
#endif
}

}  // namespace gqa_prefill
