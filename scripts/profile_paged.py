"""On the GPU, under Nsight Compute: one solution's kernel on one paged workload's K/V (paged
solutions read the pages; `*_ragged` ones the same keys gathered, as scripts/paged_vs_ragged.py
pairs them), launched twice to warm up, then once between cudaProfilerStart/Stop:

    ncu --profile-from-start off -k regex:"wgmma|main_kernel" --launch-count 1 --set full \\
        python scripts/profile_paged.py tilelang_paged_ps1 [workload]

FP8 solutions (a name with "fp8": tilelang_fp8kv, cuda_fp8kv) get FP8 caches of page size 64.
A ragged or sliding-window workload's name (prefill_bundle.workloads' RAGGED_BATCHES and
SWA_BATCHES) for the ragged definitions' solutions (tilelang_swa, cuda_ragged, ...). A padded
shape instead of a workload, for the mini definition's solutions (cuda_mini,
flashinfer_mini, ...): `padded:BATCH,SEQ_Q,SEQ_KV,CAUSAL`, e.g. padded:8,2048,2048,1. The solution
may be a Solution JSON file (an earlier version, `git show REV:solutions/...json > old.json`).

Per-instruction stall samples (where warp-specialized kernels lose time, by warp role):
    ncu ... --section SourceCounters -o report python scripts/profile_paged.py SOLUTION
    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/stall_by_role.py sass.csv     # by warp role, loop vs item, bank conflicts
The findings are in each backend's TUNING.md (paged sections).
"""

import sys
from pathlib import Path

import torch

from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution_or_file,
    call_arguments,
    gathered_ragged_inputs,
    make_inputs,
    nan_slots_to_zero,
)
from prefill_bundle.workloads import (
    FP8_K_SCALE,
    FP8_V_SCALE,
    PAGED_BATCHES,
    ragged_batch_named,
)


def main():
    name = sys.argv[1]
    workload = sys.argv[2] if len(sys.argv) > 2 else "chunked_prefill_2k_over_8k"
    case = contiguous_case(workload)
    if case is not None:  # the inputs as the tests make them
        profile(build_solution_or_file(name), case, make_inputs(case, "cuda", seed=0))
        return
    batch = next(b for b in PAGED_BATCHES if b.name == workload)
    stem = Path(name).stem  # a JSON file's solution: its file name
    fp8 = "fp8" in stem  # FP8 caches: page size 64, the workloads' scales
    page_size = 64 if fp8 else int(stem.rsplit("ps", 1)[1]) if "_ps" in stem else 1
    case = PagedCase(batch.q_lens, batch.kv_lens, page_size, shared_prefix=batch.shared_prefix,
                     fp8_scales=(FP8_K_SCALE, FP8_V_SCALE) if fp8 else ())  # fmt: skip
    paged = nan_slots_to_zero(make_inputs(case, "cuda", seed=0))
    args = gathered_ragged_inputs(case, paged) if stem.endswith("_ragged") else paged
    profile(build_solution_or_file(name), case, args)


def contiguous_case(workload: str):
    """The padded shape's or the ragged / window workload's case; None for a paged workload."""
    if workload.startswith("padded:"):
        batch, seq_q, seq_kv, causal = map(int, workload.split(":")[1].split(","))
        return PaddedCase(batch, seq_q, seq_kv, bool(causal))
    ragged = ragged_batch_named(workload)
    if ragged is not None:
        return RaggedCase(ragged.q_lens, ragged.kv_lens, window_left=ragged.window_left)
    return None


def profile(fn, case, args):
    """Two warm-up calls, then one between cudaProfilerStart and Stop."""
    call_args = call_arguments(fn, case, args)
    for _ in range(2):
        fn(*call_args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(*call_args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
