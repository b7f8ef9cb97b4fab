"""The command line's output touches nothing but its target: real files, a
real file-size limit, real signals. Each test is one case of issue 10."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "distmm", *map(str, args)], capture_output=True,
                          text=True, timeout=600, **kw)


def one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    return stderr


@pytest.fixture
def operands(tmp_path: Path):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((37, 50)), rng.standard_normal((50, 29))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return tmp_path / "a.npy", tmp_path / "b.npy", a @ b


def test_h5_output_keeps_the_other_datasets(tmp_path, operands):
    pa, pb, ref = operands
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


def test_zarr_group_is_never_replaced(tmp_path, operands):
    pa, pb, ref = operands
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


def test_zarr_array_replaced_only_with_overwrite(tmp_path, operands):
    pa, pb, ref = operands
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


def test_directory_named_like_the_output_survives(tmp_path, operands):
    pa, pb, _ = operands
    d = tmp_path / "out.npy"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        r = run_cli("matmul", pa, pb, "-o", d, "--engine", "local", *extra)
        assert r.returncode == 2
        assert "is a directory" in one_line(r.stderr) and "out.npy" in r.stderr
    assert (d / "precious.txt").read_text() == "keep me"


def test_existing_output_refused_then_replaced(tmp_path, operands):
    pa, pb, ref = operands
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


def _limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.mark.parametrize("name", ["c.npy", "c.h5:C", "c.zarr"])
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


def test_file_size_limit_keeps_an_existing_h5_file(tmp_path, operands):
    pa, pb, _ = operands
    f = tmp_path / "keep.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = np.arange(100_000.0)
    before = f.read_bytes()
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local",
                preexec_fn=_limit(f.stat().st_size + 1000))
    assert r.returncode == 1 and "file-size limit" in one_line(r.stderr)
    assert f.read_bytes() == before


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


def test_no_space_is_checked_before_computing(tmp_path, operands):
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
