"""C written by the Dask workers into the staged output (engine/dask/sink), end to end.

Covers, on real LocalClusters of worker processes and real files, ``distmm matmul A B -o C
--scheduler-file F`` with HDF5 operands (read by the workers) and each output format
(``.npy``, HDF5 in a new file, in the operands' own file, zarr, an array in a zarr group):
the same bits as the same product gathered on the client, write tasks in the task stream,
and only their few-byte acknowledgements sent to a client (``served_to_clients``: the same
check on the gathered product sees all of C); ragged blocks (301 x 199 in tiles of 100);
``--overwrite`` (refused without it, replacing a ``.npy`` file and one HDF5 dataset with it);
an ``out=`` that is no staged file (a numpy or a user's zarr array) filled by the client;
block mode, with a cell failing on the "GPU" and written after its CPU rerun;
runs that fail (shapes that do not multiply, a worker whose file-size limit stops its
writes, SIGTERM to the command) leaving nothing beside the target and no late write
making one again; a worker that cannot see the output (its own mount namespace, as a
host without the shared file system) giving the gathered fallback and a one-line note; and
a worker killed while the blocks are being written (slow).
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

import distmm  # noqa: E402
from distmm.cli.commands import main  # noqa: E402
from distmm.engine.dask import last_stats  # noqa: E402
from conftest import (equal_gpus, kill_workers, served_to_clients, start_call,  # noqa: E402
                      write_scheduler_file)

pytestmark = pytest.mark.usefixtures("tile_mode")

M, K, N, TILE = 301, 257, 199, 100  # C in 4 x 2 blocks: the last block row is one row
BLOCKS = math.ceil(M / TILE) * math.ceil(N / TILE)
ACK_BYTES = 4096  # what the acknowledgements of BLOCKS writes may add up to, at most


@pytest.fixture
def operands(tmp_path):
    """Fresh A (301 x 257) and B (257 x 199) in ``in/ops.h5`` (B chunked and compressed),
    and an empty ``out/`` folder for the results."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    with h5py.File(tmp_path / "in" / "ops.h5", "w") as fh:
        fh["A"] = a
        fh.create_dataset("B", data=b, chunks=(64, 50), compression="gzip")
    return a, b, tmp_path / "in" / "ops.h5"


def _recorded(client) -> list[dict]:
    """Every task the scheduler's task stream holds (its plugin is added by the first
    call): read whole, then picked by key, since distributed 2024.12 places a window of
    time (``get_task_stream()`` as a context) a few tenths of a second off for some
    workers, dropping tasks of the run or adding ones of the run before."""
    return list(client.get_task_stream())


def _size(path: Path) -> int:
    """``path``'s size, -1 while it does not exist (not staged yet, or renamed or removed
    when the run ended between two polls)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _tasks(records, prefix: str, token: str = "") -> int:
    """Tasks whose key starts with ``prefix`` and, given a ``token``, of the product of that
    token (``last_stats()["token"]``)."""
    return sum(1 for t in records if isinstance(t["key"], tuple)
               and str(t["key"][0]).startswith(prefix) and token in str(t["key"][0]))


def _read(spec: str) -> np.ndarray:
    head, _, dataset = spec.partition(":")
    if head.endswith(".npy"):
        return np.load(head)
    if dataset:
        with h5py.File(head, "r") as fh:
            return fh[dataset][...]
    return zarr.open_array(head, mode="r")[...]


def _left_beside(folder: Path) -> list[str]:
    """What a run left in ``folder`` that is no result: staged outputs, locks, temporary
    chunk files (searched to any depth: a zarr store is a folder)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if "partial" in p.name or p.name.endswith(".lock") or "distmm-old" in p.name)


def _gathered(client, a, b):
    """The same product, gathered on this client; the byte count sees all of C come here
    (the check the workers' writes must pass can fail)."""
    before = served_to_clients(client)
    want = distmm.matmul(a, b, client=client, tile=TILE)
    assert served_to_clients(client) - before >= want.nbytes
    return want


