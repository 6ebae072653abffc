"""TileLang GQA prefill attention: the entry points flashinfer-bench calls.

run_padded(q, k, v, causal, out), run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output,
lse), run_ragged_swa (the same with window_left before sm_scale), run_paged_ps64(q, k_cache,
v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse) and
run_paged_ps1 (the same without kv_last_page_len) and run_paged_ps64_fp8kv (page size 64 over
float8_e4m3fn caches, k_scale and v_scale before sm_scale) check their
arguments against the bundle's shared contract (arguments.py: rules and messages), then launch
one kernel from gqa_prefill_kernel.py. A variant (dtype, causal, page size, window, FP8 caches) is
compiled for sm_90a on its first use and cached; lengths and token strides are symbolic in it, so
no new shape or layout ever recompiles. q, k and v may be token-strided (slices of a fused QKV
projection): the kernel reads them in place. The padded batch is viewed as a ragged one; its
indptr tensors (and a scratch lse the padded definition does not return) are built once per
shape. A call does no host sync and, past the first call of a shape, no allocation:
flashinfer-bench times the whole call. Past that first call, a call with the same layouts goes
through a C++ fast path (fast_entry.cc) straight to the planned kernel, without the Python below.

The indptr values (and page ids, last-page lengths) are not read on the host (that would need a
sync; PREFILL_BUNDLE_VALIDATE=1 does, to raise on bad ones): the kernel itself computes the
sequences of a malformed batch that it can and writes NaN into every other row, never reading or
writing outside the tensors.

Decode-like paged batches (a few query tokens a sequence) split the keys (gqa_prefill_split):
the plan picks the share count from shapes, a split kernel writes each share's output and LSE
into a per-stream fp32 workspace, and a merge kernel writes output and lse. They also pack the
4 query heads of a KV head into one tile (items (token block, KV head): a quarter of the items
and key tiles).

Decode-like batches over FP8 caches (run_paged_ps64_fp8kv) run the lean decode program instead
(gqa_prefill_decode: one warp a (key share, KV head, sequence), 32-key tiles, mma.sync on K and V
converted to float16), its shares from decode_shares, then its merge (merge_decode).
PREFILL_BUNDLE_TILELANG_DECODE=0 in the environment when a shape is first planned keeps the
packed split program for it (A/B timing); the plan is cached per shape, so set it before the
first call.
"""

import os

import torch

from . import fast_entry
from .arguments import (
    FP8_DTYPE,
    PADDED_NAMES,
    PAGED_PS1_NAMES,
    PAGED_PS64_NAMES,
    RAGGED_NAMES,
    VALIDATE,
    PlanCache,
    StreamBuffers,
    check_causal,
    check_indptr_values,
    check_layout,
    check_padded_shapes,
    check_paged_shapes,
    check_paged_values,
    check_placement,
    check_ragged_shapes,
    check_sm_scale,
    check_window_left,
    fold_kv_scales,
    gathers_pages,
    misaligned,
    token_stride,
)
from .gqa_prefill_decode import (
    DECODE_MAX_BATCH,
    compile_decode,
    compile_merge_decode,
    decode_shares,
)
from .gqa_prefill_kernel import (
    FP8_E4M3,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    PACK_BLOCK_M,
    PACK_PAGE_SIZES,
    PACK_SPLIT_VARIANTS,
    PAGE_SIZES,
    compile_gather,
    compile_merge,
    compile_variant,
    decode_like,
    kv_shares,
)

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# (dtype, causal, SM count, page size or None, window, fp8, split, pack, long_keys) -> compiled
# kernel
_kernels = {}
_merge_kernels = {}  # dtype -> split-KV's compiled merge
_gather_kernels = {}  # dtype -> page size 1's compiled page gather
_decode_kernels = {}  # dtype -> the FP8 decode program (gqa_prefill_decode.decode_fp8)
_merge_decode_kernels = {}  # dtype -> its merge (gqa_prefill_decode.merge_decode)
# A plan holds what the launch needs beyond the arguments: padded (kernels by causal flag,
# qo_indptr, kv_indptr, scratch lse, token strides, long_keys), ragged (kernel, K/V stand-in for
# a batch without keys, or None). The padded plans are keyed by every tensor's shape and strides
# (the plan's strides view them), q's dtype and device. The ragged and paged ones are keyed by
# what the plan depends on and what a call may restride or replace by a stand-in (q, K, V and
# kv_indices: shapes, strides, dtypes) and the device. The kernels' tvm-ffi mains check every
# argument they get (dtype, rank, shape against the others, strides, device: TVM's generated
# checks, before any launch) on every call, and a call checks only the data pointers' alignment
# in Python (~2.4 us of host time a call less than keying and placing every tensor, measured on
# the CPU). A main that refuses an argument has the contract's checks run to name it
# (_named_refusal).
_padded_plans = PlanCache()
_ragged_plans = PlanCache()
_swa_plans = PlanCache()  # as ragged, for the sliding-window kernel
# Per page size, keyed as ragged: (kernel, caches' stand-in, kv_indices' stand-in, num_pages,
# key shares, merge kernel or None).
_paged_plans = {page_size: PlanCache() for page_size in PAGE_SIZES}
_fp8_plans = PlanCache()  # as _paged_plans[64], for FP8 caches
_schedulers = {}  # (device index, stream) -> the persistent kernel's work counters, int32 [2]
_split_buffers = StreamBuffers()  # split-KV's fp32 workspace
_gathered = StreamBuffers()  # page size 1's gathered K and V


