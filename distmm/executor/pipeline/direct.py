"""C copied from the device straight into the caller's result, page-locked in place.

This module covers: ``DirectOut``, which page-locks (``cudaHostRegister``) a C-contiguous
host result in segments, one per row block of C, on a thread of its own in the order the
row blocks finish, so that each block's copy out lands in the result itself instead of
passing through the staging ring and a host copy; and which unlocks each segment once the
copies into it have ended, so that the result is page-locked only while it is being written
and never after the product returns. Segments are cut at page boundaries: a row block whose
end is not page-aligned also needs the next segment, and is copied in two pieces (one copy may
not span two page-locked ranges). A segment that cannot be page-locked
(a memory-lock limit, memory the driver refuses) turns the remaining row blocks back to the
staging ring.

It does *not* cover: which results take this path (``distmm.executor.pipeline.product``),
the copies themselves (``distmm.executor.pipeline.run``), or the device calls (the device
object's ``host_register`` / ``host_unregister``).
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["DirectOut"]

PAGE = 4096


class DirectOut:
    """``out``'s rows page-locked block by block.

    Parameters
    ----------
    dev
        The pipeline's device (``host_register(ptr, nbytes)``, ``host_unregister(ptr)``,
        ``sync_event(event)``).
    out : numpy.ndarray
        C-contiguous, 2-D: the result.
    row_edges : sequence of int
        The row blocks of C, in the order their copies out are queued.
    """

    def __init__(self, dev, out: np.ndarray, row_edges):
        self.dev, self.out = dev, out
        base, row = int(out.ctypes.data), int(out.strides[0])
        starts = [base + int(r) * row for r in row_edges]
        end = starts[-1]
        cuts = [starts[0] - starts[0] % PAGE] + [s - s % PAGE for s in starts[1:-1]]
        cuts.append(-(-end // PAGE) * PAGE)
        # segment s: [cuts[s], cuts[s + 1]); block i needs every segment its bytes touch
        self.segments = [(lo, hi) for lo, hi in zip(cuts, cuts[1:])]
        self.needs = [[s for s, (lo, hi) in enumerate(self.segments)
                       if hi > lo and lo < e and hi > b]
                      for b, e in zip(starts, starts[1:])]
        self.users = [sum(s in need for need in self.needs) for s in range(len(self.segments))]
        self._locked = [threading.Event() for _ in self.segments]
        self._ok = [False] * len(self.segments)
        self._unlocked = [False] * len(self.segments)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self._releases: list = []
        self._thread = threading.Thread(target=self._lock_all, name="distmm-direct-out",
                                        daemon=True)
        self._thread.start()

    def _lock_all(self) -> None:
        self.dev.bind_thread()
        for s, (lo, hi) in enumerate(self.segments):
            if self._stop.is_set() or self.failure is not None or hi <= lo:
                self._locked[s].set()
                continue
            try:
                self.dev.host_register(lo, hi - lo)
                self._ok[s] = True
            except Exception as exc:  # noqa: BLE001 - the rest go through the staging ring
                self.failure = exc
            self._locked[s].set()

    def ready(self, block: int) -> bool:
        """Wait until block ``block``'s segments are page-locked; False where one could not
        be (that block goes through the staging ring)."""
        for s in self.needs[block]:
            self._locked[s].wait()
        return all(self._ok[s] for s in self.needs[block])

    def pieces(self, block: int, r0: int, r1: int):
        """``(start, stop)`` byte ranges of rows ``r0:r1`` of ``out`` (block ``block``), from
        the block's first byte, one per segment: a copy may not span two page-locked ranges
        (the driver rejects it), so a block that ends inside the next segment is copied in
        two."""
        row = int(self.out.strides[0])
        lo = int(self.out.ctypes.data) + r0 * row
        hi = lo + (r1 - r0) * row
        out = []
        for s in self.needs[block]:
            a, b = max(lo, self.segments[s][0]), min(hi, self.segments[s][1])
            if b > a:
                out.append((a - lo, b - lo))
        return out

    def copied(self, block: int, event, pool) -> None:
        """Block ``block``'s copy out is queued, ``event`` after it: segments no other block
        still needs are unlocked on ``pool`` once the copy has ended (copies out run in
        queue order on one stream, so the last user's event covers the earlier ones)."""
        with self._lock:
            done = []
            for s in self.needs[block]:
                self.users[s] -= 1
                if self.users[s] == 0:
                    done.append(s)
        if done:
            self._releases.append(pool.submit(self._unlock, done, event))

    def _unlock(self, segments, event) -> None:
        self.dev.bind_thread()
        if event is not None:
            self.dev.sync_event(event)
        for s in segments:
            self._unlock_one(s)

    def _unlock_one(self, s: int) -> None:
        with self._lock:
            if not self._ok[s] or self._unlocked[s]:
                return
            self._unlocked[s] = True
        self.dev.host_unregister(self.segments[s][0])

    def close(self) -> None:
        """Every segment unlocked; called once no copy into ``out`` is queued any more (after
        the product, or after a failed one has synchronized the device)."""
        self._stop.set()
        self._thread.join()
        for f in self._releases:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - unlocked below
                pass
        for s in range(len(self.segments)):
            self._unlock_one(s)
