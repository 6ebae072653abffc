"""The CUDA paged solutions (cuda_paged_ps64, cuda_paged_ps1) beyond the shared matrix.

Without a GPU: both build through flashinfer-bench and raise arguments.py's ValueError, message
for message, on CPU tensors (every check but the device one, which comes last, passes or fails
as it would on the GPU).

On a GPU (pytest -m gpu tests/test_cuda_paged.py), against the fp32 reference with NaN in every
cache slot no sequence owns: sequences ending at every position around page and 128-key tile
boundaries (the Hopper kernel's V tail zeroing, a tile's missing second page), both kernels (a
negative sm_scale runs the portable one), caches that are views of FlashInfer's combined
[num_pages, 2, page_size, 8, 128] cache (page strides of two and three pages, unequal for K and
V), a cache without pages, and the validation mode's messages. The shared matrix
(tests/test_solutions.py -k cuda_paged) and the malformed page tables (tests/test_malformed.py
-k cuda_paged, scripts/sanitize_malformed.py) cover the rest.
"""

import math

import pytest
import torch

from prefill_bundle import arguments
from prefill_bundle.testing import (
    PagedCase,
    build_solution,
    check_outputs,
    make_inputs,
    poisoned_outputs,
    reference_outputs,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")


@pytest.fixture(scope="module")
def entry_points():
    """{page size: the packed solution}, built by flashinfer-bench (tests/conftest.py names the
    arch when there is no GPU)."""
    try:
        return {64: build_solution("cuda_paged_ps64"), 1: build_solution("cuda_paged_ps1")}
    except Exception as error:  # noqa: BLE001 - the reason goes into the skip
        if "load" in str(error).lower() and not HAS_CUDA:
            pytest.skip(f"the built module does not load without a GPU here: {error}")
        raise


# ---- Argument errors (CPU tensors) ----------------------------------------------------------


def tensor(*shape, dtype=BF16):
    return torch.zeros(*shape, dtype=dtype)


def indices(*values):
    return torch.tensor(values, dtype=I32)


def paged_args(page_size, **changes):
    """Valid CPU arguments: 2 sequences of 3 and 6 query rows over 4 pages."""
    args = dict(
        q=tensor(9, 32, 128),
        k_cache=tensor(5, page_size, 8, 128),
        v_cache=tensor(5, page_size, 8, 128),
        qo_indptr=indices(0, 3, 9),
        kv_indptr=indices(0, 1, 4),
        kv_indices=indices(4, 0, 2, 1),
        kv_last_page_len=indices(7, 64) if page_size == 64 else None,
        sm_scale=1.0 / math.sqrt(128),
        output=tensor(9, 32, 128),
        lse=tensor(9, 32, dtype=F32),
    )
    args.update(changes)
    if page_size == 1:
        args.pop("kv_last_page_len")
    return list(args.values())


def python_checks(page_size, args):
    """The contract's checks in the CUDA entry's order (the device check last)."""
    if page_size == 1:
        args = args[:6] + [None] + args[6:]
    (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last, sm_scale, output, lse) = args
    tensors = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last, output, lse)
    arguments.check_paged_shapes(*tensors, page_size)
    arguments.check_sm_scale(sm_scale)
    names = arguments.PAGED_PS64_NAMES if page_size == 64 else arguments.PAGED_PS1_NAMES
    arguments.check_layout(names, tuple(x for x in tensors if x is not None))


def error_message(function, args) -> str:
    with pytest.raises(ValueError) as error:
        function(*args)
    return str(error.value)


def combined_cache_half(page_size, half, pages=5, parts=2, dtype=BF16):
    """Half `half` of a [pages, parts, page_size, 8, 128] cache: pages parts pages apart."""
    return tensor(pages, parts, page_size, 8, 128, dtype=dtype)[:, half]


def page_strided(page_size, stride, pages=5):
    size = (pages - 1) * stride + page_size * 1024
    return torch.zeros(size, dtype=BF16).as_strided(
        (pages, page_size, 8, 128), (stride, 1024, 128, 1)
    )


