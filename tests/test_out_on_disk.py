"""``distmm.matmul(..., out=)`` an array on disk (a zarr array, an h5py dataset, a memmap).

numpy's semantics: an ``out`` that is also an operand (the same file through another handle
too) gives the product as if computed into a temporary; a cast, a broadcast ``out``, 1-D and
stacked results are written as numpy writes an ndarray ``out``; what distmm refuses it
refuses before any work (an operand with a corrupt chunk shows that none was read).
"""
from __future__ import annotations

import textwrap

import h5py
import numpy as np
import pytest
import zarr

import distmm

from conftest import random_array


def _zarr(path, shape, dtype="f8", chunks=None):
    chunks = chunks if chunks is not None else tuple(min(s, 64) for s in shape)
    return zarr.create_array(str(path), shape=shape, dtype=dtype, chunks=chunks, overwrite=True)


def _reference(a, b, **kw):
    """numpy's float64 (complex128) product of the operands as given."""
    return np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64), **kw)


def _close(got, want, dtype):
    """Within float32's or float64's rounding of a product over k = 40 (values near 10)."""
    tol = 1e-4 if np.dtype(dtype).itemsize <= 4 and np.dtype(dtype).kind == "f" else 1e-11
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)


def _corrupt_operand(tmp_path, shape):
    """A zarr operand one of whose chunks does not decode: reading it fails."""
    a = _zarr(tmp_path / "corrupt.zarr", shape, chunks=(32, 32))
    a[...] = 1.0
    (tmp_path / "corrupt.zarr" / "c" / "0" / "0").write_bytes(b"garbage")
    return a


# -- out is also an operand ------------------------------------------------------------------


def _alias_cases(tmp_path, rng):
    """(name, a, b, out, reference) for each way ``out`` is an operand's own file."""
    A, B = random_array(rng, (300, 300), "f8"), random_array(rng, (300, 300), "f8")
    ref = A @ B
    cases = []
    z = _zarr(tmp_path / "a.zarr", (300, 300))
    z[...] = A
    cases.append(("zarr-a", z, B, z))
    z = _zarr(tmp_path / "b.zarr", (300, 300))
    z[...] = B
    cases.append(("zarr-b", A, z, z))
    z = _zarr(tmp_path / "r.zarr", (300, 300))
    z[...] = A
    cases.append(("zarr-reopened", zarr.open_array(str(tmp_path / "r.zarr"), mode="r"), B, z))
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    z = g.create_array("sub/x", shape=(300, 300), dtype="f8", chunks=(64, 64))
    z[...] = B
    cases.append(("zarr-group-path", A, zarr.open_group(str(tmp_path / "g.zarr"))["sub/x"], z))
    f = h5py.File(tmp_path / "a.h5", "w")
    d = f.create_dataset("x", data=A)
    cases.append(("h5-a", d, B, d))
    d = f.create_dataset("y", data=B)
    other = h5py.File(tmp_path / "a.h5", "r")  # a second handle on the same file
    cases.append(("h5-b-other-handle", A, other["y"], d))
    np.save(tmp_path / "m.npy", A)
    cases.append(("memmap", np.load(tmp_path / "m.npy", mmap_mode="r"), B,
                  np.lib.format.open_memmap(tmp_path / "m.npy", mode="r+")))
    return [(name, a, b, out, ref) for name, a, b, out in cases], (f, other)


@pytest.mark.parametrize("tile", [None, pytest.param(64, marks=pytest.mark.slow)])
def test_out_that_is_an_operand_gives_numpys_product_local(tmp_path, tile):
    cases, files = _alias_cases(tmp_path, np.random.default_rng(41 + (tile or 0)))
    try:
        for name, a, b, out, ref in cases:
            got = distmm.matmul(a, b, out=out, engine="local", tile=tile)
            assert got is out, name
            np.testing.assert_allclose(np.asarray(out[...]), ref, rtol=1e-12, atol=1e-10,
                                       err_msg=name)
    finally:
        for f in files:
            f.close()


