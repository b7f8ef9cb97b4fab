"""The plan of a file-to-file batch product under MPI: pure functions and a frozen dataclass.

This module covers: the process grid of a batch job (``rows x cols`` ranks, k never split,
so that every rank owns a block of C and writes it itself; ``ranks x 1`` when asked for whole
rows and B fits, so that each block is one contiguous range of the output file), the stripes
that cut each rank's C block into row ranges computed and written one after another (so that writing C
overlaps computing it, and a stopped job can resume at a stripe), the k panels of a stripe's
product (every owner's edge of A and B; finer for the first stripe, whose product starts while B's
panel is still arriving), and what one rank holds at once: B's column panel
(``k x n_j``, kept for every stripe), two A stripes (one multiplied, the next read) and two C
stripes (one computed, the last written), all in the accumulation dtype; CPU ranks also hold
what their host products and their writers' aligned buffers add (``_host_extra``).
``plan_batch`` refuses a product whose column panel of B does not fit the memory it is given
with stripes of the narrowest width, before anything is read: a ``ValueError`` for a GPU's
memory, a ``MemoryError`` for a ``distmm.memory-budget`` (``budget``). ``decide_batch`` is
what ``mpirun -n P distmm matmul`` decides from the job's facts (ranks, hosts, GPU or CPU
ranks, their memory, ``distmm.batch-panels``, the memory-budget of a CPU rank, direct writes):
how the ranks get their panels and the plan; ``distmm plan --ranks P`` prints the same.

It does *not* cover: reading, moving or writing bytes (``distmm.engine.mpi.stream``), or the
in-memory SUMMA of ``distmm.grid``, whose grids it reuses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distmm.direct_io import bounce_bytes
from distmm.grid import GridPlan, even_edges, make_grid
from distmm.plan import accumulate_dtype, sums_whole_k
from distmm.startup import size_text

__all__ = ["BatchPlan", "BatchSetup", "plan_batch", "decide_batch", "batch_panels",
           "b_fits_host", "PANEL_CHOICES", "STRIPES_PER_RANK", "MIN_STRIPE_ROWS",
           "B_CHUNK_BYTES", "FIRST_STEP_CHUNKS", "RESUME_STRIPE_BYTES", "MAX_BATCH_EDGES"]

#: stripes each rank's C block is cut into, when memory allows (more: finer resume points and
#: an earlier first write; fewer: larger GEMMs)
STRIPES_PER_RANK = 8
#: the narrowest stripe memory may force (a GEMM of fewer rows runs well below the device's rate)
MIN_STRIPE_ROWS = 256
#: the most bytes of C in one stripe of a resumable run (``--resume``): a stop loses the stripes
#: in flight (computed or being written), so smaller ones lose less
RESUME_STRIPE_BYTES = 512 << 20
#: bytes of B's widest column panel read and copied to the device per chunk (the next chunk is
#: read while the last one is copied)
B_CHUNK_BYTES = 256 << 20
#: chunks of B per k step of the first stripe's product (each step starts once its rows of B
#: are on the device; larger steps: fewer passes over C, a later start)
FIRST_STEP_CHUNKS = 4
#: edges a batch plan lists along one axis (Python ints in its tuples): its stripes, of all
#: grid rows together, and its first stripe's k steps. A plan whose column panel of B fits a
#: rank lists a few thousand at most; more (a product of 10**8 each way planned without a
#: memory limit) took gigabytes before the plan could be refused
MAX_BATCH_EDGES = 2**20
#: ``distmm.batch-panels``: how the ranks of a batch job get their panels (``batch_panels``)
PANEL_CHOICES = ("auto", "read", "share", "broadcast")


@dataclass(frozen=True)
class BatchPlan:
    """A batch product ``C[m, n] = A[m, k] @ B[k, n]`` on ``grid.rows x grid.cols`` ranks.

    Rank ``(i, j)`` owns ``A[row_i, kA_j]`` and ``B[kB_i, col_j]`` (``grid.a_layout`` and
    ``grid.b_layout``) and computes ``C[row_i, col_j]`` stripe by stripe: for stripe ``s``
    of grid row ``i`` (rows ``stripe_edges[i][s]:stripe_edges[i][s+1]``) each rank of the
    row contributes its piece of A's stripe, and the product is summed over ``panels`` in k
    order against B's column panel, which the ranks of column ``j`` assemble once.

    Attributes
    ----------
    grid : GridPlan
        ``layers == 1``.
    stripe_edges : tuple of tuple of int
        Per grid row, absolute row edges of its stripes.
    panels : tuple of int
        k edges of the stripe product's panels (every owner's edge of A and B).
    held_bytes : tuple of int
        Per rank: bytes held at once on the device (or in host memory for CPU ranks, with
        what their host products add where ``plan_batch`` was told their ``host_panels``).
    chunk_rows : int
        Rows of B's column panel read and copied per chunk (``B_CHUNK_BYTES`` of the widest).
    first_panels : tuple of int
        k edges of the first stripe's product on GPU ranks: ``panels`` cut every
        ``FIRST_STEP_CHUNKS`` chunks, so that its GEMMs run while B's panel arrives. Fixed by
        the plan, not by timing: a resumed run sums every stripe as an uninterrupted one does.
    """

    grid: GridPlan
    stripe_edges: tuple[tuple[int, ...], ...]
    panels: tuple[int, ...]
    held_bytes: tuple[int, ...]
    chunk_rows: int = 1
    first_panels: tuple[int, ...] = ()

    @property
    def stripes(self) -> int:
        """Most stripes of any grid row (rows differ by at most one stripe)."""
        return max(len(e) - 1 for e in self.stripe_edges)

    def stripe_count(self, i: int) -> int:
        return len(self.stripe_edges[i]) - 1

    def stripe_rows(self, i: int, s: int) -> tuple[int, int]:
        e = self.stripe_edges[i]
        return e[s], e[s + 1]

    def describe(self) -> str:
        g = self.grid
        return (f"batch grid {g.rows} x {g.cols} ranks, {self.stripes} stripe(s) per rank, "
                f"{len(self.panels) - 1} k panel(s); held per rank at most "
                f"{size_text(max(self.held_bytes), 2)}")


def _held(grid: GridPlan, i: int, j: int, stripe: int, host_panels: str | None = None,
          direct_writes: bool = False) -> int:
    """Bytes rank ``(i, j)`` holds at once with stripes of ``stripe`` rows: B's column panel,
    two A stripes and two C stripes (a C stripe is computed while the last one is written:
    ``distmm.engine.mpi.stream`` hands the writer the next only once it has written the
    last), and on CPU ranks (``host_panels``) what ``_host_extra`` adds."""
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    extra = (_host_extra(grid, nj, stripe, host_panels, direct_writes)
             if host_panels is not None else 0)
    return (grid.k * nj + 2 * stripe * grid.k + 2 * stripe * nj) * grid.itemsize + extra


def _host_extra(grid: GridPlan, nj: int, stripe: int, host_panels: str,
                direct_writes: bool = False) -> int:
    """Bytes a CPU rank holds beyond ``_held``'s count: the stripe being written in the result
    dtype where that is not the accumulation dtype (float16, bool, small integers); with
    ``direct_writes``, its writer's aligned buffers (``distmm.direct_io.bounce_bytes``: a
    stripe of whole rows is one span, else each of its rows); and, where its ranks get A's
    pieces by broadcast (``host_panels``) and the stripe's product spans several k panels,
    the product of the panel being added to the stripe's sum, or for dtypes numpy sums over
    all of k at once (``sums_whole_k``) A's pieces joined."""
    res, acc = np.dtype(grid.dtype), np.dtype(grid.acc_dtype)
    extra = stripe * nj * res.itemsize if res != acc else 0
    if direct_writes:
        extra += bounce_bytes((stripe if grid.cols == 1 else 1) * nj * res.itemsize)
    if host_panels == "broadcast":
        panels = set(grid.a_k_edges[0]) | set(grid.b_k_edges[0])
        if sums_whole_k(res):
            extra += stripe * grid.k * acc.itemsize if grid.cols > 1 else 0
        elif len(panels) > 2:
            extra += stripe * nj * acc.itemsize
    return extra


