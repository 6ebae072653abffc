"""Split-KV on the GPU for the backends that split decode-like paged batches (CUDA's
split_merge.cuh, Triton's split_kv.py, TileLang's gqa_prefill_split.py): a batch their GPU
plans split, against the reference; then with a page id out of range, the poison survives the
shares' merge in its row only.
Run under compute-sanitizer memcheck too (the split kernels and the merge must not read or
write outside their tensors with a bad page id):

    compute-sanitizer --tool memcheck python -m pytest -m gpu tests/test_split_kv_gpu.py
"""

import pytest
import torch

from prefill_bundle.testing import (
    PagedCase,
    check_outputs,
    make_inputs,
    reference_outputs,
    run_solution,
)

# Four decode-like rows over 64 to 5000 keys: both GPU plans split them (CUDA: shares of >= 4
# key tiles of 128; Triton: 4 shares of >= 8 tiles of 64).
Q_LENS, KV_LENS = (1, 1, 2, 1), (3000, 700, 5000, 64)
SOLUTIONS = [
    ("cuda_paged_ps64", 64, False),
    ("cuda_paged_ps1", 1, False),
    ("cuda_fp8kv", 64, True),
    ("triton_paged_ps64", 64, False),
    ("triton_paged_ps1", 1, False),
    ("triton_fp8kv", 64, True),
    # TileLang packs the 4 query heads of a KV head for decode-like batches and splits them,
    # both page sizes (gqa_prefill_kernel.PACK_PAGE_SIZES).
    ("tilelang_paged_ps64", 64, False),
    ("tilelang_paged_ps1", 1, False),
    ("tilelang_fp8kv", 64, True),
]


def test_triton_plans_split_the_case():
    """Else the Triton rows below would test the unsplit kernel (CUDA's plan: the nvcc host
    driver's test_plan_splits_decode_like_batches)."""
    from test_triton_paged import triton_module

    module = triton_module()
    if module.INTERPRET:
        pytest.skip("the GPU's plan")
    tokens_per_seq = sum(Q_LENS) / len(Q_LENS)
    assert module._kv_splits(tokens_per_seq, len(Q_LENS), sum(KV_LENS), 64, 132) == 4


def test_tilelang_plans_split_the_case():
    """Else the TileLang rows below would test the unsplit kernel: the entry's plan (from
    shapes: 5 tokens, 4 sequences, the page table's entries x page size), packed and split."""
    from prefill_bundle.testing import tilelang_kernels

    kernels = tilelang_kernels()
    assert kernels.decode_like(sum(Q_LENS), len(Q_LENS))
    for page_size in kernels.PACK_PAGE_SIZES:
        keys = sum(-(-n // page_size) for n in KV_LENS) * page_size
        shares = kernels.kv_shares(sum(Q_LENS), len(Q_LENS), keys, 132, block_M=64, pack=True)
        assert shares == 4, page_size


# float16 q over FP8 caches: TileLang packs it unsplit (its packed split program fails
# TileLang's sync planner: gqa_prefill_kernel.PACK_SPLIT_VARIANTS).
FLOAT16_CASES = [("tilelang_fp8kv", 64, True, torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, page_size, fp8, dtype",
    [(*solution, torch.bfloat16) for solution in SOLUTIONS] + FLOAT16_CASES,
)
def test_split_batches_on_the_gpu(name, page_size, fp8, dtype):
    """The reference's outputs; then with sequence 1's first page id out of range, its row NaN
    and the other rows unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    scales = {"fp8_scales": (0.5, 1.25)} if fp8 else {}
    case = PagedCase(Q_LENS, KV_LENS, page_size, dtype, **scales)
    inputs = make_inputs(case, "cuda", seed=1)
    expected = reference_outputs(case, inputs)
    check_outputs(run_solution(name, case, inputs), expected)
    kv_indptr, kv_indices = inputs[4], inputs[5]
    kv_indices[int(kv_indptr[1])] = inputs[1].shape[0]  # num_pages: out of range
    out, lse = run_solution(name, case, inputs)
    bad = slice(1, 2)  # sequence 1's one query row
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    for rows in (slice(0, 1), slice(2, 5)):
        check_outputs([out[rows], lse[rows]], [expected[0][rows], expected[1][rows]])
