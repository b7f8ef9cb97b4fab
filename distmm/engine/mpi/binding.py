"""Which GPU each MPI rank uses: its node-local rank, the launcher's variables, the visible devices.

This module covers: ``Binding`` (one rank's host, node-local rank, node size, the device
it uses and how that was chosen, and how many ranks of its node use the same device);
the pure choice (``node_rank`` and ``choose_binding``, from environment variables, a
device count and, under MPI, what the node's other ranks see), testable without MPI
or a GPU; ``bind_rank(comm)``, the collective that makes every rank's ``Binding`` and
prints one warning per job when ranks share GPUs; ``sharing_warning``, that warning's
text; ``visible_device_count``.
It does *not* cover: making the chosen device current (``distmm.engine.mpi.comm.
select_local_gpu``), or caching the choice per communicator
(``distmm.engine.mpi.gridcomms.local_gpu``).

Precedence
----------
The node-local rank (this rank's number among the job's ranks on its host):

1. Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK`` and ``OMPI_COMM_WORLD_LOCAL_SIZE``;
2. Slurm's ``SLURM_LOCALID`` in a job step started by ``srun`` (the node's size is the
   number of ``SLURM_GTIDS``; ``SLURM_STEP_NUM_TASKS`` must be set: a batch script also
   has ``SLURM_LOCALID=0``, which every rank an ``mpirun`` in it starts would inherit);
3. the MPI shared-memory split of the communicator (``comm.Split_type(MPI.COMM_TYPE_SHARED)``),
   whatever the launcher.

A launcher's variables count only when its world size (``OMPI_COMM_WORLD_SIZE``,
``SLURM_STEP_NUM_TASKS``) is ``MPI.COMM_WORLD``'s and its node size is the split's: on a
sub-communicator, or with variables inherited from another launch, the split decides.

The devices a rank chooses from:

1. ``CUDA_VISIBLE_DEVICES`` when set (by the user, by Slurm for ``--gpus-per-task`` or
   ``--gpu-bind``, or by a wrapper script): CUDA already shows only those, numbered from
   0, so the rank picks among ``0 .. count-1`` and never uses the listed IDs themselves.
   The node's ranks that see the same value share those devices round-robin, in
   node-local rank order; a rank whose value is its own (per-task binding) takes its
   first device;
2. otherwise Slurm's GPUs of the step (``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``:
   global IDs) when this process sees more devices than they list (no device cgroup
   hides the others): the rank picks among those IDs (CUDA's numbering matches Slurm's
   where ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the node's GPUs are all alike);
3. otherwise every device the process sees.

Rank ``i`` of ``n`` ranks choosing among ``g`` devices takes device ``i mod g``: with
``n > g`` ranks share devices round-robin and ``bind_rank`` prints one warning (rank 0,
for the whole job). Without peers' values (the pure call), the node's ranks are taken to
see what this rank sees, unless ``SLURM_GPUS_ON_NODE`` or Slurm's GPU list counts more
GPUs on the node than this rank sees: then the launcher gave this rank its own.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Binding", "NodeRank", "node_rank", "choose_binding", "bind_rank", "sharing_warning",
           "visible_device_count"]

log = logging.getLogger("distmm.engine.mpi.binding")

SPLIT = "shared-memory split"


@dataclass(frozen=True)
class NodeRank:
    """A rank's number among the ranks on its host, and where that number came from."""

    rank: int
    size: int
    source: str


@dataclass(frozen=True)
class Binding:
    """The device one rank uses, and why.

    Attributes
    ----------
    host : str
    rank : int
        Rank in the communicator the binding was made for (0 in the pure call).
    local_rank, local_size : int
        Node-local rank and the number of ranks on the node.
    rank_source : str
        Where ``local_rank`` came from: a launcher variable or ``"shared-memory split"``.
    device : int or None
        Index of the device among those CUDA shows this process (``cupy.cuda.Device(device)``);
        None when the process sees no GPU.
    devices : int
        Devices this process sees.
    how : str
        How ``device`` was chosen, in words.
    shared : int
        Ranks of the node that use this device, this one included (1: its own).
    """

    host: str
    rank: int
    local_rank: int
    local_size: int
    rank_source: str
    device: int | None
    devices: int
    how: str
    shared: int

    @property
    def sharing(self) -> bool:
        """Whether another rank of the node uses the same device."""
        return self.shared > 1

    def describe(self, gpu: str | None = None) -> str:
        """One line: host, device (``gpu`` names it, e.g. its model), node-local rank and
        how the device was chosen."""
        if gpu is None:
            gpu = "no GPU" if self.device is None else f"GPU {self.device}"
        shared = f", shared by {self.shared} ranks" if self.sharing else ""
        return (f"{self.host}, {gpu}{shared}; node-local rank {self.local_rank} of "
                f"{self.local_size} ({self.rank_source}); {self.how}")


