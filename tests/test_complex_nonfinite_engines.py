"""Complex products whose finite terms overflow in one part give numpy's Inf and NaN and
numpy's floating-point warnings on the Dask and MPI engines.

numpy's BLAS multiplies each element's sum by ``alpha = 1 + 0j``: a sum ``inf + xj`` (x
finite) comes out ``inf+nanj``. A block that sums numpy matmul calls of the same kind
(more than one row, column and k each) holds that form already; the engines pass the
shapes of those calls to ``finish_tile`` (``parts``), so ``distmm.nonfinite`` keeps it
(``nan+nanj`` before: spread again, as where the calls are not known).
The operands make every term of the overflowing elements overflow by itself, so numpy's
result does not depend on its BLAS's order of the sum.
Covers: the Dask engine on two worker processes (tiles, blocks, k pieces summed in one
task, stacks of numpy and of dask operands), ``engine="mpi"`` on 2 ranks (SUMMA's panels
on a 1 x 2 grid, layers summed on a k-split grid, a stack) and ``mpirun distmm matmul`` on
2 ranks (the striped batch path, both panel paths), complex64 and complex128, both parts.
A product split along k into k groups on the Dask engine (tiles and blocks, a CPU backend
and ``"auto"`` on CPU workers): the reduction's last task is told the groups' products; a
real product's graph is as before (no parts).
It does *not* cover: GPU results (cuBLAS's, left as they are), sums that overflow only in
some orders.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import dask
import numpy as np
import pytest

import distmm
from conftest import run_rank_script

#: numpy's warnings of a product, by one BLAS thread (as the ranks and the workers run it)
NUMPYS = r"""
import sys, warnings
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    np.matmul(a, b)
print("\n".join(f"{w.category.__name__}: {w.message}" for w in got))
"""


def overflowing(rng, shape_a, shape_b, dtype):
    """Random operands (a stack where the shapes have three axes) whose row 1 of A makes
    real parts overflow (``inf + xj``) and row 3 imaginary ones (``x + infj``), term by
    term; B's imaginary parts are small, so the other part stays finite."""
    big = np.finfo(dtype).max / 2
    a = 1 + rng.standard_normal(shape_a) + 1j * rng.standard_normal(shape_a)
    b = (1 + rng.random(shape_b)) + 1e-3j * rng.uniform(-1, 1, shape_b)
    k = shape_a[-1]
    a[..., 1, :] = big * (1 + rng.random(k))          # real * real: each term inf
    a[..., 3, :] = 1j * big * (1 + rng.random(k))     # imag * real: each term inf
    return a.astype(dtype), b.astype(dtype)


def numpys_warnings(tmp_path, a, b) -> list[str]:
    """numpy's warnings of ``a @ b`` in a process with one BLAS thread."""
    np.save(tmp_path / "wa.npy", a)
    np.save(tmp_path / "wb.npy", b)
    r = subprocess.run([sys.executable, "-c", NUMPYS, tmp_path / "wa.npy", tmp_path / "wb.npy"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def recorded(product, a, b):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = product(a, b)
    return c, [f"{w.category.__name__}: {w.message}" for w in got]


def assert_numpys(want, got):
    """NaN and Inf where numpy's are, part by part; the finite values as close as a sum in
    another order."""
    assert got.dtype == want.dtype and got.shape == want.shape
    for part in ("real", "imag"):
        w, g = getattr(want, part), getattr(got, part)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=part)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w), err_msg=part)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=part)


def the_case(want):
    """The operands give what is tested: ``inf+nanj`` in row 1, ``nan+infj`` in row 3."""
    assert np.isinf(want[..., 1, :].real).all() and np.isnan(want[..., 1, :].imag).all()
    assert np.isnan(want[..., 3, :].real).all() and np.isinf(want[..., 3, :].imag).all()


#: (layout, tile): one tile, tiles along m and n, k in pieces of 4 summed in one task, blocks
DASK_CASES = [("tiles", None), ("tiles", (4, 4, 11)), ("tiles", (4, 4, 4)), ("blocks", None),
              ("blocks", (4, 4, 11))]


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("layout,tile", DASK_CASES,
                         ids=["one-tile", "m-n-tiles", "k-pieces", "blocks", "m-n-blocks"])
