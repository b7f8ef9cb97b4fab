"""Reading operands from and writing results to files: ``.npy``, ``.zarr``, HDF5.

This module covers: opening an operand lazily (memory-mapped ``.npy``, zarr
arrays, HDF5 datasets named ``file.h5:dataset``) with errors that name the
file or dataset, and writing a result so that nothing but the target changes:

- the result is staged beside its target (same folder, so the final rename is
  atomic) under a name a user recognises, ``.NAME.distmm-partial-PID``; an
  HDF5 result is staged as a dataset ``NAME.distmm-partial-PID`` inside the
  file, which is opened in append mode, so its other datasets survive;
- an existing target is an error (``OutputExists``) unless ``overwrite``;
- a directory is never removed, and a zarr group is never replaced (a zarr
  array inside a group is written as ``group.zarr/array``);
- free space is checked before anything is computed (``InsufficientSpace``);
- ``.npy`` tiles go to disk with ``os.pwrite``, not through a memory map, so a
  full disk or a file-size limit raises ``OSError`` instead of killing the
  process with SIGBUS;
- on any exception (``KeyboardInterrupt`` and signals raised as exceptions
  included) the staged output is removed and the target is left as it was.

It does *not* cover: computing anything, or signal handling (``distmm.cli``).
"""
from __future__ import annotations

import io as _io
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distmm.errors import InsufficientSpace, OutputExists

__all__ = ["open_operand", "staged_output", "write_atomic", "parse_target", "Target",
           "NpyWriter", "SUFFIXES"]

SUFFIXES = (".npy", ".zarr", ".h5", ".hdf5")
_PARTIAL = "distmm-partial"


