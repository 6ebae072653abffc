// Host side of prefill_entry.cu, part 3: kernel choice and launch (shared-memory opt-in, TMA
// descriptors, the persistent schedule's counter), Params from checked arguments; the paged
// definitions' launch (page-table parameters, 4-D cache descriptors).
#pragma once

#include <algorithm>

#include "entry_checks.cuh"

namespace {

// Raises a kernel's dynamic shared-memory limit (above 48 KiB needs an opt-in, once per
// kernel and device).
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes));
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "gqa_prefill_kernel: cudaFuncSetAttribute(" << bytes
                                << " bytes of shared memory) failed: "
                                << cudaGetErrorString(err);
  }
}

// ---- The Hopper kernel's host side: TMA descriptors, persistent schedule.

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link to libcuda.
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || ptr == nullptr) {
      TVM_FFI_THROW(RuntimeError) << "gqa_prefill_wgmma_kernel: the CUDA driver has no "
                                     "cuTensorMapEncodeTiled ("
                                  << cudaGetErrorString(err) << ")";
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// A 3-D view (dim 128, head, row) of a [rows, heads, 128] tensor with heads dense and rows
// token_stride elements apart, read in boxes of (64, box_heads, box_rows) with the 128-byte
// swizzle; reads past the last row give zeros.
CUtensorMap tensor_map(const void* data, bool bf16, int heads, int64_t rows, int64_t token_stride,
                       int box_heads, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {kHeadDim, cuuint64_t(heads), cuuint64_t(std::max<int64_t>(rows, 1))};
  const cuuint64_t strides[2] = {kHeadDim * 2, cuuint64_t(token_stride) * 2};  // bytes
  const cuuint32_t box[3] = {64, cuuint32_t(box_heads), cuuint32_t(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = encode_tiled()(
      &map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
      const_cast<void*>(data), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    TVM_FFI_THROW(RuntimeError) << "gqa_prefill_wgmma_kernel: cuTensorMapEncodeTiled failed ("
                                << static_cast<int>(result) << ") for a [" << rows << ", "
                                << heads << ", 128] tensor";
  }
  return map;
}

// A 4-D view (dim 128, kv head 8, row in page 64, page) of a paged cache [num_pages, 64, 8, 128],
// pages page_stride elements apart, read in boxes of (64, 1, 64, 1): one page's 64 rows of one
// head and 64 columns. Pages outside [0, num_pages) read as zeros; with no page at all, `data`
// is a stand-in (q) and the kernel addresses no page. An FP8 cache (fp8): bytes, boxes of
// (128, 1, 64, 1) (a row of 128 bytes), unswizzled: the FP8 loader's staging layout; swizzled
// (fp8_swizzled: Knobs::kFp8SplitQ's K, read by the e4m3 wgmma as TMA writes it).
CUtensorMap page_tensor_map(const void* data, bool bf16, int64_t num_pages, int64_t page_stride,
                            bool fp8 = false, bool fp8_swizzled = false) {
  constexpr int kPageSize = 64;
  CUtensorMap map;
  const cuuint64_t bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[4] = {kHeadDim, kNumKvHeads, kPageSize,
                              cuuint64_t(std::max<int64_t>(num_pages, 1))};
  const cuuint64_t strides[3] = {kHeadDim * bytes, kNumKvHeads * kHeadDim * bytes,
                                 cuuint64_t(page_stride) * bytes};  // bytes
  const cuuint32_t box[4] = {fp8 ? cuuint32_t(kHeadDim) : 64, 1, kPageSize, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = fp8    ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult result = encode_tiled()(
      &map, type, 4, const_cast<void*>(data), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      fp8 && !fp8_swizzled ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    TVM_FFI_THROW(RuntimeError) << "gqa_prefill_paged_wgmma_kernel: cuTensorMapEncodeTiled failed ("
                                << static_cast<int>(result) << ") for a cache of " << num_pages
                                << " pages, " << page_stride << " elements apart";
  }
  return map;
}

// ---- Memory a call takes while its stream is captured into a CUDA graph. cudaMalloc (and the
// sync before a kept buffer grows) is not allowed then, and a kept buffer would tie the graph to
// memory a later eager call may free. So a captured call takes graph-owned memory
// (cudaMallocAsync on the capturing stream: an allocation node) and frees it on that stream once
// its kernels are enqueued (GraphScratchScope, in every entry point): each replay allocates,
// uses and frees it as the captured call did, values read at replay time.

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

thread_local std::vector<std::pair<void*, cudaStream_t>> graph_scratch;

struct GraphScratchScope {
  GraphScratchScope() = default;
  GraphScratchScope(const GraphScratchScope&) = delete;
  GraphScratchScope& operator=(const GraphScratchScope&) = delete;
  ~GraphScratchScope() {
    for (const auto& [ptr, stream] : graph_scratch) cudaFreeAsync(ptr, stream);
    graph_scratch.clear();
  }
};

void* graph_scratch_alloc(cudaStream_t stream, size_t bytes, const char* what) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocAsync(&ptr, std::max<size_t>(bytes, 1), stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    TVM_FFI_THROW(RuntimeError) << what << ": no graph memory of " << bytes
                                << " bytes while the stream is captured ("
                                << cudaGetErrorString(err) << ")";
  }
  graph_scratch.emplace_back(ptr, stream);
  return ptr;
}

// The persistent kernel's work counter (int32[2], zero between launches: the kernel's last
// CTA resets it), one per device and stream, so that concurrent streams never share one. A
// captured call gets its own, zeroed by a captured memset on every replay.
int* scheduler_counter(int device, cudaStream_t stream) {
  if (stream_capturing(stream)) {
    void* counter = graph_scratch_alloc(stream, 2 * sizeof(int), "gqa_prefill_wgmma_kernel");
    const cudaError_t err = cudaMemsetAsync(counter, 0, 2 * sizeof(int), stream);
    if (err != cudaSuccess) {
      TVM_FFI_THROW(RuntimeError) << "gqa_prefill_wgmma_kernel: no scheduler counter ("
                                  << cudaGetErrorString(err) << ")";
    }
    return static_cast<int*>(counter);
  }
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int*> counters;
  std::lock_guard<std::mutex> lock(mutex);
  int*& counter = counters[{device, stream}];
  if (counter == nullptr) {
    cudaError_t err = cudaMalloc(&counter, 2 * sizeof(int));
    if (err == cudaSuccess) err = cudaMemsetAsync(counter, 0, 2 * sizeof(int), stream);
    if (err != cudaSuccess) {
      counter = nullptr;
      TVM_FFI_THROW(RuntimeError) << "gqa_prefill_wgmma_kernel: no scheduler counter ("
                                  << cudaGetErrorString(err) << ")";
    }
  }
  return counter;
}

// Split-KV's partial results (merge_shares_kernel reads them), or page size 1's gathered K/V
// (launch_gathered): one buffer per device and stream like the scheduler counter (a call uses
// it for one of the two), grown on demand (cudaMalloc synchronizes: once a growth) and kept; a
// captured call's is the graph's (graph_scratch_alloc).
void* share_workspace(int device, cudaStream_t stream, size_t bytes) {
  if (stream_capturing(stream)) {
    return graph_scratch_alloc(stream, bytes, "gqa_prefill_paged_wgmma_kernel: workspace");
  }
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, std::pair<void*, size_t>> buffers;
  std::lock_guard<std::mutex> lock(mutex);
  auto& buffer = buffers[{device, stream}];
  if (buffer.second < bytes) {
    if (buffer.first != nullptr) {
      cudaStreamSynchronize(stream);  // the last launch on this stream may still read it
      cudaFree(buffer.first);
    }
    buffer = {nullptr, 0};
    const cudaError_t err = cudaMalloc(&buffer.first, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      buffer.first = nullptr;
      TVM_FFI_THROW(RuntimeError) << "gqa_prefill_paged_wgmma_kernel: no workspace of "
                                  << bytes << " bytes (" << cudaGetErrorString(err) << ")";
    }
    buffer.second = bytes;
  }
  return buffer.first;
}

int multiprocessors(int device) {
  static int counts[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && counts[device] > 0) return counts[device];
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count <= 0) {
    cudaGetLastError();
    count = 132;
  }
  if (cacheable) counts[device] = count;
  return count;
}

// Which kernel runs. The wgmma kernel's body exists only in an sm_90a build (flashinfer-bench
// compiles for sm_90 unless TVM_FFI_CUDA_ARCH_LIST=9.0a); elsewhere it is a stub. Host code
// cannot see the device-side __CUDA_ARCH_FEAT_SM90_ALL, so the two versions declare different
// __launch_bounds__ and cudaFuncGetAttributes reports the one of the version the device
// loaded: maxThreadsPerBlock == kWgmmaThreads means the real wgmma kernel. Decided once per
// kernel pair and device (`chosen`: the pair's cache), with the shared-memory opt-in of the
// chosen kernel. The Hopper kernel folds the softmax scale into its exponentials, which needs a
// positive scale; any other finite sm_scale runs the portable kernel.
enum Path : uint8_t { kUnknown, kPortable, kHopper };

template <typename Portable, typename Hopper>
Path kernel_path(Portable* portable, Hopper* hopper, size_t hopper_smem, float scale_log2,
                 int device_id, Path (&chosen)[64]) {
  const bool cacheable = device_id >= 0 && device_id < 64;
  Path path = cacheable ? chosen[device_id] : kUnknown;
  if (path == kUnknown) {
    path = kPortable;
    if (kEnableWgmmaPath) {
      cudaFuncAttributes attributes{};
      if (cudaFuncGetAttributes(&attributes, hopper) == cudaSuccess) {
        if (attributes.maxThreadsPerBlock == kWgmmaThreads) path = kHopper;
      } else {
        cudaGetLastError();  // not loadable here: clear the error, run the portable kernel
      }
    }
    allow_smem(portable, kPortableSmemBytes);
    if (path == kHopper) allow_smem(hopper, hopper_smem);
    if (cacheable) chosen[device_id] = path;
  }
  return scale_log2 > 0.f ? path : kPortable;
}

void check_launch(Path path, const char* hopper_name, const char* portable_name,
                  int64_t num_ctas) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << (path == kHopper ? hopper_name : portable_name) << " launch ("
                                << num_ctas << " CTAs) failed: " << cudaGetErrorString(err);
  }
}

