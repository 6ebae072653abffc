"""Which of the open issues' speed bars the committed traces meet: each bar on a solution's
flashinfer-bench latency against FlashInfer's on the same workload (report.md's ratios), one
line per (issue, workload, solution) the bar covers, FAIL first, and every trace that did not
pass. Reads traces/ only (no GPU): run it after `bash scripts/gpu_bench.sh` and `python
scripts/report.py` to judge an H100 run.

    python scripts/issue_bars.py            # every bar
    python scripts/issue_bars.py --failing  # only what is missed
    python scripts/issue_bars.py --failing --traces RUN/traces   # another run's traces, judged
        # beside the committed ones (a rehearsal on another GPU, or a run not committed yet):
        # each definition with a .jsonl under RUN/traces is judged on that run's traces alone

The bars as the issues state them (the pairing and kernel-time bars come from their own
scripts: paged_vs_ragged.py, window_vs_causal.py, fp8_vs_bf16.py, long_shapes.py):
- 16 (paged, page sizes 1 and 64): CUDA and TileLang >= 1.1x on every workload of 4096 or more
  KV tokens, Triton >= 0.9x there, every backend >= 0.8x everywhere;
- 17 (sliding window): CUDA and TileLang >= 1.0x on every window workload, Triton >= 0.8x;
- 18 (FP8 caches): CUDA and TileLang >= 1.3x on every workload of 4096 or more KV tokens,
  Triton >= 1.0x there, every backend >= 0.8x everywhere;
- 19 (beyond FA3): CUDA and TileLang >= 1.05x on the padded shapes of 2K or more tokens a
  sequence and the ragged workloads of 4096 or more tokens, Triton >= 0.9x on the three big
  padded configurations (8x2048, 1x8192 and 1x16384).
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

from flashinfer_bench import TraceSet

from prefill_bundle import MINI, PAGE_SIZES, PAGED_FP8, RAGGED, REPO_ROOT, SWA
from prefill_bundle.packing import BASELINE_AUTHOR, SOLUTIONS
from prefill_bundle.report import with_run
from prefill_bundle.workloads import MINI_SHAPES, PAGED_BATCHES, RAGGED_BATCHES, SWA_BATCHES

FAST, TRITON = ("cuda", "tilelang"), ("triton",)
BIG_PADDED = ("large_b8_q2048_kv2048_causal", "long_b1_q8192_kv8192_causal",
              "long_b1_q16384_kv16384_noncausal")  # fmt: skip


@dataclass(frozen=True)
class Check:
    issue: int
    definition: str
    workload: str
    solution: str
    ratio: float  # FlashInfer's latency / the solution's
    bar: float

    @property
    def ok(self) -> bool:
        return self.ratio >= self.bar


def kv_tokens(definition: str, workload: str) -> int:
    """The keys a workload's batch holds, all sequences together (padded: batch x seq_kv)."""
    if definition == MINI:
        shape = next(s for s in MINI_SHAPES if s.name == workload)
        return shape.batch * shape.seq_kv
    if definition in (RAGGED, SWA):
        return sum(next(b for b in RAGGED_BATCHES + SWA_BATCHES if b.name == workload).kv_lens)
    name = workload.rsplit("_", 1)[0]  # the paged uuids end in _ps1, _ps64 or _fp8kv
    return sum(next(b for b in PAGED_BATCHES if b.name == name).kv_lens)


def bars(definition: str, workload: str, backend: str) -> list:
    """(issue, bar) pairs that cover this backend's ratio on this workload."""
    long_kv = kv_tokens(definition, workload) >= 4096
    found = []
    if definition in PAGE_SIZES or definition == PAGED_FP8:
        issue, fast, triton = (18, 1.3, 1.0) if definition == PAGED_FP8 else (16, 1.1, 0.9)
        found.append((issue, 0.8))
        if long_kv and backend in FAST + TRITON:
            found.append((issue, fast if backend in FAST else triton))
    elif definition == SWA and backend in FAST + TRITON:
        found.append((17, 1.0 if backend in FAST else 0.8))
    elif definition == MINI:
        shape = next(s for s in MINI_SHAPES if s.name == workload)
        if backend in FAST and min(shape.seq_q, shape.seq_kv) >= 2048:
            found.append((19, 1.05))
        if backend in TRITON and workload in BIG_PADDED:
            found.append((19, 0.9))
    elif definition == RAGGED and backend in FAST and long_kv:
        found.append((19, 1.05))
    return found


def checks(trace_set: TraceSet) -> tuple:
    """(every Check of the traces' ratios, the traces that did not pass as (definition,
    workload, solution, status))."""
    backend_of = {s.name: s.backend for s in SOLUTIONS}
    baselines = {s.name for s in SOLUTIONS if s.author == BASELINE_AUTHOR}
    found, failed = [], []
    for definition, traces in sorted(trace_set.traces.items()):
        by_workload = {}
        for t in traces:
            by_workload.setdefault(t.workload.uuid, {})[t.solution] = t
            if not t.is_successful():
                failed.append((definition, t.workload.uuid, t.solution, t.evaluation.status.value))
        for workload, row in sorted(by_workload.items()):
            base = next((t for n, t in row.items() if backend_of.get(n) == "flashinfer"), None)
            if base is None or not base.is_successful():
                continue
            for name, t in sorted(row.items()):
                if name in baselines or not t.is_successful():
                    continue
                ratio = base.evaluation.performance.latency_ms / t.evaluation.performance.latency_ms
                for issue, bar in bars(definition, workload, backend_of[name]):
                    found.append(Check(issue, definition, workload, name, ratio, bar))
    return found, failed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--failing", action="store_true", help="only the bars missed")
    parser.add_argument("--traces", type=Path, metavar="DIR",
                        help="judge another run's traces (a copy of its traces/), with the "
                             "committed ratio in brackets")  # fmt: skip
    args = parser.parse_args()
    found, failed = checks(TraceSet.from_path(str(REPO_ROOT)))
    committed = {(c.issue, c.definition, c.workload, c.solution, c.bar): c.ratio for c in found}
    if args.traces is not None:
        try:
            found, failed = checks(with_run(TraceSet.from_path(str(REPO_ROOT)), args.traces))
        except ValueError as error:
            raise SystemExit(f"issue_bars.py: {error}") from None
    for t in failed:
        print("NOT PASSED: {} / {} / {}: {}".format(*t))
    for c in sorted(found, key=lambda c: (c.ok, c.issue, c.definition, c.workload, c.solution)):
        if args.failing and c.ok:
            continue
        verdict = "ok  " if c.ok else "FAIL"
        before = committed.get((c.issue, c.definition, c.workload, c.solution, c.bar))
        was = "" if args.traces is None else "  [committed: " + (
            "none]" if before is None else f"{before:.3f}]")  # fmt: skip
        print(f"{verdict} #{c.issue} {c.definition:45s} {c.workload:40s} {c.solution:22s} "
              f"{c.ratio:6.3f} (bar {c.bar}){was}")  # fmt: skip
    for issue in sorted({c.issue for c in found}):
        mine = [c for c in found if c.issue == issue]
        print(f"issue {issue}: {sum(c.ok for c in mine)} of {len(mine)} bars met")


if __name__ == "__main__":
    main()
