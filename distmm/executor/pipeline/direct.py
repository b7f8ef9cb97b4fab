"""Copies straight between the device and the caller's arrays, page-locked in place.

This module covers: ``PageLocked``, which page-locks (``cudaHostRegister``) a C-contiguous
2-D host array in segments, one per block of its rows (C's row blocks for the result, A's row
blocks and B's k blocks for the operands), on a thread of its own in the order the blocks
are used, so that copies go between the device and the array itself instead of through the
staging ring and a host copy; and which unlocks each segment once the last copy touching it
has ended, so that nothing stays page-locked after the product. Segments are cut at page
boundaries, so neighbouring blocks may share one; since one copy may not span two page-locked
ranges (the driver rejects it), ``pieces`` and ``rects`` cut a block's copy at the segment
boundaries it crosses. A segment that cannot be page-locked (a memory-lock limit, memory the
driver refuses) sends the blocks that need it, and all later ones, back to the ring. An
array already page-locked by its owner (``cupyx.empty_pinned``, the owner's own
``cudaHostRegister``; the device's ``host_is_locked``) is taken as one segment, ready at
once, and left locked: no lock or unlock costs anything then. Its owner must have locked it
as one range (a copy may not span two).

It does *not* cover: which arrays take this path (``distmm.executor.pipeline.product``),
issuing the copies (``distmm.executor.pipeline.run``), or the device calls (the device
object's ``host_register`` / ``host_unregister``).
"""
from __future__ import annotations

import threading

import numpy as np

from distmm.threads import submit

__all__ = ["PageLocked", "is_page_locked"]

PAGE = 4096


def is_page_locked(dev, array) -> bool:
    """Whether ``array`` (C-contiguous, 2-D) lies in host memory page-locked by its owner, as
    the device reports it (``host_is_locked``; a device without it reports nothing locked)."""
    check = getattr(dev, "host_is_locked", None)
    return (check is not None and isinstance(array, np.ndarray) and array.nbytes > 0
            and bool(check(int(array.ctypes.data), int(array.nbytes))))


class PageLocked:
    """``array``'s rows page-locked block by block.

    Parameters
    ----------
    dev
        The pipeline's device (``host_register(ptr, nbytes)``, ``host_unregister(ptr)``,
        ``sync_event(event)``, ``bind_thread()``).
    array : numpy.ndarray
        C-contiguous, 2-D.
    row_edges : sequence of int
        The blocks of rows, in the order they are first copied.
    """

    def __init__(self, dev, array: np.ndarray, row_edges, name: str = "direct"):
        self.dev, self.array = dev, array
        self.base, self.row = int(array.ctypes.data), int(array.strides[0])
        self.item = int(array.itemsize)
        starts = [self.base + int(r) * self.row for r in row_edges]
        end = starts[-1]
        # locked by its owner: one segment, left locked (``_unlocked`` set from the start)
        self.owned = is_page_locked(dev, array)
        if self.owned:
            cuts = [starts[0], max(end, starts[0])]
        else:
            cuts = [starts[0] - starts[0] % PAGE] + [s - s % PAGE for s in starts[1:-1]]
            cuts.append(-(-end // PAGE) * PAGE)
        # segment s: [cuts[s], cuts[s + 1]); block i needs every segment its bytes touch
        self.segments = list(zip(cuts, cuts[1:]))
        self.needs = [[s for s, (lo, hi) in enumerate(self.segments)
                       if hi > lo and lo < e and hi > b]
                      for b, e in zip(starts, starts[1:])]
        self.users = [sum(s in need for need in self.needs) for s in range(len(self.segments))]
        self._locked = [threading.Event() for _ in self.segments]
        self._ok = [self.owned] * len(self.segments)
        self._unlocked = [self.owned] * len(self.segments)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self._releases: list = []
        self._thread = threading.Thread(target=self._lock_all, name=f"distmm-{name}",
                                        daemon=True)
        if self.owned:
            for ev in self._locked:
                ev.set()
        else:
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

    def ready(self, block: int, *, wait: bool = True) -> bool:
        """Whether block ``block``'s segments are page-locked (waiting until they are tried,
        or not at all with ``wait=False``); False sends the block through the ring."""
        for s in self.needs[block]:
            if not wait and not self._locked[s].is_set():
                return False
            self._locked[s].wait()
        return all(self._ok[s] for s in self.needs[block])

    def pieces(self, block: int, r0: int, r1: int):
        """``(start, stop)`` byte ranges of whole rows ``r0:r1`` (in block ``block``),
        counted from their first byte, one per segment they touch."""
        lo = self.base + r0 * self.row
        hi = lo + (r1 - r0) * self.row
        out = []
        for s in self.needs[block]:
            a, b = max(lo, self.segments[s][0]), min(hi, self.segments[s][1])
            if b > a:
                out.append((a - lo, b - lo))
        return out

    def rects(self, block: int, r0: int, r1: int, c0: int, c1: int):
        """``(ra, rb, ca, cb)`` rectangles covering rows ``r0:r1``, columns ``c0:c1`` (in
        block ``block``), each inside one segment: runs of whole rows, and a row that crosses
        a segment boundary cut at the boundary's column."""
        out, it = [], self.item
        r, c = r0, c0  # the next element to cover
        for s in self.needs[block]:
            x = self.segments[s][1]  # this segment's end
            while r < r1:
                row0 = self.base + r * self.row
                if c != c0 or row0 + c1 * it > x:  # a row (or its rest) reaching past x
                    if row0 + c1 * it <= x:
                        out.append((r, r + 1, c, c1))
                        r, c = r + 1, c0
                        continue
                    cm = max(c, min(c1, c0 + (x - row0 - c0 * it) // it))
                    if cm > c:
                        out.append((r, r + 1, c, cm))
                        c = cm
                    break  # the rest of row r lies in the next segment
                # rows whose needed bytes all end at or before x
                n = min(r1 - r, (x - row0 - c1 * it) // self.row + 1)
                out.append((r, r + n, c0, c1))
                r += n
            if r >= r1:
                break
        if r < r1:  # pragma: no cover - the needed segments cover the block
            raise AssertionError(f"rows {r}:{r1} outside the page-locked segments")
        return out

    def copied(self, block: int, event, pool) -> None:
        """The last copy touching block ``block`` is queued, ``event`` after it: segments no
        other block still needs are unlocked on ``pool`` once it has passed (the copies a
        segment serves run in queue order on one stream, so the last one's event covers the
        earlier ones)."""
        with self._lock:
            done = []
            for s in self.needs[block]:
                self.users[s] -= 1
                if self.users[s] == 0:
                    done.append(s)
        if done:
            self._releases.append(submit(pool, self._unlock, done, event))

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
        """Every segment unlocked; called once no copy touching ``array`` is queued any more
        (after the product, or after a failed one has synchronized the device)."""
        self._stop.set()
        if not self.owned:
            self._thread.join()
        for f in self._releases:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - unlocked below
                pass
        for s in range(len(self.segments)):
            self._unlock_one(s)
