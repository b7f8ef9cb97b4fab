"""The command line's output touches nothing but its target: real files, a
real file-size limit, real signals. Each test is one case of issue 10."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from conftest import one_line, pause_at, read_only_mount, run_cli




@pytest.mark.slow
def test_h5_output_keeps_the_other_datasets(tmp_path, npy_operands):
    pa, pb, ref = npy_operands
    f = tmp_path / "results.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(7.0)
        fh["grp/Y"] = np.ones((3, 3), dtype=np.int32)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["C", "X", "grp"]
        np.testing.assert_array_equal(fh["X"][...], np.arange(7.0))
        np.testing.assert_array_equal(fh["grp/Y"][...], np.ones((3, 3)))
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    # an existing dataset: refused without --overwrite, replaced with it, X still there
    r = run_cli("matmul", pa, pb, "-o", f"{f}:X", "--engine", "local")
    assert r.returncode == 2 and f"{f}:X exists: pass --overwrite" in one_line(r.stderr)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:X", "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["C", "X", "grp"]
        np.testing.assert_allclose(fh["X"][...], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_h5_operands_and_output_in_one_file(tmp_path):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((21, 33)), rng.standard_normal((33, 8))
    f = tmp_path / "all.h5"
    with h5py.File(f, "w") as fh:
        fh["A"], fh["B"] = a, b
    r = run_cli("matmul", f"{f}:A", f"{f}:B", "-o", f"{f}:C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["A", "B", "C"]
        np.testing.assert_allclose(fh["C"][...], a @ b, rtol=1e-12, atol=1e-12)


def _paused_matmul(site: Path, *args) -> subprocess.Popen:
    """``python -m distmm matmul ARGS`` with ``site``'s ``sitecustomize`` (``pause_at``) first
    on its path, returned once it waits at the paused function."""
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(site), os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 60
    while not (site / "paused").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc


def _shared_h5(folder: Path, a, b) -> Path:
    """An HDF5 file in HDF5's newest format (superblock 3, which marks a file open for
    writing) holding A, B and a dataset X of the user's."""
    f = folder / "all.h5"
    with h5py.File(f, "w", libver="latest") as fh:
        fh["A"], fh["B"], fh["X"] = a, b, np.arange(7.0)
    return f