@pytest.mark.parametrize("target", ["c.npy", "c.h5:C", "ops.h5:C", "c.zarr", "g.zarr/c"])
@pytest.mark.slow
def test_each_format_is_written_by_the_workers(client, scheduler_file, operands, target,
                                               capsys):
    a, b, h5 = operands
    want = _gathered(client, a, b)
    folder = h5.parent if target.startswith("ops.h5") else h5.parent.parent / "out"
    spec = str(folder / target)
    if target.startswith("g.zarr"):
        zarr.open_group(str(folder / "g.zarr"), mode="w")
    before = served_to_clients(client)
    _recorded(client)
    status = main(["matmul", f"{h5}:A", f"{h5}:B", "-o", spec, "--scheduler-file",
                   str(scheduler_file), "--tile", str(TILE)])
    ts = _recorded(client)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.startswith(f"wrote {spec}: shape ({M}, {N})") and err == ""
    stats = last_stats()
    assert stats["written_on_workers"] and stats["read_on_workers"] == [True, True]
    token = stats["token"]
    assert _tasks(ts, "distmm-write-", token) == BLOCKS
    assert _tasks(ts, "distmm-a-", token) > 0 and _tasks(ts, "distmm-b-", token) > 0  # read there
    assert served_to_clients(client) - before < ACK_BYTES
    np.testing.assert_array_equal(_read(spec), want)  # tiles in the same order: the same bits
    assert _left_beside(h5.parent.parent) == []
    if target.startswith("ops.h5"):
        with h5py.File(h5, "r") as fh:
            assert sorted(fh) == ["A", "B", "C"]
            np.testing.assert_array_equal(fh["A"][...], a)


def test_overwrite_replaces_only_the_target(client, scheduler_file, operands, capsys):
    a, b, h5 = operands
    want = _gathered(client, a, b)
    out = h5.parent.parent / "out"
    np.save(out / "c.npy", np.arange(3.0))
    with h5py.File(out / "user.h5", "w") as fh:
        fh["X"] = np.arange(7.0)
        fh["C"] = np.zeros((2, 2))
    args = ["matmul", f"{h5}:A", f"{h5}:B", "--scheduler-file", str(scheduler_file),
            "--tile", str(TILE)]
    for spec in (str(out / "c.npy"), f"{out / 'user.h5'}:C"):
        assert main([*args, "-o", spec]) == 2
        assert "exists: pass --overwrite" in capsys.readouterr().err
        assert main([*args, "-o", spec, "--overwrite"]) == 0
        assert last_stats()["written_on_workers"]
        np.testing.assert_array_equal(_read(spec), want)
    with h5py.File(out / "user.h5", "r") as fh:
        assert sorted(fh) == ["C", "X"]
        np.testing.assert_array_equal(fh["X"][...], np.arange(7.0))
    assert sorted(p.name for p in out.iterdir()) == ["c.npy", "user.h5"]


