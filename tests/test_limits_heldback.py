"""``distmm matmul`` and its staging under real process limits, beyond the cases of
tests/test_cli_errors.py, test_cli_output.py and test_io.py (file-size limit, a zarr operand
under ``ulimit -n``, SIGXCPU, OpenBLAS under ``ulimit -v``).

- A zarr output under a small open-file limit (``ulimit -n``): the folders distmm removes
  itself (the staged array of a failed run, the old array an ``--overwrite`` moved aside)
  are removed although ``shutil.rmtree`` cannot open a descriptor per level; an existing
  zarr target whose metadata cannot be opened is the limit's error, not "not a zarr array";
  a failed write names the target, not a file of the removed staged folder.
- A ``--resume`` run that meets the open-file limit where it locks the target's folder, lists
  it, or opens a stopped run's staged HDF5 file or manifest: one line naming the limit, the
  stopped run's files kept (not "another run works on it", nor a fresh start beside it;
  reading the manifest held back: ``resume.Manifest.load`` takes EMFILE for no manifest).
- A stopped ``--resume`` run whose done-logs cannot be opened (EMFILE) says its stripes are
  kept, not '0 of N'; ``read_done``/``read_sums`` raise the limit's error, not "none logged".
- ``--profile`` past the open-file limit is the run's failure (status 1), not bad input.
- ``--resume`` beside a manifest this user cannot read (EACCES) says so, not "another run".
- ``distmm cluster`` under a small ``ulimit -n``: one line before anything starts.
- Under an address-space limit (``ulimit -v``) the automatic memory budget would have to
  plan tiles that fit it (held back: ``distmm.config.memory_budget`` does not read it).

Every case runs in a child process that sets its own limit (``preexec_fn`` or
``resource.setrlimit``) on real files.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import ended, left_in_session, one_line, run_cli

zarr = pytest.importorskip("zarr")

#: Python run in a child: ``hold(free)`` opens descriptors until the open-file limit
#: (lowered to 256 first) refuses one, then closes ``free`` of them again
_HOLD = textwrap.dedent("""
    import os, resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    def hold(free):
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in held[len(held) - free:]:
            os.close(fd)
        return held[:len(held) - free]
    def let_go(held):
        for fd in held:
            os.close(fd)
