// Entry points of both definitions (tvm-ffi, destination-passing): argument checks at the
// boundary, then one kernel launch on the caller's current CUDA stream. The kernel is in
// attention_kernel.cuh.
//
//   run_padded(q, k, v, causal, out)                                  mini_flash_attention_prefill
//   run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)  gqa_ragged_prefill_causal_...
//
// The argument contract and its error messages are prefill_bundle/arguments.py's, reproduced
// here byte for byte (every error a ValueError "<argument>: expected <what>, got <what>"): q, k,
// v float16 or bfloat16 and token-strided (heads dense), outputs and indptr contiguous, all on
// one CUDA device; causal a bool or a 0-d bool tensor, sm_scale a finite real. Arguments come in
// as AnyView, so that a wrong type gets that message too. An sm_90a build runs the wgmma kernel,
// an sm_90 build the portable one (see launch()). Indptr values are read on the device only
// (the kernels cope with malformed ones), unless PREFILL_BUNDLE_VALIDATE=1.

#include <cuda_runtime.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_kernel.cuh"

namespace {

using tvm::ffi::AnyView;
using tvm::ffi::TensorView;
using namespace gqa_prefill;

constexpr double kLog2E = 1.4426950408889634;  // 1 / ln(2)
constexpr int64_t kAlignElements = 8;  // 16 bytes: the kernels' vector and TMA loads

// ---- describe(): what arguments.describe writes --------------------------------------------

std::string dtype_name(DLDataType dtype) {
  return std::string(tvm::ffi::DLDataTypeToString(dtype));
}

std::string int_list(const int64_t* values, int n) {  // "[2, 5, 32, 128]"
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << values[i];
  os << "]";
  return os.str();
}

std::string shape_text(const TensorView& t) { return int_list(t.shape().data(), t.ndim()); }

// "bfloat16 [2, 5, 32, 128]" or "a 0-d float32 tensor"
std::string describe(const TensorView& t) {
  if (t.ndim() == 0) return "a 0-d " + dtype_name(t.dtype()) + " tensor";
  return dtype_name(t.dtype()) + " " + shape_text(t);
}

// Python's repr of a float: the shortest digits that read back, fixed notation for exponents
// -4 .. 15.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int precision = 0; precision < 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  const std::string text(buf);  // [-]d.ddde[+-]xx
  const size_t e = text.find('e');
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (text[i] >= '0' && text[i] <= '9') digits += text[i];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = std::signbit(x) ? "-" : "";
  if (exponent < -4 || exponent > 15) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::snprintf(buf, sizeof buf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + buf;
  }
  if (exponent < 0) return out + "0." + std::string(-exponent - 1, '0') + digits;
  const size_t int_digits = exponent + 1;
  if (digits.size() < int_digits) digits.append(int_digits - digits.size(), '0');
  const std::string fraction = digits.size() > int_digits ? digits.substr(int_digits) : "0";
  return out + digits.substr(0, int_digits) + "." + fraction;
}

