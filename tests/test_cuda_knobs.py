"""The CUDA solution's tuning knobs without a GPU (prefill_bundle/cuda_variants.py,
scripts/tune_cuda.py): the shipped build reports the shipped knobs, a variant instantiates its
knob values for sm_90a and reports them, and a build whose knobs differ from the ones asked for
raises. The kernels' arithmetic under other knobs runs only on a GPU (scripts/tune_cuda.py)."""

import shutil
from pathlib import Path

import pytest

from prefill_bundle import cuda_build
from prefill_bundle.cuda_variants import SHIPPED, BuildKnobs, check_knobs, variant_header
from prefill_bundle.testing import build_solution, load_script

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
# A variant that changes the ring depth and the output staging of the causal kernels (the knobs
# with the most layout arithmetic behind them).
VARIANT = "causal_3_stages"


def tune_cuda():
    return load_script("tune_cuda")


def loadable(build):
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - the reason goes into the skip
        if "load" in str(error).lower():
            pytest.skip(f"the built module does not load here: {error}")
        raise


def test_variants_name_knob_types():
    variants = tune_cuda().VARIANTS
    assert variants["default"] == SHIPPED
    assert len(set(variants.values())) == len(variants), "two variants with the same knobs"
    header = variant_header(VARIANT, variants[VARIANT])
    assert f"#define gqa_prefill gqa_prefill_{VARIANT}\n" in header
    assert (
        "#define GQA_PREFILL_KNOBS BuildKnobs<HopperKnobs<128, 3, 32, 232, true, false, true, "
        "false>, HopperKnobs<192, 2, 24, 240, true, false, true, true>, "
        "HopperKnobs<128, 2, 32, 232, true, true, true, false>, true, true, true, true, 8>\n"
    ) in header
    with pytest.raises(ValueError):
        variant_header("not an identifier", SHIPPED)


@needs_nvcc
def test_shipped_build_reports_shipped_knobs():
    runnable = loadable(lambda: build_solution("cuda_ragged"))
    check_knobs(runnable, SHIPPED, "default")
    with pytest.raises(RuntimeError, match="built with knobs"):
        check_knobs(runnable, BuildKnobs(fp8_bf16_bits=False), "fp8_cvt")


@needs_nvcc
def test_variant_compiles_for_sm_90a_with_its_knobs(monkeypatch):
    module = tune_cuda()
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
    knobs = module.VARIANTS[VARIANT]
    # build_variant checks the knobs the build reports against these.
    runnable = loadable(lambda: module.build_variant("cuda_ragged", VARIANT, knobs))
    resources = module.hopper_resources(runnable.metadata.misc["binary"])
    assert len(resources) == 16, resources  # every wgmma kernel, sm_90a code
    for kernel, usage in resources:
        assert "STACK:0 LOCAL:0" in usage, f"{VARIANT}: {kernel} spills ({usage})"


@needs_nvcc
def test_fp8_split_q_runs_q_k_in_e4m3_on_bf16_q_only(monkeypatch):
    """Knob fp8_split_q (shipped on): the bf16-q FP8 Hopper kernel issues Q K^T as e4m3 wgmmas
    (QGMMA, 4 k32 steps for each of q's two terms, at S's two issue sites) and converts no K
    tile, without spilling; the float16-q one keeps the 16-bit products (two terms hold 8 bits,
    not 11). Variant fp8_convert_k (the knob off) converts K and V, with 16-bit products."""
    module = tune_cuda()
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
    # The shipped knobs built as a variant: a variant's header names the arch, so the build
    # cache cannot hand back an sm_90 build, whose Hopper kernels are stubs.
    shipped = loadable(lambda: module.build_variant("cuda_fp8kv", "default", SHIPPED))
    binary = shipped.metadata.misc["binary"]
    for kernel, usage in module.hopper_resources(binary):
        assert "STACK:0 LOCAL:0" in usage, f"shipped: {kernel} spills ({usage})"
    bf16, half = fp8_kernels_sass(binary)
    assert bf16.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 16
    assert "QGMMA" not in half and "HGMMA.64x128x16.F32 " in half
    # The split's casts (q_hi, q_lo; q_hi back to f16 by the cvt) are there, and the producer
    # converts V alone (to f16 by the cvt, fp8_f16_pv); knob off, K's pairs take the bit-level
    # bf16 conversion (its last step a bf16x2 multiply by 2^120), as many as V's.
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C" in bf16
    assert "HMUL2.BF16_V2" not in bf16
    knobs = module.VARIANTS["fp8_convert_k"]
    assert not knobs.fp8_split_q
    convert_k = loadable(lambda: module.build_variant("cuda_fp8kv", "fp8_convert_k", knobs))
    convert_k_bf16, _ = fp8_kernels_sass(convert_k.metadata.misc["binary"])
    assert "QGMMA" not in convert_k_bf16
    v_pairs = convert_k_bf16.count("F2FP.F16.E4M3.UNPACK_B")  # no split there
    assert convert_k_bf16.count("HMUL2.BF16_V2") == v_pairs > 0
    assert bf16.count("F2FP.F16.E4M3.UNPACK_B") > v_pairs  # V's and the split's


@needs_nvcc
def test_fp8_f16_pv_runs_p_v_in_float16(monkeypatch):
    """Knob fp8_f16_pv (shipped on): the bf16-q FP8 Hopper kernel runs P V as float16 wgmmas,
    V converted by the hardware cvt, one F2FP a pair; variant fp8_bf16_pv (the knob off) runs
    it in bf16, V by the bit-level conversion (one bf16x2 multiply a pair), without spilling."""
    module = tune_cuda()
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
    shipped = loadable(lambda: module.build_variant("cuda_fp8kv", "default", SHIPPED))
    bf16, _ = fp8_kernels_sass(shipped.metadata.misc["binary"])
    assert SHIPPED.fp8_f16_pv and SHIPPED.fp8_split_q
    assert "HGMMA.64x128x16.F32 " in bf16 and "HGMMA.64x128x16.F32.BF16" not in bf16
    knobs = module.VARIANTS["fp8_bf16_pv"]
    assert not knobs.fp8_f16_pv
    built = loadable(lambda: module.build_variant("cuda_fp8kv", "fp8_bf16_pv", knobs))
    binary = built.metadata.misc["binary"]
    for kernel, usage in module.hopper_resources(binary):
        assert "STACK:0 LOCAL:0" in usage, f"fp8_bf16_pv: {kernel} spills ({usage})"
    bf16_pv, _ = fp8_kernels_sass(binary)
    assert "HGMMA.64x128x16.F32.BF16" in bf16_pv
    assert bf16_pv.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 16
    # V's pairs: the cvt's there, the multiplies here (the split's cvts are in both).
    v_pairs = bf16.count("F2FP.F16.E4M3.UNPACK_B") - bf16_pv.count("F2FP.F16.E4M3.UNPACK_B")
    assert bf16_pv.count("HMUL2.BF16_V2") == v_pairs > 0


def fp8_kernels_sass(binary: str) -> tuple:
    """The SASS of a build's two FP8 Hopper kernels (bf16 q, float16 q), one string each."""
    sass = cuda_build.sass(Path(binary))
    fp8 = {name: "\n".join(code) for name, code in sass.items() if "paged_fp8_wgmma" in name}
    (bf16,) = [code for name, code in fp8.items() if "nv_bfloat16" in name]
    (half,) = [code for name, code in fp8.items() if "6__half" in name]
    return bf16, half
