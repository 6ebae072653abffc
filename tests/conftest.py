import os

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
