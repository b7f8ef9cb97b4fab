"""distmm called from several threads of one process at once, on the CPU: a web service's
thread pool, ``concurrent.futures``, a task of dask's threaded scheduler.

Each thread multiplies its own fresh operands and every result is checked against numpy's;
what distmm keeps for the whole process (the call cache, the planner's memos, numpy's
type probes) must not let one thread's call disturb another's, nor the process's own
state (its warning filters) once the calls are done.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import distmm
from conftest import assert_matches_numpy, random_array, takes_direct
from distmm import api, plan
from distmm.threads import submit

#: (dtype, backend) of the mixed calls: every CPU backend, numpy's exact loops too
_MIX = [("float64", "blas"), ("int64", "numba"), ("float32", "numba"), ("float16", "auto"),
        ("complex128", "auto"), ("uint64", "auto"), ("object", "auto"), ("int8", "blas")]


def _in_threads(fn, count: int):
    """``fn(i)`` for ``i < count`` on a pool of ``count`` threads started together; the
    first exception (with its traceback) is raised here."""
    start = threading.Barrier(count)

    def run(i):
        start.wait()
        return fn(i)

    with cf.ThreadPoolExecutor(count) as pool:
        return [f.result() for f in [pool.submit(run, i) for i in range(count)]]


def test_mixed_calls_from_eight_threads_match_numpy():
    """Dtypes, backends, tiles, batches, 1-D operands, out= and gemm in every thread at
    once, each with its own operands."""
    def work(i):
        rng = np.random.default_rng()
        for it in range(12):
            dt, backend = _MIX[(i + it) % len(_MIX)]
            m, k, n = (int(x) for x in rng.integers(1, 24 if dt == "object" else 90, 3))
            tile = (None, 16, (9, 17, 5))[it % 3]
            kw = {"backend": backend, "tile": tile, "engine": "local"}
            if it % 4 == 0:  # batches broadcast
                a, b = random_array(rng, (2, 1, m, k), dt), random_array(rng, (3, k, n), dt)
            elif it % 4 == 1:  # a transposed view and a vector
                a, b = random_array(rng, (k, m), dt).T, random_array(rng, (k,), dt)
            else:
                a, b = random_array(rng, (m, k), dt), random_array(rng, (k, n), dt)
            if it % 4 == 2:  # this thread's own out
                out = np.empty((m, n), np.matmul(a[:0], b[:, :0]).dtype)
                got = distmm.matmul(a, b, out=out, **kw)
                assert got is out
            elif it % 4 == 3 and dt not in ("object", "float16"):
                c = random_array(rng, (m, n), dt)
                got = distmm.gemm(a, b, c, beta=1, **kw)
                want = np.matmul(a, b) + c
                if want.dtype.kind in "iu":
                    np.testing.assert_array_equal(got, want)
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.sqrt(k))
                continue
            else:
                got = distmm.matmul(a, b, **kw)
            if dt == "float16" and backend != "blas":
                np.testing.assert_array_equal(got, np.matmul(a, b))  # numpy's bits
            else:
                assert_matches_numpy(got, a, b)
        return i

    assert _in_threads(work, 8) == list(range(8))


def test_a_dask_threaded_task_may_call_distmm():
    """Tasks of dask's threaded scheduler (8 at once) that call distmm on their blocks."""
    import dask.array as da

    rng = np.random.default_rng()
    a, b = rng.integers(-99, 99, (8, 60, 50)), rng.integers(-99, 99, (8, 50, 40))
    x, y = da.from_array(a, chunks=(1, 60, 50)), da.from_array(b, chunks=(1, 50, 40))
    got = da.map_blocks(lambda p, q: distmm.matmul(p, q, backend="numba"), x, y,
                        dtype=np.int64, chunks=(1, 60, 40)).compute(scheduler="threads",
                                                                    num_workers=8)
    np.testing.assert_array_equal(got, a @ b)


