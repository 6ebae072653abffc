"""The CUDA FP8 (e4m3) paged solution (cuda_fp8kv: prefill_entry.cu::run_paged_ps64_fp8kv, the
K/V source PagedFp8Kv in solutions/gqa_ragged/cuda/kv_paged_fp8.cuh).

Without a GPU:
- the entry compiles for sm_90a, sm_90 and sm_80; the FP8 kernels spill nothing on sm_90a (on
  sm_80 at most 16 bytes more than the bf16 paged kernel, which spills there too); the sm_90a
  Hopper kernel loads pages with 4-D TMA boxes, converts and runs its HGMMAs, the sm_90 one is a
  stub;
- every kernel that existed before the FP8 loader has the same SASS as at BASE_REF (a one-time
  proof, marked slow: `pytest -m slow tests/test_cuda_fp8.py`);
- a host program built with nvcc checks the pure helpers: the bit-level e4m3 -> bf16 conversion
  and the cvt path's e4m3 -> fp16 for all 256 bytes against torch, and that every converted
  element lands where TMA's 128-byte swizzle puts it in the bf16 kernels (the wgmma layout),
  with conflict-free stores;
- argument errors through the packed solution (when its JSON exists): arguments.py's messages.

On a GPU (pytest -m gpu tests/test_cuda_fp8.py): caches that are views with a page stride of two
pages (NaN between), values near e4m3's +-448 with scales 1/256, and k_scale / v_scale not 1
with a negative sm_scale (the portable kernel), against the reference. The shared matrix
(tests/test_solutions.py::test_fp8_kv_cache) covers GPU_FP8_CASES.
"""

import shutil
import subprocess
import tarfile
from io import BytesIO

import pytest
import torch

from prefill_bundle import REPO_ROOT
from prefill_bundle.cuda_build import (
    SOURCE_DIR,
    build_host_driver,
    compile_entry,
    ptxas_report,
    sass,
)

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
# The last commit before the FP8 loader: every kernel it has must compile to the same SASS.
BASE_REF = "3a777ca"
FP8_KERNELS = ("gqa_prefill_paged_fp8_kernel", "gqa_prefill_paged_fp8_wgmma_kernel")
DTYPES = ("__half", "__nv_bfloat16")


def fp8_name(kernel: str, dtype: str) -> str:
    return f"{len(kernel)}{kernel}I{len(dtype)}{dtype}EEv"


@pytest.fixture(scope="module")
def builds(entry_builds):
    """{arch: (returncode, ptxas output, object)} of the working tree's entry for sm_90a, sm_90
    and sm_80: the session's builds (conftest.py's entry_builds, shared with
    tests/test_cuda_build.py)."""
    return {arch: entry_builds[arch] for arch in ("90a", "90", "80")}


@needs_nvcc
def test_fp8_kernels_compile_without_spills(builds):
    for arch, (returncode, output, _) in builds.items():
        assert returncode == 0, output
    report = ptxas_report(builds["90a"][1])
    for kernel in FP8_KERNELS:
        for dtype in DTYPES:
            names = [k for k in report if fp8_name(kernel, dtype) in k]
            assert len(names) == 1, (kernel, dtype, list(report))
            registers, stores, loads, _ = report[names[0]]
            assert stores == 0 and loads == 0, (names[0], report[names[0]])
            assert registers <= (128 if kernel == FP8_KERNELS[0] else 168), names[0]
    # sm_80 (any non-sm_90 build runs the portable kernels): about what the bf16 paged kernel
    # spills there.
    report = ptxas_report(builds["80"][1])
    for dtype in DTYPES:
        fp8 = [v for k, v in report.items() if fp8_name(FP8_KERNELS[0], dtype) in k]
        paged = [
            v
            for k, v in report.items()
            if f"24gqa_prefill_paged_kernelI{len(dtype)}{dtype}Li64E" in k
        ]
        assert len(fp8) == 1 and len(paged) == 1, list(report)
        # Its synchronous FP8 loads (8 bytes, converted in registers) cost 12 / 8 bytes of
        # spills more than the cp.async of the bf16 kernel there (which spills 48 / 76 on sm_80).
        assert fp8[0][0] <= 128, fp8
        assert fp8[0][1] <= paged[0][1] + 16 and fp8[0][2] <= paged[0][2] + 16, (fp8, paged)


