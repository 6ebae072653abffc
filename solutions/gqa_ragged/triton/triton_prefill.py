"""Triton GQA prefill attention: the entry points of both definitions, their argument checks and
launch plans. The kernel is in attention_kernel.py.

flashinfer-bench times the whole call, so run_*() only builds a key from shapes and dtypes, looks
up the launch plan cached under it (grid and block sizes, never data pointers or indptr values),
checks devices and layout, and launches once. Nothing here reads a device tensor: the ragged
lengths stay on the GPU and the grid is sized from total_q and the batch size alone.

Layout: every tensor must be contiguous (what flashinfer-bench passes). q, k, v and the outputs
may be float16 or bfloat16 (both definitions), all of one dtype; lse is float32.
"""

import functools
import inspect
import math
import os

import torch
import triton

from .attention_kernel import gqa_prefill_fwd

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP_SIZE = NUM_HEADS // NUM_KV_HEADS
LOG2_E = 1.0 / math.log(2.0)
PADDED_QK_SCALE = LOG2_E / math.sqrt(HEAD_DIM)  # the padded definition's fixed softmax scale
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests only).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_padded_plans = {}
_ragged_plans = {}
# The kernel's constexpr parameters, in signature order, after its 11 run-time arguments.
_CONSTEXPRS = tuple(inspect.signature(gqa_prefill_fwd.fn).parameters)[11:]


