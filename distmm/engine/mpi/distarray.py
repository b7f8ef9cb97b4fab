"""The distributed matrix: one local block per rank and the layout that says where the rest is.

This module covers: ``DistArray`` (a 2-D matrix split over the ranks of an
mpi4py communicator as a ``distmm.grid.BlockLayout`` says), its constructors
(from local blocks, from a replicated array, from a file each rank reads its
own part of), moving it to another layout (``redistribute``, one
``Alltoallv``; point-to-point pieces where a block passes what one MPI count holds),
``gather`` onto one rank or all, and ``to_file``. A Ctrl-C (``KeyboardInterrupt``) on one
rank in a collective constructor, ``redistribute`` or ``gather`` ends the job with one line
and status 130 (``MPI_Abort``): the other ranks would wait for that rank for ever.
It does *not* cover: the product (``distmm.engine.mpi.summa``), choosing grids
(``distmm.grid``), or file formats beyond reading and writing blocks
(``distmm.engine.mpi.io``).
"""
from __future__ import annotations

import hashlib
import math
import operator
import pickle

import numpy as np

from distmm._arrays import array_family
from distmm.engine.mpi import pieces
from distmm.engine.mpi.agree import agree
from distmm.engine.mpi.join import join
from distmm.grid import BlockLayout

__all__ = ["DistArray", "square_grid"]


def square_grid(ranks: int) -> tuple[int, int]:
    """The most square ``rows x cols`` factorisation of ``ranks`` (rows <= cols)."""
    rows = int(math.isqrt(ranks))
    while ranks % rows:
        rows -= 1
    return rows, ranks // rows


def _xp(x):
    """The array module of ``x``'s family: cupy for cupy arrays, numpy for the rest."""
    if array_family(x) == "cupy":
        import cupy

        return cupy
    return np


