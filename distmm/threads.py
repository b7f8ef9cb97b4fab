"""Handing a task to a thread pool that may take no more work.

This module covers ``submit``: ``pool.submit(fn, *args)``, or, where the pool takes no new
work, ``fn(*args)`` run in the calling thread; a Future of its outcome either way. A
``concurrent.futures`` pool refuses work (``RuntimeError``) once the interpreter shuts
down: a thread of the user's that still calls distmm after the main thread returned (Python
waits for it) would otherwise fail there ("cannot schedule new futures after interpreter
shutdown"). It refuses too where no thread can start, and once shut down. It is the bottom
layer's, so that every pool distmm keeps (the local engine's tiles, the GPU pipeline's
copies, the direct writes of staged outputs) takes the same way out.
It does *not* cover: making or sizing the pools (their owners).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading

__all__ = ["submit"]


def submit(pool: cf.Executor, fn, /, *args) -> cf.Future:
    """``pool.submit(fn, *args)``; where ``pool`` refuses it, ``fn(*args)`` run here before
    this returns. The Future holds ``fn``'s result or exception, as the pool's would, and is
    cancelled where the pool drops the task (``shutdown(cancel_futures=True)``). ``fn`` runs
    once: where the pool queued the task and then refused it (no thread could start), the
    first to take it runs it, this thread or one of the pool's."""
    future: cf.Future = cf.Future()
    claim = threading.Lock()

    def run():
        if not claim.acquire(blocking=False) or not future.set_running_or_notify_cancel():
            return
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the future's, as in the pool's own
            future.set_exception(exc)
        else:
            future.set_result(value)

    def dropped(queued: cf.Future):
        if queued.cancelled() and claim.acquire(blocking=False):  # run() never comes
            future.cancel()
            future.set_running_or_notify_cancel()  # its waiters (concurrent.futures.wait) told

    try:
        pool.submit(run).add_done_callback(dropped)
    except RuntimeError:
        run()
    return future
