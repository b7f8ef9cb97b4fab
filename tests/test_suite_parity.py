"""distmm.matmul against numpy.matmul where the semantics that numpy's own matmul tests
exercise meet each other: ``axes=`` with ``out=`` and with ndarray subclasses, an object
vector product of a subclass, and which of numpy's errors comes first for ``axes``/``axis``.

Every case is asked of numpy itself on the same fresh operands: the result (values against
numpy's float64 product, dtype, type, shape, mask) or the exception type numpy raises.
"""
from __future__ import annotations

import numpy as np
import pytest

import distmm

_NUMPY_2 = np.lib.NumpyVersion(np.__version__) >= "2.0.0"


def _outcome(f, *args, **kw):
    """``("ok", result)`` or ``("error", exception type)`` of ``f(*args, **kw)``."""
    try:
        return "ok", f(*args, **kw)
    except Exception as exc:  # numpy's own types are the point
        return "error", type(exc)


# -- axes= with an out that has more dimensions than the result -------------------------


@pytest.mark.parametrize("case", ["vector-result", "stack", "out-axes-past-result"])
def test_axes_with_a_broadcast_out_fill_it_as_numpy(case):
    """An ``out`` whose loop dimensions broadcast the result's (numpy takes them) keeps its
    core axes where ``axes`` puts them in ``out``'s own dimensions, not the result's."""
    rng = np.random.default_rng()
    if case == "vector-result":  # (3,) @ (3, 2) -> (2,), written into both rows of out
        a, b = rng.standard_normal(3), rng.standard_normal((3, 2))
        axes, out_shape = [(-1,), (-2, -1), (-1,)], (4, 2)
    elif case == "stack":
        a, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 4))
        axes, out_shape = [(-2, -1), (-2, -1), (-2, -1)], (6, 2, 3, 4)
    else:  # out's core axes (2, 3) lie past the 3-D result's last axis
        a, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 4))
        axes, out_shape = [(-2, -1), (-2, -1), (2, 3)], (6, 2, 3, 4)
    want = np.full(out_shape, np.nan)
    np.matmul(a, b, out=want, axes=axes)
    out = np.full(out_shape, np.nan)
    assert distmm.matmul(a, b, out=out, axes=axes) is out
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


# -- axes= with ndarray subclasses ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix's own
def test_axes_with_a_matrix_operand_wraps_the_placed_result():
    """numpy wraps the result once its axes are where ``axes`` puts them: a vector times an
    ``np.matrix`` is a (1, n) matrix, not its transpose."""
    rng = np.random.default_rng()
    v, m = rng.standard_normal(3), np.asmatrix(rng.standard_normal((3, 4)))
    axes = [(-1,), (-2, -1), (-1,)]
    want, got = np.matmul(v, m, axes=axes), distmm.matmul(v, m, axes=axes)
    assert type(got) is type(want) is np.matrix
    assert got.shape == want.shape == (1, 4)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_axes_with_a_masked_operand_masks_from_the_operands_as_given():
    """numpy's ``__array_wrap__`` context holds the operands as the caller passed them: a
    masked array's result mask comes from its mask as given, not from its moved axes."""
    rng = np.random.default_rng()
    mask = rng.random((4, 4)) < 0.3
    a = np.ma.array(rng.standard_normal((4, 4)), mask=mask)
    b = rng.standard_normal((4, 4))
    axes = [(-1, -2), (-2, -1), (-2, -1)]
    want, got = np.matmul(a, b, axes=axes), distmm.matmul(a, b, axes=axes)
    assert type(got) is type(want) is np.ma.MaskedArray
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


# -- an object vector product of a subclass ----------------------------------------------


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize("kind", ["masked", "subclass"])
@pytest.mark.parametrize("how", ["dtype-object", "object-operands"])
def test_object_vector_product_of_a_subclass_stays_object(kind, how):
    """vector @ vector in numpy's object loop gives one Python object; numpy wraps it as a
    0-d object array of the subclass (a float element must not become a float64 array)."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal(5), rng.standard_normal(5)
    kw = {"dtype": object} if how == "dtype-object" else {}
    if how == "object-operands":
        x, y = x.astype(object), y.astype(object)
    a = np.ma.array(x) if kind == "masked" else x.view(_Sub)
    want, got = np.matmul(a, y, **kw), distmm.matmul(a, y, **kw)
    assert type(got) is type(want)
    assert got.dtype == want.dtype == object
    assert np.shape(got) == ()
    assert abs(float(got[()]) - float(want[()])) <= 1e-12 * (1 + abs(float(want[()])))


# -- which error numpy raises first ---------------------------------------------------------


def _read_only(shape):
    x = np.zeros(shape)
    x.flags.writeable = False
    return x


def _keyword_making(error: str) -> dict:
    """The keyword (fresh arrays) that makes numpy's ``error`` for a 3 x 3 product."""
    return {"read-only-out": lambda: {"out": _read_only((3, 3))},
            "out-tuple-of-two": lambda: {"out": (np.zeros((3, 3)), None)},
            "bad-casting": lambda: {"casting": "bogus"},
            "bad-order": lambda: {"order": "X"},
            "refused-cast": lambda: {"dtype": np.int32}}[error]()


