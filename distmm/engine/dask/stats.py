"""What a Dask product did and moved: the plan's estimate and the cluster's log.

This module covers: the record of the last product this process ran with the
Dask engine (``last_stats``: its layout, tasks, cells moved to CPU workers and
the bytes the plan expects to move, by route), the estimate of those bytes
for scattered operands (``estimate_eager``; dask operands': the block plan's,
``distmm.plan_blocks.BlockPlan.estimated_bytes``), and ``transfer_report``, which
reads what ``distributed`` itself logged (each worker's
``transfer_incoming_log``: fetches from other workers; ``transfer_outgoing_log``:
data served to workers and to clients), so that a benchmark can put the
estimate next to the measurement. ``transfer_mark`` notes where each
worker's logs stand, so that a report counts exactly what came after it.
It does *not* cover: running anything (``eager``, ``lazy``) or the layout
(``distmm.plan_blocks``).

Routes: ``scatter`` (client to workers, not in the transfer logs),
``worker_to_worker`` (the incoming logs' sum: TCP), ``ipc`` (device chunks
opened through CUDA IPC between GPU workers of one host: in no ``distributed``
log; the workers' own count, ``transfer.routes_since``), ``gather`` (workers
to the client; the outgoing logs hold it plus ``worker_to_worker``).
"""
from __future__ import annotations

import threading
import time

__all__ = ["last_stats", "record", "estimate_eager", "transfer_mark", "transfer_report"]

_LAST: dict = {}
_LOCK = threading.Lock()


def record(stats: dict) -> None:
    with _LOCK:
        _LAST.clear()
        _LAST.update(stats)


def last_stats() -> dict:
    """The last Dask product of this process: ``mode`` (``"tiles"`` or
    ``"blocks"``), ``tasks``, ``cells``, ``units`` (per unit: worker, GPU or
    not, share of C, its block), ``moved`` (cells rerun on CPU workers),
    ``estimated_bytes`` (block mode: by route, ``scatter`` for numpy operands,
    ``worker_to_worker`` (TCP), ``ipc`` (dask operands), ``gather``; tile mode: ``plan``, the plan's own
    ``bytes_moved``), in block mode ``locality`` (``assignment``: each busy
    unit's worker in layout order, ``grid``, ``estimated_bytes`` of that
    choice and ``naive_bytes`` of the units in address order on the default
    grid, both on ``route``; ``method``; ``colocated``: None, or which of
    "one unit per device" / "one unit per worker" was chosen and the bytes
    of each; ``routes``: the choice's chunk bytes by ``tcp`` and ``ipc``; with
    IPC pairs, every ``*bytes`` of ``locality`` is ``distmm.plan_blocks.cost``: IPC
    bytes at 1/256), for dask operands in block mode ``transfer`` (``mode``,
    ``device_chunks``, the IPC ``pairs`` ``(holder, reader)``, ``probe``: the
    one-time probe's summary, ``exports``: export tasks in the graph),
    ``started`` (``time.time()``) and ``seconds`` (numpy operands). Empty
    before the first product."""
    with _LOCK:
        return dict(_LAST)


def estimate_eager(a_sc, b_sc, a_need: dict, b_need: dict, addresses: list[str], layout,
                   c_bytes: int, acc_itemsize: int) -> dict:
    """Bytes a block-mode run of scattered operands moves, by route: every
    block scattered straight to each worker whose cells read it (no block is
    fetched from another worker), the partials of split cells moved to their
    reduction, C gathered."""
    from distmm.plan_blocks import partial_bytes

    scatter = 0
    for sc, need in ((a_sc, a_need), (b_sc, b_need)):
        for idx, units in need.items():
            r, c = idx[-2], idx[-1]
            nbytes = ((sc.row_edges[r + 1] - sc.row_edges[r]) * (sc.col_edges[c + 1] - sc.col_edges[c])
                      * sc.array.dtype.itemsize)
            scatter += nbytes * len({addresses[u % len(addresses)] for u in units})
    return {"scatter": scatter, "worker_to_worker": partial_bytes(layout, addresses, acc_itemsize),
            "gather": c_bytes}


def _key_name(key) -> str:
    return str(key[0] if isinstance(key, tuple) and key else key)


