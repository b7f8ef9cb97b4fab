"""Emulated nodes on GPUs: 4 ranks of one host as 2 emulated nodes (``distmm.emulate``),
NCCL's transports read from its own log, and 4 dask-cuda workers as 2 nodes.

Covers: under ``mpiexec_command`` with ``NCCL_DEBUG=INFO``, every rank's node environment
and binding (distinct GPUs, by the real host's node-local rank) and MPI engine products of
device-resident blocks against float64 (``tests/mpi_emulate_cases.py gpu``), with every
NCCL connection between GPUs of different emulated nodes on ``NET/Socket`` and none inside
a node; a ``gpu_cluster`` of 4 workers as 2 nodes whose CUDA IPC pairs (the engine's probe,
``auto``) stay inside a node, and a product of cupy operands against float64. Needs 4 GPUs.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distmm.cli.emulated import mpiexec_command

pytestmark = [pytest.mark.gpu]

HERE = Path(__file__).resolve().parent

# "Channel 00/0 : 1[1] -> 2[2] [send] via NET/Socket/0": NCCL's rank, then the NVML index of
# its device (CUDA_DEVICE_ORDER=PCI_BUS_ID below makes it the CUDA ordinal); older NCCL
# prints the PCI bus id there ("0[1b000]")
CONNECTION = re.compile(r"Channel \d+(?:/\d+)? : \d+\[([0-9a-fx]+)\] -> \d+\[([0-9a-fx]+)\]"
                        r"(?: \[(?:send|receive)\])? via (\S+)")


def _need_gpus(count: int):
    from distmm.cli.cluster import local_gpus

    if local_gpus() < count:
        pytest.skip(f"needs {count} GPUs")


def _bus_token(bus: str) -> str:
    """NCCL's ``%lx`` of a PCI bus id: ``"0000:1B:00.0"`` -> ``"1b000"``."""
    return format(int(bus.replace(":", "").replace(".", ""), 16), "x")


@pytest.mark.mpi
def test_nccl_carries_traffic_between_emulated_nodes_over_sockets(mpiexec, mpi_env):
    _need_gpus(4)
    argv = mpiexec_command([mpiexec, "--oversubscribe"], 4, 2,
                           [sys.executable, str(HERE / "mpi_emulate_cases.py"), "2", "gpu"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=HERE,
                       env={**mpi_env, "NCCL_DEBUG": "INFO", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "VERDICT ok" in r.stdout, out[-4000:]
    node_of = {}
    for rank, node, ordinal, bus in re.findall(
            r"DEVICE rank (\d+) node (\d+) ordinal (\d+) bus (\S+)", r.stdout):
        node_of[ordinal] = node_of[_bus_token(bus)] = int(node)
    assert sorted(set(node_of.values())) == [0, 1], r.stdout[-2000:]
    links = [(node_of[a], node_of[b], how) for a, b, how in CONNECTION.findall(out)]
    across = [how for x, y, how in links if x != y]
    inside = [how for x, y, how in links if x == y]
    assert across, "NCCL logged no connection between emulated nodes:\n" + out[-4000:]
    assert all(how.startswith("NET/Socket") for how in across), sorted(set(across))
    assert not any(how.startswith("NET") for how in inside), sorted(set(inside))
    assert re.search(r"NET/Socket : Using \[\d+\]lo:", out), out[-4000:]


def test_dask_ipc_only_inside_an_emulated_node():
    _need_gpus(4)
    pytest.importorskip("dask_cuda")
    import cupy
    import dask.array as da
    import distributed

    import distmm
    from distmm.cli.cluster import gpu_cluster, random_array, to_host
    from distmm.engine.dask import last_stats
    from distmm.engine.dask.workers import worker_info

    with gpu_cluster("0,1,2,3", nodes=2) as cl, distributed.Client(cl) as client:
        infos = worker_info(client)
        node = {w.address: w.node for w in infos}
        assert sorted(node.values()) == [0, 0, 1, 1] and all(w.cuda for w in infos)
        a = random_array((3000, 2500), 700, "float64", seed=1, gpu=True).persist()
        b = random_array((2500, 2100), 700, "float64", seed=2, gpu=True).persist()
        distributed.wait([a, b])
        c = distmm.matmul(a, b, client=client)
        got = to_host(c).compute()
        pairs = {tuple(p) for p in last_stats()["transfer"]["pairs"]}
        assert pairs and all(node[x] == node[y] for x, y in pairs), (pairs, node)
        want = to_host(a).compute() @ to_host(b).compute()
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max())
        assert isinstance(c._meta, cupy.ndarray)


def test_dask_device_chunks_cross_emulated_nodes_through_nccl():
    """Two GPU workers as two emulated nodes: the chunks each lacks come from the other
    through NCCL (``distmm.engine.dask.nccl_route``), with the bits of the TCP route."""
    _need_gpus(2)
    pytest.importorskip("dask_cuda")
    import dask
    import distributed

    import distmm
    from distmm.cli.cluster import gpu_cluster, random_array, to_host
    from distmm.engine.dask import last_stats, transfer_mark, transfer_report

    with gpu_cluster("0,1", nodes=2) as cl, distributed.Client(cl) as client:
        a = random_array((3000, 2600), 700, "float32", seed=1, gpu=True).persist()
        b = random_array((2600, 2100), 700, "float32", seed=2, gpu=True).persist()
        distributed.wait([a, b])
        mark = transfer_mark(client)
        got = to_host(distmm.matmul(a, b, client=client)).compute()
        stats = last_stats()
        routes = transfer_report(client, since=mark)["device_routes"]
        assert stats["transfer"]["nccl"]["pairs"] == 2, stats["transfer"]
        assert stats["estimated_bytes"]["nccl"] > 0, stats["estimated_bytes"]
        assert routes["nccl"] > 0 and routes["tcp"] == routes["fallback"] == 0, routes
        with dask.config.set({"distmm.dask-device-transfer": "ipc"}):  # TCP between nodes
            tcp = to_host(distmm.matmul(a, b, client=client)).compute()
        assert last_stats()["transfer"]["nccl"] == {"pairs": 0}
        assert last_stats()["locality"]["assignment"] == stats["locality"]["assignment"]
        np.testing.assert_array_equal(got, tcp)
        want = (to_host(a).compute().astype(np.float64)
                @ to_host(b).compute().astype(np.float64))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
