// Entry points of both definitions (tvm-ffi, destination-passing): argument checks at the
// boundary, then one kernel launch on the caller's current CUDA stream. The kernel is in
// attention_kernel.cuh.
//
//   run_padded(q, k, v, causal, out)                                  mini_flash_attention_prefill
//   run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)  gqa_ragged_prefill_causal_...
//   run_ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse)
//                                                                  gqa_ragged_prefill_causal_swa_...
//   run_paged_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
//                  sm_scale, output, lse)                          gqa_paged_prefill_..._ps64
//   run_paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse)
//                                                                  gqa_paged_prefill_..._ps1
//   run_paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
//                        k_scale, v_scale, sm_scale, output, lse)
//                                                 gqa_paged_prefill_causal_fp8kv_..._ps64
//   built_knobs()                      the build's tuning knobs as JSON (hopper_knobs.cuh)
//
// The argument contract and its error messages are prefill_bundle/arguments.py's, reproduced
// here byte for byte (every error a ValueError "<argument>: expected <what>, got <what>"): q, k,
// v float16 or bfloat16 and token-strided (heads dense), outputs and indptr contiguous, all on
// one CUDA device; causal a bool or a 0-d bool tensor, sm_scale a finite real, window_left an
// int (or a 0-d integer tensor) in [-1, 2**31 - 1]. Arguments come in as AnyView, so that a
// wrong type gets that message too. An sm_90a build runs the wgmma kernel, an sm_90 build the
// portable one (see launch()). Indptr values are read on the device only
// (the kernels cope with malformed ones), unless PREFILL_BUNDLE_VALIDATE=1; so are page ids and
// last-page lengths. The caches k_cache / v_cache [num_pages, page_size, 8, 128] are dense
// within a page, pages any multiple of 16 bytes (and at least a page) apart; FP8 caches
// (float8_e4m3fn) come with k_scale and v_scale, finite reals: k_scale joins the softmax scale,
// v_scale multiplies the output (arguments.fold_kv_scales).
//
// The host code, in reading order: entry_describe.cuh (error-message text), entry_checks.cuh
// (the contract's checks), entry_launch.cuh (kernel choice and launch), then the entry points
// below.

#include "entry_launch.cuh"

void run_padded(AnyView q_arg, AnyView k_arg, AnyView v_arg, AnyView causal_arg,
                AnyView out_arg) {
  const GraphScratchScope graph_scratch_scope;  // a captured call's memory: freed last
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
  } else if (uses_short_key_tiles(seq_kv)) {
    bf16 ? launch<__nv_bfloat16, false, false, false, true>(params, num_slots, q_rows, kv_rows,
                                                            device)
         : launch<half, false, false, false, true>(params, num_slots, q_rows, kv_rows, device);
  } else {
    bf16 ? launch<__nv_bfloat16, false, false>(params, num_slots, q_rows, kv_rows, device)
         : launch<half, false, false>(params, num_slots, q_rows, kv_rows, device);
  }
}

// Both ragged definitions; window_left_arg is nullptr for the one without a window.
void run_ragged_batch(const Arg& q, const Arg& k, const Arg& v, const Arg& qo_indptr,
                      const Arg& kv_indptr, const AnyView* window_left_arg,
                      const AnyView& sm_scale_arg, const Arg& output, const Arg& lse) {
  const GraphScratchScope graph_scratch_scope;  // a captured call's memory: freed last
  check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse);
  const int64_t window_left = window_left_arg ? check_window_left(*window_left_arg) : -1;
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
  const bool bf16 = q->dtype().code == kDLBfloat;
  // The ragged definitions are causal. No window (-1), or one as long as every sequence's keys
  // (no sequence has more than total_kv): the causal kernels; else the band's (KeyBand), with
  // window_left < total_kv < 2^31.
  if (window_left < 0 || window_left >= total_kv) {
    bf16 ? launch<__nv_bfloat16, true, true>(params, num_slots, total_q, total_kv, device)
         : launch<half, true, true>(params, num_slots, total_q, total_kv, device);
  } else {
    params.window_left = static_cast<int>(window_left);
    bf16 ? launch<__nv_bfloat16, true, true, true>(params, num_slots, total_q, total_kv, device)
         : launch<half, true, true, true>(params, num_slots, total_q, total_kv, device);
  }
}