// Python's repr of a str (non-ASCII characters kept as they are) or of bytes.
std::string quoted_repr(const std::string& value, bool bytes) {
  const bool has_single = value.find('\'') != std::string::npos;
  const char quote = has_single && value.find('"') == std::string::npos ? '"' : '\'';
  std::string out = bytes ? "b" : "";
  out += quote;
  for (const char c : value) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (byte < 0x20 || byte == 0x7f || (bytes && byte > 0x7f)) {
      char escape[5];
      std::snprintf(escape, sizeof escape, "\\x%02x", byte);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + quote;
}

bool is_str(const AnyView& x) {
  const int32_t index = x.type_index();
  return index == tvm::ffi::TypeIndex::kTVMFFIRawStr ||
         index == tvm::ffi::TypeIndex::kTVMFFISmallStr || index == tvm::ffi::TypeIndex::kTVMFFIStr;
}
bool is_bytes(const AnyView& x) {
  const int32_t index = x.type_index();
  return index == tvm::ffi::TypeIndex::kTVMFFIByteArrayPtr ||
         index == tvm::ffi::TypeIndex::kTVMFFISmallBytes ||
         index == tvm::ffi::TypeIndex::kTVMFFIBytes;
}

// A Python value as tvm-ffi passes it: (type name, repr). Lists and tuples both arrive as an
// ffi.Array (written as a list); values without a Python counterpart give their type key.
std::pair<std::string, std::string> python_value(const AnyView& x) {
  if (x == nullptr) return {"NoneType", "None"};
  if (auto b = x.as<bool>()) return {"bool", *b ? "True" : "False"};
  if (auto i = x.as<int64_t>()) return {"int", std::to_string(*i)};
  if (auto f = x.as<double>()) return {"float", float_repr(*f)};
  if (is_str(x)) return {"str", quoted_repr(std::string(x.cast<tvm::ffi::String>()), false)};
  if (is_bytes(x)) return {"bytes", quoted_repr(std::string(x.cast<tvm::ffi::Bytes>()), true)};
  if (auto array = x.as<tvm::ffi::Array<tvm::ffi::Any>>()) {
    std::string items;
    for (const tvm::ffi::Any& item : *array) {
      items += (items.empty() ? "" : ", ") + python_value(item).second;
    }
    return {"list", "[" + items + "]"};
  }
  const std::string key = x.GetTypeKey();
  return {key, "<" + key + ">"};
}

// arguments.describe: a tensor's dtype and shape, else "<type name> <repr, 60 characters>".
std::string describe(const AnyView& x) {
  if (auto t = x.try_cast<TensorView>()) return describe(*t);
  auto [type, repr] = python_value(x);
  size_t end = 0;
  for (int chars = 0; end < repr.size() && chars < 60; ++chars) {
    do ++end;  // one UTF-8 character
    while (end < repr.size() && (static_cast<unsigned char>(repr[end]) & 0xC0) == 0x80);
  }
  return type + " " + repr.substr(0, end);
}

std::string describe_device(const DLDevice& d) {  // as torch.device prints
  std::ostringstream os;
  switch (d.device_type) {
    case kDLCPU: os << "cpu"; break;
    case kDLCUDA: os << "cuda:" << d.device_id; break;
    default: os << "device type " << static_cast<int>(d.device_type) << ":" << d.device_id;
  }
  return os.str();
}

[[noreturn]] void fail(const char* name, const std::string& expected, const std::string& got) {
  TVM_FFI_THROW(ValueError) << name << ": expected " << expected << ", got " << got;
  TVM_FFI_UNREACHABLE();  // the throw is in a destructor, which nvcc does not see as noreturn
}

// ---- The contract's checks: arguments.py's, in the same order, with the same messages -----

// A tensor argument: its name, its value, and the tensor if the value is one.
struct Arg {
  const char* name;
  AnyView value;
  std::optional<TensorView> tensor;
  Arg(const char* name, AnyView value)
      : name(name), value(value), tensor(value.try_cast<TensorView>()) {}
  const TensorView& operator*() const { return *tensor; }
  const TensorView* operator->() const { return &*tensor; }
};

bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
bool is_half(const TensorView& t) {
  return same_dtype(t.dtype(), DLDataType{kDLFloat, 16, 1}) ||
         same_dtype(t.dtype(), DLDataType{kDLBfloat, 16, 1});
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

// arguments._expect_tensor: a tensor of that dtype and shape (-1: any extent); `what` makes the
// rest of the expectation, only on failure.
template <typename What>
void expect_tensor(const Arg& x, DLDataType dtype, std::initializer_list<int64_t> shape,
                   What what) {
  if (!(x.tensor && same_dtype(x->dtype(), dtype) && shape_is(*x, shape))) {
    fail(x.name, dtype_name(dtype) + " " + what(), describe(x.value));
  }
}

void expect_same_shape(const Arg& v, const Arg& k) {
  bool same = v->ndim() == k->ndim();
  for (int i = 0; same && i < k->ndim(); ++i) same = v->size(i) == k->size(i);
  if (!same) fail(v.name, "k's shape " + shape_text(*k), describe(*v));
}

// arguments.check_padded_shapes
void check_padded_shapes(const Arg& q, const Arg& k, const Arg& v, const Arg& out) {
  if (!(q.tensor && is_half(*q) && shape_is(*q, {-1, -1, kNumHeads, kHeadDim}))) {
    fail("q", "float16 or bfloat16 [batch, seq_q, 32, 128]", describe(q.value));
  }
  const int64_t batch = q->size(0);
  for (const Arg* x : {&k, &v}) {
    expect_tensor(*x, q->dtype(), {batch, -1, kNumKvHeads, kHeadDim}, [&] {
      return "[" + std::to_string(batch) + ", seq_kv, 8, 128] (q's dtype and batch)";
    });
  }
  expect_same_shape(v, k);
  expect_tensor(out, q->dtype(), {batch, q->size(1), kNumHeads, kHeadDim},
                [&] { return shape_text(*q) + " (q's dtype and shape)"; });
}

// arguments.check_ragged_shapes
void check_ragged_shapes(const Arg& q, const Arg& k, const Arg& v, const Arg& qo_indptr,
                         const Arg& kv_indptr, const Arg& output, const Arg& lse) {
  if (!(q.tensor && is_half(*q) && shape_is(*q, {-1, kNumHeads, kHeadDim}))) {
    fail("q", "bfloat16 or float16 [total_q, 32, 128]", describe(q.value));
  }
  const int64_t total_q = q->size(0);
  for (const Arg* x : {&k, &v}) {
    expect_tensor(*x, q->dtype(), {-1, kNumKvHeads, kHeadDim},
                  [] { return std::string("[total_kv, 8, 128] (q's dtype)"); });
  }
  expect_same_shape(v, k);
  const int64_t total_kv = k->size(0);
  constexpr DLDataType kInt32{kDLInt, 32, 1};
  const auto batch_plus_one = [] { return std::string("[batch + 1]"); };
  expect_tensor(qo_indptr, kInt32, {-1}, batch_plus_one);
  if (qo_indptr->size(0) < 1) fail("qo_indptr", "int32 [batch + 1]", describe(*qo_indptr));
  const int64_t size = qo_indptr->size(0);
  expect_tensor(kv_indptr, kInt32, {size},
                [&] { return "[" + std::to_string(size) + "] (qo_indptr's shape)"; });
  if (size == 1 && (total_q > 0 || total_kv > 0)) {
    fail("qo_indptr",
         "at least one sequence for " + std::to_string(total_q) + " query and " +
             std::to_string(total_kv) + " key rows",
         describe(*qo_indptr));
  }
  expect_tensor(output, q->dtype(), {total_q, kNumHeads, kHeadDim},
                [&] { return shape_text(*q) + " (q's dtype and shape)"; });
  expect_tensor(lse, DLDataType{kDLFloat, 32, 1}, {total_q, kNumHeads},
                [&] { return "[" + std::to_string(total_q) + ", 32]"; });
}

// arguments.check_causal. A tensor's value is read on the host (a sync if on a GPU).
bool check_causal(const AnyView& causal) {
  if (auto b = causal.as<bool>()) return *b;
  if (auto t = causal.try_cast<TensorView>()) {
    if (t->ndim() == 0 && same_dtype(t->dtype(), DLDataType{kDLBool, 8, 1})) {
      const auto* data = static_cast<const char*>(t->data_ptr()) + t->byte_offset();
      if (t->device().device_type != kDLCUDA) return *data != 0;
      tvm::ffi::CUDADeviceGuard guard(t->device().device_id);
      auto stream =
          static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t->device().device_id));
      char value = 0;
      cudaError_t err = cudaMemcpyAsync(&value, data, 1, cudaMemcpyDeviceToHost, stream);
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      if (err != cudaSuccess) {
        TVM_FFI_THROW(RuntimeError) << "causal: reading the tensor failed: "
                                    << cudaGetErrorString(err);
      }
      return value != 0;
    }
  }
  fail("causal", "a Python bool or a 0-d bool tensor", describe(causal));
}

