// Entry points of both definitions (tvm-ffi, destination-passing): argument checks at the
// boundary, then one kernel launch on the caller's current CUDA stream. The kernel is in
// attention_kernel.cuh.
//
//   run_padded(q, k, v, causal, out)                                  mini_flash_attention_prefill
//   run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)  gqa_ragged_prefill_causal_...
//
// q, k, v and the outputs may be float16 or bfloat16 (both definitions), all of one dtype; lse is
// float32; every tensor must be contiguous and on the same CUDA device. An sm_90a build runs the
// wgmma kernel, an sm_90 build the portable one (see launch()). Nothing here reads a
// device tensor: the ragged grid is sized from total_q and the batch size alone.

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "attention_kernel.cuh"

namespace {

using tvm::ffi::TensorView;
using namespace gqa_prefill;

constexpr double kLog2E = 1.4426950408889634;  // 1 / ln(2)

bool is_dtype(const TensorView& t, uint8_t code, int bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}
bool is_half(const TensorView& t) {
  return is_dtype(t, kDLFloat, 16) || is_dtype(t, kDLBfloat, 16);
}
bool same_dtype(const TensorView& a, const TensorView& b) {
  return a.dtype().code == b.dtype().code && a.dtype().bits == b.dtype().bits &&
         a.dtype().lanes == b.dtype().lanes;
}

std::string dtype_name(const TensorView& t) {
  return std::string(tvm::ffi::DLDataTypeToString(t.dtype()));
}

// "bfloat16 [2, 5, 32, 128]"
std::string describe(const TensorView& t) {
  std::ostringstream os;
  os << dtype_name(t) << " [";
  for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

std::string describe_device(const DLDevice& d) {
  std::ostringstream os;
  switch (d.device_type) {
    case kDLCPU: os << "cpu"; break;
    case kDLCUDA: os << "cuda:" << d.device_id; break;
    default: os << "device type " << static_cast<int>(d.device_type) << ":" << d.device_id;
  }
  return os.str();
}

bool shape_is(const TensorView& t, std::initializer_list<int64_t> shape) {
  if (t.ndim() != static_cast<int>(shape.size())) return false;
  int i = 0;
  for (int64_t extent : shape) {
    if (extent >= 0 && t.size(i) != extent) return false;  // -1: any extent
    ++i;
  }
  return true;
}

void expect(bool ok, const char* name, const std::string& expected, const TensorView& got) {
  if (!ok) {
    TVM_FFI_THROW(ValueError) << name << ": expected " << expected << ", got " << describe(got);
  }
}

const char* address(const TensorView& t) {
  return static_cast<const char*>(t.data_ptr()) + t.byte_offset();
}

// Layout and placement, after shapes and dtypes: contiguous (the layout the kernel addresses),
// 16-byte aligned (its vector loads and stores), one CUDA device for all.
void check_placement(std::initializer_list<std::pair<const char*, const TensorView*>> tensors) {
  const DLDevice first = tensors.begin()->second->device();
  const char* first_name = tensors.begin()->first;
  for (const auto& [name, t] : tensors) {
    if (!t->IsContiguous()) {
      std::ostringstream strides;
      for (int i = 0; i < t->ndim(); ++i) strides << (i ? ", " : "") << t->stride(i);
      TVM_FFI_THROW(ValueError) << name << ": expected a contiguous tensor, got "
                                << describe(*t) << " with strides [" << strides.str() << "]";
    }
    if (reinterpret_cast<uintptr_t>(address(*t)) % 16 != 0) {
      TVM_FFI_THROW(ValueError) << name << ": expected a 16-byte aligned data pointer, got "
                                << static_cast<const void*>(address(*t));
    }
  }
  if (first.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << first_name << ": expected a CUDA tensor, got one on "
                              << describe_device(first);
  }
  for (const auto& [name, t] : tensors) {
    const DLDevice d = t->device();
    if (d.device_type != first.device_type || d.device_id != first.device_id) {
      TVM_FFI_THROW(ValueError) << name << ": expected a tensor on " << describe_device(first)
                                << " (" << first_name << "'s device), got one on "
                                << describe_device(d);
    }
  }
}

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

// A 3-D view (dim 128, head, row) of a contiguous [rows, heads, 128] tensor, read in boxes of
// (64, box_heads, box_rows) with the 128-byte swizzle; reads past the last row give zeros.
CUtensorMap tensor_map(const void* data, bool bf16, int heads, int64_t rows, int box_heads,
                       int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {kHeadDim, cuuint64_t(heads), cuuint64_t(std::max<int64_t>(rows, 1))};
  const cuuint64_t strides[2] = {kHeadDim * 2, cuuint64_t(heads) * kHeadDim * 2};  // bytes
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

// The persistent kernel's work counter (int32[2], zero between launches: the kernel's last
// CTA resets it), one per device and stream, so that concurrent streams never share one.
int* scheduler_counter(int device, cudaStream_t stream) {
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
// kernel and device, with the shared-memory opt-in of the chosen kernel.
// num_slots: query-tile slots (each one item per KV head); q_rows, kv_rows: rows of q and k.
template <typename T, bool kCausal, bool kRagged>
void launch(const Params& params, int64_t num_slots, int64_t q_rows, int64_t kv_rows,
            const DLDevice& device) {
  auto* portable = gqa_prefill_kernel<T, kCausal, kRagged>;
  auto* hopper = gqa_prefill_wgmma_kernel<T, kCausal, kRagged>;
  constexpr size_t kHopperSmem = HopperTiles<kCausal>::kSmemBytes;
  enum Path : uint8_t { kUnknown, kPortable, kHopper };
  static Path chosen[64] = {};
  const bool cacheable = device.device_id >= 0 && device.device_id < 64;
  Path path = cacheable ? chosen[device.device_id] : kUnknown;
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
    allow_smem(portable, kSmemBytes);
    if (path == kHopper) allow_smem(hopper, kHopperSmem);
    if (cacheable) chosen[device.device_id] = path;
  }
  // The Hopper kernel folds the softmax scale into its exponentials, which needs a positive
  // scale; any other finite sm_scale runs the portable kernel.
  if (!(params.scale_log2 > 0.f)) path = kPortable;
  auto stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  const int64_t num_items = num_slots * kNumKvHeads;
  int64_t num_ctas = num_items;
  if (path == kHopper) {
    HopperParams hp{};
    hp.p = params;
    const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
    constexpr int kBlockN = HopperTiles<kCausal>::kBlockN;
    hp.q_map = tensor_map(params.q, bf16, kNumHeads, q_rows, kGroupSize, kTokensPerTile);
    // No key row at all: no K/V tile is ever loaded; q stands in for the descriptors.
    const void* k = kv_rows > 0 ? params.k : params.q;
    const void* v = kv_rows > 0 ? params.v : params.q;
    hp.k_map = tensor_map(k, bf16, kNumKvHeads, kv_rows, 1, kBlockN);
    hp.v_map = tensor_map(v, bf16, kNumKvHeads, kv_rows, 1, kBlockN);
    hp.num_items = static_cast<int>(num_items);
    if (HopperTiles<kCausal>::kPersistent && num_items > multiprocessors(device.device_id)) {
      num_ctas = multiprocessors(device.device_id);
      hp.scheduler = scheduler_counter(device.device_id, stream);
    }
    hopper<<<static_cast<unsigned>(num_ctas), kWgmmaThreads, kHopperSmem, stream>>>(hp);
  } else {
    portable<<<static_cast<unsigned>(num_ctas), kNumThreads, kSmemBytes, stream>>>(params);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    const char* name = path == kHopper ? "gqa_prefill_wgmma_kernel" : "gqa_prefill_kernel";
    TVM_FFI_THROW(RuntimeError) << name << " launch (" << num_ctas
                                << " CTAs) failed: " << cudaGetErrorString(err);
  }
}

void check_grid(int64_t num_ctas) {
  if (num_ctas > std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "too many query rows: " << num_ctas
                              << " CTAs exceed the grid limit";
  }
}

const std::string kQPadded = "float16 or bfloat16 [batch, seq_q, 32, 128]";
const std::string kQRagged = "bfloat16 or float16 [total_q, 32, 128]";

}  // namespace

void run_padded(TensorView q, TensorView k, TensorView v, bool causal, TensorView out) {
  expect(is_half(q) && shape_is(q, {-1, -1, kNumHeads, kHeadDim}), "q", kQPadded, q);
  const int64_t batch = q.size(0), seq_q = q.size(1);
  const std::string dtype = dtype_name(q);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &v}}) {
    expect(same_dtype(*t, q) && shape_is(*t, {batch, -1, kNumKvHeads, kHeadDim}), name,
           dtype + " [" + std::to_string(batch) + ", seq_kv, 8, 128] (q's dtype and batch)", *t);
  }
  const int64_t seq_kv = k.size(1);
  expect(shape_is(v, {batch, seq_kv, kNumKvHeads, kHeadDim}), "v",
         "k's shape " + describe(k).substr(dtype.size() + 1), v);
  expect(same_dtype(out, q) && shape_is(out, {batch, seq_q, kNumHeads, kHeadDim}), "out",
         describe(q) + " (q's dtype and shape)", out);
  check_placement({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}});
  // The kernel indexes rows (not elements) in 32 bits.
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  if (batch * seq_q > kMaxRows || batch * seq_kv > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "q, k: more than 2^31 - 1 rows (batch x seq) are not supported";
  }
  if (batch == 0 || seq_q == 0) return;  // no query row: nothing to write

  Params params{};
  params.q = address(q);
  params.k = address(k);
  params.v = address(v);
  params.out = const_cast<char*>(address(out));
  params.lse = nullptr;
  params.batch = static_cast<int>(batch);
  params.seq_q = static_cast<int>(seq_q);
  params.seq_kv = static_cast<int>(seq_kv);
  params.tiles_per_seq = static_cast<int>((seq_q + kTokensPerTile - 1) / kTokensPerTile);
  params.scale_log2 = static_cast<float>(kLog2E / std::sqrt(static_cast<double>(kHeadDim)));
  const int64_t num_slots = batch * params.tiles_per_seq;
  check_grid(num_slots * kNumKvHeads);
  tvm::ffi::CUDADeviceGuard guard(q.device().device_id);
  const bool bf16 = is_dtype(q, kDLBfloat, 16);
  const int64_t q_rows = batch * seq_q, kv_rows = batch * seq_kv;
  if (causal) {
    bf16 ? launch<__nv_bfloat16, true, false>(params, num_slots, q_rows, kv_rows, q.device())
         : launch<half, true, false>(params, num_slots, q_rows, kv_rows, q.device());
  } else {
    bf16 ? launch<__nv_bfloat16, false, false>(params, num_slots, q_rows, kv_rows, q.device())
         : launch<half, false, false>(params, num_slots, q_rows, kv_rows, q.device());
  }
}

