"""The shared matrix: every packed solution against the reference.

On CPU only Triton solutions run (under TRITON_INTERPRET=1) on the small cases; on a GPU every
solution runs on the large cases. Baselines are not right where a query row sees no key
(FlashInfer and cuDNN return non-zero rows there), so they get only the cases where every row
sees a key; the bundle's own solutions get all of them.
"""

import pytest
import torch

from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.testing import (
    CPU_PADDED_CASES,
    CPU_RAGGED_CASES,
    GPU_PADDED_CASES,
    GPU_RAGGED_CASES,
    check_outputs,
    every_row_sees_a_key,
    make_inputs,
    reference_outputs,
    run_solution,
)

HAS_CUDA = torch.cuda.is_available()
CPU_LANGUAGES = {"triton"}  # what can run here without a GPU


def matrix(cpu_cases, gpu_cases):
    params = []
    for spec in SOLUTIONS:
        for case in gpu_cases if HAS_CUDA else cpu_cases:
            if case.definition != spec.definition:
                continue
            if spec.author == BASELINE_AUTHOR and not every_row_sees_a_key(case):
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
