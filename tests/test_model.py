"""The performance model (``distmm.plan_model``), ``distmm calibrate`` and ``distmm model``.

Covers: monotonicity (more bandwidth or GEMM rate never predicts slower; time falls with the
device count for a compute-bound size), the COSMA lower bounds (closed forms, and no plan's
volume below them), memory warnings, the calibration's JSON round trip and its derivation
from the committed records, the command line (output, bad arguments as one line and exit 2),
``distmm calibrate --quick`` end to end (a real ``mpiexec -n 2`` ping-pong, real worker
processes, real files), the stream pipeline's schedule (never faster than its GEMMs or any of its
copies alone, never slower with more bandwidth or GEMM rate), and the model against every
committed measurement.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distmm.cli.calibrate import _fit_link, fit_gemm, from_records, load
from distmm.cli.model_records import load_records
from distmm.cli.validate import TARGET, validate
from distmm.plan_model import (Calibration, GemmRate, Link, best_plan, default_calibration,
                               lower_bounds, predict)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CAL = default_calibration()


def _records():
    return load_records(sorted(RESULTS.glob("*.jsonl")) + sorted(
        RESULTS.glob("mpi-batch-profiles-*.json")) + sorted(RESULTS.glob("summa-trace-*.json")))


def _distmm(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "distmm", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _scaled_link(cal, name, factor):
    links = dict(cal.links)
    links[name] = Link(links[name].latency, links[name].bandwidth * factor)
    return dataclasses.replace(cal, links=links)


def _scaled_gemm(cal, factor):
    return dataclasses.replace(cal, gemm={k: GemmRate(v.peak * factor, v.half_size)
                                          for k, v in cal.gemm.items()})


CASES = [  # (engine, device, m, n, k, devices)
    ("mpi", "gpu", 65536, 65536, 65536, 8),
    ("mpi", "gpu", 30001, 17, 40000, 4),
    ("mpi", "gpu", 64, 64, 10**6, 4),
    ("mpi", "cpu", 4097, 4095, 4099, 6),
    ("batch", "gpu", 32768, 32768, 32768, 4),
    ("batch", "gpu", 50001, 30000, 20000, 6),
    ("dask", "gpu", 32768, 32768, 32768, 2),
    ("dask", "cpu", 4096, 4096, 4096, 2),
]


@pytest.mark.parametrize("engine,device,m,n,k,p", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}x{c[4]}-P{c[5]}" for c in CASES])
def test_more_bandwidth_or_gemm_rate_never_slower(engine, device, m, n, k, p):
    base = predict(m, n, k, "float32", devices=p, calibration=CAL, engine=engine, device=device)
    for factor in (1.5, 4.0):
        for link in ("nvlink", "mpi-host", "ipc", "tcp", "pcie-h2d", "pcie-d2h"):
            faster = _scaled_link(CAL, link, factor)
            got = predict(m, n, k, "float32", devices=p, calibration=faster, engine=engine,
                          device=device)
            assert got.seconds <= base.seconds * (1 + 1e-12), (link, factor)
        for name in ("file_read", "file_write", "file_write_shared"):
            faster = dataclasses.replace(CAL, **{name: getattr(CAL, name) * factor})
            got = predict(m, n, k, "float32", devices=p, calibration=faster, engine=engine,
                          device=device)
            assert got.seconds <= base.seconds * (1 + 1e-12), (name, factor)
        got = predict(m, n, k, "float32", devices=p, calibration=_scaled_gemm(CAL, factor),
                      engine=engine, device=device)
        assert got.seconds < base.seconds, factor


def test_parts_add_up_and_are_not_negative():
    for engine, device, m, n, k, p in CASES:
        got = predict(m, n, k, "float64", devices=p, calibration=CAL, engine=engine, device=device)
        parts = (got.compute, got.communication, got.io, got.overhead)
        assert min(parts) >= 0
        assert math.isclose(sum(parts), got.seconds, rel_tol=1e-12)
        assert 0 < got.efficiency <= 1 + 1e-9


@pytest.mark.parametrize("engine", ["mpi", "dask"])
def test_time_falls_with_devices_for_a_compute_bound_size(engine):
    times = [best_plan(65536, 65536, 65536, "float32", devices=p, calibration=CAL,
                       engine=engine).seconds for p in (1, 2, 4, 8, 16)]
    assert all(b < a for a, b in zip(times, times[1:])), times
    # and efficiency stays high: compute-bound
    assert best_plan(65536, 65536, 65536, "float32", devices=16, calibration=CAL).efficiency > 0.9


def test_gpu_ranks_of_one_node_sharing_b_read_less():
    """``batch-panels`` share (auto's choice for GPU ranks of one node): each of 4 ranks reads a
    quarter of B and copies the rest over NVLink, which the model counts instead of 4 reads
    of all of B at the page cache's shared rate; one rank and CPU ranks are unchanged."""
    def io(panels, devices=4, device="gpu"):
        return predict(65536, 65536, 65536, "float32", devices=devices, calibration=CAL,
                       engine="batch", device=device, batch_panels=panels).io

    assert io("share") < io("read") and io("auto") == io("share")
    assert io("share", devices=1) == io("read", devices=1)
    assert io("share", device="cpu") == io("read", device="cpu")


def test_batch_prediction_takes_the_plan_the_batch_path_decides():
    """The batch path's grid and panels are ``distmm.plan_batch.decide_batch``'s, from the
    hosts the model assumes (``gpus_per_node`` GPU ranks or ``cores`` CPU ranks a node) and
    the calibration's memory. The model took whole rows of C for the ranks of any one node and
    a 2-D grid across nodes: wrong where CPU ranks' copies of B do not fit half the host's
    memory (the batch path shares B on a 2-D grid) and where GPU ranks of several nodes read
    or share their panels (``batch-panels`` read, share: whole rows)."""
    from distmm.plan_batch import decide_batch

    def grid(device, cal, panels="auto", devices=4, n=8192):
        return predict(n, n, n, "float64", devices=devices, calibration=cal, engine="batch",
                       device=device, batch_panels=panels).grid

    def decided(device, cal, panels="auto", devices=4, n=8192):
        per_node = min(devices, cal.gpus_per_node if device == "gpu" else cal.cores)
        return decide_batch(n, n, n, "float64", ranks=devices, hosts=-(-devices // per_node),
                            on_gpu=device == "gpu", panels=panels,
                            memory=cal.device_memory if device == "gpu" else None,
                            host_memory=cal.host_memory).plan.grid.shape

    # 8192^3 float64 on 4 CPU ranks of one host: 4 copies of B take 2 GiB
    cpu = dataclasses.replace(CAL, cores=4, host_memory=3 * 2**30)
    assert grid("cpu", cpu) == decided("cpu", cpu) == (1, 2, 2)  # more than half of 3 GiB
    roomy = dataclasses.replace(cpu, host_memory=4 * 2**30)
    assert grid("cpu", roomy) == decided("cpu", roomy) == (1, 4, 1)  # half of 4 GiB: fits
    # 4 CPU ranks on 2 hosts of 2 cores: auto broadcasts (2-D), read takes whole rows
    two = dataclasses.replace(roomy, cores=2)
    assert grid("cpu", two) == decided("cpu", two) == (1, 2, 2)
    assert grid("cpu", two, "read") == decided("cpu", two, "read") == (1, 4, 1)
    # 4 GPU ranks on 2 nodes of 2: auto broadcasts, read and share take whole rows
    gpus = dataclasses.replace(CAL, gpus_per_node=2)
    assert grid("gpu", gpus) == decided("gpu", gpus) == (1, 2, 2)
    for panels in ("read", "share"):
        assert grid("gpu", gpus, panels) == decided("gpu", gpus, panels) == (1, 4, 1)
    # ... where share reads as read does (B's shares are copied between the GPUs of one
    # host); on one node of 4 sharing B, each rank reads a quarter of it
    io = {(panels, node): predict(65536, 65536, 65536, "float32", devices=4, calibration=c,
                                  engine="batch", batch_panels=panels).io
          for panels in ("read", "share") for node, c in ((2, gpus), (4, CAL))}
    assert io["share", 2] == io["read", 2] and io["share", 4] < io["read", 4]


def test_batch_fixed_seconds_grow_with_the_ranks_of_a_node():
    """A batch job's fixed part: one rank's launch and start-up, and per further rank of a node
    its exit, its launch and (GPU ranks) its start-up's contention."""
    from distmm.plan_model import batch_fixed_seconds

    cal = CAL.with_overheads(mpi_launch=1.25, mpi_launch_ofi=1.75, batch_startup=0.75,
                             mpi_exit=0.125, mpi_launch_rank=0.0625, batch_startup_rank=0.25)
    assert batch_fixed_seconds(cal, 1) == 2.0
    assert batch_fixed_seconds(cal, 2) == 2.4375  # 2.0 + 0.125 + 0.0625 + 0.25
    assert batch_fixed_seconds(cal, 4) == 3.3125  # 2.0 + 3 * 0.4375
    assert batch_fixed_seconds(cal, 4, mpi_ofi=True) == 3.8125  # the probed launch: 1.75
    assert batch_fixed_seconds(cal, 4, device="cpu") == 2.5625  # no CUDA: 2.0 + 3 * 0.1875
    assert batch_fixed_seconds(cal, 0) == 2.0
    # without the per-rank terms (a calibration before them): 1 + exit per further rank
    old = CAL.with_overheads(mpi_launch=1.25, batch_startup=0.75, mpi_exit=0.125)
    assert batch_fixed_seconds(old, 4) == 2.375
    # the batch path's prediction carries it as its overhead, per node
    for p, per_node in ((4, 4), (8, 4)):
        got = predict(32768, 32768, 32768, "float32", devices=p, engine="batch",
                      calibration=dataclasses.replace(cal, gpus_per_node=4))
        assert got.overhead == batch_fixed_seconds(cal, per_node)


def test_batch_rank_costs_from_multi_rank_profiles():
    """Each further rank's launch, exit and slowest start-up beyond one rank's medians: the
    median over profiles, per further rank, not below 0; profiles without launch or exit
    times are skipped."""
    from distmm.cli.calibrate import batch_rank_costs

    def prof(ranks, before, after, starts):
        return {"profile": f"mpirun-{ranks}-32768", "_file": "x.json",
                "meta": {"ranks": ranks, "before": before, "after": after},
                "ranks": [{"totals": {"startup": s, "open": 0.25}} for s in starts]}

    one = {False: 1.0, True: 1.5}
    profs = [(prof(2, 1.125, 0.375, [0.5, 0.75]), False),  # +0.125, +0.25, +0.0
             (prof(2, 1.75, 0.5, [0.5, 0.5]), True),  # +0.25, +0.375, -0.25
             (prof(4, 1.375, 0.875, [0.5, 1.25, 0.5, 0.5]), False),  # +0.125, +0.25, +0.25
             (prof(2, None, 0.5, [0.5, 0.5]), False)]  # no launch time: skipped
    costs, used = batch_rank_costs(profs, before=one, after=0.125, startup=1.0)
    assert costs == {"mpi-launch-rank": 0.125, "mpi-exit": 0.25, "batch-startup-rank": 0.0}
    assert len(used) == 3
    assert batch_rank_costs(profs[3:], before=one, after=0.125, startup=1.0) == ({}, [])


def test_batch_rank_costs_calibrated_on_two_rank_profiles_only():
    """The committed records: each further rank's costs come from the two-rank profiles at
    32768 (their configurations are fit); four ranks and 65536 stay held out."""
    from distmm.cli.model_records import fit_subset

    recs = _records()
    for machine in ("NVIDIA H200", "NVIDIA H100"):
        cal = from_records(recs, machine)
        assert 0.12 < cal.overhead("mpi-exit") < 0.18  # one rank's exit alone: 0.08-0.11
        assert 0.0 < cal.overhead("mpi-launch-rank") < 0.15
        assert 0.0 <= cal.overhead("batch-startup-rank") < 0.05  # two processes: no contention
        for name in ("mpi-exit", "mpi-launch-rank", "batch-startup-rank"):
            used = cal.sources[name].split(" (")[0]
            assert "20261127T102016Z" in used or "20261127T100037Z" in used
            # files of four ranks, or of 65536, only
            assert "20261127T100304Z" not in used and "20261127T100503Z" not in used
    base = {"benchmark": "mpi-batch", "m": 32768, "n": 32768, "k": 32768}
    assert fit_subset({**base, "variant": "mpirun-2-share", "ranks": 2})
    assert not fit_subset({**base, "variant": "mpirun-4", "ranks": 4})
    assert not fit_subset({**base, "variant": "mpirun-2", "ranks": 2, "m": 65536, "n": 65536,
                           "k": 65536})


def test_lower_bounds_closed_forms():
    n, p = 4096, 64
    b = lower_bounds(n, n, n, p)
    assert math.isclose(b.three_d, 3 * n**2 / p ** (2 / 3), rel_tol=1e-12)
    assert math.isclose(b.two_d, 2 * n**2 / math.sqrt(3 * p), rel_tol=1e-12)
    assert b.replication == 4
    assert math.isclose(b.two_and_half_d, b.two_d / 2, rel_tol=1e-12)
    s = 10**6
    assert math.isclose(lower_bounds(n, n, n, p, s).memory, 2 * n**3 / (p * 1000), rel_tol=1e-12)
    # memory limits replication: room for one copy only
    assert lower_bounds(n, n, n, p, 3 * n * n / p).replication == 1
    assert lower_bounds(0, 5, 5, 4) == lower_bounds(5, 5, 0, 4)
    assert lower_bounds(0, 5, 5, 4).lower == 0


def test_one_rank_meets_the_3d_bound_exactly():
    got = predict(1000, 1000, 1000, "float64", devices=1, calibration=CAL)
    assert math.isclose(got.words_touched, got.bounds.three_d, rel_tol=1e-9)
    assert got.bytes_received == 0


@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (30001, 977, 12345), (64, 64, 2**20),
                                   (100000, 64, 64)])
