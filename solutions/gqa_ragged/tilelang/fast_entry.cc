// The TileLang entries' fast path (fast_entry.py builds it; tilelang_prefill.py calls it first).
// A call whose every tensor has the layout of one the Python entry planned before (shapes,
// strides, dtypes, devices: the plan's key, and more) goes from the caller straight to the
// planned kernel's tvm-ffi main, with no Python in between: a cold call's Python costs 10-20 us
// of host time (TUNING.md, "A cold call's host time"). Anything else returns false and the
// Python entry takes the call as before:
//   - a layout not planned yet (it plans it, then registers it here, unless its call launched
//     something else than the main on the arguments as given: a stand-in, a restrided tensor;
//     a split's merge and page size 1's gather are taken here too, with the stream's buffers);
//   - a scale that is not a positive finite float, a window that is not a plain int;
//   - a misaligned pointer;
//   - a stream being captured into a CUDA graph (its counters are the graph's), or one without
//     its work counters yet.
// A main that raises leaves the call to the Python entry too, which then names the bad argument.
#include <dlfcn.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

// The entries' plan kinds (fast_entry.py's RAGGED, WINDOW, ...).
enum Kind : int {
  kRagged = 0, kWindow = 1, kPaged64 = 2, kPaged1 = 3, kPagedFp8 = 4, kPadded = 5, kKinds
};
constexpr size_t kPlansPerKind = 64;  // the oldest goes first when full
constexpr uintptr_t kAlign = 16;      // the kernels' vector and TMA accesses (ALIGN_BYTES)

struct Plan {
  std::vector<int64_t> key;
  ffi::Function main;
  // The padded entry's: its plan's qo_indptr, kv_indptr and scratch lse, and the strides of
  // the 3-d views of q, k, v and the output (3 each) that it passes main.
  std::vector<ffi::Tensor> tensors;
  std::vector<int64_t> strides;
  // Paged split-KV and decode programs: the merge, and the key shares (the workspace's rows
  // are shares x total_q).
  ffi::Optional<ffi::Function> merge;
  int64_t shares = 1;
  // Page size 1 gathered first: the gather into the stream's K and V buffers (main is then the
  // ragged program over them).
  ffi::Optional<ffi::Function> gather;
};

// A stream's buffers by use (fast_entry.py's SPLIT_BUFFERS, GATHER_BUFFERS; the Python entry's
// _stream_buffers): split-KV's fp32 output and LSE views for `rows` rows, or the gathered K and
// V of `rows` keys (one entry a stream: the Python entry keeps one buffer a stream).
enum Use : int64_t { kSplitBuffers = 0, kGatherBuffers = 1 };
struct Workspace {
  int64_t use;
  int32_t device;
  int64_t stream;
  int64_t rows;
  ffi::Tensor first, second;
};
constexpr size_t kWorkspaces = 32;  // the oldest goes first when full

struct Counters {
  int32_t device;
  int64_t stream;
  ffi::Tensor tensor;
};

std::mutex registry_mutex;
std::vector<std::shared_ptr<const Plan>> registry[kKinds];
std::vector<Counters> stream_counters;
std::vector<Workspace> workspaces;

// cuStreamIsCapturing from the driver that torch loaded (no link to libcuda: the module builds
// and loads on a machine without a GPU). Null if there is none: then no call is fast.
using StreamIsCapturing = int (*)(void* stream, int* status);
StreamIsCapturing stream_is_capturing() {
  static const StreamIsCapturing function = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) return StreamIsCapturing(nullptr);
    return reinterpret_cast<StreamIsCapturing>(dlsym(library, "cuStreamIsCapturing"));
  }();
  return function;
}

// t's layout appended to key; false unless t is a CUDA tensor of `device` whose data pointer
// is 16-byte aligned (device -1: t's sets it).
bool append_layout(std::vector<int64_t>& key, const DLTensor* t, int32_t& device) {
  if (t == nullptr || t->device.device_type != kDLCUDA) return false;
  if (device < 0) device = t->device.device_id;
  if (t->device.device_id != device) return false;
  const uintptr_t address = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (t->data == nullptr || address % kAlign != 0) return false;
  key.push_back(t->device.device_id);
  key.push_back(int64_t(t->dtype.code) | int64_t(t->dtype.bits) << 8 |
                int64_t(t->dtype.lanes) << 16);
  key.push_back(t->ndim);
  key.push_back(int64_t(t->byte_offset));
  for (int i = 0; i < t->ndim; ++i) key.push_back(t->shape[i]);
  for (int i = 0; i < t->ndim; ++i) key.push_back(t->strides ? t->strides[i] : -1);
  return true;
}

