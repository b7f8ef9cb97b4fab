"""Held-back cases of the Dask engine's keys and statistics, on a two-worker cluster of
processes (the ``client`` fixture).

Covers: a 1-D dask operand promoted (a leading 1 for ``a``, a trailing 1 for ``b``) under
keys of distmm's own (``lazy.promoted``), none of them a key of dask.array's own ``v @ b``
or ``v[None, :]`` (``v[:, None]``): computed together with those, or after one of them was
persisted unoptimised, the scheduler sees no key with two different tasks and every result
is numpy's; and ``last_stats()["written_on_workers"]`` of a staged output that the client
wrote itself because none of the workers that see the file was alive
(``sink.write_placement`` None); and an HDF5 dataset that ``dask.optimize`` inlined into the
tasks reading it (``inline_array=True``, fused or not) found by ``hdf5_filters.datasets_of``,
so that a worker lacking its filter refuses the product before any task.
It does *not* cover the lazy product's other cases (tests/test_dask_lazy_heldback.py) or the
workers' writes themselves (tests/test_dask_output.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import distmm  # noqa: E402
from conftest import assert_matches_numpy, random_array  # noqa: E402
from distmm.engine.dask import last_stats  # noqa: E402

pytestmark = pytest.mark.usefixtures("tile_mode")

K, N = 37, 23  # odd sizes in chunks of 10: ragged last chunks


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextmanager
def _scheduler_warnings():
    """The scheduler's log lines during the block (a LocalCluster's scheduler runs in this
    process)."""
    lines = _Lines()
    logger = logging.getLogger("distributed.scheduler")
    logger.addHandler(lines)
    try:
        yield lines.lines
    finally:
        logger.removeHandler(lines)


def _operands(side: str, dtype):
    """``(v, m, vn, mn)``: a 1-D dask operand of K values, the matrix it multiplies (K x N
    for ``side`` "a", N x K for "b"), chunks of 10, and their numpy values."""
    rng = np.random.default_rng()
    vn = random_array(rng, (K,), dtype)
    mn = random_array(rng, (K, N) if side == "a" else (N, K), dtype)
    return da.from_array(vn, chunks=10), da.from_array(mn, chunks=10), vn, mn


def _products(side, v, m, client):
    """distmm's product, dask.array's own, and dask's promotion of ``v`` as its matmul
    makes it."""
    if side == "a":
        return distmm.matmul(v, m, client=client), v @ m, v[None, :]
    return distmm.matmul(m, v, client=client), m @ v, v[:, None]


def _own_keys(x, *operands) -> set:
    """The keys of ``x``'s graph that are no key of the ``operands``' graphs."""
    theirs = set().union(*(dict(o.__dask_graph__()) for o in operands))
    return set(dict(x.__dask_graph__())) - theirs


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_vectors_promotion_has_keys_of_its_own(client, side):
    v, m, vn, mn = _operands(side, np.float64)
    ours, theirs, promotion = _products(side, v, m, client)
    clash = _own_keys(ours, v, m) & (set(dict(theirs.__dask_graph__()))
                                     | set(dict(promotion.__dask_graph__())))
    assert not clash, sorted(map(str, clash))[:3]


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.slow
def test_a_vector_product_meets_dasks_own_on_one_scheduler(client, side, dtype):
    """dask's product and promotion persisted unoptimised (their promotion task unfused),
    then distmm's computed (optimised): no key with two tasks; and, on fresh operands, all
    three computed in one graph; numpy's values, dtype and shape everywhere."""
    v, m, vn, mn = _operands(side, dtype)
    a, b = (vn, mn) if side == "a" else (mn, vn)
    ours, theirs, promotion = _products(side, v, m, client)
    with _scheduler_warnings() as lines:
        held = client.persist([theirs, promotion], optimize_graph=False)
        distributed.wait(held)
        got = ours.compute()
    assert not [x for x in lines if "run_spec" in x], [x[:200] for x in lines][:2]
    assert_matches_numpy(got, a, b)
    assert_matches_numpy(held[0].compute(), a, b)
    del held
    v, m, vn, mn = _operands(side, dtype)
    a, b = (vn, mn) if side == "a" else (mn, vn)
    ours, theirs, promotion = _products(side, v, m, client)
    together = dask.compute(ours, theirs, promotion)
    assert_matches_numpy(together[0], a, b)
    assert_matches_numpy(together[1], a, b)
    np.testing.assert_array_equal(together[2], vn[None, :] if side == "a" else vn[:, None])


