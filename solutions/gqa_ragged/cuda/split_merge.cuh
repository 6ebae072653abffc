// Split-KV's second kernel: the key shares' partial results of a decode-like paged batch
// (clip_to_share, mask_softmax.cuh) merged into the output. Share s of row r (a token and
// head) has its normalised output O_s and its base-2 lse_s; the result is
// sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m) with m = max_s lse_s, and lse m + log2 of the
// sum. A share that saw no key (lse -inf) weighs 0; a row no share saw gets 0 and -inf, as
// unsplit; NaN in any share's lse (a poisoned row: malformed batch, page id out of range)
// makes the row NaN.
#pragma once

#include <algorithm>
#include <cmath>

#include "kernel_config.cuh"

namespace gqa_prefill {

constexpr int kMaxKvShares = 16;

// Key shares for a paged batch on the Hopper path (the host's plan): decode-like batches (at
// most 4 query tokens a sequence: an item a sequence and KV head, too few to fill the GPU, and
// each as long as its context) split each item's keys into shares of at least kMinShareTiles
// key tiles of the average sequence, enough for share_waves items an SM (Knobs::kShareWaves),
// at most kMaxKvShares; 1 otherwise. From shapes only (keys: kv_indices entries x page size, an
// upper bound). Swept on an H200 (cuda/TUNING.md, the share count of decode-like rows): 4
// and 8 alike, 16 slower; 8 shipped.
constexpr int kMinShareTiles = 4;
inline int kv_shares(int64_t total_q, int64_t batch, int64_t keys, int64_t items, int sms,
                     int block_n, int share_waves) {
  if (batch < 1 || total_q > 4 * batch || items < 1) return 1;
  const int64_t by_occupancy = share_waves * int64_t(sms) / items;
  const int64_t by_length = keys / batch / (kMinShareTiles * block_n);
  return static_cast<int>(std::clamp<int64_t>(std::min(by_occupancy, by_length), 1, kMaxKvShares));
}

// The weights of `shares` partial results whose lse values are lse[0], lse[stride], ...:
// weights[s] = 2^(lse_s - m) / sum (all 0 when no share saw a key, all NaN when one is NaN).
// Returns the merged lse.
__host__ __device__ inline float share_weights(const float* lse, int64_t stride, int shares,
                                               float (&weights)[kMaxKvShares]) {
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < shares; ++s) {
    const float x = lse[s * stride];
    nan |= x != x;
    m = x > m ? x : m;
  }
  if (nan || m == -INFINITY) {
    for (int s = 0; s < shares; ++s) weights[s] = nan ? NAN : 0.f;
    return nan ? NAN : -INFINITY;
  }
  float total = 0.f;
  for (int s = 0; s < shares; ++s) {
    weights[s] = exp2f(lse[s * stride] - m);
    total += weights[s];
  }
  const float inverse = 1.f / total;  // one division (the kernel's loads wait on no branch)
  for (int s = 0; s < shares; ++s) weights[s] *= inverse;
  return m + log2f(total);
}

__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(float x, half& y) { y = __float2half_rn(x); }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16& y) {
  y = __float2bfloat16_rn(x);
}

// parts: [shares, rows, 128] of T, part_lse: [shares, rows] (rows = total_q x 32 heads);
// out [rows, 128], lse [rows]. A thread merges 8 columns of one row (16 threads a row). Its loads
// are unrolled over kMaxKvShares and predicated (shares past `shares` read as lse -inf, weight
// 0), so all of a row's lse values and parts are in flight at once: a loop over `shares` waited
// out a load's latency a share (cuda/TUNING.md, the decode kernel's merge).
template <typename T>
__global__ void merge_shares_kernel(const T* __restrict__ parts,
                                    const float* __restrict__ part_lse, T* __restrict__ out,
                                    float* __restrict__ lse, int64_t rows, int shares) {
  constexpr int kChunks = kHeadDim / 8;
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = index / kChunks;
  const int chunk = int(index % kChunks);
  if (row >= rows) return;
  // Loaded whatever the weights, unpredicated (shares past `shares` read share 0 again, weight
  // 0): predicated, ptxas put each load just before its use, one latency a share.
  uint4 bits[kMaxKvShares];
#pragma unroll
  for (int s = 0; s < kMaxKvShares; ++s) {
    const int64_t share = s < shares ? s : 0;
    bits[s] = __ldg(reinterpret_cast<const uint4*>(parts + (share * rows + row) * kHeadDim) + chunk);
  }
  float share_lse[kMaxKvShares], weights[kMaxKvShares];
#pragma unroll
  for (int s = 0; s < kMaxKvShares; ++s) {
    share_lse[s] = s < shares ? __ldg(part_lse + s * rows + row) : -INFINITY;
  }
  const float merged_lse = share_weights(share_lse, 1, kMaxKvShares, weights);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < kMaxKvShares; ++s) {  // no key seen (weight 0): adds nothing (a select)
    const T* values = reinterpret_cast<const T*>(&bits[s]);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += weights[s] != 0.f ? weights[s] * to_float(values[i]) : 0.f;
  }
  uint4 packed;
  T* result = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) from_float(merged_lse != merged_lse ? NAN : acc[i], result[i]);
  *reinterpret_cast<uint4*>(out + row * kHeadDim + chunk * 8) = packed;
  if (chunk == 0) lse[row] = merged_lse;
}

}  // namespace gqa_prefill
