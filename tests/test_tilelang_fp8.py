"""The TileLang FP8-cache solution (tilelang_fp8kv, run_paged_ps64_fp8kv) without a GPU, and on
one.

1. The FP8 variant lowers and compiles for sm_90a here (bfloat16; float16 too for its
   registers): the producer warpgroup loads each page as FP8 by TMA (one box per page) into
   staging buffers and converts them, vectorized, into the 16-bit ring the wgmma reads; v_scale
   scales the output in the epilogue; no spills at its 72 / 216 register split, which fits the
   registers the launch gives the block (setmaxnreg.inc past them never returns).
2. The entry's host logic on the CPU (a stand-in kernel records what it is given): k_scale folded
   into the softmax scale, v_scale passed on, the negative-scale rule on the folded scale, the
   FP8 plan apart from the 16-bit one; the argument checks raise a ValueError naming the
   argument.
3. On a GPU: values near e4m3's +-448 with small scales, scales not 1 with a negative sm_scale,
   and a cache view with twice a page's stride, against the reference (the shared matrix,
   tests/test_solutions.py::test_fp8_kv_cache, covers GPU_FP8_CASES).
"""

import functools
import importlib
import math
import re
import sys

import pytest
import torch
from test_tilelang_compile import compile_fresh, entry_module

from prefill_bundle import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS
from prefill_bundle.packing import SOLUTIONS
from prefill_bundle.testing import (
    PagedCase,
    build_solution,
    check_outputs,
    make_inputs,
    reference_outputs,
    run_solution,
    tilelang_kernels,
)

BF16, F16, F32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
SOLUTION = "tilelang_fp8kv"
needs_packed = pytest.mark.skipif(
    SOLUTION not in {s.name for s in SOLUTIONS},
    reason="prefill_bundle/packing.py lists no TileLang FP8 solution",
)

# 1. Compilation for the H100 -----------------------------------------------------------------

_compiled = {}


def compiled(dtype: str = "bfloat16"):
    """(device source, host source, ptxas report) of the FP8 variant that converts K and V: the
    shipped float16 one, and bfloat16's with knob fp8_split_q off (section 1b: the shipped
    bfloat16 program splits q instead of converting K; fp8_f16_pv on: V to float16)."""
    if dtype not in _compiled:
        kernels = tilelang_kernels()
        config = {**kernels.block_config(dtype, True, False), "fp8_split_q": False}
        kernel, ptxas = compile_fresh(
            kernels, dtype, True, page_size=64, cache_dtype=kernels.FP8_E4M3, **config
        )
        _compiled[dtype] = (kernel.get_kernel_source(), kernel.adapter.get_host_source(), ptxas)
    return _compiled[dtype]


def test_fp8_variants_cover_both_dtypes():
    assert set(tilelang_kernels().FP8_VARIANTS) == {"float16", "bfloat16"}


def fp8_module():
    """The packed gqa_prefill_fp8 (the FP8 policy's constants)."""
    package = tilelang_kernels().__name__.rpartition(".")[0]
    return importlib.import_module(package + ".gqa_prefill_fp8")


