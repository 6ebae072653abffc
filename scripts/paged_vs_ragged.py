"""On the GPU: each backend's paged kernel against its own ragged kernel on the same K/V (the
paged workloads' shapes; the ragged K/V is the pages gathered), kernel time in one call. The
card's clock drifts within a call (power and heat: 1.7-1.98 GHz) by more than the gap measured,
so the two kernels alternate in 6 short rounds, ABBA order (gpu_timing.alternating_ms: a
linear drift cancels), and the ratio printed is the median of the rounds' ratios, with their
spread. The issue's bar: paged at least 0.95x its ragged speed at page size 64, 0.9x at page
size 1.

    python scripts/paged_vs_ragged.py                      # every backend, FlashInfer too
    python scripts/paged_vs_ragged.py --backends cuda --page-sizes 64
"""

import argparse

from prefill_bundle.gpu_timing import alternating_ms, clocks, kernel_ms, median, round_ratios
from prefill_bundle.testing import (
    PagedCase,
    build_solution,
    call_arguments,
    gathered_ragged_inputs,
    make_inputs,
    nan_slots_to_zero,
)
from prefill_bundle.workloads import PAGED_BATCHES


def short_kernel_ms(fn, args) -> float:
    """Shorter than gpu_timing.kernel_ms's default: 6 rounds x 2 kernels x 16 batches."""
    return kernel_ms(fn, args, warmup=5, rep=20)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="*", default=["cuda", "tilelang", "triton",
                                                          "flashinfer"])  # fmt: skip
    parser.add_argument("--page-sizes", nargs="*", type=int, default=[64, 1])
    options = parser.parse_args()
    print("gpu at start:", clocks())
    rows = []
    for page_size in options.page_sizes:
        for batch in PAGED_BATCHES:
            case = PagedCase(batch.q_lens, batch.kv_lens, page_size,
                             shared_prefix=batch.shared_prefix)  # fmt: skip
            paged = nan_slots_to_zero(make_inputs(case, "cuda", seed=0))
            ragged = gathered_ragged_inputs(case, paged)
            for backend in options.backends:
                pair = {}
                for kind, name, args in (
                    ("ragged", f"{backend}_ragged", ragged),
                    ("paged", f"{backend}_paged_ps{page_size}", paged),
                ):
                    fn = build_solution(name)
                    pair[kind] = (fn, call_arguments(fn, case, args))
                for fn, args in pair.values():
                    short_kernel_ms(fn, args)  # warm-up
                ms = alternating_ms(pair, timer=short_kernel_ms)
                ratios = round_ratios(ms, "ragged", "paged")
                row = (median(ms["ragged"]), median(ms["paged"]), ratios)
                rows.append((batch.name, page_size, backend, *row))
    print("gpu at end:", clocks())
    print(f"\n{'workload':30s} {'ps':>3s} {'backend':10s} {'ragged ms':>10s} {'paged ms':>9s} "
          f"{'paged/ragged speed':>18s} {'rounds: min-max':>16s}")  # fmt: skip
    for name, page_size, backend, ragged_ms, paged_ms, ratios in rows:
        bar = 0.95 if page_size > 1 else 0.9
        ratio = median(ratios)
        flag = "" if ratio >= bar or backend == "flashinfer" else f"  < {bar}"
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"{name:30s} {page_size:3d} {backend:10s} {ragged_ms:10.4f} {paged_ms:9.4f} "
              f"{ratio:18.3f} {spread:>16s}{flag}")  # fmt: skip


if __name__ == "__main__":
    main()