def _launch(grid, meta, runners, args) -> None:
    """gqa_prefill_fwd[grid](*args, **meta), in a fraction of the host time once warm.

    The JIT binds and specializes every argument on every call (22-31 us of host time a call on
    the H100 machine, more than a short prompt's kernel), so the compiled kernel it returns is
    kept in the plan's `runners`, per device, and launched directly while the pointers keep the
    16-byte alignment it was specialized on. The plan fixes everything else the compiled kernel
    depends on (dtypes, which arguments are None, the constexprs; the integers are not
    specialized). Other pointers, and the interpreter, take the JIT path."""
    aligned = not INTERPRET and all(a is None or a.data_ptr() % 16 == 0 for a in args[:7])
    if aligned:
        device = args[0].get_device()
        runner = runners.get(device)
        if runner is not None:
            runner(*args)
            return
    constexprs = dict(NUM_HEADS=NUM_HEADS, NUM_KV_HEADS=NUM_KV_HEADS, HEAD_DIM=HEAD_DIM, **meta)
    compiled = gqa_prefill_fwd[grid](*args, **constexprs)
    if aligned:
        launch = compiled[(grid[0], grid[1], 1)]
        values = tuple(constexprs[name] for name in _CONSTEXPRS)
        runners[device] = lambda *run_args: launch(*run_args, *values)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100 SXM's; only the interpreter gets here
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_config(tokens_per_seq: float, slots, num_sms: int, causal: bool) -> dict:
    """Block sizes from the shape alone; slots(T) is the grid's first axis at T tokens per tile.

    The four query heads of a KV group always share a tile (HEADS_PER_TILE = 4): K/V tiles are
    loaded once for the group, a short sequence still fills a tl.dot's rows, and the causal
    diagonal of a 128-row block spans 32 tokens instead of 128. Two paired 128-row blocks per
    tile (ROW_BLOCKS = 2) overlap softmax with the tensor cores. Kernel time on the H100 against
    FlashInfer (issue notes; scripts/tune_triton.py): paired blocks 0.82-0.87 vs 0.74-0.76 for
    one on the big shapes, 0.92 vs 0.81 on 4x512 non-causal, 0.76 vs 0.72-0.74 on causal
    batches of 4-8K tokens; below about four waves of 32-token tiles, 64-row tiles win (4x512
    causal: 0.82 vs 0.77). BLOCK_N = 128 spills.
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
    return small_tiles if tokens_per_seq <= 128 or waves(32) < 4 else paired


def _tokens_per_tile(meta: dict) -> int:
    return meta["ROW_BLOCKS"] * meta["BLOCK_M"] // meta["HEADS_PER_TILE"]


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"a 0-d {dtype} tensor" if x.dim() == 0 else f"{dtype} {list(x.shape)}"
    return f"{type(x).__name__} {x!r:.60}"


def _expect(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {_describe(got)}")


def _check_placement(names: tuple, tensors: tuple) -> None:
    """Every call: one device (a GPU unless interpreted) and the contiguous layout the kernel
    addresses. A few attribute reads; shapes and dtypes are checked once per plan."""
    first = tensors[0]
    index = first.get_device()  # -1 off the GPU; much cheaper to read than .device.type
    if index < 0 and not INTERPRET:
        raise ValueError(f"{names[0]}: expected a CUDA tensor, got one on {first.device}")
    for name, tensor in zip(names, tensors):
        if tensor.get_device() != index or (index < 0 and tensor.device != first.device):
            raise ValueError(
                f"{name}: expected a tensor on {first.device}, got one on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tensor.stride()}")


def _plan_padded(q, k, v, causal, out, config=None) -> tuple:
    """Check shapes and dtypes (once per shape) and plan the launch."""
    is_tensor = isinstance(q, torch.Tensor)
    _expect(
        is_tensor and q.dtype in HALF_DTYPES and q.dim() == 4
        and tuple(q.shape[2:]) == (NUM_HEADS, HEAD_DIM),
        "q",
        f"float16 or bfloat16 [batch, seq_q, {NUM_HEADS}, {HEAD_DIM}]",
        q,
    )  # fmt: skip
    batch, seq_q = q.shape[0], q.shape[1]
    dtype = str(q.dtype).removeprefix("torch.")
    for name, x in (("k", k), ("v", v)):
        _expect(
            isinstance(x, torch.Tensor) and x.dtype == q.dtype and x.dim() == 4
            and x.shape[0] == batch and tuple(x.shape[2:]) == (NUM_KV_HEADS, HEAD_DIM),
            name,
            f"{dtype} [{batch}, seq_kv, {NUM_KV_HEADS}, {HEAD_DIM}] (q's dtype and batch)",
            x,
        )  # fmt: skip
    _expect(v.shape == k.shape, "v", f"k's shape {list(k.shape)}", v)
    _expect(type(causal) in (bool, int) and causal in (0, 1), "causal", "a Python bool", causal)
    _expect(
        isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape,
        "out",
        f"{dtype} {list(q.shape)} (q's dtype and shape)",
        out,
    )
    _check_placement(("q", "k", "v", "out"), (q, k, v, out))
    seq_kv = k.shape[1]
    meta = dict(
        config
        or _launch_config(
            seq_q, lambda t: batch * triton.cdiv(seq_q, t), _sm_count(q.device), bool(causal)
        )
    )
    meta.setdefault("ROW_BLOCKS", 1)
    grid = (batch * triton.cdiv(seq_q, _tokens_per_tile(meta)), NUM_HEADS // meta["HEADS_PER_TILE"])
    meta.update(CAUSAL=bool(causal), RAGGED=False, WRITE_LSE=False, INTERPRETED=INTERPRET)
    return grid, meta, batch, seq_q, seq_kv, {}


def _plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse, config=None) -> tuple:
    """Check shapes and dtypes (once per shape) and plan the launch. indptr values stay unread:
    that total_q and total_kv match indptr[-1] is the caller's contract."""
    _expect(
        isinstance(q, torch.Tensor) and q.dtype in HALF_DTYPES and q.dim() == 3
        and tuple(q.shape[1:]) == (NUM_HEADS, HEAD_DIM),
        "q",
        f"bfloat16 or float16 [total_q, {NUM_HEADS}, {HEAD_DIM}]",
        q,
    )  # fmt: skip
    total_q = q.shape[0]
    dtype = str(q.dtype).removeprefix("torch.")
    for name, x in (("k", k), ("v", v)):
        _expect(
            isinstance(x, torch.Tensor) and x.dtype == q.dtype and x.dim() == 3
            and tuple(x.shape[1:]) == (NUM_KV_HEADS, HEAD_DIM),
            name,
            f"{dtype} [total_kv, {NUM_KV_HEADS}, {HEAD_DIM}] (q's dtype)",
            x,
        )  # fmt: skip
    _expect(v.shape == k.shape, "v", f"k's shape {list(k.shape)}", v)
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        _expect(
            isinstance(x, torch.Tensor) and x.dtype == torch.int32 and x.dim() == 1
            and x.shape[0] >= 1,
            name,
            "int32 [batch + 1]",
            x,
        )  # fmt: skip
    _expect(
        kv_indptr.shape == qo_indptr.shape,
        "kv_indptr",
        f"int32 {list(qo_indptr.shape)} (qo_indptr's shape)",
        kv_indptr,
    )
    batch = qo_indptr.shape[0] - 1
    if batch == 0 and (total_q > 0 or k.shape[0] > 0):
        raise ValueError(
            f"qo_indptr: expected at least one sequence for {total_q} query and {k.shape[0]} "
            "key rows, got int32 [1]"
        )
    _expect(
        isinstance(output, torch.Tensor) and output.dtype == q.dtype and output.shape == q.shape,
        "output",
        f"{dtype} {list(q.shape)} (q's dtype and shape)",
        output,
    )
    _expect(
        isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
        and tuple(lse.shape) == (total_q, NUM_HEADS),
        "lse",
        f"float32 [{total_q}, {NUM_HEADS}]",
        lse,
    )  # fmt: skip
    _check_placement(
        ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse"),
        (q, k, v, qo_indptr, kv_indptr, output, lse),
    )
    tokens_per_seq = total_q / max(batch, 1)
    meta = dict(
        config
        or _launch_config(
            tokens_per_seq, lambda t: total_q // t + batch, _sm_count(q.device), causal=True
        )
    )
    meta.setdefault("ROW_BLOCKS", 1)
    # total_q // T + batch slots cover every sequence's tiles (see _find_sequence in the kernel).
    grid = (total_q // _tokens_per_tile(meta) + batch, NUM_HEADS // meta["HEADS_PER_TILE"])
    meta.update(CAUSAL=True, RAGGED=True, WRITE_LSE=True, INTERPRETED=INTERPRET)
    return grid, meta, batch, total_q, {}


def run_padded(q, k, v, causal, out):
    try:
        key = (q.shape, k.shape, v.shape, out.shape, q.dtype, k.dtype, v.dtype, out.dtype, causal)
        plan = _padded_plans.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable causal
        key = plan = None
    if plan is None:
        plan = _plan_padded(q, k, v, causal, out)  # raises ValueError on a bad argument
        if key is not None:
            _padded_plans[key] = plan
    else:
        _check_placement(("q", "k", "v", "out"), (q, k, v, out))
    launch_padded(plan, q, k, v, out)


def launch_padded(plan, q, k, v, out):
    grid, meta, batch, seq_q, seq_kv, runners = plan
    if grid[0] == 0:
        return  # no query row
    args = (q, k, v, out, None, None, None, batch, seq_q, seq_kv, PADDED_QK_SCALE)
    _launch(grid, meta, runners, args)


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    try:
        key = (
            q.shape, k.shape, v.shape, qo_indptr.shape, kv_indptr.shape, output.shape, lse.shape,
            q.dtype, k.dtype, v.dtype, qo_indptr.dtype, kv_indptr.dtype, output.dtype, lse.dtype,
        )  # fmt: skip
        plan = _ragged_plans.get(key)
    except AttributeError:  # not a tensor
        key = plan = None
    if plan is None:
        plan = _plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse)
        if key is not None:
            _ragged_plans[key] = plan
    else:
        _check_placement(
            ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse"),
            (q, k, v, qo_indptr, kv_indptr, output, lse),
        )
    if type(sm_scale) is not float:
        _expect(
            type(sm_scale) is int or isinstance(sm_scale, float),
            "sm_scale",
            "a Python float",
            sm_scale,
        )
    if not 0 < sm_scale < math.inf:  # nan, inf, zero or negative
        _expect(math.isfinite(sm_scale), "sm_scale", "a finite float", sm_scale)
        # The kernel takes the row max of the unscaled logits, which is the max of the scaled
        # ones only for a positive scale: softmax(s q.k) = softmax(|s| (-q).k), and s = 0 gives
        # softmax(1 * 0.k); both exact.
        q, sm_scale = (-q, -sm_scale) if sm_scale < 0 else (torch.zeros_like(q), 1.0)
    launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)


def launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    grid, meta, batch, total_q, runners = plan
    if total_q == 0:
        return  # no query row: nothing to write
    args = (q, k, v, output, lse, qo_indptr, kv_indptr, batch, 0, 0, sm_scale * LOG2_E)
    _launch(grid, meta, runners, args)
