"""Where a command will write, checked before it does any work.

This module covers ``check_writable``: a file (or a folder) a command writes at its end (a
calibration, a tuning cache, a records file, an image) refused at the start, in one line
naming it, where it could not be written: an empty path, a folder where the file goes (or a
file where the folder goes), a path through a file, a folder that is missing (where the
command does not make it) or in which no file can be made, an existing file it may not
write; and ``check_creatable`` (``check_folder``: refused in one line), the test of a folder
that every command's check before work makes (``distmm.cli.io``'s for ``distmm matmul``,
``distmm cluster``'s scheduler file, ``distmm report``'s folder). It
does *not* cover ``distmm matmul``'s targets (``distmm.cli.io``: staged outputs, HDF5
datasets, zarr arrays) or writing itself (``distmm.staging``).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["check_writable", "check_creatable", "check_folder"]


def check_writable(path, *, folder: bool = False, makes_folders: bool = True) -> None:
    """Refuse ``path`` where it cannot be written: ``ValueError`` (empty), ``IsADirectoryError``
    / ``NotADirectoryError`` (a folder where the file goes, a file where the folder or a
    folder on the way goes), ``FileNotFoundError`` (its folder missing, without
    ``makes_folders``), ``PermissionError`` (no write permission, or no file can be made in
    the folder: ``check_creatable``); each names the path."""
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
    check_folder(there / f".distmm-check-{os.getpid()}", path)


def check_folder(probe, path) -> None:
    """``check_creatable(probe)``, where the command will write ``path``: a folder in which
    no file can be made (``REFUSED``) is a ``PermissionError`` naming the folder and
    ``path``; another error (too many open files, a name too long) is raised as the write
    would meet it."""
    try:
        check_creatable(probe)
    except OSError as exc:
        if exc.errno not in REFUSED:
            raise
        raise PermissionError(exc.errno, f"cannot write in {Path(probe).parent} "
                                         f"({exc.strerror})", str(path)) from None


#: the errors of ``check_creatable`` that say no file can be made in the folder: no write
#: permission, an immutable folder (``chattr +i``), a read-only file system, a folder of a
#: file system where no process makes files (``/proc``, ``/sys``)
REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)


def check_creatable(path) -> None:
    """Create the file ``path`` and remove it at once: whether a file can be made in its
    folder, tested as the command's own write will be. ``os.access`` does not tell: it lets
    root write in ``/proc`` and ``/sys``, where no file can be made. ``path`` is created
    exclusively (``O_EXCL``), so a link there is never followed; whatever is there already is
    left as it was (nothing is learnt then, and nothing raised).

    Raises
    ------
    OSError
        The creation's (``REFUSED`` where no file can be made there; ``ENAMETOOLONG``,
        ``EMFILE``...), with ``path`` as its file name.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    try:
        os.close(fd)
    finally:
        os.unlink(path)