def test_volume_is_never_below_the_lower_bounds(m, n, k):
    for p in (1, 2, 3, 4, 8, 12, 16, 64, 256):
        for plan in (predict(m, n, k, "float32", devices=p, calibration=CAL),
                     best_plan(m, n, k, "float32", devices=p, calibration=CAL, limit=16)):
            if not plan.fits:
                continue
            assert plan.words_touched >= plan.bounds.lower * (1 - 1e-9), (p, plan.grid)
            assert plan.words_touched >= plan.bounds.three_d * (1 - 1e-9)


def test_square_2d_grid_volume_by_hand():
    n = 8192  # a 2 x 2 grid: each rank touches A's row panel, B's column panel and its C block
    got = predict(n, n, n, "float32", devices=4, calibration=CAL, grid=(1, 2, 2))
    assert got.words_touched == n * n / 2 + n * n / 2 + n * n / 4
    assert got.bytes_received == (n // 2) * (n // 2) * 2 * 4


def test_memory_warning_says_by_how_much():
    got = predict(200000, 200000, 200000, "float32", devices=2, calibration=CAL,
                  memory=80 * 2**30)
    assert not got.fits
    assert got.shortfall == got.memory_needed - 80 * 2**30
    line = got.memory_warning()
    assert "80.0 GiB" in line and f"{got.shortfall / 2**30:.1f} GiB" in line and "short" in line
    fits = predict(200000, 200000, 200000, "float32", devices=64, calibration=CAL,
                   memory=80 * 2**30)
    assert fits.fits and fits.memory_warning() == ""
    # the best plan prefers a grid that fits
    best = best_plan(60000, 60000, 60000, "float32", devices=8, calibration=CAL,
                     memory=9 * 2**30)
    assert best.fits


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        predict(10, 10, 10, devices=0, calibration=CAL)
    with pytest.raises(ValueError, match="m must be a non-negative integer"):
        predict(-1, 10, 10, devices=2, calibration=CAL)
    with pytest.raises(ValueError, match="engine must be one of"):
        predict(10, 10, 10, devices=2, calibration=CAL, engine="spark")
    with pytest.raises(ValueError, match="link must be one of"):
        predict(10, 10, 10, devices=2, calibration=CAL, link="carrier-pigeon")
    with pytest.raises(ValueError, match="no gpu GEMM rate for int64"):
        predict(10, 10, 10, "int8", devices=2, calibration=CAL)
    with pytest.raises(ValueError, match="positive flop/s"):
        GemmRate(0.0)


def test_calibration_json_round_trip(tmp_path):
    from distmm.cli.calibrate import save

    path = save(CAL, tmp_path / "c.json")
    assert load(path) == CAL
    boosted = dataclasses.replace(CAL, core_boost={"float64": 1.4}, host_staging=31e9,
                                  gemm={**CAL.gemm, "gpu:bf16": GemmRate(700e12)})
    assert load(save(boosted, tmp_path / "b.json")) == boosted
    assert load(path).rate("cpu", "float64").size_rule == "volume"
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="bad.json: not a distmm calibration"):
        load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="no calibration at"):
        load(tmp_path / "missing.json")


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["gemm"]["gpu:float32"].update(peak="fast"),
     "gemm['gpu:float32'].peak must be a number, got 'fast'"),
    (lambda d: d["gemm"]["gpu:float32"].update(peak=True),  # was: 1 flop/s
     "gemm['gpu:float32'].peak must be a number, got True"),
    (lambda d: d["links"]["nvlink"].update(bandwidth=True),
     "links['nvlink'].bandwidth must be a number, got True"),
    (lambda d: d["gemm"]["gpu:float32"].update(peak=-1.0),
     "gemm['gpu:float32']: a GEMM rate must be a positive flop/s, got -1.0"),
    (lambda d: d.update(file_read="x"), "file_read must be a number, got 'x'"),
    (lambda d: d["memory_bandwidth"].update(gpu=False),
     "memory_bandwidth['gpu'] must be a number, got False"),
], ids=["peak-text", "peak-true", "bandwidth-true", "peak-negative", "file-read-text",
        "memory-false"])
