"""Block tasks fetch their CUDA IPC offers straight from the holders, not through the scheduler.

This module covers: ``Pull`` (what a block task gets in place of an export
task's key: the key and the worker holding it), the holder's registry of the
offers its export tasks made (``publish``, ``withdraw``), the holder's handler
that hands them out (``serve``, installed on every worker by
``transfer.ExportLifetime`` under ``HANDLER``), ``Receipt`` (the small result an
export task returns instead of its offer) and, in the block task, ``resolve``:
one request per holder, all holders at once.
It does *not* cover: making the exports or their lifetime (``transfer``), or the
graph (``lazy``: the block task reads ``Pull`` arguments, and the output chunks
cut from its block depend on the export keys, so that each export lives until
the block that reads it has been made).

Why
---
With the export keys as the block task's dependencies, a block task started only
after each export task had reported to the scheduler, the scheduler had sent the
block task out, and the reader had fetched the offers: a whole scheduler round
between the last export's end and the block task's start, a measurable share of a
call (``bench/NOTES.md``, block tasks pull their offers). Here the block task starts
as soon as its own chunks are there, beside the export tasks, and asks the holders.

Exports before the GEMM
-----------------------
An export synchronises its worker's current stream before it hands out the
handle (the reader has no stream order with it), and a block task queues its
GEMM on that same stream. So a worker that ran its block task before its export
tasks made every reader of its exports wait for its whole GEMM, serialising the
workers' GEMMs (``bench/NOTES.md``, a block task lets its own worker's exports run
first). A block task therefore first lets the export tasks pinned to its own worker
run (``await_own``: seceding while they have not published), then asks for its
offers. Its own exports may also have run, been read and been released before it
starts (its other inputs came over TCP from another host or emulated node meanwhile):
an export that this worker no longer knows and that the scheduler has let go of, or
holds in memory, is not waited for (``ASK_AFTER``).

Deadlock
--------
A holder answers from its event loop and never needs a worker thread, but its
export tasks do. A block task that asked and did not get every offer within
``FIRST_WAIT`` seconds (the holder's thread busy, e.g. with its own block task
asking this worker) ``secede``\\ s, so that this worker's own export tasks can run,
asks again for up to ``LONG_WAIT`` seconds (a warning every ``PATIENCE`` seconds
names what it still waits for), and ``rejoin``\\ s. A holder that cannot be reached,
or never publishes, makes the block task raise ``IPCError`` naming it; an export task
that raised, or that finished and whose offers were withdrawn since, ends the wait at
once.
"""
from __future__ import annotations

import pickle
import threading
import time

__all__ = ["Pull", "Receipt", "HANDLER", "publish", "withdraw", "offer", "published", "serve",
           "resolve", "await_own", "norm_key"]

#: the worker handler's name (``worker.handlers``)
HANDLER = "distmm_pull"

#: seconds a block task waits for its offers before it secedes, and after
FIRST_WAIT = 0.25
LONG_WAIT = 600.0
#: seconds between the warnings of a block task still waiting for offers
PATIENCE = 30.0
#: seconds a block task waits for its own worker's exports before it asks the scheduler
#: about those this worker does not know (released before it started?), and between asks
ASK_AFTER = 2.0

_OFFERS: dict = {}  # export key (tuples, as the scheduler spells it) -> Offer, on the holder
_LOCK = threading.Lock()


def norm_key(key):
    """A task key as the worker spells it: the lists of a msgpack'd reply made tuples."""
    return tuple(norm_key(k) for k in key) if isinstance(key, (list, tuple)) else key


class Pull:
    """A block task's argument in place of offer ``index`` of export task ``key``,
    held by worker ``holder`` (its address); ``label`` names the chunk in messages."""

    __slots__ = ("key", "holder", "label", "index")

    def __init__(self, key, holder: str, label: str = "", index: int = 0):
        self.key, self.holder, self.label, self.index = norm_key(key), holder, label, int(index)

    def __reduce__(self):
        return (Pull, (self.key, self.holder, self.label, self.index))

    def __eq__(self, other):
        return isinstance(other, Pull) and (self.key, self.holder, self.index) == (
            other.key, other.holder, other.index)

    def __hash__(self):
        return hash((self.key, self.holder, self.index))

    def __repr__(self):
        return f"Pull({self.key!r}[{self.index}] from {self.holder}, {self.label})"


