"""Timing harness of the TileLang solution's lean decode program for decode-like batches over
an FP8 (e4m3) paged cache (solutions/gqa_ragged/tilelang/gqa_prefill_decode.py: decode_fp8 and
its merge merge_decode; the program's design is described there and in the solution's TUNING.md,
"A lean decode program for FP8 caches"), on single_token_rows_16.

The workload: 16 sequences of one query token, 32 query heads over 8 KV heads, head dim 128,
k_cache and v_cache float8_e4m3fn [num_pages, 64, 8, 128] behind a shuffled page table (the
page counts and last-page lengths of scripts/decode_probe.cu: 4.6K-14.5K keys a sequence, 2142
pages). This script began as the design probe (its variants over tile size, warps and stages
measured on an H200: TUNING.md); the program now lives in the solution alone, and this script
times it at several share counts, decode + merge (the solution's merge_decode, and the older
merge_shares for comparison) and decode alone, against a torch reference.

    PYTHONPATH=$PWD:$PWD/scripts python scripts/tilelang_decode_probe.py   # on the GPU
    python scripts/tilelang_decode_probe.py --compile-only   # CPU: compile, registers, shared

--shares picks the share counts (default SHARES; the entry's plan: decode_shares), --dtype q's.
"""

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import tilelang
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TILELANG_DIR = REPO_ROOT / "solutions" / "gqa_ragged" / "tilelang"

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, GROUP = 32, 8, 128, 4
PAGE = 64
# single_token_rows_16 (scripts/decode_probe.cu's kPagesOf, kLastOf).
PAGES_OF = [125, 73, 223, 161, 120, 72, 103, 162, 86, 162, 87, 110, 92, 213, 227, 126]
LAST_OF = [33, 5, 26, 44, 34, 10, 36, 38, 20, 16, 12, 24, 28, 54, 52, 50]
K_SCALE, V_SCALE = 0.5, 2.0
SHARES = (16, 24, 32)


