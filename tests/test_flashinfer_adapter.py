"""The bundle's drop-ins for FlashInfer's prefill wrappers: apply gets each definition's own
arguments (paged: kv_last_page_len for page size 64, none for 1, no page_size; the FP8 and
sliding-window definitions where the plan asks for them), and whatever no definition computes
runs FlashInfer's own kernel. On CPU, around FlashInfer's real plan/run signatures; on the GPU,
end to end against FlashInfer itself."""

import functools
import math

import pytest
import torch
from flashinfer.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)

from prefill_bundle import PAGED_FP8, PAGED_PS1, PAGED_PS64, RAGGED, SWA
from prefill_bundle import flashinfer_adapter as adapter_module
from prefill_bundle.flashinfer_adapter import PagedPrefillAdapter, RaggedPrefillAdapter
from prefill_bundle.testing import (
    PagedCase,
    RaggedCase,
    check_outputs,
    make_inputs,
    reference_outputs,
)

HAS_CUDA = torch.cuda.is_available()
# FlashInfer's own methods, taken before any test enables apply (which patches them).
METHODS = {
    wrapper: (wrapper.plan, wrapper.run)
    for wrapper in (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper)
}


@pytest.fixture(autouse=True)
def default_plan_deferral(monkeypatch):
    """Every test starts from the adapter's default (FlashInfer's plan() deferred), whatever
    the shell running pytest exports."""
    monkeypatch.delenv("PREFILL_BUNDLE_DEFER_PLAN", raising=False)


class Recorder:
    """FlashInfer's plan and run, reduced to their signatures: they record that they ran."""

    def __init__(self, wrapper=BatchPrefillWithPagedKVCacheWrapper):
        plan, run = METHODS[wrapper]
        self.calls = []
        self.plan = functools.wraps(plan)(lambda *a, **k: self.calls.append("plan"))
        self.run = functools.wraps(run)(lambda *a, **k: self.calls.append("run") or "orig")


def patched(monkeypatch, adapter_class=PagedPrefillAdapter):
    """(plan, run) wrapped by the adapter, the recorder, and the apply calls seen."""
    wrapper = getattr(__import__("flashinfer.prefill").prefill, adapter_class.wrapper)
    adapter, recorder, applied = adapter_class(), Recorder(wrapper), []
    specs = {spec.name.rpartition("_")[2]: spec for spec in adapter.targets()}

    def fake_apply(name, kwargs, fallback):
        applied.append((name, kwargs))
        q = kwargs["q"]
        return torch.full_like(q, 7.0), torch.zeros(q.shape[:2])

    monkeypatch.setattr(adapter_module, "apply", fake_apply)
    plan = adapter.make_wrapper(specs["plan"], recorder.plan)
    run = adapter.make_wrapper(specs["run"], recorder.run)
    return plan, run, recorder, applied


def new_wrapper(cls, cuda_graph=False):
    wrapper = object.__new__(cls)
    wrapper._kv_layout = "NHD"
    wrapper._use_cuda_graph = cuda_graph
    return wrapper


def plan_and_run(monkeypatch, page_size, causal=True, return_lse=True, cuda_graph=False,
                 plan_kwargs=(), run_kwargs=(), fp8=False):  # fmt: skip
    case = PagedCase((3, 5), (70, 5), page_size, fp8_scales=(0.5, 2.0) if fp8 else ())
    inputs = make_inputs(case, "cpu")
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    last = inputs[6] if page_size > 1 else torch.ones(2, dtype=torch.int32)
    plan, run, recorder, applied = patched(monkeypatch)
    wrapper = new_wrapper(BatchPrefillWithPagedKVCacheWrapper, cuda_graph)
    plan(wrapper, qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, page_size, causal=causal,
         sm_scale=0.1, **dict(plan_kwargs))  # fmt: skip
    result = run(wrapper, q, (k_cache, v_cache), return_lse=return_lse, **dict(run_kwargs))
    return result, recorder, applied, inputs


