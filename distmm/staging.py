"""Staged outputs written with ordinary writes, and HDF5 results that leave the user's file alone.

This module covers the parts of staging an output that the command line
(``distmm.cli.io``) and the MPI engine (``distmm.engine.mpi.io``) share:

- the staged name beside a target, ``.NAME.distmm-partial-PID`` (same folder,
  so the final rename is atomic), and the staged outputs a killed run left there
  (``leftovers``, for an HDF5 target those of its dataset only; ``is_live`` tells a running
  one on this host, ``claim`` takes one over for a ``--resume`` run or a removal;
  ``preparing``: ``--resume`` runs to one folder look and make theirs one at a time;
  ``reclaimable``: their space; ``remove_leftover``, with its manifest and logs), and the
  manifests and logs of a dead run whose staged output was deleted (``leftovers`` removes them);
- ``put_in_place``: the finished ``.npy`` file or zarr folder renamed onto its
  target, keeping a replaced target's permission bits, and on disk before it returns (the
  file, or the folder and its metadata files, then the folder that names the target:
  ``fsync_paths``), so that a crash after the run said it was done keeps the output; the
  consolidated metadata of the zarr groups above a zarr array made again (``_reconsolidate``);
- ``BlockWriter``: a C-ordered array at a byte offset of a file, written tile
  by tile with ``os.pwrite``, so a full disk or a file-size limit raises a
  clean ``OSError`` (no memory map to die of SIGBUS, no HDF5 call to crash);
- free space and the file-size limit (``check_room``), checked before a file
  is touched;
- HDF5: ``create_h5_stage`` makes the hidden staged file
  ``.file.h5.distmm-partial-PID`` holding only the new dataset, contiguous and
  allocated at creation, and returns the byte offset of its data, so tiles are
  written with ``pwrite`` and HDF5 writes nothing while they are; then
  ``commit_h5`` moves it into place: a rename when the target file does not
  exist, else (after ``check_room`` for the copy) the dataset is copied into
  the user's file (opened for writing, never created or truncated) under a
  temporary name, in blocks that SIGINT and SIGTERM stop between, and only then
  is an old dataset of that name (or whatever link has it: never followed) deleted and the
  copy renamed onto it (signals held off for those two metadata steps). The
  file's other datasets are never touched; on a failure the temporary dataset
  is removed, and the staged file is removed in every case. The file, and after a
  rename the folder that names it, are flushed to disk before it returns.

HDF5 has no transactions: a copy that runs out of space half way can damage
the file it writes into. That is why the room for the copy is checked first;
what remains is a race with another process filling the disk during the copy.

- ``check_target``: the refusals of a target before anything is written (a missing folder,
  a path through a file: ``file_in_the_way``; an existing one without ``overwrite``, a
  symbolic link too, which ``overwrite`` replaces and never follows, and an HDF5 file's link
  at the dataset's name, to nothing or into another file too: ``_h5_name``; whatever ``overwrite``,
  an HDF5 file's link to what exists, a folder where a file would go, a zarr group, a folder
  that is no zarr array, an HDF5 group, an HDF5 dataset path through a dataset or into
  another file, an existing HDF5 file that cannot be opened for writing; with ``overwrite``,
  a ``.npy`` file or zarr folder that is immutable or append-only: ``fixed_attribute``, or a
  zarr folder holding what cannot be removed: ``unremovable``),
  for the command line and ``DistArray.to_file`` alike; ``h5_held``: the one line for an
  HDF5 file, operand or target, that HDF5 would not open because another process writes it.

It does *not* cover: parsing targets, ``.npy`` headers, or writing zarr:
``distmm.cli.io``.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from distmm.direct_io import ALIGN, MIN_DIRECT, SpanWriter, as_bytes, libc_function, preallocate
from distmm.errors import STOP_SIGNALS, InsufficientSpace, OutputExists

__all__ = ["PARTIAL", "staged_path", "staged_pid", "pwrite_all", "BlockWriter", "check_room",
           "create_h5_stage", "commit_h5", "put_in_place", "HDF5_UNCLOSED", "H5_MARGIN",
           "leftovers", "is_live", "MANIFEST_SUFFIX", "claim", "release", "remove_if_left",
           "preparing",
           "reclaimable", "remove_leftover", "remove_tree", "is_within",
           "check_target", "h5_held", "zarr_node", "zarr_metadata", "fsync_paths",
           "fixed_attribute", "unremovable", "open_refusal", "file_in_the_way",
           "is_process_limit", "ZARR_METADATA"]

PARTIAL = "distmm-partial"

H5_MARGIN = 1 << 20
"""Bytes allowed for HDF5 metadata (object headers, group nodes) besides the data."""

HDF5_UNCLOSED: list = []
"""HDF5 files whose close failed (a full disk, a file-size limit): HDF5 tries
to flush them again when the interpreter exits and crashes doing so, so a
process that sees entries here should end with ``os._exit`` after reporting."""


def staged_path(path, pid: int | None = None) -> Path:
    """``.NAME.distmm-partial-PID`` beside ``path`` (PID: this process by default)."""
    path = Path(path)
    return path.parent / f".{path.name}.{PARTIAL}-{os.getpid() if pid is None else pid}"


def staged_pid(staged) -> int:
    """The PID in a staged output's name (``staged_path``'s ``.NAME.distmm-partial-PID``)."""
    return int(Path(staged).name.rsplit("-", 1)[1])


#: the files of a zarr folder that describe its array (v3, v2 and their attributes and
#: consolidated metadata); its chunks are the other files
ZARR_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


def fsync_paths(paths) -> None:
    """Flush each file or folder of ``paths`` that exists to disk (``fsync``): a file's data,
    a folder's entries (the names renamed or made in it)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:  # (a zarr chunk of fill values only: never stored)
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _synced_before(staged: Path) -> None:
    """A staged output's own bytes on disk before its rename: the file, or a zarr folder's
    metadata files and the folder's entries (one ``fsync`` each; the chunk files are the
    writers', flushed per stripe by a ``--resume`` run's log)."""
    if staged.is_dir():
        fsync_paths([*(staged / name for name in ZARR_METADATA), staged])
    else:
        fsync_paths([staged])


def put_in_place(staged, target, pid: int | None = None, *, overwrite: bool = True) -> None:
    """Rename a finished staged output (a file, or a zarr folder) onto ``target``.

    A target that exists is replaced, and its permission bits pass to the new
    output, as writing into it would have kept them (a new target keeps the
    umask's). A symbolic link is replaced itself, never followed (it keeps the bits of what
    it names where that is a file for a file or a folder for a folder). A folder cannot be
    renamed onto another, or onto a link: the old one is moved
    aside (``.NAME.distmm-old-PID``) and removed after the new one is in place (a
    ``RuntimeWarning`` names it where it cannot be: ``remove_tree``);
    if the new one cannot take its place, the old one is moved back. An old folder that
    could not be removed (``unremovable``) is refused before it is moved: ``PermissionError``,
    the target untouched.
    Without ``overwrite`` a target that appeared while the run computed (another
    run's) is kept and ``OutputExists`` raised (``_rename_new``). The staged output is
    flushed to disk before the rename and the folder that names ``target`` after it
    (``_synced_before``, ``fsync_paths``). A zarr array put in place in zarr groups with
    consolidated metadata has that metadata made again once it is there
    (``_reconsolidate``), so that what reads the group through it sees the new array.
    """
    staged, target = Path(staged), Path(target)
    folder = staged.is_dir()
    _put(staged, target, pid, overwrite)
    if folder:
        _reconsolidate(target)


