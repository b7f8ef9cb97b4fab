"""Reading operands from and writing results to files: ``.npy``, ``.zarr``, HDF5.

This module covers: opening an operand lazily (memory-mapped ``.npy``, zarr
arrays, HDF5 datasets named ``file.h5:dataset``) and writing a result so that
a failure leaves no partial file: the output is written under a temporary
name in the target folder and renamed into place only after success.
It does *not* cover: computing anything.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

__all__ = ["open_operand", "staged_output", "write_atomic", "SUFFIXES"]

SUFFIXES = (".npy", ".zarr", ".h5", ".hdf5")


def _split_h5(path: str) -> tuple[Path, str]:
    file, _, dataset = str(path).partition(":")
    return Path(file), dataset or "data"


def _kind(path: str) -> str:
    p = Path(str(path).split(":", 1)[0])
    if p.suffix in SUFFIXES:
        return p.suffix.lstrip(".").replace("hdf5", "h5")
    raise ValueError(f"unsupported file type {p.suffix!r} for {path}: use one of {SUFFIXES}")


def open_operand(path: str):
    """Open an operand without reading it all: a memmap, a zarr array or an h5py dataset.

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        Unsupported suffix.
    """
    kind = _kind(path)
    if kind == "npy":
        if not Path(path).exists():
            raise FileNotFoundError(path)
        return np.load(path, mmap_mode="r")
    if kind == "zarr":
        import zarr

        if not Path(path).exists():
            raise FileNotFoundError(path)
        return zarr.open_array(path, mode="r")
    import h5py

    file, dataset = _split_h5(path)
    if not file.exists():
        raise FileNotFoundError(str(file))
    return h5py.File(file, "r")[dataset]


@contextmanager
def _staged(target: Path):
    """Yield a temporary path beside ``target``; move it into place on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    tmp = tmp_dir / target.name
    try:
        yield tmp
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


@contextmanager
def staged_output(path: str, shape: tuple[int, ...], dtype):
    """Yield an empty on-disk array to fill (a ``.npy`` memmap, a zarr array or
    an h5py dataset) that appears at ``path`` only when the block exits without
    an error; an older file there stays until then. On error nothing is left.

    Examples
    --------
    >>> with staged_output("c.npy", (4, 5), "float64") as c:   # doctest: +SKIP
    ...     distmm.matmul(a, b, out=c)
    """
    kind = _kind(path)
    dtype = np.dtype(dtype)
    if kind == "h5":
        import h5py

        file, dataset = _split_h5(path)
        with _staged(file) as tmp, h5py.File(tmp, "w") as fh:
            yield fh.create_dataset(dataset, shape=shape, dtype=dtype)
        return
    with _staged(Path(path)) as tmp:
        if kind == "npy":
            mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
            yield mm
            mm.flush()
            del mm
        else:
            import zarr

            yield zarr.open_array(str(tmp), mode="w", shape=shape, dtype=dtype)


def write_atomic(path: str, array) -> None:
    """Write ``array`` to ``path`` (``.npy``, ``.zarr`` or ``file.h5:dataset``),
    replacing any old file only once the new one is complete."""
    array = np.asarray(array)
    with staged_output(path, array.shape, array.dtype) as out:
        out[...] = array