def ragged_plan_and_run(monkeypatch, plan_kwargs=(), cuda_graph=False):
    inputs = make_inputs(RaggedCase((3, 5), (70, 5)), "cpu")
    q, k, v, qo_indptr, kv_indptr = inputs[:5]
    plan, run, recorder, applied = patched(monkeypatch, RaggedPrefillAdapter)
    wrapper = new_wrapper(BatchPrefillWithRaggedKVCacheWrapper, cuda_graph)
    plan(wrapper, qo_indptr, kv_indptr, 32, 8, 128, **{"causal": True, **dict(plan_kwargs)})
    return run(wrapper, q, k, v, return_lse=True), recorder, applied, inputs


@pytest.mark.parametrize("page_size, name", [(64, PAGED_PS64), (1, PAGED_PS1)])
def test_apply_gets_the_definitions_own_arguments(monkeypatch, page_size, name):
    result, recorder, applied, inputs = plan_and_run(monkeypatch, page_size)
    assert recorder.calls == []  # FlashInfer's plan() deferred to a fallback; run served by apply
    [(called, kwargs)] = applied
    assert called == name
    expected = ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices"]
    expected += ["kv_last_page_len"] * (page_size > 1) + ["sm_scale"]
    assert list(kwargs) == expected  # the definition's inputs, in order; no page_size
    for position, key in enumerate(expected[:-1]):
        assert kwargs[key] is inputs[position]  # the planned tensors themselves, no copies
    assert kwargs["sm_scale"] == 0.1
    output, lse = result
    assert torch.all(output == 7.0) and lse.shape == (8, 32)


def test_cuda_graph_mode_stays_flashinfers(monkeypatch):
    """A use_cuda_graph=True wrapper refills its fixed buffers at each plan() and its captured
    kernel reads them at each replay; a bundle call would keep the tensors of one plan()."""
    result, recorder, applied, _ = plan_and_run(monkeypatch, 64, cuda_graph=True)
    assert recorder.calls == ["plan", "run"] and applied == [] and result == "orig"


@pytest.mark.parametrize(
    "plan_kwargs, run_kwargs",
    [
        ({"window_left": 127}, {}),  # no paged window definition
        ({}, {"window_left": 127}),
        ({"logits_soft_cap": 30.0}, {}),
        ({"pos_encoding_mode": "ROPE_LLAMA"}, {}),
        ({"custom_mask": torch.ones(1, dtype=torch.bool)}, {}),
        ({"head_dim_vo": 64}, {}),
        ({}, {"sinks": torch.zeros(32)}),
        ({}, {"k_scale": 0.5}),  # scales on a bf16 cache
        ({}, {"v_scale": 2.0}),
    ],
    ids=["plan_window", "run_window", "soft_cap", "rope", "custom_mask", "head_dim_vo",
         "sinks", "bf16_k_scale", "bf16_v_scale"],  # fmt: skip
)
def test_what_no_paged_definition_computes_stays_flashinfers(monkeypatch, plan_kwargs, run_kwargs):
    """flashinfer-bench's own adapter would have served these with the plain causal kernel."""
    result, recorder, applied, _ = plan_and_run(monkeypatch, 64, plan_kwargs=plan_kwargs,
                                                run_kwargs=run_kwargs)  # fmt: skip
    assert applied == [] and recorder.calls == ["plan", "run"] and result == "orig"


@pytest.mark.parametrize(
    "plan_kwargs", [{"logits_soft_cap": 0.0}, {"head_dim_vo": 128}, {"window_left": -1}]
)
def test_defaults_spelled_out_are_served(monkeypatch, plan_kwargs):
    _, recorder, applied, _ = plan_and_run(monkeypatch, 64, plan_kwargs=plan_kwargs)
    assert recorder.calls == [] and [name for name, _ in applied] == [PAGED_PS64]


