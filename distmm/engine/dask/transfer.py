"""Device chunks between GPU workers of one host: CUDA IPC in block mode (between hosts:
``nccl_route``, else TCP).

Workers of one host started as different emulated nodes (``distmm.emulate``) count as
workers of different hosts here (``link_of``): CUDA IPC only inside an emulated node.

This module covers: whether a block-mode product moves device (cupy) chunks
between GPU workers through CUDA IPC (``distmm.dask-device-transfer``:
``auto``, ``ipc`` or ``tcp``; ``ipc_pairs``), the one-time probe per cluster
that says between which workers IPC works (``probe``, cached per scheduler
address and worker set), the export tasks' bodies (``export_chunk``: on the
worker holding a chunk, an ``Offer`` wrapping ``distmm.executor.ipc.export``;
``export_chunks``: the offers one reader needs from that worker, published for
``pull``; for a reader on another host, ``NcclOffer`` s that ``nccl_route`` sends),
opening an offer inside a block task (``take``) with its fallbacks, and the
bytes each worker received by each route (``routes_since``, read by
``stats.transfer_report``), and the exports' lifetime (``ExportLifetime``, a
worker plugin: an export is held until the scheduler releases its task's key).
It does *not* cover: CUDA itself (``distmm.executor.ipc``), the cost model
and which holder serves which reader (``distmm.plan_blocks``: ``by_route``,
``ipc_sources``), or the graph (``lazy``: the export tasks, pinned to their
holder with ``allow_other_workers=False``).

Routes a reader records (``routes_since``): ``ipc`` (opened from another
process through CUDA IPC: one device copy), ``local`` (the block task ran in
the exporting process itself: no copy, no bytes moved), ``tcp`` (the export
failed on the holder, e.g. a numpy chunk or a full device: the offer carried
the chunk itself, through distributed's TCP transfer, which its
``transfer_incoming_log`` also counts), ``nccl`` (received from a holder on another
host through NCCL) and ``fallback`` (opening or receiving failed on the
reader, e.g. the task moved to another host: the chunk fetched from the
holder's live export as host bytes through ``client.run``).

Failures never give a wrong result: an export that fails ships the chunk; an
open that fails fetches the exported bytes the slow way, and only if that
fails too does the task raise (``IPCError``, naming both).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from distmm.engine.dask.background import BackgroundSlot
from distmm.engine.dask.pull import norm_key
from distmm.engine.dask.scheduler import scheduler_address

__all__ = ["MODES", "DEVICE_CHUNKS_KEY", "Offer", "NcclOffer", "export_chunk", "export_chunks",
           "take", "take_into", "dtype_of", "record_route", "host_copy", "host_of", "link_of",
           "device_chunks", "candidate_pairs", "ipc_pairs", "probe", "forget_probes",
           "routes_since", "ExportLifetime", "ensure_lifetime", "keep_until_released",
           "held_keys", "orphans"]

log = logging.getLogger("distmm.engine.dask")

MODES = ("auto", "ipc", "tcp")

#: debug configuration (outside the checked ``distmm`` section): treat the
#: operands' chunks as device chunks whatever their meta says, so that the
#: export tasks can be built (and their fallbacks run) on a cluster without GPUs
DEVICE_CHUNKS_KEY = "distmm-debug.device-chunks"

_ROUTES: deque = deque(maxlen=100_000)  # (time.time(), route, nbytes) on this worker
_RECORDED = 0  # receipts recorded in all (the deque keeps the last 100,000)
_ROUTES_LOCK = threading.Lock()
_STATE_LOCK = threading.Lock()  # the held export keys; never held across I/O: the worker's
                                # event loop takes it in ExportLifetime.transition
_PROBED: dict = {}  # (scheduler address, worker set) -> (pairs, info)
_PROBE_LOCK = threading.Lock()
_WARNED: set = set()


def host_of(address: str) -> str:
    """The host part of a worker address (``tcp://10.0.0.1:4000`` -> ``10.0.0.1``;
    ``tcp://[::1]:4000`` -> ``::1``)."""
    rest = str(address).split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1:rest.index("]")] if "]" in rest else rest[1:]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def device_chunks(*arrays) -> bool:
    """Whether the dask arrays' chunks are device (cupy) arrays, by their meta
    (``DEVICE_CHUNKS_KEY`` set: always)."""
    import dask.config

    if dask.config.get(DEVICE_CHUNKS_KEY, False):
        return True
    for x in arrays:
        meta = getattr(x, "_meta", None)
        if meta is None or not (type(meta).__module__ or "").startswith("cupy"):
            return False
    return bool(arrays)


