"""Benchmark records as the performance model reads them.

This module covers: loading record files (JSON lines), ``--profile`` files and SUMMA traces
(``load_records``), a record's machine (``machine_of``), which records are distmm measurements
the model describes and how (``configuration``: the MPI engine in core on GPUs or CPU ranks,
the batch path ``mpirun distmm matmul`` on files, the Dask engine on GPU workers (one, two,
two sharing a GPU, one beside CPU workers) and on CPU workers, and the stream pipeline on one
GPU from host-resident operands), the model's prediction for one (``predict_record``), and
which measurements the fixed costs are fitted on (``fit_subset``; a batch job's ``--profile``
as the record it judges: ``profile_record``).

It does *not* cover: deriving a calibration (``distmm.cli.calibrate``) or the comparison
(``distmm.cli.validate``). References (cuBLAS, numpy, dask.array, peers), the local engine and
the kernel benchmarks are no configurations of the model: ``configuration`` gives None.
"""
from __future__ import annotations

from pathlib import Path

from distmm.cli.records import json_file, read_records
from distmm.plan_model import Calibration, Prediction, predict

__all__ = ["load_records", "machine_of", "configuration", "predict_record", "fit_subset",
           "profile_record", "ofi_probed", "is_summa_trace", "trace_machine",
           "DEVICE_MEMORY", "KEYS"]

#: bytes per GPU by device name (the records do not carry it)
DEVICE_MEMORY = {"H100": 80 * 2**30, "H200": 141 * 10**9}


def load_records(paths) -> list[dict]:
    """Benchmark records (JSON lines), ``--profile`` files (``distmm-profile-1``, one or a
    mapping of several) and SUMMA traces (``bench/research/summa_trace.py --out``: a list per
    rank of its calls), each record tagged with its ``_file``; profiles come back as
    ``{"profile": name, "_file": ..., **profile}``, traces as ``{"summa_trace": name,
    "_file": ..., "machine": ..., "ranks": [...]}`` (``trace_machine``: the trace does not name
    its device, its file does). Records of a reduced ``precision`` (tf32, bf16, fp16) are left
    out, except the stream pipeline's (its ``cublas-bf16`` reference measures the precision's
    own GEMM rate in the same run): the other engines' rates are those of each dtype's own
    arithmetic. So are records whose ``invalid`` says why their figure is not to be used and
    those whose product failed its float64 check (``relerr_ok`` false, as ``distmm bench``
    writes it), as ``distmm report`` leaves them out. Each record is checked by
    ``distmm.cli.records.check_record``: a file that is not UTF-8 JSON (lines), or a record
    lacking a key or with a field of the wrong type or range, raises ``ValueError`` or
    ``TypeError`` naming the file, the line and the field."""
    out = []
    for path in paths:
        path = Path(path)
        if path.suffix == ".json":
            data = json_file(path)
            if is_summa_trace(data):
                out.append({"summa_trace": path.stem, "_file": path.name,
                            "machine": trace_machine(path.name), "ranks": data})
                continue
            if isinstance(data, dict) and data.get("format") == "distmm-profile-1":
                data = {path.stem: data}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: neither a profile nor a mapping of profiles")
            for name, prof in data.items():
                if isinstance(prof, dict) and prof.get("format") == "distmm-profile-1":
                    out.append({"profile": name, "_file": path.name, **prof})
            continue
        for _, rec in read_records(path):
            if (rec.get("precision", "highest") != "highest"
                    and rec.get("benchmark") != "pipeline"):
                continue
            if rec.get("invalid") or rec.get("relerr_ok") is False:
                continue  # a time that is no result's (as distmm report leaves it out)
            rec["_file"] = path.name
            out.append(rec)
    return out


def is_summa_trace(data) -> bool:
    """Whether parsed JSON is ``bench/research/summa_trace.py``'s output: a list per rank of
    that rank's calls, each a mapping with its ``rank``, ``grid``, ``node`` and ``events``."""
    return (isinstance(data, list) and bool(data)
            and all(isinstance(calls, list) and calls for calls in data)
            and all(isinstance(c, dict) and {"rank", "grid", "events"} <= set(c)
                    for calls in data for c in calls))


