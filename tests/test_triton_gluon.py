"""The Triton solutions' Gluon kernel for Hopper (solutions/gqa_ragged/triton/gluon_attention.py),
compiled for sm_90a without a GPU: what it must be to run at its measured speed. Its results
are checked on the GPU by the shared test matrix (run_padded takes it on sm_90)."""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch

from prefill_bundle import REPO_ROOT
from prefill_bundle.paged_malformed import (
    MALFORMED_PAGED_BATCHES,
    check_malformed_paged_outputs,
    malformed_paged_expected,
    malformed_paged_inputs,
)
from prefill_bundle.testing import (
    MALFORMED_BATCHES,
    MALFORMED_SWA_BATCHES,
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    check_malformed_outputs,
    check_outputs,
    entry_module,
    fused_qkv_inputs,
    make_inputs,
    malformed_expected,
    malformed_inputs,
    nan_neighbour_inputs,
    poisoned_outputs,
    reference_outputs,
    run_runnable,
    strided_caches,
)

pytest.importorskip("triton.experimental.gluon")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _sass(dtype: str, *kernel: str) -> str:
    """scripts/gluon_sass.py's output, in a process without the interpreter (tests/conftest.py
    turns it on without a GPU; compiled Gluon cannot call interpreted triton functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = REPO_ROOT / "scripts" / "gluon_sass.py"
    return subprocess.run([sys.executable, str(script), dtype, *kernel], env=env, check=True,
                          capture_output=True, text=True, timeout=600).stdout  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gluon_kernel_compiles_for_sm90a_with_the_softmax_overlapping_p_v(dtype):
    """Every K/V loop (unmasked and masked, two consumer warpgroups: 4 loops) waits for S
    (DEPBAR <= 1), runs its softmax's 64 exponentials, and only then waits for P V (DEPBAR
    <= 0): the order _order_after pins (without it ptxas hoists the second wait above the
    exponentials: the softmax no longer overlaps P V). Tensor-core products on asynchronous wgmma
    (HGMMA), the register split by setmaxnreg."""
    sass = _sass(dtype)
    assert sass.count("HGMMA.64x128x16.F32") == 96  # 2 warpgroups x (8 + 2 x 16 + 8)
    assert "USETMAXREG" in sass and "UTMALDG" in sass
    loops = _kv_loops(sass)
    assert len(loops) == 4 and min(loops) >= 64, loops


def test_gluon_paged_kernel_compiles_for_sm90a_with_page_boxes_and_its_v_tail_copy():
    """The paged kernel (page size 64): the ragged kernel's loops, K / V by TMA boxes of one
    page (each two messages of 64 columns, as Q's halves: Q 2 x 2, K and V 2 pages x 2 each
    in the SASS), the last V tile's cp.async copy."""
    sass = _sass("bf16", "paged")
    assert sass.count("HGMMA.64x128x16.F32") == 96
    loops = _kv_loops(sass)
    assert len(loops) == 4 and min(loops) >= 64, loops
    assert sass.count("UTMALDG") == 12
    assert sass.count("LDGSTS.E.BYPASS.128") == 64
    assert "ARRIVES.LDGSTSBAR" in sass


def test_gluon_ragged_kernel_compiles_for_sm90a_with_its_v_tail_copy():
    """The ragged kernel: the padded one's loops (the same order of waits and exponentials),
    K / V by TMA, and the producer's cp.async copy of a sequence's last V tile (16 steps of 8
    rows, 4 copies a lane each) completing on the slot's barrier."""
    sass = _sass("bf16", "ragged")
    assert sass.count("HGMMA.64x128x16.F32") == 96
    assert "USETMAXREG" in sass and "UTMALDG" in sass
    assert sass.count("LDGSTS.E.BYPASS.128") == 64
    assert "ARRIVES.LDGSTSBAR" in sass


def _kv_loops(sass: str) -> list:
    """The exponentials of each K/V loop whose softmax runs between the wait for S (DEPBAR <= 1)
    and the wait for P V (DEPBAR <= 0)."""
    events = []
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            events.append("wait_s")
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            events.append("wait_all")
        elif "MUFU.EX2" in line:
            events.append("exp")
    return [body.count("exp") for body in re.findall(r"wait_s((?: exp)*) wait_all",
                                                     " ".join(events))]  # fmt: skip


def test_gluon_window_kernel_compiles_for_sm90a_with_three_loops_a_warpgroup():
    """The ragged kernel with WINDOW: per consumer warpgroup a masked loop for the band's left
    edge, the unmasked one inside the band and a masked one from the diagonal (6 loops, each
    with the softmax between its two waits), the V tail copy as without the window."""
    sass = _sass("bf16", "window")
    assert sass.count("HGMMA.64x128x16.F32") == 128  # 2 warpgroups x (8 + 3 x 16 + 8)
    loops = _kv_loops(sass)
    assert len(loops) == 6 and min(loops) >= 64, loops
    assert sass.count("LDGSTS.E.BYPASS.128") == 64
    assert "ARRIVES.LDGSTSBAR" in sass


# ---- On the GPU: run_padded's Gluon path against the fp32 reference ----------------------------

# Short sequences for the edges: the tests lower GLUON_MIN_TOKENS (GLUON_MIN_RAGGED_TOKENS) so the
# Gluon path takes them.
GLUON_CASES = [
    PaddedCase(1, 128, 128, True),
    PaddedCase(1, 1024, 1024, True),
    PaddedCase(2, 1000, 1500, True),  # tails of both; rows see the cached prefix
    PaddedCase(2, 1500, 1100, True),  # more queries than keys: rows that see no key give 0
    PaddedCase(1, 1, 1030, True),
    PaddedCase(3, 777, 1153, False),  # tiles past a sequence's end in the middle of the batch
    PaddedCase(1, 300, 2048, False),
    PaddedCase(1, 4096, 4096, False),  # 32 tiles through the ring
]


