"""``--dtype`` of distmm plan, demo and model: bfloat16 (ml_dtypes') as the API multiplies it,
run as real subprocesses."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_cli

ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.mark.slow
def test_plan_of_bfloat16_operands_is_the_plan_matmul_makes():
    """--dtype bfloat16 was refused ("data type 'bfloat16' not understood", status 2); it is
    the plan distmm.matmul makes for bfloat16 operands: of numpy's float32 result, said on
    stderr, and the process grid of that result."""
    import dask

    import distmm

    args = (300, 200, 100, "--workers", 2, "--ranks", 4)
    budget = {"DISTMM_MEMORY_BUDGET": "1GiB"}  # an auto budget follows the free memory
    r = run_cli("plan", *args, "--dtype", "bfloat16", env=budget)
    assert r.returncode == 0, r.stderr
    with dask.config.set({"distmm.memory-budget": "1GiB"}):
        want = distmm.make_plan(300, 200, 100, ml_dtypes.bfloat16, workers=2).describe()
    assert r.stdout.startswith(want + "\n") and "dtype float32" in r.stdout, r.stdout
    assert r.stdout == run_cli("plan", *args, "--dtype", "float32", env=budget).stdout
    assert r.stderr == ("distmm plan: note: numpy's matmul of bfloat16 operands gives float32; "
                        "the plan is for a float32 result\n"), r.stderr


def test_demo_multiplies_bfloat16_operands_and_checks_their_float32_product():
    """The check is of numpy's result dtype, float32: bfloat16's kind ('V') sent it to the
    integers' equality, and its name to float64's tolerance."""
    r = run_cli("demo", "-n", 130, "--dtype", "bfloat16", "--engine", "local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dtype float32 (accumulate in float32)" in r.stdout, r.stdout
    assert "relative error vs float64 numpy" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith(": OK"), r.stdout


@pytest.mark.slow
def test_model_of_bfloat16_operands_is_that_of_their_float32_result(tmp_path):
    """The engines multiply bfloat16 operands as numpy's float32 result (and the benchmarks
    record them so): the model's predictions and records are float32's; its header names
    the operands."""
    sizes = (4096, 4096, 4096, "--gpus", "2,8")
    bf16 = run_cli("model", *sizes, "--dtype", "bfloat16", "--json")
    f32 = run_cli("model", *sizes, "--dtype", "float32", "--json")
    assert bf16.returncode == 0, bf16.stderr
    assert bf16.stdout == f32.stdout
    assert [json.loads(line)["dtype"] for line in bf16.stdout.splitlines()] == ["float32"] * 2
    r = run_cli("model", *sizes, "--dtype", "bfloat16", "-o", tmp_path / "p.jsonl")
    assert r.returncode == 0, r.stderr
    assert "] float32 (of bfloat16 operands); engine mpi" in r.stdout, r.stdout
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [rec["dtype"] for rec in records] == ["float32"] * 2


_WITHOUT_ML_DTYPES = ("import sys; sys.modules['ml_dtypes'] = None; "
                      "from distmm.cli.commands import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("argv", [["plan", "10", "10", "10"],
                                  pytest.param(["demo", "-n", "8"], marks=pytest.mark.slow),
                                  pytest.param(["model", "10", "10", "10", "--gpus", "2"],
                                               marks=pytest.mark.slow)])
def test_bfloat16_without_ml_dtypes_says_what_to_install(argv):
    """Only the name bfloat16 imports ml_dtypes; without it, one line saying what to install,
    status 2, and the other dtypes still work."""
    r = subprocess.run([sys.executable, "-c", _WITHOUT_ML_DTYPES, *argv, "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"distmm {argv[0]}: error: argument --dtype: 'bfloat16' is ml_dtypes' "
                        f"bfloat16, and ml_dtypes is not installed (pip install ml_dtypes) "
                        f"(see distmm {argv[0]} --help)\n"), r.stderr
    if argv[0] == "plan":
        r = subprocess.run([sys.executable, "-c", _WITHOUT_ML_DTYPES, *argv, "--dtype", "float16"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "dtype float16" in r.stdout, r.stderr
