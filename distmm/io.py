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

__all__ = ["open_operand", "write_atomic", "SUFFIXES"]

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


def write_atomic(path: str, array) -> None:
    """Write ``array`` to ``path`` (``.npy``, ``.zarr`` or ``file.h5:dataset``),
    replacing any old file only once the new one is complete."""
    kind = _kind(path)
    array = np.asarray(array)
    if kind == "h5":
        import h5py

        file, dataset = _split_h5(path)
        with _staged(file) as tmp:
            with h5py.File(tmp, "w") as fh:
                fh.create_dataset(dataset, data=array)
        return
    with _staged(Path(path)) as tmp:
        if kind == "npy":
            with open(tmp, "wb") as fh:
                np.save(fh, array)
        else:
            import zarr

            z = zarr.open_array(str(tmp), mode="w", shape=array.shape, dtype=array.dtype)
            z[...] = array
