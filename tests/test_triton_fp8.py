"""The Triton kernel's FP8 (e4m3) paged caches beyond the shared matrix (interpreter on CPU, the
GPU when there is one): an element type of the paged policy, nothing else.

- The kernel gets the FP8 caches themselves (no dequantized copy) and converts them exactly:
  with power-of-two scales it is the bf16 paged kernel on the dequantized caches (the LSE bit
  for bit in the interpreter).
- Scales that are not 1 and of any sign (k_scale joins sm_scale, whose sign _positive_scale
  handles; v_scale only multiplies the output).
- Cache views: FlashInfer's combined K/V cache, and a page stride that is a multiple of 16
  bytes but not of 8 elements of a page (FP8's alignment is in bytes).
- FP8 and bf16 plans never stand in for each other.
"""

import inspect
import sys

import pytest
import torch
import triton
import triton.language as tl
from test_triton_paged import DEVICE, HAS_CUDA, triton_module

from prefill_bundle.testing import (
    PagedCase,
    build_solution,
    check_outputs,
    make_inputs,
    poisoned_outputs,
    reference_outputs,
)

FP8 = torch.float8_e4m3fn
CASE = PagedCase((9, 3), (70, 3), 64, fp8_scales=(2.0, 0.5))  # bf16; a full and a partial page
SMALL = PagedCase((9, 3), (70, 3), 64, torch.float16, fp8_scales=(1.0, 1.0))


def with_scales(inputs, k_scale, v_scale, sm_scale) -> list:
    return inputs[:7] + [k_scale, v_scale, sm_scale]


def run_fp8(inputs) -> list:
    outputs = poisoned_outputs(SMALL, inputs)
    triton_module().run_paged_ps64_fp8kv(*inputs, *outputs)
    return outputs


def test_fp8_is_the_bf16_kernel_on_dequantized_caches(monkeypatch):
    """The launch gets the FP8 caches (not a copy); e4m3 -> bf16 is exact and power-of-two scales
    are too, so the bf16 kernel on k_cache * 2, v_cache * 0.5 (in bf16) computes the same
    logits (bf16 q's Q K^T as two e4m3 products, split_q_fp8: the same up to fp32 rounding in
    the interpreter), and an output that differs only by where v_scale is applied and by P's
    rounding (P V in float16 under the split: _load_v_tile)."""
    module = triton_module()
    inputs = make_inputs(CASE, DEVICE, seed=21)
    k_cache, v_cache = inputs[1:3]
    launched = []
    launch = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a: launched.append(a[3]) or launch(*a))
    fp8 = poisoned_outputs(CASE, inputs)
    module.run_paged_ps64_fp8kv(*inputs, *fp8)
    (args,) = launched
    assert args[1] is k_cache and args[2] is v_cache and args[1].dtype == FP8
    dequantized = inputs[:1] + [k_cache.to(torch.bfloat16) * 2.0, v_cache.to(torch.bfloat16) * 0.5]
    bf16 = poisoned_outputs(CASE, inputs)
    module.run_paged_ps64(*dequantized, *inputs[3:7], inputs[-1], *bf16)
    check_outputs(fp8, bf16)
    if not HAS_CUDA:  # the same logits, summed in another order
        torch.testing.assert_close(fp8[1], bf16[1], rtol=1e-5, atol=1e-5)
    check_outputs(fp8, reference_outputs(CASE, inputs))


@pytest.mark.parametrize(
    "k_scale, v_scale, sm_scale",
    [(2.0, 0.25, -0.3), (-1.5, -3.0, 0.2), (0.0, 1.0, 0.1), (1 / 64, 4.0, 1.0)],
    ids=["negative_sm_scale", "negative_k_and_v_scale", "zero_k_scale", "small_k_large_v"],
)
def test_scales(k_scale, v_scale, sm_scale):
    """sm_scale * k_scale <= 0 takes _positive_scale; v_scale scales the output, not the LSE."""
    inputs = with_scales(make_inputs(SMALL, DEVICE, seed=22), k_scale, v_scale, sm_scale)
    check_outputs(run_fp8(inputs), reference_outputs(SMALL, inputs))


