"""The Dask engine's block mode: one contiguous block of C per worker unit.

Covers: the block layout (contiguous rectangles covering C exactly once, on
the allowed cuts, cut further for the memory budget), shares in proportion to
throughput (a slow worker beside a fast one gets nothing), and, on a real
LocalCluster of two worker processes, one marked GPU by its resources and one
plain CPU worker: block products of numpy and dask operands against numpy,
shares followed on the cluster, the fallback of cells failing on purpose
(``distmm-debug.fail-tiles``) to the CPU worker with the log naming them,
split-K bitwise reproducible whichever worker finishes first, and the plan's
estimated bytes against distributed's transfer log.
"""
from __future__ import annotations

import logging
import threading
import time
import warnings

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import distmm  # noqa: E402
from distmm.engine.dask import last_stats, transfer_mark, transfer_report  # noqa: E402
from distmm.plan_blocks import block_layout, shares, worker_grid  # noqa: E402
from distmm.plan import reduction_tree  # noqa: E402
from conftest import kill_workers, start_call  # noqa: E402


# -- the layout, pure -----------------------------------------------------------

def _paint(layout):
    """Owner of every element of C (-1: nobody), and every unit's rectangle
    checked against its cells."""
    owner = np.full((layout.m, layout.n), -1)
    hits = np.zeros((layout.m, layout.n), dtype=int)
    for bi, bj in layout.cells():
        rs = slice(layout.row_edges[bi], layout.row_edges[bi + 1])
        cs = slice(layout.col_edges[bj], layout.col_edges[bj + 1])
        owner[rs, cs] = layout.owner[bi][bj]
        hits[rs, cs] += 1
    return owner, hits


LAYOUTS = [
    (1000, 900, 500, [1, 1, 1, 1], {}),
    (1000, 900, 500, [3, 1, 0], {}),
    (777, 1234, 300, [5, 1, 1, 2, 1, 1], {}),
    (4000, 3000, 4000, [1, 1], {"memory_budget": 40 * 2**20}),
    (513, 257, 100, [1, 1, 1], {"row_cuts": range(0, 513, 100), "col_cuts": (0, 7, 100, 200)}),
    (64, 64, 1 << 16, [1, 1, 1], {}),
]


@pytest.mark.parametrize("m,n,k,weights,kw", LAYOUTS, ids=[f"case{i}" for i in range(len(LAYOUTS))])
def test_blocks_are_contiguous_and_cover_c_once(m, n, k, weights, kw):
    lay = block_layout(m, n, k, weights, **kw)
    owner, hits = _paint(lay)
    assert (hits == 1).all()  # every element in exactly one cell
    assert list(lay.row_edges) == sorted(set(lay.row_edges)) and lay.row_edges[-1] == m
    assert list(lay.col_edges) == sorted(set(lay.col_edges)) and lay.col_edges[-1] == n
    seen = np.zeros((m, n), dtype=int)
    for u, blk in enumerate(lay.blocks):
        mine = owner == u
        if blk is None:
            assert not mine.any()
            continue
        r0, r1, c0, c1 = blk
        want = np.zeros((m, n), dtype=bool)
        want[r0:r1, c0:c1] = True
        assert np.array_equal(mine, want), f"unit {u}'s cells are not its rectangle {blk}"
        seen[r0:r1, c0:c1] += 1
    assert (seen == 1).all()
    for u, w in enumerate(weights):
        if w == 0:
            assert lay.blocks[u] is None
    if "row_cuts" in kw:
        assert set(lay.row_edges) <= set(kw["row_cuts"]) | {m}
        assert set(lay.col_edges) <= set(kw["col_cuts"]) | {n}
    if "memory_budget" in kw:
        kg = max(np.diff(lay.k_edges))
        for bi, bj in lay.cells():
            rh = lay.row_edges[bi + 1] - lay.row_edges[bi]
            cw = lay.col_edges[bj + 1] - lay.col_edges[bj]
            assert (2 * (rh + cw) * kg + rh * cw) * 8 <= kw["memory_budget"] * 1.3


def test_worker_grid_is_near_square():
    assert worker_grid(4, 1000, 1000) == (2, 2)
    assert worker_grid(2, 1000, 1000) in ((1, 2), (2, 1))
    assert sorted(worker_grid(6, 5000, 5000)) == [2, 3]
    assert worker_grid(8, 100, 100000) == (1, 8)  # short and wide: columns
    assert worker_grid(7, 500, 500) in ((1, 7), (7, 1))


