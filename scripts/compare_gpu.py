"""On the GPU: time packed solutions against FlashInfer the way flashinfer-bench does (its own
time_runnable: synchronize, flush L2, clone inputs, time one call with events; host overhead
included), interleaved (A B, then B A) because the card heats up within a call; best of two
rounds.

    python scripts/compare_gpu.py triton_mini tilelang_mini triton_ragged
    python scripts/compare_gpu.py triton_ragged --old OLD/triton_ragged.json   # A/B a change
    python scripts/compare_gpu.py cuda_fp8kv --old V/*.json --workloads single_token_rows_16
    python scripts/compare_gpu.py tilelang_mini --old V/x.json --padded 4x512 8x2048-causal

--old takes Solution JSON files of earlier versions (e.g. `git show REV:solutions/...json`),
timed beside the current ones as "<name>@old", or of variants (scripts/tilelang_variant.py),
under their own names; kernel time (triton.testing.do_bench) is printed too, to tell a kernel
change from a host one: by default the best of the two rounds' 50 ms timings, which moves by
2-3% between calls; with --kernel-rounds N the median of N alternating rounds' ratios, each
timing 200 ms (gpu_timing.alternating_ms), which separated 1% on the paged rows in
2026-12-01 (43) (tilelang/TUNING.md).

    python scripts/compare_gpu.py tilelang_paged_ps64 --old V/x.json --kernel-rounds 8
"""

import argparse
import math

import torch
from flashinfer_bench import Solution
from flashinfer_bench.bench.timing import time_runnable

from prefill_bundle import MINI, PAGE_SIZES, PAGED_FP8, RAGGED, SWA
from prefill_bundle.gpu_timing import alternating_ms, clocks, kernel_ms, median, round_ratios
from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    build_solution_object,
    call_arguments,
    load_solution,
    make_inputs,
    normwise_error,
    padded_case,
)
from prefill_bundle.workloads import (
    FP8_K_SCALE,
    FP8_V_SCALE,
    PAGED_BATCHES,
    RAGGED_BATCHES,
    SWA_BATCHES,
)

