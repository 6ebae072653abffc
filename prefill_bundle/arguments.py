"""The argument contract of both definitions, written once.

packing.py embeds this file into every Python-language solution of the bundle (as
`arguments.py` beside its entry file), so each solution stays self-contained; the CUDA entry
(solutions/gqa_ragged/cuda/prefill_entry.cu) implements the same rules with the same messages,
and tests/test_arguments.py runs one error table against every backend. It imports nothing from
the rest of the bundle.

Every error is a ValueError "<argument>: expected <what>, got <what it was>", raised before
anything is launched. The rules:
- q, k, v: float16 or bfloat16, all of q's dtype; [batch, seq, heads, 128] (padded) or
  [tokens, heads, 128] (ragged), 32 query and 8 key/value heads. Layout: the last dim
  contiguous, heads dense (stride 128), any token stride that is a multiple of 8 elements (16
  bytes), a 16-byte aligned data pointer: what slicing q, k, v out of one fused QKV projection
  gives. A padded tensor's batch stride must be seq * its token stride (tokens evenly spaced).
- out / output: q's dtype and shape, contiguous; lse float32 [total_q, 32], contiguous.
- qo_indptr, kv_indptr: int32 [batch + 1], contiguous, batch >= 1 when there are rows.
  Their values are not read on the default path (that would need a host sync): kernels stay
  inside their tensors whatever they hold, and rows they cannot get right come back NaN. With
  PREFILL_BUNDLE_VALIDATE=1 they are copied to the host and checked on every call.
- causal: a Python bool or a 0-d bool tensor, checked on every call. sm_scale: a finite real
  number (Python float or int, not bool), checked on every call.
- window_left (gqa_ragged_prefill_causal_swa_h32_kv8_d128): a Python int (or a 0-d integer
  tensor) in [-1, 2**31 - 1], checked on every call; -1 means no window.
- All tensors on one CUDA device (a CPU one only where a backend runs interpreted).
- Paged (gqa_paged_prefill_causal_h32_kv8_d128_ps1 / _ps64): k_cache and v_cache of q's dtype,
  [num_pages, page_size, 8, 128], dense within a page (strides [page_stride, 1024, 128, 1]) with
  any page stride that is a multiple of 8 elements and at least a page (a K or V half of
  FlashInfer's [num_pages, 2, page_size, 8, 128] cache); kv_indices (page ids) int32
  [num_kv_indices], kv_indptr offsets into it; kv_last_page_len int32 [batch] (page size 64
  only: the ps1 definition has no such input). Page ids and last-page lengths, like indptr, are
  read only by the kernels: an id outside [0, num_pages) is never dereferenced and the rows
  that would see it come back NaN.
- FP8 paged (gqa_paged_prefill_causal_fp8kv_h32_kv8_d128_ps64): as page size 64, but k_cache and
  v_cache float8_e4m3fn (a page stride a multiple of 16 elements: 16 bytes), and k_scale,
  v_scale finite real numbers checked on every call like sm_scale. The real K is
  k_cache * k_scale: the kernels fold k_scale into the softmax scale and multiply the output by
  v_scale (fold_kv_scales).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn  # the FP8 cache's element type
ALIGN_BYTES = 16  # the kernels' vector and TMA loads
ALIGN_ELEMENTS = 8  # 16 bytes of a 16-bit dtype
# Debugging mode: check indptr values on the host before every launch (one device-to-host copy
# and a stream sync per call).
VALIDATE = os.environ.get("PREFILL_BUNDLE_VALIDATE", "0") == "1"

PADDED_INPUTS = ("q", "k", "v")
PAGED_CACHES = ("k_cache", "v_cache")
RAGGED_NAMES = ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse")
PADDED_NAMES = ("q", "k", "v", "out")
PAGED_PS64_NAMES = ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices",
                    "kv_last_page_len", "output", "lse")  # fmt: skip
PAGED_PS1_NAMES = tuple(name for name in PAGED_PS64_NAMES if name != "kv_last_page_len")


def describe(x) -> str:
    """'bfloat16 [2, 5, 32, 128]', 'a 0-d float32 tensor' or 'list [[0.0]]'."""
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"a 0-d {dtype} tensor" if x.dim() == 0 else f"{dtype} {list(x.shape)}"
    return f"{type(x).__name__} {x!r:.60}"


def fail(name: str, expected: str, got: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def expect(ok: bool, name: str, expected: str, x) -> None:
    if not ok:
        fail(name, expected, describe(x))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expect_tensor(x, name: str, dtype: torch.dtype, shape: tuple, what: str) -> None:
    """shape: extents, None for any."""
    ok = (
        isinstance(x, torch.Tensor)
        and x.dtype == dtype
        and x.dim() == len(shape)
        and all(want is None or got == want for got, want in zip(x.shape, shape))
    )
    expect(ok, name, f"{_dtype_name(dtype)} {what}", x)


def _expect_indptr(qo_indptr, kv_indptr) -> int:
    """Both indptr arrays int32 [batch + 1], batch >= 0; returns batch + 1."""
    _expect_tensor(qo_indptr, "qo_indptr", torch.int32, (None,), "[batch + 1]")
    expect(qo_indptr.shape[0] >= 1, "qo_indptr", "int32 [batch + 1]", qo_indptr)
    size = qo_indptr.shape[0]
    _expect_tensor(kv_indptr, "kv_indptr", torch.int32, (size,), f"[{size}] (qo_indptr's shape)")
    return size


def _expect_outputs(q, output, lse) -> None:
    """output of q's dtype and shape; lse float32 [total_q, 32]."""
    what = f"{list(q.shape)} (q's dtype and shape)"
    _expect_tensor(output, "output", q.dtype, tuple(q.shape), what)
    total_q = q.shape[0]
    _expect_tensor(lse, "lse", torch.float32, (total_q, NUM_HEADS), f"[{total_q}, {NUM_HEADS}]")


