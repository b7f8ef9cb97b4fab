"""Operands in files every worker sees: the workers read their own blocks.

This module covers: recognising a host operand that is a whole ``.npy`` file opened with
``numpy.load(path, mmap_mode="r")``, a zarr array in a local folder, or a dataset of an
HDF5 file opened with h5py (``FileSource``, ``source_of``), checking that every worker sees
the same file (same size and modification time, ``visible``; in the same round trip, that
every worker's HDF5 has each filter an HDF5 dataset's data needs, refusing one some worker
lacks before any task), and the task that reads one
block of it on a worker (``read_block``: the ``.npy`` memory-mapped for that read only, so
that the pages read do not stay in the worker's memory as dask counts it, zarr by slices,
the HDF5 file opened read-only once per process and closed when the product ends,
``release``). With these the eager loop (``distmm.engine.dask.eager``) sends a worker the
name of the file and the slices it needs instead of reading the block in the client and
shipping its bytes: the client never holds the operand, and a block whose worker is lost is
read again by another.
It does *not* cover: files some worker does not see (the client reads their blocks and
sends them, as for any in-memory operand), or writing C (``distmm.engine.dask.sink``).

HDF5 files are opened on the workers without HDF5's file locking (``locking=False`` where
h5py and its HDF5 offer it): the client may hold the same file open for writing when the
product's output goes into it (``distmm matmul f.h5:A f.h5:B -o f.h5:C``), and it writes
nothing there until the workers are done and ``release`` has closed their handles.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace

import numpy as np

from distmm.errors import READING

__all__ = ["FileSource", "source_of", "visible", "read_block", "release"]


@dataclass(frozen=True)
class FileSource:
    """Where an operand lives: ``kind`` ``"npy"``, ``"zarr"`` or ``"h5"``, the file
    (``path``; a zarr store folder and the array's ``node`` inside it; an HDF5 file and
    the dataset's ``node``), what the client saw of it (``size``, ``mtime_ns``: the
    ``.npy`` or HDF5 file, or the zarr array's metadata file, and its inode ``ino``: a
    file replaced under the same name is another), and its ``shape`` and ``dtype``."""

    kind: str
    path: str
    node: str
    shape: tuple
    dtype: str
    size: int
    mtime_ns: int
    ino: int = 0

    @property
    def name(self) -> str:
        """The operand as a command line names it: ``file.h5:dataset``, ``store.zarr/array``."""
        if self.kind == "h5":
            return f"{self.path}:{self.node}"
        return os.path.join(self.path, self.node) if self.node else self.path

    @property
    def stamp_path(self) -> str:
        if self.kind in ("npy", "h5"):
            return self.path
        return os.path.join(self.path, self.node, "zarr.json") if self.node else \
            os.path.join(self.path, "zarr.json")


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _mapped_inode(x) -> int | None:
    """The inode of the file whose mapping holds ``x``'s data, from ``/proc/self/maps``
    (Linux); None where that cannot be told."""
    try:
        address = x.ctypes.data
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split(None, 5)
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= address < high:
                    return int(fields[4]) or None
    except (OSError, ValueError, IndexError):
        pass
    return None


def _npy_source(x) -> FileSource | None:
    """A memmap of a whole ``.npy`` file, as ``numpy.load(mmap_mode=...)`` gives it: its
    shape, dtype and order those of the file's header (a slice, a transpose or a view of
    it is not the file). Not a copy-on-write map (``mmap_mode="c"``: what the client
    changed is its own), nor one of a file since replaced under the same name."""
    path = getattr(x, "filename", None)
    if not path or not str(path).endswith(".npy") or getattr(x, "mode", None) == "c":
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
    if stamp is None or _mapped_inode(x) not in (None, stamp[2]):
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
    return None if stamp is None else replace(src, size=stamp[0], mtime_ns=stamp[1],
                                              ino=stamp[2])


def _h5_source(x) -> FileSource | None:
    """A dataset of an HDF5 file on disk (not one held in memory by the ``core`` driver),
    still under its name (not replaced since it was opened)."""
    import sys

    h5py = sys.modules.get("h5py")  # an h5py dataset means h5py is imported already
    if h5py is None or not isinstance(x, h5py.Dataset):
        return None
    try:
        fh = x.file
        if fh.driver not in ("sec2", "stdio"):  # "core" (in memory), "fileobj" (Python file)
            return None
        path, node = os.path.abspath(fh.filename), x.name
        if fh.mode == "r+":  # what this process wrote must be on disk for the workers
            fh.flush()
        held = os.fstat(fh.id.get_vfd_handle()).st_ino  # the file this process has open
    except (ValueError, RuntimeError, OSError):  # a closed file
        return None
    stamp = _stamp(path)
    if stamp is None or not node or held != stamp[2]:  # replaced under its name since
        return None
    return FileSource("h5", path, node, tuple(x.shape), np.dtype(x.dtype).str, *stamp)


def source_of(x) -> FileSource | None:
    """The file behind operand ``x`` (a whole ``.npy`` memmap, a local zarr array, an HDF5
    dataset), or None."""
    if isinstance(x, np.memmap):
        return _npy_source(x)
    if type(x).__module__.split(".")[0] == "h5py":
        return _h5_source(x)
    return _zarr_source(x)


def _stamps(paths):
    return [_stamp(p) for p in paths]


def _seen(paths, datasets):
    """On a worker: the stamps of ``paths`` (``_stamps``) and, for each HDF5 dataset of
    ``datasets`` (``_OPEN``'s keys: path, node, size, mtime_ns, ino), the filter its data
    needs that this process's HDF5 lacks (``hdf5_filters.missing_filter``; None where it
    reads, or where the dataset cannot be opened here: the stamps tell whether this is the
    operand's file)."""
    return {"stamps": _stamps(paths),
            "missing": [_missing_here(tuple(key)) for key in datasets]}


def _missing_here(key: tuple) -> str | None:
    from distmm.hdf5_filters import missing_filter

    with _OPEN_LOCK:  # the dataset this process holds open already, else a handle of its own
        held = _OPEN.get(key)
        try:
            if held is not None:
                return missing_filter(held[0])
            handle = _open_h5(key[0])
            try:
                ds = handle.get(key[1])
                return None if ds is None else missing_filter(ds)
            finally:
                handle.close()
        except Exception:  # noqa: BLE001 - not readable here at all: the stamps decide
            return None


def visible(client, sources, workers, names=None, kind: str = "HDF5 dataset") -> bool:
    """Whether every one of ``workers`` sees each of ``sources`` as the client does (same
    size, modification time and inode): a different machine's file of the same name, or
    one written or replaced since, is not the operand.

    In the same round trip, the workers open each HDF5 dataset among ``sources`` (a
    ``FileSource`` of kind ``"h5"``) and tell whether their HDF5 lacks a filter its data
    needs (another machine's HDF5, an ``HDF5_PLUGIN_PATH`` the client alone has): where
    every worker sees the files, such a worker would fail on its first block, so the
    dataset is refused here, named ``names[i]`` (what the caller calls source ``i``) with
    the dataset (as ``kind`` and its file), the filter and the workers that lack it.

    Raises
    ------
    ValueError
        Every worker sees the files, and some lack a filter an HDF5 dataset needs.
    """
    if names is None:
        names = [None] * len(sources)
    pairs = [(s, n) for s, n in zip(sources, names) if s is not None]
    if not pairs or not workers:
        return False
    sources = [s for s, _ in pairs]
    paths = [s.stamp_path for s in sources]
    h5 = [(s, n) for s, n in pairs if isinstance(s, FileSource) and s.kind == "h5"]
    try:
        if h5:
            seen = client.run(_seen, paths,
                              [(s.path, s.node, s.size, s.mtime_ns, s.ino) for s, _ in h5],
                              workers=list(workers), on_error="return")
        else:
            seen = client.run(_stamps, paths, workers=list(workers), on_error="return")
    except Exception:  # noqa: BLE001 -- a worker that cannot answer: read in the client
        return False
    want = [(s.size, s.mtime_ns, s.ino) for s in sources]
    missing = {}
    if h5:  # each answer as ``_seen`` gives it, or the worker's error
        missing = {w: v["missing"] for w, v in seen.items() if isinstance(v, dict)}
        seen = {w: v["stamps"] if isinstance(v, dict) else v for w, v in seen.items()}
    ok = all(isinstance(v, list) and [tuple(x) if x else None for x in v] == want
             for v in seen.values()) and len(seen) == len(set(workers))
    if ok:
        _refuse_missing(h5, missing, kind)
    return ok


def _refuse_missing(h5, missing: dict, kind: str) -> None:
    """The ValueError for the first HDF5 dataset of ``h5`` (``(source, name)``) needing a
    filter that some workers lack (``missing``: each worker's filters, as ``_seen``), said
    to be a ``kind``."""
    for i, (src, name) in enumerate(h5):
        lacking: dict = {}
        for worker, filters in sorted(missing.items()):
            if filters[i]:
                lacking.setdefault(filters[i], []).append(worker)
        if lacking:
            code, who = next(iter(lacking.items()))
            what = f"{name} ({kind} {src.name})" if name else f"{kind} {src.name}"
            raise ValueError(f"{what} needs HDF5 filter {code}, which is not available on "
                             f"Dask worker{'s' if len(who) > 1 else ''} {', '.join(who)} "
                             f"(not built into their HDF5, no plugin for it in their "
                             f"HDF5_PLUGIN_PATH or HDF5's default plugin folder)")


_OPEN: dict = {}  # (path, node, size, mtime_ns, ino) -> (the array, its HDF5 file or None)
_OPEN_LOCK = threading.Lock()
_KEEP_OPEN = 16  # files kept open per process (the oldest closed first)


def _checked(src: FileSource, arr, handle=None):
    if tuple(arr.shape) != src.shape or np.dtype(arr.dtype).str != src.dtype:
        if handle is not None:
            handle.close()
        raise ValueError(f"{src.path}: the file changed since the product began "
                         f"({arr.shape} {arr.dtype}, expected {src.shape} "
                         f"{np.dtype(src.dtype)})")
    return arr


def _opened(src: FileSource):
    """The array of ``src`` on this worker: a ``.npy`` file mapped for this read only (its
    pages leave the process's RSS when the read's copy is made: a map kept open holds every
    page read, which dask's memory monitor counts as the worker's memory, pausing workers
    whose share of a large operand nears their ``memory_limit``); zarr arrays and HDF5
    files opened once per process."""
    if src.kind == "npy":
        return _checked(src, np.load(src.path, mmap_mode="r", allow_pickle=False))
    key = (src.path, src.node, src.size, src.mtime_ns, src.ino)
    with _OPEN_LOCK:
        entry = _OPEN.get(key)
        if entry is None:
            handle = None
            if src.kind == "h5":
                handle = _open_h5(src.path)
                arr = handle.get(src.node)
                if arr is None:
                    handle.close()
                    raise FileNotFoundError(f"no dataset {src.node!r} in {src.path}")
            else:
                import zarr

                arr = zarr.open_array(src.path, path=src.node, mode="r")
            _checked(src, arr, handle)
            while len(_OPEN) >= _KEEP_OPEN:
                _close(_OPEN.pop(next(iter(_OPEN))))
            entry = _OPEN[key] = (arr, handle)
    return entry[0]


def _open_h5(path: str):
    """``path`` opened read-only by h5py, without HDF5's file locks where they can be
    turned off (h5py >= 3.5 with HDF5 >= 1.10.7)."""
    import h5py

    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # this h5py or HDF5 cannot turn locking off
        return h5py.File(path, "r")


def _close(entry) -> None:
    handle = entry[1]
    if handle is not None:
        try:
            handle.close()
        except Exception:  # noqa: BLE001 - a handle already closed or its file gone
            pass


def _release(paths) -> int:
    """Close this process's HDF5 handles on ``paths``; the number closed."""
    paths = set(paths)
    with _OPEN_LOCK:
        gone = [key for key, entry in _OPEN.items() if key[0] in paths and entry[1] is not None]
        for key in gone:
            _close(_OPEN.pop(key))
    return len(gone)


def release(client, sources) -> None:
    """Close the HDF5 files of ``sources`` on every worker (the product is over: the client
    may now write into such a file, or the user replace it). Zarr arrays stay open: they
    hold no lock and see no stale metadata (``.npy`` maps last one read: ``_opened``)."""
    paths = sorted({s.path for s in sources if s is not None and s.kind == "h5"})
    if not paths:
        return
    try:
        client.run(_release, paths, on_error="return")
    except Exception:  # noqa: BLE001 - a worker that cannot answer holds nothing of ours now
        pass


def read_block(src: FileSource, index: tuple) -> np.ndarray:
    """Task body, on a worker: ``array[index]`` of the file, as an array of its own; the
    error of a read that fails (a chunk that does not decode) carries a note naming the file."""
    arr = _opened(src)
    try:
        return np.array(arr[index], copy=True)
    except Exception as exc:
        exc.add_note(READING + src.name)
        raise
