"""A block task's device inputs, opened in the background in the order the task needs them.

This module covers: ``Inputs``, the mapping ``block index -> chunk`` a block
task assembles its panels from (``blocks.block_product``). Inputs that are
at hand (a chunk, a TCP offer, an offer of this process's own export, one
already opened) are taken at once; CUDA IPC offers of another process, each
one device-to-device copy, are opened one after another on a background
thread of this worker process, on a stream of their own, in the order given
(the task's first GEMM's blocks first), while the task's thread assembles
panels and starts GEMMs on what has arrived. Reading a block waits for its
copy only.
It does *not* cover: opening one offer (``transfer.take``) or which blocks a
task reads (``tasks.BlockSpec``).

Why: on 2 x H200 (fp32 n = 32768, one block of C per GPU) each worker opened
3 GiB of the other's chunks, copy by copy with a synchronisation each, before
its one GEMM was queued (bench/NOTES.md, Dask engine on GPU clusters).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from distmm.engine.dask.transfer import Offer, take

__all__ = ["Inputs", "copies"]

_POOL: list = []  # [ThreadPoolExecutor]: one opening thread per worker process
_STREAMS: dict = {}  # device id -> the non-blocking stream the opening thread copies on
_LOCK = threading.Lock()


def copies(x) -> bool:
    """Whether ``take(x)`` copies: a CUDA IPC offer of another process, not opened yet."""
    return (isinstance(x, Offer) and x.shared is not None and not x.shared.local
            and x._opened is None)


def _pool() -> ThreadPoolExecutor:
    with _LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="distmm-open"))
        return _POOL[0]


def _open(device: int, offer: Offer, out, ready):
    """On the opening thread: ``take(offer, out)`` on ``device``, copied on that
    device's own non-blocking stream (never the legacy default stream, which
    would wait for the task's GEMMs) once ``ready`` (an event the task's stream
    recorded after allocating ``out``) has passed; ``take`` synchronises its copy.

    ``out`` is allocated by the task's thread on the task's stream, so that its
    memory returns to that stream's pool and is reused in that stream's order;
    memory of the opening stream's pool could be handed to a later copy while a
    GEMM of the task's stream still reads it."""
    import cupy

    with cupy.cuda.Device(device):
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.wait_event(ready)
            return take(offer, out)


class Inputs(Mapping):
    """``block index -> chunk`` of one operand of a block task.

    ``keys``/``values``: the task's block indexes and what it was handed for
    them (chunks or ``transfer.Offer`` objects); ``order``: block indexes in
    the order the task reads them (missing ones last). Copies are queued at
    construction; ``[key]`` waits for that block's copy and re-raises its error.
    """

    def __init__(self, keys, values, order=()):
        self._ready: dict = {}
        self._futures: dict[tuple, Future] = {}
        pending = []
        for key, x in zip(keys, values):
            if copies(x):
                pending.append((key, x))
            else:
                self._ready[key] = take(x)
        self._keys = tuple(keys)
        if pending:
            import cupy

            rank = {k: i for i, k in enumerate(order)}
            pending.sort(key=lambda kx: rank.get(kx[0], len(rank)))
            device = int(cupy.cuda.runtime.getDevice())
            outs = [cupy.empty(x.shared.shape, x.shared.dtype) for _, x in pending]
            ready = cupy.cuda.get_current_stream().record()
            pool = _pool()
            for (key, x), out in zip(pending, outs):
                self._futures[key] = pool.submit(_open, device, x, out, ready)

    def __getitem__(self, key):
        if key not in self._ready:
            fut = self._futures.get(key)
            if fut is None:
                raise KeyError(key)
            self._ready[key] = fut.result()
            del self._futures[key]
        return self._ready[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def first(self):
        """The first block (at hand when any is)."""
        for key in self._keys:
            if key in self._ready:
                return self._ready[key]
        return self[self._keys[0]]

    def pending(self) -> int:
        """Copies not yet read by the task."""
        return len(self._futures)