def _gluon_from_one_token(monkeypatch, name: str, plans: str) -> tuple:
    """(solution `name`, its entry module) with the Gluon path taken from 1 query (and key) a
    sequence on, its plan cache `plans` fresh (none cached earlier for the FA-2 kernel)."""
    runnable = build_solution(name)
    module = entry_module(runnable)
    monkeypatch.setattr(module, "GLUON_MIN_TOKENS", 1)
    monkeypatch.setattr(module, "GLUON_MIN_RAGGED_TOKENS", 1)
    monkeypatch.setattr(module, plans, module.PlanCache())
    return runnable, module


@pytest.fixture
def gluon_solution(monkeypatch):
    return _gluon_from_one_token(monkeypatch, "triton_mini", "_padded_plans")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "fused_qkv"])
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: c.id)
def test_gluon_path_matches_the_reference(gluon_solution, case, fused):
    runnable, module = gluon_solution
    inputs = make_inputs(case, "cuda", seed=7)
    if fused:
        inputs = fused_qkv_inputs(inputs)
    out = poisoned_outputs(case, inputs)[0]
    assert isinstance(module._plan_padded(*inputs, out), module.GluonPlan)
    actual = run_runnable(runnable, case, inputs)
    check_outputs(actual, reference_outputs(case, inputs), names=("out",))


@gpu
@pytest.mark.gpu
def test_gluon_path_keeps_a_nan_in_one_sequence_out_of_the_others(gluon_solution):
    """K/V are read per sequence: the last tile of sequence 0 (1100 keys: 76 past its end) gets
    zeros there, not sequence 1's keys, whose NaN would reach P V through 0 x NaN."""
    case = PaddedCase(2, 1100, 1100, False)
    runnable, module = gluon_solution
    inputs, expected, rows = nan_neighbour_inputs(case, "cuda", seed=3)
    out = run_runnable(runnable, case, inputs)[0]
    assert isinstance(module._plan_padded(*inputs, out), module.GluonPlan)
    check_outputs([out[rows]], [expected[0][rows]], names=("out",))
    assert out[1].isnan().all()  # sequence 1 itself sees its NaN


# ---- On the GPU: run_ragged's Gluon path -------------------------------------------------------

GLUON_RAGGED_CASES = [
    RaggedCase((128,), (128,)),
    RaggedCase((1,), (1030,)),
    RaggedCase((1000, 700, 300), (1000, 1500, 300)),  # tails inside the next sequence
    RaggedCase((4500, 37), (3000, 4000)),  # more queries than keys: rows that see no key
    RaggedCase((1000, 1, 0, 2048), (1000, 1, 0, 2048)),  # an empty sequence, a 1-token one
    RaggedCase((300, 129, 5), (0, 700, 5)),  # a sequence without keys
    RaggedCase((2048, 2048, 2048, 2048), (2048, 2048, 2048, 2048)),  # whole tiles only
]


@pytest.fixture
def gluon_ragged_solution(monkeypatch):
    return _gluon_from_one_token(monkeypatch, "triton_ragged", "_ragged_plans")


def _assert_gluon_ragged_plan(module, inputs):
    q, k, v, qo_indptr, kv_indptr, _ = inputs
    output, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
    plan = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse)
    assert isinstance(plan, module.GluonRaggedPlan)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "fused_qkv"])
@pytest.mark.parametrize("case", GLUON_RAGGED_CASES, ids=lambda c: c.id)
def test_gluon_ragged_path_matches_the_reference(gluon_ragged_solution, case, fused):
    """Output and LSE of every row against the fp32 reference (outputs poisoned first)."""
    runnable, module = gluon_ragged_solution
    inputs = make_inputs(case, "cuda", seed=11)
    if fused:
        inputs = fused_qkv_inputs(inputs)
    _assert_gluon_ragged_plan(module, inputs)
    actual = run_runnable(runnable, case, inputs)
    check_outputs(actual, reference_outputs(case, inputs))


@gpu
@pytest.mark.gpu
def test_gluon_ragged_path_keeps_a_nan_in_one_sequence_out_of_the_others(gluon_ragged_solution):
    """Sequence 0's last V tile ends inside sequence 1's NaN values: it comes in by cp.async
    with zeros past sequence 0's keys."""
    runnable, module = gluon_ragged_solution
    case = RaggedCase((1000, 700, 300), (1000, 1500, 300))
    inputs, expected, rows = nan_neighbour_inputs(case, "cuda", seed=5)
    _assert_gluon_ragged_plan(module, inputs)
    actual = run_runnable(runnable, case, inputs)
    check_outputs([x[rows] for x in actual], [x[rows] for x in expected])


