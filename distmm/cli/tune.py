"""``distmm tune``: search the raw kernels' block, warp and thread tiles on this GPU.

This module covers: the tuning cache (a JSON file under the user's cache directory, one
entry per GPU model and dtype: the winning configuration, its speed, cuBLAS's speed in the
same run and which of the two ``backend="auto"`` should use per shape class), the search
itself and its command line. ``distmm.executor.gpu`` reads the cache; without one it uses
the registry's defaults. The command line reads the cache strictly (``read_cache``): ``--show``
and a tuning run refuse a cache file that is not one (not JSON, another version, entries that
are not objects) in one line naming it, before anything else; ``--show`` also refuses a
``--cache`` file that does not exist (the default cache missing shows as empty).

It does *not* cover: the kernels or their constraints (``distmm.executor.registry``), or compiling
and launching (``distmm.executor.cuda_loader``). Importing it needs no GPU; tuning does.

Examples
--------
$ distmm tune                       # float32 and float64, size 4096, confirmed at 8192
$ distmm tune --dtype float32 --size 2048 --confirm-size 4096
$ distmm tune --show
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

import distmm.executor.registry as registry
from distmm.cli.argtypes import integer_at_least, nonempty
from distmm.cli.exits import BAD_INPUT
from distmm.cli.outputs import check_writable
from distmm.executor.tuning import (CACHE_VERSION, cache_path, load_tuning as load,
                                    load_tuning_for as load_for, read_cache,
                                    store_tuning as store)

__all__ = ["cache_path", "load", "load_for", "store", "time_gpu", "time_alternating",
           "sustained_clock", "random_operands", "relerr_gpu", "tune_dtype", "main",
           "CACHE_VERSION", "TuneRecords", "read_cache"]


class TuneRecords:
    """Bench records (/work/shared/BENCH_RECORDS.md keys) of one ``distmm tune`` run,
    appended to ``<folder>/tune-<device-slug>-<date>.jsonl``; ``DISTMM_COMMIT`` names the
    commit measured ("unknown" without it: the installed package has no checkout)."""

    def __init__(self, device: str, folder, **common):
        from distmm.cli.records import run_id

        self.run = run_id()  # no other run's on this host
        now = _dt.datetime.now(_dt.timezone.utc)
        self.device, self.common = device, common
        self.date = now.date().isoformat()
        self.commit = os.environ.get("DISTMM_COMMIT", "unknown")
        keep = "".join(ch.lower() if ch.isalnum() else "-" for ch in device)
        slug = "-".join(part for part in keep.split("-") if part)[:40]
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"tune-{slug}-{self.date}.jsonl"

    def add(self, variant: str, dtype, m: int, n: int, k: int, seconds: float, relerr, **extra):
        rec = {"run": self.run, "benchmark": "tune", "variant": variant, "device": self.device,
               "dtype": str(np.dtype(dtype)), "m": int(m), "n": int(n), "k": int(k),
               "seconds": float(seconds),
               "tflops": 2.0 * m * n * k / seconds / 1e12 if seconds > 0 else None,
               "relerr": relerr, "commit": self.commit, "date": self.date}
        rec.update(self.common)
        rec.update(extra)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        return rec


def time_gpu(fn: Callable[[], Any], *, repeat: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` between CUDA events on the current stream, after warm-up."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def time_alternating(runs: Mapping[str, Callable[[], Any]], *, rounds: int, repeat: int,
                     warmup: int = 1) -> dict[str, float]:
    """Median seconds of each of ``runs`` timed in alternation: ``rounds`` rounds, each timing
    every run once with ``time_gpu``, so that a clock or power change during the
    measurement hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(time_gpu(fn, repeat=repeat, warmup=warmup))
    return {name: float(np.median(t)) for name, t in times.items()}


def sustained_clock(fn, seconds: float = 2.0) -> tuple[float, float, float]:
    """Run ``fn`` back to back for ``seconds`` while ``nvidia-smi`` samples the current GPU's
    SM clock and board power; returns (median MHz, median W, calls per second). The GEMM
    kernels run at the board's power cap, where the clock decides the speed (bench/NOTES.md)."""
    import subprocess
    import threading

    import cupy

    samples = []
    stop = threading.Event()
    try:  # nvidia-smi's numbering may differ from CUDA's; the PCI bus id does not
        gpu = str(cupy.cuda.Device().pci_bus_id)
    except AttributeError:
        gpu = str(cupy.cuda.Device().id)

    def sample():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True)
            try:
                mhz, watt = (float(v) for v in out.stdout.strip().splitlines()[0].split(","))
                samples.append((mhz, watt))
            except (ValueError, IndexError):
                pass
            stop.wait(0.1)

    for _ in range(3):  # warm up to the sustained clock before sampling
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t = threading.Thread(target=sample)
    t0 = time.perf_counter()
    t.start()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        cupy.cuda.get_current_stream().synchronize()
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    mhz = float(np.median([m for m, _ in samples])) if samples else float("nan")
    watt = float(np.median([w for _, w in samples])) if samples else float("nan")
    return mhz, watt, calls / dt


