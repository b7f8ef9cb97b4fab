"""Device chunks between GPU workers of different hosts: NCCL, as the MPI engine's panels go.

Workers of one host started as different emulated nodes (``distmm.emulate``) count as
workers of different hosts (``transfer.link_of``); their NCCL traffic takes the network
transport their node's environment names (sockets on loopback).

This module covers: which ``(holder, reader)`` pairs of GPU workers receive each other's
device chunks through NCCL (``pairs``: in ``auto`` mode, GPU workers whose links differ and
whose devices differ), the worker plugin that installs the holder's handler
(``SendHandler``, ``ensure_handler``), the one-time set-up of one two-rank NCCL communicator per such
directed pair on the workers (``connect``, cached per scheduler address and pair set; a
pair whose set-up fails goes over TCP), on the holder the handler a reader asks to send
(``HANDLER``, ``serve_send``) and the sender thread per pair
that issues the sends, and in the reader's block task ``receive``: the receives of the
offers it was handed, each into a new device buffer, ordered on the device before the
copies that read it (``transfer.take``).
It does *not* cover: the offers (``transfer.NcclOffer``, made by ``transfer.export_chunks``
on the holder and published for ``pull``), which chunk goes by which route
(``distmm.plan_blocks``), or the graph (``lazy``).

Why
---
Between hosts a device chunk read as an ordinary task dependency crosses distributed's
TCP comms through host copies, and the block task starts only once every such chunk has
arrived: 4 GPUs as 2 emulated nodes took 4.88 s at fp32 32768 against 0.33 s for a quarter
of one GPU's in-core product (``bench/NOTES.md``, the Dask engine across emulated nodes).
Through NCCL the bytes go device to device on the network transport, and the block task
starts beside them: its first k piece's GEMMs run while the later pieces' chunks arrive.

Order
-----
NCCL pairs a send with the receive of the same rank pair in the order each side issued
them. A reader asks a holder to send a list of offers and, once the holder has queued them
(its reply), posts the receives in the same order, holding the pair's lock across both: two
tasks of one reader never interleave their lists, and the holder's one sender thread per
pair issues each list in order. A reader whose holder cannot be asked does not post its
receives; ``transfer.take`` then fetches those chunks as host bytes from the holder
(``transfer.host_copy``).
"""
from __future__ import annotations

import logging
import queue
import threading

from distmm.engine.dask.scheduler import scheduler_address

__all__ = ["HANDLER", "CONNECT_TIMEOUT", "candidate_pairs", "pairs", "connect", "serve_send",
           "receive", "ensure_handler", "SendHandler", "links", "forget"]

log = logging.getLogger("distmm.engine.dask")

#: the holder's handler (``worker.handlers``) a reader asks to send
HANDLER = "distmm_nccl_send"
#: seconds the workers' communicator set-up may take before the pairs go over TCP
CONNECT_TIMEOUT = 60.0

_UINT8 = 1  # ncclUint8 (cupy.cuda.nccl.NCCL_UINT8), without importing cupy here


class _Link:
    """One directed pair's communicator on one of its two workers (``rank`` 0: the
    holder, which sends; 1: the reader, which receives), its ``tag`` (the set-up's id, so
    both ends can tell they share it), the reader's ``lock`` and the stream each end uses."""

    def __init__(self, tag, comm, rank: int):
        self.tag, self.comm, self.rank = tag, comm, rank
        self.lock = threading.Lock()
        self.stream = None
        self.queue: queue.SimpleQueue | None = None
        self.thread: threading.Thread | None = None

    def on_stream(self):
        if self.stream is None:
            from distmm.executor.streams import urgent_stream

            self.stream = urgent_stream()
        return self.stream


_LINKS: dict = {}  # (holder, reader) -> _Link, on the workers
_LINKS_LOCK = threading.Lock()
_CONNECTED: dict = {}  # (scheduler address, pairs) -> (working pairs, info), in the client
_CONNECTED_LOCK = threading.Lock()


def links() -> dict:
    """``{(holder, reader): rank}`` of the communicators this worker holds."""
    with _LINKS_LOCK:
        return {pair: link.rank for pair, link in _LINKS.items()}