def _scheduler(device: int):
    """The work counters of the stream the kernel launches on: zero before a launch, and the
    kernel's last block zeroes them again, so they are set once. Launches on one stream run one
    after another; two streams get two counters, so concurrent launches never share one. A call
    captured into a CUDA graph gets counters of its own (the graph's, zeroed at each replay)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
    stream = torch._C._cuda_getCurrentRawStream(device)
    counters = _schedulers.get((device, stream))
    if counters is None:
        counters = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
        _schedulers[(device, stream)] = counters
    return counters


def _fast_registers(q) -> bool:
    """Whether a call the Python entry just launched as the fast path would registers its
    layouts there. Not with PREFILL_BUNDLE_VALIDATE (its checks run in Python on every call),
    nor off the GPU, nor in a capture, nor once the fast path is off or did not build."""
    if fast_entry._tried and fast_entry._module is None:
        return False
    return not VALIDATE and q.is_cuda and not torch.cuda.is_current_stream_capturing()


def _register_counters(device: int) -> None:
    """The current stream's work counters, for the fast path (they exist: the call used them)."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    fast_entry.register_counters(device, stream, _schedulers[(device, stream)])


def _register_fast(kind: int, main, tensors: tuple, merge=None, shares: int = 1,
                   gather=None) -> None:  # fmt: skip
    """After a call launched as the fast path would (main, and a split's merge, on the
    arguments as given; or page size 1's gather, then main over the gathered K and V; a
    positive scale, the stream's own counters and buffers): the fast path takes the calls with
    these layouts from now on (and is built by the first)."""
    q = tensors[0]
    if not _fast_registers(q):
        return
    fast_entry.register_plan(kind, main, tensors, merge, shares, gather)
    device = q.get_device()
    _register_counters(device)
    stream = torch._C._cuda_getCurrentRawStream(device)
    for use, buffers, used in ((fast_entry.SPLIT_BUFFERS, _split_buffers, merge),
                               (fast_entry.GATHER_BUFFERS, _gathered, gather)):  # fmt: skip
        if used is not None:  # the buffers this call used
            views = buffers[(device, stream)][1]
            fast_entry.register_workspace(use, device, stream, views[0].shape[0], *views)


def _workspace(device: int, rows: int) -> tuple:
    """Split-KV's fp32 workspaces for `rows` rows (shares x total_q): the shares' outputs
    [rows, 32, 128] and LSE [rows, 32], kept per stream (StreamBuffers)."""
    shapes = ((rows, NUM_HEADS, HEAD_DIM), (rows, NUM_HEADS))
    return _split_buffers.views(device, torch.float32, shapes)


def _gather_buffers(device: int, rows: int, dtype: torch.dtype) -> tuple:
    """Page size 1's gathered K and V, [rows, 8, 128] each in q's dtype, kept per stream."""
    shapes = ((rows, NUM_KV_HEADS, HEAD_DIM), (rows, NUM_KV_HEADS, HEAD_DIM))
    return _gathered.views(device, dtype, shapes)


