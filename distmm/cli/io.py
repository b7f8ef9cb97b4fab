"""Reading operands from and writing results to files: ``.npy``, ``.zarr``, HDF5.

This module covers: opening an operand lazily (memory-mapped ``.npy``, zarr
arrays, HDF5 datasets named ``file.h5:dataset``) with errors that name the
file or dataset, and writing a result so that nothing but the target changes:

- the result is staged beside its target (same folder, so the final rename is
  atomic) under a name a user recognises, ``.NAME.distmm-partial-PID``; an
  HDF5 result ``file.h5:C`` is staged as a hidden HDF5 file
  ``.file.h5.distmm-partial-PID`` holding only ``C``, renamed to ``file.h5``
  when there is no such file, else copied into it (after a check of the room
  for the copy) with its other datasets untouched (``distmm.staging``);
- an existing target is an error (``OutputExists``) unless ``overwrite``;
- a directory is never removed, and a zarr group is never replaced (a zarr
  array inside a group is written as ``group.zarr/array``, and the groups' consolidated
  metadata, where they have any, made again to list it: ``distmm.staging.put_in_place``);
- an HDF5 dataset's name in an existing file is whatever link has it, a link to nothing
  or to another file too: an existing name, replaced only with ``overwrite``, and never
  followed into another file (``distmm.staging.check_target``, ``commit_h5``);
- free space is checked before anything is computed (``InsufficientSpace``);
- ``.npy`` and HDF5 tiles go to disk with ``os.pwrite``, not through a memory
  map or HDF5, so a full disk or a file-size limit raises ``OSError`` instead
  of killing the process with SIGBUS or a crash inside HDF5;
- on any exception (``KeyboardInterrupt`` and signals raised as exceptions
  included) the staged output is removed and the target is left as it was.

It does *not* cover: computing anything, or signal handling (``distmm.cli``).
"""
from __future__ import annotations

import errno
import math
import os
import stat
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distmm.cli.outputs import REFUSED, check_creatable
from distmm.direct_io import npy_header, preallocate
from distmm.hdf5_filters import check_filters
from distmm.stripe_writer import output_spec, zarr_format_for
from distmm.staging import (H5_MARGIN, BlockWriter, check_room, check_target, commit_h5,
                            create_h5_stage, file_in_the_way, h5_held, is_process_limit,
                            is_within, put_in_place, reclaimable, remove_tree, staged_path,
                            zarr_node, ZARR_METADATA)

__all__ = ["open_operand", "staged_output", "write_atomic", "parse_target", "operand_target",
           "check_target", "check_report", "check_space", "check_writable", "check_unlocked",
           "result_shape", "unreadable", "Target", "NpyWriter", "SUFFIXES"]

