"""numba CPU GEMM kernels: ``a @ b`` on one core, deterministic, GotoBLAS/BLIS style.

This module covers: one tile product ``C = A @ B`` on one core for float32,
float64, int64 and uint64 (integers wrap as numpy's do). The structure is the
classic one of GotoBLAS and BLIS:

* loop ``jc`` over column blocks of ``nc`` columns of B and C;
* loop ``pc`` over k blocks of ``kc = min(tk, KC)``: B's ``kc x nc``
  block is packed into ``NR``-column micro-panels (contiguous, zero-padded);
* loop ``ic`` over row blocks of ``mc`` rows: A's ``mc x kc`` block is packed
  into ``MR``-row micro-panels (it stays in L2);
* loops ``jr``/``ir`` over micro-tiles: the micro-kernel keeps an ``MR x NR``
  block of C in ``MR * NV`` vector registers (zmm on AVX-512) and, for each
  ``p`` of the k block, loads ``NV`` vectors of B, broadcasts ``MR`` values of
  A and does ``MR * NV`` vector FMAs (multiply-adds for integers).

The micro-kernel is written in LLVM IR through a numba ``@intrinsic`` with
explicit 512-bit vector types, so the register blocking does not depend on
LLVM's auto-vectorizer (which leaves scalar code here and prefers 256-bit
vectors on Xeons). Ragged micro-tiles go through a zero-padded scratch tile.

Determinism and IEEE semantics: each C element is summed over k in ascending
order with one fused multiply-add per term (the register sums carry on from C
between k blocks), so the bits depend neither on the run nor on the blocking
(``tk``, ``MC``, ``NC``). No fast-math flags: NaN and Inf propagate as in numpy
(``inf * 0`` is NaN). Packing reads any strides (unit-stride fast paths for
row- and column-major views) and never writes the operands. The kernels
are compiled with ``nogil=True``: the local and Dask engines run one per thread,
each on its own tile.

It does *not* cover: threading (the engines run tiles in parallel), other
dtypes (``distmm.executor.cpu`` sends them to ``numpy.matmul``).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["SUPPORTED", "panel_product", "gemm", "MR", "NV", "MC", "NC", "KC", "KC_DEFAULT",
           "nr_for"]

SUPPORTED = ("float32", "float64", "int64", "uint64")

#: rows of the micro-tile (values of A broadcast per k step)
MR = 8
#: 512-bit vectors per micro-tile row; NR = NV * (64 // itemsize) columns
NV = 3
#: rows of A packed per block (kept in L2); a multiple of MR
MC = 192
#: columns of B packed per block (kept in L3); a multiple of every NR
NC = 1536
#: k steps per iteration of the micro-kernel's loop
UNROLL = 4
#: k steps ahead that the micro-kernel prefetches its A micro-panel
PREFETCH_A = 8
#: largest k block. A B micro-panel (KC x NR, 192 bytes per k step for every dtype) is
#: 48 KiB at 256: L1-sized on Ice Lake. 128 (24 KiB) did as well on one core but worse
#: with both cores busy, where each k block costs one more pass over C through L3.
KC = 256
#: k block used when the caller gives none
KC_DEFAULT = 256
_VECTOR_BYTES = 64


def nr_for(dtype) -> int:
    """Columns of the micro-tile for ``dtype``: ``NV`` 512-bit vectors."""
    return NV * (_VECTOR_BYTES // np.dtype(dtype).itemsize)


def _make_microkernel(mr: int, nv: int, unroll: int = 1):
    """Build the ``mr x (nv * W)`` micro-kernel intrinsic (``W`` lanes per 512-bit vector).

    ``ukernel(kc, ap, aoff, bp, boff, c, coff, ldc, cnext, load_c)`` does, for ``i < mr``,
    ``j < NR``::

        c[coff + i*ldc + j] += sum over p < kc (ascending) of
                               ap[aoff + p*mr + i] * bp[boff + p*NR + j]

    with the sum held in registers and one FMA per term (floats) or a wrapping
    multiply and add (integers). ``ap``, ``bp`` and ``c`` are 1-D contiguous
    arrays of one dtype; nothing is bounds-checked. ``cnext`` is the offset in
    ``c`` of the next micro-tile, whose rows are prefetched (a hint only). With
    ``load_c`` false the sums start from zero instead of ``c`` (the first k block:
    the same bits as adding to a zeroed ``c``, without reading it).
    """

    @intrinsic
    def ukernel(typingctx, kc, ap, aoff, bp, boff, c, coff, ldc, cnext, load_c):
        sig = types.void(kc, ap, aoff, bp, boff, c, coff, ldc, cnext, load_c)

        def codegen(context, builder, signature, args):
            st = signature.args
            kc_v, aoff_v, boff_v, coff_v, ldc_v, cnext_v, load_c_v = (
                context.cast(builder, args[i], st[i], types.intp) for i in (0, 2, 4, 6, 7, 8, 9))
            dt = st[1].dtype
            elt = context.get_value_type(dt)
            size = context.get_abi_sizeof(elt)
            lanes = _VECTOR_BYTES // size
            nr = nv * lanes
            vty = ir.VectorType(elt, lanes)
            vptr = vty.as_pointer()
            is_float = isinstance(dt, types.Float)

            def const(v):
                return ir.Constant(ir.IntType(64), v)

            def data(k):
                return context.make_array(st[k])(context, builder, args[k]).data

            a_ptr = builder.gep(data(1), [aoff_v])
            b_ptr = builder.gep(data(3), [boff_v])
            c_ptr = builder.gep(data(5), [coff_v])
            c_next = builder.gep(data(5), [cnext_v])
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0i8")

            def prefetch_line(ptr, write):
                builder.call(prefetch, [builder.bitcast(ptr, i8p), ir.Constant(i32, write),
                                        ir.Constant(i32, 3), ir.Constant(i32, 1)])

            if is_float:
                fma = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(vty, [vty, vty, vty]),
                    f"llvm.fma.v{lanes}f{size * 8}")
            # Accumulators live in allocas that mem2reg turns into registers.
            accs = [[cgutils.alloca_once(builder, vty) for _ in range(nv)] for _ in range(mr)]
            c_rows = []
            for i in range(mr):
                row = builder.gep(c_ptr, [builder.mul(ldc_v, const(i))])
                ptrs = [builder.bitcast(builder.gep(row, [const(v * lanes)]), vptr)
                        for v in range(nv)]
                c_rows.append(ptrs)
            with builder.if_else(builder.icmp_signed("!=", load_c_v, const(0))) as (then, zero):
                with then:
                    for i in range(mr):
                        for v in range(nv):
                            builder.store(builder.load(c_rows[i][v], align=size), accs[i][v])
                with zero:
                    for i in range(mr):
                        for v in range(nv):
                            builder.store(ir.Constant(vty, None), accs[i][v])
            # The next micro-tile of C comes from L3 or memory: ask for it now.
            for i in range(mr):
                row = builder.gep(c_next, [builder.mul(ldc_v, const(i))])
                for off in list(range(0, nr * size, 64)) + [nr * size - size]:
                    prefetch_line(builder.gep(row, [const(off // size)]), 1)
            undef = ir.Constant(vty, ir.Undefined)
            splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

            def k_step(p):
                b_row = builder.gep(b_ptr, [builder.mul(p, const(nr))])
                b_vecs = [builder.load(builder.bitcast(builder.gep(b_row, [const(v * lanes)]), vptr),
                                       align=size) for v in range(nv)]
                a_col = builder.gep(a_ptr, [builder.mul(p, const(mr))])
                # A streams from L2: fetch PREFETCH_A k-steps ahead (one line per step
                # covers MR values of 64 bits; 32-bit values are asked for twice).
                prefetch_line(builder.gep(a_col, [const(PREFETCH_A * mr)]), 0)
                for i in range(mr):
                    a_val = builder.load(builder.gep(a_col, [const(i)]))
                    a_vec = builder.shuffle_vector(builder.insert_element(undef, a_val, const(0)),
                                                   undef, splat)
                    for v in range(nv):
                        acc = builder.load(accs[i][v])
                        if is_float:
                            new = builder.call(fma, [a_vec, b_vecs[v], acc])
                        else:
                            new = builder.add(acc, builder.mul(a_vec, b_vecs[v]))
                        builder.store(new, accs[i][v])

            # k steps in groups of `unroll` (fewer loop-counter uops per FMA), then the rest;
            # the order of the terms is the same either way.
            groups = builder.sdiv(kc_v, const(unroll))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, const(unroll))
                for u in range(unroll):
                    k_step(builder.add(first, const(u)))
            with cgutils.for_range(builder, kc_v, start=builder.mul(groups, const(unroll))) as loop:
                k_step(loop.index)
            for i in range(mr):
                for v in range(nv):
                    builder.store(builder.load(accs[i][v]), c_rows[i][v], align=size)
            return context.get_dummy_value()

        return sig, codegen

    return ukernel


_microkernel = _make_microkernel(MR, NV, UNROLL)


def _signatures():
    sigs = []
    for name in SUPPORTED:
        t = numba.from_dtype(np.dtype(name))
        arr2 = types.Array(t, 2, "A", readonly=True)
        sigs.append(types.Array(t, 2, "A")(arr2, arr2, types.intp, types.intp, types.intp))
    return sigs


_u = numba.uintp  # unsigned indices: numba then skips its negative-index wraparound


@intrinsic
def _flat_view(typingctx, arr):
    """A 1-D contiguous read-only view that starts at ``arr``'s first element and has
    no bound; it is indexed with element offsets computed from ``arr``'s strides, so
    LLVM sees unit-stride loads (the strided 2-D view hides them behind run-time byte
    strides). Only for arrays with non-negative strides."""
    ret = types.Array(arr.dtype, 1, "C", readonly=True)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(ret)(context, builder)
        itemsize = context.get_constant(
            types.intp, context.get_abi_sizeof(context.get_data_type(arr.dtype)))
        unbounded = context.get_constant(types.intp, 1 << 40)
        context.populate_array(out, data=src.data,
                               shape=cgutils.pack_array(builder, [unbounded]),
                               strides=cgutils.pack_array(builder, [itemsize]),
                               itemsize=itemsize, meminfo=None)
        return out._getvalue()

    return ret(arr), codegen


@numba.njit(nogil=True, cache=True)
def _pack_a(a, i0, mc, p0, kc, buf):
    """Pack ``a[i0:i0+mc, p0:p0+kc]`` into MR-row micro-panels, ``buf[r, p, i]``; rows
    past ``mc`` are zero."""
    s0 = a.strides[0] // a.itemsize
    s1 = a.strides[1] // a.itemsize
    flat = _flat_view(a)
    for r in range(0, mc, MR):
        base = (r // MR) * kc * MR
        rows = min(MR, mc - r)
        if a.strides[0] == a.itemsize and s1 >= 0 and rows == MR:
            # column-major A (a transposed view): a micro-panel column is contiguous
            for p in range(kc):
                src = (p0 + p) * s1 + i0 + r
                for i in range(MR):
                    buf[_u(base + p * MR + i)] = flat[_u(src + i)]
            continue
        for i in range(rows):
            if a.strides[1] == a.itemsize and s0 >= 0:
                src = (i0 + r + i) * s0 + p0
                for p in range(kc):
                    buf[_u(base + p * MR + i)] = flat[_u(src + p)]
            else:
                for p in range(kc):
                    buf[_u(base + p * MR + i)] = a[_u(i0 + r + i), _u(p0 + p)]
        for i in range(rows, MR):
            for p in range(kc):
                buf[_u(base + p * MR + i)] = 0


@numba.njit(nogil=True, cache=True)
def _pack_b(b, p0, kc, j0, nc, nr, buf):
    """Pack ``b[p0:p0+kc, j0:j0+nc]`` into ``nr``-column micro-panels, ``buf[q, p, j]``;
    columns past ``nc`` are zero."""
    s0 = b.strides[0] // b.itemsize
    s1 = b.strides[1] // b.itemsize
    rows_contiguous = b.strides[1] == b.itemsize and s0 >= 0
    cols_contiguous = b.strides[0] == b.itemsize and s1 >= 0
    flat = _flat_view(b)
    for q in range(0, nc, nr):
        base = (q // nr) * kc * nr
        cols = min(nr, nc - q)
        if rows_contiguous:
            for p in range(kc):
                src = (p0 + p) * s0 + j0 + q
                for j in range(cols):
                    buf[_u(base + p * nr + j)] = flat[_u(src + j)]
        elif cols_contiguous:
            for j in range(cols):
                src = (j0 + q + j) * s1 + p0
                for p in range(kc):
                    buf[_u(base + p * nr + j)] = flat[_u(src + p)]
        else:
            for p in range(kc):
                for j in range(cols):
                    buf[_u(base + p * nr + j)] = b[_u(p0 + p), _u(j0 + q + j)]
        if cols < nr:
            for p in range(kc):
                for j in range(cols, nr):
                    buf[_u(base + p * nr + j)] = 0


def _gemm_impl(a, b, kc_max, mc_max, nc_max):
    m, k = a.shape
    n = b.shape[1]
    lanes = 64 // a.itemsize
    nr = NV * lanes
    # C's rows are padded so that they are not a multiple of 256 bytes apart: with
    # power-of-two widths, the MR rows of a micro-tile would otherwise share a few L1
    # sets (4 KiB aliasing) and evict each other and the packed panels.
    ldc = -(-max(n, 1) // lanes) * lanes
    if (ldc * a.itemsize) % 256 == 0:
        ldc += lanes
    c_full = np.zeros((m, ldc), dtype=a.dtype)
    c = c_full[:, :n]
    if m == 0 or n == 0 or k == 0:
        return c
    kc_max = max(1, min(kc_max, k))
    mc_max = max(MR, (min(mc_max, m + MR - 1) // MR) * MR)
    nc_max = max(nr, (min(nc_max, n + nr - 1) // nr) * nr)
    a_buf = np.empty(mc_max * kc_max, dtype=a.dtype)
    b_buf = np.empty(nc_max * kc_max, dtype=a.dtype)
    edge = np.empty(MR * nr, dtype=a.dtype)
    c_flat = c_full.reshape(m * ldc)
    for jc in range(0, n, nc_max):
        nc = min(nc_max, n - jc)
        for pc in range(0, k, kc_max):
            kc = min(kc_max, k - pc)
            _pack_b(b, pc, kc, jc, nc, nr, b_buf)
            for ic in range(0, m, mc_max):
                mc = min(mc_max, m - ic)
                _pack_a(a, ic, mc, pc, kc, a_buf)
                for jr in range(0, nc, nr):
                    b_off = (jr // nr) * kc * nr
                    cols = min(nr, nc - jr)
                    for ir in range(0, mc, MR):
                        a_off = (ir // MR) * kc * MR
                        rows = min(MR, mc - ir)
                        if rows == MR and cols == nr:
                            c_off = (ic + ir) * ldc + jc + jr
                            c_next = c_off + MR * ldc if ir + MR < mc else ic * ldc + jc + jr + nr
                            _microkernel(kc, a_buf, a_off, b_buf, b_off, c_flat, c_off, ldc,
                                         c_next, pc)
                        else:
                            # Ragged micro-tile: same arithmetic on a padded copy.
                            for i in range(MR):
                                for j in range(nr):
                                    if i < rows and j < cols:
                                        edge[i * nr + j] = c[ic + ir + i, jc + jr + j]
                                    else:
                                        edge[i * nr + j] = 0
                            _microkernel(kc, a_buf, a_off, b_buf, b_off, edge, 0, nr, 0, 1)
                            for i in range(rows):
                                for j in range(cols):
                                    c[ic + ir + i, jc + jr + j] = edge[i * nr + j]
    return c


#: ``gemm(a, b, kc, mc, nc) -> a @ b`` for 2-D arrays of one supported dtype (any layout);
#: the result is a view of a row-padded buffer (rows 64 bytes longer when their width
#: is a multiple of 256 bytes).
gemm = numba.njit(_signatures(), nogil=True, cache=True)(_gemm_impl)


def panel_product(a: np.ndarray, b: np.ndarray, tk: int = KC_DEFAULT) -> np.ndarray:
    """Return ``a @ b`` computed by the numba kernel, as a new array of ``a``'s dtype.

    Parameters
    ----------
    a, b : ndarray
        2-D, ``(m, k)`` and ``(k, n)``; ``a.dtype`` is one of ``SUPPORTED``
        (``b`` is cast to it). Any strides; neither is modified.
    tk : int
        The plan's k block (``tile[2]``); the kernel blocks k by ``min(tk, KC)``.
        Each element of C is summed over k in ascending order whatever the
        blocking, so the bits do not depend on ``tk``, ``MC`` or ``NC``.

    Returns
    -------
    ndarray
        ``(m, n)`` of ``a.dtype``: a view of a new buffer whose rows are padded
        (see ``gemm``), so it is row-major but not C-contiguous in general.

    Raises
    ------
    TypeError
        If ``a.dtype`` is not supported.
    ValueError
        If the shapes do not chain.
    """
    a = np.asarray(a)
    if a.dtype.name not in SUPPORTED:
        raise TypeError(f"numba kernels support {SUPPORTED}, got {a.dtype}")
    if not a.dtype.isnative:  # numba compiles native byte order only
        a = a.astype(a.dtype.newbyteorder("="))
    b = np.asarray(b, dtype=a.dtype)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"panel_product needs (m, k) @ (k, n): a is {a.shape}, b is {b.shape}")
    return gemm(a, b, max(min(int(tk), KC), 1), MC, NC)
