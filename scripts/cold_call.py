"""On the GPU: what a cold call costs beyond the kernel. flashinfer-bench times each call on an
idle GPU (synchronize, L2 flushed, event, call, event): the host's work up to the launch and a
kernel started cold are on its clock. Per solution, median of 30 calls, the time from an event
to the kernel's end with the call made cold (host on the clock), and with the host's work hidden
behind a GPU sleep of 30, 150 and 1000 us first; with and without the L2 flush; against do_bench
(kernels back to back). TileLang's TUNING.md, "Plans keyed by less", has a table of it. Last,
flashinfer-bench's own timing as a trace takes it (time_runnable: the mean of 100 calls, each on
fresh clones of the arguments) and the same with the same arguments every call: the clones'
new tensors cost some backends more than others (TileLang's TUNING.md, "Page size 64's prefix
hits against CUDA").

    python scripts/cold_call.py
    python scripts/cold_call.py --workloads prompt_8k --backends cuda tilelang
"""

import argparse

import torch
import triton.testing
from flashinfer_bench.bench.timing import do_bench as fib_do_bench
from flashinfer_bench.bench.timing import time_runnable

from prefill_bundle.testing import RaggedCase, build_solution, make_inputs, poisoned_outputs
from prefill_bundle.workloads import RAGGED_BATCHES, SWA_BATCHES

SUFFIX = {"gqa_ragged_prefill_causal_h32_kv8_d128": "ragged",
          "gqa_ragged_prefill_causal_swa_h32_kv8_d128": "swa"}  # fmt: skip
SLEEPS_US = (0, 30, 150, 1000)  # 0: no sleep, the host's own work on the clock (a cold call)


def sleep_cycles_per_us() -> float:
    """torch.cuda._sleep's cycles per microsecond on this GPU (its clock now)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def after_idle_us(fn, args, sleep_us, flush, cache, cycles_per_us, reps=30) -> float:
    """Median us from an event to the end of fn(*args): after a GPU sleep of sleep_us (the
    host's work queued under it), or cold (sleep_us 0: synchronized, then event and call)."""
    times = []
    for _ in range(reps):
        if flush:
            cache.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(max(sleep_us, 30) * cycles_per_us))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_us == 0:
            torch.cuda.synchronize()
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    batches = {batch.name: batch for batch in RAGGED_BATCHES + SWA_BATCHES}
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=batches, metavar="NAME",
                        default=["chunked_prefill_2k_over_16k_window_4096",
                                 "batch4_prompts_1k_3k"])  # fmt: skip
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "cuda", "tilelang"])
    options = parser.parse_args()
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # as flashinfer-bench's
    cycles_per_us = sleep_cycles_per_us()
    print(f"sleep: {cycles_per_us:.0f} cycles/us; us, median of 30: do_bench | L2 flushed: cold,"
          f" after a sleep of {', '.join(map(str, SLEEPS_US[1:]))} us | not flushed: the same"
          " | flashinfer-bench's mean of 100: on clones (as its traces), on the same arguments")
    for name in options.workloads:
        batch = batches[name]
        case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
        inputs = make_inputs(case, "cuda", seed=0)
        args = inputs + poisoned_outputs(case, inputs)
        for backend in options.backends:
            fn = build_solution(f"{backend}_{SUFFIX[batch.definition]}")
            fn(*args)
            torch.cuda.synchronize()
            kernel = triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=40) * 1e3
            cells = [after_idle_us(fn, args, sleep, flush, cache, cycles_per_us)
                     for flush in (True, False) for sleep in SLEEPS_US]  # fmt: skip
            flushed = " ".join(f"{x:6.1f}" for x in cells[:4])
            unflushed = " ".join(f"{x:6.1f}" for x in cells[4:])
            traced = time_runnable(fn, args, 10, 100, "cuda") * 1e3
            same = fib_do_bench(lambda a: fn(*a), warmup=10, rep=100, setup=lambda: args) * 1e3
            print(f"{name[:40]:40s} {backend:10s} {kernel:6.1f} | {flushed} | {unflushed} | "
                  f"{traced:6.1f} {same:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
