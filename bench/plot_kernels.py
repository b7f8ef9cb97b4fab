"""Table and plots of the ``kernels`` benchmark, from its record files only.

Writes, next to the first record file (or into ``--out``):
  kernels-table-<device>.md     TFLOP/s and % of cuBLAS per step (same run)
  kernels-tflops-<device>.png   TFLOP/s against n (square) per kernel, one panel per dtype
  kernels-roofline-<device>.png each kernel at its tile-model arithmetic intensity against
                                the measured copy bandwidth and FMA peaks of the same run

Usage::

    python -m bench.plot_kernels bench/results/kernels-*.jsonl [--run RUN] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from bench.common import load, slug

STEP_TITLES = {
    "cublas": "cuBLAS (cupy.matmul)",
}


def _titles():
    try:
        import distmm.executor.registry as registry

        return {f"distmm-raw-{k.name}": f"{k.step}. {k.name}: {k.title}" for k in registry.steps()}
    except Exception:  # plotting needs no package import
        return {}


def pick_run(records, run=None):
    runs = sorted({r["run"] for r in records if r["benchmark"] == "kernels"})
    if not runs:
        raise SystemExit("no kernels records")
    run = run or runs[-1]
    return [r for r in records if r["run"] == run], run


def table(recs) -> str:
    """Markdown: per dtype, each step's TFLOP/s and % of cuBLAS at every square size."""
    titles = _titles()
    by = {(r["variant"], r["dtype"], r["m"], r["n"], r["k"]): r for r in recs}
    device = recs[0]["device"]
    out = [f"Device: {device}; run {recs[0]['run']}, commit {recs[0]['commit']}. "
           "TFLOP/s (% of cuBLAS measured in the same run); fp32 cuBLAS without TF32.", ""]
    for dt in sorted({r["dtype"] for r in recs if r["variant"] == "cublas"}):
        sizes = sorted({r["m"] for r in recs if r["dtype"] == dt and r["variant"] == "cublas"
                        and r["m"] == r["n"] == r["k"]})
        variants = sorted({r["variant"] for r in recs if r["dtype"] == dt
                           and r["variant"].startswith("distmm-raw-")},
                          key=lambda v: next(r["step"] for r in recs if r["variant"] == v))
        out.append(f"**{dt}**")
        out.append("")
        out.append("| step | " + " | ".join(f"n={s}" for s in sizes) + " |")
        out.append("|---|" + "---|" * len(sizes))
        for v in variants + ["cublas"]:
            cells = []
            for s in sizes:
                r = by.get((v, dt, s, s, s))
                ref = by.get(("cublas", dt, s, s, s))
                if r is None or not r.get("tflops"):
                    cells.append("-")
                elif v == "cublas":
                    cells.append(f"{r['tflops']:.1f}")
                else:
                    cells.append(f"{r['tflops']:.1f} ({100 * r['tflops'] / ref['tflops']:.0f}%)")
            out.append(f"| {titles.get(v, STEP_TITLES.get(v, v))} | " + " | ".join(cells) + " |")
        rect = sorted({(r["m"], r["n"], r["k"]) for r in recs if r["dtype"] == dt
                       and r["variant"] == "cublas" and not r["m"] == r["n"] == r["k"]})
        if rect and variants:
            best = variants[-1]
            out.append("")
            out.append(f"Rectangular ({best.replace('distmm-raw-', '')} vs cuBLAS): " + "; ".join(
                f"{m}x{n}x{k}: {by[(best, dt, m, n, k)]['tflops']:.1f} vs "
                f"{by[('cublas', dt, m, n, k)]['tflops']:.1f} "
                f"({100 * by[(best, dt, m, n, k)]['tflops'] / by[('cublas', dt, m, n, k)]['tflops']:.0f}%)"
                for m, n, k in rect if (best, dt, m, n, k) in by))
        out.append("")
    return "\n".join(out)


def plot_tflops(recs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = _titles()
    dtypes = sorted({r["dtype"] for r in recs if r["variant"] == "cublas"})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 5), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        series = defaultdict(list)
        for r in recs:
            if r["dtype"] == dt and r["m"] == r["n"] == r["k"] and r.get("tflops") \
                    and (r["variant"] == "cublas" or r["variant"].startswith("distmm-raw-")):
                series[r["variant"]].append((r["m"], r["tflops"]))
        order = sorted(series, key=lambda v: (v == "cublas", v != "cublas" and next(
            r["step"] for r in recs if r["variant"] == v)))
        for v in order:
            pts = sorted(series[v])
            style = dict(color="black", lw=2.5, ls="--") if v == "cublas" else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=titles.get(v, STEP_TITLES.get(v, v)), **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (C[n,n] = A[n,n] @ B[n,n])")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dt} on {recs[0]['device']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roofline(recs, path: Path, n_pick: int = 8192) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    titles = _titles()
    ceil = {r["variant"]: r for r in recs if r["variant"].startswith("ceiling-")}
    bw = ceil.get("ceiling-copy", {}).get("gbps")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    x = np.logspace(-2, 3, 200)
    colors = {"float32": "tab:blue", "float64": "tab:red"}
    for dt, cv in (("float32", "ceiling-ffma"), ("float64", "ceiling-dfma")):
        peak = ceil.get(cv, {}).get("tflops")
        if bw and peak:
            ax.plot(x, np.minimum(peak, bw * x / 1e3), color=colors[dt], alpha=0.5,
                    label=f"{dt} roof: {peak:.1f} TFLOP/s FMA probe, {bw:.0f} GB/s copy")
        pts = [r for r in recs if r["dtype"] == dt and r["m"] == r["n"] == r["k"]
               and r.get("model_bytes") and r.get("tflops")]
        if not pts:
            continue
        size = n_pick if any(r["m"] == n_pick for r in pts) else max(r["m"] for r in pts)
        for r in pts:
            if r["m"] != size:
                continue
            ai = 2.0 * r["m"] * r["n"] * r["k"] / r["model_bytes"]
            marker = "*" if r["variant"] == "cublas" else "o"
            ax.scatter([ai], [r["tflops"]], color=colors[dt], marker=marker,
                       s=120 if marker == "*" else 40, zorder=3)
            label = "cuBLAS" if r["variant"] == "cublas" else str(r.get("step", ""))
            ax.annotate(label, (ai, r["tflops"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8, color=colors[dt])
        ax.plot([], [], " ", label=f"{dt} points: n={size}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP per DRAM byte (tile model: each block reads its "
                  "panels once;\ncuBLAS: each matrix once)", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline, {recs[0]['device']} (numbers = kernel step)")
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _ = titles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plot_kernels")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--run", default=None, help="run id (default: the latest)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    recs, run = pick_run(load(args.files), args.run)
    out = args.out or args.files[0].parent
    out.mkdir(parents=True, exist_ok=True)
    tag = slug(recs[0]["device"])
    text = table(recs)
    (out / f"kernels-table-{tag}.md").write_text(text + "\n")
    print(text)
    plot_tflops(recs, out / f"kernels-tflops-{tag}.png")
    plot_roofline(recs, out / f"kernels-roofline-{tag}.png")
    print(f"wrote {out}/kernels-table-{tag}.md, kernels-tflops-{tag}.png, kernels-roofline-{tag}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