def check_padded_shapes(q, k, v, out) -> tuple:
    """Shapes and dtypes of the padded definition (once per shape): (batch, seq_q, seq_kv)."""
    expect(
        isinstance(q, torch.Tensor) and q.dtype in HALF_DTYPES and q.dim() == 4
        and tuple(q.shape[2:]) == (NUM_HEADS, HEAD_DIM),
        "q", f"float16 or bfloat16 [batch, seq_q, {NUM_HEADS}, {HEAD_DIM}]", q,
    )  # fmt: skip
    batch, seq_q = q.shape[0], q.shape[1]
    kv = (batch, None, NUM_KV_HEADS, HEAD_DIM)
    what = f"[{batch}, seq_kv, {NUM_KV_HEADS}, {HEAD_DIM}] (q's dtype and batch)"
    _expect_tensor(k, "k", q.dtype, kv, what)
    _expect_tensor(v, "v", q.dtype, kv, what)
    expect(v.shape == k.shape, "v", f"k's shape {list(k.shape)}", v)
    _expect_tensor(out, "out", q.dtype, tuple(q.shape), f"{list(q.shape)} (q's dtype and shape)")
    return batch, seq_q, k.shape[1]


def check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse) -> tuple:
    """Shapes and dtypes of the ragged definition (once per shape): (batch, total_q, total_kv)."""
    expect(
        isinstance(q, torch.Tensor) and q.dtype in HALF_DTYPES and q.dim() == 3
        and tuple(q.shape[1:]) == (NUM_HEADS, HEAD_DIM),
        "q", f"bfloat16 or float16 [total_q, {NUM_HEADS}, {HEAD_DIM}]", q,
    )  # fmt: skip
    total_q = q.shape[0]
    kv = (None, NUM_KV_HEADS, HEAD_DIM)
    _expect_tensor(k, "k", q.dtype, kv, f"[total_kv, {NUM_KV_HEADS}, {HEAD_DIM}] (q's dtype)")
    _expect_tensor(v, "v", q.dtype, kv, f"[total_kv, {NUM_KV_HEADS}, {HEAD_DIM}] (q's dtype)")
    expect(v.shape == k.shape, "v", f"k's shape {list(k.shape)}", v)
    total_kv = k.shape[0]
    size = _expect_indptr(qo_indptr, kv_indptr)
    batch = size - 1
    if batch == 0 and (total_q > 0 or total_kv > 0):
        fail(
            "qo_indptr",
            f"at least one sequence for {total_q} query and {total_kv} key rows",
            describe(qo_indptr),
        )
    _expect_outputs(q, output, lse)
    return batch, total_q, total_kv