def _put(staged: Path, target: Path, pid: int | None, overwrite: bool) -> None:
    """``put_in_place`` less the zarr groups' consolidated metadata."""
    if not overwrite:
        _synced_before(staged)
        _rename_new(staged, target)
        fsync_paths([target.parent])
        return
    link = target.is_symlink()  # replaced itself; what it names is left as it is
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    if st is not None and link and stat.S_ISDIR(st.st_mode) != staged.is_dir():
        st = None  # a link to a folder replaced by a file, or the reverse: the umask's bits
    mode = None if st is None else stat.S_IMODE(st.st_mode)
    if mode is not None:
        os.chmod(staged, mode)
    _synced_before(staged)
    if staged.is_dir() and (mode is not None or link):  # (a folder is not renamed onto a link)
        kept = unremovable(target)  # (checked before the run too: check_target)
        if kept:
            raise PermissionError(f"cannot replace {target}: {kept}")
        old = target.parent / f".{target.name}.distmm-old-{os.getpid() if pid is None else pid}"
        os.replace(target, old)
        try:
            os.replace(staged, target)
        except BaseException:
            os.replace(old, target)  # the old target back under its name
            raise
        fsync_paths([target.parent])
        if old.is_symlink():  # a link to a folder is replaced, as a .npy file's link is
            old.unlink()
        elif not remove_tree(old):
            warnings.warn(f"{target} was replaced, but its old copy, moved aside to {old}, "
                          f"could not be removed: remove it", RuntimeWarning, stacklevel=2)
    else:
        os.replace(staged, target)
        fsync_paths([target.parent])


def _group_format(folder: Path) -> tuple[int, bool] | None:
    """``(zarr format, whether it holds consolidated metadata)`` of the folder ``folder`` where
    it is a zarr group (``zarr_metadata``); else None, also where its metadata cannot be read
    (a process limit included: the array is in place by then)."""
    try:
        meta = zarr_metadata(folder)
    except OSError:
        return None
    if meta is None or meta[0] != "group":
        return None
    return meta[1], meta[2]


def _reconsolidate(target: Path) -> None:
    """Make again, with zarr's own ``zarr.consolidate_metadata``, the consolidated metadata of
    each zarr group above the zarr array ``target`` (up to the first folder that is no zarr
    group) that has any, innermost first, so that it lists the array as it is now (a new
    name, or an old one's new shape and dtype). A group without consolidated metadata is
    left without. The array is in place already: a group whose metadata cannot be written is
    a ``RuntimeWarning`` naming it, and how to do it by hand."""
    groups = []
    for above in target.parents:
        group = _group_format(above)
        if group is None:
            break
        if group[1]:
            groups.append((above, group[0]))
    if not groups:
        return
    import zarr

    for group, fmt in groups:
        try:
            with warnings.catch_warnings():  # zarr's that format 3 has no such metadata yet
                warnings.simplefilter("ignore")
                zarr.consolidate_metadata(str(group), zarr_format=fmt)
        except Exception as exc:  # noqa: BLE001 - C is in place: said, not raised
            why = " ".join(str(exc).split()) or type(exc).__name__
            warnings.warn(f"{target} was written, but the consolidated metadata of the zarr "
                          f"group {group} could not be updated ({why}), so it does not list "
                          f"{target} as it is: run zarr.consolidate_metadata({str(group)!r})",
                          RuntimeWarning, stacklevel=3)


def _rename_new(staged: Path, target: Path) -> None:
    """Rename ``staged`` onto a ``target`` that must not exist: in one step where the system
    has ``renameat2``'s ``RENAME_NOREPLACE`` (Linux; two runs committing at once cannot both
    win), else after a check. ``OutputExists`` where it exists."""
    import ctypes
    import errno

    fn = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_char_p, ctypes.c_uint], ctypes.c_int)
    err = errno.ENOSYS
    if fn is not None:
        at_cwd, noreplace = -100, 1
        if fn(at_cwd, os.fsencode(staged), at_cwd, os.fsencode(target), noreplace) == 0:
            return
        err = ctypes.get_errno()
    if err not in (errno.EEXIST, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), str(target))
    if err == errno.EEXIST or os.path.lexists(target):
        raise OutputExists(f"{target} exists (written while this run computed): pass "
                           f"--overwrite to replace it")
    os.rename(staged, target)


# ---------------------------------------------------------------- the target


def zarr_metadata(folder) -> tuple[object, int, bool] | None:
    """``(node type, zarr format, whether it holds consolidated metadata)`` of the folder
    ``folder`` as its zarr metadata says; None where it holds none that can be read.

    Format 2: ``.zarray`` (an array) or ``.zgroup`` (a group, consolidated in ``.zmetadata``),
    known by their names without reading them. Format 3: ``zarr.json``'s ``node_type``
    (whatever it holds: "array", "group", or another value) and ``consolidated_metadata``;
    a ``zarr.json`` that is not a regular file (a named pipe, whose reader would wait for a
    writer), not JSON, or not a JSON object is none.

    Raises
    ------
    OSError
        This process's limits refused the read (``EMFILE``, ``ENFILE``, ``ENOMEM``): no fault
        of the folder, which may hold a node.
    """
    folder = Path(folder)
    if (folder / ".zarray").exists():
        return "array", 2, False
    if (folder / ".zgroup").exists():
        return "group", 2, (folder / ".zmetadata").is_file()
    meta = folder / "zarr.json"
    if not meta.is_file():
        return None
    import json

    try:
        doc = json.loads(meta.read_text())
    except OSError as exc:
        if exc.errno in _PROCESS_LIMITS:  # this process's limit, not the file's fault
            raise
        return None
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    return doc.get("node_type"), 3, doc.get("consolidated_metadata") is not None


def zarr_node(path: Path) -> str | None:
    """"array", "group", or None for a folder that is no zarr node (``zarr_metadata``).

    Raises
    ------
    OSError
        See ``zarr_metadata``.
    """
    meta = zarr_metadata(path)
    return None if meta is None else meta[0]


def file_in_the_way(path) -> Path | None:
    """The nearest of ``path``'s folders that exists but is not a folder (``path`` goes
    through a file: ``/etc/hostname/x.json`` gives ``/etc/hostname``), named as ``path``
    names it; or None: its folder exists, or is missing (no file in the way)."""
    there = Path(path).parent
    while not there.exists() and there != there.parent:
        there = there.parent
    return there if there.exists() and not there.is_dir() else None