def _entry_mark(log):
    # the last entry, known by its identity and its own fields (an id alone can be reused
    # once the entry has left the bounded log)
    if not log:
        return None
    e = log[-1]
    return (id(e), e.get("start"), e.get("total"))


def _marks(dask_worker):
    from distmm.engine.dask.transfer import routes_mark

    return {"incoming": _entry_mark(dask_worker.transfer_incoming_log),
            "outgoing": _entry_mark(dask_worker.transfer_outgoing_log),
            "routes": routes_mark()}


def _after(log, mark):
    items = list(log)
    if mark is None:
        return items
    for i in range(len(items) - 1, -1, -1):
        e = items[i]
        if (id(e), e.get("start"), e.get("total")) == mark:
            return items[i + 1:]
    return items  # the marked entry has left the log: every entry kept came after it


def _logs(dask_worker, since, marks=None):
    mark = (marks or {}).get(dask_worker.address)
    # distributed stamps its transfer logs with the worker's time plus its estimate of the
    # scheduler's clock offset (``scheduler_delay``, from heartbeats: large under load),
    # which moved transfers made just before ``since`` after it; compare in the worker's time
    # (an estimate that moved between a transfer and now still misplaces it: a mark does not)
    delay = float(getattr(dask_worker, "scheduler_delay", 0) or 0)

    def entries(log, key):
        if mark is not None:
            return _after(log, mark[key])
        return [e for e in list(log) if since is None or e.get("start", 0) - delay >= since]

    def total(log, key):
        return sum(int(e.get("total", 0)) for e in entries(log, key))

    names: dict = {}
    for e in entries(dask_worker.transfer_incoming_log, "incoming"):
        for key, nbytes in (e.get("keys") or {}).items():
            names[_key_name(key)] = names.get(_key_name(key), 0) + int(nbytes or 0)
    from distmm.engine.dask.transfer import routes_since

    return {"incoming": total(dask_worker.transfer_incoming_log, "incoming"),
            "outgoing": total(dask_worker.transfer_outgoing_log, "outgoing"),
            "incoming_by_name": names,
            "device_routes": routes_since(since, after=mark["routes"] if mark else None)}


def transfer_mark(client) -> dict:
    """Where each worker's transfer logs stand now (its last entries and its
    route count), for ``transfer_report(client, since=mark)``."""
    per = client.run(_marks, on_error="return")
    return {"marks": {w: v for w, v in per.items() if isinstance(v, dict)}}


def transfer_report(client, since: float | dict | None = None) -> dict:
    """Bytes the workers logged moving: per worker ``incoming`` (fetched from
    other workers) and ``outgoing`` (served to workers and clients), and
    ``worker_to_worker`` (the incoming sum); ``by_name``: the incoming bytes
    by key name (an operand's chunks under its dask name); ``device_routes``:
    what block tasks received of other workers' device chunks by route
    (``ipc``, ``local``, ``tcp``, ``fallback``: ``distmm.engine.dask.transfer``),
    IPC bytes being in no ``distributed`` log. ``since``: a ``transfer_mark``
    taken before the work (exact: only what each worker logged after it), or a
    ``time.time()`` (e.g. ``last_stats()["started"]``: only transfers starting at
    or after it, as far as the workers' stamps, which carry an estimated clock
    offset, can tell); the logs are bounded deques
    (``distributed.admin.low-level-log-length``)."""
    if isinstance(since, dict):
        per = client.run(_logs, since=None, marks=since["marks"], on_error="return")
    else:
        per = client.run(_logs, since=since, on_error="return")
    per = {w: v for w, v in per.items() if isinstance(v, dict)}
    by_name: dict = {}
    routes: dict = {}
    for v in per.values():
        for name, nbytes in v["incoming_by_name"].items():
            by_name[name] = by_name.get(name, 0) + nbytes
        for route, nbytes in v["device_routes"].items():
            routes[route] = routes.get(route, 0) + nbytes
    return {"workers": per,
            "worker_to_worker": sum(v["incoming"] for v in per.values()),
            "outgoing": sum(v["outgoing"] for v in per.values()),
            "by_name": by_name, "device_routes": routes,
            "measured_at": time.time()}
