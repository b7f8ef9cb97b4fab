"""numpy's floating-point reports (``np.errstate``) for products distmm computes itself:
the numba kernels, float16's rounding, and tiles summed across threads and k groups."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import distmm
from distmm.fpflags import (KEPT_REPORTS, as_matmul, collect, object_rows, product_flags,
                            report)


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
@pytest.mark.slow
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
@pytest.mark.slow
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


def in_order(f, a, b, warnings_as="always", **state):
    """What a call reports under ``np.errstate(**state)``, in order: the error raised (its
    type and message), the warnings, the callback's calls (kind and flag)."""
    calls = []
    with warnings.catch_warnings(record=True) as seen, \
            np.errstate(**state, call=lambda kind, flag: calls.append((kind, flag))):
        warnings.simplefilter(warnings_as)
        try:
            f(a, b)
            raised = None
        except (FloatingPointError, RuntimeWarning) as e:
            raised = (type(e).__name__, str(e))
    return raised, [str(w.message) for w in seen], calls


#: errstates and warning filters an object product's reports are compared under
STATES = [({"all": "warn"}, "always"), ({"all": "warn"}, "error"), ({"all": "raise"}, "always"),
          ({"all": "ignore"}, "always"), ({"all": "call"}, "always"),
          ({"over": "ignore", "invalid": "raise"}, "always"),
          ({"over": "raise", "invalid": "ignore"}, "always"),
          ({"over": "warn", "invalid": "call"}, "always")]


def object_cases():
    """Object operands whose elements report in numpy's loop, by name: numpy scalars of
    several types (reports in four elements, of two kinds and two operations, whose order
    only numpy's row-major loop gives), a float32 sum left overflowing in the first row
    (numpy's loop reports "in matmul" only for the last one) or the last, Python floats
    (their flags stay set: "in matmul"), Fractions, Decimals and Python ints beside numpy
    integers, a stack, and int8 products that wrap in most elements."""
    from decimal import Decimal
    from fractions import Fraction

    h, i8, f32 = np.float16, np.int8, np.float32
    o = lambda rows: np.array(rows, dtype=object)  # noqa: E731
    rng = np.random.default_rng(7)
    wraps = o([[i8(v) for v in r] for r in rng.integers(-100, 100, (5, 4))])
    wraps_b = o([[i8(v) for v in r] for r in rng.integers(-100, 100, (4, 6))])
    order_a = o([[h(60000), h(60000), 0], [h(np.inf), h(-np.inf), i8(100)]])
    order_b = o([[h(1), i8(1)], [h(1), 0], [0, i8(100)]])
    return {
        "order": (order_a, order_b),
        "sum-left-first": (o([[f32(3e38), f32(3e38)], [f32(1), f32(1)]]), o([[f32(1)], [f32(1)]])),
        "sum-left-last": (o([[f32(1), f32(1)], [f32(3e38), f32(3e38)]]), o([[f32(1)], [f32(1)]])),
        "python-floats": (o([[1e308, 1.0], [1.0, 1.0]]), o([[10.0], [1.0]])),
        "mixed": (o([[Fraction(1, 3), 2, i8(100)], [Decimal("1.5"), 3, 1], [1e308, 2**70, 1.0]]),
                  o([[3, 1], [2, 2], [100, 0]])),
        "stack": (np.stack([order_a, order_a[::-1]]), order_b),
        "wraps": (wraps, wraps_b),
    }


#: numpy 1.x's float16 scalars report their arithmetic in another order than numpy 2's (the
#: "order" and "stack" cases), which the engines' replay (``fpflags.object_rows``) follows
NUMPY1 = np.lib.NumpyVersion(np.__version__) < "2.0.0"


def _numpy2_order(case: str) -> None:
    if NUMPY1 and case in ("order", "stack"):
        pytest.skip("numpy 1.x's float16 scalars report in another order than numpy 2's, "
                    "which the replay follows")


def _numpys_loop(case):
    """numpy's matmul; for a stack, its 2-D products one after the other: numpy's loop over
    a stack goes on to the next product after an element's error, raising the last
    product's first error (or, a warning being an error, a SystemError), where the local
    engine and this one stop at the first."""
    if case != "stack":
        return np.matmul
    return lambda a, b: [np.matmul(x, b) for x in a]


