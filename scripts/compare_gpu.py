"""On the GPU: time packed solutions against FlashInfer the way flashinfer-bench does (its own
time_runnable: synchronize, flush L2, clone inputs, time one call with events; host overhead
included), interleaved (A B A B) because the card heats up within a call; best of two rounds.

    python scripts/compare_gpu.py triton_mini tilelang_mini triton_ragged
"""

import sys

from flashinfer_bench.bench.timing import time_runnable

from prefill_bundle import MINI
from prefill_bundle.gpu_timing import clocks
from prefill_bundle.testing import (
    PaddedCase,
    RaggedCase,
    build_solution,
    load_solution,
    make_inputs,
    poisoned_outputs,
)
from prefill_bundle.workloads import RAGGED_BATCHES

PADDED = [
    PaddedCase(8, 2048, 2048, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(1, 16384, 16384, False),
    PaddedCase(1, 128, 128, True),
    PaddedCase(4, 512, 512, True),
    PaddedCase(4, 128, 2048, True),
]
RAGGED = [RaggedCase(b.q_lens, b.kv_lens) for b in RAGGED_BATCHES]


def compare(names, baseline, cases):
    names = [baseline, *names]
    runnables = {name: build_solution(name) for name in names}
    rows = []
    for case in cases:
        inputs = make_inputs(case, "cuda", seed=0)
        args = {}
        for name, fn in runnables.items():
            dps = fn.metadata.destination_passing_style
            args[name] = inputs + (poisoned_outputs(case, inputs) if dps else [])
        best = {name: float("inf") for name in names}
        for _ in range(2):
            for name in names:
                ms = time_runnable(runnables[name], args[name], 10, 50, "cuda")
                best[name] = min(best[name], ms)
        for name in names:
            rows.append((case.id[:34], name, best[name], best[baseline] / best[name]))
    return rows


def main(names):
    print("gpu at start:", clocks())
    mini = [n for n in names if load_solution(n).definition == MINI]
    ragged = [n for n in names if n not in mini]
    rows = []
    if mini:
        rows += compare(mini, "flashinfer_mini", PADDED)
    if ragged:
        rows += compare(ragged, "flashinfer_ragged", RAGGED)
    print("gpu at end:", clocks())
    print(f"\n{'shape':34s} {'solution':16s} {'ms':>9s} {'FI/x':>6s}")
    for shape, name, ms, ratio in rows:
        print(f"{shape:34s} {name:16s} {ms:9.4f} {ratio:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