def test_fp8_loads_pages_by_tma_and_converts():
    source, host, _ = compiled()
    # Q K^T on the bf16 ring as the bfloat16 paged kernel; P V in float16 (fp8_f16_pv).
    assert "tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16" in source
    assert "tl::wgmma_rs<tl::DataType::kFloat16, tl::DataType::kFloat16" in source
    assert "tl::wgmma_rs<tl::DataType::kBFloat16" not in source
    # One TMA box per page (64 slots x 128 FP8 bytes = 8192 bytes, all of head_dim: column 0,
    # slot 0, the KV head, the page id) into staging buffer b of two (16384 bytes a tile), on
    # that buffer's barrier: at the item's start for tiles 0 and 1, then for tile k + 2 (the
    # block's g + 2, in buffer g & 1).
    for cache, staged in (("K_cache", "K8"), ("V_cache", "V8")):
        pattern = (
            rf"tl::tma_load\({cache}_desc, {staged[0].lower()}8_full\[\(([^\]]+)\)\], "
            rf"\(&\(\(\(fp8_e4_t\*\){staged}\)\["
            r"\(\(\(\1\) \* 16384\) \+ \(p_\d+ \* 8192\)\)\]\)\), 0, 0, "
            r"\(tile\[5\] >> 2\), staged_pages\[p_\d+\]\);"
        )
        found = re.findall(pattern, source)
        assert [b.replace(" ", "") for b in found] == ["gt&1", "(gt+1)&1", "g&1"], cache
    assert source.count(".expect_transaction(8192);") == 6
    # The first loader warp stages a buffer once the 128 converting threads are done with its
    # last tile (consumed); they arrive once V is converted, before the V gather.
    assert "consumed[(gt & 1)].wait((((gt >> 1) & 1) ^ 1));" in source
    assert "consumed[(g & 1)].wait(((((g >> 1) + 1) & 1) ^ 1));" in source
    assert source.count("consumed[(g & 1)].arrive();") == 1
    assert "consumed[0].init(128);" in source and "consumed[1].init(128);" in source
    assert "__sync_thread_partial(11," not in source  # no named barrier a tile of its own
    # The conversion: 8 FP8 values per thread and step (an 8-byte shared load), bit-level for
    # K to bfloat16, the cvt for V to float16 (fp8_f16_pv), one 16-byte store into the swizzled
    # ring slot; 8 steps a call, K's 8 loads before the first store (one call site a tile, K
    # and V: 2 calls a thread each); fenced for wgmma's async proxy.
    assert "prmt.b32" in source and "mul.rn.bf16x2" in source
    assert source.count("tl_e4m3x8_to_bf16x8_x8((&(((fp8_e4_t*)K8)[") == 1
    assert source.count("tl_e4m3x8_to_f16x8_x8((&(((fp8_e4_t*)V8)[") == 1  # fp8_f16_pv
    assert "for (int j = 0; j < 2; ++j) {\n" in source
    prelude = source[source.index("void tl_e4m3x8_to_bf16x8_x8(") :]
    prelude = prelude[: prelude.index("\n}\n")]
    loads = [prelude.index(f"const uint2 a{u} = ") for u in range(8)]
    assert max(loads) < prelude.index("tl_e4m3x8_store_bf16x8(a0, d0);")
    assert source.count("__tl_cvt_fp8x2_to_half2(") == 4  # the gathered V pages only
    conversion = source[
        source.index("k8_full[(g & 1)].wait(") : source.index("v_full[(g & 1)].arrive()")
    ]  # fmt: skip
    assert conversion.count("tl::fence_proxy_async();") == 2
    assert conversion.index("consumed[(g & 1)].arrive();") < conversion.index("V_cache")
    # The consumers store the output from registers: no output buffer (its room stages a tile).
    assert "O_shared" not in source
    assert "*(uint1*)(Output + " in source and "__float22bfloat162_rn(" in source
    # v_scale, a kernel argument (out_scale in the source), scales the output (not lse); the
    # page stride reaches the descriptors in bytes (one an element).
    assert "float out_scale" in source and "(out_scale / logsum[" in source  # named so
    assert "(int64_t)k_page_stride" in host and "(int64_t)v_page_stride" in host


def test_fp8_float16_converts_with_the_cvt():
    source, _, _ = compiled("float16")
    assert "prmt.b32" not in source
    assert source.count("__tl_cvt_fp8x2_to_half2(") == 12  # K, V, the gathered V pages
    assert "*(fp8_e4_8_t*)(((fp8_e4_t*)K8) + " in source
    assert "*(uint4*)(((half_t*)K_shared) + " in source


def prmt_sign(x: int, selector: int) -> int:
    """PTX prmt.b32 d, x, 0, selector: byte i of d is byte selector[i] & 7 of (0, x) (x's bytes
    0 .. 3), or that byte's sign bit repeated if selector[i] & 8."""
    d = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (x >> (8 * (nibble & 7))) & 0xFF if (nibble & 7) < 4 else 0
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << (8 * i)
    return d