def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _named_refusal(refusal: Exception, check) -> None:
    """A kernel's main refused a call (its argument checks) or failed: check() runs the
    contract's checks, which raise the ValueError naming a bad argument; if none is bad, the
    main's own error stands."""
    check()
    raise refusal


def _check_sm90a(device: int) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        raise RuntimeError(
            f"the TileLang kernels are built for sm_90a (H100/H200); cuda:{device} is "
            f"sm_{capability[0]}{capability[1]}"
        )


def _kernel(
    dtype: torch.dtype,
    causal: bool,
    device: int,
    page_size: int = None,
    window: bool = False,
    fp8: bool = False,
    split: bool = False,
    pack: bool = False,
    long_keys: bool = False,
    short_keys: bool = False,
):
    """fp8: the paged kernel (page size 64) over float8_e4m3fn caches; split: its split-KV
    kernel (the shares into fp32 workspaces); pack: GQA head packing (decode-like batches);
    long_keys: contiguous K/V whose launch averages LONG_KEYS_MIN keys a sequence or more
    (long_keys_launch): the program that draws items in L2 sections; short_keys: a padded
    non-causal launch of up to SHORT_KEYS_MAX keys a sequence (short_keys_launch)."""
    num_sms = _sm_count(device)
    key = (dtype, causal, num_sms, page_size, window, fp8, split, pack, long_keys, short_keys)
    kernel = _kernels.get(key)
    if kernel is None:
        _check_sm90a(device)
        # The persistent grid takes one block per SM of the device.
        kernel = entry_function(compile_variant(
            _DTYPES[dtype], causal, num_sms=num_sms, page_size=page_size, window=window,
            cache_dtype=FP8_E4M3 if fp8 else None, split=split, pack=pack, long_keys=long_keys,
            short_keys=short_keys,
        ))  # fmt: skip
        _kernels[key] = kernel
    return kernel


# Contiguous launches draw their items in L2 sections from this many keys a sequence on
# average: page size 64's rule counts whole pages (a chunk over 8131 keys is 128 pages: 8192
# slots, sectioned, +4% on an H200), so the contiguous rule stops short of SECTION_MIN_KEYS.
LONG_KEYS_MIN = 6144


def long_keys_launch(total_kv: int, batch: int) -> bool:
    """Whether a launch over contiguous K/V runs the program that draws its items in L2
    sections: its keys average LONG_KEYS_MIN or more a sequence (+3-9% on the 8K-32K rows on an
    H200; sequences of 2-4.6K keys lost 3-10%: TUNING.md, "Items in L2 sections"). The paged
    programs decide this in the kernel (SECTION_MIN_KEYS)."""
    return total_kv >= LONG_KEYS_MIN * max(batch, 1)


# Padded non-causal launches of up to this many keys a sequence run the causal config's 128-key
# tiles (block_config's short_keys): on an H200, kernel time over FlashInfer's, 176 / 128 keys
# (TUNING.md, "Short non-causal sequences"): 4x512 0.77 / 0.98, 8x1024 0.89 / 1.03, 4x2048
# 0.89 / 0.95, 2x4096 0.92 / 0.95, 1x16384 0.97 / 0.95. CUDA's uses_short_key_tiles: the same.
SHORT_KEYS_MAX = 4096


def short_keys_launch(seq_kv: int, causal: bool) -> bool:
    """Whether a padded launch runs the non-causal program on 128-key tiles (short_keys)."""
    return not causal and seq_kv <= SHORT_KEYS_MAX


def _per_dtype(kernels: dict, compile_program, dtype: torch.dtype, device: int):
    """kernels[dtype], compiled by compile_program(dtype name) on first use."""
    kernel = kernels.get(dtype)
    if kernel is None:
        _check_sm90a(device)
        kernel = kernels[dtype] = entry_function(compile_program(_DTYPES[dtype]))
    return kernel


def _merge_kernel(dtype: torch.dtype, device: int):
    """Split-KV's merge for q's dtype (gqa_prefill_split.merge_shares)."""
    return _per_dtype(_merge_kernels, compile_merge, dtype, device)


def _decode_kernel(dtype: torch.dtype, device: int):
    """The FP8 decode program for q's dtype (gqa_prefill_decode.decode_fp8)."""
    return _per_dtype(_decode_kernels, compile_decode, dtype, device)


