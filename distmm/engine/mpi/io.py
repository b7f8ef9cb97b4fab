"""Per-rank block reads and writes for distributed matrices.

This module covers: opening ``.npy`` (a read-only memmap), zarr arrays and
``file.h5:dataset`` so that each rank reads only its block, and writing a
``DistArray`` to one staged output (``.NAME.distmm-partial-PID`` beside the
target, PID of rank 0) that takes the final name only after every rank
reported success (an ``allreduce``):

- ``.npy``: rank 0 writes the header, then every rank writes its own block at
  once with ``os.pwrite`` (disjoint byte ranges of one file);
- HDF5 (``file.h5:C``): rank 0 creates the hidden staged HDF5 file holding
  only ``C``, contiguous and allocated (``distmm.staging``); every rank writes
  its block at once with ``os.pwrite`` at the data's offset, as for ``.npy``
  (no parallel HDF5 needed); rank 0 then commits it: a rename when
  ``file.h5`` does not exist, else a copy into it that touches no other
  dataset;
- zarr: ranks write their blocks in turn, rank 0 first, a barrier between
  turns, so no two processes ever write the same zarr chunk.

On failure on any rank the staged output is removed and the target is left as
it was. ``parse_spec`` and ``StripeWriter`` live in ``distmm.stripe_writer`` (the Dask
engine's workers use them too); they are re-exported here.

A target is refused before anything is written, on every rank, as the command
line refuses it (``distmm.staging.check_target``, run on rank 0): an existing
target without ``overwrite``, and whatever ``overwrite``, a folder, a zarr
group or an HDF5 group. It does *not* cover: the command line's other checks
before a run (free space: ``distmm.cli.io``), which the command runs on rank 0
before computing.
"""
from __future__ import annotations

import math
import os

import numpy as np

from distmm.config import get_config
from distmm.engine.mpi.agree import agree, shared_error
from distmm.direct_io import npy_header, preallocate
from distmm.staging import (BlockWriter, check_target, commit_h5, create_h5_stage, put_in_place,
                            remove_tree, staged_path)
from distmm.stripe_writer import (FileSpec, StripeWriter, check_dtype, output_spec, parse_spec,
                                  zarr_format_for)

__all__ = ["open_block_source", "write_blocks", "FileSpec", "parse_spec", "create_staged",
           "StripeWriter", "finish_staged", "staged_exists"]

class _Source:
    def __init__(self, array, handle=None):
        self.array, self.handle = array, handle

    def close(self):
        if self.handle is not None:
            self.handle.close()


def open_block_source(spec: str) -> _Source:
    """Open a stored 2-D array for slicing (nothing is read yet).

    Raises
    ------
    FileNotFoundError
        No such file, or no such HDF5 dataset.
    ValueError
        An unsupported suffix, an array that is not 2-D, or a file that is not of its
        suffix's format (not numpy's, an object array, a zarr group, not HDF5), named.
    """
    f = parse_spec(spec)
    if not f.path.exists():
        raise FileNotFoundError(f"no such file: {f.path}")
    if f.kind == "npy":
        src = _Source(_load_npy(f.path))
    elif f.kind == "zarr":
        import zarr

        try:
            src = _Source(zarr.open_array(str(f.path), mode="r"))
        except (ValueError, TypeError, KeyError) as exc:  # a group, a folder of no array
            raise ValueError(f"{f.path} is not a readable zarr array ({_why(exc)})") from None
    else:
        import h5py

        try:
            fh = h5py.File(f.path, "r")
        except OSError as exc:  # HDF5's messages do not name the file
            if isinstance(exc, PermissionError):
                raise
            raise ValueError(f"{f.path} is not a readable HDF5 file ({_why(exc)})") from None
        node = fh.get(f.dataset)
        if not isinstance(node, h5py.Dataset):
            fh.close()
            raise FileNotFoundError(f"no dataset {f.dataset!r} in {f.path}")
        src = _Source(node, fh)
    if src.array.ndim != 2:
        src.close()
        raise ValueError(f"{spec} has shape {tuple(src.array.shape)}; a DistArray is 2-D")
    return src