def solution_module(module: str = "gqa_prefill_decode"):
    """A module of solutions/gqa_ragged/tilelang (gqa_prefill_decode: the program, its merge and
    plan; gqa_prefill_split: merge_shares), imported as a package module without the solution's
    entry (which needs flashinfer)."""
    name = "_tl_decode_probe_solution"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, TILELANG_DIR / "__init__.py", submodule_search_locations=[str(TILELANG_DIR)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package  # no __init__.py there: an empty namespace package
    return importlib.import_module(f"{name}.{module}")


def solution_split_module():
    return solution_module("gqa_prefill_split")


def compile_program(dtype: str = "bfloat16"):
    """The solution's decode program for q's dtype, compiled for sm_90a."""
    return solution_module().compile_decode(dtype)


# Inputs, reference ---------------------------------------------------------------------------


def make_inputs(device, pages_of=PAGES_OF, last_of=LAST_OF, seed=0, q_dtype=torch.bfloat16):
    """q, k_cache, v_cache (e4m3 of uniform [-2, 2) values), kv_indptr, kv_indices (a shuffled
    page table over used + 3 pages), kv_last_page_len."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(pages_of)
    used = sum(pages_of)
    num_pages = used + 3
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(q_dtype)
    shape = (num_pages, PAGE, NUM_KV_HEADS, HEAD_DIM)
    k = (torch.rand(shape, generator=gen) * 4 - 2).to(torch.float8_e4m3fn)
    v = (torch.rand(shape, generator=gen) * 4 - 2).to(torch.float8_e4m3fn)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages_of, dtype=torch.int32), 0)
    indices = torch.randperm(num_pages, generator=gen)[:used].to(torch.int32)
    last = torch.tensor(last_of, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, indptr, indices, last)]


def reference(q, k, v, indptr, indices, last, sm_scale):
    """fp32 out [batch, 32, 128] and base-2 lse [batch, 32], per sequence."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        n = (pages.numel() - 1) * PAGE + int(last[b])
        kb = k[pages].float().reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n] * K_SCALE
        vb = v[pages].float().reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n] * V_SCALE
        kb = kb.repeat_interleave(GROUP, dim=1)  # [n, 32, 128]
        vb = vb.repeat_interleave(GROUP, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * sm_scale  # natural log units
        lse = torch.logsumexp(s, dim=1)
        outs.append(torch.einsum("hn,nhd->hd", torch.exp(s - lse[:, None]), vb))
        lses.append(lse / math.log(2))
    return torch.stack(outs), torch.stack(lses)


def torch_merge(parts, part_lse, shares, batch):
    """The merge in torch (a cross-check of merge_shares): parts [shares * batch, 32, 128]."""
    parts = parts.view(shares, batch, NUM_HEADS, HEAD_DIM)
    lse = part_lse.view(shares, batch, NUM_HEADS)
    top = lse.max(0).values
    w = torch.exp2(lse - top)
    total = w.sum(0)
    return (parts * w[..., None]).sum(0) / total[..., None], top + torch.log2(total)


def errors(out, lse, ref_out, ref_lse):
    err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    return err, (lse.float() - ref_lse).abs().max().item()


# Compile reports -----------------------------------------------------------------------------


def shared_bytes(kernel) -> int | None:
    """The launch's dynamic shared memory (TileLang puts every shared buffer there): the last
    integer constant of the host wrapper's launch arguments (grid, block, then the bytes)."""
    try:
        host = kernel.get_host_source()
    except Exception:  # noqa: BLE001
        return None
    head = host.split("main_kernel_packed == NULL")[0]
    sizes = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", head)
    return int(sizes[-1]) if sizes else None


def ptxas_report(source: str) -> str:
    """ptxas -v of the generated CUDA source (registers, spills, shared): nvcc on TileLang's
    include paths; '' when it cannot run."""
    try:
        from tilelang.contrib.nvcc import get_target_compute_version  # noqa: F401
        from tilelang.env import env

        includes = [env.TILELANG_TEMPLATE_PATH, env.CUTLASS_INCLUDE_DIR]
    except Exception:  # noqa: BLE001
        base = Path(tilelang.__file__).parent
        includes = [base / "src", base / "3rdparty" / "cutlass" / "include"]
    includes = [str(p) for p in includes if p]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(source)
        cmd = ["nvcc", "-c", "-o", str(Path(tmp) / "k.o"), "-arch=sm_90a", "-std=c++17",
               "-O3", "--use_fast_math", "-Xptxas=-v", "-w",
               "-DENABLE_BF16", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
               *[f"-I{p}" for p in includes], str(src)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except Exception as e:  # noqa: BLE001
            return f"(ptxas not run: {e})"
    lines = [
        line.strip() for line in done.stderr.splitlines() if "ptxas info" in line or "spill" in line
    ]
    if done.returncode != 0:
        return "(nvcc failed)\n" + done.stderr[-2000:]
    return "\n".join(lines[-4:])


def parse_ptxas(report: str):
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def blocks_per_sm(threads, regs, smem):
    """H100/H200: 64K registers, 228 KB shared (1 KB reserved a block), 32 blocks, 64 warps."""
    bound = [32, 64 // (threads // 32)]
    if regs:
        per_warp = math.ceil(regs * 32 / 256) * 256
        bound.append((65536 // per_warp) // (threads // 32))
    if smem is not None:
        bound.append(233472 // (smem + 1024))
    return min(bound)


def compile_only(dtypes):
    """Compile the solution's decode program (and its merge) per dtype: shared bytes, registers,
    spills, blocks an SM. Returns whether all compiled without spills."""
    decode = solution_module()
    print(f"{'program':<22} {'status':<8} {'shared B':>9} {'regs':>5} {'spill':>5} "
          f"{'blocks/SM':>9}  seconds")  # fmt: skip
    good = True
    for dtype in dtypes:
        for name, build, threads in (
            (f"decode_fp8 {dtype}", decode.compile_decode, decode.THREADS),
            (f"merge_decode {dtype}", decode.compile_merge_decode, decode.MERGE_THREADS),
        ):
            start = time.perf_counter()
            try:
                kernel = build(dtype)
                smem = shared_bytes(kernel)
                regs, spill = parse_ptxas(ptxas_report(kernel.get_kernel_source()))
                status = "ok"
                good &= not spill
            except Exception as e:  # noqa: BLE001
                smem = regs = spill = None
                status = "FAILED"
                good = False
                print(f"{name}: {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
            occ = blocks_per_sm(threads, regs, smem) if status == "ok" else "-"
            print(f"{name:<22} {status:<8} {smem if smem is not None else '-':>9} "
                  f"{regs or '-':>5} {spill if spill is not None else '-':>5} {occ:>9}  "
                  f"{time.perf_counter() - start:.0f}", flush=True)  # fmt: skip
    return good


# GPU -----------------------------------------------------------------------------------------


def run_gpu(share_counts, reps, dtype="bfloat16"):
    from triton.testing import do_bench

    dev = "cuda"
    q_dtype = getattr(torch, dtype)
    q, k, v, indptr, indices, last = make_inputs(dev, q_dtype=q_dtype)
    sm_scale = 1 / math.sqrt(HEAD_DIM)
    ref_out, ref_lse = reference(q, k, v, indptr, indices, last, sm_scale)
    batch = q.shape[0]
    keys = sum((p - 1) * PAGE + lp for p, lp in zip(PAGES_OF, LAST_OF))
    kv_bytes = 2 * keys * NUM_KV_HEADS * HEAD_DIM
    decode_module = solution_module()
    kernel = compile_program(dtype)
    merge = decode_module.compile_merge_decode(dtype)
    old_merge = tilelang.compile(
        solution_split_module().merge_shares(dtype), target=decode_module.SM90A,
        pass_configs=decode_module.PASS_CONFIGS,
    )  # fmt: skip
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    scheduler = torch.zeros(2, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    planned = decode_module.decode_shares(batch, batch, indices.numel() * PAGE, sms)
    print(f"{torch.cuda.get_device_name()}: {batch} sequences, {keys} keys, "
          f"{kv_bytes / 1e6:.0f} MB of FP8 K+V; q {dtype}; the plan's shares: {planned}")
    print(f"{'shares':>6} {'us':>8} {'old merge':>9} {'decode us':>9} {'TB/s':>6} "
          f"{'out err':>9} {'lse err':>9}")  # fmt: skip
    rows = []
    for shares in share_counts:
        parts = torch.empty(shares * batch, NUM_HEADS, HEAD_DIM, device=dev)
        part_lse = torch.empty(shares * batch, NUM_HEADS, device=dev)
        out = torch.empty(batch, NUM_HEADS, HEAD_DIM, device=dev, dtype=q_dtype)
        lse = torch.empty(batch, NUM_HEADS, device=dev)

        def decode():
            kernel(q, k, v, qo_indptr, indptr, indices, last, indices.numel(), k.shape[0],
                   sm_scale * K_SCALE, V_SCALE, parts, part_lse, scheduler)  # fmt: skip

        def both():
            decode()
            merge(parts, part_lse, out, lse)

        def both_old():
            decode()
            old_merge(parts, part_lse, out, lse)

        try:
            both()
            torch.cuda.synchronize()
            err, lse_err = errors(out, lse, ref_out, ref_lse)
            bad = not (err <= 5e-3 and lse_err <= 1e-3)
            us = do_bench(both, warmup=25, rep=reps) * 1e3
            us_old = do_bench(both_old, warmup=25, rep=reps) * 1e3
            us_decode = do_bench(decode, warmup=25, rep=reps) * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"{shares:>6} RUN FAILED: {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
            continue
        rows.append((us, shares))
        print(f"{shares:>6} {us:8.1f} {us_old:9.1f} {us_decode:9.1f} "
              f"{kv_bytes / us / 1e6:6.2f} {err:9.2e} {lse_err:9.2e}"
              f"{'  WRONG' if bad else ''}", flush=True)  # fmt: skip
    if rows:
        us, shares = min(rows)
        print(f"best: shares {shares}: {us:.1f} us with merge_decode (the probe's n32_t32_s2 "
              f"at 32 shares: 113.5 us with merge_shares; shipped packed program ~136 us)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for sm_90a (no GPU): shared, registers")  # fmt: skip
    parser.add_argument("--shares", type=int, nargs="+", default=list(SHARES))
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms)")
    args = parser.parse_args()
    if args.compile_only or not torch.cuda.is_available():
        if not args.compile_only:
            print("no GPU: compiling only")
        sys.exit(0 if compile_only([args.dtype]) else 1)
    run_gpu(args.shares, args.reps, args.dtype)


if __name__ == "__main__":
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