def forget() -> None:
    """Drop the client's record of the pairs set up (every cluster's)."""
    with _CONNECTED_LOCK:
        _CONNECTED.clear()


# -- in the client ----------------------------------------------------------------------------

def candidate_pairs(units) -> frozenset:
    """``(holder, reader)`` address pairs of GPU workers whose probe found a device, on
    different links (hosts, or emulated nodes: ``transfer.link_of``), not on one device of
    one host (NCCL refuses two ranks of one communicator on one GPU).

    Examples
    --------
    >>> from distmm.plan_blocks import WorkerInfo
    >>> w = [WorkerInfo(f"tcp://10.0.0.1:{p}", 1, True, f"bus{p}", 1.0, True, node=p // 2)
    ...      for p in range(4)]
    >>> sorted((a[-1], b[-1]) for a, b in candidate_pairs(w))
    [('0', '2'), ('0', '3'), ('1', '2'), ('1', '3'), ('2', '0'), ('2', '1'), ('3', '0'), ('3', '1')]
    """
    from distmm.engine.dask.transfer import host_of, link_of

    gpus = sorted((u for u in units if u.gpu and u.cuda and u.device is not None),
                  key=lambda u: u.address)
    return frozenset((a.address, b.address) for a in gpus for b in gpus
                     if a.address != b.address and link_of(a) != link_of(b)
                     and (a.device, host_of(a.address)) != (b.device, host_of(b.address)))


def pairs(client, units, mode: str, device: bool) -> tuple[frozenset, dict]:
    """The ``(holder, reader)`` pairs whose device chunks go through NCCL, and a summary
    for ``last_stats()["transfer"]["nccl"]``: none unless ``mode`` is ``auto``, the chunks
    are device chunks and the export lifetime plugin runs (the readers pull their offers);
    else the candidates that ``connect`` set up."""
    from distmm.engine.dask import transfer

    cands = candidate_pairs(units) if device and mode == "auto" else frozenset()
    if not cands or not transfer.ensure_lifetime(client) or not ensure_handler(client):
        return frozenset(), {"pairs": 0}
    return connect(client, cands)


try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - distributed is a dependency
    _WorkerPlugin = object


class SendHandler(_WorkerPlugin):
    """Worker plugin: installs ``serve_send`` as the handler ``HANDLER`` readers ask."""

    name = "distmm-nccl-send"

    def setup(self, worker):
        self._worker = worker
        worker.handlers[HANDLER] = self._serve

    def _serve(self, refs=None, reader=None):
        return serve_send(refs, reader, self._worker)


_PLUGGED: set = set()  # scheduler addresses the plugin was registered with


def ensure_handler(client) -> bool:
    """Register ``SendHandler`` on the cluster once; False (with a log line) where that
    fails: the pairs then go over TCP."""
    address = scheduler_address(client)
    if address in _PLUGGED:
        return True
    try:
        client.register_plugin(SendHandler(), name=SendHandler.name)
    except Exception as exc:  # noqa: BLE001
        log.warning("distmm: the NCCL send handler could not be registered (%r)", exc)
        return False
    _PLUGGED.add(address)
    return True


