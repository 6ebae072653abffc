"""The CUDA solutions without a GPU.

1. prefill_entry.cu compiles with nvcc the way flashinfer-bench's tvm-ffi builder compiles it
   (-std=c++17 -O2 -fPIC, tvm-ffi and dlpack headers, the source folder as include path), for
   sm_90 and for sm_90a; ptxas reports every kernel variant without (meaningful) spills. The
   wgmma kernels (sm_90a) run their HGMMAs unserialized; in an sm_90 build they are stubs. The
   paged kernels (page sizes 64 and 1) are the causal ones with another K/V loader: TMA boxes per
   page (64), a cp.async gather completing on the stage barriers (1).
2. The packed solutions build through flashinfer-bench and their argument checks raise the
   ValueError that prefill_bundle/arguments.py raises, message for message, before anything
   touches CUDA (CPU tensors: every check but the device one, which comes last, passes or fails
   exactly as it would on the GPU).

The kernel's arithmetic runs only on a GPU: tests/test_solutions.py -k cuda. The paged entry
points' argument errors: tests/test_cuda_paged.py.
"""

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from prefill_bundle import REPO_ROOT, arguments
from prefill_bundle.cuda_build import RESOURCES_MD, ptxas_report
from prefill_bundle.testing import build_solution, load_script

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

# (dtype, causal, ragged) of every kernel the entry points launch.
VARIANTS = (
    [("__half", c, False) for c in (True, False)]
    + [("__nv_bfloat16", c, False) for c in (True, False)]
    + [("__half", True, True), ("__nv_bfloat16", True, True)]
)
# (dtype, page size) of every paged kernel (causal only).
PAGED_VARIANTS = [
    (dtype, page_size) for dtype in ("__half", "__nv_bfloat16") for page_size in (64, 1)
]
# (dtype) of every sliding-window kernel (the ragged causal kernels with the band policy).
SWA_VARIANTS = ["__half", "__nv_bfloat16"]
# No variant spills today; a padded non-causal kernel (at the 128-register cap of 2 CTAs per SM)
# may spill this much (it did before its K/V loads shared one loader). More is a regression.
MAX_SPILL_BYTES = 8
PORTABLE_KERNEL = "gqa_prefill_kernel"
WGMMA_KERNEL = "gqa_prefill_wgmma_kernel"  # the same variants, sm_90a only (else a stub)
PAGED_PORTABLE_KERNEL = "gqa_prefill_paged_kernel"
PAGED_WGMMA_KERNEL = "gqa_prefill_paged_wgmma_kernel"
SWA_PORTABLE_KERNEL = "gqa_prefill_swa_kernel"
SWA_WGMMA_KERNEL = "gqa_prefill_swa_wgmma_kernel"
# Padded non-causal batches of short sequences: the causal family's 128-key tiles (per dtype, as
# the window kernels; their portable kernel is gqa_prefill_kernel<dtype, full, padded>).
FULL128_WGMMA_KERNEL = "gqa_prefill_full128_wgmma_kernel"


def kernel_name(kernel: str, dtype: str, causal: bool, ragged: bool) -> str:
    """The part of the mangled name that identifies one variant."""
    return f"{len(kernel)}{kernel}I{len(dtype)}{dtype}Lb{int(causal)}ELb{int(ragged)}E"


def paged_kernel_name(kernel: str, dtype: str, page_size: int) -> str:
    return f"{len(kernel)}{kernel}I{len(dtype)}{dtype}Li{page_size}E"


def swa_kernel_name(kernel: str, dtype: str) -> str:
    return f"{len(kernel)}{kernel}I{len(dtype)}{dtype}EEv"


def resources_markdown(output: str) -> str:
    """scripts/cuda_resources.py's table (the script writes ptxas_resources.md)."""
    return load_script("cuda_resources").resources_markdown(output)


@pytest.fixture(scope="module")
def compiled(entry_builds):
    """{arch: (returncode, output)} of sm_90 and sm_90a: the session's builds (conftest.py's
    entry_builds, shared with tests/test_cuda_fp8.py)."""
    return {arch: entry_builds[arch][:2] for arch in ("90", "90a")}


@pytest.fixture(scope="module")
def objects(entry_builds):
    """{arch: the object file} of the same builds."""
    return {arch: entry_builds[arch][2] for arch in ("90", "90a")}