# ---------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """Where a path points: ``kind`` is "npy", "zarr" or "h5"; ``path`` the
    file or folder; ``dataset`` the HDF5 dataset (``None`` otherwise)."""

    kind: str
    path: Path
    dataset: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.dataset}" if self.kind == "h5" else str(self.path)


def parse_target(spec: str) -> Target:
    """Read ``a.npy``, ``a.zarr``, ``group.zarr/array`` or ``file.h5:dataset``.

    Raises
    ------
    ValueError
        A suffix distmm does not read or write; the message names the path.
    """
    spec = str(spec)
    head, sep, dataset = spec.partition(":")
    if sep and Path(head).suffix in (".h5", ".hdf5"):
        return Target("h5", Path(head), dataset.strip("/") or "data")
    p = Path(spec)
    if p.suffix in (".h5", ".hdf5"):
        return Target("h5", p, "data")
    if p.suffix == ".npy":
        return Target("npy", p)
    if p.suffix == ".zarr" or any(part.endswith(".zarr") for part in p.parts[:-1]):
        return Target("zarr", p)
    raise ValueError(f"unsupported file type {p.suffix or '(no suffix)'!r} for {spec}: "
                     f"use .npy, .zarr, group.zarr/array or file.h5:dataset")


def _zarr_node(path: Path) -> str | None:
    """"array", "group", or None for a folder that is no zarr node."""
    if (path / ".zarray").exists():
        return "array"
    if (path / ".zgroup").exists():
        return "group"
    meta = path / "zarr.json"
    if meta.exists():
        import json

        try:
            return json.loads(meta.read_text()).get("node_type")
        except (ValueError, OSError):
            return None
    return None


# ---------------------------------------------------------------- reading


def open_operand(spec: str, *, writable: bool = False):
    """Open an operand without reading it all: a memmap, a zarr array or an h5py dataset.

    ``writable`` opens an HDF5 file in ``r+`` mode, for a file that also
    receives the output (HDF5 opens one file twice only with the same mode).

    Raises
    ------
    FileNotFoundError
        The file (or the HDF5 dataset) does not exist; the message says "no such file".
    IsADirectoryError
        A folder where a ``.npy`` or HDF5 file was expected.
    ValueError
        Unsupported suffix, a file that is not of its suffix's format, or a
        zarr group where an array was expected.
    """
    t = parse_target(spec)
    if not t.path.exists():
        raise FileNotFoundError(f"no such file: {t.path}")
    if t.kind == "npy":
        if t.path.is_dir():
            raise IsADirectoryError(f"{t.path} is a directory, not a .npy file")
        try:
            return np.load(t.path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{t.path} is not a readable .npy file ({exc})") from None
    if t.kind == "zarr":
        import zarr

        node = _zarr_node(t.path) if t.path.is_dir() else None
        if node != "array":
            what = "a zarr group" if node == "group" else "not a zarr array"
            raise ValueError(f"{t.path} is {what}: name an array, e.g. {t.path}/NAME")
        return zarr.open_array(str(t.path), mode="r")
    import h5py

    if t.path.is_dir():
        raise IsADirectoryError(f"{t.path} is a directory, not an HDF5 file")
    if not h5py.is_hdf5(t.path):
        raise ValueError(f"{t.path} is not an HDF5 file")
    fh = h5py.File(t.path, "r+" if writable else "r")
    node = fh.get(t.dataset)
    if not isinstance(node, h5py.Dataset):
        names = []
        fh.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        fh.close()
        what = "no dataset" if node is None else "a group, not a dataset, at"
        raise FileNotFoundError(f"{what} {t.dataset!r} in {t.path} "
                                f"(datasets: {', '.join(names) or 'none'})")
    return node


# ---------------------------------------------------------------- the .npy writer


def _slice_bounds(s, size: int, axis: int) -> tuple[int, int]:
    if isinstance(s, (int, np.integer)):
        i = int(s) + (size if s < 0 else 0)
        if not 0 <= i < size:
            raise IndexError(f"index {s} is out of bounds for axis {axis} with size {size}")
        return i, i + 1
    if not isinstance(s, slice):
        raise IndexError(f"only slices and integers index an output file, got {s!r}")
    start, stop, step = s.indices(size)
    if step != 1:
        raise IndexError(f"only step-1 slices index an output file, got {s!r}")
    return start, max(start, stop)


class NpyWriter:
    """A C-ordered ``.npy`` file written with ``os.pwrite``: ``out[rows, cols] = tile``.

    Shaped like the array it will hold (``shape``, ``dtype``, ``ndim``), so
    ``distmm.matmul(a, b, out=writer)`` writes tiles into it; ``writer[...]``
    reads back. Writes raise ``OSError`` on a full disk or a file-size limit.

    Parameters
    ----------
    path : path
        The file to create (it must not exist).
    shape : tuple of int
    dtype : dtype
    """

    def __init__(self, path, shape, dtype):
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise TypeError(f"cannot write dtype {self.dtype} to a .npy file without pickling")
        header = _io.BytesIO()
        np.lib.format.write_array_header_2_0(
            header, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                     "shape": self.shape})
        self._offset = header.tell()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                           0o666)
        self._rfd = None
        self._pwrite(header.getvalue(), 0)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    @property
    def _width(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if self.ndim >= 2 else 1

    def _region(self, key) -> tuple[int, int, int, int, bool]:
        """(row start, row stop, col start, col stop, whole array) of a key,
        on the file's 2-D view (rows by the product of the other axes)."""
        rows = self.shape[0] if self.ndim >= 1 else 1
        if key is Ellipsis or key == () or key == (Ellipsis,):
            return 0, rows, 0, self._width, True
        if self.ndim != 2:
            raise IndexError(f"an output file of shape {self.shape} takes [...] or 2-D slices")
        key = key if isinstance(key, tuple) else (key,)
        key = tuple(k for k in key if k is not Ellipsis)
        key = key + (slice(None),) * (2 - len(key))
        if len(key) != 2:
            raise IndexError(f"too many indices for an output file of shape {self.shape}")
        r0, r1 = _slice_bounds(key[0], rows, 0)
        c0, c1 = _slice_bounds(key[1], self._width, 1)
        return r0, r1, c0, c1, False

    def __setitem__(self, key, value) -> None:
        r0, r1, c0, c1, whole = self._region(key)
        value = np.asarray(value).astype(self.dtype, copy=False)
        if whole:
            value = np.broadcast_to(value, self.shape).reshape(r1 - r0, c1 - c0)
        block = np.ascontiguousarray(np.broadcast_to(value, (r1 - r0, c1 - c0)))
        item, width = self.dtype.itemsize, self._width
        if c0 == 0 and c1 == width:  # whole rows: one contiguous write
            self._pwrite(block, self._offset + r0 * width * item)
            return
        for r in range(r1 - r0):
            self._pwrite(block[r], self._offset + ((r0 + r) * width + c0) * item)

    def __getitem__(self, key):
        r0, r1, c0, c1, whole = self._region(key)
        if self._rfd is None:
            self._rfd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        item, width = self.dtype.itemsize, self._width
        out = np.zeros((r1 - r0, c1 - c0), dtype=self.dtype)  # holes not written read as zeros
        for r in range(r1 - r0):
            data = os.pread(self._rfd, (c1 - c0) * item, self._offset + ((r0 + r) * width + c0) * item)
            row = np.frombuffer(data, dtype=self.dtype)
            out[r, :row.size] = row
        return out.reshape(self.shape) if whole else out

    def finish(self) -> None:
        """Give the file its full length and flush it to disk."""
        os.ftruncate(self._fd, self._offset + self.nbytes)
        os.fsync(self._fd)
        self.close()

    def close(self) -> None:
        for fd in (self._fd, self._rfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._rfd = None

    def __repr__(self) -> str:
        return f"NpyWriter({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"


# ---------------------------------------------------------------- staging


def _staged_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{_PARTIAL}-{os.getpid()}"


def _check_folder(t: Target) -> None:
    parent = t.path.parent
    if not parent.exists():
        raise FileNotFoundError(f"no such folder for the output {t}: {parent}")
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {t}: {parent} is not a folder")


def _check_space(t: Target, nbytes: int) -> None:
    """Refuse an output that cannot fit: the file system's free space, and the
    file-size limit (``ulimit -f``) for a single-file output, which HDF5 and a
    ``.npy`` file are (zarr writes one file per chunk)."""
    free = shutil.disk_usage(t.path.parent).free
    need = nbytes + (1 << 20)  # headers and metadata
    if need > free:
        raise InsufficientSpace(f"{t} needs {need / 2**20:.1f} MiB but its file system has "
                                f"{free / 2**20:.1f} MiB free")
    if t.kind == "zarr":
        return
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size = nbytes + 4096 + (t.path.stat().st_size if t.kind == "h5" and t.path.exists() else 0)
    if limit != resource.RLIM_INFINITY and size > limit:
        raise InsufficientSpace(f"{t} needs a file of {size / 2**20:.1f} MiB but the file-size "
                                f"limit (ulimit -f) is {limit / 2**20:.1f} MiB")


def same_file(a: str, b: str) -> bool:
    """Whether two specs name the same HDF5 file (``x.h5:A`` and ``x.h5:C``)."""
    ta, tb = parse_target(a), parse_target(b)
    if ta.kind != "h5" or tb.kind != "h5":
        return False
    try:
        return ta.path.resolve() == tb.path.resolve()
    except OSError:
        return False


def check_target(t: Target, overwrite: bool) -> bool:
    """Refuse a target that must not be written; return whether it exists.

    Raises
    ------
    OutputExists
        It exists and ``overwrite`` is false.
    IsADirectoryError
        A folder sits where a ``.npy`` or HDF5 file would go, or a zarr group
        or a folder that is no zarr array where an array would go.
    ValueError
        An HDF5 target that is not an HDF5 file.
    """
    _check_folder(t)
    p = t.path
    if t.kind in ("npy", "h5") and p.is_dir():
        raise IsADirectoryError(f"{p} is a directory; distmm writes the {t.kind} output as a file "
                                f"and never removes a directory")
    if t.kind == "zarr" and p.exists():
        node = _zarr_node(p) if p.is_dir() else None
        if node == "group":
            raise IsADirectoryError(f"{p} is a zarr group, which distmm never replaces: "
                                    f"write an array inside it, e.g. {p}/C")
        if node != "array":
            raise IsADirectoryError(f"{p} exists and is not a zarr array; distmm never removes it")
    if t.kind == "h5":
        if not p.exists():
            return False
        import h5py

        if not h5py.is_hdf5(p):
            raise ValueError(f"{p} exists and is not an HDF5 file; distmm adds datasets only to "
                             f"HDF5 files")
        with h5py.File(p, "r") as fh:
            node = fh.get(t.dataset)
        if node is None:
            return False
        if not isinstance(node, h5py.Dataset):
            raise IsADirectoryError(f"{t} is an HDF5 group, which distmm never replaces")
    elif not p.exists():
        return False
    if not overwrite:
        raise OutputExists(f"{t} exists: pass --overwrite to replace it")
    return True


@contextmanager
def staged_output(spec: str, shape: tuple[int, ...], dtype, *, overwrite: bool = False):
    """Yield an empty array to fill (an ``NpyWriter``, a zarr array or an h5py
    dataset) that replaces ``spec`` only when the block exits without an error.

    Raises
    ------
    OutputExists, IsADirectoryError, ValueError
        See ``check_target``; raised before anything is created.
    InsufficientSpace
        The result does not fit the free space of the target's file system.

    Examples
    --------
    >>> with staged_output("c.npy", (4, 5), "float64") as c:   # doctest: +SKIP
    ...     distmm.matmul(a, b, out=c)
    """
    t = parse_target(spec)
    dtype = np.dtype(dtype)
    exists = check_target(t, overwrite)
    try:
        with _staged(t, shape, dtype, exists) as out:
            yield out
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, f"{os.strerror(exc.errno)} while writing {t}; the partial "
                                     f"output was removed") from exc
        raise