class Receipt:
    """An export task's result when its readers pull: the offer itself stays in the
    holder's registry (``publish``) as long as the task's key lives."""

    __slots__ = ("label", "address")

    def __init__(self, label: str, address):
        self.label, self.address = label, address

    def __reduce__(self):
        return (Receipt, (self.label, self.address))

    def __sizeof__(self) -> int:
        return 64

    def __repr__(self):
        return f"Receipt({self.label} on {self.address})"


def publish(key, offers: tuple) -> tuple:
    """On the holder: ``offers`` are export task ``key``'s, for ``serve`` to hand out.
    Returns the tuple published (what ``withdraw`` is given)."""
    offers = tuple(offers)
    with _LOCK:
        _OFFERS[norm_key(key)] = offers
    return offers


def withdraw(key, offers=None) -> None:
    """On the holder: export ``key`` is released; stop handing it out. With ``offers``
    (those its task published), only while they are still the ones published: a later
    product of the same operands runs an export task of the same key, whose offers the
    release of the earlier one (an orphan swept late) must not take away."""
    key = norm_key(key)
    with _LOCK:
        if offers is None or _OFFERS.get(key) is offers:
            _OFFERS.pop(key, None)


def offer(key, index: int):
    """On the holder: offer ``index`` of export ``key`` as published, or None."""
    with _LOCK:
        got = _OFFERS.get(norm_key(key))
    return got[int(index)] if got is not None and 0 <= int(index) < len(got) else None


def published() -> int:
    """How many offers this process hands out now (for tests and reports)."""
    with _LOCK:
        return len(_OFFERS)


def _in_state(worker, keys, state: str) -> list:
    """Those of ``keys`` whose task is in ``state`` on ``worker``."""
    tasks = getattr(getattr(worker, "state", None), "tasks", None) or {}
    return [key for key in keys
            if getattr(tasks.get(key), "state", None) == state]


def _failed(worker, keys) -> list:
    """Those of ``keys`` whose task failed on ``worker`` (they will never publish)."""
    return _in_state(worker, keys, "error")


def _withdrawn(worker, keys) -> list:
    """Those of ``keys`` whose task finished on ``worker`` (an export task publishes before
    it returns) but whose offers are not published: withdrawn, they will not come back."""
    return _in_state(worker, keys, "memory")


async def serve(keys=None, wait: float = 0.0, worker=None):
    """The holder's handler: the offers of ``keys`` (export task keys: a tuple each),
    each once published, waiting up to ``wait`` seconds for those not yet; pickled,
    a missing one as None, and under ``"failed"`` the keys whose export task raised
    on this ``worker`` (the plugin binds it) or finished with its offers withdrawn,
    which will never publish."""
    import asyncio

    keys = [norm_key(k) for k in keys or ()]
    deadline = time.monotonic() + max(float(wait), 0.0)
    pause = 0.0005
    while True:
        with _LOCK:
            got = [_OFFERS.get(k) for k in keys]
        missing = [k for k, g in zip(keys, got) if g is None]
        failed = (_failed(worker, missing) + _withdrawn(worker, missing)
                  if missing and worker is not None else [])
        if not missing or failed or time.monotonic() >= deadline:
            return {"offers": pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL),
                    "failed": pickle.dumps(failed, protocol=pickle.HIGHEST_PROTOCOL)}
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.001)


async def _ask_all(worker, by_holder: dict, wait: float) -> dict:
    import asyncio

    async def ask(holder, keys):
        try:
            reply = await worker.rpc(holder).distmm_pull(keys=list(keys), wait=wait)
        except Exception as exc:  # noqa: BLE001 -- named with the holder below
            return holder, exc
        failed = pickle.loads(reply["failed"]) if reply.get("failed") else []
        if failed:
            return holder, RuntimeError(f"its export task(s) {failed} failed there, or "
                                        f"finished with their offers withdrawn")
        return holder, dict(zip(keys, pickle.loads(reply["offers"])))

    answers = await asyncio.gather(*(ask(h, ks) for h, ks in by_holder.items()))
    return dict(answers)


def _ask(worker, by_holder: dict, wait: float) -> dict:
    """``{(holder, key): offers}`` for those the holders had; raises ``IPCError``
    naming a holder that could not be asked."""
    from distributed.utils import sync

    from distmm.executor.ipc import IPCError

    got = {}
    for holder, answer in sync(worker.loop, _ask_all, worker, by_holder, wait).items():
        if isinstance(answer, BaseException):
            raise IPCError(f"asking holder {holder} for its CUDA IPC offers failed: "
                           f"{type(answer).__name__}: {answer}") from answer
        got.update({(holder, k): v for k, v in answer.items() if v is not None})
    return got


