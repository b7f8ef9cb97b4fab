"""The planners' limits on what they list: a product too large to plan is refused from its
sizes, before any list is built, with one line that names the sizes and the limit; one just
under the limit is modelled in seconds, its stream-pipeline schedule summarised from shorter
ones that repeat as it does (``distmm.plan_model.SIMULATED_STEPS``).

Every case runs in a child process whose address space is capped (``RLIMIT_AS``), so that a
planner that lists what it should refuse fails within seconds instead of taking the machine's
memory: ``distmm model`` itself (status 2 and one line), and the planners' functions.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmm.plan_batch import MAX_BATCH_EDGES
from distmm.plan_model import GemmRate, default_calibration
from distmm.plan_pipeline import MAX_STEPS

ROOT = Path(__file__).resolve().parent.parent
#: address space a child may map: a few times what ``distmm model`` needs, a fraction of the
#: gigabytes a planner takes that lists a product it should refuse
ADDRESS_SPACE = 2 << 30
HUGE = 99999999999999


def _capped(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _child(argv, tmp_path, limit=ADDRESS_SPACE):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path),
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # no calibration stored
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env, preexec_fn=_capped(limit))


def _model(tmp_path, *argv):
    return _child(["-m", "distmm", "model", *argv], tmp_path)


@pytest.mark.parametrize("engine, gpus, size, limit", [
    ("batch", 8, HUGE, MAX_BATCH_EDGES),
    ("batch", 8, 10**8, MAX_BATCH_EDGES),
    ("pipeline", 1, HUGE, MAX_STEPS),
    ("pipeline", 1, 10**7, MAX_STEPS),
])
@pytest.mark.slow
def test_model_refuses_a_product_too_large_to_plan(tmp_path, engine, gpus, size, limit):
    done = _model(tmp_path, str(size), str(size), str(size), "--gpus", str(gpus),
                  "--engine", engine)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"distmm model: error: a {size} x {size} x {size} "), lines
    assert lines[0].endswith(f"lists at most {limit}"), lines


@pytest.mark.slow
@pytest.mark.parametrize("engine, gpus", [("batch", "1,2,4,8"), ("pipeline", "1"),
                                          ("mpi", "1,2,4,8"), ("dask", "1,2,4,8")])
def test_model_of_a_large_product_fits_the_same_cap(tmp_path, engine, gpus):
    done = _model(tmp_path, "131072", "131072", "131072", "--gpus", gpus, "--engine", engine,
                  "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == len(gpus.split(","))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.slow
def test_model_just_under_the_pipeline_cap_answers_in_seconds(tmp_path, dtype):
    """47 x 47 units of 372 k-blocks (822k GEMMs, MAX_STEPS 1.05M): each kernel simulated, a
    minute and gigabytes (past the child's 2 GiB); summarised, a second or two."""
    begun = time.monotonic()
    done = _model(tmp_path, "760000", "760000", "760000", "--gpus", "1", "--engine", "pipeline",
                  "--dtype", dtype, "--json")
    took = time.monotonic() - begun
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    got = json.loads(line)
    assert got["grid"] == [47, 47] and got["dtype"] == dtype
    assert got["predicted_seconds"] >= got["compute_seconds"] > 0
    assert took < 60, took  # a 2-core machine beside other work: seconds, not a minute


CALIBRATION = dataclasses.replace(default_calibration(), gemm={
    **default_calibration().gemm, "gpu:bf16": GemmRate(700e12, 2000.0)})


@pytest.mark.parametrize("m, n, k, dtype, options", [
    # square tiles, B partly cached from one sweep to the next; C's last row and column of
    # units narrower (3392), the last row bound by its copies where the others are not
    (200000, 200000, 200000, "float32", {}),
    (13 * 16384 + 2000, 13 * 16384 + 3000, 200000, "float32", {"copies": "direct"}),
    (300000, 300000, 100000, "float64", {"memory": 16 << 30}),
    # B resident: units of whole columns, the first two k outer, and the last ones halving
    (2**24, 32768, 32768, "float32", {"precision": "bf16"}),
])
@pytest.mark.slow
def test_a_summarised_pipeline_schedule_is_the_whole_one(monkeypatch, m, n, k, dtype, options):
    """A schedule of more than SIMULATED_STEPS kernels, extrapolated from shorter ones, has
    the time, each lane's busy seconds and the bytes of the whole one simulated kernel by
    kernel."""
    from distmm import plan_model

    summary = plan_model.pipeline_schedule(m, n, k, dtype, calibration=CALIBRATION, **options)
    t = summary.tiling
    assert (len(t.row_edges) - 1) * (len(t.col_edges) - 1) * (len(t.k_edges) - 1) > (
        plan_model.SIMULATED_STEPS)
    monkeypatch.setattr(plan_model, "SIMULATED_STEPS", MAX_STEPS)
    whole = plan_model.pipeline_schedule(m, n, k, dtype, calibration=CALIBRATION, **options)
    for lane in ("seconds", "gemm", "h2d", "d2h", "host"):
        assert getattr(summary, lane) == pytest.approx(getattr(whole, lane), rel=1e-9), lane
    assert (summary.bytes_in, summary.bytes_out) == (whole.bytes_in, whole.bytes_out)
    assert summary.tiling == whole.tiling


def test_model_refuses_a_pipeline_schedule_too_long_to_summarise(tmp_path):
    """One unit of 2**20 k-blocks (MAX_STEPS itself): nothing repeats in fewer kernels than
    the model simulates, so it says so in one line rather than simulate them all."""
    done = _model(tmp_path, "64", "64", str(2**31), "--gpus", "1", "--engine", "pipeline")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"distmm model: error: a 64 x 64 x {2**31} product's "
                               f"stream-pipeline schedule of {2**20} GEMMs "), lines
    assert "the model simulates" in lines[0], lines