// The Hopper kernels' schedule: one CTA per item, or (persistent kernels, Tiles::kPersistent,
// more items than SMs) one per SM drawing items from the stream's counter. Returns the grid size.
template <typename Tiles>
int64_t hopper_schedule(HopperParams& hp, int64_t num_items, const DLDevice& device,
                        cudaStream_t stream) {
  hp.num_items = static_cast<int>(num_items);
  if (Tiles::kPersistent && num_items > multiprocessors(device.device_id)) {
    hp.scheduler = scheduler_counter(device.device_id, stream);
    return multiprocessors(device.device_id);
  }
  return num_items;
}

// The L2 budget of an item order's section (padded_item, locate_tile): the K/V that the items
// in flight read together. Measured on the H100 (cuda/TUNING.md): 8 and 16 MB alike, 32 MB
// slower on the padded batches (FA3's scheduler keeps 32 MB).
constexpr int64_t kL2SectionBytes = int64_t(16) << 20;
// Padded batches: (sequence, KV head) pairs per section, as many as have their K/V within the
// budget.
inline int l2_section_pairs(const Params& p, size_t element_bytes) {
  const int pairs = p.batch * kNumKvHeads;
  const int64_t pair_bytes = std::max<int64_t>(1, int64_t(p.seq_kv) * kHeadDim * 2 * element_bytes);
  return static_cast<int>(std::clamp<int64_t>(kL2SectionBytes / pair_bytes, 1, pairs));
}
// Ragged and paged batches: keys of one KV head whose K/V fit the budget.
inline int l2_section_keys(size_t element_bytes) {
  return static_cast<int>(kL2SectionBytes / (kHeadDim * 2 * element_bytes));
}

