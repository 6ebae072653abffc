import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prefill_bundle.cuda_variants import set_cuda_home

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # flashinfer-bench's CUDA builder asks nvidia-smi for the arch; without a GPU, name it. The
    # CUDA solutions then build here and run their argument checks on CPU tensors.
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", "9.0")
    set_cuda_home()  # nvcc as a wrapper script on PATH: tvm-ffi's CUDA_HOME would lack lib64


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The archs the CUDA tests read prefill_entry.cu's build for: sm_90a (the wgmma kernels, ptxas's
# report), sm_90 (where they are stubs) and sm_80 (the portable kernels' spills elsewhere).
ENTRY_ARCHS = ("90a", "90", "80")


@pytest.fixture(scope="session")
def entry_builds(tmp_path_factory) -> dict:
    """{arch: (returncode, nvcc and ptxas -v output, object)}: prefill_entry.cu compiled as
    flashinfer-bench compiles it (prefill_bundle.cuda_build.compile_entry), once per arch and
    session for every test that reads the build (tests/test_cuda_build.py, test_cuda_fp8.py):
    each build takes about a minute on CI's two cores. Built two at a time, the slowest first."""
    from prefill_bundle.cuda_build import compile_entry

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    folder = tmp_path_factory.mktemp("cuda_entry")

    def build(arch):
        obj = folder / f"entry_{arch}.o"
        return arch, (*compile_entry(nvcc, arch, obj, True), obj)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(build, ENTRY_ARCHS))
