"""The shared matrix: every packed solution against the reference.

On CPU only Triton solutions run (under TRITON_INTERPRET=1) on the small cases; on a GPU every
solution runs on the large cases. Baselines are not right where a query row sees no key
(FlashInfer and cuDNN return non-zero rows there) nor for a softmax scale <= 0, so they get only
the cases where every row sees a key with a positive scale; the bundle's own solutions get all.
"""

import pytest
import torch

from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.testing import (
    CPU_FP8_CASES,
    CPU_FUSED_CASES,
    CPU_NAN_CASES,
    CPU_PADDED_CASES,
    CPU_PAGED_CASES,
    CPU_RAGGED_CASES,
    CPU_SWA_CASES,
    GPU_FP8_CASES,
    GPU_FUSED_CASES,
    GPU_PADDED_CASES,
    GPU_PAGED_CASES,
    GPU_RAGGED_CASES,
    GPU_SWA_CASES,
    PaddedCase,
    PagedCase,
    RaggedCase,
    baselines_apply,
    build_solution,
    check_outputs,
    fused_qkv_inputs,
    make_inputs,
    nan_neighbour_inputs,
    page_gather,
    poisoned_outputs,
    reference_outputs,
    run_solution,
)

HAS_CUDA = torch.cuda.is_available()
CPU_LANGUAGES = {"triton"}  # what can run here without a GPU


def matrix(cpu_cases, gpu_cases, baselines=True):
    params = []
    for spec in SOLUTIONS:
        if spec.author == BASELINE_AUTHOR and not baselines:
            continue
        for case in gpu_cases if HAS_CUDA else cpu_cases:
            if case.definition != spec.definition:
                continue
            if spec.author == BASELINE_AUTHOR and not baselines_apply(case):
                continue
            marks = [pytest.mark.gpu] if HAS_CUDA else []
            if not HAS_CUDA and spec.language not in CPU_LANGUAGES:
                continue
            params.append(pytest.param(spec.name, case, id=f"{spec.name}-{case.id}", marks=marks))
    return params


def check_against_reference(solution, case, seed=0):
    device = "cuda" if HAS_CUDA else "cpu"
    inputs = make_inputs(case, device, seed)
    expected = reference_outputs(case, inputs)
    actual = run_solution(solution, case, make_inputs(case, device, seed))
    check_outputs(actual, expected)


@pytest.mark.parametrize("solution,case", matrix(CPU_PADDED_CASES, GPU_PADDED_CASES))
def test_padded(solution, case):
    check_against_reference(solution, case)


@pytest.mark.parametrize("solution,case", matrix(CPU_RAGGED_CASES, GPU_RAGGED_CASES))
def test_ragged(solution, case):
    check_against_reference(solution, case)


@pytest.mark.parametrize("solution,case", matrix(CPU_PAGED_CASES, GPU_PAGED_CASES))
def test_paged(solution, case):
    """Shuffled and shared pages, partly filled last pages, NaN in every unused cache slot."""
    check_against_reference(solution, case)


# Page size 1 both ways, whatever arguments.gathers_pages would choose for the case: rows
# gathered inside the attention loop ("0"), and the pages gathered into contiguous K/V first,
# then the ragged kernel ("1"; kv_indptr then indexes keys).
CPU_PS1_CASES = [c for c in CPU_PAGED_CASES if c.page_size == 1]
GPU_PS1_CASES = [
    PagedCase((1000, 0, 77), (300, 0, 77), 1),  # 700 rows see no key, an empty sequence
    PagedCase((4500, 37), (3000, 4000), 1),
    PagedCase((100, 200, 1), (500, 401, 64), 1, torch.float16, shared_prefix=(400, 400, 0)),
    PagedCase((1, 1, 3), (200, 64, 130), 1, sm_scale=-0.3),
]


@pytest.mark.parametrize("mode", ["0", "1"], ids=["rows_in_loop", "pages_first"])
@pytest.mark.parametrize("solution,case", matrix(CPU_PS1_CASES, GPU_PS1_CASES, baselines=False))
def test_page_size_1_both_ways(solution, case, mode):
    with page_gather(mode, solution):
        check_against_reference(solution, case)


# CUDA's padded non-causal batches on both tile shapes, whatever the key count would choose:
# the full family's 192-key tiles ("0") and the causal family's 128-key ones ("1";
# uses_short_key_tiles in cuda/entry_launch.cuh), and as the key count chooses (None: 4096 keys
# and fewer on 128-key tiles). Key counts off both tile grids, one key, no key (rows of zeros;
# added after the GPU run of 2026-12-01 (40)), seq_q above and below seq_kv, either side of 4096.
GPU_FULL_CASES = [
    PaddedCase(4, 512, 512, False),
    PaddedCase(3, 129, 257, False),
    PaddedCase(2, 1000, 300, False, torch.bfloat16),
    PaddedCase(2, 300, 4096, False),
    PaddedCase(1, 1, 4097, False),
    PaddedCase(2, 70, 1, False, torch.bfloat16),
    PaddedCase(2, 70, 0, False),
    PaddedCase(1, 2000, 5000, False),
]


