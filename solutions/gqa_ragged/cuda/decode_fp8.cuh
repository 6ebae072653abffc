// Decode-like batches over an FP8 cache (gqa_paged_prefill_causal_fp8kv, at most 4 query tokens
// a sequence on average): gqa_decode_fp8_kernel, a lean split-KV kernel in place of the Hopper
// kernel, whose 128-row items are 4-16 rows of work here (cuda/TUNING.md, "Decode-like rows,
// FP8: the decode kernel"). It hides latency by occupancy, as Triton's decode tile does: 3 CTAs
// of 4 warps an SM, no warp specialization, no barrier a key chunk.
//
// A CTA is (key share, KV head, sequence), numbered share fastest. Its rows are a group of
// kTokens query tokens x the KV head's 4 query heads (one m16 row tile: row r is token r / 4,
// head r % 4; kTokens 1 leaves rows 4-15 zero); a sequence with more tokens runs its groups in
// turn. The group's visible keys are cut into 32-key chunks (half a page) and the chunks into
// `shares` equal runs, one a CTA; warp w takes chunks w, w + 4, ... of the run with its own
// running max, sum and 16 x 128 fp32 output, two cp.async stages of its own (16-byte pieces;
// keys no row of the group sees are zero-filled, so NaN past a sequence never reaches P V), and
// the four warps are merged in shared memory at the end (flash-decoding's split inside the CTA).
// Q K^T and P V are mma.sync m16n8k16 in float16 with fp32 accumulators: K's B fragments are two
// e4m3 bytes of a key row (one cvt e4m3x2 -> f16x2 a register, exact), V's two bytes of two key
// rows; S's accumulators become P's A fragments (FA2's reuse). Hopper has no 16-row FP8 product
// (an e4m3 mma.sync becomes unpacks and an f16 HMMA on sm_90a: TUNING.md), so K is converted.
// q goes to float16 scaled by a power of two a row (its largest |q| into [2^14, 2^15): exact
// for every bf16 value down to 2^-24 of the row's largest; the factor's inverse joins the row's
// softmax scale), as the Hopper kernel's split of q into e4m3 terms does.
//
// Output: each share's normalised O (q's dtype, times v_scale) and base-2 lse into parts
// [shares, rows, 128] and part_lse [shares, rows] (rows = total_q x 32), merged by
// merge_shares_kernel; with one share these are the output and lse themselves.
//
// The Hopper kernel's semantics, kept: a batch whose indptr arrays are malformed computes its
// well-formed sequences only, every other row NaN (batch_part_ok, sequence_well_formed; the
// rows no well-formed sequence covers are poisoned by the share-0 CTAs, 4 rows a sequence
// index: the host sends no batch with more than 4 query rows a sequence); a page id outside
// [0, num_pages) is never dereferenced (its keys load as zeros) and makes its share's rows NaN,
// as does a last-page length outside [1, 64]; a row that sees no key gets 0 and lse -inf.
#pragma once

#include <cuda_fp8.h>

#include "kernel_config.cuh"
#include "kv_paged.cuh"
#include "ptx_sm80.cuh"
#include "split_merge.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeChunk = 32;   // keys a warp takes a step: half a page of 64
constexpr int kDecodePage = 64;    // the FP8 definition's page size
constexpr int kDecodeRowBytes = kHeadDim + 16;  // a key's 128 bytes, padded: no bank twice
constexpr int kDecodeChunkBytes = kDecodeChunk * kDecodeRowBytes;
constexpr int kDecodeWarpBytes = 2 * 2 * kDecodeChunkBytes;  // two stages of K and V
constexpr int kDecodeSmemBytes = kDecodeWarps * kDecodeWarpBytes;  // 72 KiB: 3 CTAs an SM
constexpr int kDecodeTokenBytes = kNumKvHeads * kHeadDim;         // a key's row of every head
constexpr int kDecodeMaxShares = kMaxKvShares;
static_assert(kDecodeWarps * 16 * (kHeadDim + 2) * 4 <= kDecodeSmemBytes, "the warps' merge");