@contextmanager
def _staged(t: Target, shape, dtype, exists: bool):
    _check_space(t, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    if t.kind == "h5":
        with _staged_h5(t, shape, dtype) as ds:
            yield ds
        return
    tmp = _staged_name(t.path)
    try:
        if t.kind == "npy":
            writer = NpyWriter(tmp, shape, dtype)
            try:
                yield writer
                writer.finish()
            finally:
                writer.close()
            os.replace(tmp, t.path)
            return
        import zarr

        yield zarr.open_array(str(tmp), mode="w-", shape=shape, dtype=dtype, zarr_format=_zarr_format(t))
        if exists:  # an existing zarr array (checked above): swap, then drop the old one
            old = t.path.parent / f".{t.path.name}.distmm-old-{os.getpid()}"
            os.replace(t.path, old)
            os.replace(tmp, t.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, t.path)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)  # our own staged array, never the target
        elif tmp.exists():
            tmp.unlink()


def _zarr_format(t: Target) -> int | None:
    """A zarr array inside a group takes the group's format."""
    for parent in t.path.parents:
        if parent.suffix == ".zarr":
            if (parent / ".zgroup").exists():
                return 2
            if (parent / "zarr.json").exists():
                return 3
            break
    return None


HDF5_UNCLOSED = []
"""HDF5 files whose close failed (a full disk, a file-size limit): HDF5 tries
to flush them again when the interpreter exits and crashes doing so, so a
process that sees entries here should end with ``os._exit`` after reporting."""