def test_runs_into_an_operand_s_h5_file_leave_it_as_it_was_when_refused_or_stopped(tmp_path):
    """``distmm matmul f.h5:A f.h5:B -o f.h5:C`` opened f.h5 for writing from the start: a
    refused run changed its modification time, and one that SIGTERM stopped mid-product left
    it marked open for writing, which h5py refused to open ('file is already open for write
    ... h5clear')."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((60, 40)), rng.standard_normal((40, 30))
    f = _shared_h5(tmp_path, a, b)
    before = f.stat().st_mtime_ns, sha256(f)
    time.sleep(0.01)
    r = run_cli("matmul", f"{f}:A", f"{f}:B", "-o", f"{f}:X")  # exists: no --overwrite
    assert r.returncode == 2 and f"{f}:X exists" in one_line(r.stderr)
    assert (f.stat().st_mtime_ns, sha256(f)) == before
    site = tmp_path / "site"
    site.mkdir()
    pause_at(site, "distmm.api", "matmul")
    proc = _paused_matmul(site, f"{f}:A", f"{f}:B", "-o", f"{f}:C", "--engine", "local")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "SIGTERM" in one_line(err)
    assert sha256(f) == before[1]
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["A", "B", "X"]
        np.testing.assert_array_equal(fh["A"][...], a)
    assert partials(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("a_spec, b_spec, out", [
    ("a.npy", "b.npy", "a.npy"), ("a.npy", "b.npy", "s.npy"), ("a.npy", "b.npy", "h.npy"),
    ("a.zarr", "b.zarr", "a.zarr"), ("all.h5:A", "all.h5:B", "all.h5:A")])
def test_output_replacing_its_own_operand_gives_numpy_s_bits(tmp_path, mpirun, ranks, a_spec,
                                                            b_spec, out):
    """C written over an operand (the same .npy, a symbolic or a hard link to it, the same
    zarr array, an HDF5 dataset of the file read), in several stripes: numpy's product of the
    inputs as they were (small integers: every summation order gives the same bits)."""
    rng = np.random.default_rng()
    a = rng.integers(-8, 8, (300, 257)).astype(np.float64)
    b = rng.integers(-8, 8, (257, 300)).astype(np.float64)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    os.symlink("a.npy", tmp_path / "s.npy")
    os.link(tmp_path / "a.npy", tmp_path / "h.npy")
    for name, x in (("a.zarr", a), ("b.zarr", b)):
        zarr.open_array(str(tmp_path / name), mode="w", shape=x.shape, dtype=x.dtype,
                        chunks=(64, 64))[...] = x
    f = _shared_h5(tmp_path, a, b)
    argv = ["-m", "distmm", "matmul", a_spec, b_spec, "-o", out, "--overwrite"]
    # several stripes: the local engine's tiles by its budget, the batch path's by its count
    # (a CPU rank keeps to a budget given as a size: 256 KiB holds no B panel of 2 ranks)
    r = run_cli(*argv[2:], env={"DISTMM_MEMORY_BUDGET": "256KiB"}, cwd=tmp_path) \
        if ranks == 1 else mpirun(2, *argv, env={"DISTMM_BATCH_STRIPES": "5"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    if out.endswith(".zarr"):
        got = zarr.open_array(str(tmp_path / out), mode="r")[...]
    elif ":" in out:
        with h5py.File(f, "r") as fh:
            got = fh["A"][...]
            np.testing.assert_array_equal(fh["B"][...], b)
            np.testing.assert_array_equal(fh["X"][...], np.arange(7.0))
    else:
        got = np.load(tmp_path / out)
        assert not (tmp_path / out).is_symlink()  # replaced, not followed
        if out != "a.npy":
            np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), a)
    np.testing.assert_array_equal(got, a @ b)
    assert partials(tmp_path) == []


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=[pytest.mark.mpi, pytest.mark.slow])])
@pytest.mark.parametrize("locking", ["TRUE", "FALSE"])
def test_h5_output_into_a_hard_link_of_an_operand_s_file(tmp_path, request, ranks, locking):
    """C added to an HDF5 file under a second name (a hard link) of the file its operands are
    read from: the process's own read-only handles, found by path only, were taken for
    another process's lock ("the file is open in another process", status 2), and without
    HDF5's locking C was computed and its copy refused at the end ("file is already open for
    read-only", status 1). One file by its inode: C is added, the operands kept."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((19, 11)), rng.standard_normal((11, 7))
    with h5py.File(tmp_path / "in.h5", "w") as fh:
        fh["A"], fh["B"] = a, b
    os.link(tmp_path / "in.h5", tmp_path / "twin.h5")
    argv = ["-m", "distmm", "matmul", "in.h5:A", "in.h5:B", "-o", "twin.h5:C"]
    env = {"HDF5_USE_FILE_LOCKING": locking}
    r = run_cli(*argv[2:], env=env, cwd=tmp_path) if ranks == 1 else \
        request.getfixturevalue("mpirun")(2, *argv, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "in.h5", "r") as fh:
        assert sorted(fh) == ["A", "B", "C"]
        np.testing.assert_array_equal(fh["A"][...], a)
        np.testing.assert_array_equal(fh["B"][...], b)
        np.testing.assert_allclose(fh["C"][...], a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5", "twin.h5"]


@pytest.mark.slow
def test_zarr_group_is_never_replaced(tmp_path, npy_operands):
    pa, pb, ref = npy_operands
    g = zarr.open_group(str(tmp_path / "proj.zarr"), mode="w")
    g.create_array("keep", shape=(4,), dtype="f8")[...] = 5.0
    for extra in ((), ("--overwrite",)):
        r = run_cli("matmul", pa, pb, "-o", tmp_path / "proj.zarr", "--engine", "local", *extra)
        assert r.returncode == 2
        assert "zarr group" in one_line(r.stderr) and "proj.zarr" in r.stderr
    r = run_cli("matmul", pa, pb, "-o", tmp_path / "proj.zarr" / "C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    g = zarr.open_group(str(tmp_path / "proj.zarr"), mode="r")
    assert sorted(g.keys()) == ["C", "keep"]
    np.testing.assert_array_equal(g["keep"][...], np.full(4, 5.0))
    np.testing.assert_allclose(g["C"][...], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_zarr_array_replaced_only_with_overwrite(tmp_path, npy_operands):
    pa, pb, ref = npy_operands
    z = zarr.open_array(str(tmp_path / "c.zarr"), mode="w", shape=(2, 2), dtype="f8")
    z[...] = 1.0
    r = run_cli("matmul", pa, pb, "-o", tmp_path / "c.zarr", "--engine", "local")
    assert r.returncode == 2 and "--overwrite" in one_line(r.stderr)
    assert zarr.open_array(str(tmp_path / "c.zarr"), mode="r").shape == (2, 2)
    r = run_cli("matmul", pa, pb, "-o", tmp_path / "c.zarr", "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[...], ref,
                               rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.zarr"]


@pytest.mark.slow
def test_directory_named_like_the_output_survives(tmp_path, npy_operands):
    pa, pb, _ = npy_operands
    d = tmp_path / "out.npy"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        r = run_cli("matmul", pa, pb, "-o", d, "--engine", "local", *extra)
        assert r.returncode == 2
        assert "is a directory" in one_line(r.stderr) and "out.npy" in r.stderr
    assert (d / "precious.txt").read_text() == "keep me"


def test_existing_output_refused_then_replaced(tmp_path, npy_operands):
    pa, pb, ref = npy_operands
    c = tmp_path / "c.npy"
    np.save(c, np.zeros(3))
    r = run_cli("matmul", pa, pb, "-o", c, "--engine", "local")
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert str(c) in line and "--overwrite" in line
    np.testing.assert_array_equal(np.load(c), np.zeros(3))
    r = run_cli("matmul", pa, pb, "-o", c, "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(c), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
def test_symbolic_links_at_the_target_are_replaced_not_followed(tmp_path, npy_operands):
    """A link to nothing is an existing target (it was replaced without --overwrite: the
    check followed it); --overwrite replaces a .npy link, to nothing or to a file, and
    leaves the file it pointed at as it was (zarr and HDF5 links: tests/test_cli_links.py)."""
    pa, pb, ref = npy_operands
    real = tmp_path / "real.npy"
    np.save(real, np.zeros(3))
    (tmp_path / "dangling.npy").symlink_to("nowhere.npy")
    (tmp_path / "to_real.npy").symlink_to("real.npy")
    for name in ("dangling.npy", "to_real.npy"):
        r = run_cli("matmul", pa, pb, "-o", tmp_path / name, "--engine", "local")
        assert r.returncode == 2 and "--overwrite" in one_line(r.stderr), r.stderr
        assert (tmp_path / name).is_symlink()
        r = run_cli("matmul", pa, pb, "-o", tmp_path / name, "--engine", "local", "--overwrite")
        assert r.returncode == 0, r.stderr
        assert not (tmp_path / name).is_symlink()
        np.testing.assert_allclose(np.load(tmp_path / name), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.load(real), np.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.npy", "b.npy", "dangling.npy", "real.npy", "to_real.npy"]


@pytest.mark.parametrize("kind", ["npy", "zarr", "h5"])
@pytest.mark.slow
def test_replaced_output_keeps_its_permissions(tmp_path, npy_operands, kind):
    """--overwrite renames a new file onto the old one; the old one's permission bits pass to
    it (they were the umask's before), as writing into it would have kept them. A new output
    keeps the umask's."""
    pa, pb, ref = npy_operands
    c = tmp_path / f"c.{kind}"
    if kind == "npy":
        np.save(c, np.zeros(3))
    elif kind == "zarr":
        zarr.open_array(str(c), mode="w", shape=(2, 2), dtype="f8")[...] = 1.0
    else:
        with h5py.File(c, "w") as fh:
            fh["data"] = np.zeros(3)
    mode = 0o750 if kind == "zarr" else 0o604
    c.chmod(mode)
    r = run_cli("matmul", pa, pb, "-o", c, "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert oct(c.stat().st_mode & 0o7777) == oct(mode)
    got = (np.load(c) if kind == "npy" else zarr.open_array(str(c), mode="r")[...]
           if kind == "zarr" else h5py.File(c, "r")["data"][...])
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", c.name]
    new = tmp_path / f"new.{kind}"
    r = run_cli("matmul", pa, pb, "-o", new, "--engine", "local")
    assert r.returncode == 0, r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert new.stat().st_mode & 0o7777 == (0o777 if kind == "zarr" else 0o666) & ~umask


def _limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.mark.parametrize("name", ["c.npy", "c.h5:C", "c.zarr"])
@pytest.mark.slow
def test_file_size_limit_is_a_clean_failure(tmp_path, name):
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((400, 300)))
    np.save(tmp_path / "b.npy", rng.standard_normal((300, 500)))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / name,
                "--engine", "local", "--tile", 100, preexec_fn=_limit(200_000))
    assert r.returncode == 1, r.stderr
    line = one_line(r.stderr)
    assert name in line and ("file-size limit" in line or "File too large" in line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.slow
def test_file_size_limit_on_a_zarr_output_leaves_no_chunk_behind(tmp_path):
    """A chunk write past the file-size limit ended zarr's assignment while its other chunks'
    writes went on in zarr's event loop: one finishing after the staged folder's removal made
    it again (``.c.zarr.distmm-partial-PID/c/0/1.HEX.partial``), in about a third of the runs.
    The failed run now waits for them first."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((600, 300)))
    np.save(tmp_path / "b.npy", rng.standard_normal((300, 600)))
    for _ in range(4):
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.zarr", cwd=tmp_path,
                    preexec_fn=_limit(200_000))
        assert r.returncode == 1 and "c.zarr" in one_line(r.stderr), r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


def test_file_size_limit_keeps_an_existing_h5_file(tmp_path, npy_operands):
    pa, pb, _ = npy_operands
    f = tmp_path / "keep.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(100_000.0)
    before = sha256(f)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local",
                preexec_fn=_limit(f.stat().st_size + 1000))
    assert r.returncode == 1 and "file-size limit" in one_line(r.stderr)
    assert sha256(f) == before
    assert partials(tmp_path) == []


def _staged(folder: Path):
    return [p for p in folder.iterdir() if "distmm-partial" in p.name or "partial" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_mid_run_leaves_nothing(tmp_path, signum, status):
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((3000, 2000)))
    np.save(tmp_path / "b.npy", rng.standard_normal((2000, 3000)))
    np.save(tmp_path / "c.npy", np.arange(5.0))  # an older result, replaced only on success
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                             tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--overwrite",
                             "--engine", "local", "--tile", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _staged(tmp_path):  # the staged output exists: tiles are being computed
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    staged = _staged(tmp_path)
    assert [p.name for p in staged] == [f".c.npy.distmm-partial-{proc.pid}"]
    time.sleep(0.5)
    assert proc.poll() is None, "the product finished before the signal: make it bigger"
    os.kill(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert signal.Signals(signum).name in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), np.arange(5.0))


@pytest.mark.slow
def test_sigterm_is_acted_on_within_2_s_while_numba_compiles_and_runs(tmp_path):
    """The numba backend's first tiles compile and then run for seconds on a pool thread;
    the signal ends the process within 2 s anyway (running tiles are not waited for)."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((2500, 2500)))
    np.save(tmp_path / "b.npy", rng.standard_normal((2500, 2500)))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))  # compiles afresh
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                             tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--backend", "numba",
                             "--engine", "local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not _staged(tmp_path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert proc.poll() is None, "the product finished before the signal: make it bigger"
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 2.0
    assert proc.returncode == 143, err
    assert one_line(err).strip() == "distmm matmul: error: terminated by SIGTERM"
    assert not _staged(tmp_path) and not (tmp_path / "c.npy").exists()


@pytest.mark.slow
def test_kill_9_leftovers_of_one_process_are_named_and_removed(tmp_path):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((2500, 2500)), rng.standard_normal((2500, 2500))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    cmd = [sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy",
           "-o", tmp_path / "c.npy", "--backend", "numba", "--engine", "local"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not _staged(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    left = _staged(tmp_path)
    assert left, "the staged output went with the killed process"
    r = subprocess.run(cmd[:-4] + ["--backend", "blas"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"distmm matmul: removed {left[0].name}" in r.stderr
    assert not _staged(tmp_path)
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-10, atol=1e-10)


def test_no_space_is_checked_before_computing(tmp_path, npy_operands):
    """A result larger than the file system's free space fails before any
    tile: made with a huge shape from two small broadcast-free operands."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    m = int(free // 8 // 4) + 1  # C = (m, 4) float64 is larger than the free space
    a = np.lib.format.open_memmap(tmp_path / "tall.npy", mode="w+", dtype="f8", shape=(m, 1))
    del a  # sparse: takes no space
    np.save(tmp_path / "row.npy", np.ones((1, 4)))
    t0 = time.monotonic()
    r = run_cli("matmul", tmp_path / "tall.npy", tmp_path / "row.npy", "-o", tmp_path / "c.npy",
                "--engine", "local")
    assert r.returncode == 1
    assert "MiB free" in one_line(r.stderr) and "c.npy" in r.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "c.npy").exists() and not _staged(tmp_path)


# ---------------------------------------------------------------- HDF5: the user's file is never damaged


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def h5_storage(path: Path) -> dict:
    """Every dataset of an HDF5 file: dtype, shape, attributes, the byte offset
    of its data in the file and those raw bytes as stored."""
    out = {}
    raw = path.read_bytes()

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            offset, size = obj.id.get_offset(), obj.id.get_storage_size()
            out[name] = (str(obj.dtype), obj.shape, dict(obj.attrs), offset,
                         raw[offset:offset + size], obj[...].tobytes())

    with h5py.File(path, "r") as fh:
        fh.visititems(visit)
    return out


@pytest.fixture
def user_h5(tmp_path):
    """An existing HDF5 file with datasets X and grp/Y (fresh random data, two
    dtypes, an attribute): the file distmm must not damage."""
    rng = np.random.default_rng()
    f = tmp_path / "user.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = rng.standard_normal((40, 30))
        fh["grp/Y"] = rng.integers(-1000, 1000, (17, 5), dtype=np.int32)
        fh["X"].attrs["units"] = "m"
    return f


def partials(folder: Path):
    return sorted(p.name for p in folder.iterdir() if "partial" in p.name)


@pytest.mark.slow
def test_an_h5_file_made_while_the_run_computes_is_added_to_not_replaced(tmp_path, npy_operands):
    """``-o new.h5:C`` where new.h5 did not exist when the run began, and another process
    made it (dataset D) before C was moved into place: C is added beside D, as into a file
    that was there (the staged file was renamed over it, and D was lost)."""
    pa, pb, ref = npy_operands
    site = tmp_path / "site"
    site.mkdir()
    pause_at(site, "distmm.staging", "commit_h5")
    f = tmp_path / "new.h5"
    proc = _paused_matmul(site, pa, pb, "-o", f"{f}:C", "--engine", "local")
    other = np.random.default_rng().standard_normal((7, 3))
    with h5py.File(f, "w") as fh:
        fh["D"] = other
    (site / "go").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["C", "D"]
        np.testing.assert_array_equal(fh["D"][...], other)
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    assert partials(tmp_path) == []


@pytest.mark.slow
def test_h5_add_and_overwrite_touch_only_c(tmp_path, npy_operands, user_h5):
    pa, pb, ref = npy_operands
    before = h5_storage(user_h5)
    r = run_cli("matmul", pa, pb, "-o", f"{user_h5}:C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    after = h5_storage(user_h5)
    assert sorted(after) == ["C", "X", "grp/Y"]
    assert {k: after[k] for k in before} == before  # X and Y bitwise, in place
    with h5py.File(user_h5, "r") as fh:
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    # --overwrite replaces C (a new product, of another shape) and nothing else
    rng = np.random.default_rng()
    b2 = rng.standard_normal((50, 11))
    np.save(tmp_path / "b2.npy", b2)
    r = run_cli("matmul", pa, tmp_path / "b2.npy", "-o", f"{user_h5}:C", "--engine", "local",
                "--overwrite")
    assert r.returncode == 0, r.stderr
    again = h5_storage(user_h5)
    assert sorted(again) == ["C", "X", "grp/Y"] and {k: again[k] for k in before} == before
    with h5py.File(user_h5, "r") as fh:
        np.testing.assert_allclose(fh["C"][...], np.load(pa) @ b2, rtol=1e-12, atol=1e-12)
    assert partials(tmp_path) == []


def test_h5_new_file_is_the_staged_file_renamed(tmp_path, npy_operands):
    pa, pb, ref = npy_operands
    r = run_cli("matmul", pa, pb, "-o", f"{tmp_path}/new.h5:grp/C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "new.h5", "r") as fh:
        names = []
        fh.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert names == ["grp/C"]
        np.testing.assert_allclose(fh["grp/C"][...], ref, rtol=1e-12, atol=1e-12)
    assert partials(tmp_path) == []


def _start_and_stop_mid_run(tmp_path, target):
    """Start a product into ``target`` (an HDF5 file) and stop it (SIGSTOP) once
    its staged file is complete and tiles are being computed."""
    # k of 12000 (sparse files of zeros, made at once: their values are not checked): the
    # tiles outlast the poll below on a fast machine (800 x 3000 x 800 ran 0.2 s after the
    # staged file was complete here, in a fraction of that on a CI machine with faster BLAS)
    for name, shape in (("a.npy", (800, 12000)), ("b.npy", (12000, 800))):
        np.lib.format.open_memmap(tmp_path / name, mode="w+", dtype="f8", shape=shape)
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                             tmp_path / "b.npy", "-o", f"{target}:C", "--engine", "local",
                             "--tile", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staged = tmp_path / f".{target.name}.distmm-partial-{proc.pid}"
    deadline = time.monotonic() + 60
    while not (staged.exists() and staged.stat().st_size >= 800 * 800 * 8):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGSTOP)
    assert partials(tmp_path) == [staged.name]  # the only file distmm made
    return proc


def test_sigterm_mid_run_leaves_the_h5_file_as_it_was(tmp_path, user_h5):
    before = sha256(user_h5)
    proc = _start_and_stop_mid_run(tmp_path, user_h5)
    assert sha256(user_h5) == before  # tiles go to the staged file only
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "SIGTERM" in one_line(err)
    assert sha256(user_h5) == before
    assert partials(tmp_path) == []


def test_file_size_limit_mid_run_leaves_the_h5_file_as_it_was(tmp_path, user_h5):
    """A real limit, lowered on the running process (prlimit) after the free-space
    check passed: the tile writes into the staged file fail (EFBIG)."""
    before = sha256(user_h5)
    proc = _start_and_stop_mid_run(tmp_path, user_h5)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (65536, 65536))
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    line = one_line(err)
    assert "File too large" in line and f"{user_h5}:C" in line
    assert sha256(user_h5) == before
    assert partials(tmp_path) == []


@pytest.mark.parametrize("name", ["c.npy", "c.h5:C", "c.zarr"])
@pytest.mark.slow
def test_empty_results_of_stacks_and_vectors_are_written_as_numpy(tmp_path, name):
    """Empty results numpy computes (a stack with an empty core dimension, an empty
    matrix @ vector) are written in every format (.npy and HDF5 refused them with an
    internal memoryview error and exit 2)."""
    cases = [(np.ones((3, 4)), np.ones((2, 4, 0))), (np.ones((0, 2)), np.ones(2)),
             (np.ones((2, 0, 3)), np.ones((3, 5)))]
    for i, (a, b) in enumerate(cases):
        np.save(tmp_path / f"a{i}.npy", a)
        np.save(tmp_path / f"b{i}.npy", b)
        out = tmp_path / f"{i}{name}"
        r = run_cli("matmul", tmp_path / f"a{i}.npy", tmp_path / f"b{i}.npy", "-o", out)
        assert r.returncode == 0, r.stderr
        path, _, key = str(out).partition(":")
        if path.endswith(".npy"):
            got = np.load(path)
        elif path.endswith(".zarr"):
            got = zarr.open_array(path, mode="r")[...]
        else:
            with h5py.File(path, "r") as f:
                got = f[key][...]
        want = np.matmul(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype


def test_npz_archive_named_npy_is_bad_input_in_one_line(tmp_path, npy_operands):
    """np.savez to a file named .npy (a zip of arrays): the command ended with status 1 and
    'AttributeError: 'NpzFile' object has no attribute 'dtype''; now status 2, one line naming
    the file and its arrays, and nothing written."""
    pa, pb, _ = npy_operands
    z = tmp_path / "z.npy"
    with open(z, "wb") as f:
        np.savez(f, A=np.ones((50, 29)))
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_cli("matmul", pa, z, "-o", tmp_path / "c.npy", "--engine", "local")
    assert r.returncode == 2
    assert f"{z} is a .npz archive (arrays: A), not a .npy file" in one_line(r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("kind", ["bfloat16.npy", "V4.h5"])
def test_raw_bytes_operand_says_what_was_saved_and_what_to_do(tmp_path, npy_operands, kind):
    """numpy.save (and h5py) store ml_dtypes' bfloat16 as raw 2-byte values, '|V2': the line
    said only 'has dtype |V2: matmul needs boolean or numeric operands'; now it names the
    likely bfloat16 and what distmm takes instead (float32 and --precision bf16), and for
    other raw bytes ('|V4') what they are."""
    pa, pb, _ = npy_operands
    if kind == "bfloat16.npy":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        spec = tmp_path / "a16.npy"
        np.save(spec, np.load(pa).astype(ml_dtypes.bfloat16))
        says = (f"{spec} has dtype |V2: 2-byte values of a type the file does not name, as "
                f"numpy.save and h5py store ml_dtypes' bfloat16; save the array as float32 "
                f"(x.astype(numpy.float32), exact) and pass --precision bf16")
    else:
        with h5py.File(tmp_path / "v.h5", "w") as fh:
            fh["A"] = np.zeros((37, 50), dtype="V4")
        spec = f"{tmp_path / 'v.h5'}:A"
        says = (f"{spec} has dtype |V4: 4-byte values of a type the file does not name, as "
                f"numpy.save and h5py store a dtype numpy has no name for; matmul needs "
                f"boolean or numeric operands")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_cli("matmul", spec, pb, "-o", tmp_path / "c.npy", "--engine", "local")
    assert r.returncode == 2
    assert says in one_line(r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder holding a.npy and b.npy where no file can be created: write permission taken
    away, or (as root, who ignores it) a read-only bind mount; skipped where neither holds."""
    rng = np.random.default_rng()
    src = tmp_path / "src"
    src.mkdir()
    a, b = rng.standard_normal((9, 7)), rng.standard_normal((7, 5))
    np.save(src / "a.npy", a)
    np.save(src / "b.npy", b)
    src.chmod(0o555)
    try:
        if not os.access(src, os.W_OK):
            yield src
        else:
            with read_only_mount(src, tmp_path / "ro") as mounted:
                yield mounted
    finally:
        src.chmod(0o755)


@pytest.mark.parametrize("name", ["c.npy", "c.zarr", "c.h5:C"])
@pytest.mark.slow
def test_read_only_folder_is_bad_input_naming_the_target(read_only_folder, name):
    """The output's folder cannot be written: the run failed with status 1 and named the
    staged file ('Read-only file system: .c.npy.distmm-partial-PID'); now status 2 and the
    target and its folder, before any work."""
    folder = read_only_folder
    r = run_cli("matmul", folder / "a.npy", folder / "b.npy", "-o", folder / name,
                "--engine", "local")
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"cannot write {folder / name}: its folder {folder}" in line and "partial" not in line
    assert sorted(p.name for p in folder.iterdir()) == ["a.npy", "b.npy"]


def test_h5_file_in_a_folder_with_a_colon(tmp_path, npy_operands):
    """A folder or an HDF5 file whose name holds a colon ('run:1/x.h5:A', 'a:b.h5:C'): the
    spec was cut at its first colon and refused ('unsupported file type '.h5:A''); now the
    file is the part up to the '.h5:' (or '.hdf5:') that names one."""
    pa, pb, ref = npy_operands
    folder = tmp_path / "run:1"
    folder.mkdir()
    with h5py.File(folder / "x.h5", "w") as fh:
        fh["A"] = np.load(pa)
    r = run_cli("matmul", f"{folder / 'x.h5'}:A", pb, "-o", f"{folder / 'a:b.h5'}:g/C",
                "--engine", "local")
    assert r.returncode == 0, r.stderr
    with h5py.File(folder / "a:b.h5", "r") as fh:
        np.testing.assert_allclose(fh["g/C"][...], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dataset", ["X/C", "grp/Y/C", "ext/C", "soft/C", "gone/C"])
@pytest.mark.slow
def test_h5_dataset_path_through_a_dataset_is_bad_input(tmp_path, npy_operands, dataset):
    """-o f.h5:X/C where X is a dataset (or a link to one, or a link to nothing): C was
    computed and the copy into the file failed at the end (status 1, 'message type not
    found'); now status 2 before any work, naming the dataset on the way, the file as it
    was."""
    pa, pb, _ = npy_operands
    f = tmp_path / "results.h5"
    with h5py.File(tmp_path / "other.h5", "w") as fh:
        fh["D"] = np.arange(3.0)
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(7.0)
        fh["grp/Y"] = np.ones((3, 3))
        fh["ext"] = h5py.ExternalLink("other.h5", "/D")
        fh["soft"] = h5py.SoftLink("/X")
        fh["gone"] = h5py.SoftLink("/nothing")
    before = sha256(f)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:{dataset}", "--engine", "local", "--overwrite")
    assert r.returncode == 2, r.stderr
    prefix = dataset.rpartition("/")[0]
    assert f"cannot write {f}:{dataset}: {prefix!r} in {f} is" in one_line(r.stderr)
    assert sha256(f) == before and not partials(tmp_path)


@pytest.mark.mpi
@pytest.mark.slow
def test_mpirun_h5_dataset_path_through_a_dataset_and_a_colon(tmp_path, npy_operands, mpirun):
    """The batch path (2 ranks): -o f.h5:X/C through a dataset failed with status 1 after all
    its work; a folder with a colon was an unsupported file type. Now status 2 before any
    work, and the product written."""
    pa, pb, ref = npy_operands
    folder = tmp_path / "run:1"
    folder.mkdir()
    f = folder / "results.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(7.0)
    before = sha256(f)
    r = mpirun(2, "-m", "distmm", "matmul", pa, pb, "-o", f"{f}:X/C", "--overwrite")
    assert r.returncode == 2, r.stderr
    assert f"cannot write {f}:X/C: 'X' in {f} is a dataset, not a group" in r.stderr
    assert sha256(f) == before and not partials(folder)
    r = mpirun(2, "-m", "distmm", "matmul", pa, pb, "-o", f"{f}:g/C")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        np.testing.assert_allclose(fh["g/C"][...], ref, rtol=1e-12, atol=1e-12)


def _linked_h5(folder: Path) -> tuple[Path, Path]:
    """results.h5 with links to a group of other.h5 ('ext' to /G, 'root' to its /, 'through'
    a soft link to /ext/G2 that goes through 'ext') and a soft link to a group of its own
    ('soft' to /G)."""
    other, f = folder / "other.h5", folder / "results.h5"
    with h5py.File(other, "w") as fh:
        fh["G/G2/D"] = np.arange(3.0)
    with h5py.File(f, "w") as fh:
        fh.create_group("G")
        fh["ext"] = h5py.ExternalLink("other.h5", "/G")
        fh["root"] = h5py.ExternalLink("other.h5", "/")
        fh["through"] = h5py.SoftLink("/ext/G2")
        fh["soft"] = h5py.SoftLink("/G")
    return f, other


@pytest.mark.parametrize("dataset, link, says", [
    ("ext/C", "ext", "is an external link to '/G' in {other}"),
    ("ext/new/C", "ext", "is an external link to '/G' in {other}"),
    ("root/C", "root", "is an external link to '/' in {other}"),
    ("through/C", "through", "leads to a group of {other}"),
])
@pytest.mark.slow
def test_h5_dataset_path_into_another_file_is_bad_input(tmp_path, npy_operands, dataset, link, says):
    """-o f.h5:ext/C where ext is an external link to a group of another file: C was written
    into that other file (status 0), which distmm was not asked to write. Now status 2 before
    any work, naming the link and the file it points to; both files as they were."""
    pa, pb, _ = npy_operands
    f, other = _linked_h5(tmp_path)
    before = sha256(f), sha256(other)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:{dataset}", "--engine", "local", "--overwrite")
    assert r.returncode == 2, r.stderr
    assert (f"cannot write {f}:{dataset}: {link!r} in {f} " + says.format(other=other)
            + ", another file, which distmm does not write into") in one_line(r.stderr)
    assert (sha256(f), sha256(other)) == before and not partials(tmp_path)


def test_h5_soft_link_to_a_group_of_the_file_is_followed(tmp_path, npy_operands):
    """A soft link to a group of the file itself stays a way into that group."""
    pa, pb, ref = npy_operands
    f, other = _linked_h5(tmp_path)
    before = sha256(other)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:soft/C", "--engine", "local")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        np.testing.assert_allclose(fh["G/C"][...], ref, rtol=1e-12, atol=1e-12)
    assert sha256(other) == before and not partials(tmp_path)


@pytest.mark.mpi
@pytest.mark.slow
def test_mpirun_h5_dataset_path_into_another_file(tmp_path, npy_operands, mpirun):
    """The batch path (2 ranks): C went into the external link's file; now status 2 before
    any work, naming the link and that file."""
    pa, pb, _ = npy_operands
    f, other = _linked_h5(tmp_path)
    before = sha256(f), sha256(other)
    r = mpirun(2, "-m", "distmm", "matmul", pa, pb, "-o", f"{f}:ext/C")
    assert r.returncode == 2, r.stderr
    assert f"cannot write {f}:ext/C: 'ext' in {f} is an external link to '/G' in {other}" \
        in r.stderr
    assert (sha256(f), sha256(other)) == before and not partials(tmp_path)


# ---------------------------------------------------------------- checks that ask the kernel


def contents(path: Path) -> dict:
    """Every file at or under ``path``, by name, with its bytes' digest."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): sha256(p) for p in files}


@pytest.mark.parametrize("flag", ["a", "i"])
def test_an_h5_file_that_cannot_be_opened_for_writing_is_refused_before_any_work(
        tmp_path, npy_operands, chattr, flag):
    """An append-only HDF5 file (chattr +a): os.access told root it was writable, C was
    computed and the copy into the file failed at the end (status 1, 'cannot open ... to add
    'C''); now the file is opened for writing as HDF5 will open it (and closed unwritten):
    status 2 before any work, one line naming the file and the dataset, the file as it was."""
    pa, pb, _ = npy_operands
    f = tmp_path / "results.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(7.0)
    before = sha256(f)
    chattr(f, flag)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local")
    assert r.returncode == 2, r.stderr
    assert (f"cannot add 'C' to {f}: the file cannot be opened for writing (Operation not "
            f"permitted)") in one_line(r.stderr)
    assert sha256(f) == before and not partials(tmp_path)


@pytest.mark.parametrize("name", ["c.npy", "c.zarr"])
@pytest.mark.parametrize("flag, fixed", [("i", "immutable"), ("a", "append-only")])
@pytest.mark.slow
def test_a_target_no_one_may_replace_is_refused_before_any_work(tmp_path, npy_operands, chattr,
                                                                name, flag, fixed):
    """--overwrite of an immutable or append-only .npy file or zarr folder: C was computed and
    its rename failed at the end, naming the staged file ('Operation not permitted:
    .c.npy.distmm-partial-PID') or the folder; now refused before any work, in one line
    naming the target and its attribute, the target as it was."""
    pa, pb, _ = npy_operands
    target = tmp_path / name
    (np.save if name.endswith(".npy") else zarr.save_array)(str(target), np.arange(6.0))
    before = contents(target)
    chattr(target, flag)
    r = run_cli("matmul", pa, pb, "-o", target, "--engine", "local", "--overwrite")
    assert r.returncode == 2, r.stderr
    assert f"cannot replace {target}: it is {fixed} (chattr)" in one_line(r.stderr)
    assert contents(target) == before and not partials(tmp_path)
    assert not [p for p in tmp_path.iterdir() if "distmm-old" in p.name]


def test_an_append_only_folder_is_refused_without_leaving_the_test_file(tmp_path, npy_operands,
                                                                        chattr):
    """An append-only folder (chattr +a): a file can be made there but never removed, so the
    test of the folder left its file behind ('.c.npy.distmm-partial-PID', which a later run
    takes for a stopped run's). Now refused before the file is made."""
    pa, pb, _ = npy_operands
    folder = tmp_path / "log"
    folder.mkdir()
    chattr(folder, "a")
    r = run_cli("matmul", pa, pb, "-o", folder / "c.npy", "--engine", "local")
    assert r.returncode == 2, r.stderr
    assert f"cannot write {folder / 'c.npy'}: its folder {folder}" in one_line(r.stderr)
    assert list(folder.iterdir()) == []


def test_check_writable_asks_the_kernel_as_the_command_will_write(tmp_path, chattr):
    """os.access told root an append-only file was writable: a calibration or a tuning cache
    that replaces it, a report that rewrites it, failed only at the end. Now the file is
    opened as the command will open it (closed unwritten), or for one it replaces, its
    attributes read; records appended to it are let through."""
    from distmm.cli.outputs import check_writable

    f = tmp_path / "cal.json"
    f.write_text("{}\n")
    chattr(f, "a")
    with pytest.raises(PermissionError, match=r"cannot be written \(Operation not permitted\)"):
        check_writable(f)
    with pytest.raises(PermissionError, match=r"cannot be replaced \(it is append-only\)"):
        check_writable(f, writes="replace")
    check_writable(f, writes="append")
    assert f.read_text() == "{}\n" and list(tmp_path.iterdir()) == [f]


@pytest.fixture
def as_nobody():
    """(a folder the user nobody (65534) owns, ``run(ids, *args)``: python ARGS as nobody,
    its output captured): ``ids`` "both" switches the real and the effective user (``setpriv
    --reuid``), "effective" only the effective one (the real one stays root's, as in a
    set-user-ID program). The folder is outside pytest's, which only root may enter. Skipped
    where setpriv cannot switch (not root, no setpriv)."""
    switch = {"both": ["--reuid=65534", "--regid=65534"],
              "effective": ["--euid=65534", "--egid=65534"]}
    try:
        ok = os.geteuid() == 0 and subprocess.run(
            ["setpriv", *switch["both"], "--clear-groups", "true"]).returncode == 0
    except FileNotFoundError:
        ok = False
    if not ok:
        pytest.skip("cannot run a process as the user nobody here (needs root and setpriv)")
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="distmm-nobody-"))
    top.chmod(0o755)
    folder = top / "own"
    folder.mkdir()
    os.chown(folder, 65534, 65534)

    def run(ids, *args):
        return subprocess.run(["setpriv", *switch[ids], "--clear-groups", sys.executable, *args],
                              capture_output=True, text=True, timeout=300, cwd=folder)

    try:
        if run("both", "-c", "import distmm").returncode != 0:
            pytest.skip("the user nobody cannot import distmm from this interpreter (its "
                        "environment lies in a folder only root may enter, as a mktemp -d venv)")
        yield folder, run
    finally:
        shutil.rmtree(top)


def test_checks_answer_for_the_effective_user(as_nobody):
    """A process whose effective user is nobody and real user root: os.access answered for
    root, so an HDF5 file of root's (0644) passed, C was computed, and the copy into the file
    failed at the end (status 1); a file of root's passed check_writable. Now both are opened
    as the effective user will open them: status 2 before any work, the file as it was."""
    folder, run = as_nobody
    rng = np.random.default_rng()
    np.save(folder / "a.npy", rng.standard_normal((6, 4)))
    np.save(folder / "b.npy", rng.standard_normal((4, 3)))
    f = folder / "root.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(7.0)
    f.chmod(0o644)
    before = sha256(f)
    r = run("effective", "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "root.h5:C",
            "--engine", "local")
    assert r.returncode == 2, r.stderr
    assert ("cannot add 'C' to root.h5: the file cannot be opened for writing (Permission "
            "denied)") in one_line(r.stderr)
    assert sha256(f) == before and not partials(folder)
    r = run("effective", "-c", f"from distmm.cli.outputs import check_writable; "
                               f"check_writable({str(f)!r})")
    assert r.returncode == 1 and f"cannot be written (Permission denied): '{f}'" in r.stderr


def test_a_read_only_file_in_a_writable_folder_may_be_replaced(as_nobody):
    """A file its user may not write (0444) in a folder they may: os.access refused it, yet a
    calibration or a tuning cache replaces it (a rename, which its folder allows). Now
    check_writable(writes="replace") lets it through, and the replacement it promises is
    made; to be opened for writing (the default) it is still refused."""
    folder, run = as_nobody
    f = folder / "cal.json"
    f.write_text("{}\n")
    os.chown(f, 65534, 65534)
    f.chmod(0o444)
    code = textwrap.dedent(f"""
        import os
        from distmm.cli.outputs import check_writable
        try:
            check_writable({str(f)!r})
        except PermissionError as exc:
            print(exc)
        check_writable({str(f)!r}, writes="replace")
        with open("new.json", "w") as fh:
            fh.write("[1]")
        os.replace("new.json", {str(f)!r})
        """)
    r = run("both", "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"[Errno 13] cannot be written (Permission denied): '{f}'\n"
    assert f.read_text() == "[1]"


@pytest.mark.parametrize("kind", ["h5", "zarr"])
@pytest.mark.slow
def test_an_operand_its_user_may_not_read_is_named_in_one_line(as_nobody, kind):
    """An HDF5 file or a zarr folder the user may not read: the HDF5 one said h5py's words on
    HDF5's call ("Unable to determine if file is accessible as hdf5 (unable to open file:
    name = ..., errno = 13, ...)"), the zarr one named a file it does not hold
    ("Permission denied: a.zarr/.zarray" for a zarr v3 array). Both now say "Permission
    denied" naming the operand, as a .npy file's refusal does: status 2, nothing written."""
    folder, run = as_nobody
    rng = np.random.default_rng()
    a = rng.standard_normal((7, 5))
    np.save(folder / "b.npy", rng.standard_normal((5, 3)))
    if kind == "h5":
        with h5py.File(folder / "a.h5", "w") as fh:
            fh["A"] = a
        (folder / "a.h5").chmod(0o600)
        spec, name = "a.h5:A", "a.h5"
    else:
        zarr.create_array(str(folder / "a.zarr"), shape=a.shape, chunks=(3, 2),
                          dtype="f8", zarr_format=3)[...] = a
        (folder / "a.zarr").chmod(0o700)
        spec, name = "a.zarr", "a.zarr"
    r = run("both", "-m", "distmm", "matmul", spec, "b.npy", "-o", "c.npy", "--engine", "local")
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == f"distmm matmul: error: Permission denied: {name}\n"
    assert sorted(p.name for p in folder.iterdir()) == sorted([name, "b.npy"])


# ---------------------------------------------------------------- names of the output


@pytest.mark.slow  # three commands, ~5 s (8 s on two ranks)
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_zarr_output_named_as_a_folder_and_the_line_naming_what_was_written(
        tmp_path, npy_operands, mpirun, ranks):
    """``-o c.zarr/`` (a shell's completion of the folder) was refused as "ends with a path
    separator"; ``-o x.h5:`` wrote the dataset ``data`` but said "wrote x.h5:". The line
    names the target written; a .npy or HDF5 name ending with a separator is still refused."""
    import zarr

    pa, pb, ref = npy_operands

    def cli(*argv):
        argv = ("matmul", pa, pb, "-o", *map(str, argv))
        return run_cli(*argv) if ranks == 1 else mpirun(2, "-m", "distmm", *argv)

    r = cli(f"{tmp_path / 'c.zarr'}/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'c.zarr'}: shape (37, 29)"), r.stdout
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[...], ref,
                               rtol=1e-12)
    r = cli(f"{tmp_path / 'x.h5'}:")
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {tmp_path / 'x.h5'}:data: "), r
    with h5py.File(tmp_path / "x.h5", "r") as f:
        np.testing.assert_allclose(f["data"][...], ref, rtol=1e-12)
    r = cli(f"{tmp_path / 'c.npy'}/")
    assert r.returncode == 2 and "ends with a path separator" in r.stderr, r.stderr
    if ranks == 1:
        one_line(r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.zarr", "x.h5"]


@pytest.mark.parametrize("out", ["x.npy", "x.h5:C", "sub.zarr"])
@pytest.mark.slow
def test_an_output_inside_a_zarr_array_is_refused_before_any_work(tmp_path, out):
    """``-o sq.zarr/x.npy`` with ``sq.zarr`` an operand: C was computed, then the run failed
    with "input A (sq.zarr) changed" (its staged file counted in the folder's size), and any
    .npy or HDF5 file there sits among an array's chunks. Refused in one line before any work,
    as a zarr array inside a zarr array already was; the array untouched."""
    import zarr

    sq = tmp_path / "sq.zarr"
    zarr.save_array(str(sq), np.random.default_rng().standard_normal((6, 6)))
    before = sorted(p.relative_to(sq) for p in sq.rglob("*"))
    r = run_cli("matmul", sq, sq, "-o", f"{sq}/{out}")
    assert r.returncode == 2, r.stderr
    assert f"cannot write {sq}/{out}" in one_line(r.stderr)
    assert ("it lies inside the zarr array" if not out.endswith(".zarr") else
            "is a zarr array, not a group") in r.stderr
    assert sorted(p.relative_to(sq) for p in sq.rglob("*")) == before