def test_an_out_that_is_no_staged_file_is_filled_by_the_client(client, tmp_path):
    """``out=`` a numpy array or a user's zarr array (not a staged output of the command
    line): the client writes the blocks into it as they arrive."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    want = distmm.matmul(a, b, client=client, tile=TILE)
    mine = zarr.open_array(str(tmp_path / "mine.zarr"), mode="w", shape=(M, N), chunks=(64, 64),
                           dtype="float64")
    for out in (np.full((M, N), np.nan), mine):
        assert distmm.matmul(a, b, out=out, client=client, tile=TILE) is out
        assert last_stats()["written_on_workers"] is False
        np.testing.assert_array_equal(out[...], want)


def test_block_mode_cells_are_written_by_the_workers_also_after_a_fallback(pair, tmp_path):
    """Block mode (``pair``: two workers that are GPUs by their resource only), cell (0, 0)
    failing on the GPU on purpose: its write task fails with it, and the cell, run again on
    the CPU executor, is written by the worker that ran it; the bits of the same product
    gathered."""
    import dask.config

    from distmm.cli.io import staged_output

    client = pair[0]
    rng = np.random.default_rng()
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    am = np.load(tmp_path / "a.npy", mmap_mode="r")
    bm = np.load(tmp_path / "b.npy", mmap_mode="r")
    with equal_gpus(), dask.config.set({"distmm.dask-layout": "auto",
                                        "distmm-debug.fail-tiles": [[0, 0]]}):
        want = distmm.matmul(a, b, client=client)
        cells = last_stats()["cells"]
        _recorded(client)
        with staged_output(str(tmp_path / "c.npy"), want.shape, want.dtype) as out:
            distmm.matmul(am, bm, out=out, client=client)
    stats = last_stats()
    ts = _recorded(client)
    assert stats["mode"] == "blocks" and stats["moved"] == [(0, 0)] and stats["written_on_workers"]
    writes = [t for t in ts if isinstance(t["key"], tuple)
              and str(t["key"][0]).startswith(f"distmm-write-{stats['token']}-")]
    assert sum(t.get("status") == "OK" for t in writes) == cells
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]


def test_shapes_that_do_not_multiply_stage_nothing(client, scheduler_file, operands, capsys):
    a, b, h5 = operands
    out = h5.parent.parent / "out"
    status = main(["matmul", f"{h5}:A", f"{h5}:A", "-o", str(out / "c.zarr"),
                   "--scheduler-file", str(scheduler_file)])
    assert status == 2 and "inner dimensions differ" in capsys.readouterr().err
    assert list(out.iterdir()) == []


# -- workers of their own: another file-size limit, another mount namespace ----------------


@contextmanager
def _cluster_with_outsider(command_prefix=(), preexec_fn=None):
    """A LocalCluster of one worker process plus one ``dask worker`` process started as
    ``command_prefix + [python, -m, distributed.cli.dask_worker, ...]``; yields a client once
    both are up."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cl:
        cmd = [*command_prefix, sys.executable, "-m", "distributed.cli.dask_worker",
               cl.scheduler_address, "--nthreads", "1", "--no-nanny", "--memory-limit", "2GiB",
               "--dashboard-address", ":0"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # this distmm
        log = tempfile.TemporaryFile()  # a pipe nobody reads could fill and stop the worker
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                preexec_fn=preexec_fn, env=env)
        try:
            with distributed.Client(cl) as c:
                try:
                    c.wait_for_workers(2, timeout=60)
                except TimeoutError:
                    proc.kill()
                    proc.wait()
                    log.seek(0)
                    pytest.fail("the outside worker did not start: "
                                f"{log.read()[-2000:].decode(errors='replace')}")
                yield c
        finally:
            log.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _file_size_limit():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))


@pytest.mark.slow
def test_a_worker_that_cannot_write_fails_the_run_and_leaves_nothing(operands, tmp_path, capsys):
    """One worker's file-size limit (64 KiB: C is 468 KiB) stops its writes with EFBIG: the
    command fails with one line naming the output, and nothing is left beside it."""
    a, b, h5 = operands
    out = tmp_path / "out"
    with _cluster_with_outsider(preexec_fn=_file_size_limit) as c:
        write_scheduler_file(c, tmp_path / "sched.json")
        status = main(["matmul", f"{h5}:A", f"{h5}:B", "-o", str(out / "c.npy"),
                       "--scheduler-file", str(tmp_path / "sched.json"), "--tile", "50"])
        err = capsys.readouterr().err
        assert status == 1, err
        assert err.count("\n") == 1 and "File too large while writing" in err and "c.npy" in err
        time.sleep(0.5)  # a late write would create nothing either: the fence ended them
        assert list(out.iterdir()) == []


