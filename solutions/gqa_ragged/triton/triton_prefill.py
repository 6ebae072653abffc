"""Triton GQA prefill attention: the entry points of every definition (padded, ragged, ragged with
a sliding window, paged with page size 1 and 64, page size 64 with FP8 caches), their argument
checks and launch plans. The kernel is in attention_kernel.py.

flashinfer-bench times the whole call, so run_*() only builds a key from shapes, strides and
dtypes, looks up the launch plan cached under it (grid and block sizes, never data pointers or
indptr values), checks devices and alignment, and launches once. Nothing here reads a device
tensor: the ragged lengths stay on the GPU and the grid is sized from total_q and the batch size
alone; the kernel itself copes with indptr values that are not a partition (ragged_batch.py) and
with page ids and last-page lengths it cannot use (paged_kv.py).

The argument rules and messages are the bundle's shared contract (arguments.py): q, k, v may be
token-strided (slices of a fused QKV projection), float16 or bfloat16, all of one dtype.
"""

import functools
import inspect
import math
import os

import torch
import triton
import triton.language as tl

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
    token_stride,
)
from .attention_kernel import gqa_prefill_fwd
from .launcher import direct_runner
from .paged_kv import gather_pages
from .split_kv import merge_kv_splits

try:  # Gluon ships with triton >= 3.5 (the pinned 3.6 has it); older ones run the FA-2 kernel
    from . import gluon_attention
except (ImportError, AttributeError):  # no Gluon, or one without an API the kernel uses
    gluon_attention = None

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP_SIZE = NUM_HEADS // NUM_KV_HEADS
LOG2_E = 1.0 / math.log(2.0)
PADDED_QK_SCALE = LOG2_E / math.sqrt(HEAD_DIM)  # the padded definition's fixed softmax scale
# Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests only).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_padded_plans = PlanCache()
_ragged_plans = PlanCache()
_window_plans = PlanCache()  # the ragged plans with WINDOW on
_paged_plans = {1: PlanCache(), 64: PlanCache()}  # by page size
_fp8_plans = PlanCache()  # page size 64, FP8 caches: a definition of its own, checked as such
# The kernel's parameters by kind, in signature order: a compiled kernel takes them all
# positionally. launch_* pass the run-time ones in _RUNTIME_ARGS order (a tuple costs the host
# less than keywords, ~0.7 us a call), checked here against the signature.
_PARAMETERS = inspect.signature(gqa_prefill_fwd.fn).parameters.values()
_RUNTIME_ARGS = ("q", "k", "v", "out", "lse", "qo_indptr", "kv_indptr", "kv_indices",
                 "kv_last_page_len", "num_seqs", "seq_q", "seq_kv", "num_pages", "qk_scale",
                 "v_scale", "window_left")  # fmt: skip
# Padded and ragged batches read K/V contiguous (the paged arguments are None).
CONTIGUOUS_KV = dict(PAGE_SIZE=0, K_PAGE_STRIDE=0, V_PAGE_STRIDE=0)
if _RUNTIME_ARGS != tuple(p.name for p in _PARAMETERS if p.annotation is not tl.constexpr):
    raise ImportError("triton_prefill: _RUNTIME_ARGS no longer matches gqa_prefill_fwd")


def _launch(grid, meta, runners, args) -> None:
    """gqa_prefill_fwd[grid](*args, **meta), through _cached_launch; a split plan (KV_SPLITS >
    1) through _launch_split."""
    if meta["KV_SPLITS"] > 1:
        _launch_split(grid, meta, runners, args)
        return
    _cached_launch(gqa_prefill_fwd, grid, lambda: _attention_constexprs(meta), runners,
                   args[0].get_device(), args)  # fmt: skip


def _attention_constexprs(meta: dict) -> dict:
    return {"MALFORMED_ONLY": False, "NUM_HEADS": NUM_HEADS, "NUM_KV_HEADS": NUM_KV_HEADS,
            "HEAD_DIM": HEAD_DIM, **meta}  # fmt: skip


def _cached_launch(kernel, grid, constexprs, runners, key, args) -> None:
    """kernel[grid](*args, **constexprs()), in a fraction of the host time once warm.

    The JIT binds and specializes every argument on every call (22-31 us of host time a call on
    the H100 machine, more than a short prompt's kernel), so the compiled kernel it returns is
    kept in the plan's `runners` under `key` (per device and kernel), and launched directly
    (launcher.direct_runner: triton's C launcher, TMA descriptor encodings kept) while the
    pointers keep the 16-byte alignment it was specialized on (every call's pointers have it:
    check_placement). The plan fixes everything else the compiled kernel depends on
    (dtypes, which arguments are None, the constexprs; the integers are not specialized). The
    interpreter takes the JIT path. constexprs: a function, called only when compiling."""
    if not INTERPRET:
        runner = runners.get(key)
        if runner is not None:
            runner(*args)
            return
    values = constexprs()
    compiled = kernel[grid](*args, **values)
    if not INTERPRET:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        runners[key] = direct_runner(compiled, grid, compiled_constexprs(kernel, values))


