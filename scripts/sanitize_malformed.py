"""Every backend's ragged solution under compute-sanitizer memcheck on the fixed list of
malformed batches (prefill_bundle.testing.MALFORMED_BATCHES), plus a valid batch, printing one
line per case: the solution, the batch, and whether the NaN rows and the well-formed rows are
what the contract says. memcheck itself reports any access outside an allocation.

    compute-sanitizer --tool memcheck python scripts/sanitize_malformed.py

The outputs live in tight allocations of their own (no guard space), so that a write one element
past them is an error to memcheck. Run with --solutions NAME ... to restrict.
"""

import argparse

import torch

from prefill_bundle import RAGGED
from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.testing import (
    MALFORMED_BATCHES,
    MalformedBatch,
    build_solution,
    check_malformed_outputs,
    malformed_expected,
    malformed_inputs,
)

VALID = MalformedBatch("valid_partition", (0, 30, 70, 100), (0, 40, 80, 120))
OURS = [s.name for s in SOLUTIONS if s.definition == RAGGED and s.author != BASELINE_AUTHOR]

parser = argparse.ArgumentParser()
parser.add_argument("--solutions", nargs="*", default=OURS)
names = parser.parse_args().solutions
failures = 0
for name in names:
    run = build_solution(name)
    for batch in [VALID, *MALFORMED_BATCHES]:
        inputs = malformed_inputs(batch, "cuda", seed=11)
        expected = malformed_expected(batch, inputs)
        output = torch.full_like(inputs[0], -7.0)
        lse = torch.full(inputs[0].shape[:2], -7.0, device="cuda")
        run(*inputs, output, lse)
        torch.cuda.synchronize()
        try:
            check_malformed_outputs([output, lse], expected)
            verdict = "ok"
        except AssertionError as error:
            failures += 1
            verdict = f"WRONG: {str(error).splitlines()[0]}"
        nan_rows = int(output.isnan().all(-1).all(-1).sum())
        print(f"{name:16s} {batch.name:24s} nan_rows={nan_rows:3d} {verdict}", flush=True)
print(f"{len(names) * (len(MALFORMED_BATCHES) + 1) - failures} passed, {failures} failed")
