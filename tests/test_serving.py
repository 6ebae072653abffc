"""Apply over the bundle, on CPU with synthetic traces: real dispatch to the traced winner,
buckets for unseen shapes, causal in the key, failed builds and incorrect traces left out."""

import json
import shutil
from datetime import datetime

import pytest
import torch
from flashinfer_bench import TraceSet
from flashinfer_bench.apply import ApplyConfig, ApplyRuntime, apply, disable_apply
from flashinfer_bench.compile import BuilderRegistry

from prefill_bundle import MINI, OP_TYPE, PAGED_PS1, PAGED_PS64, RAGGED, REPO_ROOT, SWA
from prefill_bundle.serving import (
    UNSERVABLE_KEY,
    BucketedPrefillKeyBuilder,
    dispatch_table,
    enable_bundle_apply,
    pow2_bucket,
)
from prefill_bundle.testing import PagedCase, RaggedCase, make_inputs
from prefill_bundle.workloads import (
    PAGED_BATCHES,
    SWA_BATCHES,
    PaddedShape,
    mini_trace,
    paged_trace,
    ragged_trace,
)

MARKERS = {"solution_a": 1.0, "solution_b": 2.0, "broken": 3.0, "incorrect": 4.0}
FALLBACK_MARKER = -1.0


def solution_json(name):
    # Like the bundle's solutions: float16 only, refused with a ValueError before any work.
    body = (
        "def run(q, k, v, causal, out):\n"
        "    if str(q.dtype) != 'torch.float16':\n"
        "        raise ValueError(f'q: expected float16, got {q.dtype}')\n"
        f"    out.fill_({MARKERS[name]})\n"
    )
    if name == "broken":
        body = "raise ImportError('this solution does not build')\n" + body
    return {
        "name": name,
        "definition": MINI,
        "author": "test",
        "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "main.py::run"},
        "sources": [{"path": "main.py", "content": body}],
    }


def trace_line(shape, solution, latency_ms, status="PASSED", abs_error=2e-3):
    trace = mini_trace(shape).model_dump(mode="json", exclude_unset=True)
    evaluation = {
        "status": status,
        "environment": {"hardware": "test"},
        "timestamp": datetime(2026, 11, 23).isoformat(),
        # Elementwise relative error in the hundreds, as every correct fp16 kernel shows.
        "correctness": {"max_relative_error": 414.0, "max_absolute_error": abs_error},
    }
    if status == "PASSED":
        evaluation["performance"] = {"latency_ms": latency_ms, "reference_latency_ms": 10.0,
                                     "speedup_factor": 10.0 / latency_ms}  # fmt: skip
    return json.dumps({**trace, "solution": solution, "evaluation": evaluation})


SMALL = PaddedShape("small", 1, 128, 128, True)
MEDIUM = PaddedShape("medium", 4, 512, 512, True)
LARGE = PaddedShape("large", 8, 2048, 2048, True)


@pytest.fixture
def trace_root(tmp_path):
    shutil.copytree(REPO_ROOT / "definitions", tmp_path / "definitions")
    for name in MARKERS:
        path = tmp_path / "solutions" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(solution_json(name)))
    lines = [
        trace_line(SMALL, "solution_a", 1.0),
        trace_line(SMALL, "solution_b", 2.0),
        trace_line(SMALL, "broken", 0.5),  # fastest, but its build fails
        trace_line(SMALL, "incorrect", 0.1, status="INCORRECT_NUMERICAL"),
        trace_line(MEDIUM, "solution_a", 3.0),
        trace_line(MEDIUM, "solution_b", 1.0),
        trace_line(MEDIUM, "incorrect", 0.2, abs_error=0.5),  # PASSED under a loose --atol
        trace_line(LARGE, "solution_a", 3.0),
        trace_line(LARGE, "solution_b", 1.0),
    ]
    traces = tmp_path / "traces" / OP_TYPE / f"{MINI}.jsonl"
    traces.parent.mkdir(parents=True)
    traces.write_text("\n".join(lines) + "\n")
    monkey_cache = tmp_path / "cache"
    return tmp_path, monkey_cache


@pytest.fixture
def runtime(trace_root, monkeypatch):
    root, cache = trace_root
    monkeypatch.setenv("FIB_CACHE_PATH", str(cache))
    runtime = enable_bundle_apply(root=root)
    yield runtime
    disable_apply()


@apply(MINI)
def attention(q, k, v, causal, out):
    out.fill_(FALLBACK_MARKER)


def served_by(batch, seq_q, seq_kv, causal=True, dtype=torch.float16):
    q = torch.randn(batch, seq_q, 32, 128, dtype=dtype)
    k = torch.randn(batch, seq_kv, 8, 128, dtype=dtype)
    out = torch.empty_like(q)
    attention(q, k, torch.randn_like(k), causal, out)
    assert torch.all(out == out.flatten()[0])
    marker = out.flatten()[0].item()
    return {v: n for n, v in MARKERS.items()}.get(marker, "fallback")