def _merge_decode_kernel(dtype: torch.dtype, device: int):
    """The decode program's merge for q's dtype (gqa_prefill_decode.merge_decode)."""
    return _per_dtype(_merge_decode_kernels, compile_merge_decode, dtype, device)


def decode_program_enabled() -> bool:
    """Whether decode-like FP8 batches run the decode program: unless
    PREFILL_BUNDLE_TILELANG_DECODE is "0" (read when a shape is first planned)."""
    return os.environ.get("PREFILL_BUNDLE_TILELANG_DECODE", "1") != "0"


def _gather_kernel(dtype: torch.dtype, device: int):
    """Page size 1's page gather for q's dtype (gqa_prefill_kv.gather_pages)."""
    return _per_dtype(_gather_kernels, compile_gather, dtype, device)


def entry_function(kernel):
    """A compiled kernel's tvm-ffi entry function (`main`), to be called with the kernel's
    arguments in order. The JIT kernel's own call does exactly that after its adapter's Python
    bookkeeping for outputs it would allocate (these kernels allocate none): ~5-7 us a call on
    the host, where the whole of CUDA's entry takes ~8 (TUNING.md)."""
    executable = kernel.adapter.get_exportable_executable()
    # Freshly compiled: a tvm.runtime.Executable (jit() gives the runnable module); loaded from
    # TileLang's disk cache: the module itself.
    module = executable.jit() if hasattr(executable, "jit") else executable
    return module.main


