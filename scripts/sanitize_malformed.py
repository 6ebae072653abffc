"""Every backend's ragged and paged solutions under compute-sanitizer memcheck on the fixed lists
of malformed batches (prefill_bundle.testing.MALFORMED_BATCHES plus a valid batch;
the same with a sliding window for the window solutions;
prefill_bundle.paged_malformed.MALFORMED_PAGED_BATCHES, a valid one first, and its page-size-64
batches over FP8 caches for the _fp8kv solutions), printing one
line per case: the solution, the batch, and whether the NaN rows and the well-formed rows are
what the contract says. memcheck itself reports any access outside an allocation.

    compute-sanitizer --tool memcheck python scripts/sanitize_malformed.py

The outputs live in tight allocations of their own (no guard space), so that a write one element
past them is an error to memcheck. Run with --solutions NAME ... to restrict, --only TEXT to
run only the batches whose id contains TEXT (e.g. --only long: the 9000-key batches).
"""

import argparse
from dataclasses import replace

import torch

from prefill_bundle import PAGE_SIZES, PAGED_FP8, RAGGED, SWA
from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.paged_malformed import (
    MALFORMED_FP8_BATCHES,
    MALFORMED_PAGED_BATCHES,
    check_malformed_paged_outputs,
    long_batches,
    malformed_paged_expected,
    malformed_paged_inputs,
)
from prefill_bundle.testing import (
    MALFORMED_BATCHES,
    MALFORMED_SWA_BATCHES,
    MalformedBatch,
    build_solution,
    check_malformed_outputs,
    malformed_expected,
    malformed_inputs,
)

VALID = MalformedBatch("valid_partition", (0, 30, 70, 100), (0, 40, 80, 120))
# Sequences long enough that CUDA's Hopper kernels draw their KV heads in L2 sections
# (locate_tile: above 4096 keys of 16-bit K/V), valid and beside malformed entries.
# And keys averaging 8192 a sequence or more, where TileLang's entry picks its programs that draw
# items in L2 sections (long_keys_launch).
LONG = [
    MalformedBatch("long_valid", (0, 300, 400, 600), (0, 9000, 9500, 9700), 600, 9700),
    MalformedBatch("long_then_garbage", (0, 300, 600, 500), (0, 9000, 9700, 9600), 600, 9700),
    MalformedBatch("long_keys_valid", (0, 300, 600), (0, 9000, 18000), 600, 18000),
    MalformedBatch("long_keys_then_garbage", (0, 300, 600, 500), (0, 9000, 18000, 17000), 600,
                   25000),  # fmt: skip
]
DEFINITIONS = (RAGGED, SWA, *PAGE_SIZES, PAGED_FP8)
OURS = [s.name for s in SOLUTIONS if s.definition in DEFINITIONS and s.author != BASELINE_AUTHOR]

parser = argparse.ArgumentParser()
parser.add_argument("--solutions", nargs="*", default=OURS)
parser.add_argument("--only", default="", help="run only the batches whose id contains this")
args = parser.parse_args()
names = args.solutions
failures = cases = 0
for name in names:
    run = build_solution(name)
    if "_paged_" in name or name.endswith("_fp8kv"):
        if name.endswith("_fp8kv"):
            batches = MALFORMED_FP8_BATCHES + long_batches(64, fp8=True)
        else:
            page_size = int(name.rsplit("_ps", 1)[1])
            batches = [b for b in MALFORMED_PAGED_BATCHES if b.page_size == page_size]
            batches += long_batches(page_size)
        inputs_of, expected_of = malformed_paged_inputs, malformed_paged_expected
        check = check_malformed_paged_outputs
    elif name.endswith("_swa"):
        batches = [replace(VALID, window_left=7), *MALFORMED_SWA_BATCHES]
        inputs_of, expected_of = malformed_inputs, malformed_expected
        check = check_malformed_outputs
    else:
        batches = [VALID, *MALFORMED_BATCHES, *LONG]
        inputs_of, expected_of, check = (
            malformed_inputs,
            malformed_expected,
            check_malformed_outputs,
        )
    for batch in [b for b in batches if args.only in b.id]:
        inputs = inputs_of(batch, "cuda", seed=11)
        expected = expected_of(batch, inputs)
        output = torch.full_like(inputs[0], -7.0)
        lse = torch.full(inputs[0].shape[:2], -7.0, device="cuda")
        run(*inputs, output, lse)
        torch.cuda.synchronize()
        cases += 1
        try:
            check([output, lse], expected)
            verdict = "ok"
        except AssertionError as error:
            failures += 1
            verdict = f"WRONG: {str(error).splitlines()[0]}"
        nan_rows = int(output.isnan().all(-1).all(-1).sum())
        print(f"{name:18s} {batch.id:38s} nan_rows={nan_rows:3d} {verdict}", flush=True)
print(f"{cases - failures} passed, {failures} failed")