def test_traced_shape_goes_to_its_fastest_correct_solution(runtime):
    assert served_by(1, 128, 128) == "solution_a"  # "broken" was faster but does not build
    assert served_by(4, 512, 512) == "solution_b"  # "incorrect" was faster but is not admitted


def test_unseen_shape_goes_to_its_bucket_winner(runtime):
    assert served_by(1, 100, 120) == "solution_a"  # bucket of (1, 128, 128)
    assert served_by(3, 300, 400) == "solution_b"  # bucket of (4, 512, 512)


def test_bucket_without_traces_goes_to_the_definition_best(runtime):
    assert served_by(2, 9000, 9000) == "solution_b"  # solution_b wins 2 buckets of 3


def test_causal_is_part_of_the_key(runtime):
    assert served_by(1, 128, 128, causal=True) == "solution_a"
    assert served_by(1, 128, 128, causal=False) == "solution_b"  # no non-causal trace: def best


def test_dispatch_table_lists_the_buckets(runtime):
    table = dispatch_table(runtime)[MINI]
    assert sorted(table.values()) == ["solution_a", "solution_b", "solution_b"]


def test_restricting_solutions_switches_backend(trace_root, monkeypatch):
    root, cache = trace_root
    monkeypatch.setenv("FIB_CACHE_PATH", str(cache))
    enable_bundle_apply(["solution_b"], root=root)
    try:
        assert served_by(1, 128, 128) == "solution_b"
    finally:
        disable_apply()


def test_without_apply_the_fallback_runs():
    assert ApplyRuntime.get_instance() is None
    assert served_by(1, 16, 16) == "fallback"


def test_stock_config_admits_none_of_these_traces(trace_root, monkeypatch):
    root, cache = trace_root
    monkeypatch.setenv("FIB_CACHE_PATH", str(cache))
    trace_set = TraceSet.from_path(str(root))
    stock = ApplyConfig()
    assert trace_set.filter_traces(MINI, stock.max_atol, stock.max_rtol) == []


def test_key_buckets():
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 128, 129, 2048)] == [0, 1, 2, 4, 128, 256, 2048]
    definition = TraceSet.from_path(str(REPO_ROOT)).definitions[MINI]
    builder = BucketedPrefillKeyBuilder(definition)
    q = torch.empty(3, 300, 32, 128)
    k = torch.empty(3, 400, 8, 128)
    from_args = builder.build_from_args((q, k, k, True))
    from_workload = builder.build_from_workload(
        mini_trace(PaddedShape("x", 4, 512, 512, True)).workload
    )
    assert from_args == from_workload
    assert builder.build_from_args((q, k, k, False)) != from_args


@pytest.mark.parametrize("name, page_size", [(PAGED_PS1, 1), (PAGED_PS64, 64)])
def test_paged_key_counts_key_tokens_as_pages_times_page_size(name, page_size):
    definition = TraceSet.from_path(str(REPO_ROOT)).definitions[name]
    builder = BucketedPrefillKeyBuilder(definition)
    batch = PAGED_BATCHES[0]  # 8 sequences of 256 new tokens over about 5K cached
    case = PagedCase(batch.q_lens, batch.kv_lens, page_size, shared_prefix=batch.shared_prefix)
    inputs = make_inputs(case, "cpu")
    from_args = builder.build_from_args(inputs)
    assert from_args == builder.build_from_workload(paged_trace(batch, name).workload)
    pages = inputs[5].shape[0]
    assert dict(from_args.axes) == {"seqs": 8, "q": 2048, "kv": pow2_bucket(pages * page_size)}


def test_window_is_part_of_the_key_by_its_power_of_two():
    """An unseen window keys to its bucket (1000 with 1024), so it goes to that bucket's winner;
    no window (-1) and window 0 are buckets of their own."""
    definition = TraceSet.from_path(str(REPO_ROOT)).definitions[SWA]
    builder = BucketedPrefillKeyBuilder(definition)
    batch = SWA_BATCHES[1]  # 8K prompt, window 1024
    assert batch.window_left == 1024
    inputs = make_inputs(RaggedCase(batch.q_lens, batch.kv_lens, window_left=1000), "meta")
    from_args = builder.build_from_args(inputs)
    assert from_args == builder.build_from_workload(ragged_trace(batch).workload)
    assert dict(from_args.feats) == {"causal": True, "window": 1024}

    def key(window):
        return builder.build_from_args(inputs[:5] + [window] + inputs[6:])

    assert key(1024) == from_args != key(1025)
    assert len({key(-1), key(0), key(1), key(1024)}) == 4
    assert key("1024") == UNSERVABLE_KEY  # the solution will say why