def compiled_constexprs(kernel, values: dict) -> list:
    """What a compiled kernel takes last: its constexpr parameters' values in signature order, a
    parameter's default where `values` leaves it out (as the JIT's own call does)."""
    out = []
    for name, default in _constexpr_parameters(kernel):
        value = values.get(name, default)
        if value is inspect.Parameter.empty:
            raise KeyError(f"{kernel.fn.__name__}: no value for constexpr {name}")
        out.append(value)
    return out


@functools.lru_cache(maxsize=None)
def _constexpr_parameters(kernel) -> tuple:
    """A kernel's constexpr parameters in signature order, (name, default) each."""
    parameters = inspect.signature(kernel.fn).parameters.values()
    return tuple((p.name, p.default) for p in parameters if p.annotation is tl.constexpr)


# Split-KV (split_kv.py): at most this many key shares per tile, each at least this many key
# tiles long (the interpreter's test sequences are short: 2 tiles).
MAX_KV_SPLITS = 16
MIN_TILES_PER_SPLIT = 2 if INTERPRET else 8
MERGE_ROWS = 16  # rows (token x head) a merge program takes
LONG_KEYS = 4096  # keys a sequence from which paired tiles pay at fewer waves (_launch_config)
WAVES = 4  # of decode programs at 4 CTAs an SM (FP8 single-token rows: 1 wave 206 us, 4 169)


def _kv_splits(tokens_per_seq: float, batch: int, kv_tokens: int, block_n: int, num_sms: int,
               min_tiles: int = MIN_TILES_PER_SPLIT) -> int:  # fmt: skip
    """Key shares per tile for a decode-like batch (at most 4 query tokens a sequence: one tile
    a sequence and KV head), 1 otherwise. Enough shares for four waves of the decode tiles'
    programs (4 CTAs an SM by registers; waves of short shares even out the sequences'
    unequal lengths: measured, TUNING.md), but none shorter than min_tiles key tiles for the
    average sequence. From shapes alone: kv_tokens is total_kv (paged: pages x page size, an
    upper bound)."""
    if tokens_per_seq > 4 or batch < 1:
        return 1
    programs = batch * NUM_KV_HEADS
    by_occupancy = WAVES * 4 * num_sms // programs
    by_length = int(kv_tokens / batch) // (min_tiles * block_n)
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


def _split_grid(meta: dict, grid: tuple) -> tuple:
    """The plan's grid with the key shares as its third axis (1: no split)."""
    return (*grid, meta["KV_SPLITS"]) if meta["KV_SPLITS"] > 1 else grid


def _plan_splits(meta: dict, tokens_per_seq: float, batch: int, kv_tokens: int, device) -> int:
    """The plan's KV_SPLITS (a config's own, else _kv_splits; paired row blocks never split)."""
    if "KV_SPLITS" in meta or meta["ROW_BLOCKS"] > 1:
        return meta.get("KV_SPLITS", 1)
    return _kv_splits(tokens_per_seq, batch, kv_tokens, meta["BLOCK_N"], _sm_count(device))


_split_buffers = StreamBuffers()  # split-KV's fp32 shares
_gathered = StreamBuffers()  # page size 1's gathered K and V


def _split_workspace(out, lse, splits: int) -> tuple:
    """Split-KV's fp32 workspaces for `splits` shares of out and lse, kept per stream
    (StreamBuffers: a call of the same shape allocates nothing and builds no view, 13-26 us of
    host time before the launch on the H200 hosts: TUNING.md, host time on the decode rows).
    The shares' outputs are a multiple of 128 floats: their LSE stays aligned."""
    shapes = ((splits, *out.shape), (splits, *lse.shape))
    return _split_buffers.views(out.get_device(), torch.float32, shapes)


