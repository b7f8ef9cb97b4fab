"""Block mode's pure planner (``distmm.plan_blocks.plan_blocks``), without a cluster.

Covers: every element of C computed once by one unit, for odd sizes; block edges on
ragged chunks' edges; mixed GPU/CPU workers (shares, the fallback, the devices);
chunks spread over holders (the moves, their routes and the estimates agree with the
cost model, and a placement that moves nothing is found); co-located GPU workers;
determinism; the errors; and that the planner imports no runtime.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest

import distmm.plan_blocks as pb
from distmm.plan import make_plan
from distmm.plan_blocks import (HOST_BANDWIDTH, TASK_OVERHEAD, ClusterFacts, OperandFacts,
                                WorkerInfo, edges, plan_blocks)

GPU0 = WorkerInfo("tcp://10.0.0.1:4000", 1, True, "0", 20000.0, True, 80 * 2**30)
GPU1 = WorkerInfo("tcp://10.0.0.1:4001", 1, True, "1", 14000.0, True, 40 * 2**30)
CPU = WorkerInfo("tcp://10.0.0.2:4000", 3, False, None, 300.0, False)


def _ragged(total: int, rng) -> tuple[int, ...]:
    out, left = [], total
    while left > 0:
        c = min(left, int(rng.integers(1, max(total // 3, 2) + 1)))
        out.append(c)
        left -= c
    return tuple(out)


def _cover(bp) -> np.ndarray:
    """How many times each element of C is computed (over k group 0) and by which unit."""
    lay = bp.layout
    count = np.zeros((lay.m, lay.n), dtype=int)
    for bi, bj in lay.cells():
        r0, r1 = lay.row_edges[bi], lay.row_edges[bi + 1]
        c0, c1 = lay.col_edges[bj], lay.col_edges[bj + 1]
        count[r0:r1, c0:c1] += 1
        u = lay.owner[bi][bj]
        blk = lay.blocks[u]
        assert blk is not None and blk[0] <= r0 and r1 <= blk[1] and blk[2] <= c0 and c1 <= blk[3]
    return count


@pytest.mark.parametrize("m, n, k", [(22, 23, 24), (97, 513, 1001), (2049, 1023, 4097),
                                     (1, 777, 3), (4097, 5, 65)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("workers", [(GPU0,), (GPU0, GPU1), (GPU0, GPU1, CPU), (CPU,)],
                         ids=["gpu", "two-gpus", "mixed", "cpu"])
def test_every_element_of_c_is_computed_once(m, n, k, workers):
    plan = make_plan(m, n, k, "float64", workers=4)
    bp = plan_blocks(plan, ClusterFacts(workers), OperandFacts(8), OperandFacts(8))
    assert (_cover(bp) == 1).all()
    lay = bp.layout
    assert lay.k_edges[0] == 0 and lay.k_edges[-1] == k
    assert sum(lay.area(u) for u in range(len(bp.units))) == m * n
    # each position's worker is one of the cluster's, each CPU thread a unit of its own
    assert {u.address for u in bp.units} <= {w.address for w in workers}
    assert len(bp.units) == sum(1 if w.gpu else w.nthreads for w in workers)
    # scattered: every block read goes from the client to each worker reading it
    assert all(mv.route == "scatter" for mv in bp.moves)
    assert bp.estimated_bytes["scatter"] == sum(
        nbytes * len({bp.addresses[u] for u in pos}) for _, nbytes, pos in bp.reads)
    assert bp.estimated_bytes["gather"] == m * n * 8


def test_block_edges_lie_on_ragged_chunk_edges_and_every_chunk_is_read():
    rng = np.random.default_rng()
    m, n, k = 1013, 899, 1531
    a_ch, b_ch = (_ragged(m, rng), _ragged(k, rng)), (_ragged(k, rng), _ragged(n, rng))
    a_k, b_k = edges(a_ch[1]), edges(b_ch[0])
    plan = make_plan(m, n, k, "float32", workers=3, memory_budget=2**20)  # small: several cells
    bp = plan_blocks(plan, ClusterFacts((GPU0, GPU1, CPU)), OperandFacts(4, "A", a_ch),
                     OperandFacts(4, "B", b_ch), row_cuts=edges(a_ch[0]), col_cuts=edges(b_ch[1]),
                     k_cuts=sorted(set(a_k) | set(b_k)))
    lay = bp.layout
    assert set(lay.row_edges) <= set(edges(a_ch[0]))
    assert set(lay.col_edges) <= set(edges(b_ch[1]))
    assert set(lay.k_edges) <= set(a_k) | set(b_k)
    assert (_cover(bp) == 1).all()
    read = {key: nbytes for key, nbytes, _ in bp.reads}
    want = {("A", r, c): a_ch[0][r] * a_ch[1][c] * 4
            for r, c in itertools.product(range(len(a_ch[0])), range(len(a_ch[1])))}
    want.update({("B", r, c): b_ch[0][r] * b_ch[1][c] * 4
                 for r, c in itertools.product(range(len(b_ch[0])), range(len(b_ch[1])))})
    assert read == want


def test_a_gpu_far_faster_than_the_cpu_workers_takes_all_of_c():
    plan = make_plan(4097, 4095, 2047, "float64", workers=4)
    slow = WorkerInfo("tcp://10.0.0.2:4000", 3, False, None, 20.0, False)
    bp = plan_blocks(plan, ClusterFacts((slow, GPU0)), OperandFacts(8), OperandFacts(8))
    assert bp.units[0].address == GPU0.address and [u.gpu for u in bp.units] == [True] + [False] * 3
    assert bp.layout.blocks[0] == (0, 4097, 0, 4095) and bp.layout.blocks[1:] == (None,) * 3
    assert bp.fallback_workers() == (slow.address,)
    assert set(bp.devices().values()) == {("gpu", 1)}
    assert len(bp.devices()) == len(list(bp.layout.cells())) * bp.layout.groups
    assert set(bp.homes().values()) == {GPU0.address}
    # the CPU workers' threads close to the GPU: each gets a share in proportion
    fast = WorkerInfo("tcp://10.0.0.2:4000", 1, False, None, 10000.0, False)
    bp = plan_blocks(plan, ClusterFacts((GPU0, fast)), OperandFacts(8), OperandFacts(8))
    shares = {u.address: bp.layout.area(i) / (4097 * 4095) for i, u in enumerate(bp.units)}
    assert shares[GPU0.address] == pytest.approx(2 / 3, abs=0.05)
    assert shares[fast.address] == pytest.approx(1 / 3, abs=0.05)


def test_the_placement_follows_where_the_chunks_are():
    """A's row halves held the other way round: the units swap and nothing moves."""
    m, n, k = 2048, 256, 512
    w0, w1 = GPU0.address, GPU1.address
    equal = (GPU0, WorkerInfo(w1, 1, True, "1", 20000.0, True, 80 * 2**30))
    a_ch, b_ch = ((1024, 1024), (k,)), ((k,), (n,))
    where = {("A", 0, 0): [w1], ("A", 1, 0): [w0], ("B", 0, 0): [w0, w1]}
    plan = make_plan(m, n, k, "float64", workers=2)
    bp = plan_blocks(plan, ClusterFacts(equal, where), OperandFacts(8, "A", a_ch),
                     OperandFacts(8, "B", b_ch), row_cuts=(0, 1024, 2048), col_cuts=(0, n),
                     k_cuts=(0, k))
    assert bp.layout.grid == (2, 1)
    assert bp.locality["assignment"] == [w1, w0]
    assert bp.moves == () and bp.estimated_bytes["worker_to_worker"] == 0
    assert bp.locality["naive_bytes"] == 2 * 1024 * k * 8  # each half of A moved
    assert bp.locality["method"] == "exact"


