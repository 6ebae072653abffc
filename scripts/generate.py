"""Write every generated file (definitions, solutions, workloads, blobs) from its sources.

python scripts/generate.py          # write what changed
python scripts/generate.py --check  # exit 1 if a generated file is out of sync
"""

import argparse
import sys

from prefill_bundle.dataset import out_of_sync, write_all

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--check", action="store_true", help="only report files out of sync")
args = parser.parse_args()
if args.check:
    stale = out_of_sync()
    for path in stale:
        print(f"out of sync: {path}")
    sys.exit(1 if stale else 0)
for path in write_all():
    print(f"wrote {path}")
