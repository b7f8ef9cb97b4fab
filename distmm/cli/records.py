"""Benchmark records: the device and commit measured, and tidy records as
``BENCH_RECORDS.md`` defines them (one JSON object per line).

This module covers: device naming (``gpu_name``, ``cpu_model``, ``slug``) and the commit
measured (``git_commit``; ``git_dirty``: whether the tree had uncommitted changes); a run's id,
unique on its host (``run_id``); appending records to a ``.jsonl`` file, each record one
``write`` of one whole line on a file opened for appending, under an exclusive lock of the file
so that writers beside each other take turns, flushed to disk before the next measurement
starts, so that a killed run keeps every record it finished (``RecordWriter``,
``append_record``; a file whose last line lacks its newline gets one first, so a record never
joins the end of another line; ``RecordWriter`` refuses, before the run, a file that holds
anything but records); reading them back (``json_lines``: the values of a file with their line
numbers, a last line cut short left out where the reader asks; ``read_records``, ``load``: the
records of one file or several, each field a reader uses checked by ``check_record``, so that
the report, ``distmm model --validate`` and ``distmm calibrate --from-records`` refuse a bad
record in one line naming its file, line and field; ``json_file``: a whole JSON file (a
profile, a trace, a timeline), its errors naming it, one that holds benchmark records refused
with a line saying records files are ``.jsonl``); one line saying what a record measured
(``progress_line``).
It does *not* cover timing or operands (``distmm.cli.bench``, ``bench.common``), the
benchmarks' shared command line and results folder (``bench.common.records``), or plots
(``distmm.cli.report``).
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import math
import os
import platform
import stat
import subprocess
import time
from pathlib import Path

import numpy as np

from distmm import jsonfile

__all__ = ["git_commit", "git_dirty", "cpu_model", "gpu_name", "slug", "run_id", "RecordWriter",
           "append_record", "json_file", "json_lines", "read_records", "check_record", "load",
           "make_record", "progress_line", "REQUIRED"]


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


def git_dirty(where: str | os.PathLike | None = None) -> bool | None:
    """Whether the checkout this module lies in (or the one at ``where``) has uncommitted
    changes to its tracked files: then a record's ``commit`` names code other than what
    ran, and ``RecordWriter`` adds ``commit_dirty: true``. None where it cannot be told
    (``DISTMM_COMMIT`` set, an installed wheel, no git)."""
    if where is None and os.environ.get("DISTMM_COMMIT"):
        return None
    try:
        # --no-optional-locks: a look that never writes the index beside another git
        return bool(subprocess.run(["git", "--no-optional-locks", "status", "--porcelain",
                                    "--untracked-files=no"], capture_output=True, text=True,
                                   check=True, timeout=60,
                                   cwd=where or Path(__file__).parent).stdout.strip())
    except Exception:
        return None


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


# -- the run ---------------------------------------------------------------------------------

#: the ids this process made (``run_id``)
_MADE: set[str] = set()
#: how long a claimed id stays claimed (seconds): past it, the next claim removes it
_CLAIM_KEPT = 120


def run_id() -> str:
    """A new run's id: the UTC second it starts, ``20261206T163257Z`` (the shape the records
    have always had, and which ``distmm calibrate`` finds in a profile's file name), no other
    run's on this host. Each id is claimed by creating a file of its name (``O_EXCL``) in
    ``run-ids`` of distmm's cache folder (``distmm.executor.tuning.cache_dir``); a second
    that another run, here or in another process, has claimed is waited out, and the next
    one taken. Where that folder cannot be written, the ids are unique within this process
    only."""
    from distmm.executor.tuning import cache_dir

    folder = cache_dir() / "run-ids"
    while True:
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        if stamp not in _MADE and _claim(folder, stamp, now):
            _MADE.add(stamp)
            return stamp
        time.sleep(1.0 - now % 1.0 + 0.01)  # into the next second


def _claim(folder: Path, stamp: str, now: float) -> bool:
    """Claim the id ``stamp`` in ``folder``: False where it is claimed already; True where
    this call claimed it, or where ``folder`` cannot take claims (no one can be asked). Ids
    claimed more than ``_CLAIM_KEPT`` seconds before ``now`` are removed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a file in its place, a cache folder that cannot be written
        return True
    try:
        os.close(os.open(folder / stamp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    old = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now - _CLAIM_KEPT))
    for claim in os.listdir(folder):
        if claim < old:
            try:
                os.unlink(folder / claim)
            except OSError:
                pass
    return True