#: a child whose worker thread multiplies while its main thread waits, and goes on once a
#: SIGINT has ended the main thread (the interpreter then shuts down, waiting for it)
_AFTER_MAIN = """
import threading, time
import numpy as np
import distmm

a = np.arange(150 * 130).reshape(150, 130) % 97 - 48

def work():
    done = 0
    while True:
        main_ended = not threading.main_thread().is_alive()
        got = distmm.matmul(a, a.T, tile=32, engine="local", backend="numba")
        done += int(np.array_equal(got, a @ a.T))
        if done == 1:
            print("ready", flush=True)
        if main_ended:
            print("after the main thread ended:", done, flush=True)
            return

threading.Thread(target=work).start()
# short sleeps: a SIGINT another thread receives reaches the main thread when it wakes (and
# not join(): an interrupted join marks the thread as ended, which the interpreter then
# does not wait for)
while True:
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_thread_still_multiplies_after_the_main_thread_is_interrupted():
    """Ctrl-C ends the main thread while another (non-daemon) thread runs distmm: Python
    waits for that thread, whose products must still complete. The local engine's tile
    pool (concurrent.futures) takes no work once the interpreter shuts down: its calls
    raised RuntimeError ("cannot schedule new futures after interpreter shutdown")."""
    proc = subprocess.Popen([sys.executable, "-c", _AFTER_MAIN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DISTMM_LOCAL_THREADS": "2"})
    try:
        ready = proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert ready == "ready\n" and "RuntimeError" not in err, err
    assert "after the main thread ended:" in out, (out, err)
    calls = int(out.split("after the main thread ended:")[1])
    assert calls >= 2, out  # every call gave numpy's product, the last after the main thread
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)


#: a child whose main thread starts a (non-daemon) worker and returns once the worker has run
#: AHEAD; the worker then waits until the interpreter shuts down (Python waits for it:
#: concurrent.futures' pools take no new work from then on) and calls distmm: BODY, which
#: prints "after the main thread ended:" and what it found
_AFTER_RETURN = """
import sys, threading, time
import numpy as np
import distmm

ready = threading.Event()

def work():
AHEAD    ready.set()
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    time.sleep(0.2)  # concurrent.futures' exit hook, run just after, has refused new work
BODY