struct DecodeParams {
  Params p;
  PageTable pages;
  void* parts;      // [shares, total_q * 32, 128] of q's dtype
  float* part_lse;  // [shares, total_q * 32]
  int shares;
};

// Key shares of the decode kernel (host plan): about 4 waves of 3 CTAs an SM over the batch's
// (sequence, KV head) pairs, each share at least 512 keys of the average sequence, at most
// kDecodeMaxShares. keys: kv_indices entries x 64 (a bound). More than 4 x 3 x sms pairs get
// one share, so the grid is the host's bound on pairs (uses_decode_kernel).
inline int decode_shares(int64_t batch, int64_t keys, int sms) {
  constexpr int64_t kWaves = 4, kCtasPerSm = 3, kMinShareKeys = 512;
  const int64_t pairs = std::max<int64_t>(batch, 1) * kNumKvHeads;
  const int64_t by_occupancy = (kWaves * kCtasPerSm * sms + pairs - 1) / pairs;
  const int64_t by_length = keys / std::max<int64_t>(batch, 1) / kMinShareKeys;
  return static_cast<int>(
      std::clamp<int64_t>(std::min(by_occupancy, by_length), 1, kDecodeMaxShares));
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// c += a b, float16 m16n8k16 (ptx_sm80.cuh's fragment layout: g = lane / 4, t = lane % 4; a[0],
// a[2]: row g, a[1], a[3]: row g + 8; kRows16: whether rows 8-15 are live, else their zeros
// are constants).
template <bool kRows16>
__device__ __forceinline__ void decode_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1) {
  const uint32_t a[4] = {a0, kRows16 ? a1 : 0u, a2, kRows16 ? a3 : 0u};
  ElementOps<half>::mma(c, a, b0, b1);
}

// A warp's 32 K and V rows of chunk c (keys 32 c ..) into its stage: 8 pieces of 16 bytes a
// row, rows from `live_keys` on zero-filled. Returns false (nothing read) for a page id out of
// range.
__device__ __forceinline__ bool load_decode_chunk(const DecodeParams& d, int first_entry,
                                                  int live_keys, int kv_head, int c,
                                                  uint32_t k_dst, uint32_t v_dst, int lane) {
  const int page = __ldg(d.pages.kv_indices + first_entry + c / 2);
  const bool in_range = page_in_range(page, d.pages);
  const int64_t within = int64_t((c % 2) * kDecodeChunk) * kDecodeTokenBytes + kv_head * kHeadDim;
  const char* k_base = static_cast<const char*>(d.p.k) + (in_range ? page * d.pages.k_page_stride + within : 0);
  const char* v_base = static_cast<const char*>(d.p.v) + (in_range ? page * d.pages.v_page_stride + within : 0);
#pragma unroll
  for (int i = 0; i < kDecodeChunk * 8 / 32; ++i) {
    const int piece = lane + 32 * i, row = piece / 8, col = (piece % 8) * 16;
    const bool live = in_range && c * kDecodeChunk + row < live_keys;
    const int64_t offset = live ? int64_t(row) * kDecodeTokenBytes + col : 0;
    cp_async_16(k_dst + row * kDecodeRowBytes + col, k_base + offset, live ? 16 : 0);
    cp_async_16(v_dst + row * kDecodeRowBytes + col, v_base + offset, live ? 16 : 0);
  }
  return in_range;
}

// NaN in output and lse of every share for rows [row0, row0 + 4) of heads 4 kv_head .. + 3 that
// no well-formed sequence covers (malformed batches only).
template <typename T>
__device__ void poison_uncovered(const DecodeParams& d, int row0, int kv_head) {
  const int64_t rows = int64_t(d.p.total_q) * kNumHeads;
  for (int i = threadIdx.x; i < 4 * kGroupSize * d.shares; i += kDecodeThreads) {
    const int token = row0 + i / kGroupSize % 4, head = kv_head * kGroupSize + i % kGroupSize;
    const int share = i / (4 * kGroupSize);
    if (token >= d.p.total_q || row_covered(d.p, token)) continue;
    const int64_t row = share * rows + int64_t(token) * kNumHeads + head;
    T* out = static_cast<T*>(d.parts) + row * kHeadDim;
    for (int j = 0; j < kHeadDim; ++j) from_float(__int_as_float(0x7fffffff), out[j]);
    d.part_lse[row] = __int_as_float(0x7fffffff);
  }
}

