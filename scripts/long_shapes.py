"""On the GPU: the kernel-time table of issue 19 (beyond FA3): each backend's padded kernel
(the mini definition's solutions, float16) against FlashInfer fa3 and SDPA on the long shapes,
kernel time (do_bench, L2 flushed, 200 ms a timing), all solutions alternating ABBA over the
rounds in one call (gpu_timing.alternating_ms), TF/s from the median time and the masked FLOP
count, the ratio to FlashInfer the median of the rounds' ratios (the card's clock moves by
10-15% between rounds on the 7-15 ms shapes: each round's pair shares its moment), clocks
printed. Writes the table as markdown (report.md includes it: KERNEL_TIME_MD in
prefill_bundle.report).

    python scripts/long_shapes.py                    # prints the table
    python scripts/long_shapes.py --out kernel_time.md
"""

import argparse
import datetime
import platform
from importlib.metadata import version

import torch

from prefill_bundle.gpu_timing import alternating_ms, clocks, kernel_ms, median, round_ratios
from prefill_bundle.report import FLOPS_PER_PAIR, visible_pairs
from prefill_bundle.testing import PaddedCase, build_solution, call_arguments, make_inputs

# Issue 19's shapes: (batch, length, causal).
SHAPES = [(1, 16384, False), (1, 32768, True), (8, 2048, True), (1, 8192, True), (4, 512, False)]
BASELINE = "flashinfer_mini"
SOLUTIONS = [BASELINE, "cuda_mini", "tilelang_mini", "triton_mini", "sdpa_mini"]
ROUNDS = 6
REP_MS = 200  # do_bench's window: 13+ calls of the longest shape
PACKAGES = ("torch", "triton", "flashinfer-python", "flashinfer-bench", "tilelang")


def flops(batch: int, length: int, causal: bool) -> float:
    return FLOPS_PER_PAIR * batch * visible_pairs(length, length, causal)


def measure() -> tuple:
    """(rows, clocks at start, clocks at end, the GPU's name); a row: shape label, flops, and
    per solution its median ms and its median ratio to FlashInfer over the rounds."""
    runnables = {name: build_solution(name) for name in SOLUTIONS}
    start = clocks()
    rows = []
    for batch, length, causal in SHAPES:
        case = PaddedCase(batch, length, length, causal)
        inputs = make_inputs(case, "cuda", seed=0)
        calls = {name: (fn, call_arguments(fn, case, inputs)) for name, fn in runnables.items()}
        ms = alternating_ms(calls, ROUNDS, lambda fn, args: kernel_ms(fn, args, rep=REP_MS))
        for name in SOLUTIONS:  # the spread behind each median
            rounds = " ".join(f"{x:.3f}" for x in ms[name])
            print(f"{batch}x{length} causal={causal} {name:16s} ms by round: {rounds}")
        mask = "causal" if causal else "non-causal"
        medians = {name: median(ms[name]) for name in SOLUTIONS}
        ratios = {name: median(round_ratios(ms, BASELINE, name)) for name in SOLUTIONS}
        rows.append((f"{batch}x{length} {mask}", flops(batch, length, causal), medians, ratios))
        del inputs, calls
        torch.cuda.empty_cache()
    return rows, start, clocks(), torch.cuda.get_device_name()


def markdown(rows, start, end, device) -> str:
    names = SOLUTIONS
    lines = [
        "## Kernel time on the long shapes (issue 19)",
        "",
        "Generated on the GPU by `python scripts/long_shapes.py --out kernel_time.md` (not from "
        "the traces): the mini definition's solutions (float16), kernel time with "
        f"`triton.testing.do_bench` (L2 flushed, {REP_MS} ms a timing), all solutions "
        f"alternating over {ROUNDS} rounds in one call. Each cell: the median time, TF/s from it "
        "and the masked FLOP count, and the ratio to FlashInfer fa3 (its time / the solution's, "
        "the median of the rounds' ratios).",
        "",
        "| shape | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for label, work, ms, ratios in rows:
        cells = []
        for name in names:
            tflops = work / (ms[name] * 1e-3) / 1e12
            ratio = "" if name == BASELINE else f" · **{ratios[name]:.2f}×**"
            cells.append(f"{ms[name] * 1e3:.0f} µs · {tflops:.0f} TF/s{ratio}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    versions = ", ".join(f"{p} {version(p)}" for p in PACKAGES)
    lines += [
        "",
        f"- {device}, {datetime.date.today()}, {platform.node()}; "
        f"{versions}; SM clock, temperature, power at start: {start}; at end: {end}.",
        "",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the markdown table there")
    options = parser.parse_args()
    text = markdown(*measure())
    print(text)
    if options.out:
        with open(options.out, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
