// K/V source policy PagedKv<kPageSize> (the gqa_paged definitions): Params' k and v are the
// caches [num_pages, kPageSize, 8, 128], dense within a page, pages pages.k_page_stride /
// v_page_stride elements apart. kv_indptr indexes kv_indices: sequence s has the pages
// P = kv_indices[kv_indptr[s] .. kv_indptr[s + 1]) and (|P| - 1) * kPageSize + last keys
// (last = last_page_len[s], 1 for page size 1); key j is row j % kPageSize of page
// P[j / kPageSize]. The interface is ContiguousKv's (kv_contiguous.cuh).
//
// What the cache may hold past a sequence's keys (slots of its last page, pages nobody lists)
// is anything, NaN included: K rows there give logits that are masked by select, V rows are
// zero-filled by the loads or zeroed before P V (0 * NaN is NaN). A page id outside
// [0, num_pages) is never dereferenced (its rows load as zeros) and its item comes back NaN
// (poison_rows), as does every item of a sequence whose last-page length is not in
// [1, kPageSize] (seq_kv = -1).
#pragma once

#include <type_traits>

#include "hopper_layout.cuh"
#include "kernel_config.cuh"
#include "ptx_sm80.cuh"
#include "ptx_sm90.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

// Keys of a paged sequence with `pages` pages (locate_tile's SequenceKeys); -1 for a malformed
// last-page length.
template <int kPageSize>
struct PagedKeys {
  const int* last_page_len;
  __device__ __forceinline__ int operator()(int seq, int pages) const {
    if constexpr (kPageSize == 1) {
      return pages;
    } else {
      if (pages == 0) return 0;
      const int last = __ldg(last_page_len + seq);
      return 1 <= last && last <= kPageSize ? (pages - 1) * kPageSize + last : -1;
    }
  }
};

