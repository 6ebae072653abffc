"""Baseline: FlashInfer's BatchPrefillWithRaggedKVCacheWrapper (fa3 on Hopper, fa2 elsewhere).

A serving loop plans once per batch and runs once per layer, so a wrapper is planned once per
shape and cached; run() only launches. The padded definition's indptr follows from its shape, so
its cache is exact. The ragged definition's plan depends on the indptr values, which only a host
sync could read: its cache is keyed on (total_q, total_kv, batch), so two batches with the same
totals but different lengths would share a plan. That is fine for benchmarking a workload whose
lengths are fixed; serve ragged batches through FlashInfer's own plan()/run() instead.

The FP8-cache definition plans the paged wrapper with kv_data_type float8_e4m3fn and lets
FlashInfer pick its backend (fa3 has no 16-bit-query, FP8-cache kernel); k_scale and v_scale go
to run().

The sliding-window definition plans the same wrapper with window_left (its cache key too).

The paged definitions run BatchPrefillWithPagedKVCacheWrapper the same way (causal, NHD, plan
cached per shape). Its plan keeps the index tensors it was given and its run reads them, so
every call points the planned wrapper at that call's tensors (flashinfer-bench clones the inputs
before every timed call: the planned ones would be stale).
"""

import torch
from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
_workspaces = {}
_planned = {}


def _backend(device: torch.device) -> str:
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _planned_wrapper(key, qo_indptr, kv_indptr, causal, sm_scale, dtype, window_left=-1):
    wrapper = _planned.get(key)
    if wrapper is None:
        device = qo_indptr.device
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(
            _workspace(device), "NHD", backend=_backend(device)
        )
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            q_data_type=dtype,
            kv_data_type=dtype,
            o_data_type=dtype,
        )
        _planned[key] = wrapper
    return wrapper


def run_padded(q, k, v, causal, out):
    batch, seq_q = q.shape[0], q.shape[1]
    seq_kv = k.shape[1]
    key = ("padded", batch, seq_q, seq_kv, bool(causal), q.dtype, q.device)
    wrapper = _planned.get(key)
    if wrapper is None:
        seqs = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        wrapper = _planned_wrapper(
            key, seqs * seq_q, seqs * seq_kv, bool(causal), HEAD_DIM**-0.5, q.dtype
        )
    wrapper.run(
        q.view(batch * seq_q, NUM_HEADS, HEAD_DIM),
        k.view(batch * seq_kv, NUM_KV_HEADS, HEAD_DIM),
        v.view(batch * seq_kv, NUM_KV_HEADS, HEAD_DIM),
        out=out.view(batch * seq_q, NUM_HEADS, HEAD_DIM),
    )


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    key = ("ragged", q.shape[0], k.shape[0], qo_indptr.shape[0], float(sm_scale), q.dtype, q.device)
    wrapper = _planned_wrapper(key, qo_indptr, kv_indptr, True, float(sm_scale), q.dtype)
    wrapper.run(q, k, v, out=output, lse=lse, return_lse=True)


def run_ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse):
    """The ragged wrapper planned with FlashInfer's own window_left (same meaning as ours)."""
    window_left = int(window_left)
    key = ("swa", q.shape[0], k.shape[0], qo_indptr.shape[0], window_left, float(sm_scale),
           q.dtype, q.device)  # fmt: skip
    wrapper = _planned_wrapper(key, qo_indptr, kv_indptr, True, float(sm_scale), q.dtype,
                               window_left)  # fmt: skip
    wrapper.run(q, k, v, out=output, lse=lse, return_lse=True)


def _run_paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, sm_scale,
               output, lse, scales=None):  # fmt: skip
    page_size = k_cache.shape[1]
    key = ("paged", page_size, q.shape[0], kv_indices.shape[0], qo_indptr.shape[0],
           float(sm_scale), q.dtype, k_cache.dtype, q.device)  # fmt: skip
    wrapper = _planned.get(key)
    if wrapper is None:
        # An FP8 cache under a 16-bit query has no fa3 kernel: FlashInfer picks ("auto").
        backend = _backend(q.device) if k_cache.dtype == q.dtype else "auto"
        wrapper = BatchPrefillWithPagedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            page_size,
            causal=True,
            sm_scale=float(sm_scale),
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            o_data_type=q.dtype,
        )
        _planned[key] = wrapper
    # What plan() does with device tensors (.to() returns them): keep this call's.
    wrapper._qo_indptr_buf = qo_indptr
    wrapper._paged_kv_indptr_buf = kv_indptr
    wrapper._paged_kv_indices_buf = kv_indices
    wrapper._paged_kv_last_page_len_buf = last_page_len
    k_scale, v_scale = scales or (None, None)
    result = wrapper.run(q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, out=output,
                         lse=lse, return_lse=True)  # fmt: skip
    if result[0] is not output:  # v_scale is applied out of place: an extra pass, then a copy
        output.copy_(result[0])


def run_paged_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                   sm_scale, output, lse):  # fmt: skip
    _run_paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
               output, lse)  # fmt: skip


_ones = {}


def run_paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse):
    """Page size 1 has no last-page lengths in its definition: every last page holds 1 token."""
    batch = qo_indptr.shape[0] - 1
    if (batch, q.device) not in _ones:
        _ones[batch, q.device] = torch.ones(batch, dtype=torch.int32, device=q.device)
    _run_paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, _ones[batch, q.device],
               sm_scale, output, lse)  # fmt: skip


def run_paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                         k_scale, v_scale, sm_scale, output, lse):  # fmt: skip
    """FP8 (e4m3) caches: FlashInfer folds k_scale into the softmax scale and multiplies the
    output by v_scale after its kernel."""
    _run_paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
               output, lse, (float(k_scale), float(v_scale)))  # fmt: skip
