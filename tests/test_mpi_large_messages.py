"""MPI messages past what one C int counts (2**31 - 1 bytes), which Open MPI 5 refuses
(``MPI_ERR_ARG``): the engine's point-to-point messages and broadcasts go in pieces
(``distmm.engine.mpi.pieces``). Real messages over 2 GiB on 2 ranks, and the engine end to
end with the piece size made a few bytes, so that small operands cross in several pieces."""
from __future__ import annotations

import pytest

from conftest import run_rank_script


def _available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            return int(dict(line.split(":", 1) for line in fh)["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


PIECES = r'''
import numpy as np
from mpi4py import MPI
from distmm.engine.mpi import pieces

comm = MPI.COMM_WORLD
rank = comm.rank
lines = []
n = 2**31 + 77  # past one count, and not a whole number of pieces
PERIOD = 251
pattern = comm.bcast(np.random.default_rng().integers(0, 256, PERIOD, dtype=np.uint8), root=0)
STEP = PERIOD << 18  # a whole number of periods


def patterned():
    block = np.resize(pattern, STEP)
    buf = np.empty(n, np.uint8)
    for lo in range(0, n, STEP):
        buf[lo:lo + STEP] = block[:min(STEP, n - lo)]
    return buf


def check(what, buf):
    # the pattern's first period, and every byte the one a period before it: all of it
    good = np.array_equal(buf[:PERIOD], pattern) and all(
        np.array_equal(buf[lo + PERIOD:min(lo + STEP, n - PERIOD) + PERIOD],
                       buf[lo:min(lo + STEP, n - PERIOD)]) for lo in range(0, n - PERIOD, STEP))
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD'}")


def attempt(what, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported
        lines.append(f"rank {rank}: {what}: BAD {type(exc).__name__}: {exc}")


buf = patterned() if rank == 0 else np.empty(n, np.uint8)
if rank:
    buf.fill(0)  # its pages made now: MPI filling them one at a time is much slower
if rank == 0:
    attempt("send", lambda: pieces.send(comm, buf, 1, tag=5))
else:
    attempt("recv", lambda: pieces.recv(comm, buf, 0, tag=5))
check("send/recv", buf)
if rank:
    buf[:] = 0
attempt("bcast", lambda: pieces.bcast(comm, buf, 0))
check("bcast", buf)
if rank:
    buf[:] = 0
attempt("ibcast", lambda: pieces.ibcast(comm, buf, 0).wait())
check("ibcast", buf)
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''

LAYERS = r'''
import numpy as np
from mpi4py import MPI
from distmm.engine.mpi import DistArray, MPIEngine
from distmm.grid import make_grid

comm = MPI.COMM_WORLD
rank = comm.rank
lines = []
rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy if rank == 0 else None))
m, n, k = 16401, 16399, 2  # a float64 C block of 2151622392 bytes: past one count
a = rng.integers(-9, 10, (m, k)).astype(np.float64)  # small integers: every sum is exact
b = rng.integers(-9, 10, (k, n)).astype(np.float64)
grid = make_grid(m, n, k, np.dtype(np.float64), ranks=2, grid=(2, 1, 1))
try:
    c = MPIEngine(comm).run_distributed(DistArray.from_array(a, comm),
                                        DistArray.from_array(b, comm), grid, "blas")
    good = c.stats["bytes_received"] == c.stats["bytes_estimated"]
    if rank == 0:
        step = 1024
        good = good and c.local.shape == (m, n) and c.local.dtype == np.float64 and all(
            np.array_equal(c.local[lo:lo + step], a[lo:lo + step] @ b) for lo in range(0, m, step))
    got = "ok" if good else f"BAD {c.stats}"
except Exception as exc:  # noqa: BLE001 - reported
    got = f"BAD {type(exc).__name__}: {exc}"
lines.append(f"rank {rank}: layers summed: {got}")
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''