@pytest.mark.parametrize("other", ["read-only-out", "out-tuple-of-two", "bad-casting",
                                   "bad-order", "refused-cast"])
def test_axis_and_axes_together_is_numpys_first_error(other):
    """numpy refuses ``axis`` with ``axes`` (TypeError) before it looks at ``out``,
    ``casting``, ``order`` or the loop."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    kw = {"axis": -1, "axes": [(0, 1), (1, 0), (0, 1)], **_keyword_making(other)}
    want, got = _outcome(np.matmul, a, b, **kw), _outcome(distmm.matmul, a, b, **kw)
    assert want == ("error", TypeError)
    assert got == want


@pytest.mark.parametrize("case", ["overflow-safe-axes", "bad-order-axis", "refused-out-axes",
                                  "refused-dtype-axes"])
def test_python_scalar_operand_with_axes_raises_numpys_error(case):
    """A Python scalar operand fails in numpy as it does without ``axes``/``axis``: its
    weak-scalar cast, ``order`` and loop errors come before the missing dimension."""
    rng = np.random.default_rng()
    args, kw = {
        "overflow-safe-axes": ((rng.integers(0, 9, 4).astype(np.uint16), -3),
                               {"casting": "safe", "axes": [(-1,), (-2, -1), (-1,)]}),
        "bad-order-axis": ((3, rng.standard_normal((2, 4, 4)).astype(np.float32)),
                           {"order": "X", "axis": -1}),
        "refused-out-axes": ((rng.integers(0, 9, (3, 1)).astype(np.int32), 2),
                             {"out": np.zeros((3, 1), np.uint64),
                              "axes": [(-1, -2), (-2, -1), (-2, -1)]}),
        "refused-dtype-axes": ((2, rng.standard_normal((2, 3, 3)).astype(object)),
                               {"dtype": "i1", "axes": [(0, 1), (1, 0), (0, 1)]}),
    }[case]
    want, got = _outcome(np.matmul, *args, **kw), _outcome(distmm.matmul, *args, **kw)
    assert want[0] == "error"
    assert got == want


@pytest.mark.parametrize("other", ["read-only-out", "out-tuple-of-two", "bad-order",
                                   "bad-casting"])
def test_errors_that_come_before_a_non_boolean_subok_as_in_numpy(other):
    """numpy reads ``out`` (its tuple, a read-only array), ``order`` and ``casting`` (each a
    ValueError) before ``subok``."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    kw = {"subok": 2, **_keyword_making(other)}
    want, got = _outcome(np.matmul, a, b, **kw), _outcome(distmm.matmul, a, b, **kw)
    assert want == ("error", ValueError)
    assert got == want


@pytest.mark.parametrize("case", ["unknown-dtype", "detailed-dtype", "signature-and-dtype",
                                  "out-tuple-of-two"])
