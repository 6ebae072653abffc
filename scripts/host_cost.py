"""On the GPU: where the time of a call goes. Per workload and solution: host time per call
(the GPU kept busy, so the Python side is what is measured), kernel time (do_bench) and
flashinfer-bench's time (host + kernel, L2 flushed). For Triton, also the pieces of its entry
point: the per-call checks, its launch, and (FA-2 plans) what the JIT's own launch costs, or
(Gluon plans) the descriptors its launch builds. For TileLang, its Python up to the kernel
(the kernel stubbed) and the kernel's tvm-ffi `main` alone (argument checks, TMA descriptors,
launch), with the arguments of the last call.

    python scripts/host_cost.py                       # the four short ragged workloads
    python scripts/host_cost.py --batches chunked_prefill_2k_over_16k_window_4096 prompt_8k
    python scripts/host_cost.py --paged chunked_prefill_2k_over_8k fresh_prompts_4x1k_3k
    python scripts/host_cost.py --fp8 single_token_rows_16 prefix_cache_hits_8x256
    python scripts/host_cost.py --mini noncausal_b4_q512_kv512 small_b1_q128_kv128_causal

--paged takes page size 1 workloads instead: the solutions' calls, and the pieces of Triton's
when it gathers the pages first (arguments.gathers_pages): the buffers' allocation, the copy's
launch and the ragged launch over the buffers. --fp8 takes paged workloads over FP8 caches
(page size 64, the workloads' scales): the solutions' calls only. --mini takes the padded
definition's workloads (float16, as the traces): the solutions' calls only.
"""

import argparse
import functools

import torch
import triton.testing
from flashinfer_bench.bench.timing import time_runnable

from prefill_bundle import HEAD_DIM, NUM_KV_HEADS
from prefill_bundle.gpu_timing import host_us
from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    entry_module,
    make_inputs,
    nan_slots_to_zero,
    poisoned_outputs,
    tilelang_python_entry,
)
from prefill_bundle.workloads import (
    FP8_K_SCALE,
    FP8_V_SCALE,
    MINI_SHAPES,
    PAGED_BATCHES,
    RAGGED_BATCHES,
    SWA_BATCHES,
)

BACKENDS = ("flashinfer", "cuda", "tilelang", "triton")
# Calls a host measurement: fewer than the launch queue holds (two launches a Triton Gluon call)
# while long kernels queue.
CALLS = 200
SUFFIX = {"gqa_ragged_prefill_causal_h32_kv8_d128": "ragged",
          "gqa_ragged_prefill_causal_swa_h32_kv8_d128": "swa"}  # fmt: skip


def timed_calls(runnables: dict, inputs: list, outputs: list, workload: str) -> list:
    """(workload, solution, host us, kernel us, flashinfer-bench us) of each solution's call."""
    rows = []
    for name, fn in runnables.items():
        call = lambda: fn(*inputs, *outputs)  # noqa: E731
        bench = time_runnable(fn, inputs + outputs, 10, 50, "cuda") * 1e3
        kernel = triton.testing.do_bench(call, warmup=10, rep=50) * 1e3
        rows.append((workload, name, host_us(call, CALLS), kernel, bench))
    return rows


def tilelang_rows(workload: str, module, plans, call) -> list:
    """TileLang's call in two: its Python with the kernel stubbed in the plan the calls above
    used last, and that kernel's tvm-ffi main alone with the arguments the call passed it; then
    two pieces of the Python (the work counters, and the capture check within them)."""
    key = next(reversed(plans))
    plan = plans[key]
    if not callable(plan[0]):
        return []  # page size 1 gathered first: two kernels
    captured = []
    # The Python entry's pieces: the C++ fast path (which takes planned calls) set aside.
    with tilelang_python_entry(module):
        plans[key] = (lambda *args: captured.append(args), *plan[1:])
        call()
        plans[key] = (lambda *args: None, *plan[1:])
        python = host_us(call, CALLS)
        plans[key] = plan
    main, args = plan[0], captured[0]
    pieces = {
        "tilelang: python only": python,
        "tilelang: main alone": host_us(lambda: main(*args), CALLS),
        "tilelang: work counters": host_us(lambda: module._scheduler(0), CALLS),
        "tilelang: capturing?": host_us(torch.cuda.is_current_stream_capturing, CALLS),
    }
    return [(workload, label, us, float("nan"), float("nan")) for label, us in pieces.items()]


def paged_rows(names: list) -> list:
    """Page size 1 workloads: every solution's call, then the pieces of Triton's gathered call."""
    batches = {batch.name: batch for batch in PAGED_BATCHES}
    rows = []
    for name in names:
        batch = batches[name]
        runnables = {f"{b}_paged_ps1": build_solution(f"{b}_paged_ps1") for b in BACKENDS}
        case = PagedCase(batch.q_lens, batch.kv_lens, 1, shared_prefix=batch.shared_prefix)
        inputs = nan_slots_to_zero(make_inputs(case, "cuda"))
        outputs = poisoned_outputs(case, inputs)
        rows += timed_calls(runnables, inputs, outputs, name)
        tilelang_mod = entry_module(runnables["tilelang_paged_ps1"])
        rows += tilelang_rows(name, tilelang_mod, tilelang_mod._paged_plans[1],
                              lambda: runnables["tilelang_paged_ps1"](*inputs, *outputs))
        triton_mod = entry_module(runnables["triton_paged_ps1"])
        plans = triton_mod._paged_plans[1]
        plan = plans[next(reversed(plans))]
        if not isinstance(plan, triton_mod.GatherPlan):
            continue
        q, k_cache, v_cache, qo, kv, ids, scale = inputs
        out, lse = outputs
        rows_, grid, runners, ragged = plan
        shape = (2, rows_, NUM_KV_HEADS, HEAD_DIM)
        k, v = torch.empty(shape, dtype=q.dtype, device=q.device)
        copy_args = (k_cache, v_cache, ids, k, v, rows_, k_cache.shape[0], k_cache.stride(0),
                     v_cache.stride(0))  # fmt: skip
        pieces = {
            "triton: the buffers": lambda: torch.empty(shape, dtype=q.dtype, device=q.device),
            "triton: the copy's launch": lambda: runners[q.get_device()](*copy_args),
            "triton: launch_ragged": lambda: triton_mod.launch_ragged(
                ragged["plan"], q, k, v, qo, kv, scale, out, lse
            ),
        }
        for label, fn in pieces.items():
            rows.append((name, label, host_us(fn, CALLS), float("nan"), float("nan")))
    return rows