def _file_mapped(x) -> bool:
    """Whether ``x`` is a numpy array whose memory is a mapped file (an ``np.memmap``, or a
    view of one or of an ``mmap.mmap``)."""
    import mmap

    while isinstance(x, (np.ndarray, memoryview)):
        if isinstance(x, np.memmap):
            return True
        x = x.obj if isinstance(x, memoryview) else x.base
    return isinstance(x, mmap.mmap)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _interrupt_ends_the_job(what: str):
    """Decorate a collective method: a ``KeyboardInterrupt`` in it (Ctrl-C, SIGINT at one
    rank) prints one line naming the rank and ``what``, and ends the job with status 130
    (``MPI_Abort``), where the communicator has other ranks: they would wait for this one in
    their next collective call for ever, and its own exit (``MPI_Finalize``) for them."""
    import functools
    import sys

    def decorate(fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                first = args[0] if args else None
                comm = first.comm if isinstance(first, DistArray) else \
                    kwargs.get("comm", args[2] if len(args) > 2 else None)
                comm = comm if comm is not None else _world()
                if comm.size == 1:
                    raise
                print(f"distmm: rank {comm.rank} of {comm.size} interrupted in {what}; "
                      f"calling MPI_Abort", file=sys.stderr, flush=True)
                comm.Abort(130)
                raise
        return collective
    return decorate


class DistArray:
    """A 2-D matrix distributed over the ranks of ``comm``, one block per rank.

    Parameters
    ----------
    local : ndarray or cupy.ndarray
        This rank's block, shape ``layout.local_shape(comm.rank)`` (``(0, 0)`` on ranks
        that own none). A cupy block stays on the GPU through products and
        ``redistribute``; ``gather`` and ``to_file`` copy it to the host.
    layout : BlockLayout
        Edges and owners of every block (the same on every rank).
    comm : mpi4py communicator

    Attributes
    ----------
    shape, dtype, ndim, layout, comm, local
    stats : dict
        Set on products: bytes this rank received, the grid, the estimate.

    Examples
    --------
    Under ``mpiexec -n 4``::

        a = DistArray.from_array(np.ones((1000, 500)))      # each rank keeps its block
        c = distmm.matmul(a, b)                              # a DistArray
        full = c.gather(root=0)                              # ndarray on rank 0, None elsewhere
    """

    ndim = 2

    def __init__(self, local, layout: BlockLayout, comm=None):
        self.comm = comm if comm is not None else _world()
        self.layout = layout
        expected = layout.local_shape(self.comm.rank)
        if tuple(local.shape) != expected:
            raise ValueError(f"rank {self.comm.rank}: local block has shape {tuple(local.shape)}, "
                             f"the layout gives it {expected}")
        self.local = local
        self.stats: dict = {}
        #: from_array's (shape, dtype, sample digest) of the array this rank was given, which
        #: every rank's must equal: compared by the first collective call that takes it
        self._given = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.local.dtype)

    def _host_local(self) -> np.ndarray:
        """The local block in host memory (a cupy block is copied; numpy as it is)."""
        return self.local.get() if hasattr(self.local, "__cuda_array_interface__") else self.local

    def _like_local(self, host: np.ndarray):
        """``host`` where the local block lives: copied to the device for a cupy block."""
        xp = _xp(self.local)
        return host if xp is np else xp.asarray(host)

    def __repr__(self) -> str:
        rows, cols = self.layout.blocks
        return (f"DistArray(shape={self.shape}, dtype={self.dtype}, blocks {rows} x {cols}, "
                f"rank {self.comm.rank} holds {tuple(self.local.shape)})")

    # -- constructors ---------------------------------------------------------
    @classmethod
    @_interrupt_ends_the_job("DistArray.from_array")
    def from_array(cls, x, comm=None, layout: BlockLayout | None = None) -> "DistArray":
        """From an array every rank holds (or can slice: a memmap, a zarr array,
        an h5py dataset, a cupy array): each rank keeps (reads) only its own block,
        a cupy block for a cupy array (on the array's device).
        The default layout is the most square grid of the ranks.
        A block of a memory-mapped file (``np.memmap``, ``np.load(mmap_mode=...)``, a view
        of one) is read into memory, so the file written again or truncated later leaves the
        DistArray as it was; a block of whole rows of a numpy array in memory may share its
        memory, as ``np.asarray`` shares it (copy the array first where it will change).

        Every rank must pass the same array, and every rank of ``comm`` must call this:
        what one rank refuses (an array that is not 2-D, a ragged list, a layout that does
        not fit) is raised on every rank, after one small exchange. The first collective
        call that takes the result (``distmm.matmul``, ``redistribute``, ``gather``,
        ``to_file``) compares the ranks' shapes, dtypes and layouts, and a sample of the
        values of numpy and cupy arrays and of nested lists (``agree.fingerprint``), and
        raises ``ValueError`` on every rank where they differ.

        Raises
        ------
        ValueError
            An array that is not 2-D (a ragged list: numpy's error), a layout for another
            shape or whose owners are not ranks of ``comm``.
        TypeError
            A ``layout`` that is not a ``BlockLayout``.
        """
        comm = comm if comm is not None else _world()
        dist, error = None, None
        try:  # refused on one rank: the others would wait for it in their next collective
            if array_family(x) != "cupy" and getattr(x, "ndim", None) is None:
                x = np.asarray(x)  # a list or a tuple: its values are compared too
            dist = cls.from_agreed(x, comm, layout)
            if _file_mapped(x) and np.may_share_memory(dist.local, x):
                # whole rows of a memory-mapped file: read them now, as from_file does (the
                # file written again would change the block, truncated end the rank: SIGBUS)
                dist.local = np.array(dist.local)
            values = b""
            if array_family(x) == "cupy" or isinstance(x, np.ndarray):
                from distmm.engine.mpi.agree import fingerprint

                values = fingerprint(x)
            dist._given = (tuple(dist.shape), dist.dtype, _digest(dist.layout), values)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            error = exc
        join(comm, "DistArray.from_array")
        agree(comm, error, (), into=set(), when="in DistArray.from_array")
        return dist

    @classmethod
    def from_agreed(cls, x, comm=None, layout: BlockLayout | None = None) -> "DistArray":
        """``from_array`` without its exchange and without recording what this rank was
        given, for callers that compare the ranks' arrays and agree on what one rank
        refuses themselves (the engine, ``distmm.matmul``)."""
        comm = comm if comm is not None else _world()
        xp = _xp(x)
        if getattr(x, "ndim", None) != 2:
            x = xp.asarray(x)
            if x.ndim != 2:
                raise ValueError(f"DistArray needs a 2-D array, got shape {x.shape}")
        if layout is None:
            layout = BlockLayout.grid(tuple(x.shape), *square_grid(comm.size))
        _layout_type(layout)
        if tuple(layout.shape) != tuple(x.shape):
            raise ValueError(f"layout is for shape {layout.shape}, the array has {tuple(x.shape)}")
        # an owner that is no rank of comm would hold a block no rank keeps
        _check_owners(layout, comm.size, "DistArray")
        r0, r1, c0, c1 = layout.local_bounds(comm.rank)
        block = xp.ascontiguousarray(x[r0:r1, c0:c1]) if r1 > r0 and c1 > c0 else \
            xp.empty((r1 - r0, c1 - c0), dtype=x.dtype)
        return cls(block, layout, comm)

    @classmethod
    @_interrupt_ends_the_job("DistArray.from_local")
    def from_local(cls, block, comm=None, *, grid: tuple[int, int] | None = None) -> "DistArray":
        """From the block each rank holds, on a ``rows x cols`` grid of ranks
        numbered row-major (default: the most square grid). Block shapes are
        exchanged once; blocks in a grid row must have equal heights and blocks
        in a grid column equal widths (ragged edges anywhere). A cupy block stays
        on its device; anything else goes through ``numpy.asarray`` (a subclass such as
        ``np.matrix`` becomes a plain block, and a masked array's mask is dropped, as
        ``distmm.gemm`` drops it).

        Every refusal is raised on every rank, also one that only some ranks' blocks
        or arguments cause.

        Raises
        ------
        ValueError
            Blocks that do not tile a matrix, a block that is not 2-D, or a grid that is
            not the ranks' (sizes below 1, another product) or differs between ranks.
        TypeError
            A grid that is not two ints, blocks of different dtypes (naming a rank of
            each), or cupy blocks on some ranks and numpy blocks on others.
        """
        comm = comm if comm is not None else _world()
        # what only some ranks refuse (a block that is not 2-D, another grid) is raised on
        # every rank: the others would wait for it in the exchange of shapes below
        error = None
        try:
            if _xp(block) is np:
                block = np.asarray(block)
            if block.ndim != 2:
                raise ValueError(f"rank {comm.rank}: a local block must be 2-D, got shape "
                                 f"{block.shape}")
            rows, cols = _grid(grid) if grid is not None else square_grid(comm.size)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            error = exc
        join(comm, "DistArray.from_local")
        agree(comm, error, (), into=set(), when="in DistArray.from_local")
        everyone = comm.allgather(((rows, cols), tuple(block.shape), block.dtype,
                                   _xp(block) is not np))
        grids = [g for g, *_ in everyone]
        other = next((r for r, g in enumerate(grids) if g != grids[0]), None)
        if other is not None:
            raise ValueError(f"from_local needs the same grid on every rank: {grids[0][0]} x "
                             f"{grids[0][1]} on rank 0, {grids[other][0]} x {grids[other][1]} "
                             f"on rank {other}")
        if rows * cols != comm.size:
            raise ValueError(f"grid {rows} x {cols} does not match {comm.size} ranks")
        info = [rest for _, *rest in everyone]
        other = next((r for r, (_, d, _) in enumerate(info) if d != info[0][1]), None)
        if other is not None:
            raise TypeError(f"local blocks have different dtypes: {np.dtype(info[0][1])} on "
                            f"rank 0, {np.dtype(info[other][1])} on rank {other}")
        on_device = [r for r, (_, _, dev) in enumerate(info) if dev]
        if 0 < len(on_device) < comm.size:
            raise TypeError(f"local blocks are cupy arrays on ranks {on_device} and numpy "
                            f"arrays on the other {comm.size - len(on_device)}: use one kind "
                            f"on every rank")
        shapes = [s for s, _, _ in info]
        heights = [shapes[i * cols][0] for i in range(rows)]
        widths = [shapes[j][1] for j in range(cols)]
        for r, (h, w) in enumerate(shapes):
            i, j = divmod(r, cols)
            if h != heights[i] or w != widths[j]:
                raise ValueError(f"block of rank {r} has shape {(h, w)}, but grid row {i} has "
                                 f"height {heights[i]} and grid column {j} width {widths[j]}")
        row_edges = tuple(np.concatenate([[0], np.cumsum(heights)]).astype(int).tolist())
        col_edges = tuple(np.concatenate([[0], np.cumsum(widths)]).astype(int).tolist())
        layout = BlockLayout((row_edges[-1], col_edges[-1]), row_edges, col_edges,
                             tuple(tuple(i * cols + j for j in range(cols)) for i in range(rows)))
        return cls(block, layout, comm)

    @classmethod
    @_interrupt_ends_the_job("DistArray.from_file")
    def from_file(cls, spec: str, comm=None, layout: BlockLayout | None = None) -> "DistArray":
        """From ``.npy`` (a memmap), a zarr array or ``file.h5:dataset``: each
        rank reads only its own block. Collective: what one rank cannot open or read (a
        corrupt zarr chunk in its block) is raised on every rank, and so is a file whose
        shape or dtype differs between ranks (the values are not compared), and a
        ``layout`` that differs between ranks or does not fit the file or the ranks.

        Raises
        ------
        FileNotFoundError, ValueError
            A missing file or dataset, an unsupported suffix, an array that is not 2-D;
            ``ValueError``: arrays of other shapes or dtypes on different ranks, a layout
            that differs between ranks, is for another shape or has owners that are not
            ranks of ``comm``.
        TypeError
            A ``layout`` that is not a ``BlockLayout``.
        """
        from distmm.engine.mpi.io import open_block_source

        comm = comm if comm is not None else _world()
        join(comm, "DistArray.from_file")
        source, error = None, None
        try:  # a file only some ranks cannot open is refused on every rank
            if layout is not None:
                _layout_type(layout)
            source = open_block_source(spec)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            error = exc
        agree(comm, error, (), before_raise=lambda: source is not None and source.close(),
              into=set(), when="in DistArray.from_file")
        try:
            mine = (tuple(source.array.shape), np.dtype(source.array.dtype), str(spec),
                    _digest(layout))
            everyone = comm.allgather(mine) if comm.size > 1 else [mine]
            other = next((r for r, x in enumerate(everyone) if x[:2] != everyone[0][:2]), None)
            if other is not None:
                (s0, d0, f0, _), (s1, d1, f1, _) = everyone[0], everyone[other]
                raise ValueError(f"from_file needs the same array on every rank: {s0} "
                                 f"{np.dtype(d0)} in {f0} on rank 0, {s1} {np.dtype(d1)} in "
                                 f"{f1} on rank {other}")
            other = next((r for r, x in enumerate(everyone) if x[3] != everyone[0][3]), None)
            if other is not None:
                raise ValueError(f"from_file needs the same layout= on every rank: rank 0's "
                                 f"and rank {other}'s differ")
            dist, error = None, None
            try:  # a layout or a block only some ranks refuse is refused on every rank
                dist = cls.from_agreed(source.array, comm, layout)
                if isinstance(source.array, np.ndarray) and \
                        np.may_share_memory(dist.local, source.array):
                    # whole rows of a .npy file are a view of its read-only memmap: read
                    # them now (a file written again later would end the rank with SIGBUS)
                    dist.local = np.array(dist.local)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
                error = exc
            agree(comm, error, (), into=set(), when="in DistArray.from_file")
            return dist
        finally:
            source.close()

    # -- agreeing ---------------------------------------------------------------
    def settle(self) -> None:
        """Collective: raise ``ValueError`` on every rank where ``from_array`` was given
        arrays of other shapes, dtypes or sampled values on different ranks (once)."""
        given, self._given = self._given, None
        if given is None or self.comm.size == 1:
            return
        everyone = self.comm.allgather(given)
        other = next((r for r, g in enumerate(everyone) if g != everyone[0]), None)
        if other is None:
            return
        mine, theirs = everyone[0], everyone[other]
        if mine[:2] != theirs[:2]:
            what = (f"{mine[0]} {np.dtype(mine[1])} on rank 0, {theirs[0]} "
                    f"{np.dtype(theirs[1])} on rank {other}")
        elif mine[2] != theirs[2]:
            what = f"layout= differs between rank 0 and rank {other}"
        else:
            what = f"the values differ between rank 0 and rank {other} (sampled elements)"
        raise ValueError(f"DistArray.from_array needs the same array on every rank: {what}")

    def _check_layout(self, layout: BlockLayout, what: str) -> None:
        """Collective: ``layout`` (the same on every rank) is for this matrix and the ranks of
        its communicator; ValueError on every rank otherwise."""
        self.settle()
        _same_everywhere(self.comm, what, _digest(layout))
        if tuple(layout.shape) != tuple(self.shape):
            raise ValueError(f"layout is for shape {layout.shape}, the array has {self.shape}")
        _check_owners(layout, self.comm.size, what)

    # -- moving -----------------------------------------------------------------
    @_interrupt_ends_the_job("DistArray.redistribute")
    def redistribute(self, layout: BlockLayout) -> "DistArray":
        """The same matrix in another layout (one ``Alltoallv`` of raw bytes through
        host memory, or point-to-point ``distmm.engine.mpi.pieces`` where a block has more
        bytes than one MPI call moves; object arrays go pickled, point to point); cupy
        blocks come back as cupy blocks.
        Collective; a layout for another shape, for ranks the communicator does not
        have, or different on different ranks is a ``ValueError`` on every rank, and one
        that is not a ``BlockLayout`` (on any rank) a ``TypeError``."""
        join(self.comm, "DistArray.redistribute")
        error = None
        try:  # refused on one rank: the others would wait for it in the comparison below
            _layout_type(layout)
        except TypeError as exc:
            error = exc
        agree(self.comm, error, (), into=set(), when="in DistArray.redistribute")
        self._check_layout(layout, "redistribute")
        return self.moved(layout)

    def moved(self, layout: BlockLayout) -> "DistArray":
        """``redistribute`` to a layout the caller made the same on every rank."""
        if tuple(layout.shape) != tuple(self.shape):
            raise ValueError(f"layout is for shape {layout.shape}, the array has {self.shape}")
        if layout == self.layout:
            return self
        comm, rank, size = self.comm, self.comm.rank, self.comm.size
        local = self._host_local()
        src = self.layout.local_bounds(rank)
        dst = layout.local_bounds(rank)
        pieces_out, pieces_in = [], []
        for peer in range(size):
            pieces_out.append(_overlap(src, layout.local_bounds(peer)))
            pieces_in.append(_overlap(self.layout.local_bounds(peer), dst))
        out = np.empty((dst[1] - dst[0], dst[3] - dst[2]), dtype=self.dtype)
        if self.dtype.kind == "O":
            from distmm.engine.mpi.comm import pickled, unpickled

            send = [None if p is None else
                    pickled(local[p[0] - src[0]:p[1] - src[0], p[2] - src[2]:p[3] - src[2]])
                    for p in pieces_out]
            got = [None if x is None else unpickled(x)
                   for x in pieces.alltoall_objects(comm, send)]
            _agree_sent(comm, got)
            for p, block in zip(pieces_in, got):
                if p is not None:
                    out[p[0] - dst[0]:p[1] - dst[0], p[2] - dst[2]:p[3] - dst[2]] = block
            return DistArray(self._like_local(out), layout, comm)
        item = self.dtype.itemsize
        send_counts = [0 if p is None else (p[1] - p[0]) * (p[3] - p[2]) * item for p in pieces_out]
        recv_counts = [0 if p is None else (p[1] - p[0]) * (p[3] - p[2]) * item for p in pieces_in]
        send = np.empty(sum(send_counts), dtype=np.uint8)
        pos = 0
        for p, count in zip(pieces_out, send_counts):
            if count:
                piece = np.ascontiguousarray(local[p[0] - src[0]:p[1] - src[0], p[2] - src[2]:p[3] - src[2]])
                send[pos:pos + count] = piece.reshape(-1).view(np.uint8)
                pos += count
        recv = np.empty(sum(recv_counts), dtype=np.uint8)
        if _over_one_count((self.layout, layout), item):
            ends = np.cumsum([0] + send_counts).tolist()
            pieces.pairwise(comm, [send[ends[p]:ends[p + 1]] for p in range(size)], recv,
                            recv_counts)
        else:
            comm.Alltoallv([send, send_counts], [recv, recv_counts])
        pos = 0
        for p, count in zip(pieces_in, recv_counts):
            if count:
                shape = (p[1] - p[0], p[3] - p[2])
                out[p[0] - dst[0]:p[1] - dst[0], p[2] - dst[2]:p[3] - dst[2]] = \
                    recv[pos:pos + count].view(self.dtype).reshape(shape)
                pos += count
        return DistArray(self._like_local(out), layout, comm)

    @_interrupt_ends_the_job("DistArray.gather")
    def gather(self, root: int | None = 0):
        """The whole matrix as an ndarray on ``root`` (``None`` on the other
        ranks), or on every rank with ``root=None``. Collective; a root that is not a
        rank of the communicator, or differs between ranks, is refused on every rank."""
        comm, error = self.comm, None
        join(comm, "DistArray.gather")
        try:
            if root is not None:
                if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
                    raise TypeError(f"gather: root must be a rank (an int) or None, got "
                                    f"{type(root).__name__} {root!r}")
                root = operator.index(root)
                if not 0 <= root < comm.size:
                    raise ValueError(f"gather: root {root} is not one of the {comm.size} ranks "
                                     f"(0 to {comm.size - 1}); root=None gathers onto every rank")
            # the whole matrix where it is gathered: a MemoryError on one rank alone is
            # raised on every rank, not left to the exchange the others would wait in
            whole = np.empty(self.shape, dtype=self.dtype) if root in (None, comm.rank) else None
            if root is None:
                whole = (whole, self._allgather_buffer())
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            error = exc
        agree(comm, error, (), into=set(), when="in DistArray.gather")
        self.settle()
        _same_everywhere(comm, "gather", root, lambda r: f"root={r}")
        if root is None:
            return self._allgather(*whole)
        del whole  # moved() makes its own
        full = self.moved(BlockLayout.single(self.shape, root))
        return full._host_local() if comm.rank == root else None

    def _allgather_buffer(self) -> np.ndarray | None:
        """The bytes of every rank's block, in rank order, for ``_allgather`` (``None`` for
        object blocks, which travel pickled)."""
        if self.dtype.kind == "O":
            return None
        return np.empty(sum(self._allgather_counts()), dtype=np.uint8)

    def _allgather_counts(self) -> list[int]:
        """The bytes of each rank's block, in rank order."""
        return [math.prod(self.layout.local_shape(r)) * self.dtype.itemsize
                for r in range(self.comm.size)]

    def _allgather(self, out: np.ndarray, flat: np.ndarray | None) -> np.ndarray:
        """Every rank's block into ``out`` (the whole matrix, on every rank), through ``flat``
        (``_allgather_buffer``)."""
        comm = self.comm
        if self.dtype.kind == "O":
            from distmm.engine.mpi.comm import pickled, unpickled

            mine = pickled(self._host_local())
            blocks = [unpickled(p) for p in pieces.alltoall_objects(comm, [mine] * comm.size)]
            _agree_sent(comm, blocks)
        else:
            counts = self._allgather_counts()
            mine = np.ascontiguousarray(self._host_local()).reshape(-1).view(np.uint8)
            if _over_one_count((BlockLayout.single(self.shape),), self.dtype.itemsize):
                pieces.pairwise(comm, [mine] * comm.size, flat, counts)
            else:
                comm.Allgatherv(mine, [flat, counts])
            blocks, pos = [], 0
            for r, count in enumerate(counts):
                blocks.append(flat[pos:pos + count].view(self.dtype).reshape(self.layout.local_shape(r)))
                pos += count
        for r, block in enumerate(blocks):
            r0, r1, c0, c1 = self.layout.local_bounds(r)
            if r1 > r0 and c1 > c0:
                out[r0:r1, c0:c1] = block
        return out

    def to_file(self, spec: str, *, overwrite: bool = False) -> None:
        """Write the matrix to ``.npy``, zarr or ``file.h5:dataset``: each rank
        writes its own block into one staged output that takes the final name
        only after every rank succeeded (see ``distmm.engine.mpi.io``)."""
        from distmm.engine.mpi.io import write_blocks

        join(self.comm, "DistArray.to_file")
        self.settle()
        write_blocks(spec, self, overwrite=overwrite)


