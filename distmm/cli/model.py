"""``distmm calibrate`` and ``distmm model``: their options, and what they print.

This module covers: the parsers of both commands (``add_parsers``, called by
``distmm.cli.commands.build_parser``), ``distmm calibrate [-o FILE] [--quick]
[--from-records FILES --machine NAME]`` (measure this machine, or derive a calibration from
benchmark records, and store it), and ``distmm model --gpus 8,64 M N K`` (per device count:
predicted time and its parts, efficiency, the best grid and its replication, the words a rank
touches against the 2D / 2.5D / 3D lower bounds, and a warning first where a rank's memory
will not suffice) and ``distmm model --validate RECORDS... [-o FILE.jsonl]`` (the model against
every configuration in the records, a table, and records with ``predicted_seconds``).

It does *not* cover: the model (``distmm.plan_model``), measuring (``distmm.cli.calibrate``),
or reading records (``distmm.cli.validate``).
"""
from __future__ import annotations

import argparse
import datetime
import errno
import json
import math
import os
import sys
from pathlib import Path

from distmm.cli.argtypes import nonempty, positive_size
from distmm.cli.exits import raise_if_signalled
from distmm.cli.outputs import check_writable, file_in_the_way

__all__ = ["add_parsers", "run_calibrate", "run_model"]


def _counts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of device counts") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"device counts must be at least 1, got {value}")
        if value in out:  # a second row (and -o record) of the same count
            raise argparse.ArgumentTypeError(f"device count {value} is given twice in {text!r}")
        out.append(value)
    return out


def add_parsers(sub, common, dtype_type, count_type) -> None:
    """Add ``calibrate`` and ``model`` to the ``distmm`` parser's subcommands."""
    from distmm.plan_model import DEVICE_KINDS, ENGINES, LINKS

    c = sub.add_parser("calibrate", parents=[common],
                       help="measure the performance model's parameters on this machine",
                       description="measure GEMM rates, memory, MPI, TCP and file bandwidths "
                                   "(and on GPUs cuBLAS, PCIe and NCCL) and store them as JSON; "
                                   "or derive them from benchmark records")
    c.add_argument("-o", "--output", default=None, metavar="FILE",
                   type=nonempty("output path"),
                   help="where to store it (default: a per-host file under the user's cache "
                        "folder, ~/.cache/distmm/calibration-HOST.json)")
    c.add_argument("--quick", action="store_true",
                   help="small sizes and few repeats (seconds, for tests)")
    c.add_argument("--from-records", nargs="+", default=None, metavar="FILE", type=nonempty(),
                   help="derive the calibration from benchmark records (.jsonl), --profile "
                        "files (.json) and SUMMA traces (summa-trace-*.json) instead of "
                        "measuring")
    c.add_argument("--machine", default=None, type=nonempty("machine name"),
                   help="with --from-records: which machine's records (a device name such as "
                        "'NVIDIA H200'; default: the only one, or the GPU one)")
    c.set_defaults(func=run_calibrate)

    m = sub.add_parser("model", parents=[common],
                       help="predict time, efficiency and the best grid per device count",
                       description="the calibrated performance model: per device count the "
                                   "predicted time, efficiency, best grid, communication against "
                                   "the 2D/2.5D/3D lower bounds and a memory check; or, with "
                                   "--validate, the model against measured records")
    m.add_argument("sizes", nargs="*", type=count_type, metavar="M N K",
                   help="C[M,N] = A[M,K] @ B[K,N]")
    m.add_argument("--gpus", "--devices", dest="devices", type=_counts, default=None,
                   metavar="P1,P2,...", help="device counts (ranks or workers), e.g. 8,64,512")
    m.add_argument("--dtype", type=dtype_type, default="float32",
                   help="element type of A and B; the model is of numpy's result of their "
                        "product (float32 for bfloat16, which needs ml_dtypes) (default float32)")
    m.add_argument("--engine", choices=ENGINES, default="mpi",
                   help="mpi: in-core SUMMA; batch: mpirun distmm matmul on files; dask: block "
                        "layout (GPU workers) or tiles (CPU workers); pipeline: one GPU "
                        "streaming host-resident numpy operands through its ring (--gpus 1) "
                        "(default mpi)")
    m.add_argument("--device", choices=DEVICE_KINDS, default="gpu",
                   help="what each rank or worker computes on (default gpu)")
    m.add_argument("--calibration", default=None, metavar="FILE", type=nonempty(),
                   help="a stored calibration (default: this host's, else nominal H100 values)")
    m.add_argument("--link", choices=LINKS, default=None,
                   help="the link between ranks (default: nvlink for GPU ranks, ipc for GPU "
                        "workers, mpi-host for CPU ranks, tcp for CPU workers)")
    m.add_argument("--memory", type=positive_size("80GiB"), default=None, metavar="SIZE",
                   help="memory of one device, e.g. 80GiB (default: the calibration's)")
    m.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="devices per host, which share its disk and links (default: the "
                        "calibration's, i.e. the machine it was measured on)")
    m.add_argument("--validate", nargs="+", default=None, metavar="RECORDS", type=nonempty(),
                   help="compare the model with every configuration in these records "
                        "(.jsonl), the --profile files (.json) and SUMMA traces "
                        "(summa-trace-*.json: NCCL's socket link) they are calibrated from")
    m.add_argument("-o", "--output", default=None, metavar="FILE.jsonl", type=nonempty(),
                   help="with --validate: write the comparison as records (predicted_seconds); "
                        "else append one prediction record per device count (seconds null, "
                        "role predicted), which distmm report draws as predicted")
    m.add_argument("--benchmark", default=None, metavar="NAME", type=nonempty("name"),
                   help="with -o: the benchmark the predictions join (default: the engine's, "
                        "mpi, mpi-batch or dask-gpu / cpu-dask)")
    m.add_argument("--variant", default=None, metavar="NAME", type=nonempty("name"),
                   help="with -o: the variant family (default distmm-ENGINE); the count is "
                        "added as @Pgpus / @Pranks / @Pworkers")
    m.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    m.set_defaults(func=run_model)


