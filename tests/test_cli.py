"""The command line, run as a real subprocess, on real files."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from conftest import run_cli


def test_plan_command():
    r = run_cli("plan", 5000, 3000, 7000, "--workers", 4, "--tile", 1024)
    assert r.returncode == 0, r.stderr
    assert "grid 5 x 3 = 15 C tiles" in r.stdout
    assert "C tiles per worker [4, 4, 4, 3]" in r.stdout


@pytest.mark.slow  # ~2 s: a plan and a one-rank batch run
def test_counts_of_one_take_the_singular(tmp_path):
    """distmm plan said "= 1 C tiles", "(1 additions per tile)", "for 1 ranks", and the batch
    summary line "1 ranks": a count of 1 takes the singular, others the plural."""
    r = run_cli("plan", 64, 64, 10000, "--workers", 2, "--ranks", 1)
    assert r.returncode == 0, r.stderr
    assert "grid 1 x 1 = 1 C tile;" in r.stdout and "(1 addition per tile)" in r.stdout
    assert " for 1 rank;" in r.stdout and "in 1 stripe of " not in r.stdout, r.stdout
    r = run_cli("plan", 64, 64, 10000, "--workers", 4, "--ranks", 2)
    assert "= 1 C tile;" in r.stdout and "(3 additions per tile)" in r.stdout
    assert " for 2 ranks;" in r.stdout and "on 1 host," in r.stdout, r.stdout
    np.save(tmp_path / "a.npy", np.ones((3, 2)))
    np.save(tmp_path / "b.npy", np.ones((2, 4)))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                "--profile", tmp_path / "p.json")  # the MPI engine's batch path, one rank
    assert r.returncode == 0 and ", 1 rank, grid 1x1," in r.stdout, (r.stdout, r.stderr)


def test_hosts_goes_with_ranks_and_is_at_most_their_count():
    for argv, said in ((["--hosts", 2], "--hosts goes with --ranks"),
                       (["--ranks", 2, "--hosts", 3], "--hosts 3 is more hosts than --ranks 2"),
                       (["--ranks", 2, "--hosts", 0], "argument --hosts:")):
        r = run_cli("plan", 10, 10, 10, *argv)
        assert r.returncode == 2 and r.stdout == "" and said in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_plan_ranks_takes_the_configured_backend_as_the_job_does(tmp_path):
    """``distmm plan --ranks`` planned CPU ranks under ``DISTMM_BACKEND=raw``, where
    ``mpirun distmm matmul`` takes the configured backend (GPU ranks); ``--backend`` wins."""
    env = {**_no_settings(tmp_path), "DISTMM_BACKEND": "raw"}
    for argv, ranks in (([], "GPU ranks"), (["--backend", "numba"], "CPU ranks")):
        r = run_cli("plan", 512, 512, 512, "--ranks", 2, *argv, env=env)
        assert r.returncode == 0 and f"on 1 host, {ranks}" in r.stdout, (r.stdout, r.stderr)


def _no_settings(home: Path) -> dict:
    """An environment without distmm settings: no DISTMM_/DASK_DISTMM__ variable, no
    DASK_CONFIG, and a HOME without ~/.config/dask."""
    unset = {k: None for k in os.environ if k.startswith(("DISTMM_", "DASK_DISTMM__"))}
    return {**unset, "DASK_CONFIG": None, "HOME": str(home)}


def test_info_command(tmp_path):
    r = run_cli("info", env=_no_settings(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "numpy" in r.stdout and "mpi4py" in r.stdout
    assert r.stdout.splitlines()[-1] == "config      defaults"
    # the MPI library's version came with its C string's NUL: grep called the output binary
    assert "\x00" not in r.stdout and all(line == line.rstrip() for line in
                                          r.stdout.splitlines()), repr(r.stdout)


@pytest.mark.slow
def test_info_shows_the_settings_in_force_and_where_each_was_set(tmp_path):
    """distmm info printed versions and devices only: a DISTMM_ variable or a YAML file in
    dask's config paths changed plans with nothing to show it before a job."""
    folder = tmp_path / "dask"
    folder.mkdir()
    (folder / "site.yaml").write_text("distmm:\n  batch_stripes: 3\n  precision: tf32\n"
                                      "  engine: auto\n")
    env = {**_no_settings(tmp_path), "DASK_CONFIG": str(folder),
           "DISTMM_MEMORY_BUDGET": "4GiB", "DASK_DISTMM__PRECISION": "bf16"}
    r = run_cli("info", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert lines[at:] == ["config      memory-budget = 4GiB (DISTMM_MEMORY_BUDGET)",
                          f"            batch-stripes = 3 ({folder / 'site.yaml'})",
                          "            precision = bf16 (DASK_DISTMM__PRECISION)"]
    # a value that does not parse: the command's one line, naming the key, and status 2
    r = run_cli("info", env={**env, "DISTMM_BATCH_STRIPES": "0"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "distmm.batch-stripes = 0 is not valid" in r.stderr


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
    """Sizes too large to plan, or for this machine to hold, are told from the arguments
    before any work: bad arguments, status 2 (they were a MemoryError's 1, "the run
    started and failed")."""
    r = run_cli("demo", "-n", 99999999999, "--engine", "local")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "-n 99999999999 float64" in r.stderr and "GiB" in r.stderr, r.stderr
    assert "MemoryError" not in r.stderr, r.stderr
    r = run_cli("plan", 99999999999999, 8, 8)
    assert r.returncode == 2, r.stderr
    assert "tiles along one axis" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli("plan", 10**7, 10**7, 10**7, "--ranks", 8)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("distmm plan: error: a 10000000 x 10000000 result in tiles "
                               "of "), r.stderr
    assert "tiles; a plan lists at most" in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("fmt", ["npy", "zarr", "h5"])
@pytest.mark.slow
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


@pytest.mark.parametrize("engine", ["local", pytest.param("dask", marks=pytest.mark.slow)])
def test_demo_prints_the_plan_it_runs_and_allows_for_the_configured_precision(engine):
    """The demo printed a plan of its own: not the configured precision (distmm.precision
    tf32, with which it then judged the float32 product WRONG against float32's tolerance,
    status 1), nor the Dask workers' lower memory budget, nor distmm.local-threads (which
    the local engine ran while the demo said one thread per core)."""
    env = {"DISTMM_PRECISION": "tf32", "DISTMM_MEMORY_BUDGET": "1TiB", "DISTMM_LOCAL_THREADS": "3"}
    workers = ["--workers", 1] if engine == "dask" else []
    r = run_cli("demo", "-n", 64, "--dtype", "float32", "--engine", engine, *workers, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].endswith("dtype float32 (accumulate in float32), precision tf32"), lines
    assert lines[-1].endswith("within the tf32 error bound: OK"), lines
    if engine == "local":
        assert lines[0] == "in-process engine: 3 thread(s)", lines
        assert "workers    3; C tiles per worker [1, 0, 0]" in lines, lines
        assert "(budget 1048576 MiB)" in r.stdout, r.stdout  # this process's: the configured
    else:  # each worker's share of its memory_limit, below the configured 1 TiB
        assert "(budget " in r.stdout and "(budget 1048576 MiB)" not in r.stdout, r.stdout


@pytest.mark.parametrize("argv, said", [
    (["demo", "-n", "64", "--engine", "local", "--report", ""], "argument --report: an empty path"),
    # was: "in-process engine: 200000 thread(s)" printed first; on a cluster, a start of as
    # many worker processes before the planner refused them
    (["demo", "-n", "8", "--engine", "local", "--workers", "200000"],
     "argument --workers: '200000' must be at most 131072"),
    (["matmul", "a.npy", "b.npy", "-o", "c.npy", "--profile", ""],
     "argument --profile: an empty path"),
    (["matmul", "a.npy", "b.npy", "-o", "c.npy", "--scheduler-file", ""],
     "argument --scheduler-file: an empty path"),
    (["matmul", "a.npy", "b.npy", "-o", "c.npy", "--scheduler", ""],
     "argument --scheduler: an empty address"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_empty_path_or_too_many_workers_is_a_bad_argument(tmp_path, monkeypatch, capfd,
                                                              argv, said):
    """An empty --report, --profile, --scheduler-file or --scheduler was read as not given:
    the demo ran without its report, and matmul without a profile or locally instead of on
    a cluster, with status 0. Each is one line, status 2, before anything is read."""
    monkeypatch.chdir(tmp_path)
    err = _refused_in_one_line(capfd, argv, argv[0])
    assert said in err, err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_probe_failure_names_the_mpi_notice_not_its_rule():
    from distmm.cli.calibrate import _stderr_line

    notice = ("-" * 74 + "\nprterun has detected an attempt to run as root.\n\nRunning as root is "
              "discouraged.\n" + "-" * 74 + "\n")
    assert _stderr_line(notice) == "prterun has detected an attempt to run as root."
    assert _stderr_line("Traceback (most recent call last):\n  x\nValueError: bad\n") == \
        "ValueError: bad"
    assert _stderr_line("\n---\n") == "no output"


@pytest.mark.slow
def test_debug_before_a_command_that_parses_its_own_options(tmp_path):
    missing = tmp_path / "missing.json"
    r = run_cli("--debug", "trace", "--from-json", missing)
    assert r.returncode == 2, r.stderr  # was argparse's "unrecognized arguments"
    assert "Traceback" in r.stderr and r.stderr.rstrip().endswith(f"{missing}")
    r = run_cli("trace", "--from-json", missing)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


# ---------------------------------------------------------------- secondary commands without a GPU


def _refused_in_one_line(capfd, argv, command):
    """``distmm ARGV`` in this process ends with status 2 and one line ``distmm COMMAND:
    error: ...`` on stderr, nothing on stdout."""
    from distmm.cli import main

    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    out, err = capfd.readouterr()
    assert status == 2 and out == "", (argv, status, out, err)
    assert err.startswith(f"distmm {command}: error: ") and err.count("\n") == 1, (argv, err)
    return err


@pytest.mark.parametrize("argv, said", [
    (["tune", "--size", "-5"], "argument --size: '-5' must be at least 1"),
    (["tune", "--confirm-size", "0"], "argument --confirm-size: '0' must be at least 1"),
    (["tune", "--processes", "0"], "argument --processes: '0' must be at least 1"),
    (["tune", "--max-configs", "nan"], "argument --max-configs: 'nan' is not an integer"),
    (["tune", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["tune", "--cache", ""], "argument --cache: an empty path"),
    (["tune", "--show", "--records", "r"], "--records writes a tuning run's measurements"),
    (["trace", "--n", "0"], "argument --n: '0' must be at least 1"),
    (["trace", "--device-memory-limit", "-1"], "'-1' is not a size such as 8GB"),
    (["trace", "-o", "t.txt"], "'.txt' is no image format distmm trace writes"),
    (["trace", "-o", ""], "-o: an empty path"),
    (["trace", "--from-json", ""], "--from-json: an empty path"),
    (["trace", "--from-json", "t.json", "--json", "u.json"], "--json saves a traced run's"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_secondary_commands_refuse_bad_options_in_one_line(tmp_path, monkeypatch, capfd, argv,
                                                            said):
    """tune and trace printed argparse's usage block over several lines and took a negative
    or zero size (tune ran into the GPU work with it); trace wrote ``-o t`` as ``t.png`` and
    failed on ``t.txt`` only after its run. Each is one line, status 2, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    err = _refused_in_one_line(capfd, argv, argv[0])
    assert said in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, said", [
    (["bench", "nope.toml"], "No such file or directory: nope.toml"),
    (["bench", "adir"], "Not a file: adir"),
    (["report", "nope.jsonl", "-o", "out"], "No such file or directory: nope.jsonl"),
    (["report", "adir", "-o", "out"], "Not a file: adir"),
    (["cluster", "--scheduler-file", "nofolder/s.json"], "nofolder/s.json: no such directory"),
    (["cluster", "--scheduler-file", "adir"], "--scheduler-file adir is a directory"),
    (["trace", "--n", "-5"], "argument --n: '-5' must be at least 1"),
    (["trace", "--dtype", "int7"], "argument --dtype: invalid choice: 'int7'"),
    (["trace", "-o", "nofolder/t.png"], "No such folder for the output: nofolder/t.png"),
    (["trace", "-o", "adir"], "a folder, not a file: adir"),
    (["trace", "--from-json", "adir"], "Is a directory: adir"),
    (["demo", "-n", "0"], "argument -n/--n: '0' must be at least 1"),
    (["demo", "--n", "0"], "argument -n/--n: '0' must be at least 1"),  # as trace spells it
    (["demo", "-n", "-5"], "argument -n/--n: '-5' must be at least 1"),
    (["demo", "--dtype", "int7"], "argument --dtype: 'int7' is not a dtype matmul takes"),
    # was: the product ran and the report was written into a folder made for it
    (["demo", "-n", "64", "--engine", "dask", "--report", "nofolder/r.html"],
     "No such folder for the output: nofolder/r.html"),
    (["demo", "-n", "64", "--engine", "dask", "--report", "adir"],
     "a folder, not a file (--report): adir"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_missing_or_folder_path_and_bad_sizes_are_one_line_before_any_work(
        tmp_path, monkeypatch, capfd, argv, said):
    """bench's study, report's records, cluster's scheduler file, trace's and demo's outputs:
    a path that is missing or a folder, and trace's and demo's bad sizes and dtypes, are one
    line naming what was wrong, status 2, and nothing is made."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    err = _refused_in_one_line(capfd, argv, argv[0])
    assert said in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["adir"]
    assert list((tmp_path / "adir").iterdir()) == []


@pytest.mark.parametrize("argv, said", [
    (["--memory-limit", "inf"], "'inf' is neither a fraction"),
    (["--memory-limit", "1e400"], "'1e400' is neither a fraction"),
    (["--memory-limit", ""], "'' is not a memory limit"),
    (["--memory-limit", "4096"], "'4096' is 4096 bytes: a worker needs more"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cluster_refuses_memory_limits_no_worker_runs_under(capfd, argv, said):
    """--memory-limit inf / 1e400 ended in an OverflowError traceback; '' (dask reads it as
    1 byte) or 4096 (bytes, not MiB) started workers that their nannies restarted without end.
    Parsed only: a cluster is never started here."""
    from distmm.cli.commands import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["cluster", *argv])
    err = capfd.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("distmm cluster: error: argument --memory-limit: ") and said in err


def test_cluster_refuses_an_empty_scheduler_file(tmp_path, monkeypatch, capfd):
    """--scheduler-file '' said the current folder 'is a directory'."""
    from distmm.cli.serve import _check_scheduler_file

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--scheduler-file: an empty path"):
        _check_scheduler_file("", overwrite=False)


def test_tune_and_trace_say_they_need_a_gpu_in_the_error_line(tmp_path, monkeypatch, capfd):
    pytest.importorskip("matplotlib")
    from distmm.executor import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.chdir(tmp_path)
    err = _refused_in_one_line(capfd, ["tune", "--records", "r"], "tune")
    assert "needs cupy and a GPU" in err
    err = _refused_in_one_line(capfd, ["trace", "--json", "t.json"], "trace")
    assert "a traced run needs cupy and a GPU" in err and "--from-json" in err
    assert list(tmp_path.iterdir()) == []


def test_outputs_are_checked_where_they_would_be_written(tmp_path):
    """What tune (its cache, its records folder), calibrate, bench and trace write, checked
    before their work: nothing is made by the check."""
    from distmm.cli.outputs import check_writable

    (tmp_path / "f").write_text("")
    check_writable(tmp_path / "new" / "deeper" / "tune.json")
    check_writable(tmp_path / "records", folder=True)
    with pytest.raises(IsADirectoryError, match="a folder, not a file"):
        check_writable(tmp_path)
    with pytest.raises(NotADirectoryError, match="not a folder"):
        check_writable(tmp_path / "f", folder=True)
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        check_writable(tmp_path / "f" / "tune.json")
    with pytest.raises(FileNotFoundError, match="No such folder"):
        check_writable(tmp_path / "new" / "t.png", makes_folders=False)
    with pytest.raises(ValueError, match="an empty output path"):
        check_writable("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="writes under /proc")
def test_outputs_where_no_file_can_be_made_are_refused_before_any_work(tmp_path):
    """os.access lets root write in /proc, where no file can be made: the demo started its
    cluster and ran the product before its --report failed ('No such file or directory'), and
    calibrate, bench, tune and trace (their check_writable) measured before theirs did. A
    file is made and removed in the folder now: one line, status 2, before any work."""
    from distmm.cli.outputs import check_writable

    for path, folder in (("/proc/tune.json", False), ("/proc/new/deeper/cal.json", False),
                         ("/proc/records", True)):
        with pytest.raises(PermissionError, match="cannot write in /proc"):
            check_writable(path, folder=folder)
    r = run_cli("demo", "-n", 64, "--engine", "dask", "--workers", 1, "--report",
                "/proc/r.html")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert re.fullmatch(r"distmm demo: error: cannot write in /proc \((No such file or "
                        r"directory|Permission denied)\): /proc/r.html\n", r.stderr), r.stderr


@pytest.mark.parametrize("what", ["scheduler-file", "matmul output", "profile"])
def test_the_checks_before_work_follow_no_link_where_they_try_a_file(tmp_path, what):
    """Each check makes and removes a file where the command will write first (the
    scheduler file's and the output's staged names, the profile's temporary): distmm
    cluster's opened a link there, emptied the file it pointed to and removed the link.
    Whatever is at that name is left as it was."""
    from distmm.cli.io import check_report, check_writable, parse_target
    from distmm.cli.serve import _check_scheduler_file

    victim = tmp_path / "victim"
    victim.write_text("kept")
    pid = os.getpid()
    check, name = {
        "scheduler-file": (lambda: _check_scheduler_file(str(tmp_path / "s.json"), False),
                           f".s.json.distmm-partial-{pid}"),
        "matmul output": (lambda: check_writable(parse_target(str(tmp_path / "c.npy"))),
                          f".c.npy.distmm-partial-{pid}"),
        "profile": (lambda: check_report("--profile", tmp_path / "p.json", ()),
                    f"p.json.tmp-{pid}")}[what]
    (tmp_path / name).symlink_to(victim)
    check()
    assert victim.read_text() == "kept" and (tmp_path / name).is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "victim"])


def test_calibration_file_is_readable_as_open_makes_files_and_replaces_a_link(tmp_path):
    """save() left mkstemp's 0600 on a new calibration (unreadable to the group sharing it)."""
    import stat

    from distmm.cli.calibrate import save
    from distmm.plan_model import default_calibration

    umask = os.umask(0o022)
    try:
        save(default_calibration(), tmp_path / "new.json")
        old = tmp_path / "old.json"
        old.write_text("{}")
        old.chmod(0o640)
        save(default_calibration(), old)
        (tmp_path / "elsewhere.json").write_text("keep")
        (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
        save(default_calibration(), tmp_path / "link.json")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    assert not (tmp_path / "link.json").is_symlink()
    assert (tmp_path / "elsewhere.json").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.json", "link.json",
                                                          "new.json", "old.json"]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["workers-starting", "mid-product"])
def test_ctrl_c_during_the_demo_s_cluster_is_one_line_and_130(when):
    """Ctrl-C (SIGINT to the whole foreground group) while the demo's embedded cluster
    started printed the KeyboardInterrupt traceback of each worker process still importing,
    and mid-product each worker's warning of its cancelled task: now only the command's line
    (the workers start with SIGINT blocked; their preload drops a closing worker's cancelled
    tasks), and no process is left."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "distmm", "demo", "--engine", "dask", "-n",
                             "3000", "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if when == "workers-starting":  # a worker process has been spawned: it imports
            deadline = time.monotonic() + 60
            while not any("spawn_main" in " ".join(p.cmdline())
                          for p in psutil.Process(proc.pid).children(recursive=True)):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
        else:  # the plan is printed before the full-size warm-up product
            for line in proc.stdout:
                if line.startswith("memory"):
                    break
            time.sleep(0.3)
        kids = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err == "distmm demo: error: interrupted (SIGINT)\n", err
    _, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, alive


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "SIGTERM"])
def test_calibrate_stopped_during_its_tcp_probe_says_one_line_and_leaves_nothing(tmp_path, how):
    """Ctrl-C (SIGINT to the whole foreground group) while the TCP probe's LocalCluster ran
    printed each worker's KeyboardInterrupt traceback, and SIGTERM multiprocessing's
    'leaked semaphore objects' warning, after the command's line."""
    import signal
    import time

    import psutil

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="^ofi")
    out = tmp_path / "cal.json"
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "calibrate", "--quick", "-o",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "TCP between" in line:
            break
    assert lines and "TCP between" in lines[-1], "".join(lines)
    time.sleep(1.0)  # the probe's cluster is starting or measuring
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert kids
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    try:  # left worker processes held stderr open: read it with a limit
        _, rest = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for kid in kids:
            kid.kill()
        proc.kill()
        raise
    assert proc.returncode == (130 if how == "ctrl-c" else 143), rest
    said = "interrupted (SIGINT)" if how == "ctrl-c" else "terminated by SIGTERM"
    assert rest == f"distmm calibrate: error: {said}\n", rest
    gone, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, alive
    assert list(tmp_path.iterdir()) == []


def test_a_configured_dask_engine_names_the_commands_scheduler_options(tmp_path):
    """``DISTMM_ENGINE=dask distmm matmul`` without a scheduler gave the Python API's hint
    ("pass client= or create one (distributed.Client(...))"): it names the configuration and
    the command's --scheduler/--scheduler-file, in one line, and writes nothing."""
    np.save(tmp_path / "a.npy", np.ones((3, 2)))
    np.save(tmp_path / "b.npy", np.ones((2, 4)))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                env={"DISTMM_ENGINE": "dask", "DASK_DISTMM__ENGINE": None})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("distmm matmul: error: distmm.engine dask (DISTMM_ENGINE) runs "
                               "on a Dask cluster: pass --scheduler ADDRESS or "
                               "--scheduler-file FILE"), r.stderr
    assert "client=" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a.npy", "b.npy"]


def test_resume_or_profile_beside_another_engine_reads_as_a_sentence(tmp_path):
    """The refusal of --profile (or --resume) beside --engine said "--profile run the MPI
    engine's ...": one flag takes "runs", two "run"."""
    argv = ["matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
            "--engine", "local"]
    for flags, said in ((["--profile", tmp_path / "p.json"], "--profile runs the MPI engine's"),
                        (["--resume", "--profile", tmp_path / "p.json"],
                         "--resume and --profile run the MPI engine's")):
        r = run_cli(*argv, *flags)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"distmm matmul: error: {said} file-to-file product" in r.stderr, r.stderr