@pytest.mark.slow
def test_out_that_is_an_operand_gives_numpys_product_dask(tmp_path, client):
    cases, files = _alias_cases(tmp_path, np.random.default_rng(7))
    try:
        for name, a, b, out, ref in cases:
            distmm.matmul(a, b, out=out, engine="dask", client=client, tile=64)
            np.testing.assert_allclose(np.asarray(out[...]), ref, rtol=1e-12, atol=1e-10,
                                       err_msg=name)
    finally:
        for f in files:
            f.close()


def test_a_separate_out_on_disk_is_still_written_directly(tmp_path):
    """A zarr operand and another zarr array as out: no temporary needed, tiles go in."""
    rng = np.random.default_rng(3)
    A, B = random_array(rng, (200, 150), "f8"), random_array(rng, (150, 120), "f8")
    za = _zarr(tmp_path / "a.zarr", A.shape)
    za[...] = A
    out = _zarr(tmp_path / "o.zarr", (200, 120))
    distmm.matmul(za, B, out=out, tile=64)
    np.testing.assert_allclose(out[...], A @ B, rtol=1e-12, atol=1e-10)


# -- casts and shapes numpy takes -------------------------------------------------------------


def _numpy_cases(rng):
    """(name, a, b, out shape, out dtype, keywords) of calls numpy takes with an ndarray out."""
    A, B = random_array(rng, (60, 40), "f8"), random_array(rng, (40, 30), "f8")
    S = random_array(rng, (3, 60, 40), "f8")
    return [
        ("float32", A, B, (60, 30), "f4", {}),
        ("complex128", A, B, (60, 30), "c16", {}),
        ("big-endian", A, B, (60, 30), ">f8", {}),
        ("dtype=float32", A, B, (60, 30), "f8", {"dtype": "f4"}),
        ("broadcast", A[:5, :4], B[:4, :3], (2, 5, 3), "f8", {}),
        ("1-D", A[0], B, (30,), "f8", {}),
        ("stacked", S, B, (3, 60, 30), "f8", {}),
        ("vector-vector", A[0], B[:, 0], (), "f8", {}),
        ("axes", A, B, (30, 60), "f8", {"axes": [(0, 1), (0, 1), (1, 0)]}),
    ]


@pytest.mark.parametrize("kind", ["zarr", "h5py"])
def test_out_on_disk_takes_what_numpy_takes(tmp_path, kind):
    rng = np.random.default_rng(17)
    with h5py.File(tmp_path / "o.h5", "w") as f:
        for name, a, b, shape, dtype, kw in _numpy_cases(rng):
            if kind == "zarr":
                out = _zarr(tmp_path / f"{name}.zarr", shape, dtype)
            else:
                out = f.create_dataset(name, shape=shape, dtype=dtype)
            want = np.matmul(a, b, out=np.zeros(shape, dtype), **kw)  # numpy's, same out
            got = distmm.matmul(a, b, out=out, **kw)
            assert got is out, name
            assert np.dtype(out.dtype) == np.dtype(dtype), name
            loop = kw.get("dtype", dtype)
            _close(out[...], want, loop)
            _close(out[...], _reference(a, b, axes=kw["axes"]) if "axes" in kw
                   else np.broadcast_to(_reference(a, b), shape), loop)


@pytest.mark.slow
def test_out_on_disk_takes_a_cast_and_a_stack_on_dask(tmp_path, client):
    rng = np.random.default_rng(5)
    for name, a, b, shape, dtype, kw in _numpy_cases(rng)[:7]:
        out = _zarr(tmp_path / f"{name}.zarr", shape, dtype)
        distmm.matmul(a, b, out=out, engine="dask", client=client, **kw)
        _close(out[...], np.broadcast_to(_reference(a, b), shape), kw.get("dtype", dtype))


# -- refusals, before any work ----------------------------------------------------------------


