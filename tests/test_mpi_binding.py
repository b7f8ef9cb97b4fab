"""Which GPU each MPI rank takes (``distmm.engine.mpi.binding``), on the CPU.

The pure choice from launcher variables (Open MPI, Slurm) and ``CUDA_VISIBLE_DEVICES``
for a given device count, as a table of cases; the one sharing warning's text; errors.
Under a real ``mpiexec -n 3`` (the device count passed in, so no GPU is needed): each
rank's node-local rank and device, per-rank ``CUDA_VISIBLE_DEVICES`` values, a
sub-communicator, and the sharing warning printed once per job, not once per rank.
Under a real ``mpiexec -n 2``: ``distmm info`` prints every rank's binding once, in
rank order, from rank 0. GPU checks are in tests/test_mpi_gpu_blocks.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distmm.engine.mpi.binding import SPLIT, Binding, choose_binding, node_rank, sharing_warning

HERE = Path(__file__).resolve().parent


def ompi(local_rank: int, local_size: int, world: int | None = None, **more) -> dict:
    """Open MPI's variables for one rank (world size defaults to the node's)."""
    return dict({"OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
                 "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
                 "OMPI_COMM_WORLD_SIZE": str(world or local_size)}, **more)


def slurm_step(local_id: int, gtids: str, ntasks: int, **more) -> dict:
    """srun's variables for one task of a job step."""
    return dict({"SLURM_LOCALID": str(local_id), "SLURM_GTIDS": gtids,
                 "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_PROCID": str(local_id)}, **more)


OM, SL = "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"