def check_paged_shapes(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    output,
    lse,
    page_size,
    cache_dtype=None,
) -> tuple:
    """Shapes and dtypes of a paged definition (once per shape): (batch, total_q, num_pages,
    num_kv_indices). kv_last_page_len is None for page size 1 (the ps1 definition has none).
    cache_dtype: the caches' dtype where it is not q's (FP8_DTYPE for the FP8 definition)."""
    expect(
        isinstance(q, torch.Tensor) and q.dtype in HALF_DTYPES and q.dim() == 3
        and tuple(q.shape[1:]) == (NUM_HEADS, HEAD_DIM),
        "q", f"bfloat16 or float16 [total_q, {NUM_HEADS}, {HEAD_DIM}]", q,
    )  # fmt: skip
    total_q = q.shape[0]
    cache = (None, page_size, NUM_KV_HEADS, HEAD_DIM)
    what = f"[num_pages, {page_size}, {NUM_KV_HEADS}, {HEAD_DIM}]"
    what += " (q's dtype)" if cache_dtype is None else ""
    cache_dtype = q.dtype if cache_dtype is None else cache_dtype
    _expect_tensor(k_cache, "k_cache", cache_dtype, cache, what)
    _expect_tensor(v_cache, "v_cache", cache_dtype, cache, what)
    expect(v_cache.shape == k_cache.shape, "v_cache", f"k_cache's shape {list(k_cache.shape)}",
           v_cache)  # fmt: skip
    num_pages = k_cache.shape[0]
    size = _expect_indptr(qo_indptr, kv_indptr)
    _expect_tensor(kv_indices, "kv_indices", torch.int32, (None,), "[num_kv_indices]")
    num_kv_indices = kv_indices.shape[0]
    batch = size - 1
    if page_size > 1 or kv_last_page_len is not None:  # page size 1's definition has none
        _expect_tensor(kv_last_page_len, "kv_last_page_len", torch.int32, (batch,), f"[{batch}]")
    if batch == 0 and (total_q > 0 or num_kv_indices > 0):
        fail(
            "qo_indptr",
            f"at least one sequence for {total_q} query rows and {num_kv_indices} pages",
            describe(qo_indptr),
        )
    _expect_outputs(q, output, lse)
    return batch, total_q, num_pages, num_kv_indices


def check_causal(causal) -> bool:
    """Every call: a Python bool, or a 0-d bool tensor (read on the host: a sync if on a GPU)."""
    if type(causal) is bool:
        return causal
    if isinstance(causal, torch.Tensor) and causal.dim() == 0 and causal.dtype == torch.bool:
        return bool(causal)
    fail("causal", "a Python bool or a 0-d bool tensor", describe(causal))


def check_sm_scale(sm_scale, name: str = "sm_scale") -> float:
    """Every call: any finite real number (zero and negative scales are valid softmax scales)."""
    if type(sm_scale) is float and -math.inf < sm_scale < math.inf:
        return sm_scale  # the common case, in one comparison
    ok = isinstance(sm_scale, (float, int)) and not isinstance(sm_scale, bool)
    expect(ok and math.isfinite(sm_scale), name, "a finite float", sm_scale)
    return float(sm_scale)


