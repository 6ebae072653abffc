"""On the GPU: time packed solutions against FlashInfer on the big padded shapes, interleaved
(A B A B) because the card heats up within a call; best of two rounds of do_bench medians.

    python scripts/compare_gpu.py triton_mini tilelang_mini
"""

import subprocess
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefill_bundle.testing import PaddedCase, build_solution, make_inputs  # noqa: E402

CASES = [
    PaddedCase(8, 2048, 2048, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(1, 16384, 16384, False),
    PaddedCase(4, 512, 512, True),
    PaddedCase(4, 128, 2048, True),
]


def clocks():
    query = "--query-gpu=clocks.sm,temperature.gpu,power.draw"
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()


def main(names):
    names = ["flashinfer_mini", *names]
    runnables = {name: build_solution(name) for name in names}
    print("gpu at start:", clocks())
    rows = []
    for case in CASES:
        q, k, v, causal = make_inputs(case, "cuda", seed=0)
        out = {name: torch.empty_like(q) for name in names}
        calls = {name: (lambda n=name: runnables[n](q, k, v, causal, out[n])) for name in names}
        best = {name: float("inf") for name in names}
        for _ in range(2):
            for name, fn in calls.items():
                best[name] = min(best[name], triton.testing.do_bench(fn, warmup=25, rep=150))
        for name in names:
            rows.append((case.id, name, best[name], best["flashinfer_mini"] / best[name]))
    print("gpu at end:", clocks())
    print(f"\n{'shape':36s} {'solution':16s} {'ms':>9s} {'FI/x':>6s}")
    for shape, name, ms, ratio in rows:
        print(f"{shape:36s} {name:16s} {ms:9.4f} {ratio:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
