// K/V source policy ContiguousKv<kRagged>: k and v are token-strided tensors, a sequence's keys
// are consecutive rows of them (the padded and ragged definitions). The kernels call a K/V
// source only through this interface (PagedKv in kv_paged.cuh is the other one):
//   Args                    what the kernel needs beyond Params / HopperParams
//   kRagged                 sequences from indptr arrays (validity checks, poisoning)
//   kMayPoison              items can come back NaN for what the source found (paged: a page
//                           id out of range, a malformed last-page length)
//   locate<kCausal>(...)    locate_tile with the source's keys per sequence
//   RowLoader<T>            the portable kernel's K/V tiles: load_k / load_v (cp.async rows)
//   TileLoader              the Hopper producer's K/V tiles (sm_90a): per item start_item,
//                           per tile start_tile (before waiting for the ring stage), then
//                           load_k / load_v into the stage, completing on its full barrier;
//                           its constants tell the kernel how many producer threads load and
//                           how a stage completes; kKAhead: K of tile n + 1 loads before V of
//                           tile n, keep_for_v() holding tile n's place for that V
#pragma once

#include "hopper_layout.cuh"
#include "kernel_config.cuh"
#include "ptx_sm80.cuh"
#include "ptx_sm90.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

template <bool kRaggedBatch>
struct ContiguousKv {
  struct Args {};
  static constexpr bool kRagged = kRaggedBatch;
  static constexpr bool kMayPoison = false;
  static constexpr bool kScalesOutput = false;  // the output is P V / l as it is

  template <bool kCausal>
  __device__ __forceinline__ static bool locate(const Params& p, const Args&, int slot,
                                                bool batch_ok, TileCoords& t,
                                                int* kv_head = nullptr, int section_keys = 0) {
    return locate_tile<kCausal, kRagged>(p, slot, batch_ok, t, {}, kv_head, section_keys);
  }

  // One thread's share of the portable kernel's K and V tiles: 4 of a tile's 64 rows
  // (row_in_tile + 16 i), one 16-byte chunk of each. Rows at or past the sequence end are
  // zero-filled without a global read (src pointing at the tensor's first row), so padding keys
  // give 0 * 0 in P V, not garbage. K and V share one row index and one shared-memory address:
  // the K/V loop runs at the 128-register cap, and two loaders with runtime token strides made
  // it spill (TUNING.md).
  template <typename T>
  struct RowLoader {
    const Params& p;
    const T* k_src;       // this thread's chunk of the sequence's k row row_in_tile
    const T* v_src;       // ... and of its v row
    uint32_t thread_dst;  // shared-memory byte address of the chunk in K's tile row row_in_tile
    int row_in_tile;

    static constexpr int kRowsPerPass = kNumThreads / kChunksPerRow;
    static constexpr uint32_t kVTileOffset = kPortableBlockN * kSmemStride * 2;  // sV - sK, bytes

    __device__ __forceinline__ RowLoader(const Params& p, const Args&, const TileCoords& t,
                                         int kv_head, const T* k_tile, int tid)
        : p(p) {
      row_in_tile = tid / kChunksPerRow;
      const int column = kv_head * kHeadDim + tid % kChunksPerRow * 8;
      k_src = static_cast<const T*>(p.k) + token_offset(t.kv_start + row_in_tile, p.k_stride) +
              column;
      v_src = static_cast<const T*>(p.v) + token_offset(t.kv_start + row_in_tile, p.v_stride) +
              column;
      thread_dst = smem_addr(k_tile + row_in_tile * kSmemStride + column % kHeadDim);
    }

    // Keys [key0, key0 + 64) of a sequence of seq_len keys into K's tile / V's tile.
    __device__ __forceinline__ void load_k(int key0, int seq_len) const {
      load(k_src, p.k, p.k_stride, 0, key0, seq_len);
    }
    __device__ __forceinline__ void load_v(int key0, int seq_len) const {
      load(v_src, p.v, p.v_stride, kVTileOffset, key0, seq_len);
    }
    // Contiguous rows are always there: nothing to report.
    __device__ __forceinline__ bool saw_bad_page() const { return false; }

