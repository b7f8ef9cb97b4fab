"""numpy's floating-point reports (``np.errstate``) for products distmm computes itself:
the numba kernels, float16's rounding, and tiles summed across threads and k groups."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import distmm
from distmm.fpflags import as_matmul, collect, product_flags, report


def outcome(f, a, b, mode):
    """What a call reports under ``np.errstate(all=mode)``: raised or not, the warnings,
    the callback's calls."""
    calls = []
    with warnings.catch_warnings(record=True) as seen, \
            np.errstate(all=mode, call=lambda kind, flag: calls.append(kind)):
        warnings.simplefilter("always")
        try:
            f(a, b)
            raised = None
        except FloatingPointError as e:
            raised = str(e)
    return raised, sorted({str(w.message) for w in seen}), sorted(set(calls))


def specials(rng, dtype, m, k, n, case):
    """Random operands with the values that raise one flag placed at random."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    i, j, p, q = rng.integers(m), rng.integers(n), rng.integers(k), rng.integers(k - 1)
    if case == "inf*0":
        a[i, p] = np.inf
        b[p, j] = 0
    elif case == "inf-inf":  # two terms of one sum, far apart in k
        a[i, 0], a[i, k - 1] = np.inf, -np.inf
        b[0, j], b[k - 1, j] = 1, 1
    elif case == "overflow":  # every term of row i positive: +inf only, never inf - inf
        a[i] = np.finfo(dtype).max / 4
        b = np.abs(b)
        b[:, j] = 3
    elif case == "underflow":  # a float16 sum too small for float16
        a[i] = 1e-4
        b[:, j] = 0
        b[q, j] = 1e-4
    elif case == "nan-in":  # a NaN operand propagates without a flag
        a[i, p] = np.nan
    elif case == "nan-and-inf*0":  # an invalid product where a NaN operand also reaches
        a[i, q] = np.nan
        a[i, k - 1], b[k - 1, j] = np.inf, 0
    elif case == "inf-in":  # an infinity times a finite number: no flag
        a[i, p] = np.inf
        b[p] = 1.5
    return a, b


CASES = ["inf*0", "inf-inf", "overflow", "underflow", "nan-in", "nan-and-inf*0", "inf-in", "none"]


@pytest.mark.parametrize("mode", ["raise", "warn", "ignore", "call"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kw", [{}, {"tile": 64}, {"tile": (32, 32, 48)}],
                         ids=["one-tile", "tiles", "split-k"])
def test_float16_reports_as_numpys_matmul(kw, case, mode):
    """float16: numpy's own loop, in the calling thread, is the reference."""
    rng = np.random.default_rng()
    a, b = specials(rng, np.float16, 150, 200, 130, case)
    want = outcome(np.matmul, a, b, mode)
    got = outcome(lambda x, y: distmm.matmul(x, y, engine="local", **kw), a, b, mode)
    assert got == want
    if mode != "ignore" and case in ("inf*0", "inf-inf", "overflow", "underflow",
                                     "nan-and-inf*0"):
        assert want != (None, [], [])  # the case raises its flag in numpy


@pytest.mark.parametrize("case", [c for c in CASES if c != "underflow"])
@pytest.mark.parametrize("dtype,kw", [(np.float32, {}), (np.float64, {"tile": (64, 64, 64)})],
                         ids=["f32", "f64-split-k"])
def test_numba_kernels_report_the_flags_of_their_operations(dtype, kw, case):
    """float32 and float64 on distmm's numba kernels: the flags of the products and sums
    themselves (numpy's matmul calls BLAS there and reports only the flags its calling
    thread's part of the product raised)."""
    rng = np.random.default_rng()
    a, b = specials(rng, dtype, 150, 200, 130, case)
    with collect() as want:
        (a[:, :, None] * b[None, :, :]).sum(1)
    kinds = {"invalid value": "invalid"}
    _, _, calls = outcome(lambda x, y: distmm.matmul(x, y, engine="local", backend="numba",
                                                     **kw), a, b, "call")
    assert {kinds.get(c, c) for c in calls} == want
    raised, _, _ = outcome(lambda x, y: distmm.matmul(x, y, backend="numba", **kw), a, b, "raise")
    assert (raised is not None) == bool(want)
    assert raised is None or raised.endswith("encountered in matmul")


def test_one_report_per_product_across_threads():
    """Tiles on the pool's threads: one warning for the call, as numpy gives, not one per tile."""
    rng = np.random.default_rng()
    a = rng.standard_normal((256, 96)).astype(np.float16)
    b = rng.standard_normal((96, 256)).astype(np.float16)
    a[:, 0] = np.inf
    b[0, :] = 0  # every tile's sums meet inf * 0
    with warnings.catch_warnings(record=True) as seen, np.errstate(all="warn"):
        warnings.simplefilter("always")
        distmm.matmul(a, b, engine="local", tile=32)
    assert [str(w.message) for w in seen] == ["invalid value encountered in matmul"]