@needs_nvcc
@pytest.mark.parametrize("arch", ["90", "90a"])
def test_entry_compiles(compiled, arch):
    returncode, output = compiled[arch]
    assert returncode == 0, output


def variant_resources(report: dict, kernel: str):
    """(variant, name, ptxas resources) of each variant of kernel; each must appear once."""
    paged = kernel in (PAGED_PORTABLE_KERNEL, PAGED_WGMMA_KERNEL)
    swa = kernel in (SWA_PORTABLE_KERNEL, SWA_WGMMA_KERNEL, FULL128_WGMMA_KERNEL)
    variants = [(d,) for d in SWA_VARIANTS] if swa else PAGED_VARIANTS if paged else VARIANTS
    for variant in variants:
        naming = swa_kernel_name if swa else paged_kernel_name if paged else kernel_name
        name = naming(kernel, *variant)
        matches = [k for k in report if name in k]
        assert len(matches) == 1, f"{name} not among {list(report)}"
        registers, spill_stores, spill_loads, _ = report[matches[0]]
        print(f"{name}: {registers} registers, {spill_stores}/{spill_loads} bytes spilled")
        yield variant, name, report[matches[0]]


@needs_nvcc
def test_every_kernel_variant_fits_two_ctas_per_sm(compiled):
    returncode, output = compiled["90a"]
    assert returncode == 0, output
    report = ptxas_report(output)
    for (dtype, causal, ragged), name, resources in variant_resources(report, PORTABLE_KERNEL):
        registers, spill_stores, spill_loads, _ = resources
        assert registers <= 128, "__launch_bounds__(256, 2) caps registers at 128"
        assert spill_stores <= MAX_SPILL_BYTES and spill_loads <= 2 * MAX_SPILL_BYTES, report
        if ragged or causal:
            assert spill_stores == 0, f"{name}: {spill_stores} bytes of spill stores"
    for kernel in (PAGED_PORTABLE_KERNEL, SWA_PORTABLE_KERNEL):
        for _, name, (registers, spill_stores, spill_loads, _) in variant_resources(report, kernel):
            assert registers <= 128 and spill_stores == 0 and spill_loads == 0, (name, registers)
    # + the FP8 paged kernels (portable and wgmma, per dtype): tests/test_cuda_fp8.py; + the
    # split-KV merge per dtype (tests/test_cuda_split_kv.py); + page size 1's page gather per
    # dtype (tests/test_cuda_paged.py); + the FP8 decode kernel per dtype and group of 1 or 4
    # tokens (test_decode_kernel_fits_three_ctas_per_sm); + the padded non-causal 128-key
    # wgmma kernel per dtype.
    expected = (2 * len(VARIANTS) + 2 * len(PAGED_VARIANTS) + 2 * len(SWA_VARIANTS) + 2 * 2 + 2
                + 2 + 4 + 2)  # fmt: skip
    assert len(report) == expected, f"unexpected kernels: {list(report)}"


@needs_nvcc
def test_wgmma_kernel_variants_do_not_spill_or_serialize(compiled):
    returncode, output = compiled["90a"]
    assert returncode == 0, output
    report = ptxas_report(output)
    for kernel in (WGMMA_KERNEL, PAGED_WGMMA_KERNEL, SWA_WGMMA_KERNEL, FULL128_WGMMA_KERNEL):
        for _, name, resources in variant_resources(report, kernel):
            registers, spill_stores, spill_loads, _ = resources
            assert registers <= 255 and spill_stores == 0 and spill_loads == 0, (name, resources)
    # C7515 and kin: ptxas had to wait for each wgmma before the next (accumulators touched
    # between issue and wait), which would undo the asynchronous pipeline.
    assert "Potential Performance Loss" not in output, output


@needs_nvcc
def test_resource_table_in_report_is_current(compiled):
    returncode, output = compiled["90a"]
    assert returncode == 0, output
    assert RESOURCES_MD.read_text() == resources_markdown(output), (
        "run: python scripts/cuda_resources.py && python scripts/report.py"
    )


def hopper_hgmma(block_n: int, unrolled: bool) -> tuple[int, int]:
    """HGMMA instructions in a Hopper kernel's SASS: (S = Q K^T's, 8 k-steps of m64 x block_n
    each; O += P V's, block_n / 16 k-steps of m64 x 128 each). S in the prologue and in each copy
    of the loop body, P V in each copy and after the loop. A loop unrolled twice (kLoopUnroll)
    has three copies: the body twice, plus one iteration for an odd trip count."""
    copies = 1 + (3 if unrolled else 1)
    return copies * 8, copies * block_n // 16


