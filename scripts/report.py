"""Write report.md from the traces in traces/.   python scripts/report.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_bench import TraceSet  # noqa: E402

from prefill_bundle import REPO_ROOT  # noqa: E402
from prefill_bundle.report import render  # noqa: E402

(REPO_ROOT / "report.md").write_text(render(TraceSet.from_path(str(REPO_ROOT))))
print("wrote report.md")
