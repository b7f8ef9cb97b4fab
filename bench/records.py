"""Tidy benchmark records (see shared BENCH_RECORDS.md): one JSON object per line.

Every benchmark in bench/ writes through ``RecordWriter`` so that records share
one ``run`` id, the commit and the date, and plots are made from files only.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """``DISTMM_COMMIT`` when set (device copies of the tree may carry a stale .git), else HEAD."""
    if os.environ.get("DISTMM_COMMIT"):
        return os.environ["DISTMM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except Exception:
        return os.environ.get("DISTMM_COMMIT", "unknown")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def gpu_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def slug(text: str) -> str:
    keep = "".join(ch.lower() if ch.isalnum() else "-" for ch in text)
    return "-".join(part for part in keep.split("-") if part)[:40]


def relerr(c, c_ref) -> float:
    """``norm(C - C_ref) / norm(C_ref)`` in float64 on the host."""
    c = np.asarray(c, dtype=np.float64)
    c_ref = np.asarray(c_ref, dtype=np.float64)
    den = np.linalg.norm(c_ref)
    return float(np.linalg.norm(c - c_ref) / den) if den else float(np.linalg.norm(c))


class RecordWriter:
    """Append records of one run to ``bench/results/<benchmark>-<device>-<date>.jsonl``.

    Parameters
    ----------
    benchmark : str
        ``cpu``, ``kernels``, ``pipeline``, ...
    device : str
        GPU name or CPU model.
    out_dir : path, optional
        Where the file goes (default ``bench/results``; the GPU scripts write
        under ``$OUT`` on the device machine and the files are copied back).
    """

    def __init__(self, benchmark: str, device: str, out_dir: str | os.PathLike | None = None,
                 **common):
        self.benchmark = benchmark
        self.device = device
        self.date = _dt.date.today().isoformat()
        self.run = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.commit = git_commit()
        self.common = common
        out = Path(out_dir) if out_dir else RESULTS
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{benchmark}-{slug(device)}-{self.date}.jsonl"
        self.records: list[dict] = []

    def add(self, variant: str, dtype: str, m: int, n: int, k: int, seconds: float,
            relerr: float | None, **extra) -> dict:
        rec = {
            "run": self.run, "benchmark": self.benchmark, "variant": variant,
            "device": self.device, "dtype": str(np.dtype(dtype)), "m": int(m), "n": int(n),
            "k": int(k), "seconds": float(seconds),
            "tflops": 2.0 * m * n * k / seconds / 1e12 if seconds > 0 else None,
            "relerr": relerr, "commit": self.commit, "date": self.date,
        }
        rec.update(self.common)
        rec.update(extra)
        self.records.append(rec)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        return rec


def median_seconds(fn, *, repeat: int = 5, warmup: int = 1, sync=None) -> float:
    """Median wall time of ``fn()`` after ``warmup`` calls; ``sync()`` runs before
    each clock read (device synchronisation for GPU work)."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def load(paths) -> list[dict]:
    """Read records from jsonl files (plots and tables use only this)."""
    out = []
    for p in paths:
        with open(p) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out
