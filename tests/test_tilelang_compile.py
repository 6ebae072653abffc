"""The TileLang solutions without a GPU.

1. Each program (causal, non-causal) lowers and compiles for sm_90a here, in one dtype each
   (COMPILED_VARIANTS), and its CUDA source has the Hopper path: asynchronous K/V loads (TMA
   from a producer warp), wgmma for Q K^T (both operands in shared memory) and for P V (P from
   registers), and the malformed-batch path (checks shared out over warp lanes, NaN rows). A
   token stride changes no device code.
2. The same TileLang program, its allocations made local and its grid a loop nest, runs through
   TileLang's C backend behind the packed entry points on the shared CPU cases, fused-QKV and
   malformed batches included. That checks the program's own arithmetic (tile-to-sequence
   search, causal bounds, masks, empty rows, guarded stores, the malformed-batch tests and
   poisoning) and the entry points' host logic, not the Hopper lowering.
3. The argument checks raise a ValueError naming the argument, before anything touches CUDA.
"""

import functools
import itertools
import math
import re
import sys
from types import SimpleNamespace

import pytest
import tilelang
import torch

from prefill_bundle.testing import (
    CPU_FUSED_CASES,
    CPU_NAN_CASES,
    CPU_PADDED_CASES,
    CPU_RAGGED_CASES,
    MALFORMED_BATCHES,
    MalformedBatch,
    PaddedCase,
    RaggedCase,
    build_solution,
    build_solution_object,
    check_malformed_outputs,
    check_outputs,
    compile_fresh,
    entry_module,
    fused_qkv_inputs,
    load_script,
    make_inputs,
    malformed_expected,
    malformed_inputs,
    nan_neighbour_inputs,
    reference_outputs,
    rewritten_kernel_module,
    run_solution,
    tilelang_kernels,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


# 1. Compilation for the H100, once per variant and session -----------------------------------

_compiled = {}


def compiled_kernel(dtype: str, causal: bool, long_keys: bool = False, short_keys: bool = False):
    """(kernel, ptxas report) of a variant, compiled once per session (long_keys: its program
    for launches of long sequences; short_keys: the non-causal one for short sequences)."""
    key = (dtype, causal, long_keys, short_keys)
    if key not in _compiled:
        config = {"long_keys": True} if long_keys else {}
        config.update({"short_keys": True} if short_keys else {})
        _compiled[key] = compile_fresh(tilelang_kernels(), dtype, causal, **config)
    return _compiled[key]


def compiled(dtype: str, causal: bool):
    """(device source, host source, ptxas report) of a variant."""
    kernel, ptxas = compiled_kernel(dtype, causal)
    return kernel.get_kernel_source(), kernel.adapter.get_host_source(), ptxas


def test_variants_cover_both_entry_points():
    variants = set(tilelang_kernels().VARIANTS)
    assert {("float16", True), ("bfloat16", True)} <= variants  # run_ragged: causal only
    assert {(d, c) for d in ("float16", "bfloat16") for c in (True, False)} <= variants
    assert set(COMPILED_VARIANTS) <= variants


# The variants compiled for sm_90a here (each ~30 s on CI's 2 cores): one per program, the
# causal (persistent, 128-key tiles) and the non-causal one (176-key tiles), in the dtype of
# the definition that runs it most: the ragged definition's bfloat16, the padded one's float16.
# block_config takes no dtype (the tiles, schedule and register split are the same); the dtype
# changes the wgmma operand type, which each dtype's compile checks once. Every variant runs in
# the GPU matrix (tests/test_solutions.py -k tilelang).
COMPILED_VARIANTS = [("bfloat16", True), ("float16", False)]


def proxy_fenced_waits(source: str) -> dict:
    """The consumers' waits on the ring's and Q's full barriers, in source order: {barrier:
    [whether TileLang's proxy fence is the next statement, ...]}. wgmma reads shared memory
    through the async proxy, so a slot cp.async wrote (the generic proxy) needs the fence
    between the wait and the wgmma (PTX ISA, wgmma's async proxy); TMA's writes do not."""
    lines = [line.strip() for line in source.splitlines()]
    waits = {}
    for i, line in enumerate(lines):
        wait = re.match(r"(k_full|v_full|q_full)\[.*\]\.wait\(", line)
        if wait:
            fenced = lines[i + 1] == "tl::fence_proxy_async();"
            waits.setdefault(wait.group(1), []).append(fenced)
    return waits


def check_v_tail_fence(source: str):
    """TMA fills every K and V slot but an item's last V (the tail's or a partial page's
    cp.async): only that wait is fenced."""
    waits = proxy_fenced_waits(source)
    assert len(waits["v_full"]) >= 2 and waits["v_full"][-1], waits
    assert not any(waits["v_full"][:-1]) and not any(waits["k_full"]), waits


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_compiles_for_sm90a_with_async_loads_and_wgmma(dtype, causal):
    source, _, _ = compiled(dtype, causal)
    operand = {"float16": "kFloat16", "bfloat16": "kBFloat16"}[dtype]
    if tilelang_kernels().block_config(dtype, causal).get("ws"):
        assert "tl::tma_load(" in source  # a producer warp loads K/V by TMA ...
        assert "tl::warpgroup_reg_dealloc<24>" in source  # ... holding few registers
        # ... but a sequence's last V tile by cp.async, zeros past its keys (the next
        # sequence's V may hold NaN: 0 x NaN in P V), once, after the slot's wait.
        block_n = tilelang_kernels().block_config(dtype, causal)["block_N"]
        assert source.count(f"tl_copy_v_tail<{block_n}, ") == 1  # V_TAIL_COPY, its one call
        assert source.count("tl::mbarrier_cp_async_arrive(v_full") == 1
        check_v_tail_fence(source)  # ... fenced before its P V
    else:
        assert "tl::cp_async_gs_conditional<16>(" in source  # 16-byte async copies, bounded
    assert f"tl::wgmma_ss<tl::DataType::{operand}, tl::DataType::{operand}" in source  # Q K^T
    assert f"tl::wgmma_rs<tl::DataType::{operand}, tl::DataType::{operand}" in source  # P V
    assert "exp2" in source
    # Causal: the warpgroups take turns issuing their GEMMs (block_config's pingpong).
    assert ("tl::__named_barrier_arrive(" in source) == causal


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_v_tail_copy_starts_where_the_swizzled_layout_puts_each_lane(dtype, causal):
    """V_TAIL_COPY derives every row's place in V_shared from the lane's first chunk, assuming
    TileLang's layout for it is the 128-byte swizzle (16-byte chunk c of row r of a 64-column
    half at c ^ (r % 8); halves of block_N rows, stages of two halves). The address TileLang
    passes for that chunk, evaluated for each lane of the producer warp and each ring stage,
    must be the one that layout gives (a TileLang that laid V_shared out otherwise fails here,
    not only on the GPU)."""
    source, _, _ = compiled(dtype, causal)
    block_n = tilelang_kernels().block_config(dtype, causal)["block_N"]
    call = re.search(r"tl_copy_v_tail<\d+, \w+>\(\(&\(\(\(\w+\*\)V_shared\)\[(.*?)\]\)\),", source)
    expression = call.group(1).replace("(int)", "")
    assert set(re.findall(r"[A-Za-z_]\w*", expression)) == {"g", "threadIdx", "x"}, expression
    producer = SimpleNamespace(x=0)
    for stage in range(2):
        for lane in range(32):
            producer.x = 256 + lane  # the producer warp follows the 256 consumer threads
            got = eval(expression, {"g": stage, "threadIdx": producer})  # noqa: S307
            row, chunk = lane // 16, lane % 16
            half, c = chunk // 8, chunk % 8
            want = (stage * 2 + half) * block_n * 64 + row * 64 + (c ^ (row % 8)) * 8
            assert got == want, (stage, lane, got, want)


def test_persistent_output_buffer_takes_stmatrix_without_bank_conflicts():
    """The causal (persistent) program stages its output in its own shared buffer with
    stmatrix: each 8x8 matrix's 8 row addresses (lanes 8m .. 8m + 7) must fall in 8 distinct
    16-byte bank groups. Unswizzled, its rows were 256 bytes apart, all in one group (8x the
    shared wavefronts, ~6% of 8x2048 causal on the H100: tilelang/TUNING.md)."""
    source = compiled("bfloat16", True)[0]
    stores = re.findall(r"ptx_stmatrix_m8n8_x4\(\(&\(\(\(\w+\*\)O_shared\)\[(.*?)\]\)\)", source)
    assert stores, "the output is staged with stmatrix"
    for index, step, matrix in itertools.product(stores, range(8), range(4)):
        expression = re.sub(r"\bi_\d+\b", str(step), index)  # the unrolled loop's steps
        groups = {
            eval(expression.replace("((int)threadIdx.x)", str(lane))) * 2 // 16 % 8
            for lane in range(8 * matrix, 8 * matrix + 8)
        }  # fmt: skip
        assert len(groups) == 8, (index, step, matrix, groups)


def test_non_causal_program_is_persistent_with_its_output_in_q():
    """128 x 176 tiles leave no room for an output buffer, so the persistent non-causal program
    stages its output in Q's buffer (output_in_q): Q's buffer is released after the epilogue's
    last read of it, behind a proxy fence (the next Q is a TMA write), not after the item's last
    Q K^T as where the output has a buffer of its own (a Q landing there would overwrite rows
    still being written out)."""
    config = tilelang_kernels().block_config("float16", False)
    assert config["persistent"] and config["output_in_q"]
    source = compiled("float16", False)[0]
    assert "AtomicAddRet((&(Scheduler[0])), 1)" in source  # items drawn from the counter
    q_load = re.search(r"tl::tma_load\(Q_desc, q_full\[0\], \(&\(\(\(\w+\*\)(\w+)\)", source)
    assert q_load and q_load.group(1) == "O_shared"  # Q lands in the staging buffer: one buffer
    arrives = [m.start() for m in re.finditer(r"q_empty\[0\]\.arrive\(\);", source)]
    assert len(arrives) == 1, arrives
    before = source[: arrives[0]]
    assert before.rstrip().endswith("tl::fence_proxy_async();")
    assert before.rfind("*(uint4*)(Output + ") > before.rfind("ptx_stmatrix"), "after the stores"
    # The causal program keeps its own buffer and releases Q after the last Q K^T.
    causal = compiled("bfloat16", True)[0]
    assert causal.count("q_empty[0].arrive();") == 1
    assert causal.index("q_empty[0].arrive();") < causal.rindex("ptx_stmatrix")


def test_short_keys_rule_takes_short_non_causal_sequences_only():
    """Measured (TUNING.md, "Short non-causal sequences"): 128-key tiles ahead up to 4096 keys,
    176-key ones from 16K; causal launches have one config."""
    rule = entry_module("tilelang_mini").short_keys_launch
    assert rule(512, False) and rule(1, False) and rule(4096, False)
    assert not rule(4097, False) and not rule(16384, False) and not rule(512, True)


def test_short_keys_program_runs_the_causal_tiles_with_its_own_output_buffer():
    """block_config's short_keys: the non-causal program on 128-key tiles with an output buffer
    of its own (Q released after the item's last Q K^T, as in the causal program), 0 spills."""
    kernels = tilelang_kernels()
    config = kernels.block_config("float16", False, short_keys=True)
    assert config["block_N"] == 128 and not config.get("output_in_q")
    assert kernels.block_config("float16", True, short_keys=True) == kernels.block_config(
        "float16", True
    )  # fmt: skip
    kernel, ptxas = compiled_kernel("float16", False, short_keys=True)
    source = kernel.get_kernel_source()
    assert "AtomicAddRet((&(Scheduler[0])), 1)" in source  # persistent
    assert source.count("tl_copy_v_tail<128, ") == 1  # 128-key tiles (the tail copy's rows)
    assert source.count("q_empty[0].arrive();") == 1
    assert source.index("q_empty[0].arrive();") < source.rindex("ptx_stmatrix")
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_compiles_without_register_spills(dtype, causal):
    """The consumer warpgroups run on 240 registers and the producer warp on 24 (setmaxnreg),
    both near their limits: code added anywhere in the kernel (the malformed-batch path was) can
    make ptxas spill, into the K/V loops too."""
    _, _, ptxas = compiled(dtype, causal)
    assert "Used 168 registers" in ptxas  # the launch bound; setmaxnreg then splits them
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


# The programs for launches of long sequences (long_keys: the entry picks them when the keys
# average LONG_KEYS_MIN a sequence): the same two, their items drawn in L2 sections always.
# Spill bytes allowed: the causal one's draw spills one 8-byte slot of the loader warp's 24
# registers (reloaded once an item); the same draw decided at run time spilled the contiguous
# programs everywhere (TUNING.md, "Items in L2 sections").
LONG_KEYS_SPILL_BYTES = {("bfloat16", True): 8, ("float16", False): 0}


def test_long_keys_rule_takes_long_sequences_only():
    """Measured (TUNING.md, "Items in L2 sections for contiguous K/V"): sections gain from a 2K
    chunk over 8131 keys up and lose on sequences of 2-4.6K keys."""
    rule = entry_module("tilelang_ragged").long_keys_launch
    assert rule(8131, 1) and rule(16384, 1) and rule(4 * 14932, 4)
    assert not rule(8 * 2048, 8) and not rule(37907, 8) and not rule(7820, 4)
    assert not rule(0, 0)


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_long_keys_programs_draw_in_sections(dtype, causal):
    kernel, ptxas = compiled_kernel(dtype, causal, long_keys=True)
    source = kernel.get_kernel_source()
    assert "int run = (fetch[0] >> 3);" in source  # runs of SECTION_HEADS = 8 heads
    assert "kv_rows >>" not in source  # always: the entry chose the program by the rule
    assert "Used 168 registers" in ptxas
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas)]
    assert spills and max(spills) <= LONG_KEYS_SPILL_BYTES[(dtype, causal)], ptxas


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_compiles_the_malformed_batch_path(dtype, causal):
    """The first consumer warp tests the batch (once per block) and, in a malformed batch only,
    each item's tile, its lanes sharing the scan and ANDing it by a vote; the producer waits for
    both verdicts; rows are poisoned with NaN in output and lse."""
    source, _, _ = compiled(dtype, causal)
    assert source.count("__all_sync(") == 2
    assert "batch_checked[0].wait(0);" in source and "item_checked[" in source
    assert "std::numeric_limits<" in source and ">::quiet_NaN();" in source  # output rows
    assert "] = CUDART_NAN_F;" in source  # lse rows