def _launch_split(grid, meta, runners, args) -> None:
    """The attention kernel over KV_SPLITS key shares into fp32 workspaces (args' out and lse
    are replaced; _split_workspace), then merge_kv_splits into out and lse."""
    out, lse = args[3], args[4]
    splits = meta["KV_SPLITS"]
    part_out, part_lse = _split_workspace(out, lse, splits)
    device = out.get_device()
    _cached_launch(gqa_prefill_fwd, grid, lambda: _attention_constexprs(meta), runners, device,
                   (*args[:3], part_out, part_lse, *args[5:]))  # fmt: skip
    rows = out.shape[0] * NUM_HEADS
    merge_constexprs = lambda: dict(HEAD_DIM=HEAD_DIM, KV_SPLITS=splits,  # noqa: E731
                                    BLOCK_ROWS=MERGE_ROWS, INTERPRETED=INTERPRET)  # fmt: skip
    _cached_launch(merge_kv_splits, (-(-rows // MERGE_ROWS),), merge_constexprs, runners,
                   ("merge", device), (part_out, part_lse, out, lse, rows))  # fmt: skip


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100 SXM's; only the interpreter gets here
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_config(tokens_per_seq: float, slots, num_sms: int, causal: bool,
                   keys_per_seq: float = 0.0) -> dict:  # fmt: skip
    """Block sizes from the shape alone; slots(T) is the grid's first axis at T tokens per tile,
    keys_per_seq the average keys of a sequence (paged: an upper bound).

    The four query heads of a KV group always share a tile (HEADS_PER_TILE = 4): K/V tiles are
    loaded once for the group, a short sequence still fills a tl.dot's rows, and the causal
    diagonal of a 128-row block spans 32 tokens instead of 128. Two paired 128-row blocks per
    tile (ROW_BLOCKS = 2) overlap softmax with the tensor cores; below about four waves of
    32-token tiles, 64-row tiles win, unless every query tile reads many keys (a chunk over a
    long context: at least LONG_KEYS a sequence) and paired tiles still fill the GPU once: then
    a 64-row tile loads (or gathers) each key for 4x fewer rows than a paired one, and that
    cost outweighs the balance of more waves. BLOCK_N = 128 spills. The measurements behind
    each threshold: TUNING.md.
    """
    if INTERPRET:
        # The interpreter pays per program and per op, not per element; small tiles still make
        # the small test sequences cross tile boundaries and the causal diagonal.
        return dict(HEADS_PER_TILE=4, BLOCK_M=32, BLOCK_N=16, ROW_BLOCKS=1, num_warps=4,
                    num_stages=1)  # fmt: skip
    if tokens_per_seq <= 4:  # decode-like: 4 tokens x 4 heads fill the smallest tl.dot
        return dict(HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=64, ROW_BLOCKS=1, num_warps=4,
                    num_stages=2)  # fmt: skip
    small_tiles = dict(HEADS_PER_TILE=4, BLOCK_M=64, BLOCK_N=64, ROW_BLOCKS=1, num_warps=4,
                       num_stages=3)  # fmt: skip
    paired = dict(HEADS_PER_TILE=4, BLOCK_M=128, BLOCK_N=64, ROW_BLOCKS=2, num_warps=8,
                  num_stages=3)  # fmt: skip

    def waves(tokens_per_tile):  # programs per SM
        return slots(tokens_per_tile) * NUM_KV_HEADS / num_sms

    if not causal:
        return small_tiles if tokens_per_seq <= 64 or waves(64) < 1 else paired
    if tokens_per_seq <= 128:
        return small_tiles
    if waves(32) >= 4 or (keys_per_seq >= LONG_KEYS and waves(64) >= 1):
        return paired
    return small_tiles


def _tokens_per_tile(meta: dict) -> int:
    return meta["ROW_BLOCKS"] * meta["BLOCK_M"] // meta["HEADS_PER_TILE"]


def _plan_padded(q, k, v, causal, out, config=None) -> tuple:
    """Check shapes, dtypes and strides (once per key) and plan the launch."""
    batch, seq_q, seq_kv = check_padded_shapes(q, k, v, out)
    check_layout(PADDED_NAMES, (q, k, v, out), INTERPRET)
    causal = check_causal(causal)
    gluon_plan = None if config else _gluon_plan(q, k, v, causal, out, batch, seq_q, seq_kv)
    if gluon_plan is not None:
        return gluon_plan
    meta = dict(
        config
        or _launch_config(
            seq_q, lambda t: batch * triton.cdiv(seq_q, t), _sm_count(q.device), causal
        )
    )
    meta.setdefault("ROW_BLOCKS", 1)
    grid = (batch * triton.cdiv(seq_q, _tokens_per_tile(meta)), NUM_HEADS // meta["HEADS_PER_TILE"])
    meta.update(CAUSAL=causal, WINDOW=False, RAGGED=False, WRITE_LSE=False, INTERPRETED=INTERPRET,
                KV_SPLITS=1)  # fmt: skip
    meta.update(_strides(q, k, v), **CONTIGUOUS_KV)
    return grid, meta, batch, seq_q, seq_kv, {}


def _plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse, config=None, window=False,
                 gluon=True) -> tuple:  # fmt: skip
    """Check shapes, dtypes and strides (once per key) and plan the launch. indptr values stay
    unread on the host: the kernel checks them (see ragged_batch.py). window: the kernel with
    the sliding window (window_left a run-time argument). Its grid and tiles are the causal
    plan's: a window changes how many key tiles a program reads, not how many programs there
    are, and the heaviest-first order (last tiles of a sequence first) still holds, a query's
    band min(p + 1, window_left + 1) never shrinking along the sequence. gluon: the Gluon
    kernel may take the call (_gluon_suits)."""
    batch, total_q, total_kv = check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse)
    check_layout(RAGGED_NAMES, (q, k, v, qo_indptr, kv_indptr, output, lse), INTERPRET)
    if gluon and not config and _gluon_suits(q, k, v, output, batch, total_kv, window):
        # The FA-2 plan runs after the Gluon kernel, for malformed batches only.
        fa2 = _plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse, config=_GLUON_FALLBACK,
                           window=window)  # fmt: skip
        grid = gluon_attention.ragged_grid(batch, total_q, _sm_count(q.device))
        return GluonRaggedPlan((batch, grid, fa2, {}, window))
    tokens_per_seq = total_q / max(batch, 1)
    meta = dict(
        config
        or _launch_config(
            tokens_per_seq, lambda t: total_q // t + batch, _sm_count(q.device), causal=True,
            keys_per_seq=total_kv / max(batch, 1),
        )
    )
    meta.setdefault("ROW_BLOCKS", 1)
    # total_q // T + batch slots cover every sequence's tiles (see find_sequence).
    grid = (total_q // _tokens_per_tile(meta) + batch, NUM_HEADS // meta["HEADS_PER_TILE"])
    grid = _malformed_only_grid(grid, q.device) if meta.get("MALFORMED_ONLY") else grid
    meta.update(CAUSAL=True, WINDOW=window, RAGGED=True, WRITE_LSE=True, INTERPRETED=INTERPRET)
    meta.update(_strides(q, k, v), **CONTIGUOUS_KV)
    meta["KV_SPLITS"] = 1 if window or meta.get("MALFORMED_ONLY") else _plan_splits(
        meta, tokens_per_seq, batch, total_kv, q.device)  # fmt: skip
    return _split_grid(meta, grid), meta, batch, total_q, total_kv, {}


def _plan_paged(page_size, tensors, config=None, cache_dtype=None, gather=None) -> tuple:
    """Check shapes, dtypes and strides (once per key) and plan the launch: the ragged plan with
    K/V read through the page table. Page ids and lengths stay unread on the host (paged_kv.py).
    tensors: q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len (None for
    page size 1), output, lse. cache_dtype: FP8_DTYPE for FP8 caches (else q's dtype); the
    kernel specializes on the caches' element type, the tiles the same. gather (page size 1):
    gather the pages first and run the ragged kernel (GatherPlan); None: as gathers_pages says."""
    q, k_cache, v_cache, output = *tensors[:3], tensors[7]
    batch, total_q, num_pages, num_kv_indices = check_paged_shapes(
        *tensors, page_size, cache_dtype=cache_dtype
    )
    check_layout(*_paged_arguments(page_size, tensors), INTERPRET)
    if page_size == 1 and config is None:
        if gather is None:
            gather = gathers_pages(total_q, batch, num_kv_indices, q.element_size())
        if gather and num_kv_indices > 0:
            return GatherPlan((num_kv_indices, (triton.cdiv(num_kv_indices, GATHER_ROWS),), {},
                               {}))  # fmt: skip
    tokens_per_seq = total_q / max(batch, 1)
    if (page_size == 64 and cache_dtype is None and not config and num_pages > 0
            and _gluon_suits(q, None, None, output, batch, num_kv_indices * page_size)
            and gluon_attention.paged_suits(k_cache, v_cache)):  # fmt: skip
        # The FA-2 plan runs after the Gluon kernel, for malformed batches only.
        fa2 = _plan_paged(page_size, tensors, config=_GLUON_FALLBACK)
        return GluonPagedPlan((batch, gluon_attention.ragged_grid(batch, total_q,
                                                                  _sm_count(q.device)), fa2, {}))
    meta = dict(
        config
        or _launch_config(
            tokens_per_seq, lambda t: total_q // t + batch, _sm_count(q.device), causal=True,
            keys_per_seq=num_kv_indices * page_size / max(batch, 1),
        )
    )
    meta.setdefault("ROW_BLOCKS", 1)
    if cache_dtype is not None and config is None:
        # FP8 tiles take half the shared memory: one more stage fits at the same occupancy. The
        # paired kernel's loops then spill nothing; the decode tiles' 3 stages keep more loads
        # in flight (single-token rows 149 -> 128 us, H200; 4 stages 136). TUNING.md.
        meta["num_stages"] += 1
    grid = (total_q // _tokens_per_tile(meta) + batch, NUM_HEADS // meta["HEADS_PER_TILE"])
    grid = _malformed_only_grid(grid, q.device) if meta.get("MALFORMED_ONLY") else grid
    meta.update(CAUSAL=True, WINDOW=False, RAGGED=True, WRITE_LSE=True, INTERPRETED=INTERPRET)
    # FP8 caches under bf16 q: Q K^T on K as read, q split in two e4m3 terms (split_q_fp8;
    # float16 q's 11 bits would not fit two terms, and its conversion is one cvt a pair), on
    # the wgmma tiles (64 rows and paired; the interpreter's small tiles, so that CPU tests run
    # it): +4-7% on the prefill batches, but -7% on the decode tiles (16 rows, split-KV; H200,
    # TUNING.md), which keep K's conversion.
    wgmma_tiles = INTERPRET or meta["BLOCK_M"] >= 64
    meta["FP8_QK"] = cache_dtype is not None and q.dtype == torch.bfloat16 and wgmma_tiles
    # Tokens are dense within a page (the layout check): only the page strides vary.
    meta.update(Q_TOKEN_STRIDE=token_stride(q), K_TOKEN_STRIDE=NUM_KV_HEADS * HEAD_DIM,
                V_TOKEN_STRIDE=NUM_KV_HEADS * HEAD_DIM, PAGE_SIZE=page_size,
                K_PAGE_STRIDE=k_cache.stride(0), V_PAGE_STRIDE=v_cache.stride(0))  # fmt: skip
    meta["KV_SPLITS"] = 1 if meta.get("MALFORMED_ONLY") else _plan_splits(
        meta, tokens_per_seq, batch, num_kv_indices * page_size, q.device)  # fmt: skip
    return _split_grid(meta, grid), meta, batch, total_q, num_kv_indices, num_pages, {}


def _paged_arguments(page_size, tensors) -> tuple:
    """The definition's argument names and tensors (page size 1 has no kv_last_page_len)."""
    if page_size == 1:
        return PAGED_PS1_NAMES, tensors[:6] + tensors[7:]
    return PAGED_PS64_NAMES, tensors


def _strides(q, k, v) -> dict:
    """The token strides, compiled in: a fused QKV projection's slices get a kernel of their own,
    and contiguous tensors keep the code they had."""
    return dict(Q_TOKEN_STRIDE=token_stride(q), K_TOKEN_STRIDE=token_stride(k),
                V_TOKEN_STRIDE=token_stride(v))  # fmt: skip


class GluonRaggedPlan(tuple):
    """A ragged call's plan for the Gluon kernel: (batch, grid, the FA-2 plan for malformed
    batches, runners, window: the kernel with the sliding window)."""


class GluonPagedPlan(tuple):
    """A page size 64 call's plan for the Gluon kernel (gluon_paged_fwd): (batch, grid, the
    FA-2 plan for malformed batches, runners)."""


class GatherPlan(tuple):
    """A page size 1 call that gathers its pages into contiguous K/V first (gather_pages), then
    runs the ragged plan on them: (num_kv_indices, the gather's grid, its runners, {"ragged":
    the ragged plan}, made on the first launch: planning it needs the buffers)."""


class GluonPlan(tuple):
    """A padded call's plan for the Gluon kernel (gluon_attention.py): (seq_q, seq_kv, causal,
    grid, runners, the CTAs' items: padded_schedule on q's device)."""


# The Gluon kernel runs the padded batch on sm_90 from this many queries and keys a sequence:
# its launch costs ~13 us more host time than the FA-2 kernel's (three TMA descriptors encoded),
# which flashinfer-bench counts; below, that outweighs its faster kernel (TUNING.md, "Gluon").
GLUON_MIN_TOKENS = 1024
# ... and ragged, paged and window batches from this many queries a sequence on average (the
# host cannot see the lengths: indptr stays on the GPU). H200, 2026-11-29 (19): a batch of 1 to
# 4096 tokens a sequence, 804 on average, 0.77 -> 0.88x FlashInfer on the Gluon kernel; two
# chunks of 512 and 256 queries (384 on average, an 80 us call) 0.88 -> 0.76x (its descriptors'
# host time); page size 64, 8 x 256 queries over 4.5K keys, 0.94 -> 0.84x in kernel time
# (TUNING.md, "Gluon for page size 64").
GLUON_MIN_RAGGED_TOKENS = 512
# ... or from 128 in a long call: at least this many query-key pairs (total_q x total_kv /
# batch), where the Gluon path's extra host and launch time (~30 us) is small. Since its items
# come from a counter (2026-11-29 (20), H200) the paged Gluon kernel ran 8 x 256 queries over
# 4.5K keys (9.7M pairs) at 1.08x FlashInfer's kernel time against the FA-2 kernel's 0.98, the
# paged mixed batch (440 a sequence, 10M) 1.15x against 0.93; the ragged chunk of 384 a
# sequence (1.3M pairs) stays on FA-2 (TUNING.md, "Items by a counter").
GLUON_MIN_PAIRS = 4 << 20
# ... and the window plans from this window_left (16 key tiles) on: with narrower windows (1024)
# the FA-2 window kernel measured as fast or faster (4 prompts of 1-3K: 0.91x FlashInfer against
# the Gluon kernel's 0.84; TUNING.md, "Gluon for the sliding window").
GLUON_MIN_WINDOW = 2048


def gluon_takes_batch(batch: int, total_q: int, total_kv: int, window: bool = False) -> bool:
    """Whether a batch's sizes suit the Gluon kernel (GLUON_MIN_RAGGED_TOKENS, GLUON_MIN_PAIRS;
    a window batch by its queries alone: the pairs overcount its band). total_kv: key tokens
    (paged: pages x page size)."""
    tokens_per_seq = total_q / max(batch, 1)
    if total_kv == 0:
        return False
    if tokens_per_seq >= GLUON_MIN_RAGGED_TOKENS:
        return True
    long_call = total_q * total_kv / max(batch, 1) >= GLUON_MIN_PAIRS
    return not window and long_call and tokens_per_seq >= 128  # a row tile a sequence


def _gluon_suits(q, k, v, out, batch, total_kv, window=False) -> bool:
    """Whether a ragged call goes to the Gluon kernel: sm_90, TMA-readable q / k / v (k, v
    None: a paged call, whose caches paged_suits judges), int32 output offsets, sizes as
    gluon_takes_batch wants."""
    if gluon_attention is None or INTERPRET or q.device.type != "cuda":
        return False
    if not gluon_takes_batch(batch, q.shape[0], total_kv, window):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if not all(gluon_attention.tma_readable(x[None]) for x in (q, k, v) if x is not None):
        return False
    return q.shape[0] * out.stride(0) < 2**31


# The FA-2 plan that follows the Gluon kernel: malformed batches only (it poisons rows and
# computes the well-formed sequences of a malformed batch). On every other batch each program
# scans indptr and returns, so its launch costs waves of programs: paired 64-token tiles made
# 4x fewer than 16-token ones (H100, kernel time with the verdict before the search: 8 x 2048
# 22.6 -> 11.1 us, 4 x 1-3K 12.5 -> 7.5, one 2K chunk 6.5 -> 5.0; triton/TUNING.md), and its
# grid is now one wave (_malformed_only_grid).
_GLUON_FALLBACK = dict(HEADS_PER_TILE=4, BLOCK_M=128, BLOCK_N=64, ROW_BLOCKS=2, num_warps=8,
                       num_stages=3, MALFORMED_ONLY=True)  # fmt: skip


def _malformed_only_grid(grid: tuple, device) -> tuple:
    """A MALFORMED_ONLY plan's grid: one wave. On a well-formed batch its programs only scan
    indptr and return, so the launch costs what its waves do; a program takes a whole SM (8
    warps at 255 registers, 160 KB of shared memory), so at most one an SM across the head
    blocks of axis 1 (16 x 8 on an H100's or H200's 132 SMs). On a malformed batch each program
    runs its share of the full grid's slots in turn (gqa_prefill_fwd): slower, but that batch
    is the caller's error."""
    slots, head_blocks = grid
    return min(slots, max(1, _sm_count(device) // head_blocks)), head_blocks


def _gluon_plan(q, k, v, causal, out, batch, seq_q, seq_kv):
    """The Gluon plan if the call suits it (sm_90, TMA-readable layouts, int32 output offsets,
    long enough sequences), else None."""
    if gluon_attention is None or INTERPRET or q.device.type != "cuda" or batch < 1:
        return None
    if min(seq_q, seq_kv) < GLUON_MIN_TOKENS:
        return None
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return None
    if not all(map(gluon_attention.tma_readable, (q, k, v))):
        return None
    if batch > 1 and q.stride(0) != seq_q * q.stride(1):
        return None
    if batch * seq_q * out.stride(1) >= 2**31:
        return None
    grid = gluon_attention.grid(batch, seq_q, _sm_count(q.device))
    schedule = gluon_attention.padded_schedule(batch, seq_q, seq_kv, causal, grid[0])
    schedule = torch.tensor(schedule, dtype=torch.int32, device=q.device)
    return GluonPlan((seq_q, seq_kv, causal, grid, {}, schedule))


def run_padded(q, k, v, causal, out):
    causal = check_causal(causal)
    try:
        key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               out.dtype, v.shape, out.shape, causal)  # fmt: skip
        plan = _padded_plans.lookup(key)
    except (AttributeError, TypeError):  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_padded(q, k, v, causal, out)  # raises ValueError on a bad argument
        if key is not None:
            _padded_plans.store(key, plan)
    else:
        check_placement(PADDED_NAMES, (q, k, v, out), INTERPRET)
    launch_padded(plan, q, k, v, out)


def launch_padded(plan, q, k, v, out):
    if isinstance(plan, GluonPlan):
        seq_q, seq_kv, causal, grid, runners, schedule = plan
        args = gluon_attention.launch_args(q, k, v, out, seq_q, seq_kv, PADDED_QK_SCALE, causal,
                                           schedule)  # fmt: skip
        _cached_launch(gluon_attention.gluon_padded_fwd, grid, lambda: gluon_attention.CONSTEXPRS,
                       runners, q.get_device(), args)  # fmt: skip
        return
    grid, meta, batch, seq_q, seq_kv, runners = plan
    if grid[0] == 0:
        return  # no query row
    args = (q, k, v, out, None, None, None, None, None, batch, seq_q, seq_kv, None,
            PADDED_QK_SCALE, None, None)  # fmt: skip
    _launch(grid, meta, runners, args)


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    sm_scale = check_sm_scale(sm_scale)
    tensors = (q, k, v, qo_indptr, kv_indptr, output, lse)
    plan = _checked_ragged_plan(_ragged_plans, False, tensors)
    if sm_scale <= 0:
        q, sm_scale = _positive_scale(q, sm_scale)
    launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)


def run_ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse):
    """The ragged causal definition with FlashInfer's sliding window: the query at bottom-right
    position p = i + kv_len - q_len sees the keys [p - window_left, p]; -1: no window.

    A window of at least total_kv keys (the longest any sequence can have) hides no key: it
    runs the ragged kernel, as -1 does. So the window kernel only ever gets window_left <
    total_kv, and its band arithmetic (p - window_left) stays far inside int32."""
    window_left = check_window_left(window_left)
    sm_scale = check_sm_scale(sm_scale)
    tensors = (q, k, v, qo_indptr, kv_indptr, output, lse)
    # k is [total_kv, 8, 128] (a wrong shape fails the plan's checks either way)
    no_window = window_left < 0 or (isinstance(k, torch.Tensor) and window_left >= k.shape[0])
    if no_window:
        plan, window_left = _checked_ragged_plan(_ragged_plans, False, tensors), None
    else:
        long_band = window_left >= GLUON_MIN_WINDOW
        plan = _checked_ragged_plan(_window_plans, True, tensors, gluon=long_band)
    if sm_scale <= 0:
        q, sm_scale = _positive_scale(q, sm_scale)
    launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse, window_left)