    // From src (k_src or v_src; tokens token_stride elements apart; tensor: its first row) into
    // the tile tile_offset bytes past K's.
    __device__ __forceinline__ void load(const T* src, const void* tensor, int token_stride,
                                         uint32_t tile_offset, int key0, int seq_len) const {
#pragma unroll
      for (int i = 0; i < kPortableBlockN / kRowsPerPass; ++i) {
        const int key = key0 + i * kRowsPerPass;
        const bool valid = key + row_in_tile < seq_len;
        cp_async_16(thread_dst + tile_offset + i * kRowsPerPass * kSmemStride * 2,
                    valid ? static_cast<const void*>(src + token_offset(key, token_stride))
                          : tensor,
                    valid ? 16 : 0);
      }
    }
  };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // The Hopper producer's K/V tiles: one thread, two TMA boxes (64 columns x kBlockN rows) per
  // tile from hp.k_map / hp.v_map, completing on the stage's full barrier with their bytes.
  // Rows past a sequence's end are the next sequence's, or TMA's zeros past the tensor's end:
  // their logits are masked, but a NaN or inf there would still reach O through 0 x NaN, so
  // the consumers zero those V rows before the item's last P V (zero_v_tail).
  struct TileLoader {
    static constexpr int kThreads = 1;  // producer threads that load K/V
    // Arrivals (besides TMA bytes) that complete a K / V stage's full barrier.
    static constexpr int kKFullArrivals = 1;
    static constexpr int kVFullArrivals = 1;
    static constexpr bool kGenericProxyWrites = false;  // TMA writes in the async proxy
    static constexpr bool kZeroesVTail = true;          // the next sequence's rows
    static constexpr bool kKAhead = false;              // measured: no gain (TUNING.md, K ahead)

    template <typename Tiles>
    __host__ __device__ static constexpr int producer_registers() {
      return Tiles::kProducerRegisters;
    }

    const HopperParams& hp;
    int row;  // the current tile's first row of k / v

    __device__ __forceinline__ TileLoader(const HopperParams& hp, const Args&, int /*thread*/)
        : hp(hp) {}

    __device__ __forceinline__ void prefetch_descriptors() const {
      tma_prefetch_descriptor(hp.k_map);
      tma_prefetch_descriptor(hp.v_map);
    }
    // Consumers, before the item's last P V, when that tile holds `rows` < kBlockN keys of the
    // sequence: the V tile's rows past them become zeros (zero_tile_rows).
    template <typename Tiles>
    __device__ __forceinline__ static bool zero_v_tail(uint32_t v_tile, int rows, int thread) {
      return zero_tile_rows<Tiles>(v_tile, rows, Tiles::kBlockN, thread);
    }
    __device__ __forceinline__ void start_item(const WorkItem&) {}
    // Tile n of item w is next.
    template <typename Tiles>
    __device__ __forceinline__ void start_tile(const WorkItem& w, int n) {
      row = w.t.kv_start + n * Tiles::kBlockN;
    }

    // The tile's K / V into the ring stage at dst (full: its barrier; flags: its K/V flags
    // word, unused here).
    template <typename Tiles>
    __device__ __forceinline__ void load_k(uint32_t dst, uint32_t full, const WorkItem& w) {
      load<Tiles>(hp.k_map, dst, full, w);
    }
    template <typename Tiles>
    __device__ __forceinline__ void load_v(uint32_t dst, uint32_t full, uint32_t /*flags*/,
                                           const WorkItem& w) {
      load<Tiles>(hp.v_map, dst, full, w);
    }

    template <typename Tiles>
    __device__ __forceinline__ void load(const CUtensorMap& map, uint32_t dst, uint32_t full,
                                         const WorkItem& w) const {
      mbarrier_arrive_expect_tx(full, Tiles::kKvTileBytes);
      for (int half = 0; half < 2; ++half) {
        tma_load_3d(dst + half * Tiles::kKvHalfBytes, map, full, half * 64, w.kv_head, row);
      }
    }
  };
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
};

}  // namespace gqa_prefill