def _lone_token(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A one-token ragged q, k or v at the dense token stride, whatever stride torch gave its dim
    of 1: the TMA descriptor takes the stride, and wants a 16-byte multiple."""
    if x.stride(0) == heads * HEAD_DIM:
        return x
    return x.as_strided((1, heads, HEAD_DIM), (heads * HEAD_DIM, HEAD_DIM, 1))


def _plan_padded(q, k, v, out) -> tuple:
    """Check shapes, dtypes and layout (once per key) and build the launch's fixed tensors: the
    kernels by causal flag (compiled on first use), indptr tensors, a scratch lse, the token
    strides of q, k and v (the kernel sees [rows, heads, 128] at that stride) and whether the
    launch draws its items in L2 sections. None for a batch with nothing to launch (no row, or
    no key: its rows get 0), whose calls run these checks each time (no main checks them)."""
    batch, seq_q, seq_kv = check_padded_shapes(q, k, v, out)
    check_layout(PADDED_NAMES, (q, k, v, out))
    if batch == 0 or seq_q == 0 or seq_kv == 0:
        return None
    seqs = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    lse = torch.empty(batch * seq_q, NUM_HEADS, dtype=torch.float32, device=q.device)
    strides = tuple((token_stride(x), HEAD_DIM, 1) for x in (q, k, v))
    return {}, seqs * seq_q, seqs * seq_kv, lse, strides, long_keys_launch(seq_kv, 1)


def run_padded(q, k, v, causal, out):
    """q [batch, seq_q, 32, 128], k/v [batch, seq_kv, 8, 128] (float16 or bfloat16), causal
    (bottom-right aligned) -> out [batch, seq_q, 32, 128], written in place."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.padded(q, k, v, causal, out):
                return
        except Exception:  # as in run_ragged
            pass
    _run_padded(q, k, v, causal, out)


def _run_padded(q, k, v, causal, out):
    causal = check_causal(causal)
    tensors = (q, k, v, out)
    try:
        # The views below need every shape and stride; the other dtypes and devices are left
        # to the kernel's main, as in the ragged plans, and the alignment checked here.
        key = (q.shape, k.shape, v.shape, out.shape, q.stride(), k.stride(), v.stride(),
               out.stride(), q.dtype, q.get_device())  # fmt: skip
        plan = _padded_plans.lookup(key)
        if plan is not None and misaligned(*tensors):
            plan = None  # the plan's checks name it
    except (AttributeError, TypeError):  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_padded(*tensors)  # raises ValueError on a bad argument
        if plan is None:  # nothing to launch; checked on every call
            if q.shape[0] and q.shape[1]:
                out.zero_()  # no query sees a key (no indptr here: no row is malformed)
            return
        if key is not None:
            _padded_plans.store(key, plan)
    kernels, qo_indptr, kv_indptr, lse, (q_strides, k_strides, v_strides), long_keys = plan
    kernel = kernels.get(causal)
    if kernel is None:
        short_keys = short_keys_launch(k.shape[1], causal)
        kernel = kernels[causal] = _kernel(
            q.dtype, causal, q.get_device(), long_keys=long_keys, short_keys=short_keys
        )  # fmt: skip
    total_q, total_kv = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    out_rows = out.view(total_q, NUM_HEADS, HEAD_DIM)
    try:
        kernel(
            q.as_strided((total_q, NUM_HEADS, HEAD_DIM), q_strides),
            k.as_strided((total_kv, NUM_KV_HEADS, HEAD_DIM), k_strides),
            v.as_strided((total_kv, NUM_KV_HEADS, HEAD_DIM), v_strides),
            qo_indptr,
            kv_indptr,
            total_kv,
            HEAD_DIM**-0.5,
            out_rows,
            lse,
            _scheduler(q.get_device()),
        )
    except Exception as refusal:
        _named_refusal(refusal, lambda: _plan_padded(*tensors))
    if _fast_registers(q):
        # The fast path passes main the same views, built from these strides.
        view_strides = (*q_strides, *k_strides, *v_strides, *out_rows.stride())
        fast_entry.register_padded(kernel, tensors, causal, (qo_indptr, kv_indptr, lse),
                                   view_strides)  # fmt: skip
        _register_counters(q.get_device())


def _plan_ragged(window: bool, q, k, v, qo_indptr, kv_indptr, output, lse) -> tuple:
    """Check shapes, dtypes and layout (once per key). A batch without key rows still runs the
    kernel (its rows get 0 and -inf, or NaN where the indptr values are malformed), on a 1-row
    zero K/V: a TMA descriptor needs a row. window: the sliding-window kernel."""
    tensors = (q, k, v, qo_indptr, kv_indptr, output, lse)
    batch, _, total_kv = check_ragged_shapes(*tensors)
    check_layout(RAGGED_NAMES, tensors)
    keyless = None
    if total_kv == 0:
        keyless = torch.zeros(1, NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device=q.device)
    device = q.get_device()
    if window:
        return _kernel(q.dtype, True, device, window=True), keyless
    return _kernel(q.dtype, True, device, long_keys=long_keys_launch(total_kv, batch)), keyless


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    """q [total_q, 32, 128], k/v [total_kv, 8, 128] (bfloat16 or float16), qo_indptr/kv_indptr
    int32 [batch + 1], sm_scale (finite) -> output [total_q, 32, 128] and lse [total_q, 32] float32
    (base 2), written in place. Causal, bottom-right aligned per sequence."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
                return
        except Exception:  # the Python entry takes the call and names a bad argument
            pass
    _run_ragged(None, q, k, v, qo_indptr, kv_indptr, check_sm_scale(sm_scale), output, lse)


def run_ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse):
    """run_ragged with a sliding window: query i of a sequence (position p = i + seq_kv - seq_q)
    sees key j iff p - window_left <= j <= p; window_left -1 is no window. -1, and a window at
    least as long as all the keys (2**31 - 1 too), run the causal kernel: no key lies further
    left. Otherwise the window kernel visits only the key tiles of each query tile's band."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse):
                return
        except Exception:  # as in run_ragged
            pass
    window_left = check_window_left(window_left)
    sm_scale = check_sm_scale(sm_scale)
    keys = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else None  # else: raises
    no_window = window_left < 0 or (keys is not None and window_left >= keys)
    _run_ragged(None if no_window else window_left, q, k, v, qo_indptr, kv_indptr, sm_scale,
                output, lse)  # fmt: skip


def _run_ragged(window_left, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    """window_left: None (causal) or the window, in [0, total_kv)."""
    tensors = (q, k, v, qo_indptr, kv_indptr, output, lse)
    windowed = window_left is not None
    plans = _swa_plans if windowed else _ragged_plans
    try:
        key = (q.shape, k.shape, v.shape, qo_indptr.shape, q.stride(), k.stride(), v.stride(),
               q.dtype, k.dtype, v.dtype, q.get_device())  # fmt: skip
        plan = plans.lookup(key)
        if plan is not None and misaligned(*tensors):
            plan = None  # the plan's checks name it
    except (AttributeError, TypeError):  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_ragged(windowed, *tensors)  # raises ValueError on a bad argument
        if key is not None:
            plans.store(key, plan)
    elif q.shape[0] == 0:
        _plan_ragged(windowed, *tensors)  # no main will check the arguments
    total_q, total_kv = q.shape[0], k.shape[0]
    if VALIDATE:
        check_indptr_values(qo_indptr, kv_indptr, total_q, total_kv)
    if total_q == 0:
        return
    kernel, keyless = plan
    if keyless is not None:
        check_placement(RAGGED_NAMES, tensors)  # K and V's device (main sees the stand-in)
        k = v = keyless
    elif total_kv == 1:
        k, v = _lone_token(k, NUM_KV_HEADS), _lone_token(v, NUM_KV_HEADS)
    if total_q == 1:
        q = _lone_token(q, NUM_HEADS)
    if sm_scale <= 0:
        # The kernel folds the scale into exp2 after masking, which needs it positive:
        # softmax(s q.k) = softmax(|s| (-q).k), and s = 0 gives softmax(1 * 0.k); both exact.
        q, sm_scale = (-q, -sm_scale) if sm_scale < 0 else (torch.zeros_like(q), 1.0)
    windows = () if window_left is None else (window_left,)
    try:
        kernel(
            q, k, v, qo_indptr, kv_indptr, total_kv, *windows, sm_scale, output, lse,
            _scheduler(q.get_device()),
        )  # fmt: skip
    except Exception as refusal:
        _named_refusal(refusal, lambda: _plan_ragged(windowed, *tensors))
    as_given = q is tensors[0] and k is tensors[1] and v is tensors[2]  # no stand-in, restride
    if keyless is None and as_given:
        _register_fast(fast_entry.WINDOW if windowed else fast_entry.RAGGED, kernel, tensors)


def _paged_arguments(page_size: int, tensors: tuple) -> tuple:
    """The definition's argument names and tensors (page size 1 has no kv_last_page_len)."""
    if page_size == 1:
        return PAGED_PS1_NAMES, tensors[:6] + tensors[7:]
    return PAGED_PS64_NAMES, tensors


def _one_page(cache: torch.Tensor) -> torch.Tensor:
    """A one-page cache at the dense page stride, whatever stride torch gave its dim of 1: the
    TMA descriptor takes the stride, and wants a 16-byte multiple."""
    page = cache.shape[1] * NUM_KV_HEADS * HEAD_DIM
    if cache.stride(0) * cache.element_size() % 16 == 0 and cache.stride(0) >= page:
        return cache
    return cache.as_strided(cache.shape, (page, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM, 1))


def paged_plan(dtype: str, page_size: int, fp8: bool, total_q: int, batch: int, kv_bound: int,
               num_sms: int) -> tuple:  # fmt: skip
    """(pack, shares) from shapes; kv_bound: the page table's entries x page size. Decode-like
    batches pack the query heads of a KV head and split (both page sizes; float16 over FP8
    caches packs unsplit: PACK_SPLIT_VARIANTS); no other batch splits."""
    if not (page_size in PACK_PAGE_SIZES and decode_like(total_q, batch)):
        return False, 1  # kv_shares splits decode-like batches only: these pack
    if (dtype, page_size, fp8) not in PACK_SPLIT_VARIANTS:
        return True, 1
    return True, kv_shares(total_q, batch, kv_bound, num_sms, block_M=PACK_BLOCK_M, pack=True)


def _plan_paged(page_size: int, tensors: tuple, fp8: bool = False) -> tuple:
    """Check shapes, dtypes and layout (once per key). A cache without pages, or a page table
    without entries, runs the kernel on a zero 1-page (1-entry) stand-in, told there are none
    (page_count, kv_rows 0): the kernel then reads neither, and a TMA descriptor needs a page.
    tensors: q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len (None for
    page size 1), output, lse. fp8: float8_e4m3fn caches."""
    q = tensors[0]
    cache_dtype = FP8_DTYPE if fp8 else None
    batch, total_q, num_pages, num_kv_indices = check_paged_shapes(
        *tensors, page_size, cache_dtype
    )  # fmt: skip
    check_layout(*_paged_arguments(page_size, tensors))
    pageless = indexless = None
    if num_pages == 0:
        shape = (1, page_size, NUM_KV_HEADS, HEAD_DIM)
        pageless = torch.zeros(shape, dtype=cache_dtype or q.dtype, device=q.device)
    if num_kv_indices == 0:
        indexless = torch.zeros(1, dtype=torch.int32, device=q.device)
    device = q.get_device()
    if page_size == 1 and gathers_pages(total_q, batch, num_kv_indices, q.element_size()):
        # The pages into contiguous K/V first (_run_gathered), then the ragged program.
        ragged = _kernel(q.dtype, True, device, long_keys=long_keys_launch(num_kv_indices, batch))
        gather = _gather_kernel(q.dtype, device), ragged
        return None, pageless, indexless, num_pages, 1, None, gather
    decodes = fp8 and decode_like(total_q, batch) and batch <= DECODE_MAX_BATCH
    if decodes and decode_program_enabled():
        # The decode program writes fp32 shares (one at least) for its merge.
        shares = decode_shares(total_q, batch, num_kv_indices * page_size, _sm_count(device))
        kernel = _decode_kernel(q.dtype, device)
        merge = _merge_decode_kernel(q.dtype, device)
        return kernel, pageless, indexless, num_pages, shares, merge, None
    pack, shares = paged_plan(
        _DTYPES[q.dtype], page_size, fp8, total_q, batch, num_kv_indices * page_size,
        _sm_count(device),
    )  # fmt: skip
    kernel = _kernel(q.dtype, True, device, page_size, fp8=fp8, split=shares > 1, pack=pack)
    merge = _merge_kernel(q.dtype, device) if shares > 1 else None
    return kernel, pageless, indexless, num_pages, shares, merge, None


def run_paged_ps64(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse
):
    """q [total_q, 32, 128], k_cache/v_cache [num_pages, 64, 8, 128] (bfloat16 or float16, any
    page stride), qo_indptr/kv_indptr int32 [batch + 1] (kv_indptr into kv_indices), kv_indices
    int32 [num_kv_indices] (page ids), kv_last_page_len int32 [batch], sm_scale (finite) ->
    output [total_q, 32, 128] and lse [total_q, 32] float32 (base 2), written in place. Causal,
    bottom-right aligned per sequence."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.paged_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                               kv_last_page_len, sm_scale, output, lse):  # fmt: skip
                return
        except Exception:  # as in run_ragged
            pass
    _run_paged(64, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
               sm_scale, output, lse)  # fmt: skip


def run_paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                         k_scale, v_scale, sm_scale, output, lse):  # fmt: skip
    """run_paged_ps64 over float8_e4m3fn caches (a page stride a multiple of 16 elements), the
    real K = k_cache * k_scale and V = v_cache * v_scale (k_scale, v_scale finite): k_scale
    joins the softmax scale, v_scale multiplies the output in the kernel's epilogue (lse
    unchanged: fold_kv_scales). The kernel converts the FP8 V pages to q's dtype on chip, and K's
    under float16 q (bfloat16 q: Q K^T in e4m3 on K as stored, gqa_prefill_fp8's split)."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                     kv_last_page_len, k_scale, v_scale, sm_scale, output,
                                     lse):  # fmt: skip
                return
        except Exception:  # as in run_ragged
            pass
    sm_scale, v_scale = fold_kv_scales(sm_scale, k_scale, v_scale)
    _run_paged(64, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
               sm_scale, output, lse, v_scale)  # fmt: skip


def run_paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse):
    """run_paged_ps64 for pages of one token, k_cache/v_cache [num_pages, 1, 8, 128], without
    kv_last_page_len."""
    fast = fast_entry._module
    if fast is not None:
        try:
            if fast.paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
                              output, lse):  # fmt: skip
                return
        except Exception:  # as in run_ragged
            pass
    _run_paged(1, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, sm_scale, output,
               lse)  # fmt: skip


