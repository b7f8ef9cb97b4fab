"""Arrays derived from a lazy product over an HDF5 dataset (arithmetic, ufuncs, reductions,
``map_blocks``, ``concatenate`` and ``stack`` with other arrays): plain dask arrays, whose
reads of the file keep their pins (``lazy.keep_read_pins``) where dask's default optimisation
fused the tasks and dropped them. On a cluster with one worker that does not see the file
(``blind_worker``), every other task of the derived array sent to that worker
(``Client.compute``/``persist`` with ``workers=``), the reads still go to the workers that
read the file: the values are numpy's, and nothing hangs (each wait is bounded). The graph
itself: dask.array's optimisation of such an array keeps the read layers and their
annotations, and leaves any other graph as dask's own optimisation makes it."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import distmm
from conftest import assert_close

h5py = pytest.importorskip("h5py")
da = pytest.importorskip("dask.array")
import dask  # noqa: E402
from dask.highlevelgraph import HighLevelGraph  # noqa: E402

from distmm.engine.dask.lazy import PinnedArray, pin_reads  # noqa: E402

WAIT = 30  # seconds: a compute here takes about one; a hung one fails the test there

#: an array derived from the product ``r`` (with ``d``, the chunked operand ``b``), and its
#: numpy counterpart over ``c = a @ b``
DERIVED = {
    "add": (lambda r, d: r + 1, lambda c, b: c + 1),
    "sum": (lambda r, d: r.sum(), lambda c, b: c.sum()),
    "mean": (lambda r, d: (r * 2).mean(axis=0), lambda c, b: (c * 2).mean(axis=0)),
    "map_blocks": (lambda r, d: da.map_blocks(np.negative, r), lambda c, b: np.negative(c)),
    "concatenate": (lambda r, d: da.concatenate([r, r]), lambda c, b: np.concatenate([c, c])),
    "exp": (lambda r, d: da.exp(r / 64), lambda c, b: np.exp(c / 64)),
    "stack": (lambda r, d: da.stack([r, d[:24]]), lambda c, b: np.stack([c, b[:24]])),
}


def _operands(folder, inline=False):
    """``(a, b, x, d)``: integer-valued float64 ``a`` (24 x 30) and ``b`` (30 x 24), whose
    products are exact in any order, ``x`` over ``a`` in a fresh HDF5 file in ``folder``
    (``dask.array.from_array`` of the open dataset, under a fresh name: no key of another
    test), ``d`` over ``b`` in memory."""
    rng = np.random.default_rng()
    a = rng.integers(-4, 5, (24, 30)).astype(np.float64)
    b = rng.integers(-4, 5, (30, 24)).astype(np.float64)
    path = folder / f"{uuid.uuid4().hex}.h5"
    with h5py.File(path, "w") as fh:
        fh["A"] = a
    ds = h5py.File(path, "r")["A"]
    x = da.from_array(ds, chunks=(8, 10), name="h5-" + uuid.uuid4().hex, inline_array=inline)
    return a, b, x, da.from_array(b, chunks=(10, 8))


@pytest.mark.parametrize("op", sorted(DERIVED))
def test_dask_s_optimisation_of_a_derived_array_keeps_the_read_layers_and_pins(tmp_path, op):
    """dask.array's optimisation (what ``Client.compute`` and ``persist`` call) of an array
    derived from pinned reads: the read layers and their ``workers``/``allow_other_workers``
    annotations are there (it was one plain dict of fused tasks); computed here, its values
    are numpy's."""
    a, b, x, d = _operands(tmp_path)
    readers = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    p, pinned = pin_reads(x, lambda ds: readers)
    assert pinned and isinstance(p, PinnedArray)
    derive, expect = DERIVED[op]
    y = derive(p @ d, d)
    assert type(y) is da.Array
    graph = y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__())
    assert isinstance(graph, HighLevelGraph), type(graph)
    annotated = {key: layer.annotations for layer in graph.layers.values() for key in layer}
    reads = {k: v for k, v in annotated.items()
             if (k[0] if isinstance(k, tuple) else k) in (x.name, "original-" + x.name)}
    assert len(reads) == 1 + len(x.__dask_keys__()) * len(x.__dask_keys__()[0]), sorted(reads)
    for key, ann in reads.items():
        assert ann and list(ann["workers"]) == readers and ann["allow_other_workers"] is False, \
            (key, ann)
    assert_close(y.compute(scheduler="sync"), expect(a @ b, b))


def test_a_graph_without_pinned_reads_is_optimised_as_dask_does(tmp_path):
    """Once reads were pinned: an array without such pins is optimised by dask's own
    optimisation (the same tasks), and an ``array_optimize`` of the user's is the one
    called."""
    from dask.array.optimization import optimize

    _, _, x, d = _operands(tmp_path)
    assert pin_reads(x, lambda ds: ["tcp://127.0.0.1:1"])[1]
    y = (x + 1) @ d
    keys = y.__dask_keys__()
    graph = y.__dask_optimize__(y.__dask_graph__(), keys)
    assert sorted(map(str, dict(graph))) == sorted(map(str, optimize(y.dask, keys)))
    called = []

    def mine(dsk, keys, **kwargs):
        called.append(keys)
        return dsk

    with dask.config.set(array_optimize=mine):
        assert y.__dask_optimize__(y.dask, keys) is y.dask and called == [keys]


def _computed(client, y, where, persist):
    """``y`` computed (``persist``: persisted, then gathered) on ``client``'s cluster with its
    tasks sent to worker ``where`` (those without a placement of their own), waited for
    ``WAIT`` seconds at most."""
    if persist:
        y = client.persist(y, workers=[where])
        return client.compute(y).result(timeout=WAIT)
    return client.compute(y, workers=[where]).result(timeout=WAIT)


@pytest.mark.slow  # a LocalCluster of worker processes, and one more worker
@pytest.mark.parametrize("persist", [False, True], ids=["compute", "persist"])
@pytest.mark.parametrize("op", sorted(DERIVED) + ["add-inline"])
def test_a_derived_array_s_reads_stay_on_the_workers_that_read_the_file(
        tmp_path, client, blind_worker, op, persist):
    """A derived array, its tasks sent to the worker that does not see the file: its reads
    went there too (fused into plain tasks without their pins), which failed to open the
    file, and the compute hung; now they run where the file is, and the values are
    numpy's."""
    a, b, x, d = _operands(tmp_path, inline=op.endswith("-inline"))
    r = distmm.matmul(x, d, client=client)
    assert isinstance(r, PinnedArray)
    derive, expect = DERIVED[op.removesuffix("-inline")]
    y = derive(r, d)
    assert type(y) is da.Array
    got = _computed(client, y, blind_worker, persist)
    assert_close(got, expect(a @ b, b))