// arguments.check_sm_scale: a finite float or int (not bool).
double check_sm_scale(const AnyView& sm_scale) {
  std::optional<double> value = sm_scale.as<double>();
  if (auto i = sm_scale.as<int64_t>()) value = static_cast<double>(*i);
  if (!value || !std::isfinite(*value)) fail("sm_scale", "a finite float", describe(sm_scale));
  return *value;
}

// arguments.token_stride: elements between consecutive tokens (padded: batch and seq flattened).
int64_t token_stride(const TensorView& t) {
  for (int dim = t.ndim() - 3; dim >= 0; --dim) {
    if (t.size(dim) > 1) return t.stride(dim);
  }
  return t.size(-2) * t.size(-1);
}

// arguments.strides_ok: the last dim contiguous, heads dense, an aligned token stride, and a
// padded tensor's tokens evenly spaced.
bool strides_ok(const TensorView& t) {
  const int d = t.ndim();
  if ((t.stride(d - 1) != 1 && t.size(d - 1) > 1) ||
      (t.stride(d - 2) != t.size(d - 1) && t.size(d - 2) > 1)) {
    return false;
  }
  const int64_t step = token_stride(t);
  if (step % kAlignElements != 0 || step < t.size(d - 2) * t.size(d - 1)) return false;
  return d == 3 || t.size(0) <= 1 || t.size(1) <= 1 || t.stride(0) == t.size(1) * step;
}

const char* address(const TensorView& t) {
  return static_cast<const char*>(t.data_ptr()) + t.byte_offset();
}

