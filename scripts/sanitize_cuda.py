"""On the GPU, under compute-sanitizer: run the CUDA solutions on a small padded case and on a
ragged batch with an empty sequence and queries without keys, and check the results.

    compute-sanitizer --kernel-name kns=gqa_prefill python scripts/sanitize_cuda.py
"""

from prefill_bundle.testing import (
    PaddedCase,
    RaggedCase,
    check_outputs,
    make_inputs,
    reference_outputs,
    run_solution,
)

CASES = [
    ("cuda_mini", PaddedCase(2, 37, 53, True)),
    ("cuda_mini", PaddedCase(1, 70, 19, True)),
    ("cuda_mini", PaddedCase(2, 33, 65, False)),
    ("cuda_ragged", RaggedCase((7, 0, 33, 16), (7, 0, 40, 0))),
    # More work items than SMs: the persistent kernel and its work counter.
    ("cuda_mini", PaddedCase(2, 700, 900, True)),
    ("cuda_ragged", RaggedCase((600, 0, 300, 5), (650, 0, 200, 0))),
]

for name, case in CASES:
    inputs = make_inputs(case, "cuda", seed=1)
    check_outputs(run_solution(name, case, inputs), reference_outputs(case, inputs))
    print(f"{name} {case.id}: ok")