@contextmanager
def _staged_h5(t: Target, shape, dtype):
    import h5py

    created = not t.path.exists()
    staged = f"{t.dataset}.{_PARTIAL}-{os.getpid()}"
    try:
        fh = h5py.File(t.path, "a")
    except OSError as exc:
        raise PermissionError(f"cannot open {t.path} to add {t.dataset!r}: {exc}") from None
    try:
        if staged in fh:
            del fh[staged]
        yield fh.create_dataset(staged, shape=shape, dtype=dtype)
        if t.dataset in fh:
            del fh[t.dataset]
        fh.move(staged, t.dataset)
        fh.close()
    except BaseException:
        try:
            if not created and staged in fh:
                del fh[staged]
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        try:
            fh.close()
        except Exception:  # noqa: BLE001 - as above
            HDF5_UNCLOSED.append(t.path)
        if created:
            t.path.unlink(missing_ok=True)  # the file is ours alone: leave nothing
        raise


def write_atomic(spec: str, array, *, overwrite: bool = False) -> None:
    """Write ``array`` to ``spec`` (``.npy``, ``.zarr`` or ``file.h5:dataset``),
    replacing an existing target (with ``overwrite``) only once the new one is
    complete."""
    array = np.asarray(array)
    with staged_output(spec, array.shape, array.dtype, overwrite=overwrite) as out:
        out[...] = array
