// K/V source policy PagedFp8Kv (gqa_paged_prefill_causal_fp8kv_h32_kv8_d128_ps64) and its two
// kernels: PagedKv<64> (kv_paged.cuh: the same page table, sequence search, bad-id and malformed
// last-page handling) over caches of float8_e4m3fn, converted on chip to q's dtype (exact: every
// e4m3 value is a bf16 and an fp16 value) for the unchanged tensor-core products; on Hopper under
// bf16 q, K stays e4m3 (Knobs::kFp8SplitQ) and V goes to fp16 for a float16 P V
// (Knobs::kFp8F16Pv: PageFp8Loader::PvElement). The real K is
// k_cache x k_scale (the host folds k_scale into the softmax scale), the real V v_cache x v_scale
// (PageTable::v_scale, multiplied into O before the epilogue; lse does not see it).
//
// Hopper (PageFp8Loader): one thread issues one TMA box per page (128 bytes x 64 rows, no
// swizzle) of K and of V into an FP8 staging buffer (16 KiB each, one tile) as soon as the
// previous tile's conversion is done; the producer warpgroup (128 threads, idle otherwise)
// converts each staged tile into the ring stage the consumers read, in the 128-byte swizzled
// 16-bit layout TMA writes for the bf16 kernels, zeroes V rows past the sequence (so the
// consumers skip zero_v_tail), fences its generic-proxy writes for wgmma and arrives on the
// stage's full barrier. Per 128-key tile: 32 KiB FP8 read + 64 KiB written in shared memory, off
// the consumers' path. Portable (RowLoader): each thread reads 8 FP8 values of a row from global
// memory, converts them and stores the 16 bytes where cp.async would have put them.
#pragma once

#include <cuda_fp8.h>

#include "kernel_hopper.cuh"
#include "kernel_portable.cuh"
#include "kv_paged.cuh"

namespace gqa_prefill {

// Knob Knobs::kFp8Bf16Bits (bf16 only; hopper_knobs.cuh, TUNING.md): 1 (shipped) converts with
// integer ops and a bf16x2 multiply by 2^120 (4 ops a pair, no F2FP; exact for every finite e4m3
// value, NaN reads as +-480); 0 with the hardware cvt e4m3x2 -> f16x2, then f16 -> f32 -> bf16x2
// (exact, NaN included; its temporaries spill in the 40-register producer). fp16 always uses
// the cvt (1 F2FP a pair).

// ---- Layout helpers (host and device: tests/test_cuda_fp8.py checks them on the host) --------

// The FP8 staging tile: key row r (0 .. 127; page r / 64) at r * 128 bytes, unswizzled (one
// TMA box of 128 dims x 64 rows per page).
constexpr int kFp8RowBytes = kHeadDim;
constexpr uint32_t kFp8TileBytes = 128 * kFp8RowBytes;  // a 128-key tile of K or of V

// Byte offset in the 16-bit tile (two 64-column halves of half_bytes, 128-byte swizzle: 16-byte
// chunk c of row r at chunk c ^ (r % 8)) of the converted 16 FP8 values (dims 16 c16 ..
// 16 c16 + 15) of row `row`: part j (0, 1) holds dims 16 c16 + 8 j .. + 7.
__host__ __device__ constexpr uint32_t fp8_converted_offset(int row, int c16, int j,
                                                            uint32_t half_bytes) {
  return (c16 / 4) * half_bytes + row * 128 + (((2 * (c16 % 4) + j) ^ (row % 8)) * 16);
}

// The bit-level conversion (knob kFp8Bf16Bits): prmt's sign mode spreads two e4m3
// bytes into 16-bit lanes, sign-extended; shifted left 4, a lane holds the sign at bit 15 and
// exponent and mantissa at bits 4 .. 10 (the mask drops the copies of the sign): a bf16 of the
// value x 2^-120 (subnormals included), made exact by the multiply.
// prmt selectors: bytes 0, 1 (pair 0) or 2, 3 (pair 1) into 16-bit lanes, sign-extended.
__host__ __device__ constexpr uint32_t fp8_pair_selector(int i) { return i ? 0xB3A2u : 0x9180u; }
constexpr uint32_t kFp8Bf16Mask = 0x87f087f0u;
constexpr uint16_t kBf16TwoPow120 = 0x7B80u;

__host__ __device__ inline uint32_t prmt_sign(uint32_t x, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(x), "r"(selector));
  return d;
#else
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xf;
    uint32_t byte = (nibble & 7) < 4 ? (x >> (8 * (nibble & 7))) & 0xff : 0;
    if (nibble & 8) byte = (byte & 0x80) ? 0xff : 0;
    d |= byte << (8 * i);
  }
  return d;
