"""Write report.md and report_ratios.png from the traces in traces/:

    python scripts/report.py

or the same for another run's traces (a copy of its traces/), e.g. the H200 snapshot, headed by
RUN.md beside the traces' folder (where and from what code the run came), with the kernel-time
table of `long_shapes.py` from the same device if a kernel_time.md lies there too:

    python scripts/report.py --traces blob/h200/traces --out report_h200.md --title "an NVIDIA H200"
"""

import argparse
import sys
from pathlib import Path

from prefill_bundle import REPO_ROOT
from prefill_bundle.report import plot_ratios, report

parser = argparse.ArgumentParser()
parser.add_argument("--traces", type=Path, metavar="DIR", help="another run's traces")
parser.add_argument("--out", default="report.md", help="the report, relative to the repository")
parser.add_argument("--title", default="the H100", help="the device, as the title names it")
args = parser.parse_args()
try:
    text, trace_set, image = report(args.traces, args.out, args.title)
except ValueError as error:  # another run's folder without traces, or with a trace twice
    sys.exit(f"report.py: {error}")
(REPO_ROOT / args.out).write_text(text)
plot_ratios(trace_set, REPO_ROOT / image)
print(f"wrote {args.out} and {image}")