def find_cuobjdump():
    """cuobjdump from PATH, beside nvcc, or the copy that Triton bundles."""
    candidates = [shutil.which("cuobjdump")]
    if NVCC is not None:
        candidates.append(str(Path(NVCC).resolve().parent / "cuobjdump"))
        candidates.append("/usr/local/cuda/bin/cuobjdump")
    try:
        import triton

        candidates.append(
            str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
        )
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def sass_by_function(cuobjdump: str, obj: Path) -> dict:
    """{mangled function name: its SASS text} of an object's sm_90(a) cubin."""
    result = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    functions = {}
    for block in re.split(r"\n\s*Function : ", result.stdout)[1:]:
        name, _, body = block.partition("\n")
        functions[name.strip()] = body
    return functions


@needs_nvcc
def test_wgmma_kernels_use_hgmma_only_on_sm90a(compiled, objects):
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump found")
    assert all(returncode == 0 for returncode, _ in compiled.values())
    for arch in ("90", "90a"):
        functions = sass_by_function(cuobjdump, objects[arch])
        for dtype, causal, ragged in VARIANTS:
            wgmma = [f for f in functions if kernel_name(WGMMA_KERNEL, dtype, causal, ragged) in f]
            portable = [
                f for f in functions if kernel_name(PORTABLE_KERNEL, dtype, causal, ragged) in f
            ]
            assert len(wgmma) == 1 and len(portable) == 1, list(functions)
            sass = functions[wgmma[0]]
            # kBlockN is 128 for causal kernels (their loop unrolled), 192 for non-causal ones.
            block_n = 128 if causal else 192
            hgmma = {n: sass.count(f"HGMMA.64x{n}x16.F32") for n in (128, 176, 192)}
            if arch == "90a":
                s_steps, pv_steps = hopper_hgmma(block_n, unrolled=causal)
                expected = {128: 0, 176: 0, 192: 0}
                expected[block_n] += s_steps
                expected[128] += pv_steps
                assert hgmma == expected, f"{wgmma[0]}: {hgmma} HGMMA on sm_90a"
                # TMA loads, mbarriers, register reallocation: the warp-specialized pipeline.
                for instruction in ("UTMALDG.3D", "SYNCS.ARRIVE", "USETMAXREG"):
                    assert instruction in sass, f"{wgmma[0]}: no {instruction}"
                # FA3's turns between the consumer warpgroups (bar.arrive on the other's named
                # barrier) in the non-causal kernels only (shipped_knobs' pingpong).
                assert ("BAR.ARV" in sass) == (not causal), f"{wgmma[0]}: turns"
            else:
                assert not any(hgmma.values()), f"{wgmma[0]}: the sm_90 stub holds HGMMA"
            assert "HGMMA" not in functions[portable[0]]
            assert "HMMA" in functions[portable[0]]


@needs_nvcc
def test_paged_wgmma_kernels_load_pages_as_designed(compiled, objects):
    """sm_90a: the causal kernel's HGMMAs; Q by TMA (3-D); K/V by one 4-D TMA box per page
    (page size 64) or a cp.async gather arriving on the ring's barriers (page size 1)."""
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump found")
    assert all(returncode == 0 for returncode, _ in compiled.values())
    for arch in ("90", "90a"):
        functions = sass_by_function(cuobjdump, objects[arch])
        for dtype, page_size in PAGED_VARIANTS:
            wgmma, portable = (
                [f for f in functions if paged_kernel_name(kernel, dtype, page_size) in f]
                for kernel in (PAGED_WGMMA_KERNEL, PAGED_PORTABLE_KERNEL)
            )
            assert len(wgmma) == 1 and len(portable) == 1, list(functions)
            sass = functions[wgmma[0]]
            hgmma = sass.count("HGMMA.64x128x16.F32")
            if arch == "90a":
                # The paged loaders' loop is not unrolled (cuda/TUNING.md).
                expected = sum(hopper_hgmma(128, unrolled=False))
                assert hgmma == expected, f"{wgmma[0]}: {hgmma} HGMMA"
                assert "UTMALDG.3D" in sass and "USETMAXREG" in sass, wgmma[0]
                if page_size == 64:
                    assert "UTMALDG.4D" in sass and "LDGSTS" not in sass, wgmma[0]
                else:
                    assert "UTMALDG.4D" not in sass, wgmma[0]
                    assert "LDGSTS" in sass and "ARRIVES.LDGSTSBAR" in sass, wgmma[0]
            else:
                assert "HGMMA" not in sass, f"{wgmma[0]}: the sm_90 stub holds HGMMA"
            assert "HGMMA" not in functions[portable[0]]
            assert "HMMA" in functions[portable[0]] and "LDGSTS" in functions[portable[0]]