#endif
}
// Elements 2 i, 2 i + 1 of the four in `fp8` as bf16 bit patterns of value x 2^-120.
__host__ __device__ inline uint32_t fp8_pair_bf16_scaled(uint32_t fp8, int i) {
  return (prmt_sign(fp8, fp8_pair_selector(i)) << 4) & kFp8Bf16Mask;
}

// Whether this device pass has the hardware cvt e4m3x2 -> f16x2 (sm_89 on; the portable
// kernel's sm_80 build takes cuda_fp8.h's emulation).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHasFp8Cvt = true;
#else
constexpr bool kHasFp8Cvt = false;
#endif

// Four e4m3 values (the bytes of `fp8`, element 0 lowest) as two packed pairs of T.
template <typename T>
__device__ __forceinline__ void fp8x4_to(uint32_t fp8, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && Knobs::kFp8Bf16Bits) {
    const __nv_bfloat162 factor =
        __halves2bfloat162(__ushort_as_bfloat16(kBf16TwoPow120), __ushort_as_bfloat16(kBf16TwoPow120));
    uint32_t pair[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t bits = fp8_pair_bf16_scaled(fp8, i);
      __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), factor);
      pair[i] = *reinterpret_cast<uint32_t*>(&v);
    }
    lo = pair[0];
    hi = pair[1];
  } else if constexpr (std::is_same_v<T, __half> && kHasFp8Cvt) {
    // The word's two 16-bit halves straight into the cvt (no shift for the upper pair).
    asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(fp8));
  } else {
    uint32_t pair[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(fp8 >> (16 * i)), __NV_E4M3);
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(__half2float(__ushort_as_half(h.x)),
                                                       __half2float(__ushort_as_half(h.y)));
        pair[i] = *reinterpret_cast<const uint32_t*>(&v);
      } else {
        pair[i] = uint32_t(h.x) | (uint32_t(h.y) << 16);
      }
    }
    lo = pair[0];
    hi = pair[1];
  }
}

// 16 e4m3 values -> 16 values of T (two 16-byte chunks: out[0 .. 3] dims 0 .. 7).
template <typename T>
__device__ __forceinline__ void fp8x16_to(const uint4& in, uint4 (&out)[2]) {
  fp8x4_to<T>(in.x, out[0].x, out[0].y);
  fp8x4_to<T>(in.y, out[0].z, out[0].w);
  fp8x4_to<T>(in.z, out[1].x, out[1].y);
  fp8x4_to<T>(in.w, out[1].z, out[1].w);
}

// The FP8 Hopper kernel's shared memory: the paged kernels' (Smem below, before its alignment
// slack), its output buffer holding FP8 staging buffer 0 (the consumers write O from
// registers: PageFp8Loader::kUsesOutputBuffer), then six mbarriers (K staged, V staged and
// consumed, per staging buffer), the leader's state and staging buffer 1. A staging buffer:
// one 128-key tile of K (16 KiB) then one of V.
struct Fp8Smem {
  using Smem = HopperSmem<Fp8HopperTiles>;
  static constexpr uint32_t kStagedK = Smem::kItems + 128;  // + 8 * buffer
  static constexpr uint32_t kStagedV = kStagedK + 16, kConsumed = kStagedV + 16;
  // The leader's state, kept here rather than in registers (the producer has 40): the next
  // tile's two page ids, and whether the item so far met an id out of range.
  static constexpr uint32_t kNextIds = kConsumed + 16, kItemBad = kNextIds + 8;
  // kFp8SplitQ: the two page coordinates of K's tile per staging buffer (K goes by TMA straight
  // into the ring; the leader writes them when it stages V and reads them at the ring's turn).
  static constexpr uint32_t kKCoords = kItemBad + 8;  // + 8 * buffer
  static constexpr uint32_t kBuffer0 = Smem::kO;
  static constexpr uint32_t kBuffer1 = kStagedK + 128;  // 128-byte aligned
  static constexpr uint32_t kBytes = kBuffer1 + 2 * kFp8TileBytes + 1024;  // + alignment slack
  static_assert(kKCoords + 16 <= kBuffer1, "the barriers and the leader's state fit");
  static_assert(Fp8HopperTiles::kOwnOutputBuffer && 2 * kFp8TileBytes <= kQTileBytes,
                "staging buffer 0 fits in the output buffer");
  static_assert(kBytes <= 227 * 1024, "Hopper allows 227 KiB per CTA");
  __host__ __device__ static constexpr uint32_t buffer(uint32_t b) {
    return b ? kBuffer1 : kBuffer0;
  }
};