@pytest.mark.parametrize("dtype,causal", COMPILED_VARIANTS)
def test_token_strides_reach_the_tma_descriptors(dtype, causal):
    """The host code reads each of q, k and v's token stride from the tensor on every call and
    gives it to that tensor's TMA descriptor (in bytes): any stride, no copy."""
    _, host, _ = compiled(dtype, causal)
    for name in ("q", "k", "v"):
        assert f"int32_t {name}_stride = " in host
        assert f"(((int64_t){name}_stride) * (int64_t)2)" in host


# The kernel's token-strided declaration of q, k and v, and a contiguous one.
_STRIDED = "T.StridedTensor([rows, heads, HEAD_DIM], [token_stride, HEAD_DIM, 1], dtype)"
_CONTIGUOUS = "T.Tensor([rows, heads, HEAD_DIM], dtype)"


def test_timeline_script_stamps_every_event_of_the_window_program(tmp_path):
    """scripts/tilelang_timeline.py's rewrites still find their anchors in the kernel's sources,
    and its stamped window program compiles for sm_90a with one stamp site per event and without
    spilling registers (stamped_kernels refuses a program that spills: the shipped ones do not,
    and a spilled one times another program; the stamps did spill until 2026-11-28 (12))."""
    timeline = load_script("tilelang_timeline")
    source = timeline.stamped_kernels(tmp_path, [(True, None)])[True, None].get_kernel_source()
    sites = re.findall(r"tl_stamp\((\d+)\);", source)
    events = [e for e in range(len(timeline.EVENTS)) if e != timeline.ITEMS]
    assert sorted(map(int, sites)) == events
    assert f"tl_stamp_value({timeline.ITEMS}, " in source
    assert source.count("tl_stamp_flush(") == 2  # its definition and the consumers' copy


