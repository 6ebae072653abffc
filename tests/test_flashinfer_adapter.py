"""The bundle's drop-in for FlashInfer's BatchPrefillWithPagedKVCacheWrapper: apply gets each
paged definition's own arguments (kv_last_page_len for page size 64, none for 1, no page_size).
On CPU, around FlashInfer's real plan/run signatures; on the GPU, end to end against FlashInfer
itself."""

import functools
import math

import pytest
import torch
from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper

from prefill_bundle import PAGED_PS1, PAGED_PS64
from prefill_bundle import flashinfer_adapter as adapter_module
from prefill_bundle.flashinfer_adapter import PagedPrefillAdapter
from prefill_bundle.testing import PagedCase, check_outputs, make_inputs, reference_outputs

HAS_CUDA = torch.cuda.is_available()
# FlashInfer's own methods, taken before any test enables apply (which patches them).
PLAN, RUN = BatchPrefillWithPagedKVCacheWrapper.plan, BatchPrefillWithPagedKVCacheWrapper.run


class Recorder:
    """FlashInfer's plan and run, reduced to their signatures: they record that they ran."""

    def __init__(self):
        self.calls = []
        self.plan = functools.wraps(PLAN)(lambda *a, **k: self.calls.append("plan"))
        self.run = functools.wraps(RUN)(lambda *a, **k: self.calls.append("run") or "orig")


def patched(monkeypatch):
    """(plan, run) wrapped by the adapter, the recorder, and the apply calls seen."""
    adapter, recorder, applied = PagedPrefillAdapter(), Recorder(), []
    specs = {spec.name: spec for spec in adapter.targets()}

    def fake_apply(name, kwargs, fallback):
        applied.append((name, kwargs))
        q = kwargs["q"]
        return torch.full_like(q, 7.0), torch.zeros(q.shape[:2])

    monkeypatch.setattr(adapter_module, "apply", fake_apply)
    plan = adapter.make_wrapper(specs["gqa_paged_prefill_plan"], recorder.plan)
    run = adapter.make_wrapper(specs["gqa_paged_prefill_run"], recorder.run)
    return plan, run, recorder, applied


def plan_and_run(monkeypatch, page_size, causal=True, return_lse=True, cuda_graph=False):
    case = PagedCase((3, 5), (70, 5), page_size)
    inputs = make_inputs(case, "cpu")
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    last = inputs[6] if page_size > 1 else torch.ones(2, dtype=torch.int32)
    plan, run, recorder, applied = patched(monkeypatch)
    wrapper = object.__new__(BatchPrefillWithPagedKVCacheWrapper)
    wrapper._kv_layout = "NHD"
    wrapper._use_cuda_graph = cuda_graph
    plan(wrapper, qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, page_size, causal=causal,
         sm_scale=0.1)  # fmt: skip
    result = run(wrapper, q, (k_cache, v_cache), return_lse=return_lse)
    return result, recorder, applied, inputs


@pytest.mark.parametrize("page_size, name", [(64, PAGED_PS64), (1, PAGED_PS1)])
def test_apply_gets_the_definitions_own_arguments(monkeypatch, page_size, name):
    result, recorder, applied, inputs = plan_and_run(monkeypatch, page_size)
    assert recorder.calls == ["plan"]  # planned for a fallback; run served by apply
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


def test_without_return_lse_run_returns_the_output_only(monkeypatch):
    result, _, _, _ = plan_and_run(monkeypatch, 64, return_lse=False)
    assert isinstance(result, torch.Tensor) and torch.all(result == 7.0)


@pytest.mark.parametrize("page_size, causal", [(64, False), (16, True)])
def test_what_no_definition_covers_runs_flashinfer_itself(monkeypatch, page_size, causal):
    result, recorder, applied, _ = plan_and_run(monkeypatch, page_size, causal)
    assert applied == [] and recorder.calls == ["plan", "run"] and result == "orig"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_wrapper_is_served_by_the_bundle_and_matches_flashinfer(page_size):
    """plan + run through FlashInfer's own wrapper with apply enabled: the bundle's kernel
    answers (its result differs from FlashInfer's own in the last bits) and matches both the
    reference and FlashInfer run without apply."""
    from flashinfer_bench.apply import disable_apply

    from prefill_bundle.serving import enable_bundle_apply

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

    own = flashinfer_call()  # FlashInfer alone (unused slots cleaned: it reads them)
    runtime = enable_bundle_apply()
    try:
        served = flashinfer_call()
    finally:
        disable_apply()
    check_outputs(served, expected, names=("output", "lse"))
    check_outputs(own, expected, names=("output", "lse"))
    assert not torch.equal(served[0], own[0])  # someone else answered
    assert runtime is not None


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