def _into(out_of, f):
    """``f`` with ``out=`` a fresh ``out_of(a, b, shape)`` poisoned with -7 (an operand as
    it is); the outs are kept, each with its contents before the call."""
    made = []

    def call(a, b):
        out = out_of(a, b, a.shape[:-1] + b.shape[-1:])
        if out is not a:
            out[...] = -7
        made.append((out, out.copy()))
        return f(a, b, out=out)

    return call, made


_OUTS = {  # out= as numpy writes it itself (filled, then the report) or through a buffer
    "c-order": lambda a, b, shape: np.empty(shape, a.dtype),
    "transposed": lambda a, b, shape: np.empty(shape[::-1], a.dtype).T,
    "strided": lambda a, b, shape: np.empty((shape[0] * 2,) + shape[1:], a.dtype)[::2],
    "cast": lambda a, b, shape: np.empty(shape, np.float32),
    "overlap": lambda a, b, shape: a,
}


@pytest.mark.parametrize("mode", ["raise", "warn", "call"])
@pytest.mark.parametrize("case", ["inf*0", "overflow", "none"])
@pytest.mark.parametrize("shape", [(2, 2, 2), (150, 130, 130), (3, 40, 50, 50)],
                         ids=["one-tile", "tiles", "stack"])
@pytest.mark.parametrize("kind", list(_OUTS))
def test_out_is_filled_before_the_report_where_numpys_loop_writes_it(kind, shape, case, mode):
    """numpy writes ``out`` and then reports its flags: a ``FloatingPointError`` leaves
    ``out`` holding the result, unless numpy went through a buffer (a cast into ``out``, an
    ``out`` that is an operand), where ``out`` is left as it was; distmm did neither (a one
    tile product, a stack and a cast raised with ``out`` untouched). float16: numpy's own
    loop, whose flags do not depend on BLAS's threads."""
    rng = np.random.default_rng()
    *batch, m, k, n = shape
    a, b = specials(rng, np.float16, m, k, n, case if k > 2 else "none")
    if k == 2 and case != "none":  # two elements: the flag in element (0, 0)
        a[0], b[:, 0] = ((np.inf, 1), (0, 1)) if case == "inf*0" else ((60000, 60000), (2, 0))
    a = np.broadcast_to(a, tuple(batch) + a.shape).copy()
    ref, ref_outs = _into(_OUTS[kind], np.matmul)
    got, got_outs = _into(_OUTS[kind], distmm.matmul)
    want = outcome(ref, a.copy(), b, mode)
    assert outcome(got, a.copy(), b, mode) == want
    np.testing.assert_array_equal(got_outs[0][0], ref_outs[0][0])
    if case != "none" and mode == "raise":
        assert want[0] is not None
        untouched = np.array_equal(*ref_outs[0], equal_nan=True)
        assert untouched == (kind in ("cast", "overlap"))


def _flags_held(dask_worker=None):
    from distmm.engine.dask import tasks

    return {k: set(v) for k, v in tasks._FLAGS.items()}


@pytest.mark.parametrize("mode", ["raise", "warn", "ignore", "call"])
@pytest.mark.parametrize("case", ["inf*0", "inf-inf", "overflow", "underflow", "none"])
def test_dask_cluster_reports_its_workers_flags_as_numpys_matmul(client, case, mode):
    """float16 tiles split along k on two worker processes: the client reports what numpy's
    loop raises, once, under the client's errstate (the workers' own would say nothing to the
    caller), and no worker keeps the call's flags afterwards."""
    rng = np.random.default_rng()
    a, b = specials(rng, np.float16, 150, 200, 130, case)
    want = outcome(np.matmul, a, b, mode)
    got = outcome(lambda x, y: distmm.matmul(x, y, engine="dask", client=client,
                                             tile=(32, 32, 48)), a, b, mode)
    assert got == want
    assert not any(client.run(_flags_held).values())
    if mode != "ignore" and case != "none":
        assert want != (None, [], [])  # the case raises its flag in numpy


@pytest.mark.parametrize("kind", ["c-order", "stack", "cast"])
def test_dask_cluster_fills_out_before_the_report(client, kind):
    """The workers' flags are reported after ``out`` is filled, as numpy's loop does (through
    a cast, ``out`` is left as it was)."""
    rng = np.random.default_rng()
    a, b = specials(rng, np.float16, 150, 200, 130, "inf*0")
    if kind == "stack":
        a = np.stack([a, a[::-1]])
    make = _OUTS["cast" if kind == "cast" else "c-order"]
    ref, ref_outs = _into(make, np.matmul)
    got, got_outs = _into(make, lambda x, y, out: distmm.matmul(
        x, y, out=out, engine="dask", client=client, tile=(32, 32, 48)))
    want = outcome(ref, a, b, "raise")
    assert want[0] is not None
    assert outcome(got, a, b, "raise") == want
    np.testing.assert_array_equal(got_outs[0][0], ref_outs[0][0])


