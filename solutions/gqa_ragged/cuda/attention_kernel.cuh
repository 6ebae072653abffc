// GQA prefill attention forward for head_dim 128, 32 query heads and 8 KV heads, fp16 or bf16
// in, fp32 accumulate. Two kernels: the portable one (FlashAttention-2 style: mma.sync m16n8k16,
// ldmatrix and cp.async; any sm_90 build), described here, and a Hopper one (FlashAttention-3
// style: TMA, wgmma, warp-specialized; sm_90a builds only), described at
// gqa_prefill_wgmma_kernel below; the host picks one.
//
// A work item = one query tile of one KV head (both kernels): BLOCK_M = 128 rows = 32 query
// tokens x the 4 query heads of the KV group (row r is token r / 4, head 4 * kv_head + r % 4).
// The 4 heads are contiguous in memory, so K/V tiles are loaded once for the group and a row of
// the tile is one contiguous 256-byte row of q / out. Portable kernel: one CTA per item, 8 warps,
// each owning 16 rows. K/V tiles of BLOCK_N = 64 keys stream through shared memory (one K and
// one V buffer): V[n] loads while S = Q K[n]^T is computed, K[n+1] loads while O += P V[n] is.
//
// Causal masks are bottom-right aligned per sequence: query i sees key j iff
// j <= i + seq_kv - seq_q. A row that sees no key ends with output 0 and lse -inf.
//
// q, k and v may be token-strided (any token stride, heads dense); out and lse are contiguous.
//
// Ragged batches: the host never reads indptr values. Each CTA checks that the batch is valid
// (both indptr arrays non-decreasing from 0 to their totals: batch_part_ok); if it is not, only
// well-formed sequences are computed and every other row comes back NaN (poison_slab).
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

// Element offset of token `row` (>= 0) of a tensor whose tokens are `stride` elements apart:
// one 32 x 32 -> 64-bit multiply.
__device__ __forceinline__ uint64_t token_offset(int row, int stride) {
  return uint64_t(uint32_t(row)) * uint32_t(stride);
}

// One thread's share of K and V tiles: 4 of a tile's 64 rows (row_in_tile + 16 i), one 16-byte
// chunk of each. Rows at or past the sequence end are zero-filled without a global read (src
// pointing at the tensor's first row), so padding keys give 0 * 0 in P V, not garbage. K and V
// share one loader (one row index, one shared-memory address): the K/V loop runs at the
// 128-register cap, and two loaders with runtime token strides made it spill.
template <typename T>
struct KvTileLoader {
  const T* k_src;       // this thread's chunk of the sequence's k row row_in_tile
  const T* v_src;       // ... and of its v row
  uint32_t thread_dst;  // shared-memory byte address of the chunk in K's tile row row_in_tile
  int row_in_tile;

  static constexpr int kRowsPerPass = kNumThreads / kChunksPerRow;

  __device__ __forceinline__ KvTileLoader(const Params& p, int seq_start, int kv_head,
                                          const T* k_tile, int tid) {
    row_in_tile = tid / kChunksPerRow;
    const int column = kv_head * kHeadDim + tid % kChunksPerRow * 8;
    k_src = static_cast<const T*>(p.k) + token_offset(seq_start + row_in_tile, p.k_stride) + column;
    v_src = static_cast<const T*>(p.v) + token_offset(seq_start + row_in_tile, p.v_stride) + column;
    thread_dst = smem_addr(k_tile + row_in_tile * kSmemStride + column % kHeadDim);
  }

