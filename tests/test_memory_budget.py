"""What the memory budget bounds on the local engine, measured: the peak resident memory of a
real child process (its high-water mark, reset just before the product) above what it held
before, with C preallocated and touched (``out=``), so that what is left is distmm's own
working memory.

``distmm.memory-budget`` is the bytes one task may hold; the local engine runs a task per
thread, so a product holds about ``threads x budget`` besides its operands and C: the
partials finished and not yet summed are a few per thread (not every tile's, whose sum is
k_splits times C), and a tile's k partials are summed as they come (``PartialSum``: a few
of them, not all k_splits, which a long k split to fit the budget makes many).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distmm.engine.tiles import PartialSum, reduce_partials
from distmm.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
BUDGET = 1 * MiB
THREADS = 2

#: the child: a product of exact (small integer) complex values into a preallocated C, after
#: a small one that imports and starts everything; prints the plan and the peak above the start
_CHILD = r"""
import json, sys
import numpy as np
import distmm

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

m, n, k, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
def operand(shape):
    x = np.empty(shape, np.complex128)
    x.real, x.imag = rng.integers(-3, 4, shape), rng.integers(-3, 4, shape)
    return x
a, b = operand((m, k)), operand((k, n))
out = np.empty((m, n), np.complex128)
out.fill(0)  # its pages touched: np.zeros would leave that to the product
distmm.matmul(a[:100, :300], b[:300, :100], engine="local", backend=backend)
plan = distmm.make_plan(m, n, k, "complex128", backend=backend)  # what the call plans
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here
start = status("VmRSS:")
distmm.matmul(a, b, out=out, engine="local", backend=backend)
extra = status("VmHWM:") - start
print(json.dumps({"extra": extra, "tile": plan.tile, "k_splits": plan.k_splits,
                  "grid": plan.grid, "exact": bool(np.array_equal(out, a @ b))}))
"""


def _peak(m: int, n: int, k: int, backend: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISTMM_MEMORY_BUDGET": str(BUDGET),
           "DISTMM_LOCAL_THREADS": str(THREADS), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for key in ("DASK_DISTMM__MEMORY_BUDGET", "DASK_DISTMM__LOCAL_THREADS"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(m), str(n), str(k), backend],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _resettable_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident memory")


@pytest.mark.parametrize("m, n, k, backend, why", [
    # 256 C tiles of 64 x 64, k in 4 groups, on the thread pool (complex128 through
    # backend="numba" is numpy's matmul on the engine's threads): all its partials are
    # 64 MiB, for a 16 MiB C
    (1024, 1024, 1024, "numba", "partials of every tile"),
    # one C tile, k in 256 groups of 256 (one task each, in this thread: BLAS threads itself):
    # the tile's 256 partials of 64 KiB are 16 MiB
    (64, 64, 65536, "blas", "a tile's k partials"),
])
@pytest.mark.slow
def test_the_local_engine_holds_about_threads_times_the_budget(m, n, k, backend, why):
    got = _peak(m, n, k, backend)
    assert got["exact"]
    assert got["k_splits"] >= 4 and got["tile"][:2] == [64, 64], got  # what the case is about
    # one task's panels and partial per thread, the partials in flight, and a fixed
    # allowance (the pool's threads, the allocator); holding all the partials takes 16 MiB
    # (a tile's) or 64 MiB (the product's)
    assert got["extra"] <= THREADS * BUDGET * 2 + 4 * MiB, (why, got["extra"] / MiB, got)


class _Term:
    """A symbolic partial: adding two records the sum's shape, so that two reductions are
    the same additions in the same order exactly when their strings are equal."""

    def __init__(self, text):
        self.text = text

    def __add__(self, other):
        return _Term(f"({self.text}+{other.text})")


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 33, 64, 100])
def test_partials_summed_as_they_come_are_the_plans_tree(count):
    """``PartialSum`` adds a tile's partials in k order as they arrive, keeping at most
    log2(count) + 1 of them, and makes exactly the plan's tree of additions
    (``reduce_partials``): the same bits as every other engine."""
    plan = make_plan(64, 64, 256 * count, "float64", tile=(64, 64, 256), k_splits=count)
    assert plan.k_splits == count
    terms = [_Term(str(s)) for s in range(count)]
    total, held = PartialSum(plan), 0
    for term in terms:
        total.add(term)
        held = max(held, total.held)
    assert total.result().text == reduce_partials(plan, terms).text
    assert held <= count.bit_length()


def test_partial_sum_needs_every_partial():
    plan = make_plan(64, 64, 1024, "float64", tile=(64, 64, 256), k_splits=4)
    total = PartialSum(plan)
    for s in range(3):
        total.add(np.full((2, 2), float(s)))
    with pytest.raises(ValueError, match="expected 4 partials, got 3"):
        total.result()
