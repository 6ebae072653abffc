"""The TileLang paged solutions (page sizes 64 and 1) without a GPU, and on one.

1. Each paged program (bfloat16: COMPILED_PAGED_VARIANTS) lowers and compiles for sm_90a here:
   page size 64 loads a TMA box per page (k_cache a 4-d tensor whose page stride reaches the
   descriptor), page size 1 gathers rows with cp.async from the producer warpgroup; both
   wgmma, neither spills.
2. The same program's CPU stand-in (the pipelined program, made local: see
   test_tilelang_compile.py) behind the packed entry points matches the reference on the shared
   paged cases (NaN in every unused cache slot, shuffled and shared pages, partly filled last
   pages) and on malformed page tables (ids out of range, bad offsets and last-page lengths):
   the page arithmetic, the zero-filled V rows, the bad-page marks and the malformed-batch
   rules. Not the Hopper lowering: the GPU matrix (tests/test_solutions.py, test_malformed.py)
   runs the warp-specialized program.
3. On a GPU: page tables and cache layouts beyond the shared matrix.
"""

import functools
import re
import sys

import pytest
import torch
from test_tilelang_compile import (
    check_v_tail_fence,
    compile_fresh,
    cpu_programs,
    entry_module,
    proxy_fenced_waits,
)

from prefill_bundle import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS
from prefill_bundle.packing import SOLUTIONS
from prefill_bundle.paged_malformed import (
    MALFORMED_PAGED_BATCHES,
    check_malformed_paged_outputs,
    malformed_paged_expected,
    malformed_paged_inputs,
)
from prefill_bundle.testing import (
    CPU_PAGED_CASES,
    PagedCase,
    RaggedCase,
    build_solution,
    check_outputs,
    make_inputs,
    reference_outputs,
    run_solution,
    tilelang_kernels,
)

F16, F32 = torch.float16, torch.float32
HAS_CUDA = torch.cuda.is_available()
# The entry-point tests need packing.py's TileLang paged specs (their Solution JSON).
PACKED = {s.name for s in SOLUTIONS} >= {"tilelang_paged_ps1", "tilelang_paged_ps64"}
needs_packed = pytest.mark.skipif(
    not PACKED, reason="prefill_bundle/packing.py lists no TileLang paged solutions"
)


def solution_of(page_size: int) -> str:
    return f"tilelang_paged_ps{page_size}"


# 1. Compilation for the H100, once per variant and session -----------------------------------

_compiled = {}


def compiled(dtype: str, page_size: int):
    """(device source, host source, ptxas report) of a paged variant."""
    if (dtype, page_size) not in _compiled:
        kernel, ptxas = compile_fresh(tilelang_kernels(), dtype, True, page_size=page_size)
        sources = kernel.get_kernel_source(), kernel.adapter.get_host_source()
        _compiled[(dtype, page_size)] = (*sources, ptxas)
    return _compiled[(dtype, page_size)]


def test_paged_variants_cover_both_entry_points():
    assert set(tilelang_kernels().PAGED_VARIANTS) == {
        (d, p) for d in ("float16", "bfloat16") for p in (1, 64)
    }
    assert set(COMPILED_PAGED_VARIANTS) <= set(tilelang_kernels().PAGED_VARIANTS)


# The variants compiled for sm_90a here (each 30-45 s on CI's 2 cores): both page sizes (their
# K/V loaders differ), in the paged definitions' bfloat16. The float16 ones are the same
# program with another wgmma operand type (tests/test_tilelang_compile.py compiles float16 for
# the non-causal program); they run in the GPU matrix (tests/test_solutions.py -k tilelang).
COMPILED_PAGED_VARIANTS = [("bfloat16", 64), ("bfloat16", 1)]


