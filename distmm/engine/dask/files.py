"""Operands in files every worker sees: the workers read their own blocks.

This module covers: recognising a host operand that is a whole ``.npy`` file opened with
``numpy.load(path, mmap_mode="r")`` or a zarr array in a local folder (``FileSource``,
``source_of``), checking that every worker sees the same file (same size and modification
time, ``visible``), and the task that reads one block of it on a worker (``read_block``:
the ``.npy`` memory-mapped once per process, zarr by slices). With these the eager loop
(``distmm.engine.dask.eager``) sends a worker the name of the file and the slices it needs
instead of reading the block in the client and shipping its bytes: the client never holds
the operand, and a block whose worker is lost is read again by another.
It does *not* cover: HDF5 datasets (an open h5py file cannot travel to a worker: they are
read in the client as before), files some worker does not see (the same), or writing.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["FileSource", "source_of", "visible", "read_block"]


@dataclass(frozen=True)
class FileSource:
    """Where an operand lives: ``kind`` ``"npy"`` or ``"zarr"``, the file (``path``; a
    zarr store folder and the array's ``node`` inside it), what the client saw of it
    (``size``, ``mtime_ns``: the ``.npy`` file, or the zarr array's metadata file), and
    its ``shape`` and ``dtype``."""

    kind: str
    path: str
    node: str
    shape: tuple
    dtype: str
    size: int
    mtime_ns: int

    @property
    def stamp_path(self) -> str:
        if self.kind == "npy":
            return self.path
        return os.path.join(self.path, self.node, "zarr.json") if self.node else \
            os.path.join(self.path, "zarr.json")


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _npy_source(x) -> FileSource | None:
    """A memmap of a whole ``.npy`` file, as ``numpy.load(mmap_mode=...)`` gives it: its
    shape, dtype and order those of the file's header (a slice, a transpose or a view of
    it is not the file)."""
    path = getattr(x, "filename", None)
    if not path or not str(path).endswith(".npy"):
        return None
    try:  # the file as numpy maps it (its header), not read
        whole = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    fortran = whole.flags.f_contiguous and not whole.flags.c_contiguous
    contiguous = x.flags.f_contiguous if fortran else x.flags.c_contiguous
    if (whole.shape != x.shape or whole.dtype != x.dtype or not contiguous
            or getattr(x, "offset", None) != whole.offset):
        return None
    stamp = _stamp(path)
    if stamp is None:
        return None
    return FileSource("npy", os.path.abspath(path), "", tuple(x.shape), x.dtype.str, *stamp)


def _zarr_source(x) -> FileSource | None:
    """A zarr array (format 3) stored in a local folder."""
    root = getattr(getattr(x, "store", None), "root", None)
    if root is None or type(x).__module__.split(".")[0] != "zarr":
        return None
    if getattr(getattr(x, "metadata", None), "zarr_format", None) != 3:
        return None
    src = FileSource("zarr", os.path.abspath(str(root)), str(getattr(x, "path", "") or ""),
                     tuple(x.shape), np.dtype(x.dtype).str, 0, 0)
    stamp = _stamp(src.stamp_path)  # where the metadata lies depends on path and node
    return None if stamp is None else replace(src, size=stamp[0], mtime_ns=stamp[1])


def source_of(x) -> FileSource | None:
    """The file behind operand ``x`` (a whole ``.npy`` memmap, a local zarr array), or None."""
    if isinstance(x, np.memmap):
        return _npy_source(x)
    return _zarr_source(x)


def _stamps(paths):
    return [_stamp(p) for p in paths]


def visible(client, sources, workers) -> bool:
    """Whether every one of ``workers`` sees each of ``sources`` as the client does (same
    size and modification time): a different machine's file of the same name, or one
    written since, is not the operand."""
    sources = [s for s in sources if s is not None]
    if not sources or not workers:
        return False
    paths = [s.stamp_path for s in sources]
    try:
        seen = client.run(_stamps, paths, workers=list(workers), on_error="return")
    except Exception:  # noqa: BLE001 -- a worker that cannot answer: read in the client
        return False
    want = [(s.size, s.mtime_ns) for s in sources]
    return all(isinstance(v, list) and [tuple(x) if x else None for x in v] == want
               for v in seen.values()) and len(seen) == len(set(workers))


_OPEN: dict = {}  # (path, node, mtime_ns) -> the opened array, one per worker process
_OPEN_LOCK = threading.Lock()
_KEEP_OPEN = 16  # files kept open per process (the oldest closed first)


def _opened(src: FileSource):
    key = (src.path, src.node, src.mtime_ns)
    with _OPEN_LOCK:
        arr = _OPEN.get(key)
        if arr is None:
            if src.kind == "npy":
                arr = np.load(src.path, mmap_mode="r", allow_pickle=False)
            else:
                import zarr

                arr = zarr.open_array(src.path, path=src.node, mode="r")
            if tuple(arr.shape) != src.shape or np.dtype(arr.dtype).str != src.dtype:
                raise ValueError(f"{src.path}: the file changed since the product began "
                                 f"({arr.shape} {arr.dtype}, expected {src.shape} "
                                 f"{np.dtype(src.dtype)})")
            while len(_OPEN) >= _KEEP_OPEN:
                _OPEN.pop(next(iter(_OPEN)))
            _OPEN[key] = arr
    return arr


def read_block(src: FileSource, index: tuple) -> np.ndarray:
    """Task body, on a worker: ``array[index]`` of the file, as an array of its own."""
    return np.array(_opened(src)[index], copy=True)