def _checked_ragged_plan(plans, window, tensors, gluon=True) -> tuple:
    """The launch plan of a ragged call (shapes, dtypes and strides checked once per key, the
    placement on every call); window: run_ragged_swa's kernel; gluon: _plan_ragged's (part of
    the key)."""
    q, k, v, qo_indptr, kv_indptr, output, lse = tensors
    try:
        key = (
            q.shape, k.shape, q.stride(), k.stride(), v.stride(), qo_indptr.shape, q.dtype,
            k.dtype, v.dtype, qo_indptr.dtype, kv_indptr.dtype, output.dtype, lse.dtype,
            v.shape, kv_indptr.shape, output.shape, lse.shape, gluon,
        )  # fmt: skip
        plan = plans.lookup(key)
    except AttributeError:  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_ragged(*tensors, window=window, gluon=gluon)
        if key is not None:
            plans.store(key, plan)
    else:
        check_placement(RAGGED_NAMES, tensors, INTERPRET)
    if VALIDATE:
        check_indptr_values(qo_indptr, kv_indptr, q.shape[0], k.shape[0])
    return plan


def _positive_scale(q, sm_scale) -> tuple:
    """(q', s') with softmax(s q.k) = softmax(s' q'.k) and s' > 0. The kernel takes the row max
    of the unscaled logits, which is the max of the scaled ones only for a positive scale:
    softmax(s q.k) = softmax(|s| (-q).k), and s = 0 gives softmax(1 * 0.k); both exact. (q'
    keeps q's strides: the plan compiled them in.)"""
    same_strides = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
    if sm_scale < 0:
        return torch.neg(q, out=same_strides), -sm_scale
    return same_strides.zero_(), 1.0


def launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse, window_left=None):
    """window_left: an int in [0, total_kv) for a window plan, None for any other."""
    if isinstance(plan, GluonRaggedPlan):
        batch, grid, fa2, runners, window = plan
        args = gluon_attention.ragged_launch_args(q, k, v, output, lse, qo_indptr, kv_indptr,
                                                  batch, sm_scale * LOG2_E,
                                                  window_left=window_left)  # fmt: skip
        constexprs = (gluon_attention.WINDOW_CONSTEXPRS if window
                      else gluon_attention.RAGGED_CONSTEXPRS)  # fmt: skip
        _cached_launch(gluon_attention.gluon_ragged_fwd, grid, lambda: constexprs, runners,
                       q.get_device(), args)  # fmt: skip
        plan = fa2  # does nothing unless the batch is malformed
    grid, meta, batch, total_q, total_kv, runners = plan
    if total_q == 0:
        return  # no query row: nothing to write
    args = (q, k, v, output, lse, qo_indptr, kv_indptr, None, None, batch, total_q, total_kv,
            None, sm_scale * LOG2_E, None, window_left)  # fmt: skip
    _launch(grid, meta, runners, args)


def run_paged_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                   sm_scale, output, lse):  # fmt: skip
    _run_paged(64, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
               sm_scale, output, lse)  # fmt: skip


