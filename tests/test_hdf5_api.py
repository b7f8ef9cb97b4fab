"""h5py datasets passed to ``distmm.matmul`` and ``distmm.gemm`` (operands and ``out=``) whose
data goes through an HDF5 filter this process lacks (a plugin not installed): refused before
any work in one line naming the dataset and the filter, as the command line refuses such an
operand (tests/test_hdf5_filters.py); filters that are available, and an optional missing
one that no chunk went through, multiply as numpy does."""
from __future__ import annotations

import numpy as np
import pytest

import distmm
from conftest import run_rank_script

h5py = pytest.importorskip("h5py")

#: HDF5's registered id of the blosc filter, a plugin HDF5 itself does not have
BLOSC = 32001
#: an id no filter is registered under
UNKNOWN = 32999
NAMED = {BLOSC: f"{BLOSC} (blosc)", UNKNOWN: f"{UNKNOWN}"}
WHY = "which is not available here"


@pytest.fixture
def no_plugins(tmp_path):
    """HDF5's plugin search path for the test: one empty folder (a blosc plugin installed on
    this machine is not found); the path as it was restored after."""
    from h5py import h5pl

    saved = [h5pl.get(i) for i in range(h5pl.size())]
    empty = tmp_path / "plugins"
    empty.mkdir()
    for _ in saved:
        h5pl.remove(0)
    h5pl.append(str(empty).encode())
    try:
        if h5py.h5z.filter_avail(BLOSC):
            pytest.skip("a blosc filter is registered in this process already")
        yield
    finally:
        h5pl.remove(0)
        for path in saved:
            h5pl.append(path)


def _filtered(fh, name, x, code, *, through: bool = True):
    """``x`` as dataset ``name`` of the open HDF5 file ``fh``, chunked by 4 rows, with the
    optional filter ``code`` (h5py's ``allow_unknown_filter``): its chunks stored as filter
    ``code``'s output (``through``; here the raw bytes, as a writer with the plugin would store
    its own) or as having skipped it (filter mask bit set), as a writer without it stores
    them."""
    ds = fh.create_dataset(name, shape=x.shape, dtype=x.dtype, chunks=(4, x.shape[1]),
                           compression=code, allow_unknown_filter=True)
    for r0 in range(0, x.shape[0], 4):
        chunk = np.zeros((4, x.shape[1]), x.dtype)
        chunk[:len(x[r0:r0 + 4])] = x[r0:r0 + 4]
        ds.id.write_direct_chunk((r0, 0), chunk.tobytes(), filter_mask=0 if through else 1)
    return ds


def _stored(ds) -> list:
    """Every stored chunk of ``ds`` as HDF5 holds it: its filter mask and bytes."""
    return [ds.id.read_direct_chunk(ds.id.get_chunk_info(i).chunk_offset)
            for i in range(ds.id.get_num_chunks())]


def _operands(rng, m=37, k=23, n=29):
    return rng.random((m, k)), rng.random((k, n))


def _refused(call, what, ds, code, of="HDF5 dataset"):
    """``call()`` raises a one-line ValueError naming ``what``, the dataset (``of`` it) and
    the filter."""
    with pytest.raises(ValueError) as info:
        call()
    text = str(info.value)
    assert "\n" not in text, text
    assert text.startswith(f"{what} ({of} {ds.file.filename}:{ds.name}) needs HDF5 "
                           f"filter {NAMED[code]}, {WHY}"), text


# -- refused before any work ------------------------------------------------------------------


@pytest.mark.parametrize("code", [BLOSC, UNKNOWN])
@pytest.mark.parametrize("position", ["a", "b"])
def test_an_operand_needing_a_missing_filter_is_refused(tmp_path, no_plugins, code, position):
    """h5py's own words came where the local engine read a block: "Can't synchronously read
    data (can't open directory (/usr/local/lib/plugin)...)", an OSError naming neither the
    dataset nor the filter."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        if position == "a":
            ds = _filtered(fh, "A", a, code)
            operands = (ds, b)
        else:
            ds = _filtered(fh, "g/B", b, code)
            operands = (a, ds)
        _refused(lambda: distmm.matmul(*operands, engine="local"), f"matmul: operand {position}",
                 ds, code)


@pytest.mark.parametrize("code", [BLOSC, UNKNOWN])
def test_gemm_refuses_an_operand_or_c_needing_a_missing_filter(tmp_path, no_plugins, code):
    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        ds_a = _filtered(fh, "A", a, code)
        ds_c = _filtered(fh, "C", rng.random((a.shape[0], b.shape[1])), code)
        _refused(lambda: distmm.gemm(ds_a, b), "gemm: operand a", ds_a, code)
        _refused(lambda: distmm.gemm(a, b, ds_c, beta=2.0), "gemm: operand c", ds_c, code)


@pytest.mark.parametrize("axes", [None, [(0, 1), (0, 1), (1, 0)]])
def test_an_out_needing_a_missing_filter_is_refused_and_left_as_it_was(tmp_path, no_plugins,
                                                                        axes):
    """h5py's "Can't synchronously write data" came once the product was computed (the
    tiles' writes read the chunks they land in); with ``axes``, numpy's temporary was
    computed first too."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    shape = (a.shape[0], b.shape[1]) if axes is None else (b.shape[1], a.shape[0])
    with h5py.File(tmp_path / "o.h5", "w") as fh:
        out = _filtered(fh, "C", rng.random(shape), UNKNOWN)
        before = _stored(out)
        kw = {} if axes is None else {"axes": axes}
        _refused(lambda: distmm.matmul(a, b, out=out, engine="local", **kw), "matmul: out",
                 out, UNKNOWN)
        assert _stored(out) == before


