"""Block mode's task bodies: one whole block of C per task, on its device.

This module covers: ``block_product``, which computes one block of C (over
one k group) in one task: on a GPU worker with the GPU executor's stream
pipeline reading the block's panels straight from the chunks it was handed
(``Chunked``: no copy of the whole panel), raising
``distmm.errors.TileFailed`` when the device fails (out of memory after the
pipeline's retries, a lost device, or on purpose for tests), or handing the
block to a CPU worker itself; on a CPU worker with the CPU executor; and
``cut``, one output chunk sliced out of its block. Device chunks of other
workers may arrive as CUDA IPC offers: a GPU task copies the pieces it needs
straight from the other process's memory into its panels
(``transfer.take_into``), assembling each panel in one pass, each k piece's panels
on a second stream while the previous piece's GEMM runs (``_overlapped_block``); chunks of
workers on other hosts arrive as NCCL offers, whose receives the task posts at its start
in the order it reads them (``_receive``), each copy waiting on the device for its chunk.
It does *not* cover: which blocks exist (``distmm.plan_blocks``), the
graph (``graph``) or the per-tile tasks (``tasks``). Module-level functions,
pickled by reference.
"""
from __future__ import annotations

import threading

import numpy as np

from distmm.engine.dask.tasks import (BlockSpec, TaskPlan, array_module, as_chunk, cached_executor,
                                      block_parts, panel, recording_flags, worker_has_gpu)
from distmm.engine.dask.transfer import NcclOffer, Offer, dtype_of, take, take_into
from distmm.engine.tiles import finish_tile, tile_partial

__all__ = ["block_product", "cut", "Chunked", "device_pieces"]


class Chunked:
    """A 2-D panel over a grid of chunks, read by slices as the stream
    pipeline reads its operands: a slice inside one chunk is a view, one
    across chunks is assembled from the pieces it covers (only that region is
    copied, in the pipeline's copy threads)."""

    def __init__(self, blocks: dict, lead: tuple, row_pieces, col_pieces):
        self.blocks, self.lead = blocks, lead
        self.row_pieces, self.col_pieces = tuple(row_pieces), tuple(col_pieces)
        self.row_off = np.cumsum([0] + [r1 - r0 for _, r0, r1 in self.row_pieces]).tolist()
        self.col_off = np.cumsum([0] + [c1 - c0 for _, c0, c1 in self.col_pieces]).tolist()
        self.shape = (self.row_off[-1], self.col_off[-1])
        self.ndim = 2
        rb, cb = self.row_pieces[0][0], self.col_pieces[0][0]
        self.dtype = blocks[(rb, cb)].dtype

    @staticmethod
    def _overlap(pieces, offsets, lo: int, hi: int):
        out = []
        for (blk, p0, _), g0, g1 in zip(pieces, offsets[:-1], offsets[1:]):
            a, b = max(lo, g0), min(hi, g1)
            if b > a:
                out.append((blk, p0 + a - g0, p0 + b - g0))
        return out

    def __getitem__(self, idx):
        rs, cs = idx
        r0, r1, _ = rs.indices(self.shape[0])
        c0, c1, _ = cs.indices(self.shape[1])
        rows = self._overlap(self.row_pieces, self.row_off, r0, r1)
        cols = self._overlap(self.col_pieces, self.col_off, c0, c1)
        return panel(self.blocks, self.lead, rows, cols)

    def __array__(self, dtype=None, copy=None):
        out = self[0:self.shape[0], 0:self.shape[1]]
        return out if dtype is None else out.astype(dtype, copy=False)


def _whole(x):
    return x if isinstance(x, np.ndarray) or not isinstance(x, Chunked) else np.asarray(x)


def _device_error(exc: BaseException) -> bool:
    """An error of the device rather than of the inputs: cupy's and CUDA's own,
    no GPU after all, or the pipeline's out-of-memory after its retries."""
    from distmm.errors import BackendUnavailable

    mod = type(exc).__module__ or ""
    return mod.startswith(("cupy", "cupy_backends")) or isinstance(exc, (BackendUnavailable,
                                                                         MemoryError))


def _device_limit(share: int):
    """Device bytes the pipeline may use when ``share`` workers use this GPU
    (None: the pipeline's own default, ``distmm.device-memory-limit`` or 90%
    of the free memory)."""
    from distmm.config import get_config

    if share <= 1 or get_config().device_memory_limit is not None:
        return None
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(min(0.85 * total / share, 0.95 * free))