def fp8_rows(names: list) -> list:
    """Paged workloads over FP8 caches: every backend's call."""
    batches = {batch.name: batch for batch in PAGED_BATCHES}
    runnables = {f"{b}_fp8kv": build_solution(f"{b}_fp8kv") for b in BACKENDS}
    rows = []
    for name in names:
        batch = batches[name]
        case = PagedCase(batch.q_lens, batch.kv_lens, 64, shared_prefix=batch.shared_prefix,
                         fp8_scales=(FP8_K_SCALE, FP8_V_SCALE))  # fmt: skip
        inputs = nan_slots_to_zero(make_inputs(case, "cuda"))
        outputs = poisoned_outputs(case, inputs)
        rows += timed_calls(runnables, inputs, outputs, name)
        triton_mod = entry_module(runnables["triton_fp8kv"])
        plan = triton_mod._fp8_plans[next(reversed(triton_mod._fp8_plans))]
        k_scale, v_scale, scale = inputs[7:10]
        scale, v_scale = triton_mod.fold_kv_scales(scale, k_scale, v_scale)
        tensors = (*inputs[:7], *outputs)
        pieces = {
            "triton: checks": lambda: triton_mod.check_placement(
                triton_mod.PAGED_PS64_NAMES, tensors
            ),
            "triton: launch_paged": lambda: triton_mod.launch_paged(
                plan, *inputs[:7], scale, *outputs, v_scale
            ),
        }
        for label, fn in pieces.items():
            rows.append((name, label, host_us(fn, CALLS), float("nan"), float("nan")))
    return rows


def mini_rows(names: list) -> list:
    """The padded definition's workloads: every backend's call."""
    shapes = {shape.name: shape for shape in MINI_SHAPES}
    runnables = {f"{b}_mini": build_solution(f"{b}_mini") for b in BACKENDS}
    rows = []
    for name in names:
        shape = shapes[name]
        case = PaddedCase(shape.batch, shape.seq_q, shape.seq_kv, shape.causal)
        inputs = make_inputs(case, "cuda", seed=0)
        rows += timed_calls(runnables, inputs, poisoned_outputs(case, inputs), name)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    batches = {batch.name: batch for batch in RAGGED_BATCHES + SWA_BATCHES}
    parser.add_argument("--batches", nargs="+", choices=batches, metavar="NAME",
                        default=[batch.name for batch in RAGGED_BATCHES[:4]])  # fmt: skip
    parser.add_argument("--paged", nargs="+", metavar="NAME",
                        choices=[batch.name for batch in PAGED_BATCHES])  # fmt: skip
    parser.add_argument("--fp8", nargs="+", metavar="NAME",
                        choices=[batch.name for batch in PAGED_BATCHES])  # fmt: skip
    parser.add_argument("--mini", nargs="+", metavar="NAME",
                        choices=[shape.name for shape in MINI_SHAPES])  # fmt: skip
    options = parser.parse_args()
    if options.mini:
        print_rows(mini_rows(options.mini))
        return
    if options.fp8:
        print_rows(fp8_rows(options.fp8))
        return
    if options.paged:
        print_rows(paged_rows(options.paged))
        return
    selected = [batches[name] for name in options.batches]
    rows = []
    for batch in selected:
        suffix = SUFFIX[batch.definition]
        # (build_solution is memoized: a definition's solutions are built once)
        runnables = {f"{b}_{suffix}": build_solution(f"{b}_{suffix}") for b in BACKENDS}
        triton_mod = entry_module(runnables[f"triton_{suffix}"])
        case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
        inputs = make_inputs(case, "cuda", seed=0)
        outputs = poisoned_outputs(case, inputs)
        rows += timed_calls(runnables, inputs, outputs, batch.name)
        tilelang_mod = entry_module(runnables[f"tilelang_{suffix}"])
        windowed = batch.window_left is not None and 0 <= batch.window_left < inputs[1].shape[0]
        tilelang_plans = tilelang_mod._swa_plans if windowed else tilelang_mod._ragged_plans
        rows += tilelang_rows(batch.name, tilelang_mod, tilelang_plans,
                              lambda: runnables[f"tilelang_{suffix}"](*inputs, *outputs))
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
    print_rows(rows)


def print_rows(rows: list) -> None:
    print(f"\n{'workload':40s} {'entry':26s} {'host us':>8s} {'kernel us':>9s} {'bench us':>9s}")
    for workload, name, host, kernel, bench in rows:
        print(f"{workload:40s} {name:26s} {host:8.1f} {kernel:9.1f} {bench:9.1f}")


if __name__ == "__main__":
    main()
