"""Write report.md and report_ratios.png from the traces in traces/.   python scripts/report.py"""

from flashinfer_bench import TraceSet

from prefill_bundle import REPO_ROOT
from prefill_bundle.report import plot_ratios, render

trace_set = TraceSet.from_path(str(REPO_ROOT))
(REPO_ROOT / "report.md").write_text(render(trace_set))
plot_ratios(trace_set, REPO_ROOT / "report_ratios.png")
print("wrote report.md and report_ratios.png")
