"""The performance model against committed benchmark records: every measured configuration.

This module covers: which records are distmm measurements the model describes and how
(``configuration``: the MPI engine in core on GPUs or CPU ranks, the batch path
``mpirun distmm matmul`` on files, the Dask engine on GPU workers (one, two, two sharing a GPU,
one beside CPU workers) and on CPU workers), the prediction for one (``predict_record``), and
``validate``: a calibration per machine from the records' reference measurements and the fit
subset (``distmm.cli.calibrate.from_records``), then the model's prediction against the latest
measurement of every configuration, with the relative error and whether the configuration was
fitted on or held out; ``validation_records`` turns the rows into JSON-lines records with
``predicted_seconds`` beside ``seconds`` (what ``distmm report`` reads).

It does *not* cover: the model (``distmm.plan_model``) or printing (``distmm.cli.model``).
References (cuBLAS, numpy, dask.array, peers), the local engine and the kernel benchmarks are
not configurations of the model and are skipped.
"""
from __future__ import annotations

from collections import defaultdict

from distmm.plan_model import Calibration, Prediction, predict

__all__ = ["configuration", "predict_record", "validate", "validation_records", "TARGET"]

#: the issue's target: every measured time within this relative error
TARGET = 0.15


def configuration(rec: dict) -> dict | None:
    """How the model describes a record, or None for a record that is no distmm measurement
    of an engine it models."""
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
    if bench == "cpu" and variant == "distmm-dask":
        return {**base, "engine": "dask", "device": "cpu", "devices": int(rec.get("workers") or 1),
                "label": "dask cpu"}
    return None


_KEYS = ("engine", "device", "devices", "grid", "ranks_per_device", "threads_per_rank",
         "extra_cpu_workers", "link")


def predict_record(conf: dict, cal: Calibration) -> Prediction:
    """The model's prediction for a ``configuration``."""
    kwargs = {k: conf[k] for k in _KEYS if conf.get(k) is not None}
    return predict(conf["m"], conf["n"], conf["k"], conf["dtype"], calibration=cal, **kwargs)


def validate(records, *, calibration: Calibration | None = None) -> list[dict]:
    """Compare the model with every configuration in ``records`` (from
    ``distmm.cli.calibrate.load_records``).

    Each machine gets its calibration from the records (``from_records``), unless
    ``calibration`` is given: then it serves every machine. A configuration is one engine, device count, layout, size and
    dtype on one machine; its measured time is that of its latest run (the code as it is),
    with the range over every run beside it.

    Returns
    -------
    list of dict
        One row per configuration: ``machine``, ``label``, ``engine``, ``devices``, ``m``,
        ``n``, ``k``, ``dtype``, ``grid``, ``seconds`` (latest run), ``run``, ``commit``,
        ``runs``, ``seconds_min``, ``seconds_max``, ``predicted_seconds``, the parts
        (``compute_seconds``, ...), ``error`` ((predicted - measured) / measured),
        ``role`` (``fit``: fixed costs were fitted on it; ``held-out``) and ``within``
        (``|error| <= TARGET``).
    """
    from distmm.cli.calibrate import fit_subset, from_records, machine_of

    groups: dict = defaultdict(list)
    for rec in records:
        conf = configuration(rec)
        if conf is None:
            continue
        machine = machine_of(rec["device"])
        key = (machine, conf["label"]) + tuple(
            (k, conf.get(k)) for k in ("m", "n", "k", "dtype") + _KEYS)
        groups[key].append((rec, conf))
    cals: dict = {}
    rows = []
    for key in sorted(groups, key=str):
        machine = key[0]
        if machine not in cals:
            cals[machine] = calibration or from_records(records, machine)
        cal = cals[machine]
        runs = groups[key]
        rec, conf = max(runs, key=lambda rc: (str(rc[0].get("run")), rc[0]["seconds"]))
        pred = predict_record(conf, cal)
        measured = float(rec["seconds"])
        error = (pred.seconds - measured) / measured
        rows.append({
            "machine": machine, "device": rec["device"], "label": conf["label"],
            "engine": conf["engine"], "devices": conf["devices"],
            "m": conf["m"], "n": conf["n"], "k": conf["k"], "dtype": conf["dtype"],
            "grid": list(pred.grid), "seconds": measured, "run": rec.get("run"),
            "commit": rec.get("commit"), "runs": len(runs),
            "seconds_min": min(r["seconds"] for r, _ in runs),
            "seconds_max": max(r["seconds"] for r, _ in runs),
            "predicted_seconds": pred.seconds, "compute_seconds": pred.compute,
            "communication_seconds": pred.communication, "io_seconds": pred.io,
            "overhead_seconds": pred.overhead, "error": error,
            "role": "fit" if any(fit_subset(r) for r, _ in runs) else "held-out",
            "within": abs(error) <= TARGET, "source": rec["_file"]})
    return rows


def validation_records(rows, *, run: str, commit: str, date: str) -> list[dict]:
    """The rows as benchmark records (``benchmark: model-validation``, ``variant``: the
    configuration, ``seconds`` measured and ``predicted_seconds``), one per configuration."""
    out = []
    for row in rows:
        out.append({"run": run, "benchmark": "model-validation",
                    "variant": f"{row['label']} ({row['engine']})", "device": row["device"],
                    "dtype": row["dtype"], "m": row["m"], "n": row["n"], "k": row["k"],
                    "seconds": row["seconds"], "predicted_seconds": row["predicted_seconds"],
                    "tflops": 2.0 * row["m"] * row["n"] * row["k"] / row["seconds"] / 1e12,
                    "relerr": None, "commit": commit, "date": date,
                    "devices": row["devices"], "grid": row["grid"], "error": row["error"],
                    "role": row["role"], "measured_run": row["run"],
                    "measured_commit": row["commit"], "runs": row["runs"],
                    "seconds_min": row["seconds_min"], "seconds_max": row["seconds_max"],
                    "parts": {"compute": row["compute_seconds"],
                              "communication": row["communication_seconds"],
                              "io": row["io_seconds"], "overhead": row["overhead_seconds"]},
                    "source": row["source"]})
    return out
