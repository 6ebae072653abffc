"""Write report.md and report_ratios.png from the traces in traces/.   python scripts/report.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_bench import TraceSet  # noqa: E402

from prefill_bundle import REPO_ROOT  # noqa: E402
from prefill_bundle.report import plot_ratios, render  # noqa: E402

trace_set = TraceSet.from_path(str(REPO_ROOT))
(REPO_ROOT / "report.md").write_text(render(trace_set))
plot_ratios(trace_set, REPO_ROOT / "report_ratios.png")
print("wrote report.md and report_ratios.png")
