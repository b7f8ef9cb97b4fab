"""CUDA IPC between GPU worker processes of one host, on a real GPU (one is enough).

Covers, on two dask-cuda workers sharing GPU 0 (``shared_client`` of conftest.py:
``gpu_cluster("0", per_device=2)``): ``distmm.executor.ipc.export`` in one process and
``open_copy`` in the other, bitwise equal to the source for float32, float64 and int32, odd
shapes, an empty array, non-contiguous sources (copied contiguous by the export) and a
contiguous one at an offset into its allocation (exported in place); eight
threads of one reader opening the same export at once; rectangles of an export copied
straight into place in a larger buffer (``map_export`` + ``copy_rect``, as block panels are made); the exporting process opening its own
export; the probe finding both directions; a reader whose open fails (an offer altered to
look exported on another host) fetching the bytes from the holder's live export instead; and
``distmm.matmul`` of cupy chunks persisted on both workers: the plan's IPC bytes are what
the workers opened, no operand chunk crosses TCP, the product matches a float64 reference,
and ``distmm.dask-device-transfer: tcp`` gives the same bits over TCP; a block whose k is cut
into two pieces (``blocks.device_pieces``) against float64, both routes alike. The CPU side is
``tests/test_dask_ipc.py``.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

import dask  # noqa: E402
import distributed  # noqa: E402

import distmm  # noqa: E402
from distmm.engine.dask import last_stats, transfer, transfer_mark, transfer_report  # noqa: E402
from conftest import placed  # noqa: E402


@pytest.fixture(scope="module")
def shared(shared_client):
    """``shared_client``'s two workers on GPU 0, and their addresses in order."""
    w0, w1 = sorted(shared_client.scheduler_info(n_workers=-1)["workers"])
    return shared_client, w0, w1


# -- run on the workers ---------------------------------------------------------------------

def _to_device(x, layout: str):
    import cupy

    if layout == "offset":  # contiguous, 5 rows into a larger allocation: exported directly
        d = cupy.zeros((x.shape[0] + 5,) + x.shape[1:], x.dtype)
        d[5:] = cupy.asarray(x)
        return d[5:]
    d = cupy.asarray(x)
    if layout == "transposed":
        return d.T
    if layout == "strided":
        return d[::2, 1::3]
    return d


_KEPT: list = []  # in the worker processes: exports made by _export, kept alive


def _export(arr):
    """Export ``arr`` and keep the export alive in this process, as a holder must
    (the engine's ``ExportLifetime``): distributed's Active Memory Manager may drop
    this task's replica here once a reader holds the result, and with it the last
    reference to the allocation (seen on 2 x H200: the exporter's own open failed)."""
    from distmm.executor import ipc

    shared = ipc.export(arr)
    _KEPT.append(shared)
    return shared


def _open(shared):
    import cupy

    from distmm.executor import ipc

    out = ipc.open_copy(shared)
    return {"host": cupy.asnumpy(out), "contiguous": bool(out.flags.c_contiguous),
            "pid": os.getpid(), "cupy": isinstance(out, cupy.ndarray)}


def _offer(arr):
    from distmm.engine.dask.transfer import export_chunk

    return export_chunk(arr, "test-chunk")


def _take_as_if_elsewhere(offer):
    """Open an offer as a reader on another host would: the IPC open is refused
    (before any CUDA call) and the bytes come from the holder's live export."""
    import time

    import cupy

    from distmm.engine.dask.transfer import routes_since, take

    since = time.time()
    offer.shared.host = "another-host/0"
    got = take(offer)
    return cupy.asnumpy(got), isinstance(got, cupy.ndarray), routes_since(since)


def _submit(client, fn, *args, worker):
    return client.submit(fn, *args, workers=[worker], allow_other_workers=False, pure=False)


def _on_worker(client, x, worker, layout="contiguous"):
    """``x`` as a cupy array (in ``layout``) held by ``worker``."""
    return _submit(client, _to_device, client.scatter(x, workers=[worker]), layout, worker=worker)


def _source(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-2**31, 2**31 - 1, size=shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


# -- the executor's export and open, between two processes ---------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("shape, layout", [((777, 1283), "contiguous"), ((1, 1), "contiguous"),
                                           ((4099, 3), "transposed"), ((1001, 999), "strided"),
                                           ((513, 257), "offset"),
                                           ((0, 7), "contiguous")])