def test_moves_routes_and_estimates_agree_over_spread_holders():
    rng = np.random.default_rng()
    m, n, k = 1999, 1501, 1203
    a_ch, b_ch = (_ragged(m, rng), _ragged(k, rng)), (_ragged(k, rng), _ragged(n, rng))
    gpu2 = WorkerInfo("tcp://10.0.0.1:4002", 1, True, "2", 18000.0, True, 80 * 2**30)
    workers = (GPU0, GPU1, gpu2, CPU)
    addrs = [w.address for w in workers]
    where = {}
    for name, ch in (("A", a_ch), ("B", b_ch)):
        for r, c in itertools.product(range(len(ch[0])), range(len(ch[1]))):
            where[(name, r, c)] = sorted(rng.choice(addrs, size=int(rng.integers(1, 3)),
                                                    replace=False).tolist())
    ipc = frozenset({(GPU0.address, GPU1.address), (GPU1.address, gpu2.address)})
    a_k, b_k = edges(a_ch[1]), edges(b_ch[0])
    plan = make_plan(m, n, k, "float64", workers=6)
    bp = plan_blocks(plan, ClusterFacts(workers, where, ipc), OperandFacts(8, "A", a_ch),
                     OperandFacts(8, "B", b_ch), row_cuts=edges(a_ch[0]), col_cuts=edges(b_ch[1]),
                     k_cuts=sorted(set(a_k) | set(b_k)))
    # every chunk a reader lacks moves to it once; none it holds
    lacking = {(key, bp.addresses[u]) for key, _, pos in bp.reads for u in pos
               if bp.addresses[u] not in where[key]}
    assert {(mv.key, mv.to) for mv in bp.moves} == lacking
    assert len(bp.moves) == len(lacking)
    for mv in bp.moves:
        assert mv.holder in where[mv.key]
        assert (mv.route == "ipc") == ((mv.holder, mv.to) in ipc)
    by_route = {r: sum(mv.nbytes for mv in bp.moves if mv.route == r)
                for r in ("tcp", "ipc", "nccl")}
    assert bp.locality["routes"] == by_route
    partials = pb.partial_bytes(bp.layout, bp.addresses, 8)
    assert bp.estimated_bytes == {"worker_to_worker": by_route["tcp"] + partials,
                                  "ipc": by_route["ipc"], "gather": m * n * 8}
    assert {(mv.key, mv.to): mv.holder for mv in bp.moves if mv.route == "ipc"} == dict(bp.sources)
    assert bp.locality["estimated_bytes"] <= bp.locality["naive_bytes"]
    assert bp.locality["estimated_bytes"] == by_route["tcp"] + by_route["ipc"] // 256 + partials


