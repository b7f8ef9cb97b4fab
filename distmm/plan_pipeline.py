"""The planner's schedule for the GPU stream pipeline: pure arithmetic.

This module covers: the pipeline's tiling of ``C[m, n] = A[m, k] @ B[k, n]``
(``PipelineTiling``: C units, k-blocks, device slot and buffer counts) chosen
from a device memory budget by ``choose_tiling``; the smaller tiling to retry
with after an out-of-memory error (``shrink_tiling``); the order of C units and
the whole kernel/load schedule with Belady's eviction of cached blocks
(``plan_block_loads``). ``pipeline_tiling(plan, budget)`` is the entry the
executor calls: the plan's problem and dtype with the device's budget.

It does *not* cover: running the schedule (``distmm.executor.pipeline``), the
CPU/cluster tile grid (``distmm.plan``), or reading the budget from a device or
the config. Like ``distmm.plan`` it imports numpy only: no cupy, dask or files.

How it works
------------
C is cut into *units* (row ranges times column ranges). When all of B fits in
the budget, units span the full width of C, B's k-blocks are loaded once
(during the first unit) and stay resident, and the last rows are cut into
units of halving height so that little output is left to copy out after the
last kernel (where asked, beside tensor-core GEMMs with operands that cross
straight, units of column blocks, A's rows and B's columns crossing in turn so that
the units they complete grow in both directions: ``choose_tiling``'s ``columns``).
Otherwise units are square tiles, swept row by row in serpentine order, and a cache of A and B blocks with Belady's eviction (the schedule is
known in advance, so the block used furthest in the future is evicted) keeps
the A row panel resident across a sweep of B column panels.
"""
from __future__ import annotations

import collections
import heapq
import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "PipelineTiling",
    "Step",
    "choose_tiling",
    "shrink_tiling",
    "unit_order",
    "plan_block_loads",
    "pipeline_tiling",
    "spare_bytes",
    "FAST_DTYPES",
    "MAX_STEPS",
]

#: result dtypes the stream pipeline computes
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

MiB = 1 << 20
_TILE_CANDIDATES = (16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64)
_TK_CANDIDATES = (8192, 4096, 2048, 1024, 512, 256, 128, 64)
#: the precisions of tensor-core GEMMs (``distmm.precision.REDUCED``; a planner imports nothing
#: of distmm's)
_TENSOR_CORES = ("tf32", "bf16", "fp16")
#: the widest k-block a precision's GEMMs take: each k-block's GEMM reads and writes C's unit
#: once more, which costs ~25% beside a tensor-core GEMM at 2048 (bench/NOTES.md, host-resident
#: bfloat16) and ~2% beside an SIMT one
TK_MAX = {"highest": 2048, **{p: 8192 for p in _TENSOR_CORES}}
_BUDGET_FRACTION = 0.92    # of the device budget for our buffers; the rest for cuBLAS workspace
#: narrow units run k outer at the start (``PipelineTiling.lead``): while B first crosses
#: (39 ms at 32768^2 bf16), a k-block feeds this many units' GEMMs instead of one
#: (bench/NOTES.md, host-resident bfloat16)
LEAD = 2
#: beside tensor-core GEMMs, resident B may be split into column blocks (``choose_tiling``'s
#: ``columns``) where each block's rows are at least this many columns: a column block of
#: page-locked B crosses as a 2-D copy, at full rate from 32 KB rows (bench/NOTES.md)
COLUMN_MIN = 4096
_TAIL_BYTES = 64 * MiB     # full-width mode: last unit's output at most this (short tail)
#: kernels (``Step``) a schedule lists, ~0.5 KB each: a product whose operands fit one host's
#: memory takes a few hundred thousand at most at its own tiling; more (10**7 each way: 2e9)
#: took gigabytes before anything could be refused. The model simulates at most a few tens of
#: thousands of them, and summarises a longer schedule (``distmm.plan_model.SIMULATED_STEPS``)
MAX_STEPS = 2**20

