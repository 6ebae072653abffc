"""Malformed ragged batches (indptr values that are not a partition) never crash, never touch
memory outside the tensors, and never come back silently plausible: rows of well-formed
sequences are right, every other row is NaN (output and lse). See README, "Malformed batches".

Every bundle solution of the ragged definition runs here on a GPU; without one, Triton under its
interpreter. q, k and v lie inside NaN-filled guard buffers: a read outside them would turn a
well-formed row NaN, and a write outside the outputs would change a guard.
scripts/sanitize_malformed.py runs the same list under compute-sanitizer memcheck on the GPU.
"""

import pytest
import torch

from prefill_bundle import PAGE_SIZES, PAGED_FP8, PAGED_PS1, RAGGED, SWA
from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.paged_malformed import (
    MALFORMED_FP8_BATCHES,
    MALFORMED_PAGED_BATCHES,
    check_malformed_paged_outputs,
    malformed_paged_expected,
    malformed_paged_inputs,
)
from prefill_bundle.testing import (
    MALFORMED_BATCHES,
    MALFORMED_SWA_BATCHES,
    build_solution,
    check_malformed_outputs,
    malformed_expected,
    malformed_inputs,
    page_gather,
    well_formed_sequences,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
GUARD = 4096  # elements of NaN before and after every tensor


def solutions(definitions=(RAGGED,)):
    names = [
        s.name for s in SOLUTIONS if s.definition in definitions and s.author != BASELINE_AUTHOR
    ]
    return names if HAS_CUDA else [n for n in names if n.startswith("triton")]


def guarded(x: torch.Tensor, fill=float("nan")):
    """x's values in the middle of a buffer filled with `fill`; returns (view, buffer)."""
    buffer = torch.full((2 * GUARD + x.numel(),), fill, dtype=x.dtype, device=x.device)
    view = buffer[GUARD : GUARD + x.numel()].view(x.shape)
    view.copy_(x)
    return view, buffer


def run_guarded(solution: str, inputs: list) -> list:
    """The solution on inputs whose first three tensors (q and the keys/values or caches) lie in
    NaN guard buffers, outputs in guard buffers of their own; checks that no guard was written
    and every row was. Returns [output, lse]."""
    tensors = [guarded(x)[0] for x in inputs[:3]]
    output, output_buffer = guarded(torch.full_like(inputs[0], -7.0), fill=-3.0)
    lse, lse_buffer = guarded(torch.full(inputs[0].shape[:2], -7.0, device=DEVICE), fill=-3.0)
    build_solution(solution)(*tensors, *inputs[3:], output, lse)
    if HAS_CUDA:
        torch.cuda.synchronize()
    for buffer in (output_buffer, lse_buffer):
        guard = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
        assert (guard == -3.0).all(), "a write outside the outputs"
    assert not (output == -7.0).all(-1).any(), "rows never written"
    return [output, lse]


def test_well_formed_sequences_rule():
    """The rule itself, on hand-made cases."""
    assert well_formed_sequences((0, 30, 70, 100), (0, 40, 80, 120), 100, 120) == [0, 1, 2]
    assert well_formed_sequences((0, 30, 70, 100), (0, 40, 80, 200), 100, 120) == [0, 1]
    assert well_formed_sequences((0, 50, 30, 100), (0, 40, 80, 120), 100, 120) == []
    assert well_formed_sequences((0, 70, 80, 30, 100), (0,) * 5, 100, 0) == []
    assert well_formed_sequences((10, 30, 70, 90), (0, 40, 80, 120), 100, 120) == [0, 1, 2]
    assert well_formed_sequences((0, 30, 70, 100), (-1, 40, 80, 120), 100, 120) == [1, 2]


# Under the interpreter (CI's time budget) the ragged entry takes the odd batches and the window
# entry (the same kernel, WINDOW_BATCHES below) the even ones: every fault runs once on CPU; on a
# GPU all of them through both entries.
RAGGED_BATCHES = MALFORMED_BATCHES if HAS_CUDA else MALFORMED_BATCHES[1::2]


@pytest.mark.parametrize("solution", solutions())
@pytest.mark.parametrize("batch", RAGGED_BATCHES, ids=lambda b: b.id)
def test_malformed_batch(solution, batch):
    inputs = malformed_inputs(batch, DEVICE, seed=3)
    expected = malformed_expected(batch, inputs)
    check_malformed_outputs(run_guarded(solution, inputs), expected)


WINDOW_BATCHES = MALFORMED_SWA_BATCHES if HAS_CUDA else MALFORMED_SWA_BATCHES[::2]


@pytest.mark.parametrize("solution", solutions((SWA,)))
@pytest.mark.parametrize("batch", WINDOW_BATCHES, ids=lambda b: b.id)
def test_malformed_batch_with_window(solution, batch):
    """The same batches through the sliding-window entry (window 7 of up to 120 keys)."""
    inputs = malformed_inputs(batch, DEVICE, seed=3)
    expected = malformed_expected(batch, inputs)
    check_malformed_outputs(run_guarded(solution, inputs), expected)


def paged_cases():
    """Under the interpreter half the batches (CI's time budget): page size 64 the even ones, page
    size 1 and the FP8 caches the odd ones, so every kind of fault runs once; on a GPU all."""
    bf16 = [
        pytest.param(name, batch, id=f"{name}-{batch.id}")
        for name in solutions(tuple(PAGE_SIZES))
        for i, batch in enumerate(MALFORMED_PAGED_BATCHES)
        if name.endswith(f"_ps{batch.page_size}") and (HAS_CUDA or (i + batch.page_size) % 2 == 0)
    ]
    fp8 = [
        pytest.param(name, batch, id=f"{name}-{batch.id}")
        for name in solutions((PAGED_FP8,))
        for i, batch in enumerate(MALFORMED_FP8_BATCHES)
        if HAS_CUDA or i % 2 == 1
    ]
    return bf16 + fp8


@pytest.mark.parametrize("solution,batch", paged_cases())
def test_malformed_paged_batch(solution, batch):
    """Page ids, page offsets and last-page lengths out of range, bf16/fp16 and FP8 caches; q and
    the caches inside NaN guard buffers (a page id read outside the cache would turn a computed
    row NaN)."""
    inputs = malformed_paged_inputs(batch, DEVICE, seed=4)
    expected = malformed_paged_expected(batch, inputs)
    check_malformed_paged_outputs(run_guarded(solution, inputs), expected)


def gathered_cases():
    """The page size 1 batches with the pages gathered first (arguments.gathers_pages): the
    copy kernel meets the bad ids, the ragged kernel the bad offsets. Under the interpreter the
    even ones (test_malformed_paged_batch runs the odd ones through the in-loop gather)."""
    batches = [b for b in MALFORMED_PAGED_BATCHES if b.page_size == 1]
    return [
        pytest.param(name, batch, id=f"{name}-{batch.id}")
        for name in solutions((PAGED_PS1,))
        for i, batch in enumerate(batches)
        if HAS_CUDA or i % 2 == 0
    ]


@pytest.mark.parametrize("solution,batch", gathered_cases())
def test_malformed_ps1_batch_pages_first(solution, batch):
    inputs = malformed_paged_inputs(batch, DEVICE, seed=4)
    expected = malformed_paged_expected(batch, inputs)
    with page_gather("1", solution):
        check_malformed_paged_outputs(run_guarded(solution, inputs), expected)