def test_gpu_workers_sharing_a_device_run_as_one_unit_where_that_moves_less():
    a0 = WorkerInfo("tcp://10.0.0.1:5000", 1, True, "0", 20000.0, True, 80 * 2**30)
    a1 = WorkerInfo("tcp://10.0.0.1:5001", 1, True, "0", 20000.0, True, 80 * 2**30)
    m, n, k = 1024, 1024, 1024
    ch = ((512, 512), (512, 512))
    where = {(name, r, c): [a1.address] for name in "AB" for r in range(2) for c in range(2)}
    plan = make_plan(m, n, k, "float32", workers=2)
    bp = plan_blocks(plan, ClusterFacts((a0, a1), where), OperandFacts(4, "A", ch),
                     OperandFacts(4, "B", ch), row_cuts=(0, 512, 1024), col_cuts=(0, 512, 1024),
                     k_cuts=(0, 512, 1024))
    assert bp.locality["colocated"]["chosen"] == "one unit per device"
    assert bp.addresses == [a1.address] and bp.units[0].share_device == 1
    assert bp.moves == ()
    assert bp.locality["colocated"]["bytes"]["one unit per worker"] > 0


def test_the_same_facts_give_the_same_plan():
    rng = np.random.default_rng()
    m, n, k = 1537, 2049, 777
    a_ch, b_ch = (_ragged(m, rng), _ragged(k, rng)), (_ragged(k, rng), _ragged(n, rng))
    addrs = [GPU0.address, GPU1.address, CPU.address]
    where = {(name, r, c): [addrs[int(rng.integers(3))]]
             for name, ch in (("A", a_ch), ("B", b_ch))
             for r, c in itertools.product(range(len(ch[0])), range(len(ch[1])))}
    shuffled = dict(sorted(where.items(), key=lambda kv: rng.random()))
    plan = make_plan(m, n, k, "float64", workers=5)
    cuts = dict(row_cuts=edges(a_ch[0]), col_cuts=edges(b_ch[1]),
                k_cuts=sorted(set(edges(a_ch[1])) | set(edges(b_ch[0]))))
    ops = OperandFacts(8, "A", a_ch), OperandFacts(8, "B", b_ch)
    pb._PLANS.clear()
    first = plan_blocks(plan, ClusterFacts((GPU0, GPU1, CPU), where), *ops, **cuts)
    pb._PLANS.clear()  # searched again, not taken from the planner's memo
    again = plan_blocks(plan, ClusterFacts((GPU0, GPU1, CPU), shuffled), *ops, **cuts)
    assert first is not again
    assert first == again and repr(first) == repr(again)
    assert first.estimated_seconds == again.estimated_seconds > TASK_OVERHEAD


