"""On the GPU machine, before `flashinfer-bench run` or a timing script: build every named
solution and run it once on a small case, each in its own process, in parallel. CUDA entries
are one long nvcc job each and TileLang compiles its kernels on first call (into its disk
cache), so the benchmark then finds every build ready (13 solutions in 108 s on the 16-core H100
host, 2026-11-25).

    python scripts/prebuild_gpu.py cuda_ragged tilelang_ragged triton_ragged ...

A Solution JSON file (an earlier version, or a variant from scripts/tilelang_variant.py or
`tune_cuda.py --json`, under any file name: its definition says what to warm) is built and
warmed the same way. Every case's outputs are checked
against the reference (prefill_bundle.testing.check_outputs), so a build that runs but computes
wrongly is reported as FAILED here, before anything times it.

By default only the dtype of the solution's definition is warmed (what the benchmark runs);
--both-dtypes warms and checks bfloat16 and float16 alike (each TileLang dtype is a compile of
its own, and FlashInfer's fp16 window module is not in the device pack: ~100 s of JIT).
"""

import multiprocessing as mp
import sys
import time
from functools import partial
from pathlib import Path


def definition_of(name: str) -> str:
    """The definition of the packed solution NAME, or of the Solution JSON file NAME (*.json)."""
    from flashinfer_bench import Solution

    from prefill_bundle.testing import load_solution

    if name.endswith(".json"):
        return Solution.model_validate_json(Path(name).read_text()).definition
    return load_solution(name).definition


def warm_dtypes(solution: str, both_dtypes: bool) -> tuple:
    """The query dtypes to warm `solution` (a name or a JSON file) in: its definition's, or
    both 16-bit ones."""
    import torch

    from prefill_bundle.testing import load_definition

    if both_dtypes:
        return (torch.bfloat16, torch.float16)
    definition = load_definition(definition_of(solution))
    return (getattr(torch, definition.inputs["q"].dtype.value),)


def warm_cases(definition: str, dtypes: tuple) -> list:
    """Small cases of `definition` in `dtypes`: both masks, rows that see no key, decode-like
    rows (which the paged plans split)."""
    from prefill_bundle import MINI, PAGE_SIZES, PAGED_FP8, SWA
    from prefill_bundle.testing import PaddedCase, PagedCase, RaggedCase

    if definition == MINI:
        return [PaddedCase(2, 300, 300, c, d) for c in (True, False) for d in dtypes]
    if definition == SWA:
        return [RaggedCase((300, 5), (300, 40), d, window_left=64) for d in dtypes]
    if definition == PAGED_FP8:
        return [PagedCase((100, 7), (300, 70), 64, fp8_scales=(0.5, 1.25)),
                PagedCase((1, 1, 2, 1), (3000, 700, 5000, 64), 64, fp8_scales=(0.5, 1.25))]
    if definition in PAGE_SIZES:
        return [PagedCase(q_lens, kv_lens, PAGE_SIZES[definition], d) for d in dtypes
                for q_lens, kv_lens in (((100, 7), (300, 70)),
                                        ((1, 1, 2, 1), (3000, 700, 5000, 64)))]
    return [RaggedCase((300, 5), (300, 40), d) for d in dtypes]


def warm(name: str, both_dtypes: bool = False) -> str:
    import torch

    from prefill_bundle.testing import (
        build_solution_or_file,
        check_outputs,
        make_inputs,
        reference_outputs,
        run_runnable,
    )

    start = time.time()
    try:
        cases = warm_cases(definition_of(name), warm_dtypes(name, both_dtypes))
        runnable = build_solution_or_file(name)
        for case in cases:
            inputs = make_inputs(case, "cuda")
            check_outputs(run_runnable(runnable, case, inputs), reference_outputs(case, inputs))
        torch.cuda.synchronize()
        return f"{name}: ok (outputs checked) {time.time() - start:.0f} s"
    except Exception as error:  # reported, never stopping the others
        return f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}"


def main():
    both_dtypes = "--both-dtypes" in sys.argv[1:]
    names = [name for name in sys.argv[1:] if name != "--both-dtypes"]
    with mp.get_context("spawn").Pool(min(len(names), 12)) as pool:
        for line in pool.imap_unordered(partial(warm, both_dtypes=both_dtypes), names):
            print(line, flush=True)


if __name__ == "__main__":
    main()
