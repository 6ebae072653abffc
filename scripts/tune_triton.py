"""On the GPU: time Triton launch configs against FlashInfer (kernel time, same call) on the big
padded shapes, and the host overhead of both entry points on the small ones; with --mid, the
plans' three tile layouts on mid-size workloads instead (what _launch_config's thresholds rest
on); with --paged, the same layouts on the paged workloads with few long sequences (chunked
prefill: one 2K chunk over 8K-32K keys) and neighbours, at page sizes 1 and 64, against
FlashInfer's paged wrapper, and on the same keys contiguous (ragged); with --decode, the
decode tiles (16 rows) by key tile, stages and key shares on the single-token rows over FP8
and bf16 page-64 caches. Interleaves the variants (A B A B) because the card heats up within a
call. Writes nothing; prints tables.

    python scripts/tune_triton.py [--mid | --paged | --decode] [--stages N ...]
    python scripts/tune_triton.py --paged --workloads fresh_prompts_4x1k_3k mixed_batch \
        --stages 3 4 5
"""

import argparse
import functools
import json

import torch
import triton
import triton.testing

from prefill_bundle.gpu_timing import clocks, host_us
from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    entry_module,
    make_inputs,
    normwise_error,
    poisoned_outputs,
)
from prefill_bundle.workloads import FP8_K_SCALE, FP8_V_SCALE, PAGED_BATCHES, RAGGED_BATCHES

# What was measured with it, kept or not: solutions/gqa_ragged/triton/TUNING.md.
# CONFIGS[1] is what the plans pick for the big shapes.
CONFIGS = [
    dict(HEADS_PER_TILE=4, BLOCK_M=128, BLOCK_N=64, ROW_BLOCKS=1, num_warps=8, num_stages=3),
    dict(HEADS_PER_TILE=4, BLOCK_M=128, BLOCK_N=64, ROW_BLOCKS=2, num_warps=8, num_stages=3),
    dict(HEADS_PER_TILE=4, BLOCK_M=128, BLOCK_N=64, ROW_BLOCKS=2, num_warps=8, num_stages=4),
]
BIG = [PaddedCase(8, 2048, 2048, True), PaddedCase(1, 8192, 8192, True),
       PaddedCase(1, 16384, 16384, False)]  # fmt: skip
SMALL = [PaddedCase(1, 128, 128, True), PaddedCase(4, 512, 512, True)]
# --mid: the layouts _launch_config chooses between, on shapes near its thresholds.
PLAN_CONFIGS = [
    CONFIGS[1],  # paired row blocks
    CONFIGS[0],  # one 128-row block
    dict(HEADS_PER_TILE=4, BLOCK_M=64, BLOCK_N=64, ROW_BLOCKS=1, num_warps=4, num_stages=3),
]
MID_RAGGED = (
    "batch4_prompts_1k_3k",
    "mixed_short_and_long",
    "prompt_8k",
    "chunked_prefill_with_prefix",
)
MID = [RaggedCase(b.q_lens, b.kv_lens) for b in RAGGED_BATCHES if b.name in MID_RAGGED]
MID += [PaddedCase(4, 512, 512, True), PaddedCase(4, 512, 512, False),
        PaddedCase(2, 2048, 2048, True), PaddedCase(4, 4096, 4096, True)]  # fmt: skip
# --paged: one or four 2K chunks over long contexts, and a prefix-cache batch for contrast.
LONG_KEYS = ("chunked_prefill_2k_over_8k", "chunked_prefill_2k_over_32k",
             "chunked_prefill_4x2k_over_16k", "prefix_cache_hits_8x256")  # fmt: skip


def paged_cases(names=LONG_KEYS) -> list:
    """The named paged workloads at page sizes 1 and 64, and their keys contiguous (ragged)."""
    return [
        case
        for b in PAGED_BATCHES
        if b.name in names
        for case in [PagedCase(b.q_lens, b.kv_lens, ps, shared_prefix=b.shared_prefix)
                     for ps in (1, 64)] + [RaggedCase(b.q_lens, b.kv_lens)]  # fmt: skip
    ]


# --decode: the decode tiles' knobs (_launch_config's decode-like branch, _kv_splits' shares).
DECODE_CONFIGS = [
    dict(HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=block_n, ROW_BLOCKS=1, num_warps=4,
         num_stages=stages, KV_SPLITS=shares)
    for block_n in (32, 64, 128) for stages in (2, 3, 4) for shares in (8, 16, 32)
]  # fmt: skip
_single_rows = next(b for b in PAGED_BATCHES if b.name == "single_token_rows_16")
DECODE = [PagedCase(_single_rows.q_lens, _single_rows.kv_lens, 64, fp8_scales=scales)
          for scales in ((FP8_K_SCALE, FP8_V_SCALE), ())]  # fmt: skip


@functools.lru_cache(maxsize=None)
def solution(name):
    return build_solution(name)


def module_of(runnable):
    return entry_module(runnable)


