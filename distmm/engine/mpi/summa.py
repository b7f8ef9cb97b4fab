"""SUMMA on a ``layers x rows x cols`` process grid, panels double-buffered.

This module covers: ``summa``: on one rank, one local GEMM through the
executor (no panels: nothing moves); on more, for each panel of a layer's k range, the owner column broadcasts
its A panel along the process row and the owner row its B panel along the
process column, then every rank adds ``A_panel @ B_panel`` (through the
executor) to its C block. The broadcasts of panel p+1 are posted before the
product of panel p starts, so they move while it computes. With several
layers (k split), the layers' C blocks are summed onto layer 0 along the
grid's fixed tree, so the result's bits never depend on timing; inside a rank
panels are summed in k order. A float16, long double or object result is numpy's
bits: numpy sums each element over k in one ascending sum (float32 for float16, its
loop without BLAS for long doubles, Python's additions for objects), which partial
sums added afterwards do not reproduce (``distmm.plan.sums_whole_k``), so each
rank keeps its panels whole (its row of A and column of B, ``(mi + nj) * k`` values
in the accumulation dtype; ``distmm.grid`` splits no such product's k, a forced
grid's other layers send theirs to layer 0) and multiplies them in one product; an
object block's elements keep their reports from their place in C, for numpy's order
(``distmm.fpflags.object_rows``).
A complex64 or complex128 element that is not finite is left as the panels' sum gives it
(a 1 x 1 block keeps an Inf numpy's BLAS turns NaN), but for a host panel one wide, whose
product (numpy's own loop) takes the form of the block's other panels' (BLAS's:
``distmm.nonfinite.as_whole_call``): the engine's ``finish_tile`` gives it numpy's form for
the whole product (``distmm.nonfinite``), told the shapes of the host products summed
(``block_parts``).
It does *not* cover: choosing the grid (``distmm.grid``), the grid's
communicators (``distmm.engine.mpi.gridcomms``), moving operands into
the grid's layout (``distmm.engine.mpi.distarray``), or kernels (executors).
"""
from __future__ import annotations

import bisect

import numpy as np

from distmm.engine.mpi import pieces
from distmm.engine.mpi.comm import pickled as to_bytes
from distmm.engine.mpi.comm import unpickled
from distmm.engine.mpi.gridcomms import GridComms
from distmm.errors import NotPicklable
from distmm.fpflags import object_rows
from distmm.grid import GridPlan
from distmm.nonfinite import as_whole_call, part_shape
from distmm.plan import sums_whole_k

__all__ = ["summa", "block_parts", "LocalFailure"]