def _gpu_executor(tp: TaskPlan, backend: str):
    """This worker's GPU executor for ``tp`` (``backend`` where it is a GPU one, else auto)."""
    from distmm.executor import GPU_BACKENDS

    return cached_executor(backend if backend in GPU_BACKENDS else "auto", tp.acc_dtype, True,
                           tp.precision)


def _gpu_block(tp: TaskPlan, backend: str, a, b, share: int):
    """``a @ b`` in the accumulation dtype on this worker's GPU: host float
    panels through the stream pipeline, others through the device."""
    acc = np.dtype(tp.acc_dtype)
    ex = _gpu_executor(tp, backend)
    host = isinstance(a, (np.ndarray, Chunked))
    if host and acc.name in ("float32", "float64") and a.shape[1]:
        from distmm.executor.pipeline import run_pipelined
        from distmm.plan import make_plan

        m, k = a.shape
        n = b.shape[1]
        out = ex.empty_host((m, n), acc)
        run_pipelined(ex, make_plan(m, n, k, acc, workers=1, precision=tp.precision), a, b,
                      out,  # copies cast
                      device_memory_limit=_device_limit(share))
        return out
    a, b = _whole(a), _whole(b)
    part = tile_partial(ex, tp, a, b)
    return ex.to_host(part) if host else part


@recording_flags
def _cpu_block(tp: TaskPlan, backend: str, a, b, at=None):
    from distmm.executor import CPU_BACKENDS

    a, b = _whole(a), _whole(b)
    if not isinstance(a, np.ndarray):  # device chunks falling back to the CPU
        a, b = array_module(a).asnumpy(a), array_module(b).asnumpy(b)
    ex = cached_executor(backend if backend in CPU_BACKENDS else "auto", tp.acc_dtype, False,
                         tp.precision)
    return tile_partial(ex, tp, a, b, at)


def _cpu_elsewhere(tp: TaskPlan, backend: str, a, b, workers, cell):
    """Run ``a @ b`` with the CPU executor on one of ``workers`` from inside a
    task (the task leaves the worker's thread pool while it waits)."""
    import logging
    import uuid

    from distributed import worker_client

    with worker_client() as client:
        a_f, b_f = client.scatter([_whole(a), _whole(b)], workers=list(workers), broadcast=False, direct=True)
        fut = client.submit(_cpu_block, tp, backend, a_f, b_f, workers=list(workers),
                            allow_other_workers=True, key=f"distmm-fallback-{uuid.uuid4().hex}")
        where = client.who_has([a_f]).get(a_f.key, ())
        logging.getLogger("distmm.engine.dask").warning(
            "distmm: tile %s failed on the GPU and moved to CPU worker(s) %s", cell, list(where))
        return fut.result()