def test_an_out_with_a_mandatory_missing_filter_is_refused_with_no_chunk_stored(tmp_path,
                                                                                no_plugins):
    """HDF5 writes no chunk without a mandatory filter ("required filter 32000 is not
    registered", once the product was computed): refused though nothing is stored yet. The
    filter: h5py's lzf, unregistered for the test (HDF5 creates no dataset naming a mandatory
    filter it lacks)."""
    from h5py import h5d, h5p, h5s, h5t, h5z

    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "o.h5", "w") as fh:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((4, b.shape[1]))
        dcpl.set_filter(h5z.FILTER_LZF, h5z.FLAG_MANDATORY, ())
        h5d.create(fh.id, b"C", h5t.NATIVE_DOUBLE, h5s.create_simple((a.shape[0], b.shape[1])),
                   dcpl=dcpl)
    assert h5z.unregister_filter(h5z.FILTER_LZF)
    try:
        assert not h5z.filter_avail(h5z.FILTER_LZF)
        with h5py.File(tmp_path / "o.h5", "r+") as fh:
            out = fh["C"]
            with pytest.raises(ValueError, match=f"^matmul: out \\(HDF5 dataset .*o.h5:/C\\) "
                                                 f"needs HDF5 filter 32000 \\(lzf\\), {WHY}"):
                distmm.matmul(a, b, out=out, engine="local")
            assert out.id.get_num_chunks() == 0
    finally:
        h5z._register_lzf()
    assert h5z.filter_avail(h5z.FILTER_LZF)


@pytest.mark.slow
def test_the_dask_engine_refuses_them_before_any_task(tmp_path, no_plugins, client):
    """On a cluster the workers read the operand's blocks and failed there
    (``UnreadableInput``: "... cannot be read: OSError ..."), after the product's tasks ran."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        ds = _filtered(fh, "A", a, BLOSC)
        out = _filtered(fh, "C", rng.random((a.shape[0], b.shape[1])), UNKNOWN)
        fh.flush()
        before = _stored(out)
        client.get_task_stream()  # the scheduler records tasks from now on
        _refused(lambda: distmm.matmul(ds, b, client=client, tile=16), "matmul: operand a",
                 ds, BLOSC)
        _refused(lambda: distmm.matmul(a, b, out=out, client=client, tile=16), "matmul: out",
                 out, UNKNOWN)
        import dask.array as da

        _refused(lambda: distmm.matmul(da.from_array(ds, chunks=(10, 9)), b, client=client),
                 "matmul: operand a", ds, BLOSC, "dask array of HDF5 dataset")
        assert not client.get_task_stream()
        assert _stored(out) == before


@pytest.mark.parametrize("code", [BLOSC, UNKNOWN])
@pytest.mark.parametrize("inline", [False, True])
def test_a_dask_array_over_such_a_dataset_is_refused_when_called(tmp_path, no_plugins, code,
                                                                 inline):
    """``dask.array.from_array(dataset)``: dask's own product (numpy's hands it to dask) is
    lazy and raises h5py's OSError once computed, naming neither dataset nor filter; distmm's
    lazy product did the same. Now refused when called, found in the array's graph (the
    dataset a layer of its own, or inlined in the reading tasks), also through a transpose."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        ds_a, ds_b = _filtered(fh, "A", a, code), _filtered(fh, "g/B", b.T.copy(), code)
        x = da.from_array(ds_a, chunks=(10, 9), inline_array=inline)
        y = da.from_array(ds_b, chunks=(8, 9), inline_array=inline).T
        with pytest.raises(OSError):
            np.matmul(x, b).compute()
        of = "dask array of HDF5 dataset"
        _refused(lambda: distmm.matmul(x, b, engine="local"), "matmul: operand a", ds_a, code,
                 of)
        _refused(lambda: distmm.matmul(a, y), "matmul: operand b", ds_b, code, of)
        _refused(lambda: distmm.gemm(x, y), "gemm: operand a", ds_a, code, of)


