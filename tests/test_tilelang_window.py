"""The TileLang sliding-window solution (tilelang_swa, run_ragged_swa) without a GPU, and on one.

1. The window program (bfloat16: COMPILED_WINDOW_VARIANTS) lowers and compiles for sm_90a
   here: the causal ragged program with window_left a kernel argument, each item's keys moved
   to its band's first key tile, the left-edge and diagonal tiles masked, the interior
   unmasked; wgmma, TMA, no spills.
2. The same program's CPU stand-in (the pipelined program, made local: see
   test_tilelang_compile.py) behind the packed entry point matches the reference on the shared
   window cases (windows 0, 1, short, longer than a sequence or than all of them, -1, seq_q >
   seq_kv, empty sequences, a negative scale) with the solution's tiles and small ones, so
   that the band's edges cut tiles anywhere. -1 and windows as long as all the keys run the
   causal kernel; the tests check which kernel ran. Not the Hopper lowering: the GPU matrix
   (tests/test_solutions.py -k tilelang_swa) runs the warp-specialized program.
3. On a GPU: fused-QKV views and the persistent scheduler's counters across window launches.
"""

import functools
import sys

import pytest
import torch
from test_tilelang_compile import (
    compile_fresh,
    cpu_programs,
    entry_module,
)

from prefill_bundle.packing import SOLUTIONS
from prefill_bundle.testing import (
    CPU_SWA_CASES,
    RaggedCase,
    check_outputs,
    fused_qkv_inputs,
    make_inputs,
    reference_outputs,
    run_solution,
    tilelang_kernels,
)

F16 = torch.float16
HAS_CUDA = torch.cuda.is_available()
SOLUTION = "tilelang_swa"
needs_packed = pytest.mark.skipif(
    SOLUTION not in {s.name for s in SOLUTIONS},
    reason="prefill_bundle/packing.py lists no TileLang sliding-window solution",
)


# 1. Compilation for the H100, once per variant and session -----------------------------------

_compiled = {}


def compiled(dtype: str):
    """(device source, host source, ptxas report) of a window variant."""
    if dtype not in _compiled:
        kernel, ptxas = compile_fresh(tilelang_kernels(), dtype, True, window=True)
        _compiled[dtype] = (kernel.get_kernel_source(), kernel.adapter.get_host_source(), ptxas)
    return _compiled[dtype]


def test_window_variants_cover_both_dtypes():
    assert set(tilelang_kernels().WINDOW_VARIANTS) == {"float16", "bfloat16"}


# The variant compiled for sm_90a here (~40 s on CI's 2 cores): the sliding-window definition's
# bfloat16. The float16 one is the same program with another wgmma operand type
# (tests/test_tilelang_compile.py compiles float16 for the non-causal program); it runs in the
# GPU matrix (tests/test_solutions.py -k tilelang_swa, test_window_on_gpu_with_fused_qkv_views).
COMPILED_WINDOW_VARIANTS = ["bfloat16"]


@pytest.mark.parametrize("dtype", COMPILED_WINDOW_VARIANTS)
def test_window_compiles_for_sm90a(dtype):
    source, host, _ = compiled(dtype)
    operand = {"float16": "kFloat16", "bfloat16": "kBFloat16"}[dtype]
    assert f"tl::wgmma_ss<tl::DataType::{operand}, tl::DataType::{operand}" in source  # Q K^T
    assert f"tl::wgmma_rs<tl::DataType::{operand}, tl::DataType::{operand}" in source  # P V
    assert "tl::tma_load(K_desc" in source and "tl::tma_load(V_desc" in source
    assert "tl::warpgroup_reg_dealloc<24>" in source
    assert "int window_left" in source  # a runtime argument: one kernel for every window
    assert "tl::__named_barrier_arrive(" not in source  # no pingpong (block_config)
    # The item's keys start at its band's first key tile (128-key tiles).
    assert "max((((tile[4] + tile[3]) - tile[1]) - window_left), 0) >> 7) * 128" in source
    # The band's left edge: masked tiles, then the unmasked interior, then the diagonal.
    assert source.count("- window_left) <= ") == 3  # tile 0, left-edge loop, diagonal loop
    for name in ("q", "k", "v"):
        assert f"(((int64_t){name}_stride) * (int64_t)2)" in host


@pytest.mark.parametrize("dtype", COMPILED_WINDOW_VARIANTS)
def test_window_compiles_without_register_spills(dtype):
    """Producer 24 registers, consumers 240 (setmaxnreg), as the causal kernel: the window's
    third key loop and its masks must not make ptxas spill."""
    _, _, ptxas = compiled(dtype)
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


# 2. The TileLang program on the CPU behind the packed entry point -----------------------------


@pytest.fixture(scope="module")
def cpu_window_kernels(tmp_path_factory):
    get = cpu_programs(tmp_path_factory, "window")
    return lambda window, config: get(config, window=window)


def _launcher(kernel):
    """A stand-in for the compiled CUDA kernel with the same arguments (window_left among the
    scalars of the window kernel); bfloat16 via float16, token-strided q, k, v via copies."""

    def launch(q, k, v, *rest):
        *scalars, output, lse, scheduler = rest
        q, k, v = (x.to(F16).contiguous() for x in (q, k, v))
        output16 = output if output.dtype == F16 else torch.empty_like(output, dtype=F16)
        kernel(q, k, v, *scalars, output16, lse, scheduler)
        output.copy_(output16)

    return launch


# The solution's tiles, and small ones so that the small cases cross many tile boundaries
# (block_M != block_N both ways).
CPU_WINDOW_CONFIGS = {
    "solution_tiles": None,
    "tiles16x32": dict(block_M=16, block_N=32, num_stages=2),
    "tiles32x16": dict(block_M=32, block_N=16, num_stages=2),
}


