"""Every JSON file loads through flashinfer-bench's own models; workloads and blobs are coherent;
generated files are in sync with their sources."""

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch
from flashinfer_bench import TraceSet
from flashinfer_bench.compile.builder import BuildError
from flashinfer_bench.data import SupportedLanguages
from safetensors.torch import load_file

from prefill_bundle import (
    MINI,
    PAGE_SIZES,
    PAGED_FP8,
    PAGED_PS1,
    PAGED_PS64,
    RAGGED,
    REPO_ROOT,
    SWA,
    gpu_timing,
)
from prefill_bundle.dataset import out_of_sync
from prefill_bundle.definitions import FLASHINFER_TRACE_DIR
from prefill_bundle.packing import SOLUTIONS
from prefill_bundle.testing import (
    build_solution,
    entry_module,
    load_script,
    load_solution,
    normwise_error,
)
from prefill_bundle.workloads import MINI_SHAPES, PAGED_BATCHES, RAGGED_BATCHES, SWA_BATCHES


def load():
    return TraceSet.from_path(str(REPO_ROOT))


def test_trace_set_loads_definitions_solutions_workloads():
    ts = load()
    assert set(ts.definitions) == {MINI, RAGGED, SWA, PAGED_FP8, *PAGE_SIZES}
    assert {s.name for sols in ts.solutions.values() for s in sols} == {s.name for s in SOLUTIONS}
    for name, sols in ts.solutions.items():
        assert name in ts.definitions
        for sol in sols:
            assert sol.get_entry_source() is not None
    assert len(ts.workloads[MINI]) == len(MINI_SHAPES) == 7
    assert len(ts.workloads[RAGGED]) == len(RAGGED_BATCHES)
    assert len(ts.workloads[SWA]) == len(SWA_BATCHES)
    for name in (*PAGE_SIZES, PAGED_FP8):
        assert len(ts.workloads[name]) == len(PAGED_BATCHES)


def test_paged_definitions_are_flashinfer_traces_but_for_the_reference():
    for name in PAGE_SIZES:
        ours = json.loads((REPO_ROOT / "definitions" / "gqa_paged" / f"{name}.json").read_text())
        ours.pop("reference")
        assert ours == json.loads((FLASHINFER_TRACE_DIR / f"{name}.json").read_text())


def test_every_trace_refers_to_known_definition_and_solution():
    ts = load()
    names = {s.name for sols in ts.solutions.values() for s in sols}
    for def_name, traces in ts.traces.items():
        assert def_name in ts.definitions
        for trace in traces:
            assert trace.solution in names, f"trace of unknown solution {trace.solution}"


def test_workload_axes_match_definition():
    ts = load()
    for name, traces in ts.workloads.items():
        definition = ts.definitions[name]
        for trace in traces:
            assert set(trace.workload.axes) == set(definition.var_axes)
            assert set(trace.workload.inputs) == set(definition.inputs)


def test_sliding_window_definition_is_the_ragged_one_plus_window_left():
    ts = load()
    ragged, swa = ts.definitions[RAGGED], ts.definitions[SWA]
    assert list(swa.inputs) == ["q", "k", "v", "qo_indptr", "kv_indptr", "window_left", "sm_scale"]
    assert (
        swa.inputs["window_left"].dtype.value == "int32" and swa.inputs["window_left"].shape is None
    )
    assert {k: v for k, v in swa.inputs.items() if k != "window_left"} == dict(ragged.inputs)
    assert swa.outputs == ragged.outputs and swa.axes == ragged.axes
    windows = {t.workload.inputs["window_left"].value for t in ts.workloads[SWA]}
    assert {4096, 1024, 128} <= windows  # Mistral, Gemma 3 local, gpt-oss
    assert any(w > 8192 - 1 for w in windows)  # a window longer than its sequences