// Knobs::kFp8SplitQ holds for bf16 q only (float16's 11 bits do not fit two e4m3 terms): the
// loader (kSplitQ) and the host's K map (swizzled) both ask here.
template <typename T>
constexpr bool kFp8SplitsQ = Knobs::kFp8SplitQ && std::is_same_v<T, __nv_bfloat16>;
// The type of the P V product's operands (V converted, P packed): float16 under
// Knobs::kFp8F16Pv (the hardware cvt, one instruction a pair), else q's.
template <typename T>
using Fp8PvElement = std::conditional_t<Knobs::kFp8F16Pv, __half, T>;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The Hopper producer's K/V tiles from FP8 pages (see the top of the file). Two staging buffers,
// tile c (counted over the CTA's items) in buffer c % 2: the leader (thread 0) stages an item's
// first two tiles when it starts it, and tile c + 2 of the item as soon as all 128 threads have
// converted tile c (the buffer's consumed barrier), so that each TMA has a tile's conversion
// (and the consumers' wait on the ring) to land in. It reads the page ids a tile ahead
// (cp.async, waited for at the next staging) and stages each page as PageTmaLoader does (a
// missing page or an id out of range: coordinate -1, zeros); all 128 threads convert. Thread t
// converts 16-byte FP8 chunk t % 8 of rows t / 8 + 16 i (i = 0 .. 7): 8 threads read one 128-byte
// row (conflict-free); their two 16-byte stores go to 8 distinct bank groups per phase (the
// second half's threads store their odd chunk first). T: q's dtype, the converted tiles'.
// kSplitQ (Knobs::kFp8SplitQ, bf16 q): K is not staged nor converted: at the ring's turn the
// leader loads K's two pages by TMA straight into the stage, 128-byte swizzled e4m3 rows (the
// K map is swizzled), for the consumers' e4m3 Q K^T (split_q_e4m3); V as above.
template <typename T>
struct PageFp8Loader {
  static constexpr int kPageSize = 64;
  static constexpr int kThreads = 128;
  static constexpr bool kSplitQ = kFp8SplitsQ<T>;
  static constexpr int kKFullArrivals = kSplitQ ? 1 : kThreads;
  static constexpr int kVFullArrivals = kThreads;
  static constexpr bool kGenericProxyWrites = false;  // each thread fences before it arrives
  static constexpr bool kZeroesVTail = false;         // converted as zeros
  static constexpr bool kUsesOutputBuffer = true;     // staging buffer 0: O goes out directly
  static constexpr bool kKAhead = false;              // its staging converts K and V in turn
  using PvElement = Fp8PvElement<T>;                  // V's converted tiles, P's packing

  // All 128 threads work: 40 registers each (the most that the consumers' 232 leave).
  template <typename Tiles>
  __host__ __device__ static constexpr int producer_registers() {
    return 40;
  }

  const HopperParams& hp;
  const PageTable& pages;
  uint32_t count;  // tiles converted so far (all items): buffer count % 2, parity (count / 2) % 2
  int tile;        // the item's tile being converted
  int rows;        // keys of the sequence in it (V rows past them: zeros)