def run_window_on_cpu(monkeypatch, kernels, config: str) -> list:
    """Point the packed entry at the CPU program with config's tiles, its device checks told
    that CPU tensors are fine, and no plan from an earlier test; returns the list of kernels
    launched (True: the window kernel, False: the causal one)."""
    entry = entry_module(SOLUTION)
    block_config = tilelang_kernels().block_config
    launched = []

    def kernel(dtype, causal, device, page_size=None, window=False, long_keys=False):
        assert causal and page_size is None and not (window and long_keys)
        tiles = CPU_WINDOW_CONFIGS[config]
        if tiles is None:  # the ws program's tiles through the pipelined one
            tiles = dict(block_config(entry._DTYPES[dtype], causal))
            for knob in ("ws", "pingpong", "persistent"):
                tiles.pop(knob, None)
        launch = _launcher(kernels(window, tiles))

        def run(*args):
            launched.append(window)
            launch(*args)

        return run

    contract = sys.modules[entry.__name__.rpartition(".")[0] + ".arguments"]
    for name in ("check_layout", "check_placement"):
        check = functools.partial(getattr(contract, name), interpreted=True)
        monkeypatch.setattr(entry, name, check)
    monkeypatch.setattr(entry, "_kernel", kernel)
    monkeypatch.setattr(entry, "_ragged_plans", contract.PlanCache())
    monkeypatch.setattr(entry, "_swa_plans", contract.PlanCache())
    monkeypatch.setattr(entry, "_scheduler", lambda device: torch.zeros(2, dtype=torch.int32))
    return launched


# Beyond the shared cases: a window longer than one sequence's keys but not all (the window
# kernel runs), edges on the tile grid, a window of one tile less one.
CPU_WINDOW_CASES = CPU_SWA_CASES + [
    RaggedCase((130, 5), (130, 100), window_left=110),
    RaggedCase((70, 3), (100, 64), F16, window_left=32),
    RaggedCase((48,), (80,), window_left=15),
]


def uses_window_kernel(case) -> bool:
    return 0 <= case.window_left < sum(case.kv_lens)


def window_params():
    """Every case at the small tiles (the causal ones, -1 and windows past all keys, only at the
    solution's: test_tilelang_compile.py runs that kernel at every tile size), and a few at the
    solution's tiles, which run slowly on the CPU."""
    params = []
    for case in CPU_WINDOW_CASES:
        small = [c for c in CPU_WINDOW_CONFIGS if c != "solution_tiles"]
        at_solution_tiles = not uses_window_kernel(case) or case.window_left in (17, 110)
        configs = (small if uses_window_kernel(case) else []) + (
            ["solution_tiles"] if at_solution_tiles else []
        )
        params += [pytest.param(case, c, id=f"{case.id}-{c}") for c in configs]
    return params


@needs_packed
@pytest.mark.parametrize("case,config", window_params())
def test_window_program_on_cpu_matches_reference(case, config, cpu_window_kernels, monkeypatch):
    launched = run_window_on_cpu(monkeypatch, cpu_window_kernels, config)
    inputs = make_inputs(case, "cpu")
    check_outputs(run_solution(SOLUTION, case, make_inputs(case, "cpu")),
                  reference_outputs(case, inputs))  # fmt: skip
    if sum(case.q_lens):
        assert launched == [uses_window_kernel(case)]


@needs_packed
def test_window_entry_takes_fused_qkv_views_and_a_tensor_window_on_cpu(
    cpu_window_kernels, monkeypatch
):
    """q, k, v sliced out of one QKV projection, and window_left a 0-d int tensor."""
    launched = run_window_on_cpu(monkeypatch, cpu_window_kernels, "tiles16x32")
    case = RaggedCase((40, 9), (40, 9), F16, window_left=6)
    inputs = make_inputs(case, "cpu", seed=5)
    views = fused_qkv_inputs(inputs)
    views[5] = torch.tensor(case.window_left)
    check_outputs(run_solution(SOLUTION, case, views), reference_outputs(case, inputs))
    assert launched == [True]


# 3. On a GPU ----------------------------------------------------------------------------------


@needs_packed
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_window_on_gpu_with_fused_qkv_views():
    for seed, case in enumerate([
        RaggedCase((3000, 2048), (3000, 9000), window_left=127),
        RaggedCase((1,), (1,), window_left=0),
        RaggedCase((700, 129), (700, 1000), F16, window_left=255),
    ]):  # fmt: skip
        inputs = make_inputs(case, "cuda", seed)
        actual = run_solution(SOLUTION, case, fused_qkv_inputs(inputs))
        check_outputs(actual, reference_outputs(case, inputs))


@needs_packed
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_window_launches_reset_the_scheduler():
    """The window kernel is persistent too: each launch must leave its work counters zero, or
    the next one skips items (poisoned outputs show that). Window and causal launches of
    different sizes back to back."""
    cases = [
        RaggedCase((300, 1, 0, 129), (300, 40, 7, 129), window_left=64),
        RaggedCase((300, 1, 0, 129), (300, 40, 7, 129)),
        RaggedCase((4096,), (4096,), window_left=1000),
        RaggedCase((4096,), (4096,), window_left=-1),
        RaggedCase((77, 5), (500, 5), window_left=0),
    ]
    for seed, case in enumerate(cases):
        name = "tilelang_ragged" if case.window_left is None else SOLUTION
        inputs = make_inputs(case, "cuda", seed)
        actual = run_solution(name, case, make_inputs(case, "cuda", seed))
        check_outputs(actual, reference_outputs(case, inputs))
    torch.cuda.synchronize()
    for name in ("tilelang_ragged", SOLUTION):
        for counters in entry_module(name)._schedulers.values():
            assert counters.tolist() == [0, 0]
