import os
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
