"""On the GPU, under Nsight Compute: the CUDA bf16 paged kernel (page size 64) and the FP8-cache
kernel on the same K/V of one paged workload, each launched twice (ncu takes the second):

    ncu -k regex:gqa_prefill_paged_wgmma_kernel --launch-skip 1 --launch-count 1 --set full \\
        python scripts/profile_fp8.py [workload]
    ncu -k regex:gqa_prefill_paged_fp8_wgmma_kernel ... (the same)

The findings are in solutions/gqa_ragged/cuda/TUNING.md (FP8 section).
"""

import sys

import torch

from prefill_bundle.testing import PagedCase, build_solution, make_inputs, poisoned_outputs
from prefill_bundle.workloads import FP8_K_SCALE, FP8_V_SCALE, PAGED_BATCHES


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "chunked_prefill_2k_over_8k"
    batch = next(b for b in PAGED_BATCHES if b.name == name)
    case = PagedCase(batch.q_lens, batch.kv_lens, 64, shared_prefix=batch.shared_prefix,
                     fp8_scales=(FP8_K_SCALE, FP8_V_SCALE))  # fmt: skip
    fp8 = make_inputs(case, "cuda", seed=0)
    # NaN in unused cache slots to 0, then the bf16 caches hold exactly the FP8 ones' values.
    fp8[1:3] = [x.float().nan_to_num().to(torch.float8_e4m3fn) for x in fp8[1:3]]
    q = fp8[0]
    bf16 = [q, (fp8[1].float() * FP8_K_SCALE).to(q.dtype),
            (fp8[2].float() * FP8_V_SCALE).to(q.dtype), *fp8[3:7], fp8[-1]]  # fmt: skip
    for solution, args in (("cuda_paged_ps64", bf16), ("cuda_fp8kv", fp8)):
        fn = build_solution(solution)
        outputs = poisoned_outputs(case, args)
        for _ in range(2):
            fn(*args, *outputs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