@pytest.fixture
def searches(monkeypatch):
    """The planner's memo emptied, and a list that gets one entry per layout search."""
    pb._PLANS.clear()
    found: list = []
    real = pb._plan_blocks
    monkeypatch.setattr(pb, "_plan_blocks", lambda *a: found.append(1) or real(*a))
    return found


def test_facts_seen_again_are_planned_once(searches):
    """The same facts (where-dicts in another order included) return the plan made for
    them without a search; a chunk held elsewhere is new facts and is planned."""
    rng = np.random.default_rng()
    m, n, k = 3001, 2049, 1777
    a_ch, b_ch = (_ragged(m, rng), _ragged(k, rng)), (_ragged(k, rng), _ragged(n, rng))
    addrs = [GPU0.address, GPU1.address]
    where = {(name, r, c): [addrs[int(rng.integers(2))]]
             for name, ch in (("A", a_ch), ("B", b_ch))
             for r, c in itertools.product(range(len(ch[0])), range(len(ch[1])))}
    plan = make_plan(m, n, k, "float32", workers=2)
    ops = OperandFacts(4, "A", a_ch), OperandFacts(4, "B", b_ch)
    first = plan_blocks(plan, ClusterFacts((GPU0, GPU1), where), *ops)
    again = plan_blocks(plan, ClusterFacts((GPU0, GPU1), dict(reversed(where.items()))), *ops)
    assert again == first and len(searches) == 1
    moved = dict(where)
    key = next(iter(moved))
    moved[key] = [a for a in addrs if a not in moved[key]]
    other = plan_blocks(plan, ClusterFacts((GPU0, GPU1), moved), *ops)
    assert len(searches) == 2 and other is not first
    with pytest.raises(TypeError):
        first.locality["method"] = "changed"  # what the memo hands out cannot be changed