void run_ragged(AnyView q_arg, AnyView k_arg, AnyView v_arg, AnyView qo_indptr_arg,
                AnyView kv_indptr_arg, AnyView sm_scale_arg, AnyView output_arg,
                AnyView lse_arg) {
  const Arg q("q", q_arg), k("k", k_arg), v("v", v_arg), qo_indptr("qo_indptr", qo_indptr_arg),
      kv_indptr("kv_indptr", kv_indptr_arg), output("output", output_arg), lse("lse", lse_arg);
  run_ragged_batch(q, k, v, qo_indptr, kv_indptr, nullptr, sm_scale_arg, output, lse);
}

void run_ragged_swa(AnyView q_arg, AnyView k_arg, AnyView v_arg, AnyView qo_indptr_arg,
                    AnyView kv_indptr_arg, AnyView window_left_arg, AnyView sm_scale_arg,
                    AnyView output_arg, AnyView lse_arg) {
  const Arg q("q", q_arg), k("k", k_arg), v("v", v_arg), qo_indptr("qo_indptr", qo_indptr_arg),
      kv_indptr("kv_indptr", kv_indptr_arg), output("output", output_arg), lse("lse", lse_arg);
  run_ragged_batch(q, k, v, qo_indptr, kv_indptr, &window_left_arg, sm_scale_arg, output, lse);
}