def test_a_calibration_field_of_the_wrong_type_is_named(tmp_path, change, expected):
    data = CAL.to_dict()
    change(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load(tmp_path / "c.json")
    assert str(info.value) == f"{tmp_path / 'c.json'}: {expected}"
    with pytest.raises(TypeError, match="peak must be a number, got True"):
        GemmRate(True)
    with pytest.raises(TypeError, match="latency must be a number, got '0'"):
        Link("0", 1e9)


def test_gemm_fit_recovers_its_parameters():
    truth = GemmRate(50e12, 900.0)
    pts = [(s, truth.rate(s, s, s)) for s in (1024, 2048, 4096, 8192, 16384)]
    got = fit_gemm(pts)
    assert math.isclose(got.peak, truth.peak, rel_tol=1e-6)
    assert math.isclose(got.half_size, truth.half_size, rel_tol=1e-4)
    # rates falling with size: no extrapolated peak, the median
    assert fit_gemm([(4096, 60e12), (8192, 55e12), (16384, 52e12)]) == GemmRate(55e12, 0.0)


def test_a_cores_rate_counts_the_work_of_thin_panels_and_the_cores_busy_beside_it():
    core = GemmRate(40e9, 500.0, "volume")
    # a panel of 512 columns: the cube of its work has a side of 1290, near the peak; as the
    # smallest side (a GPU's rule) it would run at about half
    assert core.rate(2048, 2048, 512) > 0.85 * 40e9 > GemmRate(40e9, 500.0).rate(2048, 2048, 512)
    # towards a matrix-vector product the thin side holds it back: no more than 8 times it
    assert math.isclose(core.rate(4, 4096, 4096), core.rate(32, 32, 32))
    assert core.rate(4, 4096, 4096) < 0.1 * 40e9
    with pytest.raises(ValueError, match="size_rule"):
        GemmRate(1e9, 0.0, "max")
    cal = dataclasses.replace(CAL, cores=16, core_boost={"float64": 2.0})
    shared = cal.rate("cpu", "float64").peak
    rates = [cal.core_rate("float64", busy).peak for busy in range(1, 17)]
    assert math.isclose(rates[0], 2 * shared) and math.isclose(rates[-1], shared)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    # the time per flop is linear in the busy cores: 3 of 5 busy, half-way from 1/2 to 1
    five = dataclasses.replace(cal, cores=5)
    assert math.isclose(shared / five.core_rate("float64", 3).peak, 0.75)
    assert cal.core_rate("float32", 1) == cal.rate("cpu", "float32")  # no boost measured
    assert cal.core_rate("float64", 64).peak == shared  # more than its cores: all busy
    with pytest.raises(ValueError, match="core_boost of float64 must be 1 or more"):
        dataclasses.replace(CAL, core_boost={"float64": 0.5})
    # fewer cores busy: a CPU run predicted faster per core
    one = predict(4096, 4096, 4096, "float64", devices=1, calibration=cal, device="cpu")
    assert math.isclose(one.compute, 2 * 4096**3 / cal.core_rate("float64", 1).rate(
        4096, 4096, 4096), rel_tol=1e-9)


def test_a_one_core_reference_is_compared_at_the_chunks_it_multiplied():
    # dask.array on one single-thread worker multiplies chunk by chunk: its rate is set
    # against the all-busy rate of chunk-sided GEMMs, not of the whole product's side
    shared = GemmRate(40e9, 500.0, "volume")
    numpy = [{"run": "r", "device": "cpu x", "benchmark": "scaling", "variant": "numpy",
              "dtype": "float64", "m": s, "n": s, "k": s, "threads": 16, "_file": "f.jsonl",
              "seconds": 2.0 * s**3 / (16 * shared.rate(s / 16 ** (1 / 3), 1e9, 1e9))}
             for s in (2048, 4096, 8192)]
    alone = 1.5 * shared.rate(1024, 1024, 1024)
    ref = {"run": "r", "device": "cpu x", "benchmark": "scaling", "variant": "dask.array@1workers",
           "engine": "reference", "workers": 1, "threads_per_worker": 1, "chunk": 1024,
           "dtype": "float64", "m": 4096, "n": 4096, "k": 4096, "_file": "f.jsonl",
           "seconds": 2.0 * 4096**3 / alone}
    cal = from_records(numpy + [ref], "cpu x")
    got = cal.rate("cpu", "float64")
    assert math.isclose(cal.core_boost["float64"], alone / got.rate(1024, 1024, 1024),
                        rel_tol=1e-9)
    # without a chunk recorded: the whole product, as before
    whole = from_records(numpy + [{k: v for k, v in ref.items() if k != "chunk"}], "cpu x")
    assert math.isclose(whole.core_boost["float64"], alone / got.rate(4096, 4096, 4096),
                        rel_tol=1e-9)


def test_cpu_ranks_broadcasts_are_not_hidden_behind_their_gemms():
    # host Ibcast progresses only inside MPI calls: a CPU rank's panel broadcasts move
    # between its GEMMs, not during them (overlap "mpi-cpu", 0 unless a calibration says)
    cal = dataclasses.replace(CAL, cores=16)
    cpu = predict(4096, 4096, 4096, "float64", devices=4, calibration=cal, device="cpu")
    hidden = predict(4096, 4096, 4096, "float64", devices=4, device="cpu",
                     calibration=dataclasses.replace(cal, overlap={**cal.overlap,
                                                                   "mpi-cpu": 0.9}))
    assert cpu.grid == (1, 2, 2) and cpu.compute == hidden.compute
    # 4 panels a rank, each an A panel of 2048 x 1024 and a B panel of 1024 x 2048 broadcast
    # to one other rank: all of them counted, once
    link = cal.link("mpi-host")
    assert math.isclose(cpu.communication, 4 * 2 * link.seconds(2048 * 1024 * 8), rel_tol=1e-9)
    assert hidden.communication < 0.5 * cpu.communication
    # GPU ranks keep the engine's overlap
    gpu = predict(32768, 32768, 32768, devices=4, calibration=cal)
    assert gpu.communication == predict(32768, 32768, 32768, devices=4, calibration=dataclasses.replace(
        cal, overlap={**cal.overlap, "mpi-cpu": 0.0})).communication


def test_gpu_ranks_host_staged_copies_come_between_their_gemms():
    # two ranks sharing a GPU broadcast through host memory: the host MPI part moves while a
    # GEMM runs, but each panel's copy off the root's device and onto the others' runs on the
    # rank's compute stream, between two GEMMs: counted whole, whatever the overlap
    def shared(overlap):
        cal = dataclasses.replace(CAL, overlap={**CAL.overlap, "mpi": overlap})
        return predict(16384, 16384, 16384, devices=2, calibration=cal, ranks_per_device=2,
                       grid=(1, 1, 2))
    hidden, exposed = shared(1.0), shared(0.0)
    assert hidden.link == "mpi-host" and hidden.compute == exposed.compute
    # 4 panels of 16384 x 4096 float32, each broadcast to the other rank; the GEMMs (two
    # ranks' on one GPU) outlast each host broadcast, so at overlap 1 what is left is the
    # first panel's broadcast and every panel's copies off and onto the device
    nbytes = 16384 * 4096 * 4
    pcie = 2 * (CAL.link("pcie-d2h").seconds(nbytes) + CAL.link("pcie-h2d").seconds(nbytes))
    first = CAL.link("mpi-host").seconds(nbytes)
    assert math.isclose(hidden.communication, first + 4 * pcie, rel_tol=1e-9)
    assert math.isclose(exposed.communication, 4 * (first + pcie), rel_tol=1e-9)


def test_calibration_from_committed_records():
    recs = _records()
    h200 = from_records(recs, "NVIDIA H200")
    assert 48e12 < h200.rate("gpu", "float32").peak < 56e12  # cuBLAS in-core records
    assert "records:" in h200.sources["gpu:float32"]
    assert 6e9 < h200.file_read < 10e9  # cat from the page cache
    assert 40e9 < h200.links["pcie-h2d"].bandwidth < 70e9  # --profile of a one-rank batch job
    assert 1.0 < h200.overhead("mpi-launch") < 3.0
    assert h200.sources["nvlink"] == "default"  # no record measures it
    # single-rank batch profiles that wrote C directly: their rate, not dd's, is the machine's
    # write rate (2.0-2.3 GB/s against dd's 0.5-1.4)
    h100 = from_records(recs, "NVIDIA H100")
    for cal in (h100, h200):
        assert 1.8e9 < cal.file_write < 2.6e9 and "direct writes" in cal.sources["file_write"]
    cpu = from_records(recs, "AMD EPYC")
    assert "gpu:float32" not in cpu.gemm and cpu.cores == 2
    assert cpu.rate("cpu", "float64").size_rule == "volume"
    # the 16-core study's references on one single-thread worker: one core alone runs faster
    # than its share of numpy's 16 threads
    # one run's references alone (a shared VM's numpy varies 1.7-2.5x from run to run): the
    # 2-core study's numpy ran 60 GFLOP/s a core
    run = from_records(recs, "AMD EPYC", run="20261127T132943Z")
    assert run.sources["cpu:float64"] == "records: cpu-scaling-2-amd-epyc-2026-11-27.jsonl"
    assert 50e9 < run.rate("cpu", "float64").rate(2048, 2048, 2048) < 70e9
    assert "cpu-scaling-2" in cpu.sources["cpu:float64"] and "mpi-amd-epyc" in cpu.sources[
        "cpu:float64"]
    xeon = from_records(recs, "Intel(R) Xeon(R) Processor")
    assert 1.1 < xeon.core_boost["float64"] < 2.0 and "one core alone" in xeon.sources[
        "core_boost:float64"]
    with pytest.raises(ValueError, match="no records of machine"):
        from_records(recs, "Cray-1")
    # NCCL's socket link: the SUMMA traces' column broadcasts between 2 emulated nodes
    # (3.1-5.6 GB/s each); no H100 trace, so the nominal value stays there
    assert 3.7e9 < h200.links["nccl-socket"].bandwidth < 4.6e9
    assert "summa-trace-nvidia-h200" in h200.sources["nccl-socket"]
    assert "1host" not in h200.sources["nccl-socket"]  # one host: no broadcast crosses
    assert h100.links["nccl-socket"] == CAL.links["nccl-socket"]
    assert h100.sources["nccl-socket"] == "default"


def _summa_trace(sizes_ms, node=("0", "0", "1", "1")):
    """A ``bench/research/summa_trace.py`` trace of 4 ranks on a 1 x 2 x 2 grid, two calls:
    every rank broadcasts along its row in 1 ms and along its column as ``sizes_ms`` says
    (``(bytes, ms)`` pairs), and multiplies once."""
    calls = []
    for rank in range(4):
        mine = []
        for call in range(2):
            events, t = [], 0.0
            for nbytes, ms in sizes_ms:
                events += [["bcast", "row", nbytes, t, t + 1.0],
                           ["bcast", "col", nbytes, t, t + ms]]
                t += ms
            events.append(["gemm", "", 2 * 1024**3, t, t + 10.0])
            mine.append({"rank": rank, "call": call, "seconds": t / 1e3, "grid": [1, 2, 2],
                         "node": node[rank], "summary": {}, "events": events})
        calls.append(mine)
    return calls


def test_calibration_takes_nccl_socket_from_summa_traces(tmp_path):
    from distmm.cli.calibrate import cross_node_broadcasts, socket_link

    ref = tmp_path / "r.jsonl"
    ref.write_text(json.dumps({"benchmark": "gemm", "variant": "cublas", "device": "NVIDIA H200",
                               "dtype": "float32", "m": 8192, "n": 8192, "k": 8192,
                               "seconds": 0.022, "run": "x"}) + "\n")
    # 2 emulated nodes (ranks 0, 1 and 2, 3): the column broadcasts cross, the row ones do
    # not; 1 GB in 250 ms and 0.5 GB in 125 ms: 4 GB/s and no latency to see
    trace = tmp_path / "summa-trace-nvidia-h200-2026-01-01-2nodes.json"
    trace.write_text(json.dumps(_summa_trace([(10**9, 250.0), (5 * 10**8, 125.0)])))
    recs = load_records([ref, trace])
    (t,) = [r for r in recs if "summa_trace" in r]
    assert t["machine"] == "NVIDIA H200" and t["_file"] == trace.name
    got = cross_node_broadcasts(t)
    assert len(got) == 4 * 2 * 2  # 4 ranks, 2 calls, 2 column broadcasts each
    assert sorted(set(got)) == [(5 * 10**8, 0.125), (10**9, 0.25)]
    cal = from_records(recs, "NVIDIA H200")
    latency = CAL.links["nccl-socket"].latency  # a line through them has none: the default's
    assert cal.links["nccl-socket"].latency == latency
    assert cal.links["nccl-socket"].bandwidth == pytest.approx(
        8 * 1.5e9 / (8 * 0.375 - 16 * latency))
    assert trace.name in cal.sources["nccl-socket"]
    assert "bytes over summed time of 16 broadcasts" in cal.sources["nccl-socket"]
    # a latency the broadcasts show: the least-squares line
    link, how = socket_link([(10**6, 0.001 + 10**6 / 5e9), (10**9, 0.001 + 10**9 / 5e9)],
                            CAL.links["nccl-socket"])
    assert link.latency == pytest.approx(0.001) and link.bandwidth == pytest.approx(5e9)
    assert how == "least squares over 2 broadcasts"
    # one host (no node differs), another machine's trace, no trace: the nominal link
    for name, nodes in (("summa-trace-nvidia-h200-1host.json", (None,) * 4),
                        ("summa-trace-nvidia-h100-2nodes.json", ("0", "0", "1", "1"))):
        other = tmp_path / name
        other.write_text(json.dumps(_summa_trace([(10**9, 250.0)], node=nodes)))
        cal = from_records(load_records([ref, other]), "NVIDIA H200")
        assert cal.links["nccl-socket"] == CAL.links["nccl-socket"]
        assert cal.sources["nccl-socket"] == "default"
    # distmm report takes the trace beside the records and draws nothing from it
    from distmm.cli.report import read_inputs

    records, profiles = read_inputs([str(ref), str(trace)])
    assert len(records) == 1 and profiles == []


def test_mpi_ranks_of_several_nodes_broadcast_inside_a_node_over_nvlink():
    """Through NCCL's socket link on 4 GPUs as 2 nodes of 2 (grid 1 x 2 x 2, consecutive ranks
    a node): a process row's broadcast stays inside its node (NVLink), a column's crosses."""
    slow = dataclasses.replace(CAL, links={**CAL.links, "nccl-socket": Link(50e-6, 4e9)})
    kw = dict(devices=4, calibration=slow, link="nccl-socket", grid=(1, 2, 2))
    n = 65536
    two = predict(n, n, n, "float32", **kw, ranks_per_device=1)
    nodes = lambda per: predict(n, n, n, "float32", devices=4, link="nccl-socket",  # noqa: E731
                                grid=(1, 2, 2), calibration=dataclasses.replace(
                                    slow, gpus_per_node=per))
    assert nodes(2).seconds < nodes(1).seconds  # every broadcast crosses with 1 GPU a node
    # on one host (4 GPUs a node or more) every broadcast takes the link named, as before
    assert nodes(4).seconds == nodes(8).seconds == nodes(1).seconds
    # the row broadcasts' link does not matter across 2 nodes only if they are on NVLink
    fast_nv = dataclasses.replace(slow, gpus_per_node=2,
                                  links={**slow.links, "nvlink": Link(20e-6, 1e15)})
    assert predict(n, n, n, "float32", devices=4, link="nccl-socket", grid=(1, 2, 2),
                   calibration=fast_nv).seconds < nodes(2).seconds
    assert two.seconds == nodes(8).seconds


# -- the model against every committed measurement --------------------------------------------

#: configurations whose latest measurement the model misses by more than TARGET, and why
#: (every error: docs/figures/report.md; why: bench/NOTES.md, "A calibrated performance model")
KNOWN_MISSES = {
    # measured at commit 5cce11f, before block mode moved chunks between GPUs by CUDA IPC:
    # TCP through host copies then (4.4-10.5 s); the H200 records of the same settings at
    # later commits are within 6%
    ("NVIDIA H100", "dask gpu distmm-dask@2gpu", "float32", 16384),
    ("NVIDIA H100", "dask gpu distmm-dask@2gpu", "float32", 32768),
    ("NVIDIA H100", "dask gpu distmm-dask@2gpu", "float64", 32768),
    # two ranks sharing one GPU broadcast through host memory: no record measures host MPI
    # on the GPU machines (the nominal 8 GB/s stands in); the panels' copies off and onto
    # the device come between the GEMMs on the rank's stream (the twentieth session): -20%
    # here, the H100 -11% (within since then)
    ("NVIDIA H200", "mpi gpu 2 rank(s) on 1 GPU(s)", "float32", 16384),
    # 4 H100s at 32768 writing through the page cache (9933fa6): +25.5%, 5.94 s against
    # 7.45 s. The model writes at dd's median rate, where its own run's disk was faster (dd
    # 3.0 s for 4 GiB, against 3.8 s at the median rate); each further rank's launch and exit
    # from the two-rank profiles (0.24 s a rank, where one rank's exit, 0.11 s, stood before)
    # add 0.4 s more
    ("NVIDIA H100", "batch mpirun-4-buffered", "float32", 32768),
    # one run, at commit 10739ff, when one MPI rank on a GPU took 3.4x cuBLAS
    ("NVIDIA H200", "mpi gpu 1 rank(s) on 1 GPU(s)", "float32", 16384),
    # the one process of f836e0d (writes through the page cache, launched with Open MPI's ofi
    # probe) at 32768: 5.60 s against 6.70 s; its writes took 2.38 s where dd's median rate
    # gives 3.1 s (the disk varies 1.4x between runs). The runs of today's code on this key are
    # within 2%
    ("NVIDIA H200", "batch batch-1", "float32", 32768),
    # 4 ranks of f836e0d on a 2 x 2 grid at 32768 (npy and HDF5), launched with Open MPI's ofi
    # probe: 8.05 / 8.08 s against 6.83 s (-15.2%, -15.5%). Each further rank's launch, exit
    # and start-up come from two-rank profiles (0.21 s a rank); these four ranks' launch took
    # 2.2 s against the ofi-probed single process's 1.7 s (0.17 s a further rank, against
    # 0.06 s without the probe) and their slowest start-up 1.2-1.6 s against 0.84 s: four
    # processes starting CUDA at once contend, two do not. Today's code on the first key
    # (grid 4 x 1, 8f4ad1f) is within 10%
    ("NVIDIA H200", "batch mpirun-4", "float32", 32768),
    ("NVIDIA H200", "batch mpirun-4-h5", "float32", 32768),
    # shared VMs, each run predicted with the core rates of numpy measured in the same run:
    # at 16384 on 16 cores, 4 and 16 ranks ran 1.35x faster than numpy's 16 threads did in
    # that run (the same counts ran 1.6x slower in the other runs of the day: 9.1-15.6 s);
    # at 4096 on 2 cores the latest of six runs (2.03-4.18 s) took 2.29 s, the model 1.82 s
    ("Intel(R) Xeon(R) Processor", "mpi cpu 16 rank(s) on 16 cores", "float64", 16384),
    ("Intel(R) Xeon(R) Processor", "mpi cpu 4 rank(s) on 16 cores", "float64", 16384),
    ("Intel(R) Xeon(R) Processor @ 2.80GHz", "dask cpu", "float64", 4096),
    # GPU ranks as 2 emulated nodes, each rank bound to one core by mpiexec (its default for
    # an app context of two ranks or fewer, kept before distmm.engine.mpi.cpus widened it, or
    # kept on purpose with mpi-cpus: keep): NCCL's socket threads share the rank's core, which
    # the model does not describe (4 H100: 11.1-15.6 s, 4 H200: 10.4-11.2 s, against 3.0 s
    # unbound; 2 H200 at 32768: 5.3 s against 1.1 s)
    ("NVIDIA H100", "study mpi gpu on 4 GPU(s), emulated nodes 2, one CPU a rank", "float32",
     65536),
    ("NVIDIA H200", "study mpi gpu on 4 GPU(s), emulated nodes 2, one CPU a rank", "float32",
     65536),
    ("NVIDIA H200", "study mpi gpu on 2 GPU(s), emulated nodes 2, one CPU a rank", "float32",
     32768),
    # the Dask engine on 4 GPUs as 2 emulated nodes through NCCL at 32768 (cd74780): 0.849 s
    # against 0.538 s. NCCL's socket link is the SUMMA traces' 4.1 GB/s a pair of GPUs; the
    # 2.1 GiB a worker receives from the other node then take 0.52 s, 0.19 s of it not behind
    # its 0.34 s of GEMMs, where about 2.8 GB/s a worker was measured (at 65536 the same rate
    # is hidden either way: within 10%)
    ("NVIDIA H200", "study dask gpu on 4 GPU(s), emulated nodes 2 through NCCL", "float32",
     32768),
    # two ranks under mpirun at 32768 with today's code (193376b) on a 2 x H200 host, three
    # launch settings in one run: 5.81-5.92 s against 4.73 s (fit: their profiles calibrate
    # each further rank's launch, exit and start-up; theirs took 2.19-2.30 s against the
    # model's 2.36 s, so the miss is inside the profile); their writes took 2.3-2.6 s for
    # 2 GiB a rank (dd in the same runs 2.9-3.5 s for 4 GiB), where the model writes at the
    # 4 x H200 host's direct rate (2.25 GB/s shared by the two ranks: 1.9 s)
    ("NVIDIA H200", "batch mpirun-2-bind-default-cpus-auto", "float32", 32768),
    ("NVIDIA H200", "batch mpirun-2-bind-default-cpus-keep", "float32", 32768),
    ("NVIDIA H200", "batch mpirun-2-bind-none-cpus-auto", "float32", 32768),
} | {
    # cpu-scaling on 16 cores of the 64-core H100 host (set apart with taskset while GPU tests
    # ran on the others), with the run's own numpy (16 threads) and one-core reference (a
    # single-thread worker's dask.array: 1.40x one core's share of numpy's 16 threads at its
    # 1024-sided chunk GEMMs) as the core rates (bench/NOTES.md, "CPU configurations
    # in the model"). What it misses: runs faster than that one-core reference
    # on one or two cores (the MPI engine's one GEMM at 4096: 78 GFLOP/s against the
    # reference's 59 in the same run: +43%; the Dask engine on 2 workers at 58-60 GFLOP/s a
    # core: +27%, +34%), and 8 and 16 single-thread ranks at 0.67-0.78 of numpy's 16
    # threads (-16 to -22%, broadcasts between the GEMMs counted: the host MPI link is
    # nominal, and 16 processes' panel GEMMs share the cores' caches and memory). Within since the nineteenth session: the Dask engine on
    # one core and the MPI engine on 2 cores at 4096
    ("Intel(R) Xeon(R) Processor", f"study {engine} cpu on {cores} core(s)", "float64", m)
    for engine, cores, m in [("dask", 2, 4096), ("dask", 16, 8192), ("mpi", 1, 4096),
                             ("mpi", 8, 4096), ("mpi", 16, 4096), ("mpi", 16, 8192)]
} | {
    # the stream pipeline with the caller's arrays page-locked in place on each call (a debug
    # setting, off): within since the twentieth session (the locking and unlocking, at a
    # probe's nominal rates, stall the product: -9% to +5%)
    # a fresh process's first call with distmm.warmup() started just before it: one run each
    # at 11-25's code (2.28 s, 2.48 s against steady 1.43 s, 1.41 s; the warm-up's cuBLAS
    # start-up took 3.0-3.5 s on its thread, and the same run's first calls without the
    # warm-up took as long, 2.38 s and 2.41 s: that build's first call, not the warm-up's);
    # no H200 first call at 16384 fits the first call's cost there, so the model adds none
    # (-39%, -44%)
    ("NVIDIA H200", "pipeline first-call-warmup", "float32", 32768),
    ("NVIDIA H200", "pipeline first-call-warmup", "float64", 32768),
    # the H100's first call costs 0.09 s over its steady call in the model (fitted: the float32
    # first call with the warm-up at 16384); the float64 calls with the warm-up ran 0.29 s
    # and 0.63 s over their steady calls (-19%, -18%)
    ("NVIDIA H100", "pipeline first-call-warmup", "float64", 16384),
    ("NVIDIA H100", "pipeline first-call-warmup", "float64", 32768),
    # float32 host operands rounded to bfloat16 on the GPU, through the staging ring, in the
    # twentieth session's runs of leading k-outer units (one run each, 9a2021a): 0.318-0.344 s
    # against the model's 0.399 (+16% to +25%); the ring's host copies bound these, and
    # that machine copied faster than the ring rate fitted on the 16384 runs (the same
    # variant without the debug setting, 14 runs at several commits: -0.3%)
    ("NVIDIA H200", "pipeline distmm-host-bf16-from-f32-lead1", "float32", 32768),
    ("NVIDIA H200", "pipeline distmm-host-bf16-from-f32-lead2", "float32", 32768),
    ("NVIDIA H200", "pipeline distmm-host-bf16-from-f32-lead4", "float32", 32768),
    # C's units in column halves (a debug setting, off: the twentieth session), lead 3 run
    # once, at 4077a15: 0.185 s against the model's 0.134 (-27%). Each unit's A rows waited on
    # the copy-in stream for GEMMs that had read their slot (mended in 3dfe4e8: the lead-2 runs
    # since, -9%, are within), which the model's lanes do not know
    ("NVIDIA H200", "pipeline distmm-host-bf16-pinned-halves-lead3", "float32", 32768),
    # the H100's first bfloat16 runs through the staging ring (one run each, c2032c6,
    # 2026-12-05): 0.2115 s against the model's 0.280 (+32%), and from float32 operands
    # 0.266 s against 0.420 (+58%). The ring's host copies bound both, and the model's rate
    # for them is fitted on that H100's float64 ring runs at 16384 of 2026-11-25 (30.7 GB/s);
    # this machine's copies ran faster (traced: 4 GiB staged in 119 ms of thread time). The
    # same run's page-locked variant, which skips the ring, is within (+4.5%)
    ("NVIDIA H100", "pipeline distmm-host-bf16", "float32", 32768),
    ("NVIDIA H100", "pipeline distmm-host-bf16-from-f32", "float32", 32768),
}


def test_model_against_every_committed_measurement():
    rows = validate(_records())
    engines = {r["engine"] for r in rows}
    assert engines == {"mpi", "batch", "dask", "pipeline"}
    assert len(rows) >= 50
    misses = {(r["machine"], r["label"], r["dtype"], r["m"]) for r in rows if not r["within"]}
    assert misses == KNOWN_MISSES, (
        f"outside {TARGET:.0%}: {sorted(misses)}; newly outside: {sorted(misses - KNOWN_MISSES)}; "
        f"now within: {sorted(KNOWN_MISSES - misses)}")
    # the GPU configurations of the code as it is: the MPI engine on 1 and 2 GPUs at 32768,
    # the batch path on 2 and 4 GPUs at 32768 and 65536, the Dask engine on H200: all within
    gpu = [r for r in rows if r["machine"].startswith("NVIDIA")
           and (r["machine"], r["label"], r["dtype"], r["m"]) not in KNOWN_MISSES]
    assert len(gpu) >= 30 and all(abs(r["error"]) <= TARGET for r in gpu)
    held = [r for r in gpu if r["role"] == "held-out"]
    assert len(held) >= 25
    # distmm bench's study records are configurations too: the MPI engine on 1, 2 and 4 H100
    # (strong and weak) and the Dask engine on 2, all within
    study = [r for r in gpu if r["label"].startswith("study ")]
    assert {r["devices"] for r in study} == {1, 2, 4} and len(study) >= 10


# -- the stream pipeline ---------------------------------------------------------------------

PIPE_CAL = dataclasses.replace(CAL, host_staging=30e9,
                               gemm={**CAL.gemm, "gpu:bf16": GemmRate(700e12, 500.0)})
PIPE_CASES = [  # (m, n, k, dtype, precision, copies, operand bytes)
    (32768, 32768, 32768, "float32", "highest", "ring", None),
    (16384, 16384, 16384, "float64", "highest", "ring", None),
    (20000, 12000, 30001, "float32", "highest", "direct", None),
    (32768, 32768, 32768, "float32", "bf16", "ring", 2),
    (32768, 32768, 32768, "float32", "bf16", "ring", 4),
    (32768, 32768, 32768, "float32", "bf16", "direct", 2),
]
PIPE_IDS = [f"{c[3]}-{c[4]}-{c[5]}-{c[0]}" for c in PIPE_CASES]


def _pipe(cal, m, n, k, dtype, precision, copies, item, **kw):
    return predict(m, n, k, dtype, devices=1, calibration=cal, engine="pipeline",
                   precision=precision, copies=copies, operand_itemsize=item, **kw)


@pytest.mark.parametrize("case", PIPE_CASES, ids=PIPE_IDS)
def test_pipeline_never_slower_with_more_bandwidth_or_gemm_rate(case):
    base = _pipe(PIPE_CAL, *case)
    for factor in (1.5, 4.0):
        for link in ("pcie-h2d", "pcie-d2h"):
            got = _pipe(_scaled_link(PIPE_CAL, link, factor), *case)
            assert got.seconds <= base.seconds * (1 + 1e-12), (link, factor)
        got = _pipe(dataclasses.replace(PIPE_CAL, host_staging=30e9 * factor), *case)
        assert got.seconds <= base.seconds * (1 + 1e-12), factor
        faster = dataclasses.replace(PIPE_CAL, gemm={
            key: GemmRate(v.peak * factor, v.half_size) for key, v in PIPE_CAL.gemm.items()})
        assert _pipe(faster, *case).seconds <= base.seconds * (1 + 1e-12), factor
    # a slower call set-up or first call never makes it faster either
    slower = PIPE_CAL.with_overheads(pipeline_call=0.05, pipeline_first_call=0.3)
    assert _pipe(slower, *case).seconds >= base.seconds
    first = _pipe(slower, *case, first_call=True).seconds
    assert first >= _pipe(slower, *case).seconds + 0.3 - 1e-9


@pytest.mark.parametrize("case", PIPE_CASES, ids=PIPE_IDS)
def test_pipeline_is_bounded_by_its_gemms_and_its_copies(case):
    from distmm.plan_model import pipeline_schedule

    m, n, k, dtype, precision, copies, item = case
    got = _pipe(PIPE_CAL, *case)
    s = pipeline_schedule(m, n, k, dtype, calibration=PIPE_CAL, precision=precision,
                          copies=copies, operand_itemsize=item)
    assert math.isclose(got.seconds, s.seconds, rel_tol=1e-12)
    parts = (got.compute, got.communication, got.io, got.overhead)
    assert min(parts) >= 0 and math.isclose(sum(parts), got.seconds, rel_tol=1e-12)
    out = m * n * (8 if dtype == "float64" else 4)
    rate = PIPE_CAL.gemm["gpu:bf16" if precision == "bf16" else f"gpu:{dtype}"].peak
    # never faster than the GEMMs alone, nor than any one of its copies alone
    lo = 1 - 1e-9  # the lanes' sums and the schedule add the same seconds in other orders
    assert got.seconds >= 2.0 * m * n * k / rate * lo
    assert got.seconds >= s.gemm * lo
    assert s.bytes_in >= (m * k + k * n) * (item or out // (m * n))
    assert s.bytes_out == out
    assert got.seconds >= s.bytes_in / PIPE_CAL.links["pcie-h2d"].bandwidth * lo
    assert got.seconds >= out / PIPE_CAL.links["pcie-d2h"].bandwidth * lo
    if copies == "ring":  # every byte in and out through the host threads' copies
        assert math.isclose(s.host, (s.bytes_in + out) / 30e9, rel_tol=1e-9)
        assert got.seconds >= s.host * lo
    else:
        assert s.host == 0
    # and never slower than every lane one after another
    assert got.seconds <= s.gemm + s.h2d + s.d2h + s.host + s.latency + 1e-9
    assert got.efficiency <= 1 + 1e-9


def test_pipeline_copies_bind_beside_tensor_core_gemms_and_the_ring_costs_more():
    ring = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", "bf16", "ring", 2)
    direct = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", "bf16", "direct", 2)
    wide = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", "bf16", "ring", 4)
    assert direct.seconds < ring.seconds < wide.seconds
    assert ring.io > ring.compute  # 8 GiB through host memory against 0.1 s of GEMMs
    simt = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", "highest", "ring", None)
    assert simt.compute > 0.9 * simt.seconds  # beside SIMT GEMMs the copies hide
    with pytest.raises(ValueError, match="one GPU"):
        predict(1024, 1024, 1024, devices=2, calibration=PIPE_CAL, engine="pipeline")
    with pytest.raises(ValueError, match="no gpu GEMM rate for fp16"):
        _pipe(PIPE_CAL, 1024, 1024, 1024, "float32", "fp16", "ring", 2)
    with pytest.raises(ValueError, match="copies must be one of"):
        _pipe(PIPE_CAL, 1024, 1024, 1024, "float32", "highest", "pigeon", None)


def test_pipeline_arrays_locked_in_place_pay_their_locking_and_unlocking():
    # the caller's arrays page-locked in place by the call and unlocked after it: A, B and C
    # whole at ``host_register`` and ``host_unregister``, beside nothing (the driver
    # serialises them with the other threads' CUDA calls); copied as page-locked arrays
    for precision, item in (("highest", None), ("bf16", 2), ("bf16", 4)):
        direct = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", precision, "direct", item)
        locked = _pipe(PIPE_CAL, 32768, 32768, 32768, "float32", precision, "locked", item)
        nbytes = 2 * 32768**2 * (item or 4) + 32768**2 * 4
        lock = nbytes / PIPE_CAL.host_register + nbytes / PIPE_CAL.host_unregister
        assert math.isclose(locked.seconds, direct.seconds + lock, rel_tol=1e-9)
        assert locked.compute == direct.compute
    # nominal: a probe's 24-34 ms a GiB to lock, 18-21 to unlock (bench/NOTES.md)
    assert 0.024 < 2**30 / PIPE_CAL.host_register < 0.034
    assert 0.018 < 2**30 / PIPE_CAL.host_unregister < 0.021
    faster = dataclasses.replace(PIPE_CAL, host_register=PIPE_CAL.host_register * 2)
    assert (_pipe(faster, 8192, 8192, 8192, "float32", "highest", "locked", None).seconds
            < _pipe(PIPE_CAL, 8192, 8192, 8192, "float32", "highest", "locked", None).seconds)
    back = Calibration.from_dict(faster.to_dict())
    assert back.host_register == faster.host_register
    with pytest.raises(ValueError, match="host_unregister must be positive"):
        dataclasses.replace(PIPE_CAL, host_unregister=0.0)


def test_pipeline_records_are_configurations():
    from distmm.cli.model_records import configuration

    base = {"benchmark": "pipeline", "device": "NVIDIA H200", "dtype": "float32", "m": 32768,
            "n": 32768, "k": 32768, "seconds": 1.0}
    assert configuration({**base, "variant": "cublas", "residency": "device"}) is None
    assert configuration({**base, "variant": "cublas-bf16", "residency": "device",
                          "precision": "bf16"}) is None
    assert configuration({**base, "variant": "naive-host", "residency": "host"}) is None
    ring = configuration({**base, "variant": "distmm-host-bf16", "residency": "host",
                          "precision": "bf16", "operands_as": "uint16", "direct_in": []})
    assert (ring["engine"], ring["copies"], ring["precision"], ring["operand_itemsize"]) == (
        "pipeline", "ring", "bf16", 2)
    pinned = configuration({**base, "variant": "distmm-host-pinned", "residency": "host-pinned",
                            "direct_in": ["A", "B"]})
    assert pinned["copies"] == "direct" and pinned["precision"] is None
    locked = configuration({**base, "variant": "distmm-host-locked-in-place",
                            "residency": "host", "direct_in": True})
    assert locked["copies"] == "locked"
    first = configuration({**base, "variant": "first-call-warmup", "residency": "host"})
    assert first["first_call"] and first["copies"] == "ring" and "tiling" not in first


def test_pipeline_calibration_from_committed_records():
    recs = _records()
    h200 = from_records(recs, "NVIDIA H200")
    # the pipeline's in-core cuBLAS BF16 reference (0.100-0.103 s at 32768)
    assert 650e12 < h200.gemm["gpu:bf16"].peak < 720e12
    # the ring's copies: fitted on the 16384 runs (float64 through the ring, 6 GiB in 0.20 s),
    # not on the 32768 runs held out; the timeline of the bf16 ring (not read by the model)
    # gave 29.3 GB/s over the time its copies ran
    assert 28e9 < h200.host_staging < 36e9 and "fit on" in h200.sources["host_staging"]
    assert "2026-11-22" in h200.sources["host_staging"]
    assert h200.sources["pipeline-first-call"] == "default"  # no H200 first call at 16384
    h100 = from_records(recs, "NVIDIA H100")
    # its one bf16 pipeline run (2026-12-05): in-core cuBLAS BF16 0.0946 s at 32768
    assert 700e12 < h100.gemm["gpu:bf16"].peak < 780e12
    assert "pipeline-nvidia-h100-80gb-hbm3-2026-12-05.jsonl" in h100.sources["gpu:bf16"]
    assert 0.0 < h100.overhead("pipeline-first-call") < 0.3
    assert "fit on" in h100.sources["pipeline-first-call"]


# -- the command line ------------------------------------------------------------------------

@pytest.mark.slow
def test_model_command_prints_a_row_per_device_count(tmp_path):
    from distmm.cli.calibrate import save

    save(from_records(_records(), "NVIDIA H100"), tmp_path / "h100.json")
    done = _distmm("model", "--gpus", "1,2,8", "32768", "32768", "32768", "--calibration",
                   str(tmp_path / "h100.json"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "engine mpi" in lines[0] and "NVIDIA H100" in lines[0]
    rows = {int(ln.split()[0]): ln.split() for ln in lines[2:] if ln.split()[0].isdigit()}
    assert sorted(rows) == [1, 2, 8]
    assert rows[1][3] == "1x1x1" and float(rows[1][2]) == pytest.approx(1.0, abs=0.01)
    assert float(rows[8][1]) < float(rows[2][1]) < float(rows[1][1])
    js = _distmm("model", "--gpus", "4", "1000", "2000", "3000", "--json", "--engine", "batch",
                 "--calibration", str(tmp_path / "h100.json"))
    rec = json.loads(js.stdout.splitlines()[0])
    assert rec["engine"] == "batch" and rec["devices"] == 4 and rec["predicted_seconds"] > 0


def test_model_command_warns_before_the_table():
    done = _distmm("model", "--gpus", "2,64", "200000", "200000", "200000", "--memory", "80GiB")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("warning: on 2 gpu(s) a rank needs") and "short" in first
    assert sum(ln.startswith("warning:") for ln in done.stdout.splitlines()) == 1


_BAD_MODEL_ARGS = [
    (["--gpus", "8,x", "10", "10", "10"], "not a comma-separated list of device counts"),
    (["--gpus", "0", "10", "10", "10"], "device counts must be at least 1"),
    (["--gpus", "8", "10", "10"], "model needs three sizes M N K, got 2"),
    (["10", "10", "10"], "model needs --gpus"),
    (["--gpus", "8", "10", "10", "-1"], "must not be negative"),
    (["--gpus", "8", "10", "10", "10", "--engine", "spark"], "invalid choice: 'spark'"),
    (["--gpus", "8", "10", "10", "10", "--link", "pigeon"], "invalid choice: 'pigeon'"),
    (["--gpus", "8", "10", "10", "10", "--memory", "lots"], "'lots' is not a size"),
    (["--gpus", "8", "10", "10", "10", "--calibration", "/nonexistent/c.json"],
     "no calibration at /nonexistent/c.json"),
    (["--gpus", "8", "10", "10", "10", "--dtype", "int8"], "no gpu GEMM rate for int64"),
    (["--validate", "/nonexistent/r.jsonl"], "/nonexistent/r.jsonl"),
    (["--validate", "x.jsonl", "--gpus", "4"], "--validate takes records only"),
    (["--gpus", "8", "10", "10", "10", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--gpus", "8", "10", "10", "10", "--memory", "1e400"], "'1e400' is not a size"),
    # was: a second, identical row (and a second record under -o)
    (["--gpus", "8,64,8", "10", "10", "10"], "device count 8 is given twice in '8,64,8'"),
    # was: a time for an A of 2**63 x 10 elements, which no array can hold
    (["--gpus", "8", str(2**63), "10", "10"], "more than an array can hold"),
]
_BAD_MODEL_IDS = ["gpus-word", "gpus-zero", "two-sizes", "no-gpus", "negative", "engine", "link",
                  "memory", "calibration", "int8", "records", "validate-gpus", "gpus-per-node",
                  "memory-overflow", "gpus-twice", "size-2**63"]
# argparse's own refusals and the repeats of a kind run with the slow cases
_SLOW_MODEL_IDS = {"gpus-zero", "negative", "engine", "link", "int8", "validate-gpus"}


@pytest.mark.parametrize("argv,needle", [
    pytest.param(*case, id=i, marks=[pytest.mark.slow] * (i in _SLOW_MODEL_IDS))
    for case, i in zip(_BAD_MODEL_ARGS, _BAD_MODEL_IDS, strict=True)])
@pytest.mark.slow
def test_model_bad_arguments_one_line_exit_2(argv, needle):
    done = _distmm("model", *argv)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert needle in done.stderr and done.stderr.startswith("distmm model: error:")


@pytest.mark.parametrize("engine, gpus", [("mpi", "1,2"), ("dask", "1,2"), ("batch", "1,2"),
                                          ("pipeline", "1")])
def test_a_size_of_0_is_refused_in_one_line_for_every_engine(tmp_path, capsys, engine, gpus):
    """An empty product has no multiply-adds: no engine's time to model (was: 0 s at
    efficiency 1.00 for mpi, its fixed costs for dask and batch)."""
    from distmm.cli import main

    for sizes in (["0", "100", "100"], ["100", "100", "0"]):
        argv = ["model", "--engine", engine, "--gpus", gpus, *sizes, "--json",
                "-o", str(tmp_path / "p.jsonl")]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"distmm model: error: M N K must each be at least 1, got "
                                     f"{' '.join(sizes)}: a product with a size of 0 has no "
                                     f"multiply-adds, nothing to model\n")
    assert list(tmp_path.iterdir()) == []


def test_model_validate_writes_records_report_can_read(tmp_path):
    out = tmp_path / "v.jsonl"
    files = [str(p) for p in sorted(RESULTS.glob("mpi-batch-*"))]
    done = _distmm("model", "--validate", *files, "-o", str(out))
    assert done.returncode == 0, done.stderr
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert {r["benchmark"] for r in recs} == {"model-validation"}
    assert all(r["predicted_seconds"] > 0 and r["seconds"] > 0 for r in recs)
    assert "configurations within 15%" in done.stdout
    from distmm.cli.report import REQUIRED

    assert all(all(k in r for k in REQUIRED) for r in recs)


def test_model_validate_refuses_an_output_it_cannot_write_before_the_table(tmp_path):
    # was: the whole table, then an error naming the hidden staged file
    files = [str(p) for p in sorted(RESULTS.glob("mpi-batch-*"))]
    for out, needle in ((tmp_path, f"a folder, not a file: {tmp_path}"),
                        (tmp_path / "no" / "v.jsonl", f"no such folder: {tmp_path / 'no'}")):
        done = _distmm("model", "--validate", *files, "-o", str(out))
        assert done.returncode == 2, done.stderr
        assert done.stdout == "" and done.stderr.count("\n") == 1 and needle in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_model_predictions_become_records_report_marks_predicted(tmp_path):
    from distmm.cli.calibrate import save

    save(from_records(_records(), "NVIDIA H200"), tmp_path / "h200.json")
    out = tmp_path / "pred.jsonl"
    done = _distmm("model", "--gpus", "8,16", "32768", "32768", "32768", "--calibration",
                   str(tmp_path / "h200.json"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["variant"] for r in recs] == ["distmm-mpi@8gpus", "distmm-mpi@16gpus"]
    for r, p in zip(recs, (8, 16)):
        assert r["seconds"] is None and r["role"] == "predicted" and r["ranks"] == p
        assert r["device"] == "NVIDIA H200" and r["benchmark"] == "mpi"
        assert r["predicted_seconds"] > 0 and "not measured" in r["note"]
    assert recs[1]["predicted_seconds"] < recs[0]["predicted_seconds"]
    # the report puts them after the measured 1- and 2-GPU runs of the same family, marked
    measured = [str(p) for p in sorted(RESULTS.glob("mpi-nvidia-h200-*.jsonl"))]
    done = _distmm("report", *measured, str(out), "-o", str(tmp_path / "rep"))
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "rep" / "report.md").read_text()
    rows = [ln for ln in table.splitlines() if "| distmm-mpi |" in ln and "ranks 8 " in ln]
    assert rows and all(f"{recs[0]['predicted_seconds']:.4g} (predicted)" in ln for ln in rows)
    bad = _distmm("model", "--gpus", "8", "10", "10", "10", "--variant", "x")
    assert bad.returncode == 2 and "add -o" in bad.stderr


@pytest.mark.parametrize("points, latency, bandwidth", [
    ([(8, 1e-4), (2**20, 1.1e-4 + 2**20 / 5e9)], 1e-4, 2**20 / (1e-5 + 2**20 / 5e9)),
    # a 1 MiB message no slower than 8 bytes (seen on a loaded VM): at least its bytes over
    # its time, not 2**20 / 1e-9 (10^15 bytes/s: communication free in every prediction)
    ([(2**20, 9e-4), (8, 1e-3)], 1e-3, 2**20 / 9e-4),
    ([(8, 1e-3), (2**20, 1.05e-3)], 1e-3, 2**20 / 1.05e-3),
])
def test_a_link_fit_never_divides_by_the_timer_s_noise(points, latency, bandwidth):
    link = _fit_link(points)
    assert link.latency == latency and link.bandwidth == pytest.approx(bandwidth, rel=1e-12)


def test_calibrate_from_records_needs_a_machine_when_several(tmp_path):
    files = [str(RESULTS / "mpi-amd-epyc-2026-11-25.jsonl"),
             str(RESULTS / "mpi-intel-r-xeon-r-processor-2026-11-25.jsonl")]
    done = _distmm("calibrate", "--from-records", *files, "-o", str(tmp_path / "c.json"))
    assert done.returncode == 2 and "name one with --machine" in done.stderr
    assert not (tmp_path / "c.json").exists()
    done = _distmm("calibrate", "--from-records", *files, "--machine", "AMD EPYC", "-o",
                   str(tmp_path / "c.json"))
    assert done.returncode == 0, done.stderr
    assert load(tmp_path / "c.json").machine == "AMD EPYC"


@pytest.mark.slow
@pytest.mark.mpi
def test_calibrate_quick_end_to_end(tmp_path, mpi_env):
    out = tmp_path / "cal.json"
    done = _distmm("calibrate", "--quick", "-o", str(out), env={
        **mpi_env, "TMPDIR": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")},
        timeout=180)
    assert done.returncode == 0, done.stderr
    cal = load(out)
    assert isinstance(cal, Calibration)
    if not any(key.startswith("gpu:") for key in cal.gemm):  # said, not left to be inferred
        assert "calibrate: not measured: no GPU" in done.stderr, done.stderr
    assert cal.sources["mpi-host"].startswith("measured: mpiexec -n 2")
    assert cal.sources["tcp"].startswith("measured: LocalCluster")
    assert cal.rate("cpu", "float64").peak > 1e8
    assert cal.rate("cpu", "float64").size_rule == "volume"
    cores = len(os.sched_getaffinity(0))
    assert cal.cores == cores
    if cores > 1:  # one core alone measured beside all of them: a factor of 1 or more
        assert cal.core_boost["float64"] >= 1.0
        assert "one thread" in cal.sources["core_boost:float64"]
    assert cal.links["mpi-host"].bandwidth > 1e7 and cal.links["mpi-host"].latency < 0.1
    assert cal.file_write > 1e6 and cal.file_read > 1e6
    assert not list(tmp_path.glob("distmm-calibrate-*"))  # its temporary files are gone
    assert not (tmp_path / "cache").exists()  # -o: nothing written to the default place
    model = _distmm("model", "--gpus", "1,2", "--device", "cpu", "--dtype", "float64",
                    "--calibration", str(out), "2000", "2000", "2000")
    assert model.returncode == 0, model.stderr
    assert "engine mpi on cpus" in model.stdout
    folder = _distmm("calibrate", "--quick", "-o", str(tmp_path))
    assert folder.returncode == 2 and "a folder, not a file" in folder.stderr


def test_batch_records_say_how_b_reached_the_ranks():
    """A batch record's configuration carries ``batch_panels``: the record's own, or, for
    records made before it was kept, ``share`` where a whole-rows run copied between GPUs."""
    from distmm.cli.model_records import configuration

    base = {"benchmark": "mpi-batch", "device": "NVIDIA H100 80GB HBM3", "dtype": "float32",
            "m": 32768, "n": 32768, "k": 32768, "seconds": 5.0, "ranks": 4,
            "grid": [1, 4, 1]}
    conf = lambda **r: configuration({**base, "variant": "mpirun-4", **r})["batch_panels"]
    assert conf(batch_panels="broadcast") == "broadcast"
    assert conf(phases={"read": 1.0, "comm": 0.02}) == "share"
    assert conf(phases={"read": 1.0}) == "read"
    assert conf(grid=[1, 2, 2], phases={"comm": 0.5}) == "read"  # a 2-D grid of one host


def test_dask_workers_of_several_hosts_receive_other_hosts_chunks_over_the_link():
    cal = dataclasses.replace(default_calibration(), gpus_per_node=2)
    one_host = dataclasses.replace(cal, gpus_per_node=8)
    for n in (16384, 32768, 65536):
        kw = dict(devices=4, engine="dask", device="gpu")
        tcp = predict(n, n, n, "float32", calibration=cal, link="tcp", **kw)
        nccl = predict(n, n, n, "float32", calibration=cal, link="nccl-socket", **kw)
        ipc = predict(n, n, n, "float32", calibration=cal, **kw)
        # the same remote bytes: NCCL's arrive while the k pieces multiply, TCP's before
        assert ipc.seconds <= nccl.seconds < tcp.seconds
        # one host: every remote chunk over the link named, as before
        flat = predict(n, n, n, "float32", calibration=one_host, link="tcp", **kw)
        remote = 0.75 * (n * n / 2 + n * n / 2) * 4  # 3 of 4 quarters of a worker's panels
        assert flat.communication == pytest.approx(cal.link("tcp").seconds(remote))
        # two hosts of two: a third of those bytes come from the worker's own host through
        # CUDA IPC, the rest over the link, whose bandwidth the host's two workers share
        panels = remote / 0.75
        assert tcp.communication == pytest.approx(
            cal.link("ipc").seconds(panels / 4) + cal.link("tcp").seconds(panels / 2 * 2))
        # NCCL connects each pair of GPUs on its own: a worker's bytes from the other host at
        # the link's rate, not shared by its host's workers (the first k piece's wait exposed)
        far = cal.link("nccl-socket").seconds(panels / 2)
        first = far * 8192 / n
        assert nccl.communication == pytest.approx(
            cal.link("ipc").seconds(panels / 4) + first
            + max(0.0, far - first - nccl.compute))


# -- calibrations and arguments that would have given a wrong figure --------------------------

_MISLEADING = [  # (a change to a stored calibration, what the refusal names)
    (lambda d: d["memory_bandwidth"].update(cpu=-5e9), "memory_bandwidth of cpu must be positive"),
    (lambda d: d["memory_bandwidth"].update(gpu=0.0), "memory_bandwidth of gpu must be positive"),
    (lambda d: d["overheads"].update({"mpi-call": -10.0}), "overhead mpi-call must be seconds"),
    (lambda d: d["overheads"].update({"dask-call": math.nan}), "overhead dask-call must be"),
    (lambda d: d["links"]["mpi-host"].update(latency=math.inf), "latency must be finite"),
    (lambda d: d["gemm"]["cpu:float64"].update(half_size=math.inf), "half_size must be finite"),
    (lambda d: d.update(file_read=math.inf), "file_read must be positive bytes/s, got inf"),
    (lambda d: d.update(cores=0), "cores must be a positive integer, got 0"),
    (lambda d: d.update(cores=2.5), "cores must be a positive integer, got 2.5"),
    (lambda d: d.update(host_memory=0), "host_memory must be a positive integer"),
    (lambda d: d.update(gpus_per_node=0), "gpus_per_node must be a positive integer"),
    (lambda d: d.update(machine=None), "machine must name the machine"),
    (lambda d: d.update(format="distmm-calibration-2"), "format 'distmm-calibration-2', not"),
]


def test_a_calibration_that_would_mislead_is_refused_naming_its_file(tmp_path):
    # was: a negative overhead printed a negative time, a NaN one 'nan', an infinite latency
    # 'inf', an infinite half_size or no host memory a ZeroDivisionError (status 1), and
    # zero cores, 2.5 cores or a negative memory bandwidth were taken as they were
    from distmm.cli.calibrate import save

    good = save(CAL, tmp_path / "good.json").read_text()
    for i, (change, needle) in enumerate(_MISLEADING):
        data = json.loads(good)
        change(data)
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError) as err:
            load(path)
        assert str(err.value).startswith(f"{path}: ") and needle in str(err.value), needle
    # records where a calibration belongs: said so, not 'not JSON (Extra data ...)'
    records = RESULTS / "mpi-amd-epyc-2026-11-25.jsonl"
    with pytest.raises(ValueError, match="benchmark records \\(JSON lines\\), not a calibration"):
        load(records)


@pytest.mark.slow
def test_model_refuses_a_calibration_it_cannot_use_naming_the_file(tmp_path):
    from distmm.cli.calibrate import save

    cpu = save(from_records(_records(), "AMD EPYC"), tmp_path / "cpu.json")
    # a CPU machine's calibration asked for GPUs: the file named, and the way out
    done = _distmm("model", "--gpus", "8", "100", "100", "100", "--calibration", str(cpu))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert f"{cpu}: the calibration of 'AMD EPYC' has no gpu GEMM rate" in done.stderr
    assert "(or --device cpu)" in done.stderr
    # a valid rate so small its times overflow: refused, not 'inf' printed as a figure
    data = json.loads(cpu.read_text())
    data["gemm"]["cpu:float64"]["peak"] = 1e-300
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(data))
    done = _distmm("model", "--gpus", "8", "--device", "cpu", "--dtype", "float64",
                   "--calibration", str(tiny), "2000", "2000", "2000")
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert f"{tiny}: its rates give inf s on 8 cpu(s)" in done.stderr
    done = _distmm("model", "--validate", str(RESULTS / "cpu-scaling-2-amd-epyc-2026-11-27.jsonl"),
                   "--calibration", str(tiny))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert f"{tiny}: its rates give inf s for " in done.stderr
    # a calibration where records belong: was 'no distmm measurement ... in these records'
    done = _distmm("model", "--validate", str(cpu),
                   str(RESULTS / "mpi-amd-epyc-2026-11-25.jsonl"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"{cpu}: a calibration, not records" in done.stderr
    # records of kernels only: the files named (was 'in these records')
    kernels = RESULTS / "kernels-nvidia-h200-2026-11-22.jsonl"
    done = _distmm("model", "--validate", str(kernels))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"no distmm measurement the model describes in {kernels}" in done.stderr


def test_calibrate_refuses_to_store_over_its_own_records(tmp_path):
    # was: -o naming one of --from-records replaced the records with the calibration
    records = tmp_path / "r.jsonl"
    records.write_bytes((RESULTS / "mpi-amd-epyc-2026-11-25.jsonl").read_bytes())
    before = records.read_bytes()
    done = _distmm("calibrate", "--from-records", str(records), "-o",
                   str(tmp_path / "." / "r.jsonl"))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "is one of the records it would be derived from" in done.stderr
    assert records.read_bytes() == before and sorted(tmp_path.iterdir()) == [records]


@pytest.mark.slow  # ~4 s: two commands, held and let go at a second's start

def test_model_predictions_of_two_runs_at_once_are_two_runs(tmp_path):
    """distmm model -o named its run by the current second: two runs into one records file in
    the same second were one run (distmm report paired each with the other's). Both held just
    before they write, then let go together just after a second begins: each run's records
    carry an id of their own (``distmm.cli.records.run_id``)."""
    import re
    import time

    from conftest import pause_at

    out, procs, sites = tmp_path / "pred.jsonl", [], []
    for size in ("1000", "2000"):
        site = tmp_path / f"site-{size}"
        site.mkdir()
        pause_at(site, "distmm.cli.model", "_write_predictions")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
               "DISTMM_CACHE_DIR": str(tmp_path / "cache")}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distmm", "model", "--gpus", "2", size, size, size, "-o",
             str(out)], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE))
        sites.append(site)
    try:
        deadline = time.time() + 60
        while not all((site / "paused").exists() for site in sites):
            assert all(p.poll() is None for p in procs) and time.time() < deadline
            time.sleep(0.01)
        time.sleep(1.0 - time.time() % 1.0 + 0.02)  # just after a second begins
        for site in sites:
            (site / "go").touch()
        done = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], done
    runs = {r["m"]: r["run"] for r in map(json.loads, out.read_text().splitlines())}
    assert len(set(runs.values())) == 2, runs
    assert all(re.fullmatch(r"model-\d{8}T\d{6}Z", run) for run in runs.values()), runs


@pytest.mark.slow  # ~2 s: a second's start, then the next second
def test_two_tune_runs_in_one_second_are_two_runs(tmp_path, monkeypatch):
    """distmm tune's records named their run by the current second, as distmm model's did:
    two runs begun in the same second were one run. Each takes ``run_id``'s, its own."""
    import time

    from distmm.cli.tune import TuneRecords

    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path / "cache"))
    time.sleep(1.0 - time.time() % 1.0 + 0.02)  # just after a second begins
    first, second = (TuneRecords("NVIDIA H100", tmp_path) for _ in range(2))
    assert first.run != second.run and first.path == second.path, (first.run, second.run)