""")


def _child(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", _HOLD + textwrap.dedent(body)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def _limit(which: int, n: int):
    """A ``preexec_fn`` that sets the limit ``which`` (soft and hard) to ``n``."""
    return lambda: resource.setrlimit(which, (n, n))


def _zarr(path: Path, x: np.ndarray, chunks=(7, 5)) -> None:
    zarr.open_array(str(path), mode="w", shape=x.shape, chunks=chunks, dtype=x.dtype)[...] = x


def _read(path: Path) -> np.ndarray:
    return zarr.open_array(str(path), mode="r")[...]


def test_old_zarr_array_replaced_with_one_free_descriptor_is_removed(tmp_path):
    """``put_in_place`` moves an old zarr array aside and removes it once the new one is in
    place; with one descriptor free, ``shutil.rmtree`` (a descriptor per level) failed
    silently and ``.c.zarr.distmm-old-PID`` stayed beside C for good."""
    rng = np.random.default_rng()
    old, new = rng.standard_normal((23, 17)), rng.standard_normal((19, 13))
    _zarr(tmp_path / "c.zarr", old)
    _zarr(tmp_path / ".c.zarr.distmm-partial-1", new)
    _child(tmp_path, """
        from distmm.staging import put_in_place
        held = hold(1)
        put_in_place(".c.zarr.distmm-partial-1", "c.zarr")
        let_go(held)
    """)
    assert sorted(os.listdir(tmp_path)) == ["c.zarr"]
    np.testing.assert_array_equal(_read(tmp_path / "c.zarr"), new)


def test_staged_zarr_array_of_a_failed_run_is_removed_with_one_free_descriptor(tmp_path):
    """A run that fails while this process has one descriptor free (its other chunk
    files' writes hold the rest): the staged folder ``.c.zarr.distmm-partial-PID`` was left
    (``shutil.rmtree`` with ``ignore_errors``), and an old C must stay as it was."""
    rng = np.random.default_rng()
    old = rng.standard_normal((21, 11))
    _zarr(tmp_path / "c.zarr", old)
    r = _child(tmp_path, """
        from distmm.cli.io import staged_output
        try:
            with staged_output("c.zarr", (45, 33), "f8", overwrite=True) as out:
                out[...] = 1.0
                held = hold(1)
                raise RuntimeError("stopped")
        except RuntimeError as exc:
            let_go(held)
            print(exc)
    """)
    assert r.stdout.strip() == "stopped"
    assert sorted(os.listdir(tmp_path)) == ["c.zarr"]
    np.testing.assert_array_equal(_read(tmp_path / "c.zarr"), old)


@pytest.mark.parametrize("call", ["check_target(parse_target('c.zarr'), True)",
                                  "open_operand('c.zarr')"])
@pytest.mark.slow
def test_zarr_array_metadata_past_the_open_file_limit_is_the_limits_error(tmp_path, call):
    """A v3 zarr array whose ``zarr.json`` cannot be opened (EMFILE): the target check said
    'c.zarr exists and is not a zarr array; distmm never removes it' (IsADirectoryError,
    bad input) and the operand 'is not a readable zarr array (its metadata file ... is not
    zarr metadata)'; the limit's OSError now, which the command line names."""
    _zarr(tmp_path / "c.zarr", np.random.default_rng().standard_normal((9, 8)))
    r = _child(tmp_path, f"""
        import errno
        import zarr  # (imported by the call otherwise: past the limit too)
        from distmm.cli.io import check_target, open_operand, parse_target
        held = hold(0)
        try:
            {call}
        except Exception as exc:
            let_go(held)
            print(type(exc).__name__, getattr(exc, "errno", None) == errno.EMFILE)
    """)
    assert r.stdout.strip() == "OSError True"


@pytest.mark.slow
@pytest.mark.parametrize("exists", [True, False])
def test_zarr_output_under_open_file_limits_leaves_only_c(tmp_path, exists):
    """``distmm matmul -o c.zarr`` (``--overwrite`` over an old C, or a new one) under an
    open-file limit brought down from 14 until a run fails: every run that succeeds leaves
    C alone beside the operands (an old C's copy ``.c.zarr.distmm-old-PID`` stayed at 10 to
    12), numpy's product in it; the run that fails says so in one line naming the limit
    (here 'Too many open files while writing c.zarr; the partial output was removed', not
    the staged chunk file ``.c.zarr.distmm-partial-PID/c/1/0``, which stayed too), status
    1, and leaves an old C as it was."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((1001, 301)), rng.standard_normal((301, 999))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    old = rng.standard_normal((5, 3))
    want = ["a.npy", "b.npy"]
    for limit in range(14, 6, -1):
        if exists:
            _zarr(tmp_path / "c.zarr", old)
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.zarr", "--tile", 100,
                    *(["--overwrite"] if exists else []), cwd=tmp_path, timeout=120,
                    preexec_fn=_limit(resource.RLIMIT_NOFILE, limit))
        if r.returncode != 0:
            break
        assert sorted(os.listdir(tmp_path)) == want + ["c.zarr"], (limit, r.stderr)
        np.testing.assert_allclose(_read(tmp_path / "c.zarr"), a @ b, rtol=1e-12, atol=1e-12)
        if not exists:
            shutil.rmtree(tmp_path / "c.zarr")
    assert r.returncode == 1, r.stderr
    line = one_line(r.stderr)
    assert f"(the open-file limit, ulimit -n, is {limit})" in line, line
    assert "distmm-partial" not in line and "not a zarr array" not in line, line
    assert sorted(os.listdir(tmp_path)) == want + (["c.zarr"] if exists else [])
    if exists:
        np.testing.assert_array_equal(_read(tmp_path / "c.zarr"), old)


#: a child's ``distmm matmul`` that prints its peak address space (VmPeak, bytes) as it ends
_PEAK = ("import re, sys\nfrom distmm.cli import main\nstatus = main(sys.argv[1:])\n"
         "print(int(re.search(r'VmPeak:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) << 10)\n"
         "sys.exit(status)\n")


