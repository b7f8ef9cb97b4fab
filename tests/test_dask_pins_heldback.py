"""A dask operand over an HDF5 dataset (``dask.array.from_array``) on a cluster where a worker
cannot open the file: its reads go to the workers the engine checked to read it
(``files.visible``), and to no other (``allow_other_workers=False``), and so do the reads of
the arrays made from the lazy result (squeezed, transposed, reshaped, cast, indexed,
rechunked). The worker that cannot open the file is a real one: a ``dask worker`` process
of the ``cluster`` in a mount namespace of its own, where a tmpfs hides the file's folder
(the operand's file is not there for it, as on a host without the shared file system).
The scheduler runs in this process: a plugin records, for each task, its worker
restrictions and the worker it ran on."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import distmm
from conftest import assert_close, assert_matches_numpy, hidden_worker

h5py = pytest.importorskip("h5py")
da = pytest.importorskip("dask.array")
pytest.importorskip("distributed")
import dask  # noqa: E402
from distributed.diagnostics.plugin import SchedulerPlugin  # noqa: E402

from distmm.engine.dask.lazy import PinnedArray  # noqa: E402

pytestmark = pytest.mark.slow  # a LocalCluster of worker processes, and one more worker

LAYOUTS = {"tiles": {"distmm.dask-layout": "tiles"},
           "blocks": {"distmm.dask-layout": "blocks", "distmm.dask-worker-gflops": {"cpu": 10}}}


class _Record(SchedulerPlugin):
    """Each task that went to a worker: ``key -> (its worker restrictions, whether they are
    loose, the worker)``."""

    def __init__(self):
        self.ran: dict = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            ts = self.scheduler.tasks[key]
            self.ran[key] = (sorted(ts.worker_restrictions or ()), bool(ts.loose_restrictions),
                             ts.processing_on.address)


@pytest.fixture
def record(cluster):
    plugin = _Record()
    plugin.scheduler = cluster.scheduler
    cluster.scheduler.add_plugin(plugin, name="distmm-test-record")
    try:
        yield plugin
    finally:
        cluster.scheduler.remove_plugin(name="distmm-test-record")


def _reads(record, token) -> dict:
    """The recorded tasks that read the dataset: ``from_array``'s of name ``token`` (its
    getters and its ``original-`` task)."""
    return {k: v for k, v in record.ran.items()
            if (k[0] if isinstance(k, tuple) else k) in (token, "original-" + token)}


def _assert_pinned(record, token, readers):
    reads = _reads(record, token)
    assert reads, sorted(record.ran, key=str)[:10]
    for key, (restrictions, loose, worker) in reads.items():
        assert restrictions == sorted(readers) and not loose, (key, restrictions, loose)
        assert worker in readers, (key, worker)


def _dataset(folder, x, name="X"):
    """``x`` as dataset ``name`` of a fresh HDF5 file in ``folder``, open for reading."""
    path = folder / f"{uuid.uuid4().hex}.h5"
    with h5py.File(path, "w") as fh:
        fh[name] = x
    return h5py.File(path, "r")[name]


def _operand(ds, chunks, inline=False):
    token = "h5-" + uuid.uuid4().hex
    return da.from_array(ds, chunks=chunks, name=token, inline_array=inline), token


def _computed(client, x):
    """``x`` computed on ``client``'s cluster, waited for 60 s at most."""
    return client.compute(x).result(timeout=60)


def _workers(client) -> list[str]:
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


