"""GPU benchmark of the Dask engine (``dask-gpu``): distmm-dask against dask.array and cuBLAS.

Writes one record per (setting, variant, dtype, n) through ``bench.common`` to
``bench/results/dask-gpu-<gpu>-<date>.jsonl`` and prints TFLOP/s and the ratios measured in
the same run (issue 13, item 6).

Settings (``--settings``), each a fresh cluster
------------------------------------------------
``1gpu``    ``dask_cuda.LocalCUDACluster``, one worker on GPU 0.
``2gpu``, ``4gpu``  one worker per GPU on two or four GPUs of this host; run only when as many
            are visible.
``shared``  two dask-cuda workers sharing GPU 0 (dask_cuda refuses ``CUDA_VISIBLE_DEVICES="0,0"``,
            so the second is a copy of the first's worker spec; see ``distmm.cli.cluster``),
            each with half the device-memory spilling limit: correctness and overhead where
            only one GPU exists.
``mixed``   the GPU worker plus ``--cpu-workers`` single-thread workers that see no GPU
            (default: the machine's other cores).
Every GPU worker carries the resource ``GPU: 1``. Variants other than ``cublas`` are named
``<variant>@<setting>`` outside ``1gpu`` (the records' ``variant`` says how the GPU was shared).

Variants, all in the same run
-----------------------------
``distmm-dask``           ``distmm.matmul(A, B, client=client).persist()`` on operands with
                          chunks ``--chunks[0]``.
``dask.array-chunk<c>``   ``(A @ B).persist()``, dask.array's own matmul, for each ``c`` of
                          ``--chunks`` (default 8192 and 4096). In ``mixed`` only at the
                          first chunk size, restricted to the GPU worker (its tasks on cupy
                          chunks cannot run on workers without a GPU): against ``1gpu`` it
                          shows what the other workers cost any computation on the cluster.
``cublas``                ``cupy.matmul`` in this process, in-core on one GPU, measured in each
                          setting just before its cluster variants (the ratios' reference).
A and B are random normal arrays made on the GPU workers (cupy chunks, one seeded generator
per chunk, ``client.persist(..., workers=<GPU workers>)``) before the clock starts, fresh for
every call (new keys: nothing timed is a zero or a reuse); C is persisted on the cluster, not
gathered, and the clock stops after every worker's GPU is synchronised.

Timing: the first call of each variant (its check: the cluster has already made operands, so
cupy is imported on the workers) is ``first_seconds``; then ``--rounds`` rounds, each timing
every variant once in turn; ``seconds`` is their median. Check: 64 sampled rows of C against
the float64 product of the same rows of A with B, computed on the GPU workers one column
strip of B per task (one float64 GEMM over all of k: an order of sums neither variant uses);
a result beyond the tolerance, or a variant that fails, makes the run exit 1.

``--rehearse`` runs the same code on the CPU, for CI: ``distributed.LocalCluster`` worker
processes stand in for GPU workers (numpy chunks, resource ``GPU: 1``), ``numpy`` (BLAS in
this process) stands in for cuBLAS, and the defaults are small (n = 203, chunks 64 and 32,
one round). Run on a GPU machine under the benchmark lock, or through
``bash bench/device/run.sh daskgpu``::

    python -m bench.dask_gpu --settings 1gpu shared mixed --sizes 16384 32768
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from bench.common import (GPU_RESOURCE, RecordWriter, add_cpu_workers, cpu_cluster, cpu_model,
                          free_gpu, gpu_cluster, gpu_name, gpu_sync, gpu_workers, local_gpus,
                          parser, random_array, random_operands, release_cluster, relerr,
                          share_workers, sync_workers, to_host)

SETTINGS = ("1gpu", "2gpu", "4gpu", "shared", "mixed")
SAMPLE_ROWS = 64
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _args(argv):
    p = parser(__doc__, prog="python -m bench.dask_gpu")
    p.add_argument("--settings", nargs="+", default=["1gpu", "shared", "mixed"], choices=SETTINGS)
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="n of the n x n x n products (default 16384 32768; rehearsal 203)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"],
                   choices=["float32", "float64"])
    p.add_argument("--chunks", type=int, nargs="+", default=None,
                   help="chunk sizes: distmm-dask uses the first, dask.array each "
                        "(default 8192 4096; rehearsal 64 32)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed calls per variant after the first (default 3; rehearsal 1)")
    p.add_argument("--cpu-workers", type=int, default=None,
                   help="CPU workers of the mixed setting (default: cores - 1; rehearsal 1)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one product may take before the variant is given up")
    p.add_argument("--protocol", default="auto", choices=["auto", "ucx", "tcp"],
                   help="comms of the GPU clusters: UCX where distributed-ucxx is installed "
                        "(auto), or as named; the records carry it, and '+ucx' ends the "
                        "variant names of UCX runs")
    p.add_argument("--rehearse", action="store_true",
                   help="CPU rehearsal: LocalCluster workers, numpy chunks, numpy for cuBLAS")
    args = p.parse_args(argv)
    small = args.rehearse
    args.sizes = args.sizes or ([203] if small else [16384, 32768])
    args.chunks = args.chunks or ([64, 32] if small else [8192, 4096])
    args.rounds = args.rounds if args.rounds is not None else (1 if small else 3)
    if args.cpu_workers is None:
        args.cpu_workers = 1 if small else max(len(os.sched_getaffinity(0)) - 1, 1)
    if args.rounds < 1 or min(args.sizes) < 1 or min(args.chunks) < 1:
        p.error("--rounds, --sizes and --chunks must be positive")
    return args


# -- clusters --------------------------------------------------------------------------------

def start_cluster(setting: str, *, rehearse: bool, cpu_workers: int, protocol: str = "auto",
                  nodes: int = 1):
    """(cluster, description, GPUs used, CPU workers) of one setting (``protocol``: the GPU
    clusters' comms, ``distmm.cli.cluster.gpu_cluster``; a rehearsal is TCP; ``nodes``: the
    ``2gpu``/``4gpu`` workers as that many emulated nodes)."""
    if rehearse:
        gpu_like = {"1gpu": 1, "2gpu": 2, "4gpu": 4, "shared": 1, "mixed": 1}[setting]
        cluster = cpu_cluster(gpu_like, resources={GPU_RESOURCE: 1})
        what = f"LocalCluster(processes=True), {gpu_like} worker(s) standing in for GPU workers"
        gpus = 0
        if setting == "shared":  # the GPU setting's code path: a copy of the worker's spec
            try:
                share_workers(cluster, 2)
            except BaseException:
                cluster.close()
                raise
            what += " and a copy of its spec: 2 workers"
    elif setting in ("2gpu", "4gpu"):
        gpus = int(setting[0])
        devices = ",".join(map(str, range(gpus)))
        cluster = gpu_cluster(devices, protocol=protocol, nodes=nodes)
        what = f"LocalCUDACluster(CUDA_VISIBLE_DEVICES='{devices}'), one worker per GPU" + (
            f", as {nodes} emulated nodes" if nodes > 1 else "")
    elif setting == "shared":
        cluster = gpu_cluster("0", per_device=2, protocol=protocol)
        what = ("LocalCUDACluster(CUDA_VISIBLE_DEVICES='0') and a copy of its worker spec: "
                "2 workers on GPU 0, device_memory_limit 0.4 each")
        gpus = 1
    else:
        cluster = gpu_cluster("0", protocol=protocol)
        what, gpus = "LocalCUDACluster(CUDA_VISIBLE_DEVICES='0'), 1 worker", 1
    try:
        cpus = 0
        if setting == "mixed":
            cpus = len(add_cpu_workers(cluster, cpu_workers))
            what += f" + {cpus} single-thread CPU worker(s) with CUDA_VISIBLE_DEVICES=''"
    except BaseException:
        cluster.close()
        raise
    return cluster, what, gpus, cpus


# -- one product ------------------------------------------------------------------------------

class Bench:
    """The cluster of one setting and what every measurement on it shares."""

    def __init__(self, client, *, gpu: bool, timeout: float):
        self.client = client
        self.gpu = gpu
        self.timeout = timeout
        self.gpu_addrs = gpu_workers(client)
        everyone = client.scheduler_info(n_workers=-1)["workers"]
        # only where some workers have no GPU: a restriction also stops work stealing
        self.restrict = self.gpu_addrs if len(everyone) > len(self.gpu_addrs) else None
        self.seed = 0

    def persist(self, collection):
        """Persisted on the GPU workers only (the operands, dask.array's product, the check)."""
        from distributed import wait

        out = self.client.persist(collection, workers=self.restrict)
        wait(out, timeout=self.timeout)
        return out

    def operands(self, n: int, chunk: int, dtype: str, seed: int | None = None):
        if seed is None:
            self.seed += 2
            seed = 1_000_000 + self.seed
        a = random_array((n, n), chunk, dtype, seed=seed, gpu=self.gpu)
        b = random_array((n, n), chunk, dtype, seed=seed + 1, gpu=self.gpu)
        return self.persist([a, b])

    def product(self, variant: str, a, b):
        """Seconds of one product, and C (persisted on the cluster)."""
        from distributed import wait

        import distmm

        t0 = time.perf_counter()
        if variant == "distmm-dask":
            c = distmm.matmul(a, b, client=self.client).persist()
        else:
            c = self.client.persist(a @ b, workers=self.restrict)
        wait(c, timeout=self.timeout)
        sync_workers(self.client, self.gpu_addrs if self.gpu else None)
        return time.perf_counter() - t0, c

    def check(self, c, a, b, rows) -> float:
        """relerr of C's sampled rows against their float64 product, computed on the GPU
        workers one column strip of B at a time (one float64 GEMM over all of k per strip:
        neither dask.array's block sums nor distmm's tiles)."""
        from distributed import futures_of

        # futures, not to_delayed(): dask 2024.12 (the floor) handed a persisted chunk's
        # to_delayed() to the task as its unexecuted task tuple
        a_rows = self.persist(take_rows(a, rows).rechunk((len(rows), a.shape[1])))
        (a_part,) = futures_of(a_rows)
        b = self.persist(b)
        held = {f.key: f for f in futures_of(b)}
        columns = zip(*b.__dask_keys__())  # B's chunks down each column, top to bottom
        strips = [self.client.submit(_reference_strip, a_part, *[held[key] for key in column],
                                     workers=self.restrict, pure=False) for column in columns]
        got = self.client.compute(to_host(take_rows(c, rows)), workers=self.restrict, sync=True)
        return relerr(got, np.hstack(self.client.gather(strips)))


def take_rows(x, rows):
    """Rows ``rows`` of dask array ``x``, by basic slices (no fancy index reaches a chunk)."""
    import dask.array as da

    return da.concatenate([x[int(r):int(r) + 1] for r in rows], axis=0)


def _reference_strip(a_rows, *b_column):
    """``a_rows @ B[:, strip]`` in float64 from B's chunks down one column, as numpy."""
    xp = np if isinstance(a_rows, np.ndarray) else __import__("cupy")
    strip = xp.concatenate([blk.astype(np.float64) for blk in b_column], axis=0)
    out = xp.matmul(a_rows.astype(np.float64), strip)
    return out if xp is np else out.get()


def sample_rows(n: int) -> np.ndarray:
    if n <= SAMPLE_ROWS:
        return np.arange(n)
    return np.sort(np.random.default_rng(n).choice(n, SAMPLE_ROWS, replace=False))


def in_core_reference(n: int, dtype: str, rounds: int, *, gpu: bool):
    """(first seconds, median seconds, every time, relerr on sampled rows) of the in-core
    single-device product in this process: cupy.matmul, or numpy in a rehearsal."""
    rows = sample_rows(n)
    if gpu:
        import cupy

        a, b = random_operands(n, n, n, dtype, seed=n)
        rows = cupy.asarray(rows)
        sync = gpu_sync
        mm = cupy.matmul
    else:
        rng = np.random.default_rng(n)
        a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
        sync = None
        mm = np.matmul
    t0 = time.perf_counter()
    c = mm(a, b)
    if sync:
        sync()
    first = time.perf_counter() - t0
    if gpu:
        ref = cupy.matmul(a[rows].astype(np.float64), b.astype(np.float64))
        err = relerr(cupy.asnumpy(c[rows]), cupy.asnumpy(ref))
        del ref
    else:
        err = relerr(c[rows], a[rows].astype(np.float64) @ b.astype(np.float64))
    del c
    times = []
    for _ in range(rounds):
        if sync:
            sync()
        t0 = time.perf_counter()
        mm(a, b)
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    del a, b
    if gpu:
        free_gpu()
    return first, float(np.median(times)), times, err


def measure(bench: Bench, variants: list[str], chunks: dict, n: int, dtype: str, rounds: int):
    """({variant: (first seconds, every timed seconds, relerr)}, {variant: why it failed})."""
    client = bench.client
    done: dict = {}
    failed: dict = {}
    rows = sample_rows(n)
    # the check (each variant's first call) on one pair made at the first chunk size, rechunked
    # (values unchanged) for the others: one float64 reference for all
    base = chunks[variants[0]]
    a0, b0 = bench.operands(n, base, dtype, seed=7 + n)
    for variant in variants:
        try:
            a, b = (a0, b0) if chunks[variant] == base else \
                bench.persist([a0.rechunk(chunks[variant]), b0.rechunk(chunks[variant])])
            first, c = bench.product(variant, a, b)
            done[variant] = (first, [], bench.check(c, a, b, rows))
        except Exception as exc:  # reported and left out of the records, never a zero time
            failed[variant] = f"{type(exc).__name__}: {exc}"
        a = b = c = None
        release_cluster(client, keep=(a0, b0))
    del a0, b0
    release_cluster(client)
    for _ in range(rounds):
        for variant in list(done):
            try:
                a, b = bench.operands(n, chunks[variant], dtype)
                seconds, c = bench.product(variant, a, b)
                done[variant][1].append(seconds)
            except Exception as exc:
                failed[variant] = f"{type(exc).__name__}: {exc}"
                del done[variant]
            a = b = c = None
            release_cluster(client)
    return done, failed


# -- the run ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = _args(argv)
    import dask
    import distributed
    from distributed import Client

    gpu = not args.rehearse
    visible = 0
    versions = {"dask_version": dask.__version__, "distributed_version": distributed.__version__,
                "numpy_version": np.__version__}
    if gpu:
        visible = local_gpus()
        if visible < 1:
            print("dask_gpu: no GPU visible (cupy and a CUDA device are needed; --rehearse "
                  "runs on the CPU)", file=sys.stderr)
            return 1
        import cupy
        import dask_cuda

        versions.update(cupy_version=cupy.__version__, dask_cuda_version=dask_cuda.__version__)
        if os.environ.get("CUPY_TF32"):
            print("dask_gpu: CUPY_TF32 is set; float32 references would be TF32", file=sys.stderr)
            return 1
    device = gpu_name() if gpu else cpu_model()
    writer = RecordWriter("dask-gpu", device, out_dir=args.out_dir, gpus_visible=visible,
                          rounds=args.rounds, rehearse=args.rehearse, **versions)
    chunks = {"distmm-dask": args.chunks[0]}
    chunks.update({f"dask.array-chunk{c}": c for c in args.chunks})
    reference = "cublas" if gpu else "numpy"
    failed = 0
    for setting in args.settings:
        if setting in ("2gpu", "4gpu") and gpu and visible < int(setting[0]):
            print(f"[{setting}] not run: {visible} GPU visible", flush=True)
            continue
        # mixed: dask.array at distmm's chunk size only, on the GPU worker (what the
        # cluster's other workers cost any computation on it, beside distmm's figure)
        variants = [v for v in chunks if setting != "mixed" or v == "distmm-dask"
                    or v == f"dask.array-chunk{args.chunks[0]}"]
        cluster, what, gpus, cpus = start_cluster(setting, rehearse=args.rehearse,
                                                  cpu_workers=args.cpu_workers,
                                                  protocol=args.protocol)
        with cluster, Client(cluster) as client:
            bench = Bench(client, gpu=gpu, timeout=args.timeout)
            workers = len(client.scheduler_info(n_workers=-1)["workers"])
            protocol = client.scheduler.address.split("://", 1)[0]
            print(f"[{setting}] {what}: {workers} worker(s), {len(bench.gpu_addrs)} GPU "
                  f"worker(s), {protocol}", flush=True)
            common = {"setting": setting, "gpus": gpus, "workers": workers,
                      "gpu_workers": len(bench.gpu_addrs), "cpu_workers": cpus, "cluster": what,
                      "protocol": protocol, "device_transfer": _device_transfer()}
            for dtype in args.dtypes:
                for n in args.sizes:
                    first, ref_s, ref_times, ref_err = in_core_reference(n, dtype, args.rounds,
                                                                         gpu=gpu)
                    done, why = measure(bench, variants, chunks, n, dtype, args.rounds)
                    failed += _emit(writer, setting, common, reference, dtype, n,
                                    (first, ref_s, ref_times, ref_err), done, why, chunks)
    print(f"run {writer.run}; records: {writer.path}", flush=True)
    return 1 if failed else 0


def _device_transfer() -> str:
    """``distmm.dask-device-transfer`` as configured (``DISTMM_DASK_DEVICE_TRANSFER``)."""
    from distmm.config import get_config

    return get_config().dask_device_transfer


def _emit(writer, setting, common, reference, dtype, n, ref, results, why, chunks) -> int:
    """Write and print the records of one (setting, dtype, n); returns how many failed."""
    first, ref_s, ref_times, ref_err = ref
    tol = TOLERANCE[dtype]
    failed = int(ref_err > tol)
    rec = writer.add(reference, dtype, n, n, n, ref_s, ref_err, **{
        **common, "workers": 1, "first_seconds": first, "all_seconds": ref_times,
        "checked_rows": min(SAMPLE_ROWS, n),
        "note": "in-core on one device in the benchmark's process, operands made there (not "
                "on the cluster); measured just before this setting's cluster variants"})
    lines = [f"  {reference:28s} first {first:8.3f} s  warm {ref_s:8.3f} s "
             f"{rec['tflops']:8.4g} TFLOP/s  relerr {ref_err:.1e}"]
    dask_array = {v: r for v, r in results.items() if v.startswith("dask.array")}
    for variant in [*results, *why]:
        name = variant
        if variant == "distmm-dask" and common["device_transfer"] != "auto":
            name += f"({common['device_transfer']})"  # distmm.dask-device-transfer as set
        name = name if setting == "1gpu" else f"{name}@{setting}"
        if common["protocol"] == "ucx":
            name += "+ucx"
        if variant in why:
            failed += 1
            lines.append(f"  {name:28s} FAILED (no record): {why[variant]}"[:400])
            continue
        first_v, times, err = results[variant]
        seconds = float(np.median(times))
        extra = {"first_seconds": first_v, "all_seconds": times, "best_seconds": min(times),
                 "chunk": chunks[variant], f"ratio_to_{reference}": ref_s / seconds,
                 f"{reference}_seconds": ref_s, "checked_rows": min(SAMPLE_ROWS, n)}
        if variant == "distmm-dask":
            extra["speedup_vs"] = {v: float(np.median(r[1])) / seconds
                                   for v, r in dask_array.items()}
        if err > tol:
            failed += 1
        rec = writer.add(name, dtype, n, n, n, seconds, err, **common, **extra,
                         note="operands made and persisted on the GPU workers before the clock "
                              "(fresh keys each call); C persisted, not gathered; clock stops "
                              "after every GPU worker's device is synchronised")
        lines.append(f"  {name:28s} first {first_v:8.3f} s  warm {seconds:8.3f} s "
                     f"{rec['tflops']:8.4g} TFLOP/s  {ref_s / seconds:5.2f}x {reference}  "
                     f"relerr {err:.1e}{'  WRONG' if err > tol else ''}")
    print(f"[{setting}] {dtype} n={n}:\n" + "\n".join(lines), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
