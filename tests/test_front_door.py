"""One front door: a call resolves its engine once; ``distmm plan``, ``distmm.make_plan`` and
``distmm.matmul`` read one configuration; float16 products give numpy's bits.

Real parts throughout: a real ``distributed.LocalCluster``, ``distmm plan`` and ``distmm.matmul``
in subprocesses with real environment variables. The counters below wrap the real functions
(they call through), so what is counted is what ran.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import dask
import numpy as np
import pytest

import distmm
from distmm import api
from distmm.api import CALLS
from distmm.executor import resolve_backend

distributed = pytest.importorskip("distributed")


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` so that each call is recorded, then runs the real function."""
    real = getattr(owner, name)
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _operands(rng, m: int, k: int, n: int, dtype="float64"):
    return (rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype))


# -- the engine is resolved once per call ----------------------------------------------------

def test_local_calls_resolve_the_engine_once(monkeypatch):
    rng = np.random.default_rng()
    a, b = _operands(rng, 67, 45, 23)
    ref = a @ b
    CALLS.clear()
    calls = _count_calls(monkeypatch, api, "get_engine")

    def once(fn):
        calls.clear()
        result = fn()
        assert calls == ["get_engine"], calls
        return result

    # a fixed budget: "auto" follows the machine's available memory, which another process
    # can move past a 64 MiB step between the two calls (a miss, seen under a loaded CI run)
    with dask.config.set({"distmm.memory-budget": "256MiB"}):
        np.testing.assert_allclose(once(lambda: distmm.matmul(a, b)), ref, rtol=1e-12,
                                   atol=1e-12)  # miss
        np.testing.assert_allclose(once(lambda: distmm.matmul(a, b)), ref, rtol=1e-12,
                                   atol=1e-12)  # hit
    assert CALLS.hits == 1
    direct = np.empty((67, 23))  # tiles written into out
    assert once(lambda: distmm.matmul(a, b, out=direct)) is direct
    np.testing.assert_allclose(direct, ref, rtol=1e-12, atol=1e-12)
    cast = np.empty((67, 23), dtype=np.complex128)  # another dtype: computed, then copied
    assert once(lambda: distmm.matmul(a, b, out=cast)) is cast
    np.testing.assert_allclose(cast.real, ref, rtol=1e-12, atol=1e-12)
    c = rng.standard_normal((67, 23))
    np.testing.assert_allclose(once(lambda: distmm.gemm(a, b, c, alpha=2.0, beta=-0.5)),
                               2.0 * ref - 0.5 * c, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def client():
    # not the default client: the other tests' engine="auto" stays local
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as c:
        c.wait_for_workers(2, timeout=60)
        yield c


@pytest.mark.slow
def test_cluster_calls_build_one_engine_and_ask_the_scheduler_once(client, monkeypatch):
    """``out=`` on a cluster built a throwaway DaskEngine (and a second scheduler round trip)
    before the one that ran; now one engine and one ``cluster_state`` per call."""
    import distmm.engine.dask as dask_engine
    from distmm.engine.dask import placement

    rng = np.random.default_rng()
    a, b = _operands(rng, 131, 77, 65)
    ref = a @ b
    built = _count_calls(monkeypatch, dask_engine.DaskEngine, "__init__")
    asked = _count_calls(monkeypatch, placement, "cluster_state")

    def once(fn):
        built.clear()
        asked.clear()
        with client.as_current():  # the engine's as_completed asks for the current client
            result = fn()
        assert len(built) == 1 and len(asked) == 1, (built, asked)
        return result

    np.testing.assert_allclose(once(lambda: distmm.matmul(a, b, client=client, tile=64)), ref,
                               rtol=1e-12, atol=1e-12)
    out = np.empty((131, 65))
    assert once(lambda: distmm.matmul(a, b, out=out, client=client, tile=64)) is out
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    with distributed.Client(client.scheduler.address):  # a default client: "auto" uses it
        np.testing.assert_allclose(once(lambda: distmm.matmul(a, b, tile=64)), ref, rtol=1e-12, atol=1e-12)
    assert api.get_engine("auto").name == "local"
    np.testing.assert_allclose(once(lambda: distmm.gemm(a, b, client=client, tile=64)), ref,
                               rtol=1e-12, atol=1e-12)


# -- one configuration: the dry run shows the plan the run uses --------------------------------

def _run(code_or_args, env_extra: dict, *, module: bool) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTMM_", "DASK_DISTMM__"))}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "distmm", *code_or_args] if module else \
        [sys.executable, "-c", code_or_args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


RUN_AND_SHOW_PLAN = """
import numpy as np, distmm
from distmm.api import CALLS
rng = np.random.default_rng()
a, b = rng.standard_normal((4096, 4096)), rng.standard_normal((4096, 4096))
c = distmm.matmul(a, b)
rows = rng.choice(4096, 16, replace=False)
err = np.linalg.norm(c[rows] - a[rows] @ b) / np.linalg.norm(a[rows] @ b)
assert err < 1e-13, err
print(CALLS.last.plan.describe())
"""


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["DISTMM_MEMORY_BUDGET", "DASK_DISTMM__MEMORY_BUDGET"])
def test_plan_command_prints_the_plan_matmul_runs(variable):
    env = {variable: "64MiB"}
    shown = _run(["plan", "4096", "4096", "4096"], env, module=True)
    assert "(budget 64 MiB)" in shown, shown
    assert "tiles      512 x 512" in shown, shown  # 2048 tiles need more than 64 MiB a task
    ran = _run(RUN_AND_SHOW_PLAN, env, module=False)
    assert shown.strip() == ran.strip()


