"""Panel broadcasts for SUMMA: one ``ibcast(panel, root)`` whatever moves the bytes.

This module covers: ``NullBroadcaster`` (a communicator of one rank: nothing
moves, nothing is made), ``HostBroadcaster`` (mpi4py ``Ibcast`` of host buffers, in
``distmm.engine.mpi.pieces`` past one MPI count; a pickled ``bcast`` for object arrays,
``pickled``/``unpickled`` keeping a failure to pickle as a value so that no rank stops
inside a collective), ``CudaAwareBroadcaster`` (mpi4py on cupy
buffers, where the MPI library reports CUDA support through
``MPIX_Query_cuda_support``), ``StagedBroadcaster`` (cupy buffers through pinned
host memory for MPIs without CUDA support) and ``NcclBroadcaster``
(``cupy.cuda.nccl``; the unique id goes over MPI), plus ``make_broadcaster``
that picks one. Each counts the bytes its rank receives.
It does *not* cover: which panel goes where (``distmm.engine.mpi.summa``).
"""
from __future__ import annotations

import os
import pickle

import numpy as np

from distmm.engine.mpi import pieces
from distmm.errors import NotPicklable

__all__ = ["NullBroadcaster", "HostBroadcaster", "CudaAwareBroadcaster", "StagedBroadcaster", "NcclBroadcaster",
           "make_broadcaster", "mpi_cuda_aware", "pickled", "unpickled"]


def pickled(x) -> bytes | NotPicklable:
    """``x`` pickled, or the ``NotPicklable`` saying why not (sent in its place: the
    receivers learn of it in the same collective instead of waiting for ever)."""
    try:
        return pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return NotPicklable(f"object elements that do not pickle cannot move between ranks "
                            f"({type(exc).__name__}: {exc})")


def unpickled(payload):
    """What ``pickled`` made, back; a ``NotPicklable`` for one that failed there or here."""
    if isinstance(payload, NotPicklable):
        return payload
    try:
        return pickle.loads(payload)
    except Exception as exc:
        return NotPicklable(f"object elements from another rank do not unpickle here "
                            f"({type(exc).__name__}: {exc})")


class _Done:
    """A finished request; ``unsent``: the ``NotPicklable`` of an object panel that did
    not arrive (the caller decides what to do once every broadcast is done)."""

    def __init__(self, unsent: NotPicklable | None = None):
        self.unsent = unsent

    def wait(self):
        return None


class _MPIRequest:
    """A broadcast in flight (``pieces.Requests``); ``after`` runs once it is done."""

    def __init__(self, request, after=None):
        self.request, self.after = request, after

    def wait(self):
        self.request.wait()
        if self.after is not None:
            self.after()
            self.after = None


class NullBroadcaster:
    """The broadcaster of a one-rank communicator (or none): every panel is already
    where it is needed, so ``ibcast`` does nothing and nothing (no NCCL communicator,
    no stream, no pinned buffer) is ever made."""

    bytes_received = 0

    def __init__(self, comm=None):
        self.comm = comm

    def ibcast(self, buf, root: int):
        return _Done()

    def close(self):
        pass


class HostBroadcaster:
    """Broadcasts host (numpy) panels over an mpi4py communicator.

    ``ibcast(buf, root)`` starts a nonblocking broadcast of the contiguous
    array ``buf`` (filled on ``root``, overwritten elsewhere) and returns a
    request with ``wait()``. Object arrays are broadcast at once, pickled.
    """

    def __init__(self, comm):
        self.comm = comm
        self.bytes_received = 0

    def ibcast(self, buf, root: int):
        if self.comm.size == 1:
            return _Done()
        if self.comm.rank != root:
            self.bytes_received += buf.nbytes
        if buf.dtype.kind == "O":
            got = pieces.bcast_object(self.comm, pickled(buf) if self.comm.rank == root else None,
                                      root)
            if self.comm.rank != root or isinstance(got, NotPicklable):
                got = unpickled(got)
                if isinstance(got, NotPicklable):
                    return _Done(got)
                buf[...] = got
            return _Done()
        return _MPIRequest(pieces.ibcast(self.comm, buf, root))

    def close(self):
        pass