def random_operands(m: int, n: int, k: int, dtype, seed: int | None = None):
    """Fresh random device operands (never zeros): normal floats, small signed integers."""
    import cupy

    rng = cupy.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        a = rng.standard_normal((m, k), dtype=np.float64).astype(dt)
        b = rng.standard_normal((k, n), dtype=np.float64).astype(dt)
    else:
        a = rng.integers(-8, 9, size=(m, k), dtype=np.int64).astype(dt)
        b = rng.integers(-8, 9, size=(k, n), dtype=np.int64).astype(dt)
    return a, b


def relerr_gpu(c, a, b) -> float:
    """``norm(C - A@B) / norm(A@B)`` with the reference in float64 (cuBLAS DGEMM)."""
    import cupy

    ref = cupy.matmul(a.astype(np.float64), b.astype(np.float64))
    den = float(cupy.linalg.norm(ref))
    err = float(cupy.linalg.norm(c.astype(np.float64) - ref))
    return err / den if den else err


def _raw_runner(spec, params, a, b, c):
    from distmm.executor import cuda_loader

    m, k = a.shape
    n = b.shape[1]

    def run():
        cuda_loader.launch(spec.name, a, False, k, b, False, n, c, n, m, n, k, params=params)
    return run


def _search_space(spec, dtype: str, cc: int, max_configs: int) -> list[dict]:
    """Phase 1 of the search: every valid block x warp shape with 128 or 256 threads, for
    every BK and register budget (blocks per SM), at 3 stages (the defaults first)."""
    default = spec.params(dtype)
    out = [default]
    for p in spec.candidates(dtype, cc):
        if spec.threads(p) in (128, 256) and p["STAGES"] == 3 and p not in out:
            out.append(p)
    return out[:max_configs]


def tune_dtype(dtype: str, *, size: int = 4096, confirm_size: int = 8192, max_configs: int = 400,
               processes: int | None = None, log=print, records=None) -> dict:
    """Search the best kernel's configurations for ``dtype``; return the cache entry.

    Phase 1 times every block x warp shape, BK and register budget (blocks per SM) at
    ``size`` with 3 stages; phase 2 varies the stages of the best four; the best six are
    timed again at ``confirm_size`` next to cuBLAS, and the winner is the fastest there. A configuration whose result is
    wrong (relative error against a float64 product above 1e-4 for float32) is discarded.
    """
    import cupy

    from distmm.executor import cuda_loader

    spec = registry.best_kernel()
    dtype = np.dtype(dtype).name
    cc = cuda_loader.compute_capability()
    tol = {"float32": 1e-4, "float64": 1e-12}.get(dtype, 0.0)

    def measure(configs, n):
        errors = cuda_loader.warm([(spec.name, dtype, p, False, False) for p in configs],
                                  processes=processes)
        for e in errors:
            log(f"  compile failed: {e}")
        a, b = random_operands(n, n, n, dtype)
        c = cupy.full((n, n), np.nan if dtype.startswith("float") else -1, dtype=dtype)
        results = []
        for p in configs:
            try:
                run = _raw_runner(spec, p, a, b, c)
                run()
                cupy.cuda.get_current_stream().synchronize()
                err = relerr_gpu(c, a, b)
                if not err <= tol:
                    log(f"  {p}: WRONG (relerr {err:.2e}); skipped")
                    continue
                sec = time_gpu(run, repeat=5, warmup=1)
            except Exception as exc:
                log(f"  {p}: failed ({exc})")
                continue
            tf = 2.0 * n**3 / sec / 1e12
            results.append((tf, p, sec, err))
            if records is not None:
                records.add(f"tune-{spec.name}", dtype, n, n, n, sec, err, params=p)
        results.sort(key=lambda r: -r[0])
        return results

    t0 = time.perf_counter()
    phase1 = _search_space(spec, dtype, cc, max_configs)
    log(f"{dtype}: phase 1, {len(phase1)} block/warp shapes at n={size}")
    res1 = measure(phase1, size)
    for tf, p, *_ in res1[:5]:
        log(f"  {tf:6.2f} TFLOP/s  {p}")
    if not res1:
        raise RuntimeError(f"no {spec.name} configuration ran correctly for {dtype}")
    phase2 = []
    for _, best, *_ in res1[:4]:
        for st in spec.tune_space["STAGES"]:
            p = dict(best, STAGES=st)
            if p not in phase1 and p not in phase2 and not spec.violations(dtype, p, cc):
                phase2.append(p)
    log(f"{dtype}: phase 2, {len(phase2)} BK/stage variants at n={size}")
    res2 = measure(phase2, size)
    allres = sorted(res1 + res2, key=lambda r: -r[0])
    top = [p for _, p, *_ in allres[:6]]
    log(f"{dtype}: confirming the best {len(top)} at n={confirm_size}")
    res3 = measure(top, confirm_size)
    if not res3:
        raise RuntimeError(f"no configuration ran at n={confirm_size} for {dtype}")
    tf_best, p_best, sec_best, err_best = res3[0]

    # cuBLAS in the same run, and the raw/cuBLAS choice per shape class
    prefer, vs = {}, {}
    shapes = {"small": (512, 512, 512), "medium": (2048, 2048, 2048),
              "large": (confirm_size,) * 3, "skinny": (4096, 64, 4096)}
    for cls, (m, n, k) in shapes.items():
        a, b = random_operands(m, n, k, dtype)
        c = cupy.empty((m, n), dtype=dtype)
        t_raw = time_gpu(_raw_runner(spec, p_best, a, b, c))
        t_blas = time_gpu(lambda: cupy.matmul(a, b, out=c))
        prefer[cls] = "raw" if t_raw < t_blas else "cublas"
        vs[cls] = {"raw_tflops": 2 * m * n * k / t_raw / 1e12,
                   "cublas_tflops": 2 * m * n * k / t_blas / 1e12}
        if records is not None:
            records.add(f"distmm-raw-{spec.name}", dtype, m, n, k, t_raw, None,
                        note="tune shape-class check", params=p_best)
            records.add("cublas", dtype, m, n, k, t_blas, None, note="tune shape-class check")
    entry = {
        "kernel": spec.name, "params": p_best, "tflops": tf_best, "size": confirm_size,
        "relerr": err_best, "cublas_tflops": vs["large"]["cublas_tflops"], "prefer": prefer,
        "classes": vs, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds_spent": round(time.perf_counter() - t0, 1),
    }
    log(f"{dtype}: best {p_best}: {tf_best:.2f} TFLOP/s at n={confirm_size}; cuBLAS "
        f"{entry['cublas_tflops']:.2f}; auto uses {prefer}")
    return entry