// Whether a non-causal padded batch runs gqa_prefill_full128_wgmma_kernel (the causal family's
// tiles: 128 keys, the output in a buffer of its own, so the next item's Q loads during the
// epilogue) instead of the full family's 192-key tiles: up to 4096 keys a sequence. Measured
// when the full family had 176-key tiles (192 is within 1% of 176 at 5000-6000 keys); H200,
// kernel time over FlashInfer's, 176 / 128 keys (cuda/TUNING.md, "Short non-causal
// sequences"): 4x512 0.91 / 1.10, 8x1024 0.99 / 1.07, 6x1536 0.93 / 0.98, 4x2048 0.97 / 1.01,
// 2x4096 0.99 / 1.01, 1x8192 1.00 / 0.99, 1x16384 0.95 / 0.95 (0.97 / 0.93 in tune_cuda.py).
// PREFILL_BUNDLE_SHORT_KEY_TILES=0 never, =1 always; read on every call, as
// PREFILL_BUNDLE_PAGE_GATHER.
bool uses_short_key_tiles(int64_t seq_kv) {
  constexpr int64_t kShortKeys = 4096;
  const char* mode = std::getenv("PREFILL_BUNDLE_SHORT_KEY_TILES");
  if (mode != nullptr && std::strcmp(mode, "0") == 0) return false;
  if (mode != nullptr && std::strcmp(mode, "1") == 0) return true;
  return seq_kv <= kShortKeys;
}