def run_paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                         kv_last_page_len, k_scale, v_scale, sm_scale, output, lse):  # fmt: skip
    """Page size 64 over float8_e4m3fn caches, K = k_cache * k_scale, V = v_cache * v_scale: the
    paged kernel reading FP8 tiles (converted to q's dtype on chip), k_scale folded into the
    softmax scale and v_scale into the output (fold_kv_scales)."""
    sm_scale, v_scale = fold_kv_scales(sm_scale, k_scale, v_scale)
    _run_paged(64, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
               sm_scale, output, lse, v_scale)  # fmt: skip


def run_paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse):
    _run_paged(1, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, sm_scale, output,
               lse)  # fmt: skip


def _run_paged(page_size, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
               kv_last_page_len, sm_scale, output, lse, v_scale=None):  # fmt: skip
    """v_scale: a float for FP8 caches (sm_scale then has k_scale folded in), else None."""
    sm_scale = check_sm_scale(sm_scale)
    plans = _paged_plans[page_size] if v_scale is None else _fp8_plans
    tensors = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output,
               lse)  # fmt: skip
    try:
        key = (
            q.shape, k_cache.shape, q.stride(), k_cache.stride(), v_cache.stride(),
            qo_indptr.shape, kv_indices.shape, q.dtype, k_cache.dtype, v_cache.dtype,
            qo_indptr.dtype, kv_indptr.dtype, kv_indices.dtype, output.dtype, lse.dtype,
            v_cache.shape, kv_indptr.shape, output.shape, lse.shape,
            None if kv_last_page_len is None else (kv_last_page_len.shape, kv_last_page_len.dtype),
        )  # fmt: skip
        plan = plans.lookup(key)
    except AttributeError:  # not a tensor
        key = plan = None
    if plan is None:
        cache_dtype = None if v_scale is None else FP8_DTYPE
        plan = _plan_paged(page_size, tensors, cache_dtype=cache_dtype)  # ValueError if bad
        if key is not None:
            plans.store(key, plan)
    else:
        check_placement(*_paged_arguments(page_size, tensors), INTERPRET)
    if VALIDATE:
        check_paged_values(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, q.shape[0],
                           k_cache.shape[0], page_size)  # fmt: skip
    if sm_scale <= 0:
        q, sm_scale = _positive_scale(q, sm_scale)
    launch_paged(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                 sm_scale, output, lse, v_scale)  # fmt: skip