def connect(client, wanted) -> tuple[frozenset, dict]:
    """Set up one communicator per pair of ``wanted`` on its two workers (those both
    already hold with one tag are kept). Returns the pairs that work and
    ``{"pairs", "cached", "failures"}``; a failure leaves its pair to TCP. Cached per
    scheduler address and pair set."""
    wanted = frozenset(wanted)
    key = (scheduler_address(client), wanted)
    with _CONNECTED_LOCK:
        hit = _CONNECTED.get(key)
    if hit is not None:
        return hit[0], dict(hit[1], cached=True)
    order = sorted(wanted)
    members = sorted({a for p in order for a in p})
    failures: dict = {}
    try:
        held = client.run(_held_tags, workers=members, on_error="return")
        tags = {a: h for a, h in held.items() if isinstance(h, dict)}
        failures.update({a: f"{type(h).__name__}: {h}" for a, h in held.items()
                         if not isinstance(h, dict)})
        ok = {p for p in order if p[0] in tags and p[1] in tags
              and tags[p[0]].get(p) is not None and tags[p[0]].get(p) == tags[p[1]].get(p)}
        todo = [p for p in order if p not in ok and p[0] in tags and p[1] in tags]
        if todo:
            made = client.run(_make_ids, todo, workers=sorted({h for h, _ in todo}),
                              on_error="return")
            ids = {}
            for a, got in made.items():
                if isinstance(got, dict):
                    ids.update(got)
                else:
                    failures[a] = f"{type(got).__name__}: {got}"
            todo = [p for p in todo if p in ids]
            items = [(p, ids[p]) for p in todo]
            joined = (client.run(_join, items, CONNECT_TIMEOUT,
                                 workers=sorted({a for p in todo for a in p}), on_error="return")
                      if items else {})
            for a, got in joined.items():
                if not isinstance(got, dict):
                    failures[a] = f"{type(got).__name__}: {got}"
            for p in todo:
                ends = [joined.get(p[0]), joined.get(p[1])]
                if all(isinstance(e, dict) and e.get(p) is True for e in ends):
                    ok.add(p)
                else:
                    failures[f"{p[0]} -> {p[1]}"] = next(
                        (e.get(p) for e in ends if isinstance(e, dict) and e.get(p) is not True),
                        "a worker did not answer")
    except Exception as exc:  # noqa: BLE001 -- a worker leaving mid-way: TCP this time
        log.debug("distmm: NCCL set-up failed: %r", exc)
        return frozenset(), {"pairs": 0, "cached": False, "failures": {"connect": repr(exc)}}
    if failures:
        log.warning("distmm: NCCL between some GPU workers of different hosts could not be "
                    "set up; their device chunks go over TCP: %s",
                    "; ".join(f"{k}: {v}" for k, v in sorted(failures.items())[:4]))
    out = (frozenset(ok), {"pairs": len(ok), "failures": failures})
    with _CONNECTED_LOCK:
        _CONNECTED[key] = out
    return out[0], dict(out[1], cached=False)


# -- on the workers: set-up -------------------------------------------------------------------

def _held_tags(dask_worker=None) -> dict:
    with _LINKS_LOCK:
        return {pair: link.tag for pair, link in _LINKS.items()}


def _make_ids(todo, dask_worker=None) -> dict:
    """On a holder: a NCCL unique id for each pair of ``todo`` it holds (its bootstrap
    listens in this process, rank 0 of the pair's communicator)."""
    from cupy.cuda import nccl

    me = dask_worker.address
    return {p: nccl.get_unique_id() for p in todo if p[0] == me}


def _init_all(items, me: str) -> dict:
    """Join the communicators of ``items`` (``(pair, id)``, one global order: every worker
    joins its pairs in it, so each blocking join meets its peer) that ``me`` is in."""
    from cupy.cuda import nccl

    out = {}
    for pair, uid in items:
        if me not in pair:
            continue
        rank = 0 if pair[0] == me else 1
        try:
            comm = nccl.NcclCommunicator(2, uid, rank)
        except Exception as exc:  # noqa: BLE001 -- reported to the client, the pair goes TCP
            out[pair] = f"{type(exc).__name__}: {exc}"
            continue
        link = _Link(hash(tuple(uid)), comm, rank)
        with _LINKS_LOCK:
            old = _LINKS.pop(pair, None)
            _LINKS[pair] = link
        if old is not None and old.queue is not None:
            old.queue.put(None)  # its sender thread ends
        out[pair] = True
    return out


async def _join(items, timeout: float, dask_worker=None) -> dict:
    """``_init_all`` on a thread of this worker (its event loop keeps answering), for at
    most ``timeout`` seconds."""
    import asyncio

    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(
        loop.run_in_executor(None, _init_all, items, dask_worker.address), timeout)


# -- on the holder ----------------------------------------------------------------------------

