"""The Triton kernel's paged K/V policy beyond the shared matrix (interpreter on CPU, the GPU
when there is one): it changes where keys and values come from and nothing else.

- Every launch config (block shapes, paired row blocks, key tiles that span pages) gives the
  ragged kernel's result on the same K/V gathered from the pages: bit for bit in the
  interpreter, within the one correctness check on a GPU.
- Caches that are views with a page stride larger than a page (FlashInfer's [num_pages, 2,
  page_size, 8, 128] cache), K and V with different page strides, a cache without pages.
- One plan serves every page table of a shape (ids are read by the kernel, not baked in).
- GPU only: page offsets past 2^31 elements (64-bit page arithmetic).
"""

import math

import pytest
import torch

from prefill_bundle import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS
from prefill_bundle.testing import (
    PagedCase,
    build_solution,
    check_outputs,
    entry_module,
    gathered_ragged_inputs,
    make_inputs,
    poisoned_outputs,
    reference,
    reference_outputs,
    strided_caches,
)
from prefill_bundle.workloads import lengths_to_indptr

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SMALL_BLOCKS = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
CONFIGS = {
    "four_heads_per_tile": dict(HEADS_PER_TILE=4, **SMALL_BLOCKS),
    "one_head_per_tile": dict(HEADS_PER_TILE=1, **SMALL_BLOCKS),
    "wide_key_tiles": dict(HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
    "paired_row_blocks": dict(HEADS_PER_TILE=4, ROW_BLOCKS=2, **SMALL_BLOCKS),
    # 128-key tiles span two pages of 64: page size 64 takes the per-key page id path.
    "key_tiles_across_pages": dict(
        HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=1
    ),
}
CASES = [
    # Last pages of 1, 64 (full) and 1 keys over shared prefix pages; rows without keys.
    PagedCase((20, 20, 5), (129, 128, 65), 64, shared_prefix=(64, 64, 0)),
    PagedCase((45, 0, 20), (12, 0, 70), 1, torch.float16),
    PagedCase((7, 33), (7, 40), 64, torch.float16),
    PagedCase((9, 20, 3), (40, 33, 40), 1, shared_prefix=(30, 0, 30)),
]


def triton_module():
    return entry_module("triton_paged_ps64")


def split_inputs(case, inputs):
    """(tensors for _plan_paged without the outputs, sm_scale)."""
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    last = inputs[6] if case.page_size > 1 else None
    return (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last), inputs[-1]


def run_paged(module, case, inputs, config=None, caches=None):
    """Launch the paged kernel directly (config: the plan's block sizes, else its own choice);
    caches replaces (k_cache, v_cache)."""
    tensors, sm_scale = split_inputs(case, inputs)
    if caches is not None:
        tensors = tensors[:1] + tuple(caches) + tensors[3:]
    outputs = poisoned_outputs(case, inputs)
    plan = module._plan_paged(case.page_size, tensors + tuple(outputs), config=config)
    module.launch_paged(plan, *tensors, sm_scale, *outputs)
    return outputs


# Each config on two cases (one of each page size), each case under two or three configs: the
# interpreter takes ~10 s a case on CI's 2 cores.
CONFIG_CASES = [
    pytest.param(
        config, CASES[(i + j) % len(CASES)], id=f"{config}-{CASES[(i + j) % len(CASES)].id}"
    )
    for i, config in enumerate(CONFIGS)
    for j in (0, 1)
]


@pytest.mark.parametrize("config,case", CONFIG_CASES)
def test_paged_is_the_ragged_kernel_on_gathered_kv(config, case):
    module = triton_module()
    inputs = make_inputs(case, DEVICE, seed=11)
    paged = run_paged(module, case, inputs, CONFIGS[config])
    q, k, v, qo_indptr, kv_tokens, sm_scale = gathered_ragged_inputs(case, inputs)
    ragged = poisoned_outputs(case, inputs)
    plan = module._plan_ragged(q, k, v, qo_indptr, kv_tokens, *ragged, config=CONFIGS[config])
    module.launch_ragged(plan, q, k, v, qo_indptr, kv_tokens, sm_scale, *ragged)
    if HAS_CUDA:
        check_outputs(paged, ragged)
    else:  # the same tiles in the same order: the interpreter gives the same bits
        for got, want in zip(paged, ragged):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    check_outputs(paged, reference_outputs(case, inputs))


@pytest.mark.parametrize("slots", [(2, 2), (2, 3)], ids=["kv_interleaved", "unequal_strides"])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.id)
def test_cache_views_with_page_strides(case, slots):
    module = triton_module()
    inputs = make_inputs(case, DEVICE, seed=12)
    caches = strided_caches(inputs[1], inputs[2], *slots)
    assert not caches[0].is_contiguous() and caches[1].stride(0) == slots[1] * caches[1][0].numel()
    check_outputs(run_paged(module, case, inputs, caches=caches), reference_outputs(case, inputs))