# -- records ---------------------------------------------------------------------------------

def make_record(*, run: str, benchmark: str, variant: str, device: str, dtype, m: int, n: int,
                k: int, seconds: float, relerr: float | None, commit: str, date: str,
                **extra) -> dict:
    """One record: BENCH_RECORDS.md's keys in their order (``tflops`` from the others),
    then ``extra``. A ``relerr`` that is NaN or infinite (a product with NaN or Inf in its
    checked rows) is written null, with ``relerr_nonfinite`` (``"nan"``, ``"inf"``) saying
    what it was: JSON has no such number, and ``check_record`` refuses it."""
    if relerr is not None and not math.isfinite(relerr):
        extra = {"relerr_nonfinite": str(float(relerr)), **extra}
        relerr = None
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
    ``fsync``: a run killed afterwards keeps the whole line. A file that does not end with
    a newline (written by hand, or cut short) gets one before the record, in the same
    ``write``: its last line stays as it was, the record a line of its own. The check and
    the write hold an exclusive ``flock`` of the file, so that writers appending to one file
    at once take turns: none takes another's line, still being written, for a line cut
    short (a blank line between theirs), and a line a full disk cut is taken back out from
    the file's end, where it is. A path that is no regular file (``/dev/null``, a pipe)
    takes the line unsynced."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks (ENOLCK): the write alone
                pass
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        written = os.write(fd, line)
        if written != len(line):  # a full disk mid-line: take the fragment back out
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            raise OSError(28, "No space left on device", str(path))
        if regular:  # /dev/null, a pipe: nothing to flush (EINVAL)
            os.fsync(fd)
    finally:
        os.close(fd)  # and the lock with it


class RecordWriter:
    """Append records of one run to ``<out_dir>/<benchmark>-<device-slug>-<date>.jsonl``
    (or to ``path``), each with the writer's ``run``: ``run_id()``, no other writer's on
    this host.

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

    Raises
    ------
    ValueError, TypeError
        The file exists and holds something ``read_records`` refuses (it is no records
        file, or a record in it is bad): named with its line, before anything is measured,
        not after a run whose records would join a file no reader takes.
    """

    def __init__(self, benchmark: str, device: str, out_dir: str | os.PathLike | None = None,
                 *, file_stem: str | None = None, path: str | os.PathLike | None = None,
                 **common):
        self.benchmark = benchmark
        self.device = device
        self.date = _dt.date.today().isoformat()
        self.commit = git_commit()
        # a tree with uncommitted changes ran: the commit alone does not name it
        self.common = {"commit_dirty": True, **common} if git_dirty() else common
        if path is not None:
            self.path = Path(path)
        else:
            out = Path(out_dir) if out_dir else Path.cwd()
            self.path = out / f"{file_stem or benchmark}-{slug(device)}-{self.date}.jsonl"
        if self.path.is_file():
            try:
                for _ in read_records(self.path):
                    pass
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{exc}; records are appended to a file of records only") \
                    from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = run_id()  # after the checks: a refused file waits for no free second
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