def _int(value) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def _launcher_rank(env: Mapping[str, str], world_size: int | None) -> NodeRank | None:
    """The node-local rank the launcher's variables give, or None (see the precedence)."""
    candidates = []
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        candidates.append((_int(env.get("OMPI_COMM_WORLD_LOCAL_RANK")),
                           _int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE")),
                           _int(env.get("OMPI_COMM_WORLD_SIZE")), "OMPI_COMM_WORLD_LOCAL_RANK"))
    if "SLURM_LOCALID" in env and "SLURM_STEP_NUM_TASKS" in env:
        gtids = [t for t in env.get("SLURM_GTIDS", "").split(",") if t.strip()]
        candidates.append((_int(env.get("SLURM_LOCALID")), len(gtids) or None,
                           _int(env.get("SLURM_STEP_NUM_TASKS")), "SLURM_LOCALID"))
    for rank, size, world, name in candidates:
        if rank is None or size is None or not 0 <= rank < size:
            continue
        if world_size is not None and world != world_size:
            continue  # the variables describe another launch
        return NodeRank(rank, size, name)
    return None


def node_rank(environ: Mapping[str, str] | None = None, *, split: tuple[int, int] | None = None,
              world_size: int | None = None) -> NodeRank:
    """This rank's node-local rank, by the module's precedence.

    Parameters
    ----------
    environ : mapping, optional
        The environment (default ``os.environ``).
    split : (rank, size), optional
        The rank and size of the MPI shared-memory split of the communicator.
    world_size : int, optional
        ``MPI.COMM_WORLD.size``: launcher variables of another world size are ignored.

    Returns
    -------
    NodeRank

    Raises
    ------
    ValueError
        Neither a launcher's variables nor ``split`` give a node-local rank.

    Examples
    --------
    >>> node_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    ...            "OMPI_COMM_WORLD_SIZE": "4"}, world_size=4)
    NodeRank(rank=1, size=2, source='OMPI_COMM_WORLD_LOCAL_RANK')
    """
    env = os.environ if environ is None else environ
    found = _launcher_rank(env, world_size)
    if found is not None and (split is None or found.size == split[1]):
        return found
    if split is None:
        raise ValueError("no node-local rank: no launcher variables (OMPI_COMM_WORLD_LOCAL_RANK, "
                         "SLURM_LOCALID) and no MPI shared-memory split given")
    return NodeRank(split[0], split[1], SPLIT)


def _visible(env: Mapping[str, str]) -> str | None:
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else value.strip()


def _slurm_gpu_ids(env: Mapping[str, str]) -> tuple[str, list[int]] | None:
    """Slurm's global IDs of the step's (else the job's) GPUs on this node, or None."""
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        raw = env.get(name, "").strip()
        if raw:
            ids = [_int(t) for t in raw.split(",")]
            if all(i is not None for i in ids):
                return name, ids
    return None


def _node_gpus(env: Mapping[str, str]) -> int | None:
    """GPUs Slurm gave the step on this node (``SLURM_GPUS_ON_NODE``, else its ID list)."""
    count = _int(env.get("SLURM_GPUS_ON_NODE"))
    if count is not None:
        return count
    ids = _slurm_gpu_ids(env)
    return len(ids[1]) if ids else None