def serve_send(refs=None, reader=None, worker=None) -> dict:
    """The holder's handler: queue the sends of the published ``NcclOffer`` s ``refs``
    (``(export key, index)`` each, in the order the reader will receive them) to
    ``reader``. Returns ``{"queued": n}``, or ``{"error": why}`` with nothing queued."""
    from distmm.engine.dask import pull
    from distmm.engine.dask.transfer import NcclOffer

    me = getattr(worker, "address", None)
    with _LINKS_LOCK:
        link = _LINKS.get((me, reader))
    if link is None or link.rank != 0:
        return {"error": f"no NCCL communicator from {me} to {reader}"}
    offers = []
    for key, index in refs or ():
        offer = pull.offer(key, index)
        if not isinstance(offer, NcclOffer) or offer.array is None:
            return {"error": f"export {key!r}[{index}] is not published here as an NCCL offer"}
        offers.append(offer)
    with _LINKS_LOCK:
        if link.thread is None:
            link.queue = queue.SimpleQueue()
            link.thread = threading.Thread(target=_send_loop, args=(link,), daemon=True,
                                           name=f"distmm-nccl-send-{reader}")
            link.thread.start()
    link.queue.put(offers)
    return {"queued": len(offers)}


def _send_loop(link: _Link) -> None:
    """A holder's sender thread for one pair: each list of offers sent in order on the
    pair's stream (after the work that made each chunk); the chunks are kept until their
    sends have run."""
    stream = link.on_stream()
    while True:
        offers = link.queue.get()
        if offers is None:
            return
        try:
            for offer in offers:
                if offer.ready is not None:
                    stream.wait_event(offer.ready)
                if offer.nbytes:
                    link.comm.send(offer.array.data.ptr, offer.nbytes, _UINT8, 1, stream.ptr)
            stream.synchronize()  # the chunks may be freed once their sends have run
        except Exception as exc:  # noqa: BLE001 -- the reader's wait names the holder
            log.error("distmm: sending %d chunk(s) through NCCL failed: %r", len(offers), exc)
        del offers


# -- in the reader's block task ---------------------------------------------------------------

def receive(offers) -> int:
    """In a block task: post the receives of ``offers`` (``NcclOffer`` s not yet received,
    in the order the task will read them), each holder's after asking it to send them.
    Returns the bytes posted; offers of a holder without a communicator to this worker, or
    that could not be asked, are left for ``transfer.take``'s fallback."""
    from distributed import get_worker
    from distributed.utils import sync

    import cupy

    from distmm.engine.dask.transfer import record_route

    worker = get_worker()
    me = worker.address
    by_holder: dict = {}
    seen: set = set()
    for x in offers:
        if x._opened is None and id(x) not in seen and x.ref is not None:
            seen.add(id(x))
            by_holder.setdefault(x.address, []).append(x)
    posted = 0
    current = cupy.cuda.get_current_stream()
    for holder, group in sorted(by_holder.items()):
        with _LINKS_LOCK:
            link = _LINKS.get((holder, me))
        if link is None or link.rank != 1:
            continue
        with link.lock:
            stream = link.on_stream()
            try:  # every buffer before the holder is asked: a send queued must be received
                with stream:
                    bufs = [cupy.empty(x.shape, x.dtype) for x in group]
            except cupy.cuda.memory.OutOfMemoryError as exc:
                log.warning("distmm: no device memory to receive %d chunk(s) from %s through "
                            "NCCL (%s); fetching them as host bytes", len(group), holder, exc)
                continue
            try:
                reply = sync(worker.loop, _ask_send, worker, holder,
                             [list(x.ref) for x in group], me)
            except Exception as exc:  # noqa: BLE001 -- the fallback fetches them
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in reply:
                log.warning("distmm: holder %s did not send %d chunk(s) through NCCL (%s); "
                            "fetching them as host bytes", holder, len(group), reply["error"])
                continue
            # the buffers may reuse memory this worker's earlier copies and GEMMs still read
            stream.wait_event(current.record())
            for x, buf in zip(group, bufs):
                if x.nbytes:
                    link.comm.recv(buf.data.ptr, x.nbytes, _UINT8, 0, stream.ptr)
                x.received(buf, stream.record())
                posted += x.nbytes
        record_route("nccl", sum(x.nbytes for x in group))
    return posted


async def _ask_send(worker, holder: str, refs, me: str) -> dict:
    return await worker.rpc(holder).distmm_nccl_send(refs=refs, reader=me)
