"""On the GPU: each backend's sliding-window kernel against its own causal kernel on the same
q, k, v (the sliding-window workloads' shapes), kernel time in one call, the two alternating
in 6 ABBA rounds (gpu_timing.alternating_ms; medians, band/causal from each round's pair). The
issue's bar: TF/s counted over the band (visible pairs only) at least 0.9x the backend's own
causal TF/s at the same lengths; and the window kernel's speed against FlashInfer's window
kernel (bar 1.0 CUDA / TileLang, 0.8 Triton).

    python scripts/window_vs_causal.py                       # every backend, FlashInfer too
    python scripts/window_vs_causal.py --backends cuda flashinfer
    python scripts/window_vs_causal.py --bounds              # no GPU: the tiles' bounds only

The "tile bound" column: the best band/causal a kernel can reach with its tiles when every
computed pair costs the same, (visible / computed pairs) under the window over the same under
the causal mask (report.tiled_pairs), for the tiles each backend runs these workloads with.
A window of 128 visited with 128-key tiles computes about twice its visible pairs, so no tiled
kernel meets the 0.9 bar there; the gap between the ratio and its bound is the kernel's own.
"""

import argparse
import functools

from prefill_bundle.gpu_timing import alternating_ms, clocks, median, round_ratios
from prefill_bundle.report import FLOPS_PER_PAIR, tiled_pairs, visible_pairs
from prefill_bundle.testing import (
    RaggedCase,
    build_solution,
    call_arguments,
    entry_module,
    make_inputs,
)
from prefill_bundle.workloads import SWA_BATCHES

BAR_VS_FLASHINFER = {"cuda": 1.0, "tilelang": 1.0, "triton": 0.8}
# (query tokens, keys) per tile: CUDA 128 rows = 32 tokens x a KV group's 4 heads, 128 keys;
# TileLang's window kernel 128 tokens of one head (it packs heads for decode-like paged batches
# only), 128 keys; Triton's paired row blocks 2 x 32 tokens, 64 keys (its plan for all but the
# 2K chunk, which takes 16-token tiles); FlashInfer fa3 128 tokens of one head, 128 keys.
TILES = {"cuda": (32, 128), "tilelang": (128, 128), "triton": (64, 64), "flashinfer": (128, 128)}


def pairs(batch) -> tuple:
    """The batch's visible pairs under its window and under the causal mask alone."""
    lengths = list(zip(batch.q_lens, batch.kv_lens))
    band = sum(visible_pairs(q, kv, True, batch.window_left) for q, kv in lengths)
    return band, sum(visible_pairs(q, kv, True) for q, kv in lengths)


@functools.lru_cache(maxsize=None)
def triton_entry():
    """The Triton window solution's entry module (triton_prefill)."""
    return entry_module("triton_swa")


def tiles(batch, backend: str) -> tuple:
    """TILES, but Triton's Gluon kernel (128 query tokens of one head, 128 keys) where
    triton_prefill plans it on an H100: windows from GLUON_MIN_WINDOW, batches its
    gluon_takes_batch takes."""
    if backend == "triton":
        entry = triton_entry()
        total_q, total_kv = sum(batch.q_lens), sum(batch.kv_lens)
        if batch.window_left >= entry.GLUON_MIN_WINDOW and entry.gluon_takes_batch(
                len(batch.q_lens), total_q, total_kv, window=True):  # fmt: skip
            return 128, 128
    return TILES[backend]


def tile_bound(batch, backend: str, band: int, full: int) -> float:
    """The best band/causal ratio the backend's tiles allow on the batch (see the docstring);
    band, full: pairs(batch)."""
    tokens, keys = tiles(batch, backend)
    lengths = list(zip(batch.q_lens, batch.kv_lens))
    band_tiled = sum(tiled_pairs(q, kv, tokens, keys, batch.window_left) for q, kv in lengths)
    full_tiled = sum(tiled_pairs(q, kv, tokens, keys) for q, kv in lengths)
    return (band / band_tiled) / (full / full_tiled)


def tflops(pairs: int, ms: float) -> float:
    return FLOPS_PER_PAIR * pairs / (ms * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="*", default=["cuda", "tilelang", "triton",
                                                          "flashinfer"])  # fmt: skip
    parser.add_argument("--bounds", action="store_true", help="the tiles' bounds only, no GPU")
    options = parser.parse_args()
    if options.bounds:
        print(f"{'workload':40s} " + " ".join(f"{b:>10s}" for b in options.backends))
        for batch in SWA_BATCHES:
            counts = pairs(batch)
            bounds = " ".join(f"{tile_bound(batch, b, *counts):10.3f}" for b in options.backends)
            print(f"{batch.name:40s} {bounds}")
        return
    print("gpu at start:", clocks())
    rows = []
    for batch in SWA_BATCHES:
        case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
        windowed = make_inputs(case, "cuda", seed=0)
        causal = windowed[:5] + windowed[6:]  # the same q, k, v without the window
        band, full = pairs(batch)
        timed = {}
        for backend in options.backends:
            pair = {}
            for kind, name, args in (("causal", f"{backend}_ragged", causal),
                                     ("window", f"{backend}_swa", windowed)):  # fmt: skip
                fn = build_solution(name)
                pair[kind] = (fn, call_arguments(fn, case, args))
            ms = alternating_ms(pair)
            timed[backend] = ms
        for backend, ms in timed.items():
            causal_ms, window_ms = median(ms["causal"]), median(ms["window"])
            # band/causal from the rounds' own pairs; against FlashInfer across pairs
            ratio = median(round_ratios(ms, "causal", "window")) * band / full
            fi_ms = median(timed["flashinfer"]["window"]) if "flashinfer" in timed else 0
            speeds = tflops(full, causal_ms), tflops(band, window_ms)
            rows.append((batch.name, backend, causal_ms, window_ms, *speeds, ratio,
                         tile_bound(batch, backend, band, full), fi_ms / window_ms))  # fmt: skip
    print("gpu at end:", clocks())
    print(f"\n{'workload':40s} {'backend':10s} {'causal ms':>9s} {'window ms':>9s} "
          f"{'causal TF/s':>11s} {'band TF/s':>9s} {'band/causal':>11s} {'tile bound':>10s} "
          f"{'vs FI':>6s}")  # fmt: skip
    for name, backend, causal_ms, window_ms, causal_tf, band_tf, ratio, bound, vs_fi in rows:
        flags = []
        if ratio < 0.9:
            flags.append("band < 0.9")
        if backend in BAR_VS_FLASHINFER and vs_fi and vs_fi < BAR_VS_FLASHINFER[backend]:
            flags.append(f"FI < {BAR_VS_FLASHINFER[backend]}")
        print(f"{name:40s} {backend:10s} {causal_ms:9.4f} {window_ms:9.4f} {causal_tf:11.0f} "
              f"{band_tf:9.0f} {ratio:11.3f} {bound:10.3f} {vs_fi:6.2f}  "
              f"{', '.join(flags)}")  # fmt: skip


if __name__ == "__main__":
    main()