def test_ragged_blobs_agree_with_axes_and_constraints():
    ts = load()
    for trace in ts.workloads[RAGGED] + ts.workloads[SWA]:
        axes, inputs = trace.workload.axes, trace.workload.inputs
        tensors = {
            name: load_file(str(REPO_ROOT / spec.path))[spec.tensor_key]
            for name, spec in inputs.items()
            if spec.type == "safetensors"
        }
        qo, kv = tensors["qo_indptr"], tensors["kv_indptr"]
        for indptr, total in ((qo, axes["total_q"]), (kv, axes["total_kv"])):
            assert indptr.dtype == torch.int32 and indptr.shape == (axes["len_indptr"],)
            assert indptr[0] == 0 and indptr[-1] == total
            assert torch.all(indptr.diff() >= 0)
        q_lens, kv_lens = qo.diff(), kv.diff()
        # flashinfer-bench judges any inf as wrong: every query row must see a key (causal).
        assert torch.all((q_lens == 0) | (kv_lens >= q_lens)), trace.workload.uuid


def test_paged_blobs_are_page_tables_of_the_axes():
    """indptr partitions, page ids in range, last pages in [1, page_size], every row sees a key,
    and the allocator's properties: shuffled pages, shared prefix pages, partly filled pages."""
    ts = load()
    for name, page_size in {**PAGE_SIZES, PAGED_FP8: 64}.items():
        partial_last_pages = 0
        for trace in ts.workloads[name]:
            axes, inputs = trace.workload.axes, trace.workload.inputs
            t = {
                key: load_file(str(REPO_ROOT / spec.path))[spec.tensor_key]
                for key, spec in inputs.items()
                if spec.type == "safetensors"
            }
            qo, kv, ids = t["qo_indptr"], t["kv_indptr"], t["kv_indices"]
            assert qo[0] == 0 and qo[-1] == axes["total_q"] and torch.all(qo.diff() >= 0)
            assert kv[0] == 0 and kv[-1] == axes["num_kv_indices"] == len(ids)
            assert torch.all(kv.diff() >= 1)  # every workload sequence has pages
            assert ids.min() >= 0 and ids.max() < axes["num_pages"]
            last = t.get("kv_last_page_len", torch.ones(len(qo) - 1, dtype=torch.int32))
            assert torch.all((last >= 1) & (last <= page_size))
            partial_last_pages += int((last < page_size).sum())
            kv_lens = (kv.diff() - 1) * page_size + last
            assert torch.all(kv_lens >= qo.diff()), trace.workload.uuid  # no keyless row
            assert not torch.equal(ids, ids.sort().values)  # shuffled
        assert partial_last_pages > 0 or page_size == 1
    for trace in ts.workloads[PAGED_FP8]:  # scales that are not 1
        scales = [trace.workload.inputs[k].value for k in ("k_scale", "v_scale")]
        assert all(s > 0 for s in scales) and 1.0 not in scales
    shared = ts.workloads["gqa_paged_prefill_causal_h32_kv8_d128_ps64"][0]
    assert shared.workload.uuid == "prefix_cache_hits_8x256_ps64"
    spec = shared.workload.inputs["kv_indices"]
    ids = load_file(str(REPO_ROOT / spec.path))["kv_indices"]
    assert len(set(ids.tolist())) < len(ids)  # the system prompt's pages are shared


def test_workload_uuids_are_unique():
    ts = load()
    uuids = [t.workload.uuid for traces in ts.workloads.values() for t in traces]
    assert len(uuids) == len(set(uuids))


def test_generated_files_are_in_sync():
    assert out_of_sync() == [], "run: python scripts/generate.py"


def test_sync_check_catches_an_edited_source():
    source = REPO_ROOT / "solutions" / "gqa_ragged" / SOLUTIONS[0].backend / SOLUTIONS[0].sources[0]
    original = source.read_bytes()
    try:
        source.write_bytes(original + b"\n# edited after packing\n")
        assert SOLUTIONS[0].json_path in out_of_sync()
    finally:
        source.write_bytes(original)
    assert out_of_sync() == []