def _unshare_prefix(hidden: Path) -> list[str]:
    """A command prefix that runs in a mount namespace of its own with an empty tmpfs over
    ``hidden``: the files there are not seen, as on a host without the shared file system.
    Skips where this machine does not allow it."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    probe = subprocess.run(["unshare", *flags, "sh", "-c", f"mount -t tmpfs tmpfs {hidden}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here ({probe.stderr.strip()})")
    return ["unshare", *flags, "sh", "-c", f'mount -t tmpfs tmpfs {hidden} && exec "$@"', "sh"]


@pytest.mark.slow
def test_a_worker_that_does_not_see_the_output_gives_the_gathered_fallback(operands, tmp_path):
    """The command, as a process of its own: its note is one line on its stderr."""
    a, b, h5 = operands
    out = tmp_path / "out"
    with _cluster_with_outsider(_unshare_prefix(out)) as c:
        write_scheduler_file(c, tmp_path / "sched.json")
        want = _gathered(c, a, b)
        before = served_to_clients(c)
        _recorded(c)
        r = subprocess.run([sys.executable, "-m", "distmm", "matmul", f"{h5}:A", f"{h5}:B",
                            "-o", out / "c.npy", "--scheduler-file", tmp_path / "sched.json",
                            "--tile", str(TILE)], capture_output=True, text=True, timeout=300)
        served = served_to_clients(c) - before
        ts = _recorded(c)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n") == 1 and "the workers do not see" in r.stderr, r.stderr
    assert "gathered" in r.stderr
    assert _tasks(ts, "distmm-write-") == 0 and _tasks(ts, "distmm-a-") > 0  # still read there
    assert served >= want.nbytes
    np.testing.assert_array_equal(np.load(out / "c.npy"), want)
    assert sorted(p.name for p in out.iterdir()) == ["c.npy"]


# -- stopped and disturbed runs (slow) ------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_write_leaves_nothing(client, scheduler_file, tmp_path):
    """SIGTERM to the command while the workers write a zarr result: exit 143, and neither
    the staged folder nor its lock remains, also after the workers' last tasks end (a zarr
    write would otherwise make the removed folder again)."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((2400, 2000)))
    np.save(tmp_path / "b.npy", rng.standard_normal((2000, 2400)))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                             tmp_path / "b.npy", "-o", out / "c.zarr", "--scheduler-file",
                             scheduler_file, "--tile", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    staged = out / f".c.zarr.distmm-partial-{proc.pid}"
    while not any(p.is_file() and p.name != "zarr.json" for p in staged.rglob("*")):
        assert proc.poll() is None, proc.communicate()  # blocks are being written
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().endswith("terminated by SIGTERM") and err.count("\n") == 1, err
    deadline = time.monotonic() + 30
    while client.run_on_scheduler(lambda dask_scheduler: any(
            ts.state == "processing" for ts in dask_scheduler.tasks.values())):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_a_worker_killed_while_blocks_are_written(tmp_path):
    """SIGKILL of one of three workers once C's blocks are being written (the file has
    grown past 1 MiB of its 32 MB): what it held (operand blocks read, blocks of C not yet
    written) is read, computed and written again elsewhere; every block's write task
    completed, C has the bits of an undisturbed run and nothing is left beside it. The kill
    lands among the writes, not inside one chosen ``pwrite``: a block left half written is
    written whole by its next run, which this cannot force."""
    from distmm.cli.io import staged_output

    rng = np.random.default_rng()
    a, b = rng.standard_normal((2000, 1500)), rng.standard_normal((1500, 2000))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    am = np.load(tmp_path / "a.npy", mmap_mode="r")
    bm = np.load(tmp_path / "b.npy", mmap_mode="r")
    with distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cl, \
            distributed.Client(cl) as c:
        c.wait_for_workers(3, timeout=60)
        want = distmm.matmul(a, b, client=c, tile=250)

        def product():
            with staged_output(str(tmp_path / "c.npy"), want.shape, want.dtype) as out:
                distmm.matmul(am, bm, out=out, client=c, tile=250)
            return last_stats()

        staged = tmp_path / f".c.npy.distmm-partial-{os.getpid()}"
        for _ in range(3):  # a run that ends before the kill lands (a starved poll) runs again
            _recorded(c)
            run, result = start_call(product)
            deadline = time.monotonic() + 60
            while run.is_alive() and _size(staged) <= (1 << 20):  # writes begun
                assert time.monotonic() < deadline, result
                time.sleep(0.005)
            killed = kill_workers(c, run, kills=1, gap=0.0)
            run.join(timeout=120)
            stream = _recorded(c)
            if killed or "error" in result:
                break
            (tmp_path / "c.npy").unlink()
    assert killed == 1
    assert "error" not in result, result.get("error")
    assert result["c"]["written_on_workers"]
    written = {t["key"][1:] for t in stream if isinstance(t["key"], tuple)
               and str(t["key"][0]).startswith(f"distmm-write-{result['c']['token']}-")}
    assert written == {(i, j) for i in range(8) for j in range(8)}  # each block, by a worker
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]