def json_lines(path, cut: list | None = None):
    """The values of a JSON-lines file with their line numbers, ``(number, value)``, blank
    lines skipped; a line that is not UTF-8 JSON raises ``ValueError`` naming
    ``path:number`` (and saying so where it is a last line without its newline: a writer
    killed mid-line, a copy or a disk cut short, or a line still being written). With a
    list ``cut``, such a last line is left out instead and its ``path:number`` appended to
    ``cut`` (the report's readers: every whole line before it is a record a run finished);
    a bad line that ends with its newline raises all the same."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode()
                value = json.loads(line) if line.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                ended = raw.endswith(b"\n")
                if cut is not None and not ended:
                    cut.append(f"{path}:{number}")
                    return
                if isinstance(exc, UnicodeDecodeError):
                    raise ValueError(f"{path}:{number}: not UTF-8 text") from None
                why = "" if ended else "; the file's last line, cut short (no newline at its end)"
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg}){why}") from None
            if line.strip():
                yield number, value


#: the keys every record has (BENCH_RECORDS.md; ``seconds`` null in a prediction)
REQUIRED = ("run", "benchmark", "variant", "device", "dtype", "m", "n", "k", "seconds")


def _is_record_like(value) -> bool:
    """Whether a JSON value looks like a benchmark record (an object with the ``REQUIRED``
    keys and no ``format``) or a list of them."""
    if isinstance(value, list):
        return bool(value) and all(map(_is_record_like, value))
    return isinstance(value, dict) and "format" not in value and set(REQUIRED) <= set(value)


def json_file(path):
    """The value of a whole JSON file (a profile, a trace, a timeline: the readers choose it
    by its ``.json`` name), as ``distmm.jsonfile.json_file`` reads it; a file that holds
    benchmark records instead (JSON lines, one record, or a list of them) raises
    ``ValueError`` naming it and saying that records files are ``.jsonl``: a ``.json`` name
    keeps meaning a profile, so a file of records is never half read as one."""
    try:
        data = jsonfile.json_file(path)
        records = _is_record_like(data)
    except ValueError:
        if not _is_record_like(_first_line(path)):
            raise
        records = True  # JSON lines, the first a record
    if records:
        raise ValueError(f"{path}: looks like benchmark records, and records files are JSON "
                         f"lines named .jsonl (one record per line); a .json file is read as "
                         f"a profile or a trace")
    return data


def _first_line(path):
    """The JSON value of the first line of ``path`` that is not blank, or None."""
    with open(path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    return json.loads(raw)
                except ValueError:
                    return None
    return None


_TEXT = ("benchmark", "variant", "device", "role", "precision", "invalid", "engine", "setting",
         "mode", "residency", "series", "source")
_SIZES = ("m", "n", "k")
_NUMBERS = ("tflops", "relerr", "predicted_seconds", "first_seconds", "seconds_min",
            "seconds_max", "gbps")
_COUNTS = {"gpus": 0, "workers": 0, "cpu_workers": 0, "gpu_workers": 0, "nccl_pairs": 0,
           "written_direct": 0, "ranks": 1, "threads": 1, "threads_per_rank": 1, "cores": 1,
           "cpus_per_rank": 1, "devices": 1, "gpus_visible": 1, "per_device": 1}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_record(record, where: str) -> dict:
    """``record`` itself when it is a record the readers can use, else ``ValueError``
    (``TypeError`` for a value of the wrong type) naming ``where`` (``FILE:LINE``) and the
    field: a JSON object with the ``REQUIRED`` keys; ``run`` a string or an integer;
    ``benchmark``, ``variant``, ``device`` and the other names (``role``, ``precision``,
    ``invalid``, ...) strings (the optional ones may be null); ``dtype`` a numeric dtype
    numpy knows; ``m``, ``n``, ``k`` integers from 0 to 2**63 - 1 (0: a ceiling probe);
    ``seconds`` a positive finite number or null, at which ``2*m*n*k / seconds`` is finite;
    ``tflops``, ``relerr``, ``predicted_seconds`` and the other measured numbers finite, not
    negative, or null; the counts (``gpus``, ``workers``, ``ranks``, ``threads``, ``cores``,
    ``per_device``, ...) integers or null (at least 0 for ``gpus``, ``workers``, ``cpu_workers``, ``gpu_workers``,
    ``nccl_pairs`` and ``written_direct``, at least 1 for the others);
    ``emulated_nodes`` a positive integer or ``"all-links"``; ``grid`` null or a list of
    positive integers; ``all_seconds`` a list of finite numbers, not negative. Other keys
    are not checked."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{where}: the record lacks {', '.join(missing)}")

    def bad(key, want, error=TypeError):
        shown = repr(record[key])
        shown = shown if len(shown) <= 60 else shown[:56] + " ..."
        raise error(f"{where}: field {key!r} must be {want}, got {shown}")

    if not (isinstance(record["run"], str) or _is_int(record["run"])):
        bad("run", "a string or an integer")
    for key in _TEXT:
        value = record.get(key)
        if not isinstance(value, str) and (value is not None or key in REQUIRED):
            bad(key, "a string")
    dtype = record["dtype"]
    if not isinstance(dtype, str):
        bad("dtype", "a dtype name such as 'float32'")
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        kind = None
    if kind not in ("i", "u", "f", "c"):
        bad("dtype", "a numeric dtype numpy knows, such as 'float32'", ValueError)
    for key in _SIZES:
        if not _is_int(record[key]):
            bad(key, "an integer")
        if not 0 <= record[key] < 2**63:
            bad(key, "an integer from 0 to 2**63 - 1", ValueError)
    seconds = record["seconds"]
    if seconds is not None and not (_is_number(seconds) and seconds > 0):
        bad("seconds", "a positive finite number or null",
            TypeError if not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
            else ValueError)
    if seconds is not None and not math.isfinite(
            2.0 * record["m"] * record["n"] * record["k"] / seconds):
        bad("seconds", "a time its size's flop rate is finite at (2*m*n*k / seconds overflows)",
            ValueError)
    for key in _NUMBERS:
        value = record.get(key)
        if value is not None and not (_is_number(value) and value >= 0):
            bad(key, "a finite number, not negative, or null",
                TypeError if not isinstance(value, (int, float)) or isinstance(value, bool)
                else ValueError)
    for key, least in _COUNTS.items():
        value = record.get(key)
        if value is not None and not _is_int(value):
            bad(key, "an integer or null")
        if value is not None and value < least:
            bad(key, f"at least {least}", ValueError)
    nodes = record.get("emulated_nodes")
    if nodes is not None and nodes != "all-links" and not (_is_int(nodes) and nodes >= 1):
        bad("emulated_nodes", "a positive integer or 'all-links'", ValueError)
    grid = record.get("grid")
    if grid is not None and not (isinstance(grid, list)
                                 and all(_is_int(g) and g >= 1 for g in grid)):
        bad("grid", "a list of positive integers or null", ValueError)
    times = record.get("all_seconds")
    if times is not None and not (isinstance(times, list)
                                  and all(_is_number(t) and t >= 0 for t in times)):
        bad("all_seconds", "a list of finite numbers, not negative", ValueError)
    return record


