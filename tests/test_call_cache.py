"""The call cache of ``distmm.api``: a repeated call reuses what it resolved
(validation, engine, backend, plan) and is never stale.

Every test runs real products on fresh random inputs and checks results against
numpy (float64 references for floating types); the cache's own counters and its
last entry show whether a call hit and which plan it ran.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import dask.config
import numpy as np
import pytest

import distmm
from distmm.api import CALLS
from conftest import assert_matches_numpy, random_array

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _empty_cache():
    """An empty cache, and a memory budget of a fixed size: the auto budget follows the
    machine's available memory, which other processes move across its 64 MiB steps between
    two calls, and a changed budget is rightly a miss."""
    CALLS.clear()
    with dask.config.set({"distmm.memory-budget": "1GiB"}):
        yield
    CALLS.clear()


def _call(a, b, **kw):
    """``distmm.matmul`` and whether it hit the cache."""
    hits = CALLS.hits
    out = distmm.matmul(a, b, **kw)
    return out, CALLS.hits == hits + 1


# ------------------------------------------------------------------ hits are exact

@pytest.mark.parametrize("a_dtype,b_dtype", [
    ("float64", "float64"), ("float32", "float32"), ("int8", "int8"), ("int64", "int64"),
    ("bool", "bool"), ("complex128", "complex128"), ("complex64", "complex64"),
    ("float16", "float16"), ("int32", "float32"), ("uint8", "int8"),
])
def test_a_hit_gives_the_bits_of_an_uncached_call(a_dtype, b_dtype):
    rng = np.random.default_rng()
    a = random_array(rng, (37, 53), a_dtype)
    b = random_array(rng, (53, 29), b_dtype)
    first, hit1 = _call(a, b)  # a miss: validated, resolved and planned in full
    second, hit2 = _call(a, b)
    third, hit3 = _call(a.copy(), b.copy())  # new arrays, same signature
    assert (hit1, hit2, hit3) == (False, True, True)
    want_type = np.matmul(a, b).dtype.type
    for got in (first, second, third):
        assert got.dtype == first.dtype and got.dtype.type is want_type
        assert got.tobytes() == first.tobytes()
    lossless = ("float64", "int64", "bool", "complex128")
    if a.dtype.name in lossless and b.dtype.name in lossless:
        listed = distmm.matmul(a.tolist(), b.tolist())  # never cached: no array attributes
        assert listed.tobytes() == second.tobytes()
    with np.errstate(over="ignore"):
        assert_matches_numpy(second, a, b)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((53,), (53, 29)), ((37, 53), (53,)), ((53,), (53,)), ((3, 37, 53), (53, 29)),
    ((2, 1, 7, 5), (3, 5, 4)), ((0, 5), (5, 3)), ((5, 0), (0, 3)),
])
def test_vectors_batches_and_empty_products_hit_like_numpy(a_shape, b_shape):
    rng = np.random.default_rng()
    a, b = random_array(rng, a_shape, np.float64), random_array(rng, b_shape, np.float64)
    first, _ = _call(a, b)
    second, hit = _call(a, b)
    assert hit
    assert type(second) is type(np.matmul(a, b))  # a numpy scalar for vector @ vector
    assert np.asarray(second).tobytes() == np.asarray(first).tobytes()
    assert_matches_numpy(second, a, b)


def test_a_hit_returns_a_new_array_and_leaves_inputs_alone():
    rng = np.random.default_rng()
    a, b = rng.standard_normal((31, 17)), rng.standard_normal((17, 23))
    a0, b0 = a.copy(), b.copy()
    first, _ = _call(a, b)
    second, hit = _call(a, b)
    assert hit and second is not first and not np.shares_memory(first, second)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


# ------------------------------------------------------------------ never stale

def test_shape_dtype_and_type_character_are_part_of_the_key():
    rng = np.random.default_rng()
    a, b = rng.standard_normal((19, 11)), rng.standard_normal((11, 13))
    _call(a, b)
    for x, y in [(a[:, :7], b[:7]), (a.astype(np.float32), b.astype(np.float32)),
                 (a.astype(np.float32), b), (a[:18], b)]:
        got, hit = _call(x, y)
        assert not hit
        assert_matches_numpy(got, x, y)
    # np.longlong and np.int64 compare equal but numpy keeps the type: so must a hit
    ia = rng.integers(-9, 9, size=(19, 11))
    ib = rng.integers(-9, 9, size=(11, 13))
    assert ia.dtype.char != "q"
    _call(ia, ib)
    qa, qb = ia.astype(np.longlong), ib.astype(np.longlong)
    for _ in range(2):
        got, _hit = _call(qa, qb)
        assert got.dtype.type is np.matmul(qa, qb).dtype.type
        np.testing.assert_array_equal(got, qa @ qb)


@pytest.mark.parametrize("dtype", ["float64", "int16"])
def test_c_and_f_order_and_views_are_separate_entries(dtype):
    rng = np.random.default_rng()
    a, b = random_array(rng, (41, 23), dtype), random_array(rng, (23, 17), dtype)
    layouts = [(a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b)),
               (np.asfortranarray(a), np.asfortranarray(b)),
               (random_array(rng, (23, 41), dtype).T, b),  # F order again, other values
               (random_array(rng, (41, 46), dtype)[:, ::2], b)]  # strided view
    seen = set()
    for x, y in layouts:
        layout = (x.strides, y.strides)
        got, hit = _call(x, y)
        assert hit == (layout in seen)
        seen.add(layout)
        again, hit_again = _call(x, y)
        assert hit_again and again.tobytes() == got.tobytes()
        with np.errstate(over="ignore"):
            assert_matches_numpy(got, x, y)
    assert len(CALLS) == len(seen) == 5


def test_operand_family_changes_are_not_served_from_the_cache():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    _call(a, b)
    lazy, hit = _call(da.from_array(a, chunks=16), da.from_array(b, chunks=16))
    assert not hit and isinstance(lazy, da.Array)
    assert_matches_numpy(lazy.compute(scheduler="synchronous"), a, b)
    listed, hit = _call(a.tolist(), b.tolist())
    assert not hit and isinstance(listed, np.ndarray)
    assert_matches_numpy(listed, a, b)
    mixed, hit = _call(a, b.tolist())
    assert not hit
    assert_matches_numpy(mixed, a, b)
    back, hit = _call(a, b)
    assert hit and isinstance(back, np.ndarray)


def test_arguments_are_part_of_the_key():
    rng = np.random.default_rng()
    a, b = rng.standard_normal((70, 90)), rng.standard_normal((90, 60))
    _call(a, b)
    resolved = {}
    for kw in [dict(tile=32), dict(tile=(16, 32, 8)), dict(backend="blas"),
               dict(backend="numba"), dict(engine="local")]:
        got, hit = _call(a, b, **kw)
        assert not hit
        assert_matches_numpy(got, a, b)
        resolved[str(kw)] = (CALLS.last.plan.tile, CALLS.last.request.backend)
        again, hit = _call(a, b, **kw)
        assert hit and again.tobytes() == got.tobytes()
    assert resolved["{'tile': 32}"][0] == (32, 32, 32)
    assert resolved["{'tile': (16, 32, 8)}"][0] == (16, 32, 8)
    assert resolved["{'backend': 'blas'}"][1] == "blas"
    assert resolved["{'backend': 'numba'}"][1] == "numba"
    got, hit = _call(a, b, tile=[16, 32, 8])  # a list tile is unhashable: planned, not cached
    assert not hit
    assert_matches_numpy(got, a, b)


def test_config_changes_between_calls_change_the_plan():
    rng = np.random.default_rng()
    a, b = rng.standard_normal((300, 300)), rng.standard_normal((300, 300))
    # explicit budgets and threads: plans that do not move with the host's free memory
    with dask.config.set({"distmm.memory-budget": "1GiB", "distmm.local-threads": 1}):
        want, _ = _call(a, b)
        base = CALLS.last.plan
        _, hit = _call(a, b)
        assert hit and CALLS.last.plan == base
        assert base.memory_budget == 2**30 and base.k_splits == 1
        with dask.config.set({"distmm.memory-budget": "256KiB"}):
            got, hit = _call(a, b)
            small = CALLS.last.plan
            assert not hit and small.memory_budget == 256 * 2**10
            assert small.tile != base.tile and small.k_splits > 1
            assert_matches_numpy(got, a, b)
            _, hit = _call(a, b)
            assert hit and CALLS.last.plan == small
        got, hit = _call(a, b)  # leaving the context: the 1 GiB plan again
        assert not hit and CALLS.last.plan == base
        assert got.tobytes() == want.tobytes()
        with dask.config.set({"distmm.tile": [100, 50, 25]}):
            got, hit = _call(a, b)
            assert not hit and CALLS.last.plan.tile == (100, 50, 25)
            assert_matches_numpy(got, a, b)
        with dask.config.set({"distmm.local-threads": 3}):
            got, hit = _call(a, b)
            assert not hit and CALLS.last.plan.workers == 3
            assert_matches_numpy(got, a, b)
        _call(a, b)
        assert CALLS.last.plan.workers == 1
    ia = rng.integers(-9, 9, size=(30, 40))
    ib = rng.integers(-9, 9, size=(40, 20))
    for backend in ("numba", "blas", "numba"):
        with dask.config.set({"distmm.backend": backend}):
            got, hit = _call(ia, ib)
            assert not hit and CALLS.last.request.backend == backend
            np.testing.assert_array_equal(got, ia @ ib)


_ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import dask.config
    import numpy as np
    import distmm
    from distmm.api import CALLS

    rng = np.random.default_rng()
    a, b = rng.standard_normal((300, 300)), rng.standard_normal((300, 300))
    ref = a @ b
    out = []

    def call():
        got = distmm.matmul(a, b)
        assert np.abs(got - ref).max() <= 1e-10 * np.abs(ref).max()
        out.append([CALLS.last.plan.memory_budget, list(CALLS.last.plan.tile), CALLS.hits])

    call(); call()                                   # DISTMM_MEMORY_BUDGET from the start
    os.environ["DASK_DISTMM__MEMORY_BUDGET"] = "3MiB"
    dask.config.refresh()                            # dask's way to re-read the environment
    call(); call()
    with dask.config.set({"distmm.memory-budget": "7MiB"}):
        call()
    call()
    print(json.dumps(out))
""")