def test_baselines_do_not_serve_unless_named(trace_root, monkeypatch):
    root, cache = trace_root
    monkeypatch.setenv("FIB_CACHE_PATH", str(cache))
    path = root / "solutions" / "solution_a.json"
    path.write_text(json.dumps({**solution_json("solution_a"), "author": "baseline"}))
    enable_bundle_apply(root=root)
    try:
        assert served_by(1, 128, 128) == "solution_b"
    finally:
        disable_apply()


def test_a_call_the_solution_refuses_goes_to_the_fallback(runtime, caplog):
    """bf16 on the float16 definition: the user's function served it before apply, so it still
    does; one warning names the reason, the first time only."""
    with caplog.at_level("WARNING", logger="prefill_bundle.serving"):
        assert served_by(1, 128, 128, dtype=torch.bfloat16) == "fallback"
        assert served_by(1, 100, 100, dtype=torch.bfloat16) == "fallback"
    warnings = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1 and "q: expected float16" in warnings[0], warnings
    assert served_by(1, 128, 128) == "solution_a"  # and the solution still serves the rest


def test_an_error_of_the_fallback_itself_is_raised_once(runtime):
    calls = []

    @apply(MINI)
    def failing(q, k, v, causal, out):
        calls.append(1)
        raise ValueError("the user's own error")

    q = torch.zeros(1, 4, 32, 128, dtype=torch.bfloat16)  # the solution refuses it
    k = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the user's own error"):
        failing(q, k, k, True, torch.empty_like(q))
    assert len(calls) == 1


def test_a_refused_call_without_a_fallback_raises_the_solutions_error(runtime):
    """apply called with no fallback: a routed call's refusal is the caller's error, as is."""
    q = torch.zeros(1, 128, 32, 128, dtype=torch.bfloat16)  # the solutions take float16 only
    k = torch.zeros(1, 128, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^q: expected float16"):
        apply(MINI, args=(q, k, k, True, torch.empty_like(q)))
    assert runtime.refusals == {}  # nothing fell back, so nothing was warned of


def test_unknown_solution_names_raise_at_enable_time(trace_root, monkeypatch):
    root, cache = trace_root
    monkeypatch.setenv("FIB_CACHE_PATH", str(cache))
    with pytest.raises(ValueError, match=r"^solutions: expected names among .*solution_a"):
        enable_bundle_apply(["solution_typo"], root=root)
    assert ApplyRuntime.get_instance() is None


def test_key_of_arguments_that_are_not_the_definitions():
    """An indptr given as a list keys to a miss; the chosen solution then refuses the call."""
    definition = TraceSet.from_path(str(REPO_ROOT)).definitions[RAGGED]
    builder = BucketedPrefillKeyBuilder(definition)
    q, k = torch.empty(5, 32, 128), torch.empty(7, 8, 128)
    assert builder.build_from_args((q, k, k, [0, 5], [0, 7], 0.1)) == UNSERVABLE_KEY


def test_a_shape_seen_before_takes_its_remembered_route(runtime, monkeypatch):
    """The second call of a raw key asks neither the table nor the registry (apply's per-call
    overhead, issue 19), and gets the same solution; served counts each call."""
    assert served_by(4, 300, 400) == "solution_b"
    lookups = []
    table_match = runtime._table.match_solution
    monkeypatch.setattr(runtime._table, "match_solution",
                        lambda *a: lookups.append(a) or table_match(*a))  # fmt: skip
    registry = BuilderRegistry.get_instance()
    build = registry.build
    monkeypatch.setattr(registry, "build", lambda *a: lookups.append(a) or build(*a))
    for _ in range(3):
        assert served_by(4, 300, 400) == "solution_b"
    assert lookups == []
    assert runtime.served["solution_b"] == 4
    assert served_by(1, 100, 120) == "solution_a"  # a new raw key: looked up once
    assert len(lookups) == 2


def test_keyword_arguments_route_as_positional_ones(runtime):
    """flashinfer-bench's FlashInfer adapters call apply with keyword arguments."""
    q = torch.randn(4, 300, 32, 128, dtype=torch.float16)
    k = torch.randn(4, 400, 8, 128, dtype=torch.float16)
    out = torch.empty_like(q)
    arguments = {"q": q, "k": k, "v": k, "causal": True, "out": out}
    apply(MINI, kwargs=arguments, fallback=lambda **_: out.fill_(FALLBACK_MARKER))
    assert torch.all(out == MARKERS["solution_b"])
    assert runtime.served["solution_b"] == 1


def test_a_value_returning_call_gets_the_definitions_outputs(runtime):
    """Called without out, apply allocates it (shaped off q, the definition's dtype) for the
    destination-passing solution and returns it, as flashinfer-bench's runnable would."""
    q = torch.randn(4, 300, 32, 128, dtype=torch.float16)
    k = torch.randn(4, 400, 8, 128, dtype=torch.float16)
    out = apply(MINI, args=(q, k, k, True), fallback=lambda *_: None)
    assert out.shape == q.shape and out.dtype == torch.float16
    assert torch.all(out == MARKERS["solution_b"])