@dataclass(frozen=True)
class PipelineTiling:
    """The pipeline's own tiling of ``C[m, n] = A[m, k] @ B[k, n]``.

    Attributes
    ----------
    row_edges, col_edges, k_edges : tuple of int
        Boundaries of units along m and n, and of k-blocks.
    a_slots, b_slots : int
        Device slots for A blocks (``tm_max x tk_max``) and B blocks
        (``tk_max x tn_max``).
    c_buffers : int
        Device buffers for C units (``tm_max x tn_max``).
    itemsize : int
    mode : str
        ``"full-width"`` (B resident, units span all columns) or ``"tiles"``.
    lead : int
        Units whose k-blocks run k outer at the start (``plan_block_loads``): while B
        first crosses, each of its k-blocks feeds ``lead`` units' GEMMs instead of one.
    """

    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    k_edges: tuple[int, ...]
    a_slots: int
    b_slots: int
    c_buffers: int
    itemsize: int
    mode: str = "tiles"
    lead: int = 1

    @staticmethod
    def _widest(edges) -> int:
        return max((edges[i + 1] - edges[i] for i in range(len(edges) - 1)), default=0)

    @property
    def tm_max(self) -> int:
        return self._widest(self.row_edges)

    @property
    def tn_max(self) -> int:
        return self._widest(self.col_edges)

    @property
    def tk_max(self) -> int:
        return self._widest(self.k_edges)

    @property
    def a_slot_bytes(self) -> int:
        return self.tm_max * self.tk_max * self.itemsize

    @property
    def b_slot_bytes(self) -> int:
        return self.tk_max * self.tn_max * self.itemsize

    @property
    def c_buffer_bytes(self) -> int:
        return self.tm_max * self.tn_max * self.itemsize

    @property
    def b_resident(self) -> bool:
        """All of B lives in one device buffer (full-width mode); block ``kb`` is
        its rows ``k_edges[kb]:k_edges[kb+1]``, so short k-blocks waste nothing."""
        return self.mode == "full-width"

    @property
    def b_bytes(self) -> int:
        if self.b_resident:
            return self.k_edges[-1] * self.col_edges[-1] * self.itemsize
        return self.b_slots * self.b_slot_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory the pipeline's buffers take."""
        return self.a_slots * self.a_slot_bytes + self.b_bytes + self.c_buffers * self.c_buffer_bytes

    def describe(self) -> dict:
        d = asdict(self)
        d.update(tm_max=self.tm_max, tn_max=self.tn_max, tk_max=self.tk_max,
                 device_bytes=self.device_bytes)
        for key in ("row_edges", "col_edges", "k_edges"):
            edges = d.pop(key)
            d[key.split("_")[0] + "_sizes"] = [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]
        return d


def _check_steps(m: int, n: int, k: int, units: int, blocks: int, shape) -> None:
    """Refuse a tiling of ``units`` C units of ``blocks`` k-blocks each (or at least that
    many, counted before any edge is listed) beyond ``MAX_STEPS`` kernels."""
    if units * blocks > MAX_STEPS:
        tm, tn, tk = shape
        raise ValueError(f"a {m} x {n} x {k} product in {tm} x {tn} x {tk} units and k-blocks "
                         f"takes {units * blocks:.3g} GEMMs; the stream pipeline's schedule "
                         f"lists at most {MAX_STEPS}")


def _edges(length: int, tile: int) -> tuple[int, ...]:
    return tuple(range(0, length, tile)) + (length,) if length else (0,)