// num_slots: query-tile slots (each one item per KV head); q_rows, kv_rows: rows of q and k.
// kWindow: the sliding-window kernels (ragged, causal; params.window_left in [0, kv_rows)).
// kShortKeys: a non-causal padded batch on the causal family's tiles (uses_short_key_tiles).
template <typename T, bool kCausal, bool kRagged, bool kWindow = false, bool kShortKeys = false>
void launch(const Params& params, int64_t num_slots, int64_t q_rows, int64_t kv_rows,
            const DLDevice& device) {
  static_assert(!kWindow || (kCausal && kRagged), "the window is the ragged causal mask's band");
  static_assert(!kShortKeys || !(kCausal || kRagged || kWindow), "128-key tiles: padded, full");
  auto* portable = [] {
    if constexpr (kWindow) {
      return gqa_prefill_swa_kernel<T>;
    } else {
      return gqa_prefill_kernel<T, kCausal, kRagged>;
    }
  }();
  auto* hopper = [] {
    if constexpr (kWindow) {
      return gqa_prefill_swa_wgmma_kernel<T>;
    } else if constexpr (kShortKeys) {
      return gqa_prefill_full128_wgmma_kernel<T>;
    } else {
      return gqa_prefill_wgmma_kernel<T, kCausal, kRagged>;
    }
  }();
  using Tiles = HopperTiles<kCausal || kShortKeys>;
  constexpr size_t kHopperSmem = HopperSmem<Tiles>::kBytes;
  static Path chosen[64] = {};
  const Path path = kernel_path(portable, hopper, kHopperSmem, params.scale_log2,
                                device.device_id, chosen);
  auto stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  const int64_t num_items = num_slots * kNumKvHeads;
  int64_t num_ctas = num_items;
  if (path == kHopper) {
    HopperParams hp{};
    hp.p = params;
    const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
    hp.q_map = tensor_map(params.q, bf16, kNumHeads, q_rows, params.q_stride, kGroupSize,
                          kTokensPerTile);
    // No key row at all: no K/V tile is ever loaded; q stands in for the descriptors.
    const void* k = kv_rows > 0 ? params.k : params.q;
    const void* v = kv_rows > 0 ? params.v : params.q;
    hp.k_map = tensor_map(k, bf16, kNumKvHeads, kv_rows, params.k_stride, 1, Tiles::kBlockN);
    hp.v_map = tensor_map(v, bf16, kNumKvHeads, kv_rows, params.v_stride, 1, Tiles::kBlockN);
    if constexpr (kRagged) {
      hp.section_keys = l2_section_keys(sizeof(T));
    } else {
      hp.section_pairs = l2_section_pairs(params, sizeof(T));
    }
    num_ctas = hopper_schedule<Tiles>(hp, num_items, device, stream);
    hopper<<<static_cast<unsigned>(num_ctas), kWgmmaThreads, kHopperSmem, stream>>>(hp);
  } else {
    portable<<<static_cast<unsigned>(num_ctas), kNumThreads, kPortableSmemBytes, stream>>>(params);
  }
  check_launch(path,
               kWindow      ? "gqa_prefill_swa_wgmma_kernel"
               : kShortKeys ? "gqa_prefill_full128_wgmma_kernel"
                            : "gqa_prefill_wgmma_kernel",
               kWindow ? "gqa_prefill_swa_kernel" : "gqa_prefill_kernel", num_ctas);
}