@pytest.mark.slow
@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0",
                    reason="numpy 1.x's OpenBLAS 0.3.23 hangs under a tight RLIMIT_AS")
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_automatic_memory_budget_fits_the_address_space_limit(tmp_path):
    """Under an address-space limit (``ulimit -v``) that a run with a 16 MiB memory budget
    fits with 8 MiB to spare, the default budget ('auto') plans tiles of 2048 and fails
    ('MemoryError: Unable to allocate 31.3 MiB ...', one line, nothing left): the budget
    distmm picks itself should fit the limit it can read (``resource.getrlimit``) less what
    the process has mapped (the operands' memory maps included)."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3001, 2001)), rng.standard_normal((2001, 2999))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = ["matmul", "a.npy", "b.npy", "-o", "c.npy"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "DISTMM_MEMORY_BUDGET": "16MiB"}
    r = subprocess.run([sys.executable, "-c", _PEAK, *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    limit = int(r.stdout.split()[-1]) + (8 << 20)
    os.unlink(tmp_path / "c.npy")
    r = run_cli(*argv, cwd=tmp_path, timeout=300, env={"OPENBLAS_NUM_THREADS": "1"},
                preexec_fn=_limit(resource.RLIMIT_AS, limit))
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy"] + \
        (["c.npy"] if r.returncode == 0 else [])
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)


def test_no_staged_name_in_a_write_error(tmp_path):
    """An error of a file inside the staged output (its chunk, removed since) is reported
    as the target's: 'Too many open files while writing c.zarr; the partial output was
    removed', not the hidden name of a file that no longer exists."""
    r = _child(tmp_path, """
        import errno
        from distmm.cli.io import staged_output
        try:
            with staged_output("c.zarr", (40, 30), "f8") as out:
                raise OSError(errno.EMFILE, "Too many open files",
                              ".c.zarr.distmm-partial-%d/c/1/0" % os.getpid())
        except OSError as exc:
            print(exc.errno == errno.EMFILE, exc.filename, "|", exc)
    """)
    assert r.stdout.strip() == ("True None | [Errno 24] Too many open files while writing "
                                "c.zarr; the partial output was removed"), r.stdout
    assert os.listdir(tmp_path) == []
    assert not re.search("distmm-partial", r.stdout)


def test_stripe_writer_error_past_the_open_file_limit_names_the_target(tmp_path):
    """An MPI rank's (or Dask worker's) zarr write under ``ulimit -n`` (``mpiexec -n 2 sh -c
    'ulimit -n 24; exec distmm matmul ... -o c.zarr'``) said 'Too many open files:
    .c.zarr.distmm-partial-PID.lock', the hidden lock of a staged output removed since; it
    names the target now, its errno kept (the command line adds the limit)."""
    pid = os.getpid()
    zarr.open_array(str(tmp_path / f".c.zarr.distmm-partial-{pid}"), mode="w", shape=(30, 20),
                    chunks=(7, 7), dtype="f8")
    r = _child(tmp_path, f"""
        import errno
        import numpy as np
        from distmm.stripe_writer import StripeWriter
        w = StripeWriter("c.zarr", {pid}, (30, 20), "f8", 0)
        w.write(0, 5, 0, 20, np.ones((5, 20)))  # shares chunks: under the lock
        held = hold(0)
        try:
            w.write(5, 12, 0, 20, np.ones((7, 20)))
        except OSError as exc:
            let_go(held)
            print(exc.errno == errno.EMFILE, exc.filename, "|", exc)
    """)
    assert r.stdout.strip() == "True None | [Errno 24] Too many open files while writing c.zarr"


def _paused_matmul(folder: Path, site: Path, *args) -> subprocess.Popen:
    """``distmm matmul ARGS`` in ``folder``, returned once it waits where ``pause_at`` in
    ``site`` made it (``site/paused``)."""
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", *map(str, args)],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (site / "paused").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not pause: {proc.communicate()}")
        time.sleep(0.01)
    return proc


@pytest.mark.slow
def test_live_staged_output_survives_a_scan_past_the_open_file_limit(tmp_path):
    """A running ``distmm matmul -o c.npy`` (held before its rename) keeps
    ``.c.npy.distmm-partial-PID``; a second process that scans the folder's leftovers and then
    meets its open-file limit (``/proc/PID/cmdline`` and the manifest cannot be opened: EMFILE)
    took it for a dead run's and removed it (``remove_if_left``), and the run then failed.
    An error other than "no such process / no manifest" now counts as live."""
    from conftest import pause_at

    rng = np.random.default_rng()
    a, b = rng.standard_normal((53, 31)), rng.standard_normal((31, 47))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    site = tmp_path.parent / f"{tmp_path.name}-site"
    site.mkdir()
    pause_at(site, "distmm.staging", "put_in_place")
    proc = _paused_matmul(tmp_path, site, "a.npy", "b.npy", "-o", "c.npy", "--engine", "local")
    try:
        staged = f".c.npy.distmm-partial-{proc.pid}"
        assert staged in os.listdir(tmp_path)
        r = _child(tmp_path, """
            from pathlib import Path
            from distmm.staging import is_live, leftovers, reclaimable, remove_if_left
            found = leftovers(Path("c.npy"))
            held = hold(0)
            try:
                seen = [is_live(p) for p in found], [remove_if_left(p) for p in found]
            finally:
                let_go(held)
            print([p.name for p in found], *seen)
        """)
        assert r.stdout.split() == [f"['{staged}']", "[True]", "[False]"], r.stdout
        assert staged in os.listdir(tmp_path)
    finally:
        (site / "go").touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)


