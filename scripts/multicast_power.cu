// Power of L2 -> shared-memory traffic with and without TMA multicast (cuda/TUNING.md, "What
// multicast would save in power"). 2-CTA clusters, one CTA an SM; each CTA receives a 32 KB chunk
// of a 16 MB (L2-resident) buffer a stage, either copied whole by itself (mode 0: both CTAs of a
// cluster read it from L2, as today's kernels do) or half by each CTA with .multicast::cluster
// (mode 1: L2 read once, FA3's non-causal scheme). A spin of DELAY cycles a stage stands in for
// the consumers' work, so the modes can be compared at the same delivered bytes/s.
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -o multicast_power \
//        scripts/multicast_power.cu
//   python scripts/multicast_power.py ./multicast_power     (samples power; or run it alone:)
//   ./multicast_power MODE DELAY SECONDS
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <chrono>
#include <cuda_runtime.h>

constexpr int kStages = 4, kChunk = 32768, kThreads = 128;

__device__ __forceinline__ uint32_t smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }"
               :: "r"(bar), "r"(parity) : "memory");
}

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads)
stream(const char* src, long chunks, int iters, int mode, long long delay, int* sink) {
  extern __shared__ __align__(1024) char buf[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  uint32_t rank; asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  int cluster = blockIdx.x / 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(&empty[s])), "r"(mode ? 2 : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  // Stage i % kStages: its empty barrier takes the arrivals of every CTA its chunk lands in (1, or
  // both with multicast), its full barrier the chunk's 32 KB.
  auto issue = [&](int i) {
    int s = i % kStages;
    if (i >= kStages) wait(smem(&empty[s]), ((i / kStages) - 1) & 1);
    uint32_t fb = smem(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(fb), "r"(kChunk) : "memory");
    const char* g = src + ((cluster * 53L + i) % chunks) * kChunk;
    uint32_t d = smem(buf + s * kChunk);
    if (mode == 0) {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(d), "l"(g), "r"(kChunk), "r"(fb) : "memory");
    } else {
      uint32_t half = kChunk / 2;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
                   :: "r"(d + rank * half), "l"(g + rank * half), "r"(half), "r"(fb), "h"((uint16_t)3) : "memory");
    }
  };
  if (threadIdx.x == 0)  // kStages - 1 chunks in flight ahead of the one waited on
    for (int i = 0; i < kStages - 1 && i < iters; ++i) issue(i);
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    if (threadIdx.x == 0 && i + kStages - 1 < iters) issue(i + kStages - 1);
    int s = i % kStages;
    wait(smem(&full[s]), (i / kStages) & 1);
    acc += buf[s * kChunk + threadIdx.x * 256];  // read, so the copies cannot be idle work
    long long t0 = clock64();
    while (clock64() - t0 < delay) {}
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t eb = smem(&empty[s]);
      if (mode == 0) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(eb) : "memory");
      } else {
        for (uint32_t peer = 0; peer < 2; ++peer) {
          uint32_t r;
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(eb), "r"(peer));
          asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(r) : "memory");
        }
      }
    }
  }
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (acc == 12345) sink[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s MODE(0: each CTA copies, 1: multicast) DELAY SECONDS [ITERS]\n", argv[0]);
    return 2;
  }
  int mode = atoi(argv[1]); long long delay = atoll(argv[2]); double seconds = atof(argv[3]);
  int iters = argc > 4 ? atoi(argv[4]) : 2000;
  long bytes = 16L << 20, chunks = bytes / kChunk;
  char* src; int* sink; cudaMalloc(&src, bytes); cudaMalloc(&sink, 4096);
  // random bytes so the traffic toggles like real data
  char* host = (char*)malloc(bytes); unsigned x = 12345;
  for (long i = 0; i < bytes; ++i) { x = x * 1664525u + 1013904223u; host[i] = (char)(x >> 24); }
  cudaMemcpy(src, host, bytes, cudaMemcpyHostToDevice);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int grid = sms / 2 * 2, dyn = kStages * kChunk + 1024;
  cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
  stream<<<grid, kThreads, dyn>>>(src, chunks, iters, mode, delay, sink);
  if (cudaDeviceSynchronize() != cudaSuccess) { printf("error %s\n", cudaGetErrorString(cudaGetLastError())); return 1; }
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto t0 = std::chrono::steady_clock::now(); int launches = 0;
  cudaEventRecord(a);
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    for (int k = 0; k < 4; ++k) stream<<<grid, kThreads, dyn>>>(src, chunks, iters, mode, delay, sink);
    launches += 4; cudaDeviceSynchronize();
  }
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  double per = ms / launches, delivered = (double)grid * iters * kChunk;
  printf("mode %d delay %lld: %.3f ms a launch, delivered %.2f TB/s, L2 read %.2f TB/s, %s\n", mode, delay,
         per, delivered / per / 1e9, delivered / (mode ? 2 : 1) / per / 1e9, cudaGetErrorString(cudaGetLastError()));
  return 0;
}