def _run_paged(page_size, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
               kv_last_page_len, sm_scale, output, lse, v_scale=None):  # fmt: skip
    """v_scale: a float for FP8 caches (sm_scale then has k_scale folded in), else None."""
    sm_scale = check_sm_scale(sm_scale)
    tensors = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output,
               lse)  # fmt: skip
    fp8 = v_scale is not None
    plans = _fp8_plans if fp8 else _paged_plans[page_size]
    try:
        key = (
            q.shape, k_cache.shape, v_cache.shape, qo_indptr.shape, kv_indices.shape, q.stride(),
            k_cache.stride(), v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype,
            kv_indices.dtype, q.get_device(),
        )  # fmt: skip
        plan = plans.lookup(key)
        if plan is not None and misaligned(*_paged_arguments(page_size, tensors)[1]):
            plan = None  # the plan's checks name it
    except (AttributeError, TypeError):  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_paged(page_size, tensors, fp8)  # raises ValueError on a bad argument
        if key is not None:
            plans.store(key, plan)
    elif q.shape[0] == 0:
        _plan_paged(page_size, tensors, fp8)  # no main will check the arguments
    total_q = q.shape[0]
    if VALIDATE:
        check_paged_values(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, total_q,
                           plan[3], page_size)  # fmt: skip
    if total_q == 0:
        return
    if plan[1] is not None or plan[2] is not None:
        # The caches' or the page table's device (main sees the stand-in).
        check_placement(*_paged_arguments(page_size, tensors))
    try:
        _launch_paged(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                      kv_last_page_len, sm_scale, output, lse, v_scale)  # fmt: skip
    except Exception as refusal:
        _named_refusal(refusal, lambda: _plan_paged(page_size, tensors, fp8))
    kernel, pageless, indexless, num_pages, shares, merge, gather = plan
    # The main (and a split's merge, or a gather first) on the arguments as given
    # (_launch_paged's stand-ins and restrides).
    as_given = (total_q != 1 or _lone_token(q, NUM_HEADS) is q) and (
        num_pages != 1 or (_one_page(k_cache) is k_cache and _one_page(v_cache) is v_cache)
    )  # fmt: skip
    if pageless is None and indexless is None and as_given and sm_scale > 0:
        kind = fast_entry.PAGED_FP8 if fp8 else (
            fast_entry.PAGED_64 if page_size == 64 else fast_entry.PAGED_1
        )  # fmt: skip
        main, gather = (kernel, None) if gather is None else (gather[1], gather[0])
        _register_fast(kind, main, _paged_arguments(page_size, tensors)[1], merge, shares,
                       gather)  # fmt: skip


