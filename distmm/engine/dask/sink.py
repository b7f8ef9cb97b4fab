"""C written by the workers: each writes the blocks it computed into the staged output.

This module covers: recognising an ``out=`` that is a staged output of the command line
(``distmm.cli.io.staged_output``: the ``NpyWriter`` of ``.NAME.distmm-partial-PID``, the
``BlockWriter`` of a hidden HDF5 stage, a zarr array in a staged folder) as a ``FileSink``
(the target, the process that staged it, where the data starts, what the client sees of the
file), the task that writes one block of C there on a worker (``write_block``), and the
fence that ends a product's writes (``close``). The writes go through the MPI batch path's
``StripeWriter`` (``distmm.stripe_writer``), one per worker process and product: ``.npy`` and
HDF5 with ``os.pwrite`` at the data's offset, zarr through zarr, under ``StripeWriter``'s
lock beside the staged array unless every block covers whole zarr chunks (``aligned``), so
two writers never write one chunk at once. Whether every worker sees the staged file is
``distmm.engine.dask.files.visible``, as for operands.

``close`` runs on every worker once the product ends, in success and in failure: the
worker stops taking writes of that product (a late one raises ``SinkClosed`` and writes
nothing), waits for the write it is running, then flushes (``fsync``) and closes its file.
So once the engine returns or raises, no worker writes into the staged output any more,
and the command line can rename it into place or remove it; a zarr writer could otherwise
create the removed folder again. A worker killed mid-write leaves a partly written block,
which the block's next run, on another worker, writes whole again; ``close`` also removes
the temporary chunk files zarr's atomic writes leave behind a killed writer.

It does *not* cover: creating, committing or removing the staged output (``distmm.cli.io``,
``distmm.staging``, ``distmm.stripe_writer``), or running the product and retrying lost
blocks (``distmm.engine.dask.eager``). Outputs that are not staged files (a user's memmap,
zarr or HDF5 array passed as ``out=``) are written by the client, block by block.
"""
from __future__ import annotations

import os
import re
import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from distmm.staging import PARTIAL, staged_path

__all__ = ["FileSink", "sink_of", "write_block", "write_placement", "close", "SinkClosed"]

_STAGED = re.compile(r"^\.(?P<name>.+)\." + re.escape(PARTIAL) + r"-(?P<pid>\d+)$")
_ZARR_TEMP = re.compile(r"\.[0-9a-f]{32}\.partial$")  # zarr's LocalStore: chunk.<uuid>.partial


class SinkClosed(RuntimeError):
    """A write task of a product whose writes have ended (``close``) ran late: not written."""


@dataclass(frozen=True)
class FileSink:
    """A staged output the workers write into: ``kind`` ``"npy"``, ``"h5"`` or ``"zarr"``,
    the ``target`` it will replace and the ``pid`` that staged it (the staged file is
    ``staging.staged_path(target, pid)``), ``shape`` and ``dtype`` of C, ``header``: the
    data's byte offset (``.npy``, HDF5), zarr's ``chunks``, what the client saw of the
    staged file (``stamp_path``, ``size``, ``mtime_ns``, ``ino``: for ``files.visible``),
    this product's ``token``, for zarr, whether every block covers whole chunks
    (``aligned``: written without the lock), for ``.npy`` and HDF5, whether large spans
    go past the page cache (``direct``: the client's ``distmm.direct-writes``, as running
    workers do not see the client's later ``dask.config`` changes), and the workers found
    to see the staged file (``writers``: ``for_workers``; only they write it,
    ``write_placement``)."""

    kind: str
    target: str
    pid: int
    shape: tuple
    dtype: str
    header: int | None
    chunks: tuple | None
    stamp_path: str
    size: int
    mtime_ns: int
    token: str
    aligned: bool = False
    ino: int = 0
    direct: bool = True
    writers: frozenset = frozenset()

    @property
    def staged(self) -> Path:
        return staged_path(self.target, self.pid)

    def for_blocks(self, row_edges, col_edges) -> FileSink:
        """This sink for blocks cut at ``row_edges`` x ``col_edges``: ``aligned`` when
        each edge is a zarr chunk edge or the array's end."""
        if self.chunks is None:
            return self
        (m, n), (cm, cn) = self.shape[-2:], self.chunks[-2:]
        aligned = (all(int(r) % cm == 0 or int(r) == m for r in row_edges)
                   and all(int(c) % cn == 0 or int(c) == n for c in col_edges))
        return replace(self, aligned=aligned)

    def for_workers(self, workers) -> FileSink:
        """This sink written by ``workers`` only: those found to see the staged file
        (``files.visible``)."""
        return replace(self, writers=frozenset(workers))


def write_placement(sink: FileSink, alive) -> dict | None:
    """The annotations of a round's write tasks: on the live workers of ``sink.writers`` and
    no other (``allow_other_workers=False``: a worker that joined after the check may not see
    the staged file, and would fail or write into another file of its name); None where none
    of them is ``alive``: the client writes that round's blocks."""
    workers = sorted(sink.writers & set(alive))
    if not workers:
        return None
    return {"workers": workers, "allow_other_workers": False}


def _staged_of(path: Path):
    """``(target, pid)`` of a staged path ``.NAME.distmm-partial-PID``, or None."""
    found = _STAGED.match(path.name)
    if found is None:
        return None
    target, pid = path.parent / found["name"], int(found["pid"])
    return (target, pid) if staged_path(target, pid) == path else None


def _kind_of(target: Path) -> str | None:
    if target.suffix == ".npy":
        return "npy"
    if target.suffix in (".h5", ".hdf5"):
        return "h5"
    if target.suffix == ".zarr" or any(part.endswith(".zarr") for part in target.parts[:-1]):
        return "zarr"
    return None