SUFFIXES = (".npy", ".zarr", ".h5", ".hdf5")


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
        See ``distmm.stripe_writer.output_spec``.
    """
    f = output_spec(spec)
    return Target(f.kind, f.path, f.dataset)


def operand_target(spec: str) -> Target:
    """``parse_target`` for an operand: a zarr array's folder may end with a path separator,
    as a shell's completion writes it (``a.zarr/``, ``group.zarr/A/``).

    Raises
    ------
    ValueError
        See ``parse_target``.
    """
    spec = str(spec)
    bare = spec.rstrip("/" + os.sep)
    if bare != spec and bare:
        try:
            t = parse_target(bare)
        except ValueError:
            t = None
        if t is not None and t.kind == "zarr":
            return t
    return parse_target(spec)


# ---------------------------------------------------------------- reading


def operands_dtype(a_spec: str, a, b_spec: str, b) -> np.dtype:
    """numpy's result dtype of ``a @ b`` for two opened operands; a dtype matmul does not
    take is a TypeError naming its file (the API raises numpy's own, which names none)."""
    from distmm.plan import is_bfloat16, result_dtype

    for spec, x in ((a_spec, a), (b_spec, b)):
        dt = np.dtype(x.dtype)
        if dt.kind == "V" and dt.names is None:  # raw bytes: a dtype the file could not name
            raise TypeError(f"{spec} has dtype {dt}: {_unnamed(dt)}")
        if dt.kind == "O":  # no format distmm writes stores an object result
            raise TypeError(f"{spec} holds {_objects(x)} (dtype {dt}): matmul needs boolean "
                            f"or numeric operands")
        if dt.kind not in "biufc" and not is_bfloat16(dt):
            raise TypeError(f"{spec} has dtype {dt}: matmul needs boolean or numeric operands")
    return result_dtype(np.dtype(a.dtype), np.dtype(b.dtype))


def _unnamed(dt: np.dtype) -> str:
    """What to do with an operand of raw bytes (``|V2``...): what numpy.save and h5py store
    for a dtype numpy has no name for, such as ml_dtypes' bfloat16, which no format distmm
    reads keeps."""
    if dt.itemsize == 2:
        return ("2-byte values of a type the file does not name, as numpy.save and h5py store "
                "ml_dtypes' bfloat16; save the array as float32 (x.astype(numpy.float32), "
                "exact) and pass --precision bf16 for bfloat16 arithmetic")
    return (f"{dt.itemsize}-byte values of a type the file does not name, as numpy.save and "
            f"h5py store a dtype numpy has no name for; matmul needs boolean or numeric "
            f"operands: save the array as one, e.g. x.astype(numpy.float32)")


def _objects(x) -> str:
    """What the elements of an opened operand of object dtype are: as h5py marks its dtype
    (variable-length strings, object or region references, variable-length sequences), or
    as a zarr array's data type names them (``variable_length_bytes``); else Python objects."""
    import h5py

    dt = np.dtype(x.dtype)
    meta = getattr(x, "metadata", None)  # a zarr array's: data_type (v3), dtype (v2)
    zdt = getattr(meta, "data_type", None) or getattr(meta, "dtype", None)
    if hasattr(zdt, "to_json"):
        try:
            with warnings.catch_warnings():  # zarr's on a type without a v3 specification
                warnings.simplefilter("ignore")
                name = zdt.to_json(zarr_format=3)
        except (TypeError, ValueError):
            name = None
        if isinstance(name, str):
            return f"zarr's {name} values"
    string = h5py.check_string_dtype(dt)
    if string is not None:
        return "variable-length strings" if string.encoding == "utf-8" else \
            "variable-length byte strings"
    ref = h5py.check_ref_dtype(dt)
    if ref is not None:
        return "region references" if ref is h5py.RegionReference else "object references"
    base = h5py.check_vlen_dtype(dt)
    if base is not None:
        return f"variable-length sequences of {np.dtype(base)}"
    return "Python objects"


def check_shapes(a_spec: str, a, b_spec: str, b) -> None:
    """numpy's shape rules for ``a @ b`` of two opened operands (``distmm.plan.matmul_shapes``);
    a ValueError naming the files where numpy refuses."""
    from distmm.plan import matmul_shapes

    for spec, x in ((a_spec, a), (b_spec, b)):
        if x.shape is None:  # h5py's shape of a null dataspace (h5py.Empty)
            raise ValueError(f"{spec} holds no data (an empty HDF5 dataspace); matmul needs "
                             f"arrays of at least 1 dimension")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"{a_spec if a.ndim == 0 else b_spec} holds a scalar; matmul needs "
                         f"arrays of at least 1 dimension")
    matmul_shapes(tuple(a.shape), tuple(b.shape), a_name=a_spec, b_name=b_spec)


def result_shape(a, b) -> tuple[int, ...]:
    """numpy's shape of ``a @ b`` for two opened operands that multiply (``check_shapes``):
    the broadcast batch, then ``(m, n)``, less the axis of a vector operand."""
    from distmm.plan import matmul_shapes

    batch, m, n, _ = matmul_shapes(tuple(a.shape), tuple(b.shape))
    shape = [*batch, m, n]
    if b.ndim == 1:
        shape.pop(-1)
    if a.ndim == 1:
        shape.pop(-1 if b.ndim == 1 else -2)
    return tuple(shape)


def unreadable(exc: BaseException, operands: dict):
    """An ``UnreadableInput`` naming the operand (``{spec: opened array}``) whose read raised
    ``exc``: a frame of the traceback, or of its causes, is a method of that very array (a
    zarr chunk that does not decode, an HDF5 filter that fails), or a Dask worker's read noted
    its file on it; None for any other error, which names its file already or is not a
    read's."""
    from distmm.errors import READING, UnreadableInput

    if isinstance(exc, (MemoryError, UnreadableInput)):
        return None
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for note in getattr(e, "__notes__", ()):  # a Dask worker's read names its file so
            if isinstance(note, str) and note.startswith(READING):
                return UnreadableInput(f"{note[len(READING):]} cannot be read: "
                                       f"{type(exc).__name__}: {exc}")
        tb = e.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            for spec, array in operands.items():
                if owner is array and not isinstance(array, np.ndarray):
                    return UnreadableInput(f"{spec} cannot be read: {type(exc).__name__}: {exc}")
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return None


