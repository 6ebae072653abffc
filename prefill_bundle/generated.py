"""A generated file (definition, solution, workload, blob) and how it renders to bytes.

Generated files are never edited by hand: `python scripts/generate.py` writes them (dataset.py
lists them), and `tests/test_dataset.py` fails when one on disk differs from what the sources
give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

from pydantic import BaseModel

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