def launch_paged(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                 sm_scale, output, lse, v_scale=None):  # fmt: skip
    """v_scale: a float for FP8 caches (a plan of _fp8_plans), else None."""
    if isinstance(plan, GatherPlan):
        launch_gathered(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
                        output, lse)  # fmt: skip
        return
    if isinstance(plan, GluonPagedPlan):
        batch, grid, fa2, runners = plan
        args = gluon_attention.paged_launch_args(q, k_cache, v_cache, output, lse, qo_indptr,
                                                 kv_indptr, kv_indices, kv_last_page_len, batch,
                                                 sm_scale * LOG2_E)  # fmt: skip
        _cached_launch(gluon_attention.gluon_paged_fwd, grid,
                       lambda: gluon_attention.PAGED_CONSTEXPRS, runners, q.get_device(), args)
        plan = fa2  # does nothing unless the batch is malformed
    grid, meta, batch, total_q, num_kv_indices, num_pages, runners = plan
    if total_q == 0:
        return  # no query row: nothing to write
    args = (q, k_cache, v_cache, output, lse, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
            batch, total_q, num_kv_indices, num_pages, sm_scale * LOG2_E, v_scale,
            None)  # fmt: skip
    _launch(grid, meta, runners, args)


GATHER_ROWS = 8  # keys a program of gather_pages copies (16 KB of K and V at 16 bits)
GATHER_CONSTEXPRS = dict(ROW=NUM_KV_HEADS * HEAD_DIM, ROWS=GATHER_ROWS, num_warps=4)


def launch_gathered(plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
                    output, lse):  # fmt: skip
    """A GatherPlan's call: the pages into the stream's K and V buffers (StreamBuffers), then
    the ragged kernel over them, kv_indptr now indexing keys as it indexed pages."""
    num_kv_indices, grid, runners, ragged = plan
    shape = (num_kv_indices, NUM_KV_HEADS, HEAD_DIM)
    k, v = _gathered.views(q.get_device(), q.dtype, (shape, shape))
    args = (k_cache, v_cache, kv_indices, k, v, num_kv_indices, k_cache.shape[0],
            k_cache.stride(0), v_cache.stride(0))  # fmt: skip
    _cached_launch(gather_pages, grid, lambda: GATHER_CONSTEXPRS, runners, q.get_device(), args)
    if "plan" not in ragged:
        ragged["plan"] = _plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse)
    launch_ragged(ragged["plan"], q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)