std::optional<DLTensor*> tensor(const ffi::AnyView& value) {
  return value.try_cast<DLTensor*>();
}

// The layout key of a call's tensors, or nullopt if one is not a tensor or fails append_layout.
std::optional<std::vector<int64_t>> layout_key(std::initializer_list<ffi::AnyView> tensors,
                                               int32_t& device) {
  std::vector<int64_t> key;
  key.reserve(16 * tensors.size());
  for (const ffi::AnyView& value : tensors) {
    const std::optional<DLTensor*> t = tensor(value);
    if (!t || !append_layout(key, *t, device)) return std::nullopt;
  }
  return key;
}

// A float argument in (0, inf): what the kernels take as it is.
std::optional<double> positive_float(const ffi::AnyView& value) {
  if (value.type_index() != ffi::TypeIndex::kTVMFFIFloat) return std::nullopt;
  const double x = *value.as<double>();
  if (!(x > 0.0 && x < INFINITY)) return std::nullopt;
  return x;
}

// A finite float (FP8's k_scale and v_scale may be any finite value but 0 for k_scale's fold).
std::optional<double> finite_float(const ffi::AnyView& value) {
  if (value.type_index() != ffi::TypeIndex::kTVMFFIFloat) return std::nullopt;
  const double x = *value.as<double>();
  if (!std::isfinite(x)) return std::nullopt;
  return x;
}

// The work counters of the current stream on device; nullopt if it has none registered or is
// being captured (then the Python entry gives the call the graph's own).
std::optional<ffi::Tensor> current_counters(int32_t device) {
  const StreamIsCapturing is_capturing = stream_is_capturing();
  if (is_capturing == nullptr) return std::nullopt;
  void* stream = TVMFFIEnvGetStream(kDLCUDA, device);
  int status = 1;
  if (is_capturing(stream, &status) != 0 || status != 0) return std::nullopt;
  const int64_t stream_id = reinterpret_cast<int64_t>(stream);
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const Counters& c : stream_counters) {
    if (c.device == device && c.stream == stream_id) return c.tensor;
  }
  return std::nullopt;
}

// The current stream's buffers of use for `rows` rows on device, if registered.
std::optional<std::pair<ffi::Tensor, ffi::Tensor>> current_workspace(Use use, int32_t device,
                                                                      int64_t rows) {
  const int64_t stream_id = reinterpret_cast<int64_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const Workspace& w : workspaces) {
    if (w.use == use && w.device == device && w.stream == stream_id && w.rows == rows) {
      return std::make_pair(w.first, w.second);
    }
  }
  return std::nullopt;
}

// The plan of kind registered for key, or null (shared: the registry may drop it meanwhile).
std::shared_ptr<const Plan> find_plan(Kind kind, const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const std::shared_ptr<const Plan>& plan : registry[kind]) {
    if (plan->key == key) return plan;
  }
  return nullptr;
}

// The plan of kind for key, and the current stream's counters; nullopt if either is missing.
std::optional<std::pair<std::shared_ptr<const Plan>, ffi::Tensor>> plan_and_counters(
    Kind kind, const std::vector<int64_t>& key, int32_t device) {
  const std::optional<ffi::Tensor> counters = current_counters(device);
  if (!counters) return std::nullopt;
  std::shared_ptr<const Plan> plan = find_plan(kind, key);
  if (plan == nullptr) return std::nullopt;
  return std::make_pair(std::move(plan), *counters);
}

// Keeps plan under kind (the oldest goes when full); a key already there stays as it is.
void store(int64_t kind, Plan plan) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<std::shared_ptr<const Plan>>& plans = registry[kind];
  for (const std::shared_ptr<const Plan>& kept : plans) {
    if (kept->key == plan.key) return;
  }
  if (plans.size() == kPlansPerKind) plans.erase(plans.begin());
  plans.push_back(std::make_shared<const Plan>(std::move(plan)));
}

}  // namespace

// ---- Registration (the Python entry, after a call it planned and launched as the fast path
// would have). tensors: the call's tensor arguments in the entry's order.