def test_token_stride_changes_no_device_code(tmp_path):
    """Contiguous inputs run the code they ran before q, k and v took a token stride: the
    kernel declared contiguous compiles to the same CUDA source, but for V's row stride, which
    the zero-filled copy of a sequence's last V tile takes as an argument (a constant there)."""
    contiguous = rewritten_kernel_module(tmp_path, "contiguous", [(_STRIDED, _CONTIGUOUS)])
    kernel, _ = compile_fresh(contiguous, "bfloat16", True)
    strided = compiled("bfloat16", True)[0]
    row_bytes = "(uint)2048"  # 8 heads x 128 bfloat16
    assert strided.count("(((uint)v_stride) * (uint)2)") == 1
    assert strided.count("int total_q, int v_stride)") == 2  # declaration, definition
    as_contiguous = strided.replace("(((uint)v_stride) * (uint)2)", row_bytes).replace(
        "int total_q, int v_stride)", "int total_q)"
    )
    assert kernel.get_kernel_source() == as_contiguous


def test_entry_calls_the_kernels_entry_function():
    """The entry calls each kernel's tvm-ffi `main` (entry_function), not the JIT kernel, whose
    adapter spends ~5-7 us of Python a call before it makes the same call. A fresh compile's
    adapter holds a tvm.runtime.Executable, one loaded from TileLang's disk cache the runtime
    module itself: from both, the function is the kernel's host entry, whose argument check
    answers a call with no arguments (no GPU needed)."""
    fresh, _ = compiled_kernel(*COMPILED_VARIANTS[0])
    module = fresh.adapter.get_exportable_executable().jit()
    loaded = SimpleNamespace(adapter=SimpleNamespace(get_exportable_executable=lambda: module))
    entry_function = entry_module("tilelang_ragged").entry_function
    for kernel in (fresh, loaded):
        main = entry_function(kernel)
        with pytest.raises(RuntimeError, match="main: num_args should be 10"):
            main()


