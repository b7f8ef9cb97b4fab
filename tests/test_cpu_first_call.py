"""A process's first integer products on the CPU: ``backend="auto"`` runs them on numpy's loop
until that has cost about what loading distmm's numba kernels costs (``AUTO_LOOP_FLOPS``), then
on the kernels; both give numpy's bits. Each case runs in a fresh process (what is loaded is
the process's state)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from distmm.executor import AUTO_LOOP_FLOPS, resolve_backend

#: the child's prelude: its report of what is loaded, and numpy's bits for integer operands
#: over their whole range (the sums wrap)
_PRELUDE = """
import json, sys, threading
import numpy as np
import distmm
from distmm.executor import cpu

def loaded():
    return "numba" in sys.modules

def operands(dtype, m, k, n, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == bool:
        return rng.random((m, k)) < 0.5, rng.random((k, n)) < 0.5
    info = np.iinfo(dt)
    return (rng.integers(info.min, info.max, (m, k), dtype=dt, endpoint=True),
            rng.integers(info.min, info.max, (k, n), dtype=dt, endpoint=True))

def same(c, a, b):
    want = a @ b
    return bool(c.dtype == want.dtype and np.array_equal(c, want))
"""


def _child(body: str) -> dict:
    """Run ``body`` after the prelude in a fresh process; it prints one JSON object."""
    r = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_auto_leaves_a_small_integer_product_to_the_executor():
    flops = 2 * 300 * 300 * 300
    for dtype in (np.int64, np.int8, np.uint64, np.bool_):
        assert resolve_backend("auto", dtype, family="numpy", flops=flops) == ("auto", False)
        assert resolve_backend("auto", dtype, family="numpy",
                               flops=AUTO_LOOP_FLOPS) == ("auto", False)
        assert resolve_backend("auto", dtype, family="numpy",
                               flops=AUTO_LOOP_FLOPS + 1) == ("numba", False)
    # explicit backends, and float16's numba sums (numpy's bits), are as they were
    assert resolve_backend("numba", np.int64, family="numpy", flops=flops) == ("numba", False)
    assert resolve_backend("blas", np.int64, family="numpy", flops=flops) == ("blas", False)
    assert resolve_backend("auto", np.float16, family="numpy", flops=flops) == ("numba", False)
    assert resolve_backend("auto", np.int64, family="numpy", flops=flops,
                           workers_decide=True) == ("auto", False)


@pytest.mark.slow
def test_a_first_small_integer_product_runs_on_numpys_loop_without_numba():
    out = _child("""
a, b = operands("int64", 300, 200, 100, 1)
first = {"same": same(distmm.matmul(a, b), a, b), "numba": loaded()}
loop = cpu.loop_flops()
blas = {"same": same(distmm.matmul(a, b, backend="blas"), a, b), "numba": loaded()}
numba = {"same": same(distmm.matmul(a, b, backend="numba"), a, b), "numba": loaded()}
print(json.dumps({"first": first, "loop": loop, "blas": blas, "numba": numba,
                  "loop_after": cpu.loop_flops(), "kernels": cpu.kernels_loaded()}))
""")
    assert out["first"] == {"same": True, "numba": False}
    assert out["loop"] == 2 * 300 * 200 * 100
    assert out["blas"] == {"same": True, "numba": False}
    # an explicit backend="numba" still takes the kernels, whatever the size
    assert out["numba"] == {"same": True, "numba": True}
    assert out["kernels"] and out["loop_after"] == out["loop"]


@pytest.mark.slow
def test_integer_products_give_numpys_wrapped_bits_on_the_loop_and_on_the_kernels():
    out = _child("""
dtypes = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"]
shapes = [(37, 29, 41), (1, 300, 1), (130, 3, 70)]
cases = [(dt, s, operands(dt, *s, seed)) for seed, dt in enumerate(dtypes) for s in shapes]
loop = [same(distmm.matmul(a, b), a, b) for _, _, (a, b) in cases]
# the executor's own panels: b copied column-major for numpy's loop, and one too large to copy
executor = cpu.CPUExecutor("auto")
panels = [operands(dt, 5, 3000, 7, 9) for dt in ("int64", "uint64")]
panels += [operands(dt, 3, 2**16, 10, 10) for dt in ("int64", "uint64")]
loop += [same(executor.panel_product(a, b), a, b) for a, b in panels]
on_loop, flops = not loaded(), cpu.loop_flops()
big = np.ones((700, 700), np.int64)  # past AUTO_LOOP_FLOPS: the kernels load
big_same = same(distmm.matmul(big, big), big, big)
kernels = [same(distmm.matmul(a, b), a, b) for _, _, (a, b) in cases]
print(json.dumps({"loop": loop, "on_loop": on_loop, "flops": flops, "big": big_same,
                  "kernels": kernels, "loaded": cpu.kernels_loaded(),
                  "flops_after": cpu.loop_flops()}))
""")
    assert out["on_loop"] and all(out["loop"]), out["loop"]
    assert out["flops"] == 9 * 2 * (37 * 29 * 41 + 300 + 130 * 3 * 70) + 2 * 2 * (
        5 * 3000 * 7 + 3 * 2**16 * 10)
    assert out["big"] and out["loaded"]
    # the same calls (the call cache's entries) now run on the kernels, with the same bits
    assert all(out["kernels"]) and out["flops_after"] == out["flops"], out["kernels"]


@pytest.mark.slow
def test_the_kernels_load_once_the_loop_has_done_its_share_and_stay():
    n = 256
    per_call = 2 * n**3
    out = _child(f"""
a, b = operands("int64", {n}, {n}, {n}, 3)
calls = []
while not cpu.kernels_loaded() and len(calls) < 100:
    calls.append(same(distmm.matmul(a, b), a, b))
flops = cpu.loop_flops()
warm = same(distmm.matmul(a, b), a, b)
print(json.dumps({{"calls": calls, "flops": flops, "warm": warm,
                   "flops_after": cpu.loop_flops()}}))
""")
    # AUTO_LOOP_FLOPS / per_call products on the loop, then the one that loaded the kernels
    assert all(out["calls"]) and len(out["calls"]) == AUTO_LOOP_FLOPS // per_call + 1
    assert out["flops"] == AUTO_LOOP_FLOPS
    assert out["warm"] and out["flops_after"] == AUTO_LOOP_FLOPS


@pytest.mark.slow
def test_a_large_first_integer_product_takes_the_kernels_and_small_ones_follow():
    out = _child("""
big = np.arange(800 * 700, dtype=np.int64).reshape(800, 700) * 7919
c = distmm.matmul(big, big.T)
first = {"same": same(c, big, big.T), "loaded": cpu.kernels_loaded(), "loop": cpu.loop_flops()}
a, b = operands("uint64", 64, 64, 64, 4)
small = {"same": same(distmm.matmul(a, b), a, b), "loop": cpu.loop_flops()}
print(json.dumps({"first": first, "small": small}))
""")
    assert out["first"] == {"same": True, "loaded": True, "loop": 0}
    assert out["small"] == {"same": True, "loop": 0}


@pytest.mark.slow
def test_threads_that_exhaust_the_loop_together_all_get_numpys_bits():
    out = _child("""
a, b = operands("int64", 256, 256, 256, 5)
want = a @ b
ok = []
def work():
    for _ in range(6):
        ok.append(bool(np.array_equal(distmm.matmul(a, b), want)))
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"ok": ok, "loaded": cpu.kernels_loaded(), "flops": cpu.loop_flops()}))
""")
    assert len(out["ok"]) == 24 and all(out["ok"])
    # 24 products are three times the loop's share: it was spent, then the kernels loaded
    assert out["loaded"] and out["flops"] == AUTO_LOOP_FLOPS
