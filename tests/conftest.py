import os
import shutil
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # flashinfer-bench's CUDA builder asks nvidia-smi for the arch; without a GPU, name it. The
    # CUDA solutions then build here and run their argument checks on CPU tensors.
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", "9.0")
    # tvm-ffi takes CUDA_HOME from nvcc's grandparent folder; a wrapper script on PATH
    # (/usr/local/bin/nvcc) leaves it without lib64 for -lcudart.
    nvcc = shutil.which("nvcc")
    if nvcc and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        if not (Path(nvcc).resolve().parent.parent / "lib64").exists():
            if Path("/usr/local/cuda/lib64").exists():
                os.environ["CUDA_HOME"] = "/usr/local/cuda"


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
