"""HDF5 operands read by Dask workers whose HDF5 lacks a filter the dataset needs, though the
client has it (another machine's HDF5, an ``HDF5_PLUGIN_PATH`` set on the client only):
refused before any task, in one line naming the dataset, the filter and the workers, asked
in the round trip that checks the workers see the file (``distmm.engine.dask.files.visible``).
The workers here lack h5py's lzf filter, unregistered in their processes only."""
from __future__ import annotations

import numpy as np
import pytest

import distmm
from conftest import run_cli, write_scheduler_file

h5py = pytest.importorskip("h5py")
pytest.importorskip("distributed")
from distmm.engine.dask import last_stats  # noqa: E402

pytestmark = pytest.mark.slow  # a LocalCluster of worker processes

LZF = "32000 \\(lzf\\)"
WHY = ("\\(not built into their HDF5, no plugin for it in their HDF5_PLUGIN_PATH or HDF5's "
       "default plugin folder\\)$")


def _unregister_lzf() -> bool:
    from h5py import h5z

    return bool(h5z.unregister_filter(h5z.FILTER_LZF))


def _register_lzf() -> bool:
    from h5py import h5z

    h5z._register_lzf()
    return bool(h5z.filter_avail(h5z.FILTER_LZF))


@pytest.fixture
def without_lzf(client):
    """``take(workers)``: those workers' HDF5 no longer has lzf (the client's still has);
    every worker has it again after the test."""
    def take(workers):
        assert all(client.run(_unregister_lzf, workers=list(workers)).values())
        return list(workers)

    try:
        yield take
    finally:
        assert all(client.run(_register_lzf).values())


def _workers(client) -> list[str]:
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def _lzf(fh, name, x):
    """``x`` as dataset ``name`` of ``fh``, chunked, every chunk compressed by lzf."""
    return fh.create_dataset(name, data=x, chunks=(7, x.shape[1]), compression="lzf")


def _operands(rng, m=37, k=23, n=29):
    return rng.random((m, k)), rng.random((k, n))


def _refused(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert type(info.value) is ValueError  # not UnreadableInput, a worker's failed read
    assert len(str(info.value).splitlines()) == 1, str(info.value)
    return str(info.value)


@pytest.mark.parametrize("func, position", [("matmul", "a"), ("matmul", "b"), ("gemm", "b")])
def test_an_operand_some_worker_lacks_a_filter_for_is_refused_before_any_task(
        tmp_path, client, without_lzf, func, position):
    """The client's HDF5 reads the dataset, so the API's own check passed; the worker without
    the filter failed on its first block (``UnreadableInput``: "... cannot be read ..."),
    after the product's tasks were sent. Now: refused before any task, naming that worker
    and not the one that reads it."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    lacking, having = _workers(client)
    without_lzf([lacking])
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        ds = _lzf(fh, "g/X", a if position == "a" else b)
        ops = (ds, b) if position == "a" else (a, ds)
        client.get_task_stream()  # the scheduler records tasks from now on
        text = _refused(lambda: getattr(distmm, func)(*ops, client=client, tile=16),
                        f"^{func}: operand {position} \\(HDF5 dataset "
                        f"{tmp_path / 'ops.h5'}:/g/X\\) needs HDF5 filter {LZF}, which is not "
                        f"available on Dask worker {lacking} {WHY}")
        assert having not in text
        assert not client.get_task_stream()


def test_workers_that_all_lack_it_are_all_named(tmp_path, client, without_lzf):
    rng = np.random.default_rng()
    a, b = _operands(rng)
    workers = without_lzf(_workers(client))
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        ds_a, ds_b = _lzf(fh, "A", a), _lzf(fh, "B", b)
        fh.flush()
        client.get_task_stream()
        _refused(lambda: distmm.matmul(ds_a, ds_b, client=client, tile=16),
                 f"^matmul: operand a \\(HDF5 dataset {tmp_path / 'ops.h5'}:/A\\) needs HDF5 "
                 f"filter {LZF}, which is not available on Dask workers "
                 f"{', '.join(workers)} {WHY}")
        assert not client.get_task_stream()


def test_the_command_line_refuses_it_in_one_line(tmp_path, client, without_lzf):
    """``distmm matmul f.h5:A b.npy --scheduler-file ...``: the client process has lzf (h5py
    registers it), the cluster's workers do not."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    workers = without_lzf(_workers(client))
    with h5py.File(tmp_path / "a.h5", "w") as fh:
        _lzf(fh, "A", a)
    np.save(tmp_path / "b.npy", b)
    (tmp_path / "scheduler").mkdir()
    sched = write_scheduler_file(client, tmp_path / "scheduler" / "s.json")
    r = run_cli("matmul", f"{tmp_path / 'a.h5'}:A", tmp_path / "b.npy", "-o",
                tmp_path / "c.npy", "--scheduler-file", sched, "--tile", "16")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "needs HDF5 filter 32000 (lzf), which is not available on Dask workers " \
        f"{', '.join(workers)}" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5", "b.npy", "scheduler"]


def _probes(client, monkeypatch) -> list:
    """The functions the client runs on the workers from ``distmm.engine.dask.files``,
    but for closing its handles, as the product runs."""
    seen = []
    run = client.run

    def counted(func, *args, **kw):
        if func.__module__ == "distmm.engine.dask.files" and func.__name__ != "_release":
            seen.append(func.__name__)
        return run(func, *args, **kw)

    monkeypatch.setattr(client, "run", counted)
    return seen


def test_workers_with_the_filter_read_it_in_one_round_trip(tmp_path, client, monkeypatch):
    """The filter check rides on the round trip that asks whether the workers see the file:
    one for an HDF5 operand, one (as before) for a ``.npy`` one; the workers read both."""
    rng = np.random.default_rng()
    a, b = _operands(rng)
    np.save(tmp_path / "b.npy", b)
    with h5py.File(tmp_path / "a.h5", "w") as fh:
        ds = _lzf(fh, "A", a)
        fh.flush()
        mb = np.load(tmp_path / "b.npy", mmap_mode="r")
        probes = _probes(client, monkeypatch)
        got = distmm.matmul(ds, mb, client=client, tile=16)
        assert len(probes) == 1, probes
        assert last_stats()["read_on_workers"] == [True, True]
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)
        del probes[:]
        got = distmm.matmul(a, mb, client=client, tile=16)
        assert probes == ["_stamps"]
        assert last_stats()["read_on_workers"] == [False, True]
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)