@pytest.mark.parametrize("inline", [False, True], ids=["original", "inline"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reads_of_a_file_a_worker_cannot_open_go_only_to_those_that_can(
        tmp_path, client, record, layout, inline):
    """The reads were placed by the scheduler's own heuristics, on any worker: the one
    without the file failed the read (or, fetching the dataset, failed to unpickle it)."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    seeing = _workers(client)
    with hidden_worker(client, tmp_path):
        x, token = _operand(_dataset(tmp_path, a), (10, 10), inline)
        with dask.config.set(LAYOUTS[layout]):
            c = distmm.matmul(x, da.from_array(b, chunks=(10, 7)), client=client)
        assert isinstance(c, PinnedArray)
        got = _computed(client, c)
        _assert_pinned(record, token, seeing)
    assert_matches_numpy(got, a, b)


def test_reads_stay_on_the_checked_workers_when_one_joins_later(tmp_path, client, record):
    """Every worker saw the file when the product was made; one that joins before it is
    computed was never asked, and does not see the file: no read goes there."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((30, 40)), rng.standard_normal((40, 25))
    checked = _workers(client)
    ds = _dataset(tmp_path, b)
    y, token = _operand(ds, (10, 8))
    c = distmm.matmul(a, y, client=client)
    with hidden_worker(client, tmp_path):
        got = _computed(client, c)
        _assert_pinned(record, token, checked)
    assert_matches_numpy(got, a, b)


@pytest.mark.parametrize("position", ["a", "b", "both"])
def test_a_vector_operand_s_squeezed_result_keeps_the_pins(tmp_path, client, record, position):
    """``distmm.api`` squeezes the product of a 1-D operand: the squeezed array was a plain
    dask array, whose optimisation dropped every pin (the reads' among them)."""
    rng = np.random.default_rng()
    a = rng.standard_normal(30) if position in ("a", "both") else rng.standard_normal((12, 30))
    b = rng.standard_normal(30) if position in ("b", "both") else rng.standard_normal((30, 9))
    seeing = _workers(client)
    with hidden_worker(client, tmp_path):
        x, token = _operand(_dataset(tmp_path, a), 10)
        c = distmm.matmul(x, da.from_array(b, chunks=10), client=client)
        assert isinstance(c, PinnedArray) and c.shape == np.matmul(a, b).shape
        got = _computed(client, c)
        _assert_pinned(record, token, seeing)
    assert_matches_numpy(got, a, b)


def test_a_squeezed_result_keeps_the_plan_s_placement(client, record):
    """Without any file: a vector's product is squeezed, and its product tasks still carry
    the plan's worker pins (loose), as the 2-D product's do."""
    rng = np.random.default_rng()
    v, b = rng.standard_normal(40), rng.standard_normal((40, 30))
    c = distmm.matmul(da.from_array(v, chunks=10), da.from_array(b, chunks=10), client=client)
    assert isinstance(c, PinnedArray)
    got = _computed(client, c)
    product = {k: r for k, r in record.ran.items()
               if isinstance(k, tuple) and str(k[0]).startswith("distmm-matmul-")}
    assert product and all(r[0] for r in product.values()), product
    assert_matches_numpy(got, v, b)


DERIVED = {
    "T": lambda c: c.T,
    "transpose": lambda c: c.transpose(1, 0),
    "np.transpose": np.transpose,
    "reshape": lambda c: c.reshape(-1),
    "ravel": lambda c: c.ravel(),
    "astype": lambda c: c.astype(np.float32),
    "getitem": lambda c: c[3:17, ::2],
    "rechunk": lambda c: c.rechunk((7, 11)) if isinstance(c, da.Array) else c,
    "squeeze": lambda c: c[:1].squeeze(),
    "np.squeeze": lambda c: np.squeeze(c[:, :1]),
    "swapaxes": lambda c: c.swapaxes(0, 1),
}


@pytest.mark.parametrize("op", sorted(DERIVED))
def test_arrays_made_from_the_result_keep_the_read_pins(tmp_path, client, record, op):
    """An array made from the lazy result by a shape or dtype method (or numpy's function of
    that name) is a ``PinnedArray`` too: computed, the reads it still makes go to the
    workers that see the file, and its values are numpy's of the product."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((24, 30)), rng.standard_normal((30, 22))
    seeing = _workers(client)
    with hidden_worker(client, tmp_path):
        x, token = _operand(_dataset(tmp_path, a), (8, 10))
        c = distmm.matmul(x, da.from_array(b, chunks=(10, 11)), client=client)
        want = DERIVED[op](_computed(client, c))
        record.ran.clear()
        d = DERIVED[op](c)
        assert isinstance(d, PinnedArray), type(d)
        got = _computed(client, d)
        _assert_pinned(record, token, seeing)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want)