def test_sync_check_catches_an_edited_reference():
    reference = REPO_ROOT / "prefill_bundle" / "references" / f"{MINI}.py"
    original = reference.read_bytes()
    try:
        reference.write_bytes(original.replace(b"QUERY_CHUNK = 4096", b"QUERY_CHUNK = 2048"))
        assert f"definitions/gqa_ragged/{MINI}.json" in out_of_sync()
    finally:
        reference.write_bytes(original)


def test_report_is_generated_from_the_committed_traces():
    from prefill_bundle.report import render

    assert (REPO_ROOT / "report.md").read_text() == render(load()), "run: python scripts/report.py"


H200_SNAPSHOT = "blob/h200/traces"


def test_h200_report_is_generated_from_its_snapshot():
    """report_h200.md: the H200 run's traces (every definition, each through flashinfer-bench's
    models), rendered with its RUN.md and its own kernel-time table; its traces PASSED and name
    the H200, the committed traces/ the H100 (the issues' bars are judged on those)."""
    from prefill_bundle.report import report

    text, trace_set, _ = report(Path(H200_SNAPSHOT), "report_h200.md", "an NVIDIA H200")
    assert (REPO_ROOT / "report_h200.md").read_text() == text, (
        f'run: python scripts/report.py --traces {H200_SNAPSHOT} --out report_h200.md '
        '--title "an NVIDIA H200"'
    )
    assert set(trace_set.traces) == set(trace_set.definitions)
    snapshot = [t for ts in trace_set.traces.values() for t in ts]
    assert all(t.is_successful() for t in snapshot)
    assert {t.evaluation.environment.hardware for t in snapshot} == {"NVIDIA H200"}
    committed = [t for ts in load().traces.values() for t in ts]
    assert {t.evaluation.environment.hardware for t in committed} == {"NVIDIA H100 80GB HBM3"}
    kernel_time = text.split("## Kernel time on the long shapes", 1)[1].split("\n## ", 1)[0]
    assert "- NVIDIA H200, " in kernel_time and "H100" not in kernel_time