def test_one_plan_serves_every_page_table():
    """The same shapes with the pages renumbered (and the cache permuted to match): one plan,
    both right."""
    module = triton_module()
    case = CASES[0]
    inputs = make_inputs(case, DEVICE, seed=13)
    expected = reference_outputs(case, inputs)
    plans = module._paged_plans[64]
    plans.clear()
    renumber = torch.randperm(inputs[1].shape[0], generator=torch.Generator().manual_seed(2))
    renumbered = list(inputs)
    renumbered[5] = renumber.to(DEVICE)[inputs[5].long()].to(torch.int32)
    for name in (1, 2):  # page p moves to renumber[p]
        renumbered[name] = torch.empty_like(inputs[name])
        renumbered[name][renumber.to(DEVICE)] = inputs[name]
    for args in (inputs, renumbered):
        outputs = poisoned_outputs(case, args)
        module.run_paged_ps64(*args, *outputs)
        check_outputs(outputs, expected)
    assert len(plans) == 1


@pytest.mark.parametrize("page_size", [1, 64])
def test_cache_without_pages(page_size):
    """num_pages = 0: every listed page id is out of range, so rows that see a key are NaN;
    a sequence without pages and rows that see no key are computed (0, lse -inf)."""
    module = triton_module()
    q_lens, pages = (5, 3, 4), (2, 0, 1)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM).to(DEVICE, torch.bfloat16)
    cache = torch.empty(0, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device=DEVICE)
    qo_indptr = lengths_to_indptr(q_lens).to(DEVICE)
    kv_indptr = lengths_to_indptr(pages).to(DEVICE)
    kv_indices = torch.zeros(sum(pages), dtype=torch.int32, device=DEVICE)
    output = torch.full_like(q, -7.0)
    lse = torch.full(q.shape[:2], -7.0, device=DEVICE)
    if page_size == 1:
        module.run_paged_ps1(q, cache, cache, qo_indptr, kv_indptr, kv_indices, 0.1, output, lse)
        kv_lens = pages
    else:
        last = torch.tensor([3, 1, 2], dtype=torch.int32, device=DEVICE)
        module.run_paged_ps64(q, cache, cache, qo_indptr, kv_indptr, kv_indices, last, 0.1,
                              output, lse)  # fmt: skip
        kv_lens = (64 + 3, 0, 2)
    row = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for i in range(q_len):
            sees_a_key = i + kv_len - q_len >= 0 and kv_len > 0
            if sees_a_key:
                assert output[row].isnan().all() and lse[row].isnan().all(), row
            else:
                assert (output[row] == 0).all() and (lse[row] == -math.inf).all(), row
            row += 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (caches of several GB)")
@pytest.mark.parametrize("page_size", [1, 64])
def test_page_offsets_past_int32(page_size):
    """Pages whose element offset (page id x page stride) exceeds 2^31: the kernel must take it
    in 64 bits. Each cache holds 2^31 + a few pages' worth of elements (4 GiB); the sequences
    use the last pages and a few low ones."""
    page_elements = page_size * NUM_KV_HEADS * HEAD_DIM
    num_pages = 2**31 // page_elements + 8
    q_lens = (3, 70)
    kv_lens = (129, 192) if page_size == 64 else (70, 130)
    counts = [-(-n // page_size) for n in kv_lens]
    # Pages from the top of the cache and from its bottom, alternating.
    ids = [num_pages - 1 - j if j % 2 else j for j in range(sum(counts))]
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.float16)
    caches = []
    for _ in range(2):
        cache = torch.full((num_pages, page_size, NUM_KV_HEADS, HEAD_DIM), float("nan"),
                           dtype=torch.float16, device="cuda")  # fmt: skip
        values = torch.randn(len(ids), page_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        cache[torch.tensor(ids, device="cuda")] = values.to("cuda", torch.float16)
        caches.append(cache)
    qo_indptr = lengths_to_indptr(q_lens).cuda()
    kv_indptr = lengths_to_indptr(counts).cuda()
    kv_indices = torch.tensor(ids, dtype=torch.int32, device="cuda")
    inputs = [q, *caches, qo_indptr, kv_indptr, kv_indices]
    if page_size == 64:
        last = [n - (c - 1) * page_size for n, c in zip(kv_lens, counts)]
        inputs.append(torch.tensor(last, dtype=torch.int32, device="cuda"))
    inputs.append(1.0 / math.sqrt(HEAD_DIM))
    case = PagedCase(q_lens, kv_lens, page_size, torch.float16)
    outputs = poisoned_outputs(case, inputs)
    build_solution(f"triton_paged_ps{page_size}")(*inputs, *outputs)
    check_outputs(outputs, list(reference(case.definition)(*inputs)))