// Decode-like FP8 batches (at most 4 query rows a sequence on average, a grid within 2^31 - 1
// CTAs) go to gqa_decode_fp8_kernel (decode_fp8.cuh) on the Hopper path.
// PREFILL_BUNDLE_DECODE_KERNEL=0 sends them to the Hopper kernel's split-KV instead (read on
// every call, as PREFILL_BUNDLE_PAGE_GATHER: both paths in one process, for tests and timing).
bool uses_decode_kernel(int64_t q_rows, int64_t batch) {
  if (batch < 1 || q_rows > 4 * batch || batch * kNumKvHeads > std::numeric_limits<int32_t>::max())
    return false;
  const char* mode = std::getenv("PREFILL_BUNDLE_DECODE_KERNEL");
  return mode == nullptr || std::strcmp(mode, "0") != 0;
}

// The decode kernel of one token a group (every sequence one token on average) or four, with
// its shared-memory opt-in once per device.
template <typename T, int kTokens>
auto* decode_kernel(int device_id) {
  static bool allowed[64] = {};
  auto* kernel = gqa_decode_fp8_kernel<T, kTokens>;
  const bool cacheable = device_id >= 0 && device_id < 64;
  if (!cacheable || !allowed[device_id]) {
    allow_smem(kernel, kDecodeSmemBytes);
    if (cacheable) allowed[device_id] = true;
  }
  return kernel;
}

// The decode kernel's launch: its shares' results into the stream's workspace, merged into out
// and lse by merge_shares_kernel (one share: straight into out and lse).
template <typename T>
void launch_fp8_decode(const Params& params, const PageTable& pages, int64_t q_rows,
                       const DLDevice& device, cudaStream_t stream) {
  const int shares = decode_shares(params.batch, int64_t(params.total_kv) * kDecodePage,
                                   multiprocessors(device.device_id));
  const int64_t rows = q_rows * kNumHeads;  // (token, head) rows of output and lse
  DecodeParams d{params, pages, params.out, params.lse, shares};
  if (shares > 1) {
    const size_t part_bytes = size_t(shares) * size_t(rows) * kHeadDim * sizeof(T);
    char* workspace = static_cast<char*>(share_workspace(
        device.device_id, stream, part_bytes + size_t(shares) * size_t(rows) * sizeof(float)));
    d.parts = workspace;
    d.part_lse = reinterpret_cast<float*>(workspace + part_bytes);
  }
  auto* kernel = q_rows == params.batch ? decode_kernel<T, 1>(device.device_id)
                                        : decode_kernel<T, 4>(device.device_id);
  int64_t num_ctas = int64_t(shares) * kNumKvHeads * params.batch;
  kernel<<<static_cast<unsigned>(num_ctas), kDecodeThreads, kDecodeSmemBytes, stream>>>(d);
  if (shares > 1) {
    check_launch(kHopper, "gqa_decode_fp8_kernel", "", num_ctas);
    const int64_t threads = rows * (kHeadDim / 8);
    merge_shares_kernel<T><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        static_cast<const T*>(d.parts), d.part_lse, static_cast<T*>(params.out), params.lse, rows,
        shares);
    num_ctas = (threads + 255) / 256;
  }
  check_launch(kHopper, shares > 1 ? "merge_shares_kernel" : "gqa_decode_fp8_kernel", "",
               num_ctas);
}