def _kept_edges(g: GridPlan, stripe_edges, forced) -> tuple[tuple[int, ...], ...]:
    """``stripe_edges`` as a plan lists them, refused (``ValueError``) unless a forced grid's
    rows of C are cut by them, in order."""
    kept = tuple(tuple(int(e) for e in row) for row in stripe_edges)
    if forced is None or len(kept) != g.rows or any(
            len(row) < 2 or (row[0], row[-1]) != (r0, r1) or
            any(b < a for a, b in zip(row, row[1:]))
            for row, r0, r1 in zip(kept, g.row_edges, g.row_edges[1:])):
        raise ValueError(f"stripe edges that do not cut the {g.rows} x {g.cols} grid's rows "
                         f"of C ({list(g.row_edges)})")
    return kept


def plan_batch(m: int, n: int, k: int, dtype="float64", *, ranks: int,
               memory: int | None = None, stripes: int = STRIPES_PER_RANK,
               grid: tuple[int, int] | None = None, whole_rows: bool = False,
               stripe_bytes: int | None = None, budget: int | None = None,
               host_panels: str | None = None, direct_writes: bool = False,
               stripe_edges=None) -> BatchPlan:
    """Plan a batch product on ``ranks`` ranks.

    Parameters
    ----------
    m, n, k : int
    dtype : dtype
        numpy's result dtype.
    ranks : int
    memory : int, optional
        Bytes one rank may hold (its GPU's, or host memory for CPU ranks); ``None``: no limit.
    stripes : int
        Stripes per rank's C block (fewer when a block has fewer rows; more when two stripes
        would not fit ``memory``, down to ``MIN_STRIPE_ROWS`` rows each).
    grid : (rows, cols), optional
        Force the process grid.
    whole_rows : bool
        Prefer ``ranks x 1`` (each rank's C block whole rows: one contiguous range of a
        C-ordered file, written directly; every rank holds all of B) when B and two stripes
        fit ``memory`` and ``m >= ranks``; otherwise the grid ``distmm.grid.make_grid`` picks
        (where ``budget`` refuses both, its refusal names the smaller least of the two).
    stripe_bytes : int, optional
        More stripes where one would hold more than this many bytes of C (a resumable run
        passes ``RESUME_STRIPE_BYTES``).
    budget : int, optional
        Bytes one rank may hold by ``distmm.memory-budget`` (CPU ranks), as ``memory`` (the
        lower of the two where both are given) but refused with a ``MemoryError``.
    host_panels : str, optional
        CPU ranks: how they get their panels (``"read"``, ``"share"`` or ``"broadcast"``,
        ``batch_panels``), so that ``held_bytes`` counts what their host products add
        (``_host_extra``); None: GPU ranks (the device's memory).
    direct_writes : bool
        CPU ranks: their writers write C past the page cache (``distmm.direct-writes`` and a
        ``.npy`` or HDF5 output), so that ``held_bytes`` counts their aligned buffers.
    stripe_edges : sequence of sequences of int, optional
        With ``grid``: the stripes a stopped run kept (``--resume``), planned as they are
        (``stripes``, ``stripe_bytes`` and the narrowing that ``memory`` or ``budget`` would
        make are not applied; what they hold is refused as below).

    Raises
    ------
    ValueError
        Negative sizes, a forced grid that is not ``ranks``, a column panel of B
        (``k x n / cols``) that does not fit ``memory`` with two stripes of the narrowest
        width (the message says how much one rank needs), more stripes or first-stripe
        k steps than ``MAX_BATCH_EDGES`` (told from the sizes, before any is listed), or
        ``stripe_edges`` that do not cut the grid's rows of C.
    MemoryError
        What one rank holds with stripes of the narrowest width (or with ``stripe_edges``)
        is more than ``budget`` (the message names the budget and that least; the error's
        ``least`` is it in bytes, but for ``stripe_edges``).

    Examples
    --------
    >>> p = plan_batch(32768, 32768, 32768, "float32", ranks=4)
    >>> p.grid.shape, p.stripes, len(p.panels) - 1
    ((1, 2, 2), 8, 2)
    >>> p.stripe_edges[1][:3]
    (16384, 18432, 20480)
    >>> plan_batch(32768, 32768, 32768, "float32", ranks=4, whole_rows=True).grid.shape
    (1, 4, 1)
    """
    if stripes < 1:
        raise ValueError(f"stripes must be at least 1, got {stripes}")
    rows_refused = None  # the budget's refusal of whole rows, where they were tried
    if whole_rows and grid is None and ranks > 1 and m >= ranks:
        try:
            return plan_batch(m, n, k, dtype, ranks=ranks, memory=memory, stripes=stripes,
                              grid=(ranks, 1), stripe_bytes=stripe_bytes, budget=budget,
                              host_panels=host_panels, direct_writes=direct_writes)
        except ValueError:  # B does not fit one rank: the grid below shares it
            pass
        except MemoryError as exc:
            rows_refused = exc
    limit = memory if budget is None else budget if memory is None else min(memory, budget)
    forced = None if grid is None else (1, int(grid[0]), int(grid[1]))
    g = make_grid(m, n, k, dtype, ranks=ranks, grid=forced, k_split=False)
    kept = None if stripe_edges is None else _kept_edges(g, stripe_edges, forced)
    counts, widths, held = [], [], [0] * g.ranks
    widest = max(g.col_edges[j + 1] - g.col_edges[j] for j in range(g.cols))  # of C's columns
    for i in range(g.rows):
        mi = g.row_edges[i + 1] - g.row_edges[i]
        if kept is not None:
            counts.append(len(kept[i]) - 1)
            widths.append(max(b - a for a, b in zip(kept[i], kept[i][1:])))
            for j in range(g.cols):
                held[g.rank_at(0, i, j)] = _held(g, i, j, widths[i], host_panels, direct_writes)
            continue
        count = stripes
        if stripe_bytes:
            count = max(count, -(-mi * widest * np.dtype(g.dtype).itemsize // int(stripe_bytes)))
        count = max(1, min(count, mi))
        if limit is not None:
            while True:
                width = math.ceil(mi / count) if mi else 0
                need = max(_held(g, i, j, width, host_panels, direct_writes)
                           for j in range(g.cols))
                if need <= limit or width <= MIN_STRIPE_ROWS or width <= 1:
                    break
                count *= 2
        counts.append(count)
        widths.append(-(-mi // count))  # the widest of even_edges(mi, count), before listed
        for j in range(g.cols):
            held[g.rank_at(0, i, j)] = _held(g, i, j, widths[i], host_panels, direct_writes)
    worst = max(range(g.ranks), key=held.__getitem__)
    if budget is not None and held[worst] > budget:
        _, i, _ = g.coords(worst)
        width = widths[i]
        if rows_refused is not None and rows_refused.least < held[worst]:
            raise rows_refused  # the least of the grids tried: a budget that holds it runs
        if kept is not None:
            raise MemoryError(
                f"its kept stripes (of up to {width} rows, on {g.rows} x {g.cols} ranks) hold "
                f"{size_text(held[worst], 2)} on rank {worst}, more than the "
                f"distmm.memory-budget of {size_text(budget, 2)}: resume with a budget of at least "
                f"{size_text(held[worst], 2, up=True)}")
        refused = MemoryError(
            f"a {m} x {n} x {k} {np.dtype(dtype).name} batch product on {g.rows} x {g.cols} "
            f"ranks holds at least {size_text(held[worst], 2)} on rank {worst} (B's column "
            f"panel k x n/{g.cols} and stripes of A and C of {width} rows), more than its "
            f"distmm.memory-budget of {size_text(budget, 2)}: set a larger budget or use more "
            f"ranks")
        refused.least = held[worst]
        raise refused
    if memory is not None and max(held) > memory:
        raise ValueError(
            f"a {m} x {n} x {k} {np.dtype(dtype).name} product on {g.rows} x {g.cols} ranks needs "
            f"{max(held) / 2**30:.1f} GiB on rank {worst} (B's column panel k x n/{g.cols} and two "
            f"stripes), more than the {memory / 2**30:.1f} GiB it has: use more ranks")
    chunk_rows = max(1, B_CHUNK_BYTES // max(1, widest * g.itemsize))
    step = chunk_rows * FIRST_STEP_CHUNKS
    for what, listed in (("stripes", sum(counts)),
                         (f"first-stripe k steps of {step} rows", -(-k // step))):
        if listed > MAX_BATCH_EDGES:
            raise ValueError(
                f"a {m} x {n} x {k} {np.dtype(dtype).name} batch product on {g.rows} x {g.cols} "
                f"ranks has {listed:.3g} {what}; a batch plan lists at most {MAX_BATCH_EDGES}")
    edges = kept or tuple(tuple(r0 + e for e in even_edges(r1 - r0, count))
                          for r0, r1, count in zip(g.row_edges, g.row_edges[1:], counts))
    panels = tuple(sorted(set(g.a_k_edges[0]) | set(g.b_k_edges[0])))
    first = tuple(sorted(set(panels) | set(range(0, k, step))))
    return BatchPlan(grid=g, stripe_edges=edges, panels=panels, held_bytes=tuple(held),
                     chunk_rows=chunk_rows, first_panels=first)


def batch_panels(choice: str = "auto", *, hosts: int = 1, on_gpu: bool = False) -> str:
    """How the ranks of a batch job get their panels, from ``distmm.batch-panels``'s
    ``choice``: ``"read"`` (each rank reads every piece of A's stripes and B's column panel
    it needs), ``"share"`` (GPU ranks that read: B's column panel read in shares and copied
    between the GPUs) or ``"broadcast"`` (each rank reads its own block; the rest comes by
    broadcast). ``auto`` reads where all ``hosts`` are one (an emulated node counts as a host
    of its own), sharing on GPUs, and broadcasts across hosts; ``share`` reads on CPU ranks
    and across hosts (the shares are copied between the GPUs of one host).

    >>> batch_panels(hosts=1), batch_panels(hosts=1, on_gpu=True), batch_panels(hosts=2)
    ('read', 'share', 'broadcast')
    """
    if choice not in PANEL_CHOICES:
        raise ValueError(f"batch-panels must be one of {', '.join(PANEL_CHOICES)}, "
                         f"got {choice!r}")
    if int(hosts) != hosts or hosts < 1:
        raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
    direct = hosts == 1 if choice == "auto" else choice in ("read", "share")
    if not direct:
        return "broadcast"
    # B's shares are copied between the GPUs of one host (CUDA IPC): across hosts, read
    return "share" if on_gpu and choice in ("share", "auto") and hosts == 1 else "read"


def b_fits_host(k: int, n: int, dtype, *, ranks: int, available: int | None) -> bool:
    """Whether every CPU rank may hold all of B (whole rows of C): ``ranks`` copies of it in
    the accumulation dtype take at most half of ``available``, the host memory the rank
    with the least has (``None``: no limit)."""
    need = k * n * np.dtype(accumulate_dtype(np.dtype(dtype))).itemsize * ranks
    return available is None or need <= int(available) // 2


@dataclass(frozen=True)
class BatchSetup:
    """What a batch job runs (``decide_batch``): ``plan``, and ``panels``, how its ranks get
    their panels (``"read"``, ``"share"`` or ``"broadcast"``: ``batch_panels``)."""

    plan: BatchPlan
    panels: str

    @property
    def direct(self) -> bool:
        """Whether each rank reads every panel it needs itself (``read`` or ``share``)."""
        return self.panels != "broadcast"

    def reads(self, rank: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """``((r0, r1, k0, k1), (k0, k1, c0, c1))``: the rectangles of A and of B ``rank``
        reads from the files itself (A stripe by stripe; the rest of each stripe and of B's
        column panel comes from the other ranks, by broadcast or by a copy between GPUs)."""
        g = self.plan.grid
        _, i, j = g.coords(rank)
        r0, r1, c0, c1 = g.row_edges[i], g.row_edges[i + 1], g.col_edges[j], g.col_edges[j + 1]
        if not self.direct:
            a_k, b_k = g.a_k_edges[0], g.b_k_edges[0]
            return (r0, r1, a_k[j], a_k[j + 1]), (b_k[i], b_k[i + 1], c0, c1)
        k0, k1 = 0, g.k
        if self.panels == "share" and g.rows > 1 and g.k and c1 > c0:  # a share of the panel
            edges = even_edges(g.k, g.rows)
            k0, k1 = edges[i], edges[i + 1]
        return (r0, r1, 0, g.k), (k0, k1, c0, c1)

    def describe(self, most: int = 16) -> list[str]:
        """Lines for ``distmm plan --ranks``: the grid, the stripes and what each rank reads
        (the first ``most`` ranks and the last)."""
        p, g = self.plan, self.plan.grid
        how = {"read": "each rank reads all it needs",
               "share": "B's column panels read in shares and copied between the GPUs",
               "broadcast": "each rank reads its own block, the rest comes by broadcast"}
        lines = [f"grid       {g.rows} x {g.cols} ranks (rows x cols)"
                 + (", whole rows of C each" if g.cols == 1 and g.ranks > 1 else "")
                 + f"; panels {self.panels}: {how[self.panels]}",
                 f"stripes    {p.stripes} per rank at most; held per rank at most "
                 f"{size_text(max(p.held_bytes), 2)}"]
        shown = list(range(min(g.ranks, most)))
        if g.ranks > most:
            shown.append(g.ranks - 1)
        for rank in shown:
            if rank == g.ranks - 1 and rank > most:
                lines.append(f"           ranks {most} to {g.ranks - 2} not listed")
            _, i, j = g.coords(rank)
            (ar0, ar1, ak0, ak1), (bk0, bk1, bc0, bc1) = self.reads(rank)
            rows = [b - a for a, b in zip(p.stripe_edges[i], p.stripe_edges[i][1:])]
            count = len(rows)
            c = (f"C[{g.row_edges[i]}:{g.row_edges[i + 1]}, {g.col_edges[j]}:"
                 f"{g.col_edges[j + 1]}]")
            if not max(rows) or bc1 == bc0:
                lines.append(f"rank {rank:<6}{c}: nothing to compute")
                continue
            height = f"{max(rows)}" if min(rows) == max(rows) else f"{min(rows)}-{max(rows)}"
            lines.append(f"rank {rank:<6}{c} in {count} stripe{'s' if count != 1 else ''} of "
                         f"{height} row{'s' if max(rows) != 1 else ''}; reads A[{ar0}:{ar1}, "
                         f"{ak0}:{ak1}], B[{bk0}:{bk1}, {bc0}:{bc1}]")
        return lines


def decide_batch(m: int, n: int, k: int, dtype="float64", *, ranks: int, hosts: int = 1,
                 on_gpu: bool = False, panels: str = "auto", memory: int | None = None,
                 host_memory: int | None = None, stripes: int = STRIPES_PER_RANK,
                 resume: bool = False, budget: int | None = None,
                 direct_writes: bool = False, grid: tuple[int, int] | None = None,
                 stripe_edges=None) -> BatchSetup:
    """What ``mpirun -n ranks distmm matmul`` runs for ``C[m, n] = A[m, k] @ B[k, n]``: how
    the ranks get their panels (``batch_panels``) and the plan, whole rows of C per rank
    where they read their panels and B fits (GPU ranks: ``memory``; CPU ranks: half of
    ``host_memory`` for all ranks' copies of B, ``b_fits_host``, and ``budget``), else the
    grid ``plan_batch`` picks. CPU ranks hold at most ``budget`` each (what ``held_bytes``
    counts, with their host products' share): more stripes where it needs them.

    Parameters
    ----------
    m, n, k : int
    dtype : dtype
        numpy's result dtype.
    ranks, hosts : int
        The job's ranks and the hosts they run on (an emulated node counts as a host).
    on_gpu : bool
        GPU ranks (else CPU ranks).
    panels : str
        ``distmm.batch-panels`` (``PANEL_CHOICES``).
    memory : int, optional
        Bytes a GPU rank may hold (the least of any rank); ``None``: no limit, as for CPU
        ranks.
    host_memory : int, optional
        The available host memory of the rank with the least (CPU ranks); ``None``: no limit.
    stripes : int
        ``distmm.batch-stripes``.
    resume : bool
        A ``--resume`` run: stripes of at most ``RESUME_STRIPE_BYTES`` of C.
    budget : int, optional
        ``distmm.memory-budget`` given as a size: the bytes one CPU rank may hold (per rank,
        whatever threads its BLAS runs); ``None`` (``auto``): no limit but ``host_memory``'s
        on whole rows. GPU ranks plan with ``memory`` alone.
    direct_writes : bool
        CPU ranks write C past the page cache (``plan_batch``'s).
    grid, stripe_edges : optional
        A stopped run's grid ``(rows, cols)`` and the stripes it kept, which a ``--resume``
        run takes on (``plan_batch``'s).

    Raises
    ------
    ValueError
        As ``plan_batch`` and ``batch_panels``.
    MemoryError
        CPU ranks would hold more than ``budget`` with stripes of the narrowest width
        (``plan_batch``).

    Examples
    --------
    >>> decide_batch(400, 400, 400, ranks=4).plan.grid.shape
    (1, 4, 1)
    >>> s = decide_batch(400, 400, 400, ranks=4, hosts=2)
    >>> s.panels, s.plan.grid.shape
    ('broadcast', (1, 2, 2))
    """
    mode = batch_panels(panels, hosts=hosts, on_gpu=on_gpu)
    rows = mode != "broadcast" and (on_gpu or b_fits_host(k, n, dtype, ranks=ranks,
                                                          available=host_memory))
    plan = plan_batch(m, n, k, dtype, ranks=ranks, memory=memory, stripes=stripes, grid=grid,
                      whole_rows=rows, stripe_bytes=RESUME_STRIPE_BYTES if resume else None,
                      budget=None if on_gpu else budget, host_panels=None if on_gpu else mode,
                      direct_writes=direct_writes and not on_gpu, stripe_edges=stripe_edges)
    return BatchSetup(plan=plan, panels=mode)
