"""On the GPU, under compute-sanitizer: run the CUDA solutions on a small padded case, on a ragged
batch with an empty sequence and queries without keys, and on paged batches (NaN in every cache
slot no sequence owns, partly filled last pages, shared pages, both kernels), and check the
results.

    compute-sanitizer --kernel-name kns=gqa_prefill python scripts/sanitize_cuda.py

Malformed batches and page tables: scripts/sanitize_malformed.py.
"""

from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
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
for page_size in (64, 1):
    name = f"cuda_paged_ps{page_size}"
    CASES += [
        # An empty sequence, queries without keys, last pages of 1, 63 and 65 - 64 keys.
        (name, PagedCase((7, 0, 33, 16, 5), (1, 0, 63, 65, 0), page_size)),
        # Shared prefix pages; more work items than SMs (the persistent kernel).
        (name, PagedCase((600, 1, 300), (650, 700, 257), page_size, shared_prefix=(512, 512, 0))),
        # A softmax scale <= 0 runs the portable kernel.
        (name, PagedCase((45, 20), (129, 70), page_size, sm_scale=-0.3)),
    ]

for name, case in CASES:
    inputs = make_inputs(case, "cuda", seed=1)
    check_outputs(run_solution(name, case, inputs), reference_outputs(case, inputs))
    print(f"{name} {case.id}: ok")