@pytest.mark.parametrize("scales", [{}, {"k_scale": 0.5, "v_scale": 2.0}])
def test_fp8_caches_go_to_the_fp8_definition_with_runs_scales(monkeypatch, scales):
    _, recorder, applied, inputs = plan_and_run(monkeypatch, 64, run_kwargs=scales, fp8=True)
    [(called, kwargs)] = applied
    assert called == PAGED_FP8 and recorder.calls == []
    assert list(kwargs) == ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices",
                            "kv_last_page_len", "k_scale", "v_scale", "sm_scale"]  # fmt: skip
    assert (kwargs["k_scale"], kwargs["v_scale"]) == (scales.get("k_scale", 1.0),
                                                      scales.get("v_scale", 1.0))  # fmt: skip
    assert kwargs["k_cache"].dtype == torch.float8_e4m3fn


def test_fp8_scale_tensors_stay_flashinfers(monkeypatch):
    result, _, applied, _ = plan_and_run(monkeypatch, 64, run_kwargs={"k_scale": torch.ones(1)},
                                         fp8=True)  # fmt: skip
    assert applied == [] and result == "orig"


@pytest.mark.parametrize("window_left, name", [(-1, RAGGED), (1023, SWA)])
def test_ragged_wrapper_gets_the_ragged_or_window_definition(monkeypatch, window_left, name):
    result, recorder, applied, inputs = ragged_plan_and_run(
        monkeypatch, {"window_left": window_left, "sm_scale": 0.2}
    )
    [(called, kwargs)] = applied
    assert called == name and recorder.calls == []
    expected = ["q", "k", "v", "qo_indptr", "kv_indptr"] + ["window_left"] * (window_left >= 0)
    assert list(kwargs) == expected + ["sm_scale"]
    for position, key in enumerate(expected[:5]):
        assert kwargs[key] is inputs[position]
    assert kwargs.get("window_left", -1) == window_left and kwargs["sm_scale"] == 0.2
    assert torch.all(result[0] == 7.0)


@pytest.mark.parametrize(
    "plan_kwargs, cuda_graph",
    [({"causal": False}, False), ({"logits_soft_cap": 50.0}, False), ({}, True)],
    ids=["not_causal", "soft_cap", "cuda_graph_mode"],
)
def test_ragged_wrapper_stays_flashinfers_beyond_the_definitions(monkeypatch, plan_kwargs,
                                                                  cuda_graph):  # fmt: skip
    result, recorder, applied, _ = ragged_plan_and_run(monkeypatch, plan_kwargs, cuda_graph)
    assert applied == [] and recorder.calls == ["plan", "run"] and result == "orig"


def test_run_arguments_by_keyword_or_extra_positional(monkeypatch):
    """run() reads its arguments without inspect's bind: q and the cache by keyword are served
    the same; an extra positional argument (FlashInfer's legacy *args) goes to FlashInfer."""
    inputs = make_inputs(PagedCase((3, 5), (70, 5), 64), "cpu")
    plan, run, recorder, applied = patched(monkeypatch)
    wrapper = new_wrapper(BatchPrefillWithPagedKVCacheWrapper)
    plan(wrapper, *inputs[3:7], 32, 8, 128, 64, causal=True)
    run(wrapper, q=inputs[0], paged_kv_cache=tuple(inputs[1:3]))
    assert [name for name, _ in applied] == [PAGED_PS64]
    assert run(wrapper, inputs[0], tuple(inputs[1:3]), 0.5) == "orig"
    assert len(applied) == 1 and recorder.calls == ["plan", "run"]


