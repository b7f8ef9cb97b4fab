"""The command line, run as a real subprocess, on real files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "distmm", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def test_plan_command():
    r = run_cli("plan", 5000, 3000, 7000, "--workers", 4, "--tile", 1024)
    assert r.returncode == 0, r.stderr
    assert "grid 5 x 3 = 15 C tiles" in r.stdout
    assert "C tiles per worker [4, 4, 4, 3]" in r.stdout


def test_info_command():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "numpy" in r.stdout and "mpi4py" in r.stdout


def test_demo_local_engine():
    r = run_cli("demo", "-n", 300, "--engine", "local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "GFLOP/s" in r.stdout


@pytest.mark.parametrize("dtype, check", [("complex64", "relative error vs complex128 numpy"),
                                          ("int16", "equal to numpy's product")])
def test_demo_checks_complex_and_integer_products(dtype, check):
    """The check covers a complex product's imaginary parts (it dropped them and said
    WRONG, with a ComplexWarning) and compares integers with numpy's wrapped product."""
    r = run_cli("demo", "-n", 130, "--dtype", dtype, "--engine", "local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{check}" in r.stdout and r.stdout.rstrip().endswith(": OK"), r.stdout
    assert "Warning" not in r.stderr, r.stderr


def test_demo_and_plan_too_large_say_so_in_one_line():
    r = run_cli("demo", "-n", 99999999999, "--engine", "local")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "-n 99999999999 float64" in r.stderr and "GiB" in r.stderr, r.stderr
    r = run_cli("plan", 99999999999999, 8, 8)
    assert r.returncode == 1
    assert "tiles along one axis" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("fmt", ["npy", "zarr", "h5"])
def test_matmul_on_files(tmp_path: Path, fmt):
    rng = np.random.default_rng()
    a = rng.standard_normal((37, 50))
    b = rng.standard_normal((50, 29))
    if fmt == "npy":
        pa, pb, pc = tmp_path / "a.npy", tmp_path / "b.npy", tmp_path / "c.npy"
        np.save(pa, a)
        np.save(pb, b)
    elif fmt == "zarr":
        pa, pb, pc = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "c.zarr"
        for p, x in ((pa, a), (pb, b)):
            z = zarr.open_array(str(p), mode="w", shape=x.shape, dtype=x.dtype, chunks=(16, 16))
            z[...] = x
    else:
        with h5py.File(tmp_path / "in.h5", "w") as fh:
            fh["a"] = a
            fh["b"] = b
        pa, pb, pc = f"{tmp_path}/in.h5:a", f"{tmp_path}/in.h5:b", f"{tmp_path}/out.h5:c"
    r = run_cli("matmul", pa, pb, "-o", pc, "--engine", "local")
    assert r.returncode == 0, r.stderr
    if fmt == "npy":
        c = np.load(pc)
    elif fmt == "zarr":
        c = zarr.open_array(str(pc), mode="r")[...]
    else:
        with h5py.File(tmp_path / "out.h5", "r") as fh:
            c = fh["c"][...]
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    leftovers = [p.name for p in tmp_path.iterdir() if "partial" in p.name]
    assert not leftovers


def test_failed_matmul_leaves_no_output(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.ones((3, 4)))
    np.save(tmp_path / "b.npy", np.ones((5, 2)))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy")
    assert r.returncode == 2
    assert "(3, 4)" in r.stderr and "(5, 2)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.parametrize("name", ["c.npy", "c.zarr", "c.h5"])
def test_failure_while_filling_keeps_old_output(tmp_path: Path, name):
    from distmm.cli.io import open_operand, staged_output, write_atomic

    target = tmp_path / name
    write_atomic(str(target), np.arange(6.0).reshape(2, 3))
    with pytest.raises(OSError, match="No space"):
        with staged_output(str(target), (4, 3), "float64", overwrite=True) as c:
            c[0:2, :] = 1.0  # half written, then the disk fills up
            raise OSError("No space left on device")
    np.testing.assert_array_equal(np.asarray(open_operand(str(target))[...]), np.arange(6.0).reshape(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_corrupt_input_mid_run_leaves_no_output(tmp_path: Path):
    rng = np.random.default_rng()
    a = rng.standard_normal((64, 48))
    pa = tmp_path / "a.zarr"
    z = zarr.open_array(str(pa), mode="w", shape=a.shape, dtype=a.dtype, chunks=(16, 16))
    z[...] = a
    np.save(tmp_path / "b.npy", rng.standard_normal((48, 40)))
    chunks = sorted(p for p in pa.rglob("*") if p.is_file() and p.name[0].isdigit())
    chunks[-1].write_bytes(b"not a chunk")  # the last row panel cannot be decoded
    r = run_cli("matmul", pa, tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--tile", 16, "--engine", "local")
    assert r.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "b.npy"]


def test_missing_file_is_a_clear_error(tmp_path: Path):
    r = run_cli("matmul", tmp_path / "nope.npy", tmp_path / "nope.npy", "-o", tmp_path / "c.npy")
    assert r.returncode == 2
    assert f"no such file: {tmp_path / 'nope.npy'}" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cluster_operands_are_made_per_chunk_from_the_seed():
    """distmm.cli.cluster.random_array (the demo's and benchmark's operands): the same seed and
    chunks give the same values and keys, another seed other values, each chunk its own."""
    import numpy as np

    from distmm.cli.cluster import random_array, to_host

    for dtype in ("float32", "float64", "int16", "bool"):
        x = random_array((101, 67), 32, dtype, seed=5, gpu=False)
        y = random_array((101, 67), 32, dtype, seed=5, gpu=False)
        z = random_array((101, 67), 32, dtype, seed=6, gpu=False)
        assert x.name == y.name != z.name
        xv = to_host(x).compute(scheduler="sync")
        assert xv.dtype == np.dtype(dtype) and xv.shape == (101, 67)
        assert np.array_equal(xv, y.compute(scheduler="sync"))
        assert not np.array_equal(xv, z.compute(scheduler="sync"))
        assert not np.array_equal(xv[:32, :32], xv[32:64, :32])  # chunks seeded apart
        if dtype.startswith("float"):
            assert abs(float(xv.mean())) < 0.1 and 0.9 < float(xv.std()) < 1.1


def test_gpu_cluster_protocol_is_ucx_only_where_distributed_ucxx_imports(monkeypatch):
    import sys
    import types

    from distmm.cli.cluster import gpu_protocol

    monkeypatch.setitem(sys.modules, "distributed_ucxx", None)  # import fails: not installed
    assert gpu_protocol("auto") == "tcp"
    assert gpu_protocol("tcp") == "tcp"
    with pytest.raises(ImportError, match="distributed-ucxx"):
        gpu_protocol("ucx")
    with pytest.raises(ValueError, match="protocol must be one of"):
        gpu_protocol("ucxx")
    monkeypatch.setitem(sys.modules, "distributed_ucxx", types.ModuleType("distributed_ucxx"))
    assert gpu_protocol("auto") == "ucx"
    assert gpu_protocol("tcp") == "tcp"  # asked for: kept


_SWALLOWED = """
import os, signal, sys, time
from distmm.cli import commands

plan = commands._cmd_plan


class Finaliser:
    def __del__(self):  # Python only prints what a finaliser raises ("Exception ignored in")
        os.kill(os.getpid(), signal.SIG{name})
        time.sleep(5)


def swallowing_plan(args):
    Finaliser()  # collected at once: the signal's exception is raised inside __del__
    return plan(args)


commands._cmd_plan = swallowing_plan
sys.exit(commands.main(["plan", "10", "10", "10"]))
"""


@pytest.mark.parametrize("name,status,said", [("TERM", 143, "terminated by SIGTERM"),
                                              ("INT", 130, "interrupted (SIGINT)")])
def test_a_signal_whose_exception_python_swallowed_still_ends_the_command(name, status, said):
    """A signal whose exception lands where Python only prints it (a garbage-collection
    callback or finaliser, as while a Dask cluster starts or closes) ended nothing: bench and
    calibrate went on, wrote their output and exited 0. Now the command ends with the
    signal's status and one line, and nothing is printed from inside the finaliser."""
    r = subprocess.run([sys.executable, "-c", _SWALLOWED.replace("{name}", name)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert r.stderr == f"distmm plan: error: {said}\n", r.stderr


def test_calibrate_refuses_a_file_it_cannot_write_before_measuring(tmp_path):
    (tmp_path / "plain").write_text("")
    r = run_cli("calibrate", "--quick", "-o", tmp_path / "plain" / "cal.json")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("distmm calibrate: error:") and r.stderr.count("\n") == 1
    assert "is not a folder" in r.stderr  # one line: no measuring step was shown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_plan_refuses_too_many_ranks_before_printing_and_notes_a_missing_gpu():
    r = run_cli("plan", 100, 100, 100, "--ranks", 10**9)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert "ranks must be at most" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("plan", 100, 100, 100, "--backend", "raw")
    if "no CUDA GPU here" not in r.stderr:
        pytest.skip("this machine has a GPU")
    assert r.returncode == 0 and "tiles" in r.stdout, r.stderr


def test_demo_refuses_a_gpu_backend_without_a_gpu_before_its_cluster_starts():
    from distmm.executor import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    r = run_cli("demo", "-n", 64, "--engine", "dask", "--backend", "raw")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "needs a CUDA GPU" in r.stderr


def test_demo_report_refused_before_the_product_where_it_cannot_be_written(tmp_path):
    # --report with the local engine was silently ignored; a folder failed after the product
    r = run_cli("demo", "-n", 64, "--engine", "local", "--report", tmp_path / "r.html")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "--engine dask" in r.stderr
    r = run_cli("demo", "-n", 64, "--engine", "dask", "--report", tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "a folder" in r.stderr and str(tmp_path) in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_calibrate_probe_failure_names_the_mpi_notice_not_its_rule():
    from distmm.cli.calibrate import _stderr_line

    notice = ("-" * 74 + "\nprterun has detected an attempt to run as root.\n\nRunning as root is "
              "discouraged.\n" + "-" * 74 + "\n")
    assert _stderr_line(notice) == "prterun has detected an attempt to run as root."
    assert _stderr_line("Traceback (most recent call last):\n  x\nValueError: bad\n") == \
        "ValueError: bad"
    assert _stderr_line("\n---\n") == "no output"


def test_debug_before_a_command_that_parses_its_own_options(tmp_path):
    missing = tmp_path / "missing.json"
    r = run_cli("--debug", "trace", "--from-json", missing)
    assert r.returncode == 2, r.stderr  # was argparse's "unrecognized arguments"
    assert "Traceback" in r.stderr and r.stderr.rstrip().endswith(f"{missing}")
    r = run_cli("trace", "--from-json", missing)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
