"""The CPUs a GPU rank runs on: a launcher's one-core binding widened to the rank's share.

Open MPI's ``mpirun`` binds each rank to one core when it starts two ranks or fewer (an
app context of two in the MPMD form counts so), unless told otherwise (``--bind-to
none``, ``--map-by slot:PE=N``). A GPU rank is not one thread: NCCL's proxy threads move
every byte that crosses a network (its socket transport), and the batch path reads,
copies and writes on threads of its own. Bound to one core they take turns with the
rank's main thread, and the product waits for them (``bench/NOTES.md``, "One core per
rank").

This module covers: the pure choice (``share``: the node-local rank's contiguous share
of the CPUs the node allows, given that this rank's mask is a single CPU and the node
has more CPUs than ranks), where the allowed CPUs come from (``allowed_cpus``: the
cgroup's cpuset, else every CPU, within the launching process's mask), ``wanted`` (this
process's share, or None) and ``widen`` (applies it to every thread of the process), under
the ``mpi-cpus`` setting: ``auto`` widens, ``keep`` keeps the launcher's mask. A mask of several CPUs is a choice
someone made and is never changed; CPU ranks (no GPU) are never changed either: one core
each is what a BLAS rank wants.
It does *not* cover: choosing the GPU (``distmm.engine.mpi.binding``).
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

__all__ = ["share", "allowed_cpus", "parse_cpu_list", "wanted", "widen"]

log = logging.getLogger("distmm.engine.mpi.cpus")

_CPUSETS = ("/sys/fs/cgroup/cpuset.cpus.effective",
            "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``"0-3,8,10-11"``) as sorted CPU numbers.

    >>> parse_cpu_list("0-3,8,10-11\\n")
    [0, 1, 2, 3, 8, 10, 11]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def allowed_cpus() -> list[int]:
    """The CPUs the job may use on this node: the cgroup's effective cpuset where one is
    readable (else ``0 .. os.cpu_count() - 1``), within the mask of the process that
    started this one (the launcher's daemon: a ``taskset`` around ``mpirun`` stays in
    force) where that can be read."""
    cpus: list[int] = []
    for path in _CPUSETS:
        try:
            with open(path) as fh:
                cpus = parse_cpu_list(fh.read())
        except (OSError, ValueError):
            continue
        if cpus:
            break
    cpus = cpus or list(range(os.cpu_count() or 1))
    try:
        parent = os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # not Linux, or a parent already gone
        return cpus
    return [c for c in cpus if c in parent] or cpus


def share(current: Sequence[int], allowed: Sequence[int], local_rank: int,
          local_size: int) -> list[int] | None:
    """The CPUs a GPU rank should run on, or None to leave its mask alone.

    Only a mask of one CPU is widened (a launcher's default; a wider one is someone's
    choice), and only where the node has more allowed CPUs than ranks: then the rank
    takes the ``local_rank``-th of ``local_size`` contiguous, even shares of ``allowed``.

    Examples
    --------
    >>> share([5], range(64), 1, 4)[:2], len(share([5], range(64), 1, 4))
    ([16, 17], 16)
    >>> share([0, 1], range(64), 0, 4) is None, share([3], range(4), 3, 4) is None
    (True, True)
    """
    allowed = sorted(allowed)
    if len(set(current)) != 1 or local_size < 1 or len(allowed) <= local_size:
        return None
    if not 0 <= local_rank < local_size:
        return None
    per, extra = divmod(len(allowed), local_size)
    lo = local_rank * per + min(local_rank, extra)
    return allowed[lo:lo + per + (local_rank < extra)]


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - not Linux
        return [0]


def wanted(local_rank: int, local_size: int, setting: str = "auto") -> list[int] | None:
    """The CPUs ``widen`` would give this process, or None where it would leave the mask
    (``keep``, a mask of several CPUs, no spare CPUs, or a platform without affinity
    calls)."""
    if setting != "auto" or not hasattr(os, "sched_setaffinity"):
        return None
    return share(sorted(os.sched_getaffinity(0)), allowed_cpus(), local_rank, local_size)


def widen(local_rank: int, local_size: int, setting: str = "auto") -> list[int] | None:
    """Apply ``wanted`` to every thread of this process and return the new CPUs, or None
    where nothing changed."""
    cpus = wanted(local_rank, local_size, setting)
    if cpus is None:
        return None
    done = False
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
            done = True
        except OSError:  # a thread that ended meanwhile, or a CPU the cgroup refuses
            continue
    if done:
        log.info("a one-CPU binding widened to %d CPUs (node-local rank %d of %d)", len(cpus),
                 local_rank, local_size)
    return cpus if done else None