void run_ragged(TensorView q, TensorView k, TensorView v, TensorView qo_indptr,
                TensorView kv_indptr, double sm_scale, TensorView output, TensorView lse) {
  expect(is_half(q) && shape_is(q, {-1, kNumHeads, kHeadDim}), "q", kQRagged, q);
  const int64_t total_q = q.size(0);
  const std::string dtype = dtype_name(q);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &v}}) {
    expect(same_dtype(*t, q) && shape_is(*t, {-1, kNumKvHeads, kHeadDim}), name,
           dtype + " [total_kv, 8, 128] (q's dtype)", *t);
  }
  const int64_t total_kv = k.size(0);
  expect(shape_is(v, {total_kv, kNumKvHeads, kHeadDim}), "v",
         "k's shape " + describe(k).substr(dtype.size() + 1), v);
  for (const auto& [name, t] :
       {std::pair<const char*, const TensorView*>{"qo_indptr", &qo_indptr},
        {"kv_indptr", &kv_indptr}}) {
    expect(is_dtype(*t, kDLInt, 32) && t->ndim() == 1 && t->size(0) >= 1, name,
           "int32 [batch + 1]", *t);
  }
  expect(kv_indptr.size(0) == qo_indptr.size(0), "kv_indptr",
         "int32 [" + std::to_string(qo_indptr.size(0)) + "] (qo_indptr's shape)", kv_indptr);
  const int64_t batch = qo_indptr.size(0) - 1;
  if (batch == 0 && (total_q > 0 || total_kv > 0)) {
    TVM_FFI_THROW(ValueError) << "qo_indptr: expected at least one sequence for " << total_q
                              << " query and " << total_kv << " key rows, got int32 [1]";
  }
  if (!std::isfinite(sm_scale)) {
    TVM_FFI_THROW(ValueError) << "sm_scale: expected a finite float, got " << sm_scale;
  }
  expect(same_dtype(output, q) && shape_is(output, {total_q, kNumHeads, kHeadDim}), "output",
         describe(q) + " (q's dtype and shape)", output);
  expect(is_dtype(lse, kDLFloat, 32) && shape_is(lse, {total_q, kNumHeads}), "lse",
         "float32 [" + std::to_string(total_q) + ", 32]", lse);
  check_placement({{"q", &q},
                   {"k", &k},
                   {"v", &v},
                   {"qo_indptr", &qo_indptr},
                   {"kv_indptr", &kv_indptr},
                   {"output", &output},
                   {"lse", &lse}});
  if (total_q > std::numeric_limits<int32_t>::max() ||
      total_kv > std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "q, k: more than 2^31 - 1 rows are not supported";
  }
  if (total_q == 0) return;  // no query row: nothing to write

  Params params{};
  params.q = address(q);
  params.k = address(k);
  params.v = address(v);
  params.out = const_cast<char*>(address(output));
  params.lse = reinterpret_cast<float*>(const_cast<char*>(address(lse)));
  params.qo_indptr = reinterpret_cast<const int*>(address(qo_indptr));
  params.kv_indptr = reinterpret_cast<const int*>(address(kv_indptr));
  params.batch = static_cast<int>(batch);
  params.total_q = static_cast<int>(total_q);
  params.total_kv = static_cast<int>(total_kv);
  params.scale_log2 = static_cast<float>(sm_scale * kLog2E);
  // total_q / 32 + batch slots cover every sequence's query tiles (see the kernel's search).
  const int64_t num_slots = total_q / kTokensPerTile + batch;
  check_grid(num_slots * kNumKvHeads);
  tvm::ffi::CUDADeviceGuard guard(q.device().device_id);
  // The ragged definition is always causal.
  is_dtype(q, kDLBfloat, 16)
      ? launch<__nv_bfloat16, true, true>(params, num_slots, total_q, total_kv, q.device())
      : launch<half, true, true>(params, num_slots, total_q, total_kv, q.device());
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_padded, run_padded);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_ragged, run_ragged);
