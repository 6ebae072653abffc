"""On any machine: where a warp-specialized kernel's stall samples go, from Nsight Compute's
per-SASS-instruction page (the ncu report of scripts/profile_paged.py with SourceCounters):

    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/stall_by_role.py sass.csv [other.csv ...]
    python scripts/stall_by_role.py --compare tilelang.csv cuda.csv   # side by side, by role

Per file: samples and instructions by warp role (the code after a `USETMAXREG` to at most 64
registers is the producer's, to at least 160 the consumers'; the counts in between, as the
launch's first split of Triton's Gluon kernels, keep the role before), by how often an
instruction ran (the
main loop runs once a key tile, the prologue and epilogue once an item: the execution count
tells them apart), the instructions with the most samples, and shared-memory instructions with
bank conflicts (wavefronts beyond the ideal). tilelang/TUNING.md (2026-11-27 (3)) read the
TileLang kernel against CUDA's this way. Caveat: the role is the code's position, and ptxas
places mbarrier retry loops out of line after the producer's code, so a consumer's retries
count as the producer's (their samples land on the consumer's branch into them; their
execution counts, millions, give them away).
"""

import argparse
import csv
from collections import Counter, defaultdict
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    return float(text.replace(",", "") or 0)


def role_after_setmaxnreg(source: str, role: str) -> str:
    """The warp role of the code after `USETMAXREG... <count>`: by the registers it sets, not by
    DEALLOC / ALLOC (a Gluon consumer partition deallocates from 256 to 240)."""
    registers = int(source.rstrip(" ;").rsplit(",", 1)[-1].split()[-1], 0)
    if registers <= 64:
        return "producer"
    return "consumer" if registers >= 160 else role


def read_rows(path: str) -> list:
    """The instruction rows as dicts: role, source, samples, executed, stalls (Counter),
    wavefronts and ideal wavefronts of shared memory."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    header = next(i for i, line in enumerate(lines) if line and line[0] == "Address")
    names = lines[header]
    col = {name: i for i, name in enumerate(names)}
    stalls = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    role, rows = "prologue", []
    for line in lines[header + 1 :]:
        if len(line) < len(names):
            continue
        source = line[col["Source"]].strip()
        if "SETMAXREG" in source:
            role = role_after_setmaxnreg(source, role)
        get = lambda name: number(line[col[name]]) if name in col else 0.0  # noqa: E731
        rows.append(dict(
            role=role, source=source, samples=get(SAMPLES), executed=get(EXECUTED),
            stalls=Counter({n[len("stall_"):]: get(n) for n in stalls}),
            wavefronts=get("L1 Wavefronts Shared"), ideal=get("L1 Wavefronts Shared Ideal"),
        ))  # fmt: skip
    return rows


def top(counter: Counter, total: float, n: int) -> str:
    return ", ".join(f"{k} {100 * v / max(total, 1):.0f}%" for k, v in counter.most_common(n) if v)


def summarize(path: str, count: int = 15) -> str:
    rows = read_rows(path)
    total = sum(r["samples"] for r in rows)
    out = [f"== {path}: {total:.0f} samples, {sum(r['executed'] for r in rows) / 1e6:.1f} M "
           "warp instructions"]  # fmt: skip
    roles = defaultdict(lambda: [0.0, 0.0, Counter()])
    # Execution counts rounded to 1000: one class for the loop, one per item, ...
    classes = defaultdict(lambda: [0.0, 0.0, Counter()])
    for r in rows:
        for key, table in ((r["role"], roles), ((r["role"], round(r["executed"], -3)), classes)):
            table[key][0] += r["samples"]
            table[key][1] += r["executed"]
            table[key][2].update(r["stalls"])
    out.append("by role:")
    for role, (samples, executed, stalls) in roles.items():
        out.append(f"  {role:9s} {100 * samples / total:5.1f}% of samples, {executed / 1e6:7.2f} M "
                   f"instructions; {top(stalls, samples, 5)}")  # fmt: skip
    out.append("by execution count (a class: instructions run about as often):")
    for (role, runs), (samples, executed, stalls) in sorted(
        classes.items(), key=lambda item: -item[1][0]
    ):  # fmt: skip
        if samples >= 0.01 * total:
            out.append(f"  {role:9s} x{runs / 1e3:7.1f}K  {100 * samples / total:5.1f}% of "
                       f"samples, {executed / 1e6:7.2f} M instructions; "
                       f"{top(stalls, samples, 4)}")  # fmt: skip
    out.append(f"top {count} instructions:")
    for r in sorted(rows, key=lambda r: -r["samples"])[:count]:
        out.append(f"  {r['samples']:7.0f} {r['role'][:4]} x{r['executed'] / 1e3:7.1f}K "
                   f"{r['source'][:64]:64s} {top(r['stalls'], r['samples'], 2)}")  # fmt: skip
    conflicted = [r for r in rows if r["wavefronts"] > r["ideal"] > 0]
    if conflicted:
        out.append("shared-memory bank conflicts (wavefronts / ideal):")
        for r in sorted(conflicted, key=lambda r: r["ideal"] - r["wavefronts"])[:count]:
            out.append(f"  {r['wavefronts'] / r['ideal']:5.1f}x {r['role'][:4]} "
                       f"x{r['executed'] / 1e3:7.1f}K {r['source'][:64]}")  # fmt: skip
    return "\n".join(out)


def compare(paths: list) -> str:
    """Two or more profiles side by side (e.g. a TileLang kernel and CUDA's on the same K/V): per
    role, samples and instructions, then each stall reason's samples, a column a profile, the
    reasons that differ most first (tilelang/TUNING.md, page size 1 against CUDA's)."""
    tables = []
    for path in paths:
        table = defaultdict(Counter)
        for r in read_rows(path):
            table[r["role"]].update(r["stalls"])
            table[r["role"]]["(samples)"] += r["samples"]
            table[r["role"]]["(M instructions)"] += r["executed"] / 1e6
        tables.append(table)
    names = [Path(path).stem[:14] for path in paths]
    out = [f"{'':26s}" + "".join(f"{name:>15s}" for name in names)]
    for role in ("consumer", "producer", "prologue"):
        counters = [table.get(role, Counter()) for table in tables]
        reasons = set().union(*counters) - {"(samples)", "(M instructions)"}
        spread = lambda k: max(c[k] for c in counters) - min(c[k] for c in counters)  # noqa: E731
        out.append(role)
        for key in ["(samples)", "(M instructions)", *sorted(reasons, key=lambda k: -spread(k))]:
            if any(c[key] for c in counters):
                out.append(f"  {key:24s}" + "".join(f"{c[key]:15.1f}" for c in counters))
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compare", action="store_true",
                        help="the profiles' stall reasons side by side, by role")
    options = parser.parse_args()
    if options.compare:
        print(compare(options.csv))
        return
    for path in options.csv:
        print(summarize(path, options.top))


if __name__ == "__main__":
    main()
