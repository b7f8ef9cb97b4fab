"""The tiling planner: pure functions and frozen dataclasses.

This module covers: the dtype rules of a product (numpy's result dtype, the
dtype tiles are accumulated in, and which precision modes a dtype takes:
``check_precision``; ``distmm.precision`` describes the modes and their bounds), the tile grid with ragged edges, the owner of
each C tile, the k-split with its fixed reduction tree, and estimates of flops,
bytes moved and peak memory per worker.

It does *not* cover: running anything, reading files, or talking to a runtime.
It imports numpy only: no dask, cupy or mpi4py, so every engine can consume a
``Plan`` and none recomputes tile arithmetic.

See also: ``distmm.engine`` (runs a plan), ``distmm.api`` (makes one).
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Plan",
    "make_plan",
    "split_edges",
    "reduction_tree",
    "result_dtype",
    "ufunc_dtype",
    "multiplies",
    "accumulate_dtype",
    "sums_whole_k",
    "DEFAULT_MEMORY_BUDGET",
    "tile_for_chunks",
    "np_dtype",
    "PRECISIONS",
    "check_precision",
]

DEFAULT_MEMORY_BUDGET = 2 * 1024**3  # bytes per worker for operand tiles and partials
_MIN_TILE = 64


_NP_DTYPES: dict[str, np.dtype] = {}


def np_dtype(name: str) -> np.dtype:
    """``np.dtype(name)`` for the dtype names a ``Plan`` keeps (``plan.dtype``,
    ``plan.acc_dtype``), looked up in a table instead of parsed on every call."""
    try:
        return _NP_DTYPES[name]
    except KeyError:
        return _NP_DTYPES.setdefault(name, np.dtype(name))


#: the names ``precision=`` takes (``distmm.precision`` describes the modes)
PRECISIONS = ("highest", "tf32", "bf16", "fp16")


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ``ml_dtypes.bfloat16`` (told by name: distmm does not
    import ml_dtypes; whoever holds a bfloat16 array has it)."""
    return np.dtype(dtype).name == "bfloat16"


#: ml_dtypes' integers narrower than a byte: numpy's matmul casts them to int8 (the first of
#: its integer loops they cast to safely) and sums with wrap-around, as distmm sums integers
_NARROW_INTS = frozenset(("int1", "uint1", "int2", "uint2", "int4", "uint4"))


def is_narrow_int(dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' integers narrower than a byte (``int4``,
    ``uint4``, ``int2``...; told by name, as ``is_bfloat16``)."""
    dt = np.dtype(dtype)
    return dt.kind not in "iu" and dt.name in _NARROW_INTS


def is_minifloat(dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' floats narrower than bfloat16 (``float8_*``,
    ``float6_*``, ``float4_*``; ``float8_e5m2``'s kind is ``'f'``). numpy's matmul casts
    them to float32 (its result dtype with them), and so do distmm's panels: a float32
    product, as for bfloat16 operands, without numpy's bits (its BLAS's summation order)."""
    return np.dtype(dtype).name.startswith(("float8_", "float6_", "float4_"))


def multiplies(dtype) -> bool:
    """Whether distmm multiplies operands of ``dtype``: boolean, numeric (bfloat16 and
    ml_dtypes' narrow integers and narrow floats too, but ``float8_e5m2``:
    ``_ufunc_dtype``) or object."""
    dt = np.dtype(dtype)
    if is_minifloat(dt):
        return dt.kind != "f"
    return dt.kind in "biufcO" or is_bfloat16(dt) or is_narrow_int(dt)


def reduced_applies(result_dtype) -> bool:
    """Whether a reduced mode applies to a product of this numpy result dtype."""
    dt = np.dtype(result_dtype)
    return dt in (np.float32, np.float16) or is_bfloat16(dt)


