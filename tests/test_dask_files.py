"""Operands in files every worker sees: the workers read their own blocks (engine/dask/files).

Covers, on a real LocalCluster of worker processes: a whole ``.npy`` memmap, a zarr
array (a root array and one inside a group) and HDF5 datasets (contiguous, and chunked
with compression, in a file the client holds open for writing) multiplied with the workers
reading the blocks they need from the file (read tasks in the task stream, nothing
scattered; the workers' HDF5 handles closed afterwards), with
the same bits as the same product of in-memory operands; what is not the file (a slice, a
transpose, an in-memory copy) going through the client as before; and the visibility
check refusing a file the workers see differently.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")

import distmm  # noqa: E402
from distmm.engine.dask import files, last_stats  # noqa: E402


def _read_tasks(ts, operand: str) -> int:
    """Tasks of the task stream that read blocks of operand ``a`` or ``b`` from a file."""
    return sum(1 for t in ts.data if isinstance(t["key"], tuple)
               and str(t["key"][0]).startswith(f"distmm-{operand}-"))


def _operands(tmp_path, dtype, m=301, k=257, n=199):
    rng = np.random.default_rng()
    if np.dtype(dtype).kind == "i":
        a = rng.integers(-50, 50, (m, k)).astype(dtype)
        b = rng.integers(-50, 50, (k, n)).astype(dtype)
    else:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
    return a, b


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
@pytest.mark.slow
def test_npy_memmaps_are_read_by_the_workers(client, tmp_path, dtype):
    a, b = _operands(tmp_path, dtype)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", np.asfortranarray(b))  # a Fortran-ordered file too
    am = np.load(tmp_path / "a.npy", mmap_mode="r")
    bm = np.load(tmp_path / "b.npy", mmap_mode="r")
    with distributed.get_task_stream(client) as ts:
        got = distmm.matmul(am, bm, client=client)
    assert last_stats()["read_on_workers"] == [True, True]
    assert _read_tasks(ts, "a") > 0 and _read_tasks(ts, "b") > 0
    want = distmm.matmul(a, b, client=client)  # the same product, scattered from memory
    assert last_stats()["read_on_workers"] == [False, False]
    assert got.dtype == want.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)
    if dtype == "int64":
        np.testing.assert_array_equal(got, a @ b)
    else:
        ref = a.astype(np.float64) @ b.astype(np.float64)
        tol = 1e-4 if dtype == "float32" else 1e-12
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol


def test_zarr_arrays_are_read_by_the_workers(client, tmp_path):
    a, b = _operands(tmp_path, "float64", 520, 333, 410)
    za = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=a.shape, chunks=(128, 100),
                         dtype=a.dtype)
    za[:] = a
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    zb = group.create_array("b", shape=b.shape, chunks=(90, 128), dtype=b.dtype)
    zb[:] = b
    with distributed.get_task_stream(client) as ts:
        got = distmm.matmul(za, zb, client=client)
    assert last_stats()["read_on_workers"] == [True, True]
    assert _read_tasks(ts, "a") > 0 and _read_tasks(ts, "b") > 0
    np.testing.assert_array_equal(got, distmm.matmul(a, b, client=client))


def _open_h5_handles(dask_worker=None) -> int:
    return sum(1 for entry in files._OPEN.values() if entry[1] is not None)


@pytest.mark.parametrize("mode", ["r", "r+"])
def test_h5_datasets_are_read_by_the_workers(client, tmp_path, mode):
    """``r+``: the client holds the file open for writing (the command line does so when
    the output goes into the operands' file); the workers read it all the same."""
    a, b = _operands(tmp_path, "float64", 301, 257, 199)
    with h5py.File(tmp_path / "ops.h5", "w") as fh:
        fh["A"] = a
        fh.create_dataset("g/B", data=b, chunks=(40, 64), compression="gzip")
    fh = h5py.File(tmp_path / "ops.h5", mode)
    try:
        ds_a, ds_b = fh["A"], fh["g/B"]
        client.get_task_stream()  # the scheduler records tasks from now on
        got = distmm.matmul(ds_a, ds_b, client=client, tile=100)
        stats = last_stats()
        assert stats["read_on_workers"] == [True, True]
        reads = {str(t["key"][0]).split("-")[1] for t in client.get_task_stream()  # all held
                 if isinstance(t["key"], tuple) and stats["token"] in str(t["key"][0])
                 and str(t["key"][0]).startswith(("distmm-a-", "distmm-b-"))}
        assert reads == {"a", "b"}
        assert sum(client.run(_open_h5_handles).values()) == 0  # closed when the product ended
    finally:
        fh.close()
    want = distmm.matmul(a, b, client=client, tile=100)  # the same product, scattered
    assert last_stats()["read_on_workers"] == [False, False]
    np.testing.assert_array_equal(got, want)
    ref = a @ b
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-12


def test_an_h5_file_the_workers_see_differently_is_read_by_the_client(client, tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as fh:
        fh["A"] = np.ones((4, 5))
    with h5py.File(tmp_path / "x.h5", "r") as fh:
        src = files.source_of(fh["A"])
    assert (src.kind, src.node, src.shape) == ("h5", "/A", (4, 5))
    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    assert files.visible(client, [src], workers)
    os.utime(tmp_path / "x.h5", ns=(src.mtime_ns + 10**9, src.mtime_ns + 10**9))  # rewritten
    assert not files.visible(client, [src], workers)
    with h5py.File(tmp_path / "x.h5", "r") as fh:  # replaced while open: the client's is old
        os.replace(tmp_path / "x.h5", tmp_path / "old.h5")
        with h5py.File(tmp_path / "x.h5", "w") as new:
            new["A"] = np.full((4, 5), 2.0)
        assert files.source_of(fh["A"]) is None
        np.testing.assert_array_equal(distmm.matmul(fh["A"], np.ones((5, 2)), client=client),
                                      np.full((4, 2), 5.0))
    with h5py.File(tmp_path / "m.h5", "w", driver="core", backing_store=False) as fh:
        fh["A"] = np.ones((4, 5))  # in memory only: no file for a worker to open
        assert files.source_of(fh["A"]) is None


def test_what_is_not_the_whole_file_goes_through_the_client(client, tmp_path):
    a, b = _operands(tmp_path, "float64", 120, 120, 90)
    np.save(tmp_path / "a.npy", a)
    am = np.load(tmp_path / "a.npy", mmap_mode="r")
    for view, want_a in ((am[1:], a[1:]), (am.T, a.T), (np.array(am), a)):
        bb = b if view.shape[1] == b.shape[0] else b[1:]
        got = distmm.matmul(view, bb, client=client)
        assert last_stats()["read_on_workers"] == [False, False]
        np.testing.assert_allclose(got, want_a @ bb, rtol=1e-12, atol=1e-12)


def test_a_file_the_workers_see_differently_is_not_read_there(client, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((4, 5)))
    src = files.source_of(np.load(tmp_path / "a.npy", mmap_mode="r"))
    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    assert files.visible(client, [src], workers)
    stale = replace(src, mtime_ns=src.mtime_ns - 1)  # as if written again since
    assert not files.visible(client, [stale], workers)
    os.remove(tmp_path / "a.npy")
    assert not files.visible(client, [src], workers)


def test_a_file_gone_after_the_check_raises_its_error_at_once(client, tmp_path, monkeypatch):
    """The file vanishes between the visibility check and the workers' reads: the
    product raises the reads' FileNotFoundError at once, not the retry loop's
    WorkersLost a minute later (seen trying it as a user)."""
    import time

    a, b = _operands(tmp_path, "float64", 400, 300, 200)
    np.save(tmp_path / "a.npy", a)
    am = np.load(tmp_path / "a.npy", mmap_mode="r")
    checked = files.visible

    def checked_then_removed(*args, **kwargs):  # the moment: right after the real check
        ok = checked(*args, **kwargs)
        os.remove(tmp_path / "a.npy")
        return ok

    monkeypatch.setattr(files, "visible", checked_then_removed)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="a.npy"):
        distmm.matmul(am, b, client=client, tile=100)
    assert time.monotonic() - t0 < 30


def test_a_chunk_the_workers_cannot_decode_names_its_file(client, tmp_path):
    """A zarr chunk cut short: the workers' read raises zarr's own error, as numpy's read of
    the array would, with a note naming the array (the command line's one line names it)."""
    a, b = _operands(tmp_path, "float64", 60, 40, 30)
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=a.shape, chunks=(10, 40), dtype="f8")
    z[...] = a
    chunk = tmp_path / "a.zarr" / "c" / "3" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    za = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    with pytest.raises(Exception) as want:
        np.matmul(za, b)
    with pytest.raises(type(want.value)) as got:
        distmm.matmul(za, b, client=client, tile=10)
    assert f"distmm: while reading {tmp_path / 'a.zarr'}" in got.value.__notes__