def test_fp8_bfloat16_bits_are_exact():
    """The bit-level conversion's constants on every e4m3 value in every byte of a word:
    bfloat16 of value x 2^-120, times 2^120, is the value (subnormals included); NaN reads as
    +-480 (the CUDA kernel's too)."""
    fp8 = fp8_module()
    factor = torch.tensor([fp8.BF16_2_POW_120], dtype=torch.int16).view(BF16).float()
    assert factor.item() == 2.0**120
    values = torch.arange(256, dtype=torch.uint8)
    expected = values.view(FP8).float()
    expected[values & 0x7F == 0x7F] = 480.0 * torch.where(
        values[values & 0x7F == 0x7F] > 0x7F, -1, 1
    )
    rng = torch.Generator().manual_seed(0)
    for byte in range(4):
        others = torch.randint(0, 2**32, (256,), generator=rng, dtype=torch.int64)
        words = (others & ~(0xFF << (8 * byte))) | (values.long() << (8 * byte))
        selector = fp8.BF16_SELECTORS[byte // 2]
        lanes = [(prmt_sign(int(w), selector) << 4) & fp8.BF16_MASK for w in words]
        half = [(x >> (16 * (byte % 2))) & 0xFFFF for x in lanes]
        scaled = torch.tensor(half, dtype=torch.int32).to(torch.int16).view(BF16).float()
        converted = (scaled * factor).to(BF16).float()  # exact: bf16 holds every e4m3 value
        assert torch.equal(converted, expected), byte


@pytest.mark.parametrize("dtype", tilelang_kernels().FP8_VARIANTS)
def test_fp8_compiles_without_register_spills(dtype):
    """The converting producer warpgroup runs on 72 registers (56 spilled; float16 spilled at 64
    while its V gather was unrolled) beside 216 for each consumer warpgroup: both dtypes, their
    conversions differ."""
    source, _, ptxas = compiled(dtype)
    assert "tl::warpgroup_reg_dealloc<72>" in source
    assert "tl::warpgroup_reg_alloc<216>" in source
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


@pytest.mark.parametrize("dtype", tilelang_kernels().FP8_VARIANTS)
def test_fp8_register_split_fits_the_launch(dtype):
    """setmaxnreg moves registers within the block's pool, what the launch gave it (ptxas's count
    a thread times the threads), and setmaxnreg.inc blocks until the pool has enough: a split
    over it hangs the kernel. 64 / 224 asked 64 x 128 + 224 x 256 = 65536 of 168 x 384 = 64512:
    one consumer warpgroup never got its registers, the launch never completed on the H100."""
    source, _, ptxas = compiled(dtype)
    (threads,) = map(int, re.findall(r"__launch_bounds__\((\d+), 1\)", source))
    (launch,) = map(int, re.findall(r"Used (\d+) registers", ptxas))
    (producer,) = map(int, re.findall(r"tl::warpgroup_reg_dealloc<(\d+)>", source))
    (consumer,) = map(int, re.findall(r"tl::warpgroup_reg_alloc<(\d+)>", source))
    assert threads == 384 and producer % 8 == 0 and consumer % 8 == 0
    assert producer * 128 + consumer * (threads - 128) <= launch * threads


# 1b. Knob fp8_split_q (on in the shipped config): Q K^T in e4m3 on the cache's K ---------------

SPLIT_Q = "fp8_split_q"
E4M3_QK = (
    "tl::wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, "
    "tl::DataType::kFloat32, 64, 128, 32, false, false"
)  # m64n128k32, both operands K-major in shared memory


def split_q_config():
    """The shipped config of the FP8 program (paged: no pingpong), the knob on."""
    return tilelang_kernels().block_config("bfloat16", True, False)


def compiled_split_q(dtype: str = "bfloat16"):
    """(device source, host source, ptxas report) of the FP8 variant with fp8_split_q."""
    key = (dtype, SPLIT_Q)
    if key not in _compiled:
        kernels = tilelang_kernels()
        kernel, ptxas = compile_fresh(
            kernels, dtype, True, page_size=64, cache_dtype=kernels.FP8_E4M3, **split_q_config()
        )  # fmt: skip
        _compiled[key] = (kernel.get_kernel_source(), kernel.adapter.get_host_source(), ptxas)
    return _compiled[key]


def steps_module():
    package = tilelang_kernels().__name__.rpartition(".")[0]
    return importlib.import_module(package + ".gqa_prefill_steps")


def test_fp8_split_q_is_on_in_the_shipped_fp8_config():
    """The FP8 programs are causal and paged (block_config(dtype, True, False)); the packed
    decode-like ones (pack_config) split q over FP8 caches under bfloat16 q, with three ring
    stages in the room that K's staging and 16-bit slots left (TUNING.md, GQA head packing)."""
    kernels = tilelang_kernels()
    assert all(kernels.block_config(d, True, False)[SPLIT_Q] is True for d in FP8_DTYPES)
    packed_fp8 = kernels.pack_config("bfloat16", kernels.FP8_E4M3)
    assert packed_fp8[SPLIT_Q] is True and packed_fp8["num_stages"] == 3
    for config in (kernels.pack_config(), kernels.pack_config("float16", kernels.FP8_E4M3)):
        assert not config.get(SPLIT_Q, False) and config["num_stages"] == 2
    assert kernels.pack_config()["fp8_f16_pv"] is True  # P V in float16 there too


FP8_DTYPES = ("bfloat16", "float16")


@pytest.mark.parametrize(
    "dtype,fp8,split,pack,applies",
    [
        ("bfloat16", True, False, False, True),
        ("float16", True, False, False, False),  # 11 bits: two e4m3 terms hold 8
        ("bfloat16", True, True, False, True),  # split, packed or both: the decode-like ones
        ("bfloat16", True, False, True, True),
        ("bfloat16", True, True, True, True),
        ("bfloat16", False, False, False, False),  # 16-bit caches: nothing to split for
    ],
)
def test_fp8_split_q_applies_to_the_bfloat16_programs_over_fp8_caches(
    dtype, fp8, split, pack, applies
):
    """A knob merged into every config (scripts/tilelang_variant.py) reaches every program;
    only the bfloat16 ones over FP8 caches change (split, packed or not)."""
    kernels = tilelang_kernels()
    steps = steps_module().build_steps(
        dtype, True, 64 if pack else 128, 128, 64, cache_dtype=kernels.FP8_E4M3 if fp8 else None,
        split=split, pack=pack, fp8_split_q=True, fp8_f16_pv=True,
    )  # fmt: skip
    assert steps.split_q == applies
    assert getattr(steps.kv, "split_q", False) == applies
    if fp8:
        assert steps.kv.k_ring_dtype == (kernels.FP8_E4M3 if applies else dtype)
        # fp8_f16_pv: P V in float16 in every bfloat16 FP8 program, split, packed or not.
        assert steps.kv.v_ring_dtype == ("float16" if dtype == "bfloat16" else dtype)


def test_fp8_split_q_runs_q_kt_in_e4m3_without_converting_k():
    """The consumers' Q K^T: two e4m3 wgmmas (q_hi, then q_lo into the same accumulator) on
    the ring's e4m3 K at each of its three call sites (tile 0, the unmasked and the masked
    loop); P V in float16 (fp8_f16_pv, on in the shipped config). K comes by TMA straight into
    the ring slot (a box of 64 slots x 128 bytes per page in the cache, on k_full), 128-byte
    swizzled as the e4m3 wgmma's descriptors read it; only V is staged and converted."""
    source, host, _ = compiled_split_q()
    assert source.count(E4M3_QK) == 6
    assert "wgmma_ss<tl::DataType::kBFloat16" not in source  # no 16-bit Q K^T
    assert "tl::wgmma_rs<tl::DataType::kFloat16, tl::DataType::kFloat16" in source  # P V
    assert "tl::wgmma_rs<tl::DataType::kBFloat16" not in source
    descriptor = r"initialize_wgmma_descriptor<1, 1, 64>\(desc_a\w*, \(&\(\(\(fp8_e4_t\*\)(Q_\w+)\)"
    descriptors = re.findall(descriptor, source)  # the A operand of each e4m3 Q K^T
    assert descriptors == ["Q_hi", "Q_lo"] * 3, descriptors
    # No K staging and no K conversion; V's as the shipped program's.
    assert "K8" not in source and "k8_full" not in source
    assert source.count("tl_e4m3x8_to_f16x8_x8((&(((fp8_e4_t*)V8)[") == 1  # fp8_f16_pv
    assert source.count(".expect_transaction(8192);") == 4  # K: 1 site, V: 3 (as before)
    pattern = (
        r"tl::tma_load\(K_cache_desc, k_full\[\(g & 1\)\], "
        r"\(&\(\(\(fp8_e4_t\*\)K_shared\)\[\(\(\(g & 1\) \* 16384\) \+ \(p_\d+ \* 8192\)\)\]\)\), "
        r"0, 0, \(tile\[5\] >> 2\), pages\[p_\d+\]\);"
    )
    assert len(re.findall(pattern, source)) == 1
    # The K slot is waited free (k_empty) before the boxes, and k_full's 128 loader threads
    # arrive after them.
    k_load = source[source.index("k_empty[(g & 1)].wait(") : source.index("v8_full[(g & 1)].wait(")]
    assert "tl::tma_load(K_cache_desc" in k_load and k_load.count("k_full[(g & 1)].arrive();") == 1
    assert "k_full[0].init(128);" in source
    swizzles = tensor_map_swizzles(host)
    assert swizzles["K_cache_desc"] == 3, swizzles  # CU_TENSOR_MAP_SWIZZLE_128B
    assert swizzles["V_cache_desc"] == 0, swizzles  # the staging buffer: no swizzle


def tensor_map_swizzles(host: str) -> dict:
    """{descriptor: its swizzle mode} from the host source's cuTensorMapEncodeTiled calls
    (TileLang's packed arguments: descriptor, dtype, rank, address, rank dims, rank strides,
    rank box dims, rank element strides, interleave, swizzle, ...)."""
    swizzles = {}
    creations = re.findall(r"void\* (\w+_desc) = stack_\d+;(.*?)TVMFFIFunctionCall", host, re.S)
    for name, call in creations:
        value = r"stack_ffi_any\)\[(\d+)\]\.v_int64\) = \(\(int64_t\)(-?\d+)\);"
        args = dict(re.findall(value, call))
        rank = int(args["2"])
        swizzles[name] = int(args[str(4 + 4 * rank + 1)])
    return swizzles


def test_fp8_split_q_splits_q_once_an_item_with_the_kernels_constants():
    """After Q lands, each consumer thread reads its accumulator rows of Q (bf16 -> fp32), takes
    each row's largest |q| (shuffles within the quad), derives 2^-e (the row's softmax factor,
    times scale * log2 e) and 2^e (NaN for a row holding inf) from its float bits with the
    module's constants (split_rows below models them), writes e4m3(x 2^e) and e4m3 of the
    remainder into Q_hi and Q_lo (satfinite: values stay below 256), fences them for the
    async proxy, and the consumers sync before the first e4m3 wgmma. The softmax takes the
    per-row factor in its FMA."""
    source, _, _ = compiled_split_q()
    fp8 = fp8_module()
    start = source.index("q_full[0].wait((items_done[0] & 1));")
    split = source[start : source.index(E4M3_QK, start)]
    assert "__bfloat1622float2(" in split and "tl::AllReduce<tl::MaxOp, 4, 1" in split
    clamp = fp8.E_CLAMP
    target = fp8.SPLIT_Q_TOP
    assert f"min(max((biased - 127), -{clamp}), {clamp})" in split
    assert re.search(rf"condval_\d+ = {target};", split)  # a row of zeros: scaled by 1
    assert f"+ {127 - target}) << 23" in split  # 2^(e - 7): the softmax's factor
    assert f"({127 + target} - condval" in split  # 2^(7 - e): the scale into [128, 256)
    assert "(biased == 255)" in split and "CUDART_NAN_F" in split
    assert split.count("__NV_SATFINITE, __NV_E4M3)") == 3  # q_hi, q_hi again, q_lo
    assert "__tl_cvt_fp8x2_to_float2(" in split  # q_hi back to fp32 for the remainder
    assert "(fp8_e4_t*)Q_hi)" in split and "(fp8_e4_t*)Q_lo)" in split
    fence = split.rindex("tl::fence_proxy_async();")
    barrier = split.rindex("tl::__sync_thread_partial(4, 256);")
    assert split.rindex("(fp8_e4_t*)Q_lo)") < fence < barrier
    factors = re.findall(r"exp2f\(\(\(scores_max_prev\[i_\d+\] \* (\w+)\[", source)
    assert factors == ["row_scale"] * 3, factors  # each softmax: tile 0's, both loops'
    assert "sm_scale * 0x1.71547652b82fep+0f" in split  # scale * log2 e, k_scale folded


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_fp8_split_q_compiles_without_register_spills(dtype):
    """The knob-on program keeps the shipped split (72 / 216 within the launch's 168) with 0
    spills: the split's 64 fp32 values a thread live in acc_s, free between items."""
    source, host, ptxas = compiled_split_q(dtype)
    assert "tl::warpgroup_reg_dealloc<72>" in source
    assert "tl::warpgroup_reg_alloc<216>" in source
    assert "Used 168 registers" in ptxas
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas


def test_fp8_loader_reads_page_ids_a_tile_ahead():
    """ReadPageIds: in the loaders' tile loop, tile k's ids come from the registers loaded at
    tile k - 1 (StartItem: tile 0's), and the loads of tile k + 1's and k + 2's ids (two pages a
    tile: kv_indices at k x 2 + 2 and + 4) are issued there, none of tile k's own; StageTile
    takes k + 2's from them (TUNING.md, FP8: page ids a tile ahead)."""
    source = compiled_split_q()[0]
    assert re.search(r"pages\[(\w+)\] = next_pages\[\1\];", source)
    loads = re.findall(r"kv_indices\[\(+\(\(int64_t\)k\) \* \(int64_t\)2\)[^;]*;", source)
    assert loads and all(load.endswith(("(int64_t)2)];", "(int64_t)4)];")) for load in loads)
    assert any(load.endswith("(int64_t)2)];") for load in loads)
    assert any(load.endswith("(int64_t)4)];") for load in loads)


def test_fp8_loaders_convert_without_a_barrier_before():
    """The staged V tile's TMA landing (v8_full) and the ring slot's release (v_empty) order the
    conversion's reads and writes: Convert passes its FP8 sources to the prelude with access
    mask 0, so TileLang's planner puts no 128-thread barrier between those waits and the
    conversion (the loader warps no longer wait there for the first one's staging: TUNING.md,
    FP8)."""
    source = compiled_split_q()[0]
    (between,) = re.findall(r"v_empty\[[^\n]*\]\.wait\([^\n]*\n(.*?)tl_e4m3x8_to_f16x8_x8\(",
                            source, re.S)  # fmt: skip
    assert "__sync_thread_partial" not in between


def test_fp8_f16_pv_converts_v_with_the_cvt_and_rounds_p_to_float16():
    """Knob fp8_f16_pv (on in the shipped config, with the split): V's ring slots are float16,
    filled by the prelude's grouped cvt.rn.f16x2.e4m3x2 (two a word, no bf16x2 multiply) and,
    for pages that are not whole, by the gather's casts to half; P is rounded to half for the
    P V wgmma; the output stays bfloat16."""
    source, _, _ = compiled_split_q()
    fp8 = fp8_module()
    assert split_q_config()["fp8_f16_pv"] is True
    assert source.count("cvt.rn.f16x2.e4m3x2") == 2  # the prelude's, once per 16-bit half
    assert "tl_e4m3x8_to_bf16x8_x8((" not in source  # defined, never called
    assert "mul.rn.bf16x2" in fp8.FP8_TO_BF16 and "mul.rn.bf16x2" not in fp8.FP8_TO_F16
    assert "half_t V_shared_local_cast[8];" in source  # the V gather's casts
    assert "*(uint4*)(((half_t*)V_shared) + " in source
    assert "bfloat16_t* __restrict__ Output" in source  # the output in q's dtype


def test_fp8_split_q_leaves_float16_q_on_the_16_bit_path():
    """float16 q: the knob (on in the shipped config) changes nothing, its program (TileLang's
    TIR, before lowering) is the one with the knob off, text for text."""
    kernels = tilelang_kernels()
    config = kernels.block_config("float16", True, False)
    scripts = [
        kernels.gqa_prefill(
            "float16", True, page_size=64, cache_dtype=kernels.FP8_E4M3,
            **{**config, SPLIT_Q: knob},
        ).script()
        for knob in (True, False)
    ]  # fmt: skip
    assert scripts[0] == scripts[1]
    assert "e4m3" in scripts[0]  # the FP8 program indeed


def split_rows(q: torch.Tensor, top: int, clamp: int):
    """The kernel's split (SplitQ) of bf16 rows, in torch: (q_hi, q_lo, 2^-e, 2^e) with
    e = top - floor(log2 max |row|) (the exponent clamped to [-clamp, clamp]; a row of zeros
    or subnormals: e = 0; a row holding inf: 2^e NaN), q_hi = e4m3(q 2^e) and q_lo =
    e4m3(q 2^e - q_hi), both rounded to nearest, satfinite."""
    values = q.float()
    largest = values.abs().where(~values.isnan(), 0.0).amax(dim=1)  # fmaxf ignores NaN
    biased = (largest.view(torch.int32) >> 23) & 0xFF
    exponent = torch.where(biased == 0, top, (biased - 127).clamp(-clamp, clamp))
    unscale = ((127 - top + exponent) << 23).view(F32)
    scale = ((127 + top - exponent) << 23).view(F32)
    scale = torch.where(biased == 0xFF, torch.nan, scale)
    scaled = values * scale[:, None]

    def e4m3(x):
        return x.clamp(-448, 448).to(FP8).float().where(~x.isnan(), torch.nan)

    q_hi = e4m3(scaled)
    return q_hi, e4m3(scaled - q_hi), unscale, scale


def test_fp8_split_q_terms_are_exact_on_bf16_rows():
    """The module's constants (SPLIT_Q_TOP, E_CLAMP) on random bf16 rows over 60 binades, rows
    of zeros and of subnormals: the scaled row's largest |value| lies in [2^top, 2^(top + 1))
    (under e4m3's 448), q_hi + q_lo is the scaled row exactly where |value| >= 1/4 and within
    2^-10 below, and 2^-e undoes the scaling exactly; a row holding inf gets a NaN scale (all
    its terms NaN), a NaN stays NaN in its place."""
    fp8 = fp8_module()
    top, clamp = fp8.SPLIT_Q_TOP, fp8.E_CLAMP
    assert 2.0 ** (top + 1) <= 448.0  # no term saturates
    assert 2.0 ** -(clamp + top) > torch.finfo(F32).tiny  # 2^e, 2^-e normal floats
    rng = torch.Generator().manual_seed(1)
    magnitudes = 2.0 ** torch.randint(-30, 30, (512, 1), generator=rng).float()
    q = (torch.randn(512, HEAD_DIM, generator=rng) * magnitudes).to(BF16)
    q[0] = 0
    q[1] = torch.tensor(2.0**-130).to(BF16)  # subnormal bf16
    q_hi, q_lo, unscale, scale = split_rows(q, top, clamp)
    scaled = q.float() * scale[:, None]
    rows = slice(2, None)
    largest = scaled[rows].abs().amax(dim=1)
    assert ((2.0**top <= largest) & (largest < 2.0 ** (top + 1))).all()
    big = scaled.abs() >= 0.25
    assert torch.equal((q_hi + q_lo)[big], scaled[big])
    assert ((q_hi + q_lo - scaled).abs() <= 2.0**-10).all()
    assert torch.equal(scaled * unscale[:, None], q.float())
    assert not q_hi[:2].any() and not q_lo[:2].any() and (unscale[:2] == 1).all()
    # inf: the whole row NaN; NaN: that value NaN, the rest split as usual.
    q[5, 3] = torch.inf
    q[6, 7] = torch.nan
    q_hi, q_lo, _, scale = split_rows(q, top, clamp)
    assert scale[5].isnan() and q_hi[5].isnan().all() and q_lo[5].isnan().all()
    assert q_hi[6, 7].isnan() and q_hi[6].isnan().sum() == 1 and not scale[6].isnan()


# 2. The entry point's host logic on the CPU ----------------------------------------------------


def fp8_args(total_q=4, pages=3, batch=2, dtype=BF16, **changes):
    args = dict(
        q=torch.randn(total_q, NUM_HEADS, HEAD_DIM, dtype=dtype),
        k_cache=torch.zeros(pages, 64, NUM_KV_HEADS, HEAD_DIM, dtype=FP8),
        v_cache=torch.zeros(pages, 64, NUM_KV_HEADS, HEAD_DIM, dtype=FP8),
        qo_indptr=torch.tensor([0, 1, total_q][: batch + 1], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 1, pages][: batch + 1], dtype=torch.int32),
        kv_indices=torch.arange(pages, dtype=torch.int32),
        kv_last_page_len=torch.full((batch,), 5, dtype=torch.int32),
        k_scale=0.5,
        v_scale=0.25,
        sm_scale=1.0 / math.sqrt(HEAD_DIM),
        output=torch.zeros(total_q, NUM_HEADS, HEAD_DIM, dtype=dtype),
        lse=torch.zeros(total_q, NUM_HEADS, dtype=F32),
    )
    args.update(changes)
    return args