def test_deferred_plan_runs_flashinfers_plan_only_for_a_fallback(monkeypatch):
    """By default a served plan never runs FlashInfer's plan(); a run() of it that falls back
    runs that plan() first, once; a plan no definition computes, or a CUDA-graph wrapper's, is
    FlashInfer's at once; PREFILL_BUNDLE_DEFER_PLAN=0 plans every plan() at once."""
    result, recorder, applied, inputs = plan_and_run(monkeypatch, 64)
    assert recorder.calls == [] and [name for name, _ in applied] == [PAGED_PS64]
    assert torch.all(result[0] == 7.0)

    plan, run, recorder, applied = patched(monkeypatch)
    wrapper = new_wrapper(BatchPrefillWithPagedKVCacheWrapper)
    plan(wrapper, *inputs[3:7], 32, 8, 128, 64, causal=True)
    q, cache = inputs[0], tuple(inputs[1:3])
    run(wrapper, q, cache)
    assert recorder.calls == []
    sinks = torch.zeros(32)  # no definition computes sinks: FlashInfer's kernel, planned first
    assert run(wrapper, q, cache, sinks=sinks) == "orig"
    assert run(wrapper, q, cache, sinks=sinks) == "orig"
    assert recorder.calls == ["plan", "run", "run"] and len(applied) == 1
    plan(wrapper, *inputs[3:7], 32, 8, 128, 64, causal=True)  # a new plan: deferred again
    run(wrapper, q, cache)
    assert recorder.calls == ["plan", "run", "run"] and len(applied) == 2

    for kwargs in ({"causal": False}, {"causal": True, "cuda_graph": True}):
        _, recorder, applied, _ = plan_and_run(monkeypatch, 64, **kwargs)
        assert recorder.calls == ["plan", "run"] and applied == []

    for value, calls in (("0", ["plan"]), ("1", [])):
        monkeypatch.setenv("PREFILL_BUNDLE_DEFER_PLAN", value)
        result, recorder, applied, _ = plan_and_run(monkeypatch, 64)
        assert recorder.calls == calls and [name for name, _ in applied] == [PAGED_PS64]
        assert torch.all(result[0] == 7.0)
    for value in ("true", "", "off"):  # a value the adapter does not know is not guessed at
        monkeypatch.setenv("PREFILL_BUNDLE_DEFER_PLAN", value)
        with pytest.raises(ValueError, match="PREFILL_BUNDLE_DEFER_PLAN=.*expected 1 .* or 0"):
            plan_and_run(monkeypatch, 64)


def test_deferred_plan_runs_for_apply_s_own_fallback(monkeypatch):
    """apply's fallback (no solution for the key) is FlashInfer's run(): its deferred plan()
    first."""
    plan, run, recorder, _ = patched(monkeypatch)
    monkeypatch.setattr(adapter_module, "apply", lambda name, kwargs, fallback: fallback(**kwargs))
    inputs = make_inputs(PagedCase((3, 5), (70, 5), 64), "cpu")
    wrapper = new_wrapper(BatchPrefillWithPagedKVCacheWrapper)
    plan(wrapper, *inputs[3:7], 32, 8, 128, 64, causal=True)
    assert recorder.calls == []
    assert run(wrapper, inputs[0], tuple(inputs[1:3])) == "orig"
    assert recorder.calls == ["plan", "run"]


def test_deferred_plan_refuses_a_fallback_inside_a_capture(monkeypatch):
    """A deferred plan() cannot run inside a CUDA graph capture: the fallback says so, and the
    plan stays deferred for a run() outside it."""
    plan, run, recorder, _ = patched(monkeypatch)
    inputs = make_inputs(PagedCase((3, 5), (70, 5), 64), "cpu")
    wrapper = new_wrapper(BatchPrefillWithPagedKVCacheWrapper)
    plan(wrapper, *inputs[3:7], 32, 8, 128, 64, causal=True)
    monkeypatch.setattr(adapter_module, "capturing", lambda q: True)
    with pytest.raises(RuntimeError, match="capture.*PREFILL_BUNDLE_DEFER_PLAN=0"):
        run(wrapper, inputs[0], tuple(inputs[1:3]))
    assert recorder.calls == []
    monkeypatch.setattr(adapter_module, "capturing", lambda q: False)  # the plan kept for later
    assert run(wrapper, inputs[0], tuple(inputs[1:3]), sinks=torch.zeros(32)) == "orig"
    assert recorder.calls == ["plan", "run"]


def test_without_return_lse_run_returns_the_output_only(monkeypatch):
    result, _, _, _ = plan_and_run(monkeypatch, 64, return_lse=False)
    assert isinstance(result, torch.Tensor) and torch.all(result == 7.0)


