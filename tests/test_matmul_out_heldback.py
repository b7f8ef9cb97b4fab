"""Held-back cases of distmm.matmul against numpy.matmul (with dask, where a dask operand
hands numpy's call to dask): ndarray subclasses beside a dask operand, and ``out=`` on the
local, Dask and MPI engines.

This module covers: an ``np.matrix``, a masked array or a user's subclass beside a dask
operand (numpy+dask's lazy dask array of the subclass's chunks, no work at the call, or
their ValueError at the call), and ``out=`` as numpy takes it: a wrong shape, one the
result broadcasts into, a dtype under each ``casting`` (with ``dtype=`` too), an ``out``
that is ``a`` or ``b`` or overlaps them, Fortran, strided and negative-stride views,
read-only arrays and memmaps, ``.npy`` memmaps, ``np.matrix`` and masked ``out``, a tuple,
1-D operands, stacks, a dask ``out``; on refusal ``out`` keeps its NaN poison, inputs are
never modified, and the result is ``out`` itself. Each case is asked of numpy on the same
fresh operands.
It does *not* cover: numpy's own matmul tests (tests/test_numpy_suite.py), ``axes=`` with
``out=`` (tests/test_suite_parity.py), on-disk ``out`` (tests/test_out_on_disk.py).
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import distmm
from conftest import run_rank_script

da = pytest.importorskip("dask.array")

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")


class Sub(np.ndarray):
    """A user's own ndarray subclass (no ``__array_wrap__`` of its own)."""


# -- subclasses beside a dask operand -----------------------------------------------------------

def _subclass(kind, x):
    if kind == "matrix":
        return np.matrix(x)
    if kind == "masked":
        return np.ma.masked_array(x, mask=x > 0.5)
    return x.view(Sub)


def _computed(x):
    """``("ok", value)`` or ``("error", type)`` of computing a dask array."""
    try:
        return "ok", x.compute()
    except Exception as exc:
        return "error", type(exc)


@pytest.mark.parametrize("kind", ["matrix", "masked", "user"])
@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("split", [False, True], ids=["one chunk", "n chunks"])
def test_a_subclass_beside_a_dask_operand_is_numpy_and_dasks_lazy_result(kind, side, split):
    """numpy hands the call to dask: a lazy dask array whose chunks are the subclass (k in
    one chunk: dask builds no sum of an np.matrix), computing to numpy+dask's values and type,
    or failing as theirs does (a masked product's chunk masks) (was: computed at the call and
    wrapped, an np.matrix or a masked array, or dask's error at the call)."""
    rng = np.random.default_rng()
    x, y = rng.random((5, 5)), rng.random((5, 5))
    sub = _subclass(kind, x)
    other = 2 if split else -1
    ops = (sub, da.from_array(y, chunks=(-1, other))) if side == "a" else \
        (da.from_array(y, chunks=(other, -1)), sub)
    want = np.matmul(*ops)
    got = distmm.matmul(*ops, engine="local")
    assert isinstance(want, da.Array) and isinstance(got, da.Array), type(got)
    assert type(got._meta) is type(want._meta)
    (w_ok, w), (g_ok, g) = _computed(want), _computed(got)
    assert w_ok == g_ok
    if w_ok == "error":
        assert g is w
        return
    assert type(g) is type(w) and g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-13)
    np.testing.assert_array_equal(np.ma.getmaskarray(g), np.ma.getmaskarray(w))


def test_a_subclass_beside_a_dask_operand_does_no_work_at_the_call():
    """The dask operand's chunks are not computed by the call (was: computed, to wrap)."""
    rng = np.random.default_rng()
    calls = []

    def chunk(block):
        calls.append(block.shape)
        return block

    y = da.from_array(rng.random((4, 3)), chunks=-1).map_blocks(chunk, meta=np.empty((0, 0)))
    for sub in (np.matrix(rng.random((5, 4))), np.ma.masked_array(rng.random((5, 4)))):
        result = distmm.matmul(sub, y, engine="local")
        assert isinstance(result, da.Array) and not calls, calls


