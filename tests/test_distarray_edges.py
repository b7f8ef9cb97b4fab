"""DistArray at its edges under real ``mpiexec``: layouts that do not fit the ranks, files
that fail on one rank only, lists that differ between ranks, files of the wrong format;
then shapes smaller than the grid, empty dimensions, numpy's dtypes and bits, unusual
blocks (Fortran-ordered, strided, read-only, big-endian, a memmap) and every file format.

Each test writes SCRIPT and runs it on every rank; the ranks gather their lines to rank 0,
which prints them (mpiexec may interleave the ranks' own writes), and the test asserts that
each rank printed every line it should and each says ``ok``. The fixture's timeout bounds a
hang: a rank left waiting for another fails the test.
"""
from __future__ import annotations

import pytest

from conftest import run_rank_script

SCRIPT = r'''
import os, sys
import numpy as np
from mpi4py import MPI
import distmm
from distmm import DistArray
from distmm.grid import BlockLayout

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
last = rank == P - 1
tmp = sys.argv[1]
lines = []


def refused(what, call, expect, words, alike=True):
    """call() raises ``expect`` (None: any type) on every rank: one line naming ``words``,
    the same on every rank (``alike=False``: the rank that refused names its own error,
    the others that rank and the error)."""
    try:
        call()
        got = "no error"
    except Exception as exc:  # noqa: BLE001 - checked below
        got = f"{type(exc).__name__}: {exc}"
    seen = comm.allgather(got)
    good = (got != "no error" and (expect is None or got.startswith(expect.__name__ + ": "))
            and words in got and "\n" not in got and (len(set(seen)) == 1 or not alike))
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD ' + repr(seen)}")


def same(what, got, want):
    """``got`` is ``want``: dtype, shape and bytes (object arrays: elements and types)."""
    if got is None or want is None:
        good = got is None and want is None
    elif want.dtype.kind == "O":
        good = (got.dtype == want.dtype and got.shape == want.shape
                and [(type(v), v) for v in got.ravel()] == [(type(v), v) for v in want.ravel()])
    else:
        good = (got.dtype == want.dtype and got.shape == want.shape
                and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes())
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD %r vs %r' % (got, want)}")


def fixes():
    x = np.arange(12.0 * P).reshape(4, 3 * P)
    columns = BlockLayout.grid(x.shape, 1, P)  # rank r reads columns 3r to 3r + 3
    if rank == 0:
        import h5py, zarr

        np.save(f"{tmp}/x.npy", x)
        z = zarr.create_array(f"{tmp}/x.zarr", shape=x.shape, dtype=x.dtype, chunks=(4, 3),
                              zarr_format=3)
        z[:] = x
        chunk = f"{tmp}/x.zarr/c/0/{P - 1}"  # the last rank's block, and only its
        assert os.path.isfile(chunk), chunk
        with open(chunk, "wb") as fh:
            fh.write(b"not zstd")
        with open(f"{tmp}/pickle.npy", "wb") as fh:
            fh.write(b"not numpy's format")
        np.save(f"{tmp}/objects.npy", np.arange(4).reshape(2, 2).astype(object))
        zarr.open_group(f"{tmp}/group.zarr", mode="w")
        with open(f"{tmp}/not.h5", "wb") as fh:
            fh.write(b"not HDF5")
    comm.Barrier()
    # a block only the last rank cannot read: the others waited for it in the next collective
    refused("a corrupt chunk in the last rank's block",
            lambda: DistArray.from_file(f"{tmp}/x.zarr", layout=columns).gather(None), None, "")
    # a layout only the last rank gives: it raised alone, or read another block
    other = BlockLayout.grid(x.shape, P, 1)
    refused("from_file another layout on the last rank",
            lambda: DistArray.from_file(f"{tmp}/x.npy", layout=other if last else columns),
            ValueError, f"same layout= on every rank: rank 0's and rank {P - 1}'s differ")
    wrong = BlockLayout.grid((5, 3 * P), 1, P)
    refused("from_file a layout for another shape on the last rank",
            lambda: DistArray.from_file(f"{tmp}/x.npy", layout=wrong if last else columns),
            ValueError, f"rank {P - 1}'s differ")
    # owners that are no ranks: their blocks were kept by no rank, gather gave garbage
    beyond = BlockLayout.grid(x.shape, 1, P + 1)
    owners = f"are not a 1 x {P + 1} grid of the ranks 0 to {P - 1}"
    refused("from_array owners past the last rank",
            lambda: DistArray.from_array(x, layout=beyond).gather(None), ValueError, owners)
    refused("from_file owners past the last rank",
            lambda: DistArray.from_file(f"{tmp}/x.npy", layout=beyond).gather(None),
            ValueError, owners)
    refused("from_array a layout that is no BlockLayout",
            lambda: DistArray.from_array(x, layout=(1, P)), TypeError, "BlockLayout")
    refused("from_file a layout that is no BlockLayout",
            lambda: DistArray.from_file(f"{tmp}/x.npy", layout=(1, P)), TypeError, "BlockLayout")
    # nested lists were never compared: a matrix mixing the ranks' lists
    refused("from_array lists that differ on the last rank",
            lambda: DistArray.from_array((x + last).tolist()).gather(None), ValueError,
            f"values differ between rank 0 and rank {P - 1}")
    # files not of their suffix's format: the error names the file
    for name in ("pickle.npy", "objects.npy", "group.zarr", "not.h5:A"):
        refused(f"from_file {name}", lambda: DistArray.from_file(f"{tmp}/{name}"), ValueError,
                f"{tmp}/{name.split(':')[0]} is not ")
    same("the ranks in step after the refusals",
         DistArray.from_file(f"{tmp}/x.npy", layout=columns).gather(P - 1), x if last else None)


def follow_ups():
    """Refusals one rank alone made, or that came after the work began, on 3 ranks."""
    a, b = np.arange(12.0).reshape(3, 4), np.arange(8.0).reshape(4, 2)
    # b's blocks on the ranks in reverse order: SUMMA paired the wrong panels (MPI_Abort)
    one = "both DistArrays must live on one communicator"
    refused("operands on the ranks in another order",
            lambda: distmm.matmul(DistArray.from_array(a, comm),
                                  DistArray.from_array(b, comm.Split(0, P - 1 - rank))),
            ValueError, one)
    refused("an operand on COMM_SELF, the other on every rank",
            lambda: distmm.matmul(DistArray.from_array(a), DistArray.from_array(b, MPI.COMM_SELF)),
            ValueError, one)
    same("an operand on a Dup", distmm.matmul(DistArray.from_array(a),
                                              DistArray.from_array(b, comm.Dup())).gather(None),
         a @ b)
    same("both on COMM_SELF", distmm.matmul(DistArray.from_array(a, MPI.COMM_SELF),
                                            DistArray.from_array(b, MPI.COMM_SELF)).gather(None),
         a @ b)
    # edges that decrease: only the rank owning the negative block raised, the others hung
    x = np.arange(12.0 * P).reshape(4, 3 * P)
    refused("row edges that decrease",
            lambda: DistArray.from_array(x, layout=BlockLayout(
                x.shape, (0, 3, 1, 4), (0, 3 * P), ((0,), (1,), (2,)))).gather(None),
            ValueError, "row edges (0, 3, 1, 4) decrease")
    refused("column edges that decrease",
            lambda: DistArray.from_array(x).redistribute(BlockLayout(
                x.shape, (0, 4), (0, 6, 2, 3 * P), ((0, 1, 2),))).gather(None),
            ValueError, f"column edges (0, 6, 2, {3 * P}) decrease")
    # from_array refused by the last rank alone: the others went on into a collective
    refused("from_array a vector on the last rank",
            lambda: DistArray.from_array(np.ones(3) if last else x), ValueError,
            "DistArray needs a 2-D array, got shape (3,)")
    refused("from_array a ragged list on the last rank",
            lambda: DistArray.from_array([[1.0, 2.0], [3.0]] if last else [[1.0, 2.0], [3.0, 4.0]]),
            ValueError, "inhomogeneous")
    refused("from_array a layout for another shape on the last rank",
            lambda: DistArray.from_array(x, layout=BlockLayout.grid((5, 3 * P), 1, P) if last
                                         else None), ValueError, "layout is for shape (5, ")
    # matmul cuts a replicated operand after the ranks agreed: a refusal on one rank first
    refused("matmul out= on the last rank only",
            lambda: distmm.matmul(DistArray.from_array(a), b, out=np.empty((3, 2)) if last
                                  else None), ValueError, "out= is not supported", alike=False)
    refused("matmul a replicated vector on the last rank",
            lambda: distmm.matmul(DistArray.from_array(a), np.ones(3) if last else b),
            ValueError, "b is 1-D beside a DistArray", alike=False)
    # a DistArray on one rank, an array every rank holds on the others: "the values of the
    # replicated b differ" on every rank
    b_dist = DistArray.from_array(b)
    refused("matmul b a DistArray on the last rank only",
            lambda: distmm.matmul(DistArray.from_array(a), b_dist if last else b), ValueError,
            "needs the same kind of operands on every rank: b is ", alike=False)
    # a vector beside a DistArray was "DistArray needs a 2-D array": numpy's result is 1-D
    refused("matmul a replicated vector on every rank",
            lambda: distmm.matmul(np.ones(a.shape[0]), DistArray.from_array(a)), ValueError,
            "matmul: a is 1-D beside a DistArray, whose product numpy makes 1-D and a "
            "DistArray cannot hold: pass a.reshape(1, -1)")
    # gemm read a DistArray as a 0-d array; tile= was not looked at
    refused("gemm of DistArrays", lambda: distmm.gemm(DistArray.from_array(a),
                                                      DistArray.from_array(b), engine="mpi"),
            TypeError, "gemm takes arrays, not DistArrays (a and b)")
    refused("gemm with c a DistArray",
            lambda: distmm.gemm(a, b, DistArray.from_array(a @ b), beta=1.0, engine="mpi"),
            TypeError, "gemm takes arrays, not DistArrays (c)")
    refused("matmul of DistArrays with tile=0",
            lambda: distmm.matmul(DistArray.from_array(a), b, tile=0), ValueError,
            "tile sizes must be positive, got (0, 0, 0)")
    refused("matmul of DistArrays with tile='big'",
            lambda: distmm.matmul(DistArray.from_array(a), DistArray.from_array(b), tile="big"),
            TypeError, "tile must be an int or (tm, tn, tk) of ints, got 'big'")
    refused("matmul of DistArrays with tile=0 on the last rank",
            lambda: distmm.matmul(DistArray.from_array(a), b, tile=0 if last else None),
            ValueError, "tile sizes must be positive", alike=False)
    same("matmul of DistArrays with tile=(2, 2, 2)",
         distmm.matmul(DistArray.from_array(a), b, tile=(2, 2, 2)).gather(None), a @ b)


def product(what, a, b, **layouts):
    got = distmm.matmul(DistArray.from_array(a, layout=layouts.get("la")),
                        DistArray.from_array(b, layout=layouts.get("lb"))).gather(None)
    same(what, got, np.matmul(a, b))


def battery():
    rng = np.random.default_rng(7)  # the same operands on every rank
    small = lambda shape, dt: rng.integers(-3, 4, shape).astype(dt)
    # shapes smaller than the grid and empty dimensions: numpy's bits (integer values)
    for m, k, n in [(1, 7, 5), (7, 1, 5), (7, 5, 1), (1, 1, 1), (2, 0, 3), (0, 3, 2), (3, 2, 0),
                    (0, 0, 0), (P + 1, 2 * P + 1, P)]:
        for dt in ("float64", "int64", "object"):
            product(f"{dt} {m}x{k}x{n}", small((m, k), dt), small((k, n), dt))
    # numpy's result dtype and bits
    for da, db in [("int8", "uint8"), ("bool", "bool"), ("float16", "float16"),
                   ("complex64", "complex64"), ("int8", "float16"), ("bool", "int16"),
                   ("uint8", "uint8"), ("object", "float64"), ("float32", "int64")]:
        product(f"{da} @ {db}", small((5, 7), da), small((7, 4), db))
    wrap = rng.integers(0, 256, (6, 9), dtype=np.uint8)  # sums that wrap, as numpy's do
    product("uint8 wrapping", wrap, wrap.T.copy())
    a, b = small((7, 5), "float64"), small((5, 6), "float64")
    product("layouts: the last rank, rank 0", a, b, la=BlockLayout.single(a.shape, P - 1),
            lb=BlockLayout.single(b.shape, 0))
    product("layouts: rows, columns", a, b, la=BlockLayout.grid(a.shape, P, 1),
            lb=BlockLayout.grid(b.shape, 1, P))
    same("DistArray @ ndarray", distmm.matmul(DistArray.from_array(a), b).gather(None), a @ b)
    same("ndarray @ DistArray", distmm.matmul(a, DistArray.from_array(b)).gather(None), a @ b)
    # blocks as users hold them: Fortran-ordered, strided, read-only, big-endian
    whole = np.arange(30.0 * P).reshape(3 * P, 10)
    mine = whole[3 * rank:3 * rank + 3]
    read_only = mine.copy()
    read_only.flags.writeable = False
    for what, block in [("Fortran", np.asfortranarray(mine)), ("strided", mine[:, ::2]),
                        ("read-only", read_only), ("big-endian", mine.astype(">f8"))]:
        d = DistArray.from_local(block, grid=(P, 1))
        want = np.concatenate([whole[3 * r:3 * r + 3] for r in range(P)])
        want = want[:, ::2] if what == "strided" else want
        same(f"from_local {what} gathered", d.gather(0), want.astype(block.dtype)
             if rank == 0 else None)
        same(f"from_local {what} multiplied", distmm.matmul(d, np.eye(want.shape[1])).gather(None),
             want @ np.eye(want.shape[1]))
    if rank == 0:
        np.save(f"{tmp}/whole.npy", whole)
    comm.Barrier()
    mapped = np.load(f"{tmp}/whole.npy", mmap_mode="r")
    same("from_array of a memmap", DistArray.from_array(mapped).gather(None), whole)
    # every format, odd and empty sizes, read back bitwise
    for shape in [(1, 1), (P + 2, 2 * P + 1), (0, 3)]:
        for dt in ("float64", "int8", "bool", "complex64", "float16", ">f8"):
            x = small(shape, dt)
            for spec in (f"{tmp}/c.npy", f"{tmp}/c.zarr", f"{tmp}/c.h5:C"):
                DistArray.from_array(x).to_file(spec, overwrite=True)
                back = DistArray.from_file(spec).gather(None)
                zarr = spec.endswith(".zarr")  # zarr 3 stores little-endian
                same(f"{spec.rsplit('/', 1)[1]} {shape} {dt}", back,
                     x.astype(x.dtype.newbyteorder("<")) if zarr else x)
    # arguments every rank refuses, or the last only: one line on every rank
    d = DistArray.from_array(a)
    refused("gather to a root past the last rank", lambda: d.gather(P), ValueError,
            f"root {P} is not one of the {P} ranks")
    if P > 1:
        refused("gather to another root on the last rank", lambda: d.gather(P - 1 if last else 0),
                ValueError, f"root={P - 1} on rank {P - 1}")
        refused("from_local another dtype on the last rank",
                lambda: DistArray.from_local(np.ones((2, 3), np.float32 if last else np.float64),
                                             grid=(P, 1)), TypeError, f"float32 on rank {P - 1}")
        refused("from_local another width on the last rank",
                lambda: DistArray.from_local(np.ones((2, 4 if last else 3)), grid=(P, 1)),
                ValueError, f"block of rank {P - 1} has shape (2, 4)")
    refused("from_array of a vector", lambda: DistArray.from_array(np.ones(3)), ValueError,
            "2-D")
    refused("from_local of a 3-D block", lambda: DistArray.from_local(np.ones((1, 2, 3))),
            ValueError, "must be 2-D")


def layout_args():
    x = comm.bcast(np.random.default_rng().random((7, 5)) if rank == 0 else None)
    d = DistArray.from_array(x, layout=BlockLayout.grid(x.shape, 1, P))  # 0:2, 2:4, 4:5
    # a float edge bounding ranks 0's and 1's new blocks, not the last rank's: the first two
    # raised alone, the last went on (to wait for them in its next collective)
    refused("a float column edge",
            lambda: d.redistribute(BlockLayout(x.shape, (0, 7), (0, 3.0, 4, 5), ((0, 1, 2),))),
            TypeError, "column edges must be integers, got (0, 3.0, 4, 5)")
    refused("a layout that is no BlockLayout", lambda: d.redistribute((1, P)), TypeError,
            "layout must be a distmm.grid.BlockLayout, got tuple (1, 3)")
    refused("a layout that is no BlockLayout on the last rank",
            lambda: d.redistribute((1, P) if rank == P - 1 else d.layout), TypeError,
            "layout must be a distmm.grid.BlockLayout, got tuple (1, 3)")
    # numpy integers and arrays as edges: the layout of the same ints
    rows = BlockLayout(x.shape, np.array([0, 4, 4, 7]), [0, np.int64(5)], [[P - 1], [1], [0]])
    e = d.redistribute(rows)
    back = e.redistribute(d.layout)
    good = (e.layout == BlockLayout(x.shape, (0, 4, 4, 7), (0, 5), ((P - 1,), (1,), (0,)))
            and all(got.dtype == x.dtype and got.tobytes() == x.tobytes()
                    for got in (e.gather(None), back.gather(None))))
    lines.append(f"rank {rank}: numpy edges: {'ok' if good else 'BAD'}")
    # the same layout of numpy ints on the last rank only: refused as another layout
    ints = BlockLayout(x.shape, (0, 4, 4, 7), (0, 5), ((P - 1,), (1,), (0,)))
    try:
        got = d.redistribute(rows if rank == P - 1 else ints).gather(None)
        good = got.tobytes() == x.tobytes()
    except ValueError as exc:
        good = False
        lines.append(f"rank {rank}: {exc}")
    lines.append(f"rank {rank}: numpy edges on the last rank only: {'ok' if good else 'BAD'}")


{"fixes": lambda: (fixes(), follow_ups()), "battery": battery,
 "follow_ups": follow_ups, "layout_args": layout_args}[sys.argv[2]]()
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


def _run(mpirun, tmp_path, ranks: int, case: str, timeout: float):
    return run_rank_script(mpirun, tmp_path / "distarray_edges.py", SCRIPT, ranks, tmp_path,
                           case, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.slow
def test_layouts_and_files_one_rank_gets_wrong_are_refused_on_every_rank(tmp_path, mpirun):
    """On 3 ranks: a corrupt zarr chunk that only the last rank reads, and a from_file
    layout= that only the last rank gives, raise on every rank (the others waited for ever:
    the timeout); layouts whose owners are no ranks are refused (a block was kept by no
    rank: gather gave uninitialised memory), as is a layout that is no BlockLayout (an
    AttributeError); nested lists that differ between ranks are compared as arrays are (a
    mixed matrix); a file that is not of its suffix's format is named (numpy's advice to
    unpickle, zarr's and HDF5's errors without the path). Then (``follow_ups``): operands
    on the ranks in another order, or on COMM_SELF beside COMM_WORLD, are refused (SUMMA
    paired the wrong blocks: MPI_Abort), a Dup multiplies; edges that decrease are refused
    on every rank (the rank owning the negative block raised alone); what from_array
    refuses on the last rank alone is raised on every rank (the others went on into a
    collective); gemm refuses DistArrays by name (it read them as 0-d arrays), and matmul of
    DistArrays checks tile= (tile=0 was taken); a DistArray on one rank beside an array
    the others hold whole is named so (it read as the replicated values differing)."""
    r, lines, bad = _run(mpirun, tmp_path, 3, "fixes", timeout=90)
    assert len(lines) == 3 * (13 + 19) and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_products_blocks_and_files_are_numpys(ranks, tmp_path, mpirun):
    """Products of DistArrays smaller than the grid or empty, of every dtype pair, in any
    layout, with blocks as users hold them, and every file format read back: numpy's dtype
    and bits; refusals on every rank, one line each."""
    r, lines, bad = _run(mpirun, tmp_path, ranks, "battery", timeout=240)
    per_rank = 107 + (3 if ranks > 1 else 0)  # three refusals need a second rank
    assert len(lines) == per_rank * ranks and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


UNCAUGHT = r'''
import numpy as np
from mpi4py import MPI
from distmm import DistArray

