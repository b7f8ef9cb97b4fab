"""numpy's own matmul tests, run against ``distmm.matmul``.

The test sources come from the installed numpy (``numpy/_core/tests`` in numpy 2,
``numpy/core/tests`` in numpy 1.26), read with ``ast`` when this module is imported; in
their text ``np.matmul`` (and numpy's test copy ``umt.matmul``) becomes distmm's matmul
on one engine, and the result is run as pytest items of this module. numpy itself is not
patched: numpy's own matmul stays the reference where a test compares with it, and distmm
may call it. Each item asserts what numpy's test asserts.

What runs, for each engine (class and function names end in the engine's name):

- ``test_multiarray.py``: ``MatmulCommon`` through ``TestMatmul``, ``TestMatmulInplace``
  (``a @= b`` as numpy computes it: ``matmul(a, b, out=(a,), axes=...)``), ``test_matmul_axes``,
  and ``TestMethods``' ``test_dot_matmul_out``, ``test_dot_matmul_inner_array_casting_fails``
  and ``test_matmul_out``; of ``TestMatmulOperator`` the case a function can meet (which
  operands ``matmul`` refuses, with numpy's exception type);
- ``test_ufunc.py``: ``test_can_ignore_signature`` (as in numpy's text), and the matmul
  cases of ``test_vecdot_matvec_vecmat_complex``, ``test_axes_argument``,
  ``test_ufunc_types``, ``test_ufunc_noncontiguous`` and ``test_params_common_gufunc``
  (those tests loop over many ufuncs: their matmul case is transcribed here; the last one
  only where the installed numpy has it, since numpy 1.26's ufuncs have no signature);
- ``linalg``'s ``test_matmul`` and ``test_mixins.py``'s ``TestNDArrayOperatorsMixin.test_matmul``
  (transcribed: numpy 1.26 has no ``np.linalg.matmul``).

Engines: the default (``engine="auto"``), ``"local"``, the one-rank ``"mpi"`` engine in this
process, and ``"dask"`` on an in-process cluster (threads, no worker processes). Marked
``slow``: every dask item (the engine's set-up per product makes them seconds in all), and
on every engine ``TestMatmulInplace.test_shapes``' ``2d_large`` and ``3d_large`` cases
(10**5 rows, 10**4 stacked matrices).

Left out: the ``@`` operator itself (``TestMatmulOperator``'s other cases, ``__matmul__``
and ``__rmatmul__`` overrides: distmm has no operator), ``np.matmul.at`` and the ufunc
object's attributes (distmm's matmul is a function; only the absence of ``.at`` is
checked), and tests of numpy's internal modules (``_multiarray_tests``, ``_umath_tests``
beyond the reference above).

numpy's test sources missing altogether (a stripped install): the module is skipped.
The folder present but ``MatmulCommon`` or ``TestMatmul`` not found in it: a failure.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import itertools
import operator
import os
import pathlib
import warnings
from unittest import mock

import numpy as np
import numpy.testing as npt
import pytest
from numpy.exceptions import ComplexWarning

import distmm

_NUMPY = pathlib.Path(np.__file__).parent
_TESTS = next((p for p in (_NUMPY / "_core" / "tests", _NUMPY / "core" / "tests")
               if (p / "test_multiarray.py").is_file()), None)
if _TESTS is None:
    pytest.skip(f"numpy {np.__version__}'s test sources are not installed",
                allow_module_level=True)

# engine -> whether its items go under the slow marker
ENGINES = {"default": False, "local": False, "mpi": False, "dask": True}
REQUIRED = ("MatmulCommon", "TestMatmul")
_IMPORTED: dict = {}  # the names numpy's test files import


def _definitions(path: pathlib.Path) -> tuple[str, dict]:
    """A numpy test file's text and its classes and functions by name (the imports at its
    top run into ``_IMPORTED``, as the names its test text uses)."""
    text = path.read_text() if path.is_file() else ""
    tree = ast.parse(text)
    found: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            found.setdefault(node.name, node)
    # numpy 1.26's _umath_tests loads only with the experimental DType API switched on
    # (numpy's own conftest.py sets it for its tests)
    with mock.patch.dict(os.environ, {"NUMPY_EXPERIMENTAL_DTYPE_API": "1"}):
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and \
                    getattr(node, "module", None) != "__future__":
                try:
                    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"),
                         _IMPORTED)
                except Exception:  # an internal module this numpy lacks: its tests say so
                    pass
    return text, found


def _source(text: str, found: dict, name: str) -> str | None:
    node = found.get(name)
    return None if node is None else ast.get_source_segment(text, node)


def _methods(text: str, found: dict, cls: str, names: set) -> list[str]:
    node = found.get(cls)
    if not isinstance(node, ast.ClassDef):
        return []
    return [ast.get_source_segment(text, n, padded=True) for n in node.body
            if isinstance(n, ast.FunctionDef) and n.name in names]


_mm_text, _mm = _definitions(_TESTS / "test_multiarray.py")
_uf_text, _uf = _definitions(_TESTS / "test_ufunc.py")
MISSING = [name for name in REQUIRED if name not in _mm]

# -- numpy's text, with its matmul replaced by MATMUL (bound per engine below) ---------------

_PIECES = []
if "MatmulCommon" in _mm:
    _PIECES.append(_source(_mm_text, _mm, "MatmulCommon"))
if "TestMatmul" in _mm:
    _PIECES.append(_source(_mm_text, _mm, "TestMatmul")
                   .replace("matmul = np.matmul", "matmul = staticmethod(MATMUL)")
                   .replace("np.matmul(", "MATMUL("))
if "TestMatmulInplace" in _mm:
    # numpy's a @= b (number.c, array_inplace_matrix_multiply): the axes keep the result
    # from broadcasting into a
    _PIECES.append('''
def _imatmul(a, b):
    if a.ndim == 1:
        return MATMUL(a, b, out=(a,), axes=[(-1,), (-2, -1), (-1,)])
    return MATMUL(a, b, out=(a,), axes=[(-2, -1), (-2, -1), (-2, -1)])
''')
    _PIECES.append(_source(_mm_text, _mm, "TestMatmulInplace").replace("a @= b", "_imatmul(a, b)"))
if "test_matmul_axes" in _mm:
    _PIECES.append(_source(_mm_text, _mm, "test_matmul_axes").replace("np.matmul(", "MATMUL("))
_misc = _methods(_mm_text, _mm, "TestMethods", {"test_dot_matmul_out", "test_matmul_out",
                                                "test_dot_matmul_inner_array_casting_fails"})
if _misc:
    _PIECES.append("class TestMatmulMethods:\n" + "\n".join(_misc).replace("np.matmul(", "MATMUL("))
_ignore = _methods(_uf_text, _uf, "TestUfunc", {"test_can_ignore_signature"})
if _ignore:
    _PIECES.append("class TestUfuncCanIgnoreSignature:\n"
                   + "\n".join(_ignore).replace("umt.matmul(", "MATMUL("))

# the matmul cases of numpy tests that loop over many ufuncs, transcribed
_PIECES.append('''
class TestMatmulOperatorAsFunction:
    # test_multiarray.py: TestMatmulOperator.test_matmul_raises, numpy's exception types
    @pytest.mark.parametrize("args", [(np.int8(5), np.int8(5)),
                                      (np.void(b'abc'), np.void(b'abc')),
                                      (np.arange(10), np.void(b'abc'))])
    def test_matmul_raises(self, args):
        with pytest.raises(Exception) as want:
            np.matmul(*args)
        assert_raises(want.type, MATMUL, *args)


class TestUfuncMatmul:
    def test_vecdot_matvec_vecmat_complex_matmul(self):
        # test_ufunc.py: TestUfunc.test_vecdot_matvec_vecmat_complex, the np.matmul case
        shape1, shape2 = (1, 3), (3, 1)
        arr1 = np.array([1, 2j, 3])
        arr2 = np.array([1, 2, 3])
        actual1 = MATMUL(arr1.reshape(shape1), arr2.reshape(shape2))
        expected1 = np.array((arr1 * arr2).sum(), ndmin=2)
        assert_array_equal(actual1, expected1)
        actual2 = MATMUL(arr2.reshape(shape1), arr1.reshape(shape2))
        assert_array_equal(actual2, np.array((arr2 * arr1).sum(), ndmin=2))
        actual3 = MATMUL(arr1.reshape(shape1).astype("object"),
                         arr2.reshape(shape2).astype("object"))
        assert_array_equal(actual3, expected1.astype(object))
        assert actual3.dtype == object

    def test_axes_argument_matrix_multiply(self):
        # test_ufunc.py: TestUfunc.test_axes_argument, its matrix_multiply part
        mm = MATMUL
        a = np.arange(12).reshape((2, 3, 2))
        b = np.arange(8).reshape((2, 2, 2, 1)) + 1
        c = mm(a, b)
        assert_array_equal(c, np.matmul(a, b))
        c = mm(a, b, axes=[(-2, -1), (-2, -1), (-2, -1)])
        assert_array_equal(c, np.matmul(a, b))
        c = mm(a, b, axes=[(1, 2), (2, 3), (2, 3)])
        assert_array_equal(c, np.matmul(a, b))
        c = mm(a, b, axes=[(0, -1), (1, 2), (-2, -1)])
        assert_array_equal(c, np.matmul(a.transpose(1, 0, 2), b.transpose(0, 3, 1, 2)))
        c = np.empty((2, 2, 3, 1))
        d = mm(a, b, out=c, axes=[(1, 2), (2, 3), (2, 3)])
        assert_(c is d)
        assert_array_equal(c, np.matmul(a, b))
        c = np.empty((1, 2, 2, 3))
        d = mm(a, b, out=c, axes=[(-2, -1), (-2, -1), (3, 0)])
        assert_(c is d)
        assert_array_equal(c, np.matmul(a, b).transpose(3, 0, 1, 2))
        # improperly constructed axes: numpy's exception type each
        for bad in ([(-2, -1), (-2, -1), (-2, -1), (-2, -1)], [(-2, -1), (-2, -1)],
                    [(-2, -1), (-2, -1), (-2,)], 1, [(-2, -1), 1, (-2, -1)],
                    [(-2, -1), (-2, -1), (-2, -1, 0)], [(-2, -1), (-2, -1), (-2, -5)],
                    [(-2, -1), (-2, -1), (-2, -2)], [(-2, -1), (-2, -1), (-2, "a")]):
            with pytest.raises(Exception) as want:
                np.matmul(a, b, axes=bad)
            assert_raises(want.type, mm, a, b, axes=bad)
        z = np.zeros((2, 2))
        assert_raises(ValueError, mm, z, z, out=z, axes=[0, 1])

    def test_at_not_none_signature(self):
        # test_ufunc.py: np.matmul.at is refused (a gufunc); distmm's matmul has no .at
        a = np.ones((2, 2, 2))
        b = np.ones((1, 2, 2))
        assert_raises(TypeError, np.matmul.at, a, [0], b)
        assert not hasattr(MATMUL, "at")

    @pytest.mark.parametrize("typ", [t for t in np.matmul.types if "O" not in t and "?" not in t])
    def test_ufunc_types(self, typ):
        # test_ufunc.py: test_ufunc_types, np.matmul's loops
        inp, out = typ.split("->")
        res = MATMUL(*[np.ones((3, 3), t) for t in inp])
        assert res.dtype == np.dtype(out)

    @pytest.mark.parametrize("typ", [t for t in np.matmul.types if not set("O?mM") & set(t)])
    def test_ufunc_noncontiguous(self, typ):
        # test_ufunc.py: test_ufunc_noncontiguous, np.matmul's loops
        inp, out = typ.split("->")
        args_c = [np.empty((6, 6), t) for t in inp]
        args_n = [np.empty((12, 18), t)[::2, ::3] for t in inp]
        args_o = []
        for t in inp:
            orig_dt = np.dtype(t)
            off_dt = f"S{orig_dt.alignment}"
            dtype = np.dtype([("_", off_dt), ("t", orig_dt)], align=False)
            args_o.append(np.empty((6, 6), dtype=dtype)["t"])
        for x in args_c + args_n + args_o:
            x.flat = range(1, 37)
        res_c, res_n, res_o = MATMUL(*args_c), MATMUL(*args_n), MATMUL(*args_o)
        want = np.matmul(*args_c)
        assert res_c.dtype == res_n.dtype == res_o.dtype == want.dtype
        if np.issubdtype(want.dtype, np.floating):
            tol = 3 * np.finfo(want.dtype).eps
            assert_allclose(res_c, want, atol=tol, rtol=tol)
            assert_allclose(res_c, res_n, atol=tol, rtol=tol)
            assert_allclose(res_c, res_o, atol=tol, rtol=tol)
        else:
            assert_equal(res_c, want)
            assert_equal(res_c, res_n)
            assert_equal(res_c, res_o)


class TestLinalgAndMixins:
    def test_linalg_matmul(self):
        # linalg/tests/test_linalg.py: test_matmul
        x = np.arange(6).reshape((2, 3))
        assert_equal(MATMUL(x, x.T), np.array([[5, 14], [14, 50]]))

    def test_mixins_matmul(self):
        # lib/tests/test_mixins.py: TestNDArrayOperatorsMixin.test_matmul
        mixins = _numpy_test_module("lib", "test_mixins")
        array = np.array([1, 2], dtype=np.float64)
        array_like = mixins.ArrayLike(array)
        expected = mixins.ArrayLike(np.float64(5))
        mixins._assert_equal_type_and_value(expected, MATMUL(array_like, array))
        mixins._assert_equal_type_and_value(expected, MATMUL(array, array_like))
''')
if "test_params_common_gufunc" in _uf:
    _PIECES.append('''
class TestUfuncParams:
    def test_params_common_gufunc(self):
        # test_ufunc.py: TestLowlevelAPIAccess.test_params_common_gufunc for np.matmul:
        # numpy's keywords and defaults (distmm's own engine, client, ... left aside); numpy's
        # "no value" (axes, axis) is distmm's NO_VALUE, and so is keepdims's default, which
        # numpy refuses given at all for matmul
        want = {n: p.default for n, p in inspect.signature(np.matmul).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
        got = {n: p.default for n, p in inspect.signature(MATMUL).parameters.items()
               if p.kind is p.KEYWORD_ONLY and n in want}
        assert set(got) == set(want), set(want) ^ set(got)
        assert_raises(TypeError, np.matmul, np.ones((2, 2)), np.ones((2, 2)), keepdims=False)
        no_value = inspect.signature(distmm.matmul).parameters["axes"].default
        diff = {n: (want[n], got[n]) for n in want
                if not (got[n] is no_value and (want[n] is np._NoValue or n == "keepdims"))
                and want[n] != got[n]}
        assert not diff, diff
''')


@functools.lru_cache(maxsize=None)
def _numpy_test_module(package: str, name: str):
    path = _NUMPY / package / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_numpy_suite_{package}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CODE = [compile(piece, "<numpy's matmul tests for distmm>", "exec") for piece in _PIECES]
BROKEN: list[str] = []  # pieces of numpy's text that did not run (names this module lacks)
_DASK = {}  # the in-process client while the dask items run


@pytest.fixture(scope="module")
def _dask_client():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                       dashboard_address=None)
    # not the default client: the default engine's items stay off it
    client = distributed.Client(cluster, set_as_default=False)
    _DASK["client"] = client
    yield client
    _DASK.clear()
    client.close()
    cluster.close()


def _engine_matmul(engine: str):
    if engine == "default":
        return distmm.matmul
    if engine == "dask":
        @functools.wraps(distmm.matmul)
        def matmul(*args, **kwargs):
            return distmm.matmul(*args, engine="dask", client=_DASK["client"], **kwargs)
        return matmul
    return functools.wraps(distmm.matmul)(functools.partial(distmm.matmul, engine=engine))


# what numpy's test text (and the transcriptions above) names
_NAMESPACE = {**_IMPORTED, "np": np, "pytest": pytest, "itertools": itertools,
              "operator": operator, "warnings": warnings, "inspect": inspect,
              "ComplexWarning": ComplexWarning, "distmm": distmm,
              "_numpy_test_module": _numpy_test_module,
              **{name: getattr(npt, name) for name in (
                  "assert_", "assert_allclose", "assert_array_equal", "assert_equal",
                  "assert_raises", "assert_raises_regex")}}
# numpy's parametrized cases that take seconds on their own: (class, method) -> case ids
SLOW_CASES = {("TestMatmulInplace", "test_shapes"): {"2d_large", "3d_large"}}


def _mark_slow_cases(cls: type, method: str, ids: set) -> None:
    """Mark the cases ``ids`` of ``cls.method``'s parametrization slow."""
    func = getattr(cls, method, None)
    for mark in list(getattr(func, "pytestmark", [])):
        names = list(mark.kwargs.get("ids") or ())
        if mark.name != "parametrize" or len(mark.args) != 2 or not names:
            continue
        argnames, argvalues = mark.args
        several = len([n for n in argnames.split(",") if n.strip()]) > 1 \
            if isinstance(argnames, str) else len(argnames) > 1
        cases = [pytest.param(*(v if several else (v,)), id=str(i),
                              marks=[pytest.mark.slow] if i in ids else [])
                 for v, i in zip(argvalues, names)]
        kwargs = {k: v for k, v in mark.kwargs.items() if k != "ids"}
        func.pytestmark = [m for m in func.pytestmark if m is not mark] + \
            [pytest.mark.parametrize(argnames, cases, **kwargs).mark]