@needs_nvcc
def test_hopper_fp8_kernel_stages_pages_by_tma_and_converts_v(builds):
    for arch in ("90a", "90"):
        functions = sass(builds[arch][2])
        for dtype in DTYPES:
            names = [f for f in functions if fp8_name(FP8_KERNELS[1], dtype) in f]
            assert len(names) == 1, list(functions)
            code = "\n".join(functions[names[0]])
            if arch == "90a":
                # P V as in the bf16 paged kernel: 8 k16 steps in the loop and 8 for the last
                # tile. S the same for float16 q; for bf16 q (knob fp8_split_q) two e4m3 terms
                # of 4 k32 steps each, in the loop and in the prologue.
                split = dtype == "__nv_bfloat16"
                assert code.count("HGMMA.64x128x16.F32") == (2 if split else 4) * 8, names[0]
                assert code.count("QGMMA.64x128x32.F32.E4M3.E4M3") == (16 if split else 0)
                # K/V by TMA; the only cp.async: the leader's 4-byte page ids (LDGSTS.E).
                assert "UTMALDG.4D" in code and "UTMALDG.3D" in code
                assert "LDGSTS.E.BYPASS" not in code and "LDGSTS.E.128" not in code
                assert "USETMAXREG.DEALLOC.CTAPOOL 0x28" in code  # the producer: 40 registers
                # P V in float16 for both q dtypes (fp8_f16_pv): V by the cvt, no bit-level
                # bf16 conversion and no bf16 product left.
                assert "F2FP.F16.E4M3.UNPACK_B" in code, names[0]
                assert "HMUL2.BF16" not in code and "HGMMA.64x128x16.F32.BF16" not in code
            else:
                assert "HGMMA" not in code, f"{names[0]}: the sm_90 stub holds HGMMA"


@needs_nvcc
@pytest.mark.slow
def test_kernels_before_fp8_have_the_same_sass(builds, tmp_path):
    """scripts/cuda_sass_identity.py's comparison, for sm_90a, of every function BASE_REF has.

    The proof that the FP8 loader changed no earlier kernel, made when it landed (75cc4e5): it
    costs another full nvcc build (of BASE_REF), so it is marked slow and pyproject's addopts
    leave it out of the default run; `pytest -m slow` runs it. `python
    scripts/cuda_sass_identity.py BASE_REF` compares sm_90 and sm_90a the same way (and lists
    the FP8 kernels, new since, as differing)."""
    folder = SOURCE_DIR.relative_to(REPO_ROOT).as_posix()
    archive = subprocess.run(["git", "archive", BASE_REF, folder], cwd=REPO_ROOT,
                             capture_output=True)  # fmt: skip
    if archive.returncode:
        pytest.skip(f"{BASE_REF} is not in this checkout")
    tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(tmp_path)
    import prefill_bundle.cuda_build as cuda_build

    saved = cuda_build.SOURCE_DIR, cuda_build.ENTRY
    try:
        cuda_build.SOURCE_DIR = tmp_path / folder
        cuda_build.ENTRY = cuda_build.SOURCE_DIR / "prefill_entry.cu"
        returncode, output = compile_entry(NVCC, "90a", tmp_path / "old.o", False)
    finally:
        cuda_build.SOURCE_DIR, cuda_build.ENTRY = saved
    assert returncode == 0, output
    old, new = sass(tmp_path / "old.o"), sass(builds["90a"][2])
    assert set(old) <= set(new)
    different = [name for name in old if old[name] != new[name]]
    assert not different, different
    assert {name for name in new if name not in old} == {
        n for n in new if any(k in n for k in FP8_KERNELS)
    }


DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "attention_kernel.cuh"
using namespace gqa_prefill;
// Line 1: for every byte b, the bit-level bf16 conversion (bits of the value x 2^-120, then the
// exact product as float bits) and the cvt path's fp16 bits. Then per (row, c16, j): the byte
// offset of the converted chunk in the 16-bit tile.
int main() {
  for (int b = 0; b < 256; ++b) {
    const uint32_t scaled = fp8_pair_bf16_scaled(uint32_t(b), 0) & 0xffffu;
    uint32_t as_float = scaled << 16;
    float value;
    std::memcpy(&value, &as_float, 4);
    value *= 1.329227995784916e36f;  // 2^120, exact
    uint32_t product;
    std::memcpy(&product, &value, 4);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(b), __NV_E4M3);
    // Pair 1 (bytes 2, 3) and lane 1 (byte 1) of the bit path too.
    const uint32_t word = uint32_t(b) << 24 | uint32_t(b) << 16 | uint32_t(b) << 8;
    const uint32_t pair1 = fp8_pair_bf16_scaled(word, 1);
    const uint32_t lane1 = fp8_pair_bf16_scaled(word, 0) >> 16;
    std::printf("%u %u %u %u %u %u\n", b, scaled, product, unsigned(h.x), pair1, lane1);
  }
  for (int row = 0; row < 128; ++row)
    for (int c16 = 0; c16 < 8; ++c16)
      for (int j = 0; j < 2; ++j)
        std::printf("%d %d %d %u\n", row, c16, j, fp8_converted_offset(row, c16, j, 16384));
}
"""


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    program = build_host_driver(NVCC, DRIVER, tmp_path_factory.mktemp("fp8_helpers"), "sm_80")
    run = subprocess.run([str(program)], capture_output=True, text=True, check=True)
    rows = [list(map(int, line.split())) for line in run.stdout.splitlines()]
    return rows[:256], rows[256:]


def test_bit_conversion_is_exact_for_every_finite_e4m3(helpers):
    conversions, _ = helpers
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for b, scaled, product, half_bits, pair1, lane1 in conversions:
        assert scaled == lane1 == pair1 & 0xFFFF == pair1 >> 16, b  # every lane alike
        got = torch.tensor([product], dtype=torch.int64).to(torch.uint32).view(torch.float32)[0]
        want = values[b]
        if want.isnan():
            assert abs(float(got)) == 480.0, b  # NaN reads as +-480 on the bit path
        else:
            assert float(got) == float(want) and got.signbit() == want.signbit(), (b, got, want)
            assert float(want.to(torch.bfloat16)) == float(want)  # bf16 holds it exactly
        half = torch.tensor([half_bits], dtype=torch.int32).to(torch.uint16).view(torch.float16)
        half = half[0].float()
        assert (half.isnan() and want.isnan()) or float(half) == float(want), (b, half, want)


def tma_swizzle_128b(row: int, dim: int, half_bytes: int = 16384) -> int:
    """Where TMA (CU_TENSOR_MAP_SWIZZLE_128B, boxes of 64 16-bit columns) puts element (row, dim)
    of a 128-row tile: the 16-byte chunk index within the 128-byte row XOR row % 8."""
    byte = (dim % 64) * 2
    return (dim // 64) * half_bytes + row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def test_converted_elements_land_where_tma_puts_them(helpers):
    _, offsets = helpers
    assert len(offsets) == 128 * 8 * 2
    for row, c16, j, offset in offsets:
        for e in range(8):
            assert offset + 2 * e == tma_swizzle_128b(row, 16 * c16 + 8 * j + e), (row, c16, j)
    by_key = {(row, c16, j): offset for row, c16, j, offset in offsets}
    # A store phase: the 8 threads of one row (c16 = 0 .. 7), the second half's odd part first.
    for row in range(128):
        for jj in range(2):
            banks = {by_key[row, c16, jj ^ (c16 // 4)] // 16 % 8 for c16 in range(8)}
            assert len(banks) == 8, (row, jj)


# ---- Argument errors through the packed solution (its JSON is regenerated by the lead) ------


@pytest.fixture(scope="module")
def fp8_entry():
    """The packed cuda_fp8kv solution built by flashinfer-bench, with the working tree's CUDA
    sources (the JSON may predate them, e.g. without kv_paged_fp8.cuh)."""
    from prefill_bundle.testing import build_solution_object, load_solution

    try:
        solution = load_solution("cuda_fp8kv")
    except KeyError:
        pytest.skip("no cuda_fp8kv.json under solutions/ yet")
    data = solution.model_dump()
    paths = [source["path"] for source in data["sources"]]
    paths += [p for p in ("kv_paged_fp8.cuh",) if p not in paths]
    data["sources"] = [{"path": p, "content": (SOURCE_DIR / p).read_text()} for p in paths]
    data["name"] = "cuda_fp8kv_working_tree"
    try:
        return build_solution_object(type(solution).model_validate(data))
    except Exception as error:  # noqa: BLE001 - the reason goes into the skip
        if "load" in str(error).lower() and not HAS_CUDA:
            pytest.skip(f"the built module does not load without a GPU here: {error}")
        raise


def fp8_arguments(**changes):
    fp8, i32 = torch.float8_e4m3fn, torch.int32
    args = dict(
        q=torch.zeros(3, 32, 128, dtype=torch.bfloat16),
        k_cache=torch.zeros(2, 64, 8, 128, dtype=fp8),
        v_cache=torch.zeros(2, 64, 8, 128, dtype=fp8),
        qo_indptr=torch.tensor([0, 3], dtype=i32),
        kv_indptr=torch.tensor([0, 1], dtype=i32),
        kv_indices=torch.tensor([1], dtype=i32),
        kv_last_page_len=torch.tensor([5], dtype=i32),
        k_scale=0.5,
        v_scale=2.0,
        sm_scale=0.1,
        output=torch.zeros(3, 32, 128, dtype=torch.bfloat16),
        lse=torch.zeros(3, 32),
    )
    args.update(changes)
    return list(args.values())


ERRORS = {
    "bf16_cache": (
        dict(k_cache=torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16)),
        "k_cache: expected float8_e4m3fn [num_pages, 64, 8, 128], got bfloat16 [2, 64, 8, 128]",
    ),
    "k_scale_nan": (dict(k_scale=float("nan")), "k_scale: expected a finite float, got float nan"),
    "v_scale_str": (dict(v_scale="1"), "v_scale: expected a finite float, got str '1'"),
    "product_overflows": (
        dict(k_scale=1e300, sm_scale=1e10),
        "k_scale: expected a finite float whose product with sm_scale is finite, got float 1e+300",
    ),
    "page_stride_8": (
        dict(
            v_cache=torch.zeros(2 * 65536 + 8, dtype=torch.float8_e4m3fn).as_strided(
                (2, 64, 8, 128), (65536 + 8, 1024, 128, 1)
            )
        ),  # fmt: skip
        "v_cache: expected pages dense inside and a page stride that is a multiple of 16 "
        "elements and at least one page, got float8_e4m3fn [2, 64, 8, 128] with strides "
        "[65544, 1024, 128, 1]",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_fp8_argument_errors(fp8_entry, case):
    changes, message = ERRORS[case]
    with pytest.raises(ValueError) as error:
        fp8_entry(*fp8_arguments(**changes))
    assert str(error.value) == message


# ---- On a GPU -------------------------------------------------------------------------------


def with_page_stride_of_two_pages(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [:, 0] of a [num_pages, 2, 64, 8, 128] buffer, NaN in the other half."""
    buffer = torch.full((cache.shape[0], 2, *cache.shape[1:]), float("nan"), device=cache.device)
    buffer = buffer.to(cache.dtype)
    buffer[:, 0] = cache
    return buffer[:, 0]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "case_args",
    [
        dict(
            q_lens=(45, 300), kv_lens=(12, 4100), fp8_scales=(1 / 256, 1 / 128), kv_magnitude=300.0
        ),  # fmt: skip
        dict(q_lens=(100, 37), kv_lens=(100, 300), sm_scale=-0.3, fp8_scales=(2.0, 0.25)),
        # Cache values near 100 scaled to O(1): the check's absolute tolerance (1e-2) is for
        # outputs of order 1 (fp16 rounding of outputs near 125 alone is 0.06).
        dict(
            q_lens=(129, 3),
            kv_lens=(257, 70),
            dtype=torch.float16,
            fp8_scales=(1 / 64, 1 / 128),
            kv_magnitude=100.0,
        ),  # fmt: skip
    ],
    ids=["near_448_scales_1_256", "negative_sm_scale_portable", "fp16"],
)
def test_fp8_through_strided_cache_views(fp8_entry, case_args):
    from prefill_bundle.testing import (
        PagedCase,
        check_outputs,
        make_inputs,
        poisoned_outputs,
        reference_outputs,
    )

    case = PagedCase(page_size=64, **case_args)
    inputs = make_inputs(case, "cuda")
    inputs[1], inputs[2] = (with_page_stride_of_two_pages(x) for x in inputs[1:3])
    assert inputs[1].stride(0) == 2 * inputs[1][0].numel()
    expected = reference_outputs(case, inputs)
    outputs = poisoned_outputs(case, inputs)
    fp8_entry(*inputs, *outputs)
    torch.cuda.synchronize()
    check_outputs(outputs, expected)