// merge (paged kinds only): the split or decode program's merge, after main wrote `shares`
// shares of every row into the stream's workspace; None: main writes output and lse.
// gather (page size 1 only): the pages into the stream's K and V buffers first, main then the
// ragged program over them.
void register_plan(int64_t kind, ffi::Function main, ffi::Array<ffi::Tensor> tensors,
                   ffi::Optional<ffi::Function> merge, int64_t shares,
                   ffi::Optional<ffi::Function> gather) {
  TVM_FFI_ICHECK(0 <= kind && kind < kKinds && kind != kPadded) << "no plan kind " << kind;
  TVM_FFI_ICHECK(!merge || (kind >= kPaged64 && kind <= kPagedFp8 && shares >= 1))
      << "a merge for a paged plan, with its shares";
  TVM_FFI_ICHECK(!gather || (kind == kPaged1 && !merge)) << "a gather for page size 1 alone";
  std::vector<int64_t> key;
  int32_t device = -1;
  for (const ffi::Tensor& t : tensors) {
    if (!append_layout(key, t.GetDLTensorPtr(), device)) return;  // never fast: not kept
  }
  store(kind, Plan{std::move(key), std::move(main), {}, {}, std::move(merge), shares,
                    std::move(gather)});
}

// A stream's buffers of use for `rows` rows. The gathered K and V replace the stream's last
// ones whatever their rows (the Python entry's buffer may have grown: the old one goes).
void register_workspace(int64_t use, int64_t device, int64_t stream, int64_t rows,
                        ffi::Tensor first, ffi::Tensor second) {
  TVM_FFI_ICHECK(use == kSplitBuffers || use == kGatherBuffers) << "no buffer use " << use;
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (Workspace& w : workspaces) {
    if (w.use == use && w.device == device && w.stream == stream &&
        (w.rows == rows || use == kGatherBuffers)) {
      w.rows = rows;
      w.first = std::move(first);
      w.second = std::move(second);
      return;
    }
  }
  if (workspaces.size() == kWorkspaces) workspaces.erase(workspaces.begin());
  workspaces.push_back(
      Workspace{use, int32_t(device), stream, rows, std::move(first), std::move(second)});
}

// The padded entry's plan for q, k, v and out with the causal flag: main, the plan's indptr
// tensors and scratch lse, and the 3-d views' strides (q, k, v, out: 3 each).
void register_padded(ffi::Function main, ffi::Tensor q, ffi::Tensor k, ffi::Tensor v,
                     ffi::Tensor out, bool causal, ffi::Tensor qo_indptr, ffi::Tensor kv_indptr,
                     ffi::Tensor lse, ffi::Array<int64_t> view_strides) {
  TVM_FFI_ICHECK(view_strides.size() == 12) << "3 strides for each of q, k, v and out";
  std::vector<int64_t> key;
  int32_t device = -1;
  for (const ffi::Tensor& t : {q, k, v, out}) {
    if (!append_layout(key, t.GetDLTensorPtr(), device)) return;
  }
  key.push_back(causal);
  std::vector<int64_t> strides(view_strides.begin(), view_strides.end());
  store(kPadded, Plan{std::move(key), std::move(main), {qo_indptr, kv_indptr, lse},
                      std::move(strides), std::nullopt, 1});
}

void register_counters(int64_t device, int64_t stream, ffi::Tensor counters) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (Counters& c : stream_counters) {
    if (c.device == device && c.stream == stream) {
      c.tensor = std::move(counters);
      return;
    }
  }
  stream_counters.push_back(Counters{int32_t(device), stream, std::move(counters)});
}

// Drops every plan and counter (tests; the interpreter's exit, before its objects go).
void clear() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& plans : registry) plans.clear();
  stream_counters.clear();
  workspaces.clear();
}

int64_t plan_count(int64_t kind) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return 0 <= kind && kind < kKinds ? int64_t(registry[kind].size()) : -1;
}

// ---- The fast calls: true if the kernel was launched, false if the Python entry must take it.

namespace {

// t as [rows, heads, 128] at the given strides (the padded entry's as_strided and view).
DLTensor view_3d(const DLTensor* t, int64_t (&shape)[3], const int64_t* strides) {
  DLTensor view = *t;
  view.ndim = 3;
  view.shape = shape;
  view.strides = const_cast<int64_t*>(strides);
  return view;
}

}  // namespace