def test_environment_changes_between_calls_change_the_plan():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTMM_", "DASK_DISTMM__"))}
    env["DISTMM_MEMORY_BUDGET"] = "1MiB"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = json.loads(proc.stdout.strip().splitlines()[-1])
    budgets = [c[0] for c in calls]
    hits = [c[2] for c in calls]
    assert budgets == [2**20, 2**20, 3 * 2**20, 3 * 2**20, 7 * 2**20, 3 * 2**20]
    assert hits == [0, 1, 1, 2, 2, 2]  # each change re-plans; the same setting again hits


def test_a_default_client_turns_auto_from_the_cached_local_engine_to_dask():
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((90, 70)), rng.standard_normal((70, 50))
    _call(a, b)
    _, hit = _call(a, b)
    assert hit
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster:
        with distributed.Client(cluster) as client:
            def transitions(dask_scheduler):
                return dask_scheduler.transition_counter

            before = client.run_on_scheduler(transitions)
            got, hit = _call(a, b)
            # ran on the cluster (the scheduler's own count: the task stream came back empty
            # at distributed's floor, 2024.12)
            assert not hit and client.run_on_scheduler(transitions) > before
            assert_matches_numpy(got, a, b)
            local, hit = _call(a, b, engine="local")
            assert not hit
            assert_matches_numpy(local, a, b)
    # No client again: the local engine runs it (from the old entry, or from a new one
    # where the cluster's start changed dask's configuration object).
    got, hit = _call(a, b)
    assert CALLS.last is not None and CALLS.last.engine.name == "local"
    assert_matches_numpy(got, a, b)
    if not hit:
        got, hit = _call(a, b)
        assert hit
        assert_matches_numpy(got, a, b)


