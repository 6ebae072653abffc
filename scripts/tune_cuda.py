"""On the GPU: kernel time of variants of the CUDA solution against FlashInfer fa3 on the big
padded shapes and two ragged batches, interleaved (A B A B; the card heats up within a call),
each checked against FlashInfer's output first. Prints a table.

A variant is a BuildKnobs (prefill_bundle/cuda_variants.py): knob values per kernel family
(causal, full, paged) that instantiate the kernel templates (HopperKnobs<...> in
solutions/gqa_ragged/cuda/hopper_knobs.cuh) through the one hook GQA_PREFILL_KNOBS, built under
its own name and namespace. Every build reports the knobs it was built with (built_knobs) and
is checked against the variant's: a hook the sources ignore raises instead of timing the
shipped kernels. --compile-only builds each variant for sm_90a without a GPU, checks its knobs
and lists its Hopper kernels' stack and local memory (non-zero: spills).

    TVM_FFI_CUDA_ARCH_LIST=9.0a python scripts/tune_cuda.py [variant ...]
    python scripts/tune_cuda.py --compile-only [variant ...]
    python scripts/tune_cuda.py --json cuda_paged_ps1 .ab paged_3_stages   # for compare_gpu --old
"""

import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

from prefill_bundle.cuda_build import cuobjdump
from prefill_bundle.cuda_variants import (
    SHIPPED,
    SHIPPED_CAUSAL,
    SHIPPED_FULL,
    SHIPPED_PAGED,
    BuildKnobs,
    build_variant,
    set_cuda_home,
    variant_solution,
)
from prefill_bundle.gpu_timing import clocks
from prefill_bundle.testing import (
    PaddedCase,
    RaggedCase,
    build_solution,
    make_inputs,
    normwise_error,
    poisoned_outputs,
)

