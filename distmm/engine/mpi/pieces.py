"""Messages of any size over mpi4py, in pieces that one MPI count holds.

This module covers: ``send``, ``recv``, ``bcast`` and ``ibcast`` of a contiguous array's
bytes (numpy, or cupy for a CUDA-aware MPI) as one message where it has at most
``MAX_COUNT`` bytes, else as messages of ``PIECE_BYTES``; ``send_object``,
``recv_object``, ``bcast_object`` and ``alltoall_objects``, mpi4py's pickled
``send``/``recv``/``bcast``/``alltoall`` for pickles of any size; ``pairwise``, an
``Alltoallv`` of bytes as point-to-point pieces; and ``fits``. An MPI without large
counts (Open MPI 5) refuses a count past a C int (``MPI_ERR_ARG``), pickled messages
included.
It does *not* cover: which buffers move where (``distmm.engine.mpi.summa``,
``distmm.engine.mpi.comm``, ``distmm.engine.mpi.distarray``).
"""
from __future__ import annotations

import pickle

import numpy as np

__all__ = ["MAX_COUNT", "PIECE_BYTES", "fits", "send", "recv", "bcast", "ibcast", "Requests",
           "send_object", "recv_object", "bcast_object", "pairwise", "alltoall_objects"]

#: the most bytes one MPI call moves: its counts and displacements are C ints
MAX_COUNT = 2**31 - 1
#: the bytes of one message of a buffer past ``MAX_COUNT``
PIECE_BYTES = 2**30

_PAIRWISE_TAG = 0x6d76  # the pieces of pairwise (a pair's messages arrive in order)


def fits(nbytes: int) -> bool:
    """Whether ``nbytes`` bytes go in one MPI call."""
    return nbytes <= MAX_COUNT


def _flat(buf):
    """The bytes of the C-contiguous array ``buf`` (numpy or cupy), as a flat uint8 view."""
    if not buf.flags.c_contiguous:  # reshape would copy: received bytes would be lost
        raise ValueError(f"MPI messages move C-contiguous arrays, got one of shape "
                         f"{tuple(buf.shape)} and strides {tuple(buf.strides)}")
    return buf.reshape(-1).view(np.uint8)


def _spans(nbytes: int):
    """The ``(lo, hi)`` byte ranges of the messages of ``nbytes`` bytes (the same on every
    rank that knows the size): one where it fits, else pieces of ``PIECE_BYTES``."""
    if fits(nbytes):
        return [(0, nbytes)]
    step = max(1, int(PIECE_BYTES))
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]


def send(comm, buf, dest: int, tag: int = 0) -> None:
    """``comm.Send`` of the contiguous array ``buf``'s bytes, in pieces past ``MAX_COUNT``."""
    flat = _flat(buf)
    for lo, hi in _spans(flat.size):
        comm.Send(flat[lo:hi], dest=dest, tag=tag)


def recv(comm, buf, source: int, tag: int = 0) -> None:
    """``comm.Recv`` into the contiguous array ``buf`` of what ``send`` sent (its size)."""
    flat = _flat(buf)
    for lo, hi in _spans(flat.size):
        comm.Recv(flat[lo:hi], source=source, tag=tag)


def bcast(comm, buf, root: int) -> None:
    """``comm.Bcast`` of the contiguous array ``buf`` (the same size on every rank)."""
    flat = _flat(buf)
    for lo, hi in _spans(flat.size):
        comm.Bcast(flat[lo:hi], root=root)


class Requests:
    """Nonblocking messages in flight; ``wait()`` returns once every one is done, ``Test()``
    says whether they are (as an mpi4py request's, for callers that poll)."""

    def __init__(self, requests):
        self.requests = requests

    def Test(self) -> bool:  # mpi4py's name: pollers call it
        from mpi4py import MPI

        return not self.requests or bool(MPI.Request.Testall(self.requests))

    def wait(self) -> None:
        from mpi4py import MPI

        if self.requests:
            MPI.Request.Waitall(self.requests)
            self.requests = []