def test_make_plan_reads_the_configuration():
    import dask.config

    with dask.config.set({"distmm.memory-budget": "64MiB"}):
        plan = distmm.make_plan(4096, 4096, 4096, workers=3)
    assert plan.memory_budget == 64 * 2**20 and plan.tile[:2] == (512, 512) and plan.workers == 3
    with dask.config.set({"distmm.memory-budget": "1GiB", "distmm.tile": 256}):
        plan = distmm.make_plan(1000, 900, 500, "float32", workers=2)
        assert plan.memory_budget == 2**30 and plan.tile == (256, 256, 256)
        assert distmm.make_plan(1000, 900, 500, "float32", workers=2, tile=100).tile == (100,) * 3
    with pytest.raises(TypeError):
        distmm.make_plan(10, 10, 10, "U5")
    with pytest.raises(ValueError, match="workers"):
        distmm.make_plan(10, 10, 10, workers=0)


def test_make_plan_is_the_plan_of_the_call():
    rng = np.random.default_rng()
    a, b = _operands(rng, 301, 1203, 95)
    with dask.config.set({"distmm.memory-budget": "48MiB"}):
        CALLS.clear()
        distmm.matmul(a, b)
        assert CALLS.last.plan == distmm.make_plan(301, 95, 1203)
    # The default budget ("auto") is a share of the memory available at the call, measured
    # again after a second: the two calls may see different amounts, and nothing else differs.
    CALLS.clear()
    distmm.matmul(a, b)
    dry = distmm.make_plan(301, 95, 1203)
    assert dataclasses.replace(CALLS.last.plan, memory_budget=dry.memory_budget) == dry


# -- float16: numpy's bits --------------------------------------------------------------------

SHAPES16 = [(64, 4096, 64), (200, 3000, 150), (33, 5001, 7), (300, 75000, 20), (1, 9000, 1)]


@pytest.mark.parametrize("m,k,n", [  # the longest k with the slow cases
    pytest.param(m, k, n, id=f"{m}x{k}x{n}", marks=[pytest.mark.slow] * (k > 50000))
    for m, k, n in SHAPES16])
def test_float16_products_are_numpys_bits(m, k, n):
    rng = np.random.default_rng()
    a, b = _operands(rng, m, k, n, "float16")
    want = np.matmul(a, b).view(np.uint16)
    CALLS.clear()
    got = distmm.matmul(a, b)
    assert got.dtype == np.float16
    assert CALLS.last.request.backend == "numba" and CALLS.last.plan.k_splits == 1
    differ = int(np.count_nonzero(got.view(np.uint16) != want))
    assert differ == 0, f"{differ} of {want.size} elements differ from numpy"


@pytest.mark.slow
def test_float16_stacks_and_the_cluster_are_numpys_bits(client):
    rng = np.random.default_rng()
    a = rng.standard_normal((3, 17, 4999)).astype(np.float16)
    b = rng.standard_normal((4999, 40)).astype(np.float16)
    want = np.matmul(a, b).view(np.uint16)
    assert np.array_equal(distmm.matmul(a, b).view(np.uint16), want)
    a2, b2 = _operands(rng, 64, 4096, 64, "float16")  # fewer tiles than workers: no k split
    with client.as_current():
        got = distmm.matmul(a2, b2, client=client, tile=(32, 32, 256))
    assert np.array_equal(got.view(np.uint16), np.matmul(a2, b2).view(np.uint16))