def _k_edges(k: int, tk: int) -> tuple[int, ...]:
    """k-blocks of ``tk``, after a ramp of ``tk/8, tk/4, tk/2``: the first kernel
    starts after an eighth of a full block's bytes have crossed, and each later
    block's copy hides behind the kernel before it (the pipeline's start-up)."""
    edges, size = [0], max(64, tk // 8)
    while size < tk and edges[-1] + size < k:
        edges.append(edges[-1] + size)
        size *= 2
    edges.extend(range(edges[-1] + tk, k, tk))
    edges.append(k)
    return tuple(edges)


def _ramp_edges(length: int, tile: int, tail: int) -> tuple[int, ...]:
    """Units of ``tile`` rows, then halving ones down to at most ``tail`` rows,
    so that the output left to copy after the last kernel is small."""
    sizes, rest = [], length
    while rest > tile:
        sizes.append(tile)
        rest -= tile
    tail = max(tail, 64)
    while rest > tail:
        take = rest - (rest // 2) // 64 * 64
        if take >= rest:
            break
        sizes.append(take)
        rest -= take
    if rest:
        sizes.append(rest)
    edges = [0]
    for s in sizes:
        edges.append(edges[-1] + s)
    return tuple(edges)


def choose_tiling(m: int, n: int, k: int, itemsize: int, budget: int, *,
                  tiles: tuple[int, int, int] | None = None,
                  tk_max: int = 2048, narrow: bool = False, lead: int = LEAD,
                  columns: int = 1) -> PipelineTiling:
    """Choose the pipeline's units, k-blocks and slot counts for a device budget.

    Parameters
    ----------
    m, n, k : int
        The problem (all positive).
    itemsize : int
        Bytes per element of the compute dtype.
    budget : int
        Device bytes the pipeline may use; about 92% of it goes to buffers.
    tiles : (tm, tn, tk), optional
        Force square-tile mode with these sizes (slot counts still follow the
        budget, but at least two of each); used to test the out-of-memory retry.
    tk_max : int
        The widest k-block (``TK_MAX`` of the GEMMs' precision).
    narrow : bool
        Full-width units of a quarter of the widest that fits (the reduced precisions:
        beside tensor-core GEMMs the copies are the limit, and a 16384-row unit's 2 GiB of
        float32 C could only start its copy out after the unit's GEMMs; bench/NOTES.md,
        host-resident bfloat16), the first ``lead`` of them k outer (``PipelineTiling.lead``),
        with C buffers for them and two more in the memory the wider units were given.
    lead : int
        With ``narrow``: how many of the first units run k outer (``PipelineTiling.lead``).
    columns : int
        With ``narrow`` and B resident: C's units in this many column blocks (each at least
        ``COLUMN_MIN`` wide, a multiple of 64 but the last), in ``unit_order``'s growing
        order, so that GEMMs start once one block of B and one of A's row blocks have
        crossed, not all of B. For operands and a result that cross straight
        (page-locked): B's blocks cross as 2-D copies, and A's rows stay on the device
        for every block (``panels_for``).

    Returns
    -------
    PipelineTiling

    Raises
    ------
    MemoryError
        Not even 64 x 64 tiles fit the budget.
    ValueError
        A schedule of more than ``MAX_STEPS`` kernels (told before any edge is listed).

    Examples
    --------
    >>> t = choose_tiling(32768, 32768, 32768, 4, 70 * 2**30)
    >>> t.mode, t.tm_max, t.tk_max, t.b_slots, t.k_edges[:3]
    ('full-width', 16384, 2048, 19, (0, 256, 768))
    >>> choose_tiling(4096, 4096, 4096, 4, 16 * 2**20).mode
    'tiles'
    """
    s = int(itemsize)
    usable = int(budget * _BUDGET_FRACTION)
    if tiles is not None:
        tm, tn, tk = (max(1, min(int(t), d)) for t, d in zip(tiles, (m, n, k)))
        return _fill_slots(m, n, k, s, usable, tm, tn, tk, minimum=2)

    tks = [t for t in _TK_CANDIDATES if t <= max(int(tk_max), 64)]
    # Full-width units with all of B resident: B is read from the host once.
    for tk in tks:
        tk = min(tk, k)
        b_bytes = k * n * s
        if b_bytes > 0.75 * usable:
            continue
        for tm in _TILE_CANDIDATES:
            tm = min(tm, m)
            for c_buffers, a_slots in ((3, 4), (2, 3), (2, 2)):
                need = b_bytes + c_buffers * tm * n * s + a_slots * tm * tk * s
                if need <= usable and (tm >= min(m, 1024) or tm * n * s >= 64 * MiB):
                    tail = max(64, _TAIL_BYTES // max(n * s, 1) // 64 * 64)
                    spare = usable - need
                    a_slots += min(4, spare // max(tm * tk * s, 1))
                    unit = min(tm, max(64, tm // 4)) if narrow else tm  # m < 64: one unit
                    parts = min(int(columns), n // COLUMN_MIN) if narrow else 1
                    # at least as many units and k-blocks as these, before they are listed
                    _check_steps(m, n, k, -(-m // unit), -(-k // tk), (unit, n, tk))
                    k_edges = _k_edges(k, tk)
                    kb = len(k_edges) - 1
                    rows = _ramp_edges(m, unit, tail)
                    units_k_outer = 1
                    if narrow:  # C buffers of the narrower units in the wider ones' bytes
                        c_buffers = min(c_buffers * (tm // unit), max(1, lead) + 2)
                        units_k_outer = max(1, min(lead, c_buffers - 2, len(rows) - 1))
                    cols = (0, n)
                    if parts > 1:  # smaller units: as many more C buffers in the same bytes
                        inner = (round(n * p / parts / 64) * 64 for p in range(1, parts))
                        cols = (0, *sorted(set(inner) - {0, n}), n)
                        c_buffers *= len(cols) - 1
                    _check_steps(m, n, k, (len(rows) - 1) * (len(cols) - 1), kb, (unit, n, tk))
                    # resident B: each k block of each column block its own place
                    return PipelineTiling(rows, cols, k_edges, int(a_slots),
                                          kb * (len(cols) - 1), c_buffers, s, "full-width",
                                          units_k_outer)
            if tm == m and tm < 1024:
                break

    # Square tiles; the cache keeps an A row panel and as many B blocks as fit.
    for tile in _TILE_CANDIDATES:
        tm, tn = min(tile, m), min(tile, n)
        for tk in tks:
            tk = min(tk, k)
            if 2 * tm * tn * s + 2 * tm * tk * s + 2 * tk * tn * s <= usable:
                return _fill_slots(m, n, k, s, usable, tm, tn, tk, minimum=2)
    raise MemoryError(f"device memory budget of {budget} bytes is too small for even 64 x 64 "
                      f"tiles of {s}-byte elements (distmm.device-memory-limit)")


def _fill_slots(m, n, k, s, usable, tm, tn, tk, *, minimum) -> PipelineTiling:
    kb = math.ceil(k / tk)
    gn = math.ceil(n / tn)
    _check_steps(m, n, k, -(-m // tm) * gn, kb, (tm, tn, tk))
    c_bytes, a_bytes, b_bytes = tm * tn * s, tm * tk * s, tk * tn * s
    spare = usable - 2 * c_bytes - minimum * (a_bytes + b_bytes)
    a_slots = minimum + max(0, min(kb, spare // a_bytes if spare > 0 else 0))
    spare -= (a_slots - minimum) * a_bytes
    b_slots = minimum + max(0, min(kb * gn, spare // b_bytes if spare > 0 else 0))
    return PipelineTiling(_edges(m, tm), _edges(n, tn), _edges(k, tk),
                          int(a_slots), int(b_slots), 2, s, "tiles")


def unit_order(tiling: PipelineTiling) -> list[tuple[int, int]]:
    """C units in the order they are computed: rows outer, columns serpentine
    (a sweep ends on the B panel the next one starts with); with B resident in column
    blocks, growing: each next A row block or B column block (whichever keeps the
    rows and columns met so far closest to square) adds its units with those met, so
    that the GEMMs have work once one of each has crossed, and more work per byte
    crossed as the square grows."""
    gm, gn = len(tiling.row_edges) - 1, len(tiling.col_edges) - 1
    if tiling.b_resident:
        re, ce = tiling.row_edges, tiling.col_edges
        order: list = []
        a = b = rows = cols = 0
        while a < gm or b < gn:
            if a > 0 and b < gn and (a == gm or b == 0 or cols < rows):
                order += [(i, b) for i in range(a)]
                cols, b = cols + ce[b + 1] - ce[b], b + 1
            else:
                order += [(a, j) for j in range(b)]
                rows, a = rows + re[a + 1] - re[a], a + 1
        return order
    order = []
    for i in range(gm):
        cols = range(gn) if i % 2 == 0 else range(gn - 1, -1, -1)
        order.extend((i, j) for j in cols)
    return order


@dataclass(frozen=True)
class Step:
    """One kernel: ``C_unit (+)= A[i, kb] @ B[kb, j]`` and the loads before it."""

    unit: int
    i: int
    j: int
    kb: int
    first: bool  # first k-block of its unit: beta = 0
    last: bool   # last k-block: the unit is finished after it
    a_slot: int
    b_slot: int
    load_a: bool
    load_b: bool


def plan_block_loads(tiling: PipelineTiling) -> list[Step]:
    """The whole schedule: kernels in order, with the block loads each needs.

    Blocks are cached in ``a_slots`` / ``b_slots`` device slots; on a miss the
    resident block whose next use is furthest away is evicted (Belady's rule,
    optimal because the schedule is known in advance). The first ``tiling.lead``
    units run k outer, each k-block of B feeding all of them as it arrives (each
    unit's last two k-blocks together, so that the first unit ends first); the
    k-blocks of later consecutive units run in alternating directions so that the
    blocks used last are reused first.

    Raises
    ------
    ValueError
        More than ``MAX_STEPS`` kernels (told before any is listed).
    """
    t = tiling
    gk = len(t.k_edges) - 1
    _check_steps(t.row_edges[-1], t.col_edges[-1], t.k_edges[-1],
                 (len(t.row_edges) - 1) * (len(t.col_edges) - 1), gk,
                 (t.tm_max, t.tn_max, t.tk_max))
    order = unit_order(tiling)
    lead = max(1, min(int(tiling.lead), tiling.c_buffers, len(order)))
    # k outer, except that each leading unit takes its last two k-blocks together: B's last
    # k-block then lands during the first unit's GEMM of the one before, and that unit's C
    # starts leaving one short GEMM after all of B is in, not after every leading unit's
    # GEMMs of the next-to-last k-block (bench/NOTES.md, host-resident bfloat16)
    split = gk - 2 if lead > 1 and gk > 2 else gk
    units = [(u, i, j) for u, (i, j) in enumerate(order)]
    head, rest = units[:lead], units[lead:]
    keys = [(u, i, j, kb, kb == 0, kb == gk - 1) for kb in range(split) for u, i, j in head]
    keys += [(u, i, j, kb, kb == 0, kb == gk - 1) for u, i, j in head for kb in range(split, gk)]
    for u, i, j in rest:
        kbs = range(gk) if u % 2 == 0 else range(gk - 1, -1, -1)
        for idx, kb in enumerate(kbs):
            keys.append((u, i, j, kb, idx == 0, idx == gk - 1))

    def assign(block_keys, slots):
        nxt = [math.inf] * len(block_keys)
        seen: dict = {}
        for s in range(len(block_keys) - 1, -1, -1):
            nxt[s] = seen.get(block_keys[s], math.inf)
            seen[block_keys[s]] = s
        resident: dict = {}     # block -> slot
        next_use: dict = {}     # block -> next step using it
        # the resident blocks by next use, latest first: a step uses one block, so no two
        # resident blocks share a next use, and an entry whose block has since been used
        # again (its next use passed) is dropped when it comes to the top
        furthest: list = []
        # Free slots are reused oldest-freed first: a load then waits for a kernel
        # long finished, not the one just issued (LIFO reuse made each load wait for
        # the kernel just issued, serialising copies and kernels: bench/NOTES.md).
        free = collections.deque(range(slots))
        out = []
        for s, key in enumerate(block_keys):
            if key in resident:
                out.append((resident[key], False))
            else:
                if free:
                    slot = free.popleft()
                else:
                    while next_use.get(furthest[0][1]) != -furthest[0][0]:
                        heapq.heappop(furthest)
                    victim = heapq.heappop(furthest)[1]
                    slot = resident.pop(victim)
                    del next_use[victim]
                resident[key] = slot
                out.append((slot, True))
            if nxt[s] == math.inf:  # never used again: free its slot now
                free.append(resident.pop(key))
                next_use.pop(key, None)
            else:
                next_use[key] = nxt[s]
                heapq.heappush(furthest, (-nxt[s], key))
        return out

    a_plan = assign([(i, kb) for (_, i, _, kb, _, _) in keys], tiling.a_slots)
    if tiling.b_resident:  # each k block of each column block its own place, loaded once
        seen: set = set()
        b_plan = []
        for (_, _, j, kb, _, _) in keys:
            b_plan.append((j * gk + kb, (kb, j) not in seen))
            seen.add((kb, j))
    else:
        b_plan = assign([(kb, j) for (_, _, j, kb, _, _) in keys], tiling.b_slots)
    return [Step(u, i, j, kb, first, last, a[0], b[0], a[1], b[1])
            for (u, i, j, kb, first, last), a, b in zip(keys, a_plan, b_plan)]


def shrink_tiling(tiling: PipelineTiling, m, n, k, s, budget) -> PipelineTiling | None:
    """The next smaller tiling after an out-of-memory error: square tiles of half
    the size (then half the k-block, then single slots), given at most half the
    device memory the failed tiling asked for; None at the floor, or where the smaller
    tiles' schedule would list more than ``MAX_STEPS`` kernels."""
    tm, tn, tk = tiling.tm_max, tiling.tn_max, tiling.tk_max
    base = min(tm, tn) if tiling.mode == "full-width" else max(tm, tn)
    usable = min(int(budget * _BUDGET_FRACTION), tiling.device_bytes // 2)
    try:
        if base > 64:
            nt = max(64, base // 2)
            return _fill_slots(m, n, k, s, usable, min(nt, m), min(nt, n), min(tk, nt, k),
                               minimum=2)
        if tk > 64:
            return _fill_slots(m, n, k, s, usable, tm, tn, max(64, tk // 2), minimum=2)
    except ValueError:  # more kernels than a schedule lists: no smaller tiling to retry with
        return None
    if tiling.a_slots > 1 or tiling.b_slots > 1 or tiling.c_buffers > 1:
        return PipelineTiling(tiling.row_edges, tiling.col_edges, tiling.k_edges,
                              1, 1, 1, s, "tiles")
    return None


def spare_bytes(tiling: PipelineTiling, budget: int) -> int:
    """Device bytes of ``budget`` left for buffers beyond ``tiling``'s own."""
    return int(budget * _BUDGET_FRACTION) - tiling.device_bytes


def pipeline_tiling(plan, budget: int, *, tiles: tuple[int, int, int] | None = None,
                    precision: str = "highest", lead: int | None = None,
                    columns: int = 1) -> PipelineTiling:
    """The pipeline's tiling for ``plan`` (its ``m``, ``n``, ``k`` and ``dtype``)
    under a device budget of ``budget`` bytes, for GEMMs of ``precision`` (its k-blocks
    up to ``TK_MAX[precision]``): the one schedule the pipeline runs.

    The plan's own tile grid is for CPUs and clusters, whose memory budget is per
    worker; the GPU's budget is only known on the device, so the executor passes
    it in and this pure function does the tiling (the executor tiles nothing).

    Raises
    ------
    TypeError
        A result dtype other than float32 / float64.
    MemoryError
        Not even 64 x 64 tiles fit the budget.
    ValueError
        A schedule of more than ``MAX_STEPS`` kernels.
    """
    dtype = np.dtype(plan.dtype)
    if dtype not in FAST_DTYPES:
        raise TypeError(f"the stream pipeline computes float32 and float64 results, got {dtype}; "
                        f"use the GPU executor's tile path for this dtype")
    return choose_tiling(int(plan.m), int(plan.n), int(plan.k), dtype.itemsize, int(budget),
                         tiles=tiles, tk_max=TK_MAX.get(precision, TK_MAX["highest"]),
                         narrow=precision in _TENSOR_CORES, lead=LEAD if lead is None else lead,
                         columns=columns)
