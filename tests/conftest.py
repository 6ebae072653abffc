import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from filelock import FileLock

from prefill_bundle.cuda_variants import set_cuda_home

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # flashinfer-bench's CUDA builder asks nvidia-smi for the arch; without a GPU, name it. The
    # CUDA solutions then build here and run their argument checks on CPU tensors.
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", "9.0")
    set_cuda_home()  # nvcc as a wrapper script on PATH: tvm-ffi's CUDA_HOME would lack lib64


def _interpreter_patches_once():
    """Triton 3.6's interpreter patches triton.language again (inspect.getmembers over its
    modules) at every call of a @triton.jit helper, though the launch has patched it for the
    whole grid: with our kernels' ~15K helper calls a launch, about half of the Triton tests'
    time under the interpreter. A helper call inside a launch skips the repeat when the language
    modules its globals see (triton.language, or triton.language.core for triton's own helpers
    such as tl.max) are patched already in that launch; anything else, and any other Triton
    version, runs as Triton wrote it."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if triton.__version__ != "3.6.0":
        return
    launch = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__
    patched = []  # per launch in progress: the language modules patched in it
    langs_of = {}  # fn -> the language modules _patch_lang(fn) patches

    def langs(fn):
        if fn not in langs_of:
            seen = fn.__globals__.values()
            langs_of[fn] = frozenset(name for name, lang in (("tl", tl), ("core", tl.core))
                                     if any(value is lang for value in seen))  # fmt: skip
        return langs_of[fn]

    def launch_patched_once(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper_in_launch(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:
                patched[-1] |= langs(self.fn)
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # as helper_call, less its _patch_lang
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_patched_once
    interpreter.InterpretedFunction.__call__ = helper_in_launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_once()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in a pytest-xdist worker process

# ---- One worker per core on a machine without a GPU ------------------------------------------
# The CPU suite is one core's work (the Triton interpreter, TileLang's C stand-in, nvcc and
# TileLang compiles, each single-threaded); CI's machine has two. Where pytest-xdist is installed
# (the dev extra) and there is no GPU, the suite runs on one xdist worker per core (at most 4),
# each test file whole on one worker (--dist loadfile: module-scoped fixtures and compile caches
# stay per file). -n N on the command line decides instead; -n 0 runs in one process. The GPU
# machine runs the suite in one process (its pack has no pytest-xdist).
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if WORKER is not None or torch.cuda.is_available():
        return
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    if config.option.collectonly or config.option.usepdb:
        return
    workers = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    if workers >= 2:
        config.option.numprocesses = workers
        if config.option.dist == "no":
            config.option.dist = "loadfile"


if WORKER is not None and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)) > 1:
    # Cores are the workers': torch's own threads would only contend with the other workers.
    torch.set_num_threads(1)


# ---- prefill_entry.cu, built once per run ---------------------------------------------------

# The archs the CUDA tests read prefill_entry.cu's build for: sm_90a (the wgmma kernels, ptxas's
# report), sm_90 (where they are stubs) and sm_80 (the portable kernels' spills elsewhere).
ENTRY_ARCHS = ("90a", "90", "80")


@pytest.fixture(scope="session")
def entry_builds(tmp_path_factory) -> dict:
    """{arch: (returncode, nvcc and ptxas -v output, object)}: prefill_entry.cu compiled as
    flashinfer-bench compiles it (prefill_bundle.cuda_build.compile_entry), once per arch and
    run for every test that reads the build (tests/test_cuda_build.py, test_cuda_fp8.py, on any
    worker): each build takes about a minute on CI's two cores. Built two at a time, the
    slowest first."""
    from prefill_bundle.cuda_build import compile_entry

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    # The run's temporary folder: xdist workers each have a folder in it.
    root = tmp_path_factory.getbasetemp()
    root = root.parent if WORKER is not None else root
    folder = root / "cuda_entry"
    with FileLock(str(root / "cuda_entry.lock")):
        record = folder / "builds.json"
        if not record.exists():
            folder.mkdir(exist_ok=True)

            def build(arch):
                return arch, compile_entry(nvcc, arch, folder / f"entry_{arch}.o", True)

            with ThreadPoolExecutor(max_workers=2) as pool:
                record.write_text(json.dumps(dict(pool.map(build, ENTRY_ARCHS))))
        built = json.loads(record.read_text())
    return {arch: (*built[arch], folder / f"entry_{arch}.o") for arch in ENTRY_ARCHS}