@recording_flags
def block_product(tp: TaskPlan, backend: str, spec: BlockSpec, device: str, fail: bool,
                  share: int, a_list, b_list, cell=None, fallback=(), own_exports=()):
    """One block of C (over one k group) in one task.

    ``device``: ``"gpu"`` runs the GPU executor on this worker's device (the
    CPU executor where the worker is marked GPU but has none); a failure of
    the device raises ``TileFailed`` for the engine to run the block again on
    a CPU worker; ``fail`` raises it on purpose (``distmm-debug.fail-tiles``).
    ``"cpu"`` runs the CPU executor. ``share``: workers using this GPU.
    ``fallback``: CPU workers that rerun a failed GPU block themselves (dask
    operands, where no loop outside the graph can; the worker's log names
    ``cell``); empty: ``TileFailed`` reaches the caller (the eager loop).
    Inputs may be ``transfer.Offer`` objects (another worker's device chunk
    exported through CUDA IPC): on a GPU their pieces are copied straight into
    the panels (``_device_panels``); elsewhere each is opened whole first.
    A ``pull.Pull`` input is first fetched from its holder (``pull.resolve``),
    after the export tasks of this worker (``own_exports``, ``pull.Pull`` each)
    have run (``pull.await_own``).
    """
    from distmm.engine.dask.pull import await_own, resolve
    from distmm.errors import TileFailed

    await_own(own_exports)
    a_list, b_list = resolve(a_list, b_list)
    if device == "gpu" and worker_has_gpu():
        _receive(spec, a_list, b_list)
    host = isinstance(_held(a_list[0]), np.ndarray)
    device_panels = device == "gpu" and not host
    if not device_panels:  # device panels open offers as they copy them in (_device_panels)
        a_list = [take(x) for x in a_list]
        b_list = [take(x) for x in b_list]
    a_blocks = dict(zip(spec.a_keys, a_list))
    b_blocks = dict(zip(spec.b_keys, b_list))
    acc = None
    on_host = True  # every piece multiplied by numpy's matmul on a CPU (finish_tile's parts)
    if device_panels and not fail and worker_has_gpu() and np.dtype(tp.acc_dtype).kind == "f":
        try:
            acc = _overlapped_block(tp, backend, spec, a_blocks, b_blocks)
            on_host = False
        except Exception as exc:
            if not _device_error(exc):
                raise
            import logging

            logging.getLogger("distmm.engine.dask").warning(
                "distmm: block %s failed on the GPU (%s: %s); running it piece by piece",
                cell, type(exc).__name__, exc)
    for a_k, b_k in (spec.k_pieces if acc is None else ()):
        on_gpu = device == "gpu" and (fail or not host or worker_has_gpu())
        if on_gpu and host:  # the pipeline reads the chunks by slices
            a_sub = Chunked(a_blocks, spec.a_lead, spec.a_rows, a_k)
            b_sub = Chunked(b_blocks, spec.b_lead, b_k, spec.b_cols)
        elif device_panels:
            a_sub, b_sub = _device_panels(spec, a_k, b_k, a_blocks, b_blocks)
        else:
            a_sub = panel(a_blocks, spec.a_lead, spec.a_rows, a_k)
            b_sub = panel(b_blocks, spec.b_lead, b_k, spec.b_cols)
        if on_gpu:
            try:
                if fail:
                    raise TileFailed("block failed on purpose (distmm-debug.fail-tiles)")
                try:
                    part = _gpu_block(tp, backend, a_sub, b_sub, share)
                    on_host = False
                except Exception as exc:
                    if not _device_error(exc):
                        raise
                    raise TileFailed(f"the GPU failed on a {a_sub.shape[0]} x {b_sub.shape[1]} "
                                     f"block: {type(exc).__name__}: {exc}") from exc
            except TileFailed:
                if not fallback:
                    raise
                part = _cpu_elsewhere(tp, backend, a_sub, b_sub, fallback, cell)
                if not host:
                    part = array_module(a_sub).asarray(part)
        else:
            part = _cpu_block(tp, backend, a_sub, b_sub, spec.whole_at)
        acc = part if acc is None else acc + part
    if not spec.finish:
        return acc
    # the CPU executor's products are numpy's matmul (its numba kernels take no complex)
    parts = block_parts(spec.a_rows, spec.b_cols, spec.k_pieces) if on_host else None
    return as_chunk(finish_tile(tp, acc, parts), spec.batch_ndim)


def _receive(spec: BlockSpec, a_list, b_list) -> None:
    """Post the NCCL receives of the inputs that are ``transfer.NcclOffer`` s (chunks of
    workers on other hosts), in the order the k loop reads them: by chunk along k, A's
    before B's, so the first piece's chunks arrive first and the later ones while its GEMMs
    run."""
    order = [((kb, 0, rb), x) for (rb, kb), x in zip(spec.a_keys, a_list)
             if isinstance(x, NcclOffer)]
    order += [((kb, 1, cb), x) for (kb, cb), x in zip(spec.b_keys, b_list)
              if isinstance(x, NcclOffer)]
    if order:
        from distmm.engine.dask import nccl_route

        nccl_route.receive([x for _, x in sorted(order, key=lambda t: t[0])])


def _held(x):
    """What an input holds: a chunk as it is; for a ``transfer.Offer`` whose export failed, the
    chunk it carries inline (a host chunk where cupy does not import); else the offer (an IPC
    export of a device chunk)."""
    from distmm.engine.dask.transfer import Offer

    if isinstance(x, Offer) and x.shared is None:
        return x.data
    return x


