"""Device chunks between GPU workers of different hosts through NCCL: the parts that need
no GPU (``distmm.engine.dask.nccl_route``, ``transfer.NcclOffer``, the planner's ``nccl``
route, the export tasks' route, the order a block task receives in).

The NCCL transfers themselves need two GPUs: ``tests/test_emulate_gpu.py`` runs a product
across two emulated nodes through them.
"""
from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

pytest.importorskip("distributed")

from distmm import plan_blocks as loc  # noqa: E402
from distmm.engine.dask import blocks, nccl_route, transfer  # noqa: E402
from distmm.engine.dask.lazy import export_layer  # noqa: E402
from distmm.engine.dask.tasks import BlockSpec  # noqa: E402
from distmm.plan import make_plan  # noqa: E402
from distmm.plan_blocks import ClusterFacts, OperandFacts, WorkerInfo, plan_blocks  # noqa: E402

# two hosts of two GPU workers each, and a CPU worker
A0, A1, B0, B1 = ("tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4001",
                  "tcp://10.0.0.2:4002")
GPUS = tuple(WorkerInfo(a, 1, True, f"bus-{i % 2}", 20000.0, True, 80 * 2**30)
             for i, a in enumerate((A0, A1, B0, B1)))
CPU = WorkerInfo("tcp://10.0.0.3:4001", 4, False, None, 100.0, False)