// arguments.check_layout: args[0 .. 2] are q, k, v (token-strided), the rest contiguous; all on
// q's CUDA device. (tvm-ffi tensors always carry their strides.)
void check_layout(std::initializer_list<const Arg*> args) {
  int index = 0;
  for (const Arg* x : args) {
    const TensorView& t = **x;
    const bool input = index++ < 3;
    if (input ? !strides_ok(t) : !t.IsContiguous()) {
      fail(x->name,
           input ? "the last dim contiguous, heads dense and a token stride that is a multiple "
                   "of 8 elements"
                 : "a contiguous tensor",
           describe(t) + " with strides " + int_list(t.strides().data(), t.ndim()));
    }
    if (reinterpret_cast<uintptr_t>(address(t)) % 16 != 0) {
      std::ostringstream hex;
      hex << "0x" << std::hex << reinterpret_cast<uintptr_t>(address(t));
      fail(x->name, "a 16-byte aligned data pointer", hex.str());
    }
  }
  const Arg& first = **args.begin();
  const DLDevice device = first->device();
  if (device.device_type != kDLCUDA) {
    fail(first.name, "a CUDA tensor", "one on " + describe_device(device));
  }
  for (const Arg* x : args) {
    const DLDevice d = (*x)->device();
    if (d.device_type != device.device_type || d.device_id != device.device_id) {
      fail(x->name,
           "a tensor on " + describe_device(device) + " (" + first.name + "'s device)",
           "one on " + describe_device(d));
    }
  }
}