# Each case changes the valid arguments of both page sizes (ps64: only for page size 64); {} and
# the layouts the kernels take (combined caches) fail only at the device check.
PAGED_CASES = {
    "valid": {},
    "q_float16": dict(q=tensor(9, 32, 128, dtype=F16)),
    "q_4d": dict(q=tensor(1, 9, 32, 128)),
    "q_list": dict(q=[[0.0]]),
    "k_cache_float16": lambda ps: dict(k_cache=tensor(5, ps, 8, 128, dtype=F16)),
    "k_cache_page_size": lambda ps: dict(k_cache=tensor(5, 2 * ps, 8, 128)),
    "k_cache_3d": dict(k_cache=tensor(5, 8, 128)),
    "k_cache_none": dict(k_cache=None),
    "v_cache_pages": lambda ps: dict(v_cache=tensor(4, ps, 8, 128)),
    "v_cache_4_heads": lambda ps: dict(v_cache=tensor(5, ps, 4, 128)),
    "qo_indptr_int64": dict(qo_indptr=torch.tensor([0, 3, 9])),
    "qo_indptr_empty": dict(qo_indptr=indices()),
    "qo_indptr_list": dict(qo_indptr=[0, 3, 9]),
    "kv_indptr_size": dict(kv_indptr=indices(0, 4)),
    "kv_indptr_int64": dict(kv_indptr=torch.tensor([0, 1, 4])),
    "kv_indices_int64": dict(kv_indices=torch.tensor([4, 0, 2, 1])),
    "kv_indices_2d": dict(kv_indices=indices(4, 0, 2, 1)[None]),
    "kv_last_page_len_size": ("ps64", dict(kv_last_page_len=indices(7, 64, 1))),
    "kv_last_page_len_int64": ("ps64", dict(kv_last_page_len=torch.tensor([7, 64]))),
    "kv_last_page_len_not_contiguous": ("ps64", dict(kv_last_page_len=indices(7, 0, 64, 0)[::2])),
    "no_sequence_with_pages": dict(
        q=tensor(0, 32, 128),
        qo_indptr=indices(0),
        kv_indptr=indices(0),
        output=tensor(0, 32, 128),
        lse=tensor(0, 32, dtype=F32),
    ),
    "no_sequence_with_rows": dict(qo_indptr=indices(0), kv_indptr=indices(0), kv_indices=indices()),
    "output_float16": dict(output=tensor(9, 32, 128, dtype=F16)),
    "output_rows": dict(output=tensor(8, 32, 128)),
    "lse_bfloat16": dict(lse=tensor(9, 32)),
    "lse_not_contiguous": dict(lse=tensor(32, 9, dtype=F32).t()),
    "sm_scale_nan": dict(sm_scale=float("nan")),
    "sm_scale_str": dict(sm_scale="0.1"),
    "sm_scale_tensor": dict(sm_scale=torch.tensor(0.1)),
    "q_fused_qkv": dict(q=tensor(9, 6144)[:, :4096].unflatten(-1, (32, 128))),
    "q_token_stride_4100": dict(q=tensor(9, 4100)[:, :4096].unflatten(-1, (32, 128))),
    "k_cache_combined": lambda ps: dict(k_cache=combined_cache_half(ps, 0)),
    "v_cache_combined_three_parts": lambda ps: dict(v_cache=combined_cache_half(ps, 2, parts=3)),
    "k_cache_heads_not_dense": lambda ps: dict(k_cache=tensor(5, ps, 128, 8).transpose(2, 3)),
    "k_cache_page_stride_not_16_bytes": lambda ps: dict(k_cache=page_strided(ps, ps * 1024 + 4)),
    "v_cache_pages_overlap": lambda ps: dict(v_cache=page_strided(ps, ps * 1024 - 8)),
    "k_cache_one_page_any_stride": lambda ps: dict(
        k_cache=page_strided(ps, 4, pages=1),
        v_cache=tensor(1, ps, 8, 128),
        kv_indices=indices(0, 0, 0, 0),
    ),
    "kv_indices_misaligned": dict(kv_indices=indices(0, 4, 0, 2, 1)[1:]),
    "output_misaligned": dict(output=tensor(9 * 4096 + 1)[1:].view(9, 32, 128)),
}


