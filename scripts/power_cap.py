"""On the GPU: the SM clock, power draw and throttle reasons while each mini solution runs back
to back for 4 s on two long shapes (and cuBLAS's bf16 GEMM 8192^3 beside them), sampled by
nvidia-smi every 100 ms, the steady state's medians, two rounds in ABBA order. On the H200 every
kernel ran at the software power cap (cuda/TUNING.md, "The long shapes run at the card's power
cap"): TF/s per GHz is then a kernel's cycle efficiency, the clock what its power allows.

    python scripts/power_cap.py [--shapes 1x16384 8x2048-causal 1x8192-causal] [--no-gemm]
    python scripts/power_cap.py --solutions flashinfer_mini cuda_mini V/cuda_mini_x.json

A shape is BATCHxLENGTH[-causal], as compare_gpu.py's --padded. Each solution is called a few times
before its first sample (its first call builds or plans).
"""

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch

from prefill_bundle.report import FLOPS_PER_PAIR, visible_pairs
from prefill_bundle.testing import (
    build_solution_or_file,
    call_arguments,
    make_inputs,
    padded_case,
)

SOLUTIONS = ["flashinfer_mini", "cuda_mini", "tilelang_mini", "triton_mini"]
SHAPES = ["1x16384", "8x2048-causal"]
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.sw_power_cap"


def sampled(run) -> tuple:
    """run() under nvidia-smi sampling every 100 ms: (median SM MHz, median W, last temperature,
    samples with the power cap active, samples) over the last two thirds of the samples."""
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.3)
    run()
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 3]
    rows = rows[len(rows) // 3 :]  # the steady state
    capped = sum(row[3].strip() == "Active" for row in rows)
    mhz = statistics.median(float(r[0]) for r in rows)
    watts = statistics.median(float(r[1]) for r in rows)
    return mhz, watts, rows[-1][2], capped, len(rows)


def sample(fn, seconds: float = 4.0) -> tuple:
    """fn run back to back for `seconds`: (ms a call, then sampled()'s medians)."""
    calls = 0

    def run():
        nonlocal calls
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                fn()
            calls += 4
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    medians = sampled(run)
    return (start.elapsed_time(end) / calls, *medians)


def row(label: str, name: str, flops: float, fn) -> str:
    ms, mhz, watts, temperature, capped, samples = sample(fn)
    tflops = flops / ms / 1e9
    return (f"| {label} | {name} | {ms:.3f} | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | "
            f"{tflops / mhz * 1000:.0f} | {capped}/{samples} | {temperature} |")  # fmt: skip


def one_call(fn, case, inputs):
    """A call of the built solution on inputs (testing.call_arguments)."""
    call_args = call_arguments(fn, case, inputs)
    return lambda: fn(*call_args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", type=padded_case, default=[padded_case(s) for s in SHAPES],
        help="BATCHxLENGTH[-causal]",
    )  # fmt: skip
    parser.add_argument("--solutions", nargs="+", default=SOLUTIONS, help="names or JSON files")
    parser.add_argument("--no-gemm", action="store_true", help="leave out cuBLAS's GEMM")
    args = parser.parse_args()
    names = [Path(s).stem for s in args.solutions]
    runnables = {Path(s).stem: build_solution_or_file(s) for s in args.solutions}
    print("| shape | kernel | ms a call | TF/s | SM MHz | W | TF/s per GHz | power-capped samples "
          "| C |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for case in args.shapes:
        inputs = make_inputs(case, "cuda", seed=0)
        flops = FLOPS_PER_PAIR * case.batch * visible_pairs(case.seq_q, case.seq_kv, case.causal)
        label = f"{case.batch}x{case.seq_kv} {'causal' if case.causal else 'non-causal'}"
        calls = {name: one_call(fn, case, inputs) for name, fn in runnables.items()}
        for call in calls.values():  # the first calls build and plan
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        for round_ in range(2):
            for name in names if round_ == 0 else names[::-1]:
                print(row(f"{label}, round {round_ + 1}", name, flops, calls[name]), flush=True)
    if args.no_gemm:
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    print(row("GEMM 8192^3", "cuBLAS bf16", 2 * 8192**3, lambda: a @ b))


if __name__ == "__main__":
    main()