@pytest.fixture
def recorded_launches(monkeypatch):
    """The packed FP8 entry with its device checks told that CPU tensors are fine and a stand-in
    kernel that records each launch's arguments and the variant it was asked for."""
    entry = entry_module(SOLUTION)
    contract = sys.modules[entry.__name__.rpartition(".")[0] + ".arguments"]
    for name in ("check_layout", "check_placement"):
        check = functools.partial(getattr(contract, name), interpreted=True)
        monkeypatch.setattr(entry, name, check)
    launches = []

    def kernel(dtype, causal, device, page_size=None, window=False, fp8=False, split=False,
               pack=False):  # fmt: skip
        return lambda *args: launches.append(((dtype, causal, page_size, fp8, split, pack), args))

    monkeypatch.setattr(entry, "_kernel", kernel)

    def per_dtype(name):  # the decode program and its merge (the decode path), by q's dtype
        return lambda dtype, device: lambda *args: launches.append(((name, dtype), args))

    monkeypatch.setattr(entry, "_decode_kernel", per_dtype("decode"))
    monkeypatch.setattr(entry, "_merge_decode_kernel", per_dtype("merge"))
    monkeypatch.setattr(entry, "_workspace", lambda device, rows: (
        torch.zeros(rows, NUM_HEADS, HEAD_DIM), torch.zeros(rows, NUM_HEADS)))  # fmt: skip
    # The plan's: nothing splits (fp8_args' batches are decode-like: packed, keys too short).
    monkeypatch.setattr(entry, "_sm_count", lambda device: 132)
    monkeypatch.setattr(entry, "_fp8_plans", contract.PlanCache())
    monkeypatch.setattr(entry, "_paged_plans", {p: contract.PlanCache() for p in (1, 64)})
    monkeypatch.setattr(entry, "_scheduler", lambda device: torch.zeros(2, dtype=torch.int32))
    return launches


