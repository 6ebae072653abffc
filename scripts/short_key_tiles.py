"""On the GPU: CUDA's padded non-causal kernels by key count, the full family's tiles (192 keys,
cuda_variants.SHIPPED_FULL) against the causal family's 128-key ones
(gqa_prefill_full128_wgmma_kernel), each forced with PREFILL_BUNDLE_SHORT_KEY_TILES=0 / 1,
kernel time over FlashInfer fa3's in alternating rounds
(gpu_timing). Where the two cross sets uses_short_key_tiles' threshold (cuda/entry_launch.cuh;
cuda/TUNING.md, "Short non-causal sequences"). Outputs checked against FlashInfer's first.

    python scripts/short_key_tiles.py [--shapes 4x512 8x1024 4x2048 ...] [--dtype float16]
"""

import argparse
import os

import torch

from prefill_bundle.cuda_variants import SHIPPED_CAUSAL, SHIPPED_FULL
from prefill_bundle.gpu_timing import alternating_ms, clocks, kernel_ms, median, round_ratios
from prefill_bundle.testing import (
    build_solution,
    make_inputs,
    normwise_error,
    padded_case,
    poisoned_outputs,
)

SHAPES = ["4x512", "8x1024", "4x2048", "2x4096", "1x8192", "1x16384"]
# column (the family's keys a tile) -> PREFILL_BUNDLE_SHORT_KEY_TILES
FULL, SHORT = str(SHIPPED_FULL.block_n), str(SHIPPED_CAUSAL.block_n)
TILES = {FULL: "0", SHORT: "1"}
ROUNDS = 4


def forced(fn, mode: str):
    """fn with the tile shape forced on every call (the CUDA entry reads the variable per call)."""

    def call(*args):
        os.environ["PREFILL_BUNDLE_SHORT_KEY_TILES"] = mode
        return fn(*args)

    return call


def table(rows: list) -> str:
    """rows: (shape, FlashInfer's ms, {tiles: ms}, {tiles: median ratio}, {tiles: error})."""
    lines = [f"| shape | FlashInfer us | {FULL}-key us | {SHORT}-key us | {FULL}-key ratio "
             f"| {SHORT}-key ratio | error {FULL} / {SHORT} |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape, fi_ms, ms, ratio, error in rows:
        lines.append(
            f"| {shape} | {fi_ms * 1e3:.1f} | {ms[FULL] * 1e3:.1f} | {ms[SHORT] * 1e3:.1f} "
            f"| {ratio[FULL]:.3f} | {ratio[SHORT]:.3f} | {error[FULL]:.1e} / {error[SHORT]:.1e} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=SHAPES, help="BATCHxKEYS (seq_q = seq_kv)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    flashinfer, cuda = build_solution("flashinfer_mini"), build_solution("cuda_mini")
    print("gpu at start:", clocks(), flush=True)
    rows = []
    for shape in args.shapes:
        case = padded_case(shape, dtype)
        inputs = make_inputs(case, "cuda", seed=0)
        calls = {"flashinfer": (flashinfer, inputs + poisoned_outputs(case, inputs))}
        for tiles, mode in TILES.items():
            calls[tiles] = (forced(cuda, mode), inputs + poisoned_outputs(case, inputs))
        for fn, call_args in calls.values():
            fn(*call_args)
        torch.cuda.synchronize()
        expected = calls["flashinfer"][1][len(inputs)]
        error = {t: normwise_error(calls[t][1][len(inputs)], expected) for t in TILES}
        ms = alternating_ms(calls, ROUNDS, lambda fn, a: kernel_ms(fn, a, warmup=25, rep=120))
        ratio = {t: median(round_ratios(ms, "flashinfer", t)) for t in TILES}
        rows.append((shape, median(ms["flashinfer"]), {t: median(ms[t]) for t in TILES}, ratio,
                     error))  # fmt: skip
        print(rows[-1], flush=True)
    os.environ.pop("PREFILL_BUNDLE_SHORT_KEY_TILES", None)
    print("gpu at end:", clocks())
    print(table(rows))


if __name__ == "__main__":
    main()