def test_a_dask_array_over_readable_datasets_multiplies_as_numpy(tmp_path, no_plugins):
    """Datasets whose filters this HDF5 applies (gzip, lzf, an optional missing filter no
    chunk went through) pass the check; the lazy product computes numpy's values."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b = _operands(rng)
    want = np.matmul(a, b)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        for ds_a, ds_b, _ in _readable(fh, a, b, want.shape):
            got = distmm.matmul(da.from_array(ds_a, chunks=(10, 9)),
                                da.from_array(ds_b, chunks=(9, 8)), engine="local")
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got.compute(), want, rtol=1e-12, err_msg=ds_a.name)


# -- what reads is multiplied as numpy does ---------------------------------------------------


def _readable(fh, a, b, c_shape):
    """Operands and outs whose filters this HDF5 applies: gzip with shuffle and Fletcher32,
    h5py's lzf, and an optional missing filter that no chunk went through (an operand whose
    writer skipped it, an out with no chunk stored yet: its writes skip it)."""
    yield (fh.create_dataset("gz/A", data=a, chunks=(5, 7), compression="gzip", shuffle=True,
                             fletcher32=True),
           fh.create_dataset("gz/B", data=b, chunks=(6, 4), compression="gzip"),
           fh.create_dataset("gz/C", shape=c_shape, dtype="f8", chunks=(8, 3),
                             compression="gzip", shuffle=True))
    yield (fh.create_dataset("lzf/A", data=a, chunks=(9, 23), compression="lzf"),
           fh.create_dataset("lzf/B", data=b, chunks=(23, 5), compression="lzf"),
           fh.create_dataset("lzf/C", shape=c_shape, dtype="f8", chunks=(4, 4),
                             compression="lzf"))
    yield (_filtered(fh, "skipped/A", a, BLOSC, through=False),
           _filtered(fh, "skipped/B", b, UNKNOWN, through=False),
           fh.create_dataset("skipped/C", shape=c_shape, dtype="f8", chunks=(4, c_shape[1]),
                             compression=UNKNOWN, allow_unknown_filter=True))


def _multiplies_as_numpy(tmp_path, **engine):
    rng = np.random.default_rng()
    a, b = _operands(rng)
    want = np.matmul(a, b)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        for ds_a, ds_b, out in _readable(fh, a, b, want.shape):
            fh.flush()
            got = distmm.matmul(ds_a, ds_b, **engine)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=ds_a.name)
            assert distmm.matmul(a, b, out=out, **engine) is out
            np.testing.assert_array_equal(out[...], want, err_msg=out.name)


def test_available_filters_multiply_as_numpy_does(tmp_path, no_plugins):
    _multiplies_as_numpy(tmp_path, engine="local")


@pytest.mark.slow
def test_available_filters_multiply_as_numpy_does_on_dask(tmp_path, no_plugins, client):
    _multiplies_as_numpy(tmp_path, client=client, tile=16)


_BESIDE_DISTARRAY = r'''
import sys
import h5py
import numpy as np
from mpi4py import MPI
import distmm
from distmm.engine.mpi import DistArray

comm = MPI.COMM_WORLD
rank = comm.rank
path, code = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(7)  # the same b on every rank
b = rng.standard_normal((6, 5))
if rank == 0:
    with h5py.File(path, "w") as fh:
        ds = fh.create_dataset("A", shape=(8, 6), dtype="f8", chunks=(4, 6), compression=code,
                               allow_unknown_filter=True)
        for r0 in (0, 4):
            ds.id.write_direct_chunk((r0, 0), rng.standard_normal((4, 6)).tobytes())
comm.Barrier()
lines = []
with h5py.File(path, "r") as fh:
    try:
        distmm.matmul(fh["A"], DistArray.from_array(b, comm))
        lines.append(f"rank {rank}: refused: BAD (no error)")
    except ValueError as exc:
        good = str(exc).startswith("matmul: operand a (HDF5 dataset ") and \
            f"needs HDF5 filter {code}" in str(exc)
        lines.append(f"rank {rank}: refused: {'ok' if good else 'BAD ' + str(exc)}")
    except Exception as exc:
        lines.append(f"rank {rank}: refused: BAD {type(exc).__name__}: {exc}")
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow
def test_beside_a_distarray_it_is_refused_on_every_rank(tmp_path, mpirun):
    """An h5py operand beside a DistArray (2 ranks): every rank refuses it in the filter's
    words (h5py's OSError came from reading it for the ranks' agreement on its values)."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "rank.py", _BESIDE_DISTARRAY, 2,
                                    tmp_path / "ops.h5", UNKNOWN)
    assert len(lines) == 2 and not bad, "\n".join(bad or lines) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