def test_long_shapes_table_counts_masked_flops_and_ratios():
    """scripts/long_shapes.py's table (issue 19) from given medians and ratios: TF/s over the
    visible pairs (causal: s (s + 1) / 2 a head), the ratios as given."""
    long_shapes = load_script("long_shapes")
    assert long_shapes.flops(1, 4, False) == 4.0 * 32 * 128 * 16
    assert long_shapes.flops(2, 4, True) == 4.0 * 32 * 128 * 2 * 10
    times = {name: 2.0 for name in long_shapes.SOLUTIONS}
    times["cuda_mini"] = 1.0
    work = 8e12  # 8 TFLOP: 4000 TF/s at 2 ms, 8000 at 1 ms
    ratios = {name: 2.0 / ms for name, ms in times.items()}
    text = long_shapes.markdown([("1x16384 non-causal", work, times, ratios)], "s", "e", "H100")
    row = next(line for line in text.splitlines() if line.startswith("| 1x16384"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert cells[long_shapes.SOLUTIONS.index("flashinfer_mini")] == "2000 µs · 4000 TF/s"
    assert cells[long_shapes.SOLUTIONS.index("cuda_mini")] == "1000 µs · 8000 TF/s · **2.00×**"
    assert cells[long_shapes.SOLUTIONS.index("triton_mini")] == "2000 µs · 4000 TF/s · **1.00×**"


def test_every_python_built_solution_passes_flashinfer_bench_build():
    """flashinfer-bench's builder refuses an entry whose parameter count is not the definition's
    (inputs, plus outputs in destination-passing style) and the bench then records
    COMPILE_ERROR on the GPU: build every Python, Triton and TileLang solution here (an import
    and the signature check; CUDA solutions build in tests/test_cuda_build.py)."""
    failures = {}
    for spec in SOLUTIONS:
        if load_solution(spec.name).spec.language == SupportedLanguages.CUDA:
            continue
        try:
            build_solution(spec.name)
        except BuildError as error:
            failures[spec.name] = str(error)
    assert failures == {}


def test_prebuild_warms_the_definitions_dtype_unless_asked_for_both():
    """scripts/prebuild_gpu.py warms what the benchmark runs: the definition's query dtype."""
    script = load_script("prebuild_gpu")
    assert script.warm_dtypes("tilelang_mini", False) == (torch.float16,)
    assert script.warm_dtypes("flashinfer_swa", False) == (torch.bfloat16,)
    assert script.warm_dtypes("cuda_fp8kv", False) == (torch.bfloat16,)
    assert script.warm_dtypes("triton_ragged", True) == (torch.bfloat16, torch.float16)


def test_prebuild_takes_a_variant_json_under_any_name(tmp_path):
    """A variant's Solution JSON (tune_cuda.py --json names it cuda_mini_<variant>.json) is
    warmed on its definition's cases, whatever the file is called."""
    from prefill_bundle import MINI, PAGED_PS1
    from prefill_bundle.testing import PaddedCase, PagedCase, load_solution

    script = load_script("prebuild_gpu")
    path = tmp_path / "cuda_mini_some_variant.json"
    path.write_text(load_solution("cuda_mini").model_dump_json())
    assert script.definition_of(str(path)) == MINI
    assert script.warm_dtypes(str(path), False) == (torch.float16,)
    cases = script.warm_cases(MINI, (torch.float16,))
    assert {type(c) for c in cases} == {PaddedCase} and {c.causal for c in cases} == {True, False}
    paged = script.warm_cases(script.definition_of("tilelang_paged_ps1"), (torch.bfloat16,))
    assert {(type(c), c.page_size) for c in paged} == {(PagedCase, 1)}
    assert script.definition_of("tilelang_paged_ps1") == PAGED_PS1


def test_stall_by_role_splits_samples_at_setmaxnreg(tmp_path):
    """scripts/stall_by_role.py on a small SASS page: the producer's and consumers' samples
    are counted apart (by the registers each USETMAXREG sets, a Gluon consumer's deallocation
    included), and a store with 8x its ideal wavefronts is listed as conflicted."""
    columns = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
               "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "stall_long_sb",
               "stall_barrier", "stall_long_sb (Not Issued)"]  # fmt: skip
    rows = [
        ["0x00", "S2R R0, SR_TID.X", "2", "1,000", "0", "0", "0", "0", "0"],
        ["0x10", "USETMAXREG.DEALLOC.CTAPOOL 0x18", "0", "1,000", "0", "0", "0", "0", "0"],
        ["0x20", "@!P0 BRA 0x40", "30", "7,000", "0", "0", "30", "0", "0"],
        ["0x30", "USETMAXREG.TRYALLOC.CTAPOOL P0, 0xf0", "0", "2,000", "0", "0", "0", "0", "0"],
        ["0x40", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "215,000", "0", "0", "0", "60", "0"],
        ["0x50", "STSM.16.M88.4 [R0], R8", "8", "32,000", "800", "100", "0", "8", "0"],
        # Gluon: a partition's first split (120, the role before kept), then a consumer's
        # deallocation from 256 to 240
        ["0x60", "USETMAXREG.DEALLOC.CTAPOOL 0x78 ;", "0", "1,000", "0", "0", "0", "0", "0"],
        ["0x70", "BAR.SYNC.DEFER_BLOCKING 0x1 ;", "4", "1,000", "0", "0", "0", "4", "0"],
        ["0x80", "USETMAXREG.DEALLOC.CTAPOOL 0xf0 ;", "0", "1,000", "0", "0", "0", "0", "0"],
        ["0x90", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "6", "215,000", "0", "0", "0", "6", "0"],
    ]

    def sass_page(name: str):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Kernel Name", "main_kernel"])
            writer.writerow(columns)
            writer.writerows(rows)
        return path

    path = sass_page("sass.csv")
    script = load_script("stall_by_role")
    by_role = {}
    for r in script.read_rows(path):
        by_role[r["role"]] = by_role.get(r["role"], 0.0) + r["samples"]
    assert by_role == {"prologue": 2, "producer": 30, "consumer": 78}
    summary = script.summarize(str(path))
    assert "producer   27.3% of samples" in summary
    assert "long_sb 100%" in summary
    assert " 8.0x cons x   32.0K STSM" in summary
    assert "WARPGROUP" not in summary.split("bank conflicts")[1]  # conflict-free lines omitted
    # --compare: the same page against one whose consumers wait on barrier twice as long; the
    # columns are the files', the reason that differs most listed first under its role.
    rows[4][2], rows[4][7] = "120", "120"
    table = script.compare([str(path), str(sass_page("other.csv"))]).splitlines()
    assert table[0].split() == ["sass", "other"]
    consumer = table.index("consumer")
    assert table[consumer + 1].split() == ["(samples)", "78.0", "138.0"]
    assert table[consumer + 3].split() == ["barrier", "78.0", "138.0"]
    assert table[table.index("producer") + 3].split() == ["long_sb", "30.0", "30.0"]


def test_pairing_rounds_cancel_a_clock_drift():
    """gpu_timing.alternating_ms, which the pairing scripts (paged_vs_ragged, window_vs_causal,
    fp8_vs_bf16) time with: two equal kernels on a card that slows by 1% a call (the drift seen
    within one call) pair at 1.0, where ragged-first rounds gave 0.99 every round."""
    calls = []

    def drifting_ms(fn, args):
        calls.append(fn)
        return 1.0 + 0.01 * len(calls)

    pair = {"ragged": ("r", ()), "paged": ("p", ())}
    ms = gpu_timing.alternating_ms(pair, timer=drifting_ms)
    ratios = gpu_timing.round_ratios(ms, "ragged", "paged")
    assert len(ratios) == gpu_timing.PAIRED_ROUNDS and calls[:4] == ["r", "p", "p", "r"]
    assert statistics.median(ratios) == pytest.approx(1.0, abs=1e-3)
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=1e-3)
    # three calls alternate the same way
    ms = gpu_timing.alternating_ms({n: (n, ()) for n in "abc"}, 2, timer=drifting_ms)
    assert [len(v) for v in ms.values()] == [2, 2, 2]
    assert calls[-6:] == ["a", "b", "c", "c", "b", "a"]


