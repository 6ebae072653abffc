"""One argument contract for every backend (prefill_bundle/arguments.py): each bad argument is a
ValueError naming it, raised before any launch, with the same message from Triton, CUDA and
TileLang. Without a GPU every backend still runs its checks on CPU tensors (the device check
comes last, so each case's one fault is what fails); Triton, interpreted, also takes them.
"""

import functools
import math
import re

import pytest
import torch

from prefill_bundle import REPO_ROOT, arguments
from prefill_bundle.packing import SOLUTIONS
from prefill_bundle.testing import build_solution, entry_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
BACKENDS = ("triton", "cuda", "tilelang")
SOLUTION_NAMES = {spec.name for spec in SOLUTIONS}


def tensor(*shape, dtype=F16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def transposed(*shape, dtype=F16):
    """A tensor of the given shape whose last two dimensions are swapped in memory."""
    return tensor(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def token_strided(tokens, heads, stride, dtype=F16, offset=0):
    """[tokens, heads, 128] viewed in rows of `stride` elements, from element `offset` on."""
    rows = tensor(tokens, stride + offset, dtype=dtype)
    return rows[:, offset : offset + heads * 128].unflatten(-1, (heads, 128))


def indptr(*values):
    return torch.tensor(values, dtype=I32, device=DEVICE)


def padded_args(**changes):
    args = dict(
        q=tensor(2, 3, 32, 128),
        k=tensor(2, 5, 8, 128),
        v=tensor(2, 5, 8, 128),
        causal=True,
        out=tensor(2, 3, 32, 128),
    )
    return list({**args, **changes}.values())


def ragged_args(**changes):
    args = dict(
        q=tensor(4, 32, 128, dtype=BF16),
        k=tensor(6, 8, 128, dtype=BF16),
        v=tensor(6, 8, 128, dtype=BF16),
        qo_indptr=indptr(0, 1, 4),
        kv_indptr=indptr(0, 2, 6),
        sm_scale=1.0 / math.sqrt(128),
        output=tensor(4, 32, 128, dtype=BF16),
        lse=tensor(4, 32, dtype=F32),
    )
    return list({**args, **changes}.values())


# name: (argument named in the error, changes to the valid arguments)
PADDED_ERRORS = {
    "q_float32": ("q", dict(q=tensor(2, 3, 32, 128, dtype=F32))),
    "q_rank_3": ("q", dict(q=tensor(6, 32, 128))),
    "q_16_heads": ("q", dict(q=tensor(2, 3, 16, 128), out=tensor(2, 3, 16, 128))),
    "q_head_dim_64": ("q", dict(q=tensor(2, 3, 32, 64), out=tensor(2, 3, 32, 64))),
    "q_not_a_tensor": ("q", dict(q=[[0.0]])),
    "k_dtype_differs_from_q": ("k", dict(k=tensor(2, 5, 8, 128, dtype=BF16))),
    "k_4_heads": ("k", dict(k=tensor(2, 5, 4, 128), v=tensor(2, 5, 4, 128))),
    "k_head_dim_64": ("k", dict(k=tensor(2, 5, 8, 64), v=tensor(2, 5, 8, 64))),
    "k_batch_differs_from_q": ("k", dict(k=tensor(3, 5, 8, 128), v=tensor(3, 5, 8, 128))),
    "v_seq_differs_from_k": ("v", dict(v=tensor(2, 4, 8, 128))),
    "v_rank_3": ("v", dict(v=tensor(10, 8, 128))),
    "causal_int": ("causal", dict(causal=1)),
    "causal_2": ("causal", dict(causal=2)),
    "causal_string": ("causal", dict(causal="False")),
    "causal_float_tensor": ("causal", dict(causal=torch.tensor(1.0))),
    "out_wrong_shape": ("out", dict(out=tensor(2, 4, 32, 128))),
    "out_wrong_dtype": ("out", dict(out=tensor(2, 3, 32, 128, dtype=BF16))),
    "q_head_dim_strided": ("q", dict(q=transposed(2, 3, 32, 128))),
    "k_head_dim_strided": ("k", dict(k=transposed(2, 5, 8, 128))),
    "k_batch_stride_uneven": ("k", dict(k=tensor(2, 6, 8, 128)[:, :5])),
    "out_not_contiguous": ("out", dict(out=transposed(2, 3, 32, 128))),
    "out_misaligned": ("out", dict(out=tensor(2 * 3 * 32 * 128 + 4)[4:].view(2, 3, 32, 128))),
}

RAGGED_ERRORS = {
    "q_float32": ("q", dict(q=tensor(4, 32, 128, dtype=F32))),
    "q_rank_4": ("q", dict(q=tensor(1, 4, 32, 128, dtype=BF16))),
    "q_16_heads": ("q", dict(q=tensor(4, 16, 128, dtype=BF16))),
    "q_head_dim_64": ("q", dict(q=tensor(4, 32, 64, dtype=BF16))),
    "k_dtype_differs_from_q": ("k", dict(k=tensor(6, 8, 128, dtype=F16))),
    "k_32_heads": ("k", dict(k=tensor(6, 32, 128, dtype=BF16), v=tensor(6, 32, 128, dtype=BF16))),
    "v_length_differs_from_k": ("v", dict(v=tensor(7, 8, 128, dtype=BF16))),
    "qo_indptr_int64": ("qo_indptr", dict(qo_indptr=torch.zeros(3, dtype=torch.int64))),
    "qo_indptr_list": ("qo_indptr", dict(qo_indptr=[0, 1, 4])),
    "qo_indptr_rank_2": ("qo_indptr", dict(qo_indptr=indptr(0, 1, 4)[None])),
    "qo_indptr_empty": ("qo_indptr", dict(qo_indptr=indptr(), kv_indptr=indptr())),
    "qo_indptr_without_sequence": ("qo_indptr", dict(qo_indptr=indptr(0), kv_indptr=indptr(0))),
    "kv_indptr_int64": ("kv_indptr", dict(kv_indptr=torch.zeros(3, dtype=torch.int64))),
    "kv_indptr_length_differs": ("kv_indptr", dict(kv_indptr=indptr(0, 1, 2, 6))),
    "kv_indptr_not_contiguous": ("kv_indptr", dict(kv_indptr=indptr(0, 9, 2, 9, 6, 9)[::2])),
    "sm_scale_tensor": ("sm_scale", dict(sm_scale=torch.tensor(0.1))),
    "sm_scale_string": ("sm_scale", dict(sm_scale="0.1")),
    "sm_scale_bool": ("sm_scale", dict(sm_scale=True)),
    "sm_scale_nan": ("sm_scale", dict(sm_scale=float("nan"))),
    "sm_scale_inf": ("sm_scale", dict(sm_scale=float("-inf"))),
    "output_wrong_shape": ("output", dict(output=tensor(5, 32, 128, dtype=BF16))),
    "output_wrong_dtype": ("output", dict(output=tensor(4, 32, 128, dtype=F16))),
    "lse_wrong_dtype": ("lse", dict(lse=tensor(4, 32, dtype=BF16))),
    "lse_wrong_shape": ("lse", dict(lse=tensor(4, 8, dtype=F32))),
    "lse_not_contiguous": ("lse", dict(lse=transposed(4, 32, dtype=F32))),
    "q_head_dim_strided": ("q", dict(q=transposed(4, 32, 128, dtype=BF16))),
    "q_token_stride_not_16_bytes": ("q", dict(q=token_strided(4, 32, 4100, BF16))),
    # stride 512 < 8 heads x 128: tokens would overlap
    "k_tokens_overlap": (
        "k",
        dict(k=tensor(4096, dtype=BF16).as_strided((6, 8, 128), (512, 128, 1))),
    ),
    "v_misaligned": ("v", dict(v=token_strided(6, 8, 1032, BF16, offset=4))),
}


def paged_args(page_size: int, **changes):
    """Two sequences over a 5-page cache: pages [3, 0] and [4]."""
    args = dict(
        q=tensor(4, 32, 128, dtype=BF16),
        k_cache=tensor(5, page_size, 8, 128, dtype=BF16),
        v_cache=tensor(5, page_size, 8, 128, dtype=BF16),
        qo_indptr=indptr(0, 1, 4),
        kv_indptr=indptr(0, 2, 3),
        kv_indices=indptr(3, 0, 4),
        kv_last_page_len=indptr(page_size, 1),
        sm_scale=1.0 / math.sqrt(128),
        output=tensor(4, 32, 128, dtype=BF16),
        lse=tensor(4, 32, dtype=F32),
    )
    if page_size == 1:
        del args["kv_last_page_len"]
    return list({**args, **changes}.values())


def swa_args(window_left=16, **changes):
    args = ragged_args(**changes)
    return args[:5] + [window_left] + args[5:]


def _cache(page_size, *lead, dtype=BF16):
    return tensor(*(lead or (5,)), page_size, 8, 128, dtype=dtype)


def _unaligned_page_stride(page_size):
    page = page_size * 8 * 128
    return tensor(5 * (page + 4), dtype=BF16).as_strided((5, page_size, 8, 128),
                                                         (page + 4, 1024, 128, 1))  # fmt: skip


# name: (argument, page sizes it applies to, changes(page_size))
PAGED_ERRORS = {
    "q_float32": ("q", (1, 64), lambda ps: dict(q=tensor(4, 32, 128, dtype=F32))),
    "k_cache_rank_3": ("k_cache", (1, 64), lambda ps: dict(k_cache=tensor(5 * ps, 8, 128))),
    "k_cache_other_page_size": ("k_cache", (1, 64), lambda ps: dict(k_cache=_cache(ps * 2))),
    "k_cache_dtype_differs": ("k_cache", (1, 64), lambda ps: dict(k_cache=_cache(ps, dtype=F16))),
    "v_cache_pages_differ": ("v_cache", (1, 64), lambda ps: dict(v_cache=_cache(ps, 6))),
    "kv_indptr_length_differs": ("kv_indptr", (1, 64), lambda ps: dict(kv_indptr=indptr(0, 3))),
    "kv_indices_int64": (
        "kv_indices",
        (1, 64),
        lambda ps: dict(kv_indices=torch.zeros(3, dtype=torch.int64)),
    ),
    "kv_indices_rank_2": ("kv_indices", (1, 64), lambda ps: dict(kv_indices=indptr(3, 0, 4)[None])),
    "kv_last_page_len_missing": ("kv_last_page_len", (64,), lambda ps: dict(kv_last_page_len=None)),
    "kv_last_page_len_length": (
        "kv_last_page_len",
        (64,),
        lambda ps: dict(kv_last_page_len=indptr(64, 1, 1)),
    ),
    "sm_scale_nan": ("sm_scale", (1, 64), lambda ps: dict(sm_scale=float("nan"))),
    "output_wrong_shape": (
        "output",
        (1, 64),
        lambda ps: dict(output=tensor(5, 32, 128, dtype=BF16)),
    ),
    "lse_wrong_dtype": ("lse", (1, 64), lambda ps: dict(lse=tensor(4, 32, dtype=BF16))),
    "k_cache_page_not_dense": (
        "k_cache",
        (64,),
        lambda ps: dict(k_cache=transposed(5, ps, 128, 8, dtype=BF16)),
    ),
    "v_cache_page_stride_unaligned": (
        "v_cache",
        (1, 64),
        lambda ps: dict(v_cache=_unaligned_page_stride(ps)),
    ),
}
PAGED_PARAMS = [
    pytest.param(argument, page_size, changes, id=f"{name}_ps{page_size}")
    for name, (argument, sizes, changes) in PAGED_ERRORS.items()
    for page_size in sizes
]

FP8 = arguments.FP8_DTYPE


FP8_NAMES = ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices",
             "kv_last_page_len", "k_scale", "v_scale", "sm_scale", "output", "lse")  # fmt: skip


def fp8_args(**changes):
    """The page-size-64 arguments with float8_e4m3fn caches and k_scale, v_scale before sm_scale."""
    base = paged_args(64, k_cache=_cache(64, dtype=FP8), v_cache=_cache(64, dtype=FP8))
    args = dict(zip(FP8_NAMES, base[:7] + [0.5, 1.25] + base[7:]))
    return list({**args, **changes}.values())


def _fp8_page_stride(elements):
    """An FP8 cache whose pages lie `elements` apart (a page is 65536 elements)."""
    return tensor(5 * elements, dtype=FP8).as_strided((5, 64, 8, 128), (elements, 1024, 128, 1))


# name: (argument, changes): the FP8 definition's own rules (the rest are page size 64's)
FP8_ERRORS = {
    "k_cache_bfloat16": ("k_cache", dict(k_cache=_cache(64))),
    "v_cache_float16": ("v_cache", dict(v_cache=_cache(64, dtype=F16))),
    "k_cache_e5m2": ("k_cache", dict(k_cache=_cache(64, dtype=torch.float8_e5m2))),
    "q_fp8": ("q", dict(q=tensor(4, 32, 128, dtype=FP8))),
    "output_fp8": ("output", dict(output=tensor(4, 32, 128, dtype=FP8))),
    "k_scale_nan": ("k_scale", dict(k_scale=float("nan"))),
    "k_scale_string": ("k_scale", dict(k_scale="0.5")),
    "k_scale_bool": ("k_scale", dict(k_scale=True)),
    "v_scale_inf": ("v_scale", dict(v_scale=float("inf"))),
    "v_scale_none": ("v_scale", dict(v_scale=None)),
    "k_scale_times_sm_scale_overflows": ("k_scale", dict(k_scale=1e300, sm_scale=1e300)),
    "sm_scale_nan": ("sm_scale", dict(sm_scale=float("nan"))),
    # 8 FP8 elements are 8 bytes: TMA and vector loads need 16
    "v_cache_page_stride_8_bytes": ("v_cache", dict(v_cache=_fp8_page_stride(65536 + 8))),
}

SWA_ERRORS = {
    "window_left_below_minus_1": -2,
    "window_left_float": 1.5,
    "window_left_bool": True,
    "window_left_string": "16",
    "window_left_float_tensor": torch.tensor(3.0),
    "window_left_past_int32": 2**31,
}


def contract_message(definition: str, args: list) -> str:
    """What the shared Python contract says of these arguments (devices aside)."""
    try:
        if definition == "mini":
            q, k, v, causal, out = args
            arguments.check_causal(causal)
            arguments.check_padded_shapes(q, k, v, out)
            arguments.check_layout(arguments.PADDED_NAMES, (q, k, v, out), interpreted=True)
        elif definition == "fp8kv":
            q, kc, vc, qo, kv, ids, last, k_scale, v_scale, sm_scale, output, lse = args
            arguments.fold_kv_scales(sm_scale, k_scale, v_scale)
            tensors = (q, kc, vc, qo, kv, ids, last, output, lse)
            arguments.check_paged_shapes(*tensors, 64, cache_dtype=FP8)
            arguments.check_layout(arguments.PAGED_PS64_NAMES, tensors, interpreted=True)
        elif definition.startswith("paged"):
            page_size = int(definition.removeprefix("paged_ps"))
            if page_size == 1:
                args = args[:6] + [None] + args[6:]
            q, kc, vc, qo, kv, ids, last, sm_scale, output, lse = args
            arguments.check_sm_scale(sm_scale)
            tensors = (q, kc, vc, qo, kv, ids, last, output, lse)
            arguments.check_paged_shapes(*tensors, page_size)
            names = arguments.PAGED_PS64_NAMES
            if page_size == 1:
                tensors, names = tensors[:6] + tensors[7:], arguments.PAGED_PS1_NAMES
            arguments.check_layout(names, tensors, interpreted=True)
        else:
            if definition == "swa":
                arguments.check_window_left(args[5])
                args = args[:5] + args[6:]
            q, k, v, qo, kv, sm_scale, output, lse = args
            arguments.check_sm_scale(sm_scale)
            arguments.check_ragged_shapes(q, k, v, qo, kv, output, lse)
            tensors = (q, k, v, qo, kv, output, lse)
            arguments.check_layout(arguments.RAGGED_NAMES, tensors, interpreted=True)
    except ValueError as error:
        return str(error)
    raise AssertionError("the contract accepts these arguments")


def entry(backend: str, definition: str):
    return build_solution(f"{backend}_{definition}")


def assert_rejected(backend, definition, args, argument):
    expected = contract_message(definition, args)
    assert expected.startswith(f"{argument}: expected "), expected
    with pytest.raises(ValueError) as error:
        entry(backend, definition)(*args)
    assert str(error.value).splitlines()[0] == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argument, changes", PADDED_ERRORS.values(), ids=PADDED_ERRORS.keys())
def test_padded_errors(backend, argument, changes):
    assert_rejected(backend, "mini", padded_args(**changes), argument)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argument, changes", RAGGED_ERRORS.values(), ids=RAGGED_ERRORS.keys())
def test_ragged_errors(backend, argument, changes):
    assert_rejected(backend, "ragged", ragged_args(**changes), argument)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argument, page_size, changes", PAGED_PARAMS)
def test_paged_errors(backend, argument, page_size, changes):
    assert_rejected(backend, f"paged_ps{page_size}", paged_args(page_size, **changes(page_size)),
                    argument)  # fmt: skip


@pytest.mark.parametrize("backend", [b for b in BACKENDS if f"{b}_fp8kv" in SOLUTION_NAMES])
@pytest.mark.parametrize("argument, changes", FP8_ERRORS.values(), ids=FP8_ERRORS.keys())
def test_fp8_cache_errors(backend, argument, changes):
    assert_rejected(backend, "fp8kv", fp8_args(**changes), argument)


def test_fp8_arguments_are_valid():
    """The table's base arguments pass the contract (each case's one change is its fault)."""
    with pytest.raises(AssertionError, match="accepts"):
        contract_message("fp8kv", fp8_args())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", SWA_ERRORS.values(), ids=SWA_ERRORS.keys())
def test_window_errors(backend, window):
    assert_rejected(backend, "swa", swa_args(window_left=window), "window_left")


def runs_here(backend: str) -> bool:
    return HAS_CUDA or backend == "triton"


@pytest.mark.parametrize("backend", BACKENDS)
def test_devices_are_checked(backend):
    """Off the GPU only the interpreted Triton backend takes CPU tensors."""
    if HAS_CUDA:
        other, expected = "cpu", "k: expected a tensor on cuda:0 (q's device), got one on cpu"
    elif backend == "triton":
        other, expected = "meta", "k: expected a tensor on cpu (q's device), got one on meta"
    else:
        with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor, got one on cpu"):
            entry(backend, "ragged")(*ragged_args())
        return
    args = ragged_args()
    args[1] = args[1].to(other)
    with pytest.raises(ValueError, match=rf"^{re.escape(expected)}"):
        entry(backend, "ragged")(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_on_every_call(backend):
    """Shapes are planned once per key; causal, sm_scale, layout and devices on every call."""
    if not runs_here(backend):
        pytest.skip("needs a GPU")
    run = entry(backend, "mini")
    run(*padded_args())  # plans this shape
    run(*padded_args(causal=torch.tensor(False)))  # a 0-d bool tensor is a causal flag too
    for bad in (1, 1.0, 0):
        with pytest.raises(ValueError, match=r"^causal: expected a Python bool"):
            run(*padded_args(causal=bad))
    with pytest.raises(ValueError, match=r"^out: expected a contiguous tensor"):
        run(*padded_args(out=transposed(2, 3, 32, 128)))

    run = entry(backend, "ragged")
    run(*ragged_args())
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite float"):
        run(*ragged_args(sm_scale=None))
    with pytest.raises(ValueError, match=r"^lse: expected a contiguous tensor"):
        run(*ragged_args(lse=transposed(4, 32, dtype=F32)))


def planned_error_cases(backend: str) -> list:
    """(definition, valid arguments, changes -> arguments, its error cases) for every planned
    definition the backend serves."""
    cases = [
        ("mini", padded_args(), padded_args, PADDED_ERRORS.values()),
        ("ragged", ragged_args(), ragged_args, RAGGED_ERRORS.values()),
        ("swa", swa_args(), swa_args, RAGGED_ERRORS.values()),
    ]
    for page_size in (1, 64):
        errors = [(arg, make(page_size)) for arg, sizes, make in PAGED_ERRORS.values()
                  if page_size in sizes]  # fmt: skip
        cases.append((f"paged_ps{page_size}", paged_args(page_size),
                      functools.partial(paged_args, page_size), errors))  # fmt: skip
    if f"{backend}_fp8kv" in SOLUTION_NAMES:
        cases.append(("fp8kv", fp8_args(), fp8_args, FP8_ERRORS.values()))
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_once_the_shape_is_planned(backend):
    """Plans are keyed by part of the arguments (TileLang's by what its kernels' mains do not
    check themselves). After a valid call has planned its shape, each error case still raises
    the contract's ValueError, and before any launch: an output that the case leaves alone
    stays NaN."""
    for definition, valid, arguments_with, errors in planned_error_cases(backend):
        entry(backend, definition)(*valid)
        # The padded definition's out is its last argument; the others end in output, lse.
        name, index = ("out", -1) if definition == "mini" else ("output", -2)
        for argument, changes in errors:
            args = arguments_with(**changes)
            output = args[index]
            if name not in changes:
                output.fill_(float("nan"))
            assert_rejected(backend, definition, args, argument)
            if name not in changes:
                assert bool(output.isnan().all()), f"{definition}: {argument} launched"


@pytest.mark.parametrize("name", ["triton_mini", "triton_ragged"])
def test_cpu_tensors_are_rejected_without_the_interpreter(name, monkeypatch):
    module = entry_module(name)
    monkeypatch.setattr(module, "INTERPRET", False)
    args = padded_args() if name == "triton_mini" else ragged_args()
    args = [x.cpu() if isinstance(x, torch.Tensor) else x for x in args]
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor"):
        build_solution(name)(*args)


VALIDATION_ERRORS = {
    "qo_not_starting_at_0": (indptr(1, 1, 4), indptr(0, 2, 6), "qo_indptr[0] = 1"),
    "qo_decreasing": (indptr(0, 5, 4), indptr(0, 2, 6), "qo_indptr[2] = 4 < qo_indptr[1] = 5"),
    "kv_last_value": (indptr(0, 1, 4), indptr(0, 2, 7), "kv_indptr[2] = 7"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qo, kv, position", VALIDATION_ERRORS.values(), ids=VALIDATION_ERRORS)
def test_validation_mode_names_the_first_bad_position(backend, qo, kv, position, monkeypatch):
    """PREFILL_BUNDLE_VALIDATE=1 checks indptr values on the host before every launch."""
    if not runs_here(backend):
        pytest.skip("needs a GPU")
    run = entry(backend, "ragged")
    if backend != "cuda":  # Python solutions read the switch once, at import
        module = entry_module(run)
        monkeypatch.setattr(module, "VALIDATE", True)
    else:
        monkeypatch.setenv("PREFILL_BUNDLE_VALIDATE", "1")
    pattern = rf"^\w+_indptr: expected non-decreasing .*{re.escape(position)}"
    with pytest.raises(ValueError, match=pattern):
        run(*ragged_args(qo_indptr=qo, kv_indptr=kv))


class _OnDevice:
    """A tensor stand-in on GPU `index`: check_placement's GPU path (one pass of cheap reads,
    then the rules one by one for the message) runs here without a GPU."""

    def __init__(self, index=0, ptr=1024, contiguous=True):
        self.index, self.ptr, self.contiguous = index, ptr, contiguous
        self.device = f"cuda:{index}"

    def get_device(self):
        return self.index

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return self.contiguous

    def stride(self):
        return (1, 128)


@pytest.mark.parametrize(
    "position, changes, message",
    [
        (None, {}, None),
        (1, dict(ptr=1032), "k: expected a 16-byte aligned data pointer, got 0x408"),
        (5, dict(index=1), "output: expected a tensor on cuda:0 (q's device), got one on cuda:1"),
        (6, dict(contiguous=False), "lse: expected a contiguous tensor"),
        (1, dict(contiguous=False), None),  # k: check_layout's stride rules, not contiguity
    ],
)
def test_placement_on_a_gpu(position, changes, message):
    tensors = [_OnDevice() for _ in arguments.RAGGED_NAMES]
    if position is not None:
        tensors[position] = _OnDevice(**changes)
    if message is None:
        assert arguments.check_placement(arguments.RAGGED_NAMES, tuple(tensors)) is None
    else:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            arguments.check_placement(arguments.RAGGED_NAMES, tuple(tensors))


def test_page_size_1_gathers_pages_of_prefill_like_batches(monkeypatch):
    """gathers_pages (the Python entries; entry_launch.cuh's copy for CUDA): from 384 query rows
    a sequence on average, while the two buffers stay within 256 MiB; the environment forces
    either way. The committed page size 1 workloads: the 2K chunks, fresh prompts and the mixed
    batch (440 a sequence) gather, the prefix hits (256) and single-token rows do not."""
    gathers = arguments.gathers_pages
    monkeypatch.delenv("PREFILL_BUNDLE_PAGE_GATHER", raising=False)
    assert gathers(2048, 1, 8131, 2) and gathers(2048 * 4, 4, 59729, 2)
    assert gathers(2642, 6, 23288, 2)  # mixed_batch
    assert not gathers(2048, 8, 37907, 2)  # prefix_cache_hits_8x256
    assert not gathers(16, 16, 136546, 2)  # single_token_rows_16
    assert gathers(384, 1, 65536, 2) and not gathers(384, 1, 65537, 2)  # 256 MiB of K and V
    assert not gathers(383, 1, 100, 2) and not gathers(5, 0, 0, 2)
    monkeypatch.setenv("PREFILL_BUNDLE_PAGE_GATHER", "1")
    assert gathers(1, 1, 1, 2) and gathers(1, 1, 1 << 30, 2) and not gathers(1, 1, 0, 2)
    monkeypatch.setenv("PREFILL_BUNDLE_PAGE_GATHER", "0")
    assert not gathers(2048, 1, 8131, 2)


def test_cuda_entry_gathers_pages_by_the_same_rule():
    """entry_launch.cuh re-states gathers_pages in C++ (no Python in the CUDA entry): its two
    bounds must be arguments.py's."""
    source = (REPO_ROOT / "solutions/gqa_ragged/cuda/entry_launch.cuh").read_text()
    assert f"kMinQueries = {arguments.PAGE_GATHER_MIN_QUERIES}," in source
    assert f"kMaxBytes = int64_t({arguments.PAGE_GATHER_MAX_BYTES >> 20}) << 20;" in source
    assert arguments.PAGE_GATHER_MAX_BYTES % (1 << 20) == 0
    assert source.count('"PREFILL_BUNDLE_PAGE_GATHER"') == 1


def test_stream_buffers_on_the_cpu_are_fresh_each_call():
    buffers = arguments.StreamBuffers()
    a = buffers.views(-1, torch.float16, ((3, 8, 128), (3, 8, 128)))
    b = buffers.views(-1, torch.float16, ((3, 8, 128), (3, 8, 128)))
    assert [v.shape for v in a] == [(3, 8, 128), (3, 8, 128)]
    assert a[0].data_ptr() != b[0].data_ptr() and not buffers
    assert a[1].data_ptr() == a[0].data_ptr() + 3 * 8 * 128 * 2  # one after the other


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_stream_buffers_are_kept_per_stream_and_grown():
    buffers = arguments.StreamBuffers()
    shapes = ((4, 32, 128), (4, 32))
    first = buffers.views(0, torch.float32, shapes)
    assert buffers.views(0, torch.float32, shapes) is first  # same shapes: the same views
    smaller = buffers.views(0, torch.float32, ((2, 32, 128), (2, 32)))
    assert smaller[0].data_ptr() == first[0].data_ptr()  # fits: the same buffer
    assert smaller[1].data_ptr() == first[0].data_ptr() + 2 * 32 * 128 * 4
    grown = buffers.views(0, torch.float32, ((64, 32, 128), (64, 32)))
    assert grown[0].numel() == 64 * 32 * 128
    other = buffers.views(0, torch.bfloat16, shapes)  # another dtype: another buffer
    assert other[0].dtype == torch.bfloat16
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        theirs = buffers.views(0, torch.bfloat16, shapes)
        assert theirs[0].data_ptr() != other[0].data_ptr()  # a stream of its own
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = buffers.views(0, torch.bfloat16, shapes)
        assert captured[0].data_ptr() not in (theirs[0].data_ptr(), other[0].data_ptr())
    assert len(buffers) == 2