def test_claimed_manifest_past_the_open_file_limit_is_held(tmp_path):
    """A staged output whose maker is gone but whose manifest a ``--resume`` run holds (its
    ``flock``, here this process's): ``claim`` under the open-file limit (the manifest cannot
    be opened: EMFILE) returned -1, "no manifest, free to take", ``is_live`` False and
    ``remove_if_left`` removed both; held (None), live, kept now."""
    import fcntl

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    staged = tmp_path / f".c.npy.distmm-partial-{gone}"
    with open(staged, "wb") as f:  # (np.save would add .npy to the name)
        np.save(f, np.random.default_rng().standard_normal((7, 5)))
    manifest = tmp_path / f"{staged.name}.resume.json"
    manifest.write_text("{}")
    fd = os.open(manifest, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = _child(tmp_path, f"""
            from pathlib import Path
            from distmm.staging import claim, is_live, remove_if_left
            staged = Path({staged.name!r})
            held = hold(0)
            try:
                seen = claim(staged), is_live(staged), remove_if_left(staged)
            finally:
                let_go(held)
            print(*seen)
        """)
    finally:
        os.close(fd)
    assert r.stdout.split() == ["None", "True", "False"], r.stdout
    assert sorted(os.listdir(tmp_path)) == sorted([staged.name, manifest.name])


#: ``python -c _LIMITED_AT MODULE:NAME@CALL ARGV``: ``distmm ARGV`` whose open-file limit
#: (soft) is brought down, as ``MODULE.NAME`` (a function, or a class's method: ``Class.name``)
#: is called the CALL-th time, to the descriptors open then, so that the next file it opens
#: meets the limit
_LIMITED_AT = r"""
import importlib, os, resource, sys
where, argv = sys.argv[1], sys.argv[2:]
module, name = where.split(":")
name, call = name.split("@")
owner = importlib.import_module(module)
*path, name = name.split(".")
for part in path:
    owner = getattr(owner, part)
real, calls = getattr(owner, name), []
def limited(*args, **kwargs):
    calls.append(1)
    if len(calls) == int(call):
        fd = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (fd, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return real(*args, **kwargs)
setattr(owner, name, staticmethod(limited) if isinstance(owner, type) else limited)
from distmm.cli import main
sys.exit(main(argv))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("where, output", [
    ("distmm.engine.mpi.batch:claim@1", "c.npy"),
    ("distmm.engine.mpi.batch:preparing@1", "c.npy"),
    ("distmm.engine.mpi.batch:leftovers@1", "c.npy"),
    ("distmm.staging:_h5_holds@2", "c.h5:C"),  # (the first: the space check's)
    ("distmm.engine.mpi.resume:Manifest.load@1", "c.npy")])
@pytest.mark.slow
def test_resume_past_the_open_file_limit_says_so_and_keeps_the_stopped_run(tmp_path, mpi_env,
                                                                           where, output):
    """``distmm matmul ... --resume`` beside a stopped run's staged output and manifest, whose
    open-file limit is met (EMFILE) where it locks the folder (``preparing``), lists it
    (``leftovers``), opens a staged HDF5 file (``_h5_holds``), claims the manifest (``claim``)
    or reads it (``Manifest.load``): it said 'another run works on .c.npy.distmm-partial-PID'
    (status 2: nobody did), or went on without the folder's lock or without the stopped run
    and failed naming its own new hidden staged file, or took the manifest for none and
    removed the stopped run's C; one line now, naming too many open files and the limit
    (status 1), everything beside C kept."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((31, 17)))
    np.save(tmp_path / "b.npy", rng.standard_normal((17, 23)))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = output.split(":")[0]
    staged = tmp_path / f".{name}.distmm-partial-{gone}"
    if name.endswith(".h5"):
        h5py = pytest.importorskip("h5py")
        with h5py.File(staged, "w") as fh:
            fh["C"] = rng.standard_normal((31, 23))
    else:
        with open(staged, "wb") as fh:  # (np.save would add .npy to the name)
            np.save(fh, rng.standard_normal((31, 23)))
    (tmp_path / f"{staged.name}.resume.json").write_text("{}")
    names = sorted(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-c", _LIMITED_AT, where, "matmul", "a.npy", "b.npy",
                        "-o", output, "--resume"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**mpi_env, "OMPI_MCA_btl": "^ofi"})
    line = one_line(r.stderr).rstrip("\n")
    assert re.fullmatch(rf"distmm matmul: error: cannot resume {re.escape(output)}.*: .*"
                        r"too many open files.*"
                        r" \(the open-file limit, ulimit -n, is \d+\)", line, re.I), line
    assert "another run works on" not in line, line
    assert r.returncode == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == names


