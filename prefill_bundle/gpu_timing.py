"""Helpers of the GPU scripts (scripts/tune_*.py, compare_gpu.py, host_cost.py): the card's
clock and temperature (it heats up within one call: print them with every timing), and the host
time of a call."""

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
