"""On the GPU: time TileLang tile configs and pipeline schedules against FlashInfer on the big
padded shapes, each checked against FlashInfer's output first. Interleaves the variants (A B A B)
because the card heats up within a call. Writes nothing; prints a table (past results:
solutions/gqa_ragged/tilelang/TUNING.md).

    python scripts/tune_tilelang.py
"""

import json
import time

import torch
import triton.testing

from prefill_bundle.gpu_timing import clocks
from prefill_bundle.testing import (
    PaddedCase,
    build_solution,
    make_inputs,
    normwise_error,
    tilelang_kernels,
)

CONFIGS = [
    # FA3 written out: TMA producer warp, mbarrier ring, async wgmma (softmax beside P V); the
    # defaults (block_config) are cfg0 for causal and cfg1 for non-causal
    dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True),
    dict(block_M=128, block_N=176, num_stages=2, ws=True),
    dict(block_M=128, block_N=128, num_stages=2, ws=True),
]
BIG = [PaddedCase(8, 2048, 2048, True), PaddedCase(1, 8192, 8192, True),
       PaddedCase(1, 16384, 16384, False)]  # fmt: skip


def kernel_module():
    return tilelang_kernels("tilelang_mini")


def main():
    fi = build_solution("flashinfer_mini")
    kernels = kernel_module()
    compiled = {}
    for i, config in enumerate(CONFIGS):
        for causal in (True, False):
            start = time.perf_counter()
            try:
                compiled[i, causal] = kernels.compile_variant("float16", causal, **config)
                print(f"cfg{i} causal={causal}: compiled in {time.perf_counter() - start:.0f} s")
            except Exception as e:  # noqa: BLE001 - a config that does not lower
                print(f"cfg{i} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
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
            err = normwise_error(out, out_fi)
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
