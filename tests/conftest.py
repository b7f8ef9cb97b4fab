"""What the test modules share: skip logic, fixtures and comparison helpers.

This module covers:

- skipping by marker: a test marked ``gpu`` is skipped unless cupy imports and sees a CUDA
  device, and one marked ``mpi`` unless ``mpiexec`` (or ``mpirun``) is on PATH, so no
  test module carries a prelude of its own;
- MPI launches: the ``mpiexec`` path, the environment the ranks run in (``mpi_env``) and
  ``mpirun`` (``mpiexec -n P python ...`` with a timeout, output captured);
- the shared Dask fixtures, all on real worker processes: ``cluster`` and ``client`` (two
  single-thread workers), ``scheduler_file`` (the ``cluster``'s, for ``distmm matmul
  --scheduler-file``), ``pair`` (two workers marked GPU by their resource only),
  ``shared_client`` (two dask-cuda workers sharing GPU 0), ``tile_mode``, and
  ``blind_worker`` (one more worker of ``cluster`` that does not see ``tmp_path``:
  ``hidden_worker``);
- files no process may change (``chattr``: immutable or append-only, taken off at the end);
- batch jobs on localhost (``batch_env``): Slurm's and PBS's commands replaced by the
  stand-ins of ``tests/batchsim/`` on ``PATH``, a spool folder per test, and the file the
  jobs source to find this Python (``DISTMM_ENV_SETUP``);
- helpers that more than one test module calls: the numpy comparison
  (``random_array``, ``assert_matches_numpy``), dask operands persisted on chosen workers
  (``placed``), worker loss during a product (``start_call``, ``kill_workers``), and the
  bytes the workers have sent to clients (``served_to_clients``); whether a folder takes
  ``O_DIRECT`` writes (``takes_direct``); the ``distmm`` command as a child process
  (``run_cli``) and ``distmm cluster`` served by one (``serve_cluster``, ``stop_cluster``,
  ``assert_all_gone``). Test
  modules import them with ``from conftest import ...``; no test module imports another.

It does *not* cover what the scripts under ``mpiexec`` need (``mpi_cases.py``,
``mpi_reuse_cases.py`` and ``mpi_verdict.py`` run outside pytest and import nothing from
here).

See also the markers in ``pyproject.toml``: ``slow`` cases run only under
``pytest -m slow``; the plain ``pytest`` leaves them out.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: numpy 1.x's bundled OpenBLAS (0.3.23) picks its kernels by CPU, and its SkylakeX ones give
#: complex Inf and NaN forms (NaN where the others, and numpy 2's, keep an Inf) and stack bits
#: (a stack's gemm against its elements' calls) that differ: where a test holds distmm to those
#: of numpy's, numpy 1.x may fail it on such a CPU (session 46's tree fails alike there)
NUMPY1_BLAS_FORMS = pytest.mark.xfail(
    np.lib.NumpyVersion(np.__version__) < "2.0.0", strict=False,
    reason="numpy 1.x's OpenBLAS kernels on this CPU give other Inf/NaN forms or stack bits")

# A suite started as a background job of a non-interactive shell (`pytest ... &`, nohup in a
# script) has SIGINT ignored, and every child it starts inherits that: the tests that send a
# child SIGINT would see it ignored, as the shell asked. Python's own handler here instead,
# which a child's exec resets to the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# -- the command line ------------------------------------------------------------------------


def one_line(stderr: str) -> str:
    """``stderr`` after checking it is one line, without a traceback (a command's refusal)."""
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    return stderr


@contextlib.contextmanager
def read_only_mount(src: Path, at: Path):
    """``src`` bind-mounted read-only at ``at`` (made here) for the block: a folder where
    nothing can be written even by root, who ignores permission bits; skips the test where
    no such mount can be made."""
    at.mkdir()
    ok = subprocess.run(["mount", "--bind", src, at], capture_output=True).returncode == 0
    if ok and (subprocess.run(["mount", "-o", "remount,ro,bind", at],
                              capture_output=True).returncode != 0 or os.access(at, os.W_OK)):
        subprocess.run(["umount", at], capture_output=True)
        ok = False
    if not ok:
        pytest.skip("no read-only bind mount here")
    try:
        yield at
    finally:
        subprocess.run(["umount", at], capture_output=True)


@pytest.fixture
def npy_operands(tmp_path: Path):
    """Fresh float64 A (37 x 50) and B (50 x 29) saved as ``a.npy`` and ``b.npy`` in
    ``tmp_path``: ``(path of A, path of B, A @ B)``."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((37, 50)), rng.standard_normal((50, 29))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return tmp_path / "a.npy", tmp_path / "b.npy", a @ b


def run_cli(*args, timeout: float = 600, env: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
    """``python -m distmm ARGS`` in a child process, its output captured as text. ``env``
    adds to this process's environment (a value of None removes that variable)."""
    if env is not None:
        env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "distmm", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def run_rank_script(mpirun, path, text: str, ranks: int, *args, timeout: float = 120):
    """Writes ``text`` (an MPI script whose rank 0 prints every rank's ``rank R: what: ok``
    or ``...: BAD ...`` lines) to ``path``, runs it on ``ranks`` ranks with ``args`` through
    the ``mpirun`` fixture, and returns ``(result, lines, bad)``: the ``rank`` lines and
    those not ending in ``: ok``."""
    path.write_text(text)
    r = mpirun(ranks, path, *args, timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("rank ")]
    return r, lines, [line for line in lines if not line.endswith(": ok")]


#: a child's ``sitecustomize``: once MODULE is imported, its NAME waits for the file ``go`` in
#: FOLDER (after making ``paused`` there), or SECONDS where given, before it runs or (AFTER)
#: once it has returned; only on MPI rank RANK where given
_PAUSE_AT = """
import functools, importlib.machinery, os, sys, time

MODULE, NAME, FOLDER, AFTER = {module!r}, {name!r}, {folder!r}, {after!r}
SECONDS, RANK, CALL = {seconds!r}, {rank!r}, {call!r}
calls = 0


def _wait():
    if RANK is not None and os.environ.get("OMPI_COMM_WORLD_RANK") != str(RANK):
        return
    if SECONDS is not None:
        time.sleep(SECONDS)
        return
    open(os.path.join(FOLDER, "paused"), "w").close()
    while not os.path.exists(os.path.join(FOLDER, "go")):
        time.sleep(0.01)


def _paused(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global calls
        calls += 1
        if not AFTER and calls == CALL:
            _wait()
        made = fn(*args, **kwargs)
        if AFTER and calls == CALL:
            _wait()
        return made
    return wrapper


class PauseAt:
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            setattr(module, NAME, _paused(getattr(module, NAME)))

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PauseAt())
"""


def marking(path: Path):
    """A ``map_blocks`` function that passes its block through and appends to ``path``: a
    dask array built with it shows by ``path`` existing whether anything of it was computed."""
    def mark(x):
        with open(path, "a") as f:
            f.write("x")
        return x
    return mark


def pause_at(folder: Path, module: str, name: str, *, after: bool = False,
             seconds: float | None = None, rank: int | None = None, call: int = 1) -> None:
    """Make ``folder`` a ``sitecustomize`` (a child with it first on PYTHONPATH): the child's
    ``call``-th call of ``module.name`` waits for ``folder/go`` before it runs (``after``: once
    it has returned), making ``folder/paused`` when it starts waiting; with ``seconds``, it
    sleeps that long instead; with ``rank``, only MPI rank ``rank`` waits (Open MPI's rank
    variable). A module run as ``__main__`` (``python -m``) is out of its reach."""
    (folder / "sitecustomize.py").write_text(
        _PAUSE_AT.format(module=module, name=name, folder=str(folder), after=after,
                         seconds=seconds, rank=rank, call=call))


# -- skipping by marker ---------------------------------------------------------------------


@functools.cache
def gpu_available() -> bool:
    """Whether cupy imports and sees at least one CUDA device (asked once per session)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device: the runtime raises its own error types
        return False


def _mpiexec_path() -> str | None:
    return shutil.which("mpiexec") or shutil.which("mpirun")


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests without cupy and a device, ``mpi`` tests without mpiexec."""
    no_gpu = pytest.mark.skip(reason="needs cupy and a CUDA GPU")
    no_mpi = pytest.mark.skip(reason="no mpiexec on PATH")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not gpu_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("mpi") is not None and _mpiexec_path() is None:
            item.add_marker(no_mpi)


# -- MPI ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """The path of ``mpiexec`` (or ``mpirun``); skips the test where there is none."""
    exe = _mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec on PATH")
    return exe


@pytest.fixture
def mpi_env() -> dict[str, str]:
    """A fresh copy of the environment ranks run in: root allowed, oversubscription on,
    one BLAS thread per rank, and the checkout first on PYTHONPATH (the scripts under
    tests/ import ``mpi_verdict`` and the package)."""
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
                OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# Open MPI's launcher on a busy 2-core VM has failed, rarely, before starting any rank
# ("The PMIx server's listener thread failed to start"; once in a full CI run). That is
# the launcher's, not distmm's: such a launch is tried again, and nothing else is.
LAUNCH_ATTEMPTS = 3
_LAUNCHER_FAILURES = ("PMIx server's listener thread failed to start",)


def launcher_failed(result: subprocess.CompletedProcess) -> bool:
    """Whether ``mpiexec`` itself failed to start, before any rank ran."""
    out = (result.stdout or "") + (result.stderr or "")
    return result.returncode != 0 and any(m in out for m in _LAUNCHER_FAILURES)


@pytest.fixture
def mpirun(mpiexec, mpi_env):
    """``mpirun(ranks, *argv, timeout=120, env=None, cwd=None)``: runs
    ``mpiexec -n ranks --oversubscribe python *argv`` in ``mpi_env`` (updated by ``env``)
    and returns the ``subprocess.CompletedProcess`` (text output captured). The timeout
    bounds a hang: ``subprocess.TimeoutExpired`` fails the test. A launch that ``mpiexec``
    itself failed to start (``launcher_failed``) is tried again, up to LAUNCH_ATTEMPTS."""

    def run(ranks: int, *argv, timeout: float = 120, env: dict | None = None, cwd=None):
        for attempt in range(LAUNCH_ATTEMPTS):
            r = subprocess.run([mpiexec, "-n", str(ranks), "--oversubscribe", sys.executable,
                                *map(str, argv)], capture_output=True, text=True,
                               timeout=timeout, env={**mpi_env, **(env or {})}, cwd=cwd)
            if not launcher_failed(r):
                break
        return r

    return run


# -- Dask clusters (real worker processes) --------------------------------------------------


@pytest.fixture
def tile_mode():
    """The Dask engine in tile mode (one task per plan tile) for the test: on a GPU machine
    the workers would see the GPU and run block mode (tests/test_dask_placement.py). Modules
    that test tile mode use it with ``pytestmark = pytest.mark.usefixtures("tile_mode")``."""
    import dask.config

    with dask.config.set({"distmm.dask-layout": "tiles"}):
        yield


@pytest.fixture(scope="module")
def cluster():
    """A LocalCluster of two single-thread worker processes (3 GiB each), one per module."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="3GiB") as cl:
        yield cl


@pytest.fixture
def client(cluster):
    """A client of ``cluster`` for one test, once both workers are up (after a test that
    killed one, its nanny's replacement)."""
    import distributed

    with distributed.Client(cluster) as c:
        c.wait_for_workers(2, timeout=120)
        yield c


@contextlib.contextmanager
def hidden_worker(client, folder):
    """One more worker of ``client``'s cluster (one thread, no nanny) that does not see
    ``folder``'s files: ``dask worker`` in a mount namespace of its own where a tmpfs hides
    the folder, as on a host without the shared file system (the test is skipped where no
    mount namespace can be made); yields its address. It is stopped at the end (killed
    where SIGTERM does not end it in 10 s)."""
    import uuid

    hide = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f"mount -t tmpfs tmpfs '{folder}' && exec \"$0\" \"$@\""]
    if shutil.which("unshare") is None or subprocess.run(
            hide + ["true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here to hide a folder from one worker")
    marker = folder / "seen-by-the-others"
    marker.touch()
    before = set(client.scheduler_info(n_workers=-1)["workers"])
    proc = subprocess.Popen(hide + [
        sys.executable, "-m", "distributed.cli.dask_worker", client.scheduler.address,
        "--nthreads", "1", "--no-nanny", "--no-dashboard", "--memory-limit", "2GiB",
        "--name", f"blind-{uuid.uuid4().hex[:8]}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client.wait_for_workers(len(before) + 1, timeout=60)
        (address,) = set(client.scheduler_info(n_workers=-1)["workers"]) - before
        seen = client.run(os.path.exists, str(marker))
        assert not seen[address] and all(v for w, v in seen.items() if w != address), seen
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and \
                len(client.scheduler_info(n_workers=-1)["workers"]) > len(before):
            time.sleep(0.1)


@pytest.fixture
def blind_worker(client, tmp_path):
    """``hidden_worker`` of the ``client`` fixture's cluster, hiding ``tmp_path``: its
    address."""
    with hidden_worker(client, tmp_path) as address:
        yield address


def write_scheduler_file(client, path) -> Path:
    """A scheduler file naming ``client``'s scheduler at ``path``, as ``dask scheduler
    --scheduler-file`` writes one (its ``address`` is what a client reads).
    ``Client.write_scheduler_file`` dumps the whole ``scheduler_info()``, which stops being
    JSON once the workers report metrics keyed by tuples."""
    import json

    path = Path(path)
    path.write_text(json.dumps({"type": "Scheduler", "address": client.scheduler.address}))
    return path


@pytest.fixture
def scheduler_file(client, tmp_path):
    """The scheduler file of ``cluster`` (``write_scheduler_file``), in a folder of its own
    beside the test's files."""
    (tmp_path / "scheduler").mkdir()
    return write_scheduler_file(client, tmp_path / "scheduler" / "scheduler.json")


@pytest.fixture(scope="module")
def pair():
    """Two single-thread worker processes, both GPU by their resource only (no device
    visible to either: their GPU tasks run the CPU executor); ``(client, w0, w1)`` with
    the addresses in the engine's (sorted) order."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", memory_limit="2GiB",
                                  resources={"GPU": 1}, env={"CUDA_VISIBLE_DEVICES": ""}) as cl, \
            distributed.Client(cl) as c:
        c.wait_for_workers(2, timeout=60)
        w0, w1 = sorted(c.scheduler_info(n_workers=-1)["workers"])
        yield c, w0, w1


@pytest.fixture(scope="module")
def shared_client():
    """Two dask-cuda workers sharing GPU 0 (``gpu_cluster("0", per_device=2)``), for ``gpu``
    tests; skips without dask-cuda."""
    pytest.importorskip("dask_cuda")
    from distributed import Client

    from distmm.cli.cluster import gpu_cluster

    with gpu_cluster("0", per_device=2) as cl, Client(cl) as c:
        c.wait_for_workers(2, timeout=120)
        yield c


# -- file attributes ----------------------------------------------------------------------


@pytest.fixture
def chattr(tmp_path):
    """``chattr(path, "i")``: a file or folder made immutable (or "a", append-only), which no
    process, root's included, may write, replace or remove (root ignores permission bits);
    both attributes are taken off everything under ``tmp_path`` at the end (a marked file a
    run moved there included). Skipped where chattr or the file system does not take it (not
    root, a file system without attributes)."""
    made = []

    def set_attribute(path, flag):
        try:
            r = subprocess.run(["chattr", f"+{flag}", str(path)], capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no chattr here")
        if r.returncode != 0:
            pytest.skip(f"chattr +{flag} refused here: {r.stderr.strip()}")
        made.append(path)

    yield set_attribute
    if made:
        subprocess.run(["chattr", "-R", "-i", "-a", str(tmp_path)], capture_output=True)
        for path in made:  # one outside tmp_path
            subprocess.run(["chattr", "-i", "-a", str(path)], capture_output=True)


# -- batch jobs (tests/batchsim stand-ins for sbatch, srun, qsub, ...) -----------------------

BATCHSIM = ROOT / "tests" / "batchsim"


@pytest.fixture
def batch_env(tmp_path, mpi_env) -> dict[str, str]:
    """The environment a test submits batch jobs in: the stand-ins first on ``PATH``, then
    this Python's folder (``dask``, ``distmm``, ``mpiexec``), a spool folder under
    ``tmp_path``, and ``DISTMM_ENV_SETUP``: a file that gives a job (PBS passes none of the
    submitter's environment) this Python, the checkout, and MPI allowed as root with more
    ranks than cores. Dashboards on any free port."""
    bindir = os.path.dirname(sys.executable)
    setup = tmp_path / "env-setup.sh"
    setup.write_text(
        f"export PATH={bindir}:$PATH PYTHONPATH={ROOT}\n"
        "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi\n"
        "export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe\n"
        "export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1\n")
    return {**mpi_env, "PATH": f"{BATCHSIM}{os.pathsep}{bindir}{os.pathsep}{os.environ['PATH']}",
            "BATCHSIM_SPOOL": str(tmp_path / "spool"), "BATCHSIM_PYTHON": sys.executable,
            "DISTMM_ENV_SETUP": str(setup), "DISTMM_DASHBOARD": ":0", "OMPI_MCA_btl": "^ofi",
            "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
            "NUMBA_NUM_THREADS": "1"}


# -- helpers more than one module calls ------------------------------------------------------

FLOAT_TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13,
             np.complex64: 2e-6, np.complex128: 1e-13, np.longdouble: 1e-13}


def random_array(rng, shape, dtype):
    """Fresh random values of ``dtype``: booleans (30 % true), integers over their whole
    range (so narrow ones wrap as numpy's do), standard normal floats and complexes."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.3
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def assert_matches_numpy(got, a, b):
    """``got`` has the shape and dtype of ``np.matmul(a, b)``; its values are exact for
    integers and booleans, and within a relative error (scaled by sqrt(k)) of a float64
    (or complex128) reference for floating types."""
    want = np.matmul(a, b)
    assert np.shape(got) == np.shape(want)
    assert np.asarray(got).dtype == want.dtype
    if want.dtype.kind in "biuO":
        np.testing.assert_array_equal(got, want)
        return
    ref_type = np.complex128 if want.dtype.kind == "c" else np.float64
    ref = np.matmul(np.asarray(a, ref_type), np.asarray(b, ref_type))
    den = np.linalg.norm(ref) or 1.0
    err = np.linalg.norm(np.asarray(got, ref_type) - ref) / den
    assert err <= FLOAT_TOL[want.dtype.type] * max(1, np.sqrt(a.shape[-1])), err


def assert_close(got, want):
    """Exact for integers; float64 results within 1e-11 of ``want`` (relative, and
    absolute against its largest magnitude)."""
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max())


def equal_gpus():
    """A config context in which the Dask engine rates every GPU worker alike."""
    import dask.config

    return dask.config.set({"distmm.dask-worker-gflops": {"gpu": 1000, "cpu": 1}})


def placed(client, x, chunks, where):
    """``x`` as a dask array of ``chunks`` whose chunk ``(i, j)`` is persisted on
    ``where[i][j]``; checked with ``who_has``."""
    import dask.array as da
    import distributed

    rows, cols = np.cumsum((0,) + chunks[0]), np.cumsum((0,) + chunks[1])
    pieces = []
    for i in range(len(chunks[0])):
        line = []
        for j in range(len(chunks[1])):
            blk = da.from_array(x[rows[i]:rows[i + 1], cols[j]:cols[j + 1]], chunks=-1)
            line.append(client.persist(blk, workers=[where[i][j]]))
        pieces.append(line)
    distributed.wait([p for line in pieces for p in line])
    out = client.persist(da.block(pieces))
    distributed.wait(out)
    held = client.who_has(out)
    for i, line in enumerate(where):
        for j, w in enumerate(line):
            assert held[(out.name, i, j)] == (w,), (held, where)
    return out


def _served_here(dask_worker) -> int:
    # a client fetches results with get_data and no ``who``; a worker names itself
    return sum(int(e["total"]) for e in dask_worker.transfer_outgoing_log if e.get("who") is None)


def served_to_clients(client) -> int:
    """Bytes of task results the cluster's workers have sent to clients so far (gathered
    futures: the ``transfer_outgoing_log`` entries of requests that name no worker).
    The difference around a call is what its clients received."""
    return sum(client.run(_served_here).values())


def start_call(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on a started thread; returns ``(thread, out)``,
    ``out`` getting ``"c"`` (the result) or ``"error"`` (what it raised, for the
    test's assertion to report). Tests kill workers while it runs."""
    out: dict = {}

    def product():
        try:
            out["c"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported by the caller's assertion
            out["error"] = exc

    run = threading.Thread(target=product)
    run.start()
    return run, out


def _product_running(client) -> bool:
    def running(dask_scheduler):
        return any(ts.state == "processing" for key, ts in dask_scheduler.tasks.items()
                   if isinstance(key, tuple) and "distmm-" in str(key[0]))

    return client.run_on_scheduler(running)


def kill_workers(client, run: threading.Thread, kills: int, gap: float) -> int:
    """SIGKILL ``kills`` of the worker processes alive when the product started,
    one every ``gap`` seconds while ``run`` is alive; returns how many were
    killed before it ended. Replacements the nannies start are left alone (a
    worker killed while its nanny is still starting it may not come back)."""
    deadline = time.monotonic() + 60
    while not _product_running(client):
        if not run.is_alive() or time.monotonic() > deadline:
            return 0
        time.sleep(0.01)
    pids = sorted(client.run(os.getpid, on_error="ignore").values())
    killed = 0
    for pid in pids[-kills:]:
        if not run.is_alive():
            break
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
        time.sleep(gap)
    return killed


def stop_after_logged(line, folder: Path, env: dict, logged: int,
                      pattern: str = ".c.*.done-*") -> str:
    """Run ``line`` (a ``--resume`` run in ``folder``, one stripe a 0.1 s), SIGTERM its
    ranks once their done-logs (``pattern``) list ``logged`` stripes, and return its stderr,
    which must say that C stripes were kept."""
    import psutil

    proc = subprocess.Popen(line, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": "0.1"})
    deadline = time.time() + 120
    while sum(len(p.read_text().split()) for p in Path(folder).glob(pattern)) < logged:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    for rank in [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "distmm" in " ".join(p.cmdline())] or [psutil.Process(proc.pid)]:
        rank.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "C stripes kept in" in err, err
    return err


def takes_direct(folder) -> bool:
    """Whether ``folder``'s file system takes an aligned ``O_DIRECT`` write (tmpfs and some
    overlay or network file systems do not; distmm then writes through the page cache)."""
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    path = Path(folder) / "direct-probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flag, 0o644)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        return bool(flag)
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


# -- distmm cluster as a subprocess ---------------------------------------------------------


def serve_cluster(scheduler_file: Path, *args, timeout: float = 120) -> subprocess.Popen:
    """``distmm cluster --port 0 --dashboard-address :0 --scheduler-file F *args`` in a
    session of its own (so that a signal to its group is a terminal's Ctrl-C), returned
    once F names a scheduler; fails the test if it ends or takes ``timeout`` seconds first."""
    import json

    proc = subprocess.Popen([sys.executable, "-m", "distmm", "cluster", "--port", "0",
                             "--dashboard-address", ":0", "--scheduler-file", str(scheduler_file),
                             *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if json.loads(scheduler_file.read_text())["address"]:
                return proc
        except (FileNotFoundError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"distmm cluster ended with {proc.returncode}: {out} {err}")
        if time.monotonic() > deadline:
            stop_cluster(proc, None)
            pytest.fail(f"distmm cluster wrote no scheduler file in {timeout} s")
        time.sleep(0.05)


def stop_cluster(proc: subprocess.Popen, send, timeout: float = 60):
    """Stop ``distmm cluster``: ``send(proc)`` sends the signal; returns ``(exit status,
    stdout, stderr, seconds)``, failing the test after ``timeout`` s. ``send=None`` kills
    the command and every process under it (cleanup after a failed test)."""
    import psutil

    if send is None:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.communicate()
        return None
    t0 = time.monotonic()
    send(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_cluster(proc, None)
        pytest.fail(f"distmm cluster did not stop within {timeout} s of the signal")
    return proc.returncode, out, err, time.monotonic() - t0


def assert_all_gone(procs: list) -> None:
    """Every ``psutil.Process`` of ``procs`` has ended within 10 s (a zombie waiting for
    its new parent to reap it has ended)."""
    import psutil

    def status(p):
        try:
            return p.status()
        except psutil.NoSuchProcess:
            return None

    _, alive = psutil.wait_procs(procs, timeout=10)
    alive = [p for p in alive if status(p) not in (None, psutil.STATUS_ZOMBIE)]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def ended(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc``'s output once it ended; its session (``start_new_session=True``) killed and
    the test failed where it takes over ``timeout`` seconds (a hang)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out}\n{err[-3000:]}")


def left_in_session(sid: int) -> list:
    """The processes of session ``sid`` still running (not zombies) 10 s at most after its
    leader ended or was stopped: a worker or nanny a command left behind."""
    import psutil

    deadline = time.monotonic() + 10
    while True:
        left = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, " ".join(p.cmdline())))
            except (OSError, psutil.Error):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def identical(got, want) -> bool:
    """Same type (a plain ndarray), dtype, shape and elements: NaN where NaN, each part's
    sign too (-0.0 is not 0.0); objects by ==."""
    if type(got) is not np.ndarray or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype == object:
        return got.tolist() == want.tolist()
    if got.dtype.kind in "biu":
        return np.array_equal(got, want)
    parts = [np.stack([z.real, z.imag]).astype(np.float64) for z in (got, want)]
    return (np.array_equal(parts[0], parts[1], equal_nan=True)
            and np.array_equal(np.signbit(parts[0]), np.signbit(parts[1])))


def recorded(product, a, b):
    """``product(a, b)`` and the warnings it gave, as ``(category, message)`` pairs in order."""
    import warnings

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = product(a, b)
    return c, [(w.category, str(w.message)) for w in got]


def reported(f):
    """A call's result and numpy's reports: the warnings under errstate 'warn', in order,
    and the ``FloatingPointError``'s message under 'raise' (None where none is raised)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen, np.errstate(all="warn"):
        warnings.simplefilter("always")
        result = f()
    try:
        with np.errstate(all="raise"):
            f()
        raised = None
    except FloatingPointError as exc:
        raised = str(exc)
    return result, [str(w.message) for w in seen], raised


def too_big_results():
    """Broadcast 1-column by 1-row operands whose results numpy cannot hold, numpy's error
    for each and the words distmm's has."""
    import re

    from distmm.plan import MAX_TILES

    for n, error, words in ((2**31, ValueError, "array is too big"),
                            (2 * 10**8, MemoryError, re.escape(f"at most {MAX_TILES:.3g}"))):
        x = np.broadcast_to(np.ones((1, 1)), (n, 1))
        y = np.broadcast_to(np.ones((1, 1)), (1, n))
        with pytest.raises(error):
            np.matmul(x, y)
        yield x, y, error, words