def _collect(engine: str, slow: bool) -> None:
    """numpy's tests with MATMUL bound to ``engine``, as this module's Test*/test_* names."""
    space = dict(_NAMESPACE, MATMUL=_engine_matmul(engine))
    for code in _CODE:
        try:
            exec(code, space)
        except Exception as exc:
            BROKEN.append(f"{engine}: {type(exc).__name__}: {exc}")
    for (cls, method), ids in SLOW_CASES.items():
        if isinstance(space.get(cls), type):
            _mark_slow_cases(space[cls], method, ids)
    marks = [pytest.mark.slow] if slow else []
    if engine == "dask":
        marks.append(pytest.mark.usefixtures("_dask_client"))
    for name, obj in list(space.items()):
        if name in _NAMESPACE:
            continue
        if (name.startswith("Test") and isinstance(obj, type)) or \
                (name.startswith("test_") and inspect.isfunction(obj)):
            for mark in marks:
                obj = mark(obj)
            globals()[f"{name}_{engine}"] = obj


for _engine, _slow in ENGINES.items():
    _collect(_engine, _slow)


def test_numpy_matmul_tests_found():
    """The core classes are in the installed numpy's test sources (renamed or moved: this
    module would run nothing of them), and every piece of numpy's text read ran."""
    assert not MISSING, f"not found in {_TESTS / 'test_multiarray.py'}: {', '.join(MISSING)}"
    assert not BROKEN, "; ".join(BROKEN)