template <typename T, int kTokens>
__global__ void __launch_bounds__(kDecodeThreads, 3) gqa_decode_fp8_kernel(const DecodeParams d) {
  static_assert(kTokens == 1 || kTokens == 4, "one token or four in the m16 row tile");
  constexpr bool kRows16 = kTokens == 4;
  constexpr int kRows = 4 * kTokens;  // live rows of the tile
  extern __shared__ __align__(16) uint8_t decode_smem[];
  const Params& p = d.p;
  const int share = int(blockIdx.x % unsigned(d.shares));
  const int kv_head = int(blockIdx.x / unsigned(d.shares)) % kNumKvHeads;
  const int seq = int(blockIdx.x / unsigned(d.shares * kNumKvHeads));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  if (!__syncthreads_and(batch_part_ok(p, threadIdx.x, kDecodeThreads))) {
    if (share == 0) poison_uncovered<T>(d, 4 * seq, kv_head);
    if (!sequence_well_formed(p, seq)) return;
  }
  const int q_begin = __ldg(p.qo_indptr + seq), q_len = __ldg(p.qo_indptr + seq + 1) - q_begin;
  const int first_entry = __ldg(p.kv_indptr + seq);
  const int kv_len = PagedKeys<kDecodePage>{d.pages.last_page_len}(
      seq, __ldg(p.kv_indptr + seq + 1) - first_entry);
  const int64_t rows = int64_t(p.total_q) * kNumHeads;
  const uint32_t smem = smem_addr(decode_smem);
  const uint32_t stages = smem + warp * kDecodeWarpBytes;  // stage s: K at s * 2 chunks, V after

#pragma unroll 1
  for (int tok0 = 0; tok0 < q_len; tok0 += kTokens) {
    const int causal_offset = kv_len - q_len;  // token i sees keys j <= i + causal_offset
    const int group_end = min(tok0 + kTokens, q_len);
    const int live_keys = max(0, min(kv_len, group_end + causal_offset));
    const int chunks = (live_keys + kDecodeChunk - 1) / kDecodeChunk;
    const int per_share = (chunks + d.shares - 1) / d.shares;
    const int chunk_lo = share * per_share, chunk_hi = min(chunk_lo + per_share, chunks);

    // This thread's rows g and g + 8 (r = 0, 1): token g / 4 + 2 r, head g % 4; their last
    // visible key (-1: none, or a row past the group's tokens).
    int last_key[2];
    float row_scale[2];  // the softmax scale (base 2) over q's power-of-two factor
    uint32_t qa[8][4];   // Q's A fragments for the 8 k-steps of 16 dims
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int token = tok0 + g / 4 + 2 * r;
      const bool live = (kRows16 || (r == 0 && g < 4)) && token < q_len;
      last_key[r] = live ? min(kv_len - 1, token + causal_offset) : -1;
      const T* q_row = static_cast<const T*>(p.q) +
                       token_offset(q_begin + (live ? token : 0), p.q_stride) +
                       (kv_head * kGroupSize + g % 4) * kHeadDim;
      float x[8][4];
      float top = 0.f;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const T* pair = q_row + 16 * s + 8 * h + 2 * t;
          x[s][2 * h] = live ? to_float(pair[0]) : 0.f;
          x[s][2 * h + 1] = live ? to_float(pair[1]) : 0.f;
          top = fmaxf(top, fmaxf(fabsf(x[s][2 * h]), fabsf(x[s][2 * h + 1])));
        }
      }
      top = fmaxf(top, __shfl_xor_sync(~0u, top, 1));
      top = fmaxf(top, __shfl_xor_sync(~0u, top, 2));
      // fmaxf drops NaN: a row with NaN or inf in q takes the NaN scale from any of its lanes.
      bool bad = false;
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) bad |= !isfinite(x[s][i]);
      bad = __shfl_xor_sync(~0u, int(bad), 1) | bad;
      bad = __shfl_xor_sync(~0u, int(bad), 2) | bad;
      // Exponents within [-112, 127]: the factor and its inverse stay normal floats.
      const int e = min(max(int(__float_as_uint(top) >> 23) - 127, -112), 127);
      const float scale = bad ? __int_as_float(0x7fffffff) : __uint_as_float(uint32_t(127 + 14 - e) << 23);
      row_scale[r] = p.scale_log2 * __uint_as_float(uint32_t(127 - 14 + e) << 23);
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const __half2 lo = __floats2half2_rn(x[s][0] * scale, x[s][1] * scale);
        const __half2 hi = __floats2half2_rn(x[s][2] * scale, x[s][3] * scale);
        qa[s][r] = *reinterpret_cast<const uint32_t*>(&lo);      // a[0] (r 0) or a[1] (r 1)
        qa[s][2 + r] = *reinterpret_cast<const uint32_t*>(&hi);  // a[2] or a[3]
      }
    }

    float o[16][4];  // n-tile j: dims 8 j + 2 t, + 1 of row g (o[j][0..1]) and g + 8 ([2..3])
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (base 2) and sum
    bool poisoned = false;  // a page id out of range in this warp's chunks

    int c = chunk_lo + warp;
    if (c < chunk_hi) {
      poisoned |= !load_decode_chunk(d, first_entry, live_keys, kv_head, c, stages,
                                     stages + kDecodeChunkBytes, lane);
    }
    cp_async_commit();
