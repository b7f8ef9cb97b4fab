"""``distmm bench STUDY.toml``: run a scaling study and write one record per configuration.

This module covers: the command's options (``add_parser``); the checks of the machine
before anything runs (the memory every problem's operands take, the cores a CPU study's
threads and workers take, the GPUs, ``mpiexec`` starting the most ranks, dask-cuda a study
needs); ``--dry-run``; and measuring every configuration of a study (``distmm.cli.study``):
the in-process references (numpy's BLAS on every core, in-core cuBLAS on one GPU) and the
local engine on operands made once per problem, a real ``distributed`` cluster per Dask
worker count (single-thread CPU worker processes, or one dask-cuda worker per GPU) with
dask.array measured on the same cluster, and one ``mpiexec -n P`` per rank count
(``distmm.cli.bench_rank``); a series on emulated nodes (``nodes``, ``emulated`` in the
study) gets its own cluster, started as those nodes (``distmm.cli.cluster``), or its own
launch, Open MPI's MPMD form with each node's environment (``distmm.cli.emulated``), and
its records carry ``emulated_nodes``. Every configuration's first call and ``repeats`` warm
calls are timed (the record's ``seconds`` is the warm calls' median), its result is checked
against float64 (``check_rows`` sampled rows of C, or all of them), and its record is
appended to the output in one write as soon as it is measured, so a killed study keeps what
it finished; one progress line per configuration.
It does *not* cover: the study file's schema (``distmm.cli.study``), the ranks' own program
(``distmm.cli.bench_rank``), the records' format (``distmm.cli.records``) or the plots
(``distmm report``). dask, distributed, dask_cuda, cupy and mpi4py are imported where used.

Operands: the in-process variants and the MPI ranks multiply the same matrices
(``distmm.cli.blocks``, made block by block so no rank holds a whole one); the Dask
variants multiply random operands made and persisted on the workers before the clock
starts (``distmm.cli.cluster.random_array``), and C stays on the cluster (persisted, not
gathered). A GPU study's local engine gets numpy operands (host-resident, the stream
pipeline); cuBLAS, the Dask workers and the MPI ranks hold theirs on the GPU.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from distmm.cli.argtypes import nonempty
from distmm.cli.exits import Signalled, raise_if_signalled
from distmm.cli.outputs import check_writable
from distmm.cli.records import progress_line
from distmm.cli.study import Config, Study, load_study

__all__ = ["add_parser", "run_bench", "RELERR_BOUND", "default_output"]

#: relerr above this fails the configuration (its record is still written, ``relerr_ok`` false)
RELERR_BOUND = {"float32": 1e-4, "float64": 1e-11}
#: the same at a study's reduced ``precision`` (float32 operands): about ten times each
#: format's unit roundoff (2**-11 for tf32 and fp16, 2**-8 for bf16)
PRECISION_RELERR_BOUND = {"tf32": 5e-3, "fp16": 5e-3, "bf16": 4e-2}


def add_parser(sub, common) -> None:
    """Add ``distmm bench`` to the subparsers ``sub`` of ``distmm``."""
    b = sub.add_parser("bench", parents=[common], help="run a scaling study (a TOML file) and "
                       "write its records",
                       description="run the scaling study STUDY.toml (engines, backends, "
                                   "dtypes, sizes, strong and weak series over device counts, "
                                   "references measured in the same run) and append one "
                                   "record per configuration to a JSON-lines file, which "
                                   "distmm report reads")
    b.add_argument("study", metavar="STUDY.toml", type=nonempty(),
                   help="the study file (bench/studies/*.toml)")
    b.add_argument("-o", "--output", metavar="FILE.jsonl", default=None, type=nonempty(),
                   help="the records file, appended to (default: <study>-<device>-<date>.jsonl "
                        "in the results/ folder beside a studies/ folder holding the study, "
                        "else in the current folder)")
    b.add_argument("--dry-run", action="store_true",
                   help="list the configurations, the clusters and the mpiexec launches, and "
                        "measure nothing")
    b.set_defaults(func=lambda args: run_bench(args.study, args.output, dry_run=args.dry_run))


# ---------------------------------------------------------------- the command


def default_output(study: Study, device: str, date: str) -> Path:
    """``<results>/<study>-<device-slug>-<date>.jsonl``: ``results/`` beside the ``studies/``
    folder that holds the study file (``bench/results`` for ``bench/studies/x.toml``), else
    the current folder."""
    from distmm.cli.records import slug

    where = Path(study.path).resolve().parent
    folder = where.parent / "results" if where.name == "studies" else Path.cwd()
    return folder / f"{study.name}-{slug(device)}-{date}.jsonl"


def run_bench(study_path: str, output: str | None = None, *, dry_run: bool = False) -> int:
    """Run the study ``study_path``; return the exit status (1 when a configuration failed or
    was off its float64 reference, after the others ran).

    Raises ``ValueError`` (exit 2) for a bad study file or a machine that lacks what it
    asks for, before anything runs."""
    study = load_study(study_path)
    configs = study.configurations()
    if dry_run:
        _list(study, configs)
        return 0
    _check_machine(study, configs)
    if output == "":
        raise ValueError("-o '' names no file: -o takes a records file (FILE.jsonl)")
    if output is not None and (Path(output).is_dir() or output.endswith(("/", os.sep))):
        raise IsADirectoryError(21, "Is a directory (-o takes a records file)", output)
    from distmm.cli.records import RecordWriter, cpu_model, gpu_name

    device = gpu_name() if study.device == "gpu" else cpu_model()
    path = output or default_output(study, device, datetime.date.today().isoformat())
    _check_output(Path(path), study)
    writer = RecordWriter(study.benchmark, device, path=path, study=study.name)
    runner = _Runner(study, configs, writer)
    mode = "" if study.precision == "highest" else f" at precision {study.precision}"
    print(f"distmm bench {study.name}: {len(configs)} configurations on {device}{mode}, run "
          f"{writer.run}, records to {writer.path}", flush=True)
    runner.run()
    failed = runner.failures
    print(f"distmm bench {study.name}: {runner.written} records in {writer.path}"
          + (f"; {len(failed)} failed: {'; '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def _check_output(path: Path, study: Study) -> None:
    """The records file can be written (appended to, or created in its folder, or the folder
    made), before anything runs: not after a study's measurements, which would all be lost
    (``check_writable``); ``ValueError`` for the study file itself (records appended to it
    would break it)."""
    if path.exists() and os.path.samefile(path, study.path):
        raise ValueError(f"{path}: -o names the study file itself: records go to a .jsonl "
                         f"file of their own")
    check_writable(path, writes="append")


def _as_nodes(nodes) -> str:
    """`` as N emulated nodes`` (or the all-links mode) for the listing; empty for one host."""
    if nodes is None:
        return ""
    return (" with every link on the network path (emulated, all-links)" if nodes == "all-links"
            else f" as {nodes} emulated nodes")


def _list(study: Study, configs: list[Config]) -> None:
    from distmm.cli.emulated import mpiexec_command

    def places(engine):
        seen = {c.place: c for c in configs if c.engine == engine}
        return ", ".join(f"{c.count}{_as_nodes(c.nodes)}"
                         for _, c in sorted(seen.items(), key=lambda kv: str(kv[0]))) or "none"

    unit = "GPU" if study.device == "gpu" else "CPU"
    mode = "" if study.precision == "highest" else f", precision {study.precision}"
    print(f"study {study.name} ({study.path}): device {study.device}{mode}, {len(configs)} "
          f"configurations, {study.repeats} warm calls each after the first")
    for i, c in enumerate(configs, 1):
        where = {"dask": f"Dask cluster of {c.count} {unit} workers{_as_nodes(c.nodes)}",
                 "mpi": f"mpiexec -n {c.count}{_as_nodes(c.nodes)}", "local": "this process",
                 "numpy": "this process", "cublas": "this process, one GPU"}[c.engine]
        print(f"[{i}/{len(configs)}] {c.describe()}: {where}"
              + (f", chunks {c.chunk}" if c.chunk else ""))
    dask, mpi = places("dask"), places("mpi")
    print(f"Dask clusters: {dask}{' workers' * (dask != 'none')}; mpiexec launches: {mpi}"
          f"{' ranks' * (mpi != 'none')}")
    for c in {c.place: c for c in configs if c.engine == "mpi" and c.nodes is not None}.values():
        argv = mpiexec_command(study.mpiexec, c.count, c.nodes,
                               ["python", "-m", "mpi4py", "-m", "distmm.cli.bench_rank", "SPEC"])
        print(f"emulated launch of {c.count} ranks: {' '.join(argv)}")


def _check_machine(study: Study, configs: list[Config]) -> None:
    """What the study needs of this machine, before anything runs (``ValueError``)."""
    where = study.path
    engines = {c.engine for c in configs}
    _check_memory(study, configs)
    if "mpi" in engines:
        if shutil.which(study.mpiexec[0]) is None:
            raise ValueError(f"{where}: mpiexec: {study.mpiexec[0]!r} is not on PATH (the "
                             f"study has an mpi series)")
        if any(c.engine == "mpi" and c.nodes is not None for c in configs):
            _check_open_mpi(study)
        _check_launches(study, configs)
    if study.device == "gpu":
        from distmm.cli.cluster import local_gpus

        need = max(c.count for c in configs)
        have = local_gpus()
        if have < need:
            raise ValueError(f"{where}: device: the study needs {need} GPU(s), this machine "
                             f"has {have} (cupy and a CUDA driver)")
        if "dask" in engines:
            try:
                importlib.import_module("dask_cuda")
            except ImportError:
                raise ValueError(f"{where}: the study's dask series on GPUs need dask-cuda: "
                                 f"pip install \"distmm[gpu]\"") from None
    elif not study.oversubscribe:
        _check_cores(study, configs)


def _rank_threads(study: Study, count: int, cores: int) -> int:
    """The BLAS threads of each of ``count`` MPI ranks: ``threads_per_rank``, else
    (``"share"``) the ``cores`` shared between them, at least one."""
    return study.threads_per_rank or max(1, cores // count)


def _check_cores(study: Study, configs: list[Config]) -> None:
    """A CPU study's local threads and Dask workers (one single-thread process each), and
    its MPI ranks' threads (``threads_per_rank`` x ranks, where a rank has more than one),
    within this machine's usable cores (``distmm.config.available_cpus``): more is refused
    before anything runs unless the study sets ``oversubscribe = true``. Ranks of one thread
    each beyond the cores are the launcher's slots (``_check_launches``)."""
    from distmm.config import available_cpus

    cores = available_cpus()
    for i, s in enumerate(study.series):
        for engine, unit in (("local", "threads"), ("dask", "workers")):
            if engine in s.engines and max(s.counts) > cores:
                raise ValueError(f"{study.path}: series[{i}].counts: {max(s.counts)} {engine} "
                                 f"{unit}, more than this machine's {cores} usable cores: set "
                                 f"oversubscribe = true in the study to run them anyway")
    for c in configs:
        threads = _rank_threads(study, c.count, cores) if c.engine == "mpi" else 1
        if threads > 1 and threads * c.count > cores:
            raise ValueError(f"{study.path}: threads_per_rank: {c.describe()}: {threads} "
                             f"threads x {c.count} ranks = {threads * c.count}, more than this "
                             f"machine's {cores} usable cores: set oversubscribe = true in the "
                             f"study to run them anyway")