def test_export_and_open_between_two_processes_are_bitwise(shared, dtype, shape, layout):
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, shape, dtype)
    want = {"transposed": x.T, "strided": x[::2, 1::3]}.get(layout, x)
    arr = _on_worker(client, x, w0, layout)
    sh = _submit(client, _export, arr, worker=w0)
    got = _submit(client, _open, sh, worker=w1).result()
    assert got["cupy"] and got["contiguous"]
    assert got["host"].dtype == want.dtype and got["host"].shape == want.shape
    assert np.array_equal(got["host"], want)
    meta = sh.result()  # on the client: the small fields only
    assert meta.shape == want.shape and meta.dtype == want.dtype and not meta.local
    assert meta.pid != got["pid"]
    assert (meta.handle is None) == (want.size == 0)
    if meta.handle is not None:
        assert isinstance(meta.handle, bytes) and len(meta.handle) == 64
    assert len(pickle.dumps(meta)) < 1024
    if layout == "offset":  # exported in place: the array starts 5 rows into its allocation
        assert meta.offset >= 5 * shape[1] * np.dtype(dtype).itemsize
    elif layout in ("transposed", "strided"):  # a contiguous copy of its own
        assert meta.offset == 0
    # the exporting process opens its own export: a copy, the same bits
    own = _submit(client, _open, sh, worker=w0).result()
    assert own["pid"] == meta.pid and np.array_equal(own["host"], want)


def _open_at_once(shared, readers):
    """``readers`` threads of this process open one export at the same moment (as two
    tasks of one worker reading the same panel do)."""
    import threading

    import cupy

    from distmm.executor import ipc

    barrier = threading.Barrier(readers)
    got: list = [None] * readers

    def read(r):
        cupy.cuda.Device(0).use()
        barrier.wait(timeout=60)
        try:
            got[r] = cupy.asnumpy(ipc.open_copy(shared))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got[r] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=read, args=(r,)) for r in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_readers_of_one_export_in_one_process_at_once_all_get_its_bytes(shared):
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, (2049, 1537), "float32")
    arr = _on_worker(client, x, w0)
    sh = _submit(client, _export, arr, worker=w0)
    for _ in range(3):
        got = _submit(client, _open_at_once, sh, 8, worker=w1).result()
        errors = [g for g in got if isinstance(g, str)]
        assert not errors, errors
        assert all(np.array_equal(g, x) for g in got)


def test_the_probe_finds_both_directions(shared):
    client, w0, w1 = shared
    transfer.forget_probes()
    pairs, info = transfer.probe(client, [w0, w1])
    assert pairs == {(w0, w1), (w1, w0)}, info
    assert info["failures"] == {} and info["cached"] is False
    again, info = transfer.probe(client, [w1, w0])
    assert again == pairs and info["cached"] is True


def test_a_failed_open_fetches_the_bytes_from_the_holder(shared):
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, (1531, 257), "float32")
    arr = _on_worker(client, x, w0)
    offer = _submit(client, _offer, arr, worker=w0)
    host, on_device, routes = _submit(client, _take_as_if_elsewhere, offer, worker=w1).result()
    assert on_device and np.array_equal(host, x)
    assert routes["fallback"] == x.nbytes and routes["ipc"] == routes["tcp"] == 0, routes


def _take_into_panel(offer, elsewhere: bool):
    """In the reader: rows 100:900, columns 3:250 of the offered chunk copied into
    the middle of a NaN panel by ``transfer.take_into`` (as a block task's panels
    are made); ``elsewhere``: the offer altered to look exported on another host,
    so that mapping it fails and the bytes come through ``take``'s fallback."""
    import time

    import cupy

    from distmm.engine.dask.transfer import routes_since, take_into
    from distmm.executor import ipc

    since = time.time()
    if elsewhere:
        offer.shared.host = "another-host/0"
    panel = cupy.full((1000, 400), np.nan, dtype=np.float32)
    mapped: dict = {}
    try:
        take_into(offer, panel[50:850, 60:307], (), 100, 3, mapped)
    finally:
        cupy.cuda.get_current_stream().synchronize()
        for ptr in mapped.values():
            ipc.unmap(ptr)
    return cupy.asnumpy(panel), len(mapped), routes_since(since)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_take_into_copies_a_piece_of_an_offer_into_its_place(shared, elsewhere):
    """What a GPU block task does with another worker's chunk: the piece it needs
    copied straight into its panel (one mapping, the piece's bytes by the IPC
    route), or, when the mapping fails, the whole chunk fetched from the holder
    and the piece copied from it; the same values either way."""
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, (1531, 257), "float32")
    offer = _submit(client, _offer, _on_worker(client, x, w0), worker=w0)
    got, maps, routes = _submit(client, _take_into_panel, offer, elsewhere, worker=w1).result()
    want = np.full((1000, 400), np.nan, dtype=np.float32)
    want[50:850, 60:307] = x[100:900, 3:250]
    np.testing.assert_array_equal(got, want)
    if elsewhere:
        assert maps == 0 and routes["fallback"] == x.nbytes and routes["ipc"] == 0, routes
    else:
        assert maps == 1 and routes["ipc"] == 800 * 247 * 4 and routes["fallback"] == 0, routes


