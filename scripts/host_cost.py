"""On the GPU: where the time of a small call goes. For the short ragged workloads, per solution:
host time per call (the GPU kept busy, so the Python side is what is measured), kernel time
(do_bench) and flashinfer-bench's time (host + kernel, L2 flushed). For Triton, also the pieces
of its entry point: the per-call checks, its launch, and what the JIT's own launch costs.

    python scripts/host_cost.py
"""

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
from prefill_bundle.workloads import RAGGED_BATCHES

SOLUTIONS = ("flashinfer_ragged", "cuda_ragged", "tilelang_ragged", "triton_ragged")


def main():
    runnables = {name: build_solution(name) for name in SOLUTIONS}
    triton_mod = entry_module(runnables["triton_ragged"])
    rows = []
    for batch in RAGGED_BATCHES[:4]:
        case = RaggedCase(batch.q_lens, batch.kv_lens)
        inputs = make_inputs(case, "cuda", seed=0)
        outputs = poisoned_outputs(case, inputs)
        for name, fn in runnables.items():
            call = lambda: fn(*inputs, *outputs)  # noqa: E731
            bench = time_runnable(fn, inputs + outputs, 10, 50, "cuda") * 1e3
            kernel = triton.testing.do_bench(call, warmup=10, rep=50) * 1e3
            rows.append((batch.name, name, host_us(call), kernel, bench))
        q, k, v, qo, kv, scale = inputs
        out, lse = outputs
        plan = triton_mod._plan_ragged(q, k, v, qo, kv, out, lse)
        grid, meta, nseq, total_q, total_kv, _ = plan
        names = ("q", "k", "v", "qo_indptr", "kv_indptr", "output", "lse")
        tensors = (q, k, v, qo, kv, out, lse)
        pieces = {
            "triton: checks": lambda: triton_mod.check_placement(names, tensors),
            "triton: launch_ragged": lambda: triton_mod.launch_ragged(plan, *inputs, *outputs),
        }
        # The JIT path that launch_ragged skips once warm (_cached_launch in triton_prefill.py).
        jit_args = (q, k, v, out, lse, qo, kv, None, None, nseq, total_q, total_kv, None,
                    scale * triton_mod.LOG2_E, None, None)  # fmt: skip
        constexprs = triton_mod._attention_constexprs(meta)
        launch = triton_mod.gqa_prefill_fwd[grid]
        pieces["triton: jit launch"] = functools.partial(launch, *jit_args, **constexprs)
        for label, fn in pieces.items():
            rows.append((batch.name, label, host_us(fn), float("nan"), float("nan")))
    print(f"\n{'workload':28s} {'entry':26s} {'host us':>8s} {'kernel us':>9s} {'bench us':>9s}")
    for workload, name, host, kernel, bench in rows:
        print(f"{workload:28s} {name:26s} {host:8.1f} {kernel:9.1f} {bench:9.1f}")


if __name__ == "__main__":
    main()