@needs_nvcc
def test_page_gather_kernel_moves_rows_in_16_byte_vectors(compiled, objects):
    """Page size 1's page gather (launch_gathered): per dtype one 128-bit load of K and of V a
    thread, and one 128-bit store of each; no spills."""
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump found")
    returncode, output = compiled["90a"]
    assert returncode == 0, output
    report = ptxas_report(output)
    gathers = [name for name in report if "gather_pages_kernel" in name]
    assert len(gathers) == 2, list(report)
    assert all(report[name][1] == report[name][2] == 0 for name in gathers), report
    functions = sass_by_function(cuobjdump, objects["90a"])
    for name in [f for f in functions if "gather_pages_kernel" in f]:
        sass = functions[name]
        assert sass.count("LDG.E.128.CONSTANT") == 2 and sass.count("STG.E.128") == 2, sass


def script_sass(tmp_path: Path, script: str, *flags: str) -> dict:
    """scripts/SCRIPT built for sm_90a: sass_by_function of the binary (skips without cuobjdump)."""
    binary = tmp_path / Path(script).stem
    subprocess.run([NVCC, "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17", *flags,
                    "-o", str(binary), str(REPO_ROOT / "scripts" / script)],
                   check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump")
    return sass_by_function(cuobjdump, binary)


@needs_nvcc
def test_page_gather_benchmark_compiles_with_tma_row_boxes(tmp_path):
    """scripts/page_gather_bench.cu (cuda/TUNING.md, page size 1 by TMA boxes of one row)
    builds for sm_90a, and its TMA variants are what it measures: UTMALDG in a loop over the
    warp's lanes (BRA.U.ANY: the coordinates go through uniform registers), its cp.async
    variant 16-byte LDGSTS."""
    functions = script_sass(tmp_path, "page_gather_bench.cu", "-Wno-deprecated-declarations")
    by_method = {m: next(body for name, body in functions.items() if f"ILi{m}E" in name)
                 for m in range(5)}  # fmt: skip
    assert "LDGSTS.E.BYPASS.128" in by_method[0] and "UTMALDG" not in by_method[0]
    for method in (1, 3):
        assert "UTMALDG.3D" in by_method[method] and "BRA.U.ANY" in by_method[method]


@needs_nvcc
def test_multicast_power_probe_copies_what_it_compares(tmp_path):
    """scripts/multicast_power.cu (cuda/TUNING.md, what multicast would save in power) builds for
    sm_90a with one plain bulk copy and one multicast bulk copy in its loop and its prologue."""
    (sass,) = script_sass(tmp_path, "multicast_power.cu").values()
    assert sass.count("UBLKCP.S.G.MULTICAST") == 2, sass
    assert sass.count("UBLKCP.S.G ") == 2, sass


@needs_nvcc
def test_decode_kernel_fits_three_ctas_per_sm(compiled, objects):
    """gqa_decode_fp8_kernel (decode_fp8.cuh; cuda/TUNING.md, the decode kernel) builds for
    sm_90a with no spills within three CTAs of 128 threads an SM (<= 170 registers), and its
    chunk loop is what it counts: 32 f16 mma.sync a product (HMMA.16816.F32, 64 in all), K and V
    converted by the e4m3 unpack (one F2FP a register: 64 of each), K's fragments by 16-bit and
    V's by 8-bit shared loads, the chunks by 16-byte cp.async; each dtype and group size."""
    returncode, output = compiled["90a"]
    assert returncode == 0, output
    report = ptxas_report(output)
    decode = [name for name in report if "gqa_decode_fp8_kernel" in name]
    assert len(decode) == 4, decode
    for name in decode:
        registers, spill_stores, spill_loads, stack = report[name]
        assert registers <= 170 and spill_stores == spill_loads == stack == 0, (name, report[name])
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump")
    bodies = [body for name, body in sass_by_function(cuobjdump, objects["90a"]).items()
              if "gqa_decode_fp8_kernel" in name]  # fmt: skip
    assert len(bodies) == 4
    for sass in bodies:
        assert sass.count("HMMA.16816.F32") == 64
        assert sass.count("F2FP.F16.E4M3.UNPACK") == 128
        assert sass.count("LDS.U16") == 64 and sass.count("LDS.U8") == 128
        assert "LDGSTS.E.BYPASS.128" in sass and "LDL" not in sass and "STL" not in sass


@needs_nvcc
def test_decode_probe_compiles(tmp_path):
    """scripts/decode_probe.cu, the timing harness of the solution's decode kernel on
    single_token_rows_16's shape, builds against the solution's headers."""
    binary = tmp_path / "decode_probe"
    result = subprocess.run([NVCC, "-O3", "-arch=sm_90a", "-std=c++17", "-o", str(binary),
                             str(REPO_ROOT / "scripts" / "decode_probe.cu")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr


@needs_nvcc
@pytest.mark.parametrize(
    "wgmma_kernel,portable_kernel",
    [(SWA_WGMMA_KERNEL, SWA_PORTABLE_KERNEL), (FULL128_WGMMA_KERNEL, None)],
    ids=["window", "full128"],
)
def test_kernels_on_the_causal_tiles(compiled, objects, wgmma_kernel, portable_kernel):
    """sm_90a: the sliding-window Hopper kernel (the ragged causal one with a band) and the
    padded non-causal kernel of short sequences run the causal family's tiles: 128-key HGMMAs
    (the loop unrolled twice), none of 192 keys, TMA Q and K/V boxes, setmaxnreg, no turns. The
    window's portable kernel uses mma.sync (full128's is the padded full one); the sm_90 build
    holds a stub."""
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump found")
    assert all(returncode == 0 for returncode, _ in compiled.values())
    for arch in ("90", "90a"):
        functions = sass_by_function(cuobjdump, objects[arch])
        for dtype in SWA_VARIANTS:
            wgmma = [f for f in functions if swa_kernel_name(wgmma_kernel, dtype) in f]
            assert len(wgmma) == 1, list(functions)
            sass = functions[wgmma[0]]
            if arch == "90a":
                hgmma = sass.count("HGMMA.64x128x16.F32")
                expected = sum(hopper_hgmma(128, unrolled=True))  # as the causal kernel's
                assert hgmma == expected, f"{wgmma[0]}: {hgmma} HGMMA"
                assert "HGMMA.64x192x16" not in sass, f"{wgmma[0]}: 192-key tiles"
                assert "BAR.ARV" not in sass, f"{wgmma[0]}: the causal family takes no turns"
                for instruction in ("UTMALDG.3D", "SYNCS.ARRIVE", "USETMAXREG"):
                    assert instruction in sass, f"{wgmma[0]}: no {instruction}"
            else:
                assert "HGMMA" not in sass, f"{wgmma[0]}: the sm_90 stub holds HGMMA"
            if portable_kernel is not None:
                portable = [f for f in functions if swa_kernel_name(portable_kernel, dtype) in f]
                assert len(portable) == 1, list(functions)
                assert "HGMMA" not in functions[portable[0]]
                assert "HMMA" in functions[portable[0]]


# 2. The packed solutions and their argument checks -------------------------------------------


@pytest.fixture(scope="module")
def entry_points():
    """Both packed solutions, built by flashinfer-bench. Without a GPU the builder cannot ask
    nvidia-smi for the arch: it compiles for sm_90 (TVM_FFI_CUDA_ARCH_LIST) then."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    with pytest.MonkeyPatch.context() as env:
        if not torch.cuda.is_available() and "TVM_FFI_CUDA_ARCH_LIST" not in os.environ:
            env.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0")
        # tvm-ffi takes CUDA_HOME from nvcc's grandparent folder; a wrapper script on PATH
        # (/usr/local/bin/nvcc) leaves it without lib64 for -lcudart.
        if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
            home = Path(NVCC).resolve().parent.parent
            if not (home / "lib64").exists() and Path("/usr/local/cuda/lib64").exists():
                env.setenv("CUDA_HOME", "/usr/local/cuda")
        try:
            return build_solution("cuda_mini"), build_solution("cuda_ragged")
        except Exception as error:  # noqa: BLE001 - the reason goes into the skip
            if "load" in str(error).lower() and not torch.cuda.is_available():
                pytest.skip(f"the built module does not load without a GPU here: {error}")
            raise


BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32


def padded_args(**changes):
    args = dict(
        q=torch.zeros(2, 5, 32, 128, dtype=F16),
        k=torch.zeros(2, 7, 8, 128, dtype=F16),
        v=torch.zeros(2, 7, 8, 128, dtype=F16),
        causal=True,
        out=torch.zeros(2, 5, 32, 128, dtype=F16),
    )
    return list({**args, **changes}.values())


def ragged_args(**changes):
    args = dict(
        q=torch.zeros(9, 32, 128, dtype=BF16),
        k=torch.zeros(11, 8, 128, dtype=BF16),
        v=torch.zeros(11, 8, 128, dtype=BF16),
        qo_indptr=torch.tensor([0, 4, 9], dtype=I32),
        kv_indptr=torch.tensor([0, 5, 11], dtype=I32),
        sm_scale=1.0 / math.sqrt(128),
        output=torch.zeros(9, 32, 128, dtype=BF16),
        lse=torch.zeros(9, 32, dtype=F32),
    )
    return list({**args, **changes}.values())


def non_contiguous(shape, dtype):
    return torch.zeros(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))


def token_strided(shape, dtype, row_elements):
    """shape's tensor as a slice of rows of row_elements (what q, k, v of a fused QKV are)."""
    tokens, width = math.prod(shape[:-2]), shape[-2] * shape[-1]
    return torch.zeros(tokens, row_elements, dtype=dtype)[:, :width].view(shape)


def misaligned(shape, dtype):
    """A contiguous tensor whose data pointer is 8 bytes past a 16-byte boundary."""
    offset = 8 // torch.empty(0, dtype=dtype).element_size()
    return torch.zeros(math.prod(shape) + offset, dtype=dtype)[offset:].view(shape)


def python_padded_checks(q, k, v, causal, out):
    """The contract's checks in the CUDA entry's order (the device check last)."""
    arguments.check_padded_shapes(q, k, v, out)
    arguments.check_causal(causal)
    arguments.check_layout(arguments.PADDED_NAMES, (q, k, v, out))


def python_ragged_checks(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    arguments.check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse)
    arguments.check_sm_scale(sm_scale)
    arguments.check_layout(arguments.RAGGED_NAMES, (q, k, v, qo_indptr, kv_indptr, output, lse))


def error_message(function, args) -> str:
    with pytest.raises(ValueError) as error:
        function(*args)
    return str(error.value)


# Each case changes the valid CPU arguments; {} and the layouts the kernels take (token-strided
# q, k, v) fail only at the device check.
PADDED_CASES = {
    "valid": {},
    "q_float32": dict(q=torch.zeros(2, 5, 32, 128, dtype=F32)),
    "q_16_heads": dict(q=torch.zeros(2, 5, 16, 128, dtype=F16)),
    "q_3d": dict(q=torch.zeros(10, 32, 128, dtype=F16)),
    "q_list": dict(q=[[0.0]]),
    "k_bfloat16": dict(k=torch.zeros(2, 7, 8, 128, dtype=BF16)),
    "k_batch": dict(k=torch.zeros(3, 7, 8, 128, dtype=F16)),
    "k_none": dict(k=None),
    "v_seq": dict(v=torch.zeros(2, 6, 8, 128, dtype=F16)),
    "out_bfloat16": dict(out=torch.zeros(2, 5, 32, 128, dtype=BF16)),
    "out_seq": dict(out=torch.zeros(2, 4, 32, 128, dtype=F16)),
    "out_int": dict(out=3),
    "causal_int": dict(causal=1),
    "causal_float": dict(causal=0.5),
    "causal_str": dict(causal="yes"),
    "causal_none": dict(causal=None),
    "causal_int_tensor": dict(causal=torch.tensor(1)),
    "causal_1d_tensor": dict(causal=torch.tensor([True])),
    "causal_bool_tensor": dict(causal=torch.tensor(False)),
    "k_heads_not_dense": dict(k=non_contiguous((2, 7, 8, 128), F16)),
    "q_fused_qkv": dict(q=token_strided((2, 5, 32, 128), F16, 6144)),
    "k_fused_qkv": dict(k=token_strided((2, 7, 8, 128), F16, 6144)),
    "q_token_stride_4100": dict(q=token_strided((2, 5, 32, 128), F16, 4100)),
    "q_seq_slice": dict(q=torch.zeros(2, 6, 32, 128, dtype=F16)[:, :5]),
    "q_one_token_per_batch": dict(
        q=torch.zeros(2, 2, 32, 128, dtype=F16)[:, :1], out=torch.zeros(2, 1, 32, 128, dtype=F16)
    ),
    "q_misaligned": dict(q=misaligned((2, 5, 32, 128), F16)),
    "out_token_strided": dict(out=token_strided((2, 5, 32, 128), F16, 6144)),
}
RAGGED_CASES = {
    "valid": {},
    "q_head_dim_64": dict(q=torch.zeros(9, 32, 64, dtype=BF16)),
    "q_4d": dict(q=torch.zeros(1, 9, 32, 128, dtype=BF16)),
    "q_int": dict(q=3),
    "k_float16": dict(k=torch.zeros(11, 8, 128, dtype=F16)),
    "v_float16": dict(v=torch.zeros(11, 8, 128, dtype=F16)),
    "v_rows": dict(v=torch.zeros(10, 8, 128, dtype=BF16)),
    "qo_indptr_int64": dict(qo_indptr=torch.tensor([0, 4, 9])),
    "qo_indptr_empty": dict(qo_indptr=torch.zeros(0, dtype=I32)),
    "qo_indptr_2d": dict(qo_indptr=torch.zeros(1, 3, dtype=I32)),
    "qo_indptr_list": dict(qo_indptr=[0, 4, 9]),
    "kv_indptr_int64": dict(kv_indptr=torch.tensor([0, 5, 11])),
    "kv_indptr_size": dict(kv_indptr=torch.tensor([0, 11], dtype=I32)),
    "no_sequence": dict(
        qo_indptr=torch.tensor([0], dtype=I32), kv_indptr=torch.tensor([0], dtype=I32)
    ),
    "no_rows": dict(
        q=torch.zeros(0, 32, 128, dtype=BF16),
        k=torch.zeros(0, 8, 128, dtype=BF16),
        v=torch.zeros(0, 8, 128, dtype=BF16),
        qo_indptr=torch.tensor([0], dtype=I32),
        kv_indptr=torch.tensor([0], dtype=I32),
        output=torch.zeros(0, 32, 128, dtype=BF16),
        lse=torch.zeros(0, 32, dtype=F32),
    ),
    "output_float16": dict(output=torch.zeros(9, 32, 128, dtype=F16)),
    "lse_bfloat16": dict(lse=torch.zeros(9, 32, dtype=BF16)),
    "lse_rows": dict(lse=torch.zeros(8, 32, dtype=F32)),
    "sm_scale_nan": dict(sm_scale=float("nan")),
    "sm_scale_inf": dict(sm_scale=-float("inf")),
    "sm_scale_bool": dict(sm_scale=True),
    "sm_scale_str": dict(sm_scale="0.1"),
    "sm_scale_none": dict(sm_scale=None),
    "sm_scale_tensor": dict(sm_scale=torch.tensor(0.1)),
    "sm_scale_int": dict(sm_scale=2),
    "sm_scale_negative": dict(sm_scale=-0.5),
    "lse_non_contiguous": dict(lse=non_contiguous((9, 32), F32)),
    "qo_indptr_strided": dict(qo_indptr=torch.tensor([0, 0, 4, 0, 9, 0], dtype=I32)[::2]),
    "output_token_strided": dict(output=token_strided((9, 32, 128), BF16, 6144)),
    "q_fused_qkv": dict(q=token_strided((9, 32, 128), BF16, 6144)),
    "v_fused_qkv": dict(v=token_strided((11, 8, 128), BF16, 6144)),
    "k_token_stride_1028": dict(k=token_strided((11, 8, 128), BF16, 1028)),
    "k_heads_not_dense": dict(k=torch.zeros(11, 128, 8, dtype=BF16).transpose(1, 2)),
    "v_misaligned": dict(v=misaligned((11, 8, 128), BF16)),
    "lse_misaligned": dict(lse=misaligned((9, 32), F32)),
}


@pytest.mark.parametrize("case", PADDED_CASES)
def test_padded_errors_are_the_contracts(entry_points, case):
    args = padded_args(**PADDED_CASES[case])
    expected = error_message(python_padded_checks, args)
    assert error_message(entry_points[0], args) == expected


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_errors_are_the_contracts(entry_points, case):
    args = ragged_args(**RAGGED_CASES[case])
    expected = error_message(python_ragged_checks, args)
    assert error_message(entry_points[1], args) == expected


# Python values as tvm-ffi passes them (a tuple arrives as a list: described as one).
NON_TENSOR_VALUES = [0.1, 1e-05, 1e16, 123456789.125, -0.0, 5e-324, "it's", 'say "hi"']
NON_TENSOR_VALUES += ["tab\there", "é" * 70, b"\x00ab", [1, [2.5, None], True], list(range(40))]


@pytest.mark.parametrize("value", NON_TENSOR_VALUES, ids=repr)
def test_non_tensor_values_are_described_as_python_does(entry_points, value):
    args = padded_args(causal=value)
    assert error_message(entry_points[0], args) == error_message(python_padded_checks, args)


def test_a_few_messages_in_full(entry_points):
    """The table above compares with arguments.py; these pin the text itself."""
    run_padded, run_ragged = entry_points
    assert error_message(run_padded, padded_args(causal=1)) == (
        "causal: expected a Python bool or a 0-d bool tensor, got int 1"
    )
    assert error_message(run_ragged, ragged_args(sm_scale=float("nan"))) == (
        "sm_scale: expected a finite float, got float nan"
    )
    assert error_message(run_ragged, ragged_args(q=token_strided((9, 32, 128), BF16, 4100))) == (
        "q: expected the last dim contiguous, heads dense and a token stride that is a multiple "
        "of 8 elements, got bfloat16 [9, 32, 128] with strides [4100, 128, 1]"
    )
    assert error_message(run_ragged, ragged_args()) == "q: expected a CUDA tensor, got one on cpu"


# The sliding-window entry run_ragged_swa: the same module as run_ragged (one build of the
# sources serves every definition), so its checks are tested from cuda_ragged's build.


@pytest.fixture(scope="module")
def run_ragged_swa(entry_points):
    import tvm_ffi

    module = tvm_ffi.load_module(entry_points[1].metadata.misc["binary"])
    return getattr(module, "run_ragged_swa")  # the exported symbol exists


def swa_args(window_left=5, **changes):
    args = ragged_args(**changes)
    return args[:5] + [window_left] + args[5:]


def python_swa_checks(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, output, lse):
    arguments.check_ragged_shapes(q, k, v, qo_indptr, kv_indptr, output, lse)
    arguments.check_window_left(window_left)
    arguments.check_sm_scale(sm_scale)
    arguments.check_layout(arguments.RAGGED_NAMES, (q, k, v, qo_indptr, kv_indptr, output, lse))


WINDOW_VALUES = {
    "minus_one": -1,
    "zero": 0,
    "int32_max": 2**31 - 1,
    "minus_two": -2,
    "int32_max_plus_one": 2**31,
    "int64_min": -(2**63),
    "bool": True,
    "float": 5.0,
    "str": "5",
    "none": None,
    "tensor_int64": torch.tensor(5),
    "tensor_int32_minus_one": torch.tensor(-1, dtype=I32),
    "tensor_uint8": torch.tensor(200, dtype=torch.uint8),
    "tensor_int8_negative": torch.tensor(-3, dtype=torch.int8),
    "tensor_int64_too_big": torch.tensor(2**40),
    "tensor_float": torch.tensor(5.0),
    "tensor_bool": torch.tensor(True),
    "tensor_1d": torch.tensor([5]),
}


@pytest.mark.parametrize("case", WINDOW_VALUES)
def test_window_left_errors_are_the_contracts(run_ragged_swa, case):
    args = swa_args(WINDOW_VALUES[case])
    assert error_message(run_ragged_swa, args) == error_message(python_swa_checks, args)


@pytest.mark.parametrize("case", ["valid", "q_int", "lse_rows", "sm_scale_nan", "v_misaligned"])
def test_swa_errors_follow_the_ragged_contract(run_ragged_swa, case):
    """The other arguments' checks, in the contract's order around window_left's."""
    args = swa_args(-7, **RAGGED_CASES[case])  # a bad window is reported after the shapes
    assert error_message(run_ragged_swa, args) == error_message(python_swa_checks, args)
    args = swa_args(3, **RAGGED_CASES[case])
    assert error_message(run_ragged_swa, args) == error_message(python_swa_checks, args)


def test_window_message_in_full(run_ragged_swa):
    assert error_message(run_ragged_swa, swa_args(-2)) == (
        "window_left: expected an int in [-1, 2**31 - 1] (-1: no window), got int -2"
    )