def fold_kv_scales(sm_scale, k_scale, v_scale) -> tuple:
    """Every call (FP8 caches): each scale a finite real number. Returns (sm_scale * k_scale,
    v_scale): q.(k_cache * k_scale) = k_scale (q.k_cache), so k_scale joins the softmax scale,
    and P (v_cache * v_scale) = v_scale (P v_cache), so v_scale multiplies the output."""
    sm_scale = check_sm_scale(sm_scale)
    k_scale = check_sm_scale(k_scale, "k_scale")
    v_scale = check_sm_scale(v_scale, "v_scale")
    scale = sm_scale * k_scale
    expect(math.isfinite(scale), "k_scale", "a finite float whose product with sm_scale is finite",
           k_scale)  # fmt: skip
    return scale, v_scale


INT32_MAX = 2**31 - 1


def check_window_left(window_left) -> int:
    """Every call: a Python int (or a 0-d integer tensor, read on the host: a sync if on a GPU)
    in [-1, 2**31 - 1]; -1 means no window. A window at least as long as the keys is no window."""
    if type(window_left) is int and -1 <= window_left <= INT32_MAX:
        return window_left  # the common case
    if isinstance(window_left, torch.Tensor) and window_left.dim() == 0:
        if not window_left.dtype.is_floating_point and window_left.dtype != torch.bool:
            window_left = int(window_left)
    ok = isinstance(window_left, int) and not isinstance(window_left, bool)
    expect(ok and -1 <= window_left <= INT32_MAX, "window_left",
           "an int in [-1, 2**31 - 1] (-1: no window)", window_left)  # fmt: skip
    return window_left


def token_stride(x: torch.Tensor) -> int:
    """Elements between consecutive tokens of q, k or v (padded: batch and seq flattened)."""
    for dim in range(x.dim() - 3, -1, -1):  # the token dims, innermost first
        if x.shape[dim] > 1:
            return x.stride(dim)
    return x.shape[-2] * x.shape[-1]