def _device_panels(spec: BlockSpec, a_k, b_k, a_blocks: dict, b_blocks: dict):
    """A's and B's panels of one k piece on this worker's GPU, from device
    chunks and CUDA IPC offers (``transfer.Offer``), each assembled in one
    pass: every piece is copied into its place, another process's export
    straight from its memory by the copy engines (``transfer.take_into``). A
    panel of one piece of a chunk at hand is a view. The mappings are closed
    once every copy has finished."""
    import cupy

    from distmm.executor import ipc

    mapped: dict = {}
    try:
        a = _assemble(a_blocks, spec.a_lead, spec.a_rows, a_k, mapped)
        b = _assemble(b_blocks, spec.b_lead, b_k, spec.b_cols, mapped)
    finally:
        if mapped:
            cupy.cuda.get_current_stream().synchronize()
            ipc.unmap_later(mapped.values())
    return a, b


_COPY_STREAMS = threading.local()  # each worker thread's stream for assembling panels


def _copy_stream():
    stream = getattr(_COPY_STREAMS, "stream", None)
    if stream is None:
        from distmm.executor.streams import urgent_stream

        # non-blocking: the worker's GEMMs run on the legacy default stream, which a
        # blocking stream would wait for; urgent: the copy kernels of the next piece's
        # panels go ahead of the running GEMM's next blocks
        stream = _COPY_STREAMS.stream = urgent_stream()
    return stream


def _overlapped_block(tp: TaskPlan, backend: str, spec: BlockSpec, a_blocks: dict,
                      b_blocks: dict):
    """The block (in the accumulation dtype) on this worker's GPU, its k pieces' panels
    assembled on a copy stream while the previous piece's GEMM runs on the current stream,
    each GEMM adding into one C (``beta = 1`` after the first; the first piece one GEMM per
    chunk of C, those at hand first: ``_first_piece``). Two pieces' panels are held
    at a time: a piece's memory is reused only after its GEMM has read it. Mappings of
    other workers' exports are ended on the closing thread once the copies and GEMMs queued
    here have run (``ipc.unmap_later``): the task returns with its last copies and GEMMs
    still queued on the device (C's readers are ordered after them on the device, as for
    any cupy result)."""
    import cupy

    from distmm.executor import ipc

    ex = _gpu_executor(tp, backend)
    m = sum(r1 - r0 for _, r0, r1 in spec.a_rows)
    n = sum(c1 - c0 for _, c0, c1 in spec.b_cols)
    compute = cupy.cuda.get_current_stream()
    copy = _copy_stream()
    out = cupy.empty((m, n), dtype=np.dtype(tp.acc_dtype))
    mapped: dict = {}
    held: list = []  # (event after its GEMM, A panel, B panel) of the last two pieces
    try:
        least, later = piece_lengths(tp.acc_dtype, tp.precision)
        pieces = device_pieces(spec.k_pieces, least=least, later=later)
        for g, (a_k, b_k) in enumerate(pieces):
            if g == 0 and _split_first(spec):
                held.append(_first_piece(ex, spec, a_k, b_k, a_blocks, b_blocks, out, compute,
                                         copy, mapped))
                continue
            with copy:
                if len(held) == 2:  # piece g - 2's panels: reusable once its GEMM is done
                    done = held.pop(0)
                    copy.wait_event(done[0])
                    del done
                a = _assemble(a_blocks, spec.a_lead, spec.a_rows, a_k, mapped)
                b = _assemble(b_blocks, spec.b_lead, b_k, spec.b_cols, mapped)
                ready = copy.record()
            compute.wait_event(ready)
            ex.device_gemm(a, b, out, beta=0 if g == 0 else 1)
            held.append((compute.record(), a, b))
    finally:
        compute.wait_event(copy.record())  # so `compute`'s queued work covers every copy
        ipc.unmap_later(mapped.values())  # once that work has run, on the closing thread
        copy.wait_event(compute.record())  # the panels' memory returns to the copy stream
        held.clear()
    return out