@pytest.mark.slow
def test_dask_engine_keeps_numpys_inf_nan(client, tmp_path, dtype, layout, tile):
    """``inf+nanj``/``nan+infj`` and numpy's warnings (``nan+nanj`` before)."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (7, 11), (11, 9), dtype)
    with np.errstate(all="ignore"):
        want = a @ b
    the_case(want)
    warned = numpys_warnings(tmp_path, a, b)
    assert "RuntimeWarning: invalid value encountered in matmul" in warned
    with dask.config.set({"distmm.dask-layout": layout}):
        got, got_warned = recorded(lambda x, y: distmm.matmul(
            x, y, engine="dask", client=client, tile=tile), a, b)
    assert_numpys(want, got)
    assert got_warned == warned


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("tile", [None, (4, 4, 11), (4, 4, 4)],
                         ids=["whole", "m-n-blocks", "k-pieces"])
def test_dask_engine_stack_keeps_numpys_inf_nan(client, tmp_path, dtype, tile):
    """A stack: of whole matrices (one task per batch chunk), of matrices in blocks."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (3, 7, 11), (3, 11, 9), dtype)
    with np.errstate(all="ignore"):
        want = a @ b
    the_case(want)
    got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="dask", client=client,
                                                          tile=tile), a, b)
    assert_numpys(want, got)
    assert got_warned == numpys_warnings(tmp_path, a, b)


@pytest.mark.parametrize("chunks", [(3, 4, 4), (1, 4, 11)], ids=["k-pieces", "m-n-blocks"])
def test_dask_engine_lazy_stack_keeps_numpys_inf_nan(client, chunks):
    """A stack of dask operands whose matrices span chunks (one task per output block of a
    batch chunk, summing its k pieces): numpy's values (a lazy product's warnings are the
    workers')."""
    import dask.array as da

    rng = np.random.default_rng()
    a, b = overflowing(rng, (3, 7, 11), (3, 11, 9), np.complex128)
    with np.errstate(all="ignore"):
        want = a @ b
        got = distmm.matmul(da.from_array(a, chunks=chunks), da.from_array(b, chunks=chunks),
                            engine="dask", client=client).compute()
    the_case(want)
    assert_numpys(want, got)


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("backend", ["auto", "blas"])
@pytest.mark.parametrize("layout", ["tiles", "blocks"])
@pytest.mark.slow
def test_dask_engine_k_groups_keep_numpys_inf_nan(client, tmp_path, dtype, backend, layout):
    """A small memory budget splits k into groups, summed by the reduction's tasks
    (``nan+nanj`` before): numpy's values and warnings."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (7, 41), (41, 9), dtype)
    with np.errstate(all="ignore"):
        want = a @ b
    the_case(want)
    cfg = {"distmm.memory-budget": 2000, "distmm.dask-layout": layout}
    with dask.config.set(cfg):
        plan = distmm.make_plan(7, 9, 41, np.dtype(dtype).name, tile=(4, 4, 4), workers=2)
        assert len(plan.k_edges) > 2  # k split into groups
        got, got_warned = recorded(lambda x, y: distmm.matmul(
            x, y, engine="dask", client=client, tile=(4, 4, 4), backend=backend), a, b)
    assert_numpys(want, got)
    assert got_warned == numpys_warnings(tmp_path, a, b)


def _final_sum_args(dtype, backend):
    """The arguments of the last reduction task of block (0, 0) of a lazy product split
    into k groups, and the ``(rows, columns, k)`` of the products its groups' tasks sum."""
    import dask.array as da

    from distmm.engine.dask.graph import ProductLayer
    from distmm.engine.dask.tasks import block_parts

    x = da.ones((7, 41), dtype=dtype, chunks=(4, 4))
    y = da.ones((41, 9), dtype=dtype, chunks=(4, 4))
    with dask.config.set({"distmm.memory-budget": 2000}):
        c = distmm.matmul(x, y, engine="dask", tile=(4, 4, 4), backend=backend)
    layer, = (v for v in c.dask.layers.values() if isinstance(v, ProductLayer))
    assert layer.split
    task = layer[layer.output_key((), 0, 0)]
    summed = []
    for g in range(layer.geometry.groups):
        partial = layer[(layer.partial_name, 0, 0, g)]
        spec = (partial.args if hasattr(partial, "args") else partial[1:])[2]
        summed += block_parts(spec.a_rows, spec.b_cols, spec.k_pieces)
    return (task.args if hasattr(task, "args") else task[1:]), summed