comm = MPI.COMM_WORLD
x = np.ones((4, 6))
d = DistArray.from_array(np.ones(3) if comm.rank == comm.size - 1 else x)  # not caught
print(f"rank {comm.rank} WENT ON", flush=True)
d.gather(None)
'''


@pytest.mark.mpi
@pytest.mark.slow
def test_from_array_refused_by_one_rank_uncaught_ends_the_job(tmp_path, mpirun):
    """A vector on the last rank only, the error not caught: every rank raises the same
    line and the job ends (the other ranks went on into gather and waited for ever)."""
    script = tmp_path / "uncaught.py"
    script.write_text(UNCAUGHT)
    r = mpirun(3, script, timeout=60)
    assert r.returncode != 0 and "WENT ON" not in r.stdout, r.stdout + r.stderr[-3000:]
    line = "ValueError: DistArray needs a 2-D array, got shape (3,)"
    assert r.stderr.count(line) == 3, r.stderr[-3000:]


MAPPED = r'''
import os, sys
import numpy as np
from mpi4py import MPI
from distmm import DistArray
from distmm.grid import BlockLayout

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
tmp = sys.argv[1]
x = comm.bcast(np.random.default_rng().random((2 * P + 3, 5)) if rank == 0 else None)
plain = x.copy()
lines = []