def link_of(unit) -> tuple:
    """Where a worker's links reach: its host and its emulated node (``node``, None
    where none). Workers of one host but different emulated nodes are taken for
    workers of different hosts: their device chunks go through NCCL (``nccl_route``) or
    TCP, never CUDA IPC."""
    return host_of(unit.address), getattr(unit, "node", None)


def candidate_pairs(units) -> frozenset:
    """``(holder, reader)`` address pairs of distinct GPU workers on one host and in
    one emulated node (``link_of``).

    Examples
    --------
    >>> from distmm.plan_blocks import WorkerInfo
    >>> w = [WorkerInfo(f"tcp://10.0.0.1:{p}", 1, True, str(p), 1.0, True, node=p // 2)
    ...      for p in range(4)]
    >>> pairs = candidate_pairs(w)
    >>> len(pairs), all(int(a[-1]) // 2 == int(b[-1]) // 2 for a, b in pairs)
    (4, True)
    """
    links = {u.address: link_of(u) for u in units if u.gpu}
    gpus = sorted(links)
    return frozenset((a, b) for a in gpus for b in gpus if a != b and links[a] == links[b])


def forget_probes() -> None:
    """Drop the cached probe results (every cluster's)."""
    with _PROBE_LOCK:
        _PROBED.clear()


def _probe_open(shareds, dask_worker=None):
    from distmm.executor import ipc

    me = getattr(dask_worker, "address", None)
    return ipc.probe_open({a: s for a, s in shareds.items()
                           if a != me and (me is None or host_of(a) == host_of(me))})


_RELEASING = BackgroundSlot()  # the last probe's exports being freed on the workers


def _release_later(client, addresses, tokens) -> None:
    """Free a probe's exports (``tokens``) on ``addresses`` from a thread of its own: the
    product that probed does not wait for that round trip (``settle_probes`` does)."""

    from distmm.executor import ipc

    def run():
        try:
            client.run(ipc.probe_release, list(tokens), workers=list(addresses),
                       on_error="return")
        except Exception as exc:  # a closing client or a worker gone: nothing left to free
            log.debug("distmm: freeing the IPC probe's exports failed: %r", exc)

    _RELEASING.start(run, name="distmm-ipc-probe-release")


def settle_probes(timeout: float | None = None) -> None:
    """Wait for the last probe's exports to be freed (``probe``)."""
    _RELEASING.settle(timeout)


def probe(client, addresses) -> tuple[frozenset, dict]:
    """Between which of ``addresses`` (GPU workers) CUDA IPC works: each
    exports a small array of known values, every other worker of its host
    opens and checks it, then the exports are freed (in the background:
    ``_release_later``). Returns the working ``(holder, reader)`` pairs and what
    was found (``cached``, ``pairs``, ``failures``: reader -> holder -> error, or
    why no probe could run). Cached per scheduler address and worker set."""
    from distmm.executor import ipc

    addresses = sorted(set(addresses))
    key = (scheduler_address(client), frozenset(addresses))
    with _PROBE_LOCK:
        hit = _PROBED.get(key)
    if hit is not None:
        return hit[0], dict(hit[1], cached=True)
    pairs, failures, good = set(), {}, {}
    try:
        try:
            made = client.run(ipc.probe_export, workers=addresses, on_error="return")
            good = {a: s for a, s in made.items() if isinstance(s, ipc.Shared)}
            failures.update({a: {"export": f"{type(e).__name__}: {e}"}
                             for a, e in made.items() if a not in good})
            opened = (client.run(_probe_open, good, workers=sorted(good), on_error="return")
                      if len(good) > 1 else {})
        finally:
            if good:
                _release_later(client, sorted(good), [s.token for s in good.values()])
    except Exception as exc:  # a worker leaving mid-probe: TCP this time, probe again next
        log.debug("distmm: IPC probe failed: %r", exc)
        return frozenset(), {"cached": False, "pairs": 0, "failures": {"probe": repr(exc)}}
    for reader, res in opened.items():
        if not isinstance(res, dict):
            failures[reader] = {"open": f"{type(res).__name__}: {res}"}
            continue
        for holder, ok in res.items():
            if ok is True:
                pairs.add((holder, reader))
            else:
                failures.setdefault(reader, {})[holder] = ok
    out = (frozenset(pairs), {"pairs": len(pairs), "failures": failures})
    with _PROBE_LOCK:
        _PROBED[key] = out
    return out[0], dict(out[1], cached=False)