__device__ __forceinline__ bool page_in_range(int page, const PageTable& pages) {
  return static_cast<unsigned>(page) < static_cast<unsigned>(pages.num_pages);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The Hopper producer's K/V tiles for page size 64: a 128-key tile is two pages, each one TMA
// box (64 columns x 64 rows) per 64-column half from a 4-D map of the cache (dim, kv head, row
// in page, page). One thread loads; it reads each tile's two page ids a tile ahead. A missing
// page (past the sequence's last) or an id out of range is loaded from page -1: TMA writes
// zeros and reads nothing. The last page's slots past kv_len are loaded as they are, so the
// consumers zero those V rows before the item's last P V (zero_v_tail).
struct PageTmaLoader {
  static constexpr int kPageSize = 64;
  static constexpr int kThreads = 1;
  static constexpr int kKFullArrivals = 1;
  static constexpr int kVFullArrivals = 1;
  static constexpr bool kGenericProxyWrites = false;
  static constexpr bool kZeroesVTail = true;
  static constexpr bool kKAhead = true;  // K of tile n + 1 before V of tile n (kernel_hopper)

  template <typename Tiles>
  // 40 (the knob's 32 spilled 8 bytes once the producer split items into key shares).
  __host__ __device__ static constexpr int producer_registers() {
    return Tiles::kProducerRegisters > 40 ? Tiles::kProducerRegisters : 40;
  }

  const HopperParams& hp;
  const PageTable& pages;
  int next_ids[2];  // page ids of the next tile to load, read a tile ahead
  int coords[2];    // the current tile's pages as TMA coordinates (-1: zeros)
  int v_coords[2];  // ... of the tile whose V loads next (K runs a tile ahead)
  bool item_bad;    // the item so far met a page id out of range

  __device__ __forceinline__ PageTmaLoader(const HopperParams& hp, const PageTable& pages,
                                           int /*thread*/)
      : hp(hp), pages(pages) {}

  __device__ __forceinline__ void prefetch_descriptors() const {
    tma_prefetch_descriptor(hp.k_map);
    tma_prefetch_descriptor(hp.v_map);
  }
  __device__ __forceinline__ static int pages_of(const WorkItem& w) {
    return (w.t.seq_kv + kPageSize - 1) / kPageSize;
  }
  __device__ __forceinline__ void fetch_ids(const WorkItem& w, int n) {
    const int* ids = pages.kv_indices + w.t.kv_start + 2 * n;
    next_ids[0] = __ldg(ids);  // tile n exists: it has at least one key of the sequence
    next_ids[1] = 2 * n + 1 < pages_of(w) ? __ldg(ids + 1) : 0;
  }
  __device__ __forceinline__ void start_item(const WorkItem& w) {
    item_bad = false;
    if (w.t.kv_len > 0) fetch_ids(w, 0);
  }

  template <typename Tiles>
  __device__ __forceinline__ void start_tile(const WorkItem& w, int n) {
    static_assert(Tiles::kBlockN == 2 * kPageSize, "a K/V tile is two pages");
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool listed = 2 * n + i < pages_of(w);
      const bool in_range = page_in_range(next_ids[i], pages);
      item_bad |= listed && !in_range;
      coords[i] = listed && in_range ? next_ids[i] : -1;
    }
    if ((n + 1) * Tiles::kBlockN < w.t.kv_len) fetch_ids(w, n + 1);
  }
  // The current tile's pages are the next V's (before start_tile moves on to the next K).
  __device__ __forceinline__ void keep_for_v() {
    v_coords[0] = coords[0];
    v_coords[1] = coords[1];
  }
  template <typename Tiles>
  __device__ __forceinline__ void load_k(uint32_t dst, uint32_t full, const WorkItem& w) {
    load<Tiles>(hp.k_map, dst, full, w, coords);
  }
  template <typename Tiles>
  __device__ __forceinline__ void load_v(uint32_t dst, uint32_t full, uint32_t flags,
                                         const WorkItem& w) {
    st_shared_u32(flags, item_bad);  // before the arrival, which releases it to the consumers
    load<Tiles>(hp.v_map, dst, full, w, v_coords);
  }
  template <typename Tiles>
  __device__ __forceinline__ void load(const CUtensorMap& map, uint32_t dst, uint32_t full,
                                       const WorkItem& w, const int (&coords)[2]) const {
    mbarrier_arrive_expect_tx(full, Tiles::kKvTileBytes);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        tma_load_4d(dst + half * Tiles::kKvHalfBytes + i * kPageSize * 128, map, full, half * 64,
                    w.kv_head, 0, coords[i]);
      }
    }
  }

  // Consumers, before the item's last P V, when that tile holds `rows` < kBlockN keys of the
  // sequence: rows [rows, end of their page) of the V tile at v_tile become zeros (256 threads,
  // `thread` 0 .. 255; the caller then syncs them). Rows of a missing page are zeros already.
  template <typename Tiles>
  __device__ __forceinline__ static bool zero_v_tail(uint32_t v_tile, int rows, int thread) {
    const int end = (rows + kPageSize - 1) / kPageSize * kPageSize;
    return zero_tile_rows<Tiles>(v_tile, rows, end, thread);
  }
};

// The Hopper producer's K/V tiles for page size 1: a gather. The producer warpgroup's 128
// threads copy rows with cp.async (16 bytes each; a warp reads 4 rows x 128 bytes per
// instruction) into the 128-byte swizzled layout TMA would write (16-byte chunk c of row r at
// chunk c ^ (r % 8)); each thread's copies complete on the stage's full barrier
// (cp.async.mbarrier.arrive.noinc), and the consumers fence the generic-proxy writes before
// their wgmma reads them. Rows past the sequence and rows of an id out of range are
// zero-filled without a read. Thread t copies 16-byte chunk t % 8 of both halves of rows
// t / 8 + 16 i (i = 0 .. 7): 8 threads a row. The page ids (one a row) are read once, one per
// thread, a tile ahead: thread 8 g + i reads the id of the row that threads 8 g .. 8 g + 7 copy
// in pass i, so a shuffle within 8 lanes from lane i hands it over (an immediate lane: no
// register per pass). Everything else a thread needs is recomputed from t (the producer has 40
// registers).
struct PageGatherLoader {
  static constexpr int kThreads = 128;
  static constexpr int kKFullArrivals = kThreads;      // one cp.async arrival each
  static constexpr int kVFullArrivals = kThreads + 4;  // + each warp's flag store
  static constexpr bool kGenericProxyWrites = true;
  static constexpr bool kZeroesVTail = false;
  static constexpr int kRowsPerPass = kThreads / 8;  // 8 threads a row (a 128-byte half)
  static constexpr bool kKAhead = true;  // K of tile n + 1 before V of tile n (kernel_hopper)

