// On the GPU: the CUDA solution's decode kernel (gqa_decode_fp8_kernel, decode_fp8.cuh) and its
// merge (merge_shares_kernel) timed by share count (the host's plan, decode_shares, is marked),
// with and without the merge, for its 1-token groups (what the host launches on single-token
// rows) and its 4-token groups, every row checked against a float64 reference. The batch:
// single_token_rows_16's shape by default (16 single-token rows, 4.6K-14.5K keys each, 2142 FP8
// pages of 64 tokens x 8 KV heads x 128, the workload's lengths), or BATCH sequences of
// MEAN_KEYS keys on average (uniform in [MEAN / 2, 3 MEAN / 2]); a shuffled page table.
// cuda/TUNING.md, "Decode-like rows, FP8: the decode kernel". Written first as a standalone copy
// of the kernel's design (session 30), run on an H200 in session 31, then built into the
// solution; this harness includes the solution's headers, so there is one kernel.
//
//     nvcc -O3 -arch=sm_90a -std=c++17 -o decode_probe scripts/decode_probe.cu
//     ./decode_probe [REPS [BATCH MEAN_KEYS]]   # a table: group tokens, shares, us with the
//                                               # merge, without, TB/s, errors
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../solutions/gqa_ragged/cuda/decode_fp8.cuh"

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e = (x);                                               \
    if (e != cudaSuccess) {                                            \
      printf("%s: %s\n", #x, cudaGetErrorString(e));                   \
      exit(1);                                                         \
    }                                                                  \
  } while (0)

using gqa_prefill::kDecodeSmemBytes;
using gqa_prefill::kDecodeThreads;
constexpr int kHeadDim = 128, kKvHeads = 8, kHeads = 32, kGroup = 4, kPage = 64;
constexpr int kTokenBytes = kKvHeads * kHeadDim;  // one token's FP8 row of every KV head