PADDED = [
    PaddedCase(8, 2048, 2048, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(1, 16384, 16384, False),
    PaddedCase(1, 128, 128, True),
    PaddedCase(4, 512, 512, True),
    PaddedCase(4, 512, 512, False),
    PaddedCase(4, 128, 2048, True),
]
# Each ragged, window and paged case's workload name (--workloads), by case id.
WORKLOAD_OF = {}


def named(case, name: str):
    WORKLOAD_OF[case.id] = name
    return case


# Per definition: its FlashInfer baseline and its cases (the workloads' shapes).
CASES = {
    MINI: ("flashinfer_mini", PADDED),
    RAGGED: (
        "flashinfer_ragged",
        [named(RaggedCase(b.q_lens, b.kv_lens), b.name) for b in RAGGED_BATCHES],
    ),
    SWA: (
        "flashinfer_swa",
        [named(RaggedCase(b.q_lens, b.kv_lens, window_left=b.window_left), b.name)
         for b in SWA_BATCHES],
    ),
}  # fmt: skip
for _name, _page_size in PAGE_SIZES.items():
    CASES[_name] = (
        f"flashinfer_paged_ps{_page_size}",
        [named(PagedCase(b.q_lens, b.kv_lens, _page_size, shared_prefix=b.shared_prefix),
               b.name) for b in PAGED_BATCHES],
    )  # fmt: skip
CASES[PAGED_FP8] = (
    "flashinfer_fp8kv",
    [named(PagedCase(b.q_lens, b.kv_lens, 64, shared_prefix=b.shared_prefix,
                     fp8_scales=(FP8_K_SCALE, FP8_V_SCALE)), b.name) for b in PAGED_BATCHES],
)  # fmt: skip


def error(args, inputs, name, baseline) -> float:
    """The normwise distance of name's output to the baseline's (destination-passing: the first
    argument after the inputs, written by the timed calls); inf if not finite, nan if either
    returns its outputs instead."""
    if min(len(args[name]), len(args[baseline])) == len(inputs):
        return math.nan
    output, expected = args[name][len(inputs)], args[baseline][len(inputs)]
    if not bool(torch.isfinite(output).all()):
        return math.inf
    return normwise_error(output, expected)


def call_args(runnables, case, inputs) -> dict:
    """Each runnable's call arguments: the inputs, then poisoned outputs for a
    destination-passing one (an unwritten element shows)."""
    return {name: call_arguments(fn, case, inputs) for name, fn in runnables.items()}


def kernel_ratios(runnables, args, baseline, rounds: int) -> dict:
    """name -> the baseline's kernel time over name's: the median of `rounds` alternating
    rounds' ratios (ABBA), do_bench 200 ms a timing."""
    calls = {name: (runnables[name], args[name]) for name in runnables}
    ms = alternating_ms(calls, rounds, lambda fn, a: kernel_ms(fn, a, warmup=25, rep=200))
    return {name: median(round_ratios(ms, baseline, name)) for name in runnables}


def compare(names, baseline, cases, old=(), kernel_rounds=0):
    runnables = {name: build_solution(name) for name in [baseline, *names]}
    for solution in old:
        # an earlier version of a shipped solution, or a variant (tilelang_variant.py) by name
        label = f"{solution.name}@old" if solution.name in runnables else solution.name
        runnables[label] = build_solution_object(solution)
    names = list(runnables)
    rows = []
    for case in cases:
        inputs = make_inputs(case, "cuda", seed=0)
        args = call_args(runnables, case, inputs)
        best = {name: float("inf") for name in names}
        kernel = dict(best)
        # ABBA: in a fixed order the last solution was always timed on the card the others had
        # heated (a 7% "loss" at 2x8192 that alternating rounds did not show: cuda/TUNING.md).
        for round_ in range(2):
            for name in names if round_ == 0 else names[::-1]:
                ms = time_runnable(runnables[name], args[name], 10, 50, "cuda")
                best[name] = min(best[name], ms)
                if not kernel_rounds:  # else timed in rounds of their own below
                    kernel[name] = min(kernel[name], kernel_ms(runnables[name], args[name]))
        if kernel_rounds:
            paired = kernel_ratios(runnables, args, baseline, kernel_rounds)
        else:
            paired = {name: kernel[baseline] / kernel[name] for name in names}
        for name in names:
            ratios = best[baseline] / best[name], paired[name]
            rows.append(
                (case.id[:34], name, best[name], *ratios, error(args, inputs, name, baseline))
            )
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="+")
    parser.add_argument("--old", nargs="*", default=[], help="Solution JSON of earlier versions")
    parser.add_argument("--min-tokens", type=int, default=0, help="skip smaller ragged batches")
    parser.add_argument(
        "--workloads",
        nargs="+",
        metavar="NAME",
        help="only these ragged, window and paged workloads (no padded shapes)",
    )
    parser.add_argument(
        "--kernel-rounds",
        type=int,
        default=0,
        metavar="N",
        help="kernel time from N alternating rounds of 200 ms timings (median ratio)",
    )
    parser.add_argument(
        "--padded",
        nargs="+",
        type=padded_case,
        metavar="SHAPE",
        help="the mini definition's shapes instead: BATCHxKEYS[-causal]",
    )
    options = parser.parse_args()
    if options.padded:
        CASES[MINI] = (CASES[MINI][0], options.padded)
    old = [Solution.model_validate_json(open(path).read()) for path in options.old]
    print("gpu at start:", clocks())
    rows, min_tokens = [], options.min_tokens
    for definition, (baseline, cases) in CASES.items():
        names = [n for n in options.names if load_solution(n).definition == definition]
        if names:
            big = [c for c in cases if isinstance(c, PaddedCase) or sum(c.q_lens) >= min_tokens]
            if options.workloads:
                big = [c for c in big if WORKLOAD_OF.get(c.id) in options.workloads]
            olds = [s for s in old if s.definition == definition]
            rows += compare(names, baseline, big, olds, options.kernel_rounds)
    print("gpu at end:", clocks())
    # err: the output's normwise distance to the baseline's (a wrong variant is not a fast one)
    header = f"{'shape':34s} {'solution':20s} {'ms':>9s} {'FI/x':>6s} {'kernel FI/x':>11s}"
    print(f"\n{header} {'err vs FI':>9s}")
    for shape, name, ms, ratio, kernel_ratio, err in rows:
        flag = " WRONG" if err >= 2e-2 else ""  # not for nan: not compared
        row = f"{shape:34s} {name:20s} {ms:9.4f} {ratio:6.2f} {kernel_ratio:11.2f}"
        print(f"{row} {err:9.1e}{flag}")


if __name__ == "__main__":
    main()