def summa(grid: GridPlan, a_local, b_local, executor, comms: GridComms, *, xp=np, tk: int = 256):
    """This rank's part of ``C = A @ B``.

    Parameters
    ----------
    a_local, b_local :
        This rank's blocks of A (``grid.a_layout``) and B (``grid.b_layout``)
        in the accumulation dtype, on the executor's device (numpy or cupy).
    executor : Executor
        Multiplies panels (``panel_product``).
    comms : GridComms
    xp : module
        numpy or cupy, for panel buffers.

    Returns
    -------
    The accumulated C block (``grid.c_layout``) on layer-0 ranks, ``None`` on
    the others.
    """
    rank = comms.comm.rank
    layer, i, j = grid.coords(rank)
    acc = np.dtype(grid.acc_dtype)
    in_place = hasattr(executor, "device_gemm") and acc in (np.float32, np.float64)
    if grid.ranks == 1:
        return _local_product(a_local, b_local, executor, in_place, xp, tk)
    mi = grid.row_edges[i + 1] - grid.row_edges[i]
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    a_edges, b_edges = grid.a_k_edges[layer], grid.b_k_edges[layer]
    pe = grid.panel_edges[layer]
    panels = list(zip(pe, pe[1:]))
    # float16, long double or object on the host: one product over all of k (numpy's sum)
    whole_k = not in_place and xp is np and sums_whole_k(grid.dtype)
    if whole_k:
        k_lo = pe[0]
        a_whole = np.empty((mi, pe[-1] - k_lo), dtype=acc)
        b_whole = np.empty((pe[-1] - k_lo, nj), dtype=acc)

    def post(p):
        k0, k1 = panels[p]
        a_root = bisect.bisect_right(a_edges, k0) - 1
        b_root = bisect.bisect_right(b_edges, k0) - 1
        if j == a_root:
            off = a_edges[j]
            a_buf = xp.ascontiguousarray(a_local[:, k0 - off:k1 - off])
        else:
            a_buf = xp.empty((mi, k1 - k0), dtype=acc)
        if i == b_root:
            off = b_edges[i]
            b_buf = xp.ascontiguousarray(b_local[k0 - off:k1 - off, :])
        else:
            b_buf = xp.empty((k1 - k0, nj), dtype=acc)
        return a_buf, b_buf, comms.row.ibcast(a_buf, a_root), comms.col.ibcast(b_buf, b_root)

    first = 0
    c = None
    unsent = None  # an object panel that did not pickle: every broadcast still completes
    pending = post(0) if panels else None
    for p in range(len(panels)):
        a_buf, b_buf, a_req, b_req = pending
        a_req.wait()
        b_req.wait()
        unsent = unsent or getattr(a_req, "unsent", None) or getattr(b_req, "unsent", None)
        pending = post(p + 1) if p + 1 < len(panels) else None  # moves while panel p multiplies
        if whole_k:
            k0, k1 = panels[p]
            a_whole[:, k0 - k_lo:k1 - k_lo] = a_buf
            b_whole[k0 - k_lo:k1 - k_lo] = b_buf
        elif mi and nj and unsent is None:
            if in_place:
                # GPU: C += A_panel @ B_panel inside the GEMM (beta = 1), no extra pass over C.
                if c is None:
                    c = xp.empty((mi, nj), dtype=acc)
                executor.device_gemm(a_buf, b_buf, c, beta=0 if p == first else 1)
            else:
                prod = executor.panel_product(a_buf, b_buf, tk)
                if a_buf.shape[1] == 1:  # numpy's own loop on the host: the other panels' form
                    prod = as_whole_call(grid, prod)
                if c is None:
                    c = prod
                else:
                    c += prod
        del a_buf, b_buf
    if unsent is not None:  # object panels are whole-k: no product has run yet
        raise LocalFailure(unsent)
    if whole_k:
        return _whole_k_product(grid, a_whole, b_whole, executor, comms, layer, i, j, tk)
    if c is None:
        c = xp.zeros((mi, nj), dtype=acc)
    return _reduce_layers(grid, c, comms, layer, i, j)


def block_parts(grid: GridPlan, rank: int) -> tuple:
    """The ``(rows, columns, k)`` of the panel products ``summa`` sums into ``rank``'s C
    block on the host: every layer's panels (the layers' blocks are summed onto layer 0; a
    panel one wide in the form of the others', ``distmm.nonfinite.part_shape``), or the one
    product of a grid of one rank (``finish_tile``'s ``parts``)."""
    _, i, j = grid.coords(rank)
    mi = grid.row_edges[i + 1] - grid.row_edges[i]
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    if grid.ranks == 1:
        return ((mi, nj, grid.k),)
    return tuple(part_shape(grid, mi, nj, k1 - k0) for pe in grid.panel_edges
                 for k0, k1 in zip(pe, pe[1:]) if k1 > k0)


