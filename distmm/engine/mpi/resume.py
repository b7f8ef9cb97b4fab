"""What a stopped batch product keeps so that a rerun computes only what is missing.

This module covers: the manifest of a resumable run (``STAGED.resume.json`` beside the staged
output ``.NAME.distmm-partial-PID``: the arguments, each input's shape, dtype, size,
modification time, inode number and status-change time, and those of the other files an HDF5
input's data lies in (external links, virtual datasets), the result dtype, the backend as
resolved (compared except between the CPU backends of an integer product, whose bits they do
not change), the rank count, the grid, its stripes and the k panels each stripe is summed
over (so a rerun that would add in another order is refused), each rank's GPU (``gpu_facts``:
its model and cuBLAS, and the kernel and parameters distmm's own kernels run with, which
``distmm tune`` may change) or BLAS where
its products go through numpy's (``blas_facts``: the library, the kernel it chose for the
CPU and its threads), which decide the order of a product's sums, the staged output's name and data offset), the per-rank logs of
finished stripes (``STAGED.done-RANK``: one stripe index per line, appended and flushed to
disk only after the stripe's bytes were: the staged file's, or a zarr folder's chunk files and
the folders that name them) and of their checksums (``STAGED.sums-RANK``: ``STRIPE CRC32``
per line, the CRC-32 of the stripe's bytes as C's dtype in C order, taken from the stripe in
memory as it is written, flushed before the stripe's index is logged),
comparing a manifest with a new run's (one line naming what changed; ``short``: a kept staged
file shorter than it was made; ``unwritten``: logged stripes whose chunk files a kept zarr folder
lost, computed again; ``damaged``: logged stripes read back whose bytes no longer match their
checksum, computed again, each said in one line; ``drop_temporaries``: the chunks a killed run
was writing, which zarr writes under a temporary name; ``Manifest.load``: a damaged manifest
named), and finding the staged outputs that earlier runs left beside a target (a ``kill -9``
leaves them; a run started without ``--resume`` names and removes them, one with ``--resume``
takes the one whose manifest matches, and refuses while another run holds one: a ``--resume``
run holds its manifest's claim from the moment it is saved; ``distmm.staging`` finds, claims
and removes them).

It does *not* cover: computing or writing stripes (``distmm.engine.mpi.stream``) or the
command line's messages (``distmm.cli.mpi_matmul``).
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from distmm.staging import MANIFEST_SUFFIX, fsync_paths, is_process_limit

__all__ = ["Manifest", "input_facts", "inputs_now", "manifest_path", "done_log_path", "read_done",
           "DoneLog", "mismatch", "short", "unwritten", "blas_facts", "gpu_facts",
           "drop_temporaries", "sums_path", "read_sums", "checksum", "damaged"]

FORMAT = "distmm-resume-1"
#: what a manifest's ``checksums`` names: its ranks log each stripe's CRC-32 (``sums_path``);
#: a manifest without it (written before checksums were) has its stripes trusted unread
CHECKSUM = "crc32"
#: bytes of a kept staged file read back at a time (``damaged``)
READ_BYTES = 16 << 20


def manifest_path(staged: Path) -> Path:
    return Path(f"{staged}{MANIFEST_SUFFIX}")


def done_log_path(staged: Path, rank: int) -> Path:
    return Path(f"{staged}.done-{rank}")


def sums_path(staged: Path, rank: int) -> Path:
    return Path(f"{staged}.sums-{rank}")


def canonical(spec: str) -> str:
    """``spec`` with its file's path made absolute and resolved (``x/C.npy`` run from
    ``/tmp`` and ``/tmp/x/C.npy`` are one file), and its dataset, if any, after a colon."""
    from distmm.engine.mpi.io import parse_spec

    f = parse_spec(str(spec))
    return str(f.path.resolve()) + (f":{f.dataset}" if f.dataset else "")


def input_facts(spec: str, array) -> dict:
    """What identifies an input: its spec, shape, dtype, and its file's size, modification
    time, inode number and status-change time (which ``os.utime`` cannot set back); for a
    zarr folder the size of its files together, the newest of their times, and the folder's
    inode number."""
    from distmm.engine.mpi.io import parse_spec

    path = parse_spec(spec).path
    if path.is_dir():
        stats = [p.stat() for p in path.rglob("*") if p.is_file()]
        size = sum(st.st_size for st in stats)
        mtime = max((st.st_mtime_ns for st in stats), default=0)
        ctime = max((st.st_ctime_ns for st in stats), default=0)
        inode = path.stat().st_ino
    else:
        st = path.stat()
        size, mtime, ctime, inode = st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino
    return {"spec": str(spec), "file": canonical(spec), "shape": [int(s) for s in array.shape],
            "dtype": str(array.dtype), "bytes": int(size), "mtime_ns": int(mtime),
            "inode": int(inode), "ctime_ns": int(ctime), "sources": _sources(path, array)}


def _sources(path: Path, array) -> list:
    """The files other than ``path`` that hold an HDF5 dataset's data, each as ``[file, size,
    modification time, inode, status-change time]`` (a missing one as ``[file]``): the file an
    external link leads to, a virtual dataset's sources and external raw storage. Empty for
    every other input."""
    fh = getattr(array, "file", None)
    if fh is None or not hasattr(array, "is_virtual"):
        return []
    own = Path(fh.filename).resolve()
    names = [own]
    if array.is_virtual:
        names += [_near(own, vs.file_name) for vs in array.virtual_sources()]
    # external raw storage: HDF5 reads it from the working folder
    names += [Path(os.fsdecode(name)).resolve() for name, *_ in (array.external or ())]
    found = []
    for name in dict.fromkeys(names):  # in order, once each
        if name == path.resolve():
            continue
        try:
            st = name.stat()
            found.append([str(name), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
        except OSError:
            found.append([str(name)])
    return found


def _near(anchor: Path, name) -> Path:
    """A file HDF5 names from inside ``anchor`` (``"."``: ``anchor`` itself), as HDF5 finds it
    first: beside ``anchor``, else from the working folder."""
    name = os.fsdecode(name)
    if name == ".":
        return anchor
    beside = anchor.parent / name
    return (beside if beside.exists() else Path(name)).resolve()


#: the names numpy's OpenBLAS builds give their functions (prefix, suffix): numpy 2's
#: scipy-openblas wheels, numpy 1's wheels, a system OpenBLAS
_OPENBLAS = (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", ""))
#: the variables a BLAS takes its thread count from when it loads
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS",
                "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def blas_facts() -> dict:
    """What of numpy's BLAS decides a product's bits besides its operands: for OpenBLAS its
    configuration (version, build), the kernel it chose for this CPU and its thread count
    (another kernel, or one thread instead of several, sums over k in another order); for
    another BLAS numpy's build of it, the CPUs this process may use and the thread variables
    (which fix its threads when it loads)."""
    import ctypes

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    try:
        lib = ctypes.CDLL(core._multiarray_umath.__file__)  # its symbols and its BLAS's
    except OSError:
        lib = None
    for prefix, suffix in _OPENBLAS:
        try:
            threads, config, kernel = (getattr(lib, f"{prefix}get_{name}{suffix}")
                                       for name in ("num_threads", "config", "corename"))
        except AttributeError:
            continue
        config.restype = kernel.restype = ctypes.c_char_p
        return {"blas": config().decode(errors="replace").strip(),
                "kernel": kernel().decode(errors="replace"), "threads": int(threads())}
    try:
        build = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{build.get('name')} {build.get('version')}"
    except Exception:  # noqa: BLE001 - an older numpy
        name = "unknown"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"blas": name, "cpus": cpus,
            "env": {v: os.environ[v] for v in _THREAD_VARS if v in os.environ}}


def gpu_facts(kernels: dict | None = None) -> dict:
    """What of this rank's GPU decides a product's bits besides its operands: the model and
    compute capability of its current device and the cuBLAS version (another GPU or another
    cuBLAS picks other kernels, which sum over k in another order), and ``kernels``: what
    selects distmm's own kernels (``GPUExecutor.kernel_facts``: the kernel and its parameters,
    which ``distmm tune`` may change, and the shape classes ``auto`` runs them for)."""
    import cupy

    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    return {"gpu": name.decode(errors="replace") if isinstance(name, bytes) else str(name),
            "cc": str(device.compute_capability),
            "cublas": int(cupy.cuda.cublas.getVersion(device.cublas_handle)), **(kernels or {})}


def short(staged: Path, manifest: dict, shape, dtype) -> str | None:
    """One phrase where the kept staged file is shorter than the run made it (its header and
    the result's bytes), or None (zarr folders: ``unwritten``)."""
    if staged.is_dir() or manifest.get("header") is None:
        return None
    import numpy as np

    want = int(manifest["header"]) + int(np.prod(shape)) * np.dtype(dtype).itemsize
    have = staged.stat().st_size
    if have < want:
        return f"its staged output holds {have} of the {want} bytes it was made with"
    return None


def unwritten(staged: Path, regions: dict) -> set[int]:
    """The stripes of ``regions`` (stripe: ``(r0, r1, c0, c1)`` of C) that a kept zarr folder
    no longer holds whole: a chunk file they wrote into is gone (a cleaner, a ``find -delete``),
    which zarr would read as its fill value. Empty for a staged file (``short`` checks those).
    A chunk that held only fill values is never stored: its stripes are computed again too."""
    if not staged.is_dir():
        return set()
    import zarr

    array = zarr.open_array(str(staged), mode="r")
    return {stripe for stripe, region in regions.items()
            if not all(f.is_file() for f in _chunk_files(staged, array, region))}


def drop_temporaries(staged: Path) -> int:
    """Remove from a kept zarr folder the files zarr's local store writes a chunk into before
    renaming it to the chunk's key (``KEY.HEX.partial``), which a run killed in the middle of
    a write leaves (they would go into place with C; the chunk itself is whole or absent).
    Returns how many."""
    if not staged.is_dir():
        return 0
    import re

    found = [p for p in staged.rglob("*.partial")
             if re.fullmatch(r".+\.[0-9a-f]{32}\.partial", p.name) and p.is_file()]
    for p in found:
        p.unlink(missing_ok=True)
    return len(found)


def _chunk_files(staged: Path, array, region) -> list[Path]:
    """The chunk files of the zarr folder ``staged`` (its ``array``) that the region
    ``(r0, r1, c0, c1)`` of C lies in."""
    return [staged / array.metadata.encode_chunk_key(key) for key in _chunks(array, region)]


def _chunks(array, region) -> list[tuple[int, int]]:
    """The indices of the chunks of the zarr ``array`` that the region ``(r0, r1, c0, c1)``
    lies in."""
    r0, r1, c0, c1 = region
    if r1 <= r0 or c1 <= c0:
        return []
    rows, cols = array.chunks
    return [(i, j) for i in range(r0 // rows, -(-r1 // rows))
            for j in range(c0 // cols, -(-c1 // cols))]


def checksum(block, dtype) -> int:
    """The CRC-32 of ``block``'s bytes as ``dtype`` (C's) in C order: what its region of a
    staged output holds once written."""
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(np.asarray(block).astype(dtype, copy=False)))


def read_sums(staged: Path, rank: int) -> dict[int, int]:
    """The checksums ``rank`` logged, by stripe (a stripe written again: its last; a torn
    last line or a damaged one is ignored). Raises the ``OSError`` of this process's limits
    (``EMFILE``), which says nothing of the log: taken for none, every kept stripe would be
    said to have no checksum."""
    try:
        text = sums_path(staged, rank).read_text()
    except OSError as exc:
        if is_process_limit(exc):
            raise
        return {}
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    sums = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            try:
                sums[int(parts[0])] = int(parts[1], 16)
            except ValueError:
                continue
    return sums


def damaged(staged: Path, rank: int, regions: dict, shape, dtype, header) -> dict[int, str]:
    """The stripes of ``regions`` (stripe: ``(r0, r1, c0, c1)`` of C, logged by ``rank``)
    whose bytes in the kept staged output (``shape`` and ``dtype`` C's; ``header``: a staged
    file's data offset) no longer match the checksum logged with them (a bad disk, a partial
    copy, an edit since), each with the one line that says so: they are computed again, never
    trusted. Every stripe is read back. One logged without a checksum is trusted where the
    manifest predates checksums (``CHECKSUM``), and computed again otherwise. A zarr chunk
    file that no longer decodes is removed (a stripe written into part of it reads it first):
    no stripe in it can be read back."""
    if not regions:
        return {}
    sums = read_sums(staged, rank)
    try:
        required = (Manifest.load(staged) or {}).get("checksums") is not None
    except ValueError:
        required = True
    found = {}
    read = _ZarrSums(staged, dtype) if staged.is_dir() else _FileSums(staged, shape, dtype, header)
    try:
        for stripe in sorted(regions):
            region = _region(regions[stripe])
            what = _rows(region, shape[1])
            if stripe not in sums:
                if required:
                    found[stripe] = (f"warning: {what} of C kept in {staged.name} have no "
                                     f"checksum logged: computed again")
                continue
            try:
                got = read(region)
            except Exception as exc:  # noqa: BLE001 - whatever stops them reading back
                found[stripe] = (f"warning: {what} of C kept in {staged.name} cannot be read "
                                 f"back ({_reason(exc)}): computed again")
                continue
            if got != sums[stripe]:
                found[stripe] = (f"warning: {what} of C kept in {staged.name} changed since "
                                 f"they were written (their checksum differs from the one "
                                 f"logged): computed again")
    finally:
        read.close()
    return found


class _Unreadable(Exception):
    """Why kept stripes cannot be read back, said as it is."""


def _reason(exc: BaseException) -> str:
    """An error reading a stripe back, in one line."""
    said = (str(exc).splitlines() or [""])[0]
    return said if isinstance(exc, _Unreadable) else f"{type(exc).__name__}: {said}"


def _rows(region, width: int) -> str:
    """A stripe's place in C as a warning says it: ``rows 0:25``, or with its columns where
    it has not all of them."""
    r0, r1, c0, c1 = region
    return f"rows {r0}:{r1}" + ("" if (c0, c1) == (0, width) else f", columns {c0}:{c1}")


class _FileSums:
    """Checksums of regions of a staged ``.npy`` or HDF5 file, read back at its data offset."""

    def __init__(self, staged: Path, shape, dtype, header):
        import numpy as np

        self.item = np.dtype(dtype).itemsize
        self.width = int(shape[1]) * self.item
        self.header = int(header)
        self.fd = os.open(staged, os.O_RDONLY)
        self.buffer = memoryview(bytearray(READ_BYTES))

    def __call__(self, region) -> int:
        r0, r1, c0, c1 = region
        if r1 <= r0 or c1 <= c0:
            return zlib.crc32(b"")
        span = (c1 - c0) * self.item
        if span == self.width:  # whole rows: one span
            spans = [(self.header + r0 * self.width, (r1 - r0) * self.width)]
        else:
            spans = ((self.header + r * self.width + c0 * self.item, span) for r in range(r0, r1))
        crc = 0
        for offset, nbytes in spans:
            while nbytes > 0:
                got = os.preadv(self.fd, [self.buffer[:min(nbytes, len(self.buffer))]], offset)
                if got <= 0:
                    raise _Unreadable("the file ends before them")
                crc = zlib.crc32(self.buffer[:got], crc)
                offset, nbytes = offset + got, nbytes - got
        return crc

    def close(self) -> None:
        os.close(self.fd)


class _ZarrSums:
    """Checksums of regions of a kept zarr folder, read through zarr. A chunk file that does
    not decode is removed (a stripe written into part of it reads it first), and every region
    in it cannot be read back."""

    def __init__(self, staged: Path, dtype):
        import zarr

        self.staged, self.dtype = staged, dtype
        self.array = zarr.open_array(str(staged), mode="r")
        self.removed: dict[tuple[int, int], str] = {}  # chunk: why

    def __call__(self, region) -> int:
        r0, r1, c0, c1 = region
        keys = _chunks(self.array, region)
        try:
            if not any(key in self.removed for key in keys):
                return checksum(self.array[r0:r1, c0:c1], self.dtype)
        except Exception:
            self._remove_undecodable(keys)
            if not any(key in self.removed for key in keys):
                raise
        raise _Unreadable(next(self.removed[key] for key in keys if key in self.removed))

    def _remove_undecodable(self, keys) -> None:
        rows, cols = self.array.chunks
        for i, j in keys:
            try:
                self.array[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            except Exception as exc:  # noqa: BLE001 - it does not decode
                name = self.array.metadata.encode_chunk_key((i, j))
                (self.staged / name).unlink(missing_ok=True)
                self.removed[(i, j)] = (f"chunk file {name} does not decode, removed: "
                                        f"{_reason(exc)}")

    def close(self) -> None:
        pass


class Manifest(dict):
    """A resumable run's facts (a dict, saved as JSON)."""

    @classmethod
    def make(cls, *, a: dict, b: dict, output: str, dtype: str, backend: str, ranks: int,
             grid: tuple, stripe_edges, panels, pid: int, header,
             precision: str = "highest", blas=None) -> "Manifest":
        """``blas``: each rank's ``gpu_facts()`` (a GPU rank) or ``blas_facts()`` (a CPU rank
        whose products go through numpy's BLAS), else None."""
        return cls(format=FORMAT, a=a, b=b, output=str(output), output_file=canonical(output),
                   dtype=str(dtype),
                   precision=str(precision),
                   backend=str(backend), ranks=int(ranks), grid=[int(g) for g in grid],
                   stripe_edges=[list(map(int, e)) for e in stripe_edges],
                   panels=[int(p) for p in panels], pid=int(pid),
                   header=None if header is None else int(header),
                   blas=list(blas) if blas is not None else [None] * int(ranks),
                   checksums=CHECKSUM)

    def save(self, staged: Path, *, hold: bool = False) -> int | None:
        """Write the manifest beside ``staged`` (whole, or not at all). ``hold``: return a
        descriptor holding its claim (``distmm.staging.claim``'s lock, taken before the
        manifest appears under its name, so no other run ever sees it unclaimed)."""
        import fcntl

        path = manifest_path(staged)
        tmp = Path(f"{path}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if hold:
                fcntl.flock(fd, fcntl.LOCK_EX)  # named after this run: no one else holds it
            with os.fdopen(os.dup(fd), "w") as fh:
                json.dump(self, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            raise
        if hold:
            return fd
        os.close(fd)
        return None

    @classmethod
    def load(cls, staged: Path) -> "Manifest | None":
        """The manifest beside ``staged``, or None where it has none (or one of another
        format). Raises ``ValueError`` naming it where it is damaged (it does not parse, or a
        field the run needs is missing or of the wrong kind), and the ``OSError`` of one that is
        there but cannot be read (this process's open-file limit, its permissions): taken for
        none, its staged output would be removed as a dead run's."""
        path = manifest_path(staged)
        try:
            with open(path) as fh:
                text = fh.read()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"its manifest {path.name} is damaged ({exc})") from None
        if isinstance(data, dict) and data.get("format") not in (FORMAT, None):
            return None
        for key, kinds in _FIELDS:
            if not isinstance(data, dict) or not isinstance(data.get(key, ...), kinds):
                raise ValueError(f"its manifest {path.name} is damaged (no valid {key!r})")
        return cls(data)


#: what a manifest must hold, and of which kinds
_FIELDS = (("format", str), ("a", dict), ("b", dict), ("output", str), ("dtype", str),
           ("backend", str), ("ranks", int), ("grid", list), ("stripe_edges", list),
           ("panels", list), ("pid", int), ("header", (int, type(None))))


def inputs_now(a_spec: str, a, b_spec: str, b) -> dict:
    """The inputs' facts as ``mismatch`` compares them: taken when a product starts and again
    before its C is moved into place, an input rewritten meanwhile is found (its C would mix
    old and new data)."""
    return {"a": input_facts(a_spec, a), "b": input_facts(b_spec, b)}


def mismatch(old: dict, new: dict) -> str | None:
    """One phrase naming what differs between two manifests, or None."""
    for key, what in (("a", "input A"), ("b", "input B")):
        o, n = old.get(key, {}), new.get(key, {})
        if o.get("file", o.get("spec")) != n.get("file", n.get("spec")):  # "file": resolved
            return f"{what} was {_named(o, n)}, now {_named(n, o)}"
        for field, label in (("shape", "shape"), ("dtype", "dtype"), ("bytes", "size"),
                             ("mtime_ns", "modification time"), ("inode", "inode number"),
                             ("ctime_ns", "status-change time")):
            if o.get(field) != n.get(field):
                return f"{what} ({n.get('spec')}) changed: its {label} differs"
        was, now = o.get("sources", []), n.get("sources", [])
        if was != now:
            changed = next((x[0] for x, y in zip(was, now) if x != y),
                           (was + now)[min(len(was), len(now))][0])
            return f"{what} ({n.get('spec')}) changed: {changed}, which holds its data, differs"
    if old.get("output_file", old.get("output")) != new.get("output_file", new.get("output")):
        o = {"spec": old.get("output"), "file": old.get("output_file")}
        n = {"spec": new.get("output"), "file": new.get("output_file")}
        return f"the output changed ({_named(o, n)} then, {_named(n, o)} now)"
    for key, label in (("dtype", "result dtype"), ("backend", "backend"),
                       ("ranks", "rank count"), ("grid", "process grid"),
                       ("stripe_edges", "stripes"), ("panels", "k panels of a stripe's sum")):
        if key == "backend" and _same_bits(old, new):
            continue
        if old.get(key) != new.get(key):
            if key in ("stripe_edges", "panels"):  # lists of edges: said as counts
                was, now = _count(old.get(key)), _count(new.get(key))
                if was == now:
                    return f"the {label} changed (as many, at other edges)"
                return f"the {label} changed ({was} then, {now} now)"
            return f"the {label} changed ({old.get(key)} then, {new.get(key)} now)"
    # a manifest written before precision= existed was a "highest" run
    if old.get("precision", "highest") != new.get("precision", "highest"):
        return (f"the precision changed ({old.get('precision', 'highest')} then, "
                f"{new.get('precision', 'highest')} now)")
    if "blas" in old:  # (a manifest written before blas= existed: not compared)
        return _blas_mismatch(old["blas"], new.get("blas"))
    return None


#: the CPU backends a manifest records (``resolve_backend``'s: ``"auto"`` is the CPU executor's
#: choice for an integer product, never a GPU's)
_CPU_BACKENDS = ("auto", "numba", "blas")


def _same_bits(old: dict, new: dict) -> bool:
    """Whether two runs' backends give C the same bits though they differ: an integer (or
    boolean) product on the CPU, whose wrapping sums are the same in any order, on numpy's loop
    or distmm's kernels (``"auto"`` takes either as the process goes)."""
    import numpy as np

    try:
        exact = np.dtype(new.get("dtype")).kind in "biu"
    except TypeError:
        return False
    return (exact and old.get("dtype") == new.get("dtype")
            and old.get("backend") in _CPU_BACKENDS and new.get("backend") in _CPU_BACKENDS)


def _blas_mismatch(old, new) -> str | None:
    """One phrase naming the first rank whose BLAS facts (``blas_facts``) differ, or None."""
    old, new = old or [], new or []
    for rank in range(max(len(old), len(new))):
        o = old[rank] if rank < len(old) else None
        n = new[rank] if rank < len(new) else None
        if o == n:
            continue
        who = "the" if len(new) == 1 else f"rank {rank}'s"
        o, n = o or {}, n or {}
        for field, label in (("blas", "BLAS"), ("kernel", "BLAS kernel"),
                             ("threads", "BLAS threads"), ("cpus", "CPUs"),
                             ("env", "BLAS thread variables"), ("gpu", "GPU"),
                             ("cc", "GPU's compute capability"), ("cublas", "cuBLAS version"),
                             ("raw", "GPU kernel"), ("prefer", "GPU kernel's shape classes")):
            if o.get(field) != n.get(field):
                hint = (" (OPENBLAS_NUM_THREADS or the CPUs a rank may use set them)"
                        if field == "threads" else
                        " (`distmm tune` rewrote the tuning cache, or this node's differs)"
                        if field in ("raw", "prefer") else "")
                return (f"{who} {label} changed ({_said(o.get(field))} then, "
                        f"{_said(n.get(field))} now), which changes the order of its "
                        f"sums{hint}")
        return f"{who} BLAS changed"
    return None


def _said(value) -> str:
    """A fact as a refusal says it: ``none`` for a missing one, a GPU kernel as ``dmma (BM=128,
    BN=256, ...)`` and a mapping as ``key=value`` pairs."""
    if value is None:
        return "none"
    if isinstance(value, dict) and set(value) == {"kernel", "params"}:
        return f"{value['kernel']} ({_said(value['params'])})"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _named(facts: dict, other: dict) -> str:
    """An input's or output's spec, or its resolved file where the specs read the same."""
    spec = facts.get("spec")
    return str(facts.get("file") or spec) if spec == other.get("spec") else str(spec)


def _count(edges) -> str:
    """Stripe edges per grid row (or k panel edges) as counts: ``"3 + 3"`` (or ``"3"``)."""
    if not edges:
        return "none"
    if isinstance(edges[0], list):
        return " + ".join(str(max(len(e) - 1, 0)) for e in edges)
    return str(max(len(edges) - 1, 0))


def read_done(staged: Path, rank: int) -> set[int]:
    """Stripes ``rank`` logged as written (a torn last line is ignored). Raises the
    ``OSError`` of this process's limits (``EMFILE``), which says nothing of the log: taken
    for none, no stripe would count as done."""
    try:
        text = done_log_path(staged, rank).read_text()
    except OSError as exc:
        if is_process_limit(exc):
            raise
        return set()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    return {int(x) for x in lines if x.strip().isdigit()}


class DoneLog:
    """This rank's log of finished stripes, appended and flushed to disk per stripe, each
    after the stripe's bytes were, so that a crash of the host never leaves a logged stripe
    unwritten: a staged file's written bytes (one ``fdatasync``), or a zarr folder's chunk
    files of the stripe (zarr writes each under a temporary name and renames it) and the
    folders that name them (``fsync``); and before each line, the stripe's checksum in its
    log of checksums (``sums_path``), taken as it was written through ``summed``'s writer."""

    def __init__(self, staged: Path, rank: int, *, fresh: bool = False):
        self.path = done_log_path(staged, rank)
        # a fresh run's logs start empty, whatever a dead run of the same PID left
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(self.path, flags, 0o644)
        self._sums = os.open(sums_path(staged, rank), flags, 0o644)
        self._written = None  # (region, checksum) of the last stripe written through summed
        self._staged = Path(staged)
        self._data = self._zarr = None
        if self._staged.is_dir():
            import zarr

            self._zarr = zarr.open_array(str(staged), mode="r")
        else:
            self._data = os.open(staged, os.O_RDONLY)

    def summed(self, sink) -> "_Summed":
        """``sink`` (a ``StripeWriter``), taking each block's checksum as it writes it, for
        ``add`` to log with the block's stripe."""
        return _Summed(sink, self)

    def add(self, stripe: int, region=None) -> None:
        """Log ``stripe``, written into ``region`` ``(r0, r1, c0, c1)`` of C (a zarr
        folder's: its chunk files are flushed first), with its checksum where it was written
        through ``summed``'s writer."""
        if self._data is not None:
            os.fdatasync(self._data)  # the stripe's bytes on disk before the line saying so
        elif region is not None:
            files = _chunk_files(self._staged, self._zarr, region)
            folders = {d for f in files for d in (f.parent, *f.parent.parents)
                       if d.is_relative_to(self._staged)}  # c/0 made for it names 0 in c/...
            fsync_paths([*files, *sorted(folders, reverse=True)])
        written, self._written = self._written, None
        if written is not None and region is not None and written[0] == _region(region):
            os.write(self._sums, f"{int(stripe)} {written[1]:08x}\n".encode())
            os.fdatasync(self._sums)
        os.write(self._fd, f"{int(stripe)}\n".encode())
        os.fsync(self._fd)

    def close(self) -> None:
        for name in ("_fd", "_sums", "_data"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


def _region(region) -> tuple[int, int, int, int]:
    return tuple(int(x) for x in region)


class _Summed:
    """A writer of C's blocks that notes each block's checksum (``checksum``, as its
    writer's dtype) in a ``DoneLog`` once written; the rest is its writer's."""

    def __init__(self, sink, log: DoneLog):
        self._sink, self._log = sink, log

    def write(self, r0: int, r1: int, c0: int, c1: int, block) -> None:
        self._sink.write(r0, r1, c0, c1, block)
        self._log._written = (_region((r0, r1, c0, c1)), checksum(block, self._sink.dtype))

    def __getattr__(self, name):
        return getattr(self._sink, name)