SMALL = r'''
import numpy as np
from mpi4py import MPI
import distmm
from distmm.engine.mpi import DistArray, MPIEngine, pieces
from distmm.executor import resolve_backend
from distmm.grid import make_grid

comm = MPI.COMM_WORLD
rank = comm.rank
lines = []
rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy if rank == 0 else None))
engine = MPIEngine(comm)


def check(what, good):
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD'}")


def same(what, got, want):
    check(what, got.dtype == want.dtype and got.shape == want.shape
          and np.array_equal(got, want))


def operands(dt, m, k, n):
    if dt == "object":
        return (rng.integers(-9, 9, (m, k)).astype(object),
                rng.integers(-9, 9, (k, n)).astype(object))
    if np.dtype(dt).kind in "iu":
        return rng.integers(-99, 99, (m, k)).astype(dt), rng.integers(-99, 99, (k, n)).astype(dt)
    return rng.standard_normal((m, k)).astype(dt), rng.standard_normal((k, n)).astype(dt)


def on_grid(a, b, shape):
    (m, k), n = a.shape, b.shape[1]
    dtype = np.matmul(a[:0], b[:, :0]).dtype
    grid = make_grid(m, n, k, dtype, ranks=comm.size, grid=shape)
    backend, _ = resolve_backend("auto", dtype, family="numpy", flops=2 * m * n * k)  # matmul's
    c = engine.run_distributed(DistArray.from_array(a, comm), DistArray.from_array(b, comm),
                               grid, backend)
    check(f"{shape} {a.dtype} bytes", c.stats["bytes_received"] == c.stats["bytes_estimated"])
    return c.gather(root=None), c.stats["bytes_received"]


OPERANDS = [operands(dt, m, k, n) for dt, (m, k, n) in (
    ("float64", (9, 1001, 7)), ("int64", (13, 601, 5)), ("float16", (11, 901, 6)),
    ("longdouble", (7, 333, 5)), ("object", (5, 41, 3)))]


def products():
    out = []
    for a, b in OPERANDS:
        dt = a.dtype
        ref = np.matmul(a, b)
        # distmm.matmul's own grid: k split into layers for float64 and int64, B's panels
        # broadcast down a column of ranks for float16, long double and object
        got = distmm.matmul(a, b, engine="mpi")
        if dt == "float64":  # layers' sums: close to numpy, and the same bits every time
            check(f"matmul {dt}", got.dtype == ref.dtype and np.allclose(got, ref))
        else:
            same(f"matmul {dt}", got, ref)
        out.append(got)
        # forced grids: layers of whole-k panels sent to layer 0, panels broadcast
        for shape in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
            got, received = on_grid(a, b, shape)
            if dt == "float64":
                check(f"{shape} {dt}", np.allclose(got, ref))
            else:
                same(f"{shape} {dt}", got, ref)
            out += [got, received]
    return out


whole = products()
sizes = []
fits = pieces.fits
pieces.fits = lambda nbytes: sizes.append(nbytes) or fits(nbytes)
# every message past 300 bytes in pieces of 100, which cut through elements
pieces.MAX_COUNT, pieces.PIECE_BYTES = 300, 100
small = products()
# the pieces ran (messages past 300 bytes met) and changed no bit of any result
check("pieces used", max(sizes, default=0) > 300)
for x, y in zip(whole, small):  # bits and the bytes received
    if isinstance(x, np.ndarray) and x.dtype == np.float64:
        check("pieces change no bit", x.tobytes() == y.tobytes())
    else:
        same("pieces change no bit", np.asarray(y), np.asarray(x))
check("as many results", len(whole) == len(small) == 35)
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


def _run(mpirun, tmp_path, script: str, timeout: float):
    return run_rank_script(mpirun, tmp_path / "rank.py", script, 2, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_engine_moves_operands_in_pieces(tmp_path, mpirun):
    """On 2 ranks with messages made at most 300 bytes (pieces of 100): products whose k is
    split into layers (C blocks summed, whole-k panels sent to layer 0) and whose panels
    are broadcast (host buffers, pickled objects) give the bits they give in whole
    messages, numpy's where distmm promises them, and the bytes the plan expects."""
    r, lines, bad = _run(mpirun, tmp_path, SMALL, timeout=120)
    # per rank: 5 dtypes x 2 runs x (matmul, 3 grids x (bytes, bits)), then 37 lines
    assert len(lines) == 2 * (5 * 2 * 7 + 37) and not bad, \
        "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < 12 * 2**30, reason="needs 12 GiB of free memory")
def test_messages_past_two_gib(tmp_path, mpirun):
    """2**31 + 77 bytes sent, broadcast and broadcast without blocking on 2 ranks: every
    byte arrives (Open MPI refused each with ``MPI_ERR_ARG``)."""
    r, lines, bad = _run(mpirun, tmp_path, PIECES, timeout=300)
    assert len(lines) == 2 * 3 and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < 12 * 2**30, reason="needs 12 GiB of free memory")
def test_a_c_block_past_two_gib_is_summed_over_layers(tmp_path, mpirun):
    """A product whose k is split into 2 layers and whose C block has more than 2**31 - 1
    bytes: layer 1's block is sent to layer 0 (Open MPI refused the send with
    ``MPI_ERR_ARG`` and the job ended)."""
    r, lines, bad = _run(mpirun, tmp_path, LAYERS, timeout=300)
    assert len(lines) == 2 and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
