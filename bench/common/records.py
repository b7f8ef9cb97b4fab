"""Benchmark records: the command line every benchmark has, the device and commit measured,
and tidy records as /work/shared/BENCH_RECORDS.md defines them.

This module covers: ``parser`` (``--out-dir``, alias ``--out``); device naming (``gpu_name``,
``cpu_model``, ``slug``) and the commit measured (``git_commit``); one JSON object per line
under ``bench/results/<benchmark>-<device-slug>-<date>.jsonl`` (``RecordWriter``, ``load``).
It does not cover timing (``bench.common.timing``) or operands (``bench.common.operands``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

#: where records go unless ``--out-dir`` says otherwise
RESULTS = Path(__file__).resolve().parent.parent / "results"


# -- the command line ------------------------------------------------------------------------

def parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is the first paragraph of ``doc`` (a module
    docstring), with the option every benchmark has: ``--out-dir`` (alias ``--out``), the
    folder the records go to (default ``bench/results``)."""
    desc = (doc or "").strip().split("\n\n")[0]
    p = argparse.ArgumentParser(prog=prog, description=desc)
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="records folder (default bench/results)")
    return p


# -- the commit and the device ---------------------------------------------------------------

def git_commit() -> str:
    """``DISTMM_COMMIT`` when set (device copies of the tree may carry a stale .git), else HEAD."""
    if os.environ.get("DISTMM_COMMIT"):
        return os.environ["DISTMM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except Exception:
        return "unknown"


def cpu_model() -> str:
    """The CPU model as ``/proc/cpuinfo`` names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def gpu_name() -> str:
    """The current GPU's name as the driver reports it (needs cupy)."""
    from distmm.executor.device import gpu_name as name

    return name()


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (at most 40 characters)."""
    keep = "".join(ch.lower() if ch.isalnum() else "-" for ch in text)
    return "-".join(part for part in keep.split("-") if part)[:40]


# -- records ---------------------------------------------------------------------------------

class RecordWriter:
    """Append records of one run to ``<out_dir>/<benchmark>-<device-slug>-<date>.jsonl``.

    Parameters
    ----------
    benchmark : str
        ``cpu``, ``kernels``, ``pipeline``, ...
    device : str
        GPU name or CPU model.
    out_dir : path, optional
        Where the file goes (default ``bench/results``; the GPU runs write under ``$OUT`` on
        the device machine and the files are copied back).
    file_stem : str, optional
        The file name's first part when it is not ``benchmark`` (``cpu-dask`` for the Dask
        runs of benchmark ``cpu``).
    **common
        Keys added to every record.
    """

    def __init__(self, benchmark: str, device: str, out_dir: str | os.PathLike | None = None,
                 *, file_stem: str | None = None, **common):
        self.benchmark = benchmark
        self.device = device
        self.date = _dt.date.today().isoformat()
        self.run = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.commit = git_commit()
        self.common = common
        out = Path(out_dir) if out_dir else RESULTS
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{file_stem or benchmark}-{slug(device)}-{self.date}.jsonl"
        self.records: list[dict] = []

    def add(self, variant: str, dtype: str, m: int, n: int, k: int, seconds: float,
            relerr: float | None, **extra) -> dict:
        """Write one record (BENCH_RECORDS.md's keys, then ``common``, then ``extra``)."""
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


def load(paths) -> list[dict]:
    """Read records from jsonl files (plots and tables use only this)."""
    out = []
    for p in paths:
        with open(p) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out