def check_target(t, overwrite: bool) -> bool:
    """Refuse a target that must not be written; return whether it exists.

    ``t`` has ``kind`` ("npy", "zarr" or "h5"), ``path`` and ``dataset`` (HDF5), as
    ``distmm.stripe_writer.FileSpec`` and ``distmm.cli.io.Target`` do. The command line and
    ``DistArray.to_file`` both refuse targets with it, before anything is written.

    Raises
    ------
    FileNotFoundError
        The target's folder does not exist (``ENOENT``).
    NotADirectoryError
        The target's folder, or one above it, is a file (``ENOTDIR``; ``file_in_the_way``
        names which).
    OutputExists
        It exists and ``overwrite`` is false; a target that is a symbolic link, of every
        kind, is an existing name, whatever it names (nothing, a file, a folder); with
        ``overwrite`` the link itself is replaced and what it names left as it is
        (``_check_link``). An HDF5 dataset's name is likewise whatever link the file has
        under it (a soft link to nothing, an external link, whatever it names), replaced with
        ``overwrite`` and never followed into another file (``_h5_name``).
    IsADirectoryError
        A folder sits where a ``.npy`` or HDF5 file would go, or a zarr group
        or a folder that is no zarr array where an array would go, or an HDF5 group (or a soft
        link to one of that file) where a dataset would go (whatever ``overwrite``).
    ValueError
        An HDF5 target that is not an HDF5 file, or that another process writes (``h5_held``:
        an SWMR writer, one that stopped and left it marked open, a writer's file lock); or
        whose dataset path goes through something other than a group of that very file
        (``_check_h5_path``); a target inside a zarr array (``_check_zarr_path``); an HDF5
        target whose file is a symbolic link to something that exists (whatever
        ``overwrite``: ``_check_link``).
    PermissionError
        An existing HDF5 file that cannot be opened for writing, as the copy of the dataset
        into it will open it (``_check_opens``); an existing ``.npy`` file or zarr folder that
        is immutable or append-only (``fixed_attribute``), with ``overwrite``.
    """
    p = Path(t.path)
    label = f"{p}:{t.dataset}" if t.kind == "h5" else str(p)
    parent = p.parent
    if not parent.is_dir():
        blocked = file_in_the_way(p)  # f/d/c.npy where f is a file: not a missing folder
        if blocked is not None:
            raise NotADirectoryError(errno.ENOTDIR, f"cannot write {label}: {blocked} is not "
                                                    f"a folder")
        raise FileNotFoundError(errno.ENOENT, f"no such folder for the output {label}: {parent}")
    _check_zarr_path(p, label, t.kind)
    if p.is_symlink():  # the link itself is the target: never followed to write
        _check_link(p, t, overwrite)
        return True
    if t.kind in ("npy", "h5") and p.is_dir():
        raise IsADirectoryError(f"{p} is a directory; distmm writes the {t.kind} output as a file "
                                f"and never removes a directory")
    if t.kind == "zarr" and p.exists():
        node = zarr_node(p) if p.is_dir() else None
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
        _check_opens(p, t.dataset)
        try:
            fh = h5py.File(p, "r")
        except OSError as exc:
            held = h5_held(exc, p, t.dataset)
            if held:
                raise ValueError(held) from None
            raise
        with fh:
            _check_h5_path(fh, p, t.dataset, label)
            there = _h5_name(fh, t.dataset)
        _refuse_h5_name(there, label, overwrite)
        if there is None:
            return False
    elif not p.exists():
        return False
    if not overwrite:
        raise OutputExists(f"{label} exists: pass --overwrite to replace it")
    fixed = fixed_attribute(p) if t.kind != "h5" else None
    if fixed:
        raise PermissionError(f"cannot replace {label}: it is {fixed} (chattr), which keeps "
                              f"every process, root's too, from replacing it")
    kept = unremovable(p) if t.kind == "zarr" else None
    if kept:
        raise PermissionError(f"cannot replace {label}: {kept}")
    return True


def _check_link(p: Path, t, overwrite: bool) -> None:
    """Refuse a target ``p`` that is a symbolic link (``check_target``'s rule for every kind):
    without ``overwrite`` it is an existing name (``OutputExists``), whatever it names; with
    ``overwrite`` the new output replaces the link (``put_in_place``, ``commit_h5``) and what
    it names is never opened, written or removed. An HDF5 target's link to anything that
    exists is refused whatever ``overwrite`` (``ValueError``): the dataset would go into the
    file the link names, which the user did not name, and replacing the link with a file
    holding only the new dataset would drop that file's other datasets from the name."""
    dest = os.readlink(p)
    if t.kind == "h5" and p.exists():
        raise ValueError(_h5_link_refusal(p, t.dataset))
    if not overwrite:
        gone = "" if p.exists() else ", which does not exist"
        raise OutputExists(f"{p} is a symbolic link to {dest}{gone}: pass --overwrite to replace "
                           f"the link (what it names is left as it is)")


def _h5_link_refusal(p: Path, dataset: str) -> str:
    """The one line refusing the HDF5 target ``p:dataset`` where ``p`` is a symbolic link to
    something that exists (``_check_link``, ``commit_h5``)."""
    import h5py

    real = p.resolve()
    fix = (f"name {real}:{dataset}, or remove the link" if real.is_file() and h5py.is_hdf5(real)
           else "remove the link, or name another file")
    return (f"cannot write {p}:{dataset}: {p} is a symbolic link to {os.readlink(p)}; distmm "
            f"neither adds a dataset through a link nor replaces a link to an existing file: "
            f"{fix}")


def unremovable(folder) -> str | None:
    """Why the folder ``folder`` (a zarr array to be replaced) could not be removed once the
    new one is in its place, or None where all of it can be: a file or folder in it, links not
    followed, that is immutable or append-only (``fixed_attribute``), or a folder of it this
    process may not list or remove names from (None for a link: only the link is removed).
    ``put_in_place`` moves the old folder aside and removes it after the rename; one it could
    not remove would be left beside the target."""
    folder = Path(folder)
    if folder.is_symlink():  # the link is removed, not what it names
        return None
    failed: list[OSError] = []
    for root, dirs, files in os.walk(folder, onerror=failed.append):
        here = Path(root)
        if not os.access(here, os.W_OK | os.X_OK):
            return f"{here} may not be written (permission), so the files in it cannot be removed"
        name, fixed = _fixed_in(here, (*dirs, *files))
        if fixed:
            return (f"{here / name} in it is {fixed} (chattr), which keeps every process, "
                    f"root's too, from removing it")
    if failed:
        exc = failed[0]
        return f"{exc.filename} cannot be listed ({exc.strerror}), so it cannot be removed"
    return None


def _check_zarr_path(path: Path, label: str, kind: str = "zarr") -> None:
    """Refuse a target ``path`` (its folder exists) that lies inside a zarr array: a
    folder above it, symbolic links followed, holds an array's metadata (``.zarray``, or
    ``zarr.json`` of node_type array). A new zarr array would be written into the array's
    folder, where zarr finds it through no group (an array holds no nodes), as
    ``_check_h5_path`` refuses a dataset path through a dataset; a ``.npy`` or HDF5 file
    (``kind``) would sit among its chunks, and change an operand read from it while the run
    reads it.

    Raises
    ------
    ValueError
    """
    given = {}
    for q in path.parents:  # the folders as named, for the message
        if ".." in q.parts:
            continue
        try:
            given.setdefault(q.resolve(), q)
        except OSError:
            continue
    folder = path.parent.resolve()
    for above in (folder, *folder.parents):
        try:
            node = zarr_node(above)
        except OSError:  # a folder that cannot be looked into holds no array this one is in
            continue
        if node == "array":
            name = given.get(above, above)
            if kind != "zarr":
                raise ValueError(f"cannot write {label}: it lies inside the zarr array {name}, "
                                 f"among its chunks; name a file outside it, e.g. "
                                 f"{name.parent / path.name}")
            raise ValueError(f"cannot write {label}: {name} is a zarr array, not a group; "
                             f"name an array in a zarr group or a folder, e.g. "
                             f"{name.parent / 'C.zarr'}")


