"""``distmm bench STUDY.toml``: the study schema (bad files refused with one line naming the
key, before anything runs), the configurations a study expands to, the records file (whole
lines only, also when the study is killed), and a tiny CPU study run end to end in a
subprocess (the local engine, a real Dask cluster of 2 worker processes, ``mpiexec -n 2``),
its records fed to ``distmm report``."""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import pause_at
from distmm.cli.records import RecordWriter, append_record, json_lines, load
from distmm.cli.study import load_study, parse_study, weak_shape

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ROOT / "bench" / "studies"
REQUIRED = ("run", "benchmark", "variant", "device", "dtype", "m", "n", "k", "seconds",
            "tflops", "relerr", "commit", "date", "series", "first_seconds", "study")

# what the end-to-end test runs: every engine at 2 workers / ranks, the local engine and
# the weak series also at 1, odd sizes, every row of C checked
TINY = """
name = "tiny-test"
device = "cpu"
dtypes = ["float64", "float32"]
repeats = 2
check_rows = 0
references = ["numpy", "dask.array"]

[[series]]
kind = "strong"
engines = ["local", "dask", "mpi"]
counts = [2]
sizes = [[67, 45, 51]]
chunk = 32

[[series]]
kind = "strong"
engines = ["local"]
counts = [1]
sizes = [[67, 45, 51]]

[[series]]
kind = "weak"
engines = ["mpi"]
counts = [1, 2]
sizes_per_device = [40]
dtypes = ["float64"]
"""


