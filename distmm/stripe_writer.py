"""Writing regions of one staged output from several processes at once.

This module covers: naming an output (``parse_spec``: ``a.npy``, ``a.zarr``,
``group.zarr/array``, ``file.h5:dataset``; ``zarr_format_for``: a new zarr array takes its
group's format) and ``StripeWriter``, which one process (an MPI
rank of the batch path, a Dask worker of the Dask engine) uses to put blocks of C into the
staged output that another process created (``distmm.staging``): ``.npy`` and HDF5 with
``os.pwrite`` at the data's offset (spans of whole rows past the page cache,
``distmm.direct_io``; the rest with the kernel's writeback started at once,
``sync_file_range``), zarr through zarr under an advisory lock unless the writes cover whole
chunks.
It does *not* cover: creating, committing or removing the staged output
(``distmm.staging``, ``distmm.engine.mpi.io``), or deciding who writes which block (the
engines).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distmm.direct_io import libc_function
from distmm.staging import BlockWriter, is_within, staged_path, zarr_node

__all__ = ["FileSpec", "parse_spec", "output_spec", "check_dtype", "zarr_format_for",
           "StripeWriter"]


@dataclass(frozen=True)
class FileSpec:
    kind: str  # "npy", "zarr" or "h5"
    path: Path
    dataset: str | None = None


def parse_spec(spec: str) -> FileSpec:
    """``a.npy``, ``a.zarr``, ``group.zarr/array`` or ``file.h5:dataset``.

    Raises
    ------
    ValueError
        Any other suffix.
    """
    spec = str(spec)
    h5 = _h5_split(spec)
    if h5 is not None:
        head, dataset = h5
        return FileSpec("h5", Path(head), dataset.strip("/") or "data")
    p = Path(spec)
    if p.suffix == ".npy":
        return FileSpec("npy", p)
    if p.suffix == ".zarr" or any(part.endswith(".zarr") for part in p.parts[:-1]):
        return FileSpec("zarr", p)
    raise ValueError(f"unsupported file type {p.suffix or '(no suffix)'!r} for {spec}: "
                     f"use .npy, .zarr, group.zarr/array or file.h5:dataset")


def _h5_split(spec: str) -> tuple[str, str] | None:
    """``(file, dataset)`` of an HDF5 spec, cut at a colon that follows ``.h5`` or ``.hdf5``
    (a folder or a file name may hold colons: ``run:1/a:b.h5:C``): the first such file that
    exists, else the first whose folder exists, else the first; None for no HDF5 file."""
    cuts = [i for i, ch in enumerate(spec) if ch == ":"] + [len(spec)]
    heads = [(spec[:i], spec[i + 1:]) for i in cuts if Path(spec[:i]).suffix in (".h5", ".hdf5")]
    for found in (lambda h: Path(h).is_file(), lambda h: Path(h).parent.is_dir(), bool):
        for head, dataset in heads:
            if found(head):
                return head, dataset
    return None


def output_spec(spec) -> FileSpec:
    """``parse_spec`` for an output, refusing the names an output must not have.

    Raises
    ------
    ValueError
        A suffix distmm does not write, a name ending with a path separator (a folder; a
        zarr array's may), or
        a dataset path with a ``.`` or ``..`` part (HDF5 would make a link of that name);
        the message names the path.
    """
    spec = str(spec)
    if spec.endswith(("/", os.sep)) and not _zarr_folder(spec):
        raise ValueError(f"{spec} ends with a path separator: name a file (a.npy, c.zarr, "
                         f"file.h5:C), not a folder")
    f = parse_spec(spec)
    if f.kind == "h5" and any(part in (".", "..") for part in f.dataset.split("/")):
        raise ValueError(f"dataset path {f.dataset!r} in {spec}: '.' and '..' are not dataset "
                         f"names; give the path from the file's root, e.g. file.h5:group/C")
    return f


def _zarr_folder(spec: str) -> bool:
    """Whether ``spec`` less its trailing separators names a zarr array (``c.zarr/``, as a
    shell's completion writes the folder): a folder, which may end with one."""
    bare = spec.rstrip("/" + os.sep)
    try:
        return bool(bare) and _h5_split(bare) is None and parse_spec(bare).kind == "zarr"
    except ValueError:
        return False


def check_dtype(f: FileSpec, dtype) -> None:
    """Refuse, before any work, a result dtype the format of ``f`` cannot store.

    Raises
    ------
    TypeError
        Object arrays (a ``.npy`` file would need pickling; zarr and HDF5 have no such
        type), or a dtype zarr (in the format the target gets) or h5py has no type for
        (zarr: long double, complex long double); the message names the target.
    """
    dtype = np.dtype(dtype)
    label = f"{f.path}:{f.dataset}" if f.kind == "h5" else str(f.path)
    if dtype.hasobject:
        raise TypeError(f"cannot write {label}: the result is an object array, which distmm "
                        f"does not write to .npy (it would need pickling), zarr or HDF5")
    try:
        with warnings.catch_warnings():  # zarr's warning on an unstable type comes on writing
            warnings.simplefilter("ignore")
            _make_type(f, dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot write {label}: {f.kind} has no type for the result's dtype "
                        f"{dtype} ({exc})") from None


def _make_type(f: FileSpec, dtype: np.dtype) -> None:
    """The format's type for ``dtype``: an empty zarr array in memory, an HDF5 type."""
    if f.kind == "zarr":
        import zarr
        from zarr.storage import MemoryStore

        zarr.create_array(MemoryStore(), shape=(0,), dtype=dtype,
                          zarr_format=zarr_format_for(f.path) or 3)
    elif f.kind == "h5":
        import h5py

        h5py.h5t.py_create(dtype, logical=True)


def zarr_format_for(path) -> int | None:
    """The zarr format of a new array at ``path``: an array it replaces keeps its format
    (2 or 3), so that what read the old one reads the new; else its group's, the nearest
    existing folder above it that is a zarr group, so that the group lists it; None (zarr's
    default) when that folder is no group."""
    path = Path(path)
    if zarr_node(path) == "array":
        return 2 if (path / ".zarray").exists() else 3
    for parent in path.parents:
        if (parent / ".zgroup").exists():
            return 2
        if (parent / "zarr.json").exists():
            return 3
        if parent.exists():
            return None
    return None


class StripeWriter:
    """One rank's writer of C regions into the staged output of ``spec`` (``pid``'s).

    ``write(r0, r1, c0, c1, block)`` puts a block in place: ``.npy`` and HDF5 with
    ``os.pwrite`` at the data's offset, then asks the kernel to start writing those pages
    to disk (``sync_file_range``, Linux; elsewhere the final ``finish`` flushes all), so the
    disk works while the ranks compute; zarr through zarr, under an advisory lock beside the
    array unless ``aligned`` (every write covers whole chunks, so writers never share one).
    ``finish()`` flushes to disk and closes. ``direct``: whether large spans go past the page
    cache (``BlockWriter``'s; None: ``distmm.direct-writes`` of the configuration in force).
    """

    def __init__(self, spec: str, pid: int, shape, dtype, header, *, aligned: bool = False,
                 direct: bool | None = None):
        self.spec = parse_spec(spec)
        self.path = staged_path(self.spec.path, pid)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.aligned = aligned
        self._zarr = None
        self._blocks = None
        self._direct_done = 0  # bytes written past the page cache by a closed BlockWriter
        if self.spec.kind == "zarr":
            import zarr

            self._zarr = zarr.open_array(str(self.path), mode="r+")
        else:
            self._blocks = BlockWriter(self.path, self.shape, self.dtype, header, direct=direct)
            self._header = int(header)

    def write(self, r0: int, r1: int, c0: int, c1: int, block) -> None:
        """Put ``block`` at ``[r0:r1, c0:c1]``. An ``OSError`` of the staged output's own
        files (a chunk, the zarr lock: hidden names, removed with it) names the target."""
        try:
            self._write(r0, r1, c0, c1, block)
        except OSError as exc:
            if exc.errno is None or not is_within(exc.filename, self.path,
                                                  f"{self.path}.lock"):
                raise
            label = f"{self.spec.path}:{self.spec.dataset}" if self.spec.kind == "h5" \
                else str(self.spec.path)
            raise OSError(exc.errno, f"{os.strerror(exc.errno)} while writing {label}") from exc

    def _write(self, r0: int, r1: int, c0: int, c1: int, block) -> None:
        if r1 <= r0 or c1 <= c0:
            return
        if self._zarr is not None:
            if self.aligned:
                self._zarr[r0:r1, c0:c1] = block
                return
            import fcntl

            with open(f"{self.path}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    self._zarr[r0:r1, c0:c1] = block
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            return
        self._blocks[r0:r1, c0:c1] = block
        width = self.shape[1] * self.dtype.itemsize
        start = self._header + r0 * width + c0 * self.dtype.itemsize
        _start_writeback(self._blocks._fd, start, (r1 - r0 - 1) * width + (c1 - c0) * self.dtype.itemsize)

    @property
    def written_direct(self) -> int:
        """Bytes of C written past the page cache (``distmm.direct_io``)."""
        return self._direct_done + (self._blocks.written_direct if self._blocks else 0)

    def finish(self) -> None:
        if self._blocks is not None:
            self._direct_done += self._blocks.written_direct
            self._blocks.finish()
            self._blocks = None

    def close(self) -> None:
        if self._blocks is not None:
            self._direct_done += self._blocks.written_direct
            self._blocks.close()
            self._blocks = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range to disk without waiting (Linux ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``); nothing where the call is missing."""
    import ctypes

    fn = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_uint], ctypes.c_int)
    if fn is not None and nbytes > 0:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure leaves it to fsync