#: the errors of opening a file that say it may not be written (no permission, an immutable or
#: append-only file, a read-only file system)
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def open_refusal(path, flags: int, refused=_REFUSED) -> OSError | None:
    """Open the existing file ``path`` with ``flags`` (for writing) and close it unwritten:
    the kernel's own answer to whether the command may write it so (``os.access`` tells what
    the real user id may do, and gives root a file that is append-only, ``chattr +a``). The
    error where it refuses (its errno in ``refused``), None where it opens; another error is
    raised as the write would meet it."""
    try:
        os.close(os.open(path, flags | getattr(os, "O_CLOEXEC", 0)))
    except OSError as exc:
        if exc.errno not in refused:
            raise
        return exc
    return None


def _check_opens(path: Path, dataset: str) -> None:
    """Refuse the existing HDF5 file ``path`` where it cannot be opened for reading and
    writing, as HDF5 will open it to copy ``dataset`` into it (``O_RDWR``: ``open_refusal``):
    a ``PermissionError`` naming both."""
    exc = open_refusal(path, os.O_RDWR)
    if exc is not None:
        raise PermissionError(f"cannot add {dataset!r} to {path}: the file cannot be opened "
                              f"for writing ({exc.strerror})")


#: statx's attributes that keep a file or folder from being renamed onto or removed (and
#: every name in such a folder), whoever asks: STATX_ATTR_IMMUTABLE, STATX_ATTR_APPEND
_FIXED = ((0x10, "immutable"), (0x20, "append-only"))


def fixed_attribute(path) -> str | None:
    """"immutable" or "append-only" where the file or folder ``path`` (a link itself, not
    followed) carries that attribute (``chattr +i``, ``+a``): no process, root's included,
    renames another onto it or removes it, or a name in it where it is a folder. None where it
    carries neither, does not exist, or the system does not say (no ``statx``). The kernel's
    record of the file, not a guess from permission bits."""
    return _fixed_in(None, (path,))[1]


