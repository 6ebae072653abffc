// The Hopper kernel's configuration: its constants, parameters (HopperParams), work items,
// shared-memory layout (HopperSmem), the K/V ring position and the persistent schedule's
// next_item; its knobs (tile sizes, register split, ...): hopper_knobs.cuh. The kernel:
// kernel_hopper.cuh.
#pragma once

#include "hopper_knobs.cuh"
#include "kernel_config.cuh"
#include "ptx_sm90.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

// Set to false to build the Hopper kernel but always run the portable one.
constexpr bool kEnableWgmmaPath = true;
constexpr int kWgmmaThreads = 384;      // producer + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kWgmmaStubThreads = 32;   // the stub's bound: "not compiled"
constexpr uint32_t kQTileBytes = kBlockM * kHeadDim * 2;  // 32 KiB
constexpr uint32_t kQHalfBytes = kQTileBytes / 2;

// The kernel's parameters beyond Params: TMA descriptors (by value, __grid_constant__) and
// the work schedule.
struct HopperParams {
  Params p;
  CUtensorMap q_map;  // q as (dim 128, head 32, token), box (64, 4, 32)
  CUtensorMap k_map;  // k as (dim 128, kv head 8, token), box (64, 1, kBlockN)
  CUtensorMap v_map;
  int* scheduler;  // persistent kernels: int32[2] {items drawn, CTAs done}, zero between launches
  int num_items;   // work items (query tile slot x KV head x key share)
  int kv_shares;   // paged decode-like batches: key shares of each item's keys (<= 1: none)
  int section_pairs;  // padded batches: (sequence, KV head) pairs per L2 section (padded_item)
  int section_keys;   // ragged batches: keys whose K/V fit an L2 section of heads (locate_tile)
};

// The paged kernels' parameters: the Hopper ones, k_map / v_map 4-D views of the caches (page
// size 64; unused for page size 1), and the page table.
struct PagedHopperParams {
  HopperParams hp;
  PageTable pages;
};

// A work item as the producer hands it to the consumers.
struct WorkItem {
  TileCoords t;
  int kv_head;
  int share;  // the item's key share (hp.kv_shares > 1), else 0
  int valid;  // 0: no more work, the consumers exit
};

// The Hopper kernel's dynamic shared memory, the one source of its layout: byte offsets from
// the 1024-byte aligned base (the kernel's `base`; kBytes includes the alignment slack).
//   Q tile | K ring (kKvStages tiles) | V ring | O staging (causal only; else O reuses Q) |
//   mbarriers (8 bytes each; then the K/V flags; 128 bytes with 2 stages) | work-item slots
//   (128 bytes)
// mbarriers: full = data landed (the loader's arrivals + TMA bytes, or the producer's item),
// empty = the 256 consumer threads are done with it. Ring stage s / item slot i: the barrier
// + 8 * s (i). K/V flags: 4 bytes per ring stage, set with the V tile by a paged loader when
// the item so far has met a page id out of range (kv_paged.cuh).
template <typename Tiles>
struct HopperSmem {
  static constexpr int kKvStages = Tiles::kKvStages;
  static constexpr int kItemSlots = 2;  // work items in flight from the producer
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kQ + kQTileBytes;                  // stage s at + s * tile
  static constexpr uint32_t kV = kK + kKvStages * Tiles::kKvTileBytes;
  static constexpr uint32_t kO = Tiles::kOwnOutputBuffer ? kV + kKvStages * Tiles::kKvTileBytes
                                                         : kQ;
  static constexpr uint32_t kBarriers = kV + kKvStages * Tiles::kKvTileBytes +
                                        (Tiles::kOwnOutputBuffer ? kQTileBytes : 0);
  static constexpr uint32_t kQFull = kBarriers, kQEmpty = kQFull + 8;
  static constexpr uint32_t kKFull = kQEmpty + 8, kKEmpty = kKFull + 8 * kKvStages;
  static constexpr uint32_t kVFull = kKEmpty + 8 * kKvStages, kVEmpty = kVFull + 8 * kKvStages;
  static constexpr uint32_t kItemFull = kVEmpty + 8 * kKvStages;
  static constexpr uint32_t kItemEmpty = kItemFull + 8 * kItemSlots;
  static constexpr uint32_t kKvFlags = kItemEmpty + 8 * kItemSlots;  // + 4 * stage
  // WorkItem[kItemSlots], after the barriers and flags rounded up to 128 bytes.
  static constexpr uint32_t kItems = kBarriers + (kKvFlags + 4 * kKvStages - kBarriers + 127) /
                                                     128 * 128;
  static constexpr uint32_t kBytes = kItems + 128 + 1024;  // + slack for the 1024 alignment
  static_assert(kItemSlots * sizeof(WorkItem) <= 128, "the item slots fit");
  static_assert(kBytes <= 227 * 1024,
                "Hopper allows 227 KiB per CTA: fewer stages or keys, or no own output buffer");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Ring position of the i-th K/V tile (counted over all items of the CTA) in a ring of kStages:
// stage and the parity of its barriers' phase.
template <int kStages>
struct RingSlot {
  uint32_t stage, parity;
  __device__ __forceinline__ explicit RingSlot(uint32_t i)
      : stage(i % kStages), parity((i / kStages) & 1) {}
};

// Rows [first, end) of a K/V ring tile at `tile` (two 64-column halves of kBlockN rows x 128
// bytes, 128-byte swizzled: a row stays within its 128 bytes) become zeros, written by the 256
// consumer threads (`thread` 0 .. 255; the caller then syncs them), fenced for the wgmma's
// async-proxy reads. False if there is no row to clear.
template <typename Tiles>
__device__ __forceinline__ bool zero_tile_rows(uint32_t tile, int first, int end, int thread) {
  const int chunks = (end - first) * 8;  // 16-byte chunks per 64-column half
  if (chunks == 0) return false;
  for (int i = thread; i < 2 * chunks; i += 256) {
    const int half = i >= chunks;
    st_shared_zero16(tile + half * Tiles::kKvHalfBytes + first * 128 + (i - half * chunks) * 16);
  }
  fence_proxy_async();  // generic writes -> the wgmma's (async proxy) reads
  return true;
}

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

}  // namespace gqa_prefill
