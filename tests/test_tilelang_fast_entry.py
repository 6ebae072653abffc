"""The TileLang entries' C++ fast path (solutions/gqa_ragged/tilelang/fast_entry.cc), the padded
entry's included.

Without a GPU: the module builds with the host compiler and refuses, returning False, every call
it cannot take (CPU tensors, arguments of other types), registering no plan for them.
On a GPU: a call whose layouts the Python entry planned goes through it (the Python entry is
made to fail, and the call still writes the reference's outputs, bit for bit those of the
planned call), a new layout goes to the Python entry, and so do a new stream's first call and a
call captured into a CUDA graph.
"""

from dataclasses import replace

import pytest
import torch
from flashinfer_bench import Solution

from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    build_solution_object,
    check_outputs,
    entry_module,
    load_solution,
    poisoned_call,
    poisoned_outputs,
    reference_outputs,
    tilelang_python_entry,
)
from prefill_bundle.workloads import FP8_K_SCALE, FP8_V_SCALE

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# (solution, case, the Python function its entry falls back to): each a call the fast path
# takes once planned (the main alone on the arguments as given, a positive scale).
FAST_CASES = [
    ("tilelang_ragged", RaggedCase((300, 129), (300, 700)), "_run_ragged"),
    ("tilelang_ragged", RaggedCase((1,), (700,)), "_run_ragged"),  # one token, dense: as given
    ("tilelang_swa", RaggedCase((300, 129), (300, 700), window_left=100), "_run_ragged"),
    ("tilelang_swa", RaggedCase((300, 129), (300, 700), window_left=-1), "_run_ragged"),
    ("tilelang_paged_ps64", PagedCase((100, 37), (900, 300), 64), "_run_paged"),
    ("tilelang_paged_ps1", PagedCase((100, 37), (900, 300), 1), "_run_paged"),
    # Page size 1 gathered first (384 query rows a sequence or more): the gather into the
    # stream's K and V buffers, then the ragged program over them.
    ("tilelang_paged_ps1", PagedCase((400, 500), (900, 700), 1), "_run_paged"),
    ("tilelang_fp8kv",
     PagedCase((100, 37), (900, 300), 64, fp8_scales=(FP8_K_SCALE, FP8_V_SCALE)), "_run_paged"),
    # Decode-like: split-KV (main into the stream's workspace, then the merge), and the FP8
    # decode program.
    ("tilelang_paged_ps64", PagedCase((1,) * 8, (3000,) * 8, 64), "_run_paged"),
    ("tilelang_paged_ps1", PagedCase((1,) * 8, (3000,) * 8, 1), "_run_paged"),
    ("tilelang_fp8kv",
     PagedCase((1,) * 8, (3000,) * 8, 64, fp8_scales=(FP8_K_SCALE, FP8_V_SCALE)), "_run_paged"),
    ("tilelang_mini", PaddedCase(2, 300, 300, True), "_run_padded"),
    ("tilelang_mini", PaddedCase(1, 128, 700, False), "_run_padded"),
]  # fmt: skip


def fast_module(solution="tilelang_ragged"):
    module = entry_module(solution).fast_entry.module()
    assert module is not None, "the fast path did not build"
    return module


def test_fast_entry_builds_and_refuses_what_it_cannot_take():
    fast = fast_module()
    entries = entry_module("tilelang_ragged").fast_entry
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    lse = torch.zeros(4, 32)
    # CPU tensors, and arguments of other types: the Python entry's calls.
    assert fast.ragged(q, kv, kv, indptr, indptr, 0.1, q, lse) is False
    assert fast.ragged_swa(q, kv, kv, indptr, indptr, 3, 0.1, q, lse) is False
    assert fast.ragged([1], None, "x", 4, 5.0, 0.1, q, lse) is False
    pages = torch.zeros(3, 64, 8, 128, dtype=torch.bfloat16)
    ids, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    assert fast.paged_ps64(q, pages, pages, indptr, indptr, ids, last, 0.1, q, lse) is False
    assert fast.paged_ps1(q, pages, pages, indptr, indptr, ids, 0.1, q, lse) is False
    assert fast.paged_ps64_fp8kv(
        q, pages, pages, indptr, indptr, ids, last, 1.0, 1.0, 0.1, q, lse
    ) is False  # fmt: skip
    q4 = torch.zeros(1, 4, 32, 128, dtype=torch.float16)
    kv4 = torch.zeros(1, 4, 8, 128, dtype=torch.float16)
    assert fast.padded(q4, kv4, kv4, True, q4) is False
    assert fast.padded(q4, kv4, kv4, 1, q4) is False  # not a bool: the Python entry's
    # A plan over CPU tensors is not kept: no call could take it.
    tensors = [q, kv, kv, indptr, indptr, q, lse]
    fast.register_plan(entries.RAGGED, fast.plan_count, tensors, None, 1, None)
    assert fast.plan_count(entries.RAGGED) == 0


def test_fast_entry_is_off_with_the_environment_switch(monkeypatch):
    entries = entry_module("tilelang_ragged").fast_entry
    monkeypatch.setenv("PREFILL_BUNDLE_TILELANG_FAST", "0")
    monkeypatch.setattr(entries, "_tried", False)
    monkeypatch.setattr(entries, "_module", None)
    assert entries.module() is None


def test_python_entry_block_sets_the_fast_path_aside_and_back():
    entry = entry_module("tilelang_ragged")
    built = fast_module()
    with pytest.raises(RuntimeError), tilelang_python_entry(entry):
        assert entry.fast_entry.module() is None  # every call takes the Python entry
        with tilelang_python_entry(entry):  # nested: still aside, and after it
            assert entry.fast_entry.module() is None
        assert entry.fast_entry.module() is None
        raise RuntimeError  # a failing block puts it back too
    assert entry.fast_entry.module() is built


