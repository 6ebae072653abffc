"""Every generated file of the dataset, written or checked in one place (scripts/generate.py,
tests/test_dataset.py)."""

from __future__ import annotations

from . import REPO_ROOT
from .definitions import definition_files
from .generated import GeneratedFile
from .packing import solution_files
from .workloads import workload_files


def all_generated_files() -> list[GeneratedFile]:
    return definition_files() + solution_files() + workload_files()


def write_all() -> list[str]:
    written = []
    for f in all_generated_files():
        path = REPO_ROOT / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        data = f.render()
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            written.append(f.path)
    return written


def out_of_sync() -> list[str]:
    """Paths whose file on disk is missing or differs from what the sources generate."""
    stale = []
    for f in all_generated_files():
        path = REPO_ROOT / f.path
        if not path.exists() or path.read_bytes() != f.render():
            stale.append(f.path)
    return stale