def test_preparing_past_the_open_file_limit_fails_in_one_line(tmp_path):
    """``preparing`` (a ``--resume`` run's lock on the target's folder) where the folder
    cannot be opened for the open-file limit (EMFILE) held nothing and went on, so two such
    runs could race; an ``OSError`` naming too many open files now, before anything runs."""
    r = _child(tmp_path, """
        import errno
        from pathlib import Path
        from distmm.staging import preparing
        held = hold(0)
        try:
            with preparing(Path("c.npy")):
                line = "entered"
        except OSError as exc:
            line = f"{type(exc).__name__} {exc.errno == errno.EMFILE} {exc}"
        let_go(held)
        print(line)
    """)
    assert r.stdout.strip() == (
        f"OSError True [Errno 24] cannot resume c.npy: too many open files, so its folder "
        f"{tmp_path} cannot be opened to hold off other --resume runs while this one prepares")


@pytest.fixture
def scheduler_address():
    """The TCP address of a real Dask scheduler (one worker thread, in this process)."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  protocol="tcp", dashboard_address=":0") as cluster:
        yield cluster.scheduler_address


def test_connecting_past_the_open_file_limit_fails_at_once(tmp_path, scheduler_address):
    """``connect_client`` in a process with fewer descriptors free than connecting holds:
    distributed's connect retried EMFILE until the timeout, then 'cannot connect ... (too
    many open files); check the address and port' (or, with 4 free, 'the client could not
    register within 20 s ()'); at once now, naming the limit and its value."""
    r = _child(tmp_path, f"""
        import time
        import distributed, distributed.security  # (imported by the call otherwise)
        from distmm.cli.connect import connect_client
        for free in range(5):  # 4: the probe connects, the client does not
            held = hold(free)
            t0 = time.monotonic()
            try:
                connect_client(scheduler={scheduler_address!r}, timeout=20).close()
                line = "connected"
            except Exception as exc:
                line = f"{{type(exc).__name__}}: {{exc}}"
            seconds = time.monotonic() - t0
            let_go(held)
            print(free, seconds < 5, line)
    """)
    lines = r.stdout.splitlines()
    assert len(lines) >= 5, r.stdout
    for line in lines:
        assert " True ConnectionError: cannot connect to " in line, line
        assert "open-file limit (ulimit -n is 256)" in line and "check the address" not in line


@pytest.mark.slow
def test_command_connecting_past_the_open_file_limit_says_so_at_once(tmp_path,
                                                                     scheduler_address):
    """``distmm matmul --scheduler ADDRESS`` under ``ulimit -n`` brought down until it fails
    before its output: a run whose connection meets the limit waited the whole
    ``--connect-timeout`` and said to check the address and port; at once now, status 1, one
    line naming ``ulimit -n`` and its value."""
    import time

    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((7, 5)))
    np.save(tmp_path / "b.npy", rng.standard_normal((5, 3)))
    said = []
    for limit in range(12, 5, -1):
        t0 = time.monotonic()
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.npy", "--overwrite", "--scheduler",
                    scheduler_address, "--connect-timeout", 20, cwd=tmp_path, timeout=120,
                    preexec_fn=_limit(resource.RLIMIT_NOFILE, limit))
        seconds = time.monotonic() - t0
        line = r.stderr.splitlines()[-1] if r.stderr else ""
        assert "check the address" not in line and seconds < 10, (limit, seconds, r.stderr)
        if "cannot connect" in line:
            assert r.returncode == 1, r.stderr
            assert f"(ulimit -n is {limit})" in one_line(r.stderr), r.stderr
            said.append(limit)
    assert said, "no run met the limit while connecting"