def test_shares_follow_throughput_and_drop_slow_workers():
    s = shares([3000, 1000], 8192, 8192, 8192)
    assert s == pytest.approx((0.75, 0.25))
    # a CPU thread beside a GPU: its share would slow the run, it gets nothing
    s = shares([40000, 50, 50, 50], 16384, 16384, 16384, 4)
    assert s[0] == 1.0 and s[1:] == (0.0, 0.0, 0.0)
    # a tiny product is one block, k not split (too short for a group each)
    tiny = block_layout(8, 8, 8, shares([100, 100], 8, 8, 8))
    assert tiny.grid == (1, 1) and tiny.groups == 1
    lay = block_layout(4096, 4096, 4096, shares([3000, 1000], 4096, 4096, 4096))
    assert lay.area(0) / 4096**2 == pytest.approx(0.75, abs=0.02)


def test_many_equal_workers_all_take_part():
    """21 or more equal GPU workers each have a share under 5% of C: the share floor once
    dropped every one of them and gave all of C to one worker (so did the model's dask
    predictions at 64 to 4096 GPUs). The floor is now against the fastest worker's rate; a
    slow worker beside fast ones still gets nothing."""
    for p in (20, 21, 64, 4096):
        s = shares([50000.0] * p, 32768, 32768, 32768, 4)
        assert s == pytest.approx((1 / p,) * p), p
    s = shares([50000.0] * 32 + [2000.0], 32768, 32768, 32768, 4)
    assert s[-1] == 0.0 and s[:-1] == pytest.approx((1 / 32,) * 32)
    start = time.perf_counter()  # linear in the worker count: a model at 131072 GPUs asks it
    assert sum(shares([50000.0] * 131072, 131072, 131072, 131072, 4)) == pytest.approx(1.0)
    assert time.perf_counter() - start < 5