def _fixed_in(folder, names) -> tuple:
    """The first of ``names`` (in the folder ``folder``; None: paths as they are) that is
    immutable or append-only and which (``fixed_attribute``), else ``(None, None)``: one
    ``statx`` a name, relative to the folder's descriptor, into one buffer."""
    import ctypes

    fn = libc_function("statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_void_p], ctypes.c_int)
    if fn is None or not names:
        return None, None
    buf = ctypes.create_string_buffer(256)  # struct statx
    attributes = ctypes.c_uint64.from_buffer(buf, 8)  # stx_attributes
    at_cwd, nofollow = -100, 0x100
    fd, prefix = at_cwd, None
    if folder is not None:
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # each name by its path then
            prefix = folder
    try:
        for name in names:
            path = os.path.join(prefix, name) if prefix else name
            if fn(fd, os.fsencode(path), nofollow, 0, buf) == 0 and attributes.value:
                fixed = next((what for bit, what in _FIXED if attributes.value & bit), None)
                if fixed:
                    return name, fixed
    finally:
        if fd != at_cwd:
            os.close(fd)
    return None, None


def _h5_name(fh, dataset: str) -> str | None:
    """What the name ``dataset`` is in the HDF5 file ``fh`` (opened for reading; the groups on
    its way are groups of that file: ``_check_h5_path``), its last link never followed into
    another file: None where no link has that name; "group" for a group, or a soft link to a
    group of the file; "" for a dataset or a named datatype; else the link, in words (a soft
    link to nothing, an external link, whatever it names: that file is never opened)."""
    import h5py

    if _first_missing_group(fh, dataset) is not None:
        return None
    name, links = dataset.encode(), fh.id.links
    try:
        if not links.exists(name):
            return None
        kind = links.get_info(name).type
    except (KeyError, RuntimeError, OSError, ValueError):  # a path through a dataset: no
        return None  # name there (check_target refuses it; a copy there fails, removed)
    if kind == h5py.h5l.TYPE_EXTERNAL:
        filename, obj = links.get_val(name)
        return f"an external link to {os.fsdecode(filename)}:{obj.decode()}"
    if kind == h5py.h5l.TYPE_SOFT:
        try:
            node = fh.get(dataset)  # (read-only: a link on its way out is opened for reading)
        except (KeyError, OSError, ValueError):
            node = None
        if node is None:
            return f"a soft link to {links.get_val(name).decode()}, which does not exist"
        if isinstance(node, h5py.Group) and Path(node.file.filename).resolve() == \
                Path(fh.filename).resolve():
            return "group"
        return ""
    return "group" if h5py.h5o.get_info(fh.id, name).type == h5py.h5o.TYPE_GROUP else ""


def _refuse_h5_name(there: str | None, label: str, overwrite: bool) -> None:
    """Refuse the HDF5 target ``label`` whose name is ``there`` (``_h5_name``): a group whatever
    ``overwrite`` (``IsADirectoryError``), any other existing name without it
    (``OutputExists``; a link is an existing name whatever it names)."""
    if there == "group":
        raise IsADirectoryError(f"{label} is an HDF5 group, which distmm never replaces")
    if there is not None and not overwrite:
        what = f" ({there})" if there else ""
        fix = "replace the link (what it names is left as it is)" if there else "replace it"
        raise OutputExists(f"{label} exists{what}: pass --overwrite to {fix}")


def _check_h5_path(fh, path: Path, dataset: str, label: str) -> None:
    """Refuse a dataset path of the open HDF5 file ``fh`` (``path``) that goes through
    something other than a group of that file: a dataset, a link to one or to nothing (HDF5
    would refuse to create the dataset there once the whole product is computed), or an
    external link, or a soft link through one, to a group of another file (HDF5 would create
    the dataset in that file, which distmm was not asked to write, and its staged copy there).
    Soft links to groups of the file itself are followed. Groups missing from some point on
    are created when the dataset is.

    Raises
    ------
    ValueError
    """
    import h5py

    parts = dataset.split("/")
    own = Path(fh.filename).resolve()
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        link = fh.get(prefix, getlink=True)
        if link is None:
            return  # HDF5 creates the groups from here on
        try:
            node = fh.get(prefix)
        except (KeyError, OSError):
            node = None
        if isinstance(link, h5py.ExternalLink):
            where = node.file.filename if node is not None else link.filename
            raise ValueError(f"cannot write {label}: {prefix!r} in {path} is an external link to "
                             f"{link.path!r} in {where}, another file, which distmm does not "
                             f"write into; name a group of {path}, or {where} itself")
        if not isinstance(node, h5py.Group):
            what = "a link to nothing" if node is None else f"a {type(node).__name__.lower()}"
            raise ValueError(f"cannot write {label}: {prefix!r} in {path} is {what}, not a "
                             f"group; name a dataset in a group, e.g. {path}:C")
        other = node.file.filename
        if Path(other).resolve() != own:  # a soft link through an external link
            raise ValueError(f"cannot write {label}: {prefix!r} in {path} leads to "
                             f"a group of {other}, another file, which distmm does not "
                             f"write into; name a group of {path}")


def h5_held(exc: BaseException, path, dataset: str | None = None) -> str | None:
    """The refusal of an HDF5 file that HDF5 would not open (``exc``) because another process
    holds it (its file lock), or a writer left it marked open; None for any other error.
    ``dataset``: the file is a target's, into which it would go, opened for reading (so its
    lock is a writer's); else an operand's."""
    text = " ".join(str(exc).split())
    output = dataset is not None
    lead = f"cannot add {dataset!r} to {path}: it" if output else str(path)
    if "unable to lock file" in text:
        if output:  # a read refused: another process holds the file for writing
            return (f"{lead} is open for writing in another process (HDF5's file lock), which "
                    f"would refuse the finished {dataset}; close it there first")
        return (f"{path} is open in another process (HDF5's file lock); close it there, or "
                f"set HDF5_USE_FILE_LOCKING=FALSE at your own risk")
    if "already open for write" not in text:
        return None
    if not _swmr_marked(path):
        return (f"{lead} is open for writing in another process, or a writer that stopped "
                f"left it marked open (h5clear -s {path} clears that mark)")
    if output:
        why = (f"which no other process may write into: run once the writer has closed the "
               f"file, or write {dataset} to another file")
    else:
        why = ("which may change its data while distmm reads it: run once the writer has "
               "closed the file, or on a copy of the dataset")
    return (f"{lead} is held by an SWMR writer in another process (HDF5's single-writer/"
            f"multiple-reader mode), {why} (a writer that stopped without closing it left "
            f"that mark: h5clear -s {path} clears it)")


def _swmr_marked(path) -> bool:
    """Whether an SWMR writer holds ``path`` (or one that stopped left it marked so): HDF5
    opens it only as an SWMR reader (``swmr=True``), which distmm does not, as a writer may
    append to or rewrite an operand while its tiles are read, and no other process may write
    into it. HDF5 drops its file lock once a writer turns SWMR on, so no lock tells it."""
    import h5py

    try:
        h5py.File(path, "r", swmr=True).close()
    except OSError:
        return False
    return True


def leftovers(target: Path, dataset: str | None = None, *, strict: bool = False) -> list[Path]:
    """Staged outputs earlier runs left beside ``target`` (``.NAME.distmm-partial-PID``).

    With ``dataset`` (an HDF5 target), only the staged files holding that dataset, or none
    that can be read (a run stopped while creating its file): those of another dataset of the
    same file belong to another target.

    A run calls this before it writes, to resume or remove them; so the files a dead run kept
    beside a staged output that is gone (deleted by hand) are removed here first
    (``_remove_orphans``): no run can resume from them, and no staged output leads to them.

    A folder that cannot be listed has none, and an HDF5 file that cannot be opened for this
    process's limits (``_PROCESS_LIMITS``) is another target's; with ``strict`` (a ``--resume``
    run, which would start over beside a stopped run it did not see) the ``OSError`` of a
    process limit is raised instead, saying what could not be looked at."""
    target = Path(target)
    _remove_orphans(target)
    return _staged_beside(target, dataset, strict)


def _staged_name(target: Path, tail: str) -> re.Pattern:
    """The names of ``target``'s staged outputs (``staged_path``'s ``.NAME.distmm-partial-PID``,
    the PID the first group), followed by ``tail`` (a regular expression)."""
    return re.compile(re.escape(f".{target.name}.{PARTIAL}-") + r"(\d+)" + tail)


def _staged_beside(target: Path, dataset: str | None, strict: bool = False) -> list[Path]:
    """``leftovers``, removing nothing."""
    pattern = _staged_name(target, "$")
    folder = target.parent if str(target.parent) else Path(".")
    try:
        names = os.listdir(folder)
    except OSError as exc:
        if strict and exc.errno in _PROCESS_LIMITS:
            raise OSError(exc.errno, f"{_limit_reason(exc)}, so the folder "
                                     f"{os.path.abspath(folder)} cannot be listed") from None
        return []
    found = sorted(folder / n for n in names if pattern.match(n))
    return found if dataset is None else [p for p in found if _h5_holds(p, dataset, strict)]


def _h5_holds(staged: Path, dataset: str, strict: bool = False) -> bool:
    """Whether the staged HDF5 file holds ``dataset``, or cannot be read as one (not for this
    process's own limits: ``_PROCESS_LIMITS``, raised with ``strict``)."""
    import h5py

    try:
        with h5py.File(staged, "r") as fh:
            return isinstance(fh.get(dataset), h5py.Dataset)
    except OSError as exc:
        # this process's limits say nothing of the file, which may be another target's
        if strict and exc.errno in _PROCESS_LIMITS:
            raise OSError(exc.errno, f"{_limit_reason(exc)}, so {staged.name} cannot be opened "
                                     f"to see which dataset it holds") from None
        return getattr(exc, "errno", None) not in _PROCESS_LIMITS
    except Exception:  # noqa: BLE001 - unreadable: no other target's to keep
        return True


def is_live(staged: Path) -> bool:
    """Whether a process on this host works on ``staged``: the distmm run that made it, still
    running, or one that took it over with ``claim`` (a ``--resume`` run) and still holds it.

    The maker is the distmm process with the PID in its name that started before ``staged``
    (or a file kept beside it) last changed (``_may_have_made``): PIDs come round again, and
    a distmm process that has the PID of a dead run now, started later, is not that run."""
    pid = staged_pid(staged)
    if pid == os.getpid():
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # no such process
        return _claimed(staged)
    except OSError:  # this process's limit (EMFILE, ENOMEM), or hidden (EACCES): not a fact
        return True  # about that process, which may run
    return (b"distmm" in cmdline and _may_have_made(pid, staged)) or _claimed(staged)


#: seconds a process may seem to have started after its staged output last changed and still
#: be taken for its maker: local file systems stamp file times from the clock the start time
#: is counted against, to a clock tick, but some stamp whole seconds, FAT 2 s rounded down, and
#: a network file system's server its own clock. (The maker started before that too: a distmm
#: run imports numpy and checks its inputs first.) The price: a dead run whose PID a distmm
#: process took over less than this after the run's last write is taken for live until that
#: process ends.
START_SLACK = 2.0


def _may_have_made(pid: int, staged: Path) -> bool:
    """Whether process ``pid`` started before ``staged`` or a file kept beside it (``_extras``)
    last changed (``START_SLACK`` later counts as before), so that it may have made it. True
    where either time is unknown. A zarr folder's own time changes only with its top-level
    entries, but its maker started before it made the folder."""
    started = _started(pid)
    changed = []
    try:
        extras = _extras(staged, strict=True)
    except OSError:  # this process's limit: the files' times are unknown
        return True
    for path in (staged, *extras):
        try:
            changed.append(path.stat().st_mtime)
        except OSError:
            pass
    return started is None or not changed or started <= max(changed) + START_SLACK


def _started(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (``time.time``'s clock), from
    its start in clock ticks after boot (/proc/PID/stat's 22nd field, after the command name,
    which may hold spaces and parentheses) and /proc/uptime; None where /proc does not say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes()
        ticks = int(fields[fields.rindex(b")") + 1:].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


#: the manifest a resumable run keeps beside its staged output (``distmm.engine.mpi.resume``),
#: which ``claim`` locks
MANIFEST_SUFFIX = ".resume.json"

#: what a run keeps beside its staged output ``STAGED``, as ``STAGED`` + one of these: the
#: manifest (and the file it is saved through), each rank's logs of finished stripes and of
#: their checksums (``distmm.engine.mpi.resume``), the zarr writers' lock
#: (``distmm.stripe_writer``). Exactly these: ``STAGED.x.distmm-partial-PID`` is another
#: target's staged output.
_EXTRAS = re.escape(MANIFEST_SUFFIX) + r"(?:\.tmp)?|\.(?:done|sums)-\d+|\.lock"


def _extras(staged: Path, *, strict: bool = False) -> list[Path]:
    """The files a run keeps beside ``staged`` (``_EXTRAS``) that exist; none where the folder
    cannot be listed, or with ``strict`` the ``OSError`` of a process limit
    (``_PROCESS_LIMITS``), which says nothing of the folder."""
    pattern = re.compile(re.escape(staged.name) + f"(?:{_EXTRAS})")
    try:
        names = os.listdir(staged.parent)
    except OSError as exc:
        if strict and exc.errno in _PROCESS_LIMITS:
            raise
        return []
    return [staged.parent / n for n in sorted(names)
            if pattern.fullmatch(n) and not (staged.parent / n).is_dir()]


def _remove_orphans(target: Path) -> None:
    """Remove the manifests, logs and locks of staged outputs beside ``target`` that are gone
    (a user deleted a stopped run's staged output), each only under its claim and only where
    no process works on it: not ``is_live`` (this process's PID counts as a dead run's, as
    PIDs come round again: a run calls this before it stages anything), and its staged output
    still gone once claimed. Those of every dataset of an HDF5 file: no run can use them."""
    folder = target.parent if str(target.parent) else Path(".")
    pattern = _staged_name(target, f"(?:{_EXTRAS})")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    gone = set()
    for name in names:
        found = pattern.fullmatch(name)
        if found and not os.path.lexists(folder / name[:found.end(1)]):
            gone.add((folder / name[:found.end(1)], int(found.group(1))))
    for staged, pid in sorted(gone):
        if pid != os.getpid() and is_live(staged):
            continue
        fd = claim(staged)
        if fd is None:  # a run holds it
            continue
        try:
            if not os.path.lexists(staged):
                for extra in _extras(staged):
                    extra.unlink(missing_ok=True)
        finally:
            release(fd)


def claim(staged: Path, *, strict: bool = False) -> int | None:
    """Take ``staged`` over for this process: an exclusive advisory lock (``flock``) on its
    manifest (``STAGED.resume.json``), held until the returned descriptor is closed or the
    process ends (a kill releases it). None where another process holds it: that one resumes
    or removes ``staged``, and this one leaves it alone. -1 (nothing held) where there is no
    manifest (``ENOENT``, ``ENOTDIR``): no run can resume such a staged output. A manifest
    that cannot be opened for another reason (this process's limits, ``EMFILE``, ``ENFILE``,
    ``ENOMEM``; ``EACCES``) counts as held: its lock cannot be tried, so a run may hold it;
    with ``strict`` the ``OSError`` of a process limit (``_PROCESS_LIMITS``) or of a
    permission (``PermissionError``) is raised instead, as it says nothing of another run."""
    import fcntl

    try:
        fd = os.open(f"{staged}{MANIFEST_SUFFIX}", os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return -1
    except OSError as exc:
        if strict and exc.errno in _PROCESS_LIMITS:
            raise OSError(exc.errno, f"{_limit_reason(exc)}, so the manifest of "
                                     f"{Path(staged).name} cannot be opened to see whether a "
                                     f"run holds it") from None
        if strict and isinstance(exc, PermissionError):  # no sign of a run that holds it
            raise PermissionError(exc.errno, f"the manifest of {Path(staged).name} cannot be "
                                             f"read (permission denied), so whether a run "
                                             f"holds it cannot be seen") from None
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


#: seconds between a waiting ``--resume`` run's calls of ``preparing``'s ``stop``
WAIT_STEP = 0.05


@contextmanager
def preparing(target: Path, stop=None):
    """Hold an exclusive advisory lock (``flock``) on the folder holding ``target`` while a
    ``--resume`` run looks at the staged outputs beside it and makes its own with its claimed
    manifest: a second such run waits, then finds that one claimed (between the staged
    output's making and its manifest's saving, it took it for a dead run's, or started beside
    it). Where the folder takes no lock (some network file systems: ``flock`` fails) or cannot
    be opened (no permission to read it), nothing is held; where this process cannot open it
    for its open-file limit (``EMFILE``; the system's, ``ENFILE``) an ``OSError`` says so in
    one line, before anything is looked at.

    A run that finds the lock taken says so in one line on stderr and waits (``_wait_lock``),
    calling ``stop`` (when given) every ``WAIT_STEP`` seconds: a ``stop`` that raises ends the
    wait (a signal that arrived, where the handlers only record it, as the MPI engine's do)."""
    import fcntl

    folder = Path(target).parent
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in _NO_DESCRIPTOR:  # no lock taken, and other runs would race this one
            raise OSError(exc.errno, f"cannot resume {target}: {_limit_reason(exc)}, so its "
                                     f"folder {os.path.abspath(folder)} cannot be opened to hold "
                                     f"off other --resume runs while this one prepares") from None
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"distmm: waiting for another --resume run preparing in "
                      f"{os.path.abspath(folder)}", file=sys.stderr, flush=True)
                _wait_lock(fd, stop)
            except OSError:
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _wait_lock(fd: int, stop) -> None:
    """Wait for the ``flock`` on ``fd``, taken on a thread of its own, so that the main
    thread runs signal handlers and calls ``stop`` meanwhile, and goes on the moment the lock
    is free. The thread locks a duplicate of ``fd`` (the same lock), which it closes: when
    ``stop`` raised and ``fd`` was closed, the lock it takes later goes with that."""
    import fcntl

    own = os.dup(fd)
    taken = threading.Event()

    def take() -> None:
        try:
            fcntl.flock(own, fcntl.LOCK_EX)
        except OSError:  # no lock to wait for
            pass
        finally:
            os.close(own)
            taken.set()

    threading.Thread(target=take, name="distmm-preparing", daemon=True).start()
    while not taken.wait(WAIT_STEP):
        if stop is not None:
            stop()


def release(fd: int | None) -> None:
    """Give up a ``claim``."""
    if fd is not None and fd >= 0:
        os.close(fd)


def _claimed(staged: Path) -> bool:
    """Whether another process holds ``staged``'s claim."""
    fd = claim(staged)
    release(fd)
    return fd is None


def remove_if_left(staged: Path) -> bool:
    """Remove ``staged`` unless a process works on it (``is_live``), holding its claim
    meanwhile so that no ``--resume`` run takes it up half removed. Whether it was removed."""
    if is_live(staged):
        return False
    fd = claim(staged)
    if fd is None:
        return False
    try:
        remove_leftover(staged)
    finally:
        release(fd)
    return True


def reclaimable(target: Path, dataset: str | None = None) -> int:
    """Bytes on disk of the staged outputs beside ``target`` that no running process works
    on (``leftovers`` less ``is_live``): a run resumes or removes them before it writes, so
    their space counts as free for its output."""
    total = 0
    for staged in _staged_beside(Path(target), dataset):  # (the space check removes nothing)
        if is_live(staged):
            continue
        files = [staged] if not staged.is_dir() else [p for p in staged.rglob("*") if p.is_file()]
        for f in files:
            try:
                total += f.lstat().st_blocks * 512
            except OSError:
                pass
    return total


def remove_leftover(staged: Path) -> None:
    """Remove a staged output and its manifest, logs and lock (``_EXTRAS``)."""
    staged = Path(staged)
    for extra in _extras(staged):
        extra.unlink(missing_ok=True)
    if staged.is_dir() and not staged.is_symlink():
        remove_tree(staged)
    else:
        staged.unlink(missing_ok=True)


def is_within(name, path, *extra) -> bool:
    """Whether the file ``name`` (an OSError's ``filename``) is ``path``, one of ``extra``,
    or inside ``path``; False for None or a descriptor."""
    try:
        name = Path(os.path.abspath(os.fsdecode(name)))
    except TypeError:  # None, or a descriptor
        return False
    path = Path(os.path.abspath(path))
    return (name == path or path in name.parents
            or name in (Path(os.path.abspath(x)) for x in extra))


#: errnos of a process's own limits (open files, memory), which say nothing of a file
_PROCESS_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

#: errnos of an open-file limit: this process's (``ulimit -n``) or the system's
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


def descriptors_short(need: int) -> tuple[int, int] | None:
    """None where this process can open ``need`` more files at once (each closed again);
    else the errno that stopped it (``EMFILE``: its open-file limit; ``ENFILE``: the
    system's table) and how many it could open. Any other error is raised."""
    held = []
    try:
        while len(held) < need:
            held.append(os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
    except OSError as exc:
        if exc.errno not in _NO_DESCRIPTOR:
            raise
        return exc.errno, len(held)
    finally:
        for fd in held:
            os.close(fd)
    return None


def is_process_limit(exc: BaseException) -> bool:
    """Whether ``exc`` is the ``OSError`` of this process's own limits (``_PROCESS_LIMITS``:
    open files, memory), which says nothing of the file it was opening."""
    return isinstance(exc, OSError) and exc.errno in _PROCESS_LIMITS


def _limit_reason(exc: OSError) -> str:
    """The process limit behind ``exc`` (``_PROCESS_LIMITS``) in words, for a line that the
    command line ends with the limit in force (``ulimit -n``)."""
    if exc.errno == errno.EMFILE:
        return "too many open files"
    if exc.errno == errno.ENFILE:
        return "the system's table of open files is full (ENFILE)"
    return "no memory left (ENOMEM)"


def remove_tree(path) -> bool:
    """Remove a folder of distmm's own (a staged zarr array, an old one moved aside) and
    everything in it; whether it is gone. ``shutil.rmtree`` holds a descriptor per level
    of the folder, which a small open-file limit (``ulimit -n``) refuses: what it left is
    then removed by a walk that holds one descriptor at a time (``os.listdir``)."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return True
    try:
        _remove_walk(str(path))
    except OSError:
        pass
    return not os.path.lexists(path)


def _remove_walk(path: str) -> None:
    """Remove ``path`` bottom-up by name; a link is removed itself, never followed."""
    for name in os.listdir(path):  # its descriptor is closed before the entries are visited
        entry = os.path.join(path, name)
        try:
            is_dir = stat.S_ISDIR(os.lstat(entry).st_mode)
        except FileNotFoundError:
            continue
        if is_dir:
            _remove_walk(entry)
        else:
            os.unlink(entry)
    os.rmdir(path)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less)."""
    view = as_bytes(data)
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


# ---------------------------------------------------------------- the block writer


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


class BlockWriter:
    """A C-ordered array stored at byte ``offset`` of a file, written with
    ``os.pwrite``: ``out[rows, cols] = tile``; ``out[...]`` reads back.

    Shaped like the array it holds (``shape``, ``dtype``, ``ndim``), so
    ``distmm.matmul(a, b, out=writer)`` writes tiles into it. Writes raise
    ``OSError`` on a full disk or a file-size limit.

    Parameters
    ----------
    path : path
        The file; it must exist unless ``create`` (then it must not).
    shape : tuple of int
    dtype : dtype
    offset : int
        Where the array's first byte goes.
    create : bool
        Create the file (exclusively).
    direct : bool, optional
        Write spans of 1 MiB and more past the page cache (``distmm.direct_io``) where the
        file system takes ``O_DIRECT``; ``None``: the ``direct-writes`` setting.
    """

    def __init__(self, path, shape, dtype, offset: int, *, create: bool = False,
                 direct: bool | None = None):
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._offset = int(offset)
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(self.path, flags, 0o666)
        self._rfd = None
        if direct is None:
            from distmm.config import get_config

            direct = get_config().direct_writes
        self._span = SpanWriter(self.path, self._fd) if direct else None

    ndim = property(lambda self: len(self.shape))
    offset = property(lambda self: self._offset, doc="Where the array's first byte is.")
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def _pwrite(self, data, offset: int) -> None:
        if self._span is not None:
            self._span.write(data, offset, pwrite_all)
        else:
            pwrite_all(self._fd, data, offset)

    @property
    def written_direct(self) -> int:
        """Bytes written past the page cache so far."""
        return 0 if self._span is None else self._span.written_direct

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
        """Flush the file to disk and close it."""
        os.fsync(self._fd)
        self.close()

    def close(self) -> None:
        if self._span is not None:
            self._span.close()
            self._span = None
        for fd in (self._fd, self._rfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._rfd = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"


# ---------------------------------------------------------------- room


def check_room(label, folder, free_bytes: int, file_bytes: int | None) -> None:
    """Refuse (``InsufficientSpace``, naming ``label``) when ``folder``'s file
    system has less than ``free_bytes`` free, or when one file of
    ``file_bytes`` (``None``: no single file) would pass the file-size limit
    (``ulimit -f``). Nothing is written."""
    free = shutil.disk_usage(folder).free
    if free_bytes > free:
        raise InsufficientSpace(f"{label} needs {free_bytes / 2**20:.1f} MiB but its file system "
                                f"has {free / 2**20:.1f} MiB free")
    if file_bytes is None:
        return
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and file_bytes > limit:
        raise InsufficientSpace(f"{label} needs a file of {file_bytes / 2**20:.1f} MiB but the "
                                f"file-size limit (ulimit -f) is {limit / 2**20:.1f} MiB")


# ---------------------------------------------------------------- HDF5


def create_h5_stage(staged, dataset: str, shape, dtype) -> int:
    """Create the HDF5 file ``staged`` (it must not exist) holding only
    ``dataset``, contiguous, its storage allocated now and never filled (a
    sparse file until written); return the byte offset of its data, which is
    stored C-ordered with numpy's bytes for ``dtype``.

    Raises
    ------
    TypeError
        A dtype HDF5 stores with other bytes than numpy (object, strings).
    """
    import h5py

    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"cannot write dtype {dtype} to an HDF5 dataset")
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # on the plist: h5py < 3.11 has no fill_time=
    # large objects start on a block boundary, so whole rows of the data can be written directly
    with h5py.File(staged, "w-", alignment_threshold=MIN_DIRECT, alignment_interval=ALIGN) as fh:
        ds = fh.create_dataset(dataset, shape=tuple(shape), dtype=dtype, dcpl=dcpl)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes and ds.id.get_offset() is None:  # a scalar: allocated by its first write
            ds[()] = np.zeros((), dtype)
        if ds.id.get_type().get_size() != dtype.itemsize or ds.id.get_storage_size() != nbytes:
            raise TypeError(f"HDF5 stores dtype {dtype} in another layout than numpy")
        offset = ds.id.get_offset()
    offset = 0 if offset is None else int(offset)
    from distmm.config import get_config

    if nbytes and get_config().direct_writes:  # the data's blocks now (a full disk fails here)
        fd = os.open(staged, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            preallocate(fd, offset, nbytes)
        finally:
            os.close(fd)
    return offset


def _close(fh, path, *, quiet: bool) -> None:
    """Close an HDF5 file; a failed close is recorded (``HDF5_UNCLOSED``) and
    raised unless ``quiet`` (another error is already on its way)."""
    try:
        fh.close()
    except Exception as exc:  # noqa: BLE001
        HDF5_UNCLOSED.append(Path(path))
        if not quiet:
            raise OSError(f"cannot close {path} after adding a dataset "
                          f"({' '.join(str(exc).split())})") from None


@contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGXCPU wait until the block ends (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _first_missing_group(fh, dataset: str) -> str | None:
    """The outermost group of ``dataset``'s path that ``fh`` lacks (the copy creates it)."""
    parts = dataset.split("/")[:-1]
    for n in range(1, len(parts) + 1):
        name = "/".join(parts[:n])
        if name not in fh:
            return name
    return None


def commit_h5(staged, path, dataset: str, *, overwrite: bool = False) -> None:
    """Move ``dataset`` of the staged file into the HDF5 file ``path``; the
    staged file is removed in every case.

    A ``path`` that does not exist (or is a symbolic link to nothing) becomes the staged file
    (a rename, which replaces the link; a file made at ``path`` while the run computed is
    never replaced: the dataset is copied into it, as into one that was there). Into an
    existing file the dataset is copied under a temporary name, after checking
    that the file system and the file-size limit have room for it; then an old
    ``dataset`` (only with ``overwrite``; whatever link has that name, looked at with the file
    opened for reading and never followed into another file: ``_h5_name``) is deleted and
    the copy renamed onto it. Nothing else in the file changes; on a failure the copy is removed. After the
    rename or the copy the file is flushed to disk (``fsync``), and after a rename the
    folder that names it too.

    Raises
    ------
    InsufficientSpace
        No room for the copy (the user's file was not opened).
    OutputExists
        ``dataset`` exists (a link to nothing too) and ``overwrite`` is false.
    IsADirectoryError
        ``dataset`` names an HDF5 group, or a soft link to one.
    ValueError
        ``path`` is a symbolic link to a file (never written through, nor replaced).
    OSError
        The file cannot be opened for writing, or the copy failed.
    """
    staged, path = Path(staged), Path(path)
    try:
        if not path.exists():
            fsync_paths([staged])
            try:
                if path.is_symlink():  # a link to nothing, replaced itself (check_target)
                    os.replace(staged, path)
                else:
                    _rename_new(staged, path)
            except OutputExists:  # made while the run computed: copied into, as if it was there
                pass
            else:
                fsync_paths([path.parent])
                return
        if path.is_symlink():  # made while the run computed: check_target refuses it
            raise ValueError(_h5_link_refusal(path, dataset))
        _copy_into(staged, path, dataset, overwrite)
        fsync_paths([path])  # closed: HDF5's flush leaves the bytes in the page cache
    finally:
        staged.unlink(missing_ok=True)


#: bytes copied into an existing HDF5 file at a time (``_copy_dataset``): a signal waits for
#: one block at most, and blocks of 1 MiB copy about as fast as one ``H5Ocopy`` call
COPY_BLOCK = 1 << 20


def _copy_dataset(src, dst, name: str) -> None:
    """Copy the dataset ``src`` to ``name`` in the open file ``dst`` (its type, shape and
    creation properties; missing groups created), ``COPY_BLOCK`` bytes of rows at a time, on
    a thread of its own while this one waits.

    One call (``H5Ocopy``) would keep SIGINT and SIGTERM waiting for the whole copy (seconds
    for GiBs), then removed. Python runs a signal's handler only in the main thread, between
    calls into C, and the exception of one that runs in a finaliser (h5py frees objects after
    each call) is swallowed: so the main thread only waits, in short steps, where a handler
    that raises stops the copy; the thread stops after its current block, and the caller
    removes what it wrote. A handler that only records the signal (the MPI engine's, which
    commits what it finished) lets the copy end."""
    import h5py

    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    new = h5py.Dataset(h5py.h5d.create(dst.id, name.encode(), src.id.get_type(),
                                       src.id.get_space(), dcpl=src.id.get_create_plist(),
                                       lcpl=lcpl))
    if src.ndim == 0 or src.size == 0:
        if src.size:
            new[()] = src[()]
        return
    rows = src.shape[0]
    step = max(1, COPY_BLOCK // max(1, src.size // rows * src.dtype.itemsize))
    stop = threading.Event()
    failed: list[BaseException] = []

    def copy() -> None:
        block = np.empty((min(step, rows),) + src.shape[1:], dtype=src.dtype)
        try:
            for r0 in range(0, rows, step):
                if stop.is_set():
                    return
                part = block[:min(step, rows - r0)]
                src.read_direct(part, np.s_[r0:r0 + len(part)])
                new.write_direct(part, dest_sel=np.s_[r0:r0 + len(part)])
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            failed.append(exc)

    worker = threading.Thread(target=copy, name="distmm-h5-copy", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    finally:
        stop.set()
        worker.join()  # at most one block more
    if failed:
        raise failed[0]


def _copy_into(staged: Path, path: Path, dataset: str, overwrite: bool) -> None:
    import h5py

    label = f"{path}:{dataset}"
    with h5py.File(staged, "r") as src:
        nbytes = int(src[dataset].id.get_storage_size())
    check_room(label, path.parent, nbytes + H5_MARGIN, path.stat().st_size + nbytes + H5_MARGIN)
    try:
        with h5py.File(path, "r") as fh:  # the name, read-only: a link out of the file that
            there = _h5_name(fh, dataset)  # followed here would open its file for writing
    except OSError as exc:
        raise OSError(f"cannot open {path} to add {dataset!r} ({' '.join(str(exc).split())})") from None
    _refuse_h5_name(there, label, overwrite)  # (made while the run computed)
    try:
        dst = h5py.File(path, "r+")
    except OSError as exc:
        raise OSError(f"cannot open {path} to add {dataset!r} ({' '.join(str(exc).split())})") from None
    temp = f"{dataset}.{PARTIAL}-{os.getpid()}"
    failed = True
    try:
        new_group = _first_missing_group(dst, dataset)
        committed = False
        try:
            try:
                with h5py.File(staged, "r") as src:
                    _copy_dataset(src[dataset], dst, temp)
            except (RuntimeError, OSError, ValueError) as exc:  # HDF5's own: several lines each
                raise OSError(f"copying {dataset!r} into {path} failed "
                              f"({' '.join(str(exc).split())})") from exc
            with _signals_held():
                if dst.id.links.exists(dataset.encode()):  # the link itself, never followed:
                    del dst[dataset]  # a link to nothing or to another file too
                dst.move(temp, dataset)
                dst.flush()
                committed = True  # a signal held off until here finds C complete
        except BaseException:
            if committed:
                raise
            with _signals_held():
                try:
                    if new_group is not None and new_group in dst:
                        del dst[new_group]
                    elif temp in dst:
                        del dst[temp]
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise
        failed = False
    finally:
        _close(dst, path, quiet=failed)