@pytest.mark.parametrize("layout", ["kv_interleaved", "page_plus_16_bytes"])
def test_cache_views_with_page_strides(layout):
    inputs = make_inputs(SMALL, DEVICE, seed=23)
    k_cache, v_cache = inputs[1:3]
    if layout == "kv_interleaved":  # [num_pages, 2, 64, 8, 128]: a page stride of two pages
        buffer = torch.stack([k_cache.view(torch.uint8), v_cache.view(torch.uint8)], 1)
        views = [buffer[:, 0].view(FP8), buffer[:, 1].view(FP8)]
    else:  # 16 bytes between pages: 16 FP8 elements, which bf16's 8-element rule would not have
        page = k_cache[0].numel()
        views = []
        for cache in (k_cache, v_cache):
            flat = torch.full((cache.shape[0], page + 16), float("nan"), device=DEVICE).to(FP8)
            flat[:, :page] = cache.flatten(1)
            views.append(flat.as_strided(cache.shape, (page + 16,) + cache.stride()[1:]))
    assert views[0].stride(0) != k_cache[0].numel() and views[0].dtype == FP8
    assert all(torch.equal(a.float().nan_to_num(), b.float().nan_to_num())
               for a, b in zip(views, (k_cache, v_cache)))  # fmt: skip
    strided = inputs[:1] + views + inputs[3:]
    check_outputs(run_fp8(strided), reference_outputs(SMALL, inputs))


_split_q_fp8 = None  # the packed solution's kv_loops.split_q_fp8, set by the test


@triton.jit
def _split_rows(q_ptr, hi_ptr, lo_ptr, scale_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                INTERPRETED: tl.constexpr):  # fmt: skip
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    q_hi, q_lo, scales = _split_q_fp8(tl.load(q_ptr + offsets), 3.0, INTERPRETED)
    tl.store(hi_ptr + offsets, q_hi.to(tl.float32))
    tl.store(lo_ptr + offsets, q_lo.to(tl.float32))
    tl.store(scale_ptr + tl.arange(0, ROWS), scales)


def test_q_split_into_two_e4m3_terms_is_exact():
    """split_q_fp8 (FP8 caches under bf16 q): each term an e4m3 value, their sum q x 2^e_row
    (the row's largest in [128, 256)) exactly from 1/4 up, within 2^-10 below (e4m3's
    subnormal steps: 2^-17 of the row's largest), and the rows' scales 3.0 x 2^-e_row, for
    rows of ordinary values, values that round up to a power of two (1.94 -> 2 in the top
    term), a row whose largest is tiny or huge, and a row of zeros; a row holding inf becomes
    NaN (the saturating e4m3 cast would make inf finite, hiding it). (A NaN value stays NaN
    through the GPU's cast, which saturates infinities only; the interpreter's bf16 loads do
    not keep a NaN, so that is not tested here.)"""
    rows = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    rows[1] = torch.linspace(1.875, 1.9999, 32)  # the top term's rounding carries
    rows[2] *= 2.0**-60
    rows[3] *= 2.0**70
    rows[4] = 0.0
    rows[5, 1:] *= 2.0**-11  # mostly below 1/4 once scaled
    rows[6, 3] = float("inf")
    q = rows.to(torch.bfloat16).to(DEVICE)
    global _split_q_fp8
    package = triton_module().__name__.rpartition(".")[0]
    _split_q_fp8 = sys.modules[package + ".kv_loops"].split_q_fp8
    q_hi, q_lo = torch.empty(2, 8, 32, device=DEVICE)
    scales = torch.empty(8, device=DEVICE)
    _split_rows[(1,)](q, q_hi, q_lo, scales, ROWS=8, COLS=32, INTERPRETED=not HAS_CUDA)
    q, q_hi, q_lo, scales = (t.float().cpu() for t in (q, q_hi, q_lo, scales))
    assert q_hi[6].isnan().all() and q_lo[6].isnan().all()  # inf: the whole row is NaN
    keep = [0, 1, 2, 3, 4, 5, 7]
    q, q_hi, q_lo, scales = q[keep], q_hi[keep], q_lo[keep], scales[keep]
    for term in (q_hi, q_lo):
        assert torch.equal(term.to(FP8).float(), term)  # an e4m3 value already
    top = q.abs().amax(1)
    exponent = torch.where(top > 0, 7 - torch.floor(torch.log2(top)), 7 - -100.0)
    torch.testing.assert_close(scales, 3.0 * torch.exp2(-exponent), rtol=0, atol=0)
    scaled = q * torch.exp2(exponent)[:, None]
    exact = scaled.abs() >= 0.25
    assert torch.equal((q_hi + q_lo)[exact], scaled[exact])
    assert ((q_hi + q_lo) - scaled).abs().max() <= 2.0**-10
    assert (~exact[5]).sum() > 16 and exact.sum() > 100  # both regimes are tested
    scaled_top = scaled.abs().amax(1)
    assert ((scaled_top >= 128) & (scaled_top < 256) | (top == 0)).all()