def sink_of(out) -> FileSink | None:
    """The ``FileSink`` of an ``out=`` that is a 2-D staged output of the command line, or
    None (anything else: the client writes it)."""
    from distmm.staging import BlockWriter

    if getattr(out, "ndim", None) != 2:
        return None
    if isinstance(out, BlockWriter):
        path, header, chunks = Path(out.path), out.offset, None
        wanted = ("npy", "h5")
    elif type(out).__module__.split(".")[0] == "zarr":
        root = getattr(getattr(out, "store", None), "root", None)
        if root is None or getattr(out, "path", ""):
            return None  # not a local store, or an array inside the staged node
        path, header = Path(str(root)), None
        chunks = tuple(int(c) for c in (getattr(out, "shards", None) or out.chunks))
        wanted = ("zarr",)
    else:
        return None
    path = Path(os.path.abspath(path))
    found = _staged_of(path)
    if found is None:
        return None
    target, pid = found
    kind = _kind_of(target)
    if kind not in wanted:
        return None
    stamp_path = path
    if kind == "zarr":
        stamp_path = path / "zarr.json"
        if not stamp_path.exists():
            stamp_path = path / ".zarray"  # a zarr format 2 array (inside a format 2 group)
    try:
        st = os.stat(stamp_path)
    except OSError:
        return None
    from distmm.config import get_config

    return FileSink(kind, str(target), pid, tuple(int(s) for s in out.shape),
                    np.dtype(out.dtype).str, header, chunks, str(stamp_path), st.st_size,
                    st.st_mtime_ns, uuid.uuid4().hex, ino=st.st_ino,
                    direct=get_config().direct_writes)


# ---------------------------------------------------------------- on the workers

_LOCK = threading.Lock()
_WRITERS: dict = {}  # token -> _Writer, one per product in this worker process
_CLOSED: dict = {}  # tokens whose writes have ended here (the latest few hundred)
_KEEP_CLOSED = 256


class _Writer:
    def __init__(self, writer):
        self.writer = writer
        self.busy = 0  # writes running now
        self.idle = threading.Condition(_LOCK)


def _begin(sink: FileSink) -> _Writer:
    with _LOCK:
        if sink.token in _CLOSED:
            raise SinkClosed(f"the writes into {sink.staged} have ended")
        entry = _WRITERS.get(sink.token)
        if entry is None:
            from distmm.stripe_writer import StripeWriter

            entry = _WRITERS[sink.token] = _Writer(StripeWriter(
                sink.target, sink.pid, sink.shape, sink.dtype, sink.header,
                aligned=sink.aligned, direct=sink.direct))
        entry.busy += 1
        return entry


def write_block(sink: FileSink, region: tuple, block) -> int:
    """Task body, on a worker: write ``block`` (C's rows ``region[0]:region[1]``, columns
    ``region[2]:region[3]``) into the staged output; returns the bytes written, the only
    thing the client receives."""
    r0, r1, c0, c1 = (int(x) for x in region)
    block = np.asarray(block).reshape(r1 - r0, c1 - c0)
    entry = _begin(sink)
    try:
        entry.writer.write(r0, r1, c0, c1, block)
    finally:
        with _LOCK:
            entry.busy -= 1
            if not entry.busy:
                entry.idle.notify_all()
    return int(block.nbytes)


def _end_here(token: str, flush: bool, wait: float = 60.0) -> str | int:
    """On a worker: end the writes of ``token``; flush and close its file. Returns what
    went wrong (a flush that failed, a write still running after ``wait`` seconds), else
    the bytes this worker wrote past the page cache."""
    with _LOCK:
        _CLOSED[token] = None
        while len(_CLOSED) > _KEEP_CLOSED:
            _CLOSED.pop(next(iter(_CLOSED)))
        entry = _WRITERS.get(token)
        if entry is None:
            return 0
        if not entry.idle.wait_for(lambda: not entry.busy, timeout=wait):
            return f"a write was still running after {wait:g} s"
        del _WRITERS[token]
    try:
        if flush:
            entry.writer.finish()
        else:
            entry.writer.close()
    except OSError as exc:
        entry.writer.close()
        return f"{type(exc).__name__}: {exc}"
    return entry.writer.written_direct


def close(client, sink: FileSink, *, ok: bool, lost: bool = False) -> int:
    """End ``sink``'s writes on every worker (see the module docstring), then remove what the
    writers left beside and inside the staged output: ``StripeWriter``'s zarr lock and, after
    a worker was ``lost``, zarr's temporary chunk files. With ``ok`` (every block written),
    a worker's failed flush raises ``OSError``. Returns the bytes the workers that answered
    wrote past the page cache (``direct``).

    Raises
    ------
    OSError
        ``ok`` and a worker could not flush its writes to disk.
    """
    problems: list[str] = []
    try:
        answers = client.run(_end_here, sink.token, ok, on_error="return")
    except Exception as exc:  # noqa: BLE001 - the scheduler gone: the workers are too
        answers, problems = {}, [f"{type(exc).__name__}: {exc}"]
    # a worker that died meanwhile answers with its comm's error: its process, and so its
    # writes, ended; only a live worker's own report counts
    problems += [f"{w}: {v}" for w, v in sorted(answers.items()) if isinstance(v, str)]
    Path(f"{sink.staged}.lock").unlink(missing_ok=True)
    if sink.kind == "zarr" and lost:
        for folder, _, names in os.walk(sink.staged):
            for name in names:
                if _ZARR_TEMP.search(name):
                    Path(folder, name).unlink(missing_ok=True)
    if ok and problems:
        raise OSError(f"writing {sink.target} on the workers failed ({problems[0]})")
    return sum(v for v in answers.values() if isinstance(v, int))