# ------------------------------------------------------------------------- calibrate


def run_calibrate(args) -> int:
    from distmm.cli import calibrate as cb

    path = cb.default_path() if args.output is None else args.output
    # before measuring ('-o ""' is refused, not the default); the file is replaced
    check_writable(path, writes="replace")
    path = Path(path)
    for given in args.from_records or ():
        if path.exists() and Path(given).exists() and path.samefile(given):
            raise ValueError(f"-o {path} is one of the records it would be derived from")
    if args.from_records:
        if args.quick:
            raise ValueError("--quick measures; it does not go with --from-records")
        records = cb.load_records(args.from_records)
        machines = sorted({cb.machine_of(r["device"]) for r in records if "device" in r})
        if not machines:
            raise ValueError(f"no record in {' '.join(args.from_records)} names its device "
                             f"(the 'device' field): nothing to calibrate from")
        machine = args.machine
        if machine is None:
            gpus = [mm for mm in machines if mm.startswith("NVIDIA")]
            if len(machines) == 1 or len(gpus) == 1:
                machine = machines[0] if len(machines) == 1 else gpus[0]
            else:
                raise ValueError(f"the records hold several machines ({', '.join(machines)}): "
                                 f"name one with --machine")
        cal = cb.from_records(records, machine)
    else:
        if args.machine:
            raise ValueError("--machine goes with --from-records")
        cal = cb.measure(quick=args.quick,
                         progress=lambda line: print(f"calibrate: {line}", file=sys.stderr,
                                                     flush=True))
    raise_if_signalled()  # a signal a library swallowed while measuring: nothing stored
    cb.save(cal, path)
    _print_calibration(cal)
    print(f"stored in {path}")
    return 0