def _host_memory() -> int:
    """This machine's memory in bytes (psutil's ``total``)."""
    import psutil

    return int(psutil.virtual_memory().total)


def _check_memory(study: Study, configs: list[Config]) -> None:
    """Every configuration whose operands this machine holds (all of a CPU study's, the
    in-process ones of a GPU study's) has A, B and C within its memory: a size that cannot
    fit is refused before anything runs, not after the configurations before it."""
    total = None
    for c in configs:
        if study.device == "gpu" and c.engine in ("dask", "mpi"):
            continue  # on the GPUs: the engines check their memory
        need = (c.m * c.k + c.k * c.n + c.m * c.n) * np.dtype(c.dtype).itemsize
        total = _host_memory() if total is None else total
        if need > total:
            key = "sizes_per_device" if c.series == "weak" else "sizes"
            raise ValueError(f"{study.path}: {key}: {c.describe()} needs {need / 2**30:.4g} GiB "
                             f"for A, B and C, more than this machine's {total / 2**30:.4g} GiB "
                             f"of memory")


def _check_open_mpi(study: Study) -> None:
    """Emulated nodes under MPI give each node's ranks their environment with Open MPI's
    ``-x`` (``distmm.cli.emulated``): another launcher is refused before anything runs."""
    try:
        out = subprocess.run([study.mpiexec[0], "--version"], capture_output=True, text=True,
                             timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = str(exc)
    if "Open MPI" not in text:
        raise ValueError(f"{study.path}: mpiexec: emulated nodes need Open MPI's mpiexec (its "
                         f"-x gives each node's ranks their environment); "
                         f"{study.mpiexec[0]} --version says {' '.join(text.split())[:80]!r}")


#: tries of a launch before it is refused (Open MPI's PMIx sometimes fails to start once)
LAUNCH_TRIES = 2


def _check_launches(study: Study, configs: list[Config]) -> None:
    """The study's launcher starts its largest MPI rank count here (one launch of an empty
    Python program per emulated-node setting): more ranks than the launcher has slots (Open
    MPI without ``--oversubscribe``), root without ``--allow-run-as-root``, a launcher that
    fails, are refused before anything runs, not after the configurations before them."""
    from distmm.cli.emulated import mpiexec_command

    largest: dict = {}
    for c in configs:
        if c.engine == "mpi":
            largest[c.nodes] = max(largest.get(c.nodes, 0), c.count)
    for nodes, count in largest.items():
        argv = mpiexec_command(study.mpiexec, count, 1 if nodes is None else nodes,
                               [sys.executable, "-c", ""])
        for _ in range(LAUNCH_TRIES):
            try:
                out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                     stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                code, text = None, "did not end within 120 s"
                continue
            except OSError as exc:
                code, text = None, f"{type(exc).__name__}: {exc}"
                break
            code, text = out.returncode, out.stdout + out.stderr
            if code == 0:
                break
        if code == 0:
            continue
        paragraph = []  # the launcher's first paragraph, its banner lines of dashes left out
        for line in text.splitlines():
            line = line.strip()
            if line and set(line) <= set("-="):
                continue
            if not line and paragraph:
                break
            if line:
                paragraph.append(line)
        why = " ".join(" ".join(paragraph).split())[:240].rstrip(":") or "no output"
        hint = ("; add \"--oversubscribe\" to the study's mpiexec to run more ranks than "
                "this machine's slots" if "not enough slots" in text else
                "; add \"--allow-run-as-root\" to the study's mpiexec" if "as root" in text
                else "")
        status = "" if code is None else f" (status {code})"
        raise ValueError(f"{study.path}: mpiexec: {count} ranks{_as_nodes(nodes)} do not "
                         f"start on this machine{status}: {why}{hint}")


# ---------------------------------------------------------------- measuring


def _relerr(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


def _gpu_sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


class _Runner:
    """Measures the configurations in order and writes their records."""

    def __init__(self, study: Study, configs: list[Config], writer):
        self.study, self.configs, self.writer = study, configs, writer
        self.total = len(configs)
        self.index = {id(c): i for i, c in enumerate(configs, 1)}
        self.written = 0
        self.failures: list[str] = []
        self.cores = len(os.sched_getaffinity(0))
        self.host = platform.node()  # keeps apart two machines' runs that share an id
        self.gpu = study.device == "gpu"

    # -- bookkeeping

    def rows(self, m: int) -> np.ndarray:
        """The rows of C checked against float64 (the ranks pick the same)."""
        from distmm.cli.blocks import sample_rows

        return sample_rows(m, self.study.check_rows or m)

    def counts(self, c: Config) -> dict:
        """The record's count keys (``distmm report`` reads ranks, then gpus, then workers)."""
        if c.engine == "numpy":
            return {"threads": self.cores}
        if c.engine == "cublas":
            return {"gpus": 1}
        if c.engine == "local":
            return {"gpus": 1} if self.gpu else {"workers": c.count, "threads": c.count}
        if c.engine == "dask":
            return ({"gpus": c.count, "workers": c.count} if self.gpu
                    else {"workers": c.count, "threads_per_worker": 1})
        return {"ranks": c.count, "gpus": c.count} if self.gpu else {"ranks": c.count}

    def common(self, c: Config) -> dict:
        extra = {"engine": c.engine if c.reference is None else "reference",
                 "backend": c.backend, "series": c.series, "repeats": self.study.repeats,
                 "check_rows": self.study.check_rows, "cores": self.cores, "host": self.host}
        extra.update(self.counts(c))
        if c.per_device is not None:
            extra["per_device"] = c.per_device
        if c.chunk is not None:
            extra["chunk"] = c.chunk
        if c.nodes is not None:  # the count (or "all-links") the nodes were emulated as
            extra["emulated_nodes"] = c.nodes
        if self.study.note:
            extra["note"] = self.study.note
        if self.study.precision != "highest":
            extra["precision"] = self.study.precision
        nccl = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
        if nccl:  # the user's NCCL settings, which the ranks inherit
            extra["nccl_env"] = nccl
        from distmm.executor.streams import priority_wanted

        if not priority_wanted():  # streams for broadcasts and copies at the default priority
            extra["stream_priority"] = "default"
        import dask.config

        from distmm.engine.dask.blocks import (FIRST_PARTS_KEY, FIRST_PIECE_KEY, LATER_PIECE_KEY,
                                               piece_lengths)

        first, later = piece_lengths("float32")
        if dask.config.get(FIRST_PIECE_KEY, None) is not None:  # the Dask blocks' k pieces
            extra["first_piece_k"] = first
        if dask.config.get(LATER_PIECE_KEY, None) is not None:
            extra["later_piece_k"] = later
        if dask.config.get(FIRST_PARTS_KEY, None) is not None:
            extra["first_parts"] = int(dask.config.get(FIRST_PARTS_KEY))
        from distmm.config import get_config

        if get_config().mpi_cpus != "auto":  # GPU ranks keep a launcher's one-CPU binding
            extra["mpi_cpus"] = get_config().mpi_cpus
        return extra

    def relerr_bounds(self) -> dict:
        """relerr above which a configuration fails, per dtype, at the study's precision."""
        if self.study.precision == "highest":
            return dict(RELERR_BOUND)
        return {"float32": PRECISION_RELERR_BOUND[self.study.precision]}

    def write(self, c: Config, first: float, times: list[float], relerr: float | None,
              checked: int, **extra) -> None:
        raise_if_signalled()  # a signal a library swallowed (a cluster starting): no record
        seconds = float(np.median(times))
        ok = relerr is not None and relerr <= self.relerr_bounds()[c.dtype]
        rec = self.writer.add(c.variant, c.dtype, c.m, c.n, c.k, seconds, relerr,
                              first_seconds=first, all_seconds=times, relerr_rows=checked,
                              relerr_ok=ok, **{**self.common(c), **extra})
        self.written += 1
        print(progress_line(self.index[id(c)], self.total, rec), flush=True)
        if not ok:
            self.failures.append(f"{c.describe()}: relerr {relerr} above "
                                 f"{self.relerr_bounds()[c.dtype]:g}")

    def fail(self, c: Config, exc: BaseException) -> None:
        if not isinstance(exc, Exception):
            raise exc
        raise_if_signalled()  # a failure a swallowed signal caused (workers gone): no record
        line = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"[{self.index[id(c)]}/{self.total}] {c.describe()}: FAILED ({line})", flush=True)
        self.failures.append(f"{c.describe()}: {line}")

    def skip(self, c: Config, why: str) -> None:
        print(f"[{self.index[id(c)]}/{self.total}] {c.describe()}: skipped ({why})", flush=True)

    # -- the order

    def run(self) -> None:
        groups: dict[tuple, list[Config]] = {}
        for c in self.configs:
            if c.engine in ("numpy", "cublas", "local"):
                key = ("process", c.dtype, c.m, c.n, c.k)
            else:
                key = c.place
            groups.setdefault(key, []).append(c)
        for key, group in groups.items():
            raise_if_signalled()  # a signal a library swallowed: stop before the next one
            if key[0] == "process":
                self.in_process(group)
            elif key[0] == "dask":
                self.dask(key[1], group, nodes=key[2])
            else:
                self.mpi(key[1], group, nodes=key[2])

    # -- in this process: numpy, cuBLAS, the local engine

    def in_process(self, group: list[Config]) -> None:
        from distmm.cli import blocks

        c0 = group[0]
        m, n, k, dtype, seed = c0.m, c0.n, c0.k, c0.dtype, self.study.seed
        group = [c for c in group if c.engine != "cublas" or self.cublas_fits(c)]
        if not group:  # nothing left to measure: no operands made
            return
        try:
            a = blocks.full(blocks.A, (m, k), dtype, seed)
            b = blocks.full(blocks.B, (k, n), dtype, seed)
            rows = self.rows(m)
            ref = blocks.rows_product(a[rows], b)
        except Exception as exc:  # operands too large for this machine: the problem fails
            for c in group:
                self.fail(c, exc)
            return
        for c in group:
            raise_if_signalled()
            try:
                if c.engine == "numpy":
                    self.timed(c, lambda: a @ b, rows, ref)
                elif c.engine == "cublas":
                    self.cublas(c, a, b, rows, ref)
                else:
                    self.local(c, a, b, rows, ref)
            except Exception as exc:
                self.fail(c, exc)
        a = b = None  # the operands go before the next problem's are made
        gc.collect()

    def timed(self, c: Config, fn, rows, ref, *, sync=None, get=np.asarray, index=None,
              **extra) -> None:
        """Time the first call of ``fn`` and ``repeats`` more; check the first's rows ``rows``
        (``index``: the same rows as the result's array type takes them)."""
        def once():
            t0 = time.perf_counter()
            out = fn()
            if sync:
                sync()
            return time.perf_counter() - t0, out

        first, out = once()
        relerr = _relerr(get(out[rows if index is None else index]), ref)
        del out
        times = []
        for _ in range(self.study.repeats):
            seconds, out = once()
            del out
            times.append(seconds)
        self.write(c, first, times, relerr, len(rows), **extra)

    def local(self, c: Config, a, b, rows, ref) -> None:
        import dask.config

        import distmm

        options = {} if self.gpu else {"distmm.local-threads": c.count}
        with dask.config.set(options):
            self.timed(c, lambda: distmm.matmul(a, b, engine="local", backend=c.backend,
                                                precision=self.study.precision),
                       rows, ref, residency="host")

    def cublas_fits(self, c: Config) -> bool:
        """Whether A, B and C of ``c`` fit the GPU's free memory; says so when not."""
        import cupy

        itemsize = np.dtype(c.dtype).itemsize
        need = (c.m * c.k + c.k * c.n + c.m * c.n) * itemsize
        free = cupy.cuda.Device().mem_info[0]
        if need <= 0.95 * free:
            return True
        self.skip(c, f"in-core cuBLAS needs {need / 2**30:.1f} GiB, the GPU has "
                     f"{free / 2**30:.1f} GiB free")
        return False

    def cublas(self, c: Config, a, b, rows, ref) -> None:
        import cupy

        a_d, b_d = cupy.asarray(a), cupy.asarray(b)
        out = cupy.empty((c.m, c.n), dtype=a.dtype)
        precision = self.study.precision

        def product():
            if precision == "highest":
                return cupy.matmul(a_d, b_d, out=out)
            from distmm.executor.cublas import cublas_gemm_precision

            cublas_gemm_precision(a_d, b_d, out, precision)  # cublasGemmEx in the mode
            return out

        try:
            self.timed(c, product, rows, ref, sync=_gpu_sync,
                       get=lambda x: x.get(), index=cupy.asarray(rows), residency="device")
        finally:
            a_d = b_d = out = None
            cupy.get_default_memory_pool().free_all_blocks()

    # -- a Dask cluster per count

    def dask(self, count: int, group: list[Config], nodes=None) -> None:
        from distributed import Client

        from distmm.cli.cluster import cpu_cluster, gpu_cluster

        split = 1 if nodes is None else (count if nodes == "all-links" else nodes)
        # the workers leave Ctrl-C to this process, which closes them (cli.cluster)
        try:
            cluster = (gpu_cluster(",".join(map(str, range(count))), nodes=split)
                       if self.gpu else cpu_cluster(count, nodes=split))
        except Exception as exc:
            for c in group:
                self.fail(c, exc)
            return
        with cluster, Client(cluster) as client:
            try:
                client.wait_for_workers(count, timeout=120)
                problems: dict[tuple, list[Config]] = {}
                for c in group:
                    problems.setdefault((c.dtype, c.m, c.n, c.k, c.chunk), []).append(c)
                for (dtype, m, n, k, chunk), configs in problems.items():
                    raise_if_signalled()
                    try:
                        self.dask_problem(client, configs, dtype, m, n, k, chunk)
                    except Exception as exc:  # the operands or the check failed: all of them
                        for c in configs:
                            self.fail(c, exc)
            except (KeyboardInterrupt, Signalled):
                _quiet_close(client)
                raise

    def dask_problem(self, client, configs, dtype, m, n, k, chunk) -> None:
        import dask.array as da
        from distributed import wait

        import distmm
        from distmm.cli.cluster import random_array, sync_workers, to_host

        seed = self.study.seed
        a = random_array((m, k), chunk, dtype, seed=2 * seed + 1, gpu=self.gpu).persist()
        b = random_array((k, n), chunk, dtype, seed=2 * seed + 2, gpu=self.gpu).persist()
        wait([a, b])
        rows = self.rows(m)
        a64 = to_host(a)[rows].astype(np.float64)
        ref = da.matmul(a64, to_host(b).astype(np.float64)).compute()
        keep = a.npartitions + b.npartitions
        for c in configs:
            raise_if_signalled()

            def product(c=c):
                if c.reference == "dask.array":
                    return (a @ b).persist()
                return distmm.matmul(a, b, engine="dask", client=client,
                                     precision=self.study.precision,
                                     backend=c.backend).persist()

            def once(c=c):
                t0 = time.perf_counter()
                out = product()
                wait(out)
                if self.gpu:
                    sync_workers(client)
                return time.perf_counter() - t0, out

            try:
                first, out = once()
                relerr = _relerr(to_host(out)[rows].compute(), ref)
                del out
                _settle(client, keep)
                times = []
                for _ in range(self.study.repeats):
                    seconds, out = once()
                    del out
                    _settle(client, keep)
                    times.append(seconds)
                extra = {}
                if c.reference is None and self.gpu:  # how device chunks crossed between hosts
                    from distmm.engine.dask import last_stats

                    moved = (last_stats() or {}).get("transfer") or {}
                    extra["nccl_pairs"] = int((moved.get("nccl") or {}).get("pairs", 0))
                self.write(c, first, times, relerr, len(rows), residency="cluster", **extra)
            except Exception as exc:
                self.fail(c, exc)
                _settle(client, keep)
        a = b = a64 = None
        _settle(client, 0)

    # -- one mpiexec per count

    def mpi(self, count: int, group: list[Config], nodes=None) -> None:
        from distmm.cli import bench_rank
        from distmm.cli.emulated import mpiexec_command

        # a CPU rank's BLAS threads; on GPUs only the threads that make each rank's blocks
        threads = _rank_threads(self.study, count, self.cores)
        spec = {"configs": [bench_rank.config_to_dict(c, self.index[id(c)]) for c in group],
                "total": self.total, "repeats": self.study.repeats,
                "check_rows": self.study.check_rows, "seed": self.study.seed, "gpu": self.gpu,
                "threads": threads, "output": str(self.writer.path),
                "runner": _this_process(),
                "relerr_bound": self.relerr_bounds(), "precision": self.study.precision,
                "record": {"run": self.writer.run, "benchmark": self.writer.benchmark,
                           "device": self.writer.device, "commit": self.writer.commit,
                           "date": self.writer.date, **self.writer.common},
                "extra": {str(self.index[id(c)]): self.common(c) for c in group}}
        env = dict(os.environ)
        if not self.gpu:  # each rank's BLAS gets its share of the cores
            env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                       MKL_NUM_THREADS=str(threads))
        fd, spec_path = tempfile.mkstemp(prefix="distmm-bench-", suffix=".json")
        status_path = spec_path[:-5] + "-status.jsonl"
        spec["status"] = status_path
        with os.fdopen(fd, "w") as fh:
            json.dump(spec, fh)
        argv = mpiexec_command(self.study.mpiexec, count, 1 if nodes is None else nodes,
                               [sys.executable, "-m", "mpi4py", "-m", "distmm.cli.bench_rank",
                                spec_path])
        # a session of its own: a terminal's Ctrl-C reaches this process alone, which stops
        # the launch (a launcher that got it too printed its own abort lines)
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            if os.path.exists(status_path):  # the ranks' status lines: nobody reads them now
                os.unlink(status_path)
            raise
        finally:
            os.unlink(spec_path)
        done = {}
        if os.path.exists(status_path):
            with open(status_path) as fh:
                for line in fh:
                    entry = json.loads(line)
                    done[entry["index"]] = entry
            os.unlink(status_path)
        for c in group:
            entry = done.get(self.index[id(c)])
            if entry is None:
                self.fail(c, RuntimeError(f"not measured: mpiexec -n {count} ended with status "
                                          f"{code}"))
                continue
            self.written += 1
            if not entry["ok"]:
                self.failures.append(f"{c.describe()}: {entry['why']}")


