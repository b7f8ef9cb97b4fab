"""The ``out=`` cases of tests/test_matmul_out_heldback.py, shared by its pytest cases and
the script its MPI case runs on each rank (not collected by pytest).

This module covers: ``out_cases(folder)``, each case's fresh operands and ``out``, and
``compare``, which asks distmm.matmul on an engine and numpy.matmul the same case and says
``"ok"`` or what differed.
"""
from __future__ import annotations

import os
import warnings

import dask.array as da
import numpy as np

import distmm


class Sub(np.ndarray):
    """A user's own ndarray subclass (no ``__array_wrap__`` of its own)."""


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
