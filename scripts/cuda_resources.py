"""Write solutions/gqa_ragged/cuda/ptxas_resources.md (registers, spills, shared memory of every
CUDA kernel for sm_90a), which report.md includes.   python scripts/cuda_resources.py"""

import shutil
import sys
import tempfile
from pathlib import Path

from prefill_bundle.cuda_build import RESOURCES_MD, compile_entry, resources_markdown

with tempfile.TemporaryDirectory() as tmp:
    returncode, output = compile_entry(shutil.which("nvcc"), "90a", Path(tmp) / "e.o", True)
if returncode:
    sys.exit(output)
RESOURCES_MD.write_text(resources_markdown(output))
print(f"wrote {RESOURCES_MD}; now run python scripts/report.py")
