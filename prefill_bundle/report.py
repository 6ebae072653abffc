"""report.md from the committed traces: per workload, each solution's latency, TF/s and ratio
to FlashInfer (FlashInfer latency / solution latency, both from the same run). The same for
another run's traces (report_h200.md: the H200 snapshot under blob/h200/traces/)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from flashinfer_bench import Trace, TraceSet
from flashinfer_bench.data import load_jsonl_file
from safetensors.torch import load_file

from . import HEAD_DIM, NUM_HEADS, REPO_ROOT
from .cuda_build import RESOURCES_MD
from .packing import BASELINE_AUTHOR, SOLUTIONS
from .workloads import PAGED_DEFINITIONS

FLASHINFER_BACKEND = "flashinfer"
FLOPS_PER_PAIR = 4.0 * NUM_HEADS * HEAD_DIM  # Q K^T and P V, a multiply-add each
# Issue 19's kernel-time table, written on the GPU by scripts/long_shapes.py (not from traces).
KERNEL_TIME_MD = REPO_ROOT / "kernel_time.md"


def visible_pairs(seq_q: int, seq_kv: int, causal: bool, window_left: int = -1) -> int:
    """(query, key) pairs the mask lets through; bottom-right aligned when causal; with a window
    (window_left >= 0), only the keys p - window_left..p of the query at position p."""
    if not causal:
        return seq_q * seq_kv
    last = torch.arange(seq_q, dtype=torch.int64) + seq_kv - seq_q  # each row's last key
    first = (last - window_left).clamp_min(0) if window_left >= 0 else torch.zeros_like(last)
    return int((last.clamp(max=seq_kv - 1) - first + 1).clamp_min(0).sum())


def tiled_pairs(seq_q: int, seq_kv: int, tile_tokens: int, tile_keys: int,
                window_left: int = -1) -> int:
    """(query, key) pairs a causal kernel computes for one sequence when it cuts the queries into
    tiles of tile_tokens from the sequence's start and visits every key tile (tile_keys wide,
    aligned to 0) that holds a key some row of the query tile sees: visible_pairs plus what the
    masks throw away. Their ratio bounds a tiled kernel's TF/s counted over visible pairs."""
    pairs = 0
    shift = seq_kv - seq_q  # bottom-right: query i sits at position i + shift
    for first in range(0, seq_q, tile_tokens):
        last_key = min(first + tile_tokens - 1 + shift, seq_kv - 1)
        first_key = max(first + shift - window_left, 0) if window_left >= 0 else 0
        if last_key >= first_key:
            pairs += tile_tokens * (last_key // tile_keys - first_key // tile_keys + 1) * tile_keys
    return pairs


def workload_flops(workload, page_size: int = 0) -> float:
    """4 * heads * head_dim flops per visible pair: Q K^T and P V, a multiply-add each.
    page_size: the paged definitions' (their kv_indptr counts pages)."""
    axes, inputs = workload.axes, workload.inputs
    if "batch" in axes:
        causal = bool(inputs["causal"].value)
        pairs = axes["batch"] * visible_pairs(axes["seq_q"], axes["seq_kv"], causal)
    else:
        spec = inputs["qo_indptr"]
        blob = load_file(str(REPO_ROOT / spec.path))
        q_lens = blob["qo_indptr"].diff().tolist()
        kv_lens = blob["kv_indptr"].diff()
        if page_size:
            last = blob.get("kv_last_page_len", torch.ones_like(kv_lens))
            kv_lens = torch.where(kv_lens > 0, (kv_lens - 1) * page_size + last, 0)
        kv_lens = kv_lens.tolist()
        window = int(inputs["window_left"].value) if "window_left" in inputs else -1
        pairs = sum(visible_pairs(q, kv, True, window) for q, kv in zip(q_lens, kv_lens))
    return FLOPS_PER_PAIR * pairs


def _cell(latency_ms, flops, ratio):
    if latency_ms is None:
        return "—"
    tflops = flops / (latency_ms * 1e-3) / 1e12
    ratio_text = "" if ratio is None else f" · **{ratio:.2f}×**"
    tflops_text = f"{tflops:.1f}" if tflops < 10 else f"{tflops:.0f}"
    return f"{latency_ms * 1e3:.1f} µs · {tflops_text} TF/s{ratio_text}"


def apply_choices(trace_set: TraceSet) -> list:
    """Which solution apply dispatches per bucket (prefill_bundle.serving's key and config),
    among the bundle's own solutions, computed from the traces as flashinfer-bench does."""
    from flashinfer_bench.apply import ApplyConfigRegistry
    from flashinfer_bench.apply.table import ApplyTable

    from .serving import BUNDLE_APPLY_CONFIG, keep_only

    own = TraceSet(
        root=trace_set.root,
        definitions=dict(trace_set.definitions),
        solutions={k: list(v) for k, v in trace_set.solutions.items()},
        workloads=dict(trace_set.workloads),
        traces={k: list(v) for k, v in trace_set.traces.items()},
    )
    every = [s for sols in own.solutions.values() for s in sols]
    keep_only(own, [s.name for s in every if s.author != BASELINE_AUTHOR])
    table = ApplyTable._build(own, ApplyConfigRegistry(default=BUNDLE_APPLY_CONFIG))
    lines = [
        "## What apply serves",
        "",
        "`prefill_bundle.serving.enable_bundle_apply()` keys calls on powers of two of the "
        "batch (or sequence count), query and key lengths plus causal; per bucket it serves the "
        "traced winner, and a bucket without traces the definition's best.",
        "",
        "| definition | bucket | causal | solution |",
        "|---|---|---|---|",
    ]
    for def_name, index in sorted(table.index.items()):
        for key, solution in sorted(index.items(), key=lambda kv: str(kv[0])):
            bucket = ", ".join(f"{name} ≤ {value}" for name, value in key.axes)
            feats = dict(key.feats)
            if "window" in feats:
                bucket += f", window ≤ {feats['window']}" if feats["window"] >= 0 else ", no window"
            lines.append(f"| {def_name} | {bucket} | {feats['causal']} | {solution} |")
    for def_name, solution in sorted(table.def_best.items()):
        lines.append(f"| {def_name} | any other | | {solution} (definition's best) |")
    return lines + [""]


def plot_ratios(trace_set: TraceSet, path) -> None:
    """A bar chart of ratio to FlashInfer per workload and solution (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend_of = {s.name: s.backend for s in SOLUTIONS}
    definitions = sorted(trace_set.traces)
    fig, axes = plt.subplots(len(definitions), 1, figsize=(11, 4.2 * len(definitions)))
    for ax, def_name in zip(list(axes) if len(definitions) > 1 else [axes], definitions):
        by_workload = defaultdict(dict)
        for t in trace_set.traces[def_name]:
            if t.is_successful():
                by_workload[t.workload.uuid][t.solution] = t.evaluation.performance.latency_ms
        workloads = [w.workload.uuid for w in trace_set.workloads.get(def_name, [])]
        names = sorted(
            {
                n
                for row in by_workload.values()
                for n in row
                if backend_of.get(n) != FLASHINFER_BACKEND
            }
        )
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            ratios = []
            for wl in workloads:
                row = by_workload.get(wl, {})
                base = next(
                    (ms for n, ms in row.items() if backend_of.get(n) == FLASHINFER_BACKEND), None
                )
                ratios.append(base / row[name] if base and name in row else 0.0)
            ax.bar([x + i * width for x in range(len(workloads))], ratios, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))])
        ax.set_xticklabels(workloads, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("FlashInfer latency / solution latency")
        ax.set_title(def_name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def with_run(trace_set: TraceSet, folder: Path) -> TraceSet:
    """The same TraceSet with each definition that has a .jsonl under `folder` (a copy of some
    run's traces/) taking that run's traces in place of the committed ones. ValueError if the
    folder has none, a trace twice (two runs: which one counts would be arbitrary) or traces of
    a definition the bundle does not have."""
    run, seen = {}, set()
    for path in sorted(Path(folder).rglob("*.jsonl")):
        for t in load_jsonl_file(Trace, path):
            key = (t.definition, t.workload.uuid, t.solution)
            if key in seen:
                raise ValueError(f"{key} twice under {folder}")
            seen.add(key)
            run.setdefault(t.definition, []).append(t)
    if not run:
        raise ValueError(f"no .jsonl traces under {folder}")
    unknown = set(run) - set(trace_set.definitions)
    if unknown:
        raise ValueError(f"traces for unknown definitions {sorted(unknown)} under {folder}")
    trace_set.traces.update(run)
    return trace_set


def render(trace_set: TraceSet, source: str = "traces/", command: str = "python scripts/report.py",
           image: str = "report_ratios.png", title: str = "the H100", run: str = "",
           kernel_time: Path | None = KERNEL_TIME_MD,
           resources: Path | None = RESOURCES_MD) -> str:  # fmt: skip
    """report.md's text. Another run's (report.py --traces): the `source` folder and the
    `command` that wrote it, its `image`, the device in the `title`, a paragraph on the `run`,
    its own `kernel_time` table (long_shapes.py's, from the same device) if it has one, and
    no `resources` table (the CUDA kernels' ptxas resources belong to the committed run)."""
    backend_of = {s.name: s.backend for s in SOLUTIONS}
    lines = [
        f"# GQA prefill attention on {title}: results",
        "",
        f"Generated by `{command}` from `{source}` (do not edit by hand).",
        *([run, ""] if run else []),
        "Each cell: mean latency per call as flashinfer-bench times it (host overhead included, "
        "L2 flushed, inputs cloned before each call), TF/s from the masked FLOP count, and the "
        "ratio to FlashInfer = FlashInfer latency / solution latency from the same run.",
        "",
        f"![ratio to FlashInfer per workload]({image})",
        "",
    ]
    environments = set()
    for def_name in sorted(
        trace_set.traces, key=lambda name: name != "mini_flash_attention_prefill"
    ):
        traces = trace_set.traces[def_name]
        by_workload = defaultdict(dict)
        for t in traces:
            by_workload[t.workload.uuid][t.solution] = t
            environments.add(
                (
                    t.evaluation.environment.hardware,
                    tuple(sorted(t.evaluation.environment.libs.items())),
                )
            )
        solutions = sorted(
            {t.solution for t in traces}, key=lambda n: (backend_of.get(n) != FLASHINFER_BACKEND, n)
        )
        ratios = defaultdict(list)
        lines += [f"## {def_name}", "", "| workload | " + " | ".join(solutions) + " |"]
        lines.append("|---" * (len(solutions) + 1) + "|")
        for wl in trace_set.workloads.get(def_name, []):
            row = by_workload.get(wl.workload.uuid, {})
            flops = workload_flops(wl.workload, PAGED_DEFINITIONS.get(def_name, 0))
            baseline = next(
                (t for n, t in row.items() if backend_of.get(n) == FLASHINFER_BACKEND), None
            )
            base_ms = (
                baseline.evaluation.performance.latency_ms
                if baseline and baseline.is_successful()
                else None
            )
            cells = []
            for name in solutions:
                t = row.get(name)
                if t is None:
                    cells.append("—")
                elif not t.is_successful():
                    cells.append(t.evaluation.status.value)
                else:
                    ms = t.evaluation.performance.latency_ms
                    ratio = base_ms / ms if base_ms else None
                    if ratio is not None:
                        ratios[name].append(ratio)
                    cells.append(_cell(ms, flops, None if name == baseline.solution else ratio))
            lines.append(f"| {wl.workload.uuid} | " + " | ".join(cells) + " |")
        geo = [
            f"{math.exp(sum(map(math.log, ratios[n])) / len(ratios[n])):.2f}×" if ratios[n] else "—"
            for n in solutions
        ]
        lines += ["| geometric mean ratio | " + " | ".join(geo) + " |", ""]
    lines += apply_choices(trace_set)
    if kernel_time is not None and kernel_time.exists():
        lines += [kernel_time.read_text()]
    if resources is not None and resources.exists():
        lines += [resources.read_text()]
    lines += ["## How these numbers were produced", ""]
    for hardware, libs in sorted(environments):
        lines.append(f"- {hardware}; " + ", ".join(f"{k} {v}" for k, v in libs))
    lines += [
        "- Command: `bash scripts/gpu_bench.sh` (= `flashinfer-bench run --local .` with "
        "`TVM_FFI_CUDA_ARCH_LIST=9.0a`, default 10 warm-up runs, 50 iterations, 3 trials), then "
        f"`{command}`.",
        "- The card warms up during a run (clocks drift); flashinfer-bench times all solutions of "
        "a workload back to back, so ratios within a row are fair; absolute figures are not the "
        "card's peak.",
        "",
    ]
    return "\n".join(lines)


def report(traces: Path | None = None, out: str = "report.md", title: str = "the H100") -> tuple:
    """(text, trace set, image name) of scripts/report.py's report: of the committed traces, or
    of another run's under `traces` (a copy of its traces/; RUN.md beside that folder, where
    the run came from, heads the report, and a kernel_time.md there, long_shapes.py's table
    from the same device, replaces the committed one)."""
    trace_set = TraceSet.from_path(str(REPO_ROOT))
    source, command, run = "traces/", "python scripts/report.py", ""
    kernel_time, resources = KERNEL_TIME_MD, RESOURCES_MD
    if traces is not None:
        with_run(trace_set, REPO_ROOT / traces)
        source = f"{Path(traces).as_posix().rstrip('/')}/"
        command += f' --traces {Path(traces).as_posix()} --out {out} --title "{title}"'
        run_md = REPO_ROOT / Path(traces).parent / "RUN.md"
        run = run_md.read_text().strip() if run_md.exists() else ""
        kernel_time, resources = REPO_ROOT / Path(traces).parent / "kernel_time.md", None
    image = Path(out).stem + "_ratios.png"
    text = render(trace_set, source, command, image, title, run, kernel_time, resources)
    return text, trace_set, image
