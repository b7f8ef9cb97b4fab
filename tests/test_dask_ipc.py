"""Device chunks between GPU workers of one host (CUDA IPC), without a GPU.

Covers: the route rule (``plan_blocks.by_route``, ``ipc_sources``, ``cost``) and
the pairs a cluster gets (``transfer.candidate_pairs``, ``ipc_pairs``) as
pure functions; ``distmm.dask-device-transfer`` and its environment forms;
``distmm.executor.ipc.Shared``'s pickled form and its origin checks; and, on
a real LocalCluster of two worker processes marked GPU by their resources
(``distmm-debug.device-chunks`` standing in for cupy chunks): ``ipc`` builds
one export task per chunk crossing workers, pinned to its holder
(``allow_other_workers`` False) and read by the block task in place of the
chunk; the exports fail on numpy chunks and the chunks travel inside the
offers over TCP, with the right product and the bytes the plan estimated;
``tcp`` leaves the graph as it was; ``auto`` probes once per cluster and,
finding no working IPC, adds nothing. The GPU side is
``tests/test_dask_ipc_gpu.py``.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import types
import uuid

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import distmm  # noqa: E402
from distmm.config import get_config  # noqa: E402
from distmm.engine.dask import last_stats, transfer_mark, transfer_report  # noqa: E402
from distmm import plan_blocks as loc  # noqa: E402
from distmm.engine.dask import transfer  # noqa: E402
from distmm.engine.dask.pull import Pull  # noqa: E402
from distmm.engine.dask.workers import DEVICES_KEY  # noqa: E402
from distmm.plan_blocks import Unit  # noqa: E402
from distmm.executor import ipc  # noqa: E402
from conftest import assert_close, equal_gpus, placed  # noqa: E402

#: a task that runs only on the worker named, and always runs (export and pull tests)
PINNED = {"allow_other_workers": False, "pure": False}

# -- the route rule, pure ---------------------------------------------------------------------

H1A, H1B, H1C, H2A = "tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.1:4003", \
    "tcp://10.0.0.2:4001"


@pytest.mark.parametrize("address, host", [
    (H1A, "10.0.0.1"), ("tcp://[::1]:8786", "::1"), ("ucx://node-7:1234", "node-7"),
    ("inproc://10.1.2.3/4567/1", "10.1.2.3/4567/1"), ("tls://gpu-host:9000", "gpu-host"),
])
def test_host_of(address, host):
    assert transfer.host_of(address) == host


def test_routes_follow_the_pairs():
    rng = np.random.default_rng()
    sizes = [int(s) for s in rng.integers(1, 10**6, size=4)]
    reads = [(("a", 0, 0), sizes[0], frozenset({0, 1})),  # held by the first worker
             (("b", 0, 0), sizes[1], frozenset({1})),  # held by the first, read by the second
             (("b", 1, 0), sizes[2], frozenset({0, 1})),  # held nowhere (made on a reader)
             (("a", 1, 0), sizes[3], frozenset({1}))]  # replicas on the first and third
    addresses = [H1A, H1B]
    where = {("a", 0, 0): {H1A}, ("b", 0, 0): {H1A}, ("a", 1, 0): {H1C, H1A}}
    everything = sizes[0] + sizes[1] + sizes[2] + sizes[3]
    assert loc.by_route(reads, addresses, where) == {"tcp": everything, "ipc": 0, "nccl": 0}
    assert loc.moved(reads, addresses, where) == everything
    forward = frozenset({(H1A, H1B)})
    routes = loc.by_route(reads, addresses, where, ipc=forward)
    assert routes == {"tcp": sizes[2], "ipc": sizes[0] + sizes[1] + sizes[3], "nccl": 0}
    assert loc.cost(routes) == sizes[2] + (sizes[0] + sizes[1] + sizes[3]) // loc.IPC_COST_DIVISOR
    assert loc.ipc_sources(reads, addresses, where, forward) == {
        (("a", 0, 0), H1B): H1A, (("b", 0, 0), H1B): H1A, (("a", 1, 0), H1B): H1A}
    # a pair has a direction; a replica paired with the reader serves it
    backward = frozenset({(H1B, H1A)})
    assert loc.by_route(reads, addresses, where, ipc=backward)["ipc"] == 0
    third = frozenset({(H1C, H1B)})
    assert loc.ipc_sources(reads, addresses, where, third) == {(("a", 1, 0), H1B): H1C}
    assert loc.by_route(reads, addresses, where, ipc=third) == {
        "tcp": everything - sizes[3], "ipc": sizes[3], "nccl": 0}
    # NCCL pairs carry what no IPC pair does, at their own weight; IPC goes first
    routes = loc.by_route(reads, addresses, where, ipc=third, nccl=forward)
    assert routes == {"tcp": sizes[2], "ipc": sizes[3], "nccl": sizes[0] + sizes[1]}
    assert loc.cost(routes) == (sizes[2] + sizes[3] // loc.IPC_COST_DIVISOR
                                + (sizes[0] + sizes[1]) // loc.NCCL_COST_DIVISOR)
    assert loc.ipc_sources(reads, addresses, where, third, forward) == {
        (("a", 0, 0), H1B): H1A, (("b", 0, 0), H1B): H1A, (("a", 1, 0), H1B): H1C}
    assert loc.ipc_sources(reads, addresses, where, frozenset(), forward) == \
        loc.ipc_sources(reads, addresses, where, forward)
    # scattered from the client: never IPC
    assert loc.by_route(reads, addresses, {}, ipc=forward, from_client=True)["ipc"] == 0


def test_pairs_by_mode():
    units = [Unit(H1A, True, 1000.0), Unit(H1B, True, 1000.0), Unit(H2A, True, 1000.0),
             Unit(H1C, False, 10.0)]
    both = frozenset({(H1A, H1B), (H1B, H1A)})
    assert transfer.candidate_pairs(units) == both  # one host, GPU workers only
    assert transfer.ipc_pairs(None, units, "ipc", True)[0] == both
    for mode, device in (("tcp", True), ("ipc", False), ("auto", False)):
        pairs, info = transfer.ipc_pairs(None, units, mode, device)
        assert pairs == frozenset() and info["mode"] == mode and info["pairs"] == []
    # auto with no probed device among them: nothing to probe, nothing paired
    pairs, info = transfer.ipc_pairs(None, units, "auto", True)
    assert pairs == frozenset() and info["probe"] == {"pairs": 0}
    with pytest.raises(ValueError, match="dask-device-transfer"):
        transfer.ipc_pairs(None, units, "udp", True)


def test_device_chunks_by_meta():
    x = da.ones((4, 4), chunks=2)
    assert not transfer.device_chunks(x, x)
    with dask.config.set({transfer.DEVICE_CHUNKS_KEY: True}):
        assert transfer.device_chunks(x, x)


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [("auto", "auto"), ("ipc", "ipc"), ("tcp", "tcp"),
                                         ("IPC", "ipc"), (" tcp ", "tcp")])
def test_the_key_parses(value, want):
    assert get_config().dask_device_transfer == "auto"  # the default: IPC where it works
    with dask.config.set({"distmm.dask-device-transfer": value}):
        assert get_config().dask_device_transfer == want


@pytest.mark.parametrize("value", ["udp", None, 1])  # "": no setting (test_config)
def test_a_bad_value_names_the_key(value):
    with dask.config.set({"distmm.dask-device-transfer": value}):
        with pytest.raises(ValueError, match="distmm.dask-device-transfer"):
            get_config()


def _config_in_subprocess(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DASK_DISTMM__", "DISTMM_")) and k != "DASK_CONFIG"}
    env.update(env_extra)
    code = "from distmm.config import get_config; print(get_config().dask_device_transfer)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("env, want", [
    ({"DISTMM_DASK_DEVICE_TRANSFER": "tcp"}, "tcp"),
    ({"DASK_DISTMM__DASK_DEVICE_TRANSFER": "ipc"}, "ipc"),
    ({"DISTMM_DASK_DEVICE_TRANSFER": "tcp", "DASK_DISTMM__DASK_DEVICE_TRANSFER": "ipc"}, "ipc"),
])
@pytest.mark.slow
def test_environment_forms(env, want):
    res = _config_in_subprocess(env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == want


# -- the executor's Shared, without a GPU -----------------------------------------------------

def test_shared_pickles_small_and_checks_where_it_is_opened():
    rng = np.random.default_rng()
    shape = (int(rng.integers(1, 5000)), int(rng.integers(1, 5000)))
    handle = os.urandom(64)
    other = ipc.Shared(handle, shape, "float32", "0000:3B:00.0", 4242, uuid.uuid4().hex,
                       "elsewhere/0", uuid.uuid4().hex)
    data = pickle.dumps(other)
    assert len(data) < 1024  # never the array
    back = pickle.loads(data)
    assert (back.handle, back.shape, back.dtype, back.pci_bus_id, back.pid, back.nbytes) == (
        handle, shape, np.dtype("float32"), "0000:3B:00.0", 4242, shape[0] * shape[1] * 4)
    assert not back.local and not back.gone
    with pytest.raises(ipc.IPCError, match="another host|only between processes of one host"):
        ipc.open_copy(back)
    # this process's own export whose allocation is gone: refused, never stale bytes
    mine = ipc.Shared(handle, shape, "float64", "0000:3B:00.0", os.getpid(), ipc.PROCESS,
                      ipc.host_identity(), uuid.uuid4().hex)
    assert mine.local and mine.gone and pickle.loads(pickle.dumps(mine)).gone
    with pytest.raises(ipc.IPCError):
        ipc.open_copy(mine)
    with pytest.raises(ipc.IPCError):
        ipc.local_array(mine.token)
    with pytest.raises(ipc.IPCError):
        ipc.export(rng.standard_normal((3, 3)))  # no cupy here, or not a cupy array


# -- on a LocalCluster ------------------------------------------------------------------------

def _layer(C, prefix):
    names = [n for n in C.dask.layers if n.startswith(prefix)]
    assert len(names) <= 1, names
    return C.dask.layers[names[0]] if names else None



def _placed_pair(client, w0, w1, rng):
    """A's top rows on the second worker, its bottom rows on the first; B's k
    halves one each (``test_dask_locality``'s first case): the chosen layout
    puts the top block on the second worker, and each worker lacks one B half."""
    a, b = rng.standard_normal((1024, 768)), rng.standard_normal((768, 512))
    A = placed(client, a, ((512, 512), (768,)), [[w1], [w0]])
    B = placed(client, b, ((384, 384), (512,)), [[w0], [w1]])
    return a, b, A, B


@pytest.mark.slow
def test_ipc_exports_cross_worker_chunks_from_their_holder(pair):
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b, A, B = _placed_pair(client, w0, w1, rng)
    mark = transfer_mark(client)
    with equal_gpus(), dask.config.set({"distmm.dask-device-transfer": "ipc",
                                        transfer.DEVICE_CHUNKS_KEY: True}):
        C = distmm.matmul(A, B, client=client)
    stats = last_stats()
    half_b = 384 * 512 * 8
    assert stats["transfer"]["pairs"] == sorted([(w0, w1), (w1, w0)])
    assert stats["transfer"]["exports"] == 2
    assert stats["estimated_bytes"]["ipc"] == 2 * half_b
    assert stats["estimated_bytes"]["worker_to_worker"] == 0
    assert stats["locality"]["routes"] == {"tcp": 0, "ipc": 2 * half_b, "nccl": 0}
    assert stats["locality"]["assignment"] == [w1, w0]
    # the graph: one export per B half, pinned to the worker holding it
    exports = _layer(C, "distmm-export-")
    (export_name,) = [n for n in C.dask.layers if n.startswith("distmm-export-")]
    assert exports is not None and exports.annotations["allow_other_workers"] is False
    pinned = exports.annotations["workers"]
    holder_of = {}
    for key in exports:
        (dep,) = exports[key].dependencies
        holder_of[dep] = pinned(key)
    assert holder_of == {(B.name, 0, 0): [w0], (B.name, 1, 0): [w1]}
    product = _layer(C, "distmm-matmul-")
    export_of = {dep: key for key in exports for dep in exports[key].dependencies}
    # the block tasks do not wait for the exports: each pulls its offer from the holder
    assert stats["transfer"]["pull"] is True
    top, bottom = (product.get_dependencies((product.name, i, 0)) for i in (0, 1))
    assert top == {(A.name, 0, 0), (B.name, 1, 0)}
    assert bottom == {(A.name, 1, 0), (B.name, 0, 0)}
    assert product.b.routes == {((0, 0), w1): Pull(export_of[(B.name, 0, 0)], w0),
                                ((1, 0), w0): Pull(export_of[(B.name, 1, 0)], w1)}
    # ... and the output chunks cut from each block keep the exports its worker pulled alive
    chunks = _layer(C, "distmm-chunks-")
    for key in chunks:
        want = export_of[(B.name, 0, 0)] if key[1] == 0 else export_of[(B.name, 1, 0)]
        assert want in chunks[key].dependencies, (key, chunks[key].dependencies)
    # run it: numpy chunks cannot be exported, so each offer carries its chunk over TCP
    with distributed.get_task_stream(client) as ts:
        C = C.persist()
        distributed.wait(C)
    measured = transfer_report(client, since=mark)
    ran = {str(t["key"]): t["worker"] for t in ts.data}
    for key, holder in ((export_of[(B.name, 0, 0)], w0), (export_of[(B.name, 1, 0)], w1)):
        assert ran[str(key)] == holder, (key, ran)
    routes = measured["device_routes"]
    assert routes["tcp"] == 2 * half_b and routes["ipc"] == routes["fallback"] == 0, routes
    assert measured["by_name"].get(B.name, 0) == 0  # no B chunk fetched as itself
    # the offers (with the chunks) came through the holders' handler, once; the output
    # chunks fetched the exports' small receipts only
    assert measured["by_name"].get(export_name, 0) <= 4096, measured["by_name"]
    assert_close(C.compute(), a @ b)


def test_an_inline_offer_first_in_a_block_is_a_host_chunk(pair):
    """A's k halves on different workers: whichever worker computes a block lacks one A half,
    so an offer can come first among a block's inputs. Without cupy the export fails and the
    offer carries the numpy chunk inline: the block is then a host product, not one that
    imports cupy."""
    client, w0, w1 = pair
    rng = np.random.default_rng()
    for where in ([[w1, w0]], [[w0, w1]]):  # either worker lacks the first A half
        a, b = rng.standard_normal((512, 768)), rng.standard_normal((768, 256))  # new keys
        A = placed(client, a, ((512,), (384, 384)), where)
        B = placed(client, b, ((384, 384), (256,)), [[w0], [w1]])
        with equal_gpus(), dask.config.set({"distmm.dask-device-transfer": "ipc",
                                            transfer.DEVICE_CHUNKS_KEY: True}):
            C = distmm.matmul(A, B, client=client)
            assert last_stats()["transfer"]["exports"] > 0
            assert_close(C.compute(), a @ b)


def test_tcp_leaves_the_graph_as_it_was(pair):
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b, A, B = _placed_pair(client, w0, w1, rng)
    with equal_gpus():
        plain = distmm.matmul(A, B, client=client)  # numpy meta: no device chunks
        before = last_stats()
        with dask.config.set({"distmm.dask-device-transfer": "tcp",
                              transfer.DEVICE_CHUNKS_KEY: True}):
            C = distmm.matmul(A, B, client=client)
        stats = last_stats()
    assert C.name == plain.name and set(C.dask.layers) == set(plain.dask.layers)
    assert _layer(C, "distmm-export-") is None
    assert stats["transfer"] == {"mode": "tcp", "device_chunks": True, "probe": None,
                                 "pairs": [], "exports": 0, "nccl": {"pairs": 0}}
    assert before["transfer"]["device_chunks"] is False
    half_b = 384 * 512 * 8
    assert stats["estimated_bytes"] == dict(before["estimated_bytes"], ipc=0)
    assert stats["estimated_bytes"]["worker_to_worker"] == 2 * half_b
    assert_close(C.compute(), a @ b)


def test_auto_probes_once_per_cluster_and_adds_nothing_without_ipc(pair):
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b, A, B = _placed_pair(client, w0, w1, rng)
    transfer.forget_probes()
    # two devices (the probe's identity, stood in for): both workers are probed
    debug = {DEVICES_KEY: {w0: "dev-0", w1: "dev-1"}, transfer.DEVICE_CHUNKS_KEY: True,
             "distmm.dask-device-transfer": "auto"}  # the default, said outright
    seen = []
    with equal_gpus(), dask.config.set(debug):
        for _ in range(2):
            C = distmm.matmul(A, B, client=client)
            seen.append(last_stats()["transfer"])
    first, second = seen
    assert first["mode"] == "auto" and first["pairs"] == [] and first["exports"] == 0
    assert first["probe"]["cached"] is False and second["probe"]["cached"] is True
    assert set(first["probe"]["failures"]) == {w0, w1}  # neither could export: no cupy here
    assert all("IPCError" in str(v) for v in first["probe"]["failures"].values())
    assert (client.scheduler.address, frozenset({w0, w1})) in transfer._PROBED
    assert _layer(C, "distmm-export-") is None
    # the probes' exports are gone from the workers (freed after the probe returned)
    transfer.settle_probes(30)
    assert all(n == 0 for n in client.run(ipc.probe_release).values())
    assert_close(C.compute(), a @ b)


def test_the_probe_frees_its_exports_after_it_returns_and_only_its_own(monkeypatch):
    """The probe's exports are freed by a thread of their own once the opens are checked
    (the product does not wait for that round trip), and only that probe's: an export of a
    later probe on the same worker stays until its own release."""
    client_calls = []
    released = threading.Event()

    class Shared(ipc.Shared):
        def __init__(self, token):
            self.token = token

    made = {"tcp://h:1": Shared("t1"), "tcp://h:2": Shared("t2")}

    class Client:
        scheduler = types.SimpleNamespace(address="tcp://s:1")

        def run(self, fn, *args, workers=None, on_error=None):
            client_calls.append((getattr(fn, "__name__", fn), threading.current_thread().name,
                                 args, sorted(workers)))
            if fn is ipc.probe_export:
                return made
            if fn is ipc.probe_release:
                released.wait(30)
                return {w: 1 for w in workers}
            return {w: {h: True for h in made if h != w} for w in workers}  # _probe_open

    transfer.forget_probes()
    try:
        pairs, info = transfer.probe(Client(), list(made))
        assert pairs == {("tcp://h:1", "tcp://h:2"), ("tcp://h:2", "tcp://h:1")}
        # returned before the release answered
        assert [c[0] for c in client_calls[:2]] == ["probe_export", "_probe_open"]
        released.set()
        transfer.settle_probes(30)
    finally:
        released.set()
        transfer.forget_probes()
    name, thread, args, workers = client_calls[-1]
    assert name == "probe_release" and thread == "distmm-ipc-probe-release"
    assert args == (["t1", "t2"],) and workers == ["tcp://h:1", "tcp://h:2"]
    # on a worker: only the named exports go
    monkeypatch.setattr(ipc, "_PROBES", {"t1": object(), "later": object()})
    assert ipc.probe_release(["t1", "t2"]) == 1 and list(ipc._PROBES) == ["later"]
    assert ipc.probe_release() == 1 and not ipc._PROBES


# -- the exports' lifetime ---------------------------------------------------------------------

def _hold_fake_export(token):
    """On a worker, in a task: hold a stand-in export (any allocation object) until
    the scheduler releases this task's key."""
    fake = ipc.Shared(b"\0" * 64, (3,), "float32", "0000:00:00.0", os.getpid(), ipc.PROCESS,
                      ipc.host_identity(), token, alloc=bytearray(16))
    return transfer.keep_until_released(fake, ipc.hold)


def _until(client, fn, worker, want, seconds=30):
    """``fn()`` on ``worker`` once it returns ``want`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while client.run(fn, workers=[worker])[worker] != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return client.run(fn, workers=[worker])[worker]


def _held_here():
    return ipc.held(), transfer.held_keys()


def test_exports_are_held_until_the_scheduler_releases_their_keys(pair):
    """With the ExportLifetime plugin registered, an export task's allocation is
    held by its token (so a spilled and re-read result still finds it) until the
    scheduler releases the task's key, and then let go."""
    client, w0, _w1 = pair
    assert transfer.ensure_lifetime(client)
    assert transfer.ensure_lifetime(client)  # once per cluster
    base = client.run(_held_here, workers=[w0])[w0]
    fut = client.submit(_hold_fake_export, uuid.uuid4().hex, workers=[w0], pure=False)
    assert fut.result(timeout=60) is True
    assert client.run(_held_here, workers=[w0])[w0] == (base[0] + 1, base[1] + 1)
    time.sleep(0.5)  # still held while the key is kept (the future is alive)
    assert client.run(_held_here, workers=[w0])[w0] == (base[0] + 1, base[1] + 1)
    del fut
    assert _until(client, _held_here, w0, base) == base


def _orphans_here():
    return ipc.held(), transfer.orphans()


def _drop_replica(key, address, dask_scheduler=None):
    """What the Active Memory Manager does to a key held by two workers."""
    dask_scheduler.request_remove_replicas(address, [key], stimulus_id="test-remove-replicas")


@pytest.mark.slow
def test_a_dropped_replica_keeps_the_export_until_the_key_is_gone(pair):
    """A reader fetched the offer (two replicas) and the scheduler drops the holder's:
    the holder keeps the allocation while the key lives on the reader, and lets it go
    once the scheduler no longer knows the key (seen on two H100s: the Active Memory
    Manager dropped holders' replicas and the exports were freed under their readers)."""
    client, w0, w1 = pair
    assert transfer.ensure_lifetime(client)
    client.amm.stop()  # the test drops the replica itself, on the holder
    try:
        base = client.run(_orphans_here, workers=[w0])[w0]
        fut = client.submit(_hold_fake_export, uuid.uuid4().hex, workers=[w0], pure=False)
        assert fut.result(timeout=60) is True
        copy = client.submit(lambda x: x, fut, workers=[w1], allow_other_workers=False,
                             pure=False)
        assert copy.result(timeout=60) is True
        assert sorted(client.who_has(fut)[fut.key]) == sorted([w0, w1])
        client.run_on_scheduler(_drop_replica, fut.key, w0)
        assert _until(client, _orphans_here, w0, (base[0] + 1, base[1] + 1)) == \
            (base[0] + 1, base[1] + 1)
        time.sleep(2 * transfer.SWEEP_SECONDS + 0.5)  # the key lives on w1: still held
        assert list(client.who_has(fut)[fut.key]) == [w1]
        assert client.run(_orphans_here, workers=[w0])[w0] == (base[0] + 1, base[1] + 1)
        del fut, copy
        assert _until(client, _orphans_here, w0, base) == base  # gone: let go
    finally:
        client.amm.start()


class _SlowShared:
    """Stands in for an export whose open (or fallback fetch) takes a while."""

    def __init__(self, gate):
        self.gate = gate

    @property
    def local(self):
        self.gate.wait(20)
        return True


def test_a_release_does_not_wait_for_a_reader_opening_an_offer():
    """The worker's event loop runs ExportLifetime.transition; a task thread opening an
    offer (a fallback fetch waits on that same event loop) must not block it. Seen on an
    H100: a fallback fetch that never returned."""
    import threading

    gate = threading.Event()
    offer = transfer.Offer(_SlowShared(gate), None, "tcp://10.0.0.1:1", "chunk", 12)
    reader = threading.Thread(target=lambda: pytest.raises(ipc.IPCError, transfer.take, offer),
                              daemon=True)
    reader.start()
    time.sleep(0.2)  # the reader is inside take(), opening
    released, key = [], ("distmm-export-test", uuid.uuid4().hex)
    transfer._KEY_TOKENS[key] = ("token", released.append)  # as keep_until_released does
    loop = threading.Thread(target=transfer.ExportLifetime().transition,
                            args=(key, "memory", "forgotten"), daemon=True)
    loop.start()
    loop.join(5)
    stuck = loop.is_alive()
    gate.set()
    reader.join(20)
    assert not stuck and released == ["token"]


def test_outside_a_worker_task_nothing_is_held():
    fake = ipc.Shared(b"\0" * 64, (3,), "float32", "0000:00:00.0", os.getpid(), ipc.PROCESS,
                      ipc.host_identity(), uuid.uuid4().hex, alloc=bytearray(16))
    before = ipc.held()
    assert transfer.keep_until_released(fake, ipc.hold) is False
    assert ipc.held() == before


# -- block tasks pull their offers from the holders -------------------------------------------

def _pull_and_sum(p):
    from distmm.engine.dask.pull import resolve
    from distmm.engine.dask.transfer import take

    (offer,), = resolve([p])
    return float(np.asarray(take(offer)).sum())


def _published_here():
    from distmm.engine.dask import pull

    return pull.published()


def _offered_here(key):
    from distmm.engine.dask import pull

    with pull._LOCK:
        return pull.norm_key(key) in pull._OFFERS


def test_a_late_release_leaves_a_later_export_of_the_same_key_published():
    """Two products of the same operands run export tasks of the same key: the release of
    the first (an orphan the sweep frees after the second has published) must not withdraw
    the second's offers, which its readers are waiting for."""
    from distmm.engine.dask import pull

    key = ("distmm-export-same", 0)
    first = pull.publish(key, ["first"])
    second = pull.publish(list(key), ["second"])  # the same key as msgpack spells it
    try:
        pull.withdraw(key, first)
        with pull._LOCK:
            assert pull._OFFERS.get(key) == ("second",)
        pull.withdraw(key, second)
        with pull._LOCK:
            assert key not in pull._OFFERS
    finally:
        pull.withdraw(key)


def test_readers_holding_each_others_chunks_do_not_deadlock(pair):
    """Two single-thread workers, each running a task that pulls an offer the other
    worker's export task will publish, both started before either export: each reader
    secedes after ``pull.FIRST_WAIT``, the exports run, and both readers get the
    chunks (numpy here: the offers carry them). Once the export keys are released the
    holders stop handing the offers out."""
    client, w0, w1 = pair
    assert transfer.ensure_lifetime(client)
    rng = np.random.default_rng()
    x0, x1 = rng.standard_normal((37, 11)), rng.standard_normal((5, 29))
    c0 = client.scatter(x0, workers=[w0])
    c1 = client.scatter(x1, workers=[w1])
    k0, k1 = (f"distmm-export-test-{uuid.uuid4().hex}" for _ in range(2))
    base = client.run(_published_here)
    r0 = client.submit(_pull_and_sum, Pull(k1, w1, "x1"), workers=[w0], **PINNED)
    r1 = client.submit(_pull_and_sum, Pull(k0, w0, "x0"), workers=[w1], **PINNED)
    deadline = time.time() + 30
    while time.time() < deadline:  # both readers hold their worker's only thread
        busy = client.processing()
        if r0.key in busy.get(w0, ()) and r1.key in busy.get(w1, ()):
            break
        time.sleep(0.02)
    e0 = client.submit(transfer.export_chunks, [c0], ["x0"], key=k0, workers=[w0], **PINNED)
    e1 = client.submit(transfer.export_chunks, [c1], ["x1"], key=k1, workers=[w1], **PINNED)
    assert r0.result(timeout=60) == pytest.approx(float(x1.sum()), rel=1e-12)
    assert r1.result(timeout=60) == pytest.approx(float(x0.sum()), rel=1e-12)
    assert type(e0.result(timeout=60)).__name__ == "Receipt"  # small: the offer stays put
    assert client.run(_published_here) == {w: base[w] + 1 for w in (w0, w1)}
    del e0, e1
    deadline = time.time() + 30
    while client.run(_published_here) != base and time.time() < deadline:
        time.sleep(0.05)
    assert client.run(_published_here) == base


def test_pulled_exports_are_one_task_per_holder_and_reader():
    from distmm.engine.dask.lazy import export_layer

    sources = {(("b", 0, 0), H1B): H1A, (("b", 1, 0), H1B): H1A, (("a", 0, 1), H1B): H1A,
               (("b", 0, 0), H1C): H1A, (("a", 1, 1), H1A): H1B}
    exports, routes = export_layer("distmm-export-t", sources, pull=True)
    assert len(exports.layer) == 3  # (H1A -> H1B), (H1A -> H1C), (H1B -> H1A)
    by_task = {}
    for (chunk, reader), ex in exports.key_of.items():
        by_task.setdefault(ex, set()).add((chunk, reader))
        assert exports.holders[ex] == sources[(chunk, reader)]
    assert sorted(len(v) for v in by_task.values()) == [1, 1, 3]
    for (chunk, reader), holder in sources.items():
        p = routes[chunk[0]][(chunk[1:], reader)]
        assert isinstance(p, Pull) and p.holder == holder
        assert p.key == exports.key_of[(chunk, reader)]
        deps = [d for d in exports.layer[p.key].dependencies]
        assert len(deps) == len(by_task[p.key])
    # the offers' indexes follow the order of the task's chunks
    got = {routes[c[0]][(c[1:], H1B)].index: c for c, r in sources if r == H1B}
    assert sorted(got) == [0, 1, 2] and [got[i] for i in range(3)] == sorted(got.values())
    # without pull: one per chunk and holder, read by key (the chunk ('b', 0, 0) once)
    exports, routes = export_layer("distmm-export-t", sources, pull=False)
    assert len(exports.layer) == 4
    assert routes["b"][((0, 0), H1B)] == routes["b"][((0, 0), H1C)]


def _await_then_look(p):
    from distmm.engine.dask import pull

    pull.await_own([p])
    with pull._LOCK:
        return pull.norm_key(p.key) in pull._OFFERS


def test_a_block_task_lets_its_own_workers_exports_run_first(pair):
    """A task that started before the export task pinned to its own (single-thread)
    worker secedes, the export runs and publishes, and only then the task goes on (on
    a GPU the export's synchronisation would otherwise wait for the task's GEMM)."""
    client, w0, _w1 = pair
    assert transfer.ensure_lifetime(client)
    x = np.arange(12.0).reshape(3, 4)
    c = client.scatter(x, workers=[w0])
    key = f"distmm-export-test-{uuid.uuid4().hex}"
    t = client.submit(_await_then_look, Pull(key, w0, "x"), workers=[w0], **PINNED)
    deadline = time.time() + 30
    while t.key not in client.processing().get(w0, ()) and time.time() < deadline:
        time.sleep(0.02)
    e = client.submit(transfer.export_chunks, [c], ["x"], key=key, workers=[w0], **PINNED)
    assert t.result(timeout=60) is True
    assert type(e.result(timeout=60)).__name__ == "Receipt"
    # held by another worker: nothing to wait for
    other = client.submit(_await_then_look, Pull("distmm-export-none", _w1), workers=[w0],
                          **PINNED)
    assert other.result(timeout=30) is False


@pytest.mark.slow
def test_a_block_task_does_not_wait_for_its_own_export_released_before_it_started(pair):
    """Across hosts (or emulated nodes) a block task may start only after its own
    worker's export ran, was read and was released (its other inputs came over TCP
    meanwhile): it asks the scheduler after ``pull.ASK_AFTER`` and goes on, where it
    waited ``pull.LONG_WAIT`` (600 s) before (4 GPUs as 2 emulated nodes stood still)."""
    from distmm.engine.dask import pull

    client, w0, _w1 = pair
    assert transfer.ensure_lifetime(client)
    # hash=False: a key of its own (another test scatters the same values, and its release
    # could take this one's chunk away)
    c = client.scatter(np.arange(12.0).reshape(3, 4), workers=[w0], hash=False)
    key = f"distmm-export-test-{uuid.uuid4().hex}"
    e = client.submit(transfer.export_chunks, [c], ["x"], key=key, workers=[w0], **PINNED)
    assert type(e.result(timeout=60)).__name__ == "Receipt"
    del e  # the readers are done: the scheduler forgets the key, the holder withdraws it
    deadline = time.time() + 30
    while client.run(_offered_here, key)[w0] and time.time() < deadline:
        time.sleep(0.05)
    assert not client.run(_offered_here, key)[w0]
    t0 = time.monotonic()
    late = client.submit(_await_then_look, Pull(key, w0, "x"), workers=[w0], **PINNED)
    assert late.result(timeout=60) is False
    assert time.monotonic() - t0 < pull.ASK_AFTER + 10


def test_pulling_outside_a_worker_says_where_the_product_must_run():
    from distmm.engine.dask.pull import resolve

    with pytest.raises(ipc.IPCError, match="compute it there"):
        resolve([Pull(("distmm-export-x", 0), "tcp://10.0.0.1:1")])
    assert resolve([1, 2], [3]) == ([1, 2], [3])  # nothing to pull: the lists as they are


def _readers_stop_waiting(client, key, holder, reader, why: str, within: float):
    """An export ``key`` on ``holder`` that will never publish: a reader's pull raises
    ``IPCError`` naming the holder and ``why``, and a block task on the holder stops waiting
    for it, both within ``within`` seconds (not ``pull.LONG_WAIT``)."""
    t0 = time.time()
    r = client.submit(_pull_and_sum, Pull(key, holder, "x"), workers=[reader], **PINNED)
    with pytest.raises(ipc.IPCError, match=f"holder {holder}.*{why}"):
        r.result(timeout=60)
    own = client.submit(_await_then_look, Pull(key, holder, "x"), workers=[holder], **PINNED)
    assert own.result(timeout=60) is False
    assert time.time() - t0 < within


def _withdraw_here(key):
    from distmm.engine.dask import pull

    pull.withdraw(key)
    return pull.published()


def test_an_export_whose_offers_were_withdrawn_fails_its_readers_at_once(pair):
    """An export task that finished but whose offers are no longer published (withdrawn while
    its key stays in memory) will not publish again: a reader's pull says so, naming the
    holder, instead of waiting ``pull.LONG_WAIT`` seconds, and a block task on the holder
    stops waiting for it."""
    client, w0, w1 = pair
    assert transfer.ensure_lifetime(client)
    c = client.scatter(np.ones(3), workers=[w0])
    key = f"distmm-export-test-{uuid.uuid4().hex}"
    e = client.submit(transfer.export_chunks, [c], ["x"], key=key, workers=[w0], **PINNED)
    assert type(e.result(timeout=30)).__name__ == "Receipt"
    before = client.run(_published_here)[w0]
    assert client.run(_withdraw_here, key, workers=[w0])[w0] == before - 1
    _readers_stop_waiting(client, key, w0, w1, "withdrawn", within=20)
    del e


def _set_patience(seconds):
    """On a worker: ``pull.PATIENCE`` set, the engine's warnings kept from now on."""
    import logging

    from distmm.engine.dask import pull

    log = logging.getLogger("distmm.engine.dask")
    if not hasattr(log, "kept"):
        class Keep(logging.Handler):
            def emit(self, record):
                log.kept.append(record.getMessage())
        log.kept = []
        log.addHandler(Keep(logging.WARNING))
    old, pull.PATIENCE = pull.PATIENCE, seconds
    return old


def _kept_warnings():
    import logging

    return list(getattr(logging.getLogger("distmm.engine.dask"), "kept", []))


def test_a_reader_still_waiting_says_so_and_then_gets_its_offer(pair):
    """A reader whose offer comes late logs, every ``pull.PATIENCE`` seconds, what it still
    waits for (naming the pulled export), and goes on once the export publishes."""
    client, w0, w1 = pair
    assert transfer.ensure_lifetime(client)
    old = client.run(_set_patience, 0.3, workers=[w1])[w1]
    try:
        x = np.arange(6.0)
        c = client.scatter(x, workers=[w0])
        key = f"distmm-export-test-{uuid.uuid4().hex}"
        r = client.submit(_pull_and_sum, Pull(key, w0, "late-x"), workers=[w1], **PINNED)
        deadline = time.monotonic() + 60  # the reader has said it waits (not a fixed sleep:
        # its task's start plus one patience period, late on a loaded machine)
        while not any("has waited" in msg and "late-x" in msg
                      for msg in client.run(_kept_warnings, workers=[w1])[w1]):
            assert time.monotonic() < deadline and not r.done(), r
            time.sleep(0.1)
        e = client.submit(transfer.export_chunks, [c], ["late-x"], key=key, workers=[w0],
                          **PINNED)
        assert r.result(timeout=60) == pytest.approx(float(x.sum()))
        logs = client.run(_kept_warnings, workers=[w1])[w1]
        assert any("has waited" in msg and "late-x" in msg for msg in logs), logs[-5:]
        del e
    finally:
        client.run(_set_patience, old, workers=[w1])


def _export_that_fails(chunk):
    raise RuntimeError("export failed on purpose")


def test_a_failed_export_fails_its_readers_at_once(pair):
    """An export task that raised never publishes: a reader's pull says so (naming the
    holder) instead of waiting ``pull.LONG_WAIT`` seconds, and a block task on the holder
    stops waiting for it."""
    client, w0, w1 = pair
    assert transfer.ensure_lifetime(client)
    c = client.scatter(np.ones(3), workers=[w0])
    key = f"distmm-export-test-{uuid.uuid4().hex}"
    e = client.submit(_export_that_fails, c, key=key, workers=[w0], **PINNED)
    with pytest.raises(RuntimeError, match="on purpose"):
        e.result(timeout=30)
    _readers_stop_waiting(client, key, w0, w1, "failed", within=30)