def test_alike_workers_take_one_rate_and_their_blocks_are_even():
    """Probes of alike workers (GPUs of one model; CPU workers of one host with as many
    threads) measure a few percent apart: each group takes its median, so four GPUs of one
    model get four equal blocks; other models, hosts and thread counts keep their own,
    and a worker marked GPU whose probe found no device is not taken for a CPU worker."""
    from distmm.engine.dask.workers import _alike_rates
    from distmm.plan_blocks import block_layout

    gpus = {f"tcp://10.0.0.1:{4000 + i}": r for i, r in enumerate((51200., 49800., 50500., 50100.))}
    found = {a: {"cuda": True, "gpu_gflops": r, "name": "H100", "cpu_gflops": 9.0}
             for a, r in gpus.items()}
    found["tcp://10.0.0.1:5000"] = {"cuda": True, "gpu_gflops": 20000.0, "name": "A10"}
    found["tcp://10.0.0.1:5001"] = {"cuda": True, "gpu_gflops": None, "name": "H100",
                                    "rate_pending": True}  # still measuring: its model's
    found["tcp://10.0.0.1:5002"] = {"cuda": True, "gpu_gflops": None, "name": "L4",
                                    "rate_pending": True}  # no L4 measured yet: assumed
    found["tcp://10.0.0.1:6000"] = {"cuda": False, "cpu_gflops": 10.0}
    found["tcp://10.0.0.1:6001"] = {"cuda": False, "cpu_gflops": 12.0}
    found["tcp://10.0.0.1:6002"] = {"cuda": False, "cpu_gflops": 11.0}  # 2 threads
    found["tcp://10.0.0.2:6000"] = {"cuda": False, "cpu_gflops": 30.0}  # another host
    found["tcp://10.0.0.1:7000"] = {"cuda": False, "cpu_gflops": 5.0}  # marked GPU
    info = {a: {"nthreads": 1} for a in found}
    info["tcp://10.0.0.1:6002"] = {"nthreads": 2}
    info["tcp://10.0.0.1:7000"] = {"nthreads": 1, "resources": {"GPU": 1}}
    rates = _alike_rates(info, found)
    assert {rates[a] for a in gpus} == {(50100. + 50500.) / 2}
    assert rates["tcp://10.0.0.1:5001"] == rates[next(iter(gpus))]
    assert "tcp://10.0.0.1:5002" not in rates
    assert rates["tcp://10.0.0.1:5000"] == 20000.0
    assert rates["tcp://10.0.0.1:6000"] == rates["tcp://10.0.0.1:6001"] == 11.0
    assert rates["tcp://10.0.0.1:6002"] == 22.0 and rates["tcp://10.0.0.2:6000"] == 30.0
    assert "tcp://10.0.0.1:7000" not in rates
    even = block_layout(32768, 32768, 32768, shares([rates[a] for a in gpus], 32768, 32768,
                                                     32768, 4))
    assert {even.area(i) for i in range(4)} == {32768 * 32768 // 4}


def test_workers_whose_gpu_rate_was_pending_are_probed_again_until_it_comes():
    """The first probe of a GPU worker answers before its rate is measured (the worker
    measures it on a thread): the next product probes that worker again in the background
    and plans with the rate of its model or the assumed one; a later product has the rate,
    and a worker that has answered with its rate is not probed again."""
    from distmm.engine.dask import workers

    answers = {"tcp://h:1": [{"cuda": True, "name": "H100", "gpu_gflops": None,
                              "rate_pending": True},
                             {"cuda": True, "name": "H100", "gpu_gflops": 51000.0,
                              "rate_pending": False}],
               "tcp://h:2": [{"cuda": False, "cpu_gflops": 20.0, "rate_pending": False}]}
    asked = []
    gate = threading.Event()  # the background probe answers once the second product is planned

    class Client:
        def run(self, fn, workers=None, on_error=None):
            asked.append(sorted(workers))
            if threading.current_thread().name == "distmm-probe-rates":
                assert gate.wait(30)
            return {w: answers[w].pop(0) for w in workers}

    info = {"tcp://h:1": {"nthreads": 1}, "tcp://h:2": {"nthreads": 2}}
    for addr in info:
        workers.forget(addr)
    try:
        first = {w.address: w for w in workers.worker_info(Client(), None, info)}
        second = {w.address: w for w in workers.worker_info(Client(), None, info)}
        gate.set()
        workers.settle(30)
        third = workers.worker_info(Client(), None, info)
        fourth = workers.worker_info(Client(), None, info)
    finally:
        gate.set()
        workers.settle(30)
        for addr in info:
            workers.forget(addr)
    assert asked == [["tcp://h:1", "tcp://h:2"], ["tcp://h:1"]]
    assert first["tcp://h:1"].gflops == workers.ASSUMED_GPU_GFLOPS and first["tcp://h:1"].gpu
    assert second["tcp://h:1"].gflops == workers.ASSUMED_GPU_GFLOPS  # asked, not waited for
    assert first["tcp://h:2"].gflops == second["tcp://h:2"].gflops == 40.0
    assert [w.gflops for w in third] == [w.gflops for w in fourth] == [51000.0, 40.0]


def test_a_later_worker_at_a_known_address_is_probed_anew():
    """A probe is kept for the worker it came from: a new worker at the same address (a new
    cluster on a reused port, a worker restarted on a fixed one: another local directory)
    is probed again, and its own answer is used (here: a GPU where a CPU worker was)."""
    from distmm.engine.dask import workers

    answers = [{"cuda": False, "cpu_gflops": 20.0, "rate_pending": False},
               {"cuda": True, "name": "H100", "gpu_gflops": 51000.0, "rate_pending": False}]
    asked = []

    class Client:
        def run(self, fn, workers=None, on_error=None):
            asked.append(sorted(workers))
            return {w: answers.pop(0) for w in workers}

    addr = "tcp://h:9"
    workers.forget(addr)
    try:
        first = workers.worker_info(Client(), None, {addr: {"nthreads": 1,
                                                            "local_directory": "/s/worker-a"}})
        again = workers.worker_info(Client(), None, {addr: {"nthreads": 1,
                                                            "local_directory": "/s/worker-a"}})
        later = workers.worker_info(Client(), None, {addr: {"nthreads": 1,
                                                            "local_directory": "/s/worker-b"}})
    finally:
        workers.forget(addr)
    assert asked == [[addr], [addr]]
    assert not first[0].gpu and first == again
    assert later[0].gpu and later[0].gflops == 51000.0


def test_device_pieces_cut_a_blocks_k_at_chunk_edges_in_order():
    """A block's k range, one piece in the spec, is cut at A's and B's chunk edges into a
    first piece of at least ``least`` and later ones of at least ``later`` (a short tail
    joins the piece before), covering every k once, in order, with each piece's A and B
    spans of equal length."""
    from distmm.engine.dask.blocks import device_pieces

    def spans(pieces):
        return [(sum(k1 - k0 for _, k0, k1 in a), sum(k1 - k0 for _, k0, k1 in b))
                for a, b in pieces]

    four = tuple((i, 0, 8192) for i in range(4))
    assert spans(device_pieces([(four, four)])) == [(8192, 8192)] * 4  # the default: chunks
    # longer later pieces: one chunk first, the rest as one (a cut at 24576 would leave 8192)
    assert spans(device_pieces([(four, four)], later=16384)) == [(8192, 8192), (24576, 24576)]
    assert spans(device_pieces([(four, four)], later=8192)) == [(8192, 8192)] * 4
    eight = tuple((i, 0, 8192) for i in range(8))
    assert spans(device_pieces([(eight, eight)], later=16384)) == [
        (8192, 8192), (16384, 16384), (16384, 16384), (24576, 24576)]  # the tail of 8192 joined
    # A's k from column 100 of a chunk of 8192, then 8292 of the next; B's k in 5000 and
    # 11384: edges at 5000 (A inside its chunk) and 8092 (3092 after it: too short, joined)
    a_k = ((3, 100, 8192), (4, 0, 8292))
    b_k = ((0, 0, 5000), (1, 0, 11384))
    got = device_pieces([(a_k, b_k)], least=4096, later=4096)
    assert got == [(((3, 100, 5100),), ((0, 0, 5000),)),
                   (((3, 5100, 8192), (4, 0, 8292)), ((1, 0, 11384),))]
    assert spans(got) == [(5000, 5000), (11384, 11384)]
    assert spans(device_pieces([(a_k, b_k)], least=3000, later=3000)) == [
        (5000, 5000), (3092, 3092), (8292, 8292)]
    # short: one piece as it came; several spec pieces stay apart and in their order
    short = (((0, 0, 3000),), ((0, 0, 3000),))
    assert device_pieces([short]) == [short]
    assert device_pieces([short, short]) == [short, short]


def test_chunked_panel_reads_slices_across_chunks():
    """What the GPU pipeline reads of a block: slices of its chunks, never the
    whole panel assembled first."""
    from distmm.engine.dask.blocks import Chunked
    from distmm.engine.dask.chunks import edges, locate

    rng = np.random.default_rng()
    full = rng.standard_normal((97, 131))
    rows, cols = (30, 40, 27), (50, 1, 80)
    re_, ce_ = edges(rows), edges(cols)
    blocks = {(i, j): full[re_[i]:re_[i + 1], ce_[j]:ce_[j + 1]].copy()
              for i in range(3) for j in range(3)}
    panel = Chunked(blocks, (), locate(re_, 5, 90), locate(ce_, 20, 131))
    want = full[5:90, 20:131]
    assert panel.shape == want.shape and panel.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(panel), want)
    for _ in range(20):
        r0, r1 = sorted(rng.integers(0, want.shape[0] + 1, 2))
        c0, c1 = sorted(rng.integers(0, want.shape[1] + 1, 2))
        if r1 > r0 and c1 > c0:
            np.testing.assert_array_equal(panel[r0:r1, c0:c1], want[r0:r1, c0:c1])


