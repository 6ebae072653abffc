"""The TileLang solution's FP8 decode program (gqa_prefill_decode) without a GPU: both q dtypes
and its merge compile for sm_90a with the lean design's pieces in the CUDA source (cp.async page
loads, the FP8 -> float16 conversion, mma.sync, the batch's warp vote), ptxas takes them
without spills where nvcc is on PATH, and the plan (decode_shares) picks its share counts.
On the GPU: tests/test_decode_gpu.py."""

import shutil

import pytest

from prefill_bundle.testing import load_script

tilelang = pytest.importorskip("tilelang")


@pytest.fixture(scope="module")
def probe():
    return load_script("tilelang_decode_probe")


@pytest.fixture(scope="module")
def decode(probe):
    return probe.solution_module()


def compiled_or_skip(build, dtype):
    try:
        return build(dtype)
    except Exception as e:  # noqa: BLE001 - TileLang's lowering may be missing pieces here
        if "nvcc" in str(e).lower() or "cuda" in type(e).__name__.lower():
            pytest.skip(f"TileLang cannot compile for sm_90a here: {e}")
        raise


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_program_compiles_for_sm90a(probe, decode, dtype):
    kernel = compiled_or_skip(decode.compile_decode, dtype)
    source = kernel.get_kernel_source()
    assert "cp_async_gs<16>" in source  # the paged K/V tiles by cp.async, 16 bytes
    assert "cp_async_wait<" in source  # the hand-made pipeline's constant waits
    assert "__tl_cvt_fp8x2_to_half2" in source  # K and V converted two values a cvt
    assert "mma_sync" in source  # Q K^T and P V on mma.sync m16n8k16
    assert "__all_sync" in source  # the batch's verdict (malformed batches)
    smem = probe.shared_bytes(kernel)
    stages = decode.NUM_STAGES * 2 * decode.BLOCK_N * (decode.HEAD_DIM + decode.PAD)
    assert smem is not None and stages <= smem <= 32 * 1024  # ~9 one-warp blocks an SM
    if shutil.which("nvcc"):
        report = probe.ptxas_report(source)
        registers, spills = probe.parse_ptxas(report)
        assert registers is not None and registers <= 168, report  # measured 151
        assert not spills, report


def test_merge_compiles_without_spills(probe, decode):
    kernel = compiled_or_skip(decode.compile_merge_decode, "bfloat16")
    if shutil.which("nvcc"):
        report = probe.ptxas_report(kernel.get_kernel_source())
        registers, spills = probe.parse_ptxas(report)
        assert registers is not None, report
        assert not spills, report


def test_decode_shares(decode):
    sms = 132
    # single_token_rows_16: 16 sequences, 2142 pages: 32 shares (the probe's best with a merge).
    assert decode.decode_shares(16, 16, 2142 * 64, sms) == 32
    # Short sequences: no share under 256 keys of the average sequence.
    assert decode.decode_shares(16, 16, 16 * 1024, sms) == 4
    assert decode.decode_shares(8, 8, 8 * 100, sms) == 1
    # Many sequences: the occupancy bound (4 waves of 8 blocks an SM over 8 KV heads each).
    assert decode.decode_shares(512, 512, 512 * 8192, sms) == 2
    assert decode.decode_shares(4096, 4096, 4096 * 8192, sms) == 1
    # Never past the merge's unrolled maximum; 4 tokens a sequence still decode-like.
    assert decode.decode_shares(4, 1, 1 << 20, sms) == decode.DECODE_MAX_SHARES
    assert decode.decode_shares(64, 16, 2142 * 64, sms) == 32
    # Not decode-like: one share (the entry never routes such a batch here).
    assert decode.decode_shares(65, 16, 2142 * 64, sms) == 1
    assert decode.decode_shares(0, 0, 0, sms) == 1
