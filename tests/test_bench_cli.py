"""Every script under bench/ answers ``--help`` in a fresh process without cupy or a GPU, and
bench.common writes the records BENCH_RECORDS.md defines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NOT_SCRIPTS = {"__init__.py", "records.py", "mpi_blocks.py",
               "nvmath_peer.py", "heat_peer.py"}  # helpers, not scripts
# CI runs the tests from a copy of tests/ alone (against the installed package): no bench/ there
pytestmark = pytest.mark.skipif(not (BENCH / "common" / "__init__.py").is_file(),
                                reason="bench/ is not beside this tests/ folder")
SCRIPTS = sorted(p for p in [*BENCH.glob("*.py"), *BENCH.glob("research/*.py")]
                 if p.name not in NOT_SCRIPTS)

# cupy made unimportable, so a script that imports it before parsing its arguments fails
NO_CUPY = "import sys; sys.modules['cupy'] = None; sys.argv = sys.argv[1:]; " \
          "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_the_scripts_are_found():
    names = {p.relative_to(BENCH).as_posix() for p in SCRIPTS}
    assert {"cpu.py", "dask_cpu.py", "kernels.py", "pipeline.py", "plot_kernels.py",
            "research/dfma_probe.py"} <= names


# ids: pytest 8.0 calls them with its NOTSET marker when SCRIPTS is empty (no bench/ in CI)
@pytest.mark.parametrize("script", [  # the research probes' with the slow cases
    pytest.param(p, marks=[pytest.mark.slow] * (p.parent.name == "research")) for p in SCRIPTS],
                         ids=lambda p: p.relative_to(BENCH).as_posix() if isinstance(p, Path) else None)
@pytest.mark.slow
def test_help_without_cupy(script):
    res = subprocess.run([sys.executable, "-c", NO_CUPY, str(script), "--help"], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("usage:"), res.stdout[:500]
    # the description is the docstring's first paragraph, never empty
    assert len(res.stdout.splitlines()) > 3


# ids: pytest 8.0 calls them with its NOTSET marker when SCRIPTS is empty (no bench/ in CI)
@pytest.mark.parametrize("script", SCRIPTS,
                         ids=lambda p: p.relative_to(BENCH).as_posix() if isinstance(p, Path) else None)
def test_docstring_names_its_question_or_workload(script):
    doc = script.read_text().split('"""')[1].strip()
    assert doc, script
    if "research" in script.parts:
        assert "?" in doc.splitlines()[0], f"{script}: a probe's first line asks its question"