@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_k_groups_parts_only_for_complex(dtype):
    """A complex product's last reduction task is told the groups' product shapes (each
    once, not one per k piece); a real product's task is as before (no parts)."""
    args, summed = _final_sum_args(dtype, "blas")
    assert len(summed) > 2
    if np.dtype(dtype).kind != "c":
        assert len(args) == 5
        return
    parts, if_cpu = args[5:]
    assert if_cpu is False
    assert sorted(parts) == sorted(set(summed))
    assert _final_sum_args(dtype, "auto")[0][6] is True  # 'auto': held where no GPU runs it


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-worker", "gpu-worker"])
def test_auto_sum_step_parts_held_where_no_gpu(monkeypatch, gpu):
    """Backend ``"auto"``'s last reduction task keeps the groups' ``inf+nanj`` on a worker
    without a GPU; on one with a GPU (whose tasks may have run on it) the parts are not
    known, and the block is spread as before."""
    from distmm.engine.dask import tasks

    monkeypatch.setattr(tasks, "worker_has_gpu", lambda: gpu)
    rng = np.random.default_rng()
    tp = tasks.TaskPlan("complex128", "complex128", (5, 3, 4), m=5, n=3, k=8)
    dst = rng.standard_normal((5, 3)) + 1j * rng.standard_normal((5, 3))
    src = rng.standard_normal((5, 3)) + 1j * rng.standard_normal((5, 3))
    dst[1, :] = complex(np.inf, np.nan)  # a group's numpy matmul overflowed in the real part
    with np.errstate(all="ignore"):
        got = tasks.sum_step(tp, dst, src, True, 0, ((5, 3, 4),), True)
    assert np.isinf(got[1].real).all() != gpu and np.isnan(got[1].imag).all()
    np.testing.assert_array_equal(np.delete(got, 1, 0), np.delete(dst + src, 1, 0))


SCRIPT = r"""
import warnings
import numpy as np
from mpi4py import MPI

import distmm

comm = MPI.COMM_WORLD
rng = np.random.default_rng()


def overflowing(shape_a, shape_b, dtype):
    big = np.finfo(dtype).max / 2
    a = 1 + rng.standard_normal(shape_a) + 1j * rng.standard_normal(shape_a)
    b = (1 + rng.random(shape_b)) + 1e-3j * rng.uniform(-1, 1, shape_b)
    k = shape_a[-1]
    a[..., 1, :] = big * (1 + rng.random(k))
    a[..., 3, :] = 1j * big * (1 + rng.random(k))
    return comm.bcast((a.astype(dtype), b.astype(dtype)))


def recorded(product, a, b):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = product(a, b)
    return c, [str(w.message) for w in got]


def differs(want, got):
    for part in ("real", "imag"):
        w, g = getattr(want, part), getattr(got, part)
        if not (np.array_equal(np.isnan(w), np.isnan(g)) and np.array_equal(np.isinf(w), np.isinf(g))
                and np.allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)):
            return f"{part}: numpy {want.ravel()[8:12]} got {got.ravel()[8:12]}"
    return None


lines = []
for dt in (np.complex128, np.complex64):
    for shape_a, shape_b in (((7, 11), (11, 9)), ((7, 40), (40, 9)), ((2, 7, 11), (2, 11, 9))):
        a, b = overflowing(shape_a, shape_b, dt)
        want, warned = recorded(np.matmul, a, b)
        got, got_warned = recorded(lambda x, y: distmm.matmul(x, y, engine="mpi"), a, b)
        case = (np.isinf(want[..., 1, :].real).all() and np.isnan(want[..., 1, :].imag).all()
                and np.isnan(want[..., 3, :].real).all())
        bad = differs(want, got) or ("" if case else "not the case tested")
        if got_warned != warned:
            bad = f"warnings numpy {warned} got {got_warned}"
        lines.append(f"{np.dtype(dt).name} {shape_a} @ {shape_b}: " + (f"BAD {bad}" if bad else "ok"))
for rank, mine in enumerate(comm.gather(lines) or []):
    print("\n".join(f"rank {rank}: {line}" for line in mine), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_engine_keeps_numpys_inf_nan(tmp_path, mpirun):
    """``engine="mpi"`` on 2 ranks (SUMMA's panels; k of 11 and 40; a stack): numpy's
    ``inf+nanj``/``nan+infj`` and warnings (``nan+nanj`` before)."""
    r, lines, bad = run_rank_script(mpirun, tmp_path / "overflow.py", SCRIPT, 2)
    assert len(lines) == 2 * 2 * 3 and not bad, "\n".join(bad) + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("panels", ["broadcast", "read"])
@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.slow
def test_batch_command_keeps_numpys_inf_nan(tmp_path, mpirun, panels, dtype):
    """``mpirun -n 2 python -m distmm matmul`` (the striped batch path): numpy's
    ``inf+nanj``/``nan+infj`` in the file written and numpy's warnings, one line each
    (``nan+nanj`` before)."""
    rng = np.random.default_rng()
    a, b = overflowing(rng, (7, 11), (11, 9), dtype)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    with np.errstate(all="ignore"):
        want = a @ b
    the_case(want)
    warned = numpys_warnings(tmp_path, a, b)
    out = tmp_path / "c.npy"
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", out,
               "--engine", "mpi", env={"DISTMM_BATCH_PANELS": panels}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_numpys(want, np.load(out))
    lines = [line for line in r.stderr.splitlines() if ": warning: " in line]
    assert lines == [f"distmm matmul: warning: {w.split(': ', 1)[1]}" for w in warned], r.stderr