def test_variant_solutions_carry_their_knobs():
    """scripts/tilelang_variant.py: a variant is a solution of its own whose kernels take the
    knobs on top of the shipped block_config; the shipped solution's are untouched."""
    script = load_script("tilelang_variant")
    knobs = dict(num_stages=3, persistent=False)
    solution = script.variant("tilelang_ragged", knobs)
    assert solution.name == "tilelang_ragged__num_stages_3_persistent_False"
    kernels = tilelang_kernels(build_solution_object(solution))
    shipped = tilelang_kernels().block_config("bfloat16", True)
    assert kernels.block_config("bfloat16", True) == {**shipped, **knobs}
    assert shipped["num_stages"] != 3 and shipped["persistent"]
    # --pack: the packed (decode-like) programs' pack_config instead, block_config untouched.
    knobs = dict(block_N=64, num_stages=3)
    solution = script.variant("tilelang_fp8kv", knobs, pack=True)
    assert solution.name == "tilelang_fp8kv__pack_block_N_64_num_stages_3"
    kernels = tilelang_kernels(build_solution_object(solution))
    shipped_pack = tilelang_kernels().pack_config()
    assert kernels.pack_config() == {**shipped_pack, **knobs}
    assert shipped_pack["block_N"] != 64 and shipped_pack["num_stages"] != 3
    assert kernels.block_config("bfloat16", True) == shipped