// PREFILL_BUNDLE_VALIDATE=1: indptr values are checked on the host. Read on every call (a getenv
// is tens of nanoseconds), so a process can switch it on after the module loaded.
bool validate_indptr_values() {
  const char* value = std::getenv("PREFILL_BUNDLE_VALIDATE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// arguments.check_indptr_values: both arrays are partitions, 0 = p0 <= ... <= pn = total. One
// device-to-host copy each on the stream, and a sync.
void check_indptr_values(const Arg& qo_indptr, const Arg& kv_indptr, int64_t total_q,
                         int64_t total_kv, cudaStream_t stream) {
  const std::tuple<const Arg*, int64_t, const char*> arrays[] = {
      {&qo_indptr, total_q, "total_q"}, {&kv_indptr, total_kv, "total_kv"}};
  for (const auto& [indptr, total, rows] : arrays) {
    std::vector<int32_t> values((*indptr)->size(0));
    cudaError_t err = cudaMemcpyAsync(values.data(), address(**indptr),
                                      values.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                      stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
      TVM_FFI_THROW(RuntimeError) << indptr->name << ": copying it to the host failed: "
                                  << cudaGetErrorString(err);
    }
    const std::string name = indptr->name;
    const std::string expected =
        "non-decreasing values from 0 to " + std::string(rows) + " = " + std::to_string(total);
    const auto entry = [&](size_t i) {
      return name + "[" + std::to_string(i) + "] = " + std::to_string(values[i]);
    };
    if (values[0] != 0) fail(indptr->name, expected, entry(0));
    for (size_t i = 1; i < values.size(); ++i) {
      if (values[i] < values[i - 1]) fail(indptr->name, expected, entry(i) + " < " + entry(i - 1));
    }
    if (values.back() != total) fail(indptr->name, expected, entry(values.size() - 1));
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
  constexpr size_t kHopperSmem = HopperSmem<kCausal>::kBytes;
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
    allow_smem(portable, kPortableSmemBytes);
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
    hp.q_map = tensor_map(params.q, bf16, kNumHeads, q_rows, params.q_stride, kGroupSize,
                          kTokensPerTile);
    // No key row at all: no K/V tile is ever loaded; q stands in for the descriptors.
    const void* k = kv_rows > 0 ? params.k : params.q;
    const void* v = kv_rows > 0 ? params.v : params.q;
    hp.k_map = tensor_map(k, bf16, kNumKvHeads, kv_rows, params.k_stride, 1, kBlockN);
    hp.v_map = tensor_map(v, bf16, kNumKvHeads, kv_rows, params.v_stride, 1, kBlockN);
    hp.num_items = static_cast<int>(num_items);
    if (HopperTiles<kCausal>::kPersistent && num_items > multiprocessors(device.device_id)) {
      num_ctas = multiprocessors(device.device_id);
      hp.scheduler = scheduler_counter(device.device_id, stream);
    }
    hopper<<<static_cast<unsigned>(num_ctas), kWgmmaThreads, kHopperSmem, stream>>>(hp);
  } else {
    portable<<<static_cast<unsigned>(num_ctas), kNumThreads, kPortableSmemBytes, stream>>>(params);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    const char* name = path == kHopper ? "gqa_prefill_wgmma_kernel" : "gqa_prefill_kernel";
    TVM_FFI_THROW(RuntimeError) << name << " launch (" << num_ctas
                                << " CTAs) failed: " << cudaGetErrorString(err);
  }
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

void run_padded(AnyView q_arg, AnyView k_arg, AnyView v_arg, AnyView causal_arg,
                AnyView out_arg) {
  const Arg q("q", q_arg), k("k", k_arg), v("v", v_arg), out("out", out_arg);
  check_padded_shapes(q, k, v, out);
  const bool causal = check_causal(causal_arg);
  check_layout({&q, &k, &v, &out});
  const int64_t batch = q->size(0), seq_q = q->size(1), seq_kv = k->size(1);
  // The kernel indexes rows (not elements) in 32 bits.
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  if (batch * seq_q > kMaxRows || batch * seq_kv > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "q, k: more than 2^31 - 1 rows (batch x seq) are not supported";
  }
  if (batch == 0 || seq_q == 0) return;  // no query row: nothing to write

  Params params = input_params(q, k, v, out);
  params.lse = nullptr;
  params.batch = static_cast<int>(batch);
  params.seq_q = static_cast<int>(seq_q);
  params.seq_kv = static_cast<int>(seq_kv);
  params.tiles_per_seq = static_cast<int>((seq_q + kTokensPerTile - 1) / kTokensPerTile);
  params.scale_log2 = static_cast<float>(kLog2E / std::sqrt(static_cast<double>(kHeadDim)));
  const int64_t num_slots = batch * params.tiles_per_seq;
  check_grid(num_slots * kNumKvHeads);
  const DLDevice device = q->device();
  tvm::ffi::CUDADeviceGuard guard(device.device_id);
  const bool bf16 = q->dtype().code == kDLBfloat;
  const int64_t q_rows = batch * seq_q, kv_rows = batch * seq_kv;
  if (causal) {
    bf16 ? launch<__nv_bfloat16, true, false>(params, num_slots, q_rows, kv_rows, device)
         : launch<half, true, false>(params, num_slots, q_rows, kv_rows, device);
  } else {
    bf16 ? launch<__nv_bfloat16, false, false>(params, num_slots, q_rows, kv_rows, device)
         : launch<half, false, false>(params, num_slots, q_rows, kv_rows, device);
  }
}

void run_ragged(AnyView q_arg, AnyView k_arg, AnyView v_arg, AnyView qo_indptr_arg,
                AnyView kv_indptr_arg, AnyView sm_scale_arg, AnyView output_arg,
                AnyView lse_arg) {
  const Arg q("q", q_arg), k("k", k_arg), v("v", v_arg), qo_indptr("qo_indptr", qo_indptr_arg),
      kv_indptr("kv_indptr", kv_indptr_arg), output("output", output_arg), lse("lse", lse_arg);
  check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse);
  const double sm_scale = check_sm_scale(sm_scale_arg);
  check_layout({&q, &k, &v, &qo_indptr, &kv_indptr, &output, &lse});
  const int64_t batch = qo_indptr->size(0) - 1, total_q = q->size(0), total_kv = k->size(0);
  const DLDevice device = q->device();
  tvm::ffi::CUDADeviceGuard guard(device.device_id);
  if (validate_indptr_values()) {
    check_indptr_values(
        qo_indptr, kv_indptr, total_q, total_kv,
        static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id)));
  }
  if (total_q > std::numeric_limits<int32_t>::max() ||
      total_kv > std::numeric_limits<int32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "q, k: more than 2^31 - 1 rows are not supported";
  }
  if (total_q == 0) return;  // no query row: nothing to write

  Params params = input_params(q, k, v, output);
  params.lse = reinterpret_cast<float*>(const_cast<char*>(address(*lse)));
  params.qo_indptr = reinterpret_cast<const int*>(address(*qo_indptr));
  params.kv_indptr = reinterpret_cast<const int*>(address(*kv_indptr));
  params.batch = static_cast<int>(batch);
  params.total_q = static_cast<int>(total_q);
  params.total_kv = static_cast<int>(total_kv);
  params.scale_log2 = static_cast<float>(sm_scale * kLog2E);
  // total_q / 32 + batch slots cover every sequence's query tiles (see the kernel's search).
  const int64_t num_slots = total_q / kTokensPerTile + batch;
  check_grid(num_slots * kNumKvHeads);
  // The ragged definition is always causal.
  q->dtype().code == kDLBfloat
      ? launch<__nv_bfloat16, true, true>(params, num_slots, total_q, total_kv, device)
      : launch<half, true, true>(params, num_slots, total_q, total_kv, device);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_padded, run_padded);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_ragged, run_ragged);