def test_new_operands_lying_where_earlier_ones_did_reuse_their_plan(searches):
    """Operands of other names whose chunks lie on the same workers (a new pair made alike)
    take the plan searched for the first pair, with their own keys in it: the same plan a
    search under their names gives. A @ A (one name) is planned apart."""
    rng = np.random.default_rng()
    m, n, k = 2049, 1537, 1025
    a_ch, b_ch = (_ragged(m, rng), _ragged(k, rng)), (_ragged(k, rng), _ragged(n, rng))
    addrs = [GPU0.address, GPU1.address]
    spots = {(side, r, c): [addrs[int(rng.integers(2))]]
             for side, ch in (("a", a_ch), ("b", b_ch))
             for r, c in itertools.product(range(len(ch[0])), range(len(ch[1])))}

    def facts(na, nb):
        where = {({"a": na, "b": nb}[side], r, c): v for (side, r, c), v in spots.items()}
        return ClusterFacts((GPU0, GPU1), where, ipc={(GPU0.address, GPU1.address),
                                                      (GPU1.address, GPU0.address)})

    plan = make_plan(m, n, k, "float32", workers=2)
    first = plan_blocks(plan, facts("A1", "B1"), OperandFacts(4, "A1", a_ch),
                        OperandFacts(4, "B1", b_ch))
    second = plan_blocks(plan, facts("A2", "B2"), OperandFacts(4, "A2", a_ch),
                         OperandFacts(4, "B2", b_ch))
    assert len(searches) == 1
    assert {k[0] for k, _, _ in second.reads} == {"A2", "B2"}
    assert {mv.key[0] for mv in second.moves} <= {"A2", "B2"} and second.moves
    assert all(k[0] in ("A2", "B2") for k, _ in second.sources)
    pb._PLANS.clear()
    fresh = plan_blocks(plan, facts("A2", "B2"), OperandFacts(4, "A2", a_ch),
                        OperandFacts(4, "B2", b_ch))
    assert fresh == second and len(searches) == 2
    assert first.layout == second.layout and first.units == second.units
    square = (_ragged(m, rng),) * 2
    where = {("S", r, c): [addrs[(r + c) % 2]] for r in range(len(square[0]))
             for c in range(len(square[1]))}
    same = plan_blocks(make_plan(m, m, m, "float32", workers=2),
                       ClusterFacts((GPU0, GPU1), where), OperandFacts(4, "S", square),
                       OperandFacts(4, "S", square))
    assert {k[0] for k, _, _ in same.reads} == {"S"} and len(searches) == 3


def test_estimated_seconds_is_the_slowest_unit_and_what_it_receives():
    m, n, k = 1000, 999, 998
    plan = make_plan(m, n, k, "float64", workers=1)
    bp = plan_blocks(plan, ClusterFacts((GPU0,)), OperandFacts(8), OperandFacts(8))
    compute = 2.0 * m * n * k / (GPU0.gflops * 1e9)
    received = (m * k + k * n) * 8 / HOST_BANDWIDTH
    assert bp.estimated_seconds == pytest.approx(compute + received + TASK_OVERHEAD, rel=1e-12)
    faster = WorkerInfo(GPU0.address, 1, True, "0", 2 * GPU0.gflops, True, GPU0.device_memory)
    quick = plan_blocks(plan, ClusterFacts((faster,)), OperandFacts(8), OperandFacts(8))
    assert quick.estimated_seconds == pytest.approx(compute / 2 + received + TASK_OVERHEAD)


def test_errors_are_raised_before_planning():
    plan = make_plan(64, 64, 64, "float64", workers=1)
    with pytest.raises(ValueError, match="at least one worker"):
        plan_blocks(plan, ClusterFacts(()), OperandFacts(8), OperandFacts(8))
    with pytest.raises(ValueError, match="both scattered or both chunked"):
        plan_blocks(plan, ClusterFacts((GPU0,)), OperandFacts(8, "A", ((64,), (64,))),
                    OperandFacts(8))


def test_the_planner_imports_no_runtime():
    tree = ast.parse(Path(pb.__file__).read_text())
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert "numpy" in names  # the walk really read the imports
    assert not {n.split(".")[0] for n in names} & {"dask", "distributed", "cupy", "mpi4py", "numba"}
    assert {n for n in names if n.startswith("distmm")} == {"distmm.plan"}
