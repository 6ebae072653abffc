"""Proof that a CUDA refactor changes no kernel: compiles solutions/gqa_ragged/cuda as it is in
the working tree and as it is at a git ref (default HEAD), for sm_90 and sm_90a, the way
flashinfer-bench does (prefill_bundle.cuda_build.compile_entry), and compares the SASS of every
kernel (cuobjdump -sass, addresses and /* */ comments stripped) and ptxas's resources.

    python scripts/cuda_sass_identity.py [git ref]
"""

import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from prefill_bundle import REPO_ROOT, cuda_build

FOLDER = cuda_build.SOURCE_DIR.relative_to(REPO_ROOT).as_posix()


def build(source_dir: Path, arch: str, out: Path) -> tuple:
    """(SASS by function, ptxas resources by kernel) of source_dir's prefill_entry.cu."""
    cuda_build.SOURCE_DIR, cuda_build.ENTRY = source_dir, source_dir / "prefill_entry.cu"
    returncode, log = cuda_build.compile_entry(shutil.which("nvcc"), arch, out, True)
    assert returncode == 0, log
    return cuda_build.sass(out), cuda_build.ptxas_report(log)


def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    archive = subprocess.run(["git", "archive", ref, FOLDER], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=BytesIO(archive)).extractall(tmp)
        for arch in ("90", "90a"):
            old = build(Path(tmp) / FOLDER, arch, Path(tmp) / f"old_{arch}.o")
            new = build(REPO_ROOT / FOLDER, arch, Path(tmp) / f"new_{arch}.o")
            same_sass = old[0] == new[0]
            same_resources = old[1] == new[1]
            identical &= same_sass and same_resources
            print(
                f"sm_{arch}: {len(new[0])} functions, SASS "
                f"{'identical' if same_sass else 'DIFFERENT'}, ptxas resources "
                f"{'identical' if same_resources else 'DIFFERENT'} ({ref} vs working tree)"
            )
            for name in sorted(set(old[0]) | set(new[0])):
                if old[0].get(name) != new[0].get(name):
                    print(f"  differs: {name}")
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