@pytest.mark.parametrize("case", list(object_cases()))
@pytest.mark.parametrize("state,warnings_as", [  # the last states with the slow cases
    pytest.param(s, w, id=f"{s}-{w}", marks=[pytest.mark.slow] if n > 4 else [])
    for n, (s, w) in enumerate(STATES)])
@pytest.mark.slow
def test_dask_cluster_reports_object_elements_as_numpy(client, case, state, warnings_as):
    """Object elements that are numpy scalars report in their own arithmetic ("overflow
    encountered in scalar multiply", "... scalar add"), once per operation, in numpy's
    row-major order, the first error numpy raises; a flag left set at the loop's end is
    numpy's "in matmul". Each element a task of its own, on two worker processes: the
    client said "overflow encountered in matmul" once for everything."""
    _numpy2_order(case)
    a, b = object_cases()[case]
    want = in_order(_numpys_loop(case), a, b, warnings_as, **state)
    for tile in (1, None):
        got = in_order(lambda x, y: distmm.matmul(x, y, engine="dask", client=client,
                                                  tile=tile), a, b, warnings_as, **state)
        assert got == want, tile
    assert not any(client.run(_flags_held).values())
    if case != "mixed" and state == {"all": "warn"}:
        assert want[1] or want[0]  # the case reports in numpy
    if want[0] is None:
        assert in_order(np.matmul, a, b, warnings_as, **state) == want
    with np.errstate(all="ignore"):
        got = distmm.matmul(a, b, engine="dask", client=client, tile=1)
        assert repr(got.tolist()) == repr(np.matmul(a, b).tolist())  # NaNs, types


def test_dask_cluster_reports_object_elements_with_np_seterrcall(client):
    """np.seterrcall and np.seterr (not an errstate): the callback gets numpy's calls."""
    _numpy2_order("order")
    a, b = object_cases()["order"]
    old, old_call = np.geterr(), np.geterrcall()
    for f in (np.matmul, lambda x, y: distmm.matmul(x, y, engine="dask", client=client,
                                                   tile=1)):
        calls = []
        np.seterrcall(lambda kind, flag: calls.append((kind, flag)))
        np.seterr(all="call")
        try:
            f(a, b)
        finally:
            np.seterr(**old)
            np.seterrcall(old_call)
        if f is np.matmul:
            want = calls
    assert calls == want and len(want) == 4


@pytest.mark.parametrize("case", ["order", "sum-left-first", "python-floats", "wraps"])
def test_object_rows_report_in_numpys_order_whatever_order_the_blocks_ran(case):
    """The elements of an object product computed last to first, inside ``collect`` (as
    on workers): ``report`` gives numpy's reports, in numpy's order."""
    _numpy2_order(case)
    a, b = object_cases()[case]

    def blocks(x, y):
        with collect() as seen:
            for r in reversed(range(x.shape[0])):
                for c in reversed(range(y.shape[1])):
                    object_rows(np.matmul, x[r:r + 1], y[:, c:c + 1], (r, c))
        report(seen)

    for state, warnings_as in STATES:
        assert in_order(blocks, a, b, warnings_as, **state) == \
            in_order(np.matmul, a, b, warnings_as, **state), state


@pytest.mark.slow
def test_object_rows_keep_a_bounded_number_of_reports():
    """int8 products that wrap in most of 64000 multiplications: the first KEPT_REPORTS
    reports are numpy's, in order, then each row's distinct ones once (not all of them)."""
    rng = np.random.default_rng(3)
    a = np.array([[np.int8(v) for v in r] for r in rng.integers(-100, 100, (40, 40))], object)
    b = np.array([[np.int8(v) for v in r] for r in rng.integers(-100, 100, (40, 40))], object)

    def kept(x, y):
        with collect() as seen:
            object_rows(np.matmul, x, y, (0, 0))
        report(seen)

    raised, want, _ = in_order(np.matmul, a, b)
    _, got, _ = in_order(kept, a, b)
    assert len(want) > 2 * KEPT_REPORTS
    assert got[:KEPT_REPORTS] == want[:KEPT_REPORTS] and set(got) == set(want)
    assert len(got) < KEPT_REPORTS + 3 * a.shape[0]
    assert in_order(kept, a, b, all="raise") == in_order(np.matmul, a, b, all="raise")