def test_write_placement_names_the_live_workers_that_were_checked(tmp_path):
    """Write tasks go to the live workers found to see the staged file, and no other; with
    none of them alive, none: the client writes that round's blocks."""
    from distmm.cli.io import staged_output
    from distmm.engine.dask.sink import sink_of, write_placement

    with staged_output(str(tmp_path / "c.npy"), (5, 3), np.float64) as staged:
        found = sink_of(staged).for_workers(["tcp://w1", "tcp://w2"])
        assert found.writers == {"tcp://w1", "tcp://w2"}
        assert write_placement(found, {"tcp://w2", "tcp://w3"}) == {
            "workers": ["tcp://w2"], "allow_other_workers": False}
        assert write_placement(found, {"tcp://w3"}) is None
        staged[...] = 0


def _port_sorting_first(workers) -> int:
    """A free local port whose address sorts before every one of ``workers``: a joiner
    there is the first worker slot, and so takes the plan's first owner's tiles."""
    import socket

    for port in range(10000, 20000, 7):
        if all(f"tcp://127.0.0.1:{port}" < w for w in workers):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    pytest.skip("no free port sorting before the workers' addresses")


@pytest.mark.slow
def test_a_worker_that_joins_after_the_check_writes_none_of_the_output(client, operands,
                                                                       monkeypatch):
    """A worker that joins once the workers were found to see the staged output (here:
    between that check and the first tasks), in a mount namespace of its own where the
    output's folder is empty (a host without the shared file system), was given product
    tasks and the write tasks after them, and failed the run (its ``StripeWriter`` found no
    staged file). Now only the workers that were asked write C: the joiner's blocks go to
    one of them."""
    from distmm.cli.io import staged_output
    from distmm.engine.dask import eager

    a, b, h5 = operands
    out = h5.parent.parent / "out"
    want = _gathered(client, a, b)
    asked = set(client.scheduler_info(n_workers=-1)["workers"])
    prefix, joined = _unshare_prefix(out), []
    port = _port_sorting_first(asked)
    check = eager._file_sink

    def then_join(*args, **kw):
        found = check(*args, **kw)
        joined.append(subprocess.Popen(
            [*prefix, sys.executable, "-m", "distributed.cli.dask_worker",
             client.scheduler.address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
             "--memory-limit", "1GiB", "--worker-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, sys.path)))))
        client.wait_for_workers(len(asked) + 1, timeout=60)
        return found

    monkeypatch.setattr(eager, "_file_sink", then_join)
    try:
        with h5py.File(h5, "r") as fh:
            _recorded(client)
            with staged_output(str(out / "c.npy"), want.shape, want.dtype) as staged:
                distmm.matmul(fh["A"], fh["B"], out=staged, client=client, tile=TILE)
            stream = _recorded(client)
        token = last_stats()["token"]
        assert last_stats()["written_on_workers"]
        joiner = set(client.scheduler_info(n_workers=-1)["workers"]) - asked
        assert joiner
        writers = {t["worker"] for t in stream if isinstance(t["key"], tuple)
                   and str(t["key"][0]).startswith(f"distmm-write-{token}-")}
        assert writers and writers <= asked, (writers, asked)
        assert any(t["worker"] in joiner for t in stream if isinstance(t["key"], tuple)
                   and str(t["key"][0]).startswith(f"distmm-matmul-{token}-"))  # it computed
        assert _tasks(stream, "distmm-write-", token) == BLOCKS
        np.testing.assert_array_equal(np.load(out / "c.npy"), want)
        assert sorted(p.name for p in out.iterdir()) == ["c.npy"]
    finally:
        for proc in joined:
            proc.terminate()
            proc.wait(30)