@needs_packed
@pytest.mark.parametrize("decode", ["1", "0"])
@pytest.mark.parametrize("sm_scale", [0.125, -0.3, 0.0])
def test_fp8_entry_folds_the_scales(sm_scale, decode, recorded_launches, monkeypatch):
    """4 tokens over 2 sequences are decode-like: the decode program (gqa_prefill_decode), 1
    share, then its merge into output and lse; under PREFILL_BUNDLE_TILELANG_DECODE=0 the
    packed FP8 program (not the 16-bit one), 1 share. Both take the same arguments."""
    monkeypatch.setenv("PREFILL_BUNDLE_TILELANG_DECODE", decode)
    args = fp8_args(sm_scale=sm_scale, k_scale=2.0, v_scale=-0.75)
    build_solution(SOLUTION)(*args.values())
    if decode == "1":
        (variant, launched), (merge, merged) = recorded_launches  # fmt: skip
        assert variant == ("decode", BF16) and merge == ("merge", BF16)
        assert merged[2] is args["output"] and merged[3] is args["lse"]
    else:
        (variant, launched), = recorded_launches  # fmt: skip
        assert variant == (BF16, True, 64, True, False, True)
    q, k_cache, *rest = launched
    scale, v_scale = rest[-5], rest[-4]  # ... num_pages, sm_scale, v_scale, output, lse, sched
    assert k_cache.dtype == FP8 and v_scale == -0.75
    if sm_scale > 0:
        assert scale == sm_scale * 2.0 and torch.equal(q, args["q"])
    elif sm_scale < 0:  # softmax(s q.k) = softmax(|s| (-q).k)
        assert scale == -sm_scale * 2.0 and torch.equal(q, -args["q"])
    else:
        assert scale == 1.0 and not q.any()


