// mbarrier, TMA, named-barrier and wgmma wrappers (sm_90a builds only: the whole file is under
// __CUDA_ARCH_FEAT_SM90_ALL), and the shared-memory matrix descriptor / 128-byte swizzle.
#pragma once

#include "kernel_config.cuh"

namespace gqa_prefill {

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
// The same from a 4-D tensor map (c3: the page of a paged cache; any out-of-bounds coordinate,
// -1 included, fills the box with zeros without reading memory).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

// Arrives on `bar` once every cp.async this thread has issued so far has landed; the arrival is
// one of those the barrier was initialized to expect (.noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t value;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (TMA writes, wgmma reads) of the same memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
#define GQA_WGMMA_D192 "{" GQA_REGS_0_63 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, " \
  "%92, %93, %94, %95}"
#define GQA_WGMMA_ACC128(d)                                                                \
  GQA_ACC4(d, 0), GQA_ACC4(d, 1), GQA_ACC4(d, 2), GQA_ACC4(d, 3), GQA_ACC4(d, 4),          \
      GQA_ACC4(d, 5), GQA_ACC4(d, 6), GQA_ACC4(d, 7), GQA_ACC4(d, 8), GQA_ACC4(d, 9),      \
      GQA_ACC4(d, 10), GQA_ACC4(d, 11), GQA_ACC4(d, 12), GQA_ACC4(d, 13), GQA_ACC4(d, 14), \
      GQA_ACC4(d, 15)
#define GQA_WGMMA_ACC176(d)                                                                 \
  GQA_WGMMA_ACC128(d), GQA_ACC4(d, 16), GQA_ACC4(d, 17), GQA_ACC4(d, 18), GQA_ACC4(d, 19), \
      GQA_ACC4(d, 20), GQA_ACC4(d, 21)
#define GQA_WGMMA_ACC192(d) GQA_WGMMA_ACC176(d), GQA_ACC4(d, 22), GQA_ACC4(d, 23)

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

// wgmma m64n128k32, e4m3 x e4m3 with fp32 accumulators: A and B from shared memory, both
// K-major (the e4m3 forms take no transpose), D = A B (+ D if accumulate). K step ks of an
// e4m3 row of 128 bytes is 32 bytes further, as a 16-bit k16 step is.
__device__ __forceinline__ void wgmma_e4m3_ss_n128(float (&d)[16][4], uint64_t a, uint64_t b,
                                                   int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " GQA_WGMMA_D128
               ", %64, %65, p, 1, 1;\n}\n"
               : GQA_WGMMA_ACC128(d)
               : "l"(a), "l"(b), "r"(accumulate));
}
GQA_DEFINE_WGMMA_SS(half, "f16", 128, 64, 65, 66)
GQA_DEFINE_WGMMA_SS(half, "f16", 176, 88, 89, 90)
GQA_DEFINE_WGMMA_SS(__nv_bfloat16, "bf16", 128, 64, 65, 66)
GQA_DEFINE_WGMMA_SS(__nv_bfloat16, "bf16", 176, 88, 89, 90)
GQA_DEFINE_WGMMA_SS(half, "f16", 192, 96, 97, 98)
GQA_DEFINE_WGMMA_SS(__nv_bfloat16, "bf16", 192, 96, 97, 98)
GQA_DEFINE_WGMMA_RS(half, "f16")
GQA_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16")
#undef GQA_DEFINE_WGMMA_SS
#undef GQA_DEFINE_WGMMA_RS
#undef GQA_WGMMA_ACC128
#undef GQA_WGMMA_ACC176
#undef GQA_WGMMA_ACC192
#undef GQA_WGMMA_D128
#undef GQA_WGMMA_D176
#undef GQA_WGMMA_D192
#undef GQA_REGS_0_63
#undef GQA_ACC4

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace gqa_prefill