def _launch_paged(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                  sm_scale, output, lse, v_scale):  # fmt: skip
    """_run_paged's launches (the kernel, then split-KV's merge; or the page gather, then the
    ragged program) on a plan that matched the call."""
    fp8 = v_scale is not None
    kernel, pageless, indexless, num_pages, shares, merge, gather = plan
    total_q, num_kv_indices = q.shape[0], kv_indices.shape[0]
    if pageless is not None:
        k_cache = v_cache = pageless
    elif num_pages == 1:
        k_cache, v_cache = _one_page(k_cache), _one_page(v_cache)
    if indexless is not None:
        kv_indices = indexless
    if total_q == 1:
        q = _lone_token(q, NUM_HEADS)
    if sm_scale <= 0:
        # As in run_ragged: the kernel needs a positive scale.
        q, sm_scale = (-q, -sm_scale) if sm_scale < 0 else (torch.zeros_like(q), 1.0)
    device = q.get_device()
    if gather is not None:
        _run_gathered(gather, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, num_pages,
                      sm_scale, output, lse, _scheduler(device))  # fmt: skip
        return
    lengths = () if kv_last_page_len is None else (kv_last_page_len,)
    scales = (sm_scale, v_scale) if fp8 else (sm_scale,)
    results = (output, lse) if merge is None else _workspace(device, shares * total_q)
    kernel(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, *lengths, num_kv_indices,
        num_pages, *scales, *results, _scheduler(device),
    )  # fmt: skip
    if merge is not None:
        merge(*results, output, lse)


def _run_gathered(kernels, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, page_count,
                  sm_scale, output, lse, scheduler):  # fmt: skip
    """Page size 1 on a prefill-like batch (arguments.gathers_pages): the pages into the
    stream's K and V buffers (StreamBuffers, registered with the fast path), then the
    ragged program over them, kv_indptr indexing keys as it indexed pages. page_count: the pages
    an id may name (0 for a 1-page stand-in cache)."""
    gather, ragged = kernels
    rows = kv_indices.shape[0]
    k, v = _gather_buffers(q.get_device(), rows, q.dtype)
    gather(k_cache, v_cache, kv_indices, page_count, k, v)
    ragged(q, k, v, qo_indptr, kv_indptr, rows, sm_scale, output, lse, scheduler)