def _this_process() -> list:
    """This process's id and start time: the ranks stop when it is gone (killed)."""
    import psutil

    return [os.getpid(), psutil.Process().create_time()]


#: what logs the close of a cluster stopped mid-computation (comms cut, tasks cancelled)
_CLOSE_LOGGERS = ("distributed", "distributed.client", "asyncio", "tornado")


def _quiet_logs() -> None:
    for name in _CLOSE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _quiet_close(client, wait: float = 2.0) -> None:
    """A signal stops the study mid-computation: the cluster's close then logs every
    transfer it cuts and task it cancels, here and on the workers, which says nothing
    wrong. Silence those loggers in this process, and on the workers as far as they
    answer within ``wait`` seconds, so that the command's one line is all it prints."""
    import threading

    def workers():
        try:
            client.run(_quiet_logs, on_error="ignore")
        except Exception:  # a client or cluster already closing: nothing to quiet there
            pass

    _quiet_logs()
    done = threading.Thread(target=workers, daemon=True)
    done.start()
    done.join(wait)


def _settle(client, keep: int, timeout: float = 30, still: float = 2.0) -> None:
    """Wait until the scheduler holds no more than ``keep`` results in memory (the
    operands), so that a dropped C is gone before the next call starts; or until the count
    has not moved for ``still`` seconds (what an engine keeps on purpose), or ``timeout``."""
    gc.collect()
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        held = client.run_on_scheduler(lambda dask_scheduler: sum(
            ts.state == "memory" for ts in dask_scheduler.tasks.values()))
        if held <= keep:
            return
        if held != last:
            last, since = held, time.monotonic()
        elif time.monotonic() - since > still:
            return
        time.sleep(0.02)