def _copy_rects(shared, rects, shape, dtype):
    """In the reader: map ``shared`` once, copy each ``(r0, c0, rows, cols, dr, dc)``
    rectangle of it to ``(dr, dc)`` of a NaN- (or -1-) filled ``shape`` buffer by
    ``ipc.copy_rect``, synchronise, unmap; the buffer on the host and the bytes."""
    import cupy

    from distmm.executor import ipc

    buf = cupy.full(shape, -1 if np.dtype(dtype).kind == "i" else np.nan, dtype=dtype)
    ptr = ipc.map_export(shared)
    moved = 0
    try:
        for r0, c0, rows, cols, dr, dc in rects:
            moved += ipc.copy_rect(ptr, shared, buf[dr:dr + rows, dc:dc + cols], r0, c0)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        ipc.unmap(ptr)
    return cupy.asnumpy(buf), moved


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_rectangles_of_an_export_copy_into_place_bitwise(shared, dtype):
    """``map_export`` + ``copy_rect`` (what a block task's panels use): pieces of
    another process's export land at their place in a larger buffer, bit for
    bit, and nothing else of the buffer is written."""
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, (777, 1283), dtype)
    sh = _submit(client, _export, _on_worker(client, x, w0), worker=w0)
    rects = [(0, 0, 777, 1283, 5, 3),         # the whole export
             (100, 7, 300, 1001, 790, 1300),  # an inner rectangle, odd offsets
             (776, 1282, 1, 1, 0, 2600)]      # its last element
    got, moved = _submit(client, _copy_rects, sh, rects, (1100, 2700), dtype,
                         worker=w1).result()
    want = np.full((1100, 2700), -1 if np.dtype(dtype).kind == "i" else np.nan, dtype=dtype)
    for r0, c0, rows, cols, dr, dc in rects:
        want[dr:dr + rows, dc:dc + cols] = x[r0:r0 + rows, c0:c0 + cols]
    np.testing.assert_array_equal(got, want)  # NaN where nothing was copied, on both sides
    assert moved == sum(r[2] * r[3] for r in rects) * np.dtype(dtype).itemsize


def _map_copy_and_end_later(shared):
    """In the reader: map ``shared`` through the driver (a context is current once this
    thread has allocated), copy it whole, queue GEMMs, hand the mapping to the
    closing thread; whether the driver's path was taken, whether the queued work was still
    running when ``unmap_later`` returned, the mappings left after waiting, the copy."""
    import cupy

    from distmm.executor import ipc

    buf = cupy.full(shared.shape, np.nan, dtype=shared.dtype)
    driver = ipc.current_context() is not None
    ptr = ipc.map_export(shared)
    ipc.copy_rect(ptr, shared, buf, 0, 0)
    cupy.cuda.get_current_stream().synchronize()
    x = cupy.ones((4096, 4096), dtype=np.float64)
    for _ in range(40):  # about 0.1 s of queued work in all on an H100
        x = x @ x * (1.0 / 4096)
    busy = cupy.cuda.get_current_stream().record()
    ipc.unmap_later([ptr])
    still_running = not busy.done
    left = ipc.closing(wait=120)
    return cupy.asnumpy(buf), driver, still_running, left


def test_a_mapping_ends_on_the_closing_thread_without_waiting_for_queued_work(shared):
    """``map_export`` goes through the driver's entry points where a context is current
    (other Python threads run meanwhile), and ``unmap_later`` returns while the device
    still runs queued work (ending a mapping waits for it); the closing thread ends it."""
    client, w0, w1 = shared
    rng = np.random.default_rng()
    x = _source(rng, (1283, 777), "float32")
    sh = _submit(client, _export, _on_worker(client, x, w0), worker=w0)
    got, driver, still_running, left = _submit(client, _map_copy_and_end_later, sh,
                                               worker=w1).result()
    np.testing.assert_array_equal(got, x)
    assert driver and still_running and left == 0


# -- the engine: block mode over cupy chunks on both workers --------------------------------

def _reference(client, A, B):
    """The float64 product of the operands as they lie on the workers."""
    from distmm.cli.cluster import to_host

    a, b = client.compute([to_host(A), to_host(B)], sync=True)
    return a.astype(np.float64) @ b.astype(np.float64)


