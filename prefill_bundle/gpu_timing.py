"""Helpers of the GPU scripts (scripts/tune_*.py, compare_gpu.py, host_cost.py, the pairing
scripts): the card's clock and temperature (it heats up within one call: print them with every
timing), kernels timed in alternating rounds, and the host time of a call."""

import statistics
import subprocess
import time


def clocks() -> str:
    """'1980 MHz, 53, 522.80 W': SM clock, temperature (C), power draw, from nvidia-smi."""
    query = "--query-gpu=clocks.sm,temperature.gpu,power.draw"
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()


def host_us(fn, calls: int = 400) -> float:
    """Microseconds of host (Python) time per call of fn, calls back to back: what a call costs
    the host while the GPU keeps up (short kernels) or queues (long ones)."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return elapsed * 1e6


PAIRED_ROUNDS = 6


def kernel_ms(fn, args, warmup: int = 10, rep: int = 50) -> float:
    """fn(*args)'s kernel time: triton.testing.do_bench (L2 flushed before each call)."""
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args), warmup=warmup, rep=rep)


def alternating_ms(calls: dict, rounds: int = PAIRED_ROUNDS, timer=kernel_ms) -> dict:
    """name -> its ms in each round, the calls (name -> (fn, args)) timed by timer(fn, args)
    alternating ABBA round by round (A B, B A, ...): the card's clock drifts within a call
    (1.7-1.98 GHz, power and heat) by more than the gaps the pairing scripts look for, and a
    linear drift cancels over each two rounds (ragged-first rounds read 0.99 for equal
    kernels: tests)."""
    names = list(calls)
    ms = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            ms[name].append(timer(*calls[name]))
    return ms


def round_ratios(ms: dict, numerator: str, denominator: str) -> list:
    """numerator's ms over denominator's, round by round (alternating_ms's rounds)."""
    return [a / b for a, b in zip(ms[numerator], ms[denominator])]


def median(values: list) -> float:
    return statistics.median(values)