@pytest.mark.parametrize("page_size, causal", [(64, False), (16, True)])
def test_what_no_definition_covers_runs_flashinfer_itself(monkeypatch, page_size, causal):
    result, recorder, applied, _ = plan_and_run(monkeypatch, page_size, causal)
    assert applied == [] and recorder.calls == ["plan", "run"] and result == "orig"


def own_and_served(flashinfer_call):
    """flashinfer_call's outputs by FlashInfer alone, then with the bundle's apply enabled, and
    that runtime (its `served` counts)."""
    from flashinfer_bench.apply import disable_apply

    from prefill_bundle.serving import enable_bundle_apply

    own = flashinfer_call()
    runtime = enable_bundle_apply()
    try:
        served = flashinfer_call()
    finally:
        disable_apply()
    return own, served, runtime


def check_served(own, served, expected):
    check_outputs(served, expected, names=("output", "lse"))
    check_outputs(own, expected, names=("output", "lse"))
    assert not torch.equal(served[0], own[0])  # someone else answered


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("defer", ["1", "0"], ids=["plan_deferred", "plan_at_once"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_wrapper_is_served_by_the_bundle_and_matches_flashinfer(monkeypatch, page_size,
                                                                           defer):  # fmt: skip
    """plan + run through FlashInfer's own wrapper with apply enabled: the bundle's kernel
    answers (its result differs from FlashInfer's own in the last bits) and matches both the
    reference and FlashInfer run without apply, FlashInfer's plan() deferred or not."""
    monkeypatch.setenv("PREFILL_BUNDLE_DEFER_PLAN", defer)
    case = PagedCase((300, 17, 1), (2000, 17, 700), page_size, shared_prefix=(0, 0, 0))
    inputs = make_inputs(case, "cuda", seed=3)
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    last = inputs[6] if page_size > 1 else torch.ones(3, dtype=torch.int32, device="cuda")
    expected = reference_outputs(case, inputs)

    def flashinfer_call():
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, page_size, causal=True,
            sm_scale=1 / math.sqrt(128), q_data_type=q.dtype, kv_data_type=q.dtype,
        )  # fmt: skip
        return list(wrapper.run(q, (k_cache.nan_to_num(), v_cache.nan_to_num()), return_lse=True))

    own, served, _ = own_and_served(flashinfer_call)  # unused slots cleaned: FlashInfer reads them
    check_served(own, served, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_deferred_flashinfer_plan_serves_and_falls_back_on_the_gpu(monkeypatch):
    """The deferred plan on FlashInfer's real wrapper: a served run() matches the
    reference without FlashInfer's plan(); the same plan's run() once apply is off falls back,
    runs the deferred plan() and gives FlashInfer's own output, bit for bit."""
    from flashinfer_bench.apply import disable_apply

    from prefill_bundle.serving import enable_bundle_apply

    case = PagedCase((300, 17, 1), (2000, 17, 700), 64, shared_prefix=(0, 0, 0))
    inputs = make_inputs(case, "cuda", seed=4)
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last = inputs[:7]
    caches = (k_cache.nan_to_num(), v_cache.nan_to_num())
    expected = reference_outputs(case, inputs)

    def planned():
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, 64, causal=True,
            sm_scale=1 / math.sqrt(128), q_data_type=q.dtype, kv_data_type=q.dtype,
        )  # fmt: skip
        return wrapper

    own = list(planned().run(q, caches, return_lse=True))  # FlashInfer's (apply off)
    runtime = enable_bundle_apply()
    try:
        wrapper = planned()
        served = list(wrapper.run(q, caches, return_lse=True))
    finally:
        disable_apply()
    assert sum(runtime.served.values()) == 1
    check_served(own, served, expected)
    fallback = list(wrapper.run(q, caches, return_lse=True))
    assert torch.equal(fallback[0], own[0]) and torch.equal(fallback[1], own[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_cuda_graph_mode_replays_the_next_plan_with_apply_enabled(page_size):
    """FlashInfer's use_cuda_graph wrapper, apply enabled: run() captured after one plan(), then
    the next batch planned (its sequences reversed: the same sizes, another page table) and the
    graph replayed. The replay must answer the second batch (FlashInfer's own kernel does:
    flashinfer_adapter's docstring)."""
    from flashinfer_bench.apply import disable_apply

    from prefill_bundle.serving import enable_bundle_apply

    first = PagedCase((300, 17, 1), (2000, 17, 700), page_size)
    second = PagedCase(first.q_lens[::-1], first.kv_lens[::-1], page_size)
    batches = [make_inputs(case, "cuda", seed=seed) for seed, case in ((3, first), (4, second))]
    for inputs in batches:  # FlashInfer reads the unused cache slots
        inputs[1:3] = [cache.nan_to_num() for cache in inputs[1:3]]
    q, k_cache, v_cache = (x.clone() for x in batches[0][:3])  # the captured tensors

    def table(inputs):
        last = inputs[6] if page_size > 1 else torch.ones(3, dtype=torch.int32, device="cuda")
        return (*inputs[3:6], last)

    buffers = [torch.empty_like(x) for x in table(batches[0])]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buffers[0],
        paged_kv_indptr_buf=buffers[1], paged_kv_indices_buf=buffers[2],
        paged_kv_last_page_len_buf=buffers[3], backend="fa3",
    )  # fmt: skip

    def plan(inputs):
        wrapper.plan(
            *table(inputs), 32, 8, 128, page_size, causal=True, sm_scale=1 / math.sqrt(128),
            q_data_type=q.dtype, kv_data_type=q.dtype,
        )  # fmt: skip

    enable_bundle_apply()
    try:
        plan(batches[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapper.run(q, (k_cache, v_cache), return_lse=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = list(wrapper.run(q, (k_cache, v_cache), return_lse=True))
        plan(batches[1])
        for into, value in zip((q, k_cache, v_cache), batches[1][:3]):
            into.copy_(value)
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    finally:
        disable_apply()
    check_outputs(captured, reference_outputs(second, batches[1]), names=("output", "lse"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("window_left", [-1, 300])
def test_flashinfer_ragged_wrapper_is_served_with_its_window(window_left):
    """The ragged wrapper planned with window_left: the bundle's window kernel answers and
    matches the reference of the same window (flashinfer-bench's adapter would serve the plain
    causal kernel)."""
    case = RaggedCase((300, 17, 1), (2000, 17, 700), window_left=window_left)
    if window_left < 0:
        case = RaggedCase(case.q_lens, case.kv_lens)
    inputs = make_inputs(case, "cuda", seed=5)
    q, k, v, qo_indptr, kv_indptr = inputs[:5]

    def flashinfer_call():
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True, window_left=window_left,
                     sm_scale=1 / math.sqrt(128), q_data_type=q.dtype)  # fmt: skip
        return list(wrapper.run(q, k, v, return_lse=True))

    own, served, runtime = own_and_served(flashinfer_call)
    check_served(own, served, reference_outputs(case, inputs))
    assert sum(runtime.served.values()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_flashinfer_paged_wrapper_is_served_on_fp8_caches_with_its_scales():
    case = PagedCase((300, 17, 1), (2000, 17, 700), 64, fp8_scales=(0.5, 1.25))
    inputs = make_inputs(case, "cuda", seed=6)
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last = inputs[:7]
    clean = [cache.float().nan_to_num().to(cache.dtype) for cache in (k_cache, v_cache)]

    def flashinfer_call():
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, 64, causal=True,
            sm_scale=1 / math.sqrt(128), q_data_type=q.dtype, kv_data_type=k_cache.dtype,
        )  # fmt: skip
        return list(wrapper.run(q, tuple(clean), k_scale=0.5, v_scale=1.25, return_lse=True))

    own, served, runtime = own_and_served(flashinfer_call)
    check_served(own, served, reference_outputs(case, inputs))
    assert sum(runtime.served.values()) == 1