MPI_OBJECTS = """
import pickle, sys, threading, warnings
import numpy as np
from mpi4py import MPI
import distmm
from distmm.engine.mpi import DistArray, MPIEngine
from distmm.grid import grid_shapes, make_grid

comm = MPI.COMM_WORLD
with open(sys.argv[1], "rb") as f:
    cases, states = pickle.load(f)
engine, got = MPIEngine(comm), {}
for name, (a, b) in cases.items():
    for s, (state, warnings_as) in enumerate(states):
        got[name, s, "matmul"] = in_order(lambda x, y: distmm.matmul(x, y, engine="mpi"), a, b,
                                          warnings_as, **state)
        if a.ndim > 2:
            continue
        da, db = DistArray.from_array(a, comm), DistArray.from_array(b, comm)
        for shape in grid_shapes(comm.size):
            grid = make_grid(a.shape[0], b.shape[1], a.shape[1], "object", ranks=comm.size,
                             grid=shape)
            for streamed in (False, True):
                got[name, s, shape, streamed] = in_order(
                    lambda x, y: engine.run_distributed(x, y, grid, "auto", streamed=streamed),
                    da, db, warnings_as, **state)


class Held:  # an element that does not pickle (it holds a lock): every rank runs numpy's loop
    def __init__(self, v):
        self.v, self.lock = v, threading.Lock()

    def __mul__(self, other):
        return Held(self.v * getattr(other, "v", other))

    def __add__(self, other):
        return Held(self.v + getattr(other, "v", other))

    __rmul__, __radd__ = __mul__, __add__


a, b = cases["order"] if "order" in cases else cases["mixed"]  # (numpy 1.x: no "order")
a = np.concatenate([a, np.array([[Held(1), 1, 1]], dtype=object)])
for s, (state, warnings_as) in enumerate(states):
    got["held", s, "numpy"] = in_order(np.matmul, a, b, warnings_as, **state)
    got["held", s, "matmul"] = in_order(lambda x, y: distmm.matmul(x, y, engine="mpi"), a, b,
                                        warnings_as, **state)
with open(f"{sys.argv[2]}-{comm.rank}", "wb") as f:
    pickle.dump(got, f)
"""


@pytest.mark.slow  # 15 s: the fast suite keeps the Dask cases of the same reports
@pytest.mark.mpi
def test_mpi_ranks_report_object_elements_as_numpy(tmp_path, mpirun):
    """Object elements that are numpy scalars on two ranks (each its block of C, by rows,
    by columns or by layers, in core or in stripes; or, an element that does not pickle,
    every rank the whole product): every rank reports what numpy's loop reports, in its
    order, the first error numpy raises; they said "overflow encountered in matmul" once
    for everything."""
    import inspect
    import pickle

    cases = {name: ops for name, ops in object_cases().items()  # (see _numpy2_order)
             if not (NUMPY1 and name in ("order", "stack"))}
    with open(tmp_path / "cases.pkl", "wb") as f:
        pickle.dump((cases, STATES), f)
    script = tmp_path / "objects.py"
    script.write_text(MPI_OBJECTS.replace("comm = MPI.COMM_WORLD", inspect.getsource(in_order)
                                          + "\n\ncomm = MPI.COMM_WORLD"))
    r = mpirun(2, script, tmp_path / "cases.pkl", tmp_path / "got", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"got-{rank}", "rb") as f:
            got = pickle.load(f)
        assert len(got) > len(cases) * len(STATES)
        for (name, s, *how), outcome in got.items():
            state, warnings_as = STATES[s]
            if name == "held":  # numpy's own outcome on that rank
                assert outcome == got["held", s, "numpy"], (rank, state, warnings_as)
                continue
            a, b = cases[name]
            assert outcome == in_order(_numpys_loop(name), a, b, warnings_as, **state), \
                (rank, name, state, warnings_as, how)


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