def test_a_worker_that_joins_after_the_check_reads_none_of_the_file(tmp_path, client,
                                                                    monkeypatch):
    """A worker that joins once the check passed (here: between it and the first tasks),
    without lzf, was given its share of the reads and failed the product (h5py's OSError
    "Can't synchronously read data", noted with the file). Now only the workers that were
    asked read the file; the client reads what none of them may."""
    import os
    import subprocess
    import sys

    from distmm.engine.dask import eager

    rng = np.random.default_rng()
    a, b = _operands(rng, m=67, k=41)
    asked, joined = set(_workers(client)), []
    check = eager._file_sources

    def then_join(*args, **kw):
        found = check(*args, **kw)
        joined.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", client.scheduler.address,
             "--nthreads", "1", "--no-nanny", "--no-dashboard", "--memory-limit", "1GiB"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, sys.path)))))
        client.wait_for_workers(len(asked) + 1, timeout=60)
        assert all(client.run(_unregister_lzf, workers=sorted(set(_workers(client)) - asked))
                   .values())
        return found

    monkeypatch.setattr(eager, "_file_sources", then_join)
    try:
        with h5py.File(tmp_path / "ops.h5", "w") as fh:
            ds = _lzf(fh, "A", a)
            fh.flush()
            client.get_task_stream()
            got = distmm.matmul(ds, b, client=client, tile=16)
            stream = client.get_task_stream()
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)
        readers = {t["worker"] for t in stream if "distmm-a-" in str(t["key"])}
        assert readers and readers <= asked, (readers, asked)
    finally:
        for proc in joined:
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize("position, inline", [("a", False), ("b", True)])
def test_a_dask_array_over_a_dataset_some_worker_lacks_a_filter_for_is_refused(
        tmp_path, client, without_lzf, position, inline):
    """``da.from_array(h5py_dataset)``: the workers open the dataset when the lazy result is
    computed, and one without lzf failed there (h5py's OSError, after tasks ran); the API's
    check asks the client's HDF5 only. Now: refused before any task, naming the worker."""
    import dask.array as da

    rng = np.random.default_rng()
    a, b = _operands(rng)
    lacking, having = _workers(client)
    without_lzf([lacking])
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        _lzf(fh, "g/X", a if position == "a" else b)
    with h5py.File(tmp_path / "ops.h5", "r") as fh:  # workers open it read-only (distributed)
        x = da.from_array(fh["g/X"], chunks=(16, 16), inline_array=inline)
        ops = (x, b) if position == "a" else (a, x)
        ran = len(client.get_task_stream())  # the earlier tests' tasks
        text = _refused(lambda: distmm.matmul(*ops, client=client, tile=16).compute(),
                        f"^matmul: operand {position} \\(dask array of HDF5 dataset "
                        f"{tmp_path / 'ops.h5'}:/g/X\\) needs HDF5 filter {LZF}, which is not "
                        f"available on Dask worker {lacking} {WHY}")
        assert having not in text
        assert len(client.get_task_stream()) == ran


def test_a_dask_array_over_a_dataset_every_worker_reads_is_computed(tmp_path, client,
                                                                     monkeypatch):
    """Workers with the filter (gzip: the in-process scheduler keeps the dataset it passed
    on open, and an lzf one would keep this process from unregistering lzf in later tests):
    the check is one round trip, and the product is right."""
    import dask.array as da

    rng = np.random.default_rng()
    a, b = _operands(rng)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        fh.create_dataset("A", data=a, chunks=(7, a.shape[1]), compression="gzip")
    with h5py.File(tmp_path / "ops.h5", "r") as fh:
        x = da.from_array(fh["A"], chunks=(16, 16))
        probes = _probes(client, monkeypatch)
        got = distmm.matmul(x, b, client=client, tile=16)
        assert probes == ["_seen"], probes
        np.testing.assert_allclose(got.compute(), a @ b, rtol=1e-12)