def test_float16_never_splits_k_and_auto_is_numba():
    plan = distmm.plan.make_plan(64, 64, 2**20, "float16", workers=16, memory_budget=2**20)
    assert plan.k_splits == 1 and plan.acc_dtype == "float32"
    assert distmm.plan.make_plan(64, 64, 2**20, "float32", workers=16).k_splits > 1
    assert distmm.plan.make_plan(64, 64, 2**20, "float16", workers=16, k_splits=4).k_splits == 4
    assert resolve_backend("auto", np.float16, family="numpy", flops=10**12) == ("numba", False)
    assert resolve_backend("auto", np.float16, family="numpy", flops=1,
                           workers_decide=True) == ("numba", False)
    assert resolve_backend("blas", np.float16, family="numpy", flops=1) == ("blas", False)
    assert resolve_backend("auto", np.float16, family="cupy", flops=1) == ("auto", True)


@pytest.mark.parametrize("dtype", ["longdouble", "clongdouble"])
@pytest.mark.parametrize("m,k,n", [(20, 3000, 20), (5, 20000, 3)])
def test_long_double_products_are_numpys_values(m, k, n, dtype):
    """numpy multiplies long doubles without BLAS, one ascending sum over k: a planner that
    split k (few tiles, long k) differed in most elements' last bits."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    if dtype == "clongdouble":
        a, b = a + 1j * rng.standard_normal((m, k)), b - 1j * rng.standard_normal((k, n))
    a, b = a.astype(dtype), b.astype(dtype)
    want = np.matmul(a, b)
    for kw in ({}, {"tile": (8, 8, 64)}, {"backend": "numba"}):
        CALLS.clear()
        got = distmm.matmul(a, b, **kw)
        assert got.dtype == want.dtype and CALLS.last.plan.k_splits == 1, kw
        differ = int(np.count_nonzero(got != want))
        assert differ == 0, f"{kw}: {differ} of {want.size} elements differ from numpy"


@pytest.mark.parametrize("dtype", ["float16", "object", "longdouble"])
@pytest.mark.parametrize("k_chunk", [4096, 1000], ids=["k-whole", "k-chunked"])
@pytest.mark.slow
def test_one_sum_dask_arrays_are_numpys_bits(k_chunk, dtype):
    """float16, long doubles and object floats: numpy's one sum over k, whatever the k
    chunks (long doubles and object floats differed in most elements' last bits with k
    chunked)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b = _operands(rng, 64, 4096, 96, "float16")
    if dtype != "float16":
        a, b = (rng.standard_normal(x.shape).astype(dtype) for x in (a, b))
    lazy = distmm.matmul(da.from_array(a, chunks=(32, k_chunk)),
                         da.from_array(b, chunks=(k_chunk, 48)))
    got, want = lazy.compute(scheduler="threads"), np.matmul(a, b)
    assert got.dtype == want.dtype
    if dtype == "object":
        got, want = got.astype(np.float64), want.astype(np.float64)
    differ = int(np.count_nonzero(got != want))
    assert differ == 0, f"{differ} of {got.size} elements differ from numpy"



@pytest.mark.parametrize("dask_side", ["a", "b"])
def test_object_numpy_operand_beside_a_dask_operand(dask_side):
    """A numpy object array beside a dask operand becomes one dask chunk (dask's automatic
    chunks refuse object arrays) and the product is numpy's."""
    da = pytest.importorskip("dask.array")
    a = np.arange(6).reshape(2, 3).astype(object)
    b = np.arange(12).reshape(3, 4).astype(object) * 10**20  # beyond int64: Python ints
    args = (da.from_array(a, chunks=1), b) if dask_side == "a" else (a, da.from_array(b, chunks=2))
    got = distmm.matmul(*args).compute(scheduler="threads")
    assert got.dtype == object and got.tolist() == np.matmul(a, b).tolist()


@pytest.mark.parametrize("numpy_side", [None, "a", "b"])
def test_dask_strings_in_numpys_object_loop(numpy_side):
    """Strings beside object integers, or with dtype=object, in dask operands: numpy's object
    loop casts them to objects and repeats them (distmm refused a string dask operand)."""
    da = pytest.importorskip("dask.array")
    words = np.array([["ab", "c", "d"], ["e", "fg", ""]])
    counts = np.array([[1, 0], [2, 3], [0, 1]], dtype=object)
    for a, b, kw in ((words, counts, {}), (counts.T, words.T, {}),
                     (words, counts.astype(np.int64), {"dtype": object})):
        want = np.matmul(a, b, **kw)
        x = a if numpy_side == "a" else da.from_array(a, chunks=1)
        y = b if numpy_side == "b" else da.from_array(b, chunks=(2, 1))
        got = distmm.matmul(x, y, **kw).compute(scheduler="threads")
        assert got.dtype == object and got.tolist() == want.tolist()