def test_keyword_errors_come_before_out_errors_as_in_numpy(case):
    """numpy parses ``dtype``/``signature`` (and an ``out`` tuple's length) before it looks
    at the operands or ``out``'s array: a read-only ``out`` is not the error it reports."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    kw = {"unknown-dtype": {"dtype": "bogus"},
          "detailed-dtype": {"dtype": "U3"},
          "signature-and-dtype": {"dtype": np.float64, "signature": "dd->d"},
          "out-tuple-of-two": {"dtype": "bogus"}}[case]
    kw["out"] = ((_read_only((3, 3)), None) if case == "out-tuple-of-two"
                 else _read_only((3, 3)))
    want, got = _outcome(np.matmul, a, b, **kw), _outcome(distmm.matmul, a, b, **kw)
    assert want[0] == "error"
    assert got == want


@pytest.mark.parametrize("case", ["negative-into-unsigned", "past-int64", "past-uint8-left"])
def test_python_scalar_operand_raises_numpys_conversion_error(case):
    """numpy converts a Python scalar operand (weak, NEP 50) into the other operand's
    dtype before it finds the missing dimension: a value out of range is its error."""
    rng = np.random.default_rng()
    args = {"negative-into-unsigned": (rng.integers(0, 9, 4).astype(np.uint16), -2),
            "past-int64": (rng.integers(-9, 9, 4), 2**70),
            "past-uint8-left": (300, rng.integers(0, 9, (4, 4)).astype(np.uint8))}[case]
    want, got = _outcome(np.matmul, *args), _outcome(distmm.matmul, *args)
    # numpy 1.x (the floor) has no weak scalars: its error there is the missing dimension
    assert want == ("error", OverflowError if _NUMPY_2 else ValueError)
    assert got == want


def test_python_scalar_operand_in_range_keeps_distmms_line():
    """A scalar numpy converts fine fails for its missing dimension: distmm's ValueError,
    naming the operand."""
    with pytest.raises(ValueError, match="operand b is 0-dimensional"):
        distmm.matmul(np.random.default_rng().standard_normal((2, 2)), 3)


@pytest.mark.parametrize("case", ["fortran-operands-moved-to-c", "c-operand-moved-to-fortran"])
def test_order_a_with_axes_decides_on_the_operands_as_given(case):
    """``order="A"`` is Fortran when the operands the caller passed are (numpy's rule),
    not the views with their matrix axes moved last."""
    rng = np.random.default_rng()
    if case == "fortran-operands-moved-to-c":
        a = np.asfortranarray(rng.standard_normal((3, 4)))
        b = np.asfortranarray(rng.standard_normal((3, 5)))
        axes = [(-1, -2), (-2, -1), (-2, -1)]
    else:
        a, b = rng.standard_normal((3, 1)), rng.standard_normal((2, 1, 3))
        axes = [(0, 1), (1, 0), (0, 1)]
    want = np.matmul(a, b, order="A", axes=axes)
    got = distmm.matmul(a, b, order="A", axes=axes)
    assert got.shape == want.shape
    assert got.strides == want.strides
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# -- axes, axis and keepdims given as None, and keepdims ----------------------------------


def _numpy_keyword_case(case: str) -> dict:
    """Keywords numpy refuses for matmul (with what comes before or after them)."""
    return {"axes-none": {"axes": None},
            "axis-none": {"axis": None},
            "axes-and-axis-none": {"axes": None, "axis": None},
            "axes-none-and-wrong-out": {"axes": None, "out": np.zeros((4, 4))},
            "keepdims-false": {"keepdims": False},
            "keepdims-true": {"keepdims": True},
            "keepdims-none": {"keepdims": None},
            "keepdims-not-boolean-and-bad-casting": {"keepdims": 1, "casting": "bogus"},
            "keepdims-and-bad-casting": {"keepdims": False, "casting": "bogus"},
            "keepdims-and-refused-out": {"keepdims": False, "out": np.zeros((3, 5), np.int32)},
            "keepdims-and-signature": {"keepdims": False, "signature": "dd->d"}}[case]


@pytest.mark.parametrize("operands", ["arrays", "python-scalar", "masked", "object"])
@pytest.mark.parametrize("case", ["axes-none", "axis-none", "axes-and-axis-none",
                                  "axes-none-and-wrong-out", "keepdims-false", "keepdims-true",
                                  "keepdims-none", "keepdims-not-boolean-and-bad-casting",
                                  "keepdims-and-bad-casting", "keepdims-and-refused-out",
                                  "keepdims-and-signature"])
def test_axes_axis_keepdims_given_are_numpys_errors(case, operands):
    """numpy's defaults for ``axes``, ``axis`` and ``keepdims`` are "no value": given as
    None (or ``keepdims`` given at all) numpy refuses the call, each error in its turn."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 7)), rng.standard_normal((7, 5))
    if operands == "python-scalar":
        b = 3
    elif operands == "masked":
        a = np.ma.array(a, mask=rng.random(a.shape) < 0.3)
    elif operands == "object":
        a = a.astype(object)
    want = _outcome(np.matmul, a, b, **_numpy_keyword_case(case))
    got = _outcome(distmm.matmul, a, b, **_numpy_keyword_case(case))
    assert want[0] == "error"
    assert got == want


def test_matmul_takes_numpys_keywords():
    """Every keyword of ``numpy.matmul`` is one of ``distmm.matmul``'s (``keepdims`` too,
    which numpy refuses for matmul: its TypeError, not Python's for an unknown keyword)."""
    import inspect

    params = inspect.signature(distmm.matmul).parameters
    for name in ("casting", "order", "dtype", "subok", "signature", "axes", "axis", "keepdims"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
