"""Block mode's placement by locality (``distmm.plan_blocks``).

Covers, on a real LocalCluster of two worker processes both marked GPU by
their resources (no device visible: their GPU tasks run the CPU executor):
dask operands persisted in a known layout, where the unit order the engine
chooses moves fewer bytes than the naive one and distributed's transfer log
agrees with the estimate; operands persisted by dask itself (the chosen
never worse than the naive); two workers marked as sharing one device
(``distmm-debug.worker-devices``), taken as one unit on the worker holding
the operands when that moves fewer bytes and kept apart when it does not;
numpy operands scattered straight to the worker computing each block.
Results against a float64 product (exact for integers).
"""
from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import distmm  # noqa: E402
from distmm.engine.dask import last_stats, transfer_mark, transfer_report  # noqa: E402
from distmm.engine.dask.workers import DEVICES_KEY  # noqa: E402
from conftest import assert_close, equal_gpus, placed  # noqa: E402

MiB = 2**20


def _run_lazy(client, A, B):
    mark = transfer_mark(client)
    C = distmm.matmul(A, B, client=client)
    stats = last_stats()
    C = C.persist()
    distributed.wait(C)
    measured = transfer_report(client, since=mark)["worker_to_worker"]
    return C.compute(), stats, measured


@pytest.mark.parametrize("dtype", [pytest.param("int64", marks=pytest.mark.slow), "float64"])
def test_blocks_go_where_their_operands_are(pair, dtype):
    """A's top rows on the second worker, its bottom rows on the first: the
    naive order (first worker, top block) moves all of A and half of B, the
    chosen one half of B; distributed's log says the same."""
    client, w0, w1 = pair
    rng = np.random.default_rng()
    m, k, n = 1024, 768, 512
    if dtype == "int64":
        a, b = rng.integers(-50, 50, (m, k)), rng.integers(-50, 50, (k, n))
    else:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    A = placed(client, a, ((512, 512), (768,)), [[w1], [w0]])
    B = placed(client, b, ((384, 384), (512,)), [[w0], [w1]])
    with equal_gpus():
        got, stats, measured = _run_lazy(client, A, B)
    assert_close(got, a @ b)
    loc = stats["locality"]
    half_b = 384 * 512 * 8
    assert stats["grid"] == (2, 1)
    assert loc["naive_bytes"] == 2 * 512 * 768 * 8 + 2 * half_b
    assert loc["estimated_bytes"] == 2 * half_b < loc["naive_bytes"]
    assert loc["assignment"] == [w1, w0] and loc["method"] == "exact"
    assert loc["colocated"] is None
    assert {u["address"]: u["block"] for u in stats["units"]} == {
        w1: (0, 512, 0, 512), w0: (512, 1024, 0, 512)}
    est = stats["estimated_bytes"]["worker_to_worker"]
    assert est == loc["estimated_bytes"]
    print(f"estimated {est}, naive {loc['naive_bytes']}, logged {measured}")
    assert 1 / 1.5 <= measured / est <= 1.5, (measured, est)


def test_operands_persisted_by_dask_move_no_more_than_naively(pair):
    client, w0, w1 = pair
    gen = da.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    A = gen.standard_normal((1536, 1000), chunks=(256, 500)).persist()
    B = gen.standard_normal((1000, 1280), chunks=(500, 256)).persist()
    distributed.wait([A, B])
    a, b = A.compute(), B.compute()
    with equal_gpus():
        got, stats, measured = _run_lazy(client, A, B)
    assert_close(got, a @ b)
    loc = stats["locality"]
    est = stats["estimated_bytes"]["worker_to_worker"]
    assert est == loc["estimated_bytes"] <= loc["naive_bytes"]
    print(f"estimated {est}, naive {loc['naive_bytes']}, logged {measured}")
    if est:
        assert 1 / 1.5 <= measured / est <= 1.5, (measured, est)
    else:
        assert measured == 0


def _shared_device(w0, w1):
    return dask.config.set({DEVICES_KEY: {w0: "0000:01:00.0", w1: "0000:01:00.0"}})