def test_fp8_and_bf16_plans_stay_apart():
    """One shape, both definitions: each entry checks its own cache dtype however the other
    was called (the plan caches are apart; the key has the cache dtype as well)."""
    module = triton_module()
    inputs = make_inputs(SMALL, DEVICE, seed=24)
    half = [x.to(SMALL.dtype) for x in inputs[1:3]]
    module._fp8_plans.clear()
    module._paged_plans[64].clear()
    run_fp8(inputs)
    outputs = poisoned_outputs(SMALL, inputs)
    with pytest.raises(ValueError, match="k_cache"):  # an FP8 cache to the bf16/fp16 entry
        module.run_paged_ps64(*inputs[:7], inputs[-1], *outputs)
    module.run_paged_ps64(inputs[0], *half, *inputs[3:7], inputs[-1], *outputs)
    with pytest.raises(ValueError, match="k_cache"):  # a half cache to the FP8 entry
        module.run_paged_ps64_fp8kv(inputs[0], *half, *inputs[3:], *outputs)
    assert len(module._fp8_plans) == 1 and len(module._paged_plans[64]) == 1


@pytest.mark.parametrize("name, value", [("k_scale", float("nan")), ("v_scale", float("inf")),
                                         ("k_scale", True), ("v_scale", None)])  # fmt: skip
def test_bad_scales_are_named(name, value):
    inputs = make_inputs(SMALL, DEVICE, seed=25)
    inputs[7 if name == "k_scale" else 8] = value
    with pytest.raises(ValueError, match=name):
        run_fp8(inputs)


def test_packed_solution_is_the_fp8_entry():
    runnable = build_solution("triton_fp8kv")
    inputs = make_inputs(SMALL, DEVICE, seed=26)
    outputs = poisoned_outputs(SMALL, inputs)
    runnable(*inputs, *outputs)
    check_outputs(outputs, reference_outputs(SMALL, inputs))


def kv_loops_module():
    return sys.modules[triton_module().__name__.rsplit(".", 1)[0] + ".kv_loops"]


def test_bf16_conversion_has_the_checked_constants():
    """The GPU's e4m3 -> bf16 conversion (_e4m3_to_bf16, inline PTX) uses the TileLang FP8
    source's constants, which tests/test_tilelang_fp8.py checks on every e4m3 value."""
    from test_tilelang_fp8 import fp8_module

    fp8 = fp8_module()
    asm = inspect.getsource(kv_loops_module()._e4m3_to_bf16.fn)
    assert f"prmt.b32 lo, $2, 0, {fp8.BF16_SELECTORS[0]:#X}".replace("0X", "0x") in asm
    assert f"prmt.b32 hi, $2, 0, {fp8.BF16_SELECTORS[1]:#X}".replace("0X", "0x") in asm
    assert asm.count(f"{fp8.BF16_MASK:#X}".replace("0X", "0x")) == 2
    assert f"mov.b32 scale, {fp8.BF16_2_POW_120 * 0x10001:#X}".replace("0X", "0x") in asm
    assert asm.count("shl.b32") == 2 and asm.count("mul.rn.bf16x2") == 2


_convert = None  # kv_loops._e4m3_to_bf16 of the built solution (set before convert_kernel runs)


@triton.jit
def convert_kernel(x, y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y + offsets, _convert(tl.load(x + offsets)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="inline PTX: the GPU only")
def test_bf16_conversion_on_every_e4m3_value():
    """_e4m3_to_bf16 on the GPU: every e4m3 value in every position of a 4-value group is its
    bf16 value exactly (subnormals too); NaN reads as +-480 (the CUDA and TileLang kernels')."""
    global _convert
    _convert = kv_loops_module()._e4m3_to_bf16
    values = torch.arange(256, dtype=torch.uint8)
    for shift in range(4):  # each value at each position of a group of four
        x = torch.roll(values, shift).cuda().view(FP8)
        y = torch.full((256,), float("nan"), dtype=torch.bfloat16, device="cuda")
        convert_kernel[(1,)](x, y, N=256)
        expected = x.float()
        nan = torch.isnan(expected)
        expected[nan] = torch.where(x.view(torch.uint8)[nan] > 0x7F, -480.0, 480.0)
        torch.testing.assert_close(y.float(), expected, rtol=0, atol=0)