bool padded(ffi::AnyView q, ffi::AnyView k, ffi::AnyView v, ffi::AnyView causal,
            ffi::AnyView out) {
  if (causal.type_index() != ffi::TypeIndex::kTVMFFIBool) return false;
  int32_t device = -1;
  auto key = layout_key({q, k, v, out}, device);
  if (!key) return false;
  key->push_back(*causal.as<bool>());
  const auto target = plan_and_counters(kPadded, *key, device);
  if (!target) return false;
  const auto& [plan, counters] = *target;
  const DLTensor *tq = *tensor(q), *tk = *tensor(k), *tv = *tensor(v), *to = *tensor(out);
  if (tq->ndim != 4 || tk->ndim != 4) return false;  // the key's layouts: 4-d as planned
  const int64_t total_q = tq->shape[0] * tq->shape[1], total_kv = tk->shape[0] * tk->shape[1];
  int64_t q_shape[3] = {total_q, tq->shape[2], tq->shape[3]};
  int64_t kv_shape[3] = {total_kv, tk->shape[2], tk->shape[3]};
  int64_t v_shape[3] = {total_kv, tv->shape[2], tv->shape[3]};
  int64_t out_shape[3] = {total_q, to->shape[2], to->shape[3]};
  DLTensor q3 = view_3d(tq, q_shape, plan->strides.data());
  DLTensor k3 = view_3d(tk, kv_shape, plan->strides.data() + 3);
  DLTensor v3 = view_3d(tv, v_shape, plan->strides.data() + 6);
  DLTensor out3 = view_3d(to, out_shape, plan->strides.data() + 9);
  const double scale = std::pow(double(tq->shape[3]), -0.5);  // as Python: HEAD_DIM**-0.5
  plan->main(&q3, &k3, &v3, plan->tensors[0], plan->tensors[1], total_kv, scale, &out3,
             plan->tensors[2], counters);
  return true;
}

bool ragged(ffi::AnyView q, ffi::AnyView k, ffi::AnyView v, ffi::AnyView qo_indptr,
            ffi::AnyView kv_indptr, ffi::AnyView sm_scale, ffi::AnyView output, ffi::AnyView lse) {
  int32_t device = -1;
  const auto key = layout_key({q, k, v, qo_indptr, kv_indptr, output, lse}, device);
  const auto scale = positive_float(sm_scale);
  if (!key || !scale) return false;
  const int64_t total_kv = (*tensor(k))->shape[0];
  const auto target = plan_and_counters(kRagged, *key, device);
  if (!target) return false;
  target->first->main(q, k, v, qo_indptr, kv_indptr, total_kv, *scale, output, lse,
                      target->second);
  return true;
}

bool ragged_swa(ffi::AnyView q, ffi::AnyView k, ffi::AnyView v, ffi::AnyView qo_indptr,
                ffi::AnyView kv_indptr, ffi::AnyView window_left, ffi::AnyView sm_scale,
                ffi::AnyView output, ffi::AnyView lse) {
  if (window_left.type_index() != ffi::TypeIndex::kTVMFFIInt) return false;
  const int64_t window = *window_left.as<int64_t>();
  if (window < -1 || window > INT32_MAX) return false;
  int32_t device = -1;
  const auto key = layout_key({q, k, v, qo_indptr, kv_indptr, output, lse}, device);
  const auto scale = positive_float(sm_scale);
  if (!key || !scale) return false;
  const int64_t total_kv = (*tensor(k))->shape[0];
  // No window, or one at least as long as the keys: the causal program (run_ragged_swa).
  if (window < 0 || window >= total_kv) {
    const auto target = plan_and_counters(kRagged, *key, device);
    if (!target) return false;
    target->first->main(q, k, v, qo_indptr, kv_indptr, total_kv, *scale, output, lse,
                        target->second);
    return true;
  }
  const auto target = plan_and_counters(kWindow, *key, device);
  if (!target) return false;
  target->first->main(q, k, v, qo_indptr, kv_indptr, total_kv, window, *scale, output, lse,
                      target->second);
  return true;
}

namespace {

// A paged plan's launch: main on `head` (the arguments up to the scales), then output and lse;
// or, with a merge, the stream's workspace of shares x total_q rows and then the merge into
// output and lse (false if that workspace is not registered yet).
template <typename... Head>
bool launch_paged(const Plan& plan, const ffi::Tensor& counters, int32_t device,
                  int64_t total_q, const ffi::AnyView& output, const ffi::AnyView& lse,
                  const Head&... head) {
  if (!plan.merge) {
    plan.main(head..., output, lse, counters);
    return true;
  }
  const auto workspace = current_workspace(kSplitBuffers, device, plan.shares * total_q);
  if (!workspace) return false;
  plan.main(head..., workspace->first, workspace->second, counters);
  (*plan.merge)(workspace->first, workspace->second, output, lse);
  return true;
}


}  // namespace

