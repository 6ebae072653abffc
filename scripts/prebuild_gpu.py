"""On the GPU machine, before `flashinfer-bench run` or a timing script: build every named
solution and run it once on a small case, each in its own process, in parallel. CUDA entries
are one long nvcc job each and TileLang compiles its kernels on first call (into its disk
cache), so the benchmark then finds every build ready (13 solutions in 108 s on the 16-core H100
host, 2026-11-25).

    python scripts/prebuild_gpu.py cuda_ragged tilelang_ragged triton_ragged ...
"""

import multiprocessing as mp
import sys
import time


def warm(name: str) -> str:
    import torch

    from prefill_bundle.testing import PaddedCase, PagedCase, RaggedCase, make_inputs, run_solution

    start = time.time()
    dtypes = (torch.bfloat16, torch.float16)
    if name.endswith("_mini"):
        cases = [PaddedCase(2, 300, 300, c, d) for c in (True, False) for d in dtypes]
    elif name.endswith("_swa"):
        cases = [RaggedCase((300, 5), (300, 40), d, window_left=64) for d in dtypes]
    elif name.endswith("_fp8kv"):
        # and decode-like rows, which the plans split (split kernels, merge)
        cases = [PagedCase((100, 7), (300, 70), 64, fp8_scales=(0.5, 1.25)),
                 PagedCase((1, 1, 2, 1), (3000, 700, 5000, 64), 64, fp8_scales=(0.5, 1.25))]
    elif "_paged_ps" in name:
        page_size = int(name.rsplit("ps", 1)[1])
        cases = [PagedCase(q_lens, kv_lens, page_size, d) for d in dtypes
                 for q_lens, kv_lens in (((100, 7), (300, 70)),
                                         ((1, 1, 2, 1), (3000, 700, 5000, 64)))]
    else:
        cases = [RaggedCase((300, 5), (300, 40), d) for d in dtypes]
    try:
        for case in cases:
            run_solution(name, case, make_inputs(case, "cuda"))
        torch.cuda.synchronize()
        return f"{name}: ok {time.time() - start:.0f} s"
    except Exception as error:  # reported, never stopping the others
        return f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}"


def main():
    names = sys.argv[1:]
    with mp.get_context("spawn").Pool(min(len(names), 12)) as pool:
        for line in pool.imap_unordered(warm, names):
            print(line, flush=True)


if __name__ == "__main__":
    main()