def ibcast(comm, buf, root: int) -> Requests:
    """``comm.Ibcast`` of the contiguous array ``buf`` (the same size on every rank)."""
    flat = _flat(buf)
    return Requests([comm.Ibcast(flat[lo:hi], root=root) for lo, hi in _spans(flat.size)])


class _Large:
    """Sent in place of a pickle past one count: its size; its bytes follow in pieces."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


# room for mpi4py's own pickle around bytes sent as one pickled message
_SLACK = 1024


def _head(obj):
    """``(data, head)``: ``obj`` pickled, and what goes as the first pickled message (the
    data, or a ``_Large`` where it cannot go in one)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return data, (data if fits(len(data) + _SLACK) else _Large(len(data)))


def send_object(comm, obj, dest: int, tag: int = 0) -> None:
    """``comm.send(obj)`` for a pickle of any size (``recv_object`` receives it)."""
    data, head = _head(obj)
    comm.send(head, dest=dest, tag=tag)
    if isinstance(head, _Large):
        send(comm, np.frombuffer(data, dtype=np.uint8), dest, tag)


def recv_object(comm, source: int, tag: int = 0):
    """What ``send_object`` sent."""
    head = comm.recv(source=source, tag=tag)
    if isinstance(head, _Large):
        buf = np.empty(head.nbytes, dtype=np.uint8)
        recv(comm, buf, source, tag)
        head = buf
    return pickle.loads(head)


def bcast_object(comm, obj, root: int):
    """``comm.bcast(obj, root)`` for a pickle of any size (``obj`` is read on ``root``)."""
    if comm.rank == root:
        data, head = _head(obj)
        comm.bcast(head, root=root)
        if isinstance(head, _Large):
            bcast(comm, np.frombuffer(data, dtype=np.uint8), root)  # read on the root
        return obj
    head = comm.bcast(None, root=root)
    if isinstance(head, _Large):
        buf = np.empty(head.nbytes, dtype=np.uint8)
        bcast(comm, buf, root)
        head = buf
    return pickle.loads(head)


def pairwise(comm, pieces, recv_buf, recv_counts) -> None:
    """``Alltoallv`` of bytes as point-to-point messages no count of which passes a C int:
    ``pieces[p]`` (a uint8 array) goes to rank p, and rank p's piece for this rank lands in
    ``recv_buf``, ``recv_counts[p]`` bytes packed in rank order."""
    from mpi4py import MPI

    requests, pos = [], 0
    for peer, count in enumerate(recv_counts):
        for lo, hi in _spans(count) if count else ():
            requests.append(comm.Irecv(recv_buf[pos + lo:pos + hi], source=peer,
                                       tag=_PAIRWISE_TAG))
        pos += count
    for peer, piece in enumerate(pieces):
        for lo, hi in _spans(piece.size) if piece.size else ():
            requests.append(comm.Isend(piece[lo:hi], dest=peer, tag=_PAIRWISE_TAG))
    MPI.Request.Waitall(requests)


def alltoall_objects(comm, objs) -> list:
    """``comm.alltoall(objs)`` for pickles of any size: ``objs[p]`` goes to rank p, and the
    list of what every rank sent this one comes back (sizes first, then the pickles'
    bytes through ``pairwise``). An object passed for several ranks is pickled once."""
    made: dict = {}
    data = [made[id(x)] if id(x) in made else made.setdefault(
        id(x), pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)) for x in objs]
    sizes = comm.alltoall([len(d) for d in data])
    got = np.empty(sum(sizes), dtype=np.uint8)
    pairwise(comm, [np.frombuffer(d, dtype=np.uint8) for d in data], got, sizes)
    out, pos = [], 0
    for size in sizes:
        out.append(pickle.loads(got[pos:pos + size]))
        pos += size
    return out