def test_a_matrix_beside_a_dask_operand_of_several_k_chunks_is_numpys_outcome():
    """An np.matrix whose product dask sums over k chunks: numpy + dask's own outcome at the
    call (dask 2026's ValueError; 2024.12's lazy array, whose computing fails), never the
    eager np.matrix distmm returned; the operands stay as they were."""
    rng = np.random.default_rng()
    x, y = rng.random((3, 7)), rng.random((7, 5))
    a, b = np.matrix(x), da.from_array(y, chunks=2)
    try:
        theirs, error = np.matmul(a, b), None
    except Exception as exc:  # noqa: BLE001 - whatever they raise, distmm raises
        theirs, error = None, type(exc)
    if error is not None:
        with pytest.raises(error, match="matrix" if error is ValueError else None):
            distmm.matmul(a, b, engine="local")
    else:
        ours = distmm.matmul(a, b, engine="local")
        assert isinstance(ours, da.Array) and type(ours._meta) is type(theirs._meta)
        try:
            expected = theirs.compute()
        except Exception as exc:  # noqa: BLE001
            with pytest.raises(type(exc)):
                ours.compute()
        else:
            got = ours.compute()
            assert type(got) is type(expected)
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(a), x)


def test_a_subclass_beside_a_dask_operand_keeps_distmms_refusals():
    """distmm's checks come first: a shape mismatch, engine='mpi' (no dask operands), an
    unknown precision; ``subok=False`` gives a plain lazy array, as for an ndarray."""
    rng = np.random.default_rng()
    a, y = np.matrix(rng.random((3, 4))), da.from_array(rng.random((4, 5)), chunks=2)
    with pytest.raises(ValueError, match="inner dimensions"):
        distmm.matmul(a, y.T, engine="local")
    with pytest.raises(ValueError, match="not dask arrays"):
        distmm.matmul(a, y, engine="mpi")
    with pytest.raises(ValueError):
        distmm.matmul(a, y, engine="local", precision="nope")
    plain = distmm.matmul(a, y, engine="local", subok=False)
    assert type(plain._meta) is np.ndarray
    np.testing.assert_allclose(plain.compute(), np.asarray(a) @ y.compute(), rtol=1e-13)


# -- out= on every engine -----------------------------------------------------------------------

def _nan(shape, dtype=np.float64, order="C"):
    """An out poisoned with NaN (3 for integers), to tell a refusal's untouched out."""
    o = np.empty(shape, dtype, order=order)
    o[...] = np.nan if np.dtype(dtype).kind in "fc" else 3
    return o