# name: knobs; "default" is the sources as they are. Only the families CASES run matter for the
# timings (causal, full); measurements of earlier variants: solutions/gqa_ragged/cuda/TUNING.md.
VARIANTS = {
    "default": SHIPPED,
    # FP8 caches under bf16 q: K converted to bf16 like V, a bf16 Q K^T (shipped until
    # 2026-11-28 (14): the split, two e4m3 wgmmas on K as TMA loads it, was 1.18-1.26x faster;
    # cuda/TUNING.md, FP8: the split). On the FP8 definition: --json cuda_fp8kv .ab
    # fp8_convert_k, then compare_gpu.py cuda_fp8kv --old .ab/*.json.
    "fp8_convert_k": BuildKnobs(fp8_split_q=False),
    # FP8 caches under bf16 q: P V in bf16, V by the bit-level conversion (four instructions a
    # pair; shipped until 2026-11-28 (15), when P V went float16, V by the hardware cvt, one
    # a pair: cuda/TUNING.md). --json cuda_fp8kv .ab fp8_bf16_pv, then compare_gpu.py
    # cuda_fp8kv --old .ab/*.json.
    "fp8_bf16_pv": BuildKnobs(fp8_f16_pv=False),
    # Every consumer warpgroup computes every item, one without any of the item's tokens on
    # padding (shipped until 2026-11-29 (22): a decode-like item's rows are all warpgroup 0's;
    # cuda/TUNING.md, decode-like rows: the idle warpgroup). --json cuda_fp8kv .ab
    # busy_idle_warpgroup, then compare_gpu.py cuda_fp8kv --old .ab/*.json.
    "busy_idle_warpgroup": BuildKnobs(idle_warpgroup_waits=False),
    # Key shares of decode-like paged batches (split_merge.cuh, kv_shares): enough for 4 or 16
    # items an SM instead of 8 (single_token_rows_16: 4 / 16 shares instead of 8; Triton's best
    # was 16 shares of its 16-row tiles, triton/TUNING.md). Measured 2026-11-29 (23), H200: 4
    # within 2% of 8, 16 4-10% slower (cuda/TUNING.md, the share count of decode-like rows).
    "share_waves_4": BuildKnobs(share_waves=4),
    "share_waves_16": BuildKnobs(share_waves=16),
    # Scale the logits first (one FMUL each), then exp2(s - max).
    "unfolded_scale": BuildKnobs(
        causal=replace(SHIPPED_CAUSAL, fold_scale=False),
        full=replace(SHIPPED_FULL, fold_scale=False),
        paged=replace(SHIPPED_PAGED, fold_scale=False),
    ),
    # The full mask's 176-key tiles for the causal kernels: the 24 / 240 register split (the
    # ragged and window producers spill 24 bytes at 24), the output staged in Q's buffer (an own
    # one would not fit: 240 KiB).
    "causal_block_n_176": BuildKnobs(
        causal=replace(
            SHIPPED_CAUSAL,
            block_n=176,
            producer_registers=24,
            consumer_registers=240,
            own_output_buffer=False,
        )
    ),
    # A 3-stage K/V ring for the causal kernels, fitting 227 KiB without the output buffer.
    "causal_3_stages": BuildKnobs(
        causal=replace(SHIPPED_CAUSAL, kv_stages=3, own_output_buffer=False)
    ),
    # A 3-stage K/V ring for the paged kernels (page sizes 64 and 1; FP8 keeps its tiles),
    # fitting 227 KiB without the output buffer: 1-10% slower (TUNING.md).
    "paged_3_stages": BuildKnobs(
        paged=replace(SHIPPED_PAGED, kv_stages=3, own_output_buffer=False)
    ),
    # Non-causal with 176-key tiles (FA3's choice; shipped until 2026-12-01 (42), when sequences
    # of up to 4096 keys had moved to the 128-key kernel and 192-key tiles, FlashInfer fa3's,
    # took the rest: H200, 192 against 176 on 16K, 2x8192 and 3x6000 keys +0.4-2% one call at a
    # time, +1.2% back to back for 4 s, +0-1% in alternating do_bench rounds; 1x5000 -0.5%;
    # cuda/TUNING.md).
    "full_block_n_176": BuildKnobs(full=replace(SHIPPED_FULL, block_n=176)),
    # Non-causal with one CTA per item (shipped until 2026-11-29 (16), when the full family went
    # persistent: +2-7% on 4x512, +0.2-0.6% on 1x16384; cuda/TUNING.md).
    "full_one_cta_per_item": BuildKnobs(full=replace(SHIPPED_FULL, persistent=False)),
    # Non-causal with 128-key tiles, one CTA per item, then persistent (TUNING.md: 0.85, 0.81).
    "full_block_n_128": BuildKnobs(
        full=replace(
            SHIPPED_FULL,
            block_n=128,
            producer_registers=32,
            consumer_registers=232,
            persistent=False,
        )
    ),
    "full_block_n_128_persistent": BuildKnobs(
        full=replace(
            SHIPPED_FULL,
            block_n=128,
            producer_registers=32,
            consumer_registers=232,
            persistent=True,
        )
    ),
    # Non-causal with the causal family's knobs: 128-key tiles, the output in a buffer of its
    # own (the next item's Q loads during the epilogue), persistent; without FA3's turns (the
    # Gluon kernel's choice), and with them. H200, 2026-12-01 (40), kernel time vs FlashInfer,
    # shipped / no turns / turns: 1x16384 0.97 / 0.93 / 0.95, 4x512 non-causal 0.91 / 1.10 /
    # 1.12: shipped for up to 4096 keys as gqa_prefill_full128_wgmma_kernel (cuda/TUNING.md).
    "full_as_causal": BuildKnobs(full=SHIPPED_CAUSAL),
    "full_as_causal_pingpong": BuildKnobs(full=replace(SHIPPED_CAUSAL, pingpong=True)),
    # FA3's turns between the consumer warpgroups (named barriers around each one's GEMM issue)
    # for every family; shipped for the non-causal one only since 2026-11-29 (17) (H200, kernel
    # time vs FlashInfer: 4x512 non-causal 0.86 -> 0.91, the causal and paged rows unchanged or
    # 1-3% slower with them: cuda/TUNING.md). full_no_pingpong: the non-causal kernels without.
    "pingpong": BuildKnobs(
        causal=replace(SHIPPED_CAUSAL, pingpong=True),
        paged=replace(SHIPPED_PAGED, pingpong=True),
    ),
    "full_no_pingpong": BuildKnobs(full=replace(SHIPPED_FULL, pingpong=False)),
}
CASES = [
    PaddedCase(8, 2048, 2048, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(1, 16384, 16384, False),
    PaddedCase(4, 512, 512, True),
    RaggedCase((2048, 512, 1024, 4096), (2048, 512, 1024, 4096)),
    RaggedCase((64,) * 16, (1024,) * 16),
]


def hopper_resources(binary: str) -> list:
    """(kernel, "REG:.. STACK:.. LOCAL:..") of each wgmma kernel of an sm_90a build."""
    text = subprocess.run([cuobjdump(), "-res-usage", binary], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert "arch = sm_90a" in text, f"{binary}: no sm_90a code"
    rows = []
    for name, usage in re.findall(r"Function (\S+):\n\s*(.*)", text):
        if "wgmma_kernel" in name:
            fields = dict(re.findall(r"(\w+):(\d+)", usage))
            # The kernel's name and template arguments, without the variant's namespace.
            kernel = re.search(r"gqa_prefill(?:(?!gqa_prefill)\w)*?_kernelI\w*?E(?=E*v)", name)
            kernel = kernel.group(0)
            rows.append((kernel, f"REG:{fields['REG']} STACK:{fields['STACK']} "
                                 f"LOCAL:{fields['LOCAL']}"))  # fmt: skip
    return sorted(rows)


def _build(job: tuple) -> str:
    solution, variant = job
    set_cuda_home()
    start = time.time()
    build_variant(solution, variant, VARIANTS[variant])
    return f"built {solution} {variant} in {time.time() - start:.0f} s"


def build_all(solutions: list, variants: list) -> None:
    """Every (solution, variant) built in parallel processes (one nvcc job each, ~40 s), into
    flashinfer-bench's build cache, where the builds that follow find them: built one after the
    other, five variants of two solutions took ~8 of a device call's 10 minutes."""
    jobs = [(solution, variant) for solution in solutions for variant in variants]
    with mp.get_context("spawn").Pool(min(len(jobs), os.cpu_count() or 1, 12)) as pool:
        for line in pool.imap_unordered(_build, jobs):
            print(line, flush=True)


def compile_only(variants: list) -> None:
    """Each variant built for sm_90a as flashinfer-bench builds it, its knobs checked."""
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = "9.0a"  # the wgmma kernels exist only there
    set_cuda_home()
    build_all(["cuda_ragged"], variants)
    for variant in variants:
        runnable = build_variant("cuda_ragged", variant, VARIANTS[variant])  # from the cache
        print(f"{variant}: built for sm_90a, knobs as asked: {VARIANTS[variant].cpp()}")
        for kernel, usage in hopper_resources(runnable.metadata.misc["binary"]):
            print(f"    {kernel:70s} {usage}", flush=True)


def write_json(solution: str, folder: str, variants: list) -> None:
    """Each variant of a packed CUDA solution as Solution JSON, for `compare_gpu.py --old`
    (timed beside the shipped solution and FlashInfer on that solution's definition)."""
    for variant in variants:
        path = Path(folder) / f"{solution}_{variant}.json"
        path.write_text(variant_solution(solution, variant, VARIANTS[variant]).model_dump_json())
        print(path)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--json"]:  # --json SOLUTION FOLDER VARIANT ...
        write_json(args[1], args[2], args[3:])
        return
    variants = [a for a in args if a != "--compile-only"] or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "--compile-only" in args:
        compile_only(variants)
        return
    build_all(["cuda_mini", "cuda_ragged"], variants)
    print("gpu at start:", clocks())
    rows = []
    for case in CASES:
        suffix = "mini" if isinstance(case, PaddedCase) else "ragged"
        solutions = {"flashinfer": build_solution(f"flashinfer_{suffix}")}
        for variant in variants:
            solutions[variant] = build_variant(f"cuda_{suffix}", variant, VARIANTS[variant])
        inputs = make_inputs(case, "cuda", seed=0)
        outputs = {name: poisoned_outputs(case, inputs) for name in solutions}
        for name, fn in solutions.items():
            fn(*inputs, *outputs[name])
        torch.cuda.synchronize()
        expected = outputs["flashinfer"][0]
        errors = {}
        for name in variants:
            actual = outputs[name][0]
            err = normwise_error(actual, expected)
            errors[name] = err if bool(torch.isfinite(actual).all()) else float("nan")
        best = {name: float("inf") for name in solutions}
        for _ in range(2):
            for name, fn in solutions.items():
                ms = triton.testing.do_bench(
                    lambda: fn(*inputs, *outputs[name]), warmup=25, rep=150
                )
                best[name] = min(best[name], ms)
        for name in variants:
            rows.append((case.id[:52], name, best["flashinfer"], best[name], errors[name]))
    print("gpu at end:", clocks())
    header = f"{'shape':52s} {'variant':28s} {'FI ms':>8s} {'ms':>8s} {'FI/x':>6s}"
    print(f"\n{header} {'err vs FI':>9s}")
    for shape, name, fi, ms, err in rows:
        flag = "" if err < 5e-3 else " WRONG"
        print(f"{shape:52s} {name:28s} {fi:8.4f} {ms:8.4f} {fi / ms:6.2f} {err:9.1e}{flag}")


if __name__ == "__main__":
    main()
