"""Where a command will write, checked before it does any work.

This module covers ``check_writable``: a file (or a folder) a command writes at its end (a
calibration, a tuning cache, a records file, an image) refused at the start, in one line
naming it, where it could not be written: an empty path, a folder where the file goes (or a
file where the folder goes), a path through a file (``distmm.staging.file_in_the_way``: which
file), a folder that is missing (where the command does not make it) or in which no file can
be made, an existing file it may not write as it will (``check_file``: opened, appended to or
replaced); and ``check_creatable`` (``check_folder``: refused in one line), the test of a
folder that every command's check before work makes (``distmm.cli.io``'s for ``distmm matmul``,
``distmm cluster``'s scheduler file, ``distmm report``'s folder). It
does *not* cover ``distmm matmul``'s targets (``distmm.cli.io``: staged outputs, HDF5
datasets, zarr arrays) or writing itself (``distmm.staging``).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from distmm.staging import file_in_the_way

__all__ = ["check_writable", "check_file", "check_creatable", "check_folder", "file_in_the_way",
           "WRITES"]


def check_writable(path, *, folder: bool = False, makes_folders: bool = True,
                   writes: str | None = None) -> None:
    """Refuse ``path`` where it cannot be written: ``ValueError`` (empty), ``IsADirectoryError``
    / ``NotADirectoryError`` (a folder where the file goes, a file where the folder or a
    folder on the way goes), ``FileNotFoundError`` (its folder missing, without
    ``makes_folders``), ``PermissionError`` (an existing file the command could not write as
    it will, ``writes``: ``check_file``; or no file can be made in the folder:
    ``check_creatable``); each names the path."""
    if writes not in WRITES:
        raise ValueError(f"writes={writes!r}: one of {', '.join(map(repr, WRITES))}")
    if not str(path) or (isinstance(path, str) and not path.strip()):
        raise ValueError("an empty output path")
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        if folder:
            raise NotADirectoryError(20, "not a folder", str(path))
        raise IsADirectoryError(21, "a folder, not a file", str(path))
    there = path if folder and path.is_dir() else path.parent
    blocked = file_in_the_way(path)  # a/f/d/x.json where f is a file: never a missing folder
    if blocked is not None:
        raise NotADirectoryError(errno.ENOTDIR, f"{blocked} is not a folder", str(path))
    if not makes_folders and not there.is_dir():
        raise FileNotFoundError(errno.ENOENT, "No such folder for the output", str(path))
    while not there.exists() and there != there.parent:  # the command makes the rest
        there = there.parent
    if path.is_file():
        check_file(path, writes)
    check_folder(there / f".distmm-check-{os.getpid()}", path)


#: how a command writes an existing file (``check_file``): None, opened for writing where it
#: is (and truncated); "append", opened to append to; "replace", a file made beside it renamed
#: onto it
WRITES = (None, "append", "replace")


def check_file(path, writes: str | None = None) -> None:
    """Refuse (``PermissionError`` naming ``path``) the existing file ``path`` where the
    command could not write it as it will (``writes``), in the kernel's own answer:
    ``os.access`` tells what the real user id may do, and gives root an append-only file
    (``chattr +a``). A file to be opened is opened for writing (without truncating it; with
    ``O_APPEND`` for one appended to) and closed unwritten; a file to be replaced is refused
    where it is immutable or append-only (``distmm.staging.fixed_attribute``), as its
    permission bits do not stop a rename (its folder's are ``check_folder``'s). An error of
    the opening that is not a refusal (``REFUSED``) is raised as the write would meet it."""
    if writes == "replace":
        from distmm.staging import fixed_attribute

        fixed = fixed_attribute(path)
        if fixed:
            raise PermissionError(errno.EPERM, f"cannot be replaced (it is {fixed})", str(path))
        return
    from distmm.staging import open_refusal

    exc = open_refusal(path, os.O_WRONLY | (os.O_APPEND if writes == "append" else 0), REFUSED)
    if exc is not None:
        raise PermissionError(exc.errno, f"cannot be written ({exc.strerror})", str(path))


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
    left as it was (nothing is learnt then, and nothing raised). An append-only folder
    (``chattr +a``), where the file could be made but never removed, nor a staged output
    renamed, is refused (``EPERM``) without making it.

    Raises
    ------
    OSError
        The creation's (``REFUSED`` where no file can be made there; ``ENAMETOOLONG``,
        ``EMFILE``...), with ``path`` as its file name.
    """
    from distmm.staging import fixed_attribute

    if fixed_attribute(Path(path).parent) == "append-only":  # made there, never removed
        raise OSError(errno.EPERM, f"{os.strerror(errno.EPERM)} (an append-only folder)",
                      str(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    try:
        os.close(fd)
    finally:
        os.unlink(path)
