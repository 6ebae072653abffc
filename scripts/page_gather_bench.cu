// On the GPU: how fast an SM can gather page-size-1 K tiles (128 rows x 256 bytes of one KV
// head, rows from random pages) into the 128-byte swizzled tile the wgmma reads, the producer
// alone (no consumers): cp.async by 128 threads (CUDA's PageGatherLoader scheme) against TMA
// boxes of one row (64 columns; UTMALDG takes its coordinates in uniform registers, so lanes
// with their own rows issue one after the other). Also checks that TMA swizzles by the shared
// address (a one-row box at row r lands as a whole tile's box would) and the cp.async tile
// against the cache. cuda/TUNING.md, "Page size 1 by TMA boxes of one row", has the numbers.
//
//     nvcc -O3 -arch=sm_90a -std=c++17 -o page_gather_bench scripts/page_gather_bench.cu
//     ./page_gather_bench 16384     # cache pages of 2 KB: 34 MB, L2-resident on an H100 / H200
//     ./page_gather_bench 262144    # 537 MB: from DRAM
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(b), "r"(n)); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t b, uint32_t bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint32_t b, uint32_t parity) {
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" :: "r"(b), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
               :: "r"(dst), "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_arrive_noinc(uint32_t b) { asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(b) : "memory"); }

constexpr int kRows = 128, kTileBytes = kRows * 256, kHalf = kTileBytes / 2;

// method: 0 cp.async 128 threads; 1 TMA rows by 128 threads; 2 TMA rows by 1 thread;
// 3 TMA rows by 32 threads (4 rows each); 4 TMA rows by 4 warps' lane 0 (32 rows each)
template <int kMethod>
__global__ void __launch_bounds__(128) gather(const __grid_constant__ CUtensorMap map, const uint16_t* cache,
                                              const int* ids, int tiles, int head, long long* cycles, uint16_t* dump) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t full[2];
  const int t = threadIdx.x;
  constexpr int kArrivals = kMethod == 0 ? 128 : 1;
  if (t == 0) { mbar_init(smem_u32(&full[0]), kArrivals); mbar_init(smem_u32(&full[1]), kArrivals); }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const int* my_ids = ids + (size_t)blockIdx.x * tiles * kRows;
  long long start = clock64();
  for (int n = 0; n < tiles + 1; ++n) {
    if (n < tiles) {
      const int s = n % 2;
      const uint32_t dst = smem_u32(smem + s * kTileBytes), bar = smem_u32(&full[s]);
      const int* tid_ids = my_ids + (size_t)n * kRows;
      if constexpr (kMethod == 0) {
        const int row0 = t / 8, chunk = t % 8;
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = row0 + 16 * i;
          const int page = __ldg(tid_ids + r);
          const char* src = (const char*)cache + ((size_t)page * 8 + head) * 256 + chunk * 16;
          const uint32_t d = dst + r * 128 + ((chunk ^ (r % 8)) * 16);
          cp16(d, src, 16);
          cp16(d + kHalf, src + 128, 16);
        }
        cp_arrive_noinc(bar);
      } else if constexpr (kMethod == 1) {
        if (t == 0) mbar_expect_tx(bar, kTileBytes);
        const int page = __ldg(tid_ids + t);
        tma3(dst + t * 128, &map, bar, 0, head, page);
        tma3(dst + kHalf + t * 128, &map, bar, 64, head, page);
      } else if constexpr (kMethod == 2) {
        if (t == 0) {
          mbar_expect_tx(bar, kTileBytes);
          for (int r = 0; r < kRows; ++r) {
            const int page = __ldg(tid_ids + r);
            tma3(dst + r * 128, &map, bar, 0, head, page);
            tma3(dst + kHalf + r * 128, &map, bar, 64, head, page);
          }
        }
      } else if constexpr (kMethod == 3) {
        if (t < 32) {
          if (t == 0) mbar_expect_tx(bar, kTileBytes);
          #pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = t + 32 * i;
            const int page = __ldg(tid_ids + r);
            tma3(dst + r * 128, &map, bar, 0, head, page);
            tma3(dst + kHalf + r * 128, &map, bar, 64, head, page);
          }
        }
      } else {
        if (t % 32 == 0) {
          if (t == 0) mbar_expect_tx(bar, kTileBytes);
          const int w = t / 32;
          for (int r = 32 * w; r < 32 * w + 32; ++r) {
            const int page = __ldg(tid_ids + r);
            tma3(dst + r * 128, &map, bar, 0, head, page);
            tma3(dst + kHalf + r * 128, &map, bar, 64, head, page);
          }
        }
      }
    }
    if (n >= 1) {
      const int p = n - 1;
      mbar_wait(smem_u32(&full[p % 2]), (p / 2) & 1);
      __syncthreads();  // every thread past the wait before its stage is refilled
    }
  }
  long long end = clock64();
  if (t == 0) cycles[blockIdx.x] = end - start;
  if (dump && blockIdx.x == 0) {  // the last tile as it lies in shared memory
    const int s = (tiles - 1) % 2;
    for (int i = t; i < kTileBytes / 2; i += 128) dump[i] = ((uint16_t*)(smem + s * kTileBytes))[i];
  }
}