  // All 128 threads work: 40 registers each (the most that the consumers' 232 leave).
  template <typename Tiles>
  __host__ __device__ static constexpr int producer_registers() {
    return 40;
  }

  const HopperParams& hp;
  const PageTable& pages;
  int thread;    // 0 .. 127
  int next_id;   // the page id of row held_row() of the next tile to load
  int id;        // ... of the current tile, 0 where the row is not read (past the keys, bad id)
  uint32_t read_bits;  // bit i: this thread's 8-lane group reads its row of pass i
  int v_id;            // id and read_bits of the tile whose V loads next (K runs a tile ahead)
  uint32_t v_read_bits;
  int key0;      // the current tile's first key
  bool item_bad;

  __device__ __forceinline__ PageGatherLoader(const HopperParams& hp, const PageTable& pages,
                                              int thread)
      : hp(hp), pages(pages), thread(thread) {}

  // This thread's first row of a tile (then every 16th) and its chunk of a 128-byte half row.
  __device__ __forceinline__ int row_in_pass() const { return thread / 8; }
  __device__ __forceinline__ int chunk() const { return thread % 8; }
  // The row whose page id this thread reads for its 8 lanes.
  __device__ __forceinline__ int held_row() const {
    return row_in_pass() + kRowsPerPass * chunk();
  }

  __device__ __forceinline__ void prefetch_descriptors() const {}
  __device__ __forceinline__ int fetch_id(const WorkItem& w, int key0) const {
    const int key = key0 + held_row();
    return key < w.t.seq_kv ? __ldg(pages.kv_indices + w.t.kv_start + key) : 0;
  }
  __device__ __forceinline__ void start_item(const WorkItem& w) {
    item_bad = false;
    next_id = w.t.kv_len > 0 ? fetch_id(w, 0) : 0;
  }

  template <typename Tiles>
  __device__ __forceinline__ void start_tile(const WorkItem& w, int n) {
    key0 = n * Tiles::kBlockN;
    const bool listed = key0 + held_row() < w.t.seq_kv;
    const bool read = listed && page_in_range(next_id, pages);
    item_bad |= listed && !read;
    // Validated once a tile by the row's holder: the passes only shuffle a page that is safe to
    // address (0 where nothing is read) and test a bit of the group's ballot.
    id = read ? next_id : 0;
    read_bits = __ballot_sync(0xffffffffu, read) >> (thread % 32 / 8 * 8);
    if (key0 + Tiles::kBlockN < w.t.kv_len) next_id = fetch_id(w, key0 + Tiles::kBlockN);
  }
  // The current tile's rows are the next V's (before start_tile moves on to the next K).
  __device__ __forceinline__ void keep_for_v() {
    v_id = id;
    v_read_bits = read_bits;
  }
  template <typename Tiles>
  __device__ __forceinline__ void load_k(uint32_t dst, uint32_t full, const WorkItem& w) {
    gather<Tiles>(hp.p.k, pages.k_page_stride, dst, w, id, read_bits);
    cp_async_mbarrier_arrive_noinc(full);
  }
  template <typename Tiles>
  __device__ __forceinline__ void load_v(uint32_t dst, uint32_t full, uint32_t flags,
                                         const WorkItem& w) {
    gather<Tiles>(hp.p.v, pages.v_page_stride, dst, w, v_id, v_read_bits);
    cp_async_mbarrier_arrive_noinc(full);
    const bool warp_bad = __any_sync(0xffffffffu, item_bad);
    if (thread % 32 == 0) {
      st_shared_u8(flags + thread / 32, warp_bad);
      mbarrier_arrive(full);  // releases the flag to the consumers
    }
  }