@needs_packed
def test_fp8_decode_batch_past_the_grid_takes_the_packed_program(recorded_launches, monkeypatch):
    """The decode program's grid has the batch as its third dimension (at most 65535 blocks):
    a decode-like batch of 65536 one-token sequences (one shared page here) goes to the packed
    FP8 program instead, whatever the switch."""
    monkeypatch.setenv("PREFILL_BUNDLE_TILELANG_DECODE", "1")
    batch = 65536
    args = fp8_args(pages=1, batch=2)
    args.update(
        q=torch.zeros(batch, NUM_HEADS, HEAD_DIM, dtype=BF16),
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
        kv_indptr=torch.arange(batch + 1, dtype=torch.int32),
        kv_indices=torch.zeros(batch, dtype=torch.int32),
        kv_last_page_len=torch.full((batch,), 5, dtype=torch.int32),
        output=torch.zeros(batch, NUM_HEADS, HEAD_DIM, dtype=BF16),
        lse=torch.zeros(batch, NUM_HEADS, dtype=F32),
    )
    build_solution(SOLUTION)(*args.values())
    (variant, _), *_ = recorded_launches  # fmt: skip
    dtype, causal, page_size, fp8, _, pack = variant
    assert (dtype, causal, page_size, fp8, pack) == (BF16, True, 64, True, True)