def read_records(path, cut: list | None = None):
    """The records of one JSON-lines file with their line numbers, ``(number, record)``,
    each checked by ``check_record`` (the first bad one raises, naming ``path:number``);
    ``cut`` as ``json_lines`` takes it."""
    for number, value in json_lines(path, cut):
        yield number, check_record(value, f"{path}:{number}")


def load(paths) -> list[dict]:
    """Read records from jsonl files (plots and tables use only this), each checked by
    ``check_record``."""
    return [record for p in paths for _, record in read_records(p)]


def progress_line(index: int, total: int, rec: dict) -> str:
    """The progress line of record number ``index`` of ``total`` (``distmm bench``'s)."""
    return (f"[{index}/{total}] {rec['variant']} {rec['dtype']} {rec['m']}x{rec['n']}x{rec['k']}"
            f" ({rec['series']}): first {rec['first_seconds']:.4g} s, median "
            f"{rec['seconds']:.4g} s of {len(rec['all_seconds'])}, {rec['tflops']:.4g} TFLOP/s, "
            f"relerr {_shown(rec)}" + ("" if rec["relerr_ok"] else " ABOVE BOUND"))


def _shown(rec: dict) -> str:
    """A record's relerr for its progress line (``relerr_nonfinite``'s where null)."""
    if rec["relerr"] is None:
        return rec.get("relerr_nonfinite", "not checked")
    return f"{rec['relerr']:.2e}"