def test_done_and_checksum_logs_past_the_open_file_limit_are_not_taken_for_none(tmp_path):
    """A rank's log of finished stripes and of their checksums that cannot be opened for the
    open-file limit (EMFILE): ``read_done`` gave an empty set ('0 of N C stripes kept', a
    resumed run computing them all again) and ``read_sums`` no checksums (each kept stripe
    'has no checksum logged'); the limit's OSError now, a missing log still none."""
    staged = tmp_path / ".c.npy.distmm-partial-1"
    staged.write_bytes(b"")
    (tmp_path / f"{staged.name}.done-0").write_text("0\n2\n")
    (tmp_path / f"{staged.name}.sums-0").write_text("0 0000abcd\n2 00001234\n")
    r = _child(tmp_path, f"""
        import errno
        from pathlib import Path
        from distmm.engine.mpi import resume as rs
        staged = Path({staged.name!r})
        seen = [sorted(rs.read_done(staged, 0)), rs.read_sums(staged, 0),
                rs.read_done(staged, 1), rs.read_sums(staged, 1)]
        held = hold(0)
        for read in (rs.read_done, rs.read_sums):
            try:
                seen.append(read(staged, 0))
            except OSError as exc:
                seen.append(exc.errno == errno.EMFILE)
        let_go(held)
        print(*seen, sep=" | ")
    """)
    assert r.stdout.strip() == (f"[0, 2] | {{0: {0xabcd}, 2: {0x1234}}} | set() | {{}} | "
                                f"True | True"), r.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_stopped_run_past_the_open_file_limit_does_not_say_no_stripe_was_kept(tmp_path,
                                                                               mpi_env):
    """A ``--resume`` run stopped (SIGTERM) once it logged two stripes, whose done-logs cannot
    be opened for the open-file limit as it says what it kept: '0 of 8 C stripes kept in
    .c.npy.distmm-partial-PID'; now it says the stripes are kept and why it cannot count
    them, and a rerun with ``--resume`` finishes C from them."""
    from conftest import stop_after_logged

    rng = np.random.default_rng()
    a, b = rng.standard_normal((301, 67)), rng.standard_normal((67, 53))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    line = ["matmul", "a.npy", "b.npy", "-o", "c.npy", "--resume", "--backend", "numba"]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "8"}
    err = stop_after_logged([sys.executable, "-c", _LIMITED_AT,
                             "distmm.engine.mpi.resume:read_done@1", *line], tmp_path, env, 2)
    line_ = one_line(err).rstrip("\n")
    assert re.search(r"; C stripes kept in \.c\.npy\.distmm-partial-\d+ \(how many cannot be "
                     r"told: too many open files, so their logs cannot be read\): run the "
                     r"same command with --resume to finish", line_), line_
    assert " 0 of " not in line_, line_
    r = subprocess.run([sys.executable, "-m", "distmm", *line], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)


def test_profile_file_past_the_open_file_limit_is_the_runs_failure(tmp_path, mpi_env):
    """``distmm matmul ... --profile p.json`` whose report file cannot be created for the
    open-file limit (EMFILE, met as ``check_report`` tries it): 'cannot create the --profile
    file (Too many open files): p.json', status 2 (a PermissionError: bad input); the run's
    failure now (the line as before), status 1, the limit named, nothing written."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((13, 7)))
    np.save(tmp_path / "b.npy", rng.standard_normal((7, 11)))
    r = subprocess.run([sys.executable, "-c", _LIMITED_AT, "distmm.cli.io:check_report@1",
                        "matmul", "a.npy", "b.npy", "-o", "c.npy", "--profile", "p.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**mpi_env, "OMPI_MCA_btl": "^ofi"})
    line = one_line(r.stderr).rstrip("\n")
    assert re.fullmatch(r"distmm matmul: error: cannot create the --profile file \(Too many "
                        r"open files\): p\.json \(the open-file limit, ulimit -n, is \d+\)",
                        line), line
    assert r.returncode == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy"]


def _no_permission_override():
    """A ``preexec_fn`` that drops the capabilities by which root ignores permission bits
    (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``: ``prctl(PR_CAPBSET_DROP)``, in force
    from the ``exec``), so that a file of mode 0 cannot be read by anyone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.mpi