def strides_ok(x: torch.Tensor) -> bool:
    """The layout the kernels address: last dim contiguous, heads dense, a 16-byte aligned token
    stride; a padded tensor's batch stride seq times its token stride (tokens evenly spaced)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1 or x.stride(-2) != x.shape[-1] and x.shape[-2] > 1:
        return False
    step = token_stride(x)
    if step % ALIGN_ELEMENTS or step < x.shape[-2] * x.shape[-1]:
        return False
    return x.dim() == 3 or x.shape[0] <= 1 or x.shape[1] <= 1 or x.stride(0) == x.shape[1] * step


def cache_strides_ok(x: torch.Tensor) -> bool:
    """A paged cache's layout: dense within a page, a page stride that is a multiple of 16 bytes
    (8 elements of a 16-bit dtype, 16 of FP8) and at least one page (pages never overlap)."""
    page = x.shape[1] * x.shape[2] * x.shape[3]
    dense = x[0:1].is_contiguous() if x.shape[0] else True
    aligned = x.stride(0) * x.element_size() % ALIGN_BYTES == 0
    return dense and (x.shape[0] <= 1 or aligned and x.stride(0) >= page)


def check_layout(names: tuple, tensors: tuple, interpreted: bool = False) -> None:
    """The strides q, k, v (or the caches) must have (part of a launch plan's key: checked once
    per key), then check_placement."""
    for name, x in zip(names, tensors):
        if name in PADDED_INPUTS and not strides_ok(x):
            fail(
                name,
                "the last dim contiguous, heads dense and a token stride that is a multiple "
                f"of {ALIGN_ELEMENTS} elements",
                f"{describe(x)} with strides {list(x.stride())}",
            )
        if name in PAGED_CACHES and not cache_strides_ok(x):
            fail(
                name,
                "pages dense inside and a page stride that is a multiple of "
                f"{ALIGN_BYTES // x.element_size()} elements and at least one page",
                f"{describe(x)} with strides {list(x.stride())}",
            )
    check_placement(names, tensors, interpreted)


_STRIDED = frozenset(PADDED_INPUTS + PAGED_CACHES)  # checked by check_layout's stride rules


def misaligned(*tensors) -> bool:
    """Whether a data pointer is off ALIGN_BYTES: check_placement's alignment rule alone, for
    entries whose kernels check the rest themselves (TileLang's tvm-ffi mains)."""
    bits = 0
    for x in tensors:
        bits |= x.data_ptr()
    return bits % ALIGN_BYTES != 0


def check_placement(names: tuple, tensors: tuple, interpreted: bool = False) -> None:
    """Every call: the other tensors contiguous, 16-byte aligned data pointers, one device (a
    GPU unless interpreted). One pass of cheap reads when all is well (this runs on every
    call, on the host's clock); the first failed rule then names its argument."""
    index = tensors[0].get_device()  # -1 off the GPU; much cheaper to read than .device.type
    if index >= 0:
        for name, x in zip(names, tensors):
            if (
                x.data_ptr() % ALIGN_BYTES or x.get_device() != index
                or (name not in _STRIDED and not x.is_contiguous())
            ):  # fmt: skip
                break
        else:
            return
    _name_misplaced(names, tensors, interpreted)


def _name_misplaced(names: tuple, tensors: tuple, interpreted: bool) -> None:
    """check_placement's rules one by one, failing on the first broken one."""
    for name, x in zip(names, tensors):
        if name not in _STRIDED and not x.is_contiguous():
            fail(name, "a contiguous tensor", f"{describe(x)} with strides {list(x.stride())}")
        if x.data_ptr() % ALIGN_BYTES:
            fail(name, "a 16-byte aligned data pointer", hex(x.data_ptr()))
    first = tensors[0]
    index = first.get_device()
    if index < 0 and not interpreted:
        fail(names[0], "a CUDA tensor", f"one on {first.device}")
    for name, x in zip(names[1:], tensors[1:]):
        if x.get_device() != index or (index < 0 and x.device != first.device):
            fail(name, f"a tensor on {first.device} ({names[0]}'s device)", f"one on {x.device}")


def check_indptr_values(
    qo_indptr, kv_indptr, total_q: int, total_kv: int, kv_rows: str = "total_kv"
) -> None:
    """PREFILL_BUNDLE_VALIDATE=1: both indptr arrays are partitions, 0 = p0 <= ... <= pn = total.
    Names the array and its first bad position. Costs a device-to-host copy (a sync)."""
    for name, indptr, total, rows in (
        ("qo_indptr", qo_indptr, total_q, "total_q"),
        ("kv_indptr", kv_indptr, total_kv, kv_rows),
    ):
        values = indptr.tolist()
        expected = f"non-decreasing values from 0 to {rows} = {total}"
        if values[0] != 0:
            fail(name, expected, f"{name}[0] = {values[0]}")
        for i in range(1, len(values)):
            if values[i] < values[i - 1]:
                got = f"{name}[{i}] = {values[i]} < {name}[{i - 1}] = {values[i - 1]}"
                fail(name, expected, got)
        if values[-1] != total:
            fail(name, expected, f"{name}[{len(values) - 1}] = {values[-1]}")


def check_paged_values(
    qo_indptr, kv_indptr, kv_indices, kv_last_page_len, total_q: int, num_pages: int, page_size: int
) -> None:
    """PREFILL_BUNDLE_VALIDATE=1: both indptr arrays partitions (kv_indptr of kv_indices), every
    page id in [0, num_pages), every sequence with pages a last-page length in [1, page_size].
    Names the array and its first bad position. Costs device-to-host copies (a sync)."""
    check_indptr_values(qo_indptr, kv_indptr, total_q, kv_indices.shape[0], "num_kv_indices")
    ids = kv_indices.tolist()
    for i, page in enumerate(ids):
        if not 0 <= page < num_pages:
            fail("kv_indices", f"page ids in [0, {num_pages})", f"kv_indices[{i}] = {page}")
    if kv_last_page_len is None:
        return
    bounds, lengths = kv_indptr.tolist(), kv_last_page_len.tolist()
    for s, length in enumerate(lengths):
        if bounds[s + 1] > bounds[s] and not 1 <= length <= page_size:
            fail(
                "kv_last_page_len",
                f"values in [1, {page_size}] for sequences with pages",
                f"kv_last_page_len[{s}] = {length}",
            )


# Page size 1, prefill-like batches: the kernels gather the table's pages into contiguous K/V
# (one copy kernel, then the ragged kernel) instead of gathering rows inside the attention
# loop. The copy reads and writes each key once (H200: ~3 ns a key); the ragged kernel then
# runs 10-20% faster than the in-loop gather. Worth it when each sequence has enough query rows
# to amortize its keys' copy; and only while the two temporary buffers stay small.
PAGE_GATHER_MIN_QUERIES = 384  # average query rows a sequence (total_q / batch)
PAGE_GATHER_MAX_BYTES = 256 << 20  # K and V buffers together (64K keys of a 16-bit dtype)


def gathers_pages(total_q: int, batch: int, num_kv_indices: int, element_size: int) -> bool:
    """Whether a page-size-1 call gathers its pages first: sizes only, no device value read.
    PREFILL_BUNDLE_PAGE_GATHER=0 never does (no temporary buffers), =1 whenever there are pages
    (tests); read when a shape is planned (the Python entries cache the verdict in its plan)."""
    mode = os.environ.get("PREFILL_BUNDLE_PAGE_GATHER", "auto")
    if num_kv_indices == 0 or mode == "0":
        return False
    scratch = 2 * num_kv_indices * NUM_KV_HEADS * HEAD_DIM * element_size
    return mode == "1" or (
        total_q >= PAGE_GATHER_MIN_QUERIES * max(batch, 1) and scratch <= PAGE_GATHER_MAX_BYTES
    )


class PlanCache(OrderedDict):
    """Launch plans by shape key, least recently used dropped past `capacity`: a long-running
    server sees unboundedly many shapes."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity

    def lookup(self, key):
        plan = self.get(key)
        if plan is not None:
            self.move_to_end(key)
        return plan

    def store(self, key, plan):
        self[key] = plan
        if len(self) > self.capacity:
            self.popitem(last=False)
        return plan


class StreamBuffers(dict):
    """Scratch buffers (split-KV's shares, gathered pages) kept per (device index, stream):
    views of one flat buffer each, grown on demand, with the last call's views, so that a call
    of the same shapes allocates nothing and builds no view (host time, which flashinfer-bench
    counts). Launches on one stream run in order, so a call's kernels are done with its buffer
    before the next call's write it; two streams get two buffers. A call on CPU tensors (device
    -1: interpreted, tests) and a call captured into a CUDA graph get buffers of their own (a
    graph's: a kept one could be freed by a later call that grows it, or be shared with eager
    calls on another stream, while the graph still writes it)."""

    def views(self, device: int, dtype: torch.dtype, shapes: tuple) -> tuple:
        """Views of these shapes, one after another in the buffer (each starts 16-byte aligned
        when the sizes before it are multiples of 16 bytes)."""
        kept = device >= 0 and not torch.cuda.is_current_stream_capturing()
        slot = (device, torch._C._cuda_getCurrentRawStream(device)) if kept else None
        entry = self.get(slot) if kept else None
        if entry is not None and entry[0] == (dtype, shapes):
            return entry[1]
        sizes = [math.prod(shape) for shape in shapes]
        buffer = None
        if entry is not None and entry[2].dtype == dtype and entry[2].numel() >= sum(sizes):
            buffer = entry[2]
        if buffer is None:
            where = f"cuda:{device}" if device >= 0 else "cpu"
            buffer = torch.empty(sum(sizes), dtype=dtype, device=where)
        views, start = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(buffer[start : start + size].view(shape))
            start += size
        views = tuple(views)
        if kept:
            self[slot] = ((dtype, shapes), views, buffer)
        return views