def out_cases(folder):
    """``[(name, make, keywords)]``: ``make(rng)`` gives fresh ``(a, b, out)``."""
    def r(rng, *shape):
        return rng.random(shape)

    def aliased(which):
        def make(rng):
            x = r(rng, 4, 4)
            return (x, r(rng, 4, 4), x) if which == "a" else (r(rng, 4, 4), x, x)
        return make

    def partial(rng):
        buf = r(rng, 5, 5)
        return buf[:4, :4], r(rng, 4, 4), buf[1:, 1:]

    def transposed(rng):
        x = r(rng, 4, 4)
        return x, r(rng, 4, 4), x.T

    def stack_partial(rng):
        buf = r(rng, 2, 4, 4)
        return buf[:, :3], r(rng, 2, 4, 4), buf[:, 1:]

    def read_only(rng):
        o = _nan((3, 5))
        o.flags.writeable = False
        return r(rng, 3, 4), r(rng, 4, 5), o

    def memmap(mode):
        def make(rng):
            path = os.path.join(folder, f"out_{mode}_{rng.integers(1 << 30)}.npy")
            np.save(path, _nan((3, 5)))
            return r(rng, 3, 4), r(rng, 4, 5), np.load(path, mmap_mode=mode)
        return make

    def ints(rng, *shape):
        return rng.integers(-9, 10, shape)

    def two(sa, sb, out, **kw):
        return lambda rng: (r(rng, *sa), r(rng, *sb), out(**kw) if callable(out) else out)

    return [
        ("wrong shape", two((3, 4), (4, 5), lambda: _nan((3, 4))), {}),
        ("batch it broadcasts into", two((3, 4), (4, 5), lambda: _nan((2, 3, 5))), {}),
        ("int out, same_kind", two((3, 4), (4, 5), lambda: _nan((3, 5), np.int64)), {}),
        ("int out, unsafe", two((3, 4), (4, 5), lambda: _nan((3, 5), np.int64)),
         {"casting": "unsafe"}),
        ("float32 out, same_kind", two((3, 4), (4, 5), lambda: _nan((3, 5), np.float32)), {}),
        ("float32 out, safe", two((3, 4), (4, 5), lambda: _nan((3, 5), np.float32)),
         {"casting": "safe"}),
        ("complex out, no", two((3, 4), (4, 5), lambda: _nan((3, 5), complex)),
         {"casting": "no"}),
        ("complex out, equiv", two((3, 4), (4, 5), lambda: _nan((3, 5), complex)),
         {"casting": "equiv"}),
        ("int8 out of int64, same_kind",
         lambda rng: (ints(rng, 3, 40) * 9, ints(rng, 40, 5) * 9, _nan((3, 5), np.int8)), {}),
        ("float16 out", two((3, 4), (4, 5), lambda: _nan((3, 5), np.float16)), {}),
        ("dtype float32, float64 out, safe", two((3, 4), (4, 5), lambda: _nan((3, 5))),
         {"dtype": np.float32, "casting": "safe"}),
        ("dtype float32, float64 out", two((3, 4), (4, 5), lambda: _nan((3, 5))),
         {"dtype": np.float32}),
        ("dtype float64, float32 out", two((3, 4), (4, 5), lambda: _nan((3, 5), np.float32)),
         {"dtype": np.float64}),
        ("dtype complex, float64 out, unsafe", two((3, 4), (4, 5), lambda: _nan((3, 5))),
         {"dtype": complex, "casting": "unsafe"}),
        ("dtype int, float64 out, same_kind", two((3, 4), (4, 5), lambda: _nan((3, 5))),
         {"dtype": np.int64, "casting": "same_kind"}),
        ("out is a", aliased("a"), {}),
        ("out is b", aliased("b"), {}),
        ("out overlaps a", partial, {}),
        ("out is a.T", transposed, {}),
        ("stacked out overlaps a", stack_partial, {}),
        ("Fortran out", two((3, 4), (4, 5), lambda: _nan((3, 5), order="F")), {}),
        ("strided out", two((3, 4), (4, 5), lambda: _nan((6, 10))[::2, ::3]), {}),
        ("negative strides", two((3, 4), (4, 5), lambda: _nan((3, 5))[::-1, ::-1]), {}),
        ("read-only out", read_only, {}),
        (".npy memmap out", memmap("r+"), {}),
        ("read-only memmap out", memmap("r"), {}),
        ("copy-on-write memmap out", memmap("c"), {}),
        ("np.matrix out", two((3, 4), (4, 5), lambda: np.matrix(_nan((3, 5)))), {}),
        ("masked out, shapes its masks refuse",
         two((3, 4), (4, 5), lambda: np.ma.masked_array(_nan((3, 5)))), {}),
        ("masked out", two((4, 4), (4, 4), lambda: np.ma.masked_array(_nan((4, 4)))), {}),
        ("user subclass out", two((3, 4), (4, 5), lambda: _nan((3, 5)).view(Sub)), {}),
        ("tuple out", two((3, 4), (4, 5), lambda: (_nan((3, 5)),)), {}),
        ("vector @ matrix", two((4,), (4, 5), lambda: _nan((5,))), {}),
        ("vector @ matrix, (1, 5) out", two((4,), (4, 5), lambda: _nan((1, 5))), {}),
        ("vector @ matrix, (2, 5) out", two((4,), (4, 5), lambda: _nan((2, 5))), {}),
        ("matrix @ vector, (3, 1) out", two((3, 4), (4,), lambda: _nan((3, 1))), {}),
        ("vector @ vector, 0-d out", two((4,), (4,), lambda: _nan(())), {}),
        ("vector @ vector, (3,) out", two((4,), (4,), lambda: _nan((3,))), {}),
        ("stack", two((2, 3, 4), (4, 5), lambda: _nan((2, 3, 5))), {}),
        ("stack, Fortran out", two((2, 3, 4), (2, 4, 5), lambda: _nan((2, 3, 5), order="F")),
         {}),
        ("stack, out of another batch", two((2, 3, 4), (4, 5), lambda: _nan((3, 3, 5))), {}),
        ("stack, vector operand", two((4,), (2, 4, 5), lambda: _nan((3, 2, 5))), {}),
        ("object out", lambda rng: (r(rng, 3, 4).astype(object), r(rng, 4, 5),
                                    _nan((3, 5), object)), {}),
        ("int out of object", lambda rng: (r(rng, 3, 4).astype(object), r(rng, 4, 5),
                                           _nan((3, 5), np.int64)), {}),
        ("dask out", two((3, 4), (4, 5), lambda: da.zeros((3, 5))), {}),
        ("list out", two((3, 4), (4, 5), [[0.0] * 5] * 3), {}),
        ("empty k", two((3, 0), (0, 5), lambda: _nan((3, 5))), {}),
    ]


def _copy(x):
    return np.array(x, copy=True, subok=True) if isinstance(x, np.ndarray) else x