# -- on a cluster: one worker marked GPU, one CPU worker --------------------------

@pytest.fixture(scope="module")
def mixed():
    """A LocalCluster of two nanny'd worker processes: ``gpu`` declares the
    resource GPU=1 (no device visible to it: its GPU tasks run the CPU
    executor), ``cpu`` declares nothing."""
    with distributed.LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB") as cl:
        # no device visible to either, on any machine: the GPU worker is GPU by its resource only
        opts = {"nthreads": 1, "memory_limit": "2GiB", "env": {"CUDA_VISIBLE_DEVICES": ""}}
        cl.worker_spec["gpu"] = {"cls": distributed.Nanny, "options": {**opts, "resources": {"GPU": 1}}}
        cl.worker_spec["cpu"] = {"cls": distributed.Nanny, "options": dict(opts)}
        cl.sync(cl._correct_state)
        with distributed.Client(cl) as client:
            client.wait_for_workers(2, timeout=60)
            info = client.scheduler_info(n_workers=-1)["workers"]
            gpu = [a for a, w in info.items() if (w.get("resources") or {}).get("GPU")]
            cpu = [a for a in info if a not in gpu]
            assert len(gpu) == 1 and len(cpu) == 1
            yield client, gpu[0], cpu[0]


@pytest.mark.parametrize("hidden", ["", " ", "-1", "-1,0"])
def test_a_worker_whose_devices_are_hidden_is_a_cpu_worker_at_once(hidden):
    """CUDA_VISIBLE_DEVICES hiding every device: the probe reports no device without
    asking the driver or importing cupy (either took a CPU worker 0.1 s or more)."""
    import os
    import subprocess
    import sys

    # the driver library may not even be opened: ctypes.CDLL raises if it is
    code = ("import sys, ctypes\n"
            "def trap(*a, **k):\n    raise AssertionError('the driver was asked')\n"
            "ctypes.CDLL = trap\n"
            "from distmm.engine.dask.workers import _driver_devices, probe\n"
            "got = probe()\n"
            "print(_driver_devices(), got['cuda'], got['device'], 'cupy' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": hidden}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "False", "None", "False"], res.stdout


def _gflops(gpu, cpu):
    return dask.config.set({"distmm.dask-worker-gflops": {"gpu": gpu, "cpu": cpu}})


def _units(stats):
    return {u["address"]: u for u in stats["units"]}


