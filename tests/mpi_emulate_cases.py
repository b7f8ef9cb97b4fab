"""Cases run under an emulated-node launch by tests/test_emulate.py and
tests/test_emulate_gpu.py (not collected by pytest).

Every rank checks, from inside, the environment its emulated node gave it and that its
binding still counts the real host's node-local rank, then multiplies with the MPI engine
(odd sizes, float64 reference; on GPUs with device-resident blocks, so that NCCL carries the
panels). All ranks agree on the verdict with an allreduce; rank 0 prints ``VERDICT ok`` or
``VERDICT FAIL`` with the reasons.
Usage: mpiexec ... python tests/mpi_emulate_cases.py NODES [gpu]
"""
from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import distmm
from distmm.emulate import link_host, this_node
from distmm.engine.mpi.binding import bind_rank
from mpi_verdict import run_cases

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank
NODES = int(sys.argv[1])
GPU = len(sys.argv) > 2 and sys.argv[2] == "gpu"
failures: list[str] = []


def node_environment():
    node = this_node()
    want = rank // (P // NODES)
    assert node == want, f"rank {rank}: DISTMM_EMULATED_NODE {node}, expected {want}"
    env = os.environ
    assert env["NCCL_HOSTID"] == f"distmm-emulated-node-{want}", env.get("NCCL_HOSTID")
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_NET"] == "Socket"
    assert env["OMPI_MCA_pml"] == "ob1" and env["OMPI_MCA_btl"] == "self,tcp", (
        env.get("OMPI_MCA_pml"), env.get("OMPI_MCA_btl"))
    hosts = comm.allgather(link_host())
    assert len(set(hosts)) == NODES, hosts
    assert hosts[rank] == hosts[want * (P // NODES)], hosts


def real_binding():
    binding = bind_rank(comm, 4 if not GPU else None, warn=False)
    # the node-local rank is the real host's: every rank of the job, whatever its node
    assert (binding.local_rank, binding.local_size) == (rank, P), binding
    if not GPU:
        assert binding.device == rank, binding  # four ranks, four devices: distinct ones
    devices = comm.allgather(binding.device)
    assert len(set(devices)) == P, devices
    if GPU:  # for the test reading NCCL's log: which device (ordinal, PCI bus) is whose
        import cupy

        bus = cupy.cuda.Device(binding.device).pci_bus_id
        print(f"DEVICE rank {rank} node {this_node()} ordinal {binding.device} bus {bus}",
              flush=True)


def products():
    rng = np.random.default_rng(7)  # the same operands on every rank
    for m, n, k in [(37, 29, 31), (64, 48, 80)]:
        a = rng.standard_normal((m, k))
        b = rng.standard_normal((k, n))
        want = a @ b
        if GPU:
            import cupy

            from distmm.engine.mpi import DistArray
            from distmm.engine.mpi.gridcomms import local_gpu
            from distmm.grid import make_grid

            local_gpu(comm)
            grid = make_grid(m, n, k, "float64", ranks=P)
            da = DistArray.from_array(cupy.asarray(a), comm, grid.a_layout)
            db = DistArray.from_array(cupy.asarray(b), comm, grid.b_layout)
            got = distmm.matmul(da, db).gather(root=None)
            got = got.get() if hasattr(got, "get") else got
        else:
            got = np.asarray(distmm.matmul(a, b, engine="mpi"))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert got.shape == want.shape and err < 1e-12, (m, n, k, err)


ok, everything = run_cases(comm, [node_environment, real_binding, products], failures)
if rank == 0:
    print("VERDICT ok" if ok else "VERDICT FAIL\n" + "\n".join(everything), flush=True)