def launch_variant(case, meta, inputs, outputs):
    """The Triton kernel with launch config meta, bypassing the plan's own choice."""
    if isinstance(case, PagedCase) and case.fp8_scales:
        mod = module_of(solution("triton_fp8kv"))
        tensors = (*inputs[:7], *outputs)
        plan = mod._plan_paged(64, tensors, config=meta, cache_dtype=mod.FP8_DTYPE)
        sm_scale, v_scale = mod.fold_kv_scales(inputs[-1], *inputs[7:9])
        return lambda: mod.launch_paged(plan, *inputs[:7], sm_scale, *outputs, v_scale)
    if isinstance(case, PagedCase):
        mod = module_of(solution(f"triton_paged_ps{case.page_size}"))
        tables = inputs[3:-1] if case.page_size > 1 else [*inputs[3:6], None]
        tensors = (*inputs[:3], *tables)
        plan = mod._plan_paged(case.page_size, (*tensors, *outputs), config=meta)
        return lambda: mod.launch_paged(plan, *tensors, inputs[-1], *outputs)
    if isinstance(case, RaggedCase):
        mod = module_of(solution("triton_ragged"))
        q, k, v, qo_indptr, kv_indptr, _ = inputs
        plan = mod._plan_ragged(q, k, v, qo_indptr, kv_indptr, *outputs, config=meta)
        return lambda: mod.launch_ragged(plan, *inputs, *outputs)
    mod = module_of(solution("triton_mini"))
    plan = mod._plan_padded(*inputs, *outputs, config=meta)
    return lambda: mod.launch_padded(plan, *inputs[:3], *outputs)


def time_configs(cases, configs) -> list:
    """(case id, variant, ms, FlashInfer ms / ms) for FlashInfer and each config that runs right."""
    results = []
    for case in cases:
        if isinstance(case, PagedCase) and case.fp8_scales:
            fi = solution("flashinfer_fp8kv")
        elif isinstance(case, PagedCase):
            fi = solution(f"flashinfer_paged_ps{case.page_size}")
        elif isinstance(case, RaggedCase):
            fi = solution("flashinfer_ragged")
        else:
            fi = solution("flashinfer_mini")
        inputs = make_inputs(case, "cuda", seed=0)
        expected = poisoned_outputs(case, inputs)
        fi(*inputs, *expected)
        variants = {"flashinfer": lambda: fi(*inputs, *expected)}
        for i, meta in enumerate(configs):
            outputs = poisoned_outputs(case, inputs)
            try:
                launch = launch_variant(case, meta, inputs, outputs)
                launch()
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile (shared memory, registers)
                print(f"config {i} {meta}: {type(e).__name__}: {str(e)[:120]}")
                continue
            err = normwise_error(outputs[0], expected[0])
            if not err < 5e-3:  # nan fails too
                print(f"{case.id} config {i} {meta}: WRONG, normwise {err:.2e} vs flashinfer")
                continue
            variants[f"cfg{i}"] = launch
        best = {name: float("inf") for name in variants}
        for _ in range(2):  # interleaved rounds
            for name, fn in variants.items():
                best[name] = min(best[name], triton.testing.do_bench(fn, warmup=25, rep=150))
        results += [(case.id, name, ms, best["flashinfer"] / ms) for name, ms in best.items()]
    return results


def main():
    parser = argparse.ArgumentParser()
    layouts = parser.add_mutually_exclusive_group()
    layouts.add_argument("--mid", action="store_true", help="the plans' layouts, mid-size shapes")
    layouts.add_argument("--paged", action="store_true", help="the plans' layouts, long keys")
    layouts.add_argument("--decode", action="store_true", help="decode tiles, single-token rows")
    parser.add_argument("--stages", type=int, nargs="+", metavar="N",
                        help="each config at each of these pipeline depths")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="--paged: these paged workloads instead of the long-key ones")
    args = parser.parse_args()
    if args.workloads and not args.paged:
        parser.error("--workloads: paged workloads, with --paged")
    configs = (PLAN_CONFIGS if args.mid or args.paged else DECODE_CONFIGS if args.decode
               else CONFIGS)  # fmt: skip
    if args.stages:  # e.g. --paged --stages 3 4 5: the page-size-1 gathers' loads in flight
        configs = [{**c, "num_stages": n} for c in configs for n in args.stages]
    cases = (MID if args.mid else paged_cases(args.workloads or LONG_KEYS) if args.paged
             else DECODE if args.decode else BIG)  # fmt: skip
    print("gpu at start:", clocks())
    results = time_configs(cases, configs)
    print("gpu after timing:", clocks())
    overhead = []
    if not (args.mid or args.paged or args.decode):
        tri, fi = solution("triton_mini"), solution("flashinfer_mini")
        for case in SMALL:
            inputs = make_inputs(case, "cuda", seed=0)
            out = torch.empty_like(inputs[0])
            for name, fn in (("triton", tri), ("flashinfer", fi)):
                overhead.append((case.id, name, host_us(lambda: fn(*inputs, out))))
        print("gpu at end:", clocks())
    print("\nconfigs:", json.dumps({f"cfg{i}": c for i, c in enumerate(configs)}))
    print(f"\n{'shape':60s} {'variant':12s} {'ms':>9s} {'FI/x':>6s}")
    for shape, name, ms, ratio in results:
        print(f"{shape:60s} {name:12s} {ms:9.4f} {ratio:6.2f}")
    if overhead:
        print(f"\n{'shape':60s} {'entry':12s} {'host us/call':>12s}")
    for shape, name, us in overhead:
        print(f"{shape:60s} {name:12s} {us:12.1f}")


if __name__ == "__main__":
    main()