  // This thread, 0 .. 127 (threadIdx.x: no register held for it).
  __device__ __forceinline__ static int thread() { return threadIdx.x; }
  // The kernel's 1024-byte aligned shared-memory base (recomputed: no register held for it).
  __device__ __forceinline__ static uint32_t smem_base() {
    extern __shared__ __align__(1024) unsigned char wgmma_smem[];
    return (smem_addr(wgmma_smem) + 1023) & ~1023u;
  }

  __device__ __forceinline__ PageFp8Loader(const HopperParams& hp, const PageTable& pages,
                                           int /*thread*/)
      : hp(hp), pages(pages), count(0) {
    const uint32_t base = smem_base();
    if (thread() == 0) {
      for (int b = 0; b < 2; ++b) {
        mbarrier_init(base + Fp8Smem::kStagedK + 8 * b, 1);
        mbarrier_init(base + Fp8Smem::kStagedV + 8 * b, 1);
        mbarrier_init(base + Fp8Smem::kConsumed + 8 * b, kThreads);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    named_barrier_sync(4, kThreads);
  }

  __device__ __forceinline__ void prefetch_descriptors() const {
    if (thread() == 0) {
      tma_prefetch_descriptor(hp.k_map);
      tma_prefetch_descriptor(hp.v_map);
    }
  }
  __device__ __forceinline__ static int pages_of(const WorkItem& w) {
    return (w.t.seq_kv + kPageSize - 1) / kPageSize;
  }
  __device__ __forceinline__ static int tiles_of(const WorkItem& w) {
    return (w.t.kv_len + 2 * kPageSize - 1) / (2 * kPageSize);
  }
  // Leader: the ids of tile n into kNextIds, asynchronously (a page past the list: 0).
  __device__ __forceinline__ void fetch_ids(const WorkItem& w, int n) const {
    const int* ids = pages.kv_indices + w.t.kv_start + 2 * n;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       smem_base() + Fp8Smem::kNextIds + 4 * i),
                   "l"(ids + i), "r"(2 * n + i < pages_of(w) ? 4 : 0)
                   : "memory");
    }
    cp_async_commit();
  }
  // Leader: tile n of the item (tile c of the CTA) into buffer c % 2 once its previous tile is
  // converted; then the next tile's ids.
  __device__ __forceinline__ void stage_tile(const WorkItem& w, int n, uint32_t c) const {
    const uint32_t base = smem_base(), b = c % 2;
    mbarrier_wait(base + Fp8Smem::kConsumed + 8 * b, ((c / 2) & 1) ^ 1);
    cp_async_wait_all();
    int coords[2];
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                 : "=r"(coords[0]), "=r"(coords[1]) : "r"(base + Fp8Smem::kNextIds) : "memory");
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool listed = 2 * n + i < pages_of(w);
      const bool in_range = page_in_range(coords[i], pages);
      bad |= listed && !in_range;
      coords[i] = listed && in_range ? coords[i] : -1;
    }
    if (bad) st_shared_u32(base + Fp8Smem::kItemBad, 1);
    const uint32_t tile_at = Fp8Smem::buffer(b);
    if constexpr (kSplitQ) {  // K waits for its ring stage (load_k)
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(base + Fp8Smem::kKCoords + 8 * b),
                   "r"(coords[0]), "r"(coords[1])
                   : "memory");
    } else {
      stage(hp.k_map, tile_at, Fp8Smem::kStagedK + 8 * b, w.kv_head, coords);
    }
    stage(hp.v_map, tile_at + kFp8TileBytes, Fp8Smem::kStagedV + 8 * b, w.kv_head, coords);
    if (n + 1 < tiles_of(w)) fetch_ids(w, n + 1);
  }
  __device__ __forceinline__ void stage(const CUtensorMap& map, uint32_t tile_at, uint32_t bar,
                                        int kv_head, const int (&coords)[2]) const {
    const uint32_t base = smem_base();
    mbarrier_arrive_expect_tx(base + bar, kFp8TileBytes);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tma_load_4d(base + tile_at + i * kPageSize * kFp8RowBytes, map, base + bar, 0, kv_head, 0,
                  coords[i]);
    }
  }

  // The leader stages the item's first two tiles.
  __device__ __forceinline__ void start_item(const WorkItem& w) {
    if (thread() == 0) {
      st_shared_u32(smem_base() + Fp8Smem::kItemBad, 0);
      const int tiles = tiles_of(w);
      if (tiles > 0) {
        fetch_ids(w, 0);
        stage_tile(w, 0, count);
      }
      if (tiles > 1) stage_tile(w, 1, count + 1);
    }
  }

  template <typename Tiles>
  __device__ __forceinline__ void start_tile(const WorkItem& w, int n) {
    static_assert(Tiles::kBlockN == 2 * kPageSize, "a K/V tile is two pages");
    tile = n;
    rows = w.t.seq_kv - n * Tiles::kBlockN;
  }

  template <typename Tiles>
  __device__ __forceinline__ void load_k(uint32_t dst, uint32_t full, const WorkItem& w) {
    if constexpr (kSplitQ) {
      // The leader staged this tile's V (stage_tile) and kept K's page coordinates.
      if (thread() == 0) {
        int coords[2];
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(coords[0]), "=r"(coords[1])
                     : "r"(smem_base() + Fp8Smem::kKCoords + 8 * (count % 2))
                     : "memory");
        mbarrier_arrive_expect_tx(full, kFp8TileBytes);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          tma_load_4d(dst + i * kPageSize * kFp8RowBytes, hp.k_map, full, 0, w.kv_head, 0,
                      coords[i]);
        }
      }
      return;
    }
    const uint32_t b = count % 2;
    mbarrier_wait(smem_base() + Fp8Smem::kStagedK + 8 * b, (count / 2) & 1);
    convert<Tiles, false, T>(smem_base() + Fp8Smem::buffer(b), dst, 0);
    fence_proxy_async();  // generic writes -> the wgmma's (async proxy) reads
    mbarrier_arrive(full);
  }
  template <typename Tiles>
  __device__ __forceinline__ void load_v(uint32_t dst, uint32_t full, uint32_t flags,
                                         const WorkItem& w) {
    const uint32_t base = smem_base(), b = count % 2;
    mbarrier_wait(base + Fp8Smem::kStagedV + 8 * b, (count / 2) & 1);
    convert<Tiles, true, PvElement>(base + Fp8Smem::buffer(b) + kFp8TileBytes, dst, rows);
    mbarrier_arrive(base + Fp8Smem::kConsumed + 8 * b);  // the staged tile is read
    if (thread() == 0) {
      // The item's flag (every tile staged by the last one), released by the arrival.
      st_shared_u32(flags, ld_shared_u32(base + Fp8Smem::kItemBad));
    }
    fence_proxy_async();
    mbarrier_arrive(full);
    if (thread() == 0 && tile + 2 < tiles_of(w)) stage_tile(w, tile + 2, count + 2);
    ++count;
  }

  // kSplitQ, the consumers' side (once an item, after Q's tile landed): this thread's two
  // accumulator rows R = 64 warpgroup + 16 warp4 + group and R + 8 of Q's tile, columns
  // 32 quad_lane .. + 31, rewritten in place as two e4m3 terms: q_hi + q_lo = q x 2^e_row
  // exactly (values from 1/4 up once scaled; within 2^-10 below), e_row = 7 - floor(log2 of
  // the row's largest |q|) so that it lands in [128, 256). q_hi's rows go where Q's first
  // 64-column half kept them, q_lo's where its second did: 128-byte e4m3 rows, the same
  // swizzle, K-major for the e4m3 wgmma (the warpgroup's rows are its own: its barrier orders
  // all reads before the writes). unscale[h]: 2^-e of row h, for the softmax's scale. A row
  // holding inf is scaled by NaN (the saturating cast would make it finite). Every consumer
  // thread of the warpgroup calls it.
  __device__ __forceinline__ static void split_q(uint32_t sQ, int warpgroup, int warp4,
                                                 int group, int quad_lane, float (&unscale)[2]) {
    float v[2][32];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * warpgroup + 16 * warp4 + group + 8 * h;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int chunk = (quad_lane % 2) * 4 + c;
        uint32_t word[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(word[0]), "=r"(word[1]), "=r"(word[2]), "=r"(word[3])
                     : "r"(sQ + (quad_lane / 2) * kQHalfBytes + row * 128 +
                           ((chunk ^ (row % 8)) * 16))
                     : "memory");
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[h][8 * c + 2 * i] = __uint_as_float(word[i] << 16);
          v[h][8 * c + 2 * i + 1] = __uint_as_float(word[i] & 0xffff0000u);
        }
      }
    }
    named_barrier_sync(1 + warpgroup, 128);  // every bf16 row read before any is rewritten
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * warpgroup + 16 * warp4 + group + 8 * h;
      float top = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) top = fmaxf(top, fabsf(v[h][i]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const int biased = int(__float_as_uint(top) >> 23) & 0xff;
      const int e = min(max(biased - 127, -100), 100);
      const float scale = biased == 0xff ? __uint_as_float(0x7fc00000u)
                                         : __uint_as_float(uint32_t(127 + 7 - e) << 23);
      unscale[h] = __uint_as_float(uint32_t(127 - 7 + e) << 23);
      uint32_t hi[8], lo[8];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float x0 = v[h][2 * j] * scale, x1 = v[h][2 * j + 1] * scale;
        uint16_t h16, l16;
        uint32_t back;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h16) : "f"(x1), "f"(x0));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(back) : "h"(h16));
        const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&back));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(l16) : "f"(x1 - hf.y), "f"(x0 - hf.x));
        if (j % 2 == 0) {
          hi[j / 2] = h16;
          lo[j / 2] = l16;
        } else {
          hi[j / 2] |= uint32_t(h16) << 16;
          lo[j / 2] |= uint32_t(l16) << 16;
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t at = row * 128 + (((2 * quad_lane + j) ^ (row % 8)) * 16);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(sQ + at),
                     "r"(hi[4 * j]), "r"(hi[4 * j + 1]), "r"(hi[4 * j + 2]), "r"(hi[4 * j + 3])
                     : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(sQ + kQHalfBytes + at),
                     "r"(lo[4 * j]), "r"(lo[4 * j + 1]), "r"(lo[4 * j + 2]), "r"(lo[4 * j + 3])
                     : "memory");
      }
    }
    fence_proxy_async();                     // the generic writes -> the wgmma's reads
    named_barrier_sync(1 + warpgroup, 128);  // every term written before the first Q K^T
  }

  // The staged tile at src converted into the 16-bit tile of U at dst; kV: rows from valid_rows
  // on are zeros (K rows past the sequence are masked by the consumers).
  template <typename Tiles, bool kV, typename U>
  __device__ __forceinline__ void convert(uint32_t src, uint32_t dst, int valid_rows) const {
    const int c16 = thread() % 8, row0 = thread() / 8, j0 = c16 / 4;
    // Rows row0 + 16 i: the same swizzle phase (row % 8), 2 KiB apart in both tiles.
    const uint32_t from = src + row0 * kFp8RowBytes + c16 * 16;
    const uint32_t to0 = dst + fp8_converted_offset(row0, c16, j0, Tiles::kKvHalfBytes);
    const uint32_t to1 = dst + fp8_converted_offset(row0, c16, j0 ^ 1, Tiles::kKvHalfBytes);
    // kRowsInFlight rows' loads are issued before the first conversion (their latency overlaps).
    constexpr int kRowsInFlight = std::is_same_v<U, __nv_bfloat16> ? 2 : 1;  // fp16: spills at 2
#pragma unroll
    for (int g = 0; g < Tiles::kBlockN / 16; g += kRowsInFlight) {
      uint4 in[kRowsInFlight];
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        in[k] = {0u, 0u, 0u, 0u};
        // A predicated load (no branch around it): zeros past the sequence.
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
                     "@p ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
                     : "+r"(in[k].x), "+r"(in[k].y), "+r"(in[k].z), "+r"(in[k].w)
                     : "r"(from + (g + k) * 16 * kFp8RowBytes),
                       "r"(int(!kV || row0 + 16 * (g + k) < valid_rows)));
      }
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        const int i = g + k;
        // Part j0 (dims 16 c16 + 8 j0 .. + 7) first.
        const uint32_t a0 = j0 ? in[k].z : in[k].x, a1 = j0 ? in[k].w : in[k].y;
        const uint32_t b0 = j0 ? in[k].x : in[k].z, b1 = j0 ? in[k].y : in[k].w;
        uint4 out;
        fp8x4_to<U>(a0, out.x, out.y);
        fp8x4_to<U>(a1, out.z, out.w);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(to0 + i * 16 * 128),
                     "r"(out.x), "r"(out.y), "r"(out.z), "r"(out.w)
                     : "memory");
        fp8x4_to<U>(b0, out.x, out.y);
        fp8x4_to<U>(b1, out.z, out.w);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(to1 + i * 16 * 128),
                     "r"(out.x), "r"(out.y), "r"(out.z), "r"(out.w)
                     : "memory");
      }
    }
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T>
struct PagedFp8Kv {
  static constexpr int kPageSize = 64;
  using Args = PageTable;
  static constexpr int kKeysPerEntry = kPageSize;  // kv_start counts kv_indices entries (pages)
  static constexpr bool kRagged = true;
  static constexpr bool kMayPoison = true;
  static constexpr bool kScalesOutput = true;  // O x pages.v_scale