def test_a_cast_numpy_refuses_is_numpys_error_before_work(tmp_path):
    a = _corrupt_operand(tmp_path, (64, 64))
    out = _zarr(tmp_path / "o.zarr", (64, 64), "i4")
    with pytest.raises(type(_numpy_error(np.ones((64, 64)), np.ones((64, 64)),
                                         np.zeros((64, 64), "i4")))) as info:
        distmm.matmul(a, np.ones((64, 64)), out=out)
    assert "same_kind" in str(info.value)
    assert out.nchunks_initialized == 0


def _numpy_error(a, b, out):
    try:
        np.matmul(a, b, out=out)
    except Exception as exc:  # noqa: BLE001 - the type numpy raises is what is compared
        return exc
    raise AssertionError("numpy took it")


def test_a_shape_numpy_refuses_is_a_valueerror_before_work(tmp_path):
    a = _corrupt_operand(tmp_path, (64, 64))
    out = _zarr(tmp_path / "o.zarr", (64, 63))
    assert isinstance(_numpy_error(np.ones((64, 64)), np.ones((64, 64)), np.zeros((64, 63))),
                      ValueError)
    with pytest.raises(ValueError, match="non-broadcastable output"):
        distmm.matmul(a, np.ones((64, 64)), out=out)


def test_a_read_only_out_on_disk_is_refused_before_work(tmp_path):
    a = _corrupt_operand(tmp_path, (64, 64))
    _zarr(tmp_path / "o.zarr", (64, 64))
    with pytest.raises(ValueError, match="read-only"):
        distmm.matmul(a, np.ones((64, 64)), out=zarr.open_array(str(tmp_path / "o.zarr"),
                                                                mode="r"))
    with h5py.File(tmp_path / "o.h5", "w") as f:
        f.create_dataset("x", shape=(64, 64), dtype="f8")
    with h5py.File(tmp_path / "o.h5", "r") as f:
        with pytest.raises(ValueError, match="read-only"):
            distmm.matmul(a, np.ones((64, 64)), out=f["x"])


def test_an_out_that_cannot_be_assigned_is_refused_before_work(tmp_path):
    a = _corrupt_operand(tmp_path, (64, 64))
    out = np.lib.Arrayterator(np.zeros((64, 64)))  # shape and dtype, no __setitem__
    with pytest.raises(TypeError, match="Arrayterator cannot be written"):
        distmm.matmul(a, np.ones((64, 64)), out=out)


def test_a_temporary_larger_than_the_host_is_refused_before_work(tmp_path):
    a = _corrupt_operand(tmp_path, (64, 64))  # a 160 GB out the 2-D product broadcasts into
    out = _zarr(tmp_path / "huge.zarr", (10**7, 64, 64), "f4", chunks=(10**6, 64, 64))
    with pytest.raises(MemoryError, match=r"temporary of .* GiB before out= zarr array"):
        distmm.matmul(a, np.ones((64, 64)), out=out)
    assert out.nchunks_initialized == 0


MPI_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, zarr
    from mpi4py import MPI
    import distmm

    comm = MPI.COMM_WORLD
    rank = comm.rank
    out = zarr.create_array(f"{sys.argv[1]}/o{rank}.zarr", shape=(64, 64), dtype="f8")
    lines = []
    try:
        distmm.matmul(np.ones((64, 64)), np.ones((64, 64)), out=out, engine="mpi")
    except TypeError as exc:
        lines.append(f"REFUSED {rank} {exc}")
    lines.append(f"{'UNTOUCHED' if out.nchunks_initialized == 0 else 'WRITTEN'} {rank}")
    gathered = comm.gather(lines, root=0)  # one writer: the ranks' lines never interleave
    if rank == 0:
        for line in (line for rank_lines in gathered for line in rank_lines):
            print(line, flush=True)
""")


@pytest.mark.mpi
@pytest.mark.slow
def test_out_on_disk_is_refused_on_the_mpi_engine_by_every_rank(tmp_path, mpirun):
    script = tmp_path / "disk_out.py"
    script.write_text(MPI_SCRIPT)
    r = mpirun(2, script, tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert f"REFUSED {rank} matmul: out= zarr array" in r.stdout, r.stdout
        assert f"UNTOUCHED {rank}" in r.stdout