def _grid(grid) -> tuple[int, int]:
    """``from_local``'s ``grid=``: two positive ints (TypeError, ValueError naming it)."""
    try:
        rows, cols = grid
        if any(isinstance(g, (bool, np.bool_)) for g in (rows, cols)):
            raise TypeError
        rows, cols = operator.index(rows), operator.index(cols)
    except (TypeError, ValueError):
        raise TypeError(f"from_local: grid must be two ints (rows, cols), got {grid!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"from_local: grid {rows} x {cols} needs at least one row and one "
                         f"column of ranks")
    return rows, cols


def _layout_type(layout) -> None:
    """A ``layout=`` that is no ``BlockLayout``: TypeError naming it."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a distmm.grid.BlockLayout, got "
                        f"{type(layout).__name__} {layout!r}")


def _check_owners(layout: BlockLayout, ranks: int, what: str) -> None:
    """ValueError unless ``layout``'s owners are a grid of its blocks, each a rank below
    ``ranks``."""
    rows, cols = layout.blocks
    owners = [r for row in layout.owners for r in row]
    if len(layout.owners) != rows or any(len(row) != cols for row in layout.owners) or \
            any(not 0 <= r < ranks for r in owners):
        raise ValueError(f"{what}: the layout's owners {layout.owners} are not a "
                         f"{rows} x {cols} grid of the ranks 0 to {ranks - 1}")


def _digest(value) -> bytes:
    """Eight bytes that tell picklable values apart (what ranks compare cheaply)."""
    return hashlib.blake2b(pickle.dumps(value), digest_size=8).digest()


def _same_everywhere(comm, what: str, value, show=None) -> None:
    """Collective: ``ValueError`` on every rank unless ``value`` is the same on every rank
    (its digest compared; ``show(value)`` of rank 0 and the first other in the message)."""
    if comm.size == 1:
        return
    digests = comm.allgather(_digest(value))
    other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if other is None:
        return
    if show is None:
        raise ValueError(f"{what} needs the same arguments on every rank: rank 0's and rank "
                         f"{other}'s differ")
    values = comm.allgather(value)
    raise ValueError(f"{what} needs the same arguments on every rank: {show(values[0])} on "
                     f"rank 0, {show(values[other])} on rank {other}")


def _agree_sent(comm, got) -> None:
    """Object pieces that did not travel (a ``NotPicklable`` among ``got``, on any rank):
    the lowest such rank's ``NotPicklable`` raised on every rank."""
    from distmm.engine.mpi.agree import agree
    from distmm.errors import NotPicklable

    agree(comm, next((x for x in got if isinstance(x, NotPicklable)), None), (), into=set())


def _over_one_count(layouts, itemsize: int) -> bool:
    """Whether a block of any of ``layouts`` (the same on every rank) holds more bytes than
    one MPI call moves (``pieces.fits``): a rank's buffer, its counts or displacements could
    pass a C int."""
    return any(not pieces.fits((r1 - r0) * (c1 - c0) * itemsize)
               for layout in layouts for bi in range(layout.blocks[0])
               for bj in range(layout.blocks[1])
               for r0, r1, c0, c1 in [layout.bounds(bi, bj)])


def _overlap(a, b):
    """The intersection of two ``(r0, r1, c0, c1)`` rectangles, or None."""
    r0, r1 = max(a[0], b[0]), min(a[1], b[1])
    c0, c1 = max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r1 > r0 and c1 > c0 else None