# name: (environment, device count, peers or None, split or None, world size or None,
#        expected (local rank, local size, rank source, device, ranks on that device))
CASES = {
    "ompi-3-ranks-2-gpus-rank0": (ompi(0, 3), 2, None, None, 3, (0, 3, OM, 0, 2)),
    "ompi-3-ranks-2-gpus-rank1": (ompi(1, 3), 2, None, None, 3, (1, 3, OM, 1, 1)),
    "ompi-3-ranks-2-gpus-rank2": (ompi(2, 3), 2, None, None, 3, (2, 3, OM, 0, 2)),
    "ompi-4-ranks-4-gpus-rank3": (ompi(3, 4), 4, None, None, 4, (3, 4, OM, 3, 1)),
    "ompi-2-ranks-1-gpu": (ompi(1, 2), 1, None, None, 2, (1, 2, OM, 0, 2)),
    "ompi-2-nodes-local-rank-not-world-rank": (ompi(1, 2, world=4), 2, None, None, 4,
                                               (1, 2, OM, 1, 1)),
    "no-gpu": (ompi(1, 3), 0, None, None, 3, (1, 3, OM, None, 1)),
    # srun --gpus-per-task=1 with a device cgroup: task 3 sees its one GPU as device 0
    "slurm-per-task-cgroup": (slurm_step(3, "0,1,2,3", 4, CUDA_VISIBLE_DEVICES="0",
                                         SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="0,1,2,3"),
                              1, None, None, 4, (3, 4, SL, 0, 1)),
    # the same without a cgroup: CUDA_VISIBLE_DEVICES=3 is the global ID, still device 0 to CUDA
    "slurm-per-task-global-id": (slurm_step(3, "0,1,2,3", 4, CUDA_VISIBLE_DEVICES="3",
                                            SLURM_STEP_GPUS="0,1,2,3"),
                                 1, None, None, 4, (3, 4, SL, 0, 1)),
    # --gpus-per-task=2: the rank's own two GPUs; it takes the first, alone
    "slurm-two-gpus-per-task": (slurm_step(1, "0,1", 2, CUDA_VISIBLE_DEVICES="2,3",
                                           SLURM_GPUS_ON_NODE="4"),
                                2, None, None, 2, (1, 2, SL, 0, 1)),
    # one CUDA_VISIBLE_DEVICES for the whole step: round-robin over what it shows
    "slurm-step-wide-visible": (slurm_step(2, "4,5,6", 6, CUDA_VISIBLE_DEVICES="0,1,2",
                                           SLURM_GPUS_ON_NODE="3"),
                                3, None, None, 6, (2, 3, SL, 2, 1)),
    # no CUDA_VISIBLE_DEVICES and no cgroup: the process sees all 8, Slurm gave the step 4..7
    "slurm-step-gpus-global": (slurm_step(1, "0,1", 2, SLURM_STEP_GPUS="4,5,6,7"),
                               8, None, None, 2, (1, 2, SL, 5, 1)),
    # a device cgroup shows exactly the step's GPUs, renumbered: the IDs are not used
    "slurm-step-gpus-cgroup": (slurm_step(1, "0,1", 2, SLURM_STEP_GPUS="4,5"),
                               2, None, None, 2, (1, 2, SL, 1, 1)),
    "slurm-job-gpus-when-no-step-gpus": (slurm_step(0, "0", 1, SLURM_JOB_GPUS="2"),
                                         4, None, None, 1, (0, 1, SL, 2, 1)),
    # mpirun inside an sbatch script: the batch step's SLURM_LOCALID=0 reaches every rank
    "mpirun-in-sbatch-ompi-wins": (dict(ompi(2, 3), SLURM_LOCALID="0", SLURM_JOB_GPUS="0,1,2"),
                                   3, None, None, 3, (2, 3, OM, 2, 1)),
    "batch-script-localid-ignored": ({"SLURM_LOCALID": "0", "SLURM_GTIDS": "0"},
                                     2, None, (1, 2), 2, (1, 2, SPLIT, 1, 1)),
    # variables of another launch (another world size): the split decides
    "other-world-size": (ompi(0, 2, world=8), 2, None, (1, 2), 2, (1, 2, SPLIT, 1, 1)),
    # a sub-communicator: node size differs from the launcher's, the split decides
    "sub-communicator": (ompi(3, 4), 2, None, (0, 2), 4, (0, 2, SPLIT, 0, 1)),
    "split-only": ({}, 2, None, (2, 3), None, (2, 3, SPLIT, 0, 2)),
    # peers from the node: ranks 0 and 2 see "0", rank 1 sees "1" -> rank 2 is second on "0"
    "peers-per-rank-values": (ompi(2, 3, CUDA_VISIBLE_DEVICES="0"), 1, ["0", "1", "0"], None, 3,
                              (2, 3, OM, 0, 2)),
    "peers-all-distinct": (ompi(2, 3, CUDA_VISIBLE_DEVICES="GPU-c"), 1, ["GPU-a", "GPU-b", "GPU-c"],
                           None, 3, (2, 3, OM, 0, 1)),
    # rank 3 is the third of ranks 0, 2, 3 on value "a": slot 2 of 2 devices -> device 0
    "peers-uneven-groups": (ompi(3, 4, CUDA_VISIBLE_DEVICES="a"), 2, ["a", "b", "a", "a"], None, 4,
                            (3, 4, OM, 0, 2)),
    "peers-unset-everywhere": (ompi(1, 2), 2, [None, None], None, 2, (1, 2, OM, 1, 1)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_binding_table(case):
    env, count, peers, split, world, expected = CASES[case]
    b = choose_binding(env, count, peers=peers, split=split, world_size=world, host="n1")
    assert isinstance(b, Binding)
    assert (b.local_rank, b.local_size, b.rank_source, b.device, b.shared) == expected, b
    assert b.sharing == (expected[4] > 1)
    assert b.devices == count and b.host == "n1"
    assert "n1" in b.describe() and (("no GPU" in b.describe()) == (b.device is None))
    with pytest.raises(AttributeError):  # frozen
        b.device = 7


def test_visible_devices_are_never_used_as_indices():
    """CUDA renumbers what CUDA_VISIBLE_DEVICES lists from 0: a rank given GPU 5 uses device 0."""
    for local in range(8):
        env = slurm_step(local, "0,1,2,3,4,5,6,7", 8, CUDA_VISIBLE_DEVICES=str(local),
                         SLURM_GPUS_ON_NODE="8")
        b = choose_binding(env, 1)
        assert (b.device, b.shared) == (0, 1), b


def test_round_robin_counts():
    """n ranks over g devices: every device used, each by n // g or n // g + 1 ranks."""
    for n in range(1, 9):
        for g in range(1, 5):
            bs = [choose_binding(ompi(r, n), g) for r in range(n)]
            assert [b.device for b in bs] == [r % g for r in range(n)]
            for b in bs:
                assert b.shared == sum(1 for r in range(n) if r % g == b.device)
            assert (sharing_warning(bs) is not None) == (n > g)


def test_node_rank_precedence_and_errors():
    both = dict(ompi(1, 2), **slurm_step(0, "0,1", 2))
    assert node_rank(both, world_size=2).source == "OMPI_COMM_WORLD_LOCAL_RANK"
    assert node_rank(slurm_step(1, "4,5", 6), world_size=6).rank == 1
    with pytest.raises(ValueError, match="no node-local rank"):
        node_rank({})
    with pytest.raises(ValueError, match="no node-local rank"):  # batch script: no step
        node_rank({"SLURM_LOCALID": "0", "SLURM_GTIDS": "0"})
    assert node_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "x"}, split=(1, 2)).source == SPLIT
    assert node_rank(ompi(5, 2), split=(1, 2)).source == SPLIT  # out of range


def test_choose_binding_errors():
    with pytest.raises(ValueError, match="must not be negative"):
        choose_binding(ompi(0, 1), -1)
    with pytest.raises(ValueError, match="peers has 1 entries, the node has 2"):
        choose_binding(ompi(0, 2), 1, peers=[None])
    with pytest.raises(ValueError, match="peers gives node-local rank 0"):
        choose_binding(ompi(0, 2, CUDA_VISIBLE_DEVICES="0"), 1, peers=["1", "0"])