# 2. The TileLang program on the CPU behind the packed entry points ---------------------------

# (pattern in the kernel source, its CPU form): the C backend runs the grid as loops, one tile
# program at a time, on local buffers only; T.Parallel over local buffers becomes a serial grid.
# Its wrapper cannot pass a symbolic stride: q, k and v are declared contiguous (and _launcher
# makes them so).
_CPU_FORM = [
    ("T.alloc_shared(", "T.alloc_local("),
    ("T.alloc_fragment(", "T.alloc_local("),
    ("T.Parallel(", "T.grid("),
    (", annotations=ASYNC_COPY)", ")"),  # cp.async hints of the paged loads: T.grid takes none
    (", threads=threads)", ")"),
    (_STRIDED, _CONTIGUOUS),
    # The paged caches likewise (pages dense) and the page strides' assumption with them.
    (
        "T.StridedTensor(cache_shape, [page_stride, slot_stride, HEAD_DIM, 1], element)",
        "T.Tensor(cache_shape, element)",
    ),
    ("T.assume(k_page_stride % 8 == 0)", "pass"),
    ("T.assume(v_page_stride % 8 == 0)", "pass"),
]


# tilelang.compile's arguments for the C stand-in. TileLang runs g++ on it without -O, where
# each float16 operation (half.hpp's class) is a function call: at -O2 the programs run ~9x
# faster (test_tilelang_paged.py's CPU tests: 389 s in the kernels at -O0, 44 s at -O2, for
# ~1 s more g++ a program; CI's time budget). Same arithmetic: no -ffast-math, and no FMA
# contraction (-ffp-contract=off, as at -O0).
_CPU_COMPILE = dict(
    target="c",
    execution_backend="cython",
    pass_configs={"tirx.disable_vectorize": True},  # no vector half casts in C
    compile_flags=["-O2", "-ffp-contract=off"],
)


def cpu_programs(tmp_path_factory, tag: str, rewrites=()):
    """The kernel module rewritten for the C stand-in (shared by the TileLang test files; more
    (pattern, replacement) pairs in rewrites); returns get(config, causal=True, **variant):
    gqa_prefill's program for that variant and tile config, compiled for the CPU once per test
    module."""
    folder = tmp_path_factory.mktemp(f"tilelang_{tag}_cpu")
    module = rewritten_kernel_module(folder, f"gqa_prefill_{tag}_cpu", [*_CPU_FORM, *rewrites])
    cache = {}

    def get(config: dict, causal: bool = True, **variant):
        key = (causal, tuple(sorted(variant.items())), tuple(sorted(config.items())))
        if key not in cache:
            # The C backend has no bfloat16 locals: the CPU program runs in float16.
            func = module.gqa_prefill("float16", causal, **variant, **config)
            cache[key] = tilelang.compile(func, **_CPU_COMPILE)
        return cache[key]

    def beside(name: str, program):
        """A program beside the attention's (float16), compiled for the CPU once per module."""
        if name not in cache:
            cache[name] = tilelang.compile(program("float16"), **_CPU_COMPILE)
        return cache[name]

    get.merge = lambda: beside("merge", module.merge_shares)  # split-KV's merge
    get.gather = lambda: beside("gather", module.gather_pages)  # page size 1's page gather
    return get


@pytest.fixture(scope="module")
def cpu_kernels(tmp_path_factory):
    get = cpu_programs(tmp_path_factory, "kernel")
    # long_keys only when set: get() keys its cache on the variant's keywords
    return lambda causal, config, long_keys=False: get(
        config, causal=causal, **({"long_keys": True} if long_keys else {})
    )


def _launcher(kernel):
    """A stand-in for the compiled CUDA kernel with the same arguments; bfloat16 via float16,
    token-strided q, k, v via contiguous copies."""

    def launch(q, k, v, qo_indptr, kv_indptr, kv_rows, sm_scale, output, lse, scheduler):
        q, k, v = (x.to(F16).contiguous() for x in (q, k, v))
        output16 = output if output.dtype == F16 else torch.empty_like(output, dtype=F16)
        kernel(q, k, v, qo_indptr, kv_indptr, kv_rows, sm_scale, output16, lse, scheduler)
        output.copy_(output16)

    return launch