def mpi_cuda_aware() -> bool:
    """Whether the MPI library says it moves CUDA device buffers itself."""
    try:
        from mpi4py import MPI

        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - an MPI without the extension: not CUDA-aware
        return False


class CudaAwareBroadcaster(HostBroadcaster):
    """mpi4py on cupy buffers (``__cuda_array_interface__``), for CUDA-aware MPIs."""

    def ibcast(self, buf, root: int):
        if self.comm.size == 1:
            return _Done()
        import cupy

        cupy.cuda.get_current_stream().synchronize()  # the root's panel is written
        if self.comm.rank != root:
            self.bytes_received += buf.nbytes
        return _MPIRequest(pieces.ibcast(self.comm, buf, root))


class StagedBroadcaster(HostBroadcaster):
    """cupy panels through pinned host buffers and host MPI (no CUDA-aware MPI)."""

    def __init__(self, comm):
        super().__init__(comm)
        self._pinned = {}
        self._next = 0

    def _host(self, nbytes: int, slot: int):
        import cupy

        mem = self._pinned.get(slot)
        if mem is None or mem[1] < nbytes:
            mem = (cupy.cuda.alloc_pinned_memory(max(nbytes, 1)), nbytes)
            self._pinned[slot] = mem
        return np.frombuffer(mem[0], dtype=np.uint8, count=nbytes)

    def ibcast(self, buf, root: int):
        if self.comm.size == 1:
            return _Done()
        flat = buf.reshape(-1).view(np.uint8)
        slot, self._next = self._next % 3, self._next + 1  # at most two panels in flight
        host = self._host(flat.nbytes, slot)
        if self.comm.rank == root:
            flat.get(out=host)
        else:
            self.bytes_received += flat.nbytes

        def upload():
            if self.comm.rank != root:
                flat.set(host)

        return _MPIRequest(pieces.ibcast(self.comm, host, root), after=upload)

    def close(self):
        self._pinned.clear()


class _StreamRequest:
    """A broadcast queued on a stream: ``wait()`` makes the current stream wait for it;
    ``start`` and ``done`` are its CUDA events (for timelines)."""

    def __init__(self, start, done):
        self.start, self.done = start, done

    def wait(self):
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.done)


class NcclBroadcaster:
    """NCCL broadcasts of cupy panels on a stream of their own (``cupy.cuda.nccl``).

    The unique id is made on rank 0 of ``comm`` and broadcast over MPI. The
    returned request's ``wait()`` makes the current stream wait for the
    broadcast (an event), so the GEMM that uses the panel queues behind it
    without blocking the host.
    """

    def __init__(self, comm):
        from cupy.cuda import nccl

        from distmm.executor.streams import urgent_stream

        self.comm = comm
        self.bytes_received = 0
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl = nccl.NcclCommunicator(comm.size, uid, comm.rank)
        # at the greatest priority: NCCL's kernel takes an SM as soon as one of a running
        # GEMM's blocks ends (distmm.executor.streams)
        self.stream = urgent_stream()

    def ibcast(self, buf, root: int):
        import cupy
        from cupy.cuda import nccl

        if self.comm.size == 1:
            return _Done()
        if self.comm.rank != root:
            self.bytes_received += buf.nbytes
        ready = cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)  # the root's panel copy is queued before the send
        flat = buf.reshape(-1).view(np.uint8)
        start = self.stream.record()
        self.nccl.bcast(flat.data.ptr, flat.size, nccl.NCCL_UINT8, root, self.stream.ptr)
        return _StreamRequest(start, self.stream.record())

    def close(self):
        if getattr(self, "nccl", None) is not None:
            self.nccl.destroy()
            self.nccl = None