def same(what, d, want):
    got = d.gather(None)
    good = got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD %r vs %r' % (got, want)}")


kept = []
for how in ("open_memmap", "np.load", "asarray"):
    for grid in ("rows", "default"):
        path = f"{tmp}/x-{how}-{grid}.npy"
        if rank == 0:
            m = np.lib.format.open_memmap(path, mode="w+", dtype=x.dtype, shape=x.shape)
            m[...] = x
            m.flush()
            del m
        comm.Barrier()
        mapped = (np.lib.format.open_memmap(path, mode="r") if how == "open_memmap" else
                  np.load(path, mmap_mode="r") if how == "np.load" else
                  np.asarray(np.load(path, mmap_mode="r")))  # a plain view of a memmap
        layout = BlockLayout.grid(x.shape, P, 1) if grid == "rows" else None  # whole rows
        kept.append((f"{how} {grid}", path, DistArray.from_array(mapped, layout=layout), mapped))
# the files rewritten: the DistArrays keep the values they were given
comm.Barrier()
if rank == 0:
    for _, path, _, _ in kept:
        m = np.lib.format.open_memmap(path, mode="r+")
        m[...] = -1.0
        m.flush()
        del m
comm.Barrier()
for what, _, d, _ in kept:
    same(f"{what}: file rewritten", d, x)