# The solution's own tiles, and small ones so that the small cases cross many tile boundaries
# (block_M != block_N both ways).
CPU_CONFIGS = {
    "solution_tiles": None,
    "tiles16x32": dict(block_M=16, block_N=32, num_stages=2),
    "tiles32x16": dict(block_M=32, block_N=16, num_stages=2),
}


def cpu_form_of(config: dict) -> dict:
    """The warp-specialized program (ws) indexes threads and barriers, which the C backend cannot
    run; on the CPU its tiles run through the pipelined program, whose tile arithmetic (sequence
    search, causal bounds, masks, guarded stores) is the same. The ws program itself runs in the
    GPU matrix (tests/test_solutions.py -k tilelang)."""
    config = dict(config)
    if config.pop("ws", False):
        config.update(overlap=True)
    config.pop("pingpong", None)
    config.pop("persistent", None)
    config.pop("output_in_q", None)
    return config


def run_on_cpu(monkeypatch, cpu_kernels, solution: str, config: str, launched=None) -> None:
    """Point the packed entry `solution` at the CPU program, with config's tiles, its device
    checks told that CPU tensors are fine, and no plan from an earlier test. launched: a list
    that gets each kernel's (causal, long_keys) as the entry asks for it."""
    entry = entry_module(solution)
    block_config = tilelang_kernels().block_config

    def kernel(dtype, causal, device, long_keys=False, short_keys=False):
        if launched is not None:
            launched.append((causal, long_keys))
        shipped = block_config(entry._DTYPES[dtype], causal, short_keys=short_keys)
        tiles = CPU_CONFIGS[config] or cpu_form_of(shipped)
        return _launcher(cpu_kernels(causal, tiles, long_keys))

    contract = sys.modules[entry.__name__.rpartition(".")[0] + ".arguments"]
    for name in ("check_layout", "check_placement"):
        check = functools.partial(getattr(contract, name), interpreted=True)
        monkeypatch.setattr(entry, name, check)
    monkeypatch.setattr(entry, "_kernel", kernel)
    monkeypatch.setattr(entry, "_padded_plans", contract.PlanCache())
    monkeypatch.setattr(entry, "_ragged_plans", contract.PlanCache())
    monkeypatch.setattr(entry, "_scheduler", lambda device: torch.zeros(2, dtype=torch.int32))


def solution_of(case) -> str:
    return "tilelang_mini" if isinstance(case, PaddedCase) else "tilelang_ragged"


# No key rows at all: the kernel runs on a stand-in K/V row that no sequence may see.
CPU_CASES = CPU_PADDED_CASES + CPU_RAGGED_CASES + [RaggedCase((5, 3), (0, 0))]
SMALL_TILES = [name for name in CPU_CONFIGS if name != "solution_tiles"]


def rotating_params(items, configs, ids):
    """Each item under `configs` taken in turn (CI's time budget: the stand-in runs a case in
    seconds on 2 cores); every config still meets every kind of item across the list."""
    return [
        pytest.param(item, configs[i % len(configs)], id=f"{ids(item)}-{configs[i % len(configs)]}")
        for i, item in enumerate(items)
    ]


@pytest.mark.parametrize(
    "case,config",
    rotating_params(CPU_CASES, ["solution_tiles"], lambda c: c.id)
    + rotating_params(CPU_CASES, SMALL_TILES, lambda c: c.id),
)
def test_program_on_cpu_matches_reference(case, config, cpu_kernels, monkeypatch):
    run_on_cpu(monkeypatch, cpu_kernels, solution_of(case), config)
    inputs = make_inputs(case, "cpu")
    check_outputs(
        run_solution(solution_of(case), case, make_inputs(case, "cpu")),
        reference_outputs(case, inputs),
    )


@pytest.mark.parametrize("case", CPU_FUSED_CASES, ids=lambda c: c.id)
def test_entry_takes_fused_qkv_views_on_cpu(case, cpu_kernels, monkeypatch):
    """q, k, v sliced out of one QKV projection pass the checks and reach the kernel as rows at
    their token stride (the padded ones through a 3-d view of their own)."""
    run_on_cpu(monkeypatch, cpu_kernels, solution_of(case), "tiles16x32")
    inputs = make_inputs(case, "cpu", seed=5)
    actual = run_solution(solution_of(case), case, fused_qkv_inputs(inputs))
    check_outputs(actual, reference_outputs(case, inputs))