def test_candidates_are_gpu_workers_of_different_links_and_devices():
    pairs = nccl_route.candidate_pairs(GPUS + (CPU,))
    hosts = {A0: 1, A1: 1, B0: 2, B1: 2}
    assert pairs == {(x, y) for x in hosts for y in hosts if hosts[x] != hosts[y]}
    # one host as two emulated nodes: its workers pair across the nodes
    nodes = [WorkerInfo(f"tcp://10.0.0.1:{p}", 1, True, f"bus{p}", 1.0, True, node=p // 2)
             for p in range(4)]
    assert len(nccl_route.candidate_pairs(nodes)) == 8
    # the same device on both ends (workers sharing a GPU), or no device found: none
    same = [WorkerInfo(f"tcp://10.0.0.1:{p}", 1, True, "bus", 1.0, True, node=p)
            for p in (1, 2)]
    assert nccl_route.candidate_pairs(same) == frozenset()
    nodev = [WorkerInfo(f"tcp://10.0.0.{h}:1", 1, True, None, 1.0, False) for h in (1, 2)]
    assert nccl_route.candidate_pairs(nodev) == frozenset()


@pytest.mark.parametrize("mode, device", [("tcp", True), ("ipc", True), ("auto", False)])
def test_no_pairs_unless_auto_with_device_chunks(mode, device):
    # nothing is asked of a cluster (there is none): the answer comes before
    assert nccl_route.pairs(None, GPUS, mode, device) == (frozenset(), {"pairs": 0})


def test_an_offer_crosses_to_the_reader_without_its_chunk():
    offer = transfer.NcclOffer(A0, "('b', 0, 1)", 96, (4, 3), "float64", ref=(("x", 1), 2),
                               array=np.zeros((4, 3)), ready="event")
    back = pickle.loads(pickle.dumps(offer))
    assert (back.address, back.label, back.nbytes, back.shape, back.dtype, back.ref) == (
        A0, "('b', 0, 1)", 96, (4, 3), np.dtype("float64"), (("x", 1), 2))
    assert back.array is None and back.ready is None and back._opened is None
    assert transfer.dtype_of(back) == np.float64
    assert blocks._far(back) == 2 and blocks._far(np.zeros(1)) == 0


def test_a_holder_without_the_pair_sends_nothing():
    class W:
        address = A0

    got = nccl_route.serve_send([[("x", 0), 0]], B0, W())
    assert "error" in got and B0 in got["error"]


def test_an_offer_never_received_is_fetched_or_named():
    from distmm.executor.ipc import IPCError

    offer = transfer.NcclOffer(A0, "('a', 0, 0)", 8, (1,), "float64", ref=(("x", 0), 0))
    with pytest.raises(IPCError, match="not received through NCCL"):
        transfer.take(offer)  # not in a task on a worker: no holder to fetch it from


def _args(task):
    return task.args if hasattr(task, "args") else task[1:]


def test_export_tasks_of_nccl_pairs_export_for_nccl():
    sources = {(("a", 0, 0), B0): A0, (("a", 0, 1), B0): A0, (("b", 0, 0), A1): A0}
    layer, routes = export_layer("distmm-export-t", sources, pull=True,
                                 nccl=frozenset({(A0, B0)}))
    assert sorted(_args(task)[-1] for task in layer.layer.values()) == ["ipc", "nccl"]
    # the route follows the (holder, reader) pair, whatever the operand
    for (chunk, reader), holder in sources.items():
        pulled = routes[chunk[0]][(chunk[1:], reader)]
        assert _args(layer.layer[pulled.key])[-1] == ("nccl" if (holder, reader) == (A0, B0) else "ipc")


def test_the_planner_sends_across_hosts_by_nccl_and_avoids_it():
    rng = np.random.default_rng()
    n, c = 4096, 1024
    ch = ((c,) * 4, (c,) * 4)
    where = {}
    addrs = [w.address for w in GPUS]
    for name in ("A", "B"):
        for r, k in itertools.product(range(4), range(4)):
            where[(name, r, k)] = [addrs[int(rng.integers(0, 4))]]
    ipc = frozenset({(A0, A1), (A1, A0), (B0, B1), (B1, B0)})
    nccl = nccl_route.candidate_pairs(GPUS)
    plan = make_plan(n, n, n, "float32", workers=4)
    kw = dict(row_cuts=[0, c, 2 * c, 3 * c, n], col_cuts=[0, c, 2 * c, 3 * c, n],
              k_cuts=[0, c, 2 * c, 3 * c, n])
    bp = plan_blocks(plan, ClusterFacts(GPUS, where, ipc, nccl), OperandFacts(4, "A", ch),
                     OperandFacts(4, "B", ch), **kw)
    host = {A0: 1, A1: 1, B0: 2, B1: 2}
    for mv in bp.moves:
        across = host[mv.holder] != host[mv.to] if mv.holder else True
        assert mv.route == ("nccl" if across else "ipc"), mv
    crossing = sum(mv.nbytes for mv in bp.moves if mv.route == "nccl")
    assert bp.estimated_bytes.get("nccl", 0) == crossing > 0
    assert bp.estimated_bytes["worker_to_worker"] == 0
    # every chunk moved is pulled from its holder by an export task
    assert {(mv.key, mv.to): mv.holder for mv in bp.moves} == dict(bp.sources)
    # without NCCL the same bytes would cross by TCP, at 8 times the cost
    tcp = plan_blocks(plan, ClusterFacts(GPUS, where, ipc), OperandFacts(4, "A", ch),
                      OperandFacts(4, "B", ch), **kw)
    assert tcp.estimated_bytes["worker_to_worker"] > 0 and "nccl" not in tcp.estimated_bytes
    assert bp.locality["routes"]["nccl"] * loc.NCCL_COST_DIVISOR >= crossing


def test_a_block_receives_in_the_order_its_k_loop_reads(monkeypatch):
    got = []
    monkeypatch.setattr(nccl_route, "receive", lambda offers: got.extend(offers))

    def offer(label):
        return transfer.NcclOffer(A0, label, 8, (1,), "float32", ref=((label, 0), 0))

    spec = BlockSpec(a_lead=(), b_lead=(), a_rows=(), b_cols=(), k_pieces=(),
                     a_keys=((0, 1), (0, 0), (1, 0)), b_keys=((1, 0), (0, 0)), finish=True)
    a_list = [offer("a01"), np.zeros(1), offer("a10")]
    b_list = [offer("b10"), offer("b00")]
    blocks._receive(spec, a_list, b_list)
    # by chunk along k (a's (row, k), b's (k, col)), A's before B's, then by row or column
    assert [x.label for x in got] == ["a10", "b00", "a01", "b10"]