// The paged definitions; kv_last_page_len is nullptr for page size 1 (every page full).
// kFp8: FP8 caches, kv_scales their k_scale and v_scale.
template <int kPageSize, bool kFp8 = false>
void run_paged(const Arg& q, const Arg& k_cache, const Arg& v_cache, const Arg& qo_indptr,
               const Arg& kv_indptr, const Arg& kv_indices, const Arg* kv_last_page_len,
               const AnyView& sm_scale_arg, const Arg& output, const Arg& lse,
               const AnyView* kv_scales = nullptr) {
  const GraphScratchScope graph_scratch_scope;  // a captured call's memory: freed last
  constexpr DLDataType kFp8Dtype{kDLFloat8_e4m3fn, 8, 1};
  check_paged_shapes(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                     output, lse, kPageSize, kFp8 ? &kFp8Dtype : nullptr);
  double sm_scale = 0.0, v_scale = 1.0;
  if constexpr (kFp8) {
    std::tie(sm_scale, v_scale) = fold_kv_scales(sm_scale_arg, kv_scales[0], kv_scales[1]);
  } else {
    sm_scale = check_sm_scale(sm_scale_arg);
  }
  if (kv_last_page_len != nullptr) {
    check_paged_layout({&q, &k_cache, &v_cache, &qo_indptr, &kv_indptr, &kv_indices,
                        kv_last_page_len, &output, &lse});
  } else {
    check_paged_layout({&q, &k_cache, &v_cache, &qo_indptr, &kv_indptr, &kv_indices, &output,
                        &lse});
  }
  const int64_t batch = qo_indptr->size(0) - 1, total_q = q->size(0);
  const int64_t num_pages = k_cache->size(0), num_kv_indices = kv_indices->size(0);
  const DLDevice device = q->device();
  tvm::ffi::CUDADeviceGuard guard(device.device_id);
  if (validate_indptr_values()) {
    check_paged_values(
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len, total_q, num_pages, kPageSize,
        static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id)));
  }
  // The kernels count query rows and keys (pages x page size) in 32 bits.
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  if (total_q > kMaxRows || num_kv_indices > kMaxRows / kPageSize) {
    TVM_FFI_THROW(ValueError) << "q, kv_indices: more than 2^31 - 1 query rows or keys (pages x "
                                 "page size) are not supported";
  }
  if (total_q == 0) return;  // no query row: nothing to write

  Params params{};
  params.q = address(*q);
  params.q_stride = token_stride_32(q);
  // Rows that are zero-filled still name an address (the cache's first bytes, which the kernels
  // never read); without a page, q's stand in.
  params.k = num_pages > 0 ? address(*k_cache) : params.q;
  params.v = num_pages > 0 ? address(*v_cache) : params.q;
  params.out = const_cast<char*>(address(*output));
  params.lse = reinterpret_cast<float*>(const_cast<char*>(address(*lse)));
  params.qo_indptr = reinterpret_cast<const int*>(address(*qo_indptr));
  params.kv_indptr = reinterpret_cast<const int*>(address(*kv_indptr));
  params.batch = static_cast<int>(batch);
  params.total_q = static_cast<int>(total_q);
  params.total_kv = static_cast<int>(num_kv_indices);  // kv_indptr indexes kv_indices
  params.scale_log2 = static_cast<float>(sm_scale * kLog2E);
  PageTable pages{};
  pages.kv_indices = reinterpret_cast<const int*>(address(*kv_indices));
  pages.last_page_len = kv_last_page_len != nullptr
                            ? reinterpret_cast<const int*>(address(**kv_last_page_len))
                            : nullptr;
  // Ids are int32: past 2^31 - 1 pages every id is in range anyway.
  pages.num_pages = static_cast<int>(std::min(num_pages, kMaxRows));
  pages.v_scale = static_cast<float>(v_scale);
  // With one page (or none) no id addresses a second: its stride is any (cache_strides_ok).
  const int64_t page_elements = int64_t(kPageSize) * kNumKvHeads * kHeadDim;
  pages.k_page_stride = num_pages > 1 ? k_cache->stride(0) : page_elements;
  pages.v_page_stride = num_pages > 1 ? v_cache->stride(0) : page_elements;
  // Sequence s owns slots qo_indptr[s] / 32 + s ..., as in the ragged kernel.
  const int64_t num_slots = total_q / kTokensPerTile + batch;
  check_grid(num_slots * kNumKvHeads);
  if constexpr (kPageSize == 1 && !kFp8) {
    if (gathers_pages(total_q, batch, num_kv_indices, q->dtype().bits / 8)) {
      q->dtype().code == kDLBfloat
          ? launch_gathered<__nv_bfloat16>(params, pages, num_slots, total_q, device)
          : launch_gathered<half>(params, pages, num_slots, total_q, device);
      return;
    }
  }
  q->dtype().code == kDLBfloat
      ? launch_paged<__nv_bfloat16, kPageSize, kFp8>(params, pages, num_slots, total_q,
                                                     num_pages, device)
      : launch_paged<half, kPageSize, kFp8>(params, pages, num_slots, total_q, num_pages, device);
}

void run_paged_ps64(AnyView q_arg, AnyView k_cache_arg, AnyView v_cache_arg,
                    AnyView qo_indptr_arg, AnyView kv_indptr_arg, AnyView kv_indices_arg,
                    AnyView kv_last_page_len_arg, AnyView sm_scale_arg, AnyView output_arg,
                    AnyView lse_arg) {
  const Arg q("q", q_arg), k_cache("k_cache", k_cache_arg), v_cache("v_cache", v_cache_arg),
      qo_indptr("qo_indptr", qo_indptr_arg), kv_indptr("kv_indptr", kv_indptr_arg),
      kv_indices("kv_indices", kv_indices_arg),
      kv_last_page_len("kv_last_page_len", kv_last_page_len_arg), output("output", output_arg),
      lse("lse", lse_arg);
  run_paged<64>(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, &kv_last_page_len,
                sm_scale_arg, output, lse);
}

