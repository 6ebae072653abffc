"""On the GPU: the FP8 decode paths on decode-like batches beyond single_token_rows_16 (the one
workload they were tuned on): batch size x context length x query tokens a sequence, each
solution's kernel time (triton.testing.do_bench, best of two interleaved rounds) against
FlashInfer's FP8 paged wrapper, with the output's normwise distance to FlashInfer's (flagged
from 2e-2). Kernel time only: flashinfer-bench's timer clones every input before each call,
which on caches of a few GB takes longer than the calls.

    python scripts/decode_sweep.py                          # the decode kernels (the default)
    PREFILL_BUNDLE_DECODE_KERNEL=0 PREFILL_BUNDLE_TILELANG_DECODE=0 \\
        python scripts/decode_sweep.py                      # the paths they replaced

Both switches are read by the solutions (CUDA every call, TileLang when a shape is first
planned), so run the two settings as two processes and set them before the first call.
"""

import argparse
import itertools
import os

import torch
import triton.testing
from compare_gpu import call_args, error

from prefill_bundle.testing import PagedCase, build_solution, make_inputs
from prefill_bundle.workloads import FP8_K_SCALE, FP8_V_SCALE

SOLUTIONS = ("cuda_fp8kv", "tilelang_fp8kv", "triton_fp8kv")
BASELINE = "flashinfer_fp8kv"


def context_lengths(batch: int, mean: int, seed: int) -> tuple:
    """batch lengths drawn uniformly from [mean / 2, 3 mean / 2] (ragged, as a server's are)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(mean // 2, mean * 3 // 2 + 1, (batch,), generator=gen).tolist())


def sweep_cases(batches, contexts, rows, max_keys) -> list:
    cases = []
    for seed, (batch, mean, tokens) in enumerate(itertools.product(batches, contexts, rows)):
        if batch * mean > max_keys:
            continue
        kv_lens = context_lengths(batch, mean, seed)
        case = PagedCase((tokens,) * batch, kv_lens, 64, fp8_scales=(FP8_K_SCALE, FP8_V_SCALE))
        cases.append(((batch, mean, tokens), case))
    return cases


def kernel_times(runnables, case) -> tuple:
    """Each runnable's best do_bench time (ms) over two interleaved rounds, and its output's
    normwise distance to the first's (the baseline's)."""
    inputs = make_inputs(case, "cuda", seed=0)
    args = call_args(runnables, case, inputs)
    best = {name: float("inf") for name in runnables}
    for _ in range(2):
        for name, fn in runnables.items():
            call = lambda: fn(*args[name])  # noqa: E731
            best[name] = min(best[name], triton.testing.do_bench(call, 10, 50))
    baseline = next(iter(runnables))
    return best, {name: error(args, inputs, name, baseline) for name in runnables}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--solutions", nargs="+", default=list(SOLUTIONS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384],
                        help="mean keys a sequence")  # fmt: skip
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4],
                        help="query tokens a sequence (decode-like: at most 4)")  # fmt: skip
    parser.add_argument("--max-keys", type=int, default=1 << 18, help="skip larger batches")
    options = parser.parse_args()
    switches = {k: os.environ.get(k, "unset") for k in
                ("PREFILL_BUNDLE_DECODE_KERNEL", "PREFILL_BUNDLE_TILELANG_DECODE")}  # fmt: skip
    print("switches:", switches)
    runnables = {name: build_solution(name) for name in [BASELINE, *options.solutions]}
    header = f"{'batch':>5s} {'keys':>6s} {'q':>2s} {'FI us':>8s}"
    for name in options.solutions:
        header += f" {name[:22]:>22s}"
    print(f"{header}\n{'':24s}" + "       FI/x     err" * len(options.solutions), flush=True)
    labelled = sweep_cases(options.batches, options.contexts, options.rows, options.max_keys)
    for (batch, mean, tokens), case in labelled:
        best, errors = kernel_times(runnables, case)
        line = f"{batch:5d} {mean:6d} {tokens:2d} {best[BASELINE] * 1e3:8.1f}"
        for name in options.solutions:
            flag = "!" if not errors[name] < 2e-2 else " "
            line += f" {best[BASELINE] / best[name]:11.2f} {errors[name]:7.1e}{flag}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