def test_bad_option_is_a_usage_error():
    res = subprocess.run([sys.executable, "-c", NO_CUPY, str(BENCH / "cpu.py"), "--no-such"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "--no-such" in res.stderr


def test_record_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMM_COMMIT", "abc1234")
    sys.path.insert(0, str(ROOT))
    try:
        from bench.common import RecordWriter, load, median_seconds, slug
    finally:
        sys.path.remove(str(ROOT))
    w = RecordWriter("cpu", "AMD EPYC 7B13 64-Core Processor", tmp_path, file_stem="cpu-dask",
                     workers=2)
    assert w.path.name == f"cpu-dask-{slug('AMD EPYC 7B13 64-Core Processor')}-{w.date}.jsonl"
    w.add("numpy", "float64", 3, 5, 7, 0.5, 1e-16, note="x")
    w.add("distmm-dask", "float32", 4, 4, 4, 0.25, None, workers=3)
    recs = load([w.path])
    assert [json.loads(line) for line in w.path.read_text().splitlines()] == recs
    first, second = recs
    for key in ("run", "benchmark", "variant", "device", "dtype", "m", "n", "k", "seconds",
                "tflops", "relerr", "commit", "date"):
        assert key in first
    assert first["run"] == second["run"] and first["commit"] == "abc1234"
    assert first["tflops"] == pytest.approx(2 * 3 * 5 * 7 / 0.5 / 1e12)
    assert (first["workers"], second["workers"]) == (2, 3)   # extra keys win over common ones
    assert second["relerr"] is None and second["dtype"] == "float32"
    calls = []
    assert median_seconds(lambda: calls.append(1), repeat=3, warmup=2) >= 0
    assert len(calls) == 5


def test_device_runner_rejects_unknown_workloads():
    res = subprocess.run(["bash", str(BENCH / "device" / "run.sh"), "no-such-workload"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(_env(), OUT=""))
    assert res.returncode == 2
    assert "no-such-workload" in res.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_bench_runs_pylops_mpi_or_says_why(tmp_path):
    """bench/mpi.py at 4 ranks (square) and a ragged n: a checked pylops-mpi record where
    pylops_mpi imports, otherwise a printed reason and no record (never a zero timing)."""
    env = dict(_env(), OPENBLAS_NUM_THREADS="1")
    has_pylops = subprocess.run([sys.executable, "-c", "import pylops_mpi"], env=env,
                                capture_output=True, timeout=300).returncode == 0
    res = subprocess.run([sys.executable, "-m", "bench.mpi", "--ranks", "4", "--sizes", "51",
                          "--rounds", "1", "--peers", "pylops-mpi", "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("mpi-*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    by_variant = {r["variant"]: r for r in recs}
    assert set(by_variant) == {"numpy", "distmm-mpi"} | ({"pylops-mpi"} if has_pylops else set())
    assert by_variant["distmm-mpi"]["relerr"] < 1e-12
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("pylops-mpi")]
    assert len(lines) == 1, res.stdout
    if has_pylops:
        rec = by_variant["pylops-mpi"]
        assert (rec["ranks"], rec["grid"], rec["kind"], rec["n"]) == (4, [2, 2], "summa", 51)
        assert rec["seconds"] > 0 and len(rec["times"]) == 1
        assert rec["relerr"] < 1e-12 and rec["checked_elements"] == 51 * 51  # every row (< 64)
        assert "not run" not in lines[0]
    else:
        assert "not run: import pylops_mpi failed" in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_bench_nvmath_peer_says_why_and_changes_no_record(tmp_path):
    """bench/mpi.py with the nvmath-python peer asked for where it does not load (no nvmath
    here; on a machine with it, the CPU mode refuses it): one line with the reason, no
    record, and the other records as in the same run without the peer."""
    env = dict(_env(), OPENBLAS_NUM_THREADS="1")
    runs = {}
    for name, peers in (("without", ["--peers", "pylops-mpi"]),
                        ("with", ["--peers", "pylops-mpi", "nvmath-python"])):
        res = subprocess.run([sys.executable, "-m", "bench.mpi", "--ranks", "2", "--sizes", "37",
                              "--rounds", "1", "--out-dir", str(tmp_path / name), *peers],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        (path,) = (tmp_path / name).glob("mpi-*.jsonl")
        runs[name] = ([json.loads(line) for line in path.read_text().splitlines()],
                      res.stdout.splitlines())
    has_nvmath = subprocess.run([sys.executable, "-c", "import nvmath.distributed"], env=env,
                                capture_output=True, timeout=300).returncode == 0
    (line,) = [ln for ln in runs["with"][1] if ln.startswith("nvmath-python")]
    assert "float64 n=37 ranks=2: not run: " in line, line
    assert ("runs in --mode gpu only" if has_nvmath else
            "does not load in the ranks' environment: ModuleNotFoundError: No module named "
            "'nvmath'") in line, line
    assert not [ln for ln in runs["without"][1] if ln.startswith("nvmath-python")]
    assert [ln.split(":")[0] for ln in runs["with"][1] if not ln.startswith("nvmath")] == \
        [ln.split(":")[0] for ln in runs["without"][1]]
    timing = {"run", "seconds", "tflops", "times", "ratio_to_reference", "date"}
    with_, without = ([{k: v for k, v in r.items() if k not in timing} for r in runs[name][0]]
                      for name in ("with", "without"))
    assert [r["variant"] for r in with_] == ["numpy", "distmm-mpi"]
    for a, b in zip(with_, without, strict=True):
        assert a.pop("relerr") == pytest.approx(b.pop("relerr"), rel=1e-6, abs=1e-18)
        assert a == b


def _heat_env(site):
    """The test environment with ``site`` first on PYTHONPATH (as ``--heat-site`` puts it for
    heat's ranks), and the line ``import heat`` fails with there ("" where it imports)."""
    env = dict(_env(), OPENBLAS_NUM_THREADS="1")
    env.pop("DISTMM_HEAT_SITE", None)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-c", "import heat"], env=env, capture_output=True,
                       text=True, timeout=300)
    return env, "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.mpi
def test_mpi_bench_heat_peer_checked_record(tmp_path):
    """bench/mpi.py with the heat peer on 2 ranks and an odd n (uneven split-0 rows): a heat
    record whose relerr covers every row of C against float64, where heat and torch import
    (from $DISTMM_HEAT_SITE, a folder with heat 1.8.0 installed --no-deps beside torch)."""
    site = os.environ.get("DISTMM_HEAT_SITE", "")
    env, why = _heat_env(site)
    if why:
        pytest.skip(f"import heat fails here (heat needs torch, which CI does not install; set "
                    f"DISTMM_HEAT_SITE to a folder holding heat and torch): {why}")
    res = subprocess.run([sys.executable, "-m", "bench.mpi", "--ranks", "2", "--sizes", "53",
                          "--rounds", "1", "--peers", "heat", "--heat-site", site,
                          "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("mpi-*.jsonl")
    by_variant = {r["variant"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(by_variant) == {"numpy", "distmm-mpi", "heat"}
    rec = by_variant["heat"]
    assert (rec["ranks"], rec["n"], rec["dtype"], rec["heat_device"]) == (2, 53, "float64", "cpu:0")
    assert rec["splits"] == {"a": 0, "b": 0, "c": 0}
    assert 0 <= rec["relerr"] < 1e-13  # 64 sampled rows > n: every row of C
    assert rec["seconds"] > 0 and len(rec["times"]) == 1 and rec["threads_per_rank"] == 1
    assert set(rec["versions"]) == {"heat", "torch", "torch_blas"}
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("heat")]
    assert "not run" not in line and "splits=0,0->0" in line, line


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_bench_heat_not_installed_says_why(tmp_path):
    """bench/mpi.py with the heat peer asked for where ``import heat`` fails (CI: no heat, no
    torch): one line with the import's own error, and no heat record."""
    env, why = _heat_env("")
    if not why:
        pytest.skip("import heat works in this environment: nothing is missing")
    res = subprocess.run([sys.executable, "-m", "bench.mpi", "--ranks", "2", "--sizes", "37",
                          "--rounds", "1", "--peers", "heat", "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("mpi-*.jsonl")
    assert [json.loads(ln)["variant"] for ln in path.read_text().splitlines()] == \
        ["numpy", "distmm-mpi"]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("heat")]
    assert line.endswith(f"float64 n=37 ranks=2: not run: import heat failed in the workers' "
                         f"environment: {why}"), line


@pytest.mark.slow
def test_dask_gpu_rehearsal_writes_checked_records(tmp_path):
    """bench/dask_gpu.py --rehearse: the GPU benchmark's code on CPU worker processes (a
    worker-spec copy for 'shared', a CPU worker without GPU for 'mixed'), every variant checked
    against float64 on sampled rows and recorded, the reference (numpy) in the same run."""
    res = subprocess.run([sys.executable, "-m", "bench.dask_gpu", "--rehearse", "--settings",
                          "shared", "mixed", "--sizes", "157", "--dtypes", "float32", "float64",
                          "--chunks", "64", "48", "--rounds", "2", "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=dict(_env(), OPENBLAS_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("dask-gpu-*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    by = {(r["setting"], r["variant"], r["dtype"]): r for r in recs}
    want = set()
    for dtype in ("float32", "float64"):
        want |= {("shared", v, dtype) for v in ("numpy", "distmm-dask@shared",
                                                 "dask.array-chunk64@shared",
                                                 "dask.array-chunk48@shared")}
        want |= {("mixed", v, dtype) for v in ("numpy", "distmm-dask@mixed",
                                                "dask.array-chunk64@mixed")}
    assert set(by) == want and len(recs) == len(want)
    assert len({r["run"] for r in recs}) == 1
    for (setting, variant, dtype), rec in by.items():
        assert rec["benchmark"] == "dask-gpu" and rec["rehearse"] is True and rec["gpus"] == 0
        assert rec["m"] == rec["n"] == rec["k"] == 157 and rec["checked_rows"] == 64
        assert 0 <= rec["relerr"] < (1e-5 if dtype == "float32" else 1e-13)
        assert rec["seconds"] > 0 and rec["first_seconds"] > 0 and len(rec["all_seconds"]) == 2
        assert rec["seconds"] == pytest.approx(float(np.median(rec["all_seconds"])))
        if variant == "numpy":
            continue
        ref = by[(setting, "numpy", dtype)]
        assert rec["ratio_to_numpy"] == pytest.approx(ref["seconds"] / rec["seconds"])
        assert rec["chunk"] == (48 if "chunk48" in variant else 64)
        if setting == "shared":
            assert (rec["workers"], rec["gpu_workers"], rec["cpu_workers"]) == (2, 2, 0)
        else:
            assert (rec["workers"], rec["gpu_workers"], rec["cpu_workers"]) == (2, 1, 1)
        if variant.startswith("distmm-dask"):
            assert set(rec["speedup_vs"]) == ({"dask.array-chunk64", "dask.array-chunk48"}
                                              if setting == "shared" else {"dask.array-chunk64"})
    assert "[mixed] float64 n=157" in res.stdout and "FAILED" not in res.stdout


def test_mpi_bench_gpus_option_places_the_ranks():
    """``--ranks R --gpus G`` in the gpu mode: R ranks over min(G, R) GPUs (1: they share
    one); the mode's own cases when no ranks, sizes or dtypes are named."""
    import argparse

    from bench.mpi import MODES, _cases

    def cases(**kw):
        base = dict(ranks=None, sizes=None, dtypes=None, gpus=1)
        return _cases(argparse.Namespace(**dict(base, **kw)), MODES["gpu"])

    assert cases() == list(MODES["gpu"]["cases"])
    assert cases(ranks=[2], sizes=[64], dtypes=["float32"], gpus=2) == [(2, "float32", 64, 2)]
    assert cases(ranks=[1, 2], sizes=[64], dtypes=["float32"], gpus=4) == \
        [(1, "float32", 64, 1), (2, "float32", 64, 2)]
    assert cases(ranks=[2], sizes=[64], dtypes=["float32"]) == [(2, "float32", 64, 1)]


def test_tensor_core_variants_name_only_valid_changes():
    sys.path.insert(0, str(ROOT))
    try:
        from bench.kernels import parse_variant, tc_variants
    finally:
        sys.path.remove(str(ROOT))
    import distmm.executor.registry as registry

    assert parse_variant("INFLIGHT=1, BM=256") == {"INFLIGHT": 1, "BM": 256}
    with pytest.raises(ValueError, match="KEY=INT"):
        parse_variant("INFLIGHT")
    wg, mma = registry.get_tc("wgmma_bf16"), registry.get_tc("mma_bf16")
    got = tc_variants(wg, "bfloat16", ["INFLIGHT=1", "INFLIGHT=1,BN=256", "INFLIGHT=0",
                                       "MINB=2"], 90)
    # the defaults first; a change equal to them, one breaking the registers' rule and one
    # naming another step's parameter are left out
    assert [s for s, _ in got] == ["", "+INFLIGHT=1"]
    assert got[1][1] == dict(wg.params("bfloat16"), INFLIGHT=1)
    assert [s for s, _ in tc_variants(mma, "bfloat16", ["INFLIGHT=1"], 90)] == [""]


def test_stall_table_reads_ncu_source_page(tmp_path):
    """bench/research/stall_table.py on a source page as ncu writes it (the kernel's name on a
    line of its own before the header): shares of all samples by instruction, opcode and
    reason, with predicated and uniform instructions counted under their opcode."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.research.stall_table import table
    finally:
        sys.path.remove(str(ROOT))
    page = tmp_path / "sass.csv"
    page.write_text(
        '"Kernel Name","void k<1>(int)",\n'
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_math","stall_wait",'
        '"stall_math (Not Issued)"\n'
        '"0x10","HMMA.16816.F32.BF16 R4, R8, R12, R4","60","45","15","40"\n'
        '"0x20","@!P0  BRA 0x30","30","0","30","0"\n'
        '"0x30","HMMA.16816.F32.BF16 R16, R8, R12, R16","10","2","8","1"\n')
    text = table(str(page), top=2)
    lines = text.splitlines()
    assert lines[0].endswith("100 samples over 3 instructions")
    assert "  HMMA        70.0%" in lines and "  BRA         30.0%" in lines
    assert "by reason: wait 53.0%, math 47.0%" in text  # largest first
    top = [ln for ln in lines if ln.startswith("   ") and "0x" in ln]
    assert len(top) == 2 and "0x10" in top[0] and "math 45.0 wait 15.0" in top[0]
    assert "0x20" in top[1] and "wait 30.0" in top[1]
