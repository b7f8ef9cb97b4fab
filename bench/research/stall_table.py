"""Which SASS instructions do a kernel's warps wait on, and why? From Nsight Compute's
source page (``ncu --import R.ncu-rep --page source --csv --print-source sass``), as
``bench/device/mma_probe.sh stalls`` writes it: each instruction's share of all samples with
its largest stall reasons, the opcode classes' shares (HMMA, LDSM, BAR, SYNCS, ...) and the
reasons' shares.

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
        lines = fh.read().splitlines()
    # ncu puts the kernel's name on a line of its own before the header
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        return f"{path}: no rows"
    col = _samples_column(list(rows[0]))
    total = sum(_number(r[col]) for r in rows) or 1.0
    by_op: Counter = Counter()
    for r in rows:
        c, src = _number(r[col]), r.get("Source", "")
        op = re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split(" ")[0].split(".")[0]
        by_op[op] += c
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = {k: sum(_number(r[k]) for r in rows) for k in reasons}
    out = [f"{path}: {int(total)} samples over {len(rows)} instructions", "by opcode:"]
    out += [f"  {op:10s} {100 * c / total:5.1f}%" for op, c in by_op.most_common(12)]
    out.append("by reason: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in
                                          sorted(by_reason.items(), key=lambda t: -t[1])[:8]))
    out.append(f"top {top} instructions (share of all samples; their largest reasons):")
    for r in sorted(rows, key=lambda r: -_number(r[col]))[:top]:
        c = _number(r[col])
        why = sorted(((k[6:], _number(r[k])) for k in reasons), key=lambda t: -t[1])[:2]
        why_text = " ".join(f"{k} {100 * v / total:.1f}" for k, v in why if v)
        out.append(f"  {100 * c / total:5.1f}%  {r.get('Address', ''):>8s}  "
                   f"{r.get('Source', '').strip()[:60]:60s}  {why_text}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.research.stall_table", description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(table(args.csv, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