def build_parser() -> argparse.ArgumentParser:
    from distmm.cli.commands import _Parser  # its errors as one line, status 2

    positive = integer_at_least(1)
    p = _Parser(prog="distmm tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "float64"],
                   choices=list(registry.DTYPES))
    p.add_argument("--size", type=positive, default=4096, help="search size n (n x n x n)")
    p.add_argument("--confirm-size", type=positive, default=8192,
                   help="size of the final ranking")
    p.add_argument("--max-configs", type=positive, default=400)
    p.add_argument("--processes", type=positive, default=None,
                   help="parallel compile processes")
    p.add_argument("--cache", type=nonempty(), default=None, help=f"cache file (default {cache_path()})")
    p.add_argument("--records", type=nonempty(), default=None,
                   help="also write every measurement as bench records into this folder")
    p.add_argument("--show", action="store_true", help="print the cache and exit")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `distmm tune -- --dtype ...` (the CLI passes the rest verbatim)
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.show and args.records is not None:
        parser.error("--records writes a tuning run's measurements; --show only prints the cache")
    cache = read_cache(args.cache, must_exist=args.show and args.cache is not None)
    if args.show:
        print(json.dumps(cache, indent=1, sort_keys=True))
        return 0
    try:
        import cupy
    except ImportError as exc:
        print(f"distmm tune: error: needs cupy and a GPU: pip install \"distmm[gpu]\" ({exc})",
              file=sys.stderr)
        return BAD_INPUT
    from distmm.executor import gpu_available

    if not gpu_available():
        print(f"distmm tune: error: needs a CUDA GPU: cupy {cupy.__version__} sees no CUDA "
              f"device", file=sys.stderr)
        return BAD_INPUT
    # what the run writes, checked before hours of tuning: the cache and the records' folder
    check_writable(args.cache or cache_path(), writes="replace")
    if args.records is not None:
        check_writable(args.records, folder=True)
    from distmm.executor.device import gpu_name

    gpu = gpu_name()
    records = None
    if args.records is not None:
        records = TuneRecords(gpu, args.records, gpus=1, backend="raw")
    print(f"tuning on {gpu} (cupy {cupy.__version__}); cache {args.cache or cache_path()}")
    for dt in args.dtype:
        entry = tune_dtype(dt, size=args.size, confirm_size=args.confirm_size,
                           max_configs=args.max_configs, processes=args.processes,
                           records=records)
        path = store(gpu, dt, entry, args.cache)
        print(f"stored {dt} in {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