bool paged_ps64(ffi::AnyView q, ffi::AnyView k_cache, ffi::AnyView v_cache,
                ffi::AnyView qo_indptr, ffi::AnyView kv_indptr, ffi::AnyView kv_indices,
                ffi::AnyView kv_last_page_len, ffi::AnyView sm_scale, ffi::AnyView output,
                ffi::AnyView lse) {
  int32_t device = -1;
  const auto key = layout_key(
      {q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse},
      device);
  const auto scale = positive_float(sm_scale);
  if (!key || !scale) return false;
  const auto target = plan_and_counters(kPaged64, *key, device);
  if (!target) return false;
  const auto& [plan, counters] = *target;
  return launch_paged(*plan, counters, device, (*tensor(q))->shape[0], output, lse, q, k_cache,
                      v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                      (*tensor(kv_indices))->shape[0], (*tensor(k_cache))->shape[0], *scale);
}

bool paged_ps1(ffi::AnyView q, ffi::AnyView k_cache, ffi::AnyView v_cache,
               ffi::AnyView qo_indptr, ffi::AnyView kv_indptr, ffi::AnyView kv_indices,
               ffi::AnyView sm_scale, ffi::AnyView output, ffi::AnyView lse) {
  int32_t device = -1;
  const auto key =
      layout_key({q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, output, lse}, device);
  const auto scale = positive_float(sm_scale);
  if (!key || !scale) return false;
  const auto target = plan_and_counters(kPaged1, *key, device);
  if (!target) return false;
  const auto& [plan, counters] = *target;
  const int64_t rows = (*tensor(kv_indices))->shape[0], pages = (*tensor(k_cache))->shape[0];
  if (plan->gather) {
    // The pages into the stream's K and V buffers (in q's dtype), then the ragged program over
    // them, kv_indptr indexing keys as it indexed pages (the Python entry's _run_gathered).
    const auto buffers = current_workspace(kGatherBuffers, device, rows);
    if (!buffers) return false;
    const DLDataType dtype = (*tensor(q))->dtype;
    const DLDataType buffer_dtype = buffers->first.dtype();
    if (buffer_dtype.code != dtype.code || buffer_dtype.bits != dtype.bits) return false;
    (*plan->gather)(k_cache, v_cache, kv_indices, pages, buffers->first, buffers->second);
    plan->main(q, buffers->first, buffers->second, qo_indptr, kv_indptr, rows, *scale, output,
               lse, counters);
    return true;
  }
  return launch_paged(*plan, counters, device, (*tensor(q))->shape[0], output, lse, q, k_cache,
                      v_cache, qo_indptr, kv_indptr, kv_indices, rows, pages, *scale);
}

bool paged_ps64_fp8kv(ffi::AnyView q, ffi::AnyView k_cache, ffi::AnyView v_cache,
                      ffi::AnyView qo_indptr, ffi::AnyView kv_indptr, ffi::AnyView kv_indices,
                      ffi::AnyView kv_last_page_len, ffi::AnyView k_scale, ffi::AnyView v_scale,
                      ffi::AnyView sm_scale, ffi::AnyView output, ffi::AnyView lse) {
  int32_t device = -1;
  const auto key = layout_key(
      {q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse},
      device);
  const auto softmax_scale = finite_float(sm_scale);
  const auto k = finite_float(k_scale), v = finite_float(v_scale);
  if (!key || !softmax_scale || !k || !v) return false;
  // fold_kv_scales: k_scale joins the softmax scale, which the kernel needs positive.
  const double scale = *softmax_scale * *k;
  if (!(scale > 0.0 && scale < INFINITY)) return false;
  const auto target = plan_and_counters(kPagedFp8, *key, device);
  if (!target) return false;
  const auto& [plan, counters] = *target;
  return launch_paged(*plan, counters, device, (*tensor(q))->shape[0], output, lse, q, k_cache,
                      v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                      (*tensor(kv_indices))->shape[0], (*tensor(k_cache))->shape[0], scale,
                      *v);
}