def paged_cases() -> list:
    params = []
    for name, case in PAGED_CASES.items():
        only = None
        if isinstance(case, tuple):
            only, case = case
        for page_size in (64, 1):
            if only == "ps64" and page_size != 64:
                continue
            changes = case(page_size) if callable(case) else case
            params.append(pytest.param(page_size, changes, id=f"ps{page_size}-{name}"))
    return params


@pytest.mark.parametrize("page_size,changes", paged_cases())
def test_paged_errors_are_the_contracts(entry_points, page_size, changes):
    args = paged_args(page_size, **changes)
    expected = error_message(lambda *a: python_checks(page_size, list(a)), args)
    assert error_message(entry_points[page_size], args) == expected


def test_a_few_paged_messages_in_full(entry_points):
    """The table above compares with arguments.py; these pin the text itself."""
    cache = page_strided(64, 64 * 1024 - 8)
    assert error_message(entry_points[64], paged_args(64, k_cache=cache)) == (
        "k_cache: expected pages dense inside and a page stride that is a multiple of 8 "
        "elements and at least one page, got bfloat16 [5, 64, 8, 128] with strides "
        "[65528, 1024, 128, 1]"
    )
    assert error_message(entry_points[1], paged_args(1, kv_indices=torch.tensor([1]))) == (
        "kv_indices: expected int32 [num_kv_indices], got int64 [1]"
    )
    assert error_message(entry_points[64], paged_args(64)) == (
        "q: expected a CUDA tensor, got one on cpu"
    )
    # arguments.check_paged_shapes takes None for "no kv_last_page_len" (page size 1) at any
    # page size; the page-size-64 entry needs the tensor.
    assert error_message(entry_points[64], paged_args(64, kv_last_page_len=None)) == (
        "kv_last_page_len: expected int32 [2], got NoneType None"
    )


# ---- On the GPU ------------------------------------------------------------------------------


def run(entry_points, page_size, inputs):
    outputs = poisoned_outputs(None, inputs)
    entry_points[page_size](*inputs, *outputs)
    torch.cuda.synchronize()
    return outputs


def check_case(entry_points, case, inputs=None, seed=0):
    inputs = inputs or make_inputs(case, DEVICE, seed)
    check_outputs(run(entry_points, case.page_size, inputs), reference_outputs(case, inputs))


# Sequences ending at every position around the pages and 128-key tiles of the Hopper kernel:
# a tile's last keys in its first page (the second page missing: zeros from TMA), in its second
# page, a page's first and last slot; queries fewer, as many and more than keys.
BOUNDARY_KV = (1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 320, 383)
BOUNDARY_Q = tuple((kv, 37, kv + 5)[i % 3] for i, kv in enumerate(BOUNDARY_KV))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_every_last_page_and_tile_end(entry_points, page_size, dtype):
    check_case(entry_points, PagedCase(BOUNDARY_Q, BOUNDARY_KV, page_size, dtype))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("sm_scale", [-0.3, 0.0])
def test_portable_kernel_on_the_gpu(entry_points, page_size, sm_scale):
    """A softmax scale <= 0 runs the portable kernel (mma.sync, cp.async rows with page lookups)
    on any build; the same boundaries, NaN in unused slots."""
    check_case(entry_points, PagedCase(BOUNDARY_Q, BOUNDARY_KV, page_size, sm_scale=sm_scale))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
def test_persistent_schedule_with_shared_pages(entry_points, page_size):
    """Many more work items than SMs (the persistent kernel's counter), pages shared by prefix,
    run twice on one stream (the counter resets itself)."""
    case = PagedCase(
        (700, 1, 300, 129) * 3,
        (1500, 1400, 900, 129) * 3,
        page_size,
        shared_prefix=(1024, 1024, 0, 0) * 3,
    )
    inputs = make_inputs(case, DEVICE, seed=5)
    expected = reference_outputs(case, inputs)
    for _ in range(2):
        check_outputs(run(entry_points, page_size, inputs), expected)