def check_precision(precision, result_dtype=None, *, what: str = "matmul") -> str:
    """Return ``precision`` checked, for a product of numpy result dtype ``result_dtype``.

    Parameters
    ----------
    precision : str
        One of ``PRECISIONS`` (any case).
    result_dtype : dtype, optional
        numpy's result dtype of the product; ``None`` checks the name only.
    what : str
        The call named in the message.

    Returns
    -------
    str
        The mode, lower case.

    Raises
    ------
    ValueError
        A name that is not one of ``PRECISIONS``.
    TypeError
        A reduced mode for a result dtype it does not apply to.

    Examples
    --------
    >>> check_precision("TF32", np.float32)
    'tf32'
    """
    if precision == "highest":  # the default, on every call
        return precision
    if not isinstance(precision, str) or precision.lower() not in PRECISIONS:
        raise ValueError(f"{what}: precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    precision = precision.lower()
    if precision != "highest" and result_dtype is not None and not reduced_applies(result_dtype):
        raise TypeError(f"{what}: precision={precision!r} needs a float32, float16 or bfloat16 "
                        f"product, but the operands' result dtype is {np.dtype(result_dtype)}; "
                        f"use precision='highest'")
    return precision


def result_dtype(a_dtype: np.dtype, b_dtype: np.dtype) -> np.dtype:
    """Return the dtype numpy's ``matmul`` gives for these operand dtypes
    (remembered per pair of dtypes; see ``_result_dtype``)."""
    a_dtype, b_dtype = np.dtype(a_dtype), np.dtype(b_dtype)
    # dtype('q') == dtype('l') and they hash alike, but numpy keeps the type
    # (np.longlong vs np.int64): the character code is part of the key.
    return _result_dtype(a_dtype, a_dtype.char, b_dtype, b_dtype.char)


@functools.lru_cache(maxsize=256)
def _result_dtype(a_dtype: np.dtype, a_char: str, b_dtype: np.dtype, b_char: str) -> np.dtype:
    """Return the dtype numpy's ``matmul`` gives for these operand dtypes.

    Raises
    ------
    TypeError
        numpy's own (``UFuncTypeError``) for dtypes matmul has no loop for (strings,
        bytes, datetimes, timedeltas, structured types); a plain TypeError for a
        dtype numpy multiplies and distmm does not (``float8_e5m2``). Object arrays are
        accepted as numpy accepts them (Python ints, Fractions, Decimals multiply exactly)."""
    return ufunc_dtype(a_dtype, b_dtype)


def ufunc_dtype(a_dtype, b_dtype, *, dtype=None, out_dtype=None, casting="same_kind",
                order="K") -> np.dtype:
    """The dtype numpy's ``matmul`` computes in for these operand dtypes and its ``dtype=``,
    ``casting=`` and ``order=`` keywords, having checked that the result casts to
    ``out_dtype``.

    numpy's own type resolution, applied to empty operands: the only source of truth for
    mixed signed/unsigned, float16 and complex cases, and the source of numpy's own
    exceptions (``UFuncTypeError`` and its kin, a ValueError for an unknown ``casting``),
    raised in numpy's order: the loop, then the inputs' and the output's casts.
    """
    a_dtype, b_dtype = np.dtype(a_dtype), np.dtype(b_dtype)
    out_dtype = None if out_dtype is None else np.dtype(out_dtype)
    try:
        return _ufunc_dtype(a_dtype, a_dtype.char, b_dtype, b_dtype.char, dtype, out_dtype,
                            None if out_dtype is None else out_dtype.char, casting, order)
    except TypeError as exc:
        if "unhashable" not in str(exc):
            raise
        return _ufunc_dtype.__wrapped__(a_dtype, a_dtype.char, b_dtype, b_dtype.char, dtype,
                                        out_dtype, None, casting, order)


@functools.lru_cache(maxsize=256)
def _ufunc_dtype(a_dtype, a_char, b_dtype, b_char, dtype, out_dtype, out_char, casting, order):
    kw = {"casting": casting, "order": order, **({} if dtype is None else {"dtype": dtype})}
    empty_a, empty_b = np.empty((1, 0), a_dtype), np.empty((0, 1), b_dtype)
    with _quiet_complex_casts(casting):
        res = np.matmul(empty_a, empty_b, **kw).dtype
        if out_dtype is not None:
            np.matmul(empty_a, empty_b, out=np.empty((1, 1), out_dtype), **kw)
    for name, dt in (("a", a_dtype), ("b", b_dtype)):
        if dt.kind == "f" and is_minifloat(dt):
            # distributed sends a kind 'f' array's dtype as its str, '<f1', which numpy does
            # not read back: a Dask product of float8_e5m2 blocks hung
            raise TypeError(f"distmm does not multiply {dt} operands ({name} has dtype {dt}): "
                            f"Dask cannot send them; cast them to float32 (exact) first")
        if not multiplies(dt):
            raise TypeError(f"matmul needs boolean or numeric operands; {name} has dtype {dt}")
    return res


_WARNINGS_LOCK = threading.Lock()


@contextlib.contextmanager
def _quiet_complex_casts(casting):
    """Around ``_ufunc_dtype``'s probes: numpy's ComplexWarning for a complex to real cast
    comes from the casts of the values, not from the probe's. Only ``casting="unsafe"``
    allows such a cast, so only then are the process-wide warning filters swapped
    (``warnings.catch_warnings``, which is not thread-safe: two swaps that overlap lose
    another thread's recorded warnings or leave an "ignore" in force), one probe at a time."""
    if casting != "unsafe":
        yield
        return
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        yield


def matmul_shapes(a_shape: tuple, b_shape: tuple, *, a_name: str = "a", b_name: str = "b",
                  what: str = "") -> tuple[tuple[int, ...], int, int, int]:
    """numpy's shape rules for ``a @ b`` of operands of at least one dimension: a 1-D
    operand is a vector, stacked axes broadcast. Returns ``(batch, m, n, k)``; a
    ValueError naming both operands (``a_name``, ``b_name``) where numpy refuses, its
    message after ``what: `` when ``what`` is given."""
    prefix = f"{what}: " if what else ""
    a2 = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    if a2[-1] != b2[-2]:
        raise ValueError(f"{prefix}inner dimensions differ: {a_name} has shape {a_shape}, "
                         f"{b_name} has shape {b_shape} ({a2[-1]} != {b2[-2]})")
    try:
        batch = () if len(a2) == len(b2) == 2 else np.broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError:
        raise ValueError(f"{prefix}batch dimensions do not broadcast: {a_name} has shape "
                         f"{a_shape}, {b_name} has shape {b_shape}") from None
    return tuple(batch), a2[-2], b2[-1], a2[-1]


def accumulate_dtype(dtype: np.dtype) -> np.dtype:
    """Return the dtype tiles are computed and reduced in, for a result dtype.

    Integers accumulate in 64 bits and wrap: modular sums commute with the final
    narrowing cast, so the result is bit-identical to numpy's wrap-around.
    Booleans accumulate as counts (``any`` of ``a & b`` is ``count > 0``);
    float16 accumulates in float32, as numpy's half loop does.
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "b" or dtype.kind == "i":
        return np.dtype(np.int64)
    if dtype.kind == "u":
        return np.dtype(np.uint64)
    if dtype == np.float16 or is_bfloat16(dtype):
        return np.dtype(np.float32)
    return dtype


def sums_whole_k(dtype) -> bool:
    """Whether numpy sums each element of a ``dtype`` result over all of k in one ascending
    sum that partial sums over k groups, added afterwards, do not reproduce: its half loop's
    float32 sum for float16 (1 ulp apart, measured), its loop without BLAS for long double
    and complex long double (the last bits), and its object loop's sum of Python objects
    (any float's last bits). Such products keep k whole on every engine."""
    dtype = np.dtype(dtype)
    return dtype == np.float16 or dtype.kind == "O" or dtype.char in "gG"


#: tiles a plan lists along one axis (its edges are tuples of Python ints, ~36 bytes each):
#: more failed deep in the planner with a bare MemoryError
MAX_EDGES = 2**24

#: C tiles a plan lists (its owners and tasks, one Python object or more each): a product
#: of more, such as a broadcast 1-column by 1-row one of 10**8 each way, took minutes in
#: the planner before its result could be refused
MAX_TILES = 2**24

#: the most workers (or MPI ranks, or devices) a plan is made for: more than any machine runs
#: processes of one product, and the planners' lists per worker and per grid shape stay small
MAX_WORKERS = 2**17


def split_edges(length: int, tile: int) -> tuple[int, ...]:
    """Return the edges ``0 = e0 < e1 < ... = length`` of tiles of at most ``tile``.

    The last tile is ragged; nothing is padded. ``length == 0`` gives ``(0,)``,
    a grid of no tiles.
    """
    if tile < 1:
        raise ValueError(f"tile size must be positive, got {tile}")
    return tuple(range(0, length, tile)) + (length,) if length else (0,)


def reduction_tree(count: int) -> tuple[tuple[int, int], ...]:
    """Return the fixed pairwise reduction order of ``count`` partial products.

    Each step ``(dst, src)`` means ``partial[dst] += partial[src]``; after all
    steps ``partial[0]`` holds the sum. The tree is balanced (stride 1, 2, 4,
    ...), so its depth is ``ceil(log2(count))`` and its order is the same on
    every engine and every run: a plan's result is bitwise reproducible.
    """
    steps = []
    stride = 1
    while stride < count:
        for dst in range(0, count - stride, 2 * stride):
            steps.append((dst, dst + stride))
        stride *= 2
    return tuple(steps)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Plan:
    """A frozen tiling of ``C[m, n] = A[m, k] @ B[k, n]``.

    Attributes
    ----------
    m, n, k : int
        The problem.
    dtype : str
        numpy's result dtype.
    acc_dtype : str
        The dtype tiles are computed and reduced in (see ``accumulate_dtype``).
    tile : tuple of int
        ``(tm, tn, tk)``: C tiles are ``tm x tn``; ``tk`` is the k-blocking the
        executor uses inside a task.
    row_edges, col_edges : tuple of int
        Tile boundaries of C along m and n; ragged at the end.
    k_edges : tuple of int
        Boundaries of the k-split groups. One group means no split; with more,
        each C tile has one partial product per group, summed along
        ``reduction``.
    reduction : tuple of (int, int)
        The fixed tree over the k groups (``reduction_tree``).
    workers : int
        How many workers the plan was made for.
    owners : tuple of tuple of int
        ``owners[i][j]`` is the worker that owns C tile ``(i, j)`` and does its
        reduction; partial products of a split tile go round-robin from there.
    precision : str
        ``distmm.precision``'s mode: ``"highest"`` (exact for the dtype) or a
        reduced tensor-core mode (``"tf32"``, ``"bf16"``, ``"fp16"``) that every
        executor applies to the panels it multiplies (``tile_partial``).
    """

    m: int
    n: int
    k: int
    dtype: str
    acc_dtype: str
    tile: tuple[int, int, int]
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    k_edges: tuple[int, ...]
    reduction: tuple[tuple[int, int], ...]
    workers: int
    owners: tuple[tuple[int, ...], ...] = field(repr=False)
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    precision: str = "highest"

    # -- grid ---------------------------------------------------------------
    @property
    def grid(self) -> tuple[int, int]:
        """Number of C tiles along m and n."""
        return len(self.row_edges) - 1, len(self.col_edges) - 1

    @property
    def k_splits(self) -> int:
        """Number of k groups (1 when k is not split)."""
        return max(len(self.k_edges) - 1, 1)

    @functools.cached_property
    def single_task(self) -> bool:
        """One C tile and one k group: the whole product is one task (worked
        out once per plan; the local engine asks on every call)."""
        return self.grid == (1, 1) and self.k_splits == 1

    def row_slice(self, i: int) -> slice:
        return slice(self.row_edges[i], self.row_edges[i + 1])

    def col_slice(self, j: int) -> slice:
        return slice(self.col_edges[j], self.col_edges[j + 1])

    def k_slice(self, s: int) -> slice:
        if len(self.k_edges) < 2:
            return slice(0, 0)
        return slice(self.k_edges[s], self.k_edges[s + 1])

    def tiles(self):
        """Yield every C tile index ``(i, j)`` in row-major order."""
        gm, gn = self.grid
        for i in range(gm):
            for j in range(gn):
                yield i, j

    def owner_of_tile(self, i: int, j: int) -> int:
        return self.owners[i][j]

    def owner_of_partial(self, i: int, j: int, s: int) -> int:
        """Worker computing the partial product of k group ``s`` of tile (i, j)."""
        return (self.owners[i][j] + s) % self.workers

    # -- estimates ------------------------------------------------------------
    @property
    def flops(self) -> int:
        """Multiply-adds counted as two flops: ``2 m n k``."""
        return 2 * self.m * self.n * self.k

    @property
    def itemsize(self) -> int:
        return np.dtype(self.acc_dtype).itemsize

    @property
    def bytes_moved(self) -> int:
        """Bytes of operand tiles sent to tasks plus partials and C written.

        Each task reads its A row panel and B column panel for its k group;
        split tiles also move ``k_splits - 1`` partials to their owner.
        """
        gm, gn = self.grid
        size = self.itemsize
        a = gn * self.m * self.k * size
        b = gm * self.n * self.k * size
        c = self.m * self.n * size
        partials = (self.k_splits - 1) * self.m * self.n * size
        return a + b + c + partials

    @property
    def peak_memory_per_worker(self) -> int:
        """Largest bytes one task holds: its A and B panels, its C tile, and the
        partials its owner keeps for the reduction (a tile larger than C holds C's size)."""
        tm, tn = min(self.tile[0], self.m), min(self.tile[1], self.n)
        kg = max((self.k_edges[s + 1] - self.k_edges[s] for s in range(self.k_splits)),
                 default=0) if len(self.k_edges) > 1 else 0
        size = self.itemsize
        return (tm * kg + kg * tn + tm * tn * (1 + (self.k_splits > 1))) * size

    def describe(self) -> str:
        """A human-readable summary (what ``distmm plan`` prints)."""
        gm, gn = self.grid
        tm, tn, tk = self.tile
        per_worker = [0] * self.workers
        for i, j in self.tiles():
            per_worker[self.owners[i][j]] += 1
        lines = [
            f"C[{self.m}, {self.n}] = A[{self.m}, {self.k}] @ B[{self.k}, {self.n}]"
            f"  dtype {self.dtype} (accumulate in {self.acc_dtype})"
            + ("" if self.precision == "highest" else f", precision {self.precision}"),
            f"tiles      {tm} x {tn} (k-block {tk}); grid {gm} x {gn} = {gm * gn} C "
            f"tile{'s' if gm * gn != 1 else ''}"
            f"; ragged edges m:{self.m % tm if gm else 0} n:{self.n % tn if gn else 0}",
            f"k-split    {self.k_splits} group(s); reduction tree depth "
            f"{math.ceil(math.log2(self.k_splits)) if self.k_splits > 1 else 0}"
            f" ({len(self.reduction)} addition{'s' if len(self.reduction) != 1 else ''} per tile)",
            f"workers    {self.workers}; C tiles per worker {per_worker}",
            f"flops      {self.flops:.3e}",
            f"bytes      {self.bytes_moved:.3e} moved to and from tasks",
            f"memory     {self.peak_memory_per_worker / 2**20:.1f} MiB peak per task"
            f" (budget {self.memory_budget / 2**20:.0f} MiB)",
        ]
        return "\n".join(lines)


def _owners(gm: int, gn: int, workers: int, order: str = "rows") -> tuple[tuple[int, ...], ...]:
    """Assign C tiles to workers: tile ``t`` in row-major order (``order="rows"``)
    or column-major order (``"cols"``) goes to worker ``t * workers // tiles``.
    Counts differ by at most one (balance), and each worker's tiles are a
    contiguous run of rows (sharing A row panels) or of columns (sharing B
    column panels); the Dask engine picks the order under which more of a
    worker's inputs are already on it.
    """
    if order not in ("rows", "cols"):
        raise ValueError(f"owner_order must be 'rows' or 'cols', got {order!r}")
    tiles = gm * gn
    if order == "rows":
        return tuple(
            tuple((i * gn + j) * workers // tiles for j in range(gn)) for i in range(gm)
        )
    return tuple(
        tuple((j * gm + i) * workers // tiles for j in range(gn)) for i in range(gm)
    )


def _choose_tile(m: int, n: int, k: int, workers: int, itemsize: int,
                 memory_budget: int) -> tuple[int, int, int]:
    """Pick square-ish C tiles big enough to amortise per-task overhead and
    small enough that every worker gets at least two tiles when the problem
    allows it, and that one task fits the memory budget."""
    tile = 2048
    while tile > _MIN_TILE:
        tiles = math.ceil(m / tile) * math.ceil(n / tile)
        if tiles >= 2 * workers:
            break
        tile //= 2
    # Shrink while one task's panels (k group of at most 4 * tile) overflow the budget.
    while tile > _MIN_TILE and (2 * tile * min(k, 4 * tile) + tile * tile) * itemsize > memory_budget:
        tile //= 2
    tm = min(tile, max(m, 1))
    tn = min(tile, max(n, 1))
    return tm, tn, 256


def make_plan(
    m: int,
    n: int,
    k: int,
    dtype: np.dtype | str = "float64",
    *,
    workers: int = 1,
    tile: int | tuple[int, int, int] | None = None,
    k_splits: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    owner_order: str = "rows",
    precision: str = "highest",
) -> Plan:
    """Plan ``C[m, n] = A[m, k] @ B[k, n]`` for ``workers`` workers.

    Parameters
    ----------
    m, n, k : int
        Problem sizes; zero is allowed.
    dtype : dtype
        numpy's result dtype of the product.
    workers : int
        Number of workers that will run tasks.
    tile : int or (tm, tn, tk), optional
        C tile size (and k-block). ``None`` lets the planner choose.
    k_splits : int, optional
        Force the number of k groups; ``None`` splits k only when there are
        fewer C tiles than workers and k is long (at least 4 k-blocks a group),
        or when one group's panels would not fit ``memory_budget``; never for
        float16 or object results, whose elements numpy sums over k in one
        ascending sum (a k group's panels may then exceed the budget).
    memory_budget : int
        Bytes one task may hold; it bounds the tile and the k group length.
        This pure planner reads no configuration: ``distmm.make_plan`` and
        ``distmm.matmul`` pass the configured budget (``distmm.config``).
    owner_order : {"rows", "cols"}
        Whether each worker owns a contiguous run of C tiles in row-major
        (default) or column-major order.
    precision : {"highest", "tf32", "bf16", "fp16"}
        The mode (``distmm.precision``), checked against ``dtype``; kept in
        the plan for the executors.

    Returns
    -------
    Plan

    Raises
    ------
    ValueError
        On negative sizes, a non-positive worker count or tile, an unknown
        owner order or precision.
    TypeError
        A reduced precision for a dtype it does not apply to.

    Examples
    --------
    >>> p = make_plan(1000, 900, 5000, "float64", workers=2, tile=512)
    >>> p.grid, p.k_splits
    ((2, 2), 1)
    """
    if isinstance(tile, list):
        tile = tuple(tile)
    args = (m, n, k, np.dtype(dtype), workers, tile, k_splits, memory_budget, owner_order,
            precision)
    try:
        return _cached_plan(*args)  # plans are frozen: the same request gives the same plan
    except TypeError:  # an unhashable argument: plan without the cache
        return _make_plan(*args)


@functools.lru_cache(maxsize=512)
def _cached_plan(*args) -> Plan:
    return _make_plan(*args)


def _make_plan(m, n, k, dtype, workers, tile, k_splits, memory_budget, owner_order,
               precision="highest") -> Plan:
    """``make_plan``'s work, with its arguments in order (see there)."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    m, n, k = int(m), int(n), int(k)
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)):
        raise TypeError(f"workers must be an integer, got {workers!r}")
    workers = int(workers)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers > MAX_WORKERS:
        raise ValueError(f"workers must be at most {MAX_WORKERS}, got {workers}")
    res = np.dtype(dtype)
    acc = accumulate_dtype(res)
    precision = check_precision(precision, res, what="make_plan")
    if tile is None:
        tm, tn, tk = _choose_tile(m, n, k, workers, acc.itemsize, memory_budget)
    elif isinstance(tile, (int, np.integer)):
        tm = tn = tk = int(tile)
    else:
        if not isinstance(tile, tuple) or not all(isinstance(t, (int, np.integer)) for t in tile):
            raise TypeError(f"tile must be an int or (tm, tn, tk) of ints, got {tile!r}")
        if len(tile) != 3:
            raise ValueError(f"tile must be an int or (tm, tn, tk), got {tile!r}")
        tm, tn, tk = (int(t) for t in tile)
    if min(tm, tn, tk) < 1:
        raise ValueError(f"tile sizes must be positive, got {(tm, tn, tk)}")

    edges = max(-(-m // tm), -(-n // tn), -(-k // tk))
    if edges > MAX_EDGES:
        raise MemoryError(f"a {m} x {n} x {k} product in tiles of {(tm, tn, tk)} has {edges:.3g} "
                          f"tiles along one axis; a plan lists at most {MAX_EDGES:.3g}")
    tiles = -(-m // tm) * -(-n // tn)
    if tiles > MAX_TILES:
        raise MemoryError(f"a {m} x {n} result in tiles of {tm} x {tn} has {tiles:.3g} tiles; a "
                          f"plan lists at most {MAX_TILES:.3g}")
    row_edges = split_edges(m, tm)
    col_edges = split_edges(n, tn)
    gm, gn = len(row_edges) - 1, len(col_edges) - 1
    if k_splits is None and sums_whole_k(res):
        k_splits = 1
    elif k_splits is None:
        k_splits = 1
        n_tiles = gm * gn
        if 0 < n_tiles < workers:
            k_splits = min(math.ceil(workers / n_tiles), k // (4 * tk))
        # A k group's panels must fit the budget too.
        panel_bytes = (tm + tn) * acc.itemsize
        if panel_bytes and k:
            k_splits = max(k_splits, math.ceil(k * panel_bytes / max(memory_budget // 2, 1)))
        k_splits = max(1, min(k_splits, math.ceil(k / tk) if k else 1))
    elif k_splits < 1:
        raise ValueError(f"k_splits must be at least 1, got {k_splits}")
    if k:
        # Groups are whole k-blocks, spread evenly; the last may be ragged.
        blocks = math.ceil(k / tk)
        k_splits = min(k_splits, blocks)
        k_edges = tuple(min(k, (blocks * s // k_splits) * tk) for s in range(k_splits)) + (k,)
    else:
        k_splits = 1
        k_edges = (0, 0)
    return Plan(
        m=m, n=n, k=k,
        dtype=res.name,
        acc_dtype=acc.name,
        tile=(tm, tn, tk),
        row_edges=row_edges,
        col_edges=col_edges,
        k_edges=k_edges,
        reduction=reduction_tree(k_splits),
        workers=int(workers),
        owners=_owners(gm, gn, int(workers), owner_order),
        memory_budget=int(memory_budget),
        precision=precision,
    )


#: chunk sizes adopted as the C tile (outside this range: the planner's own tile)
CHUNK_TILE_RANGE = (64, 8192)
#: chunk-derived tiles are halved (rows first) until each worker has this many
TILES_PER_WORKER = 4
_MIN_SPLIT_TILE = 256


def _regular(chunks) -> int | None:
    """The chunk size of an axis chunked regularly (all equal, the last no larger)."""
    chunks = tuple(chunks)
    if not chunks:
        return None
    first = chunks[0]
    if all(c == first for c in chunks[:-1]) and chunks[-1] <= first:
        return int(first)
    return None


def tile_for_chunks(m: int, n: int, k: int, dtype, a_row_chunks, b_col_chunks,
                    workers: int = 1) -> tuple[int, int, int] | None:
    """The C tile for operands chunked along m (A's rows) and n (B's columns).

    Regular chunks between 64 and 8192 (or spanning the whole axis) become the
    tile, halved (rows first: a row slice of a C-ordered chunk is a view, a
    column slice a copy) until every worker has several tiles, so that a slow
    worker's tiles can be stolen. ``None``: irregular chunks, the planner
    chooses.

    Examples
    --------
    >>> tile_for_chunks(4096, 4096, 4096, "float64", (1024,) * 4, (1024,) * 4, workers=2)
    (1024, 1024, 256)
    """
    tm, tn = _regular(a_row_chunks), _regular(b_col_chunks)
    lo, hi = CHUNK_TILE_RANGE
    if not tm or not tn or not m or not n:
        return None
    tm, tn = min(tm, m), min(tn, n)
    if not (lo <= tm <= hi or tm == m) or not (lo <= tn <= hi or tn == n):
        return None

    def count(tm_, tn_):
        return math.ceil(m / tm_) * math.ceil(n / tn_)

    while count(tm, tn) < TILES_PER_WORKER * workers and tm % 2 == 0 and tm // 2 >= _MIN_SPLIT_TILE:
        tm //= 2
    while count(tm, tn) < TILES_PER_WORKER * workers and tn % 2 == 0 and tn // 2 >= _MIN_SPLIT_TILE:
        tn //= 2
    tk = make_plan(m, n, k, dtype, workers=1).tile[2]
    return (tm, tn, tk)