@pytest.mark.parametrize(
    "case,config",
    [(case, config) for case in CPU_NAN_CASES for config in ("solution_tiles", "tiles32x16")],
    ids=lambda x: getattr(x, "id", x),
)
def test_a_nan_in_one_sequence_stays_in_it_on_cpu(case, config, cpu_kernels, monkeypatch):
    """Sequence 0's last K/V tile runs into sequence 1's NaN keys: its V rows there come in as
    zeros (the pipelined program's CopyV; the ws producer's zero-filled tail, in the GPU
    matrix), so sequence 0's rows stay right."""
    run_on_cpu(monkeypatch, cpu_kernels, solution_of(case), config)
    inputs, expected, rows = nan_neighbour_inputs(case, "cpu", seed=5)
    actual = run_solution(solution_of(case), case, inputs)
    check_outputs([x[rows] for x in actual], [x[rows] for x in expected])


CPU_MALFORMED_BATCHES = MALFORMED_BATCHES + [
    # The search for a slot's sequence falls back to sequence 0 for the slots before it: with
    # 40 rows before a well-formed sequence 0, 16- and 32-row tiles would start before it.
    MalformedBatch("qo_start_past_a_tile", (40, 60, 80, 100), (0, 40, 80, 120)),
    # No key rows: the kernel runs on a stand-in K/V row that no sequence may see.
    MalformedBatch("no_key_rows", (0, 30, 70, 100), (0, 0, 5, 0), total_kv=0),
]


@pytest.mark.parametrize(
    "batch,config", rotating_params(CPU_MALFORMED_BATCHES, list(CPU_CONFIGS), lambda b: b.id)
)
def test_program_on_cpu_poisons_malformed_batches(batch, config, cpu_kernels, monkeypatch):
    """Rows of well-formed sequences right, every other row NaN, every row written."""
    run_on_cpu(monkeypatch, cpu_kernels, "tilelang_ragged", config)
    inputs = malformed_inputs(batch, "cpu", seed=3)
    output = torch.full_like(inputs[0], -7.0)
    lse = torch.full(inputs[0].shape[:2], -7.0)
    build_solution("tilelang_ragged")(*inputs, output, lse)
    assert not (output == -7.0).all(-1).any() and not (lse == -7.0).any(), "rows never written"
    check_malformed_outputs([output, lse], malformed_expected(batch, inputs))


@pytest.mark.parametrize(
    "case,config", rotating_params(CPU_CASES + CPU_NAN_CASES, SMALL_TILES, lambda c: c.id)
)
def test_long_keys_program_on_cpu_matches_reference(case, config, cpu_kernels, monkeypatch):
    """The programs for launches of long sequences (long_keys: items drawn in L2 sections of 8
    query heads, TUNING.md) with the entry's rule forced on, so these small batches take that
    order: every row right, none left unwritten (run_solution poisons the outputs)."""
    launched = []
    run_on_cpu(monkeypatch, cpu_kernels, solution_of(case), config, launched)
    monkeypatch.setattr(entry_module(solution_of(case)), "long_keys_launch", lambda *sizes: True)
    inputs = make_inputs(case, "cpu", seed=7)
    actual = run_solution(solution_of(case), case, inputs)
    check_outputs(actual, reference_outputs(case, inputs))
    assert all(long_keys for _, long_keys in launched)


# 2b. On a GPU: the persistent kernel's work counters --------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_persistent_scheduler_is_reset_by_every_launch():
    """The causal kernel hands out work items through counters that its last block zeroes again.
    If it did not, the next launch would skip items and leave rows unwritten (poisoned outputs
    catch that). Launches of different shapes back to back, then on a second stream."""
    cases = [
        RaggedCase((300, 1, 0, 129), (300, 40, 7, 129)),
        PaddedCase(2, 1000, 1200, True),
        RaggedCase((4096,), (4096,)),
        PaddedCase(1, 77, 77, True),
    ]
    solutions = {RaggedCase: "tilelang_ragged", PaddedCase: "tilelang_mini"}
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            for seed, case in enumerate(cases):
                inputs = make_inputs(case, "cuda", seed)
                actual = run_solution(solutions[type(case)], case, make_inputs(case, "cuda", seed))
                check_outputs(actual, reference_outputs(case, inputs))
    torch.cuda.synchronize()
    for name in solutions.values():
        counters = entry_module(name)._schedulers
        assert len(counters) >= 2  # one per stream
        for value in counters.values():
            assert value.tolist() == [0, 0]


# 3. Argument checks --------------------------------------------------------------------------


def tensor(*shape, dtype=F16):
    return torch.zeros(*shape, dtype=dtype)


def int32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


def padded_args(batch=2, seq_q=3, seq_kv=5, dtype=F16, **changes):
    args = dict(
        q=tensor(batch, seq_q, 32, 128, dtype=dtype),
        k=tensor(batch, seq_kv, 8, 128, dtype=dtype),
        v=tensor(batch, seq_kv, 8, 128, dtype=dtype),
        causal=True,
        out=tensor(batch, seq_q, 32, 128, dtype=dtype),
    )
    args.update(changes)
    return args


