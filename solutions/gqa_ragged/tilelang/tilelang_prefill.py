"""TileLang GQA prefill attention: the entry points flashinfer-bench calls.

run_padded(q, k, v, causal, out) and run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output,
lse) check their arguments, then launch one kernel from gqa_prefill_kernel.py. A variant (dtype,
causal) is compiled for sm_90a on its first use and cached; lengths are symbolic in it, so no new
shape ever recompiles. The padded batch is viewed as a ragged one; its indptr tensors (and a
scratch lse the padded definition does not return) are built once per shape. A call does no host
sync and, past the first call of a shape, no allocation: flashinfer-bench times the whole call.

The indptr values are trusted (reading them would need a host sync): non-decreasing, from 0 to
total_q / total_kv. Values out of range cannot make the kernel read or write outside the tensors
(TMA zero-fills, stores are bounds-checked), only give wrong rows.
"""

import math

import torch

from .gqa_prefill_kernel import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, compile_variant

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_kernels = {}  # (dtype, causal) -> compiled kernel
_padded_plans = {}  # (batch, seq_q, seq_kv, device index) -> (qo_indptr, kv_indptr, scratch lse)
_schedulers = {}  # (device index, stream) -> the persistent kernel's work counters, int32 [2]


def _scheduler(device: int):
    """The work counters of the stream the kernel launches on: zero before a launch, and the
    kernel's last block zeroes them again, so they are set once. Launches on one stream run one
    after another; two streams get two counters, so concurrent launches never share one."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    counters = _schedulers.get((device, stream))
    if counters is None:
        counters = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
        _schedulers[(device, stream)] = counters
    return counters


def _kernel(dtype: torch.dtype, causal: bool, device: torch.device):
    kernel = _kernels.get((dtype, causal))
    if kernel is None:
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            raise RuntimeError(
                f"the TileLang kernels are built for sm_90a (H100/H200); {device} is "
                f"sm_{capability[0]}{capability[1]}"
            )
        kernel = _kernels[(dtype, causal)] = compile_variant(_DTYPES[dtype], causal)
    return kernel


# Argument checks: shapes, dtypes and layout first, devices last, so that every check but the
# device one can be exercised on a machine without a GPU.


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "" if t.is_contiguous() else " non-contiguous"
    return f"{str(t.dtype)[6:]} {list(t.shape)}{layout} tensor on {t.device}"


def _check_query(q, name: str, rank: int, what: str) -> None:
    """The query fixes the dtype (float16 or bfloat16) of the other tensors."""
    if not (
        isinstance(q, torch.Tensor)
        and q.dtype in _DTYPES
        and q.dim() == rank
        and q.shape[-2:] == (NUM_HEADS, HEAD_DIM)
        and q.is_contiguous()
    ):
        _fail(name, f"contiguous float16 or bfloat16 tensor {what}", _describe(q))


def _check_tensor(t, name: str, shape: tuple, dtype: torch.dtype, what: str) -> None:
    """shape holds -1 where the tensor's rank was already wrong."""
    if not (
        isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype and t.is_contiguous()
    ):
        known = f" = {list(shape)}" if min(shape, default=0) >= 0 else ""
        _fail(name, f"contiguous {str(dtype)[6:]} tensor {what}{known}", _describe(t))


def _check_devices(names: tuple, tensors: tuple) -> None:
    device = tensors[0].get_device()  # -1 on the CPU
    if device < 0:
        _fail(names[0], "a tensor on a CUDA device", _describe(tensors[0]))
    for name, t in zip(names[1:], tensors[1:]):
        if t.get_device() != device:
            _fail(name, f"a tensor on cuda:{device} (the device of {names[0]})", _describe(t))


_PADDED_NAMES = ("q", "k", "v", "out")
_RAGGED_NAMES = ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse")