def open_operand(spec: str, *, writable: bool = False):
    """Open an operand without reading it all: a memmap, a zarr array or an h5py dataset.

    An HDF5 file is opened read-only, also one that receives the output (``writable``: refused
    where another process holds it, which would refuse C): a file opened for writing had its
    modification time changed by a refused run, and one in HDF5's newer format
    (``libver="latest"``) left marked open for writing, unreadable until ``h5clear``, by a
    run a signal ended. ``staged_output`` closes it before C is copied in.

    Raises
    ------
    FileNotFoundError
        The file (or the HDF5 dataset) does not exist; the message says "no such file".
    IsADirectoryError
        A folder where a ``.npy`` or HDF5 file was expected.
    PermissionError
        A file, or a zarr array's folder, this user may not read; the message names it.
    ValueError
        Unsupported suffix, a file that is not of its suffix's format (a ``.npy`` file
        shorter than its header says: truncated), a named pipe, socket or device where a file
        was expected (a zarr array's metadata file too), a file or a zarr group where a zarr
        array was expected, or an HDF5 file that another process holds: its file lock, or an
        SWMR writer (HDF5 files are read only when no process writes them); an HDF5 dataset
        stored through a filter this HDF5 lacks (a plugin not installed:
        ``distmm.hdf5_filters``).
    """
    t = operand_target(spec)
    if not t.path.exists():
        raise FileNotFoundError(f"no such file: {t.path}")
    if t.kind != "zarr":  # before any open: a named pipe's would wait for a writer
        _check_regular(t.path, f"{t.path} is", "not a regular file")
    if t.kind == "npy":
        if t.path.is_dir():
            raise IsADirectoryError(f"{t.path} is a directory, not a .npy file")
        _check_npy(t.path)
        try:
            return np.load(t.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError) as exc:  # EOFError: an empty file
            if "max_header_size" in str(exc):  # numpy's advice (allow_pickle=True) is for code
                raise ValueError(f"{t.path} is not a readable .npy file: its header is longer "
                                 f"than numpy reads from a file it does not trust; save the "
                                 f"array again with numpy.save") from None
            raise ValueError(f"{t.path} is not a readable .npy file ({_why(exc)})") from None
    if t.kind == "zarr":
        import zarr

        if not t.path.is_dir():
            _check_regular(t.path, f"{t.path} is", "not a zarr array (a folder)")
            raise ValueError(f"{t.path} is a file, not a zarr array (a folder holding its "
                             f"metadata, zarr.json or .zarray, and its chunks)")
        for name in ZARR_METADATA:  # zarr reads these before any chunk
            _check_regular(t.path / name, f"{t.path} is not a readable zarr array: its "
                                          f"metadata file {t.path / name} is",
                           "not a regular file")
        try:
            try:
                node = zarr_node(t.path)
            except PermissionError as exc:  # a folder this user may not enter: named itself,
                # not the first metadata file looked for in it
                raise PermissionError(exc.errno, exc.strerror, str(t.path)) from None
            if node == "array":
                return zarr.open_array(str(t.path), mode="r")
        except (ValueError, TypeError, KeyError) as exc:  # metadata zarr cannot read
            raise ValueError(f"{t.path} is not a readable zarr array ({_why(exc)})") from None
        meta = [m for m in (".zarray", ".zgroup", "zarr.json") if (t.path / m).is_file()]
        if node is None and meta:  # zarr_node reads no node type from it
            raise ValueError(f"{t.path} is not a readable zarr array (its metadata file "
                             f"{t.path / meta[0]} is not zarr metadata)")
        what = "a zarr group" if node == "group" else "not a zarr array"
        raise ValueError(f"{t.path} is {what}: name an array, e.g. {t.path}/NAME")
    import h5py

    if t.path.is_dir():
        raise IsADirectoryError(f"{t.path} is a directory, not an HDF5 file")
    with open(t.path, "rb"):  # a file this user may not read: PermissionError naming it,
        pass  # not h5py's words on HDF5's call
    if not h5py.is_hdf5(t.path):
        raise ValueError(f"{t.path} is not an HDF5 file")
    if writable and _held_elsewhere(t.path):  # C could not be copied into it at the end
        raise ValueError(f"{t.path} is open in another process (HDF5's file lock), which would "
                         f"refuse the finished C; close it there first")
    try:
        fh = h5py.File(t.path, "r")
    except OSError as exc:  # HDF5's own messages: a truncated or damaged file
        if isinstance(exc, PermissionError):
            raise
        held = h5_held(exc, t.path)
        if held:
            raise ValueError(held) from None
        raise ValueError(f"{t.path} is not a readable HDF5 file ({_why(exc)})") from None
    node = fh.get(t.dataset)
    if not isinstance(node, h5py.Dataset):
        link = fh.get(t.dataset, getlink=True) if node is None else None
        names = []
        fh.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        fh.close()
        if isinstance(link, h5py.ExternalLink):  # its file or its object is missing
            raise FileNotFoundError(f"{t.dataset!r} in {t.path} is a link to {link.filename}:"
                                    f"{link.path}, which does not resolve")
        if isinstance(link, h5py.SoftLink):
            raise FileNotFoundError(f"{t.dataset!r} in {t.path} is a link to {link.path}, "
                                    f"which does not exist")
        what = "no dataset" if node is None else "a group, not a dataset, at"
        raise FileNotFoundError(f"{what} {t.dataset!r} in {t.path} "
                                f"(datasets: {', '.join(names) or 'none'})")
    try:
        check_filters(node, f"{t.path}:{t.dataset}")
    except ValueError:
        fh.close()
        raise
    return node