def resolve(*lists):
    """In a block task: ``lists`` with every ``Pull`` replaced by its offer,
    fetched from its holder (``FIRST_WAIT``, then seceded up to ``LONG_WAIT``)."""
    # one request entry per export task (a task's offers come together)
    wanted = {(x.holder, x.key): x for lst in lists for x in lst if isinstance(x, Pull)}
    if not wanted:
        return lists
    from distributed import get_worker, rejoin, secede

    from distmm.executor.ipc import IPCError

    try:
        worker = get_worker()
    except ValueError:
        raise IPCError("this product was built for the distributed cluster it was planned on "
                       "(its block tasks fetch CUDA IPC offers from that cluster's workers); "
                       "compute it there, not with another scheduler") from None

    def by_holder(pairs):
        out: dict = {}
        for holder, key in pairs:
            out.setdefault(holder, []).append(key)
        return out

    got = _ask(worker, by_holder(wanted), FIRST_WAIT)
    missing = [p for p in wanted if p not in got]
    if missing:
        secede()  # this worker's own export tasks may be what another holder waits for
        try:
            start = time.monotonic()
            while missing:
                left = LONG_WAIT - (time.monotonic() - start)
                if left <= 0:
                    break
                got.update(_ask(worker, by_holder(missing), min(PATIENCE, left)))
                missing = [p for p in wanted if p not in got]
                if missing and time.monotonic() - start < LONG_WAIT:
                    import logging

                    logging.getLogger("distmm.engine.dask").warning(
                        "distmm: a block task on %s has waited %.0f s for the CUDA IPC offers "
                        "of %s (gives up after %.0f s)", worker.address,
                        time.monotonic() - start,
                        ", ".join(repr(wanted[p]) for p in missing[:4]), LONG_WAIT)
        finally:
            rejoin()
    if missing:
        raise IPCError("no CUDA IPC offer published within "
                       f"{LONG_WAIT:.0f} s for " + ", ".join(repr(wanted[p]) for p in missing))
    return tuple([got[(x.holder, x.key)][x.index] if isinstance(x, Pull) else x for x in lst]
                 for lst in lists)


def await_own(exports) -> None:
    """In a block task: until each of ``exports`` (``Pull`` objects) held by this
    worker is published, secede so that those export tasks can run on this
    worker's thread, and wait for them (``LONG_WAIT`` at most, then go on: only
    the readers' wait is at stake, not the result). Every ``ASK_AFTER`` seconds the
    scheduler is asked about those this worker does not know: one it has let go of
    (its readers done before this task started) or holds in memory is not waited for."""
    if not exports:
        return
    from distributed import get_worker, rejoin, secede

    try:
        worker = get_worker()
    except ValueError:  # not on a worker
        return
    mine = [norm_key(p.key) for p in exports if p.holder == worker.address]
    gone: set = set()  # released by the scheduler, or in memory there: will not publish here

    def pending():
        with _LOCK:
            waiting = [k for k in mine if k not in _OFFERS and k not in gone]
        failed = set(_failed(worker, waiting) + _withdrawn(worker, waiting)) if waiting else set()
        return [k for k in waiting if k not in failed]  # these will never publish

    if not pending():
        return
    secede()
    try:
        now = time.monotonic()
        deadline, ask = now + LONG_WAIT, now + ASK_AFTER
        pause = 0.0002
        while True:
            waiting = pending()
            now = time.monotonic()
            if not waiting or now >= deadline:
                break
            if now >= ask:
                tasks = getattr(getattr(worker, "state", None), "tasks", None) or {}
                unknown = [k for k in waiting if k not in tasks]
                if unknown:
                    gone.update(_let_go(unknown))
                ask = time.monotonic() + ASK_AFTER
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
    finally:
        rejoin()


def _settled(keys, dask_scheduler=None) -> list:
    """On the scheduler: those of ``keys`` that will not run again for the graph that holds
    them: unknown to it (forgotten), released, erred, or in memory (done)."""
    done = {None, "released", "forgotten", "erred", "memory"}
    return [k for k in keys if getattr(dask_scheduler.tasks.get(k), "state", None) in done]


def _let_go(keys) -> list:
    """Those of ``keys`` (export keys this worker does not know) that the scheduler has
    settled (``_settled``); none where it cannot be asked."""
    from distributed import get_client

    try:
        return [norm_key(k) for k in get_client().run_on_scheduler(_settled, list(keys))]
    except Exception:  # noqa: BLE001 - asking is an optimisation of the wait, not needed
        return []
