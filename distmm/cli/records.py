"""Benchmark records: the device and commit measured, and tidy records as
``BENCH_RECORDS.md`` defines them (one JSON object per line).

This module covers: device naming (``gpu_name``, ``cpu_model``, ``slug``) and the commit
measured (``git_commit``); appending records to a ``.jsonl`` file, each record one
``write`` of one whole line on a file opened for appending, flushed to disk before the next
measurement starts, so that a killed run keeps every record it finished and never a partial
line (``RecordWriter``, ``append_record``); reading them back (``json_lines``, ``load``: the
values of a file with their line numbers, the records of several); one line saying
what a record measured (``progress_line``).
It does *not* cover timing or operands (``distmm.cli.bench``, ``bench.common``), the
benchmarks' shared command line and results folder (``bench.common.records``), or plots
(``distmm.cli.report``).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["git_commit", "cpu_model", "gpu_name", "slug", "RecordWriter", "append_record",
           "json_lines", "load", "make_record", "progress_line"]


# -- the commit and the device ---------------------------------------------------------------

def git_commit() -> str:
    """``DISTMM_COMMIT`` when set (device copies of the tree may carry a stale .git), else
    HEAD of the checkout this module lies in, else ``"unknown"`` (an installed wheel)."""
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

def make_record(*, run: str, benchmark: str, variant: str, device: str, dtype, m: int, n: int,
                k: int, seconds: float, relerr: float | None, commit: str, date: str,
                **extra) -> dict:
    """One record: BENCH_RECORDS.md's keys in their order (``tflops`` from the others),
    then ``extra``."""
    rec = {
        "run": run, "benchmark": benchmark, "variant": variant, "device": device,
        "dtype": str(np.dtype(dtype)), "m": int(m), "n": int(n), "k": int(k),
        "seconds": float(seconds),
        "tflops": 2.0 * m * n * k / seconds / 1e12 if seconds > 0 else None,
        "relerr": relerr, "commit": commit, "date": date,
    }
    rec.update(extra)
    return rec


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` to ``path`` as one line in one ``write`` (``O_APPEND``), then
    ``fsync``: a reader, or a run killed afterwards, sees the whole line or nothing of it."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):  # a full disk mid-line: take the fragment back out
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            raise OSError(28, "No space left on device", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordWriter:
    """Append records of one run to ``<out_dir>/<benchmark>-<device-slug>-<date>.jsonl``
    (or to ``path``).

    Parameters
    ----------
    benchmark : str
        ``cpu``, ``kernels``, ``pipeline``, ``scaling``, ...
    device : str
        GPU name or CPU model.
    out_dir : path, optional
        Where the file goes (default: the current directory).
    file_stem : str, optional
        The file name's first part when it is not ``benchmark`` (``cpu-dask`` for the Dask
        runs of benchmark ``cpu``).
    path : path, optional
        The file itself, instead of ``out_dir`` and the name made from the others.
    **common
        Keys added to every record.
    """

    def __init__(self, benchmark: str, device: str, out_dir: str | os.PathLike | None = None,
                 *, file_stem: str | None = None, path: str | os.PathLike | None = None,
                 **common):
        self.benchmark = benchmark
        self.device = device
        self.date = _dt.date.today().isoformat()
        self.run = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.commit = git_commit()
        self.common = common
        if path is not None:
            self.path = Path(path)
        else:
            out = Path(out_dir) if out_dir else Path.cwd()
            self.path = out / f"{file_stem or benchmark}-{slug(device)}-{self.date}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []

    def add(self, variant: str, dtype: str, m: int, n: int, k: int, seconds: float,
            relerr: float | None, **extra) -> dict:
        """Write one record (BENCH_RECORDS.md's keys, then ``common``, then ``extra``)."""
        rec = make_record(run=self.run, benchmark=self.benchmark, variant=variant,
                          device=self.device, dtype=dtype, m=m, n=n, k=k, seconds=seconds,
                          relerr=relerr, commit=self.commit, date=self.date,
                          **{**self.common, **extra})
        self.records.append(rec)
        append_record(self.path, rec)
        return rec


def json_lines(path):
    """The values of a JSON-lines file with their line numbers, ``(number, value)``, blank
    lines skipped; a line that does not parse raises ``ValueError`` naming ``path:number``."""
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            yield number, value


def load(paths) -> list[dict]:
    """Read records from jsonl files (plots and tables use only this)."""
    return [value for p in paths for _, value in json_lines(p)]


def progress_line(index: int, total: int, rec: dict) -> str:
    """The progress line of record number ``index`` of ``total`` (``distmm bench``'s)."""
    return (f"[{index}/{total}] {rec['variant']} {rec['dtype']} {rec['m']}x{rec['n']}x{rec['k']}"
            f" ({rec['series']}): first {rec['first_seconds']:.4g} s, median "
            f"{rec['seconds']:.4g} s of {len(rec['all_seconds'])}, {rec['tflops']:.4g} TFLOP/s, "
            f"relerr {rec['relerr']:.2e}" + ("" if rec["relerr_ok"] else " ABOVE BOUND"))