void run_paged_ps1(AnyView q_arg, AnyView k_cache_arg, AnyView v_cache_arg, AnyView qo_indptr_arg,
                   AnyView kv_indptr_arg, AnyView kv_indices_arg, AnyView sm_scale_arg,
                   AnyView output_arg, AnyView lse_arg) {
  const Arg q("q", q_arg), k_cache("k_cache", k_cache_arg), v_cache("v_cache", v_cache_arg),
      qo_indptr("qo_indptr", qo_indptr_arg), kv_indptr("kv_indptr", kv_indptr_arg),
      kv_indices("kv_indices", kv_indices_arg), output("output", output_arg), lse("lse", lse_arg);
  run_paged<1>(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, nullptr, sm_scale_arg,
               output, lse);
}

void run_paged_ps64_fp8kv(AnyView q_arg, AnyView k_cache_arg, AnyView v_cache_arg,
                          AnyView qo_indptr_arg, AnyView kv_indptr_arg, AnyView kv_indices_arg,
                          AnyView kv_last_page_len_arg, AnyView k_scale_arg, AnyView v_scale_arg,
                          AnyView sm_scale_arg, AnyView output_arg, AnyView lse_arg) {
  const Arg q("q", q_arg), k_cache("k_cache", k_cache_arg), v_cache("v_cache", v_cache_arg),
      qo_indptr("qo_indptr", qo_indptr_arg), kv_indptr("kv_indptr", kv_indptr_arg),
      kv_indices("kv_indices", kv_indices_arg),
      kv_last_page_len("kv_last_page_len", kv_last_page_len_arg), output("output", output_arg),
      lse("lse", lse_arg);
  const AnyView kv_scales[2] = {k_scale_arg, v_scale_arg};
  run_paged<64, true>(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, &kv_last_page_len,
                      sm_scale_arg, output, lse, kv_scales);
}

// The knobs this build's kernels were instantiated with, as JSON: scripts/tune_cuda.py checks
// a variant's against the ones it asked for (a misspelled hook would build the shipped ones).
template <typename Tiles>
std::string knobs_json() {
  std::ostringstream json;
  json << std::boolalpha << "{\"block_n\": " << Tiles::kBlockN
       << ", \"kv_stages\": " << Tiles::kKvStages
       << ", \"producer_registers\": " << Tiles::kProducerRegisters
       << ", \"consumer_registers\": " << Tiles::kConsumerRegisters
       << ", \"fold_scale\": " << Tiles::kFoldScale
       << ", \"own_output_buffer\": " << Tiles::kOwnOutputBuffer
       << ", \"persistent\": " << Tiles::kPersistent
       << ", \"pingpong\": " << Tiles::kPingpong << "}";
  return json.str();
}

tvm::ffi::String built_knobs() {
  return "{\"causal\": " + knobs_json<Knobs::CausalTiles>() +
         ", \"full\": " + knobs_json<Knobs::FullTiles>() +
         ", \"paged\": " + knobs_json<Knobs::PagedTiles>() +
         ", \"fp8_bf16_bits\": " + (Knobs::kFp8Bf16Bits ? "true" : "false") +
         ", \"fp8_split_q\": " + (Knobs::kFp8SplitQ ? "true" : "false") +
         ", \"fp8_f16_pv\": " + (Knobs::kFp8F16Pv ? "true" : "false") +
         ", \"idle_warpgroup_waits\": " + (Knobs::kIdleWarpgroupWaits ? "true" : "false") +
         ", \"share_waves\": " + std::to_string(Knobs::kShareWaves) + "}";
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_padded, run_padded);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_ragged, run_ragged);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_ragged_swa, run_ragged_swa);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_paged_ps64, run_paged_ps64);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_paged_ps1, run_paged_ps1);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_paged_ps64_fp8kv, run_paged_ps64_fp8kv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(built_knobs, built_knobs);