def _every_row_written(runnable, inputs) -> list:
    """[output, lse] of runnable on inputs, both filled with -7 first: every row must be
    written (computed or NaN)."""
    output = torch.full_like(inputs[0], -7.0)
    lse = torch.full(inputs[0].shape[:2], -7.0, device=inputs[0].device)
    runnable(*inputs, output, lse)
    assert not (output == -7.0).all(-1).any() and not (lse == -7.0).any(), "rows never written"
    return [output, lse]

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", MALFORMED_BATCHES, ids=lambda b: b.id)
def test_gluon_ragged_path_leaves_malformed_batches_to_the_fa2_kernel(gluon_ragged_solution,
                                                                      batch):  # fmt: skip
    """Indptr arrays that are not a partition: the Gluon kernel writes nothing, the FA-2 kernel
    after it computes the well-formed sequences and NaN in every other row."""
    runnable, module = gluon_ragged_solution
    inputs = malformed_inputs(batch, "cuda", seed=3)
    _assert_gluon_ragged_plan(module, inputs)
    check_malformed_outputs(_every_row_written(runnable, inputs), malformed_expected(batch, inputs))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", MALFORMED_BATCHES[::3], ids=lambda b: b.id)
def test_gluon_ragged_kernel_alone_writes_nothing_of_a_malformed_batch(gluon_ragged_solution,
                                                                      batch, monkeypatch):
    """The Gluon kernel without the FA-2 kernel after it: its producer hands every item of a
    malformed batch to the consumers empty, and they store nothing (output and lse keep their
    poison); a well-formed batch as the control, every row written."""
    runnable, module = gluon_ragged_solution
    monkeypatch.setattr(module, "_launch", lambda *args: None)  # the FA-2 launch
    for malformed in (True, False):
        if malformed:
            inputs = malformed_inputs(batch, "cuda", seed=3)
        else:
            inputs = make_inputs(RaggedCase((30, 40, 30), (40, 40, 40)), "cuda", seed=3)
        _assert_gluon_ragged_plan(module, inputs)
        output = torch.full_like(inputs[0], -7.0)
        lse = torch.full(inputs[0].shape[:2], -7.0, device="cuda")
        runnable(*inputs, output, lse)
        untouched = bool((output == -7.0).all()) and bool((lse == -7.0).all())
        assert untouched if malformed else not (output == -7.0).all(-1).any()


# ---- On the GPU: run_paged_ps64's Gluon path ---------------------------------------------------

GLUON_PAGED_CASES = [
    PagedCase((1,), (1,), 64),  # last page length 1
    PagedCase((7, 0, 33), (7, 0, 40), 64),  # an empty sequence (no pages)
    PagedCase((16, 5), (16, 0), 64),  # queries without keys
    PagedCase((20, 20, 5), (129, 128, 65), 64, shared_prefix=(64, 64, 0)),  # shared pages
    PagedCase((1000, 300), (3000, 300), 64),  # partial last tiles, last pages of 56 and 44
    PagedCase((4500, 37), (3000, 4000), 64),  # rows that see no key
    PagedCase((2048,), (8192 + 37,), 64, torch.float16),  # a chunk over a cached prefix
    PagedCase((2048, 2048), (2048, 4096), 64),  # whole tiles only
]


@pytest.fixture
def gluon_paged_solution(monkeypatch):
    runnable = build_solution("triton_paged_ps64")
    module = entry_module(runnable)
    monkeypatch.setattr(module, "GLUON_MIN_RAGGED_TOKENS", 1)
    monkeypatch.setattr(module, "_paged_plans", {1: module.PlanCache(), 64: module.PlanCache()})
    return runnable, module


def _assert_gluon_paged_plan(module, inputs, caches=None):
    q, k_cache, v_cache, *tables, _ = inputs
    if caches:
        k_cache, v_cache = caches
    output, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
    tensors = (q, k_cache, v_cache, *tables, output, lse)
    assert isinstance(module._plan_paged(64, tensors), module.GluonPagedPlan)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_PAGED_CASES, ids=lambda c: c.id)
def test_gluon_paged_path_matches_the_reference(gluon_paged_solution, case):
    """Output and LSE of every row against the fp32 reference (outputs poisoned first; cache
    slots no sequence lists are NaN)."""
    runnable, module = gluon_paged_solution
    inputs = make_inputs(case, "cuda", seed=17)
    _assert_gluon_paged_plan(module, inputs)
    check_outputs(run_runnable(runnable, case, inputs), reference_outputs(case, inputs))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("slots", [(2, 2), (2, 3)], ids=["kv_interleaved", "unequal_strides"])
def test_gluon_paged_path_reads_cache_views_with_page_strides(gluon_paged_solution, slots):
    """The K and V halves of FlashInfer's [pages, 2, 64, 8, 128] cache, and unequal page
    strides (K's flat rows 128 apart, V's 192), NaN between the pages."""
    runnable, module = gluon_paged_solution
    case = GLUON_PAGED_CASES[4]
    inputs = make_inputs(case, "cuda", seed=19)
    caches = strided_caches(inputs[1], inputs[2], *slots)
    _assert_gluon_paged_plan(module, inputs, caches)
    strided = [inputs[0], *caches, *inputs[3:]]
    check_outputs(run_runnable(runnable, case, strided), reference_outputs(case, inputs))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [b for b in MALFORMED_PAGED_BATCHES if b.page_size == 64],
                         ids=lambda b: b.id)  # fmt: skip
def test_gluon_paged_path_on_malformed_batches(gluon_paged_solution, batch):
    """Bad page ids and last-page lengths (the Gluon kernel: NaN rows), indptr arrays that are
    not a partition (the FA-2 kernel after it): every row written, NaN where the contract
    says."""
    runnable, module = gluon_paged_solution
    inputs = malformed_paged_inputs(batch, "cuda", seed=4)
    _assert_gluon_paged_plan(module, inputs)
    check_malformed_paged_outputs(_every_row_written(runnable, inputs),
                                  malformed_paged_expected(batch, inputs))  # fmt: skip