FP8_ERRORS = {
    "k_cache bfloat16": ("k_cache", dict(k_cache=torch.zeros(3, 64, 8, 128, dtype=BF16))),
    "v_cache float16": ("v_cache", dict(v_cache=torch.zeros(3, 64, 8, 128, dtype=F16))),
    "k_cache page size 1": ("k_cache", dict(k_cache=torch.zeros(3, 1, 8, 128, dtype=FP8))),
    "k_scale inf": ("k_scale", dict(k_scale=math.inf)),
    "k_scale a tensor": ("k_scale", dict(k_scale=torch.tensor(0.5))),
    "v_scale nan": ("v_scale", dict(v_scale=math.nan)),
    "v_scale None": ("v_scale", dict(v_scale=None)),
    "sm_scale inf": ("sm_scale", dict(sm_scale=math.inf)),
    "k_scale overflows sm_scale": ("k_scale", dict(k_scale=1e308, sm_scale=1e308)),
    "output float16": ("output", dict(output=torch.zeros(4, 32, 128, dtype=F16))),
    "on the CPU": ("q", dict()),
}


@needs_packed
@pytest.mark.parametrize("name,changes", FP8_ERRORS.values(), ids=FP8_ERRORS.keys())
def test_fp8_argument_errors(name, changes):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        build_solution(SOLUTION)(*fp8_args(**changes).values())