for mine in comm.gather(lines) or []:  # before a rank that dies below takes them with it
    print("\n".join(mine), flush=True)
lines = []
# then truncated: a block still mapped would end the rank with SIGBUS
comm.Barrier()
if rank == 0:
    for _, path, _, _ in kept:
        os.truncate(path, 0)
comm.Barrier()
for what, _, d, _ in kept:
    same(f"{what}: file truncated", d, x)
# a block of an array in memory may share its memory, as np.asarray's result does
d = DistArray.from_array(plain, layout=BlockLayout.grid(x.shape, P, 1))
same("in memory", d, x)
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_from_array_of_a_memmap_reads_its_blocks(ranks, tmp_path, mpirun):
    """``from_array`` of a memmap of a ``.npy`` file (``open_memmap``, ``np.load(mmap_mode=)``,
    a plain ndarray view of one) whose blocks are whole rows kept views into the mapped file:
    the file written again changed the DistArray, and truncated ended the rank with SIGBUS.
    Now its blocks are read into memory, as ``from_file`` reads them: both leave it as given."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "mapped.py", MAPPED, ranks, tmp_path,
                                    timeout=90)
    assert len(lines) == 13 * ranks and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]




@pytest.mark.mpi
@pytest.mark.slow
def test_layout_arguments_of_redistribute_are_refused_on_every_rank(tmp_path, mpirun):
    """On 3 ranks: a ``BlockLayout`` with a float edge bounding only some ranks' blocks made
    those ranks raise alone in ``redistribute`` while the last went on (and hung in its next
    collective); now ``BlockLayout`` refuses it (``TypeError``) where it is made. A ``redistribute`` layout that is no ``BlockLayout`` gave an ``AttributeError``
    (or, on one rank only, the comparison's ``ValueError``): now ``TypeError`` on every rank,
    as ``from_array`` and ``from_file`` refuse it. Edges of numpy ints or arrays are taken as
    the same layout of ints (they failed in the comparison of layouts, and on one rank only
    were refused as another layout)."""
    r, lines, bad = _run(mpirun, tmp_path, 3, "layout_args", timeout=60)
    assert len(lines) == 3 * 5 and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


PAIRWISE = r'''
import sys
import numpy as np
from mpi4py import MPI
import distmm
from distmm.engine.mpi import pieces
from distmm import DistArray
from distmm.grid import BlockLayout

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
if sys.argv[1] == "small":  # the point-to-point exchange for blocks past a few bytes
    pieces.MAX_COUNT, pieces.PIECE_BYTES = 40, 24
rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy if rank == 0 else None))
lines = []


def same(what, got, want):
    if got is None or want is None:
        good = got is None and want is None
    else:
        good = (got.dtype == want.dtype and got.shape == want.shape
                and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes())
    lines.append(f"rank {rank}: {what}: {'ok' if good else 'BAD %r vs %r' % (got, want)}")


if sys.argv[1] == "big":  # a block past 2**31 - 1 bytes on the last rank, gathered to rank 0
    n = 1 << 16
    big = 2**31 // n + 1
    d = DistArray.from_local(np.full((big if rank == P - 1 else 1, n), rank + 1, np.uint8),
                             grid=(P, 1))
    try:
        full = d.gather(0)
        got = "ok" if rank else ("ok" if full.shape == (big + P - 1, n) and full[0, 0] == 1
                                 and full[-1, -1] == P and full[P - 1:].min() == P else "BAD")
    except Exception as exc:  # noqa: BLE001 - reported
        got = f"BAD {type(exc).__name__}: {exc}"
    lines.append(f"rank {rank}: gathered: {got}")
else:
    for shape in [(7, 5), (1, 9), (9, 1), (0, 4), (P + 1, 2)]:
        for dt in ("float64", "complex128", "int8", "bool", "float16"):
            x = rng.integers(-3, 4, shape).astype(dt)
            layouts = [BlockLayout.grid(shape, P, 1), BlockLayout.grid(shape, 1, P),
                       BlockLayout.single(shape, P - 1), None]
            d = DistArray.from_array(x)
            for layout in layouts[:3]:
                d = d.redistribute(layout)
                same(f"{shape} {dt} moved", d.gather(None), x)
            same(f"{shape} {dt} to rank 0", d.gather(0), x if rank == 0 else None)
    a, b = rng.random((7, 5)), rng.random((5, 4))
    got = distmm.matmul(DistArray.from_array(a), DistArray.from_array(b)).gather(None)
    lines.append(f"rank {rank}: product: {'ok' if np.allclose(got, a @ b) else 'BAD'}")
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


def _pairwise(mpirun, tmp_path, ranks: int, case: str, timeout: float):
    return run_rank_script(mpirun, tmp_path / "pairwise.py", PAIRWISE, ranks, case,
                           timeout=timeout)


@pytest.mark.mpi
@pytest.mark.slow
def test_blocks_past_one_mpi_count_move_in_pieces(tmp_path, mpirun):
    """``redistribute`` and ``gather`` of blocks past what one MPI count holds (here made
    40 bytes, in messages of 24) go point to point: numpy's bytes for odd shapes, empty
    blocks and every layout, on 3 ranks."""
    r, lines, bad = _pairwise(mpirun, tmp_path, 3, "small", timeout=120)
    assert len(lines) == 3 * (5 * 5 * 4 + 1) and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < 12 * 2**30, reason="needs 12 GiB of free memory")
def test_a_block_past_two_gib_is_gathered(tmp_path, mpirun):
    """A block of more than 2**31 - 1 bytes gathered to rank 0 on 2 ranks: the exchange's
    counts passed a C int and Open MPI refused it (``MPI_ERR_ARG`` on every rank)."""
    r, lines, bad = _pairwise(mpirun, tmp_path, 2, "big", timeout=400)
    assert len(lines) == 2 and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