REFUSED = [  # (call, words of the message)
    # B's column panel planned without a memory limit: 2.5e13 k steps in its first stripe
    (f"plan_batch({HUGE}, {HUGE}, {HUGE}, 'float32', ranks=8)", "first-stripe k steps"),
    # a stripe of C for each 8 bytes of it
    ("plan_batch(2**40, 1, 1, 'float64', ranks=1, stripe_bytes=8)", "1.1e+12 stripes"),
    # full-width units (B fits the device): 2**26 of them
    ("choose_tiling(2**40, 1, 2**21, 4, 80 << 30)", "GEMMs"),
    # square tiles: 2e9 units of 5e3 k-blocks each
    ("choose_tiling(10**7, 10**7, 10**7, 4, 80 << 30)", "1.82e+09 GEMMs"),
    # 4096 x 1024 units of one k-block, as a record's tiling may list them
    ("plan_block_loads(PipelineTiling(tuple(range(0, 4097 * 64, 64)), "
     "tuple(range(0, 1025 * 64, 64)), (0, 64), 2, 2, 2, 4))", "4.19e+06 GEMMs"),
    ("pipeline_schedule(10**7, 10**7, 10**7, calibration=default_calibration())",
     "1.82e+09 GEMMs"),
]


@pytest.mark.parametrize("call, words", REFUSED)
@pytest.mark.slow
def test_planners_refuse_before_listing(tmp_path, call, words):
    code = ("from distmm.plan_batch import plan_batch\n"
            "from distmm.plan_model import default_calibration, pipeline_schedule\n"
            "from distmm.plan_pipeline import PipelineTiling, choose_tiling, plan_block_loads\n"
            f"try:\n    {call}\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc)\nelse:\n    print('planned')\n")
    done = _child(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ValueError a "), done.stdout
    assert words in done.stdout and "at most" in done.stdout, done.stdout


def test_memory_refusal_comes_before_the_cap(tmp_path):
    """A rank's memory refuses a batch plan as it did (its message, which a caller may retry
    on), before the stripes it would cut are counted."""
    code = ("from distmm.plan_batch import plan_batch\n"
            "try:\n    plan_batch(10**8, 10**8, 10**8, 'float32', ranks=8, memory=80 << 30)\n"
            "except ValueError as exc:\n    print(exc)\n")
    done = _child(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs" in done.stdout and "more than the 80.0 GiB it has" in done.stdout, done.stdout


def test_shrinking_after_out_of_memory_stops_at_the_cap():
    """The pipeline's retries after an out-of-memory error end (None: the executor's
    MemoryError) where smaller tiles would list more kernels than a schedule holds."""
    from distmm.plan_pipeline import choose_tiling, shrink_tiling

    m = n = k = 65536
    tiling, seen = choose_tiling(m, n, k, 4, 80 << 30), 0
    while tiling is not None:
        steps = ((len(tiling.row_edges) - 1) * (len(tiling.col_edges) - 1)
                 * (len(tiling.k_edges) - 1))
        assert steps <= MAX_STEPS, (tiling.tm_max, tiling.tk_max, steps)
        tiling, seen = shrink_tiling(tiling, m, n, k, 4, 80 << 30), seen + 1
    assert seen > 3  # it did shrink before it stopped


def test_model_names_the_product_when_the_host_runs_out_of_memory(tmp_path):
    """A bare MemoryError (the host's own, while the pipeline's k-blocks are listed) reaches
    the caller as a ValueError that names the product, not an empty one."""
    code = ("import resource\n"
            "from distmm.plan_model import default_calibration, pipeline_schedule\n"
            "cal = default_calibration()\n"
            "with open('/proc/self/status') as f:\n"
            "    size = next(int(x.split()[1]) << 10 for x in f if x.startswith('VmSize'))\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 20),) * 2)\n"
            "try:\n    pipeline_schedule(64, 64, 2**31, calibration=cal)\n"  # 2**20 k-blocks
            "except ValueError as exc:\n    print(repr(str(exc)))\n")
    done = _child(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == repr("a 64 x 64 x 2147483648 product is too large to plan "
                                       "for the stream pipeline")