// The paged definitions (causal): the same schedule, K/V through the page table. Page size 64
// reads pages through 4-D descriptors of the caches; page size 1 gathers rows (no descriptor).
// Descriptors are encoded on every call, as for the ragged kernel: the caches move between
// calls (flashinfer-bench clones every argument), so a descriptor kept by shape would be stale.
// kFp8: FP8 caches (page size 64; kv_paged_fp8.cuh's kernels, FP8 page maps).
template <typename T, int kPageSize, bool kFp8 = false>
void launch_paged(const Params& params, const PageTable& pages, int64_t num_slots,
                  int64_t q_rows, int64_t num_pages, const DLDevice& device) {
  static_assert(!kFp8 || kPageSize == 64, "FP8 caches have pages of 64");
  auto* portable = [] {
    if constexpr (kFp8) {
      return gqa_prefill_paged_fp8_kernel<T>;
    } else {
      return gqa_prefill_paged_kernel<T, kPageSize>;
    }
  }();
  auto* hopper = [] {
    if constexpr (kFp8) {
      return gqa_prefill_paged_fp8_wgmma_kernel<T>;
    } else {
      return gqa_prefill_paged_wgmma_kernel<T, kPageSize>;
    }
  }();
  constexpr size_t kHopperSmem = kFp8 ? Fp8Smem::kBytes : HopperSmem<PagedHopperTiles>::kBytes;
  static Path chosen[64] = {};
  const Path path = kernel_path(portable, hopper, kHopperSmem, params.scale_log2,
                                device.device_id, chosen);
  auto stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  const int64_t num_items = num_slots * kNumKvHeads;
  int64_t num_ctas = num_items;
  if constexpr (kFp8) {
    if (path == kHopper && uses_decode_kernel(q_rows, params.batch)) {
      launch_fp8_decode<T>(params, pages, q_rows, device, stream);
      return;
    }
  }
  if (path == kHopper) {
    PagedHopperParams launch{};
    HopperParams& hp = launch.hp;
    hp.p = params;
    const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
    hp.q_map = tensor_map(params.q, bf16, kNumHeads, q_rows, params.q_stride, kGroupSize,
                          kTokensPerTile);
    if constexpr (kPageSize == 64) {
      // kFp8SplitsQ: K goes straight into the ring, swizzled for the wgmma.
      hp.k_map = page_tensor_map(params.k, bf16, num_pages, pages.k_page_stride, kFp8,
                                 kFp8 && kFp8SplitsQ<T>);
      hp.v_map = page_tensor_map(params.v, bf16, num_pages, pages.v_page_stride, kFp8);
    }
    launch.pages = pages;
    const int shares =
        kv_shares(q_rows, params.batch, int64_t(params.total_kv) * kPageSize, num_items,
                  multiprocessors(device.device_id), PagedHopperTiles::kBlockN,
                  Knobs::kShareWaves);
    const int64_t rows = q_rows * kNumHeads;  // (token, head) rows of output and lse
    const size_t part_bytes = size_t(shares) * size_t(rows) * kHeadDim * sizeof(T);
    if (shares > 1) {  // the shares' results go to a workspace, merged into out and lse below
      char* workspace = static_cast<char*>(share_workspace(
          device.device_id, stream, part_bytes + size_t(shares) * size_t(rows) * sizeof(float)));
      hp.p.out = workspace;
      hp.p.lse = reinterpret_cast<float*>(workspace + part_bytes);
      hp.kv_shares = shares;
    }
    hp.section_keys = l2_section_keys(kFp8 ? 1 : sizeof(T));
    num_ctas = hopper_schedule<PagedHopperTiles>(hp, num_items * shares, device, stream);
    hopper<<<static_cast<unsigned>(num_ctas), kWgmmaThreads, kHopperSmem, stream>>>(launch);
    if (shares > 1) {
      check_launch(path, kFp8 ? "gqa_prefill_paged_fp8_wgmma_kernel"
                              : "gqa_prefill_paged_wgmma_kernel", "", num_ctas);
      const int64_t threads = rows * (kHeadDim / 8);
      merge_shares_kernel<T><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
          static_cast<const T*>(hp.p.out), hp.p.lse, static_cast<T*>(params.out), params.lse,
          rows, shares);
      num_ctas = (threads + 255) / 256;
    }
  } else {
    const PagedParams launch{params, pages};
    portable<<<static_cast<unsigned>(num_ctas), kNumThreads, kPortableSmemBytes, stream>>>(launch);
  }
  check_launch(path, kFp8 ? "gqa_prefill_paged_fp8_wgmma_kernel" : "gqa_prefill_paged_wgmma_kernel",
               kFp8 ? "gqa_prefill_paged_fp8_kernel" : "gqa_prefill_paged_kernel", num_ctas);
}

