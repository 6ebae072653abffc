// Host side of prefill_entry.cu, part 2: the argument contract's checks, arguments.py's in the
// same order with the same messages, and the optional host check of indptr values.
#pragma once

#include "entry_describe.cuh"

namespace {

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
  if (!same) fail(v.name, std::string(k.name) + "'s shape " + shape_text(*k), describe(*v));
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

// arguments.check_paged_shapes; kv_last_page_len is nullptr for page size 1; cache_dtype the
// caches' dtype where it is not q's (float8_e4m3fn for the FP8 definition), else nullptr.
void check_paged_shapes(const Arg& q, const Arg& k_cache, const Arg& v_cache, const Arg& qo_indptr,
                        const Arg& kv_indptr, const Arg& kv_indices, const Arg* kv_last_page_len,
                        const Arg& output, const Arg& lse, int page_size,
                        const DLDataType* cache_dtype = nullptr) {
  if (!(q.tensor && is_half(*q) && shape_is(*q, {-1, kNumHeads, kHeadDim}))) {
    fail("q", "bfloat16 or float16 [total_q, 32, 128]", describe(q.value));
  }
  const int64_t total_q = q->size(0);
  for (const Arg* x : {&k_cache, &v_cache}) {
    expect_tensor(*x, cache_dtype ? *cache_dtype : q->dtype(),
                  {-1, page_size, kNumKvHeads, kHeadDim}, [&] {
                    return "[num_pages, " + std::to_string(page_size) + ", 8, 128]" +
                           (cache_dtype ? "" : " (q's dtype)");
                  });
  }
  expect_same_shape(v_cache, k_cache);
  constexpr DLDataType kInt32{kDLInt, 32, 1};
  expect_tensor(qo_indptr, kInt32, {-1}, [] { return std::string("[batch + 1]"); });
  if (qo_indptr->size(0) < 1) fail("qo_indptr", "int32 [batch + 1]", describe(*qo_indptr));
  const int64_t size = qo_indptr->size(0);
  expect_tensor(kv_indptr, kInt32, {size},
                [&] { return "[" + std::to_string(size) + "] (qo_indptr's shape)"; });
  expect_tensor(kv_indices, kInt32, {-1}, [] { return std::string("[num_kv_indices]"); });
  const int64_t num_kv_indices = kv_indices->size(0), batch = size - 1;
  if (kv_last_page_len != nullptr) {
    expect_tensor(*kv_last_page_len, kInt32, {batch},
                  [&] { return "[" + std::to_string(batch) + "]"; });
  }
  if (batch == 0 && (total_q > 0 || num_kv_indices > 0)) {
    fail("qo_indptr",
         "at least one sequence for " + std::to_string(total_q) + " query rows and " +
             std::to_string(num_kv_indices) + " pages",
         describe(*qo_indptr));
  }
  expect_tensor(output, q->dtype(), {total_q, kNumHeads, kHeadDim},
                [&] { return shape_text(*q) + " (q's dtype and shape)"; });
  expect_tensor(lse, DLDataType{kDLFloat, 32, 1}, {total_q, kNumHeads},
                [&] { return "[" + std::to_string(total_q) + ", 32]"; });
}

// The bytes of a 0-d tensor's value, read on the host (a sync if on a GPU).
void read_scalar(const char* name, const TensorView& t, void* value, size_t bytes) {
  const auto* data = static_cast<const char*>(t.data_ptr()) + t.byte_offset();
  if (t.device().device_type != kDLCUDA) {
    std::memcpy(value, data, bytes);
    return;
  }
  tvm::ffi::CUDADeviceGuard guard(t.device().device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
  cudaError_t err = cudaMemcpyAsync(value, data, bytes, cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << name << ": reading the tensor failed: "
                                << cudaGetErrorString(err);
  }
}

// arguments.check_causal. A tensor's value is read on the host (a sync if on a GPU).
bool check_causal(const AnyView& causal) {
  if (auto b = causal.as<bool>()) return *b;
  if (auto t = causal.try_cast<TensorView>()) {
    if (t->ndim() == 0 && same_dtype(t->dtype(), DLDataType{kDLBool, 8, 1})) {
      char value = 0;
      read_scalar("causal", *t, &value, 1);
      return value != 0;
    }
  }
  fail("causal", "a Python bool or a 0-d bool tensor", describe(causal));
}

// arguments.check_window_left: an int (or a 0-d integer tensor, read on the host) in
// [-1, 2**31 - 1]; -1 means no window. A tensor's value is described as the int it holds.
int64_t check_window_left(const AnyView& window_left) {
  std::optional<int64_t> value = window_left.as<int64_t>();
  std::string got;
  if (!value) {
    auto t = window_left.try_cast<TensorView>();
    const DLDataType dtype = t ? t->dtype() : DLDataType{};
    const bool integer = (dtype.code == kDLInt || dtype.code == kDLUInt) && dtype.lanes == 1 &&
                         (dtype.bits == 8 || dtype.bits == 16 || dtype.bits == 32 ||
                          dtype.bits == 64);
    if (t && t->ndim() == 0 && integer) {
      uint64_t bits = 0;  // little-endian: the value's bytes first
      read_scalar("window_left", *t, &bits, dtype.bits / 8);
      const int shift = 64 - dtype.bits;
      if (dtype.code == kDLInt) {
        value = static_cast<int64_t>(bits << shift) >> shift;  // sign-extended
      } else if (dtype.bits < 64 || bits <= uint64_t(std::numeric_limits<int64_t>::max())) {
        value = static_cast<int64_t>(bits);
      } else {
        got = "int " + std::to_string(bits);  // a uint64 past int64: out of range
      }
      if (value) got = "int " + std::to_string(*value);
    }
  }
  if (!value || *value < -1 || *value > std::numeric_limits<int32_t>::max()) {
    fail("window_left", "an int in [-1, 2**31 - 1] (-1: no window)",
         got.empty() ? describe(window_left) : got);
  }
  return *value;
}

// arguments.check_sm_scale: a finite float or int (not bool).
double check_sm_scale(const AnyView& sm_scale, const char* name = "sm_scale") {
  std::optional<double> value = sm_scale.as<double>();
  if (auto i = sm_scale.as<int64_t>()) value = static_cast<double>(*i);
  if (!value || !std::isfinite(*value)) fail(name, "a finite float", describe(sm_scale));
  return *value;
}

// arguments.fold_kv_scales (FP8 caches): {sm_scale * k_scale, v_scale}, each scale finite.
std::pair<double, double> fold_kv_scales(const AnyView& sm_scale_arg, const AnyView& k_scale_arg,
                                         const AnyView& v_scale_arg) {
  const double sm_scale = check_sm_scale(sm_scale_arg);
  const double k_scale = check_sm_scale(k_scale_arg, "k_scale");
  const double v_scale = check_sm_scale(v_scale_arg, "v_scale");
  const double scale = sm_scale * k_scale;
  if (!std::isfinite(scale)) {
    fail("k_scale", "a finite float whose product with sm_scale is finite",
         "float " + float_repr(k_scale));
  }
  return {scale, v_scale};
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

// arguments.cache_strides_ok: dense within a page (torch's is_contiguous of the first page: dims
// of extent 1 ignored), a page stride that is a multiple of 16 bytes (8 elements of a 16-bit
// dtype, 16 of FP8) and at least one page.
bool cache_strides_ok(const TensorView& t) {
  int64_t expected = 1;
  for (int dim = 3; dim >= 1 && t.size(0) > 0; --dim) {
    if (t.size(dim) != 1 && t.stride(dim) != expected) return false;
    expected *= t.size(dim);
  }
  const int64_t page = t.size(1) * t.size(2) * t.size(3);
  const int64_t bytes = t.dtype().bits / 8;
  return t.size(0) <= 1 || (t.stride(0) * bytes % kAlignBytes == 0 && t.stride(0) >= page);
}

const char* address(const TensorView& t) {
  return static_cast<const char*>(t.data_ptr()) + t.byte_offset();
}

// The end of arguments.check_placement: args[0] on a CUDA device, every other one on it too.
void check_same_cuda_device(std::initializer_list<const Arg*> args) {
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
  check_same_cuda_device(args);
}

// arguments.check_layout for the paged definitions: first the strides of q (token-strided) and
// of the caches (args[1], args[2]), then check_placement: every other tensor contiguous, each
// one's data pointer 16-byte aligned, all on q's CUDA device.
void check_paged_layout(std::initializer_list<const Arg*> args) {
  const Arg* const* x = args.begin();
  if (!strides_ok(**x[0])) {
    fail(x[0]->name,
         "the last dim contiguous, heads dense and a token stride that is a multiple of 8 "
         "elements",
         describe(**x[0]) + " with strides " + int_list((*x[0])->strides().data(), 3));
  }
  for (int i = 1; i < 3; ++i) {
    if (!cache_strides_ok(**x[i])) {
      fail(x[i]->name,
           "pages dense inside and a page stride that is a multiple of " +
               std::to_string(kAlignBytes / ((*x[i])->dtype().bits / 8)) +
               " elements and at least one page",
           describe(**x[i]) + " with strides " + int_list((*x[i])->strides().data(), 4));
    }
  }
  int index = 0;
  for (const Arg* arg : args) {
    const TensorView& t = **arg;
    if (index++ >= 3 && !t.IsContiguous()) {
      fail(arg->name, "a contiguous tensor",
           describe(t) + " with strides " + int_list(t.strides().data(), t.ndim()));
    }
    if (reinterpret_cast<uintptr_t>(address(t)) % 16 != 0) {
      std::ostringstream hex;
      hex << "0x" << std::hex << reinterpret_cast<uintptr_t>(address(t));
      fail(arg->name, "a 16-byte aligned data pointer", hex.str());
    }
  }
  check_same_cuda_device(args);
}

// PREFILL_BUNDLE_VALIDATE=1: indptr values are checked on the host. Read on every call (a getenv
// is tens of nanoseconds), so a process can switch it on after the module loaded.
bool validate_indptr_values() {
  const char* value = std::getenv("PREFILL_BUNDLE_VALIDATE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// An int32 tensor's values on the host: one device-to-host copy on the stream, and a sync.
std::vector<int32_t> host_values(const Arg& x, cudaStream_t stream) {
  std::vector<int32_t> values(x->size(0));
  cudaError_t err = cudaMemcpyAsync(values.data(), address(*x), values.size() * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << x.name << ": copying it to the host failed: "
                                << cudaGetErrorString(err);
  }
  return values;
}

// arguments.check_indptr_values: both arrays are partitions, 0 = p0 <= ... <= pn = total
// (kv_rows: what kv_indptr's total is called).
void check_indptr_values(const Arg& qo_indptr, const Arg& kv_indptr, int64_t total_q,
                         int64_t total_kv, cudaStream_t stream,
                         const char* kv_rows = "total_kv") {
  const std::tuple<const Arg*, int64_t, const char*> arrays[] = {
      {&qo_indptr, total_q, "total_q"}, {&kv_indptr, total_kv, kv_rows}};
  for (const auto& [indptr, total, rows] : arrays) {
    const std::vector<int32_t> values = host_values(*indptr, stream);
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

// arguments.check_paged_values: the indptr arrays partitions (kv_indptr of kv_indices), page ids
// in [0, num_pages), last-page lengths in [1, page_size] where a sequence has pages.
void check_paged_values(const Arg& qo_indptr, const Arg& kv_indptr, const Arg& kv_indices,
                        const Arg* kv_last_page_len, int64_t total_q, int64_t num_pages,
                        int page_size, cudaStream_t stream) {
  check_indptr_values(qo_indptr, kv_indptr, total_q, kv_indices->size(0), stream,
                      "num_kv_indices");
  const std::vector<int32_t> ids = host_values(kv_indices, stream);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= num_pages) {
      fail("kv_indices", "page ids in [0, " + std::to_string(num_pages) + ")",
           "kv_indices[" + std::to_string(i) + "] = " + std::to_string(ids[i]));
    }
  }
  if (kv_last_page_len == nullptr) return;
  const std::vector<int32_t> bounds = host_values(kv_indptr, stream);
  const std::vector<int32_t> lengths = host_values(*kv_last_page_len, stream);
  for (size_t s = 0; s < lengths.size(); ++s) {
    if (bounds[s + 1] > bounds[s] && !(1 <= lengths[s] && lengths[s] <= page_size)) {
      fail("kv_last_page_len",
           "values in [1, " + std::to_string(page_size) + "] for sequences with pages",
           "kv_last_page_len[" + std::to_string(s) + "] = " + std::to_string(lengths[s]));
    }
  }
}

}  // namespace