threading.Thread(target=work).start()
ready.wait(60)
"""


def _after_main_returned(body: str, *args, ahead: str = "", timeout: float = 120) -> list[str]:
    """What the child's worker printed after "after the main thread ended:", once the child
    ended well (status 0, no traceback: a thread's uncaught error leaves the status 0)."""
    script = _AFTER_RETURN.replace("AHEAD", ahead).replace("BODY", body)
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "after the main thread ended:" in proc.stdout, (proc.stdout, proc.stderr)
    return proc.stdout.split("after the main thread ended:")[1].split()


#: the command line's staged .npy output (``distmm.cli.io.staged_output``), C written tile by
#: tile, whole rows of 2 MiB a tile: past the page cache on the writer's threads
#: (``distmm.direct_io.SpanWriter``)
_STAGED_DIRECT = """
    from distmm.cli.io import staged_output

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((600, 200)), rng.standard_normal((200, 1024))
    with staged_output(sys.argv[1], (600, 1024), "float64") as out:
        distmm.matmul(a, b, out=out, tile=(256, 1024, 200), engine="local")
        direct = out.written_direct
    got = np.load(sys.argv[1])
    print("after the main thread ended:", np.allclose(got, a @ b, rtol=1e-12, atol=1e-12),
          direct, flush=True)
"""


def test_a_thread_writes_a_staged_output_directly_after_the_main_thread_returned(tmp_path):
    """Direct writes of a staged output go through a pool of the writer's, which took no
    work once the interpreter shut down: the product raised RuntimeError ("cannot schedule
    new futures after interpreter shutdown") and its output was not written."""
    if not takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: the writes take no pool")
    folder = tmp_path / "out"
    folder.mkdir()
    ok, direct = _after_main_returned(_STAGED_DIRECT, str(folder / "c.npy"))
    assert ok == "True" and int(direct) >= 2 * 256 * 1024 * 8  # two whole tiles went direct
    assert sorted(p.name for p in folder.iterdir()) == ["c.npy"]  # no staged file left


#: the GPU stream pipeline (host operands, cuBLAS): its copy threads are pools kept for the
#: process, made by its first product (``_WARM``: one before the main thread returns)
_WARM = ("    distmm.matmul(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32), "
         "backend='cublas', engine='local')\n")
_PIPELINE = """
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1500, 1200)).astype(np.float32)
    b = rng.standard_normal((1200, 1300)).astype(np.float32)
    want = a.astype(np.float64) @ b
    got = distmm.matmul(a, b, backend="cublas", engine="local")
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print("after the main thread ended:", bool(err < 1e-5), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("ahead", [True, False], ids=["pools-made-ahead", "pools-made-after"])
def test_a_thread_multiplies_on_the_gpu_after_the_main_thread_returned(ahead):
    """The GPU pipeline's copy threads (pools) took no work once the interpreter shut
    down: RuntimeError, whether the pools were made before or after."""
    assert _after_main_returned(_PIPELINE, ahead=_WARM if ahead else "") == ["True"]


def test_submit_runs_here_where_the_pool_takes_no_work():
    """``distmm.threads.submit``: a pool that refuses the task leaves it to this thread, its
    result or error in the Future; a task the pool drops has its Future cancelled, which
    ``concurrent.futures.wait`` sees."""
    pool = cf.ThreadPoolExecutor(1)
    pool.shutdown()
    here = submit(pool, threading.get_ident)
    assert here.done() and here.result() == threading.get_ident()
    failed = submit(pool, int, "x")
    assert isinstance(failed.exception(), ValueError)

    pool = cf.ThreadPoolExecutor(1)
    release = threading.Event()
    try:
        running = submit(pool, release.wait, 10)
        queued = submit(pool, threading.get_ident)
        pool.shutdown(wait=False, cancel_futures=True)
        done, _ = cf.wait([queued], timeout=10)
        assert queued in done and queued.cancelled()
    finally:
        release.set()
    assert running.result(timeout=10) is True


def test_a_first_call_leaves_the_warning_filters_alone():
    """The warning filters are the whole process's: a first call (its dtype probe) must not
    touch them, as ``warnings.catch_warnings`` does. Seen here in one thread: a swap resets
    what ``"default"`` has shown, so the same warning came again."""
    a, b = np.ones((3, 4), np.int8), np.ones((4, 2), np.uint16)
    distmm.matmul(a, b)  # numba's import (once per process) adds filters of its own
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(2):
            warnings.warn("shown once", UserWarning)  # one place: "default" shows it once
            api.CALLS.clear()
            plan._result_dtype.cache_clear()
            plan._ufunc_dtype.cache_clear()
            np.testing.assert_array_equal(distmm.matmul(a, b), np.matmul(a, b))
    assert [str(w.message) for w in seen] == ["shown once"]


def test_first_calls_leave_another_threads_warnings_alone():
    """A first call's dtype probe (numpy's own matmul on empty operands, once per dtype
    pair) must leave the process-wide warning filters alone: swapping them
    (``warnings.catch_warnings``) lost the warnings another thread was recording meanwhile,
    and two overlapping swaps left ``ignore ComplexWarning`` in force for the process."""
    a, b = np.ones((3, 4), np.int16), np.ones((4, 2), np.float32)
    stop = threading.Event()
    recorded: list[int] = []

    def record():
        while not stop.is_set():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                warnings.warn("this thread's own", UserWarning)
            recorded.append(len(seen))

    before = list(warnings.filters)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: the overlap comes within a second
    recorder = threading.Thread(target=record)
    recorder.start()
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end and 0 not in recorded:
            # a fresh process's first call, again and again
            api.CALLS.clear()
            plan._result_dtype.cache_clear()
            plan._ufunc_dtype.cache_clear()
            np.testing.assert_array_equal(distmm.matmul(a, b), np.matmul(a, b))
    finally:
        stop.set()
        recorder.join()
        sys.setswitchinterval(interval)
    assert recorded and set(recorded) == {1}, f"lost {recorded.count(0)} of {len(recorded)}"
    assert warnings.filters == before


# the values' own cast warns, as numpy's call does (a filter unlike distmm's own, so that one
# left in force is seen)
@pytest.mark.filterwarnings("ignore:Casting complex values:numpy.exceptions.ComplexWarning")
@pytest.mark.slow
def test_unsafe_casts_from_threads_leave_the_filters_as_they_were():
    """``casting="unsafe"`` into a real dtype from complex operands: numpy's probe warns
    (ComplexWarning), which distmm silences for the probe alone; two threads doing so at
    once must not leave the silencing in force."""
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 4)) + 1j * rng.standard_normal((5, 4))
    before = list(warnings.filters)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def work(i):
        for _ in range(40):
            plan._ufunc_dtype.cache_clear()
            got = distmm.matmul(a, a.T, dtype=np.float64, casting="unsafe")
            # numpy's: the operands cast to float64 (their real parts), then multiplied
            np.testing.assert_allclose(got, a.real @ a.T.real, rtol=1e-12, atol=1e-12)

    try:
        for _ in range(30):  # checked after each round: a later overlap may undo a leak
            _in_threads(work, 4)
            assert warnings.filters == before
    finally:
        sys.setswitchinterval(interval)