  template <bool kCausal>
  __device__ __forceinline__ static bool locate(const Params& p, const PageTable& pages, int slot,
                                                bool batch_ok, TileCoords& t,
                                                int* kv_head = nullptr, int section_keys = 0) {
    return PagedKv<kPageSize>::locate<kCausal>(p, pages, slot, batch_ok, t, kv_head,
                                               section_keys);
  }

  // The portable kernel's K/V tiles: PagedKv<64>::RowLoader's rows and chunks (4 rows a thread,
  // 8 values of each), read as FP8 with one 8-byte load, converted, stored as 16 bytes.
  template <typename U>
  struct RowLoader : PagedKv<kPageSize>::template RowLoader<U> {
    using Base = typename PagedKv<kPageSize>::template RowLoader<U>;
    using Base::Base;

    __device__ __forceinline__ void load_k(int key0, int seq_len) {
      load(this->p.k, this->pages.k_page_stride, 0, key0, seq_len);
    }
    __device__ __forceinline__ void load_v(int key0, int seq_len) {
      load(this->p.v, this->pages.v_page_stride, Base::kVTileOffset, key0, seq_len);
    }
    __device__ __forceinline__ void load(const void* cache, int64_t page_stride,
                                         uint32_t tile_offset, int key0, int seq_len) {
      const uint8_t* base = static_cast<const uint8_t*>(cache);
#pragma unroll 1
      for (int i = 0; i < kPortableBlockN / Base::kRowsPerPass; ++i) {
        const int key = key0 + this->row_in_tile + i * Base::kRowsPerPass;
        const int page =
            key < seq_len ? __ldg(this->pages.kv_indices + this->kv_start + key / kPageSize) : 0;
        const bool valid = key < seq_len && page_in_range(page, this->pages);
        this->bad |= key < seq_len && !valid;
        uint2 raw = {0u, 0u};
        if (valid) {
          const int row = key % kPageSize * kNumKvHeads * kHeadDim;
          raw = __ldg(reinterpret_cast<const uint2*>(base + page * page_stride + row +
                                                     this->column));
        }
        uint4 out;
        fp8x4_to<U>(raw.x, out.x, out.y);
        fp8x4_to<U>(raw.y, out.z, out.w);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         this->thread_dst + tile_offset + i * Base::kRowsPerPass * kSmemStride * 2),
                     "r"(out.x), "r"(out.y), "r"(out.z), "r"(out.w)
                     : "memory");
      }
    }
  };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using TileLoader = PageFp8Loader<T>;
#endif
};

// The FP8 kernels: the paged causal kernels (page size 64) over PagedFp8Kv. The host launches
// the Hopper one with Fp8Smem::kBytes of shared memory and FP8 page maps.

template <typename T>
__global__ void __launch_bounds__(kNumThreads, 2)
    gqa_prefill_paged_fp8_kernel(const PagedParams pp) {
  portable_attention<T, true, PagedFp8Kv<T>>(pp.p, pp.pages);
}

template <typename T>
__global__ void GQA_WGMMA_BOUNDS
gqa_prefill_paged_fp8_wgmma_kernel(const __grid_constant__ PagedHopperParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  hopper_attention<T, true, PagedFp8Kv<T>, Fp8HopperTiles>(params.hp, params.pages);
#else
  __trap();
#endif
}

}  // namespace gqa_prefill