def test_colocated_workers_run_as_one_unit_where_the_operands_are(pair):
    """Both operands on the second worker: one unit for the shared device, on
    that worker, and nothing moves; numpy operands too (one scatter each)."""
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b = rng.integers(-9, 9, (777, 513)), rng.integers(-9, 9, (513, 655))
    A = placed(client, a, ((400, 377), (513,)), [[w1], [w1]])
    B = placed(client, b, ((513,), (300, 355)), [[w1, w1]])
    with equal_gpus(), _shared_device(w0, w1):
        got, stats, measured = _run_lazy(client, A, B)
    np.testing.assert_array_equal(got, a @ b)
    loc = stats["locality"]
    print(f"co-located, operands on one worker: {loc['colocated']}, logged {measured}")
    assert loc["colocated"]["chosen"] == "one unit per device"
    assert loc["colocated"]["bytes"]["one unit per device"] == 0
    assert loc["colocated"]["bytes"]["one unit per worker"] > 0
    assert [u["address"] for u in stats["units"]] == [w1] and stats["units"][0]["share"] == 1.0
    assert stats["estimated_bytes"]["worker_to_worker"] == 0 and measured == 0
    # numpy operands: one unit, each operand scattered once, nothing between workers
    x, y = rng.standard_normal((900, 301)), rng.standard_normal((301, 700))
    mark = transfer_mark(client)
    with equal_gpus(), _shared_device(w0, w1):
        got = distmm.matmul(x, y, client=client)
    stats = last_stats()
    assert_close(got, x @ y)
    assert stats["locality"]["colocated"]["chosen"] == "one unit per device"
    assert len(stats["units"]) == 1 and stats["cells"] == 1
    assert stats["estimated_bytes"]["scatter"] == x.nbytes + y.nbytes
    assert transfer_report(client, since=mark)["worker_to_worker"] == 0


@pytest.mark.slow
def test_colocated_workers_stay_apart_when_that_moves_less(pair):
    """Each worker holds half of A's rows: two units (each computing the rows
    it holds) move half of B; one unit would move half of A and half of B."""
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b = rng.integers(-9, 9, (1024, 768)), rng.integers(-9, 9, (768, 512))
    A = placed(client, a, ((512, 512), (768,)), [[w0], [w1]])
    B = placed(client, b, ((384, 384), (512,)), [[w1], [w0]])
    with equal_gpus(), _shared_device(w0, w1):
        got, stats, measured = _run_lazy(client, A, B)
    np.testing.assert_array_equal(got, a @ b)
    loc = stats["locality"]
    print(f"co-located, rows split: {loc['colocated']}, logged {measured}")
    assert loc["colocated"]["chosen"] == "one unit per worker"
    assert loc["colocated"]["bytes"]["one unit per worker"] == 2 * 384 * 512 * 8
    assert loc["colocated"]["bytes"]["one unit per device"] == (512 * 768 + 384 * 512) * 8
    assert sorted(u["address"] for u in stats["units"]) == [w0, w1]
    est = stats["estimated_bytes"]["worker_to_worker"]
    assert 1 / 1.5 <= measured / est <= 1.5, (measured, est)


def test_numpy_blocks_go_straight_to_their_workers(pair):
    """Four blocks over two workers (a 2 x 2 cell grid under a small memory
    budget): every block of A and B is scattered to each worker reading it,
    and nothing is fetched between workers."""
    client, w0, w1 = pair
    rng = np.random.default_rng()
    a, b = rng.standard_normal((1200, 700)), rng.standard_normal((700, 1100))
    mark = transfer_mark(client)
    with equal_gpus(), dask.config.set({"distmm.memory-budget": "6MiB"}):
        got = distmm.matmul(a, b, client=client)
    stats = last_stats()
    assert_close(got, a @ b)
    assert stats["mode"] == "blocks" and stats["cells"] > 2
    assert stats["estimated_bytes"]["worker_to_worker"] == 0
    assert stats["estimated_bytes"]["scatter"] >= a.nbytes + b.nbytes
    assert transfer_report(client, since=mark)["worker_to_worker"] == 0