def test_dask_cluster_reports_the_flags_of_object_elements(client):
    """Object elements that are numpy scalars raise flags in their own arithmetic (an int8
    product that wraps): numpy warns or raises; on a cluster they reached only a worker's
    log. (numpy names the operation "scalar multiply"; distmm's report says "matmul".)"""
    a = np.array([[np.int8(100), np.int8(1)]], dtype=object)
    b = np.array([[np.int8(100)], [np.int8(1)]], dtype=object)
    run = lambda x, y: distmm.matmul(x, y, engine="dask", client=client)  # noqa: E731
    raised, _, _ = outcome(run, a, b, "raise")
    assert raised == "overflow encountered in matmul"
    _, warned, _ = outcome(run, a, b, "warn")
    assert warned == ["overflow encountered in matmul"]
    assert outcome(run, a, b, "ignore") == (None, [], [])
    assert outcome(np.matmul, a, b, "raise")[0] is not None
    assert not any(client.run(_flags_held).values())


def test_product_flags_reads_the_result_against_its_rows_and_columns():
    a = np.array([[np.inf, 1.0], [np.nan, 1.0], [1.0, 1.0]])
    b = np.array([[0.0, 2.0], [1.0, 1.0]])
    with np.errstate(all="ignore"):
        p = a @ b
    assert product_flags(a, b, p) == {"invalid"}  # row 0: inf * 0; row 1's NaN is its own
    assert product_flags(a[1:], b, p[1:]) == set()
    big = np.full((1, 2), 1e308)
    with np.errstate(all="ignore"):
        assert product_flags(big, np.ones((2, 1)), big @ np.ones((2, 1))) == {"overflow"}
    assert product_flags(np.ones((2, 2), np.int64), np.ones((2, 2), np.int64),
                         np.ones((2, 2), np.int64)) == set()


@pytest.mark.parametrize("flags", [{"invalid"}, {"overflow"}, {"underflow"},
                                   {"overflow", "invalid"}, {"overflow", "underflow", "invalid"}])
def test_report_raises_exactly_the_flags_asked(flags):
    calls = []
    with np.errstate(all="call", call=lambda kind, flag: calls.append(kind)):
        report(flags)
    names = {"invalid value": "invalid", "overflow": "overflow", "underflow": "underflow"}
    assert {names[c] for c in calls} == flags


def test_collect_holds_back_and_as_matmul_reports_once():
    with np.errstate(all="raise"):
        with collect() as seen:
            np.array([np.inf]) - np.array([np.inf])
        assert seen == {"invalid"}
        with pytest.raises(FloatingPointError, match="overflow encountered in matmul"):
            with as_matmul():
                np.array([1e308]) * 10
                np.array([np.inf]) * 0


def _int8_objects(rng, shape):
    x = np.empty(shape, dtype=object)
    x.ravel()[:] = [np.int8(v) for v in rng.integers(-100, 100, x.size)]
    return x


@pytest.mark.parametrize("mode", ["raise", "warn", "call"])
@pytest.mark.parametrize("kw", [{}, {"tile": 2}, {"tile": (2, 2, 2)}],
                         ids=["one-tile", "tiles", "tk-2"])
def test_object_elements_report_as_numpys_scalars(kw, mode):
    """Object elements that are numpy scalars report their own flags, in the calling thread,
    as numpy's object loop does: "overflow encountered in scalar multiply" (and "... scalar
    add"), the first one raised under "raise". Tiles and stacks said "... in matmul"."""
    rng = np.random.default_rng()
    a, b = _int8_objects(rng, (2, 5, 6)), _int8_objects(rng, (6, 4))
    # the first operation overflows: under "raise" the first error is the same whatever the
    # order of elements (tiles take them in another order than numpy's row-major loop)
    a[0, 0, 0], b[0, 0] = np.int8(100), np.int8(100)
    want = outcome(np.matmul, a, b, mode)
    got = outcome(lambda x, y: distmm.matmul(x, y, engine="local", **kw), a, b, mode)
    assert got == want
    assert want[2] == ["overflow"] if mode == "call" else "in scalar multiply" in str(want)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(distmm.matmul(a, b, engine="local", **kw),
                                      np.matmul(a, b))


@pytest.mark.parametrize("mode", ["raise", "warn", "call"])
@pytest.mark.parametrize("kw", [{}, {"tile": 1}], ids=["one-tile", "tiles"])
def test_float16_reports_several_flags_in_numpys_order(kw, mode):
    """An overflow (the float16 rounding) and an invalid (inf * 0) in one product: numpy
    reports them together, overflow first; one tile raised the kernel's invalid first."""
    a = np.array([[60000, 1], [np.inf, 1]], np.float16)
    b = np.array([[4, 0], [0, 1]], np.float16)
    want = outcome(np.matmul, a, b, mode)
    assert outcome(lambda x, y: distmm.matmul(x, y, engine="local", **kw), a, b, mode) == want