def _run(f, make, seed, kw):
    """``(outcome, out after, inputs modified)`` of ``f(a, b, out=out, **kw)``: outcome is
    ``("ok", returned out itself)`` or ``("error", type)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        a, b, out = make(np.random.default_rng(seed))
    target = out[0] if isinstance(out, tuple) else out
    before = [_copy(x) for x in (a, b)]
    try:
        with warnings.catch_warnings():  # a complex product cast to a real out: both warn
            warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
            result = f(a, b, out=out, **kw)
        outcome = ("ok", result is target)
    except Exception as exc:
        outcome = ("error", type(exc))
    aliased = isinstance(target, np.ndarray) and any(np.shares_memory(target, x) for x in (a, b))
    modified = not aliased and not all(np.array_equal(x, y) for x, y in zip((a, b), before))
    return outcome, (_copy(target) if isinstance(target, np.ndarray) else None), modified


def compare(name, make, kw, seed, **engine) -> str:
    """``"ok"`` where distmm.matmul on ``engine`` did what numpy.matmul did on the same
    operands: the same outcome, ``out`` itself returned, ``out`` after (values within a
    float64 bound, dtype, type, mask; untouched on a refusal), no input modified."""
    want, want_out, _ = _run(np.matmul, make, seed, kw)
    got, got_out, modified = _run(lambda *x, **k: distmm.matmul(*x, **k, **engine), make,
                                  seed, kw)
    if got != want or modified:
        return f"BAD {got} (numpy {want}), inputs modified: {modified}"
    if want_out is None:
        return "ok"
    if type(got_out) is not type(want_out) or got_out.dtype != want_out.dtype:
        return f"BAD out {type(got_out).__name__} {got_out.dtype}"
    if not np.array_equal(np.ma.getmaskarray(got_out), np.ma.getmaskarray(want_out)):
        return "BAD mask"
    g, w = np.asarray(got_out), np.asarray(want_out)
    if w.dtype == object:
        g, w = g.astype(np.float64), w.astype(np.float64)
    rtol = 0  # a refusal's untouched out, integers: exact
    if want[0] == "ok" and w.dtype.kind in "fc":  # sums of another order (k <= 4)
        loops = [w.dtype] + ([np.dtype(kw["dtype"])] if "dtype" in kw else [])
        rtol = 32 * max(np.finfo(dt).eps for dt in loops if dt.kind in "fc")
    if g.shape != w.shape or not np.allclose(g, w, rtol=rtol, atol=0, equal_nan=True):
        return f"BAD values {g!r} (numpy {w!r})"
    return "ok"


@pytest.mark.parametrize("case", range(len(out_cases("."))),
                         ids=[c[0] for c in out_cases(".")])
def test_out_on_the_local_engine_is_numpys(case, tmp_path):
    name, make, kw = out_cases(str(tmp_path))[case]
    seed = int(np.random.default_rng().integers(1 << 31))
    assert compare(name, make, kw, seed, engine="local") == "ok"


@pytest.mark.slow  # a cluster of two worker processes
def test_out_on_a_dask_cluster_is_numpys(client, tmp_path):
    seed = int(np.random.default_rng().integers(1 << 31))
    bad = [f"{name}: {verdict}" for name, make, kw in out_cases(str(tmp_path))
           if (verdict := compare(name, make, kw, seed, engine="dask", client=client)) != "ok"]
    assert not bad, bad


MPI_SCRIPT = r'''
import sys, warnings
import numpy as np
from mpi4py import MPI

sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore", PendingDeprecationWarning)
from test_matmul_out_heldback import compare, out_cases

comm = MPI.COMM_WORLD
seed = comm.bcast(int(np.random.default_rng().integers(1 << 31)) if comm.rank == 0 else None)
folder = sys.argv[2] + f"/rank{comm.rank}"
import os
os.makedirs(folder, exist_ok=True)
lines = [f"rank {comm.rank}: {name}: {compare(name, make, kw, seed, engine='mpi')}"
         for name, make, kw in out_cases(folder)]
for mine in comm.gather(lines) or []:
    print("\n".join(mine), flush=True)
'''


@pytest.mark.mpi
@pytest.mark.slow  # one mpiexec launch each
@pytest.mark.parametrize("ranks", [1, 2])
def test_out_under_mpiexec_is_numpys(ranks, tmp_path, mpirun):
    """engine="mpi" on 1 and 2 ranks: every out= case above, on every rank."""
    tests = os.path.dirname(os.path.abspath(__file__))
    r, lines, bad = run_rank_script(mpirun, tmp_path / "out_heldback.py", MPI_SCRIPT, ranks,
                                    tests, tmp_path, timeout=240)
    assert len(lines) == len(out_cases(".")) * ranks and not bad, \
        r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
