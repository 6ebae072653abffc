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

}  // namespace