#: what a path that is neither a regular file nor a folder is, by ``stat``'s test of its mode
_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
            (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _check_regular(path: Path, lead: str, instead: str) -> None:
    """Refuse a file of an operand (``path``, links followed) that is a named pipe, a socket
    or a device: an operand is read in parts and more than once (a ``.npy`` file is
    memory-mapped, HDF5 and zarr seek in theirs), and opening a named pipe waits for a
    writer for ever. The message is ``lead``, what it is, ``instead``. Nothing is checked
    where ``path`` is a regular file, a folder, or does not exist.

    Raises
    ------
    ValueError
    """
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing, or not to be looked at: the open that follows says so
    what = next((name for test, name in _SPECIAL if test(mode)), None)
    if what is not None:
        raise ValueError(f"{lead} {what}, {instead}: distmm reads an operand in parts, more "
                         f"than once")


def _check_npy(path: Path) -> None:
    """Refuse, naming the file, a ``.npy`` file that ``np.load`` would not open as one
    array: a ``.npz`` archive (``np.load`` gives a lazy dictionary), a file without numpy's
    magic string (``np.load`` takes it for a pickle), an object array (pickled), a header
    whose shape is not of non-negative integers or is larger than numpy can address, data
    shorter than the header says (truncated)."""
    with open(path, "rb") as f:
        head = f.read(6)
        if head[:4] == b"PK\x03\x04":
            import zipfile

            try:
                with zipfile.ZipFile(path) as z:
                    names = [n.removesuffix(".npy") for n in z.namelist()]
            except (zipfile.BadZipFile, OSError):
                names = []
            held = f" (arrays: {', '.join(names)})" if names else ""
            raise ValueError(f"{path} is a .npz archive{held}, not a .npy file: save the array "
                             f"with numpy.save")
        if head and head != b"\x93NUMPY":
            raise ValueError(f"{path} is not a .npy file: it does not start with numpy's "
                             f"magic string")
        if not head:
            return  # empty: np.load's EOFError says so
        try:
            fmt = np.lib.format
            f.seek(0)
            version = fmt.read_magic(f)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
            have = os.fstat(f.fileno()).st_size - f.tell()
        except (ValueError, EOFError, SyntaxError):
            return  # np.load's own error says what is wrong
    # numpy's header check takes any int, True and -1 too, and its memory map then fails
    # with a TypeError or OverflowError that names no file
    if any(type(n) is not int or n < 0 for n in shape):
        raise ValueError(f"{path} is not a readable .npy file (its header's shape {shape} is "
                         f"not one of non-negative integers)")
    if dtype.hasobject:
        raise TypeError(f"{path} holds Python objects (dtype {dtype}, pickled): distmm does "
                        f"not unpickle files; save a numeric array")
    need = math.prod(shape) * dtype.itemsize
    most = np.iinfo(np.intp).max
    if need > most or any(n > most for n in shape):
        raise ValueError(f"{path} is not a readable .npy file (its header's shape {shape} of "
                         f"{dtype} is larger than numpy can address)")
    if have < need:  # a copy or a download cut short; numpy's memory map says "mmap length"
        raise ValueError(f"{path} is truncated: it holds {have} of the {need} bytes of data "
                         f"its header describes (shape {shape}, dtype {dtype})")


def _why(exc: BaseException) -> str:
    """A library's exception in a few words on one line: its text, else its type."""
    text = " ".join(str(exc).split()).strip("'\"")
    return f"{type(exc).__name__}: {text}" if isinstance(exc, KeyError) or not text else text


# ---------------------------------------------------------------- the .npy writer


class NpyWriter(BlockWriter):
    """A C-ordered ``.npy`` file written with ``os.pwrite``: ``out[rows, cols] = tile``.

    A ``BlockWriter`` (shaped like the array it will hold; ``writer[...]``
    reads back) that creates the file and its header. Writes raise ``OSError``
    on a full disk or a file-size limit.

    Parameters
    ----------
    path : path
        The file to create (it must not exist).
    shape : tuple of int
    dtype : dtype
    """

    def __init__(self, path, shape, dtype):
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise TypeError(f"cannot write dtype {dtype} to a .npy file without pickling")
        header = npy_header(shape, dtype)
        super().__init__(path, shape, dtype, len(header), create=True)
        try:
            self._pwrite(header, 0)
            if self._span is not None:  # blocks now: a full disk fails here, direct writes in place
                preallocate(self._fd, len(header), self.nbytes)
        except BaseException:
            self.close()
            raise

    def finish(self) -> None:
        """Give the file its full length and flush it to disk."""
        os.ftruncate(self._fd, self._offset + self.nbytes)
        super().finish()


# ---------------------------------------------------------------- staging


def check_space(t: Target, nbytes: int) -> None:
    """Refuse an output that cannot fit: the file system's free space, and the
    file-size limit (``ulimit -f``) for a single-file output, which HDF5 and a
    ``.npy`` file are (zarr writes one file per chunk). An HDF5 result for an
    existing file needs room twice, for its staged file and for its copy. The
    space of staged outputs that stopped or killed runs left beside the target
    counts as free: the run resumes (``--resume``) or removes them before it writes. A
    folder where the staged output cannot be created is refused first (``check_writable``),
    and an existing HDF5 file that another process holds open (``check_unlocked``), into which
    C could not be copied at the end. (A dataset path through a dataset, or into another file,
    is ``check_target``'s, which every caller runs first.)"""
    check_writable(t)
    check_unlocked(t)
    freed = reclaimable(t.path, t.dataset)
    if t.kind != "h5":
        check_room(t, t.path.parent, nbytes + (1 << 20) - freed,
                   None if t.kind == "zarr" else nbytes + 4096)
    elif t.path.exists():
        check_room(t, t.path.parent, 2 * (nbytes + H5_MARGIN) - freed,
                   t.path.stat().st_size + nbytes + H5_MARGIN)
    else:
        check_room(t, t.path.parent, nbytes + H5_MARGIN - freed, nbytes + H5_MARGIN)


def check_writable(t: Target) -> None:
    """Refuse, naming the target, a folder in which its staged output cannot be created
    (a read-only file system, no write permission, ``/proc``): a ``PermissionError``, bad
    input, instead of the staged file's hidden name in an error of the run. The staged name
    itself is created and removed (``distmm.cli.outputs.check_creatable``); an error that is
    not the folder's (a name too long, too many open files) is raised as the staging would
    meet it.

    Raises
    ------
    PermissionError
    """
    try:
        check_creatable(staged_path(t.path))
    except OSError as exc:
        if exc.errno not in REFUSED:
            raise
        why = "is on a read-only file system" if exc.errno == errno.EROFS else "is not writable"
        raise PermissionError(f"cannot write {t}: its folder {t.path.parent} {why} (distmm "
                              f"stages the output beside its target)") from None


def check_unlocked(t: Target) -> None:
    """Refuse, naming the target, an existing HDF5 file that another process holds open: HDF5
    locks a file it opens (shared for reading, exclusive for writing), so the copy of C into it
    would fail once the whole product is computed. Nothing is checked where this process
    itself has the file open (an operand of the product: its own lock), or where HDF5's
    locking is off (``HDF5_USE_FILE_LOCKING=FALSE``).

    Raises
    ------
    ValueError
    """
    if t.kind == "h5" and t.path.is_file() and _held_elsewhere(t.path):
        raise ValueError(f"cannot add {t.dataset!r} to {t.path}: the file is open in another "
                         f"process (HDF5's file lock), which would refuse the finished C; "
                         f"close it there first")


def _held_elsewhere(path: Path) -> bool:
    """Whether another process holds the HDF5 file ``path`` open (HDF5's lock, ``flock``);
    False where this process has it open itself, where HDF5's locking is off, or on a file
    system without ``flock``."""
    if os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper() == "FALSE":
        return False
    import fcntl

    if _own_ids(path):  # an operand's dataset, say
        return False
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # HDF5's own lock (flock); closing
        # the descriptor below releases it
    except BlockingIOError:
        return True
    except OSError:
        pass  # a file system without flock: HDF5 does not lock there either
    finally:
        os.close(fd)
    return False


def same_file(a: str, b: str) -> bool:
    """Whether two specs name the same HDF5 file (``x.h5:A`` and ``x.h5:C``)."""
    ta, tb = operand_target(a), operand_target(b)
    if ta.kind != "h5" or tb.kind != "h5":
        return False
    return _one_file(ta.path, tb.path)


def _one_file(p: Path, q: Path) -> bool:
    """Whether two paths name one file: one inode (a hard link, a bind mount, a link), else,
    where either does not exist, one resolved path."""
    try:
        return os.path.samefile(p, q)
    except OSError:
        try:
            return p.resolve() == q.resolve()
        except OSError:
            return False


def check_report(flag: str, path, files) -> None:
    """Refuse, before any work, a report file (``--profile``) that cannot be written or
    would replace one of the product's ``files`` (its operands or output). An existing
    report file is replaced, as a log is: its temporary (``PATH.tmp-PID``, then renamed, as
    ``distmm.phases.write_profile`` writes it) is created and removed here, so that a folder
    where no file can be made (no write permission, a read-only file system, ``/proc``) is
    refused now, not once C is in place.

    Raises
    ------
    FileNotFoundError
        Its folder does not exist.
    NotADirectoryError
        Its folder, or one above it, is a file (named).
    IsADirectoryError
        It names a folder.
    PermissionError
        No file can be created in its folder (``FileNotFoundError`` where the file system says
        so), named as given.
    OSError
        This process's limits refuse the file (``EMFILE``, ``ENFILE``, ``ENOMEM``).
    ValueError
        It names an operand or the output.
    """
    p = Path(path)
    folder = p.parent
    blocked = file_in_the_way(p)  # its folder, or one above it, is a file
    if blocked is not None:
        raise NotADirectoryError(f"{flag} {p}: {blocked} is a file, not a folder")
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder for {flag} {p}: {folder}")
    if p.is_dir():
        raise IsADirectoryError(f"{flag} {p} is a directory; name a file, e.g. {p}/profile.json")
    own = p.resolve()
    for spec in files:
        if operand_target(str(spec)).path.resolve() == own:
            raise ValueError(f"{flag} {p} is also the product's {spec}: name another file")
    try:  # a dead run's temporary under this PID is left: replaced as the report is written
        check_creatable(f"{p}.tmp-{os.getpid()}")
    except OSError as exc:
        if is_process_limit(exc):  # this process's, not the file's: the run's failure
            raise OSError(exc.errno, f"cannot create the {flag} file ({exc.strerror})",
                          str(p)) from None
        made = OSError(exc.errno, "")  # the subclass of its errno; an input's error, status 2
        kind = type(made) if isinstance(made, (FileNotFoundError, PermissionError)) \
            else PermissionError
        raise kind(exc.errno, f"cannot create the {flag} file ({exc.strerror})", str(p)) from None


@contextmanager
def staged_output(spec: str, shape: tuple[int, ...], dtype, *, overwrite: bool = False,
                  checked: bool = False):
    """Yield an empty array to fill (an ``NpyWriter``, a zarr array, or for HDF5
    a ``BlockWriter`` on the staged file's dataset) that replaces ``spec`` only
    when the block exits without an error. ``checked``: the caller ran ``check_target``
    on ``spec`` itself before its work began (a zarr target's check walks the whole old
    array; ``put_in_place`` looks at it again before it replaces it).

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
    if not checked:
        check_target(t, overwrite)
    try:
        with _staged(t, shape, dtype, overwrite) as out:
            yield out
    except OSError as exc:
        ours = exc.filename is None or is_within(exc.filename, staged_path(t.path))
        if exc.errno is not None and ours:
            # (a file of the staged output, removed now, is no name to give the user)
            raise OSError(exc.errno, f"{os.strerror(exc.errno)} while writing {t}; the partial "
                                     f"output was removed") from exc
        raise


@contextmanager
def _staged(t: Target, shape, dtype, overwrite: bool):
    check_space(t, math.prod(shape) * dtype.itemsize)  # exact: np.prod wraps at 2**63
    tmp = staged_path(t.path)
    try:
        if t.kind in ("npy", "h5"):
            if t.kind == "npy":
                writer = NpyWriter(tmp, shape, dtype)
            else:  # a hidden HDF5 file holding only the new dataset
                writer = BlockWriter(tmp, shape, dtype, create_h5_stage(tmp, t.dataset, shape, dtype))
            try:
                yield writer
                writer.finish()
            finally:
                writer.close()
            if t.kind == "npy":
                put_in_place(tmp, t.path, overwrite=overwrite)
            else:
                _close_own(t.path)  # an operand's file, read-only: HDF5 opens it once here
                commit_h5(tmp, t.path, t.dataset, overwrite=overwrite)
            return
        import zarr

        try:
            yield zarr.open_array(str(tmp), mode="w-", shape=shape, dtype=dtype,
                                  zarr_format=zarr_format_for(t.path))
        except BaseException:
            _settle_zarr()  # its other chunks' writes would make the folder again
            raise
        put_in_place(tmp, t.path, overwrite=overwrite)  # an existing zarr array (checked
        # above) swapped out
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            remove_tree(tmp)  # our own staged array, never the target
        elif tmp.exists():
            tmp.unlink()


#: seconds a failed run waits for zarr's chunk writes still in flight
ZARR_SETTLE = 10.0


def _settle_zarr() -> None:
    """Wait (up to ``ZARR_SETTLE`` seconds) for the writes zarr still runs on its event loop:
    an assignment whose chunk write failed (a full disk, the file-size limit) ends at once
    while its other chunks' writes go on, and one finishing after the staged folder was
    removed makes it again (``c/0/1.HEX.partial``)."""
    import asyncio

    from zarr.core.sync import sync

    async def others() -> None:
        me = asyncio.current_task()
        rest = [task for task in asyncio.all_tasks() if task is not me]
        if rest:
            await asyncio.wait(rest, timeout=ZARR_SETTLE)

    try:
        sync(others())
    except Exception:  # noqa: BLE001 - zarr's loop gone: nothing of it runs
        pass


def _own_ids(path: Path) -> list:
    """The HDF5 objects this process holds open in the file ``path`` (an operand's dataset,
    say), under any of its names (``_one_file``)."""
    import h5py

    ids = []
    for oid in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_ALL):
        try:
            if oid.valid and _one_file(Path(os.fsdecode(h5py.h5f.get_name(oid))), path):
                ids.append(oid)
        except (OSError, ValueError):
            continue
    return ids


def _close_own(path: Path) -> None:
    """Close this process's handles on the HDF5 file ``path`` (its operands, read): HDF5 opens
    a file a second time only in the same mode, and C is copied into it for writing."""
    import h5py

    for oid in _own_ids(path):
        try:
            if oid.valid:  # not closed with an earlier one's file
                h5py.File(h5py.h5i.get_file_id(oid)).close()  # with every object in it
        except (OSError, ValueError):
            continue


def write_atomic(spec: str, array, *, overwrite: bool = False) -> None:
    """Write ``array`` to ``spec`` (``.npy``, ``.zarr`` or ``file.h5:dataset``),
    replacing an existing target (with ``overwrite``) only once the new one is
    complete."""
    array = np.asarray(array)
    with staged_output(spec, array.shape, array.dtype, overwrite=overwrite) as out:
        out[...] = array