def test_resume_beside_a_manifest_it_cannot_read_says_so(tmp_path, mpi_env):
    """``--resume`` beside a stopped run's staged output whose manifest this user cannot read
    (mode 0: EACCES; as root, run without the capabilities that ignore it): 'another run
    works on .c.npy.distmm-partial-PID' although no run did; now that the manifest cannot be
    read (permission), one line, status 2 (an input that cannot be read), its files kept."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((31, 17)))
    np.save(tmp_path / "b.npy", rng.standard_normal((17, 23)))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    staged = tmp_path / f".c.npy.distmm-partial-{gone}"
    with open(staged, "wb") as fh:  # (np.save would add .npy to the name)
        np.save(fh, rng.standard_normal((31, 23)))
    manifest = tmp_path / f"{staged.name}.resume.json"
    manifest.write_text("{}")
    manifest.chmod(0)
    names = sorted(os.listdir(tmp_path))
    try:
        r = subprocess.run([sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o",
                            "c.npy", "--resume"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**mpi_env, "OMPI_MCA_btl": "^ofi"},
                           preexec_fn=_no_permission_override if os.geteuid() == 0 else None)
    except subprocess.SubprocessError as exc:  # (a container that may not drop them)
        pytest.skip(f"root's permission override cannot be dropped: {exc}")
    line = one_line(r.stderr).rstrip("\n")
    assert line == (f"distmm matmul: error: cannot resume c.npy: the manifest of {staged.name} "
                    f"cannot be read (permission denied), so whether a run holds it cannot be "
                    f"seen"), line
    assert r.returncode == 2, r.stderr
    assert sorted(os.listdir(tmp_path)) == names


def _cluster_under(limit: int, *args) -> subprocess.Popen:
    """``distmm cluster ARGS`` (any free port, no dashboard) under ``ulimit -n LIMIT`` set by
    its shell, in a session of its own."""
    import shlex

    line = shlex.join([sys.executable, "-m", "distmm", "cluster", "--port", "0", *args])
    return subprocess.Popen(["bash", "-c", f"ulimit -n {limit}; exec {line}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)





@pytest.mark.parametrize("limit", [14, 24, 32])
@pytest.mark.slow
def test_cluster_under_a_small_open_file_limit_says_so_before_it_starts(limit):
    """``distmm cluster --workers 2`` under ``ulimit -n`` 24 or 32 (below the 40 or so that
    starting two workers holds at once): a traceback per nanny ('OSError: [Errno 24] Too
    many open files' in its pipes) and 'RuntimeError: Nanny failed to start.'; under 14 a
    start that never ended. One line now, before anything starts, naming the limit, status
    1, no process left."""
    proc = _cluster_under(limit, "--workers", "2")
    out, err = ended(proc, 30)
    line = one_line(err).rstrip("\n")
    assert re.fullmatch(r"distmm cluster: error: cannot start 2 workers: the start holds about "
                        r"\d+ files open at once .*; raise the limit \(ulimit -n\) or start "
                        rf"fewer workers \(--workers\) \(the open-file limit, ulimit -n, is "
                        rf"{limit}\)", line), line
    assert proc.returncode == 1 and out == "", (proc.returncode, out)
    assert left_in_session(proc.pid) == []


@pytest.mark.slow
def test_cluster_under_an_open_file_limit_that_fits_starts():
    """The check before the start refuses no limit at which the workers start: two workers
    under ``ulimit -n 64`` serve, and SIGINT closes them in one line (status 130)."""
    import signal
    import time

    proc = _cluster_under(64, "--workers", "2")
    deadline = time.monotonic() + 120
    try:
        first = proc.stdout.readline()
        assert first.startswith("distmm cluster: 2 CPU workers"), (first, proc.poll())
        while not proc.stdout.readline().startswith("  use it with"):
            assert time.monotonic() < deadline
        os.killpg(proc.pid, signal.SIGINT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out, err = ended(proc, 60)
    assert proc.returncode == 130, err
    assert one_line(err).startswith("distmm cluster: stopped by SIGINT: 2 workers and the "
                                    "scheduler closed"), err
    assert left_in_session(proc.pid) == []
