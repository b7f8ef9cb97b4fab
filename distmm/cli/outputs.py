"""Where a command will write, checked before it does any work.

This module covers ``check_writable``: a file (or a folder) a command writes at its end (a
calibration, a tuning cache, a records file, an image) refused at the start, in one line
naming it, where it could not be written: an empty path, a folder where the file goes (or a
file where the folder goes), a path through a file, a folder that is missing (where the
command does not make it) or that this process may not write in, an existing file it may not
write. It does *not* cover ``distmm matmul``'s targets (``distmm.cli.io``: staged outputs,
HDF5 datasets, zarr arrays) or writing itself (``distmm.staging``).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_writable"]


def check_writable(path, *, folder: bool = False, makes_folders: bool = True) -> None:
    """Refuse ``path`` where it cannot be written: ``ValueError`` (empty), ``IsADirectoryError``
    / ``NotADirectoryError`` (a folder where the file goes, a file where the folder or a
    folder on the way goes), ``FileNotFoundError`` (its folder missing, without
    ``makes_folders``), ``PermissionError`` (no write permission); each names the path."""
    if not str(path) or (isinstance(path, str) and not path.strip()):
        raise ValueError("an empty output path")
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        if folder:
            raise NotADirectoryError(20, "not a folder", str(path))
        raise IsADirectoryError(21, "a folder, not a file", str(path))
    there = path if folder and path.is_dir() else path.parent
    if not makes_folders and not there.is_dir():
        raise FileNotFoundError(2, "No such folder for the output", str(path))
    while not there.exists() and there != there.parent:  # the command makes the rest
        there = there.parent
    if not there.is_dir():
        raise NotADirectoryError(20, f"{there} is not a folder", str(path))
    if path.is_file() and not os.access(path, os.W_OK):
        raise PermissionError(13, "cannot be written", str(path))
    if not os.access(there, os.W_OK | os.X_OK):
        raise PermissionError(13, f"cannot write in {there}", str(path))