def _print_calibration(cal) -> None:
    print(f"calibration of {cal.machine}")
    for key, rate in sorted(cal.gemm.items()):
        print(f"  GEMM {key:14} {rate.peak / 1e12:9.3f} TFLOP/s peak, half rate at "
              f"min(m,n,k) = {rate.half_size:.0f}  [{cal.sources.get(key, '?')}]")
    for name, link in sorted(cal.links.items()):
        print(f"  link {name:14} {link.bandwidth / 1e9:9.2f} GB/s, latency "
              f"{link.latency * 1e6:.1f} us  [{cal.sources.get(name, '?')}]")
    print(f"  files: read {cal.file_read / 1e9:.2f} GB/s, write {cal.file_write / 1e9:.2f} GB/s"
          f"  [{cal.sources.get('file_write', '?')}]")
    mem = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in sorted(cal.memory_bandwidth.items()))
    print(f"  memory bandwidth: {mem}")
    print(f"  host staging (the stream pipeline's ring): {cal.staging_rate() / 1e9:.2f} GB/s"
          f"  [{cal.sources.get('host_staging', 'default')}]")


# ------------------------------------------------------------------------- model


def _calibration(path_text):
    from distmm.cli import calibrate as cb
    from distmm.plan_model import default_calibration

    if path_text:
        return cb.load(path_text), str(path_text)
    path = cb.default_path()
    if path.exists():
        return cb.load(path), str(path)
    return default_calibration(), f"none stored at {path}: nominal values (run distmm calibrate)"


def _stored(where: str) -> str:
    """``where`` (``_calibration``'s) as the start of an error: the file, if one was read."""
    return "" if where.startswith("none stored at ") else f"{where}: "


