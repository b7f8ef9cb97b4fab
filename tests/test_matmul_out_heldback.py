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

import numpy as np
import pytest

import distmm
from conftest import run_rank_script
from out_cases import Sub, compare, out_cases

da = pytest.importorskip("dask.array")

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")


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
from out_cases import compare, out_cases

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