def test_matmul_moves_cupy_chunks_by_ipc_and_tcp_gives_the_same_bits(shared):
    """A's rows 0:1000 on the first worker, 1000:2027 on the second; B's k
    halves one each: each worker computes the rows it holds and lacks one half
    of B, which it opens through IPC from the other worker (both directions);
    nothing of A or B crosses TCP."""
    from distmm.cli.cluster import to_host

    client, w0, w1 = shared
    rng = np.random.default_rng()
    a = cupy.asarray(rng.standard_normal((2027, 1531)).astype(np.float32))
    b = cupy.asarray(rng.standard_normal((1531, 999)).astype(np.float32))
    A = placed(client, a, ((1000, 1027), (765, 766)), [[w0, w0], [w1, w1]])
    B = placed(client, b, ((765, 766), (999,)), [[w0], [w1]])
    del a, b
    results = {}
    for mode in ("auto", "tcp"):
        mark = transfer_mark(client)
        with dask.config.set({"distmm.dask-device-transfer": mode}):
            C = distmm.matmul(A, B, client=client)
        stats = last_stats()
        C = client.persist(C)
        distributed.wait(C)
        measured = transfer_report(client, since=mark)
        got = client.compute(to_host(C), sync=True)
        results[mode] = (stats, measured, got)
    want = _reference(client, A, B)  # after the reports: it moves chunks too
    half_b = (765 + 766) * 999 * 4  # each worker's missing half of B, both directions
    stats, measured, got = results["auto"]
    assert stats["mode"] == "blocks"
    assert stats["transfer"]["pairs"] == sorted([(w0, w1), (w1, w0)]), stats["transfer"]
    assert stats["transfer"]["exports"] == 2
    assert stats["locality"]["assignment"] == [w0, w1], stats["locality"]
    est = stats["estimated_bytes"]
    assert est["ipc"] == half_b and est["worker_to_worker"] == 0, est
    routes = measured["device_routes"]
    assert routes["ipc"] == half_b, measured
    assert routes["tcp"] == routes["fallback"] == 0, measured
    tcp_device = measured["by_name"].get(A.name, 0) + measured["by_name"].get(B.name, 0)
    assert tcp_device == 0, measured["by_name"]
    assert measured["worker_to_worker"] < 64 * 1024  # two offers, a few hundred bytes each
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (2027, 999)
    np.testing.assert_allclose(got, want, rtol=3e-4, atol=3e-4 * np.abs(want).max())
    # over TCP: the same layout, the same bits, the half of B logged by distributed instead
    stats_t, measured_t, got_t = results["tcp"]
    assert stats_t["transfer"]["pairs"] == [] and stats_t["transfer"]["exports"] == 0
    assert [u["block"] for u in stats_t["units"]] == [u["block"] for u in stats["units"]]
    assert stats_t["estimated_bytes"]["ipc"] == 0
    assert stats_t["estimated_bytes"]["worker_to_worker"] == half_b
    assert measured_t["device_routes"]["ipc"] == 0
    assert measured_t["by_name"].get(B.name, 0) == half_b, measured_t["by_name"]
    assert np.array_equal(got_t, got)


def test_a_block_over_two_k_pieces_sums_them_and_both_routes_agree(shared):
    """k = 8195 in chunks of 4096 and 4099: each worker's block is cut into two k pieces
    (``blocks.device_pieces``), the first run as one GEMM per chunk of C (into parts of C
    that are not contiguous), the second copied while they run and added in the GEMM
    (beta = 1): the product matches a float64 reference, over IPC and over TCP with the
    same bits."""
    from distmm.cli.cluster import to_host
    from distmm.engine.dask.blocks import device_pieces

    client, w0, w1 = shared
    ks = (4096, 4099)
    assert len(device_pieces([(((0, 0, ks[0]), (1, 0, ks[1])),) * 2])) == 2
    rng = np.random.default_rng()
    rows, cols = (1024, 1025), (1024, 1030)  # parts of C at least FIRST_PART_SIDE a side
    # float64: its blocks are cut at every chunk edge (float32 ones into pieces of 16384)
    a = cupy.asarray(rng.standard_normal((sum(rows), sum(ks))))
    b = cupy.asarray(rng.standard_normal((sum(ks), sum(cols))))
    A = placed(client, a, (rows, ks), [[w0, w1], [w1, w0]])
    B = placed(client, b, (ks, cols), [[w1, w0], [w0, w0]])
    del a, b
    got = {}
    for mode in ("auto", "tcp"):
        with dask.config.set({"distmm.dask-device-transfer": mode}):
            C = distmm.matmul(A, B, client=client)
        assert last_stats()["mode"] == "blocks"
        got[mode] = client.compute(to_host(C), sync=True)
    want = _reference(client, A, B)
    np.testing.assert_allclose(got["auto"], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert np.array_equal(got["auto"], got["tcp"])
