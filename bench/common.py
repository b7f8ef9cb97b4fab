"""What every benchmark in ``bench/`` shares: arguments, timing, device names and records.

This module covers:

- the command line every benchmark has (``parser``: ``--out-dir``, alias ``--out``);
- timing: wall-clock medians with an optional device synchronisation (``median_seconds``,
  ``wall_times``, ``alternating_seconds``), CUDA-event medians on the current stream
  (``event_seconds``, ``event_alternating``) and the sustained clock of a GPU loop
  (``sustained_clock``);
- device naming (``gpu_name``, ``cpu_model``, ``slug``) and the commit measured
  (``git_commit``);
- a Dask cluster emptied between measurements (``release_cluster``);
- tidy records as /work/shared/BENCH_RECORDS.md defines them, one JSON object per line, under
  ``bench/results/<benchmark>-<device-slug>-<date>.jsonl`` (``RecordWriter``, ``load``);
- fresh random GPU operands and float64 error checks (``random_operands``, ``relerr``,
  ``relerr_gpu``).

It does not cover any workload (one script per workload: ``bench/cpu.py``, ``dask_cpu.py``,
``kernels.py``, ``pipeline.py``), plots (``plot_kernels.py``) or research probes
(``bench/research/``). Importing it needs neither cupy nor a GPU: every cupy import is inside
the function that needs it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

#: where records go unless ``--out-dir`` says otherwise
RESULTS = Path(__file__).resolve().parent / "results"


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


# -- errors and operands ---------------------------------------------------------------------

def relerr(c, c_ref) -> float:
    """``norm(C - C_ref) / norm(C_ref)`` in float64 on the host."""
    c = np.asarray(c, dtype=np.float64)
    c_ref = np.asarray(c_ref, dtype=np.float64)
    den = np.linalg.norm(c_ref)
    return float(np.linalg.norm(c - c_ref) / den) if den else float(np.linalg.norm(c))


def random_operands(m: int, n: int, k: int, dtype, seed: int | None = None):
    """Fresh random device operands (never zeros): normal floats, small signed integers."""
    import cupy

    rng = cupy.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        a = rng.standard_normal((m, k), dtype=np.float64).astype(dt)
        b = rng.standard_normal((k, n), dtype=np.float64).astype(dt)
    else:
        a = rng.integers(-8, 9, size=(m, k), dtype=np.int64).astype(dt)
        b = rng.integers(-8, 9, size=(k, n), dtype=np.int64).astype(dt)
    return a, b


def relerr_gpu(c, a, b) -> float:
    """``norm(C - A@B) / norm(A@B)`` on the GPU with the reference in float64 (cuBLAS DGEMM)."""
    import cupy

    ref = cupy.matmul(a.astype(np.float64), b.astype(np.float64))
    den = float(cupy.linalg.norm(ref))
    err = float(cupy.linalg.norm(c.astype(np.float64) - ref))
    return err / den if den else err


# -- timing ----------------------------------------------------------------------------------

def gpu_sync() -> None:
    """Wait for all work on the current GPU."""
    import cupy

    cupy.cuda.Device().synchronize()


def free_gpu() -> None:
    """Return cupy's pooled device and pinned memory (between configurations)."""
    import gc

    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _free_gpu_if_used() -> None:
    import sys

    if sys.modules.get("cupy") is not None:
        try:
            free_gpu()
        except Exception:  # a worker that sees no GPU
            pass


def release_cluster(client, timeout: float = 30, keep=()) -> None:
    """Wait until the scheduler of ``client`` holds no result in memory but the keys of the
    collections in ``keep`` (what the caller dropped is forgotten), then return cupy's pooled
    memory on every worker that used it (workers sharing a GPU cannot use each other's cached
    blocks)."""
    import gc

    from distributed import futures_of

    held = sum(len(futures_of(x)) for x in keep)
    gc.collect()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = client.run_on_scheduler(lambda dask_scheduler: sum(
            ts.state == "memory" for ts in dask_scheduler.tasks.values()))
        if n <= held:
            break
        time.sleep(0.05)
    client.run(_free_gpu_if_used)


def wall_times(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
               sync: Callable[[], Any] | None = None) -> list[float]:
    """Wall seconds of each of ``repeat`` calls of ``fn()`` after ``warmup`` calls;
    ``sync()`` (a device synchronisation for GPU work) runs before each clock read."""
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
    return times


def median_seconds(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median of ``wall_times``."""
    return float(np.median(wall_times(fn, repeat=repeat, warmup=warmup, sync=sync)))


def alternating_seconds(fns: Mapping[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall seconds of each callable, timed in turn ``repeat`` times (no warm-up: the
    caller's checked run is the warm-up), so that load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def event_seconds(fn: Callable[[], Any], *, repeat: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` between CUDA events on the current stream, after warm-up
    (``distmm.cli.tune.time_gpu``, the one implementation)."""
    from distmm.cli.tune import time_gpu

    return time_gpu(fn, repeat=repeat, warmup=warmup)


def event_alternating(runs: Mapping[str, Callable[[], Any]], *, rounds: int, repeat: int,
                      warmup: int = 1) -> dict[str, float]:
    """Median seconds of each of ``runs`` timed in alternation (``rounds`` rounds, each
    timing every run once with CUDA events): ``distmm.cli.tune.time_alternating``."""
    from distmm.cli.tune import time_alternating

    return time_alternating(runs, rounds=rounds, repeat=repeat, warmup=warmup)


def sustained_clock(fn: Callable[[], Any], seconds: float = 2.0) -> tuple[float, float, float]:
    """(median SM MHz, median board W, calls per second) of ``fn`` run back to back: the one
    implementation, ``distmm.cli.tune.sustained_clock`` (NOTES.md: the GEMMs run at the power cap)."""
    from distmm.cli.tune import sustained_clock as measure

    return measure(fn, seconds)


def raw_runner(kernel: str, params: dict | None, a, b, c, **launch) -> Callable[[], None]:
    """A call of registered kernel ``kernel`` computing ``c = a @ b`` (untransposed, dense)
    with template ``params``; ``launch`` goes to ``cuda_loader.launch`` (``defines``,
    ``split_tail``, ...)."""
    from distmm.executor import cuda_loader

    m, k = a.shape
    n = b.shape[1]

    def run():
        cuda_loader.launch(kernel, a, False, k, b, False, n, c, n, m, n, k, params=params,
                           **launch)
    return run
