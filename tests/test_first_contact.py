"""A new user's first commands on a CPU-only machine: ``distmm demo``, ``plan``, ``trace`` and
``tune`` refuse what cannot run here in one line, status 2, before any work."""
from __future__ import annotations

import importlib.util
import os

import dask
import pytest

import distmm
from conftest import run_cli
from distmm.cli.commands import main
from distmm.config import available_cpus

#: a cupy that imports but sees no CUDA device, as on a machine without a driver
_NO_DEVICE_CUPY = '''
import types

__version__ = "13.0.0"


def _count():
    raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")


cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=_count))
'''


def _no_device_cupy(tmp_path) -> dict:
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(_NO_DEVICE_CUPY)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_demo_refuses_more_cluster_workers_than_this_machine_can_start():
    """``distmm demo --workers 300`` on a 2-core machine started 300 worker processes (minutes,
    deaf to SIGTERM while they started); beyond four per usable core it is refused at once."""
    workers = 4 * available_cpus() + 1
    r = run_cli("demo", "-n", 8, "--engine", "dask", "--workers", workers, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and f"--workers {workers}: " in r.stderr, r.stderr
    assert "--engine local" in r.stderr, r.stderr


def test_plan_for_workers_splits_the_memory_budget_as_the_local_engine_does(capsys):
    """``distmm plan M N K --workers W`` planned W workers each with the budget of the
    default thread count's share (W tasks at once holding far more than half the memory):
    now the plan ``distmm.matmul`` makes on the local engine running W threads."""
    m, n, k, workers = 100_003, 99_999, 100_001, 64
    assert main(["plan", str(m), str(n), str(k), "--workers", str(workers)]) == 0
    printed = capsys.readouterr().out
    with dask.config.set({"distmm.local-threads": workers}):
        want = distmm.make_plan(m, n, k, "float64").describe()
    assert printed.strip() == want.strip(), printed


@pytest.mark.parametrize("command", ["trace", "tune"])
def test_gpu_commands_with_a_cupy_that_sees_no_device_say_so_in_one_line(tmp_path, command):
    """With cupy installed but no CUDA device, ``trace`` and ``tune`` went on to their run
    and failed inside it: one line saying no device is seen, status 2, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    argv = ["-o", out / "t.png"] if command == "trace" else ["--cache", out / "cache.json"]
    r = run_cli(command, *argv, env=_no_device_cupy(tmp_path), cwd=out)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"distmm {command}: error: ") and "sees no CUDA device" in r.stderr
    assert list(out.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_trace_without_cupy_names_the_extra_to_install():
    """``distmm trace`` without cupy said it needs cupy but not what to install (``tune``
    named ``distmm[gpu]``)."""
    r = run_cli("trace", "--n", 8)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert 'pip install "distmm[gpu]"' in r.stderr and "--from-json" in r.stderr, r.stderr


@pytest.mark.mpi
def test_demo_under_a_launcher_is_refused_once(mpirun):
    """``mpirun -n 2 distmm demo`` ran the whole demo on each rank (two clusters, or twice the
    threads on the cores, and every line printed twice): one line by rank 0, status 2."""
    r = mpirun(2, "-m", "distmm", "demo", "-n", 8, "--engine", "local", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "in-process engine" not in r.stdout, r.stdout
    said = [line for line in r.stderr.splitlines() if line.startswith("distmm demo: error:")]
    assert len(said) == 1 and "one of 2 MPI ranks" in said[0], r.stderr


def test_demo_larger_than_the_available_memory_is_refused_before_it_allocates(monkeypatch,
                                                                              capsys):
    """The demo's memory check took the machine's total memory: on a busy machine a size
    that fits the total but not what is free ran on into swap or the OOM killer. Now the
    available memory (64 MiB here, pretended) decides, before the operands are made."""
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=64 << 20))
    n = 1201  # operands, result and the float64 check: 48 * n**2 bytes, above 64 MiB
    assert main(["demo", "-n", str(n), "--engine", "local"]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.count("\n") == 1 and f"-n {n} float64: " in err and "available" in err, err


@pytest.mark.parametrize("engine", ["local", "dask"])
def test_demo_names_a_configured_gpu_backend_it_cannot_run(engine):
    """With ``DISTMM_BACKEND=raw`` on a machine without a GPU, ``distmm demo`` (its
    ``--backend auto``) was refused with "use --backend auto": what it had used. Now the
    setting is named, and a CPU backend to give."""
    from distmm.executor import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    r = run_cli("demo", "-n", 8, "--engine", engine, "--workers", 1,
                env={"DISTMM_BACKEND": "raw", "DASK_DISTMM__BACKEND": None})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "distmm.backend (DISTMM_BACKEND)" in r.stderr and "--backend blas" in r.stderr, r.stderr


@pytest.mark.parametrize("text", [b"distmm:\n  tile: [1, 2\n", b"- a list\n- at the top\n"])
def test_a_malformed_dask_config_file_is_bad_input(tmp_path, text):
    """A YAML file dask cannot read in DASK_CONFIG fails ``import dask`` itself: one line
    naming the file, status 2 (the user's file), no traceback; it was status 1 with
    'ValueError:' first, as a broken install. (A file that is not UTF-8: dask 2024.12 raises
    the decoder's error naming no file, newer dask this same refusal.)"""
    (tmp_path / "bad.yaml").write_bytes(text)
    r = run_cli("info", env={"DASK_CONFIG": str(tmp_path)}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"distmm info: error: A dask config file at "
                               f"'{tmp_path / 'bad.yaml'}' is malformed"), r.stderr