def _load_npy(path):
    """A read-only memmap of the ``.npy`` file ``path``; ValueError naming it where it is
    not one numpy reads without unpickling (np.load takes a file without numpy's magic
    string for a pickle, and its messages do not name the file)."""
    with open(path, "rb") as fh:
        if fh.read(6) != b"\x93NUMPY":
            raise ValueError(f"{path} is not a .npy file: it does not start with numpy's "
                             f"magic string")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as exc:  # an object array, a cut header
        empty = _empty_npy(path)  # numpy 1.x maps no array of no elements
        if empty is not None:
            return empty
        raise ValueError(f"{path} is not a readable .npy file ({_why(exc)})") from None


def _empty_npy(path):
    """The array of no elements the ``.npy`` file ``path`` holds, read-only; None for
    another file or a header that does not read."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as fh:
            version = fmt.read_magic(fh)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read(fh)
    except (ValueError, EOFError, OSError):
        return None
    if dtype.hasobject or math.prod(shape) != 0:  # an array with elements: its own error
        return None
    x = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
    x.flags.writeable = False
    return x


def _why(exc: BaseException) -> str:
    """A library's exception on one line: its text, else its type."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _create(f: FileSpec, shape, dtype, pid: int, chunks=None):
    """Rank 0: create the empty staged output; return the byte offset of the
    data (``.npy`` and HDF5) or None (zarr, chunked as ``chunks`` when given)."""
    if f.kind == "npy":
        path = staged_path(f.path, pid)
        head = npy_header(shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        with open(path, "xb") as fh:
            fh.write(head)
            fh.truncate(len(head) + nbytes)
            fh.flush()
            if get_config().direct_writes:  # blocks now: a full disk fails before any work
                preallocate(fh.fileno(), len(head), nbytes)
        return len(head)
    if f.kind == "zarr":
        import zarr

        staged = str(staged_path(f.path, pid))
        if chunks is None:
            zarr.open_array(staged, mode="w-", shape=shape, dtype=dtype,
                            zarr_format=zarr_format_for(f.path))
        else:
            # the batch path's chunks: every rank's stripes cover whole chunks; stored
            # uncompressed (dense floating-point products hardly compress, and compressing
            # would cost the writers more than the disk saves)
            zarr.create_array(staged, shape=shape, dtype=dtype, chunks=tuple(int(c) for c in chunks),
                              compressors=None, zarr_format=zarr_format_for(f.path))
        return None
    return create_h5_stage(staged_path(f.path, pid), f.dataset, shape, dtype)


def _write_own(f: FileSpec, dist, pid: int, header) -> None:
    r0, r1, c0, c1 = dist.layout.local_bounds(dist.comm.rank)
    if r1 <= r0 or c1 <= c0:
        return
    block = dist._host_local()
    if f.kind == "zarr":
        import zarr

        zarr.open_array(str(staged_path(f.path, pid)), mode="r+")[r0:r1, c0:c1] = block
        return
    writer = BlockWriter(staged_path(f.path, pid), dist.shape, dist.dtype, header)
    try:
        writer[r0:r1, c0:c1] = block
        writer.finish()
    finally:
        writer.close()


def _finish(f: FileSpec, pid: int, ok: bool, overwrite: bool) -> None:
    """Rank 0: move the staged output to the target, or remove it."""
    staged = staged_path(f.path, pid)
    if ok and f.kind == "h5":
        commit_h5(staged, f.path, f.dataset, overwrite=overwrite)
        return
    if not ok:
        if staged.is_dir() and not staged.is_symlink():
            remove_tree(staged)  # also under a small open-file limit
        else:
            try:
                staged.unlink()
            except (FileNotFoundError, NotADirectoryError):  # never made (a path through a file)
                pass
        return
    put_in_place(staged, f.path, pid, overwrite=overwrite)


def _agree(comm, ok: bool, error: BaseException | None):
    """Every rank learns whether all succeeded, and rank 0's view of the first error."""
    from mpi4py import MPI

    all_ok = comm.allreduce(1 if ok else 0, op=MPI.MIN) == 1
    if all_ok:
        return True, None
    messages = comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
    first = next((m for m in messages if m), "another rank failed")
    return False, first


def write_blocks(spec: str, dist, *, overwrite: bool = False) -> None:
    """Write a ``DistArray`` to ``spec``; every rank calls it.

    The target is checked on rank 0 before anything is written, as the command
    line checks it (``distmm.staging.check_target``): a folder, a zarr group or an
    HDF5 group is never replaced, even with ``overwrite``. Every error below is
    raised on every rank.

    Raises
    ------
    FileExistsError
        The target exists and ``overwrite`` is false.
    IsADirectoryError
        The target is a folder where a ``.npy`` or HDF5 file would go, a zarr
        group, a folder that is no zarr array, or an HDF5 group.
    FileNotFoundError
        The target's folder does not exist.
    ValueError, TypeError
        A name or a dtype the command line refuses too (``output_spec``,
        ``check_dtype`` of ``distmm.stripe_writer``); ``ValueError``: ranks that passed
        different names or ``overwrite``.
    OSError
        Writing or moving the output into place failed on some rank; the
        staged output is removed, nothing is left under the final name (or the
        old target is left as it was).
    """
    comm = dist.comm
    dtype = np.dtype(dist.dtype)
    error = None
    try:
        f = output_spec(spec)  # the command line's refusals of a name and a dtype
        check_dtype(f, dtype)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    # a refusal on some ranks only (they were given other names) is raised on every rank:
    # the others would wait for them in the broadcasts below
    agree(comm, error, (), into=set(), when="in DistArray.to_file")
    if comm.size > 1:
        asked = comm.allgather((os.fspath(spec), bool(overwrite)))
        other = next((r for r, x in enumerate(asked) if x != asked[0]), None)
        if other is not None:
            raise ValueError(f"to_file needs the same file and overwrite on every rank: "
                             f"{asked[0][0]!r} (overwrite={asked[0][1]}) on rank 0, "
                             f"{asked[other][0]!r} (overwrite={asked[other][1]}) on rank {other}")
    pid = comm.bcast(os.getpid() if comm.rank == 0 else None, root=0)
    header, error = None, None
    if comm.rank == 0:
        try:
            if check_target(f, True) and not overwrite:  # the command line's refusals
                raise FileExistsError(f"{spec} exists: pass overwrite=True to replace it")
            header = _create(f, dist.shape, dtype, pid)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            try:
                _finish(f, pid, False, overwrite)  # a half-created staged output, if any
            except OSError:
                pass  # the refusal is the error to report: every rank waits for it below
    error = shared_error(comm, error)  # the same exception on every rank
    if error is not None:
        raise error
    header = comm.bcast(header, root=0)
    error = None
    if f.kind != "zarr":
        try:
            _write_own(f, dist, pid, header)
        except Exception as exc:  # noqa: BLE001
            error = exc
    else:
        for turn in range(comm.size):
            if turn == comm.rank:
                try:
                    _write_own(f, dist, pid, header)
                except Exception as exc:  # noqa: BLE001
                    error = exc
            comm.Barrier()
    ok, message = _agree(comm, error is None, error)
    rename_error = None
    if comm.rank == 0:
        try:
            _finish(f, pid, ok, overwrite)
        except Exception as exc:  # noqa: BLE001
            rename_error = f"{type(exc).__name__}: {exc}"
            try:
                _finish(f, pid, False, overwrite)  # the staged output, if the move left it
            except OSError:
                pass  # the move's error is the one to report
    rename_error = comm.bcast(rename_error, root=0)
    if not ok:
        raise OSError(f"writing {spec} failed ({message}); the partial output was removed")
    if rename_error:
        raise OSError(f"writing {spec} failed while moving it into place ({rename_error}); "
                      f"the partial output was removed")


# ---------------------------------------------------------------- stripes, for the batch path


def create_staged(spec: str, shape, dtype, pid: int, *, chunks=None):
    """Rank 0: create the staged output of ``spec`` for ``pid`` (see ``_create``); a failure
    removes what was made. Returns the data's byte offset (``.npy``, HDF5) or None (zarr)."""
    f = parse_spec(spec)
    try:
        return _create(f, shape, np.dtype(dtype), pid, chunks)
    except BaseException:
        _finish(f, pid, False, False)
        raise


def staged_exists(spec: str, pid: int) -> bool:
    return staged_path(parse_spec(spec).path, pid).exists()


def finish_staged(spec: str, pid: int, ok: bool, *, overwrite: bool = False) -> None:
    """Rank 0, once every rank is done: move the staged output onto the target (``ok``)
    or remove it."""
    _finish(parse_spec(spec), pid, ok, overwrite)
