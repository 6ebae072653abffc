"""scripts/tilelang_decode_probe.py keeps building without a GPU: it is a timing harness of the
TileLang solution's decode program (gqa_prefill_decode: one source of truth), whose compile it
reports (shared bytes, registers, spills) with the design's pieces in the CUDA source."""

import shutil

import pytest

from prefill_bundle.testing import load_script

tilelang = pytest.importorskip("tilelang")


@pytest.fixture(scope="module")
def probe():
    return load_script("tilelang_decode_probe")


def test_probe_times_the_solutions_program(probe):
    decode = probe.solution_module()
    assert not hasattr(probe, "decode_program"), "the probe keeps no copy of the program"
    assert decode.decode_fp8 and decode.merge_decode and decode.decode_shares


def test_probe_compiles_the_solutions_program(probe):
    try:
        kernel = probe.compile_program("bfloat16")
    except Exception as e:  # noqa: BLE001 - TileLang's lowering may be missing pieces here
        if "nvcc" in str(e).lower() or "cuda" in type(e).__name__.lower():
            pytest.skip(f"TileLang cannot compile for sm_90a here: {e}")
        raise
    source = kernel.get_kernel_source()
    assert "cp_async_gs<16>" in source and "mma_sync" in source
    assert probe.shared_bytes(kernel) is not None
    if shutil.which("nvcc"):
        registers, spills = probe.parse_ptxas(probe.ptxas_report(source))
        assert registers is not None and not spills