def select_local_gpu(comm) -> int:
    """Make this rank use its GPU and return the device index (collective on ``comm``).

    The choice is ``distmm.engine.mpi.binding.bind_rank``'s: the node-local rank (launcher
    variables, else the MPI shared-memory split) over the devices ``CUDA_VISIBLE_DEVICES``
    or Slurm leave this rank, round-robin when ranks outnumber GPUs (one warning, rank 0).

    Raises
    ------
    BackendUnavailable
        A rank of ``comm`` sees no GPU (raised on every rank, so none waits for it).
    """
    import cupy

    from distmm.errors import BackendUnavailable

    from distmm.engine.mpi.binding import bind_rank

    binding = bind_rank(comm)
    blind = comm.allgather(None if binding.device is not None else (
        comm.rank, binding.host, os.environ.get("CUDA_VISIBLE_DEVICES")))
    blind = [b for b in blind if b is not None]
    if blind:
        rank, host, visible = blind[0]
        raise BackendUnavailable(f"{len(blind)} of {comm.size} ranks see no GPU; rank {rank} on "
                                 f"{host} (CUDA_VISIBLE_DEVICES={visible!r}) is one")
    _widen_cpus(comm, binding)
    cupy.cuda.Device(binding.device).use()
    return binding.device


def _widen_cpus(comm, binding) -> None:
    """A GPU rank bound to one CPU by its launcher runs on its share of the node's CPUs
    (``distmm.engine.mpi.cpus``, setting ``mpi-cpus``); rank 0 logs it once for the job."""
    import logging

    from distmm.config import get_config
    from distmm.engine.mpi.cpus import widen

    cpus = widen(binding.local_rank, binding.local_size, get_config().mpi_cpus)
    widened = comm.gather(None if cpus is None else len(cpus), root=0)
    if comm.rank == 0 and any(w is not None for w in widened):
        n = sum(w is not None for w in widened)
        logging.getLogger("distmm.engine.mpi.cpus").info(
            "%d of %d GPU ranks were bound to one CPU by the launcher and now run on their "
            "share of their node's CPUs (%d or more each); choose it with mpirun's --bind-to "
            "none or --map-by slot:PE=N, or keep the launcher's with distmm.mpi-cpus: keep",
            n, comm.size, min(w for w in widened if w is not None))


def shares_gpu(comm) -> bool:
    """Whether two ranks of ``comm`` use the same GPU (NCCL refuses that: "duplicate GPU")."""
    import socket

    import cupy

    dev = cupy.cuda.Device()
    key = (socket.gethostname(), cupy.cuda.runtime.deviceGetPCIBusId(dev.id))
    keys = comm.allgather(key)
    return len(set(keys)) != len(keys)


def make_broadcaster(comm, *, on_gpu: bool, prefer: str = "auto"):
    """The broadcaster for panels on ``comm``.

    ``prefer``: ``"auto"`` (host MPI for host panels; for GPU panels NCCL when
    ``cupy.cuda.nccl`` is available and no two ranks share a GPU, else CUDA-aware
    MPI where the library reports it, else pinned host staging), or one of ``"mpi"``, ``"nccl"``,
    ``"cuda-aware"``, ``"staged"``. A communicator of one rank (or ``None``) gets a
    ``NullBroadcaster`` whatever ``prefer`` says.
    """
    if comm is None or comm.size == 1:
        return NullBroadcaster(comm)
    if not on_gpu or prefer == "mpi":
        return HostBroadcaster(comm)
    if prefer in ("auto", "nccl"):
        try:
            from cupy.cuda import nccl

            usable = nccl.available
        except ImportError:
            usable = False
        shared = comm.size > 1 and shares_gpu(comm)  # collective: every rank asks
        if usable and not shared:
            return NcclBroadcaster(comm)
        if prefer == "nccl":
            raise RuntimeError("NCCL cannot broadcast here: " + (
                "two ranks share one GPU" if shared else
                "this cupy has no NCCL (cupy.cuda.nccl.available is False)"))
    if prefer in ("auto", "cuda-aware") and mpi_cuda_aware():
        return CudaAwareBroadcaster(comm)
    return StagedBroadcaster(comm)