def test_search_never_moves_more_than_the_naive_order():
    """Pure: random chunk placements over four units of distinct speeds; the
    exhaustive search is never beaten by pairwise swaps, nor they by the
    units in their given order, and every candidate covers C once."""
    from distmm import plan_blocks as loc
    from distmm.plan_blocks import Unit, block_layout, shares

    rng = np.random.default_rng()
    m, n, k, ch = 4096, 3072, 2048, 512
    rows, cols, ks = (ch,) * (m // ch), (ch,) * (n // ch), (ch,) * (k // ch)
    units = [Unit(f"w{i}", True, float(g)) for i, g in enumerate(rng.uniform(900, 1100, 4))]

    def make(us, grid):
        lay = block_layout(m, n, k, shares([u.gflops for u in us], m, n, k), grid=grid,
                           row_cuts=range(0, m + 1, ch), col_cuts=range(0, n + 1, ch))
        assert sum(lay.area(u) for u in range(len(us))) == m * n
        return lay

    for _ in range(3):
        where = {("a", r, c): (f"w{rng.integers(4)}",) for r in range(len(rows)) for c in range(len(ks))}
        where.update({("b", r, c): (f"w{rng.integers(4)}",) for r in range(len(ks))
                      for c in range(len(cols))})
        reads = {}

        def cost(lay, us):
            if id(lay) not in reads:
                reads[id(lay)] = (lay, loc.readers(lay, (rows, ks), (ks, cols), "a", "b", 8, 8))
            return loc.moved(reads[id(lay)][1], [u.address for u in us], where)

        exact = loc.choose(units, make, cost)
        swaps = loc.choose(units, make, cost, limit=1)
        assert exact.method == "exact" and swaps.method == "swaps"
        assert exact.bytes <= swaps.bytes <= swaps.naive_bytes == exact.naive_bytes
        assert exact.bytes == cost(exact.layout, exact.units)


def test_units_too_slow_for_a_share_stay_out_of_the_search():
    """A GPU worker beside 15 CPU workers that get no share: only the GPU's place is
    searched (a handful of layouts, not hundreds), every unit is kept (the CPU ones, last,
    still serve as the fallback), and the GPU gets the whole of C wherever it started."""
    from distmm import plan_blocks as loc
    from distmm.plan_blocks import Unit, block_layout, shares

    m = n = k = 4096
    for gpu_at in (0, 7, 15):
        units = [Unit(f"c{i:02d}", False, 20.0) for i in range(15)]
        units.insert(gpu_at, Unit("g", True, 56000.0))

        def make(us, grid):
            return block_layout(m, n, k, shares([u.gflops for u in us], m, n, k), grid=grid,
                                row_cuts=range(0, m + 1, 1024), col_cuts=range(0, n + 1, 1024))

        got = loc.choose(units, make, lambda lay, us: 0)
        assert got.candidates <= 4, got.candidates
        assert sorted(u.address for u in got.units) == sorted(u.address for u in units)
        busy = [u.address for u, b in zip(got.units, got.layout.blocks) if b is not None]
        assert busy == ["g"]
    # units that do get shares are still searched (two GPUs of different speeds)
    two = [Unit("c", False, 20.0), Unit("g1", True, 30000.0), Unit("g2", True, 56000.0)]
    got = loc.choose(two, make, lambda lay, us: 0)
    assert got.candidates >= 2


def test_a_transfer_mark_counts_what_came_after_it_even_once_it_left_the_log():
    from collections import deque

    from distmm.engine.dask.stats import _after, _entry_mark

    log = deque(maxlen=3)
    assert _after(log, _entry_mark(log)) == []
    log.extend({"start": 0.0, "total": i} for i in range(2))
    mark = _entry_mark(log)
    log.append({"start": 0.0, "total": 2})
    assert [e["total"] for e in _after(log, mark)] == [2]
    log.extend({"start": 0.0, "total": i} for i in (3, 4))  # the marked entry leaves the log
    assert [e["total"] for e in _after(log, mark)] == [2, 3, 4]
    assert _after(log, None) == list(log)