def test_normwise_error():
    """testing.normwise_error, the scripts' accuracy figure: ||a - b|| / ||b|| in fp32."""
    expected = torch.tensor([3.0, 0.0], dtype=torch.bfloat16)
    assert normwise_error(torch.tensor([3.0, 4.0]), expected) == pytest.approx(4 / 3)
    assert normwise_error(expected, expected) == 0.0


def test_tilelang_cache_holds_every_program_the_workloads_launch():
    """scripts/tilelang_cache.py lists the TileLang programs by hand: each committed workload's
    program, as the entry's own rules pick it on an H100 (long_keys_launch for contiguous K/V,
    short_keys_launch for padded non-causal batches, paged_plan and gathers_pages for the paged
    definitions), must be among them."""
    cache_script = load_script("tilelang_cache")
    programs = set(cache_script.programs())
    entry = entry_module("tilelang_paged_ps64")
    sms = cache_script.H100_SMS
    traces = load().workloads
    Program = cache_script.Program
    picked = {Program("bfloat16", window=True)}
    for trace in traces[MINI]:
        axes, causal = trace.workload.axes, trace.workload.inputs["causal"].value
        long_keys = entry.long_keys_launch(axes["seq_kv"], 1)
        short_keys = entry.short_keys_launch(axes["seq_kv"], causal)
        picked.add(Program("float16", causal, long_keys=long_keys, short_keys=short_keys))
    for trace in traces[RAGGED] + traces[SWA]:
        axes, inputs = trace.workload.axes, trace.workload.inputs
        if "window_left" in inputs and 0 <= inputs["window_left"].value < axes["total_kv"]:
            continue  # the window program; a window past every key runs the ragged one
        long_keys = entry.long_keys_launch(axes["total_kv"], axes["len_indptr"] - 1)
        picked.add(Program("bfloat16", long_keys=long_keys))
    for name, page_size in [*PAGE_SIZES.items(), (PAGED_FP8, 64)]:
        fp8 = name == PAGED_FP8
        for trace in traces[name]:
            axes = trace.workload.axes
            batch = axes["len_indptr"] - 1
            pack, shares = entry.paged_plan(
                "bfloat16", page_size, fp8, axes["total_q"], batch,
                axes["num_kv_indices"] * page_size, sms,
            )  # fmt: skip
            if page_size == 1 and entry.gathers_pages(
                axes["total_q"], batch, axes["num_kv_indices"], 2
            ):  # the pages gathered, then the ragged program
                picked.add(("gather", "bfloat16"))
                long_keys = entry.long_keys_launch(axes["num_kv_indices"], batch)
                picked.add(Program("bfloat16", long_keys=long_keys))
                continue
            picked.add(Program("bfloat16", True, page_size, False, fp8, shares > 1, pack))
    attention = [key for key in picked if isinstance(key, Program)]
    assert any(key.pack for key in attention), "some workload is packed"
    assert any(key.short_keys for key in attention), "some batch has short keys"
    assert ("gather", "bfloat16") in picked, "some page size 1 workload gathers its pages first"
    long_programs = {key[:2] for key in attention if key.long_keys}
    assert long_programs == {("float16", True), ("float16", False), ("bfloat16", True)}
    assert picked <= programs, picked - programs