def trace_machine(name: str) -> str | None:
    """The machine of a SUMMA trace from its file name, which names the device as the record
    files do (``summa-trace-nvidia-h200-DATE-....json``): the GPU model it names, or None."""
    for gpu in DEVICE_MEMORY:
        if gpu.lower() in name.lower():
            return machine_of(gpu)
    return None


def machine_of(device: str) -> str:
    """A record's ``device`` as a machine name: the GPU model, or the CPU's name."""
    for gpu in DEVICE_MEMORY:
        if gpu in device:
            return f"NVIDIA {gpu}"
    return device


def fit_subset(rec: dict) -> bool:
    """Whether a distmm measurement is one the fixed costs are fitted on: one device (one GPU,
    one rank or one worker) at the smaller size each benchmark ran, and for the batch path,
    whose fixed costs grow with the ranks of a node, also two ranks under ``mpirun`` at that
    size. Everything else (every other configuration on several devices, every larger size)
    is held out. The stream pipeline (one GPU always): its runs at 16384."""
    size = min(rec.get("m", 0), rec.get("n", 0), rec.get("k", 0))
    bench = rec.get("benchmark")
    if bench == "mpi-batch":
        variant = str(rec.get("variant", ""))
        two = variant.startswith("mpirun-") and int(rec.get("ranks") or 1) == 2
        return (variant in ("batch-1", "mpirun-1") or two) and size <= 32768
    if bench == "dask-gpu":
        return rec.get("setting") == "1gpu" and size <= 16384 and rec.get("dtype") == "float32"
    if bench == "mpi":
        return rec.get("ranks") == 1 and (rec.get("gpus") or 1) <= 1
    if bench == "pipeline":  # one GPU always: the smaller size it ran (16384)
        return size <= 16384
    return False


#: a study's debug settings a record carries (``distmm bench``'s extras): a run with any of
#: them is a configuration of its own, labelled with them, not the latest run of the default
DEBUG_EXTRAS = ("first_piece_k", "later_piece_k", "first_parts", "stream_priority")


def configuration(rec: dict) -> dict | None:
    """How the model describes a record, or None for a record that is no distmm measurement
    of an engine it models."""
    conf = _configuration(rec)
    debug = [f"{k}={rec[k]}" for k in DEBUG_EXTRAS if rec.get(k) is not None]
    if conf is not None and debug:
        conf["label"] += f" [{', '.join(debug)}]"
    return conf