def _replace_file(path, values, *, keep_times: bool = False) -> None:
    """Write ``values`` to a new .npy file renamed onto ``path`` (a new inode), with the old
    file's times when ``keep_times`` (as ``cp -p``, ``rsync -t`` or tar leave them)."""
    st = os.stat(path)
    new = path.with_name("new-" + path.name)
    np.save(new, values)
    os.replace(new, path)
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_memmap_is_the_workers_only_while_it_maps_the_file_they_see(client, tmp_path):
    """Found by a differential fuzz against numpy: the workers read the file under the
    memmap's name, which was not what the client multiplies when its map is copy-on-write
    and changed, or when the file was replaced after it was mapped; and a worker kept its
    map of a replaced file that has the old one's size and times."""
    b = np.eye(4)
    np.save(tmp_path / "c.npy", np.ones((4, 4)))
    private = np.load(tmp_path / "c.npy", mmap_mode="c")
    private[0, 0] = 100.0  # the client's own page, not the file's
    np.testing.assert_array_equal(distmm.matmul(private, b, client=client), private @ b)
    assert last_stats()["read_on_workers"] == [False, False]

    np.save(tmp_path / "r.npy", np.ones((4, 4)))
    mapped = np.load(tmp_path / "r.npy", mmap_mode="r")
    _replace_file(tmp_path / "r.npy", np.full((4, 4), 2.0))  # mapped holds the old file
    np.testing.assert_array_equal(distmm.matmul(mapped, b, client=client), np.ones((4, 4)))
    assert last_stats()["read_on_workers"] == [False, False]

    np.save(tmp_path / "s.npy", np.ones((4, 4)))
    got = distmm.matmul(np.load(tmp_path / "s.npy", mmap_mode="r"), b, client=client)
    assert last_stats()["read_on_workers"] == [True, False]
    np.testing.assert_array_equal(got, np.ones((4, 4)))
    _replace_file(tmp_path / "s.npy", np.full((4, 4), 3.0), keep_times=True)
    got = distmm.matmul(np.load(tmp_path / "s.npy", mmap_mode="r"), b, client=client)
    assert last_stats()["read_on_workers"] == [True, False]  # read there, from the new file
    np.testing.assert_array_equal(got, np.full((4, 4), 3.0))