def test_tilelang_cache_splits_the_programs_by_definition(tmp_path):
    """tilelang_cache.py --solutions: a solution's definition picks its programs; every program
    belongs to some definition, the FP8 ones to the FP8 definition only, and a variant's module
    is its own (its knobs, not the shipped pack_config)."""
    cache_script = load_script("tilelang_cache")
    programs = cache_script.programs()
    by_definition = {
        name: cache_script.definition_programs(name, programs)
        for name in (MINI, RAGGED, SWA, PAGED_FP8, *PAGE_SIZES)
    }
    assert set().union(*by_definition.values()) == set(programs)
    assert all(job[4] for job in by_definition[PAGED_FP8] if job[0] != "merge")  # decode's too
    for name, page_size in PAGE_SIZES.items():
        paged = {
            job.page_size for job in by_definition[name] if isinstance(job, cache_script.Program)
        }
        # page size 1 gathers prefill-like batches' pages first, then runs the ragged program
        assert paged == ({page_size, None} if page_size == 1 else {page_size})
    assert ("gather", "bfloat16") in by_definition[PAGED_PS1]
    assert ("gather", "bfloat16") not in by_definition[PAGED_PS64]
    assert ("merge", "bfloat16") in by_definition[PAGED_FP8]
    assert ("merge", "bfloat16") not in by_definition[RAGGED]
    variant_script = load_script("tilelang_variant")
    variant = variant_script.variant("tilelang_fp8kv", {"block_N": 64, "num_stages": 3}, pack=True)
    path = tmp_path / "variant.json"
    path.write_text(variant.model_dump_json())
    kernels = cache_script.solution_kernels(str(path))
    assert kernels.pack_config()["block_N"] == 64 and kernels.pack_config()["num_stages"] == 3
    assert cache_script.solution_kernels(None).pack_config()["block_N"] == 128