  template <typename Tiles>
  __device__ __forceinline__ void gather(const void* cache, int64_t page_stride, uint32_t dst,
                                         const WorkItem& w, int id, uint32_t read_bits) const {
    static_assert(Tiles::kBlockN / kRowsPerPass == 8, "8 passes: one id from each of 8 lanes");
    // The chunk's column in page 0 (page ids only add page * page stride to it).
    const char* column =
        static_cast<const char*>(cache) + (w.kv_head * kHeadDim + chunk() * 8) * 2;
    // The chunk's swizzled place in row row_in_pass() (+ 16 rows a pass: the same row % 8).
    const uint32_t chunk_dst =
        dst + row_in_pass() * 128 + ((chunk() ^ (row_in_pass() % 8)) * 16);
    const uint64_t stride_bytes = static_cast<uint64_t>(page_stride) * 2;
    if (stride_bytes <= 0xffffffffu) {
      // A row in 5 instructions for its 2 copies: shuffle, bit test, one 32 x 32 -> 64-bit
      // multiply-add for the address, 2 cp.async (a 64-bit page * stride was ~12 a copy).
      const uint32_t stride32 = static_cast<uint32_t>(stride_bytes);
#pragma unroll
      for (int i = 0; i < Tiles::kBlockN / kRowsPerPass; ++i) {
        const uint32_t page = __shfl_sync(0xffffffffu, id, i, 8);
        const int bytes = (read_bits >> i) & 1 ? 16 : 0;
        const char* src = mad_wide_u32(page, stride32, column);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          cp_async_16(chunk_dst + half * Tiles::kKvHalfBytes + i * kRowsPerPass * 128,
                      src + half * 128, bytes);
        }
      }
      return;
    }
#pragma unroll 1
    for (int i = 0; i < Tiles::kBlockN / kRowsPerPass; ++i) {  // pages over 4 GiB apart
      const int page = __shfl_sync(0xffffffffu, id, i, 8);
      const int bytes = (read_bits >> i) & 1 ? 16 : 0;
      const char* src = column + static_cast<int64_t>(page) * static_cast<int64_t>(stride_bytes);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        cp_async_16(chunk_dst + half * Tiles::kKvHalfBytes + i * kRowsPerPass * 128,
                    src + half * 128, bytes);
      }
    }
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <int kPageSize>
struct PagedKv {
  static_assert(kPageSize == 1 || kPageSize == 64, "the paged definitions' page sizes");
  using Args = PageTable;
  static constexpr int kKeysPerEntry = kPageSize;  // kv_start counts kv_indices entries (pages)
  static constexpr bool kRagged = true;
  static constexpr bool kMayPoison = true;
  static constexpr bool kScalesOutput = false;  // the output is P V / l as it is

  template <bool kCausal>
  __device__ __forceinline__ static bool locate(const Params& p, const PageTable& pages, int slot,
                                                bool batch_ok, TileCoords& t,
                                                int* kv_head = nullptr, int section_keys = 0) {
    return locate_tile<kCausal, true>(p, slot, batch_ok, t,
                                      PagedKeys<kPageSize>{pages.last_page_len}, kv_head,
                                      section_keys);
  }

  // The portable kernel's K/V tiles (64 keys): 4 rows (row_in_tile + 16 i) a thread, one
  // 16-byte chunk of each, with cp.async; rows past the sequence and rows of an id out of
  // range are zero-filled without a read.
  template <typename T>
  struct RowLoader {
    const Params& p;
    const PageTable& pages;
    int kv_start;         // the sequence's first kv_indices entry
    int column;           // this thread's chunk of a row (elements)
    uint32_t thread_dst;  // its chunk in K's tile row row_in_tile (shared-memory bytes)
    int row_in_tile;
    bool bad = false;     // met a page id out of range

    static constexpr int kRowsPerPass = kNumThreads / kChunksPerRow;
    static constexpr uint32_t kVTileOffset = kPortableBlockN * kSmemStride * 2;  // sV - sK