@gpu
@pytest.mark.gpu
def test_gluon_item_counter_is_zero_after_every_launch(gluon_ragged_solution,
                                                       gluon_paged_solution):  # fmt: skip
    """The ragged and paged kernels draw items past their grid from a per-stream counter that
    their last CTA zeroes: after each launch (well-formed, malformed, more items than CTAs and
    fewer) it reads [0, 0] and the next launch on the stream computes every row; a second
    stream draws from a counter of its own."""
    ragged, paged = gluon_ragged_solution[0], gluon_paged_solution[0]
    counter = entry_module(ragged).gluon_attention.item_counter
    paged_counter = entry_module(paged).gluon_attention.item_counter  # (a build of its own)
    cases = [(ragged, counter, RaggedCase((4096, 3000, 5), (4096, 5000, 5))),  # 1856 items
             (paged, paged_counter, PagedCase((2048, 700), (9000, 700), 64)),
             (ragged, counter, RaggedCase((100,), (100,))),  # 32 items: 32 CTAs
             (paged, paged_counter, PagedCase((1,), (1,), 64))]  # fmt: skip
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for seed, (runnable, drawn_from, case) in enumerate(cases):
                inputs = make_inputs(case, "cuda", seed=seed)
                check_outputs(run_runnable(runnable, case, inputs), reference_outputs(case, inputs))
                assert drawn_from(inputs[0].device).tolist() == [0, 0]
            inputs = malformed_inputs(MALFORMED_BATCHES[0], "cuda", seed=3)
            _every_row_written(ragged, inputs)
            assert counter(inputs[0].device).tolist() == [0, 0]
    device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.stream(side):
        side_counter = counter(device)
    assert side_counter is not counter(device)


# ---- On the GPU: run_ragged_swa's Gluon path ----------------------------------------------------

GLUON_WINDOW_CASES = [
    RaggedCase((3000, 2048), (3000, 9000), window_left=127),  # band edges inside key tiles
    RaggedCase((3000, 2048), (3000, 9000), torch.float16, window_left=128),
    RaggedCase((1000, 700, 300), (1000, 1500, 300), window_left=0),  # the diagonal alone
    RaggedCase((1000, 700, 300), (1000, 1500, 300), window_left=1),
    RaggedCase((4500, 37), (3000, 4000), window_left=300),  # rows that see no key
    RaggedCase((1000, 1, 0, 2048), (1000, 1, 0, 2048), window_left=64),  # empty, 1-token
    RaggedCase((300, 129, 5), (0, 700, 5), window_left=200),  # a sequence without keys
    RaggedCase((2048, 1), (16384, 5000), sm_scale=-0.3, window_left=1000),  # chunk over a prefix
    RaggedCase((1500, 2500), (1500, 2500), window_left=2000),  # wider than sequence 0
]


@pytest.fixture
def gluon_window_solution(monkeypatch):
    runnable = build_solution("triton_swa")
    module = entry_module(runnable)
    monkeypatch.setattr(module, "GLUON_MIN_RAGGED_TOKENS", 1)
    monkeypatch.setattr(module, "GLUON_MIN_WINDOW", 0)
    monkeypatch.setattr(module, "_window_plans", module.PlanCache())
    return runnable, module


def _assert_gluon_window_plan(module, inputs):
    q, k, v, qo_indptr, kv_indptr, *_ = inputs
    output, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
    plan = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse, window=True)
    assert isinstance(plan, module.GluonRaggedPlan) and plan[4]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "fused_qkv"])
@pytest.mark.parametrize("case", GLUON_WINDOW_CASES, ids=lambda c: c.id)
def test_gluon_window_path_matches_the_reference(gluon_window_solution, case, fused):
    """Output and LSE of every row against the fp32 reference (outputs poisoned first); the
    cases share one compiled kernel, each with its own window_left."""
    runnable, module = gluon_window_solution
    inputs = make_inputs(case, "cuda", seed=13)
    if fused:
        inputs = fused_qkv_inputs(inputs)
    _assert_gluon_window_plan(module, inputs)
    actual = run_runnable(runnable, case, inputs)
    check_outputs(actual, reference_outputs(case, inputs))


@gpu
@pytest.mark.gpu
def test_gluon_window_path_reads_only_the_band_tiles(gluon_window_solution):
    """Keys before the first 128-key tile an item's band meets are NaN in K and V: a read of one
    shows (an unmasked logit or a masked tile's 0 x NaN). 256 queries over 4096 keys: most of
    the keys stay unread, the outputs still match the clean reference. The windows run one
    after the other through one plan (its compiled kernel, window_left not compiled in)."""
    runnable, module = gluon_window_solution
    for window_left in (700, 0, 1, 16, 129, 100):
        case = RaggedCase((256,), (4096,), window_left=window_left)
        inputs = make_inputs(case, "cuda", seed=17)
        expected = reference_outputs(case, inputs)
        first_read = (4096 - 256 - window_left) // 128 * 128  # item 0's first row's band
        for x in inputs[1:3]:
            x[:first_read] = float("nan")
        _assert_gluon_window_plan(module, inputs)
        check_outputs(run_runnable(runnable, case, inputs), expected)


@gpu
@pytest.mark.gpu
def test_gluon_window_path_keeps_a_nan_in_one_sequence_out_of_the_others(gluon_window_solution):
    runnable, module = gluon_window_solution
    case = RaggedCase((1000, 700, 300), (1000, 1500, 300), window_left=300)
    inputs, expected, rows = nan_neighbour_inputs(case, "cuda", seed=5)
    _assert_gluon_window_plan(module, inputs)
    actual = run_runnable(runnable, case, inputs)
    check_outputs([x[rows] for x in actual], [x[rows] for x in expected])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", MALFORMED_SWA_BATCHES, ids=lambda b: b.id)