def _first_piece(ex, spec: BlockSpec, a_k, b_k, a_blocks: dict, b_blocks: dict, out, compute,
                 copy, mapped: dict):
    """The block's first k piece, one GEMM per (row chunk, column chunk) of C (``beta = 0``
    into that part of ``out``), those whose operand chunks are at hand first: the first
    GEMM starts before the other chunks' exports are mapped on the host, which then
    happens while it runs. Every element of C still sums its k pieces in the same order,
    and the parts are the same whatever the order they run in, so the bits do not depend on
    where the chunks lie. Returns ``(event after the GEMMs, A's parts, B's parts)`` for the
    caller to hold until the event."""
    row_off = np.cumsum([0] + [r1 - r0 for _, r0, r1 in spec.a_rows]).tolist()
    col_off = np.cumsum([0] + [c1 - c0 for _, c0, c1 in spec.b_cols]).tolist()
    a_far = [sum(_far(a_blocks[(rb, kb)]) for kb, _, _ in a_k) for rb, _, _ in spec.a_rows]
    b_far = [sum(_far(b_blocks[(kb, cb)]) for kb, _, _ in b_k) for cb, _, _ in spec.b_cols]
    order = sorted(((i, j) for i in range(len(spec.a_rows)) for j in range(len(spec.b_cols))),
                   key=lambda ij: (a_far[ij[0]] + b_far[ij[1]], ij))
    a_parts: dict = {}
    b_parts: dict = {}
    for i, j in order:
        with copy:
            if i not in a_parts:
                part = _assemble(a_blocks, spec.a_lead, (spec.a_rows[i],), a_k, mapped)
                a_parts[i] = (part, copy.record())
            if j not in b_parts:
                part = _assemble(b_blocks, spec.b_lead, b_k, (spec.b_cols[j],), mapped)
                b_parts[j] = (part, copy.record())
        compute.wait_event(a_parts[i][1])
        compute.wait_event(b_parts[j][1])
        ex.device_gemm(a_parts[i][0], b_parts[j][0],
                       out[row_off[i]:row_off[i + 1], col_off[j]:col_off[j + 1]], beta=0)
    return compute.record(), a_parts, b_parts


#: the first piece is split per chunk of C only into at most this many GEMMs, each at least
#: ``FIRST_PART_SIDE`` rows and columns (smaller GEMMs would cost more than they hide)
FIRST_PARTS, FIRST_PART_SIDE = 16, 1024


def _split_first(spec: BlockSpec) -> bool:
    """Whether the block's first k piece runs per chunk of C (``_first_piece``): more than
    one chunk, at most ``FIRST_PARTS`` of them, none thinner than ``FIRST_PART_SIDE``."""
    parts = len(spec.a_rows) * len(spec.b_cols)
    sides = [r1 - r0 for _, r0, r1 in spec.a_rows] + [c1 - c0 for _, c0, c1 in spec.b_cols]
    most = _positive(FIRST_PARTS_KEY)
    return 1 < parts <= (FIRST_PARTS if most is None else most) and min(sides) >= FIRST_PART_SIDE


def _far(x) -> int:
    """2 for a ``NcclOffer`` (received from another host), 1 for an ``Offer`` of another
    process's export (mapped and copied before use), else 0."""
    if isinstance(x, NcclOffer):
        return 2
    return int(isinstance(x, Offer) and x.shared is not None and not x.shared.local)


#: the shortest first k piece a block's device panels are cut into (``device_pieces``), and
#: the shortest later one, by the block's accumulation dtype at ``precision="highest"``
#: (``piece_lengths``; why these lengths: ``bench/NOTES.md``, the block's k pieces): a float32
#: block's first piece is its whole k (``WHOLE_K``; still one GEMM per chunk of C, so the
#: first GEMM waits only for one row chunk's and one column chunk's panels), since cuBLAS's
#: SGEMM runs a k cut in pieces slower than the whole k; others (and the reduced
#: precisions) in pieces of one chunk
DEVICE_PIECE_K, LATER_PIECE_K = 4096, 4096
WHOLE_K = 1 << 62
PIECE_K = {"float32": (WHOLE_K, 16384)}
#: debug configuration (dask's, outside the checked ``distmm`` section): the shortest first
#: and later pieces, so that a benchmark can compare lengths in one run
FIRST_PIECE_KEY = "distmm-debug.first-piece-k"
LATER_PIECE_KEY = "distmm-debug.later-piece-k"
#: debug configuration: the most GEMMs the first piece is split into (``_split_first``;
#: 1: never split)
FIRST_PARTS_KEY = "distmm-debug.first-parts"


def _positive(key: str):
    import dask.config

    value = dask.config.get(key, None)
    if value is None:
        return None
    value = int(value)
    if value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value}")
    return value