typedef CUresult (*Encode)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                           const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                           CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

template <int M>
float run(const CUtensorMap& map, uint16_t* cache, int* ids, int tiles, int ctas, long long* cyc, uint16_t* dump, int reps) {
  size_t smem = 2 * kTileBytes + 1024;
  CK(cudaFuncSetAttribute(gather<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  gather<M><<<ctas, 128, smem>>>(map, cache, ids, tiles, 3, cyc, dump);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) gather<M><<<ctas, 128, smem>>>(map, cache, ids, tiles, 3, cyc, nullptr);
  cudaEventRecord(b); CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms / reps;
}

int main(int argc, char** argv) {
  const int pages = argc > 1 ? atoi(argv[1]) : 16384;  // x 2 KB: 32 MB
  const int tiles = 64, ctas = 132, reps = 20;
  uint16_t* cache; int* ids; long long* cyc; uint16_t* dump;
  CK(cudaMalloc(&cache, (size_t)pages * 2048));
  std::vector<uint16_t> h((size_t)pages * 1024);
  for (size_t i = 0; i < h.size(); ++i) h[i] = (uint16_t)(i * 2654435761u >> 7);
  CK(cudaMemcpy(cache, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  std::vector<int> hid((size_t)ctas * tiles * kRows);
  srand(1); for (auto& x : hid) x = rand() % pages;
  CK(cudaMalloc(&ids, hid.size() * 4)); CK(cudaMemcpy(ids, hid.data(), hid.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&cyc, ctas * 8)); CK(cudaMalloc(&dump, 5 * kTileBytes));
  void* fn; cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
  CUtensorMap map;
  cuuint64_t dims[3] = {128, 8, (cuuint64_t)pages}, strides[2] = {256, 2048};
  cuuint32_t box[3] = {64, 1, 1}, es[3] = {1, 1, 1};
  CUresult r = ((Encode)fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, cache, dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("encode failed %d\n", r); return 1; }
  const char* names[5] = {"cp.async 128 threads", "TMA rows, 128 threads", "TMA rows, 1 thread", "TMA rows, 32 threads", "TMA rows, 4 warps' lane 0"};
  float ms[5];
  ms[0] = run<0>(map, cache, ids, tiles, ctas, cyc, dump + 0 * kTileBytes / 2, reps);
  ms[1] = run<1>(map, cache, ids, tiles, ctas, cyc, dump + 1 * kTileBytes / 2, reps);
  ms[2] = run<2>(map, cache, ids, tiles, ctas, cyc, dump + 2 * kTileBytes / 2, reps);
  ms[3] = run<3>(map, cache, ids, tiles, ctas, cyc, dump + 3 * kTileBytes / 2, reps);
  ms[4] = run<4>(map, cache, ids, tiles, ctas, cyc, dump + 4 * kTileBytes / 2, reps);
  std::vector<uint16_t> hd(5 * kTileBytes / 2);
  CK(cudaMemcpy(hd.data(), dump, hd.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<long long> hc(ctas); CK(cudaMemcpy(hc.data(), cyc, ctas * 8, cudaMemcpyDeviceToHost));
  const double bytes = (double)ctas * tiles * kTileBytes;
  printf("cache %d pages (%.0f MB), %d CTAs x %d tiles of 128 rows x 256 B\n", pages, pages * 2048 / 1e6, ctas, tiles);
  for (int m = 0; m < 5; ++m) {
    bool same = true;
    for (int i = 0; i < kTileBytes / 2; ++i) same &= hd[m * kTileBytes / 2 + i] == hd[i];
    printf("%-28s %8.1f us  %7.0f GB/s  %6.0f ns/tile/SM  layout %s cp.async's\n", names[m], ms[m] * 1e3,
           bytes / ms[m] / 1e6, ms[m] * 1e6 / tiles, same ? "==" : "!=");
  }
  // The cp.async layout is the reference: check it against the cache directly.
  int bad = 0; const int s = (tiles - 1) % 2; (void)s;
  for (int row = 0; row < 128; ++row) for (int c = 0; c < 128; ++c) {
    const int page = hid[(size_t)(tiles - 1) * kRows + row];
    const int half = c / 64, cc = c % 64, chunk = cc / 8;
    const size_t off = half * (kHalf / 2) + row * 64 + ((chunk ^ (row % 8)) * 8) + cc % 8;
    bad += hd[off] != h[((size_t)page * 8 + 3) * 128 + c];
  }
  printf("cp.async tile vs cache: %d mismatches\n", bad);
  return 0;
}
