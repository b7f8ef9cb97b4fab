"""Does a new cluster's first distmm call wait for its processes to import the task modules?

A scheduler in a process of its own imports the modules that hold the task bodies only when
the first graph naming them arrives, and each worker at its first task, unless a preload
imported them as they started (``distmm.engine.dask.preload``, which ``distmm cluster``
loads). This probe starts a plain ``LocalCluster`` (scheduler in a process of its own, no
preload) afresh for each run and, from a new client process (distmm and its Dask engine
already imported there, so the client's own imports are not counted), times four products
of ``--n`` float64 after importing those modules beforehand on nothing (``none``), the
scheduler (``scheduler``), the workers (``workers``) or both (``both``); and the same on a
``distmm cluster`` (``distmm-cluster``). No record; it informs bench/NOTES.md ("The Dask
engine's first call").

    python -m bench.research.scheduler_imports [--runs 3] [--n 1000] [--workers 2]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("none", "scheduler", "workers", "both", "distmm-cluster")

SERVE = r"""
import json, signal, sys
from distributed import LocalCluster
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda *_: None)
    with LocalCluster(n_workers=int(sys.argv[2]), threads_per_worker=int(sys.argv[3]),
                      processes=True, dashboard_address=":0", scheduler_port=0) as cl:
        with open(sys.argv[1] + ".tmp", "w") as f:
            json.dump({"address": cl.scheduler_address}, f)
        import os
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        signal.sigwait({signal.SIGTERM})
"""

CLIENT = r"""
import importlib, json, sys, time
import numpy as np
from distributed import Client
import distmm
import distmm.engine.dask.eager, distmm.engine.dask.tasks, distmm.engine.dask.blocks
MODS = [m for m in sorted(sys.modules) if m.startswith("distmm.engine.dask")]
def imp(names):
    for n in names:
        importlib.import_module(n)
variant, n = sys.argv[1], int(sys.argv[2])
cl = Client(scheduler_file=sys.argv[3])
if variant in ("scheduler", "both"):
    cl.run_on_scheduler(imp, MODS)
if variant in ("workers", "both"):
    cl.run(imp, MODS)
time.sleep(1.0)
a = np.random.default_rng(0).standard_normal((n, n))
ts = []
for _ in range(4):
    t = time.perf_counter()
    distmm.matmul(a, a, client=cl)
    ts.append(time.perf_counter() - t)
print(json.dumps(ts))
cl.close()
"""


def one(variant: str, args) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        sched = Path(tmp) / "s.json"
        if variant == "distmm-cluster":
            cmd = [sys.executable, "-m", "distmm", "cluster", "--scheduler-file", str(sched),
                   "--workers", str(args.workers), "--threads", str(args.threads),
                   "--gpus", "0", "--dashboard-address", ":0", "--port", "0"]
        else:  # the scheduler in a process of its own, nothing preloaded
            cmd = [sys.executable, "-c", SERVE, str(sched), str(args.workers), str(args.threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            for _ in range(600):
                if sched.exists() and sched.stat().st_size:
                    break
                time.sleep(0.1)
            time.sleep(1.0)  # the workers' registration
            out = subprocess.run([sys.executable, "-c", CLIENT, variant, str(args.n), str(sched)],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode:
                raise SystemExit(f"client failed: {out.stderr.strip().splitlines()[-1:]}")
            import json

            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            os.killpg(proc.pid, signal.SIGINT if variant == "distmm-cluster" else signal.SIGTERM)
            proc.wait(timeout=60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.scheduler_imports",
                                description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh clusters per variant")
    p.add_argument("--n", type=int, default=1000, help="square float64 operands")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    rows: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):  # variants interleaved: the machine's drift spreads over all
        for v in VARIANTS:
            rows[v].append(one(v, args))
    print(f"n={args.n} float64, {args.workers} CPU workers x {args.threads} threads, "
          f"{args.runs} fresh clusters a variant")
    print(f"{'imported first on':<18} {'first call (median)':>20} {'warm (median)':>14}  runs")
    for v, runs in rows.items():
        first = statistics.median(r[0] for r in runs)
        warm = statistics.median(x for r in runs for x in r[1:])
        detail = "; ".join(" ".join(f"{x:.3f}" for x in r) for r in runs)
        print(f"{v:<18} {first:>20.3f} {warm:>14.3f}  {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