def _distmm(*argv, env=None, timeout=180, cwd=None):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "distmm", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def _study(tmp_path: Path, text: str, name: str = "study.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the schema

GOOD = {"device": "cpu", "series": [{"kind": "strong", "engines": ["dask"], "counts": [1, 2],
                                     "sizes": [100]}]}


def _with(top=None, **series):
    data = json.loads(json.dumps(GOOD))
    data.update(top or {})
    data["series"][0].update(series)
    for key in [k for k, v in data["series"][0].items() if v is None]:
        del data["series"][0][key]
    return data


@pytest.mark.parametrize("data, key", [
    (_with({"colour": "red"}), "colour: unknown key"),
    (_with({"repeat": 3}), "repeat: unknown key; did you mean 'repeats'? (known: benchmark,"),
    (_with(count=[1]), "series[0].count: unknown key; did you mean 'counts'? (known: backends,"),
    (_with({"kind": "weak"}), "kind: unknown key; 'kind' belongs to the [[series]] tables"),
    (_with(repeats=3), "series[0].repeats: unknown key; 'repeats' belongs to the study's top"),
    (_with(emulated=1, nodes=2), 'series[0].emulated: true, false or "all-links", got 1'),
    (_with({"device": "tpu"}), "device: 'tpu' is not one of cpu, gpu"),
    (_with({"dtypes": ["int8"]}), "dtypes: 'int8' is not one of"),
    (_with({"repeats": 0}), "repeats: an integer of at least 1"),
    (_with({"repeats": 2.5}), "repeats: an integer of at least 1"),
    (_with({"references": ["blas"]}), "references: 'blas' is not one of"),
    (_with({"references": ["cublas"]}), "references: cublas is a GPU reference"),
    (_with({"mpiexec": "mpiexec"}), "mpiexec: a non-empty list of strings"),
    (_with({"threads_per_rank": 0}), "threads_per_rank:"),
    (_with({"name": "../x"}), "name: '../x' is not a file-name stem"),
    ({"device": "cpu"}, "series: at least one [[series]] table"),
    (_with(kind="fast"), "series[0].kind: 'fast' is not one of strong, weak"),
    (_with(kind=None), "series[0].kind: missing"),
    (_with(engines=["spark"]), "series[0].engines: 'spark' is not one of local, dask, mpi"),
    (_with(engines=[]), "series[0].engines: a non-empty list"),
    (_with(counts=[0, 2]), "series[0].counts: a non-empty list of integers of at least 1"),
    (_with(counts=[2, 2]), "series[0].counts: [2, 2] repeats a count"),
    (_with(kind="weak", sizes=None, sizes_per_device=[8], counts=[1, 10**18]),  # hung
     "series[0].counts: 1000000000000000000 is more than a study runs (at most 1048576)"),
    (_with(sizes=[[1, 2]]), "series[0].sizes: [1, 2] is neither"),
    (_with(sizes=[4096, 4096, 8192]),
     "series[0].sizes: [4096, 4096, 8192] repeats a size (4096, entries 0 and 1)"),
    (_with(sizes=[64, [30, 40, 50], [64, 64, 64]]),
     "series[0].sizes: [64, [30, 40, 50], [64, 64, 64]] repeats a size (64 and [64, 64, 64], "
     "entries 0 and 2)"),
    (_with(kind="weak", sizes=None, sizes_per_device=[64, 32, 64]),
     "series[0].sizes_per_device: [64, 32, 64] repeats a size (64, entries 0 and 2)"),
    (_with(sizes=None), "series[0].sizes: missing"),
    (_with(backends=["cublas"]), "series[0].backends: 'cublas' is not one of auto, blas, numba"),
    (_with(sizes_per_device=[64]), "series[0].sizes_per_device: belongs to a weak series"),
    (_with(kind="weak"), "series[0].sizes: belongs to a strong series"),
    (_with(kind="weak", sizes=None), "series[0].sizes_per_device: missing"),
    (_with(kind="weak", sizes=None, sizes_per_device=[64], counts=[4]),
     "series[0].counts: a weak series needs two counts or more"),
    (_with(engines=["mpi"], chunk=64), "series[0].chunk: only the Dask engine has chunks"),
    (_with({"references": ["dask.array"]}, engines=["mpi"]), "references: dask.array is measured"),
    (_with({"device": "gpu"}, engines=["local"], counts=[1, 2]), "series[0].counts: the local engine"),
    (_with({"references": ["numpy"]}, references=["dask.array"]),
     "series[0].references: dask.array is not among the study's references (numpy)"),
    (_with(references="numpy"), "series[0].references: a list of"),
    (_with({"precision": "fp8"}), "precision: 'fp8' is not one of highest, tf32, bf16, fp16"),
    (_with({"precision": "tf32", "dtypes": ["float64"]}), "dtypes: precision tf32 takes float32"),
    (_with({"precision": "bf16", "dtypes": ["float32"], "references": ["numpy"]}),
     "references: numpy has no bf16 mode"),
    (_with({"precision": "tf32", "dtypes": ["float32"]}, dtypes=["float64"]),
     "series: precision tf32 takes float32 operands"),
    (_with(sizes=[100, 2**63 - 1]), "series[0].sizes: 9223372036854775807 x 9223372036854775807"
                                    " x 9223372036854775807 overflows"),
    (_with(sizes=[[2**31, 2**31, 1]]), "series[0].sizes: 2147483648 x 2147483648 x 1 overflows"),
    (_with(kind="weak", sizes=None, sizes_per_device=[2**29], k=1, counts=[1, 4]),
     "series[0].sizes_per_device: 1073741824 x 1073741824 x 1 at count 4 overflows"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_study_refused_naming_the_key(data, key):
    with pytest.raises(ValueError) as info:
        parse_study(data, where="s.toml")
    message = str(info.value)
    assert message.startswith("s.toml: ") and key in message, message
    assert "\n" not in message


def test_good_study_expands_to_named_configurations():
    study = parse_study({
        "device": "cpu", "dtypes": ["float32", "float64"], "references": ["numpy", "dask.array"],
        "series": [{"kind": "strong", "engines": ["local", "dask", "mpi"], "counts": [1, 2],
                    "sizes": [96, [30, 40, 50]], "backends": ["auto", "numba"]},
                   {"kind": "weak", "engines": ["mpi"], "counts": [1, 2, 4],
                    "sizes_per_device": [64], "k": 32, "dtypes": ["float64"]}]}, default_name="s")
    configs = study.configurations()
    variants = {c.variant for c in configs}
    assert {"numpy", "distmm-local@1workers", "distmm-local-numba@2workers", "distmm-dask@2workers",
            "dask.array@1workers", "distmm-mpi@2ranks", "distmm-mpi-weak@4ranks"} <= variants
    # strong: 3 engines x 2 counts x 2 sizes x 2 dtypes x 2 backends; dask.array: 2 x 2 x 2;
    # weak: 3 counts; numpy: one per problem (2 strong sizes x 2 dtypes + 3 weak)
    assert len(configs) == 48 + 8 + 3 + 7
    assert len(set(configs)) == len(configs)
    weak = sorted((c.count, (c.m, c.n, c.k)) for c in configs if c.variant.startswith("distmm-mpi-weak"))
    assert weak == [(1, (64, 64, 32)), (2, (128, 64, 32)), (4, (128, 128, 32))]
    # the in-process work of a problem comes before any cluster; clusters and launches by count
    kinds = [c.engine for c in configs]
    assert max(i for i, e in enumerate(kinds) if e in ("numpy", "local")) < kinds.index("dask")
    assert max(i for i, e in enumerate(kinds) if e == "dask") < kinds.index("mpi")
    dask_counts = [c.count for c in configs if c.engine == "dask"]
    assert dask_counts == sorted(dask_counts)


def test_series_references_are_a_subset_measured_beside_that_series_only():
    study = parse_study({
        "device": "cpu", "references": ["numpy", "dask.array"],
        "series": [{"kind": "strong", "engines": ["dask"], "counts": [1, 2], "sizes": [96]},
                   {"kind": "strong", "engines": ["dask", "mpi"], "counts": [2], "sizes": [128],
                    "references": []},
                   {"kind": "strong", "engines": ["mpi"], "counts": [2], "sizes": [160],
                    "references": ["numpy"]}]}, default_name="s")
    refs = sorted((c.reference, c.m, c.count) for c in study.configurations() if c.reference)
    assert refs == [("dask.array", 96, 1), ("dask.array", 96, 2), ("numpy", 96, 1),
                    ("numpy", 160, 1)]


def test_weak_shape_keeps_c_per_device():
    for count in (1, 2, 3, 4, 6, 8, 12, 16):
        m, n, k = weak_shape(count, 100, 7)
        assert m * n == count * 100 * 100 and m >= n and k == 7


def test_committed_studies_are_valid():
    if not STUDIES.is_dir():
        pytest.skip("bench/studies is not beside this tests/ folder")
    names = sorted(p.stem for p in STUDIES.glob("*.toml"))
    assert {"cpu-scaling", "gpu-one", "gpu-scaling", "tiny"} <= set(names)
    for path in STUDIES.glob("*.toml"):
        assert load_study(path).configurations(), path


@pytest.mark.slow
def test_bad_file_is_one_line_and_exit_2(tmp_path):
    """At the command line: exit 2, one line naming the file and key, no traceback, and no
    records file made; a TOML syntax error and a missing file alike."""
    out = tmp_path / "out.jsonl"
    bad = _study(tmp_path, TINY.replace('kind = "weak"', 'kind = "weakest"'))
    broken = _study(tmp_path, "name = \n", "broken.toml")
    twice = _study(tmp_path, TINY.replace("sizes = [[67, 45, 51]]",
                                          "sizes = [[67, 45, 51], [67, 45, 51]]", 1), "twice.toml")
    for path, what in ((bad, "series[2].kind: 'weakest'"), (broken, "not a TOML file"),
                       (twice, "series[0].sizes: [[67, 45, 51], [67, 45, 51]] repeats a size"),
                       (tmp_path / "none.toml", "none.toml")):
        res = _distmm("bench", path, "-o", out, timeout=60)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("distmm bench: error: "), res.stderr
        assert what in lines[0] and "Traceback" not in res.stderr
        assert not out.exists()
    res = _distmm("bench", bad, "--dry-run", timeout=60)
    assert res.returncode == 2 and "series[2].kind" in res.stderr


def test_study_at_numpys_largest_array_is_taken():
    """float32 C of 2**31 x 2**30 is 2**63 bytes: one over numpy's largest array; one row
    less fits (a study file may name sizes this machine cannot hold: distmm bench refuses
    them before it runs, test_sizes_beyond_this_machines_memory_refused_before_anything_runs)."""
    with pytest.raises(ValueError, match="overflows"):
        parse_study(_with({"dtypes": ["float32"]}, sizes=[[2**31, 2**30, 1]]))
    parse_study(_with({"dtypes": ["float32"]}, sizes=[[2**31 - 1, 2**30, 1]]))


def test_unwritable_records_file_refused_before_anything_runs(tmp_path, capsys):
    """-o under a file, to a file that cannot be appended to, into a folder that cannot be
    written, or naming the study file: refused (exit 2) before the first measurement, not
    after every record of the study was lost (or appended to the study file)."""
    from distmm.cli.bench import run_bench
    from distmm.cli.exits import exit_status

    study = _study(tmp_path, MPI_ONLY.replace('"mpi"]', ']') % '"mpiexec"')
    (tmp_path / "file").write_text("")
    cases = [(tmp_path / "file" / "sub" / "out.jsonl", NotADirectoryError, "file"),
             (tmp_path / "out-folder/", IsADirectoryError, "out-folder"),
             ("", ValueError, "-o '' names no file"),
             (study, ValueError, "the study file itself")]
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "old.jsonl").write_text("")
    (locked / "old.jsonl").chmod(0o444)
    locked.chmod(0o555)
    if not os.access(locked, os.W_OK):  # not as root, which writes anyway
        cases += [(locked / "new.jsonl", PermissionError, "locked"),
                  (locked / "old.jsonl", PermissionError, "old.jsonl")]
    try:
        for out, error, named in cases:
            with pytest.raises(error) as info:
                run_bench(str(study), str(out) + ("/" if str(out).endswith("folder") else ""))
            assert exit_status(info.value) == 2 and named in str(info.value)
            assert "[1/" not in capsys.readouterr().out
        assert not (tmp_path / "out-folder").exists()
        assert study.read_text() == MPI_ONLY.replace('"mpi"]', ']') % '"mpiexec"'
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("kind", ["strong", "weak"])
def test_sizes_beyond_this_machines_memory_refused_before_anything_runs(tmp_path, kind):
    """A size whose A, B and C are many times this machine's memory: exit 2 with one line
    naming the key and the configuration before anything runs, no records file (before,
    the configurations ahead of it were measured, then each of its own failed in turn and
    the study ended with status 1)."""
    import psutil

    side = 4 * int((psutil.virtual_memory().total / 8) ** 0.5)  # C alone: 16 times memory
    text = MPI_ONLY.replace('"mpi"]', ']') % '"mpiexec"'  # numpy and the local engine
    if kind == "strong":
        text = text.replace("sizes = [33]", f"sizes = [33, {side}]")
    else:
        text = text.replace('kind = "strong"', 'kind = "weak"').replace(
            "sizes = [33]", f"sizes_per_device = [33, {side}]").replace(
            "counts = [1]", "counts = [1, 2]")
    key = "sizes" if kind == "strong" else "sizes_per_device"
    out = tmp_path / "out.jsonl"
    res = _distmm("bench", _study(tmp_path, text), "-o", out, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert (f"study.toml: {key}: numpy float64 {side}x{side}x{side} ({kind}) needs"
            in lines[0] and "GiB of memory" in lines[0]), lines[0]
    assert not res.stdout and not out.exists()


def test_operands_this_machine_cannot_hold_fail_their_problem_only(tmp_path, capsys,
                                                                   monkeypatch):
    """A size whose A numpy cannot allocate (2 EiB, beyond any address space), past the
    check of the machine's memory: that problem's configurations fail in one line each,
    the others are measured and recorded, and the study ends with status 1 (it stopped the
    whole study, exit 2, and left the problems after it unmeasured)."""
    from distmm.cli import bench
    from distmm.cli.bench import run_bench

    monkeypatch.setattr(bench, "_host_memory", lambda: 2**64)
    out = tmp_path / "out.jsonl"
    study = _study(tmp_path, MPI_ONLY.replace('"mpi"]', ']').replace(
        "sizes = [33]", "sizes = [[536870912, 1, 536870912], 33]") % '"mpiexec"')
    assert run_bench(str(study), str(out)) == 1
    text = capsys.readouterr().out
    assert text.count("FAILED (MemoryError") == 2, text
    assert sorted(r["m"] for r in load([out])) == [33, 33]
    assert {r["host"] for r in load([out])} == {platform.node()}  # report keeps hosts apart


def test_dry_run_lists_configurations(tmp_path):
    res = _distmm("bench", _study(tmp_path, TINY), "--dry-run", timeout=60)
    assert res.returncode == 0, res.stderr
    listed = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    assert len(listed) == len(load_study(tmp_path / "study.toml").configurations()) == 16
    assert "distmm-mpi-weak@2ranks float64 80x40x40 (weak): mpiexec -n 2" in res.stdout
    assert "Dask clusters: 2 workers; mpiexec launches: 1, 2 ranks" in res.stdout
    assert not list(tmp_path.glob("*.jsonl"))


MPI_ONLY = """
device = "cpu"
repeats = 1
references = ["numpy"]
mpiexec = [%s]
[[series]]
kind = "strong"
engines = ["local", "mpi"]
counts = [1]
sizes = [33]
"""


def test_missing_launcher_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out.jsonl"
    res = _distmm("bench", _study(tmp_path, MPI_ONLY % '"no-such-mpiexec", "-x"'), "-o", out,
                  timeout=60)
    assert res.returncode == 2, res.stderr
    assert "mpiexec: 'no-such-mpiexec' is not on PATH" in res.stderr and not res.stdout
    assert not out.exists()


#: a launcher that starts anything but the ranks' program (it passes the check before the
#: study, then fails the launch itself)
FAILS_THE_RANKS = ('"sh", "-c", \'case "$*" in *bench_rank*) exit 3;; esac; shift 2; '
                   'exec "$@"\', "launcher"')


def test_failed_launch_is_reported_and_the_rest_recorded(tmp_path):
    """A launch that fails: the MPI configuration gets a FAILED line and no record, the
    others their records, and the study exits 1."""
    out = tmp_path / "out.jsonl"
    res = _distmm("bench", _study(tmp_path, MPI_ONLY % FAILS_THE_RANKS), "-o", out, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "[3/3] distmm-mpi@1ranks float64 33x33x33 (strong): FAILED" in res.stdout
    assert sorted(r["variant"] for r in load([out])) == ["distmm-local@1workers", "numpy"]
    assert "2 records" in res.stdout.splitlines()[-1] and "1 failed" in res.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["more ranks than slots", "a launcher that fails"])
def test_a_launch_that_cannot_start_is_refused_before_anything_runs(tmp_path, mpiexec, mpi_env,
                                                                    what):
    """An MPI count beyond the machine's slots (Open MPI without --oversubscribe), or a
    launcher that fails: exit 2 with one line before anything runs, no records file (the
    configurations before the launch ran first, and the study failed at it)."""
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in mpi_env.items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
    if what == "a launcher that fails":
        text = MPI_ONLY % '"false"'
    else:
        text = (MPI_ONLY % f'"{mpiexec}"').replace("counts = [1]",
                                                    f"counts = [1, {os.cpu_count() + 1}]")
    res = _distmm("bench", _study(tmp_path, text), "-o", out, timeout=120, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not start on this machine" in lines[0], res.stderr
    if what == "more ranks than slots":
        assert f"mpiexec: {os.cpu_count() + 1} ranks" in lines[0]
        assert 'add "--oversubscribe"' in lines[0], lines[0]
    assert not res.stdout and not out.exists()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_runner_stops_its_ranks_and_leaves_no_files(tmp_path, mpi_env, sig):
    """The runner killed while mpiexec measures: with SIGTERM it stops the launch and exits
    143; with SIGKILL (no handler) the ranks notice it has gone and stop before their next
    configuration. Either way no record comes after, and no temporary file is left (the
    ranks' status file stayed after a SIGTERM; after a SIGKILL the ranks measured the whole
    launch and left the spec and status files)."""
    study = _study(tmp_path, """
name = "killed-mpi"
device = "cpu"
repeats = 60
references = []
[[series]]
kind = "strong"
engines = ["mpi"]
counts = [2]
sizes = [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211]
""")
    out, temp = tmp_path / "killed.jsonl", tmp_path / "temp"
    temp.mkdir()
    env = dict(mpi_env, OMPI_MCA_btl="^ofi", TMPDIR=str(temp))
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "bench", str(study), "-o", str(out)],
                            stdout=subprocess.PIPE, text=True, env=env)
    import psutil

    family = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.stdout.readline().startswith("[1/12]"):
                break
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == (143 if sig == signal.SIGTERM else -9)
        deadline = time.monotonic() + 60  # the ranks' next configuration
        while list(temp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list(temp.iterdir())
        psutil.wait_procs(family, timeout=30)
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        records = load([out])
        assert 1 <= len(records) < 12
        time.sleep(2)
        assert len(load([out])) == len(records)
        assert out.read_text().endswith("\n")
    finally:
        _kill_all(proc, family)


@pytest.mark.slow
def test_ctrl_c_during_a_dask_series_is_one_line_and_130(tmp_path):
    """Ctrl-C at a terminal (SIGINT to the whole foreground group) while a Dask cluster
    measures: the study's workers ignore it (distmm.cli.worker_setup, as distmm cluster's
    do) and the runner closes them, so the study ends with 130 and one line, no worker's
    traceback, no process of it left, whole records only. (Before: the workers died with
    KeyboardInterrupt tracebacks, and a runner whose signal a library swallowed went on to
    its next configuration and hung on a cluster without workers.)"""
    import psutil

    study = _study(tmp_path, """
name = "ctrl-c"
device = "cpu"
repeats = 40
references = ["dask.array"]
[[series]]
kind = "strong"
engines = ["dask"]
counts = [2]
sizes = [300, 301, 302, 303]
chunk = 64
""")
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "bench", str(study), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    family = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.stdout.readline().startswith("[1/8]"):
                break
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family  # the cluster's processes
        time.sleep(0.3)  # into the next configuration's calls
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
        assert err.strip().splitlines() == ["distmm bench: error: interrupted (SIGINT)"], err
        psutil.wait_procs(family, timeout=30)
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert 1 <= len(load([out])) < 8 and out.read_text().endswith("\n")
    finally:
        _kill_all(proc, family)


@pytest.mark.slow
@pytest.mark.mpi
def test_ctrl_c_during_an_mpi_launch_is_one_line_and_130(tmp_path, mpi_env):
    """Ctrl-C at a terminal (SIGINT to the whole foreground group) while mpiexec measures:
    the runner stops the launch, so the study ends with 130 and its one line, whole records
    only and no rank left (before, the launcher got the SIGINT too and printed its own
    "Abort is in progress...hit ctrl-c again" beside the runner's line). The SIGINT is sent
    once rank 0 is held in the launch's second configuration, so the first configuration's
    record is the only one."""
    import psutil

    study = _study(tmp_path, """
name = "ctrl-c-mpi"
device = "cpu"
repeats = 20
references = []
[[series]]
kind = "strong"
engines = ["mpi"]
counts = [2]
sizes = [300, 301, 302, 303, 304, 305]
""")
    out, site = tmp_path / "out.jsonl", tmp_path / "site"
    site.mkdir()
    # each configuration makes rank 0's blocks of A and B (bench_rank runs as __main__ under
    # mpi4py, out of the finder's reach): its third block is the second configuration's A
    pause_at(site, "distmm.cli.blocks", "block", call=3, rank=0)
    env = dict(mpi_env, OMPI_MCA_btl="^ofi",
               PYTHONPATH=os.pathsep.join([str(site), mpi_env["PYTHONPATH"]]))
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "bench", str(study), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    family = []
    try:
        deadline = time.monotonic() + 120
        while not (site / "paused").exists():  # rank 0 in the second configuration
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "rank 0 never reached the second configuration"
            time.sleep(0.01)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family  # the launcher and its ranks
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
        assert err.strip().splitlines() == ["distmm bench: error: interrupted (SIGINT)"], err
        psutil.wait_procs(family, timeout=30)
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        (record,) = load([out])  # the first configuration's, whole; none of the second
        assert (record["m"], record["n"], record["k"]) == (300, 300, 300), record
        assert len(record["all_seconds"]) == 20 and out.read_text().endswith("\n")
    finally:
        _kill_all(proc, family)


def _kill_all(proc, family) -> None:
    """The study's runner and the processes it started, whatever the test left running."""
    import psutil

    if proc.poll() is None:
        proc.kill()
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


# ---------------------------------------------------------------- the records file


def test_record_writer_appends_whole_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMM_COMMIT", "abc1234")
    w = RecordWriter("scaling", "Test CPU 9000", path=tmp_path / "r.jsonl", study="s")
    w.add("numpy", "float64", 3, 5, 7, 0.5, 1e-16, series="strong")
    append_record(w.path, {"extra": 1})
    w.add("distmm-mpi@2ranks", "float32", 4, 4, 4, 0.25, None, ranks=2)
    first, extra, third = [value for _, value in json_lines(w.path)]  # load() takes records only
    assert extra == {"extra": 1} and w.path.read_text().count("\n") == 3
    assert (first["commit"], first["study"], first["series"]) == ("abc1234", "s", "strong")
    assert first["tflops"] == pytest.approx(2 * 3 * 5 * 7 / 0.5 / 1e12)
    assert third["ranks"] == 2 and third["relerr"] is None and third["run"] == first["run"]


def test_records_of_a_tree_with_uncommitted_changes_say_so(tmp_path, monkeypatch):
    """A tracked file changed since the commit: the records carry ``commit_dirty: true``
    beside the commit (they named a commit whose code was not what ran); a clean tree, or
    a file git does not track, adds nothing."""
    from distmm.cli import records
    from distmm.cli.records import git_dirty

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*argv):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=repo,
                       check=True, capture_output=True)

    git("init", "-q")
    (repo / "kernel.py").write_text("x = 1\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "one")
    (repo / "notes.txt").write_text("untracked\n")
    assert git_dirty(repo) is False
    (repo / "kernel.py").write_text("x = 2\n")
    assert git_dirty(repo) is True
    assert git_dirty(tmp_path / "no-such-folder") is None
    for dirty in (True, False):
        monkeypatch.setattr(records, "git_dirty", lambda: dirty)
        w = RecordWriter("scaling", "Test CPU", path=tmp_path / f"{dirty}.jsonl", study="s")
        w.add("numpy", "float64", 3, 5, 7, 0.5, 1e-16, series="strong")
        (rec,) = load([w.path])
        assert rec.get("commit_dirty") is (True if dirty else None) and rec["study"] == "s"


@pytest.mark.slow
def test_killed_study_keeps_whole_records(tmp_path):
    """SIGKILL in the middle of a study: the records written before stay, every line is one
    whole record, and the file can be appended to by the next run."""
    study = _study(tmp_path, """
name = "killed"
device = "cpu"
repeats = 30
references = ["numpy"]
[[series]]
kind = "strong"
engines = ["local"]
counts = [1, 2]
sizes = [700, 701, 702, 703, 704, 705]
""")
    out = tmp_path / "killed.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "bench", str(study), "-o", str(out)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 3 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("["):
                seen += 1
        assert seen == 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    text = out.read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    assert 3 <= len(records) < 18
    assert all(r["seconds"] > 0 and len(r["all_seconds"]) == 30 for r in records)


@pytest.mark.slow
def test_two_studies_at_once_into_one_file_are_two_runs_in_the_report(tmp_path):
    """Two quick distmm bench runs started together, appending to one records file: each
    run's records have their own run id, and distmm report draws two strong series and
    pairs each with its own run's numpy (before, both runs started in the same second got
    one id, and the report took the median of the two runs' records as one series and
    shared one numpy time between them)."""
    study = _study(tmp_path, """
name = "twice"
device = "cpu"
repeats = 1
references = ["numpy"]
[[series]]
kind = "strong"
engines = ["local"]
counts = [1, 2]
sizes = [48]
""")
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "distmm", "bench", str(study), "-o",
                               str(out)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    for proc in procs:
        assert proc.communicate(timeout=180)[0].count("\n[") == 3 and proc.returncode == 0
    records = load([out])
    runs = sorted({r["run"] for r in records})
    assert len(runs) == 2 and [sum(r["run"] == run for r in records) for run in runs] == [3, 3]
    res = _distmm("report", out, "-o", tmp_path / "report", timeout=120)
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    for run in runs:
        numpy = next(r["seconds"] for r in records if r["run"] == run and r["variant"] == "numpy")
        rows = [row for row in md.splitlines() if f"| {run} |" in row]
        assert sum("| distmm-local |" in row for row in rows) == 2, md  # its strong series
        shares = [row for row in rows if "| numpy |" in row]
        assert len(shares) == 2 and all(f"| {numpy:.4g} |" in row for row in shares), md


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.mpi
def test_a_reduced_precision_study_runs_every_engine_in_it(tmp_path, mpi_env):
    """precision = "tf32" on CPU (emulated): the local engine, a Dask cluster and mpiexec -n 2
    each compute in TF32, which shows in their error against float64 (far above float32's,
    within TF32's bound), and every record says the precision."""
    study = _study(tmp_path, """
name = "tf32-test"
device = "cpu"
dtypes = ["float32"]
precision = "tf32"
repeats = 1
check_rows = 0
[[series]]
kind = "strong"
engines = ["local", "dask", "mpi"]
counts = [2]
sizes = [[97, 61, 203]]
""")
    out = tmp_path / "records.jsonl"
    res = _distmm("bench", study, "-o", out, timeout=240,
                  env=dict(mpi_env, OMPI_MCA_btl="^ofi", NCCL_SOCKET_NTHREADS="2",
                           DASK_DISTMM_DEBUG__STREAM_PRIORITY="false",
                           DASK_DISTMM_DEBUG__LATER_PIECE_K="8192"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = load([out])
    assert sorted(r["engine"] for r in records) == ["dask", "local", "mpi"]
    assert all(r["nccl_env"]["NCCL_SOCKET_NTHREADS"] == "2" for r in records)
    assert all(r["stream_priority"] == "default" for r in records)  # the debug switches, kept
    assert all(r["later_piece_k"] == 8192 for r in records)
    for r in records:
        assert r["precision"] == "tf32" and r["relerr_ok"] is True, r
        assert 1e-5 < r["relerr"] < 5e-3, r  # float32 alone gives ~1e-7 here
    assert "configurations on" in res.stdout and "at precision tf32" in res.stdout


@pytest.mark.slow
def test_tiny_study_end_to_end_then_report(tmp_path, mpi_env):
    """The local engine, a Dask cluster of 2 worker processes and mpiexec -n 2 on odd sizes:
    every configuration's record has the schema, positive times and a relerr within bound,
    the progress has one line per configuration, and distmm report draws the series."""
    study = _study(tmp_path, TINY)
    out = tmp_path / "records.jsonl"
    res = _distmm("bench", study, "-o", out, env=dict(mpi_env, OMPI_MCA_btl="^ofi"), timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    configs = load_study(study).configurations()
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    assert len(progress) == len(configs) == 16, res.stdout
    records = load([out])
    assert sorted(r["variant"] + r["dtype"] for r in records) == sorted(
        c.variant + c.dtype for c in configs)
    assert len({r["run"] for r in records}) == 1
    for r in records:
        assert all(key in r for key in REQUIRED), r
        assert r["seconds"] > 0 and r["first_seconds"] > 0 and r["tflops"] > 0
        assert len(r["all_seconds"]) == 2 and r["relerr_ok"] is True
        assert r["relerr"] < (1e-5 if r["dtype"] == "float32" else 1e-14), r
        assert r["relerr_rows"] == r["m"]  # check_rows = 0: every row
        assert r["study"] == "tiny-test" and r["benchmark"] == "scaling"
        assert r["host"] == platform.node()  # the ranks' records too
        assert "stream_priority" not in r and "later_piece_k" not in r  # defaults: not noted
    by = {(r["variant"], r["dtype"]): r for r in records}
    assert by[("distmm-dask@2workers", "float32")]["workers"] == 2
    assert by[("dask.array@2workers", "float64")]["chunk"] == 32
    mpi2 = by[("distmm-mpi@2ranks", "float64")]
    assert mpi2["ranks"] == 2 and mpi2["threads_per_rank"] >= 1
    assert (mpi2["m"], mpi2["n"], mpi2["k"]) == (67, 45, 51)
    weak = by[("distmm-mpi-weak@2ranks", "float64")]
    assert (weak["m"], weak["n"], weak["k"], weak["per_device"]) == (80, 40, 40, 40)

    report = tmp_path / "report"
    res = _distmm("report", out, "-o", report, timeout=120)
    assert res.returncode == 0, res.stderr
    pngs = {p.name for p in report.glob("*.png")}
    assert any(p.startswith("strong-") for p in pngs) and any(p.startswith("weak-") for p in pngs)
    assert all((report / p).read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    md = (report / "report.md").read_text()
    assert "## Strong scaling" in md and "## Weak scaling" in md and "distmm-mpi-weak" in md
    assert "| distmm-local |" in md  # local at 1 and 2 threads: one strong series
    assert "distmm-dask@2workers" in md and "| numpy |" in md  # shares of the references