def _whole_k_product(grid: GridPlan, a_whole, b_whole, executor, comms: GridComms,
                     layer: int, i: int, j: int, tk: int):
    """A float16, long double or object result's C block on layer 0: the other layers (a
    grid forced to split k; ``make_grid`` never does for these) send their panels of A's
    rows and B's columns to layer 0's rank of the same ``(i, j)`` (objects pickled), which
    multiplies them in k order in one product; ``None`` on the other layers."""
    if grid.layers > 1:
        comm = comms.comm
        pickled = a_whole.dtype.kind == "O"
        if layer:
            for tag, x in ((78, a_whole), (79, b_whole)):
                if pickled:
                    pieces.send_object(comm, to_bytes(x), grid.rank_at(0, i, j), tag)
                else:
                    pieces.send(comm, np.ascontiguousarray(x), grid.rank_at(0, i, j), tag)
            return None
        a_parts, b_parts = [a_whole], [b_whole]
        unsent = None  # object panels that did not travel: every message is still received
        for src in range(1, grid.layers):
            width = grid.layer_edges[src + 1] - grid.layer_edges[src]
            a_part = np.empty((a_whole.shape[0], width), dtype=a_whole.dtype)
            b_part = np.empty((width, b_whole.shape[1]), dtype=b_whole.dtype)
            for tag, x in ((78, a_part), (79, b_part)):
                if pickled:
                    got = unpickled(pieces.recv_object(comm, grid.rank_at(src, i, j), tag))
                    if isinstance(got, NotPicklable):
                        unsent = unsent or got
                    else:
                        x[...] = got
                else:
                    pieces.recv(comm, x, grid.rank_at(src, i, j), tag)
                comms.reduce_bytes += x.nbytes
            a_parts.append(a_part)
            b_parts.append(b_part)
        if unsent is not None:
            raise LocalFailure(unsent)
        a_whole = np.concatenate(a_parts, axis=1)  # layers' k ranges ascend with the layer
        b_whole = np.concatenate(b_parts, axis=0)
    m, k = a_whole.shape
    n = b_whole.shape[1]
    if not (m and n and k):
        return np.zeros((m, n), dtype=a_whole.dtype)
    try:
        return _product(executor, a_whole, b_whole, tk, (grid.row_edges[i], grid.col_edges[j]))
    except BaseException as exc:  # an object element's own error (even SystemExit, as in
        raise LocalFailure(exc) from exc  # numpy): no rank waits for this one


class LocalFailure(Exception):
    """This rank's product failed after its last exchange (``error``: an object element's
    ``TypeError``, ...): the other ranks wait for it in no broadcast, so the engine can
    have every rank agree on the error instead of ending the job."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


def _local_product(a_local, b_local, executor, in_place: bool, xp, tk: int):
    """The whole product on one rank: one GEMM, as the executor would do it alone."""
    m, n = a_local.shape[0], b_local.shape[1]
    if in_place:
        c = xp.empty((m, n), dtype=a_local.dtype)
        if m and n:
            if a_local.shape[1]:
                executor.device_gemm(a_local, b_local, c, beta=0)
            else:
                c[...] = 0
        return c
    if a_local.shape[1] == 0 or not (m and n):
        return xp.zeros((m, n), dtype=a_local.dtype)
    return _product(executor, a_local, b_local, tk, (0, 0))


def _product(executor, a, b, tk: int, at: tuple):
    """``a @ b`` through the executor; object panels (all of k) keep their elements'
    reports from ``at`` in C, in numpy's order (``distmm.fpflags.object_rows``)."""
    if a.dtype == object:
        return object_rows(lambda x, y: executor.panel_product(x, y, tk), a, b, at)
    return executor.panel_product(a, b, tk)


def _reduce_layers(grid: GridPlan, c, comms: GridComms, layer: int, i: int, j: int):
    """Sum the layers' C blocks onto layer 0 along the grid's fixed tree."""
    if grid.layers == 1:
        return c
    comm = comms.comm
    on_host = isinstance(c, np.ndarray)
    host = c if on_host else c.get()
    for dst, src in grid.reduction:
        if layer == src:
            if host.dtype.kind == "O":
                pieces.send_object(comm, host, grid.rank_at(dst, i, j), 77)
            else:
                pieces.send(comm, np.ascontiguousarray(host), grid.rank_at(dst, i, j), 77)
            return None
        if layer == dst:
            if host.dtype.kind == "O":
                other = pieces.recv_object(comm, grid.rank_at(src, i, j), 77)
            else:
                other = np.empty(host.shape, dtype=host.dtype)  # C order, as sent
                pieces.recv(comm, other, grid.rank_at(src, i, j), 77)
            comms.reduce_bytes += other.nbytes
            host = host + other
    if on_host:
        return host
    import cupy

    return cupy.asarray(host)