    __device__ __forceinline__ RowLoader(const Params& p, const PageTable& pages,
                                         const TileCoords& t, int kv_head, const T* k_tile,
                                         int tid)
        : p(p), pages(pages) {
      row_in_tile = tid / kChunksPerRow;
      const int chunk_column = tid % kChunksPerRow * 8;
      kv_start = t.kv_start;
      column = kv_head * kHeadDim + chunk_column;
      thread_dst = smem_addr(k_tile + row_in_tile * kSmemStride + chunk_column);
    }

    __device__ __forceinline__ void load_k(int key0, int seq_len) {
      load(p.k, pages.k_page_stride, 0, key0, seq_len);
    }
    __device__ __forceinline__ void load_v(int key0, int seq_len) {
      load(p.v, pages.v_page_stride, kVTileOffset, key0, seq_len);
    }
    __device__ __forceinline__ bool saw_bad_page() const { return bad; }

    // Each row looks its page id up (the 4 rows of a page-64 tile read the same one, from L1):
    // not unrolled, as the K/V loop runs at the 128-register cap (TUNING.md).
    __device__ __forceinline__ void load(const void* cache, int64_t page_stride,
                                         uint32_t tile_offset, int key0, int seq_len) {
      const T* base = static_cast<const T*>(cache);
#pragma unroll 1
      for (int i = 0; i < kPortableBlockN / kRowsPerPass; ++i) {
        const int key = key0 + row_in_tile + i * kRowsPerPass;
        const int page = key < seq_len ? __ldg(pages.kv_indices + kv_start + key / kPageSize) : 0;
        const bool valid = key < seq_len && page_in_range(page, pages);
        bad |= key < seq_len && !valid;
        const int row = key % kPageSize * kNumKvHeads * kHeadDim;
        cp_async_16(thread_dst + tile_offset + i * kRowsPerPass * kSmemStride * 2,
                    valid ? static_cast<const void*>(base + page * page_stride + row + column)
                          : cache,
                    valid ? 16 : 0);
      }
    }
  };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using TileLoader = std::conditional_t<kPageSize == 64, PageTmaLoader, PageGatherLoader>;
#endif
};

// Page size 1 before the ragged kernel on prefill-like batches (gathers_pages, entry_launch):
// row r of k_out and v_out (contiguous [num_rows, 8, 128]) is page kv_indices[r] of k_cache and
// v_cache, so kv_indptr indexes them as it indexes kv_indices. An id outside [0, num_pages) is
// never read: its K row is NaN (the query rows that see the key come back NaN, output and lse,
// as the in-loop gather's poison makes them) and its V row zero. kGatherRows rows a block, one
// 16-byte vector of a row a thread.
constexpr int kGatherVectors = kNumKvHeads * kHeadDim * 2 / 16;  // 16-byte vectors a row
constexpr int kGatherRows = 4;

template <typename T>
__global__ void __launch_bounds__(kGatherRows * kGatherVectors)
    gather_pages_kernel(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                        const int* __restrict__ kv_indices, T* __restrict__ k_out,
                        T* __restrict__ v_out, int num_rows, int num_pages, int64_t k_page_stride,
                        int64_t v_page_stride) {
  const int row = blockIdx.x * kGatherRows + threadIdx.x / kGatherVectors;
  const int vector = threadIdx.x % kGatherVectors;
  if (row >= num_rows) return;
  const int page = __ldg(kv_indices + row);
  // NaN in both 16-bit halves of a word: bfloat16 0x7fc0, half 0x7e00.
  constexpr uint32_t kNan = std::is_same_v<T, __nv_bfloat16> ? 0x7fc07fc0u : 0x7e007e00u;
  uint4 k = make_uint4(kNan, kNan, kNan, kNan), v = make_uint4(0, 0, 0, 0);
  if (0 <= page && page < num_pages) {
    k = __ldg(reinterpret_cast<const uint4*>(k_cache + page * k_page_stride) + vector);
    v = __ldg(reinterpret_cast<const uint4*>(v_cache + page * v_page_stride) + vector);
  }
  const int64_t out = int64_t(row) * kGatherVectors + vector;
  reinterpret_cast<uint4*>(k_out)[out] = k;
  reinterpret_cast<uint4*>(v_out)[out] = v;
}

}  // namespace gqa_prefill