def ipc_pairs(client, units, mode: str, device: bool) -> tuple[frozenset, dict]:
    """The ``(holder, reader)`` pairs whose device chunks go through CUDA IPC,
    and a summary for ``last_stats()["transfer"]``.

    ``tcp``, host chunks (``device`` False) or no two GPU workers on one host:
    none. ``ipc``: every pair of GPU workers on one host (a pair whose IPC
    then fails falls back per chunk, see ``take``). ``auto``: the pairs among
    those that ``probe`` found working, probing GPU workers whose worker
    probe found a device.
    """
    if mode not in MODES:
        raise ValueError(f"distmm.dask-device-transfer must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    info = {"mode": mode, "device_chunks": bool(device), "probe": None}
    cands = candidate_pairs(units) if device and mode != "tcp" else frozenset()
    if not cands:
        return frozenset(), dict(info, pairs=[])
    if mode == "ipc":
        ensure_lifetime(client)
        return cands, dict(info, pairs=sorted(cands))
    seen = sorted({u.address for u in units
                   if u.gpu and getattr(u, "device", None) is not None
                   and any(u.address in p for p in cands)})
    found, summary = probe(client, seen) if len(seen) > 1 else (frozenset(), {"pairs": 0})
    pairs = found & cands
    if pairs:
        ensure_lifetime(client)
    return pairs, dict(info, pairs=sorted(pairs), probe=summary)


# -- on the workers ------------------------------------------------------------------------

def record_route(route: str, nbytes: int) -> None:
    """Count ``nbytes`` received on this worker by ``route`` (``routes_since``)."""
    global _RECORDED
    with _ROUTES_LOCK:
        _ROUTES.append((time.time(), route, int(nbytes)))
        _RECORDED += 1


def routes_mark() -> int:
    """How many receipts this process has recorded so far (``routes_since(after=)``)."""
    return _RECORDED


def routes_since(since: float | None = None, after: int | None = None) -> dict:
    """Bytes this process received by each route (module docstring) since
    ``since`` (``time.time()``; None: all kept), or after the receipt count
    ``after`` (``routes_mark``)."""
    out = {"ipc": 0, "local": 0, "tcp": 0, "fallback": 0, "nccl": 0}
    with _ROUTES_LOCK:
        kept, recorded = list(_ROUTES), _RECORDED
    if after is not None:
        kept = kept[len(kept) - min(len(kept), recorded - after):]
    for t, route, nbytes in kept:
        if after is not None or since is None or t >= since:
            out[route] = out.get(route, 0) + nbytes
    return out


def _worker_address() -> str | None:
    try:
        from distributed import get_worker

        return get_worker().address
    except Exception:
        return None


class Offer:
    """An export task's result: a chunk offered to readers on other workers.

    ``shared``: the ``distmm.executor.ipc.Shared`` of its exported copy (None
    when the export failed: ``data`` then holds the chunk itself, which
    travels with the offer), ``address`` of the holder, ``label`` (the chunk's
    key, for messages), ``nbytes``, ``reason`` (why the export failed). A
    reader opens it once per process (``take``); the copy is kept on the
    offer, as a fetched dependency is kept by the worker, for the reader's
    other tasks.
    """

    __slots__ = ("shared", "data", "address", "label", "nbytes", "reason", "_opened", "_lock")

    def __init__(self, shared, data, address, label, nbytes, reason=None):
        self.shared, self.data, self.address = shared, data, address
        self.label, self.nbytes, self.reason = label, int(nbytes), reason
        self._opened = None
        self._lock = threading.Lock()

    def __reduce__(self):
        return (Offer, (self.shared, self.data, self.address, self.label, self.nbytes,
                        self.reason))

    def __sizeof__(self) -> int:
        return 512 + (int(getattr(self.data, "nbytes", 0)) if self.data is not None else 0)

    def __repr__(self):
        how = "IPC" if self.shared is not None else f"inline ({self.reason})"
        return f"Offer({self.label}, {self.nbytes} bytes, {how}, from {self.address})"


class NcclOffer:
    """An export task's offer of a device chunk to a reader on another host, which receives
    it through NCCL (``distmm.engine.dask.nccl_route``): ``address`` of the holder,
    ``label``, ``nbytes``, ``shape`` and ``dtype``. On the holder it keeps the chunk (C
    order) and an event after the work that made it (``array``, ``ready``); in the reader,
    once received, the chunk's copy on this device and the event after its receive
    (``_opened``, ``_event``). Pickled (the holder's reply to a reader) it carries neither."""

    __slots__ = ("address", "label", "nbytes", "shape", "dtype", "ref", "array", "ready",
                 "_opened", "_event")

    def __init__(self, address, label, nbytes, shape, dtype, ref=None, array=None,
                 ready=None):
        self.address, self.label, self.nbytes = address, label, int(nbytes)
        self.shape, self.dtype, self.ref = tuple(shape), np.dtype(dtype), ref
        self.array, self.ready = array, ready
        self._opened = self._event = None

    @classmethod
    def of(cls, chunk, label: str, address):
        """On the holder: the offer of ``chunk`` (a C-order copy where it is not one)."""
        import cupy

        arr = cupy.ascontiguousarray(chunk)
        return cls(address, label, arr.nbytes, arr.shape, arr.dtype, None, arr,
                   cupy.cuda.get_current_stream().record())

    def __reduce__(self):
        return (NcclOffer, (self.address, self.label, self.nbytes, self.shape, self.dtype,
                            self.ref))

    def __sizeof__(self) -> int:
        return 256

    def received(self, arr, event) -> None:
        """In the reader: ``arr`` will hold the chunk once ``event`` has passed."""
        self._opened, self._event = arr, event

    def __repr__(self):
        return f"NcclOffer({self.label}, {self.nbytes} bytes, from {self.address})"


def _offer_of(chunk, label: str, address):
    """``(offer, shared)``: the chunk's CUDA IPC export, or (shared None) the chunk itself."""
    from distmm.executor import ipc

    nbytes = int(getattr(chunk, "nbytes", 0))
    try:
        shared = ipc.export(chunk)
    except ipc.IPCError as exc:
        kind = type(chunk).__module__
        if kind not in _WARNED:
            _WARNED.add(kind)
            log.warning("distmm: chunk %s not exported through CUDA IPC (%s); such chunks "
                        "travel over TCP", label, exc)
        return Offer(None, chunk, address, label, nbytes, str(exc)), None
    return Offer(shared, None, address, label, nbytes), shared


def export_chunk(chunk, label: str = ""):
    """Task body, on the worker holding ``chunk``: an ``Offer`` of it (its
    CUDA IPC export, or, when exporting fails, the chunk itself). Where the
    ``ExportLifetime`` plugin runs on this worker, the export is held until
    the scheduler releases this task's key (``keep_until_released``)."""
    from distmm.executor import ipc

    offer, shared = _offer_of(chunk, label, _worker_address())
    if shared is not None:
        keep_until_released(shared, ipc.hold)
    return offer


def export_chunks(chunks, labels, route: str = "ipc"):
    """Task body, on the worker holding ``chunks`` (the ones one reader needs from it),
    where readers pull their offers (``distmm.engine.dask.pull``): each chunk's
    ``Offer``, published together under this task's key for the plugin's handler
    (offer ``i`` is ``Pull(key, holder, index=i)``) and held until the scheduler
    releases the key. Returns a small ``pull.Receipt``: an offer that carries a chunk
    (a failed export) would otherwise cross TCP again to every task depending on the
    key. One task for all: every task carries the worker's own per-task overhead, paid
    in sequence on the holder's thread, so one export task per chunk would delay the
    moment a reader has them all (``bench/NOTES.md``: one export task per holder and
    reader). Without the plugin (or outside a task) the offers themselves are
    returned, as a tuple. ``route`` ``"nccl"``: the reader is on another host and
    receives the chunks through NCCL (``NcclOffer``; nothing is exported through IPC)."""
    from distmm.engine.dask import pull
    from distmm.executor import ipc

    address = _worker_address()
    if route == "nccl":
        made = [(NcclOffer.of(chunk, label, address), None)
                for chunk, label in zip(chunks, labels)]
    else:
        made = [_offer_of(chunk, label, address) for chunk, label in zip(chunks, labels)]
    offers = tuple(offer for offer, _ in made)
    key = _current_key() if _LIFETIME else None
    if key is None:
        return offers
    for j, offer in enumerate(offers):
        if isinstance(offer, NcclOffer):
            offer.ref = (norm_key(key), j)  # what the reader asks the holder to send
    shareds = [shared for _, shared in made if shared is not None]

    published = []

    def release(_token, key=key, shareds=shareds):
        pull.withdraw(key, published[0] if published else None)
        for shared in shareds:
            ipc.release(shared.token)

    for shared in shareds:
        ipc.hold(shared)
    published.append(pull.publish(key, offers))
    with _STATE_LOCK:
        _KEY_TOKENS[key] = (repr(key), release)
    return pull.Receipt(", ".join(labels), address)


# -- the exports' lifetime: until the scheduler releases their keys ----------------------------

_KEY_TOKENS: dict = {}  # export task key -> (token, release) on this worker, while held
_LIFETIME: list = []    # [True] once the plugin is set up in this worker process


def _current_key():
    try:
        from distributed import get_worker

        return get_worker().get_current_task()
    except Exception:  # not in a task on a worker
        return None


def keep_until_released(shared, hold, release=None) -> bool:
    """In a task on a worker where ``ExportLifetime`` runs: ``hold(shared)`` now
    and ``release(shared.token)`` (default ``distmm.executor.ipc.release``) when
    the scheduler releases the running task's key. False (nothing held) where
    the plugin does not run: the export then lives as long as its ``Shared``."""
    if not _LIFETIME:
        return False
    key = _current_key()
    if key is None:
        return False
    if release is None:
        from distmm.executor.ipc import release
    hold(shared)
    with _STATE_LOCK:
        _KEY_TOKENS[key] = (shared.token, release)
    return True


def held_keys() -> int:
    """Export keys held on this worker (for tests and reports)."""
    with _STATE_LOCK:
        return len(_KEY_TOKENS)


try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - distributed is a dependency
    _WorkerPlugin = object


_ORPHANS: dict = {}  # export key -> (token, release): this worker's replica dropped, key alive
SWEEP_SECONDS = 1.0  # how often a worker asks the scheduler whether its orphans' keys are gone


def _replica_dropped(worker, key) -> bool:
    """Whether ``key`` is being released on ``worker`` because the scheduler dropped this
    worker's replica (``remove-replicas``: the Active Memory Manager keeps one copy of a key
    held by several workers), not because the key itself was released. The worker's log
    records that request before the transition it causes."""
    try:
        for entry in reversed(worker.state.log):
            if entry[0] == key:
                return entry[1] == "remove-replica"
    except Exception:  # noqa: BLE001 -- a log of another shape: the key was released
        return False
    return False


class ExportLifetime(_WorkerPlugin):
    """Worker plugin: an export task's allocation lives until the scheduler
    releases the task's key, even when the worker spilled the task's result to
    disk meanwhile (the result's pickled form carries no allocation): releasing it
    with the in-memory result would free exports that readers still open.

    A holder whose replica of the key is dropped while another worker (a reader that
    fetched the offer) still holds it keeps the allocation (an orphan) until the
    scheduler no longer knows the key anywhere: it asks every ``SWEEP_SECONDS``. Why:
    distributed's Active Memory Manager (``ReduceReplicas``) may drop a holder's replica
    of a key a reader has fetched; freeing the export then would make readers' opens and
    the holder's own tasks fail (``bench/NOTES.md``, export lifetime).

    It also installs ``pull.serve``, the handler from which block tasks fetch the
    offers published here (``export_chunks``)."""

    name = "distmm-ipc-exports"

    def setup(self, worker):
        from distmm.engine.dask import pull

        worker.handlers[pull.HANDLER] = self._serve_pull  # readers ask for their offers here
        if not _LIFETIME:
            _LIFETIME.append(True)
        self._worker = worker
        try:
            from tornado.ioloop import PeriodicCallback

            pc = PeriodicCallback(self._sweep, SWEEP_SECONDS * 1000)
            earlier = worker.periodic_callbacks.pop("distmm-ipc-orphans", None)
            if earlier is not None:  # the plugin registered again: one sweep is enough
                earlier.stop()
            worker.periodic_callbacks["distmm-ipc-orphans"] = pc
            pc.start()
        except Exception as exc:  # noqa: BLE001 -- orphans then wait for teardown
            log.warning("distmm: the IPC orphan sweep could not start (%r)", exc)

    async def _serve_pull(self, keys=None, wait: float = 0.0):
        """``pull.serve`` on this worker (which sees the export tasks that failed here)."""
        from distmm.engine.dask import pull

        return await pull.serve(keys, wait, getattr(self, "_worker", None))

    def teardown(self, worker):
        with _STATE_LOCK:
            entries = list(_ORPHANS.values())
            _ORPHANS.clear()
        for token, release in entries:
            release(token)

    def transition(self, key, start, finish, **kwargs):
        if finish in ("released", "forgotten", "error", "cancelled"):
            with _STATE_LOCK:
                entry = _KEY_TOKENS.pop(key, None)
            if entry is None:
                return
            if finish == "released" and _replica_dropped(getattr(self, "_worker", None), key):
                with _STATE_LOCK:
                    _ORPHANS[key] = entry
                return
            entry[1](entry[0])

    async def _sweep(self):
        with _STATE_LOCK:
            keys = list(_ORPHANS)
        if not keys:
            return
        try:
            who = await self._worker.scheduler.who_has(keys=keys)
        except Exception:  # noqa: BLE001 -- the scheduler away for now: ask again later
            return
        gone = {norm_key(k) for k, holders in (who or {}).items() if not holders}
        for key in keys:
            if norm_key(key) in gone:
                with _STATE_LOCK:
                    entry = _ORPHANS.pop(key, None)
                if entry is not None:
                    entry[1](entry[0])


def orphans() -> int:
    """Exports this worker holds for keys that live on only other workers now."""
    with _STATE_LOCK:
        return len(_ORPHANS)


_PLUGGED: set = set()  # scheduler addresses the plugin was registered with


def ensure_lifetime(client) -> bool:
    """Register ``ExportLifetime`` on the cluster once (workers that join later
    get it too). False, with a log line, where registering fails: the exports
    then live only as long as their results stay in memory."""
    if client is None:
        return False
    address = scheduler_address(client)
    if address in _PLUGGED:
        return True
    try:
        client.register_plugin(ExportLifetime(), name=ExportLifetime.name)
    except Exception as exc:
        log.warning("distmm: the IPC export lifetime plugin could not be registered (%r)", exc)
        return False
    _PLUGGED.add(address)
    return True


def _serve(token: str):
    """On the holder: the live export ``token`` as host bytes (the fallback route)."""
    from distmm.executor import ipc

    return ipc.local_array(token).get()


def _fetch(address: str, serve, arg, failed: str):
    """The host bytes ``serve(arg)`` returns on the holder ``address``, through
    ``client.run``, on this worker's device where cupy imports (the fallback of an IPC open
    that failed, and of an NCCL offer never received). ``IPCError`` where that fails too,
    beginning with ``failed`` (what failed first)."""
    from distmm.executor import ipc

    try:
        from distributed import worker_client

        with worker_client() as client:
            got = client.run(serve, arg, workers=[address], on_error="return")
        host = got.get(address)
        if not isinstance(host, np.ndarray):
            raise ipc.IPCError(f"the holder answered {host!r}")
    except Exception as exc:
        raise ipc.IPCError(f"{failed} and fetching it from the holder failed too "
                           f"({type(exc).__name__}: {exc})") from exc
    try:
        import cupy

        return cupy.asarray(host)
    except ImportError:  # a reader without cupy: the host copy (the CPU executor reads it)
        return host


def dtype_of(x):
    """The dtype of a chunk or of the chunk an ``Offer`` stands for."""
    if isinstance(x, Offer):
        return x.shared.dtype if x.shared is not None else x.data.dtype
    if isinstance(x, NcclOffer):
        return x.dtype
    return x.dtype


def take_into(x, dst, lead: tuple, r0: int, c0: int, mapped: dict) -> None:
    """In a block task on a GPU: rows ``r0:``, columns ``c0:`` (``dst``'s shape)
    of a chunk or an ``Offer`` (batch index ``lead``) copied into ``dst``, a
    2-D device view. Another process's CUDA IPC export is copied straight from
    its memory into ``dst`` (``ipc.copy_rect``: no whole-chunk copy first); its
    mapping is kept in ``mapped`` (token -> pointer), which the caller unmaps
    after synchronising. Anything else, or a mapping that fails, goes through
    ``take`` (and its fallback) and one copy kernel."""
    rows, cols = dst.shape
    if (isinstance(x, Offer) and x._opened is None and x.shared is not None
            and not x.shared.local and x.shared.handle is not None and len(x.shared.shape) == 2
            and not lead):
        from distmm.executor import ipc

        try:
            ptr = mapped.get(x.shared.token)
            if ptr is None:
                ptr = mapped[x.shared.token] = ipc.map_export(x.shared)
            record_route("ipc", ipc.copy_rect(ptr, x.shared, dst, r0, c0))
            return
        except ipc.IPCError as exc:
            log.warning("distmm: %r: mapping its CUDA IPC export failed (%s); opening it whole",
                        x, exc)
    dst[...] = take(x)[lead + (slice(r0, r0 + rows), slice(c0, c0 + cols))]


def take(x):
    """In a block task: a chunk as it is, or an ``Offer`` opened (once per
    process) into a chunk on this worker's device."""
    if isinstance(x, NcclOffer):
        return _received(x)
    if not isinstance(x, Offer):
        return x
    with x._lock:  # one open per offer and process; other offers open meanwhile
        if x._opened is not None:
            return x._opened
        if x.shared is None:
            arr, route, moved = x.data, "tcp", x.nbytes
        else:
            from distmm.executor import ipc

            if x.shared.local:
                arr, route, moved = ipc.open_copy(x.shared, copy=False), "local", 0
            else:
                try:
                    arr, route, moved = ipc.open_copy(x.shared), "ipc", x.nbytes
                except ipc.IPCError as exc:
                    log.warning("distmm: %r: CUDA IPC open failed (%s); fetching it from the "
                                "holder through the scheduler", x, exc)
                    arr = _fetch(x.address, _serve, x.shared.token,
                                 f"{x!r}: opening failed ({exc})")
                    route, moved = "fallback", x.nbytes
        record_route(route, moved)
        x._opened = arr
        return arr


def host_copy(ref, dask_worker=None):
    """On the holder: the published ``NcclOffer`` ``ref`` (``(export key, index)``) as host
    bytes (the fallback of a reader that did not receive it)."""
    from distmm.engine.dask import pull

    offer = pull.offer(*ref) if ref is not None else None
    if offer is None or getattr(offer, "array", None) is None:
        raise KeyError(f"no NCCL offer {ref!r} is published on this worker")
    return offer.array.get()


def _received(x: NcclOffer):
    """A received ``NcclOffer``'s chunk, the current stream ordered after its receive;
    one never received (a task that did not receive its offers) fetched as host bytes from
    the holder's registry (``host_copy``, ``_fetch``)."""
    if x._opened is None:
        got = _fetch(x.address, host_copy, x.ref, f"{x!r} was not received through NCCL")
        record_route("fallback", x.nbytes)
        x.received(got, None)
        return x._opened
    if x._event is not None:
        import cupy

        cupy.cuda.get_current_stream().wait_event(x._event)
    return x._opened