def _configuration(rec: dict) -> dict | None:
    bench, variant = rec.get("benchmark"), str(rec.get("variant", ""))
    if "profile" in rec or not rec.get("seconds") or not rec.get("m"):
        return None
    base = {"m": rec["m"], "n": rec["n"], "k": rec["k"], "dtype": rec["dtype"]}
    if bench == "mpi" and variant == "distmm-mpi":
        ranks = int(rec.get("ranks") or 1)
        grid = tuple(rec["grid"]) if rec.get("grid") else None
        if rec.get("mode") == "gpu":
            gpus = int(rec.get("gpus") or 1)
            return {**base, "engine": "mpi", "device": "gpu", "devices": ranks,
                    "ranks_per_device": max(1, ranks // max(gpus, 1)), "grid": grid,
                    "label": f"mpi gpu {ranks} rank(s) on {gpus} GPU(s)"}
        threads = int(rec.get("threads_per_rank") or 1)
        cores = int(rec.get("threads") or ranks * threads)
        return {**base, "engine": "mpi", "device": "cpu", "devices": ranks, "grid": grid,
                "threads_per_rank": threads,
                "ranks_per_device": max(1, -(-ranks * threads // max(cores, 1))),
                "label": f"mpi cpu {ranks} rank(s) on {cores} cores"}
    if bench == "mpi-batch" and (variant.startswith("mpirun-") or variant == "batch-1"):
        ranks = int(rec.get("ranks") or 1)
        grid = tuple(rec["grid"])[-2:] if rec.get("grid") else None
        return {**base, "engine": "batch", "device": "gpu", "devices": ranks, "grid": grid,
                "batch_panels": _batch_panels(rec, ranks, grid),
                "direct_writes": _direct_writes(rec), "mpi_ofi": ofi_probed([rec]),
                "label": f"batch {variant}"}
    if bench == "dask-gpu" and variant.startswith("distmm-dask"):
        setting = rec.get("setting")
        conf = {**base, "engine": "dask", "device": "gpu", "label": f"dask gpu {variant}"}
        if setting == "shared":
            return {**conf, "devices": 2, "ranks_per_device": 2}
        if setting == "mixed":
            return {**conf, "devices": int(rec.get("gpu_workers") or 1),
                    "extra_cpu_workers": int(rec.get("cpu_workers") or 0)}
        return {**conf, "devices": int(rec.get("gpus") or 1)}
    if bench == "scaling" and rec.get("engine") in ("mpi", "dask") and variant.startswith("distmm-"):
        return _study_configuration(rec, base)
    if bench == "cpu" and variant == "distmm-dask":
        return {**base, "engine": "dask", "device": "cpu", "devices": int(rec.get("workers") or 1),
                "label": "dask cpu"}
    if (bench == "pipeline" and str(rec.get("residency", "")).startswith("host")
            and variant != "naive-host"):
        return _pipeline_configuration(rec, base, variant)
    return None


def _pipeline_configuration(rec: dict, base: dict, variant: str) -> dict:
    """A stream-pipeline record (``bench.pipeline``): one GPU, host-resident operands, through
    the ring (plain numpy arrays), straight from arrays their owner page-locked (``-pinned``,
    ``direct_in``/``direct_out`` naming operands) or page-locked in place by each call
    (``-locked-in-place``, a debug setting); its precision and the bytes an operand element
    crosses as (``operands_as`` ``uint16``: bfloat16's bits); ``first-call`` variants (a fresh
    process's first ``distmm.matmul``) add the first call's set-up. The record's ``tiling``,
    where it has one, is the schedule it ran (``tiling``, beside the configuration's keys)."""
    precision = str(rec.get("precision") or "highest")
    if "locked-in-place" in variant:
        copies = "locked"
    elif (variant.endswith("-pinned") or rec.get("residency") == "host-pinned"
          or rec.get("direct_in") or rec.get("direct_out")):
        copies = "direct"
    else:
        copies = "ring"
    item = 2 if rec.get("operands_as") == "uint16" else None
    conf = {**base, "engine": "pipeline", "device": "gpu", "devices": 1,
            "precision": precision if precision != "highest" else None, "copies": copies,
            "operand_itemsize": item, "first_call": variant.startswith("first-call"),
            "label": f"pipeline {variant}"}
    if isinstance(rec.get("tiling"), dict) and rec["tiling"].get("row_sizes"):
        conf["tiling"] = rec["tiling"]
    return conf


def _batch_panels(rec: dict, ranks: int, grid) -> str:
    """How a batch record's ranks got B: its ``batch_panels``, or, in records made before it
    was kept, what its profile shows (ranks of a whole-rows grid that copied pieces of B from
    each other's GPUs shared it; such ranks that copied nothing read it all)."""
    if rec.get("batch_panels"):
        return rec["batch_panels"]
    whole_rows = grid is not None and grid[-1] == 1 and ranks > 1
    return "share" if whole_rows and (rec.get("phases") or {}).get("comm") else "read"


def _direct_writes(rec: dict) -> bool:
    """Whether a batch record's ranks wrote C past the page cache: ``written_direct`` (bytes
    its profile wrote directly, recorded since direct writes exist, commit 941389f) where
    recorded, else ``direct_writes``; a record with neither predates direct writes (its C went
    through the page cache and a sync)."""
    if rec.get("written_direct") is not None:
        return int(rec["written_direct"]) > 0
    return str(rec.get("direct_writes", "false")).lower() == "true"


def profile_record(prof: dict) -> dict:
    """A batch job's ``--profile`` (``load_records``' form, named ``VARIANT-SIZE`` as the
    ``mpi-batch`` benchmark names them) as the record ``fit_subset`` judges: its benchmark,
    variant, rank count and square size."""
    name = str(prof.get("profile", ""))
    variant, _, size = name.rpartition("-")
    n = int(size) if size.isdigit() else 0
    return {"benchmark": "mpi-batch", "variant": variant if n else name, "m": n, "n": n,
            "k": n, "ranks": int(prof.get("meta", {}).get("ranks") or 1)}


def ofi_probed(run_records) -> bool:
    """Whether Open MPI's ``MPI_Init`` probed its libfabric (ofi) BTL in a run, from the run's
    records: ``ompi_mca_btl`` (recorded since it was set) excluding ``ofi`` (``^ofi``) or naming
    other BTLs says no; a run whose records do not carry it ran with Open MPI's default, which
    probes it (about 1 s of ``MPI_Init``: bench/NOTES.md, "Launch: Open MPI's libfabric
    probe")."""
    btls = {str(r["ompi_mca_btl"]) for r in run_records if r.get("ompi_mca_btl")}
    if not btls:
        return True
    return any(("ofi" in b) != b.startswith("^") for b in btls)


def _study_configuration(rec: dict, base: dict) -> dict:
    """A ``distmm bench`` study's record (benchmark ``scaling``) of the MPI or Dask engine.
    Emulated nodes (``emulated_nodes``) are modelled with every link on NCCL's socket
    transport (MPI, and Dask GPU workers whose device chunks crossed through NCCL:
    ``nccl_pairs``, recorded since the route exists) or TCP (the other Dask records): the
    model has one link kind per configuration, and the links between emulated nodes are
    the slower ones. A GPU configuration's ``gpus_per_node`` is that of its emulated nodes
    (the Dask model takes a worker's own node's chunks through CUDA IPC)."""
    engine, gpu = rec["engine"], "gpus" in rec
    count = int(rec.get("ranks") or rec.get("workers") or rec.get("gpus") or 1)
    nodes = rec.get("emulated_nodes")
    where = f"{count} GPU(s)" if gpu else f"{count} core(s)"
    nccl = engine == "mpi" and gpu or bool(rec.get("nccl_pairs"))
    label = f"study {engine} {'gpu' if gpu else 'cpu'} on {where}" + (
        f", emulated nodes {nodes}" if nodes else "") + (
        " through NCCL" if nodes and engine == "dask" and nccl else "") + (
        ", one CPU a rank" if engine == "mpi" and gpu and _one_cpu_ranks(rec) else "")
    conf = {**base, "engine": engine, "device": "gpu" if gpu else "cpu", "devices": count,
            "label": label}
    if engine == "mpi" and rec.get("grid"):
        conf["grid"] = tuple(rec["grid"])
    if engine == "mpi" and not gpu:
        conf["threads_per_rank"] = int(rec.get("threads_per_rank") or 1)
    if nodes:
        conf["link"] = "nccl-socket" if nccl else "tcp"
        if gpu:  # the devices of one emulated node ("all-links": each its own)
            conf["gpus_per_node"] = 1 if nodes == "all-links" else max(1, count // int(nodes))
    return conf


def _one_cpu_ranks(rec: dict) -> bool:
    """Whether a study's GPU ranks each ran on one CPU (their launcher's binding kept),
    which the model does not describe: NCCL's socket threads then share the rank's core.
    ``cpus_per_rank`` says so where recorded; before it was, every emulated launch
    (``mpiexec``'s MPMD form, two ranks or fewer an app context) had mpiexec's default
    binding, one core a rank, unless its note names ``--bind-to none``."""
    if rec.get("cpus_per_rank") is not None:
        return int(rec["cpus_per_rank"]) == 1
    return bool(rec.get("emulated_nodes")) and "--bind-to none" not in str(rec.get("note", ""))


#: the arguments of ``predict`` a configuration may carry
KEYS = ("engine", "device", "devices", "grid", "ranks_per_device", "threads_per_rank",
         "extra_cpu_workers", "link", "batch_panels", "direct_writes", "mpi_ofi",
         "precision", "copies", "operand_itemsize", "first_call")


def predict_record(conf: dict, cal: Calibration) -> Prediction:
    """The model's prediction for a ``configuration`` (its ``gpus_per_node``, where it has
    one, in place of the calibration's; a pipeline record's ``tiling``)."""
    if conf.get("gpus_per_node"):
        import dataclasses

        cal = dataclasses.replace(cal, gpus_per_node=int(conf["gpus_per_node"]))
    kwargs = {k: conf[k] for k in KEYS if conf.get(k) is not None}
    if conf.get("tiling") is not None:
        kwargs["tiling"] = conf["tiling"]
    return predict(conf["m"], conf["n"], conf["k"], conf["dtype"], calibration=cal, **kwargs)
