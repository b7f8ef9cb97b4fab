"""A local-engine product stopped in the middle: Ctrl-C (a real SIGINT in the main thread)
or a tile's exception raised in a pool thread.

Each case runs in a child process that reports what the caller sees: how long after the
signal (or the failure) the call raised, which of distmm's threads still ran, the CPU time
the process used over the next half second, ``out=``'s tiles (each as it was or finished:
numpy's own call is not stopped at all, so a stopped distmm call promises no more than
that), the operands (unchanged) and a second call made right after (numpy's result).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = r'''
import json, os, signal, sys, threading, time
import numpy as np
import distmm

signal.signal(signal.SIGINT, signal.default_int_handler)
dt, backend, how, n, tile, path = sys.argv[1:7]
n, tile = int(n), (int(tile) or None)
rng = np.random.default_rng()
if np.dtype(dt).kind == "f":
    a, b = rng.standard_normal((n, n)).astype(dt), rng.standard_normal((n, n)).astype(dt)
else:
    a, b = rng.integers(-9, 9, (n, n)).astype(dt), rng.integers(-9, 9, (n, n)).astype(dt)
if how == "memmap":
    np.save(path, a)
    a = np.load(path, mmap_mode="r")
a0, b0 = np.array(a), b.copy()
kw = {"engine": "local", "backend": backend, "tile": tile}
distmm.matmul(a[:40, :40], b[:40, :40], **kw)  # numba's kernels loaded before the clock
out = np.full((n, n), 7, dt) if how == "out" else None
sent = []

def interrupt():
    sent.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)

timer = threading.Timer(0.4, interrupt)
timer.start()
try:
    if how == "gemm":
        distmm.gemm(a, b, **kw)
    elif out is not None:
        distmm.matmul(a, b, out=out, **kw)
    else:
        distmm.matmul(a, b, **kw)
    raised = None
except KeyboardInterrupt:
    raised = time.monotonic() - sent[0]
timer.join()
alive = [t.name for t in threading.enumerate() if t.name.startswith("distmm")]
cpu = time.process_time()
time.sleep(0.5)
cpu = time.process_time() - cpu
whole = distmm.matmul(a, b, **kw)  # the second call, right after
want = np.matmul(a0.astype(np.float64), b0.astype(np.float64))
tol = {"float16": 0.5, "float32": 1e-3}.get(dt, 1e-9) * np.sqrt(n)
right = bool(np.allclose(whole.astype(np.float64), want, rtol=1e-3, atol=tol))
tiles_ok = True
if out is not None:
    kept, done = out == 7, out == whole
    tiles_ok = bool(np.all(kept | done))
print(json.dumps({"raised": raised, "alive": alive, "cpu": cpu, "right": right,
                  "tiles_ok": tiles_ok, "kept": None if out is None else float(kept.mean()),
                  "inputs": bool(np.array_equal(np.asarray(a), a0) and np.array_equal(b, b0))}))
'''


def _child(tmp_path, *argv, timeout=240) -> dict:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.run([sys.executable, str(script), *map(str, argv), tmp_path / "a.npy"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child process per case, products of seconds
@pytest.mark.parametrize("dt, backend, how, n, tile", [
    ("int64", "blas", "out", 1201, 0),      # numpy's loop: a 1024-row tile takes seconds
    ("float64", "numba", "matmul", 3999, 0),
    ("int64", "numba", "out", 2999, 256),
    ("float16", "numba", "gemm", 4801, 0),  # 3001 ended within 0.4 s on an AVX-512 VM
    ("longdouble", "auto", "memmap", 1025, 0),
    ("float64", "numba", "out", 3999, 3999),  # one task, in the caller's thread
])
def test_ctrl_c_stops_every_tile_of_the_call(tmp_path, dt, backend, how, n, tile):
    """Before, the tiles already running were left to finish on the pool's threads (a
    default tile: seconds of numba's kernel or numpy's loop on every core) while the
    KeyboardInterrupt came at once; now they end at their next strip of rows (about 0.1 s
    of work) and the call waits for them. A product of one tile (run in the caller's thread)
    saw the signal only after its whole kernel call; now between two strips."""
    got = _child(tmp_path, dt, backend, how, n, tile)
    assert got["raised"] is not None, "the product ended before the signal: make it larger"
    assert got["raised"] < 1.0, got
    assert got["alive"] == [], got
    assert got["cpu"] < 0.15, got
    assert got["inputs"] and got["right"], got
    assert got["tiles_ok"], got  # out=: each C tile as it was or finished


_FAILING = r'''
import json, sys, threading, time
import h5py
import numpy as np
import distmm

n, path = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng()
a, b = rng.integers(-9, 9, (n, n)), rng.integers(-9, 9, (n, n))
with h5py.File(path, "w") as f:
    f.create_dataset("b", data=b, chunks=(n, 64), compression="gzip")
with h5py.File(path, "r") as f:  # B's last columns' chunk: bytes that do not inflate
    info = f["b"].id.get_chunk_info_by_coord((0, (n - 1) // 64 * 64))
with open(path, "r+b") as raw:
    raw.seek(info.byte_offset)
    raw.write(b"\xff" * info.size)
with h5py.File(path, "r") as f:
    start = time.monotonic()
    try:
        distmm.matmul(a, f["b"], engine="local", backend="blas")
        raised = None
    except Exception as exc:
        raised = [type(exc).__name__, time.monotonic() - start]
alive = [t.name for t in threading.enumerate() if t.name.startswith("distmm")]
cpu = time.process_time()
time.sleep(0.5)
cpu = time.process_time() - cpu
again = distmm.matmul(a[:301], b[:, :203], engine="local", backend="blas")
print(json.dumps({"raised": raised, "alive": alive, "cpu": cpu,
                  "right": bool(np.array_equal(again, a[:301] @ b[:, :203]))}))
'''


@pytest.mark.slow  # a child process, a product of seconds
def test_a_tile_that_fails_stops_the_call_at_once(tmp_path):
    """A pool thread's task fails (an h5py operand's chunk that does not inflate: C's
    second tile) while the first tile runs numpy's int64 loop for seconds. Before, the
    caller waited for the tasks ahead of the failed one in order (the whole first tile) and
    then left the others running; now it raises as soon as the task fails, after the
    running tasks end at their next strip."""
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    proc = subprocess.run([sys.executable, str(script), "1601", str(tmp_path / "b.h5")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["raised"] is not None and got["raised"][0] == "OSError", got
    assert got["raised"][1] < 1.5, got
    assert got["alive"] == [] and got["cpu"] < 0.15 and got["right"], got


_NO_MEMORY = r'''
import json, resource, threading, time, traceback
import numpy as np
import distmm

n = 1601
rng = np.random.default_rng()
a, b = rng.integers(-9, 9, (n, n)), rng.integers(-9, 9, (n, n))
out = np.zeros((n, n), np.int64)
distmm.matmul(a[:40, :40], b[:40, :40], engine="local", backend="blas")
threading.stack_size(1 << 20)  # the pool's threads start under the limit
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (20 << 20), hard))
start = time.monotonic()
try:
    distmm.matmul(a, b, out=out, engine="local", backend="blas")
    raised = None
except MemoryError as exc:
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    raised = [time.monotonic() - start, "task" in frames]
alive = [t.name for t in threading.enumerate() if t.name.startswith("distmm")]
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
again = distmm.matmul(a[:301], b[:, :203], engine="local", backend="blas")
print(json.dumps({"raised": raised, "alive": alive,
                  "right": bool(np.array_equal(again, a[:301] @ b[:, :203]))}))
'''


@pytest.mark.slow  # a child process
def test_memory_error_in_a_pool_thread(tmp_path):
    """A real MemoryError (the address space limited in a child) raised by a pool
    thread's tile: the caller gets it as numpy's type, no thread of the call is left, and
    the next call (the limit lifted) is right."""
    script = tmp_path / "nomem.py"
    script.write_text(_NO_MEMORY)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["raised"] is not None and got["raised"][1], got  # from a pool thread's task
    assert got["raised"][0] < 1.0 and got["alive"] == [] and got["right"], got
