"""On the CPU machine: compile every TileLang program the solutions' entries launch in the
benchmark (the definitions' dtypes, an H100's 132 SMs) into a fresh TileLang cache and pack it,
so that a fresh GPU machine loads them instead of compiling them (1.5-3 minutes of device time
a machine, 2026-11-27). TileLang keys its cache on the program's script, target, pass configs,
its version and its native libraries' hashes, all the same here and in the device pack.

    python scripts/tilelang_cache.py                 # writes .tilelang-cache.tar.xz (ignored)
    # on the device, carry [".device-wheels", ".tilelang-cache.tar.xz"], then
    mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tilelang-cache.tar.xz
    export TILELANG_CACHE_DIR=/tmp/tl

A program whose key differs there (another TileLang build) is compiled as before; so is
every program after a change to the TileLang sources, until the archive is rebuilt (~6 minutes
here). On the H100 (2026-11-27) a fresh machine's TileLang prebuild took 6 s with the archive.

--solutions caches the programs of Solution JSON files instead (variants from
scripts/tilelang_variant.py, for compare_gpu.py --old): only those of each one's definition.
Without it, a TileLang variant compiles on the GPU machine, ~60 s a program there (2026-11-29
(22): four variants of two solutions took a whole 540 s call without timing anything).

    python scripts/tilelang_cache.py --solutions .ab/v1/*.json --out .ab/v1/tilelang-cache.tar.xz
"""

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import NamedTuple

ARCHIVE = Path(".tilelang-cache.tar.xz")
H100_SMS = 132
DECODE_JOBS = ("decode", "merge_decode")


class Program(NamedTuple):
    """One attention program: tilelang_prefill._kernel's key, less the SM count."""

    dtype: str
    causal: bool = True
    page_size: int | None = None
    window: bool = False
    fp8: bool = False  # over FP8 caches
    split: bool = False
    pack: bool = False
    long_keys: bool = False
    short_keys: bool = False


def programs() -> list:
    """A Program for every attention program the entries launch on the committed workloads,
    ("merge", dtype) and ("gather", dtype) (page size 1's page gather, before the ragged
    program), ("decode", dtype, 64, False, True) and ("merge_decode", ...) (FP8 decode-like
    batches: gqa_prefill_decode). Written out by hand: tests/test_dataset.py checks it against
    the entry's own choices (paged_plan, gathers_pages, long_keys_launch, short_keys_launch) on
    each committed workload."""
    from prefill_bundle.testing import tilelang_kernels

    kernels = tilelang_kernels()
    jobs = [Program("float16", causal, long_keys=long_keys)
            for causal in (True, False) for long_keys in (False, True)]  # fmt: skip
    jobs.append(Program("float16", False, short_keys=True))  # 4x512
    jobs += [Program("bfloat16", long_keys=long_keys) for long_keys in (False, True)]
    jobs.append(Program("bfloat16", window=True))
    jobs += [Program("bfloat16", page_size=page_size) for page_size in kernels.PAGE_SIZES]
    jobs.append(Program("bfloat16", page_size=64, fp8=True))  # FP8 caches
    for dtype, page_size, fp8 in kernels.PACK_VARIANTS:
        if dtype == "bfloat16":
            split = (dtype, page_size, fp8) in kernels.PACK_SPLIT_VARIANTS
            jobs += [Program(dtype, page_size=page_size, fp8=fp8, split=s, pack=True)
                     for s in {False, split}]  # fmt: skip
    # The FP8 decode program and its merge (gqa_prefill_decode; decode-like FP8 batches), laid
    # out as (name, dtype, page size, window, FP8 caches).
    jobs += [(name, "bfloat16", 64, False, True) for name in DECODE_JOBS]
    return jobs + [("merge", "bfloat16"), ("gather", "bfloat16")]