def _words(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def run_model(args) -> int:
    if args.validate:
        if args.sizes or args.devices:
            raise ValueError("--validate takes records only, not M N K or --gpus")
        return _validate(args)
    if (args.benchmark or args.variant) and not args.output:
        raise ValueError("--benchmark and --variant name the records of -o FILE.jsonl: add -o")
    if len(args.sizes) != 3:
        raise ValueError(f"model needs three sizes M N K, got {len(args.sizes)}")
    if not args.devices:
        raise ValueError("model needs --gpus P1,P2,... (device counts)")
    import numpy as np

    from distmm.plan import result_dtype
    from distmm.plan_model import best_plan, predict

    m, n, k = args.sizes
    if 0 in (m, n, k):  # no multiply-adds: every engine's figures would be only its overheads
        raise ValueError(f"M N K must each be at least 1, got {m} {n} {k}: a product with a "
                         f"size of 0 has no multiply-adds, nothing to model")
    # the model, its records and the benchmarks' are of numpy's result dtype, which the
    # engines compute in: float32 for bfloat16 operands
    operands, args.dtype = args.dtype, result_dtype(args.dtype, args.dtype)
    cal, where = _calibration(args.calibration)
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
        import dataclasses

        cal = dataclasses.replace(cal, gpus_per_node=args.gpus_per_node)
    try:  # a missing rate fails before anything prints, naming the file
        cal.rate(args.device, _acc(args.dtype))
    except ValueError as exc:
        cpu = f"cpu:{_acc(args.dtype).name}" in cal.gemm
        hint = " (or --device cpu)" if args.device == "gpu" and cpu else ""
        raise ValueError(f"{_stored(where)}{exc}{hint}") from None
    rows = []
    for p in args.devices:
        best = best_plan(m, n, k, args.dtype, devices=p, calibration=cal, engine=args.engine,
                         device=args.device, link=args.link, memory=args.memory)
        own = best if args.engine != "mpi" else predict(
            m, n, k, args.dtype, devices=p, calibration=cal, engine=args.engine,
            device=args.device, link=args.link, memory=args.memory)
        for pred in (best, own):  # an extreme calibration: inf or nan, not a figure
            if not all(map(math.isfinite, (pred.seconds, pred.efficiency))):
                raise ValueError(f"{_stored(where)}its rates give {pred.seconds} s on {p} "
                                 f"{args.device}(s) (grid {'x'.join(map(str, pred.grid))}): "
                                 f"not a prediction")
        rows.append((p, best, own))
    # after the planners, whose limits speak first; before anything is printed or written
    for name, v in (("A", m * k), ("B", k * n), ("C", m * n)):
        if v > np.iinfo(np.intp).max:  # no array holds it: a figure for it would be fiction
            raise ValueError(f"{name} of a {m} x {n} x {k} product would have {v} elements, "
                             f"more than an array can hold ({np.iinfo(np.intp).max})")
    if args.output:
        _write_predictions(args, cal, rows)
    if args.json:
        for p, best, own in rows:
            print(json.dumps({**best.to_dict(), "engine_grid": list(own.grid),
                              "engine_seconds": own.seconds, "calibration": cal.machine}))
        for _, best, _ in rows:
            if best.memory_warning():
                print(best.memory_warning(), file=sys.stderr)
        return 0
    for _, best, _ in rows:  # before the table: a run would fail
        if best.memory_warning():
            print(best.memory_warning())
    link = rows[0][1].link
    of = "" if operands == args.dtype else f" (of {operands.name} operands)"
    print(f"C[{m},{n}] = A[{m},{k}] @ B[{k},{n}] {args.dtype.name}{of}; engine {args.engine} on "
          f"{args.device}s, link {link}; calibration: {cal.machine} ({where})")
    head = (f"{'devices':>8} {'time s':>10} {'eff':>6} {'best grid':>12} {'c':>3} "
            f"{'compute':>9} {'comm':>9} {'io':>8} {'fixed':>7} {'recv/rank':>10} "
            f"{'words/rank':>10} {'2D bound':>9} {'2.5D bound':>10} {'3D bound':>9} "
            f"{'mem/rank':>9}")
    print(head)
    for p, best, own in rows:
        g = "x".join(map(str, best.grid))
        b = best.bounds
        print(f"{p:>8} {best.seconds:>10.4g} {best.efficiency:>6.2f} {g:>12} "
              f"{best.replication:>3} {best.compute:>9.4g} {best.communication:>9.3g} "
              f"{best.io:>8.3g} {best.overhead:>7.3g} {best.bytes_received / 2**30:>8.3g}Gi "
              f"{_words(best.words_touched):>10} {_words(b.two_d):>9} "
              f"{_words(b.two_and_half_d) + f' c={b.replication}':>10} {_words(b.three_d):>9} "
              f"{best.memory_needed / 2**30:>7.3g}Gi")
        if own.grid != best.grid:
            print(f"{'':>8} distmm's own grid {'x'.join(map(str, own.grid))}: "
                  f"{own.seconds:.4g} s")
    print("words/rank: elements one rank loads or holds (its A and B panels, C and partials); "
          "bounds after Kwasniewski et al. SC19 (2D/2.5D: 2mnk/(P sqrt S); 3D: 3(mnk/P)^(2/3))")
    return 0


#: the benchmark a prediction joins by default, per engine and device kind
_BENCHMARKS = {("mpi", "gpu"): "mpi", ("mpi", "cpu"): "mpi", ("batch", "gpu"): "mpi-batch",
               ("batch", "cpu"): "mpi-batch", ("dask", "gpu"): "dask-gpu", ("dask", "cpu"): "cpu-dask"}


def _write_predictions(args, cal, rows) -> None:
    """Append one record per device count to ``args.output``: distmm's own plan (the grid
    the engine would choose), ``predicted_seconds`` and ``seconds`` null, ``role``
    ``"predicted"``, so that ``distmm report`` shows it in place of a measurement, marked."""
    import datetime as dt

    from distmm.cli.records import append_record, git_commit, run_id

    m, n, k = args.sizes
    run = "model-" + run_id()  # no other run's on this host
    now = dt.datetime.now(dt.timezone.utc)
    benchmark = args.benchmark or _BENCHMARKS.get((args.engine, args.device), args.engine)
    family = args.variant or f"distmm-{args.engine}"
    unit = "workers" if args.engine == "dask" and args.device == "cpu" else (
        "gpus" if args.device == "gpu" else "ranks")
    for p, best, own in rows:
        count = {"gpus": p, "ranks": p} if unit != "workers" else {"workers": p}
        append_record(args.output, {
            "run": run, "benchmark": benchmark,
            "variant": f"{family}@{p}{unit}", "device": cal.machine,
            "dtype": args.dtype.name, "m": int(m), "n": int(n), "k": int(k),
            "seconds": None, "tflops": None, "relerr": None,
            "predicted_seconds": own.seconds, "role": "predicted", **count,
            "grid": list(own.grid), "best_grid": list(best.grid),
            "best_predicted_seconds": best.seconds, "engine": args.engine,
            "link": own.link, "calibration": cal.machine, "gpus_per_node": cal.gpus_per_node,
            "commit": git_commit(),
            "date": now.date().isoformat(),
            "note": "predicted by distmm model, not measured"})


def _acc(dtype):
    from distmm.plan import accumulate_dtype

    return accumulate_dtype(dtype)


def _is_calibration(path) -> bool:
    """Whether ``path`` is a JSON object that says it is a distmm calibration."""
    if Path(path).suffix != ".json":
        return False
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith(
        "distmm-calibration")


def _validate(args) -> int:
    from distmm.cli.model_records import load_records
    from distmm.cli.validate import TARGET, validate, validation_records

    calibration = _calibration(args.calibration)[0] if args.calibration else None
    for path in args.validate:
        if not Path(path).is_file():
            raise FileNotFoundError(2, "no such record file", path)
        if _is_calibration(path):
            raise ValueError(f"{path}: a calibration, not records (give it as --calibration)")
    if args.output:  # before the table, named as given (not its staged file)
        out = Path(args.output)
        if out.is_dir():
            raise IsADirectoryError(21, "a folder, not a file", str(out))
        blocked = file_in_the_way(out)  # its folder, or one above it, is a file
        if blocked is not None:
            raise NotADirectoryError(errno.ENOTDIR, f"{blocked} is not a folder", str(out))
        if not out.absolute().parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such folder", str(out))
        for given in args.validate:  # the comparison replaces -o: never the measurements
            if out.exists() and out.samefile(given):
                raise ValueError(f"-o {out} is one of the records it compares (the comparison "
                                 f"would replace them): name another file")
    rows = validate(load_records(args.validate), calibration=calibration)
    if not rows:
        raise ValueError(f"no distmm measurement the model describes in "
                         f"{', '.join(map(str, args.validate))}")
    for r in rows:  # an extreme calibration: inf or nan, not a figure to compare
        if not math.isfinite(r["predicted_seconds"]):
            source = args.calibration or "the calibration from these records"
            raise ValueError(f"{source}: its rates give {r['predicted_seconds']} s for "
                             f"{r['label']} {r['dtype']} at {r['m']}: not a prediction")
    print(f"{'machine':18} {'configuration':40} {'dtype':7} {'size':>6} {'grid':>8} "
          f"{'measured':>9} {'predicted':>9} {'error':>7} {'role':9} runs")
    for r in rows:
        grid = "x".join(map(str, r["grid"]))
        mark = "" if r["within"] else "  <- outside"
        print(f"{r['machine'][:18]:18} {r['label'][:40]:40} {r['dtype']:7} {r['m']:>6} "
              f"{grid:>8} {r['seconds']:>9.4g} {r['predicted_seconds']:>9.4g} "
              f"{r['error']:>+7.1%} {r['role']:9} {r['runs']}{mark}")
    inside = sum(r["within"] for r in rows)
    held = [r for r in rows if r["role"] == "held-out"]
    print(f"{inside} of {len(rows)} configurations within {TARGET:.0%} "
          f"({sum(r['within'] for r in held)} of {len(held)} held out)")
    if args.output:
        from distmm.cli.records import run_id

        run = run_id()  # no other run's on this host
        now = datetime.datetime.now(datetime.timezone.utc)
        recs = validation_records(rows, run=run,
                                  commit=os.environ.get("DISTMM_COMMIT", "unknown"),
                                  date=now.strftime("%Y-%m-%d"))
        out = Path(args.output)
        tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"wrote {len(recs)} records to {out}")
    return 0