def as_combined_cache(k_cache, v_cache, k_parts=2, v_parts=2):
    """The same caches as halves of FlashInfer's [num_pages, 2, page_size, 8, 128] layout (k and
    v with page strides of k_parts and v_parts pages), NaN between the pages."""
    k_buffer = torch.full(
        (k_cache.shape[0], k_parts, *k_cache.shape[1:]),
        float("nan"),
        dtype=k_cache.dtype,
        device=k_cache.device,
    )
    v_buffer = (
        k_buffer
        if v_parts == k_parts
        else torch.full(
            (v_cache.shape[0], v_parts, *v_cache.shape[1:]),
            float("nan"),
            dtype=v_cache.dtype,
            device=v_cache.device,
        )
    )
    k_view, v_view = k_buffer[:, 0], v_buffer[:, v_parts - 1]
    k_view.copy_(k_cache)
    v_view.copy_(v_cache)
    return k_view, v_view


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("parts", [(2, 2), (3, 2)], ids=["combined", "unequal_strides"])
def test_caches_with_page_strides(entry_points, page_size, parts):
    case = PagedCase((200, 7, 64), (333, 520, 64), page_size, shared_prefix=(128, 128, 0))
    inputs = make_inputs(case, DEVICE, seed=2)
    expected = reference_outputs(case, inputs)
    inputs[1], inputs[2] = as_combined_cache(inputs[1], inputs[2], *parts)
    assert inputs[1].stride(0) != inputs[1][0].numel()
    check_outputs(run(entry_points, page_size, inputs), expected)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
def test_cache_without_pages(entry_points, page_size):
    """num_pages = 0: sequences without pages give zero rows and lse -inf; a sequence listing
    pages (necessarily out of range) gives NaN rows (each of its 30 rows sees one), and nothing
    is read."""
    q = torch.randn(50, 32, 128, device=DEVICE).to(BF16)
    cache = torch.empty(0, page_size, 8, 128, dtype=BF16, device=DEVICE)
    qo_indptr = torch.tensor([0, 20, 50], dtype=I32, device=DEVICE)
    listed = [0, 3] if page_size == 64 else list(range(40))  # 69 or 40 keys
    for ids, nan_rows in (([], 0), (listed, 30)):
        kv_indptr = torch.tensor([0, 0, len(ids)], dtype=I32, device=DEVICE)
        inputs = [
            q,
            cache,
            cache,
            qo_indptr,
            kv_indptr,
            torch.tensor(ids, dtype=I32, device=DEVICE),
        ]
        if page_size == 64:
            inputs.append(torch.tensor([1, 5], dtype=I32, device=DEVICE))
        output, lse = run(entry_points, page_size, inputs + [0.1])
        assert (output[:20] == 0).all() and (lse[:20] == float("-inf")).all()
        assert output[20:].isnan().all(-1).all(-1).sum() == nan_rows
        assert lse[20:].isnan().all(-1).sum() == nan_rows
        if nan_rows == 0:
            assert (output[20:] == 0).all() and (lse[20:] == float("-inf")).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 1])
def test_validation_mode_messages(entry_points, page_size, monkeypatch):
    """PREFILL_BUNDLE_VALIDATE=1 (read on every call): page ids and last-page lengths checked on
    the host with arguments.check_paged_values' messages."""
    case = PagedCase((5, 9), (70, 130), page_size)
    inputs = make_inputs(case, DEVICE, seed=1)
    num_pages = inputs[1].shape[0]
    bad = [
        ("kv_indices", lambda x: x.__setitem__(1, num_pages)),
        ("kv_indptr", lambda x: x.__setitem__(1, 10**6)),
    ]
    if page_size == 64:
        bad.append(("kv_last_page_len", lambda x: x.__setitem__(0, 65)))
    names = ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices"]
    names += ["kv_last_page_len"] if page_size == 64 else []
    monkeypatch.setenv("PREFILL_BUNDLE_VALIDATE", "1")
    for name, spoil in bad:
        spoiled = [x.clone() if torch.is_tensor(x) else x for x in inputs]
        spoil(spoiled[names.index(name)])
        last = spoiled[6] if page_size == 64 else None
        with pytest.raises(ValueError) as expected:
            arguments.check_paged_values(
                spoiled[3], spoiled[4], spoiled[5], last, spoiled[0].shape[0], num_pages, page_size
            )
        outputs = poisoned_outputs(None, spoiled)
        with pytest.raises(ValueError) as got:
            entry_points[page_size](*spoiled, *outputs)
        assert str(got.value) == str(expected.value)
    check_case(entry_points, case, inputs)  # valid values pass the host check