def _distmm_keys(dask_scheduler=None) -> list:
    return [str(k) for k in dask_scheduler.tasks if str(k).startswith("('distmm-")
            or str(k).startswith("distmm-")]


def test_a_failed_product_leaves_nothing_on_the_cluster(client, tmp_path):
    """Found trying it as a user: after a failed eager product (here a chunk that does not
    decode; a Ctrl-C alike) whose error is still held, as an interactive session holds the
    last one, the cluster kept the scattered and read blocks and the blocks not yet
    gathered, and went on computing them. dask's own compute lets go of its tasks."""
    import time

    a, b = _operands(tmp_path, "float64", 60, 40, 30)
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=a.shape, chunks=(10, 40), dtype="f8")
    z[...] = a
    chunk = tmp_path / "a.zarr" / "c" / "3" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    before = set(client.run_on_scheduler(_distmm_keys))
    with pytest.raises(Exception) as held:  # held: the traceback and its frames
        distmm.matmul(zarr.open_array(str(tmp_path / "a.zarr"), mode="r"), b, client=client,
                      tile=10)
    deadline = time.monotonic() + 10
    while (left := set(client.run_on_scheduler(_distmm_keys)) - before) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, sorted(left)[:5]
    assert held.value is not None


def _rss_file_mib(dask_worker=None) -> float:
    """This process's resident file-backed pages (Linux), in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_a_npy_operand_read_by_the_workers_leaves_their_memory(client, tmp_path):
    """Found trying it as a user: the workers kept their map of a ``.npy`` operand open, so
    every page they read stayed in their RSS, which dask's memory monitor counts: workers
    whose share of the file neared 80% of their ``memory_limit`` paused, and the product
    (320 MB over two 600 MiB workers) waited for ever."""
    b = np.random.default_rng(3).standard_normal((2048, 4))
    np.save(tmp_path / "w.npy", np.ones((64, 2048)))
    distmm.matmul(np.load(tmp_path / "w.npy", mmap_mode="r"), b, client=client)  # warm up
    a = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype="f8", shape=(4096, 2048))
    a[...] = 1.0  # 64 MiB, half of it read by each worker
    a.flush()
    before = client.run(_rss_file_mib)
    got = distmm.matmul(np.load(tmp_path / "a.npy", mmap_mode="r"), b, client=client, tile=512)
    assert last_stats()["read_on_workers"] == [True, False]
    np.testing.assert_allclose(got[:3], np.ones((3, 2048)) @ b)
    grew = {w: mib - before[w] for w, mib in client.run(_rss_file_mib).items()}
    assert all(g < 8 for g in grew.values()), grew