def run_padded(q, k, v, causal, out):
    """q [batch, seq_q, 32, 128], k/v [batch, seq_kv, 8, 128] (float16 or bfloat16), causal
    (bottom-right aligned) -> out [batch, seq_q, 32, 128], written in place."""
    _check_query(q, "q", 4, "[batch, seq_q, 32, 128]")
    batch, seq_q = q.shape[0], q.shape[1]
    seq_kv = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
    kv_shape = (batch, seq_kv, NUM_KV_HEADS, HEAD_DIM)
    _check_tensor(k, "k", kv_shape, q.dtype, "[batch (of q), seq_kv, 8, 128]")
    _check_tensor(v, "v", kv_shape, q.dtype, "[batch, seq_kv, 8, 128] (of k)")
    if not isinstance(causal, (bool, int)):
        _fail("causal", "a Python bool", type(causal).__name__)
    _check_tensor(out, "out", q.shape, q.dtype, "[batch, seq_q, 32, 128] (of q)")
    _check_devices(_PADDED_NAMES, (q, k, v, out))

    if batch == 0 or seq_q == 0:
        return
    if seq_kv == 0:  # no query sees a key; a TMA descriptor needs at least one row
        out.zero_()
        return
    device = q.get_device()
    plan = _padded_plans.get((batch, seq_q, seq_kv, device))
    if plan is None:
        seqs = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        lse = torch.empty(batch * seq_q, NUM_HEADS, dtype=torch.float32, device=q.device)
        plan = _padded_plans[(batch, seq_q, seq_kv, device)] = (seqs * seq_q, seqs * seq_kv, lse)
    qo_indptr, kv_indptr, lse = plan
    _kernel(q.dtype, bool(causal), q.device)(
        q.view(batch * seq_q, NUM_HEADS, HEAD_DIM),
        k.view(batch * seq_kv, NUM_KV_HEADS, HEAD_DIM),
        v.view(batch * seq_kv, NUM_KV_HEADS, HEAD_DIM),
        qo_indptr,
        kv_indptr,
        HEAD_DIM**-0.5,
        out.view(batch * seq_q, NUM_HEADS, HEAD_DIM),
        lse,
        _scheduler(device),
    )


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    """q [total_q, 32, 128], k/v [total_kv, 8, 128] (bfloat16 or float16), qo_indptr/kv_indptr
    int32 [batch + 1], sm_scale (finite) -> output [total_q, 32, 128] and lse [total_q, 32] float32
    (base 2), written in place. Causal, bottom-right aligned per sequence."""
    _check_query(q, "q", 3, "[total_q, 32, 128]")
    total_q = q.shape[0]
    total_kv = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else -1
    kv_shape = (total_kv, NUM_KV_HEADS, HEAD_DIM)
    _check_tensor(k, "k", kv_shape, q.dtype, "[total_kv, 8, 128]")
    _check_tensor(v, "v", kv_shape, q.dtype, "[total_kv, 8, 128] (of k)")
    if not (
        isinstance(qo_indptr, torch.Tensor)
        and qo_indptr.dim() == 1
        and (qo_indptr.shape[0] >= 2 or total_q == 0)  # query rows need a sequence
    ):
        _fail("qo_indptr", "int32 tensor [batch + 1] with batch >= 1", _describe(qo_indptr))
    indptr_shape = qo_indptr.shape
    _check_tensor(qo_indptr, "qo_indptr", indptr_shape, torch.int32, "[batch + 1]")
    _check_tensor(kv_indptr, "kv_indptr", indptr_shape, torch.int32, "[batch + 1] (of qo_indptr)")
    if not (
        isinstance(sm_scale, (float, int))
        and not isinstance(sm_scale, bool)
        and math.isfinite(sm_scale)
    ):
        _fail("sm_scale", "a finite float", repr(sm_scale))
    _check_tensor(output, "output", q.shape, q.dtype, "[total_q, 32, 128] (of q)")
    _check_tensor(lse, "lse", (total_q, NUM_HEADS), torch.float32, "[total_q, 32]")
    _check_devices(_RAGGED_NAMES, (q, k, v, qo_indptr, kv_indptr, output, lse))

    if total_q == 0:
        return
    if total_kv == 0:  # no query sees a key; a TMA descriptor needs at least one row
        output.zero_()
        lse.fill_(-math.inf)
        return
    if sm_scale <= 0:
        # The kernel folds the scale into exp2 after masking, which needs it positive:
        # softmax(s q.k) = softmax(|s| (-q).k), and s = 0 gives softmax(1 * 0.k); both exact.
        q, sm_scale = (-q, -sm_scale) if sm_scale < 0 else (torch.zeros_like(q), 1.0)
    _kernel(q.dtype, True, q.device)(
        q, k, v, qo_indptr, kv_indptr, float(sm_scale), output, lse, _scheduler(q.get_device())
    )
