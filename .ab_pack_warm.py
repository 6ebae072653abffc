"""Compile the TileLang paged kernels the packing A/B needs into TileLang's disk cache, one
process each, in parallel (the entry's own compile_variant arguments, so its calls hit the cache).

    python .ab_pack_warm.py
"""

import multiprocessing as mp
import time

VARIANTS = [
    dict(page_size=page_size, **flags)
    for page_size, flags in [
        (64, {}), (64, dict(split=True, pack=True)), (64, dict(pack=True)), (1, {}),
        (1, dict(split=True, pack=True)), (64, dict(fp8=True)),
        (64, dict(fp8=True, split=True, pack=True)),
    ]
]  # fmt: skip


def build(job):
    import torch
    from test_tilelang_compile import kernel_module

    dtype, variant = job
    kernels = kernel_module()
    start = time.time()
    try:
        if variant == "merge":
            kernels.compile_merge(dtype)
        else:
            variant = dict(variant)
            fp8 = variant.pop("fp8", False)
            kernels.compile_variant(
                dtype, True, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                window=False, cache_dtype=kernels.FP8_E4M3 if fp8 else None, **variant,
            )  # fmt: skip
        return f"{dtype} {variant}: ok {time.time() - start:.0f} s"
    except Exception as error:
        return f"{dtype} {variant}: FAILED {type(error).__name__}: {str(error)[:300]}"


if __name__ == "__main__":
    import sys

    sys.path.insert(0, "tests")
    jobs = [(d, v) for d in ("bfloat16", "float16") for v in VARIANTS + ["merge"]]
    with mp.get_context("spawn").Pool(min(len(jobs), 16)) as pool:
        for line in pool.imap_unordered(build, jobs):
            print(line, flush=True)