def ragged_args(total_q=4, total_kv=6, batch=2, dtype=BF16, **changes):
    args = dict(
        q=tensor(total_q, 32, 128, dtype=dtype),
        k=tensor(total_kv, 8, 128, dtype=dtype),
        v=tensor(total_kv, 8, 128, dtype=dtype),
        qo_indptr=int32(batch + 1),
        kv_indptr=int32(batch + 1),
        sm_scale=1.0 / math.sqrt(128),
        output=tensor(total_q, 32, 128, dtype=dtype),
        lse=tensor(total_q, 32, dtype=F32),
    )
    args.update(changes)
    return args


def transposed(*shape, dtype=F16):
    """A tensor of the given shape whose last two dimensions are swapped in memory."""
    return tensor(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


PADDED_ERRORS = {
    "q float32": ("q", dict(q=tensor(2, 3, 32, 128, dtype=F32))),
    "q rank 3": ("q", dict(q=tensor(6, 32, 128))),
    "q 16 heads": ("q", dict(q=tensor(2, 3, 16, 128))),
    "q head_dim 64": ("q", dict(q=tensor(2, 3, 32, 64))),
    "q non-contiguous": ("q", dict(q=transposed(2, 3, 32, 128))),
    "k batch of 1": ("k", dict(k=tensor(1, 5, 8, 128))),
    "k 4 heads": ("k", dict(k=tensor(2, 5, 4, 128))),
    "k bfloat16": ("k", dict(k=tensor(2, 5, 8, 128, dtype=BF16))),
    "k rank 3": ("k", dict(k=tensor(10, 8, 128))),
    "v seq_kv of 4": ("v", dict(v=tensor(2, 4, 8, 128))),
    "v non-contiguous": ("v", dict(v=transposed(2, 5, 8, 128))),
    "causal an int": ("causal", dict(causal=1)),
    "causal a 1-d tensor": ("causal", dict(causal=torch.tensor([True]))),
    "out seq 4": ("out", dict(out=tensor(2, 4, 32, 128))),
    "out bfloat16": ("out", dict(out=tensor(2, 3, 32, 128, dtype=BF16))),
    "on the CPU": ("q", dict()),
}


@pytest.mark.parametrize("name,changes", PADDED_ERRORS.values(), ids=PADDED_ERRORS.keys())
def test_padded_argument_errors(name, changes):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        build_solution("tilelang_mini")(*padded_args(**changes).values())


RAGGED_ERRORS = {
    "q float32": ("q", dict(q=tensor(4, 32, 128, dtype=F32))),
    "q rank 4": ("q", dict(q=tensor(1, 4, 32, 128, dtype=BF16))),
    "q 8 heads": ("q", dict(q=tensor(4, 8, 128, dtype=BF16))),
    "k 32 heads": ("k", dict(k=tensor(6, 32, 128, dtype=BF16))),
    "k float16": ("k", dict(k=tensor(6, 8, 128))),
    "v 5 rows": ("v", dict(v=tensor(5, 8, 128, dtype=BF16))),
    "v non-contiguous": ("v", dict(v=transposed(6, 8, 128, dtype=BF16))),
    "qo_indptr int64": ("qo_indptr", dict(qo_indptr=torch.zeros(3, dtype=torch.int64))),
    "qo_indptr rank 2": ("qo_indptr", dict(qo_indptr=int32(3, 1))),
    "qo_indptr no sequence": ("qo_indptr", dict(qo_indptr=int32(1), kv_indptr=int32(1))),
    "kv_indptr length": ("kv_indptr", dict(kv_indptr=int32(4))),
    "kv_indptr non-contiguous": ("kv_indptr", dict(kv_indptr=int32(6)[::2])),
    "sm_scale inf": ("sm_scale", dict(sm_scale=float("inf"))),
    "sm_scale a tensor": ("sm_scale", dict(sm_scale=torch.tensor(0.1))),
    "output float16": ("output", dict(output=tensor(4, 32, 128))),
    "output rows": ("output", dict(output=tensor(5, 32, 128, dtype=BF16))),
    "lse bfloat16": ("lse", dict(lse=tensor(4, 32, dtype=BF16))),
    "lse shape": ("lse", dict(lse=tensor(4, 8, dtype=F32))),
    "on the CPU": ("q", dict()),
}


@pytest.mark.parametrize("name,changes", RAGGED_ERRORS.values(), ids=RAGGED_ERRORS.keys())
def test_ragged_argument_errors(name, changes):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        build_solution("tilelang_ragged")(*ragged_args(**changes).values())


def test_device_check_names_the_cpu():
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
        build_solution("tilelang_ragged")(*ragged_args().values())