def definition_programs(definition: str, jobs: list) -> list:
    """The jobs a solution of `definition` launches (the merge with the paged ones; page size
    1's gather and the ragged program it runs after it)."""
    from prefill_bundle import MINI, PAGE_SIZES, PAGED_FP8, PAGED_PS1, RAGGED, SWA

    def launched(job) -> bool:
        if job[0] == "merge":
            return definition in PAGE_SIZES or definition == PAGED_FP8
        if job[0] == "gather":
            return definition == PAGED_PS1
        if job[0] in DECODE_JOBS:
            return definition == PAGED_FP8
        if definition == MINI:
            return job.dtype == "float16"
        if definition in (RAGGED, PAGED_PS1) and job.page_size is None:
            return job.dtype == "bfloat16" and not job.window
        if definition == SWA:
            return job.window
        if definition == PAGED_FP8:
            return job.fp8
        return definition in PAGE_SIZES and job.page_size == PAGE_SIZES[definition] and not job.fp8

    return [job for job in jobs if launched(job)]


def solution_kernels(path):
    """The gqa_prefill_kernel module of the TileLang solution in JSON file `path`, or the
    shipped one's (None)."""
    from prefill_bundle.testing import tilelang_kernels

    if path is None:
        return tilelang_kernels()
    from flashinfer_bench import Solution

    from prefill_bundle.testing import build_solution_object

    solution = Solution.model_validate_json(Path(path).read_text())
    return tilelang_kernels(build_solution_object(solution))


def decode_module(kernels):
    """The solution's gqa_prefill_decode beside its gqa_prefill_kernel, or (a pack that does not
    hold it yet: prefill_bundle/packing.py's list) the repository's, through the decode probe's
    loader: the same program text, so the same cache key."""
    try:
        return importlib.import_module(kernels.__name__.rpartition(".")[0] + ".gqa_prefill_decode")
    except ModuleNotFoundError:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tilelang_decode_probe

        return tilelang_decode_probe.solution_module()


def compile_program(job, path=None) -> str:
    kernels = solution_kernels(path)
    start = time.perf_counter()
    try:
        if job[0] == "merge":
            kernels.compile_merge(job[1])
        elif job[0] == "gather":
            kernels.compile_gather(job[1])
        elif job[0] in DECODE_JOBS:
            decode = decode_module(kernels)
            build = decode.compile_decode if job[0] == "decode" else decode.compile_merge_decode
            build(job[1])
        else:
            options = job._asdict()
            fp8 = options.pop("fp8")
            kernels.compile_variant(
                **options, num_sms=H100_SMS, cache_dtype=kernels.FP8_E4M3 if fp8 else None
            )
    except Exception as error:  # TVM's errors do not pickle back to the pool: their text does
        raise RuntimeError(f"{type(error).__name__}: {error}") from None
    return f"{job}: {time.perf_counter() - start:.0f} s"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--solutions", nargs="+", metavar="JSON", help="these solutions' programs")
    parser.add_argument("--out", type=Path, default=ARCHIVE)
    options = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="tilelang-cache-"))
    os.environ["TILELANG_CACHE_DIR"] = str(cache)  # the workers inherit it before importing
    if options.solutions:
        from flashinfer_bench import Solution

        shipped, jobs = programs(), []
        for path in options.solutions:
            definition = Solution.model_validate_json(Path(path).read_text()).definition
            jobs += [(job, path) for job in definition_programs(definition, shipped)]
    else:
        jobs = [(job, None) for job in programs()]
    failed = []
    with ProcessPoolExecutor(os.cpu_count(), mp_context=get_context("spawn")) as pool:
        for job, future in [(job, pool.submit(compile_program, *job)) for job in jobs]:
            try:
                print(future.result(), flush=True)
            except Exception as error:  # a worker's compile error (or its death): name the job
                print(f"{job}: FAILED: {error!r}"[:2000], flush=True)
                failed.append(job)
    if failed:
        return f"{len(failed)} of {len(jobs)} programs failed to compile: {failed}"
    subprocess.run(["tar", "-C", str(cache), "-cJf", str(options.out), "."], check=True)
    print(f"{len(jobs)} programs: {options.out} ({options.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