// single_token_rows_16's page counts and last-page lengths (its blob's kv_indptr diffs).
const int kPagesOf[16] = {125, 73, 223, 161, 120, 72, 103, 162, 86, 162, 87, 110, 92, 213, 227, 126};
const int kLastOf[16] = {33, 5, 26, 44, 34, 10, 36, 38, 20, 16, 12, 24, 28, 54, 52, 50};

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float uniform() {  // [-1, 1)
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return float((rng >> 40) & 0xFFFFFF) / float(1 << 23) - 1.f;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 30;
  const int batch = argc > 3 ? atoi(argv[2]) : 16;
  std::vector<int> pages_of(kPagesOf, kPagesOf + 16), last(kLastOf, kLastOf + 16);
  if (argc > 3) {  // BATCH sequences of MEAN_KEYS keys on average
    const int mean = atoi(argv[3]);
    pages_of.resize(batch);
    last.resize(batch);
    for (int b = 0; b < batch; ++b) {
      const int keys = std::max(1, int(mean * (1.f + 0.5f * uniform())));
      pages_of[b] = (keys + kPage - 1) / kPage;
      last[b] = keys - (pages_of[b] - 1) * kPage;
    }
  }
  std::vector<int> indptr(batch + 1, 0);
  for (int b = 0; b < batch; ++b) indptr[b + 1] = indptr[b] + pages_of[b];
  const int used = indptr[batch], num_pages = used + 3;
  std::vector<int> ids(num_pages);
  for (int i = 0; i < num_pages; ++i) ids[i] = i;
  for (int i = num_pages - 1; i > 0; --i) std::swap(ids[i], ids[int((uniform() + 1.f) * 0.5f * (i + 1)) % (i + 1)]);
  ids.resize(used);
  const size_t cache_bytes = size_t(num_pages) * kPage * kTokenBytes;
  std::vector<uint8_t> k(cache_bytes), v(cache_bytes), levels(4096);
  for (int i = 0; i < 4096; ++i)  // e4m3 of 4096 values evenly over [-3, 3): a lookup a byte
    levels[i] = __nv_cvt_float_to_fp8(3.f * (i / 2048.f - 1.f), __NV_SATFINITE, __NV_E4M3);
  for (size_t i = 0; i < cache_bytes; ++i) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    k[i] = levels[(rng >> 40) & 4095];
    v[i] = levels[(rng >> 52) & 4095];
  }
  std::vector<__nv_bfloat16> q(size_t(batch) * kHeads * kHeadDim);
  for (auto& x : q) x = __float2bfloat16(2.f * uniform());
  const float sm_scale = 1.f / sqrtf(float(kHeadDim)), k_scale = 0.5f, v_scale = 2.f;

  // The float64 reference (every row) from the e4m3 values as the GPU reads them.
  float decoded[256];
  for (int b = 0; b < 256; ++b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3);
    decoded[b] = __half2float(__half(h));
  }
  std::vector<double> ref_out(q.size()), ref_lse(size_t(batch) * kHeads);
  for (int b = 0; b < batch; ++b) {
    const int kv_len = (pages_of[b] - 1) * kPage + last[b];
    std::vector<double> scores(kv_len);
    for (int h = 0; h < kHeads; ++h) {
      const __nv_bfloat16* qh = &q[(size_t(b) * kHeads + h) * kHeadDim];
      double top = -INFINITY;
      for (int key = 0; key < kv_len; ++key) {
        const size_t base = (size_t(ids[indptr[b] + key / kPage]) * kPage + key % kPage) * kTokenBytes +
                            (h / kGroup) * kHeadDim;
        double dot = 0;
        for (int d = 0; d < kHeadDim; ++d) dot += double(__bfloat162float(qh[d])) * decoded[k[base + d]];
        scores[key] = dot * sm_scale * k_scale;
        top = std::max(top, scores[key]);
      }
      double total = 0, acc[kHeadDim] = {0};
      for (int key = 0; key < kv_len; ++key) {
        const size_t base = (size_t(ids[indptr[b] + key / kPage]) * kPage + key % kPage) * kTokenBytes +
                            (h / kGroup) * kHeadDim;
        const double w = exp(scores[key] - top);
        total += w;
        for (int d = 0; d < kHeadDim; ++d) acc[d] += w * decoded[v[base + d]];
      }
      for (int d = 0; d < kHeadDim; ++d) ref_out[(size_t(b) * kHeads + h) * kHeadDim + d] = acc[d] / total * v_scale;
      ref_lse[size_t(b) * kHeads + h] = (top + log(total)) / log(2.0);
    }
  }

  uint8_t *dk, *dv;
  int *d_indptr, *d_ids, *d_last;
  __nv_bfloat16 *dq, *d_out;
  __nv_bfloat16* d_part_o;
  float *d_part_lse, *d_lse;
  char* flush;
  const size_t flush_bytes = size_t(256) << 20;  // past the L2
  CK(cudaMalloc(&dk, cache_bytes));
  CK(cudaMalloc(&dv, cache_bytes));
  CK(cudaMalloc(&dq, q.size() * 2));
  CK(cudaMalloc(&d_out, q.size() * 2));
  CK(cudaMalloc(&d_lse, size_t(batch) * kHeads * 4));
  CK(cudaMalloc(&d_indptr, (batch + 1) * 4));
  CK(cudaMalloc(&d_ids, used * 4));
  CK(cudaMalloc(&d_last, batch * 4));
  constexpr int kMost = gqa_prefill::kDecodeMaxShares;
  CK(cudaMalloc(&d_part_o, size_t(kMost) * q.size() * 2));
  CK(cudaMalloc(&d_part_lse, size_t(kMost) * batch * kHeads * 4));
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemcpy(dk, k.data(), cache_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, v.data(), cache_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_indptr, indptr.data(), (batch + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_ids, ids.data(), used * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_last, last.data(), batch * 4, cudaMemcpyHostToDevice));
  std::vector<int> qo_indptr(batch + 1);
  for (int b = 0; b <= batch; ++b) qo_indptr[b] = b;  // one token a sequence
  int* d_qo_indptr;
  CK(cudaMalloc(&d_qo_indptr, (batch + 1) * 4));
  CK(cudaMemcpy(d_qo_indptr, qo_indptr.data(), (batch + 1) * 4, cudaMemcpyHostToDevice));

  gqa_prefill::Params params{};
  params.q = dq;
  params.k = dk;
  params.v = dv;
  params.q_stride = kHeads * kHeadDim;
  params.qo_indptr = d_qo_indptr;
  params.kv_indptr = d_indptr;
  params.batch = batch;
  params.total_q = batch;
  params.total_kv = used;
  params.scale_log2 = sm_scale * k_scale * 1.4426950408889634f;  // k_scale folded, as the host does
  gqa_prefill::PageTable pages{};
  pages.kv_indices = d_ids;
  pages.last_page_len = d_last;
  pages.num_pages = num_pages;
  pages.v_scale = v_scale;
  pages.k_page_stride = pages.v_page_stride = int64_t(kPage) * kTokenBytes;

  auto* one = gqa_prefill::gqa_decode_fp8_kernel<__nv_bfloat16, 1>;
  auto* four = gqa_prefill::gqa_decode_fp8_kernel<__nv_bfloat16, 4>;
  for (auto* kernel : {one, four}) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDecodeSmemBytes));
    cudaFuncAttributes attributes;
    CK(cudaFuncGetAttributes(&attributes, kernel));
    int ctas_per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, kDecodeThreads,
                                                     kDecodeSmemBytes));
    printf("gqa_decode_fp8_kernel<bf16, %d>: %d registers, %zu bytes of local memory, %d CTAs an SM\n",
           kernel == one ? 1 : 4, attributes.numRegs, attributes.localSizeBytes, ctas_per_sm);
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int plan = gqa_prefill::decode_shares(batch, int64_t(used) * kPage, sms);
  printf("batch %d, %d pages; the host's plan here: %d shares\n", batch, used, plan);

  const int rows = batch * kHeads;
  double kv_bytes = 0;
  for (int b = 0; b < batch; ++b) kv_bytes += 2.0 * ((pages_of[b] - 1) * kPage + last[b]) * kTokenBytes;
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  printf("tokens  shares  us (with merge)  us (decode only)  TB/s  normwise out error  max |lse - ref|\n");
  std::vector<int> counts;
  for (int shares : {1, 2, 4, 8, 12, 16, 24, 32, 48, 64}) {
    if (shares <= kMost) counts.push_back(shares);
  }
  if (std::find(counts.begin(), counts.end(), plan) == counts.end()) counts.push_back(plan);
  std::sort(counts.begin(), counts.end());
  for (auto* kernel : {one, four}) {
    for (int shares : counts) {
      const gqa_prefill::DecodeParams d{params, pages, d_part_o, d_part_lse, shares};
      float times[2] = {0.f, 0.f};
      for (int merged = 0; merged < 2; ++merged) {
        std::vector<float> samples;
        for (int rep = 0; rep < reps + 3; ++rep) {
          CK(cudaMemsetAsync(flush, rep & 0xFF, flush_bytes));
          CK(cudaEventRecord(start));
          kernel<<<shares * kKvHeads * batch, kDecodeThreads, kDecodeSmemBytes>>>(d);
          if (merged)  // as the CUDA solution launches it (entry_launch.cuh): 16 threads a row
            gqa_prefill::merge_shares_kernel<__nv_bfloat16><<<(rows * 16 + 255) / 256, 256>>>(
                d_part_o, d_part_lse, d_out, d_lse, rows, shares);
          CK(cudaEventRecord(stop));
          CK(cudaEventSynchronize(stop));
          float ms = 0.f;
          CK(cudaEventElapsedTime(&ms, start, stop));
          if (rep >= 3) samples.push_back(ms);
        }
        CK(cudaGetLastError());
        std::sort(samples.begin(), samples.end());
        times[merged] = samples[samples.size() / 2] * 1e3f;
      }
      std::vector<__nv_bfloat16> out(q.size());
      std::vector<float> lse(rows);
      CK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
      double diff = 0, norm = 0, lse_err = 0;  // out: normwise, as the project's tests judge it
      for (size_t i = 0; i < out.size(); ++i) {
        const double e = double(__bfloat162float(out[i])) - ref_out[i];
        diff += e * e;
        norm += ref_out[i] * ref_out[i];
      }
      const double out_err = diff == diff ? sqrt(diff / norm) : INFINITY;
      for (int i = 0; i < rows; ++i) {
        const double e = fabs(double(lse[i]) - ref_lse[i]);
        lse_err = e == e ? std::max(lse_err, e) : INFINITY;
      }
      printf("%6d  %5d%s  %15.1f  %16.1f  %4.2f  %14.2e  %14.2e%s\n", kernel == one ? 1 : 4, shares,
             shares == plan ? "*" : " ",
             times[1], times[0], kv_bytes / (times[1] * 1e-6) / 1e12, out_err, lse_err,
             out_err < 1e-2 && lse_err < 1e-3 ? "" : "  WRONG");
      CK(cudaMemset(d_out, 0xFF, out.size() * 2));  // poisoned (NaN) for the next row's check
      CK(cudaMemset(d_lse, 0xFF, lse.size() * 4));
    }
  }
  return 0;
}