def choose_binding(environ: Mapping[str, str] | None, device_count: int, *,
                   split: tuple[int, int] | None = None, world_size: int | None = None,
                   peers: Sequence[str | None] | None = None, host: str | None = None,
                   rank: int = 0) -> Binding:
    """The device this rank uses: a pure function of its environment and what it sees.

    Parameters
    ----------
    environ : mapping or None
        The rank's environment (None: ``os.environ``).
    device_count : int
        Devices CUDA shows this process (0: no GPU).
    split, world_size :
        As for ``node_rank``.
    peers : sequence of str or None, optional
        ``CUDA_VISIBLE_DEVICES`` (None where unset) of every rank on the node, indexed by
        node-local rank. Default: see the module's last paragraph.
    host : str, optional
        Default ``socket.gethostname()``.
    rank : int
        The rank in the communicator (recorded only).

    Returns
    -------
    Binding

    Raises
    ------
    ValueError
        No node-local rank (see ``node_rank``), a negative ``device_count``, or
        ``peers`` that are not one per rank of the node.

    Examples
    --------
    Three ranks of Open MPI on a host whose process sees two GPUs:

    >>> env = {"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    ...        "OMPI_COMM_WORLD_SIZE": "3"}
    >>> b = choose_binding(env, 2, host="n1")
    >>> b.device, b.shared
    (0, 2)
    """
    env = os.environ if environ is None else environ
    if device_count < 0:
        raise ValueError(f"device_count must not be negative, got {device_count}")
    local = node_rank(env, split=split, world_size=world_size)
    host = socket.gethostname() if host is None else host
    mine = _visible(env)
    if peers is None:
        node_gpus = _node_gpus(env)
        own = mine is not None and node_gpus is not None and node_gpus > device_count
        # the launcher gave this rank its own devices: no other rank sees this value
        peers = [mine if r == local.rank or not own else f"<rank {r}'s>" for r in range(local.size)]
    if len(peers) != local.size:
        raise ValueError(f"peers has {len(peers)} entries, the node has {local.size} ranks")
    if peers[local.rank] != mine:
        raise ValueError(f"peers gives node-local rank {local.rank} CUDA_VISIBLE_DEVICES="
                         f"{peers[local.rank]!r}, its environment {mine!r}")
    group = [r for r in range(local.size) if peers[r] == mine]
    slot = group.index(local.rank)
    if device_count == 0:
        return Binding(host, rank, local.rank, local.size, local.source, None, 0,
                       "CUDA shows this process no device", 1)
    choices, why = list(range(device_count)), f"all {device_count} visible"
    if mine is not None:
        why = f"CUDA_VISIBLE_DEVICES={mine} ({device_count} visible)"
    else:
        slurm = _slurm_gpu_ids(env)
        if slurm is not None and device_count > len(slurm[1]) and max(slurm[1]) < device_count:
            choices = slurm[1]
            why = f"{slurm[0]}={','.join(map(str, choices))} ({device_count} visible)"
    width = len(choices)
    device = choices[slot % width]
    shared = sum(1 for s in range(len(group)) if s % width == slot % width)
    if len(group) == 1:
        how = f"{why}, this rank's own"
    else:
        how = f"{why}, rank {slot} of {len(group)} round-robin"
    return Binding(host, rank, local.rank, local.size, local.source, device, device_count, how,
                   shared)


def sharing_warning(bindings: Sequence[Binding]) -> str | None:
    """The one warning for a job whose ranks share GPUs (None when none do).

    Examples
    --------
    >>> b = [choose_binding({}, 1, split=(r, 2), host="n1", rank=r) for r in range(2)]
    >>> sharing_warning(b).split(": ", 1)[1]
    'ranks share GPUs round-robin (slower than a GPU each; NCCL is not used): n1: 2 ranks on 1 GPU'
    """
    hosts: dict[str, tuple[int, set]] = {}
    for b in bindings:
        if b.device is not None and b.sharing:
            ranks, devices = hosts.get(b.host, (0, set()))
            hosts[b.host] = (ranks + 1, devices | {b.device})
    if not hosts:
        return None
    parts = [f"{h}: {n} ranks on {len(d)} GPU{'s' if len(d) > 1 else ''}"
             for h, (n, d) in sorted(hosts.items())]
    return ("distmm: ranks share GPUs round-robin (slower than a GPU each; NCCL is not used): "
            + "; ".join(parts))


@functools.lru_cache(maxsize=1)
def visible_device_count() -> int:
    """GPUs CUDA shows this process (0 without cupy or a driver); asked once."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: no GPU
        return 0


def bind_rank(comm, device_count: int | None = None, *, environ: Mapping[str, str] | None = None,
              warn: bool = True) -> Binding:
    """Every rank's ``Binding`` on ``comm`` (collective: every rank of ``comm`` calls it).

    The node's ranks (the shared-memory split) exchange their node-local ranks and
    ``CUDA_VISIBLE_DEVICES``; each then chooses as ``choose_binding`` does. When ranks
    share a device, rank 0 logs one warning (``sharing_warning``) for the whole job on
    ``distmm.engine.mpi.binding``. Nothing is made current: see ``select_local_gpu``.

    Parameters
    ----------
    comm : mpi4py communicator
    device_count : int, optional
        Devices this process sees (default ``visible_device_count()``).
    environ : mapping, optional
        Default ``os.environ``.
    warn : bool
        Log the sharing warning (rank 0).

    Returns
    -------
    Binding
        This rank's.
    """
    from mpi4py import MPI

    env = os.environ if environ is None else environ
    count = visible_device_count() if device_count is None else device_count
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        split = (node.rank, node.size)
        local = node_rank(env, split=split, world_size=MPI.COMM_WORLD.size)
        seen = node.allgather((local.rank, _visible(env)))  # in split order
        if sorted(r for r, _ in seen) == list(range(node.size)):
            peers = [v for _, v in sorted(seen, key=lambda rv: rv[0])]
        else:  # the launcher's numbering is not a numbering of this node: use the split's
            env = {k: v for k, v in env.items()
                   if k not in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")}
            peers = [v for _, v in seen]
        binding = choose_binding(env, count, split=split, world_size=MPI.COMM_WORLD.size,
                                 peers=peers, rank=comm.rank)
    finally:
        node.Free()
    if warn:
        everyone = comm.gather(binding, root=0)
        if comm.rank == 0:
            text = sharing_warning(everyone)
            if text:
                log.warning(text)
    return binding
