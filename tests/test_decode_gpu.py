"""The decode paths for decode-like batches over FP8 caches on the GPU, one matrix for both
backends that have one: CUDA's gqa_decode_fp8_kernel (solutions/gqa_ragged/cuda/decode_fp8.cuh)
and TileLang's decode program (solutions/gqa_ragged/tilelang/gqa_prefill_decode.py). Against
the reference, with a check that the decode path ran (and, under its switch, that the old path
ran instead, with the same answers). Malformed decode-like batches: tests/test_malformed.py
(paged_malformed's decode_* batches); under compute-sanitizer: scripts/sanitize_malformed.py.

    pytest -m gpu tests/test_decode_gpu.py
"""

import os
from contextlib import contextmanager

import pytest
import torch

from prefill_bundle.testing import (
    PagedCase,
    check_outputs,
    entry_module,
    make_inputs,
    reference_outputs,
    run_solution,
    tilelang_python_entry,
)

pytestmark = pytest.mark.gpu
SOLUTIONS = ["cuda_fp8kv", "tilelang_fp8kv"]
SWITCH = {  # each decode path's switch: "0" runs the old path
    "cuda_fp8kv": "PREFILL_BUNDLE_DECODE_KERNEL",
    "tilelang_fp8kv": "PREFILL_BUNDLE_TILELANG_DECODE",
}
SCALES = (0.5, 1.25)
CASES = [
    # One token a sequence (1-token groups): a single key, a full page, one key on a second
    # page, long contexts, an empty sequence; split into shares.
    PagedCase((1,) * 6, (1, 64, 65, 3000, 0, 9000), 64, fp8_scales=SCALES),
    PagedCase((1,) * 6, (1, 64, 65, 3000, 0, 9000), 64, torch.float16, fp8_scales=SCALES),
    # 4-token groups: rows that see no key (3 tokens over 1 key), an empty sequence.
    PagedCase((4, 3, 1, 0, 2), (700, 1, 64, 0, 5000), 64, fp8_scales=SCALES),
    # A sequence of 7 tokens: two groups of 4 in turn.
    PagedCase((7, 1, 1), (300, 2000, 64), 64, fp8_scales=SCALES),
    # Values near e4m3's limit with small scales; pages shared between sequences.
    PagedCase((1, 1), (5000, 333), 64, fp8_scales=(1 / 256, 1 / 128), kv_magnitude=300.0),
    PagedCase((1, 1, 1), (4160, 4100, 100), 64, shared_prefix=(4096, 4096, 0), fp8_scales=SCALES),
]


@pytest.fixture(autouse=True)
def needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")


@contextmanager
def switch(solution: str, mode: str):
    name = SWITCH[solution]
    previous = os.environ.get(name)
    os.environ[name] = mode
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def cuda_run(case, inputs) -> tuple:
    """CUDA's outputs and whether the decode kernel ran (the profiler's kernel names; the switch
    is read on every call). The old path is the Hopper kernel (wgmma in its name)."""
    run_solution("cuda_fp8kv", case, inputs)  # built and warm before the profiled call
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outputs = run_solution("cuda_fp8kv", case, inputs)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    decoded = any("gqa_decode_fp8_kernel" in name for name in names)
    assert decoded != any("wgmma" in name for name in names), names
    return outputs, decoded


def tilelang_run(case, inputs) -> tuple:
    """TileLang's outputs and whether the decode program ran: TileLang names every program
    main_kernel, so the entry's compiled decode programs are wrapped while the plan is made
    (the switch is read when a shape is planned: the plans are cleared around the call), on
    the Python entry (that the fast path runs the plan it made: test_tilelang_fast_entry.py)."""
    module = entry_module("tilelang_fp8kv")
    with tilelang_python_entry(module):
        module._fp8_plans.clear()
        run_solution("tilelang_fp8kv", case, inputs)  # compiles and plans (spies go in below)
        originals = dict(module._decode_kernels)  # after the compile: a dtype's first call
        calls = []

        def spy(kernel):
            def call(*args):
                calls.append(1)
                return kernel(*args)

            return call

        module._fp8_plans.clear()
        module._decode_kernels.update({k: spy(v) for k, v in originals.items()})
        try:
            outputs = run_solution("tilelang_fp8kv", case, inputs)
        finally:
            module._decode_kernels.update(originals)
            module._fp8_plans.clear()
    return outputs, bool(calls)


RUN = {"cuda_fp8kv": cuda_run, "tilelang_fp8kv": tilelang_run}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
@pytest.mark.parametrize("solution", SOLUTIONS)
def test_decode_path_matches_the_reference(solution, case):
    inputs = make_inputs(case, "cuda", seed=5)
    expected = reference_outputs(case, inputs)
    with switch(solution, "1"):
        outputs, decoded = RUN[solution](case, inputs)
    assert decoded
    check_outputs(outputs, expected)
    with switch(solution, "0"):
        outputs, decoded = RUN[solution](case, inputs)
    assert not decoded
    check_outputs(outputs, expected)


@pytest.mark.parametrize("magnitude", [1e5, 1e-6])
@pytest.mark.parametrize("solution", SOLUTIONS)
def test_query_beyond_float16_range_is_scaled(solution, magnitude):
    """q goes to float16 with a power of two a row: bf16 values past float16's 65504 (or far
    below its normal range) come out right."""
    case = CASES[0]
    inputs = make_inputs(case, "cuda", seed=6)
    inputs[0] *= magnitude
    expected = reference_outputs(case, inputs)
    check_outputs(run_solution(solution, case, inputs), expected)


@pytest.mark.parametrize("solution", SOLUTIONS)
def test_nan_query_row_stays_in_its_row(solution):
    case = CASES[0]
    inputs = make_inputs(case, "cuda", seed=7)
    expected = reference_outputs(case, inputs)
    inputs[0][3, 9, 17] = float("nan")  # sequence 3 (3000 keys, several shares), head 9
    out, lse = run_solution(solution, case, inputs)
    assert out[3, 9].isnan().all() and lse[3, 9].isnan()
    keep = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)
    keep[3, 9] = False
    check_outputs([out[keep], lse[keep]], [expected[0][keep], expected[1][keep]])


@pytest.mark.parametrize("solution", SOLUTIONS)
def test_bad_page_id_poisons_its_sequence_only(solution):
    case = CASES[0]
    inputs = make_inputs(case, "cuda", seed=8)
    expected = reference_outputs(case, inputs)
    kv_indptr, kv_indices = inputs[4], inputs[5]
    kv_indices[int(kv_indptr[3]) + 20] = inputs[1].shape[0]  # sequence 3's 21st page
    out, lse = run_solution(solution, case, inputs)
    assert out[3].isnan().all() and lse[3].isnan().all()
    keep = torch.arange(out.shape[0], device=out.device) != 3
    check_outputs([out[keep], lse[keep]], [expected[0][keep], expected[1][keep]])


@pytest.mark.parametrize("solution", SOLUTIONS)
def test_token_strided_query(solution):
    """q a slice of a fused QKV tensor (token stride past its heads)."""
    case = CASES[2]
    inputs = make_inputs(case, "cuda", seed=9)
    expected = reference_outputs(case, inputs)
    q = inputs[0]
    fused = torch.zeros(q.shape[0], q.shape[1] + 16, q.shape[2], dtype=q.dtype, device=q.device)
    fused[:, : q.shape[1]] = q
    inputs[0] = fused[:, : q.shape[1]]
    check_outputs(run_solution(solution, case, inputs), expected)