def test_a_staged_output_the_client_wrote_is_not_written_on_workers(client, tmp_path,
                                                                    monkeypatch):
    """A staged ``.npy`` output both workers see, in a run where none of them is alive to
    write (``sink.write_placement`` None, as after every writer was lost): the client
    writes C, no write task runs, and the stats say so."""
    from distmm.cli.io import staged_output
    from distmm.engine.dask import sink

    rng = np.random.default_rng()
    a, b = rng.standard_normal((41, 29)), rng.standard_normal((29, 33))
    with staged_output(str(tmp_path / "c.npy"), (41, 33), np.float64) as out:
        distmm.matmul(a, b, out=out, client=client, tile=16)
    assert last_stats()["written_on_workers"]  # the workers wrote it
    writes = []
    real = sink.write_placement

    def no_writer(found, alive):
        writes.append(real(found, alive))
        return None

    monkeypatch.setattr(sink, "write_placement", no_writer)
    with staged_output(str(tmp_path / "d.npy"), (41, 33), np.float64) as out:
        distmm.matmul(a, b, out=out, client=client, tile=16)
    stats = last_stats()
    assert writes and all(w is not None for w in writes)  # a staged output the workers see
    assert stats["written_on_workers"] is False, stats
    assert_matches_numpy(np.load(tmp_path / "d.npy"), a, b)
    np.testing.assert_array_equal(np.load(tmp_path / "d.npy"), np.load(tmp_path / "c.npy"))


def _unregister_lzf() -> bool:
    from h5py import h5z

    return bool(h5z.unregister_filter(h5z.FILTER_LZF))


def _register_lzf() -> bool:
    from h5py import h5z

    h5z._register_lzf()
    return bool(h5z.filter_avail(h5z.FILTER_LZF))


@pytest.mark.parametrize("fused", [False, True])
def test_a_dataset_inlined_by_dask_optimize_is_checked_on_the_workers(client, tmp_path, fused):
    """``da.from_array(dataset, inline_array=True)`` optimised (``dask.optimize``; fused
    with ``* 1`` or not): its getter tasks hold the dataset; one worker lacks its lzf
    filter: refused before any task, in one line naming that worker."""
    h5py = pytest.importorskip("h5py")
    from distmm.hdf5_filters import datasets_of

    rng = np.random.default_rng()
    a, b = rng.standard_normal((37, 23)), rng.standard_normal((23, 29))
    lacking = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        fh.create_dataset("X", data=a, chunks=(7, 23), compression="lzf")
    try:
        assert all(client.run(_unregister_lzf, workers=[lacking]).values())
        with h5py.File(tmp_path / "ops.h5", "r") as fh:
            x = da.from_array(fh["X"], chunks=(16, 16), inline_array=True)
            (x,) = dask.optimize(x * 1 if fused else x)
            assert [d.name for d in datasets_of(x)] == ["/X"]
            ran = len(client.get_task_stream())
            lzf = f"HDF5 filter 32000 \\(lzf\\).* Dask worker {lacking} "
            with pytest.raises(ValueError, match=lzf) as info:
                distmm.matmul(x, b, client=client, tile=16)
            assert type(info.value) is ValueError and "\n" not in str(info.value)
            assert len(client.get_task_stream()) == ran
    finally:
        assert all(client.run(_register_lzf).values())
