"""A's row blocks crossing whole into device panels, which the GEMMs read in place.

This module covers: ``APanels``, for A copied straight from the caller's page-locked rows in
full-width units. A column slice of host rows (a k block of a row block) crosses as a 2-D copy
at 10-48 GB/s, against 55 GB/s for contiguous bytes (bench/NOTES.md, host-resident bfloat16), so a
row block's whole rows cross instead, in one contiguous copy per page-locked range, into one of
the device panels (``tm_max x k``: two, or one for each leading unit) on the copy-in stream;
each GEMM reads its k block of the panel in place, a view whose rows are the panel's (a
device-to-device 2-D copy of it into an A slot before each GEMM held the issuing thread for
milliseconds once the compute stream's queue was deep: bench/NOTES.md, host-resident bfloat16).
A panel is reloaded only after the last GEMM of the row block it holds; a row block whose
panel is still in use goes as 2-D copies into the A slots instead.

It does *not* cover: whether A goes straight (``distmm.executor.pipeline.product``), the
page-locking (``distmm.executor.pipeline.direct``) or the schedule (``distmm.plan_pipeline``).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

__all__ = ["APanels", "panel_bytes", "panels_for"]

PANELS = 2


def panels_for(tiling) -> int:
    """Device panels for ``tiling``: two, or one for each unit that runs k outer at the
    start (``PipelineTiling.lead``), whose row blocks are all read at once; one for every
    row block where C's columns come in blocks (each row block is read by a unit of each
    column block, and crosses once)."""
    if tiling.b_resident and len(tiling.col_edges) > 2:
        return len(tiling.row_edges) - 1
    return max(PANELS, int(tiling.lead))


def panel_bytes(tiling, itemsize: int) -> int:
    """Device bytes of ``APanels``' panels for ``tiling``."""
    return panels_for(tiling) * tiling.tm_max * tiling.k_edges[-1] * int(itemsize)


class APanels:
    """Device panels of A's whole rows (``panels_for``: two, or the leading units' count).

    Parameters
    ----------
    run
        The ``PipelineRun`` (its device, ``_timed`` and ``bytes_h2d``).
    src : numpy.ndarray
        A as its bytes cross (C-contiguous), page-locked as ``locked`` says.
    locked : distmm.executor.pipeline.direct.PageLocked
        A's page-locked row blocks (``pieces``).
    steps : list of distmm.plan_pipeline.Step
        The schedule: how many GEMMs read each row block.
    """

    def __init__(self, run, src: np.ndarray, locked, steps):
        self.run, self.dev, self.t = run, run.dev, run.t
        self.src, self.locked = src, locked
        k = self.t.k_edges[-1]
        self.count = panels_for(self.t)
        self.bufs = [self.dev.array(self.dev.alloc(self.t.tm_max * k * src.itemsize),
                                    (self.t.tm_max, k), src.dtype) for _ in range(self.count)]
        self.holder: list = [None] * self.count   # the row block each panel holds
        self.free_ev: list = [None] * self.count  # after the last GEMM reading it
        self.left = Counter(st.i for st in steps)  # GEMMs of each row block not yet issued
        self.of_block: dict = {}                  # row block -> panel index, or None
        self.ready_ev: dict = {}                  # row block -> its rows' copy event

    def take(self, block: int, stream) -> bool:
        """Whether row block ``block``'s chunks come from a panel, its rows copied into one on
        ``stream`` at the first call; False where the panel is still read by unissued GEMMs."""
        if block in self.of_block:
            return self.of_block[block] is not None
        idx = block % self.count
        held = self.holder[idx]
        if held is not None and self.left[held] > 0:
            self.of_block[block] = None
            return False
        dev, t = self.dev, self.t
        if self.free_ev[idx] is not None:
            dev.wait(stream, self.free_ev[idx])
        r0, r1 = t.row_edges[block], t.row_edges[block + 1]
        src = self.src[r0:r1].reshape(-1).view(np.uint8)
        dst = self.bufs[idx][:r1 - r0].reshape(-1).view(np.uint8)
        for p0, p1 in self.locked.pieces(block, r0, r1):
            self.run._timed("h2d", f"A[{block}] rows", stream,
                            lambda: dev.h2d(dst[p0:p1], src[p0:p1], stream))
        self.run.bytes_h2d += dst.nbytes
        ev = dev.event()
        dev.record(ev, stream)
        self.ready_ev[block] = ev
        self.holder[idx], self.of_block[block] = block, idx
        return True

    def read(self, i: int, k0: int, k1: int, rows: int, stream):
        """Row block ``i``'s columns ``k0:k1`` (its first ``rows`` rows) in its panel, for a
        GEMM on ``stream`` (which then waits for the rows' copy); None where the row block
        did not go to a panel (its A slots hold it)."""
        idx = self.of_block.get(i)
        if idx is None:
            return None
        self.dev.wait(stream, self.ready_ev[i])
        return self.bufs[idx][:rows, k0:k1]

    def used(self, i: int, ev) -> None:
        """A GEMM reading row block ``i`` is issued, ``ev`` after it."""
        self.left[i] -= 1
        idx = self.of_block.get(i)
        if idx is not None:
            self.free_ev[idx] = ev
