"""On the GPU: where the time of a call goes. Per workload and solution: host time per call
(the GPU kept busy, so the Python side is what is measured), kernel time (do_bench) and
flashinfer-bench's time (host + kernel, L2 flushed). For Triton, also the pieces of its entry
point: the per-call checks, its launch, and (FA-2 plans) what the JIT's own launch costs, or
(Gluon plans) the descriptors its launch builds.

    python scripts/host_cost.py                       # the four short ragged workloads
    python scripts/host_cost.py --batches chunked_prefill_2k_over_16k_window_4096 prompt_8k
"""

import argparse
import functools

import triton.testing
from flashinfer_bench.bench.timing import time_runnable

from prefill_bundle.gpu_timing import host_us
from prefill_bundle.testing import (
    RaggedCase,
    build_solution,
    entry_module,
    make_inputs,
    poisoned_outputs,
)
from prefill_bundle.workloads import RAGGED_BATCHES, SWA_BATCHES

BACKENDS = ("flashinfer", "cuda", "tilelang", "triton")
# Calls a host measurement: fewer than the launch queue holds (two launches a Triton Gluon call)
# while long kernels queue.
CALLS = 200
SUFFIX = {"gqa_ragged_prefill_causal_h32_kv8_d128": "ragged",
          "gqa_ragged_prefill_causal_swa_h32_kv8_d128": "swa"}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    batches = {batch.name: batch for batch in RAGGED_BATCHES + SWA_BATCHES}
    parser.add_argument("--batches", nargs="+", choices=batches, metavar="NAME",
                        default=[batch.name for batch in RAGGED_BATCHES[:4]])  # fmt: skip
    selected = [batches[name] for name in parser.parse_args().batches]
    rows = []
    for batch in selected:
        suffix = SUFFIX[batch.definition]
        # (build_solution is memoized: a definition's solutions are built once)
        runnables = {f"{b}_{suffix}": build_solution(f"{b}_{suffix}") for b in BACKENDS}
        triton_mod = entry_module(runnables[f"triton_{suffix}"])
        case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
        inputs = make_inputs(case, "cuda", seed=0)
        outputs = poisoned_outputs(case, inputs)
        for name, fn in runnables.items():
            call = lambda: fn(*inputs, *outputs)  # noqa: E731
            bench = time_runnable(fn, inputs + outputs, 10, 50, "cuda") * 1e3
            kernel = triton.testing.do_bench(call, warmup=10, rep=50) * 1e3
            rows.append((batch.name, name, host_us(call, CALLS), kernel, bench))
        q, k, v, qo, kv = inputs[:5]
        scale, window = inputs[-1], batch.window_left
        if window is not None and not 0 <= window < k.shape[0]:
            window = None  # no window: run_ragged_swa runs the ragged plan
        out, lse = outputs
        names = ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse")
        tensors = (q, k, v, qo, kv, out, lse)
        plans = triton_mod._window_plans if window is not None else triton_mod._ragged_plans
        plan = plans[next(reversed(plans))]  # the plan the calls above used last
        pieces = {
            "triton: checks": lambda: triton_mod.check_placement(names, tensors),
            "triton: launch_ragged": lambda: triton_mod.launch_ragged(
                plan, q, k, v, qo, kv, scale, out, lse, window
            ),
        }
        if isinstance(plan, triton_mod.GluonRaggedPlan):
            gluon = triton_mod.gluon_attention
            pieces["triton: gluon launch args"] = lambda: gluon.ragged_launch_args(
                q, k, v, out, lse, qo, kv, plan[0], scale, window_left=window
            )
            pieces["triton: its FA-2 launch"] = lambda: triton_mod.launch_ragged(
                plan[2], q, k, v, qo, kv, scale, out, lse, window
            )
            for label, fn in pieces.items():
                rows.append((batch.name, label, host_us(fn, CALLS), float("nan"), float("nan")))
            continue
        grid, meta, nseq, total_q, total_kv, _ = plan
        # The JIT path that launch_ragged skips once warm (_cached_launch in triton_prefill.py).
        jit_args = (q, k, v, out, lse, qo, kv, None, None, nseq, total_q, total_kv, None,
                    scale * triton_mod.LOG2_E, None, window)  # fmt: skip
        constexprs = triton_mod._attention_constexprs(meta)
        launch = triton_mod.gqa_prefill_fwd[grid]
        pieces["triton: jit launch"] = functools.partial(launch, *jit_args, **constexprs)
        for label, fn in pieces.items():
            rows.append((batch.name, label, host_us(fn, CALLS), float("nan"), float("nan")))
    print(f"\n{'workload':40s} {'entry':26s} {'host us':>8s} {'kernel us':>9s} {'bench us':>9s}")
    for workload, name, host, kernel, bench in rows:
        print(f"{workload:40s} {name:26s} {host:8.1f} {kernel:9.1f} {bench:9.1f}")


if __name__ == "__main__":
    main()