#pragma unroll 1
    for (int stage = 0; c < chunk_hi; c += kDecodeWarps, stage ^= 1) {
      if (c + kDecodeWarps < chunk_hi) {
        const uint32_t next = stages + (stage ^ 1) * 2 * kDecodeChunkBytes;
        poisoned |= !load_decode_chunk(d, first_entry, live_keys, kv_head, c + kDecodeWarps,
                                       next, next + kDecodeChunkBytes, lane);
      }
      cp_async_commit();
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      __syncwarp();
      const uint8_t* k_tile = decode_smem + warp * kDecodeWarpBytes + stage * 2 * kDecodeChunkBytes;
      const uint8_t* v_tile = k_tile + kDecodeChunkBytes;

      float s[4][4];  // S: n-tile j holds keys 8 j + 2 t, + 1 of rows g ([0..1]) and g + 8
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const uint8_t* k_row = k_tile + (8 * j + g) * kDecodeRowBytes + 2 * t;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const uint32_t b0 = e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t*>(k_row + 16 * kk));
          const uint32_t b1 =
              e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t*>(k_row + 16 * kk + 8));
          decode_mma<kRows16>(s[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < (kRows16 ? 2 : 1); ++r) {
        float row_max = m[r];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = c * kDecodeChunk + 8 * j + 2 * t + e;
            float& x = s[j][2 * r + e];
            x = key <= last_key[r] ? x * row_scale[r] : -INFINITY;  // a select: NaN K masked
            row_max = fmaxf(row_max, x);
          }
        }
        row_max = fmaxf(row_max, __shfl_xor_sync(~0u, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(~0u, row_max, 2));
        const float base = row_max == -INFINITY ? 0.f : row_max;  // no key seen yet
        alpha[r] = exp2f(m[r] - base);
        float row_sum = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[j][2 * r + e] = exp2f(s[j][2 * r + e] - base);
            row_sum += s[j][2 * r + e];
          }
        }
        row_sum += __shfl_xor_sync(~0u, row_sum, 1);
        row_sum += __shfl_xor_sync(~0u, row_sum, 2);
        l[r] = l[r] * alpha[r] + row_sum;
        m[r] = row_max;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        if constexpr (kRows16) {
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int step = 0; step < 2; ++step) {  // keys 16 step .. + 15
        const __half2 p0 = __floats2half2_rn(s[2 * step][0], s[2 * step][1]);
        const __half2 p2 = __floats2half2_rn(s[2 * step + 1][0], s[2 * step + 1][1]);
        const __half2 p1 = __floats2half2_rn(s[2 * step][2], s[2 * step][3]);
        const __half2 p3 = __floats2half2_rn(s[2 * step + 1][2], s[2 * step + 1][3]);
        const uint8_t* v_col = v_tile + (16 * step + 2 * t) * kDecodeRowBytes + g;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint8_t* v = v_col + 8 * j;
          const uint16_t lo = uint16_t(v[0] | (v[kDecodeRowBytes] << 8));
          const uint16_t hi = uint16_t(v[8 * kDecodeRowBytes] | (v[9 * kDecodeRowBytes] << 8));
          decode_mma<kRows16>(o[j], *reinterpret_cast<const uint32_t*>(&p0),
                              *reinterpret_cast<const uint32_t*>(&p1),
                              *reinterpret_cast<const uint32_t*>(&p2),
                              *reinterpret_cast<const uint32_t*>(&p3), e4m3x2_to_f16x2(lo),
                              e4m3x2_to_f16x2(hi));
        }
      }
      __syncwarp();  // the stage is refilled by the next step's load
    }
    cp_async_wait_all();
    poisoned = __syncthreads_or(poisoned);  // also: every warp's stages are read

    // The four warps' rows merged: [warp][row][128] outputs, then [warp][row] (m, l).
    float* merged = reinterpret_cast<float*>(decode_smem);
    float* stats = merged + kDecodeWarps * 16 * kHeadDim;