def _persisted_pair():
    """Fresh random float64 operands (700 x 513 @ 513 x 601) and the same as dask arrays
    with uneven chunks, persisted on the cluster."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((700, 513)), rng.standard_normal((513, 601))
    A = da.from_array(a, chunks=(100, 200)).persist()
    B = da.from_array(b, chunks=(200, 150)).persist()
    return a, b, A, B


def _random(rng, shape, dtype):
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["float64", "int64", "float32"])
def test_block_products_on_a_mixed_cluster(mixed, dtype):
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = _random(rng, (613, 401), dtype), _random(rng, (401, 555), dtype)
    with _gflops(1000, 1000):
        got = distmm.matmul(a, b, client=client)
    stats = last_stats()
    assert stats["mode"] == "blocks"
    units = _units(stats)
    assert units[gpu]["gpu"] and not units[cpu]["gpu"]
    assert units[gpu]["share"] == pytest.approx(0.5, abs=0.1)
    assert stats["tasks"] == stats["cells"] == 2  # one task per worker's block
    want = a @ b
    assert got.dtype == want.dtype
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = 1e-4 if dtype == "float32" else 1e-11
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_dask_operands_keep_their_chunks_in_block_mode(mixed):
    client, gpu, cpu = mixed
    a, b, A, B = _persisted_pair()
    with _gflops(1000, 1000):
        C = distmm.matmul(A, B, client=client)
    assert last_stats()["mode"] == "blocks"
    assert C.chunks == (A @ B).chunks
    got = C.compute()
    np.testing.assert_allclose(got, a @ b, rtol=1e-11, atol=1e-11 * np.abs(a @ b).max())
    np.testing.assert_array_equal(C[100:200, 150:300].compute(), got[100:200, 150:300])


def test_block_mode_reports_the_workers_flags_as_numpys_matmul(mixed):
    """Blocks on the GPU-marked worker (its CPU executor, no device visible) and the CPU
    worker: an overflow in either reaches the caller as numpy's matmul reports it."""
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = rng.random((600, 300), np.float32), rng.random((300, 500), np.float32)
    a[rng.integers(600)] = 1e38  # one row of C overflows, in whichever block holds it
    with _gflops(3000, 1000), np.errstate(over="raise"):
        with pytest.raises(FloatingPointError, match="overflow encountered in matmul"):
            distmm.matmul(a, b, client=client)
    assert last_stats()["mode"] == "blocks"
    with _gflops(3000, 1000), np.errstate(all="warn"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = distmm.matmul(a, b, client=client)
    assert [str(w.message) for w in seen] == ["overflow encountered in matmul"]
    np.testing.assert_array_equal(np.isinf(got), np.isinf(a @ b))


def test_shares_follow_configured_throughput_on_the_cluster(mixed):
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = rng.standard_normal((1024, 300)), rng.standard_normal((300, 1024))
    with _gflops(3000, 1000):
        got = distmm.matmul(a, b, client=client)
    units = _units(last_stats())
    assert units[gpu]["share"] == pytest.approx(0.75, abs=0.07)
    assert units[cpu]["share"] == pytest.approx(0.25, abs=0.07)
    np.testing.assert_allclose(got, a @ b, rtol=1e-11, atol=1e-9)
    # the GPU far faster: the CPU worker gets nothing, and no task runs there
    with _gflops(1e6, 10):
        got = distmm.matmul(a, b, client=client)
    units = _units(last_stats())
    assert units[gpu]["share"] == 1.0 and units[cpu]["share"] == 0.0
    np.testing.assert_allclose(got, a @ b, rtol=1e-11, atol=1e-9)


def test_units_without_a_share_stay_out_of_the_layouts_costed(mixed, monkeypatch):
    """The CPU worker too slow for a share: the placement search lays C out for the GPU
    worker alone (the mixed cluster costs what the GPU worker alone would), and only the
    chosen layout carries the CPU unit, blockless and last (still the fallback)."""
    from distmm import plan_blocks

    client, gpu, cpu = mixed
    seen = []
    layout = plan_blocks.layout_for

    def spy(plan, units, **kw):
        seen.append(tuple(u.address for u in units))
        return layout(plan, units, **kw)

    monkeypatch.setattr(plan_blocks, "layout_for", spy)
    a, b, A, B = _persisted_pair()
    with _gflops(1e6, 10):
        C = distmm.matmul(A, B, client=client)
    assert len(seen) >= 2 and set(seen[:-1]) == {(gpu,)} and seen[-1] == (gpu, cpu)
    stats = last_stats()
    assert [(u["address"], u["share"]) for u in stats["units"]] == [(gpu, 1.0), (cpu, 0.0)]
    np.testing.assert_allclose(C.compute(), a @ b, rtol=1e-11, atol=1e-11 * np.abs(a @ b).max())


def test_the_worker_table_and_where_the_chunks_are_come_in_one_round_trip(mixed, monkeypatch):
    """A product of persisted dask operands asks the scheduler once before its graph is
    built: no ``scheduler_info`` or ``who_has`` of its own, and the placement still knows
    where the chunks are (it searched orders, which it does only with their places)."""
    from distmm.engine.dask import placement

    client, gpu, cpu = mixed
    a, b, A, B = _persisted_pair()
    distributed.wait([A, B])
    asked = []
    state = placement.cluster_state

    def once(*args, **kw):
        asked.append(len(args))
        return state(*args, **kw)

    def boom(*args, **kw):
        raise AssertionError("a second request to the scheduler")

    with monkeypatch.context() as mp, _gflops(1000, 1000):
        mp.setattr(placement, "cluster_state", once)
        mp.setattr(placement, "who_has", boom)
        mp.setattr(client, "scheduler_info", boom)
        mp.setattr(client, "who_has", boom)
        C = distmm.matmul(A, B, client=client)
    assert asked == [3]  # the client and both operands
    loc = last_stats()["locality"]
    assert loc["method"] in ("exact", "swaps") and loc["estimated_bytes"] <= loc["naive_bytes"]
    np.testing.assert_allclose(C.compute(), a @ b, rtol=1e-11, atol=1e-11 * np.abs(a @ b).max())


@pytest.mark.slow
def test_the_worker_table_is_read_again_when_the_workers_change():
    """The full table is kept per client while the running workers stay the same, and
    read again when one joins or leaves."""
    from distmm.engine.dask.placement import cluster_state

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="1GiB") as cl, \
            distributed.Client(cl) as client:
        first, _ = cluster_state(client)
        again, _ = cluster_state(client)
        assert again is first and len(first) == 1
        cl.scale(2)
        client.wait_for_workers(2, timeout=60)
        grown, _ = cluster_state(client)
        assert grown is not first and len(grown) == 2 and set(first) < set(grown)
        assert all(w["nthreads"] == 1 and w["memory_limit"] == 2**30 for w in grown.values())
        cl.scale(1)
        deadline = time.monotonic() + 60
        while (len(client.scheduler_info(n_workers=-1)["workers"]) > 1
               and time.monotonic() < deadline):
            time.sleep(0.1)
        shrunk, _ = cluster_state(client)
        assert len(shrunk) == 1 and shrunk is not grown


