"""The entries' C++ fast path (fast_entry.cc): built on the first call the Python entry plans
on a GPU, then tried first by every call. A cold call's Python costs 10-20 us of host time,
which flashinfer-bench counts; the fast path takes a call straight to the planned kernel's
tvm-ffi main (TUNING.md, "A cold call's host time").

PREFILL_BUNDLE_TILELANG_FAST=0 in the environment keeps every call on the Python entry. The
module needs a host C++ compiler (tvm_ffi.cpp.load_inline, cached in ~/.cache/tvm-ffi); if it
does not build, a warning says why and every call takes the Python entry.
"""

import atexit
import hashlib
import os
import warnings
from pathlib import Path

# The plan kinds, as fast_entry.cc numbers them.
RAGGED, WINDOW, PAGED_64, PAGED_1, PAGED_FP8, PADDED = range(6)
# A stream's buffers, by use: split-KV's fp32 workspace, and page size 1's gathered K and V.
SPLIT_BUFFERS, GATHER_BUFFERS = range(2)
ENTRIES = ("ragged", "ragged_swa", "paged_ps64", "paged_ps1", "paged_ps64_fp8kv", "padded")
FUNCTIONS = ENTRIES + (
    "register_plan", "register_padded", "register_counters", "register_workspace", "clear",
    "plan_count",
)  # fmt: skip

_module = None
_tried = False


def enabled() -> bool:
    return os.environ.get("PREFILL_BUNDLE_TILELANG_FAST", "1") != "0"


def module():
    """The built module, or None (disabled, or it did not build); built once."""
    global _module, _tried
    if not _tried:
        _tried = True
        if enabled():
            _module = _build()
    return _module


def module_name() -> str:
    """The built library's name, one per solution package: its registry is the library's static
    state, and two packages of the same source (a solution and its earlier version or variant in
    one process, as scripts/compare_gpu.py --old runs them) loading one library would share it,
    so the second one's calls ran the first one's planned kernels (2026-12-01 (41))."""
    package = str(Path(__file__).resolve().parent)
    return f"gqa_prefill_tilelang_fast_entry_{hashlib.sha1(package.encode()).hexdigest()[:12]}"


def _build():
    try:
        import tvm_ffi.cpp

        source = (Path(__file__).parent / "fast_entry.cc").read_text()
        built = tvm_ffi.cpp.load_inline(
            module_name(), cpp_sources=source, functions=list(FUNCTIONS)
        )  # fmt: skip
    except Exception as error:  # no compiler, a tvm-ffi without load_inline
        warnings.warn(f"TileLang's C++ fast path did not build, calls take the Python entry: "
                      f"{error}", stacklevel=3)  # fmt: skip
        return None
    # Its registry holds tvm-ffi objects (the mains, torch's counters): dropped before the
    # interpreter's own objects go.
    atexit.register(built.clear)
    return built


def register_plan(kind: int, main, tensors, merge=None, shares: int = 1, gather=None) -> None:
    """After a call the Python entry launched as the fast path would: calls with these
    tensors' layouts go to main from now on (paged split-KV and decode programs: main into the
    stream's workspace of shares x total_q rows, then merge; page size 1 gathered first: gather
    into the stream's K and V buffers, then main over them)."""
    built = module()
    if built is not None:
        built.register_plan(kind, main, list(tensors), merge, shares, gather)


def register_workspace(use: int, device: int, stream: int, rows: int, first, second) -> None:
    """A stream's buffer views for `rows` rows (the Python entry's _stream_buffers): split-KV's
    output and LSE (use SPLIT_BUFFERS), or the gathered K and V (GATHER_BUFFERS)."""
    built = _module
    if built is not None:
        built.register_workspace(use, device, stream, rows, first, second)


def register_padded(main, tensors, causal: bool, plan_tensors, view_strides) -> None:
    """register_plan for the padded entry: q, k, v and out (tensors) with the causal flag,
    the plan's qo_indptr, kv_indptr and scratch lse (plan_tensors) and the strides of the 3-d
    views of q, k, v and out it passes main (view_strides: 3 each)."""
    built = module()
    if built is not None:
        built.register_padded(main, *tensors, causal, *plan_tensors, list(view_strides))


def register_counters(device: int, stream: int, counters) -> None:
    """A stream's work counters (the Python entry's _scheduler), for the fast calls on it: the
    entry registers them with each plan it registers (a new stream's first call takes it)."""
    built = _module
    if built is not None:
        built.register_counters(device, stream, counters)