// arguments.gathers_pages: whether a page size 1 call gathers its pages into contiguous K/V
// first (launch_gathered), from sizes only: at least 384 query rows a sequence on average (the
// copy, ~3 ns a key on an H200, then costs less than the in-loop gather: TUNING.md) and the two
// buffers at most 256 MiB. PREFILL_BUNDLE_PAGE_GATHER=0 never (no workspace), =1 whenever there
// are pages; read on every call, as PREFILL_BUNDLE_VALIDATE.
bool gathers_pages(int64_t total_q, int64_t batch, int64_t num_kv_indices, int64_t element_bytes) {
  const char* mode = std::getenv("PREFILL_BUNDLE_PAGE_GATHER");
  if (num_kv_indices == 0 || (mode != nullptr && std::strcmp(mode, "0") == 0)) return false;
  if (mode != nullptr && std::strcmp(mode, "1") == 0) return true;
  constexpr int64_t kMinQueries = 384, kMaxBytes = int64_t(256) << 20;
  const int64_t bytes = 2 * num_kv_indices * kNumKvHeads * kHeadDim * element_bytes;
  return total_q >= kMinQueries * std::max<int64_t>(batch, 1) && bytes <= kMaxBytes;
}

// Page size 1 on a prefill-like batch: the pages into the stream's workspace (K rows, then V
// rows: gather_pages_kernel), then the ragged kernel over them, kv_indptr indexing keys as it
// indexed pages. params: the paged call's (k and v the caches, total_kv = num_kv_indices).
template <typename T>
void launch_gathered(Params params, const PageTable& pages, int64_t num_slots, int64_t q_rows,
                     const DLDevice& device) {
  auto stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  const int64_t rows = params.total_kv;
  const size_t row_bytes = size_t(kNumKvHeads) * kHeadDim * sizeof(T);
  char* k = static_cast<char*>(share_workspace(device.device_id, stream, 2 * rows * row_bytes));
  char* v = k + rows * row_bytes;
  gather_pages_kernel<T><<<static_cast<unsigned>((rows + kGatherRows - 1) / kGatherRows),
                           kGatherRows * kGatherVectors, 0, stream>>>(
      static_cast<const T*>(params.k), static_cast<const T*>(params.v), pages.kv_indices,
      reinterpret_cast<T*>(k), reinterpret_cast<T*>(v), static_cast<int>(rows), pages.num_pages,
      pages.k_page_stride, pages.v_page_stride);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "gather_pages_kernel: launch failed ("
                                << cudaGetErrorString(err) << ")";
  }
  params.k = k;
  params.v = v;
  params.k_stride = params.v_stride = kNumKvHeads * kHeadDim;
  launch<T, true, true>(params, num_slots, q_rows, rows, device);
}

// The kernels take token strides in 32 bits.
int token_stride_32(const Arg& x) {
  const int64_t step = token_stride(*x);
  if (step > std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << x.name << ": token strides of 2^31 elements or more are not "
                                           "supported, got "
                              << step;
  }
  return static_cast<int>(step);
}

// The fields both definitions fill alike: q, k, v with their token strides, and the output.
Params input_params(const Arg& q, const Arg& k, const Arg& v, const Arg& out) {
  Params params{};
  params.q = address(*q);
  params.k = address(*k);
  params.v = address(*v);
  params.q_stride = token_stride_32(q);
  params.k_stride = token_stride_32(k);
  params.v_stride = token_stride_32(v);
  params.out = const_cast<char*>(address(*out));
  return params;
}

void check_grid(int64_t num_ctas) {
  if (num_ctas > std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "too many query rows: " << num_ctas
                              << " CTAs exceed the grid limit";
  }
}

}  // namespace
