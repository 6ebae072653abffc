"""Generated files (definitions, solutions, workloads, blobs) and their sync check.

Generated files are never edited by hand: `python scripts/generate.py` writes them, and
`tests/test_dataset.py` fails when one on disk differs from what the sources give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

from pydantic import BaseModel

from . import REPO_ROOT

Content = Union[BaseModel, list, bytes]


@dataclass
class GeneratedFile:
    path: str  # relative to the repository root
    content: Content  # a model (.json), a list of models (.jsonl) or raw bytes (blobs)

    def render(self) -> bytes:
        if isinstance(self.content, bytes):
            return self.content
        if isinstance(self.content, list):
            lines = [m.model_dump_json(exclude_unset=True) for m in self.content]
            return ("\n".join(lines) + "\n").encode()
        data = self.content.model_dump(mode="json", exclude_unset=True)
        return (json.dumps(data, indent=2) + "\n").encode()


def all_generated_files() -> list[GeneratedFile]:
    from .definitions import definition_files
    from .packing import solution_files
    from .workloads import workload_files

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