def test_gluon_window_path_leaves_malformed_batches_to_the_fa2_kernel(gluon_window_solution,
                                                                      batch):  # fmt: skip
    runnable, module = gluon_window_solution
    inputs = malformed_inputs(batch, "cuda", seed=3)
    _assert_gluon_window_plan(module, inputs)
    check_malformed_outputs(_every_row_written(runnable, inputs), malformed_expected(batch, inputs))


def test_triton_solution_runs_without_gluon(tmp_path, monkeypatch):
    """A triton without Gluon (or without an API the kernel uses) still runs every definition
    on the FA-2 kernel: triton_prefill imports with gluon_attention None and run_padded gives
    the reference's answer (on CPU under the interpreter here)."""
    import importlib
    import shutil
    import sys

    from prefill_bundle.packing import TRITON_SOURCES

    package = tmp_path / "triton_without_gluon"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in TRITON_SOURCES:
        shutil.copy(REPO_ROOT / "solutions" / "gqa_ragged" / "triton" / name, package / name)
    shutil.copy(REPO_ROOT / "prefill_bundle" / "arguments.py", package / "arguments.py")
    import triton.experimental

    # `from triton.experimental import gluon` -> ImportError, even once gluon was imported here
    monkeypatch.delattr(triton.experimental, "gluon", raising=False)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = importlib.import_module("triton_without_gluon.triton_prefill")
    assert entry.gluon_attention is None
    case = PaddedCase(1, 33, 47, True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = make_inputs(case, device, seed=2)
    out = poisoned_outputs(case, inputs)[0]
    entry.run_padded(*inputs, out)
    check_outputs([out], reference_outputs(case, inputs), names=("out",))


@pytest.mark.parametrize("batch,seq_q,seq_kv,causal", [
    (8, 2048, 2048, True), (1, 8192, 8192, True), (2, 1500, 1100, True), (1, 300, 2048, False),
    (1, 16384, 16384, False), (3, 128, 128, True), (16, 1024, 1024, True),
])  # fmt: skip
def test_padded_schedule_runs_every_item_once_in_l2_sections_and_evens_the_ctas(
    batch, seq_q, seq_kv, causal
):
    """The padded kernel's table (plan time): every item once, the offsets and the trailing pad
    the kernel reads; the CTAs' first items all from the first L2 section's (sequence, KV head)
    units (16 MB of K / V); the CTAs' loads (key tiles + 1 an item, as _item counts them) within
    one item of each other, and never above a round robin's."""
    ga = entry_module(build_solution("triton_mini")).gluon_attention
    ctas = ga.grid(batch, seq_q, 132)[0]
    table = ga.padded_schedule(batch, seq_q, seq_kv, causal, ctas)
    m_blocks = -(-seq_q // 128)
    items = m_blocks * batch * 32

    def cost(item):  # _item's numbers: the last row block first
        m_block = m_blocks - 1 - item // (batch * 32)
        tiles = -(-seq_kv // 128)
        if causal:
            tiles = max(min(tiles, (m_block * 128 + 127 + seq_kv - seq_q + 128) // 128), 0)
        return tiles + 1

    def unit(item):  # (sequence, KV head)
        return item % (batch * 32) // 4

    assert table[0] == ctas + 1 and table[ctas] == len(table) - 1 and table[-1] == 0
    runs = [table[table[c]:table[c + 1]] for c in range(ctas)]
    assert all(runs) and sorted(i for run in runs for i in run) == list(range(items))
    section = max(1, (16 << 20) // (2 * seq_kv * 128 * 2))
    assert {unit(run[0]) // section for run in runs} == {0}
    loads = [sum(map(cost, run)) for run in runs]
    assert max(loads) - min(loads) <= max(map(cost, range(items)))
    round_robin = [sum(cost(i) for i in range(c, items, ctas)) for c in range(ctas)]
    assert max(loads) <= max(round_robin)
    if (batch, seq_q) == (8, 2048):  # 3% under a round robin's, which left 3% idle
        assert max(loads) <= 0.975 * max(round_robin)


def test_gluon_launch_glue_on_the_host(monkeypatch):
    """run_padded's Gluon branch up to the launch (here on CPU tensors, the launch recorded):
    the plan's persistent grid, TMA descriptors over q / k / v with their own strides (a fused
    QKV slice), and the kernel's run-time arguments in order."""
    runnable = build_solution("triton_mini")
    module = entry_module(runnable)
    case = PaddedCase(2, 300, 700, True)
    q, k, v, causal = fused_qkv_inputs(make_inputs(case, "cpu", seed=1))
    out = poisoned_outputs(case, [q])[0]
    launches = []
    monkeypatch.setattr(module, "_cached_launch", lambda *call: launches.append(call))
    schedule = torch.zeros(4, dtype=torch.int32)  # stands for the plan's table (recorded only)
    plan = module.GluonPlan((300, 700, True, module.gluon_attention.grid(2, 300, 132), {},
                             schedule))  # fmt: skip
    module.launch_padded(plan, q, k, v, out)
    (kernel, grid, constexprs, runners, key, args), = launches
    ga = module.gluon_attention
    assert kernel is ga.gluon_padded_fwd and constexprs() is ga.CONSTEXPRS
    # items: 3 row blocks x 2 sequences x 32 heads = 192 -> 132 CTAs; 1 x 1 x 32 -> 32
    assert grid == (132,) and ga.grid(1, 128, 132) == (32,)
    q_desc, k_desc, v_desc = args[:3]
    width = q.stride(1)  # the fused projection's token stride
    assert (q_desc.shape, q_desc.strides) == ([600, 4096], [width, 1])
    assert q_desc.block_shape == [64, 128]
    assert (k_desc.shape, k_desc.strides) == ([2, 700, 1024], [k.stride(0), width, 1])
    assert v_desc.base is v and v_desc.block_shape == [1, 128, 128]
    assert args[3] is out and args[4] is schedule
    assert args[5:] == (300, 700, 4096, module.PADDED_QK_SCALE, 1, 0)


def test_gluon_ragged_launch_glue_on_the_host(monkeypatch):
    """run_ragged's Gluon branch up to the launches (CPU tensors, the launches recorded): the
    persistent grid, flat TMA descriptors over q / k / v at their own token strides (fused QKV
    slices), the kernel's run-time arguments in order, then the FA-2 kernel planned for
    malformed batches only."""
    runnable = build_solution("triton_ragged")
    module = entry_module(runnable)
    monkeypatch.setattr(module, "INTERPRET", True)  # CPU tensors pass the placement check
    case = RaggedCase((300, 700), (500, 900))
    q, k, v, qo_indptr, kv_indptr, sm_scale = fused_qkv_inputs(make_inputs(case, "cpu", seed=1))
    output, lse = torch.empty(1000, 32, 128, dtype=q.dtype), torch.empty(1000, 32)
    launches = []
    monkeypatch.setattr(module, "_cached_launch", lambda *call: launches.append(call))
    ga = module.gluon_attention
    fa2 = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse,
                              config=module._GLUON_FALLBACK)  # fmt: skip
    plan = module.GluonRaggedPlan((2, ga.ragged_grid(2, 1000, 132), fa2, {}, False))
    module.launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse)
    (kernel, grid, constexprs, _, _, args), (fa2_kernel, fa2_grid, fa2_constexprs, _, _,
                                             fa2_args) = launches  # fmt: skip
    assert kernel is ga.gluon_ragged_fwd and constexprs() == dict(ga.CONSTEXPRS, WINDOW=False)
    # items: (1000 // 128 + 2) slots x 32 heads = 288 -> 132 CTAs
    assert grid == (132,) and ga.ragged_grid(1, 100, 132) == (32,)
    q_desc, k_desc, v_desc = args[:3]
    width = q.stride(0)  # the fused projection's token stride
    assert (q_desc.shape, q_desc.strides, q_desc.block_shape) == ([1000, 4096], [width, 1],
                                                                  [64, 128])  # fmt: skip
    assert (k_desc.shape, k_desc.strides, k_desc.block_shape) == ([1400, 1024], [width, 1],
                                                                  [128, 128])  # fmt: skip
    assert v_desc.base is v and args[3] is v
    assert args[4:-1] == (output, lse, qo_indptr, kv_indptr, 2, 1000, 1400, width, 4096,
                          sm_scale * module.LOG2_E, 1, 0, -1)  # fmt: skip
    assert args[-1] is ga.item_counter(q.device) and args[-1].tolist() == [0, 0]
    assert fa2_kernel is module.gqa_prefill_fwd and fa2_constexprs()["MALFORMED_ONLY"]
    assert not fa2_constexprs()["WINDOW"]
    # One wave: 16 x 8 programs (one an SM of 132) for the 1000 // 64 + 2 = 17 slots.
    assert fa2_grid == (16, 8)
    assert fa2_args[:7] == (q, k, v, output, lse, qo_indptr, kv_indptr)
    assert fa2_args[-1] is None

    # The window's plan: the WINDOW kernel with window_left, the FA-2 window kernel after it.
    launches.clear()
    fa2 = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse,
                              config=module._GLUON_FALLBACK, window=True)  # fmt: skip
    plan = module.GluonRaggedPlan((2, ga.ragged_grid(2, 1000, 132), fa2, {}, True))
    module.launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse, 37)
    (kernel, _, constexprs, _, _, args), (_, _, fa2_constexprs, _, _, fa2_args) = launches
    assert kernel is ga.gluon_ragged_fwd and constexprs() == dict(ga.CONSTEXPRS, WINDOW=True)
    assert args[-2] == 37 and fa2_args[-1] == 37
    assert fa2_constexprs()["WINDOW"] and fa2_constexprs()["MALFORMED_ONLY"]


def test_gluon_paged_launch_glue_on_the_host(monkeypatch):
    """run_paged_ps64's Gluon branch up to the launches (CPU tensors, the launches recorded):
    the plan takes it for caches whose page strides are whole tokens (FlashInfer's K / V
    halves: 128 flat rows a page) and not otherwise; flat descriptors down to the last page's
    last row, K's padding NaN and V's zeros, one page a box; the run-time arguments in order;
    then the FA-2 kernel planned for malformed batches only."""
    runnable = build_solution("triton_paged_ps64")
    module = entry_module(runnable)
    monkeypatch.setattr(module, "INTERPRET", True)  # CPU tensors pass the placement check
    monkeypatch.setattr(module, "_gluon_suits", lambda *args: True)
    case = PagedCase((600, 400), (700, 900), 64)
    q, k_cache, v_cache, *tables, sm_scale = make_inputs(case, "cpu", seed=1)
    k_cache, v_cache = strided_caches(k_cache, v_cache, 2, 2)
    output, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    tensors = (q, k_cache, v_cache, *tables, output, lse)
    plan = module._plan_paged(64, tensors)
    assert isinstance(plan, module.GluonPagedPlan) and plan[2][1]["MALFORMED_ONLY"]
    # Pages 64 tokens and 8 elements apart (the contract's least page-stride step): not whole
    # tokens, so no flat view.
    padded = torch.empty(k_cache.shape[0], 64 * 1024 + 8, dtype=q.dtype)[:, : 64 * 1024]
    padded = padded.view(-1, 64, 8, 128)
    assert not isinstance(module._plan_paged(64, (q, padded, padded, *tables, output, lse)),
                          module.GluonPagedPlan)  # fmt: skip
    launches = []
    monkeypatch.setattr(module, "_cached_launch", lambda *call: launches.append(call))
    module.launch_paged(plan, q, k_cache, v_cache, *tables, sm_scale, output, lse)
    (kernel, grid, constexprs, _, _, args), (fa2_kernel, fa2_grid, fa2_constexprs, _, _,
                                             fa2_args) = launches  # fmt: skip
    ga = module.gluon_attention
    assert kernel is ga.gluon_paged_fwd and constexprs() == ga.CONSTEXPRS
    assert grid == ga.ragged_grid(2, 1000, module._sm_count(q.device))
    q_desc, k_desc, v_desc = args[:3]
    pages = k_cache.shape[0]
    assert (q_desc.shape, q_desc.block_shape) == ([1000, 4096], [64, 128])
    assert (k_desc.shape, k_desc.strides, k_desc.block_shape, k_desc.padding) == (
        [(pages - 1) * 128 + 64, 1024], [1024, 1], [64, 128], "nan")
    assert (v_desc.shape, v_desc.padding) == ([(pages - 1) * 128 + 64, 1024], "zero")
    assert k_desc.base is k_cache and v_desc.base is v_cache and args[3] is v_cache
    qo_indptr, kv_indptr, kv_indices, kv_last_page_len = tables
    assert args[4:] == (output, lse, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 2, 1000,
                        kv_indices.shape[0], pages, 128, 128, 4096, sm_scale * module.LOG2_E,
                        0, ga.item_counter(q.device))  # fmt: skip
    assert fa2_kernel is module.gqa_prefill_fwd and fa2_constexprs()["MALFORMED_ONLY"]
    assert fa2_grid == (16, 8)  # one wave for 17 slots, as the ragged plan's
    assert fa2_args[:9] == (q, k_cache, v_cache, output, lse, *tables)


def test_the_malformed_only_grid_is_one_wave():
    """_GLUON_FALLBACK's grid: at most one program an SM over its 8 head blocks (a program takes
    a whole SM: 255 registers x 8 warps), however many slots the batch has; fewer slots, one
    program a slot. 8 x 2048 tokens: 16 x 8 programs for 264 slots (was 264 x 8)."""
    module = entry_module("triton_ragged")
    cpu = torch.device("cpu")  # _sm_count: an H100's 132
    grid = functools.partial(module._malformed_only_grid, device=cpu)
    assert grid((2048 * 8 // 64 + 8, 8)) == (16, 8) and 16 * 8 <= module._sm_count(cpu)
    assert grid((17, 8)) == (16, 8) and grid((5, 8)) == (5, 8) and grid((0, 8)) == (0, 8)


def _malformed_only_runs(module, monkeypatch, plan_and_launch, q) -> list:
    """The MALFORMED_ONLY plan of plan_and_launch(output, lse) (which returns the plan) on 16
    SMs (2 x 8 programs, each running several slots of a batch of 4 slots) and on enough SMs for
    a program a slot (the full grid, as before it was looped): [(grid, [output, lse])] each, the
    outputs filled with -7 first (rows left unwritten show)."""
    runs = []
    for sms in (16, 10**4):
        monkeypatch.setattr(module, "_sm_count", lambda device, sms=sms: sms)
        output = torch.full_like(q, -7.0)
        lse = torch.full(q.shape[:2], -7.0, device=q.device)
        plan = plan_and_launch(output, lse)
        runs.append((plan[0], [output, lse]))
    (looped_grid, looped), (full_grid, full) = runs
    assert looped_grid == (2, 8) and full_grid == (4, 8)  # 100 // 64 + 3 slots
    for got, want in zip(looped, full):  # the same rows, bit for bit
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    return looped


@pytest.mark.parametrize("window_left", [None, 7])
def test_the_malformed_only_plan_leaves_a_partition_alone_and_takes_a_malformed_batch(
    window_left, monkeypatch
):
    """The FA-2 plan that follows the Gluon kernel (_GLUON_FALLBACK, run here on its own: on
    the CPU under the interpreter, on the GPU compiled), on a grid of fewer programs than slots:
    on a well-formed batch its programs decide before anything else and write nothing (the
    poison stays); on a malformed one each program runs several slots, doing what the full
    grid's program of each does (well-formed sequences computed, other rows NaN), bit for bit."""
    module = entry_module("triton_ragged")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    window = window_left is not None
    monkeypatch.setattr(module, "_sm_count", lambda device: 16)

    def plan_and_launch(inputs, output, lse):
        q, k, v, qo_indptr, kv_indptr, *_, sm_scale = inputs
        plan = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, output, lse,
                                   config=module._GLUON_FALLBACK, window=window)  # fmt: skip
        module.launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse,
                             window_left)  # fmt: skip
        return plan

    inputs = make_inputs(RaggedCase((30, 70), (50, 90), window_left=window_left), device, seed=2)
    output, lse = torch.full_like(inputs[0], -7.0), torch.full((100, 32), -7.0, device=device)
    assert plan_and_launch(inputs, output, lse)[0] == (2, 8)  # 2 programs for 100 // 64 + 2 slots
    assert (output == -7.0).all() and (lse == -7.0).all()

    for batch in (MALFORMED_SWA_BATCHES if window else MALFORMED_BATCHES)[::5]:
        inputs = malformed_inputs(batch, device, seed=3)
        looped = _malformed_only_runs(module, monkeypatch,
                                      lambda *outputs: plan_and_launch(inputs, *outputs),
                                      inputs[0])  # fmt: skip
        check_malformed_outputs(looped, malformed_expected(batch, inputs))


@pytest.mark.parametrize("name", ["kv_indptr_negative_length", "all_garbage"])
def test_the_malformed_only_paged_plan_runs_several_slots_a_program(name, monkeypatch):
    """The paged FA-2 plan that follows gluon_paged_fwd (page size 64), alone, on a malformed
    batch (indptr not a partition), 2 x 8 programs for 4 slots: what the full grid computes,
    bit for bit, and what the contract says."""
    module = entry_module("triton_paged_ps64")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, = (b for b in MALFORMED_PAGED_BATCHES if b.page_size == 64 and b.name == name)
    inputs = malformed_paged_inputs(batch, device, seed=4)
    q, k_cache, v_cache, *tables, sm_scale = inputs

    def plan_and_launch(output, lse):
        tensors = (q, k_cache, v_cache, *tables, output, lse)
        plan = module._plan_paged(64, tensors, config=module._GLUON_FALLBACK)
        module.launch_paged(plan, q, k_cache, v_cache, *tables, sm_scale, output, lse)
        return plan

    looped = _malformed_only_runs(module, monkeypatch, plan_and_launch, q)
    check_malformed_paged_outputs(looped, malformed_paged_expected(batch, inputs))


def test_gluon_takes_window_plans_from_gluon_min_window(monkeypatch):
    """run_ragged_swa on a call the Gluon kernel suits: a window below GLUON_MIN_WINDOW runs the
    FA-2 window kernel alone (all its programs); from GLUON_MIN_WINDOW on the Gluon kernel with
    that window_left, then the FA-2 window kernel for malformed batches only. Launches recorded
    (CPU tensors)."""
    runnable = build_solution("triton_swa")
    module = entry_module(runnable)
    launches = []
    monkeypatch.setattr(module, "INTERPRET", True)  # CPU tensors pass the placement check
    monkeypatch.setattr(module, "_gluon_suits", lambda *args: True)
    monkeypatch.setattr(module, "_window_plans", module.PlanCache())
    monkeypatch.setattr(module, "_cached_launch", lambda *call: launches.append(call))
    monkeypatch.setattr(module, "_launch", lambda grid, meta, runners, args: launches.append(
        ("fa2", meta, args)))  # fmt: skip
    case = RaggedCase((300, 700), (500, 4000), window_left=0)
    q, k, v, qo_indptr, kv_indptr, _, sm_scale = make_inputs(case, "cpu", seed=1)
    output, lse = poisoned_outputs(case, [q])
    width = module.GLUON_MIN_WINDOW
    for window_left in (width - 1, width, width - 1, width + 5):
        launches.clear()
        runnable(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse)
        if window_left < width:
            (tag, meta, args), = launches
            assert tag == "fa2" and meta["WINDOW"] and not meta.get("MALFORMED_ONLY")
        else:
            (kernel, _, constexprs, _, _, args), (tag, meta, fa2_args) = launches
            assert kernel is module.gluon_attention.gluon_ragged_fwd and constexprs()["WINDOW"]
            assert args[-2] == window_left and tag == "fa2" and meta["MALFORMED_ONLY"]
            args = fa2_args
        assert args[-1] == window_left


def test_which_workloads_take_the_gluon_kernel():
    """gluon_takes_batch on the committed workloads' sizes (the host's view: total_q, total_kv,
    batch): ragged and paged from 512 queries a sequence, or 128 in a call of 4M query-key
    pairs (prefix hits, the paged mixed batch); the short prompts, single-token rows and the
    two-chunk ragged batch (1.3M pairs) stay on the FA-2 kernel, and so do window batches below
    512 queries a sequence."""
    from prefill_bundle.workloads import PAGED_BATCHES, RAGGED_BATCHES, SWA_BATCHES

    module = entry_module("triton_ragged")
    takes = {}
    for batches, page_size in ((RAGGED_BATCHES, None), (PAGED_BATCHES, 64), (SWA_BATCHES, None)):
        for b in batches:
            total_kv = sum(b.kv_lens)
            if page_size:  # the host sees pages, not keys
                total_kv = sum(-(-n // page_size) for n in b.kv_lens) * page_size
            window = b in SWA_BATCHES
            takes[b.name] = module.gluon_takes_batch(len(b.q_lens), sum(b.q_lens), total_kv, window)
    gluon = {name for name, taken in takes.items() if taken}
    assert {"prompt_8k", "batch4_prompts_1k_3k", "mixed_short_and_long", "prefix_cache_hits_8x256",
            "mixed_batch", "chunked_prefill_2k_over_32k", "fresh_prompts_4x1k_3k"} <= gluon
    assert not {"single_token", "prompt_35", "batch15_short_prompts", "batch_with_empty_sequence",
                "chunked_prefill_with_prefix", "single_token_rows_16"} & gluon
    assert not module.gluon_takes_batch(8, 2048, 0)  # no keys
    assert not module.gluon_takes_batch(8, 2048, 36000, window=True)  # 256 a sequence
    assert module.gluon_takes_batch(1, 512, 512, window=True)