@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_failed_gpu_cells_move_to_the_cpu_worker(mixed, dtype, caplog):
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = _random(rng, (900, 333), dtype), _random(rng, (333, 700), dtype)
    with _gflops(1e6, 10), dask.config.set({"distmm-debug.fail-tiles": [[0, 0]]}), \
            caplog.at_level(logging.WARNING, logger="distmm.engine.dask"), \
            distributed.get_task_stream(client) as stream:
        got = distmm.matmul(a, b, client=client, tile=128)
    stats = last_stats()
    assert _units(stats)[cpu]["share"] == 0.0  # planned for the GPU worker alone
    assert stats["moved"] == [(0, 0)]
    text = caplog.text
    assert "moved to CPU workers" in text and "(0, 0) rows 0:" in text and gpu in text
    want = a @ b
    if dtype == "int64":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max())
    # cell (0, 0) erred on the GPU worker, then ran on the CPU worker
    runs = [(t["worker"], t.get("status")) for t in stream.data
            if "distmm-matmul" in str(t["key"]) and str(t["key"]).replace(" ", "").endswith(",0,0)")]
    assert (gpu, "error") in runs and (cpu, "OK") in runs, runs


def test_failed_gpu_cells_of_dask_operands_rerun_on_the_cpu_worker(mixed):
    """No loop outside the graph: the failing task hands its block to the CPU
    worker itself and waits for it."""
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = _random(rng, (500, 301), "int64"), _random(rng, (301, 400), "int64")
    A, B = da.from_array(a, chunks=(250, 150)), da.from_array(b, chunks=(150, 200))
    with _gflops(1e6, 10), dask.config.set({"distmm-debug.fail-tiles": [[0, 0]]}):
        C = distmm.matmul(A, B, client=client)
    with distributed.get_task_stream(client) as stream:
        got = C.compute()
    np.testing.assert_array_equal(got, a @ b)
    reruns = [t["worker"] for t in stream.data if "distmm-fallback" in str(t["key"])]
    assert reruns == [cpu], stream.data


def _sleep_on(client, worker, seconds):
    return client.submit(time.sleep, seconds, workers=[worker], pure=False)


