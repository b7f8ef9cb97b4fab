"""The performance model against committed benchmark records: every measured configuration.

This module covers: ``validate``: a calibration per machine from the records' reference
measurements and the fit subset (``distmm.cli.calibrate.from_records``), then the model's
prediction against the latest measurement of every configuration, with the relative error and
whether the configuration was fitted on or held out; ``validation_records`` turns the rows
into JSON-lines records with ``predicted_seconds`` beside ``seconds`` (what ``distmm report``
reads).

It does *not* cover: the model (``distmm.plan_model``), which records are configurations of
it (``distmm.cli.model_records``), or printing (``distmm.cli.model``).
"""
from __future__ import annotations

from collections import defaultdict

from distmm.cli.model_records import KEYS, configuration, predict_record
from distmm.plan_model import Calibration

__all__ = ["validate", "validation_records", "TARGET", "configuration", "predict_record"]

#: the issue's target: every measured time within this relative error
TARGET = 0.15


def validate(records, *, calibration: Calibration | None = None) -> list[dict]:
    """Compare the model with every configuration in ``records`` (from
    ``distmm.cli.model_records.load_records``).

    Each machine gets its calibration from the records (``from_records``), unless
    ``calibration`` is given: then it serves every machine. A CPU configuration whose run
    measured numpy too takes its cores' rates from that run's references (shared VMs run
    numpy 1.7-2.5x apart from one run to the next; the issue's rule: the reference measured
    in the same run). A configuration is one engine,
    device count, layout, size and dtype on one machine; its measured time is that of its
    latest run (the code as it is), with the range over every run beside it.

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
    from distmm.cli.calibrate import from_records
    from distmm.cli.model_records import fit_subset, machine_of

    groups: dict = defaultdict(list)
    for rec in records:
        conf = configuration(rec)
        if conf is None:
            continue
        machine = machine_of(rec["device"])
        key = (machine, conf["label"]) + tuple(
            (k, conf.get(k)) for k in ("m", "n", "k", "dtype") + KEYS)
        groups[key].append((rec, conf))
    cals: dict = {}
    numpy_runs = {(machine_of(r["device"]), r.get("run")) for r in records
                  if r.get("variant") == "numpy" and "device" in r}
    rows = []
    for key in sorted(groups, key=str):
        machine = key[0]
        runs = groups[key]
        rec, conf = max(runs, key=lambda rc: (str(rc[0].get("run")), rc[0]["seconds"]))
        own = (machine, rec.get("run")) in numpy_runs and conf["device"] == "cpu"
        at = (machine, rec.get("run") if own else None)
        if at not in cals:
            cals[at] = calibration or from_records(records, machine, run=at[1])
        cal = cals[at]
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
