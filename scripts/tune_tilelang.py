"""On the GPU: time TileLang tile configs and pipeline schedules against FlashInfer on the big
padded shapes, each checked against FlashInfer's output first. Interleaves the variants (A B A B)
because the card heats up within a call. Writes nothing; prints a table (past results:
solutions/gqa_ragged/tilelang/TUNING.md).

    python scripts/tune_tilelang.py
"""

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import triton.testing

from prefill_bundle.gpu_timing import clocks
from prefill_bundle.testing import PaddedCase, build_solution, make_inputs

SECTION_KEYS = 32768  # gqa_prefill_kernel.l2_section_keys(2): 16 MB of 16-bit K/V a section
CONFIGS = [
    # FA3 written out: TMA producer warp, mbarrier ring, async wgmma (softmax beside P V); the
    # defaults (block_config) are cfg0 for causal and cfg1 for non-causal
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True),
    dict(block_M=128, block_N=176, num_stages=2, ws=True),
    dict(block_M=128, block_N=128, num_stages=2, ws=True),
    # cfg0 / cfg1 with CUDA's order: Q K^T and P V waited for before the softmax, P converted
    # at its end (gqa_prefill_ws, softmax_beside_pv=False)
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True,
         softmax_beside_pv=False, causal=True),
    dict(block_M=128, block_N=176, num_stages=2, ws=True, softmax_beside_pv=False, causal=False),
    # cfg0 / cfg1 with a long sequence's items in L2 sections of KV heads (build_steps)
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True,
         l2_section_keys=SECTION_KEYS, causal=True),
    dict(block_M=128, block_N=176, num_stages=2, ws=True, l2_section_keys=SECTION_KEYS,
         causal=False),
    # both
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True,
         softmax_beside_pv=False, l2_section_keys=SECTION_KEYS, causal=True),
    dict(block_M=128, block_N=176, num_stages=2, ws=True, softmax_beside_pv=False,
         l2_section_keys=SECTION_KEYS, causal=False),
    # cfg0 with the output stored from registers (no output buffer: the epilogue's two
    # 256-thread barriers go)
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True,
         output_from_registers=True, causal=True),
]  # fmt: skip
BIG = [PaddedCase(8, 2048, 2048, True), PaddedCase(1, 8192, 8192, True),
       PaddedCase(1, 16384, 16384, False)]  # fmt: skip


def kernel_module():
    entry = sys.modules[build_solution("tilelang_mini").metadata.misc["module_name"]]
    return sys.modules[entry.__name__.rpartition(".")[0] + ".gqa_prefill_kernel"]


def variants_to_compile() -> list:
    """(config index, causal, compile_variant's config): a config's "causal" limits it to one."""
    jobs = []
    for i, config in enumerate(CONFIGS):
        config = dict(config)
        only = config.pop("causal", None)
        jobs += [(i, causal, config) for causal in (True, False) if only in (None, causal)]
    return jobs


def compile_job(job):
    """In a worker process: compile one variant into TileLang's disk cache (the parent's own
    compile then loads it)."""
    i, causal, config = job
    start = time.perf_counter()
    try:
        kernel_module().compile_variant("float16", causal, **config)
        return f"cfg{i} causal={causal}: compiled in {time.perf_counter() - start:.0f} s"
    except Exception as e:  # noqa: BLE001 - a config that does not lower
        return f"cfg{i} causal={causal}: {type(e).__name__}: {str(e)[:200]}"


def main():
    fi = build_solution("flashinfer_mini")
    kernels = kernel_module()
    jobs = variants_to_compile()
    with ProcessPoolExecutor(min(len(jobs), 8), mp_context=get_context("spawn")) as pool:
        for line in pool.map(compile_job, jobs):
            print(line, flush=True)
    compiled = {}
    for i, causal, config in jobs:
        try:
            compiled[i, causal] = kernels.compile_variant("float16", causal, **config)
        except Exception:  # noqa: BLE001 - reported by its worker
            pass
    print("gpu at start:", clocks())
    results = []
    for case in BIG:
        q, k, v, causal = make_inputs(case, "cuda", seed=0)
        b, sq, skv = case.batch, case.seq_q, case.seq_kv
        out_fi = torch.empty_like(q)
        fi(q, k, v, causal, out_fi)
        variants = {"flashinfer": lambda: fi(q, k, v, causal, out_fi)}
        qo = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sq
        kv = torch.arange(b + 1, dtype=torch.int32, device="cuda") * skv
        lse = torch.empty(b * sq, 32, dtype=torch.float32, device="cuda")
        scheduler = torch.zeros(2, dtype=torch.int32, device="cuda")
        k_rows, v_rows = k.view(b * skv, 8, 128), v.view(b * skv, 8, 128)
        args = (q.view(b * sq, 32, 128), k_rows, v_rows, qo, kv, b * skv)  # kv_rows
        for i in range(len(CONFIGS)):
            if (i, causal) not in compiled:
                continue
            out = torch.full_like(q, float("nan"))

            def launch(kernel=compiled[i, causal], out=out):
                kernel(*args, 128**-0.5, out.view(b * sq, 32, 128), lse, scheduler)

            launch()
            torch.cuda.synchronize()
            err = ((out.float() - out_fi.float()).norm() / out_fi.float().norm()).item()
            if not err < 2e-3:
                print(f"cfg{i} {case.id}: WRONG, normwise {err:.2e} vs flashinfer")
                continue
            variants[f"cfg{i}"] = launch
        best = {name: float("inf") for name in variants}
        for _ in range(2):  # interleaved rounds
            for name, fn in variants.items():
                best[name] = min(best[name], triton.testing.do_bench(fn, warmup=25, rep=150))
        for name, ms in best.items():
            results.append((case.id, name, ms, best["flashinfer"] / ms))
            print(f"{case.id:40s} {name:12s} {ms:9.4f} {best['flashinfer'] / ms:6.2f}", flush=True)
    print("gpu at end:", clocks())
    print("\nconfigs:", json.dumps({f"cfg{i}": c for i, c in enumerate(CONFIGS)}))
    print(f"\n{'shape':40s} {'variant':12s} {'ms':>9s} {'FI/x':>6s}")
    for shape, name, ms, ratio in results:
        print(f"{shape:40s} {name:12s} {ms:9.4f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