def copy_of(solution: str):
    """The solution built again under another name: another package of the same sources, as a
    variant or earlier version is beside the shipped one in scripts/compare_gpu.py --old."""
    copy = load_solution(solution).model_dump(mode="json")
    copy["name"] = f"{solution}_copy"
    return build_solution_object(Solution.model_validate(copy))


def test_each_package_builds_a_library_of_its_own():
    """Each solution package loads its own library, so its own registry: one library shared by
    a solution and its copy let the copy's calls run the first one's planned kernels."""
    shipped, copy = entry_module("tilelang_mini"), entry_module(copy_of("tilelang_mini"))
    assert shipped.__file__ != copy.__file__
    assert shipped.fast_entry.module_name() != copy.fast_entry.module_name()
    assert shipped.fast_entry.module() is not None and copy.fast_entry.module() is not None
    assert shipped.fast_entry.module() is not copy.fast_entry.module()


@needs_cuda
@pytest.mark.gpu
def test_a_copy_of_the_solution_plans_its_own_calls(monkeypatch):
    """A call the shipped solution planned registers in its library only: the copy's first call
    on the same layouts takes the copy's own Python entry (with one library it took the
    shipped solution's planned kernel), and its outputs are the reference's."""
    case = PaddedCase(2, 300, 300, False)
    shipped, copy = build_solution("tilelang_mini"), copy_of("tilelang_mini")
    shipped(*poisoned_call(case))  # planned and registered in the shipped package's library
    entry, planned = entry_module(copy), []

    def python_entry(*args, _run_padded=entry._run_padded):
        planned.append(args)
        return _run_padded(*args)

    monkeypatch.setattr(entry, "_run_padded", python_entry)
    call = poisoned_call(case, seed=2)
    copy(*call)
    check_outputs(call[-1:], reference_outputs(case, call[:-1]))
    assert len(planned) == 1  # the copy's Python entry took it


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "solution,case,python", FAST_CASES, ids=[f"{s}-{c.id}" for s, c, _ in FAST_CASES]
)
def test_planned_calls_take_the_fast_path(solution, case, python, monkeypatch):
    fn = build_solution(solution)
    entry = entry_module(fn)
    first = poisoned_call(case)
    fn(*first)  # the Python entry plans and registers it
    torch.cuda.synchronize()

    def python_entry(*args, **kwargs):
        raise AssertionError("the call took the Python entry")

    monkeypatch.setattr(entry, python, python_entry)
    n = len(poisoned_outputs(case, first))  # the outputs: out (padded), or output and lse
    again = poisoned_call(case, seed=1)
    fn(*again)
    check_outputs(again[-n:], reference_outputs(case, again[:-n]))
    # The same inputs through the planned call and the fast one: the same bits.
    replay = [x.clone() if torch.is_tensor(x) else x for x in first[:-n]]
    replay += poisoned_outputs(case, first)
    fn(*replay)
    for a, b in zip(replay[-n:], first[-n:]):
        assert torch.equal(a, b)
    # Another layout (one query row more) is the Python entry's: it plans it.
    if isinstance(case, PaddedCase):
        longer = replace(case, seq_q=case.seq_q + 1)
    else:
        longer = replace(case, q_lens=(case.q_lens[0] + 1, *case.q_lens[1:]))
    with pytest.raises(AssertionError, match="Python entry"):
        fn(*poisoned_call(longer))


@needs_cuda
@pytest.mark.gpu
def test_new_streams_and_captures_go_to_the_python_entry(monkeypatch):
    case = RaggedCase((300, 129), (300, 700))
    fn = build_solution("tilelang_ragged")
    entry = entry_module(fn)
    fn(*poisoned_call(case))
    taken = []
    python_path = entry._run_ragged
    monkeypatch.setattr(entry, "_run_ragged", lambda *a: taken.append(1) or python_path(*a))
    fn(*poisoned_call(case))
    assert taken == []  # planned, on its stream: fast
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        args = poisoned_call(case)
        fn(*args)  # the stream's first call: its counters are made and registered
        assert len(taken) == 1
        fn(*args)
        assert len(taken) == 1
    torch.cuda.synchronize()
    check_outputs(args[-2:], reference_outputs(case, args[:-2]))
    args = poisoned_call(case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    assert len(taken) == 2  # captured: the graph's own counters, from the Python entry
    args[-2].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_outputs(args[-2:], reference_outputs(case, args[:-2]))


@needs_cuda
@pytest.mark.gpu
def test_calls_the_entry_restrides_stay_on_the_python_entry(monkeypatch):
    """One query token at a token stride that TMA cannot take as it is (a slice of a fused QKV
    projection): the Python entry restrides it on every call, so it never registers the layout."""
    case = RaggedCase((1,), (700,))
    fn = build_solution("tilelang_ragged")
    entry = entry_module(fn)
    args = poisoned_call(case)
    fused = torch.empty(1, 48, 128, dtype=args[0].dtype, device="cuda")
    fused[:, :32] = args[0]
    args[0] = fused[:, :32]  # token stride 48 x 128
    fn(*args)
    check_outputs(args[-2:], reference_outputs(case, args[:-2]))
    taken = []
    python_path = entry._run_ragged
    monkeypatch.setattr(entry, "_run_ragged", lambda *a: taken.append(1) or python_path(*a))
    fn(*args)
    assert taken == [1]