def piece_lengths(acc_dtype: str, precision: str = "highest") -> tuple[int, int]:
    """``(least, later)`` for ``device_pieces``: ``PIECE_K``'s lengths for the accumulation
    dtype (at ``precision="highest"``; else one chunk each), each replaced by
    ``FIRST_PIECE_KEY`` / ``LATER_PIECE_KEY`` where set (a positive integer)."""
    least, later = (PIECE_K.get(str(np.dtype(acc_dtype)), (DEVICE_PIECE_K, LATER_PIECE_K))
                    if precision == "highest" else (DEVICE_PIECE_K, LATER_PIECE_K))
    first, after = _positive(FIRST_PIECE_KEY), _positive(LATER_PIECE_KEY)
    return (least if first is None else first), (later if after is None else after)


def device_pieces(k_pieces, least: int = DEVICE_PIECE_K, later: int | None = None):
    """A block's k pieces (``BlockSpec.k_pieces``: block mode gives each k group as one
    piece) cut again at A's and B's chunk edges along k, as ``(A's pieces, B's pieces)``
    along k in ``spec.k_pieces``' form: the first piece of each at least ``least`` long,
    every later one at least ``later`` (default ``LATER_PIECE_K``), a short tail joined to
    the piece before. On a GPU the panels of piece g + 1 are copied while piece g's GEMM
    runs: one piece for the whole k would copy both whole panels before the only GEMM,
    and a short first piece lets the first GEMM start early. Deterministic: the cuts and
    the summation order follow the chunks alone.

    Examples
    --------
    >>> device_pieces([(((0, 0, 8192), (1, 0, 8192)), ((0, 0, 6000), (1, 0, 10384)))])
    [(((0, 0, 6000),), ((0, 0, 6000),)), (((0, 6000, 8192), (1, 0, 8192)), ((1, 0, 10384),))]
    >>> [len(a) for a, b in device_pieces([(tuple((i, 0, 8192) for i in range(4)),) * 2],
    ...                                   later=16384)]
    [1, 3]
    """
    later = LATER_PIECE_K if later is None else later
    out = []
    for a_k, b_k in k_pieces:
        a_off = np.cumsum([0] + [k1 - k0 for _, k0, k1 in a_k]).tolist()
        b_off = np.cumsum([0] + [k1 - k0 for _, k0, k1 in b_k]).tolist()
        total = a_off[-1]
        cuts = [0]
        for e in sorted(set(a_off[1:-1]) | set(b_off[1:-1])):
            shortest = least if len(cuts) == 1 else later  # this piece, and what is left
            if e - cuts[-1] >= shortest and total - e >= shortest:
                cuts.append(e)
        cuts.append(total)
        out += [(tuple(Chunked._overlap(a_k, a_off, lo, hi)),
                 tuple(Chunked._overlap(b_k, b_off, lo, hi)))
                for lo, hi in zip(cuts[:-1], cuts[1:])]
    return out


def _assemble(blocks: dict, lead: tuple, row_pieces, col_pieces, mapped: dict):
    import cupy

    at = (row_pieces[0][0], col_pieces[0][0])
    first = blocks[at]
    if len(row_pieces) == 1 and len(col_pieces) == 1 and not isinstance(first, Offer):
        if isinstance(first, NcclOffer):  # its received copy, after the receive
            return panel({at: take(first)}, lead, row_pieces, col_pieces)
        return panel(blocks, lead, row_pieces, col_pieces)
    rows = sum(r1 - r0 for _, r0, r1 in row_pieces)
    cols = sum(c1 - c0 for _, c0, c1 in col_pieces)
    out = cupy.empty((rows, cols), dtype_of(first))
    r = 0
    for rb, r0, r1 in row_pieces:
        c = 0
        for cb, c0, c1 in col_pieces:
            take_into(blocks[(rb, cb)], out[r:r + r1 - r0, c:c + c1 - c0], lead, r0, c0, mapped)
            c += c1 - c0
        r += r1 - r0
    return out


def cut(block, r0: int, r1: int, c0: int, c1: int, *anchors):
    """One output chunk of a block-mode block: ``block[r0:r1, c0:c1]``.
    ``anchors``: the receipts of the exports the block's tasks pulled, read only
    so that their keys (and the exports) live until the block is made."""
    return block[r0:r1, c0:c1]
