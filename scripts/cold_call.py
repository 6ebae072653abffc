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

--host prints, instead, the host's side of such a call: the microseconds from the call to its
return (time.perf_counter) in flashinfer-bench's own loop (L2 flushed, fresh clones, sync,
call), median of 60, with fresh clones and with the same arguments; for TileLang (whose planned
calls take its C++ fast path, fast_entry.cc) also its Python entry, that entry's Python alone
(the kernel stubbed in its plan) and the kernel's tvm-ffi main alone (called with the arguments
the entry gave it). A cold host call costs 2-3x what host_cost.py measures back to
back (TileLang's TUNING.md, "A cold call's host time").

    python scripts/cold_call.py
    python scripts/cold_call.py --workloads prompt_8k --backends cuda tilelang
    python scripts/cold_call.py --host --workloads single_token ps64:prefix_cache_hits_8x256
"""

import argparse
import functools
import statistics
import time

import torch
import triton.testing
from flashinfer_bench.bench.timing import _clone_args, time_runnable
from flashinfer_bench.bench.timing import do_bench as fib_do_bench

from prefill_bundle.testing import (
    PagedCase,
    RaggedCase,
    build_solution,
    entry_module,
    make_inputs,
    nan_slots_to_zero,
    poisoned_outputs,
    tilelang_python_entry,
)
from prefill_bundle.workloads import PAGED_BATCHES, RAGGED_BATCHES, SWA_BATCHES

SUFFIX = {"gqa_ragged_prefill_causal_h32_kv8_d128": "ragged",
          "gqa_ragged_prefill_causal_swa_h32_kv8_d128": "swa"}  # fmt: skip
PAGED_PREFIX = {"ps64:": 64, "ps1:": 1}  # --workloads ps64:NAME, ps1:NAME: a paged workload
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


@functools.cache
def flush_buffer() -> torch.Tensor:
    """flashinfer-bench's 256 MB L2 flush buffer, allocated once."""
    return torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def host_in_bench_loop(fn, args, clones: bool, prepare=None, reps: int = 60) -> float:
    """Median us from fn's call to its return in flashinfer-bench's loop (L2 flushed, the
    arguments cloned if clones, prepare(arguments) untimed, synchronize, call)."""
    cache = flush_buffer()
    times = []
    for i in range(reps + 10):
        cache.zero_()
        call_args = _clone_args(args) if clones else args
        if prepare is not None:
            call_args = prepare(call_args)
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn(*call_args)
        end = time.perf_counter_ns()
        torch.cuda.synchronize()
        if i >= 10:  # warm-up
            times.append((end - start) / 1e3)
    return statistics.median(times)


def tilelang_pieces(entry, plans, args) -> dict:
    """TileLang's call in two, cold: its Python with the kernel stubbed in the plan the entry
    used last, and that kernel's tvm-ffi main alone on the arguments the entry gave it."""
    key = next(reversed(plans))
    plan = plans[key]
    if not callable(plan[0]):
        return {}  # page size 1 gathered first: two kernels

    def main_args(call_args):  # what the entry passes main for these tensors (untimed)
        captured = []
        plans[key] = (lambda *x: captured.append(x), *plan[1:])
        entry(*call_args)
        plans[key] = plan
        return captured[0]

    pieces = {}
    for clones in (True, False):
        plans[key] = (lambda *x: None, *plan[1:])
        python = host_in_bench_loop(entry, args, clones)
        plans[key] = plan
        main = host_in_bench_loop(plan[0], args, clones, prepare=main_args)
        pieces[clones] = (python, main)
    return pieces


def workload(name: str) -> tuple:
    """(case, solution suffix) of a ragged or window workload, or of ps64:NAME / ps1:NAME."""
    for prefix, page_size in PAGED_PREFIX.items():
        if name.startswith(prefix):
            batch = {b.name: b for b in PAGED_BATCHES}[name[len(prefix):]]
            case = PagedCase(batch.q_lens, batch.kv_lens, page_size,
                             shared_prefix=batch.shared_prefix)  # fmt: skip
            return case, f"paged_ps{page_size}"
    batch = {b.name: b for b in RAGGED_BATCHES + SWA_BATCHES}[name]
    case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
    return case, SUFFIX[batch.definition]


def host_rows(names: list, backends: list) -> None:
    print("host us from the call to its return, flashinfer-bench's loop, median of 60: "
          "fresh clones | the same arguments")  # fmt: skip
    for name in names:
        case, suffix = workload(name)
        inputs = nan_slots_to_zero(make_inputs(case, "cuda", seed=0))
        args = inputs + poisoned_outputs(case, inputs)
        for backend in backends:
            fn = build_solution(f"{backend}_{suffix}")
            fn(*args)
            cells = [host_in_bench_loop(fn, args, clones) for clones in (True, False)]
            print(f"{name[:40]:40s} {backend:26s} {cells[0]:6.1f} | {cells[1]:6.1f}")
            if backend != "tilelang":
                continue
            # The Python entry (the C++ fast path set aside), whole and in two.
            module = entry_module(fn)
            with tilelang_python_entry(module):
                cells = [host_in_bench_loop(fn, args, clones) for clones in (True, False)]
                print(f"{name[:40]:40s} {'tilelang: python entry':26s} {cells[0]:6.1f} | "
                      f"{cells[1]:6.1f}")  # fmt: skip
                plans = {"ragged": module._ragged_plans, "swa": module._swa_plans}.get(suffix)
                if plans is None:
                    plans = module._paged_plans[int(suffix.removeprefix("paged_ps"))]
                pieces = tilelang_pieces(fn, plans, args)
            for i, label in enumerate(("tilelang: its python alone", "tilelang: main alone")):
                if pieces:
                    cold, same = pieces[True][i], pieces[False][i]
                    print(f"{name[:40]:40s} {label:26s} {cold:6.1f} | {same:6.1f}")


def main():
    names = [b.name for b in RAGGED_BATCHES + SWA_BATCHES]
    names += [prefix + b.name for prefix in PAGED_PREFIX for b in PAGED_BATCHES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=names, metavar="NAME",
                        default=["chunked_prefill_2k_over_16k_window_4096",
                                 "batch4_prompts_1k_3k"])  # fmt: skip
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "cuda", "tilelang"])
    parser.add_argument("--host", action="store_true", help="the host's side of a cold call")
    options = parser.parse_args()
    if options.host:
        host_rows(options.workloads, options.backends)
        return
    cache = flush_buffer()
    cycles_per_us = sleep_cycles_per_us()
    print(f"sleep: {cycles_per_us:.0f} cycles/us; us, median of 30: do_bench | L2 flushed: cold,"
          f" after a sleep of {', '.join(map(str, SLEEPS_US[1:]))} us | not flushed: the same"
          " | flashinfer-bench's mean of 100: on clones (as its traces), on the same arguments")
    for name in options.workloads:
        case, suffix = workload(name)
        inputs = nan_slots_to_zero(make_inputs(case, "cuda", seed=0))
        args = inputs + poisoned_outputs(case, inputs)
        for backend in options.backends:
            fn = build_solution(f"{backend}_{suffix}")
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