@pytest.mark.parametrize("dtype,page_size", COMPILED_PAGED_VARIANTS)
def test_paged_compiles_for_sm90a(dtype, page_size):
    source, host, _ = compiled(dtype, page_size)
    operand = {"float16": "kFloat16", "bfloat16": "kBFloat16"}[dtype]
    assert f"tl::wgmma_ss<tl::DataType::{operand}, tl::DataType::{operand}" in source  # Q K^T
    assert f"tl::wgmma_rs<tl::DataType::{operand}, tl::DataType::{operand}" in source  # P V
    assert "tl::tma_load(Q_desc" in source
    assert "tl::__named_barrier_arrive(" not in source  # no pingpong (block_config)
    # Items in L2 sections where the launch's keys average 8192 a sequence: kv_rows counts
    # pages (128 of 64 keys; until 2026-11-30 (28) page size 64 compared 8192 pages, so it
    # never drew in sections).
    shift = (8192 // page_size).bit_length() - 1
    assert f"if (len_indptr <= ((kv_rows >> {shift}) + 1))" in source
    # Page size 1 (block_config's gathered): a third ring stage, the output staged in Q's buffer.
    assert f"uint64_t k_full_mem[{3 if page_size == 1 else 2}];" in source
    # Gathered rows (page size 1; page size 64: the V of a sequence's last tile) land on the
    # stage's barrier.
    assert "tl::mbarrier_cp_async_arrive(" in source
    waits = proxy_fenced_waits(source)
    if page_size == 64:
        check_v_tail_fence(source)  # a partial page's V: the item's last tile only
        assert "tl::cp_async_gs_conditional<16>(" in source  # TileLang's, zero-filled
        # A TMA box per page: coordinates (columns, slot 0, KV head, page id), the page
        # stride in bytes from the tensor on every call.
        assert "tl::tma_load(K_cache_desc" in source and "tl::tma_load(V_cache_desc" in source
        assert "(((int64_t)k_page_stride) * (int64_t)2)" in host
        assert "(((int64_t)v_page_stride) * (int64_t)2)" in host
        check_page_id_window(source)
    else:
        assert "K_cache_desc" not in source  # gathered, not boxed
        # Every slot is cp.async's: every K and V wait is fenced before its wgmma.
        assert all(waits["k_full"]) and all(waits["v_full"]) and len(waits["v_full"]) >= 2
        assert "tl::warpgroup_reg_dealloc<56>" in source  # the loader warpgroup's registers
        # The loaders read a tile's page ids once (a lane's held row) and vote on which rows
        # are read; pass i takes its row's page from lane i of its half warp (a constant
        # source lane once unrolled) and copies it with the prelude's cp.async (ignore-src:
        # zeros, no read), K and V. Rows 2 w + lane // 16 of each pass on warp w: row
        # (thread & 127) >> 4 in the swizzled shared address.
        assert source.count("kv_indices[") == 1
        assert source.count("__ballot_sync(") == 1
        half_warp_shuffle = r"__shfl_sync\(\(uint\)4294967295, \w+\[0\], i_\d+, 16\)"
        assert len(re.findall(half_warp_shuffle, source)) == 2  # K's and V's pass loops
        assert source.count("tl_gather_row16(") == 3  # the prelude's definition, K's, V's
        assert "cp.async.cg.shared.global [%0], [%1], 16, ignore;" in source
        assert "tl::cp_async_gs_conditional" not in source
        assert "(((((int)threadIdx.x) & 127) >> 4) * 64)" in source


def test_page_size_1_takes_a_third_stage_and_stages_its_output_in_q():
    """block_config's gathered programs (page size 1) only: 3 stages fit beside Q once the
    output is staged in Q's buffer (TUNING.md, page size 1: +2-6% on an H200)."""
    kernels = tilelang_kernels()
    gathered = kernels.block_config("bfloat16", True, False, gathered=True)
    assert gathered["num_stages"] == 3 and gathered["output_in_q"] is True
    plain = kernels.block_config("bfloat16", True, False), kernels.block_config("bfloat16", True)
    for config in plain:
        assert config["num_stages"] == 2 and not config.get("output_in_q", False)


def check_page_id_window(source: str):
    """Page size 64's producer warp reads no page id per tile: an item's first window of 32 ids
    (a lane each) before its wait for Q's buffer, the next one in the tile loop before the
    ring's waits (the window's last tile), and each tile shuffles its two ids from the held
    window first (TUNING.md, Paged K/V)."""
    window = "held[0] = tl_page_window((&(kv_indices[0])), "
    assert source.count("tl_page_window(") == 3  # the prelude's definition, item start, loop
    assert "kv_indices[(" not in source  # no indexed id load left
    start = source.index(window)
    assert start < source.index("q_empty[0].wait(", start)
    loop = source.index("for (int k = 0; k < tiles; ++k) {", start)
    # One shuffle a page of the tile (a loop nvcc unrolls), from lane 2 (k % 16) + p.
    shuffle = source.index("__shfl_sync((uint)4294967295, held[0], (((k & 15) * 2) + p), 32)")
    assert source.count("__shfl_sync((uint)4294967295, held[0], ") == 1
    last_tile = source.index("if (((k & 15) == 15) & ((k + 1) < tiles)) {", loop)
    next_window = source.index(window, loop)
    assert loop < shuffle < last_tile < next_window < source.index("k_empty[(g & 1)].wait(", loop)


@pytest.mark.parametrize("dtype,page_size", COMPILED_PAGED_VARIANTS)
def test_paged_compiles_without_register_spills(dtype, page_size):
    """Producer 24 registers beside 240 for the consumers (page size 1: 56 and 224, its four
    loader warps gather), as for ragged: code in the loaders or the bad-page path can spill."""
    _, _, ptxas = compiled(dtype, page_size)
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_paged_code_carries_no_fp8_policy(dtype):
    """The FP8 caches are a policy of the page-size-64 source (gqa_prefill_fp8): the 16-bit
    kernel keeps its one TMA warp, its 24 / 240 split, no staging buffers, no v_scale (the
    byte-identical check of every variant: TUNING.md)."""
    source, host, _ = compiled(dtype, 64)
    for trace in ("fp8", "K8", "V8", "k8_full", "v_scale", "__sync_thread_partial(11"):
        assert trace not in source, trace
    assert "tl::warpgroup_reg_dealloc<24>" in source
    assert "(0x1p+0f/*1.000000e+00*/ / logsum[" in source
    assert "(((int64_t)k_page_stride) * (int64_t)2)" in host


# Split-KV's kernels (decode-like batches, page size 64: 16-bit and FP8) and the merge.
SPLIT_COMPILED = [("bfloat16", False)]  # FP8 splits packed only (PACK_COMPILED)


@pytest.mark.parametrize("dtype,fp8", SPLIT_COMPILED)
def test_split_kernels_compile_for_sm90a_without_spills(dtype, fp8):
    """The split program: the shares' fp32 outputs go out from registers (no output buffer),
    the register split and the 0-spill budget of the unsplit kernel hold."""
    kernels = tilelang_kernels()
    assert {(d, p, f) for d, p, f in kernels.SPLIT_VARIANTS} == {
        ("float16", 64, False), ("bfloat16", 64, False),
    }  # fmt: skip
    cache_dtype = kernels.FP8_E4M3 if fp8 else None
    kernel, ptxas = compile_fresh(
        kernels, dtype, True, page_size=64, cache_dtype=cache_dtype, split=True
    )  # fmt: skip
    source = kernel.get_kernel_source()
    assert "tl::wgmma_rs<" in source and "tl::tma_load(K_cache_desc" in source
    assert "float* __restrict__ Output" in source  # the workspace
    if not fp8:
        check_page_id_window(source)
        check_v_tail_fence(source)
    else:
        assert not any(sum(proxy_fenced_waits(source).values(), [])), "FP8 fences in its loaders"
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


# GQA head packing's kernels (decode-like batches, page size 64): split (the plan's usual case)
# and, bfloat16, unsplit (a decode-like batch over short contexts).
PACK_COMPILED = [
    ("bfloat16", 64, False, True), ("bfloat16", 64, True, True), ("bfloat16", 64, False, False),
    ("bfloat16", 1, False, True),
]  # fmt: skip


@pytest.mark.parametrize("dtype,page_size,fp8,split", PACK_COMPILED)
def test_packed_kernels_compile_for_sm90a_without_spills(dtype, page_size, fp8, split):
    """One consumer warpgroup (block_M 64: 256 threads, a pool of 256 registers a thread; the
    producer 56, 72 beside page size 1's gather, 96 beside FP8's conversion; the consumers 240,
    FP8's 216 or the gather's 224), Q gathered by cp.async on q_full (no Q descriptor), outputs from
    registers, 0 spills. Page size 1's packed split program passes the sync planner that its
    unpacked one fails. FP8 (bfloat16 q): pack_config's fp8_split_q and three ring stages."""
    kernels = tilelang_kernels()
    cache_dtype = kernels.FP8_E4M3 if fp8 else None
    kernel, ptxas = compile_fresh(
        kernels, dtype, True, page_size=page_size, cache_dtype=cache_dtype, split=split,
        pack=True,
    )  # fmt: skip
    source = kernel.get_kernel_source()
    assert "__launch_bounds__(256, 1)" in source and "tl::wgmma_rs<" in source
    assert ("tl::tma_load(K_cache_desc" in source) == (page_size == 64)
    assert "Q_desc" not in source and "tl::mbarrier_cp_async_arrive(q_full[0]);" in source
    assert source.count("tl::cp_async_gs_conditional<16>((&(((bfloat16_t*)Q_shared)") == 1
    assert ("float* __restrict__ Output" in source) == split
    if page_size == 64 and not fp8:
        check_page_id_window(source)
    else:
        assert "tl_page_window" not in source
    assert "tl::warpgroup_reg_dealloc<%d>" % (96 if fp8 else 72 if page_size == 1 else 56) in source
    # FP8 (bfloat16 q): P V in float16 (fp8_f16_pv in pack_config), V by the prelude's cvt;
    # Q K^T in e4m3 on the cache's K (fp8_split_q), no K conversion; three ring stages.
    assert ("tl::wgmma_rs<tl::DataType::kFloat16, tl::DataType::kFloat16" in source) == fp8
    assert ("tl_e4m3x8_to_f16x8_x8((" in source) == fp8
    assert ("tl::wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in source) == fp8
    assert "tl_e4m3x8_to_bf16x8_x8((" not in source
    stages = 3 if fp8 else 2
    assert f"uint64_t k_full_mem[{stages}];" in source
    # Q is cp.async's: fenced before Q K^T reads it (FP8 splits it with generic loads instead,
    # and its loaders fence the ring's converted tiles themselves).
    waits = proxy_fenced_waits(source)
    assert waits["q_full"] == [not fp8], waits
    if fp8:
        assert not any(waits["k_full"] + waits["v_full"]), waits
    elif page_size == 1:
        assert all(waits["k_full"] + waits["v_full"]), waits
    else:
        check_v_tail_fence(source)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


def test_page_gather_compiles_for_sm90a():
    """Page size 1's page gather: a thread moves 16 bytes of a key's row (8 heads x 128 over 128
    threads) from K_cache and V_cache, the page id tested against page_count before the load
    (a bad one: NaN K, zero V)."""
    source = tilelang_kernels().compile_gather("bfloat16").get_kernel_source()
    assert source.count("*(uint4*)(K_cache + ") == 1 and source.count("*(uint4*)(V_cache + ") == 1
    assert source.count("*(uint4*)(K + ") == 1 and source.count("*(uint4*)(V + ") == 1
    assert "quiet_NaN()" in source and "< page_count)" in source


def test_merge_compiles_for_sm90a():
    kernels = tilelang_kernels()
    source = kernels.compile_merge("bfloat16").get_kernel_source()
    assert "bfloat16_t* __restrict__ Output" in source and "float* __restrict__ LSE" in source


def test_split_plan_from_shapes():
    """kv_shares (the entry's plan, shapes only): decode-like batches split, enough items for 4
    waves of 132 SMs (SHARE_WAVES: 4 measured best of 1-8), shares of at least 4 key tiles of
    the average sequence, at most 16."""
    kv_shares = tilelang_kernels().kv_shares
    # single_token_rows_16: 16 rows over 136546 keys (2142 pages of 64): 512 items -> 2 shares
    assert kv_shares(16, 16, 2142 * 64, 132) == 2
    # tests/test_split_kv_gpu.py's batch: 4 sequences, 5 tokens, ~8.8K keys -> 4 (length)
    assert kv_shares(5, 4, 138 * 64, 132) == 4
    assert kv_shares(1, 1, 1 << 20, 132) == 16  # one long row: the cap
    assert kv_shares(64, 64, 64 * 300, 132) == 1  # short contexts: shares under 4 tiles
    assert kv_shares(17, 4, 1 << 20, 132) == 1  # over 4 tokens a sequence: prefill
    assert kv_shares(0, 0, 0, 132) == 1
    assert tilelang_kernels().SPLIT_PAGE_SIZES == (64,)  # page size 1 never splits (yet)


def test_pack_plan_from_shapes():
    """GQA head packing for decode-like batches only (at most 4 query tokens a sequence on
    average, shapes only); a packed item is (16-token block, KV head): 8 x (batch + total_q //
    16) items, so the shares for 4 items an SM grow."""
    kernels = tilelang_kernels()
    decode_like, kv_shares = kernels.decode_like, kernels.kv_shares
    assert decode_like(16, 16) and decode_like(5, 4) and decode_like(64, 16)
    assert not decode_like(65, 16) and not decode_like(0, 0) and not decode_like(300, 2)
    # single_token_rows_16: 8 x 17 = 136 items -> 4 shares (shares of 9-28 key tiles)
    assert kv_shares(16, 16, 2142 * 64, 132, block_M=64, pack=True) == 4
    # test_split_kv_gpu.py's batch: 8 x 4 = 32 items, ~8.8K keys over 4 sequences -> 4 (length)
    assert kv_shares(5, 4, 138 * 64, 132, block_M=64, pack=True) == 4
    assert kv_shares(17, 4, 1 << 20, 132, block_M=64, pack=True) == 1  # prefill
    assert kernels.PACK_PAGE_SIZES == (64, 1)
    assert kernels.pack_config()["block_M"] == 64


def test_entry_plan_packs_and_splits_what_compiles():
    """The entry's plan (shapes only): decode-like batches pack and split, except float16 over
    FP8 caches, whose packed split program fails TileLang's sync planner (packed, unsplit);
    prefill batches neither pack nor split; page size 1 splits only packed."""
    plan = entry_module("tilelang_paged_ps64").paged_plan
    single_token = (16, 16, 2142 * 64, 132)  # single_token_rows_16
    assert plan("bfloat16", 64, False, *single_token) == (True, 4)
    assert plan("float16", 64, False, *single_token) == (True, 4)
    assert plan("bfloat16", 64, True, *single_token) == (True, 4)
    assert plan("float16", 64, True, *single_token) == (True, 1)
    assert plan("bfloat16", 1, False, 16, 16, 136546, 132) == (True, 4)
    assert plan("bfloat16", 64, False, 2048, 1, 8192, 132) == (False, 1)
    assert plan("bfloat16", 1, False, 2048, 1, 8192, 132) == (False, 1)
    kernels = tilelang_kernels()
    assert set(kernels.PACK_SPLIT_VARIANTS) == set(kernels.PACK_VARIANTS) - {("float16", 64, True)}


# 2. The TileLang program on the CPU behind the packed entry points ---------------------------


def paged_programs(get):
    """paged(page_size, config, split, pack): the CPU program of that paged variant (get:
    cpu_programs'), with get's merge."""

    def paged(page_size, config, split=False, pack=False, long_keys=False):
        flags = dict(split=split, pack=pack, long_keys=long_keys)
        return get(config, page_size=page_size, **{k: True for k, v in flags.items() if v})

    paged.merge = get.merge
    paged.gather = get.gather
    return paged


@pytest.fixture(scope="module")
def cpu_paged_kernels(tmp_path_factory):
    return paged_programs(cpu_programs(tmp_path_factory, "paged"))


@pytest.fixture(scope="module")
def cpu_sectioned_kernels(tmp_path_factory):
    """The paged programs with their items drawn in sections whatever the batch (shipped: long
    sequences only), so the small batches take that order."""
    test = "max(SECTION_MIN_KEYS // (page_size or 1), 1) >= batch"
    rewrite = (test, test.replace(">= batch", ">= 0"))
    return paged_programs(cpu_programs(tmp_path_factory, "sectioned", [rewrite]))


def _paged_launcher(kernel):
    """A stand-in for the compiled CUDA kernel with the same arguments; bfloat16 via float16,
    caches with a page stride via contiguous copies (the C wrapper takes no symbolic stride)."""

    def launch(q, k_cache, v_cache, *rest):
        *indices, output, lse, scheduler = rest
        q, k_cache, v_cache = (x.to(F16).contiguous() for x in (q, k_cache, v_cache))
        # fp32: a split kernel's workspace
        output16 = output if output.dtype in (F16, F32) else torch.empty_like(output, dtype=F16)
        kernel(q, k_cache, v_cache, *indices, output16, lse, scheduler)
        output.copy_(output16)

    return launch


# The solution's tiles, and small ones so that the small cases cross many tile boundaries
# (page size 64: a tile of one page; page size 1: block_M != block_N both ways).
CPU_PAGED_CONFIGS = {
    64: {
        "solution_tiles": None,  # two pages a tile
        "tiles16x64": dict(block_M=16, block_N=64, num_stages=2),  # one
    },
    1: {
        "solution_tiles": None,
        "tiles16x32": dict(block_M=16, block_N=32, num_stages=2),
        "tiles32x16": dict(block_M=32, block_N=16, num_stages=2),
    },
}


def _merge_launcher(kernel):
    """A stand-in for split-KV's compiled merge; bfloat16 output via float16."""

    def launch(parts, part_lse, output, lse):
        output16 = output if output.dtype == F16 else torch.empty_like(output, dtype=F16)
        kernel(parts, part_lse, output16, lse)
        output.copy_(output16)

    return launch


def _gather_launcher(kernel):
    """A stand-in for page size 1's compiled page gather; bfloat16 via float16, caches with a
    page stride via contiguous copies."""

    def launch(k_cache, v_cache, kv_indices, page_count, k, v):
        k_cache, v_cache = (x.to(F16).contiguous() for x in (k_cache, v_cache))
        k16, v16 = (torch.empty_like(x, dtype=F16) for x in (k, v))
        kernel(k_cache, v_cache, kv_indices, page_count, k16, v16)
        k.copy_(k16)
        v.copy_(v16)

    return launch


def run_paged_on_cpu(monkeypatch, cpu_paged_kernels, page_size: int, config: str,
                     shares: int = None, pack: bool = None) -> None:  # fmt: skip
    """Point the packed paged entry at the CPU program with config's tiles, its device checks
    told that CPU tensors are fine, and no plan from an earlier test. shares: every batch split
    into that many key shares (None: the entry's own plan, for an H100's 132 SMs); pack: every
    batch decode-like or none (GQA head packing; None: the entry's own test)."""
    entry = entry_module(solution_of(page_size))
    kernels = tilelang_kernels()
    forced_pack = pack

    def kernel(dtype, causal, device, page_size=None, fp8=False, split=False, pack=False,
               long_keys=False):  # fmt: skip
        assert forced_pack is None or pack == forced_pack  # both page sizes pack
        assert not long_keys or page_size is None  # the ragged program after the gather
        # page_size None: the ragged program over page size 1's gathered pages, its tiles
        tiles = CPU_PAGED_CONFIGS[page_size or 1][config]
        if tiles is None:  # the ws program's tiles through the pipelined one
            config_of = kernels.pack_config if pack else kernels.block_config
            tiles = dict(config_of() if pack else config_of(entry._DTYPES[dtype], causal))
            for knob in ("ws", "pingpong", "persistent"):
                tiles.pop(knob, None)
        return _paged_launcher(cpu_paged_kernels(page_size, tiles, split, pack, long_keys))

    def workspace(device, rows):
        return torch.empty(rows, NUM_HEADS, HEAD_DIM), torch.empty(rows, NUM_HEADS)

    monkeypatch.setattr(entry, "_sm_count", lambda device: 132)
    monkeypatch.setattr(entry, "_workspace", workspace)
    monkeypatch.setattr(
        entry, "_merge_kernel", lambda dtype, device: _merge_launcher(cpu_paged_kernels.merge())
    )  # fmt: skip
    monkeypatch.setattr(
        entry, "_gather_kernel", lambda dtype, device: _gather_launcher(cpu_paged_kernels.gather())
    )  # fmt: skip
    if shares is not None:
        monkeypatch.setattr(entry, "kv_shares", lambda *shapes, **tiles: shares)
    if pack is not None:
        monkeypatch.setattr(entry, "decode_like", lambda *shapes: pack)

    contract = sys.modules[entry.__name__.rpartition(".")[0] + ".arguments"]
    for name in ("check_layout", "check_placement"):
        check = functools.partial(getattr(contract, name), interpreted=True)
        monkeypatch.setattr(entry, name, check)
    monkeypatch.setattr(entry, "_kernel", kernel)
    monkeypatch.setattr(entry, "_paged_plans", {p: contract.PlanCache() for p in (1, 64)})
    monkeypatch.setattr(entry, "_scheduler", lambda device: torch.zeros(2, dtype=torch.int32))


def paged_params(cases):
    return [
        pytest.param(case, config, id=f"{case.id}-{config}")
        for case in cases
        for config in CPU_PAGED_CONFIGS[case.page_size]
    ]


def check_program_on_cpu(monkeypatch, kernels, case, config, shares=None, pack=None):
    """The entry's paged program (split: shares > 1; packed) run on the CPU against the
    reference."""
    run_paged_on_cpu(monkeypatch, kernels, case.page_size, config, shares, pack=pack)
    inputs = make_inputs(case, "cpu")
    check_outputs(
        run_solution(solution_of(case.page_size), case, make_inputs(case, "cpu")),
        reference_outputs(case, inputs),
    )


def check_malformed_program_on_cpu(monkeypatch, kernels, batch, shares=None, pack=None):
    """A malformed page table through the paged program (split, packed) on the CPU: every row
    written, poisoned rows NaN, the others right."""
    config = "tiles16x64" if batch.page_size == 64 else "tiles32x16"
    run_paged_on_cpu(monkeypatch, kernels, batch.page_size, config, shares, pack=pack)
    inputs = malformed_paged_inputs(batch, "cpu", seed=4)
    expected = malformed_paged_expected(batch, inputs)
    output = torch.full_like(inputs[0], -7.0)
    lse = torch.full(inputs[0].shape[:2], -7.0)
    build_solution(solution_of(batch.page_size))(*inputs, output, lse)
    assert not (output == -7.0).all(-1).any() and not (lse == -7.0).any(), "rows never written"
    check_malformed_paged_outputs([output, lse], expected)


@needs_packed
@pytest.mark.parametrize("case,config", paged_params(CPU_PAGED_CASES))
def test_paged_program_on_cpu_matches_reference(case, config, cpu_paged_kernels, monkeypatch):
    """NaN in every cache slot no sequence owns: V rows past kv_len must not reach P V."""
    check_program_on_cpu(monkeypatch, cpu_paged_kernels, case, config)


@needs_packed
@pytest.mark.parametrize(
    "batch", MALFORMED_PAGED_BATCHES, ids=lambda b: b.id
)  # fmt: skip
def test_paged_program_on_cpu_with_malformed_tables(batch, cpu_paged_kernels, monkeypatch):
    """Rows of well-formed sequences right, rows that see a key on a bad page id NaN, every other
    row of a malformed sequence NaN, every row written."""
    check_malformed_program_on_cpu(monkeypatch, cpu_paged_kernels, batch)


# Page size 1 with the pages gathered first (arguments.gathers_pages, forced): the gather
# program, then the ragged one over its buffers.
@needs_packed
@pytest.mark.parametrize(
    "case,config",
    [
        pytest.param(case, config, id=f"{case.id}-{config}")
        for case, config in zip(
            [c for c in CPU_PAGED_CASES if c.page_size == 1], ["tiles32x16", "tiles16x32"] * 2
        )
    ],
)
def test_gathered_pages_on_cpu_match_reference(case, config, cpu_paged_kernels, monkeypatch):
    monkeypatch.setenv("PREFILL_BUNDLE_PAGE_GATHER", "1")
    check_program_on_cpu(monkeypatch, cpu_paged_kernels, case, config)


@needs_packed
@pytest.mark.parametrize(
    "batch", [b for b in MALFORMED_PAGED_BATCHES if b.page_size == 1], ids=lambda b: b.id
)
def test_gathered_pages_on_cpu_with_malformed_tables(batch, cpu_paged_kernels, monkeypatch):
    """A bad id's key a NaN K row: exactly the rows that see it NaN (output and lse); bad
    offsets through the ragged program's rules."""
    monkeypatch.setenv("PREFILL_BUNDLE_PAGE_GATHER", "1")
    check_malformed_program_on_cpu(monkeypatch, cpu_paged_kernels, batch)


# Items drawn in sections (gqa_prefill_steps' DrawItem): a dropped or doubled item leaves rows
# unwritten or wrong.
@needs_packed
@pytest.mark.parametrize(
    "case", CPU_PAGED_CASES[::2], ids=lambda c: c.id
)  # fmt: skip
def test_sectioned_program_on_cpu_matches_reference(
    case, cpu_sectioned_kernels, monkeypatch
):  # fmt: skip
    """Small tiles: many items, so every section holds some. Unpacked (decode-like batches
    pack, and packed items are not sectioned)."""
    config = "tiles16x64" if case.page_size == 64 else "tiles32x16"
    check_program_on_cpu(monkeypatch, cpu_sectioned_kernels, case, config, pack=False)


@needs_packed
@pytest.mark.parametrize("batch", MALFORMED_PAGED_BATCHES[::6], ids=lambda b: b.id)
def test_sectioned_program_on_cpu_with_malformed_tables(batch, cpu_sectioned_kernels, monkeypatch):
    check_malformed_program_on_cpu(monkeypatch, cpu_sectioned_kernels, batch, pack=False)


# Split-KV on the CPU: every batch through the split program (its shares' workspaces, then the
# merge), 3 shares (the empty shares of a short sequence included) or 4; unpacked (the entry
# packs decode-like batches: the packed tests below).
# Page size 64 only: page size 1 does not split (gqa_prefill_kernel.SPLIT_PAGE_SIZES).
SPLIT_CPU_CASES = [c for c in CPU_PAGED_CASES if c.page_size == 64] + [
    PagedCase((1, 1, 2, 1), (300, 70, 500, 6), 64),
]


@needs_packed
@pytest.mark.parametrize(
    "case,config,shares",
    [
        pytest.param(case, config, 3 + i % 2, id=f"{case.id}-{config}-{3 + i % 2}")
        for i, (case, config) in enumerate(
            (case, config)
            for case in SPLIT_CPU_CASES
            for config in CPU_PAGED_CONFIGS[case.page_size]
            if config != "solution_tiles"
        )
    ],
)
def test_split_program_on_cpu_matches_reference(case, config, shares, cpu_paged_kernels,
                                                monkeypatch):  # fmt: skip
    """The shares' key ranges cover every key once (short sequences leave shares empty: 0 and
    -inf, weighed 0), the causal offset survives the clip, the merge recombines them."""
    check_program_on_cpu(monkeypatch, cpu_paged_kernels, case, config, shares, pack=False)


@needs_packed
@pytest.mark.parametrize(
    "batch", [b for b in MALFORMED_PAGED_BATCHES if b.page_size == 64], ids=lambda b: b.id
)
def test_split_program_on_cpu_with_malformed_tables(batch, cpu_paged_kernels, monkeypatch):
    """As unsplit: every share of a poisoned row NaN (bad page ids: the share that meets one),
    so the merged row is NaN; other rows right."""
    check_malformed_program_on_cpu(monkeypatch, cpu_paged_kernels, batch, 3, pack=False)


# GQA head packing on the CPU: every batch through the packed program (rows (token, query
# head): 4 tokens a tile of 16 rows, 8 of 32, or the solution's 16 of 64), unsplit and split
# into 3, both page sizes.
PACK_CPU_CONFIGS = {
    64: (("tiles16x64", 1), ("tiles16x64", 3), ("solution_tiles", 3)),
    1: (("tiles16x32", 1), ("tiles32x16", 3), ("solution_tiles", 3)),
}
PACK_CPU_PARAMS = [
    pytest.param(case, config, shares, id=f"{case.id}-{config}-{shares}")
    for case in SPLIT_CPU_CASES + [c for c in CPU_PAGED_CASES if c.page_size == 1]
    for config, shares in PACK_CPU_CONFIGS[case.page_size]
]


@needs_packed
@pytest.mark.parametrize("case,config,shares", PACK_CPU_PARAMS)
def test_packed_program_on_cpu_matches_reference(case, config, shares, cpu_paged_kernels,
                                                 monkeypatch):  # fmt: skip
    """Each row's token (its causal position) and query head, Q rows past total_q zero, the
    stores of rows past a sequence skipped; split: the workspace's unpacked rows merge."""
    check_program_on_cpu(monkeypatch, cpu_paged_kernels, case, config, shares, pack=True)


@needs_packed
@pytest.mark.parametrize("shares", [1, 3])
@pytest.mark.parametrize("batch", MALFORMED_PAGED_BATCHES, ids=lambda b: b.id)
def test_packed_program_on_cpu_with_malformed_tables(batch, shares, cpu_paged_kernels,
                                                     monkeypatch):  # fmt: skip
    """A packed item poisons its token block's uncovered rows in all 4 query heads of its KV
    head; a bad page id NaNs the item's rows (every head of the group)."""
    check_malformed_program_on_cpu(monkeypatch, cpu_paged_kernels, batch, shares, pack=True)


@needs_packed
@pytest.mark.parametrize("page_size", [64, 1])
def test_paged_program_on_cpu_without_pages(page_size, cpu_paged_kernels, monkeypatch):
    """A cache of no pages and an empty page table: the kernel runs on 1-page and 1-entry
    stand-ins it is told are empty; rows see no key (0 and -inf)."""
    run_paged_on_cpu(monkeypatch, cpu_paged_kernels, page_size, "solution_tiles")
    case = PagedCase((3, 5), (0, 0), page_size, F16)
    q = torch.randn(8, NUM_HEADS, HEAD_DIM, dtype=F16)
    cache = torch.zeros(0, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=F16)
    indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    inputs = [q, cache, cache, indptr, torch.zeros(3, dtype=torch.int32),
              torch.zeros(0, dtype=torch.int32)]  # fmt: skip
    if page_size == 64:
        inputs.append(torch.ones(2, dtype=torch.int32))
    output = torch.full_like(q, float("nan"))
    lse = torch.full((8, NUM_HEADS), float("nan"))
    build_solution(solution_of(page_size))(*inputs, HEAD_DIM**-0.5, output, lse)
    assert (output == 0).all() and (lse == float("-inf")).all(), case.id


# 3. On a GPU ----------------------------------------------------------------------------------


@needs_packed
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [64, 1])
def test_paged_cache_views_on_gpu(page_size):
    """FlashInfer's combined [num_pages, 2, page_size, 8, 128] cache (k and v views with twice a
    page's stride: the TMA descriptors and gathers take it), and a sequence of a few keys."""
    case = PagedCase((130, 7, 64), (300, 7, 257), page_size, shared_prefix=(128, 0, 128))
    inputs = make_inputs(case, "cuda", seed=2)
    expected = reference_outputs(case, inputs)
    k_cache, v_cache = inputs[1], inputs[2]
    combined = torch.stack([k_cache, v_cache], dim=1)  # [num_pages, 2, page_size, 8, 128]
    views = [inputs[0], combined[:, 0], combined[:, 1]] + inputs[3:]
    assert views[1].stride(0) == 2 * page_size * NUM_KV_HEADS * HEAD_DIM
    check_outputs(run_solution(solution_of(page_size), case, views), expected)

    one = PagedCase((5,), (min(page_size, 3),), page_size)
    inputs = make_inputs(one, "cuda", seed=3)
    check_outputs(run_solution(solution_of(page_size), one, inputs), reference_outputs(one, inputs))


@needs_packed
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_paged_launches_reset_the_scheduler():
    """The paged kernels are persistent too: each launch must leave its work counters zero, or
    the next one skips items (poisoned outputs show that). Paged and ragged launches of
    different sizes back to back."""
    cases = [
        PagedCase((300, 1, 0, 129), (300, 40, 7, 129), 64),
        RaggedCase((300, 1, 0, 129), (300, 40, 7, 129)),
        PagedCase((300, 1, 0, 129), (300, 40, 7, 129), 1),
        PagedCase((4096,), (4096,), 64),
    ]
    for seed, case in enumerate(cases):
        name = solution_of(case.page_size) if isinstance(case, PagedCase) else "tilelang_ragged"
        inputs = make_inputs(case, "cuda", seed)
        actual = run_solution(name, case, make_inputs(case, "cuda", seed))
        check_outputs(actual, reference_outputs(case, inputs))
    torch.cuda.synchronize()
    for name in ("tilelang_ragged", solution_of(64), solution_of(1)):
        for counters in entry_module(name)._schedulers.values():
            assert counters.tolist() == [0, 0]
