"""The CUDA solution's tuning knobs without a GPU (prefill_bundle/cuda_variants.py,
scripts/tune_cuda.py): the shipped build reports the shipped knobs, a variant instantiates its
knob values for sm_90a and reports them, and a build whose knobs differ from the ones asked for
raises. The kernels' arithmetic under other knobs runs only on a GPU (scripts/tune_cuda.py)."""

import shutil

import pytest

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
        "#define GQA_PREFILL_KNOBS BuildKnobs<HopperKnobs<128, 3, 32, 232, true, false, true>, "
        "HopperKnobs<176, 2, 24, 240, true, false, false>, "
        "HopperKnobs<128, 2, 32, 232, true, true, true>, true>\n"
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
    assert len(resources) == 14, resources  # every wgmma kernel, sm_90a code
    for kernel, usage in resources:
        assert "STACK:0 LOCAL:0" in usage, f"{VARIANT}: {kernel} spills ({usage})"