  // Loads keys [key0, key0 + 64) of a sequence of seq_len keys from src (k_src or v_src; tokens
  // token_stride elements apart; tensor: its first row) into the tile tile_offset bytes past K's.
  __device__ __forceinline__ void load(const T* src, const void* tensor, int token_stride,
                                       uint32_t tile_offset, int key0, int seq_len) const {
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int key = key0 + i * kRowsPerPass;
      const bool valid = key + row_in_tile < seq_len;
      cp_async_16(thread_dst + tile_offset + i * kRowsPerPass * kSmemStride * 2,
                  valid ? static_cast<const void*>(src + token_offset(key, token_stride)) : tensor,
                  valid ? 16 : 0);
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

// ---- Ragged batches with malformed indptr values (read only here, never on the host) ---------
//
// The batch is valid iff both arrays are non-decreasing from 0 to their totals; then every
// sequence is well-formed. Otherwise sequence s is well-formed iff, in both arrays,
// 0 <= a[s] <= a[s + 1] <= total, no earlier boundary lies after a[s] and no later one before
// a[s + 1]: well-formed sequences are computed as usual, every other row of q gets NaN in
// output and lse. The binary searches below find every well-formed sequence whatever the other
// values (each probe before s is <= a[s], each one after s is >= a[s + 1]).

// This thread's part of the validity test (all parts together: the batch is valid).
__device__ __forceinline__ bool indptr_part_ok(const int* a, int n, int total, int thread,
                                               int num_threads) {
  bool ok = thread != 0 || (__ldg(a) == 0 && __ldg(a + n) == total);
#pragma unroll 1
  for (int i = thread; i < n; i += num_threads) ok &= __ldg(a + i) <= __ldg(a + i + 1);
  return ok;
}
// Both arrays' loads in flight at once (& rather than &&): one memory round trip, not two.
__device__ __forceinline__ bool batch_part_ok(const Params& p, int thread, int num_threads) {
  return indptr_part_ok(p.qo_indptr, p.batch, p.total_q, thread, num_threads) &
         indptr_part_ok(p.kv_indptr, p.batch, p.total_kv, thread, num_threads);
}

__device__ __forceinline__ bool sequence_well_formed(const Params& p, int s) {
  const int q_begin = __ldg(p.qo_indptr + s), q_end = __ldg(p.qo_indptr + s + 1);
  const int kv_begin = __ldg(p.kv_indptr + s), kv_end = __ldg(p.kv_indptr + s + 1);
  bool ok = 0 <= q_begin && q_begin <= q_end && q_end <= p.total_q && 0 <= kv_begin &&
            kv_begin <= kv_end && kv_end <= p.total_kv;
  // Boundaries 0 .. s must not lie after the sequence's start, s + 1 .. n not before its end.
#pragma unroll 1
  for (int i = 0; i <= p.batch; ++i) {
    const int q = __ldg(p.qo_indptr + i), kv = __ldg(p.kv_indptr + i);
    ok &= i <= s ? q <= q_begin && kv <= kv_begin : q >= q_end && kv >= kv_end;
  }
  return ok;
}

// Whether query row r belongs to a well-formed sequence: the last one starting at or before r.
__device__ __forceinline__ bool row_covered(const Params& p, int r) {
  int lo = 0, hi = p.batch - 1;
#pragma unroll 1
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(p.qo_indptr + mid) <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return __ldg(p.qo_indptr + lo) <= r && r < __ldg(p.qo_indptr + lo + 1) &&
         sequence_well_formed(p, lo);
}

// Malformed batches only: NaN in output and lse (the 4 heads of kv_head) for the rows of
// slot * 32 .. slot * 32 + 31 that no well-formed sequence covers. The slabs of all slots
// cover q's rows; each (slot, KV head) item's slab is poisoned by whoever takes the item,
// kThreads threads together (thread: 0 .. kThreads - 1). Computed rows are never poisoned.
template <typename T, int kThreads>
__device__ __forceinline__ void poison_slab(const Params& p, int slot, int kv_head, int thread) {
  static_assert(kThreads == 1 || kThreads % kTokensPerTile == 0, "whole rows per pass");
  constexpr int kThreadsPerRow = kThreads == 1 ? 1 : kThreads / kTokensPerTile;
  constexpr int kChunks = kGroupSize * kChunksPerRow;  // a row's 4 heads: 1 KiB, contiguous
  // 0x7fff is a NaN both as float16 and as bfloat16.
  const uint4 nan_pairs = make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
  const float nan = __int_as_float(0x7fffffff);
#pragma unroll 1
  for (int token = thread / kThreadsPerRow; token < kTokensPerTile;
       token += kThreads / kThreadsPerRow) {
    const int64_t row = int64_t(slot) * kTokensPerTile + token;
    if (row >= p.total_q || row_covered(p, int(row))) continue;
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(p.out) +
                                          (row * kNumHeads + kv_head * kGroupSize) * kHeadDim);
#pragma unroll 1
    for (int chunk = thread % kThreadsPerRow; chunk < kChunks; chunk += kThreadsPerRow) {
      out[chunk] = nan_pairs;
    }
    if (thread % kThreadsPerRow == 0) {
      *reinterpret_cast<float4*>(p.lse + row * kNumHeads + kv_head * kGroupSize) =
          make_float4(nan, nan, nan, nan);
    }
  }
}

// The query tile of CTA slot `slot` (blockIdx.x / 8); false for a spare slot (uniform over
// the CTA, which then returns) and, in a malformed batch (!batch_ok), for a slot of a sequence
// that is not well-formed.
template <bool kCausal, bool kRagged>
__device__ __forceinline__ bool locate_tile(const Params& p, int slot, bool batch_ok,
                                            TileCoords& t) {
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
    if (!batch_ok && !sequence_well_formed(p, lo)) return false;
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
    // Every sequence's last tiles first (the heaviest under a causal mask): the persistent
    // Hopper kernel takes slots in this order.
    const int seq = slot % p.batch;
    local = slot / p.batch;
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
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a row with no visible key -> 0
    const int row = warp * 16 + group + 8 * h;
#pragma unroll
    for (int db = 0; db < kHeadDim / 8; ++db) {
      stage(row, db, Ops::pack(acc[db][2 * h] * inv, acc[db][2 * h + 1] * inv));
    }
    if (p.lse != nullptr && quad_lane == 0) {
      const int token = row / kGroupSize;
      if (token < t.tile_tokens) {
        p.lse[int64_t(t.q_row0 + token) * kNumHeads + kv_head * kGroupSize + row % kGroupSize] =
            total > 0.f ? row_max[h] + log2f(total) : -INFINITY;
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

// ---- The portable kernel (mma.sync) -------------------------------------------------------

template <typename T, bool kCausal, bool kRagged>
__global__ void __launch_bounds__(kNumThreads, 2) gqa_prefill_kernel(const Params p) {
  using Ops = ElementOps<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kSmemStride;
  T* sV = sK + kBlockN * kSmemStride;

  const int kv_head = blockIdx.x % kNumKvHeads;
  const int slot = blockIdx.x / kNumKvHeads;
  const int tid = threadIdx.x;
  bool batch_ok = true;
  if constexpr (kRagged) {
    batch_ok = __syncthreads_and(batch_part_ok(p, tid, kNumThreads));
    if (!batch_ok) poison_slab<T, kNumThreads>(p, slot, kv_head, tid);
  }
  TileCoords t;
  if (!locate_tile<kCausal, kRagged>(p, slot, batch_ok, t)) return;
  const int num_kv_tiles = (t.kv_len + kBlockN - 1) / kBlockN;

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
  const KvTileLoader<T> kv_loader(p, t.kv_start, kv_head, sK, tid);
  constexpr uint32_t kVTileOffset = kBlockN * kSmemStride * 2;  // sV - sK, bytes
  if (num_kv_tiles > 0) kv_loader.load(kv_loader.k_src, p.k, p.k_stride, 0, 0, t.seq_kv);
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
    kv_loader.load(kv_loader.v_src, p.v, p.v_stride, kVTileOffset, key0, t.seq_kv);
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
    softmax_tile(s, row_max, row_sum, rescale, 1.f);
    rescale_rows(acc, rescale);

    cp_async_wait_all();  // V[n] has landed ...
    __syncthreads();      // ... for all threads, and every warp is done reading K[n]
    if (n + 1 < num_kv_tiles) {
      kv_loader.load(kv_loader.k_src, p.k, p.k_stride, 0, key0 + kBlockN, t.seq_kv);
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

// ---- The Hopper kernel (TMA, wgmma, warp-specialized; sm_90a only) ------------------------
//
// FlashAttention-3's structure, with the same 128-row query tiles, row order and tile placement
// as the portable kernel. 384 threads in three warpgroups:
//   producer (warpgroup 0, one thread): takes work items (query tile, KV head), finds their
//     sequence (locate_tile; in a malformed ragged batch it also poisons every item's slab,
//     spare ones included) and hands them to the consumers through a 2-slot item buffer,
//     then loads Q and streams K/V tiles with TMA into a 2-stage ring, each load completing
//     on an mbarrier (full), each stage reused once the consumers release it (empty);
//   consumers (warpgroups 1 and 2, 64 rows each): S = Q K^T (wgmma, A and B from shared
//     memory), the online softmax in registers, O += P V (wgmma, A = P from registers),
//     with S[n + 1] issued before P[n] V[n] so that the softmax of one tile runs while the
//     tensor cores work on the other, O's rescale done before P V while Q K^T runs, and the
//     scale folded into the exponentials (one FFMA per logit; the host runs the portable
//     kernel for a scale <= 0); then the epilogue (normalize, lse, stage the rows in shared
//     memory, 16-byte coalesced stores).
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// Causal kernels are persistent: the grid is one CTA per SM, and the producer takes the next
// item with an atomic add on a per-stream counter (next_item), items ordered heaviest first,
// so that SMs that drew short items take more. The last CTA to draw past the end zeroes the
// counter, so the next launch on the stream finds it at 0 without a memset. While the
// consumers finish an item, the producer already loads the next one's Q (causal tiles stage the
// output in a buffer of their own) and K/V. Non-causal items all cost the same: one CTA per
// item, with 176-key tiles (FA3's choice for head_dim 128), which leave no room for an output
// buffer: the output is staged in Q's buffer.
//
// Shared-memory tiles are stored as two 64-column halves of rows of 128 bytes with the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), 1024-byte aligned: what
// TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what a wgmma descriptor of layout type
// SWIZZLE_128B reads, K-major for Q and K, MN-major for V. The Q tile comes from a 3-D view
// of q (dim, head, token), box (64, 4 heads, 32 tokens): row r = (token r / 4, head r % 4).
// K/V tiles come from (dim, kv head, token), box (64, 1, kBlockN). Rows past a sequence's end
// are loaded too (the next sequence's rows, or zeros past the tensor's end, which TMA fills):
// their logits are masked to -inf, so they add 0 * finite to O.
//
// Only an sm_90a build compiles the body (wgmma, setmaxnreg); elsewhere the kernel is a stub
// that traps. The host cannot see __CUDA_ARCH_FEAT_SM90_ALL, so the two versions declare
// different maximum block sizes (__launch_bounds__): the host reads the loaded version's
// value with cudaFuncGetAttributes (maxThreadsPerBlock) and runs this kernel only where it is
// kWgmmaThreads (see prefill_entry.cu).

// Set to false to build the Hopper kernel but always run the portable one.
constexpr bool kEnableWgmmaPath = true;
constexpr int kWgmmaThreads = 384;      // producer + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kWgmmaStubThreads = 32;   // the stub's bound: "not compiled"
constexpr int kKvStages = 2;  // K/V ring depth (each of K and V)
constexpr uint32_t kQTileBytes = kBlockM * kHeadDim * 2;  // 32 KiB
constexpr uint32_t kQHalfBytes = kQTileBytes / 2;

template <bool kCausal>
struct HopperTiles {
  static constexpr int kBlockN = kCausal ? 128 : 176;   // keys per K/V tile
  static constexpr bool kOwnOutputBuffer = kCausal;     // else the output is staged in Q's
  static constexpr bool kPersistent = kCausal;          // else one CTA per work item
  static constexpr uint32_t kKvTileBytes = kBlockN * kHeadDim * 2;
  static constexpr uint32_t kKvHalfBytes = kKvTileBytes / 2;
  // setmaxnreg: 128 producer + 256 consumer threads share 64 K registers. 176-key score tiles
  // need 240 per consumer thread; with 128-key tiles the producer gets 32 (its ragged
  // sequence search spills at 24).
  static constexpr int kProducerRegisters = kCausal ? 32 : 24;
  static constexpr int kConsumerRegisters = kCausal ? 232 : 240;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 256 <= 64 * 1024, "registers");
  // Byte offsets from the 1024-aligned base.
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kQ + kQTileBytes;                  // stage s at + s * tile
  static constexpr uint32_t kV = kK + kKvStages * kKvTileBytes;
  static constexpr uint32_t kO = kOwnOutputBuffer ? kV + kKvStages * kKvTileBytes : kQ;
  static constexpr uint32_t kBarriers = kV + kKvStages * kKvTileBytes +
                                        (kOwnOutputBuffer ? kQTileBytes : 0);
  static constexpr uint32_t kSmemBytes = kBarriers + 256 + 1024;  // barriers, items, alignment
  static_assert(kKvHalfBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper allows 227 KiB per CTA");
};

// The kernel's parameters beyond Params: TMA descriptors (by value, __grid_constant__) and
// the work schedule.
struct HopperParams {
  Params p;
  CUtensorMap q_map;  // q as (dim 128, head 32, token), box (64, 4, 32)
  CUtensorMap k_map;  // k as (dim 128, kv head 8, token), box (64, 1, kBlockN)
  CUtensorMap v_map;
  int* scheduler;  // persistent kernels: int32[2] {items drawn, CTAs done}, zero between launches
  int num_items;   // work items (query tile slot x KV head)
};

// A work item as the producer hands it to the consumers.
struct WorkItem {
  TileCoords t;
  int kv_head;
  int valid;  // 0: no more work, the consumers exit
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaThreads, 1)
#else
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaStubThreads, 1)
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- mbarrier, TMA and wgmma wrappers

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase of the given parity has completed (a fresh barrier counts the phase
// before its first as completed: parity 1 passes at once).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: box at coordinates (c0, c1, c2) of a 3-D tensor map -> shared memory, completing
// `bar`'s transaction count.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (TMA writes, wgmma reads) of the same memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
template <int kNB>
__device__ __forceinline__ void fence_operands(float (&d)[kNB][4]) {
#pragma unroll
  for (int i = 0; i < kNB; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor, layout type SWIZZLE_128B (bits 62-63 = 1): start address
// (bits 0-13), leading-dimension byte offset (16-29) and stride-dimension byte offset (32-45),
// all in 16-byte units; base offset (49-51) 0, as the tiles are 1024-byte aligned.
//   K-major (Q, K): SBO = 1024 (8 rows of 128 bytes to the next 8); LBO unused (1).
//   MN-major (V): SBO = 1024 (8 keys to the next 8), LBO = one 64-column half to the next.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Byte offset of 16-byte chunk `chunk` (0-15) of row `row` in a swizzled tile of two halves.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk, uint32_t half_bytes) {
  return (chunk / 8) * half_bytes + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// wgmma m64nNk16 with fp32 accumulators d (this thread's N / 2: d[j] is n8 block j in the
// mma.sync m16n8 accumulator layout of the thread's warp's 16 rows).
//   ss: D = A B (+ D if accumulate), A and B from shared memory, both K-major.
//   rs: D += A B, A from registers (the mma.sync m16n8k16 A fragment of the warp's 16 rows),
//       B from shared memory, MN-major (transposed: imm-trans-b = 1).
// The operand lists: %0 .. %(N/2 - 1) are the accumulators.
#define GQA_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define GQA_REGS_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define GQA_WGMMA_D128 "{" GQA_REGS_0_63 "}"
#define GQA_WGMMA_D176 "{" GQA_REGS_0_63 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define GQA_WGMMA_ACC128(d)                                                                \
  GQA_ACC4(d, 0), GQA_ACC4(d, 1), GQA_ACC4(d, 2), GQA_ACC4(d, 3), GQA_ACC4(d, 4),          \
      GQA_ACC4(d, 5), GQA_ACC4(d, 6), GQA_ACC4(d, 7), GQA_ACC4(d, 8), GQA_ACC4(d, 9),      \
      GQA_ACC4(d, 10), GQA_ACC4(d, 11), GQA_ACC4(d, 12), GQA_ACC4(d, 13), GQA_ACC4(d, 14), \
      GQA_ACC4(d, 15)
#define GQA_WGMMA_ACC176(d)                                                                 \
  GQA_WGMMA_ACC128(d), GQA_ACC4(d, 16), GQA_ACC4(d, 17), GQA_ACC4(d, 18), GQA_ACC4(d, 19), \
      GQA_ACC4(d, 20), GQA_ACC4(d, 21)

// A_OP, B_OP, P_OP: the operand numbers after the N / 2 accumulators.
#define GQA_DEFINE_WGMMA_SS(T, PTX_TYPE, N, A_OP, B_OP, P_OP)                               \
  template <>                                                                               \
  struct WgmmaSS<T, N> {                                                                    \
    __device__ __forceinline__ static void run(float (&d)[N / 8][4], uint64_t a, uint64_t b, \
                                               int accumulate) {                            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P_OP ", 0;\n"                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE  \
                   " " GQA_WGMMA_D##N ", %" #A_OP ", %" #B_OP ", p, 1, 1, 0, 0;\n}\n"       \
                   : GQA_WGMMA_ACC##N(d)                                                    \
                   : "l"(a), "l"(b), "r"(accumulate));                                      \
    }                                                                                       \
  };
#define GQA_DEFINE_WGMMA_RS(T, PTX_TYPE)                                                     \
  template <>                                                                               \
  struct WgmmaRS<T> {                                                                       \
    __device__ __forceinline__ static void run(float (&d)[16][4], const uint32_t (&a)[4],   \
                                               uint64_t b) {                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                            \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " " \
                   GQA_WGMMA_D128 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"          \
                   : GQA_WGMMA_ACC128(d)                                                    \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));           \
    }                                                                                       \
  };

template <typename T, int N>
struct WgmmaSS;
template <typename T>
struct WgmmaRS;
GQA_DEFINE_WGMMA_SS(half, "f16", 128, 64, 65, 66)
GQA_DEFINE_WGMMA_SS(half, "f16", 176, 88, 89, 90)
GQA_DEFINE_WGMMA_SS(__nv_bfloat16, "bf16", 128, 64, 65, 66)
GQA_DEFINE_WGMMA_SS(__nv_bfloat16, "bf16", 176, 88, 89, 90)
GQA_DEFINE_WGMMA_RS(half, "f16")
GQA_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16")
#undef GQA_DEFINE_WGMMA_SS
#undef GQA_DEFINE_WGMMA_RS
#undef GQA_WGMMA_ACC128
#undef GQA_WGMMA_ACC176
#undef GQA_WGMMA_D128
#undef GQA_WGMMA_D176
#undef GQA_REGS_0_63
#undef GQA_ACC4

// Ring position of the i-th K/V tile (counted over all items of the CTA): stage and the parity
// of its barriers' phase.
struct RingSlot {
  uint32_t stage, parity;
  __device__ __forceinline__ explicit RingSlot(uint32_t i)
      : stage(i % kKvStages), parity((i / kKvStages) & 1) {}
};

// The producer's next item: static (stride gridDim.x) or drawn from the scheduler counter.
// Past the end, the last CTA to get there zeroes the counter for the next launch.
__device__ __forceinline__ int next_item(const HopperParams& hp, int item) {
  if (hp.scheduler == nullptr) return item + gridDim.x;
  const int next = gridDim.x + atomicAdd(hp.scheduler, 1);
  if (next >= hp.num_items) {
    __threadfence();  // this CTA's draws happen before its count below
    if (atomicAdd(hp.scheduler + 1, 1) == int(gridDim.x) - 1) {
      __threadfence();  // every CTA's draws happen before the reset
      hp.scheduler[0] = 0;
      hp.scheduler[1] = 0;
    }
  }
  return next;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, bool kCausal, bool kRagged>
__global__ void GQA_WGMMA_BOUNDS gqa_prefill_wgmma_kernel(const __grid_constant__ HopperParams hp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = HopperTiles<kCausal>;
  constexpr int kBlockN = Tiles::kBlockN;
  const Params& p = hp.p;
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  // 1024-byte alignment (the swizzle pattern repeats every 8 rows of 128 bytes).
  const uint32_t raw_base = smem_addr(wgmma_smem);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  const uint32_t sQ = base + Tiles::kQ;
  const uint32_t sK = base + Tiles::kK;
  const uint32_t sV = base + Tiles::kV;
  const uint32_t sO = base + Tiles::kO;
  // mbarriers (8 bytes each): full = data landed, empty = the consumers are done with it.
  const uint32_t bars = base + Tiles::kBarriers;
  const uint32_t q_full = bars, q_empty = bars + 8;
  const uint32_t k_full = bars + 16, k_empty = k_full + 8 * kKvStages;  // + 8 * stage
  const uint32_t v_full = k_empty + 8 * kKvStages, v_empty = v_full + 8 * kKvStages;
  const uint32_t item_full = v_empty + 8 * kKvStages, item_empty = item_full + 16;  // + 8 * slot
  static_assert(16 + 4 * 8 * kKvStages + 32 <= 128, "the barriers end before the item slots");
  WorkItem* items =
      reinterpret_cast<WorkItem*>(wgmma_smem + (bars - raw_base) + 128);  // 2 slots

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, kConsumerThreads);
    for (int s = 0; s < kKvStages; ++s) {
      mbarrier_init(k_full + 8 * s, 1);
      mbarrier_init(k_empty + 8 * s, kConsumerThreads);
      mbarrier_init(v_full + 8 * s, 1);
      mbarrier_init(v_empty + 8 * s, kConsumerThreads);
    }
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(item_full + 8 * slot, 1);
      mbarrier_init(item_empty + 8 * slot, kConsumerThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Ragged: whether the batch is valid, checked once by all threads together (the producer
  // alone uses it).
  bool batch_ok = true;
  if constexpr (kRagged) {
    batch_ok = __syncthreads_and(batch_part_ok(p, tid, kWgmmaThreads));
  } else {
    __syncthreads();
  }

  if (tid < 128) {
    // ---- Producer warpgroup: one thread works, the others leave.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Tiles::kProducerRegisters));
    if (tid != 0) return;
    tma_prefetch_descriptor(hp.q_map);
    tma_prefetch_descriptor(hp.k_map);
    tma_prefetch_descriptor(hp.v_map);
    uint32_t tile_count = 0;
    int item = blockIdx.x;
#pragma unroll 1
    for (uint32_t n_item = 0;; ++n_item) {
      WorkItem w;
      w.valid = 0;
      while (item < hp.num_items) {
        w.kv_head = item % kNumKvHeads;
        const int tile_slot = item / kNumKvHeads;
        // Every item this thread draws passes here once, spare ones included.
        if (kRagged && !batch_ok) poison_slab<T, 1>(p, tile_slot, w.kv_head, 0);
        if (locate_tile<kCausal, kRagged>(p, tile_slot, batch_ok, w.t)) {
          w.valid = 1;
          break;
        }
        item = next_item(hp, item);  // a spare or malformed sequence's slot of a ragged batch
      }
      const uint32_t slot = n_item % 2;
      mbarrier_wait(item_empty + 8 * slot, ((n_item / 2) & 1) ^ 1);
      items[slot] = w;
      mbarrier_arrive(item_full + 8 * slot);
      if (!w.valid) return;

      mbarrier_wait(q_empty, (n_item & 1) ^ 1);
      mbarrier_arrive_expect_tx(q_full, kQTileBytes);
      for (int half = 0; half < 2; ++half) {
        tma_load_3d(sQ + half * kQHalfBytes, hp.q_map, q_full, half * 64,
                    w.kv_head * kGroupSize, w.t.q_row0);
      }
      const int num_kv_tiles = (w.t.kv_len + kBlockN - 1) / kBlockN;
#pragma unroll 1
      for (int n = 0; n < num_kv_tiles; ++n, ++tile_count) {
        const RingSlot ring(tile_count);
        const int row = w.t.kv_start + n * kBlockN;
        mbarrier_wait(k_empty + 8 * ring.stage, ring.parity ^ 1);
        mbarrier_arrive_expect_tx(k_full + 8 * ring.stage, Tiles::kKvTileBytes);
        for (int half = 0; half < 2; ++half) {
          tma_load_3d(sK + ring.stage * Tiles::kKvTileBytes + half * Tiles::kKvHalfBytes,
                      hp.k_map, k_full + 8 * ring.stage, half * 64, w.kv_head, row);
        }
        mbarrier_wait(v_empty + 8 * ring.stage, ring.parity ^ 1);
        mbarrier_arrive_expect_tx(v_full + 8 * ring.stage, Tiles::kKvTileBytes);
        for (int half = 0; half < 2; ++half) {
          tma_load_3d(sV + ring.stage * Tiles::kKvTileBytes + half * Tiles::kKvHalfBytes,
                      hp.v_map, v_full + 8 * ring.stage, half * 64, w.kv_head, row);
        }
      }
      item = next_item(hp, item);
    }
  }

  // ---- Consumer warpgroups.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Tiles::kConsumerRegisters));
  using Ops = ElementOps<T>;
  using WgmmaS = WgmmaSS<T, kBlockN>;
  using WgmmaPV = WgmmaRS<T>;
  constexpr int kSB = kBlockN / 8;   // n8 blocks of a score tile
  constexpr int kPK = kBlockN / 16;  // k16 steps of P V
  const int ctid = tid - 128;        // 0 .. 255
  const int warp = ctid / 32;        // owns rows 16 warp .. 16 warp + 15 of the tile
  const int warpgroup = warp / 4;    // owns rows 64 warpgroup .. + 63
  const int lane = ctid % 32;
  const int group = lane / 4;
  const int quad_lane = lane % 4;

  // Descriptors. A (Q): this warpgroup's 64 rows; k step ks (16 columns) is 32 bytes further
  // within a 64-column half (the hardware applies the swizzle to the computed addresses).
  // B (K): all kBlockN keys, the same k steps. B (V): k step ks = keys 16 ks .. 16 ks + 15,
  // 16 rows of 128 bytes further.
  const uint64_t q_desc = smem_desc(sQ + warpgroup * 64 * 128, 16);
  const uint64_t k_desc = smem_desc(sK, 16);
  const uint64_t v_desc = smem_desc(sV, Tiles::kKvHalfBytes);
  constexpr uint64_t kStageStep = Tiles::kKvTileBytes >> 4;  // descriptor units (16 bytes)

  uint32_t tile_count = 0;
#pragma unroll 1
  for (uint32_t n_item = 0;; ++n_item) {
    const uint32_t slot = n_item % 2;
    mbarrier_wait(item_full + 8 * slot, (n_item / 2) & 1);
    const WorkItem w = items[slot];
    mbarrier_arrive(item_empty + 8 * slot);
    if (!w.valid) return;
    const TileCoords& t = w.t;
    const int num_kv_tiles = (t.kv_len + kBlockN - 1) / kBlockN;
    const int row_token = t.tok0 + (warp * 16 + group) / kGroupSize;

    // S = Q K^T of ring tile i (64 rows x kBlockN keys per warpgroup), issued and committed.
    auto issue_s = [&](float (&s)[kSB][4], const RingSlot& ring) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint64_t q_step = ((ks / 4) * kQHalfBytes + (ks % 4) * 32) >> 4;
        const uint64_t k_step = ((ks / 4) * Tiles::kKvHalfBytes + (ks % 4) * 32) >> 4;
        WgmmaS::run(s, q_desc + q_step, k_desc + ring.stage * kStageStep + k_step, ks > 0);
      }
      wgmma_commit();
    };
    float acc[kHeadDim / 8][4];
#pragma unroll
    for (int i = 0; i < kHeadDim / 8; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    }
    // O += P V of ring tile i, issued and committed.
    uint32_t pa[kPK][4];
    auto issue_pv = [&](const RingSlot& ring) {
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kPK; ++ks) {
        WgmmaPV::run(acc, pa[ks], v_desc + ring.stage * kStageStep + ((ks * 16 * 128) >> 4));
      }
      wgmma_commit();
    };
    auto pack_p = [&](const float (&s)[kSB][4]) {
#pragma unroll
      for (int ks = 0; ks < kPK; ++ks) {
        pa[ks][0] = Ops::pack(s[2 * ks][0], s[2 * ks][1]);
        pa[ks][1] = Ops::pack(s[2 * ks][2], s[2 * ks][3]);
        pa[ks][2] = Ops::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        pa[ks][3] = Ops::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      }
    };
    // Q's buffer is free for the next item once the last S of this one is done (causal), or
    // once the output staged in it has been written out (non-causal).
    auto release_q = [&]() {
      if constexpr (!Tiles::kOwnOutputBuffer) fence_proxy_async();  // generic use -> TMA
      mbarrier_arrive(q_empty);
    };
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    mbarrier_wait(q_full, n_item & 1);
    // O's rescale factors for the softmax of the latest score tile, applied before the next
    // P V (while the tensor cores run Q K^T).
    float rescale[2] = {1.f, 1.f};
    if (num_kv_tiles > 0) {
      // Prologue: P[0].
      const RingSlot first(tile_count);
      mbarrier_wait(k_full + 8 * first.stage, first.parity);
      float s[kSB][4];
      issue_s(s, first);
      wgmma_wait<0>();
      fence_operands(s);
      mbarrier_arrive(k_empty + 8 * first.stage);
      if (Tiles::kOwnOutputBuffer && num_kv_tiles == 1) release_q();
      mask_tile<kCausal>(s, t, 0, row_token, quad_lane);
      softmax_tile(s, row_max, row_sum, rescale, p.scale_log2);  // O is still 0
      pack_p(s);
    }
    // Iteration n: O += P[n] V[n] runs on the tensor cores while the softmax of S[n + 1]
    // (issued just before it) runs on the CUDA cores. The last tile's P V runs after the loop.
#pragma unroll 1
    for (int n = 0; n + 1 < num_kv_tiles; ++n) {
      const RingSlot current(tile_count + n), next(tile_count + n + 1);
      mbarrier_wait(k_full + 8 * next.stage, next.parity);
      mbarrier_wait(v_full + 8 * current.stage, current.parity);
      float s[kSB][4];
      issue_s(s, next);
      rescale_rows(acc, rescale);
      issue_pv(current);
      wgmma_wait<1>();  // S[n + 1] is done; P[n] V[n] may still run
      fence_operands(s);
      mbarrier_arrive(k_empty + 8 * next.stage);
      if (Tiles::kOwnOutputBuffer && n + 2 == num_kv_tiles) release_q();
      mask_tile<kCausal>(s, t, (n + 1) * kBlockN, row_token, quad_lane);
      softmax_tile(s, row_max, row_sum, rescale, p.scale_log2);
      wgmma_wait<0>();
      fence_operands(acc);
      mbarrier_arrive(v_empty + 8 * current.stage);
      pack_p(s);
    }
    if (num_kv_tiles > 0) {
      const RingSlot last(tile_count + num_kv_tiles - 1);
      mbarrier_wait(v_full + 8 * last.stage, last.parity);
      rescale_rows(acc, rescale);
      issue_pv(last);
      wgmma_wait<0>();
      fence_operands(acc);
      mbarrier_arrive(v_empty + 8 * last.stage);
    } else if (Tiles::kOwnOutputBuffer) {
      release_q();  // no key visible: Q was never read
    }
    tile_count += num_kv_tiles;

    // Epilogue: each warpgroup stages its own 64 rows (swizzled, conflict-free) and writes
    // them out; the barriers keep its threads from overwriting rows still being read.
    // Its addresses are computed here from opaque copies: hoisted out of the item loop, they
    // would be kept live through the main loop (and spilled).
    uint32_t stage = sO;
    int epilogue_tid = ctid;
    asm volatile("" : "+r"(stage), "+r"(epilogue_tid));
    const int epilogue_lane = epilogue_tid % 32;
    normalize_rows<T>(p, t, w.kv_head, acc, row_max, row_sum, epilogue_tid / 32, epilogue_lane,
                      [&](int row, int db, uint32_t pair) {
                        const uint32_t addr = stage + swizzled_offset(row, db, kQHalfBytes) +
                                              (epilogue_lane % 4) * 4;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pair)
                                     : "memory");
                      });
    named_barrier_sync(1 + warpgroup, 128);
    copy_rows_out<T, 64, 128>(p, t, w.kv_head, (epilogue_tid / 128) * 64, epilogue_tid % 128,
                              [&](int row, int chunk) {
                                uint4 v;
                                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                             : "r"(stage + swizzled_offset(row, chunk,
                                                                           kQHalfBytes))
                                             : "memory");
                                return v;
                              });
    named_barrier_sync(1 + warpgroup, 128);
    if constexpr (!Tiles::kOwnOutputBuffer) release_q();
  }
#else
  __trap();  // never launched: the host runs the portable kernel where this stub is loaded
#endif
}

}  // namespace gqa_prefill