@pytest.mark.slow
def test_split_k_is_bitwise_reproducible_whoever_finishes_first(mixed):
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    m, k, n = 64, 1 << 16, 48
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    results = []
    with _gflops(1000, 1000):
        for busy in (None, gpu, cpu, gpu):
            blocker = _sleep_on(client, busy, 0.4) if busy else None  # that worker finishes last
            results.append(distmm.matmul(a, b, client=client))
            stats = last_stats()
            assert stats["cells"] == 1 and stats["groups"] == 2
            if blocker is not None:
                blocker.result()
    for r in results[1:]:
        assert np.array_equal(r, results[0])
    # the plan's tree over the plan's k groups, summed here in the same order
    edges = (0, k // 2, k)  # two groups of whole 256-blocks
    parts = [a[:, edges[g]:edges[g + 1]] @ b[edges[g]:edges[g + 1]] for g in range(2)]
    want = parts[0] + parts[1]
    assert reduction_tree(2) == ((0, 1),)
    np.testing.assert_allclose(results[0], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(results[0], a @ b, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    # integers: exact
    ai, bi = _random(rng, (m, k), "int64"), _random(rng, (k, n), "int64")
    with _gflops(1000, 1000):
        np.testing.assert_array_equal(distmm.matmul(ai, bi, client=client), ai @ bi)


def test_estimated_bytes_match_the_transfer_log(mixed):
    """Two blocks in one column of the worker grid: each worker needs all of
    B, scattered straight to both of them (a copy each), so nothing moves
    between workers, as distributed's log says. For dask operands persisted
    across both workers, the plan's worker-to-worker estimate is what
    distributed logged, within 1.5x."""
    client, gpu, cpu = mixed
    rng = np.random.default_rng()
    a, b = rng.standard_normal((2048, 1024)), rng.standard_normal((1024, 512))
    mark = transfer_mark(client)
    with _gflops(1000, 1000):
        got = distmm.matmul(a, b, client=client)
    stats = last_stats()
    est = stats["estimated_bytes"]
    measured = transfer_report(client, since=mark)
    assert stats["grid"] == (2, 1)
    assert est["scatter"] == a.nbytes + 2 * b.nbytes
    assert est["gather"] == got.nbytes
    assert est["worker_to_worker"] == 0
    print(f"numpy operands: estimated {est}, logged {measured['worker_to_worker']}")
    assert measured["worker_to_worker"] == 0, measured
    np.testing.assert_allclose(got, a @ b, rtol=1e-11, atol=1e-9)
    # dask operands persisted on both workers: the chunks a block lacks move, once each
    gen = da.random.default_rng(int(rng.integers(1 << 30)))
    A = gen.standard_normal((2048, 1024), chunks=(512, 256)).persist()
    B = gen.standard_normal((1024, 512), chunks=(256, 512)).persist()
    distributed.wait([A, B])
    mark = transfer_mark(client)
    with _gflops(1000, 1000):
        C = distmm.matmul(A, B, client=client)
    stats = last_stats()
    est = stats["estimated_bytes"]
    C = C.persist()
    distributed.wait(C)
    measured = transfer_report(client, since=mark)
    a, b = A.compute(), B.compute()  # after the report: computing them moves chunks too
    assert est["worker_to_worker"] > 0
    ratio = measured["worker_to_worker"] / est["worker_to_worker"]
    print(f"dask operands: estimated {est}, logged {measured['worker_to_worker']}")
    assert 1 / 1.5 <= ratio <= 1.5, (measured, est)
    np.testing.assert_allclose(C.compute(), a @ b, rtol=1e-11, atol=1e-9)


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
def test_cpu_only_clusters_keep_one_task_per_tile():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB",
                                  env={"CUDA_VISIBLE_DEVICES": ""}) as cl, \
            distributed.Client(cl) as client:
        a = np.ones((300, 200))
        got = distmm.matmul(a, a.T, client=client, tile=100)
        assert last_stats()["mode"] == "tiles" and last_stats()["cells"] == 9
        with dask.config.set({"distmm.dask-layout": "blocks"}):
            got2 = distmm.matmul(a, a.T, client=client, tile=100)
        assert last_stats()["mode"] == "blocks" and len(last_stats()["units"]) == 2
        np.testing.assert_array_equal(got, a @ a.T)
        np.testing.assert_array_equal(got2, a @ a.T)
        with dask.config.set({"distmm.dask-layout": "blocks"}):  # empty products, both paths
            for sa, sb in (((0, 5), (5, 3)), ((4, 0), (0, 3)), ((4, 5), (5, 0))):
                x, y = np.ones(sa), np.ones(sb)
                np.testing.assert_array_equal(distmm.matmul(x, y, client=client), x @ y)
                lazy = distmm.matmul(da.from_array(x), da.from_array(y), client=client)
                np.testing.assert_array_equal(lazy.compute(), x @ y)


@pytest.mark.slow
def test_block_mode_survives_killed_workers_with_the_same_bits():
    """The eager loop's retries in block mode: two of three GPU-marked workers
    killed mid-run, the cells they held run again, bitwise equal."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((1536, 2500)), rng.standard_normal((2500, 1536))
    with distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="1GiB",
                                  resources={"GPU": 1}, env={"CUDA_VISIBLE_DEVICES": ""}) as cl, \
            distributed.Client(cl) as client, dask.config.set({"distmm.memory-budget": "8MiB"}):
        client.wait_for_workers(3, timeout=60)
        undisturbed = distmm.matmul(a, b, client=client)
        assert last_stats()["mode"] == "blocks" and last_stats()["cells"] >= 16
        run, out = start_call(distmm.matmul, a, b, client=client)
        try:
            killed = kill_workers(client, run, kills=2, gap=0.1)
        finally:
            run.join(120)
    assert killed >= 1, "the product ended before a worker could be killed"
    assert "c" in out, f"raised instead of retrying: {out.get('error')!r}"
    assert np.array_equal(out["c"], undisturbed)
    np.testing.assert_allclose(undisturbed, a @ b, rtol=1e-10, atol=1e-10 * np.abs(a @ b).max())


def test_gpu_blocks_are_budgeted_by_the_device_not_the_client():
    """Block tasks of GPU workers hold their panels on the device: half of the smallest
    device (split between workers sharing it) bounds them, capped by a configured size;
    a cluster with a CPU unit (or a device the probe did not measure) keeps the plan's."""
    from distmm.plan_blocks import DEVICE_FRACTION, Unit, block_budget

    gib = 2**30
    two = [Unit("a", True, 1.0, 1, "0", 80 * gib), Unit("b", True, 1.0, 1, "1", 40 * gib)]
    assert block_budget(3 * gib, two) == int(40 * gib * DEVICE_FRACTION)
    shared = [Unit("a", True, 1.0, 2, "0", 80 * gib), Unit("b", True, 1.0, 2, "0", 80 * gib)]
    assert block_budget(3 * gib, shared) == int(40 * gib * DEVICE_FRACTION)
    assert block_budget(3 * gib, two[:1] + [Unit("c", False, 1.0)]) == 3 * gib
    assert block_budget(3 * gib, [Unit("d", True, 1.0)]) == 3 * gib  # not measured
    assert block_budget(3 * gib, two, configured=8 * gib) == 8 * gib
    # what it changes: a float32 32768 product on two 80 GB GPUs is one cell per GPU
    lay = block_layout(32768, 32768, 32768, [1.0, 1.0], itemsize=4,
                       memory_budget=block_budget(3 * gib, [two[0], two[0]]), tk=512,
                       row_cuts=range(0, 32769, 8192), col_cuts=range(0, 32769, 8192))
    assert (len(lay.row_edges) - 1) * (len(lay.col_edges) - 1) == 2 and lay.k_edges == (0, 32768)


def test_a_k_split_for_the_budget_keeps_each_cells_groups_on_its_owner():
    """k groups forced by the memory budget (every unit has a block) run on the cell's
    owner, so no partial crosses workers; a split-K shape (too small a C for the units)
    still spreads its groups over the units."""
    lay = block_layout(32768, 32768, 32768, [1.0, 1.0], itemsize=4, memory_budget=3 * 2**30,
                       tk=512, row_cuts=range(0, 32769, 8192), col_cuts=range(0, 32769, 8192),
                       k_cuts=range(0, 32769, 8192))
    assert lay.groups > 1
    for bi, bj in lay.cells():
        assert {lay.unit_of_partial(bi, bj, g) for g in range(lay.groups)} == \
            {lay.owner[bi][bj]}
    assert lay.bytes_moved(4)["partials"] == 0
    skinny = block_layout(64, 64, 2**22, [1.0, 1.0], itemsize=4, tk=256)
    assert skinny.groups > 1
    assert {skinny.unit_of_partial(0, 0, g) for g in range(skinny.groups)} == {0, 1}
    assert skinny.bytes_moved(4)["partials"] > 0


def test_a_mixed_cluster_whose_cpu_workers_get_no_block_budgets_by_the_device():
    """The budget comes from the units given a block: a GPU worker beside CPU workers too
    slow for a share holds its whole block on its device in one task (measured need: the
    host budget cut it into 16 cells and 3 k groups, H100 fp32 32768: 1.54 s against 1.35 s
    alone); a CPU worker that does get a share brings back the plan's (host) budget."""
    from types import SimpleNamespace

    from distmm.plan_blocks import Unit, layout_for

    gib = 2**30
    gpu = Unit("g", True, 56000.0, 1, "0", 80 * gib)
    plan = SimpleNamespace(m=32768, n=32768, k=32768, acc_dtype=np.dtype("float32"),
                           memory_budget=3 * gib, tile=(512, 512, 512))
    cuts = {name: range(0, 32769, 8192) for name in ("row_cuts", "col_cuts", "k_cuts")}
    slow = [Unit(f"c{i}", False, 20.0) for i in range(15)]
    lay = layout_for(plan, [gpu] + slow, **cuts)
    assert [blk is not None for blk in lay.blocks] == [True] + [False] * 15
    assert (len(lay.row_edges) - 1) * (len(lay.col_edges) - 1) == 1 and lay.groups == 1
    fast = [Unit("c", False, 40000.0)]  # a CPU unit with a share: the host budget again
    lay = layout_for(plan, [gpu] + fast, **cuts)
    assert lay.blocks[1] is not None
    assert (len(lay.row_edges) - 1) * (len(lay.col_edges) - 1) * lay.groups > 2