def test_sharing_warning_names_each_host_once():
    bs = [choose_binding(ompi(r, 3), 2, host="a", rank=r) for r in range(3)]
    bs += [choose_binding(ompi(r, 2), 2, host="b", rank=3 + r) for r in range(2)]
    bs += [choose_binding(ompi(r, 3), 1, host="c", rank=5 + r) for r in range(3)]
    text = sharing_warning(bs)
    assert text.count("a: ") == 1 and "a: 2 ranks on 1 GPU" in text  # ranks 0 and 2 on device 0
    assert "b: " not in text
    assert "c: 3 ranks on 1 GPU" in text
    assert sharing_warning(bs[3:5]) is None
    assert sharing_warning([choose_binding(ompi(r, 2), 0) for r in range(2)]) is None  # no GPU


# -- under a real mpiexec ------------------------------------------------------------------

@pytest.fixture
def script_env(mpi_env):
    """The ranks' environment, with tests/ importable (mpi_verdict) by a script elsewhere."""
    mpi_env["PYTHONPATH"] = str(HERE) + os.pathsep + mpi_env["PYTHONPATH"]
    return mpi_env


BIND_SCRIPT = r"""
import os, sys
from mpi4py import MPI
from mpi_verdict import run_cases
from distmm.engine.mpi.binding import SPLIT, bind_rank

comm = MPI.COMM_WORLD
failures = []

def check(got, want, what):
    # recorded, not raised: every rank must go on to the same collectives
    if got != want:
        failures.append(f"rank {comm.rank}: {what}: got {got!r}, want {want!r}")

def round_robin():
    # Open MPI numbers a node's ranks by its mapping, not always in world-rank order
    local = int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    check(sorted(comm.allgather(local)), [0, 1, 2], "one host: local ranks 0, 1, 2")
    for count in (0, 1, 2, 3, 4):
        b = bind_rank(comm, device_count=count)
        check((b.rank, b.local_rank, b.local_size, b.rank_source),
              (comm.rank, local, 3, "OMPI_COMM_WORLD_LOCAL_RANK"), f"count {count}")
        want = None if count == 0 else local % count
        check(b.device, want, f"device of {count}")
        check(b.shared, 1 if count == 0 else sum(1 for r in range(3) if r % count == want),
              f"shared of {count}")
        print(f"MARK rank {comm.rank} count {count}", file=sys.stderr, flush=True)

def own_visible_device():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=f"GPU-{comm.rank}")  # a launcher's per-rank value
    b = bind_rank(comm, device_count=1, environ=env)
    check((b.device, b.shared), (0, 1), "own device")

def two_ranks_one_value():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0" if comm.rank != 1 else "1")
    b = bind_rank(comm, device_count=1, environ=env)
    check((b.device, b.shared), (0, 2 if comm.rank != 1 else 1), "ranks 0 and 2 share")
    check(b.how.endswith("this rank's own") == (comm.rank == 1), True, "how: " + b.how)

def sub_communicator():
    sub = comm.Split(color=comm.rank % 2, key=comm.rank)
    try:
        b = bind_rank(sub, device_count=4)
        check((b.rank_source, b.local_rank, b.local_size), (SPLIT, sub.rank, sub.size), "split")
        check(b.device, sub.rank, "device on the sub-communicator")
    finally:
        sub.Free()

cases = [round_robin, own_visible_device, two_ranks_one_value, sub_communicator]
ok, fails = run_cases(comm, cases, failures)
if comm.rank == 0:
    print("\n".join(fails or []))
    print("VERDICT", "ok" if ok else "FAIL", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_bind_rank_under_mpiexec_3(tmp_path, mpiexec, script_env):
    script = tmp_path / "bind.py"
    script.write_text(BIND_SCRIPT)
    r = subprocess.run([mpiexec, "-n", "3", "--oversubscribe", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120, env=script_env)
    assert "VERDICT ok" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]
    assert r.returncode == 0, r.stderr[-3000:]
    # one warning per sharing call (device counts 1 and 2, ranks 0 and 2 on one value),
    # from rank 0 only: not one per rank
    warnings = [line for line in r.stderr.splitlines() if "ranks share GPUs round-robin" in line]
    assert len(warnings) == 3, r.stderr[-5000:]
    assert "3 ranks on 1 GPU" in warnings[0] and "2 ranks on 1 GPU" in warnings[1], warnings
    assert "2 ranks on 1 GPU" in warnings[2], warnings


@pytest.mark.mpi
@pytest.mark.slow
def test_info_under_mpiexec_prints_every_rank_once(mpirun):
    r = mpirun(2, "-m", "distmm", "info")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert sum(line.startswith("distmm ") for line in out) == 1, r.stdout  # the usual info, once
    assert sum(line.startswith("numpy ") for line in out) == 1, r.stdout
    assert sum(line.startswith("ranks ") for line in out) == 1 and "2 (" in r.stdout, r.stdout
    rows = [line for line in out if line.startswith("rank ")]
    assert [row.split()[1] for row in rows] == ["0", "1"], r.stdout  # rank order, once each
    for local, row in enumerate(rows):
        assert f"node-local rank {local} of 2 (OMPI_COMM_WORLD_LOCAL_RANK)" in row, row
        assert " CPU" in row, row  # the CPUs the rank may run on
        from distmm.engine.mpi.binding import visible_device_count

        if visible_device_count() == 0:
            assert "no GPU" in row, row
        else:
            assert "GPU " in row and "no GPU" not in row, row