# ------------------------------------------------------------------ bounded

def test_the_cache_is_bounded_and_drops_its_oldest_entry(monkeypatch):
    monkeypatch.setattr(CALLS, "maxsize", 8)
    rng = np.random.default_rng()
    b = rng.standard_normal((5, 3))
    rows = list(range(1, 21))
    for m in rows:
        a = rng.standard_normal((m, 5))
        got, _ = _call(a, b)
        assert_matches_numpy(got, a, b)
        assert len(CALLS) <= 8
    assert len(CALLS) == 8
    _, hit = _call(rng.standard_normal((rows[-1], 5)), b)
    assert hit
    _, hit = _call(rng.standard_normal((rows[0], 5)), b)  # dropped long ago
    assert not hit and len(CALLS) == 8


def test_the_default_bound():
    assert 16 <= CALLS.maxsize <= 4096
    rng = np.random.default_rng()
    b = rng.standard_normal((2, 2))
    for m in range(1, CALLS.maxsize + 40):
        distmm.matmul(np.ones((m, 2)), b)
    assert len(CALLS) == CALLS.maxsize


def test_threads_share_the_cache():
    rng = np.random.default_rng()
    pairs = [(rng.standard_normal((m, 9)), rng.standard_normal((9, m + 1))) for m in range(3, 15)]
    errors = []

    def work(offset):
        try:
            for i in range(40):
                a, b = pairs[(i + offset) % len(pairs)]
                assert_matches_numpy(distmm.matmul(a, b), a, b)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert CALLS.hits > 0 and len(CALLS) <= len(pairs)
