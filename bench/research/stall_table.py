"""The SASS instructions where a kernel's warps were sampled most, from Nsight Compute's
source page (``ncu --import R.ncu-rep --page source --csv --print-source sass``), as
``bench/device/mma_probe.sh stalls`` writes it: each instruction's share of all samples, and
the opcode classes' shares (HMMA, LDSM, BAR, SYNCS, ...).

    python -m bench.research.stall_table stalls-bf16-sass.csv [--top 25]
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def _samples_column(header: list[str]) -> str:
    for name in ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)"):
        if name in header:
            return name
    raise SystemExit(f"no warp stall sampling column among {header[:12]}...")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def table(path: str, top: int = 25) -> str:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return f"{path}: no rows"
    col = _samples_column(list(rows[0]))
    counts = [(_number(r[col]), r.get("Address", ""), r.get("Source", "")) for r in rows]
    total = sum(c for c, _, _ in counts) or 1.0
    by_op: Counter = Counter()
    for c, _, src in counts:
        op = re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split(" ")[0].split(".")[0]
        by_op[op] += c
    lines = [f"{path}: {int(total)} samples over {len(rows)} instructions", "by opcode:"]
    lines += [f"  {op:10s} {100 * c / total:5.1f}%" for op, c in by_op.most_common(12)]
    lines.append(f"top {top} instructions:")
    for c, addr, src in sorted(counts, key=lambda t: -t[0])[:top]:
        lines.append(f"  {100 * c / total:5.1f}%  {addr:>8s}  {src.strip()[:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.research.stall_table", description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(table(args.csv, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