def short_key_tiles(monkeypatch, mode):
    """PREFILL_BUNDLE_SHORT_KEY_TILES=mode for the test, unset for None (the key count chooses);
    the CUDA entry reads it per call."""
    if mode is None:
        monkeypatch.delenv("PREFILL_BUNDLE_SHORT_KEY_TILES", raising=False)
    else:
        monkeypatch.setenv("PREFILL_BUNDLE_SHORT_KEY_TILES", mode)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "mode", ["0", "1", None], ids=["192_key_tiles", "128_key_tiles", "by_key_count"]
)
@pytest.mark.parametrize("case", GPU_FULL_CASES, ids=lambda case: case.id)
def test_cuda_non_causal_both_tiles(case, mode, monkeypatch):
    short_key_tiles(monkeypatch, mode)
    check_against_reference("cuda_mini", case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "seq_kv,mode,short", [(4096, None, True), (4097, None, False), (4096, "0", False),
                          (4097, "1", True)],
)  # fmt: skip
def test_cuda_key_count_chooses_the_tiles(seq_kv, mode, short, monkeypatch):
    """The kernel a padded non-causal call launches, by name in torch's profiler: 128-key tiles
    (gqa_prefill_full128_wgmma_kernel) up to 4096 keys, unless the variable forces either."""
    short_key_tiles(monkeypatch, mode)
    case = PaddedCase(1, 256, seq_kv, False)
    inputs = make_inputs(case, "cuda", seed=3)
    outputs = poisoned_outputs(case, inputs)
    solution = build_solution("cuda_mini")
    solution(*inputs, *outputs)  # built and planned before the profiled call
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        solution(*inputs, *outputs)
        torch.cuda.synchronize()
    kernels = [e.name for e in profile.events() if "gqa_prefill" in e.name]
    assert len(kernels) == 1, kernels
    assert ("gqa_prefill_full128_wgmma_kernel" in kernels[0]) == short, kernels


@pytest.mark.parametrize("solution,case", matrix(CPU_FP8_CASES, GPU_FP8_CASES))
def test_fp8_kv_cache(solution, case):
    """float8_e4m3fn caches with scales that are not 1 (and near e4m3's range limit), against
    the reference on the same dequantized K/V."""
    check_against_reference(solution, case)


@pytest.mark.parametrize("solution,case", matrix(CPU_SWA_CASES, GPU_SWA_CASES))
def test_sliding_window(solution, case):
    """Windows of 0, 1, shorter and longer than the sequence, none (-1); band edges off the
    tile grid."""
    check_against_reference(solution, case)


@pytest.mark.parametrize("solution,case", matrix(CPU_FUSED_CASES, GPU_FUSED_CASES, False))
def test_fused_qkv_slices(solution, case):
    """q, k, v as token-strided views (no copy) give what contiguous ones give."""
    device = "cuda" if HAS_CUDA else "cpu"
    inputs = make_inputs(case, device, seed=5)
    expected = reference_outputs(case, inputs)
    strided = fused_qkv_inputs(make_inputs(case, device, seed=5))
    assert not strided[0].is_contiguous()
    check_outputs(run_solution(solution, case, strided), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("language", ["cuda", "tilelang", "triton"])
def test_back_to_back_launches_on_two_streams(language):
    """Persistent kernels (CUDA, TileLang causal) draw work items from a per-stream counter that
    their last CTA zeroes again; a counter left dirty would make the next launch skip items and
    leave rows unwritten (poisoned outputs show that). Shapes of different sizes back to back,
    then on a second stream, then back on the first."""
    cases = [
        RaggedCase((300, 1, 0, 129), (300, 40, 7, 129)),
        PaddedCase(2, 1000, 1200, True),
        RaggedCase((4096,), (4096,)),
        PaddedCase(1, 77, 77, True),
        PaddedCase(3, 700, 500, False),
    ]
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            for seed, case in enumerate(cases):
                suffix = "mini" if isinstance(case, PaddedCase) else "ragged"
                inputs = make_inputs(case, "cuda", seed)
                actual = run_solution(f"{language}_{suffix}", case, make_inputs(case, "cuda", seed))
                check_outputs(actual, reference_outputs(case, inputs))
    torch.cuda.synchronize()


# ---- A NaN in one sequence's K/V stays in that sequence ---------------------------------------
# Sequence 0 ends mid-tile, so its last K/V tile runs into sequence 1, whose first keys are NaN:
# their logits are masked, but 0 x NaN in P V would still reach sequence 0's rows unless those V
# rows are never read or read as zeros. (FlashInfer's fa3 kernels carry the NaN over.)
GPU_NAN_CASES = [
    PaddedCase(2, 1100, 1100, True),
    PaddedCase(2, 1100, 1100, False),
    RaggedCase((1000, 700, 300), (1000, 1500, 300)),
]


@pytest.mark.parametrize("solution,case", matrix(CPU_NAN_CASES, GPU_NAN_CASES, baselines=False))
def test_a_nan_in_one_sequence_stays_in_it(solution, case):
    device = "cuda" if HAS_CUDA else "cpu"
    inputs, expected, rows = nan_neighbour_inputs(case, device, seed=5)
    actual = run_solution(solution, case, inputs)
    check_outputs([x[rows] for x in actual], [x[rows] for x in expected])