# 3. On a GPU ----------------------------------------------------------------------------------


@needs_packed
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fp8_scales_magnitudes_and_cache_views_on_gpu():
    """e4m3 values near +-448 with scales 1/256 (the conversion must be exact at the top of the
    range), k_scale and v_scale not 1 with a negative sm_scale (folded scale negated), and
    FlashInfer's combined [num_pages, 2, 64, 8, 128] cache (k and v views with twice a page's
    stride: the TMA descriptors and the gathered V pages take it)."""
    cases = [
        PagedCase((300, 64), (1000, 64), 64, BF16, fp8_scales=(1 / 256, 1 / 256),
                  kv_magnitude=440.0),
        PagedCase((100, 37), (100, 300), 64, F16, sm_scale=-0.3, fp8_scales=(2.0, 0.25)),
        PagedCase((129, 7), (4100, 7), 64, BF16, sm_scale=-0.05, fp8_scales=(0.5, 3.0)),
    ]  # fmt: skip
    for seed, case in enumerate(cases):
        inputs = make_inputs(case, "cuda", seed)
        check_outputs(run_solution(SOLUTION, case, inputs), reference_outputs(case, inputs))

    case = PagedCase((130, 7, 64), (300, 7, 257), 64, shared_prefix=(128, 0, 128),
                     fp8_scales=(0.5, 2.0))  # fmt: skip
    inputs = make_inputs(case, "cuda", seed=7)
    expected = reference_outputs(case, inputs)
    combined = torch.stack([inputs[1], inputs[2]], dim=1)  # [num_pages, 2, 64, 8, 128]
    views = [inputs[0], combined[:, 0], combined[:, 1]] + inputs[3:]
    assert views[1].stride(0) == 2 * 64 * NUM_KV_HEADS * HEAD_DIM and views[1].dtype == FP8
    check_outputs(run_solution(SOLUTION, case, views), expected)