@pytest.mark.parametrize("case", ["k-a", "k-b", "batch"])
def test_unknown_dask_sizes_name_the_operand_before_any_shape_check(case):
    da = pytest.importorskip("dask.array")
    v = da.from_array(np.arange(6.0), chunks=2)
    v = v[v > -1]  # shape (nan,)
    x = da.from_array(np.ones((4, 5, 6)), chunks=2)
    args = {"k-a": (v, np.ones((6, 2))), "k-b": (np.ones((2, 6)), v),
            "batch": (x[x[:, 0, 0] > 0], np.ones((6, 2)))}[case]
    name = "b" if case == "k-b" else "a"
    with pytest.raises(ValueError, match=f"operand {name} has unknown chunk sizes"):
        distmm.matmul(*args)


# -- operands distmm cannot multiply as they are: one line before any work --------------------

@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("kind", ["csr_array", "csr_matrix", "coo_array"])
def test_sparse_operands_are_refused_as_numpy_refuses_them(kind, side):
    """numpy reads a scipy.sparse matrix as a 0-d object (ValueError from np.matmul); distmm
    says what it is, where before it was taken for an on-disk array and failed mid-product."""
    sparse = pytest.importorskip("scipy.sparse")
    dense = np.random.default_rng().standard_normal((5, 5))
    s = getattr(sparse, kind)(dense)
    args = (s, dense) if side == "a" else (dense, s)
    with pytest.raises(ValueError):
        np.matmul(*args)
    with pytest.raises(ValueError, match=f"operand {side} is a scipy.sparse {kind}.*toarray"):
        distmm.matmul(*args)
    with pytest.raises(ValueError, match=f"gemm: operand {side} is a scipy.sparse {kind}"):
        distmm.gemm(*args)
    with pytest.raises(ValueError, match=f"gemm: operand c is a scipy.sparse {kind}"):
        distmm.gemm(dense, dense, s, beta=1.0)
    if side == "a":  # as out=: numpy's TypeError, where before the product was written into it
        with pytest.raises(TypeError):
            np.matmul(dense, dense, out=s)
        with pytest.raises(TypeError, match=f"out must be a dense array, got {kind}"):
            distmm.matmul(dense, dense, out=s)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("chunks", ["masked", "sparse", "matrix"])
def test_dask_chunks_other_than_numpy_or_cupy_are_refused(chunks, side):
    """A masked chunk's mask would be dropped and a sparse chunk was taken for a device
    array (``backend 'auto' needs cupy``): refused by the chunk type dask records (meta)."""
    da = pytest.importorskip("dask.array")
    dense = np.arange(16.0).reshape(4, 4)
    if chunks == "sparse":
        block = pytest.importorskip("scipy.sparse").csr_matrix(dense)
    else:
        block = np.ma.masked_equal(dense, 5.0) if chunks == "masked" else np.matrix(dense)
    x = da.from_array(block, chunks=2)
    args = (x, dense) if side == "a" else (dense, x)
    hint = "masks would be lost" if chunks == "masked" else "numpy or cupy chunks"
    with pytest.raises(TypeError, match=f"operand {side} is a dask array of .* chunks; .*{hint}"):
        distmm.matmul(*args)
    plain = da.from_array(dense, chunks=2)  # the same product of plain chunks runs
    got = distmm.matmul(plain, dense).compute(scheduler="threads")
    np.testing.assert_array_equal(got, dense @ dense)


@pytest.mark.parametrize("dtype", ["longdouble", "object", "float16"])
def test_gemm_of_k_chunked_dask_operands_keeps_one_sum(dtype):
    """gemm takes matmul's whole-k rule for dask operands chunked along k: long double and
    object results differed from numpy's product in most elements' last bits."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a = rng.standard_normal((8, 1024)).astype(dtype)
    b = rng.standard_normal((1024, 8)).astype(dtype)
    got = distmm.gemm(da.from_array(a, chunks=(8, 256)),
                      da.from_array(b, chunks=(256, 8))).compute(scheduler="threads")
    want = np.matmul(a, b)
    assert got.dtype == want.dtype
    if dtype == "object":
        got, want = got.astype(np.float64), want.astype(np.float64)
    differ = int(np.count_nonzero(got != want))
    assert differ == 0, f"{differ} of {want.size} elements differ from numpy"