#pragma unroll
    for (int r = 0; r < (kRows16 ? 2 : 1); ++r) {
      const int row = g + 8 * r;
      if (row < kRows) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          merged[(warp * 16 + row) * kHeadDim + 8 * j + 2 * t] = o[j][2 * r];
          merged[(warp * 16 + row) * kHeadDim + 8 * j + 2 * t + 1] = o[j][2 * r + 1];
        }
        if (t == 0) {
          stats[(warp * 16 + row) * 2] = m[r];
          stats[(warp * 16 + row) * 2 + 1] = l[r];
        }
      }
    }
    __syncthreads();
    // Thread: row warp + 4 i (i < kTokens), dims 4 lane .. + 3.
#pragma unroll 1
    for (int row = warp; row < kRows; row += kDecodeWarps) {
      const int token = tok0 + row / 4;
      if (token >= q_len) break;
      float top = -INFINITY;
      for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, stats[(w * 16 + row) * 2]);
      float total = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float mw = stats[(w * 16 + row) * 2];
        const float weight = mw == -INFINITY ? 0.f : exp2f(mw - top);
        total += stats[(w * 16 + row) * 2 + 1] * weight;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += merged[(w * 16 + row) * kHeadDim + 4 * lane + i] * weight;
      }
      // kv_len -1: a malformed last-page length; poisoned: a page id out of range.
      // total NaN (NaN in q or a visible key) stays NaN; 0: no key seen.
      const bool nan = poisoned || kv_len < 0, empty = total == 0.f;
      const float inv = empty ? 0.f : d.pages.v_scale / total;
      const int64_t out_row = share * rows + int64_t(q_begin + token) * kNumHeads +
                              kv_head * kGroupSize + row % 4;
      T out[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) from_float(nan ? __int_as_float(0x7fffffff) : acc[i] * inv, out[i]);
      *reinterpret_cast<uint2*>(static_cast<T*>(d.parts) + out_row * kHeadDim + 4 * lane) =
          *reinterpret_cast<const uint2*>(out);
      if (lane == 0) {
        d.part_lse[out_row] = nan ? __int_as_float(0x7fffffff)
                              : empty ? -INFINITY : top + log2f(total);
      }
    }
    __syncthreads();  // the merge's buffer is the next group's stages
  }
}

}  // namespace gqa_prefill
