"""Benchmark ``pipeline``: host-resident products through the stream pipeline
against in-core cuBLAS, measured in the same run.

Variants (records under ``bench/results/pipeline-<device>-<date>.jsonl``):

- ``cublas``: in-core reference, operands already on the GPU, ``cupy.matmul``
  into a preallocated output; CUDA-event timed.
- ``distmm-host``: numpy operands and result in host memory, the pipeline with
  the default device budget (90% of free memory); wall time of the whole call.
- ``distmm-host-capped``: the same with ``device_memory_limit`` = 8 GB.
- ``distmm-host-pinned``: the same values in arrays page-locked by their owner
  (``cupyx.empty_pinned``, made before the timed calls; ``pinned_alloc_s`` records what
  making and filling them took), which cross straight between the device and the arrays.
- ``naive-host``: copy in (pageable), one ``cupy.matmul``, copy out (pageable)
  into a preallocated host array, one stream.
- ``--precision bf16``: host-resident bfloat16 instead (``bench_bf16``): ``cublas-bf16``
  in core, ``distmm-host-bf16`` (``ml_dtypes.bfloat16`` host operands, which cross as their
  bits), ``distmm-host-bf16-from-f32`` (the same values as float32 host operands) and
  ``distmm-host-bf16-pinned`` (the bfloat16 operands and the result in page-locked arrays).

The pipeline's compute is cuBLAS (``CublasGemm``): the claim is about hiding
the copies. Inputs are fresh random normal matrices made on the GPU and copied
to the host; outputs are poisoned with NaN before the checked run, and the
error is measured on sampled rows of C against a float64 cuBLAS product of
the same rows (a full CPU float64 product at n=32768 would take hours).

With ``--first-call``, each (size, dtype) runs in a fresh process of its own and
goes through ``distmm.matmul`` on numpy operands (the API's whole host path: the
GPU executor, its huge-page result, the pinned staging ring, the pipeline):

- ``first-call``: the first host-resident product of the process (the CUDA
  context exists, nothing of distmm's is warm); wall time of the call;
- ``first-call-warmup`` (``--warmup``): the same, in a process that called
  ``distmm.warmup()`` (background) before making its operands, as a program that
  starts it before loading its data would; the record holds the warm-up's phases
  and whether it had finished when the call started;
- ``steady``: the median of the next calls (each allocates its own result, as
  the API does);
- ``cublas``: in-core ``cupy.matmul`` into a preallocated output in the same
  process, afterwards; CUDA-event timed.

Usage (``bench/device/run.sh pipeline`` runs the GPU tests of the pipeline first)::

    python -m bench.pipeline --sizes 16384 32768 --dtypes float32 float64 \
        --out-dir "$OUT" --timeline "$OUT/timeline.png"
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from bench.common import (RecordWriter, event_seconds, free_gpu, gpu_name, gpu_sync, parser,
                          wall_times)

CAP_BYTES = 8 * 10**9  # "capped at 8 GB"
SAMPLE_ROWS = 64


def _rel_rows(c_rows: np.ndarray, ref_rows: np.ndarray) -> float:
    c_rows = np.asarray(c_rows, np.float64)
    if not np.isfinite(c_rows).all():
        return float("nan")
    return float(np.linalg.norm(c_rows - ref_rows) / np.linalg.norm(ref_rows))


def _run_fields(info: dict) -> dict:
    """The pipeline run's own facts a record keeps (``run_pipelined``'s ``info``)."""
    return {key: info.get(key) for key in ("budget", "tiling", "bytes_h2d", "bytes_d2h",
                                           "retries", "direct_in", "direct_out", "a_panel")}


def _traced(call, trace_to: tuple[str, str | None]) -> None:
    """One more run of ``call(trace=...)`` traced: the timeline drawn to ``trace_to[0]`` (and
    its JSON to ``trace_to[1]``), its throughput and busy lanes printed."""
    from distmm.cli.trace import render
    from distmm.executor.pipeline import Timeline

    tl = Timeline()
    call(trace=tl)
    if trace_to[1]:
        tl.to_json(trace_to[1])
    render(tl, trace_to[0])
    busy = {lane: round(tl.busy_ms(lane), 1) for lane in
            ("h2d", "compute", "d2h", "host-stage", "host-unstage")}
    print(f"timeline -> {trace_to[0]}: {tl.meta['tflops']:.2f} TFLOP/s traced, "
          f"busy ms {busy}, span {max(o['end_ms'] for o in tl.ops):.1f} ms", flush=True)


def pinned_copies(*arrays):
    """Page-locked copies of ``arrays`` (``cupyx.empty_pinned``, as a user holding pinned data
    would) and the seconds making and filling them took."""
    import cupyx

    t0 = time.perf_counter()
    out = []
    for x in arrays:
        p = cupyx.empty_pinned(x.shape, x.dtype)
        p[...] = x
        out.append(p)
    return out, time.perf_counter() - t0


def bench_one(writer: RecordWriter, n: int, dtype: str, repeat: int, seed: int,
              variants: set[str], log, trace_to: tuple[str, str | None] | None = None) -> dict:
    import cupy

    from distmm.executor.pinned import default_pinned_pool
    from distmm.executor.cublas import CublasGemm
    from distmm.executor.pipeline import run_pipelined
    from distmm.plan import make_plan

    dt = np.dtype(dtype)
    m = k = n
    results = {}
    rng = cupy.random.default_rng(seed)
    a_d = rng.standard_normal((m, k), dtype=np.float64).astype(dt)
    b_d = rng.standard_normal((k, n), dtype=np.float64).astype(dt)
    rows = np.sort(np.random.default_rng(seed).choice(m, SAMPLE_ROWS, replace=False))
    # float64 reference of the sampled rows, on the GPU
    ref_rows = cupy.matmul(a_d[cupy.asarray(rows)].astype(np.float64),
                           b_d.astype(np.float64, copy=False)).get()
    free_gpu()

    # -- in-core cuBLAS --------------------------------------------------------------
    c_d = cupy.full((m, n), np.nan, dtype=dt)
    cupy.matmul(a_d, b_d, out=c_d)
    err = _rel_rows(c_d[cupy.asarray(rows)].get(), ref_rows)
    sec = event_seconds(lambda: cupy.matmul(a_d, b_d, out=c_d), repeat=repeat, warmup=1)
    rec = writer.add("cublas", dt, m, n, k, sec, err, residency="device",
                     note=f"relerr on {SAMPLE_ROWS} sampled rows vs float64 cuBLAS")
    results["cublas"] = rec
    log(rec)
    del c_d
    a_h = a_d.get()
    b_h = b_d.get()
    del a_d, b_d
    free_gpu()
    c_h = c_h_plain = np.empty((m, n), dtype=dt)

    # -- naive: copy in, one call, copy out ----------------------------------------------
    if "naive-host" in variants:
        def naive():
            a_x = cupy.asarray(a_h)
            b_x = cupy.asarray(b_h)
            c_x = cupy.matmul(a_x, b_x)
            c_x.get(out=c_h)
        c_h[...] = np.nan
        naive()
        err = _rel_rows(c_h[rows], ref_rows)
        times = wall_times(naive, repeat=max(1, repeat - 2), warmup=0, sync=gpu_sync)  # slow: 1 run
        sec = float(np.median(times))
        rec = writer.add("naive-host", dt, m, n, k, sec, err, residency="host",
                         times=times, note="pageable copy in, cupy.matmul, pageable copy out; "
                         f"relerr on {SAMPLE_ROWS} sampled rows")
        results["naive-host"] = rec
        log(rec)
        free_gpu()

    # -- the pipeline ----------------------------------------------------------------------
    gemm = CublasGemm()
    pool = default_pinned_pool()
    plan = make_plan(m, n, k, dt)
    for variant, limit in (("distmm-host", None), ("distmm-host-capped", CAP_BYTES),
                           ("distmm-host-pinned", None)):
        if variant not in variants:
            continue
        info: dict = {}
        extra: dict = {}
        x, y, c_h = a_h, b_h, c_h_plain
        if variant.endswith("-pinned"):
            (x, y, c_h), extra["pinned_alloc_s"] = pinned_copies(a_h, b_h, c_h_plain)
            extra["residency"] = "host-pinned"
        c_h[...] = np.nan

        def call(info=info, limit=limit, trace=None, x=x, y=y, c_h=c_h):
            run_pipelined(gemm, plan, x, y, c_h, device_memory_limit=limit, info=info,
                          trace=trace)
        call()  # warm-up and the checked run (output poisoned above)
        all_written = bool(np.isfinite(c_h).all())
        err = _rel_rows(c_h[rows], ref_rows) if all_written else float("nan")
        times = wall_times(call, repeat=repeat, warmup=0, sync=gpu_sync)
        sec = float(np.median(times))
        err_after = _rel_rows(c_h[rows], ref_rows)
        rec = writer.add(variant, dt, m, n, k, sec, err, times=times,
                         **{"residency": "host", **extra},
                         device_memory_limit=limit, **_run_fields(info),
                         pinned_limit=pool.limit, pinned_peak=pool.peak_bytes,
                         all_written=all_written, relerr_after_timing=err_after,
                         ratio_vs_cublas=results["cublas"]["seconds"] / sec,
                         compute="cuBLAS via CublasGemm",
                         note=f"wall time host to host; relerr on {SAMPLE_ROWS} sampled rows "
                         "vs float64 cuBLAS; output poisoned with NaN before the checked run")
        results[variant] = rec
        log(rec)
        if trace_to is not None and variant == "distmm-host":
            _traced(call, trace_to)
        del x, y, c_h, call
        free_gpu()
    del gemm, a_h, b_h, c_h_plain
    gc.collect()
    return results


def bench_bf16(writer: RecordWriter, n: int, repeat: int, seed: int, log,
               trace_to: tuple[str, str | None] | None = None) -> dict:
    """Host-resident bfloat16 at n^3 (``--precision bf16``): ``cublas-bf16``, in-core
    ``cublasGemmEx`` on bfloat16 operands already on the GPU (float32 out); the pipeline
    (``GPUExecutor(backend="cublas", precision="bf16")``) on the same values held on the host
    as ``ml_dtypes.bfloat16`` (``distmm-host-bf16``: they cross as their 16-bit bits) and as
    float32 (``distmm-host-bf16-from-f32``: 4 bytes an element cross, rounded on the GPU)."""
    import cupy
    import ml_dtypes

    from distmm.executor.cublas import cublas_gemm_precision, to_input_format
    from distmm.executor.gpu import GPUExecutor
    from distmm.executor.pipeline import run_pipelined
    from distmm.plan import make_plan

    m = k = n
    rng = cupy.random.default_rng(seed)
    a_bits, _ = to_input_format(rng.standard_normal((m, k), dtype=np.float32), "bf16")
    b_bits, _ = to_input_format(rng.standard_normal((k, n), dtype=np.float32), "bf16")

    def widen(bits):
        return (bits.astype(cupy.uint32) << 16).view(cupy.float32)

    rows = np.sort(np.random.default_rng(seed).choice(m, SAMPLE_ROWS, replace=False))
    ref_rows = cupy.matmul(widen(a_bits[cupy.asarray(rows)]).astype(np.float64),
                           widen(b_bits).astype(np.float64)).get()
    results = {}
    c_d = cupy.full((m, n), np.nan, dtype=np.float32)
    cublas_gemm_precision(a_bits, b_bits, c_d, "bf16")
    err = _rel_rows(c_d[cupy.asarray(rows)].get(), ref_rows)
    sec = event_seconds(lambda: cublas_gemm_precision(a_bits, b_bits, c_d, "bf16"),
                        repeat=repeat, warmup=1)
    rec = writer.add("cublas-bf16", np.float32, m, n, k, sec, err, residency="device",
                     precision="bf16", input_format="bfloat16",
                     note=f"cublasGemmEx bf16 in, fp32 out; relerr on {SAMPLE_ROWS} sampled rows "
                          "vs float64 of the bfloat16 values")
    results["cublas-bf16"] = rec
    log(rec)
    del c_d
    a16 = a_bits.get().view(ml_dtypes.bfloat16)
    b16 = b_bits.get().view(ml_dtypes.bfloat16)
    del a_bits, b_bits
    free_gpu()
    c_h = np.empty((m, n), dtype=np.float32)
    ex = GPUExecutor(backend="cublas", precision="bf16")
    plan = make_plan(m, n, k, np.float32)
    c_plain = c_h
    for variant, (a_h, b_h) in (("distmm-host-bf16", (a16, b16)),
                                ("distmm-host-bf16-from-f32", (None, None)),
                                ("distmm-host-bf16-pinned", (None, None))):
        extra: dict = {"residency": "host"}
        c_h = c_plain
        if variant.endswith("-pinned"):
            (a_h, b_h, c_h), extra["pinned_alloc_s"] = pinned_copies(a16, b16, c_plain)
            extra["residency"] = "host-pinned"
        elif a_h is None:
            a_h, b_h = a16.astype(np.float32), b16.astype(np.float32)
        info: dict = {}
        c_h[...] = np.nan

        def call(info=info, a_h=a_h, b_h=b_h, c_h=c_h, trace=None):
            run_pipelined(ex, plan, a_h, b_h, c_h, info=info, trace=trace)
        call()
        all_written = bool(np.isfinite(c_h).all())
        err = _rel_rows(c_h[rows], ref_rows) if all_written else float("nan")
        times = wall_times(call, repeat=repeat, warmup=0, sync=gpu_sync)
        sec = float(np.median(times))
        rec = writer.add(variant, np.float32, m, n, k, sec, err, times=times, **extra,
                         precision="bf16", input_format=np.dtype(a_h.dtype).name,
                         operands_as=info.get("operands_as"), **_run_fields(info),
                         all_written=all_written,
                         ratio_vs_cublas=results["cublas-bf16"]["seconds"] / sec,
                         compute="cuBLAS bf16 (GPUExecutor precision='bf16')",
                         note=f"wall time host to host; relerr on {SAMPLE_ROWS} sampled rows; "
                              "output poisoned with NaN before the checked run")
        results[variant] = rec
        log(rec)
        if trace_to is not None and variant in ("distmm-host-bf16", "distmm-host-bf16-pinned"):
            png, js = trace_to
            tag = variant.removeprefix("distmm-host-bf16")
            _traced(call, (png.replace(".png", f"{tag}.png"),
                           js.replace(".json", f"{tag}.json") if js else None))
        del a_h, b_h, c_h, call
        free_gpu()
    del c_plain, ex
    gc.collect()
    return results


def probe() -> dict:
    """Host copy bandwidth with 1..12 threads (numpy, GIL released) and pinned copies:
    the rates the pipeline's overlap depends on (printed, for the notes)."""
    import concurrent.futures as cf

    import cupy

    from distmm.executor.pinned import PinnedPool

    nbytes = 1 << 30
    src = np.random.default_rng(0).standard_normal(nbytes // 8)
    pool = PinnedPool(nbytes)
    buf = pool.acquire(nbytes)
    dst = buf.view((nbytes // 8,), np.float64)
    dst[...] = 0
    out = {}
    for threads in (1, 4, 8, 12):
        step = len(src) // 64
        with cf.ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            list(ex.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]),
                        range(0, len(src), step)))
            out[f"host_copy_{threads}t_GBps"] = round(nbytes / (time.perf_counter() - t0) / 1e9, 1)
    d = cupy.empty(nbytes // 8, np.float64)
    for name, fn in (("h2d_pinned_GBps", lambda: d.set(dst)),
                     ("d2h_pinned_GBps", lambda: d.get(out=dst))):
        fn()
        gpu_sync()
        t0 = time.perf_counter()
        fn()
        gpu_sync()
        out[name] = round(nbytes / (time.perf_counter() - t0) / 1e9, 1)
    del d
    pool.release(buf)
    pool.close()
    free_gpu()
    return out


def first_call_child(n: int, dtype: str, out_dir, steady: int, warm: bool = False) -> None:
    """One fresh process: distmm's first and steady host-resident calls, then in-core cuBLAS."""
    import cupy

    import distmm
    from distmm.executor.hostmem import thp_mode
    from distmm.executor.pinned import default_pinned_pool

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("distmm.executor.pipeline").setLevel(logging.DEBUG)
    dt = np.dtype(dtype)
    cupy.zeros(1)  # the CUDA context: not distmm's to pay
    gpu_sync()
    warm = distmm.warmup() if warm else None  # runs while the operands are made
    rng = cupy.random.default_rng(n + len(dtype))
    a_h = cupy.asnumpy(rng.standard_normal((n, n), dtype=np.float64).astype(dt))
    b_h = cupy.asnumpy(rng.standard_normal((n, n), dtype=np.float64).astype(dt))
    free_gpu()
    writer = RecordWriter("pipeline", gpu_name(), out_dir, gpus=1, workers=1, ranks=1,
                          residency="host", thp=thp_mode())
    warm_done = warm.done if warm is not None else None
    t0 = time.perf_counter()
    c = distmm.matmul(a_h, b_h)
    first = time.perf_counter() - t0
    first_extra = {} if warm is None else {"warmup_phases": warm.wait(0), "warmup_done_at_call":
                                           warm_done, "warmup_error": warm.error}
    pinned = default_pinned_pool().peak_bytes
    rows = np.random.default_rng(n).choice(n, SAMPLE_ROWS, replace=False)
    a_rows = cupy.asarray(a_h[rows]).astype(np.float64)
    ref_rows = cupy.asnumpy(a_rows @ cupy.asarray(b_h).astype(np.float64))
    err = _rel_rows(c[rows], ref_rows)
    del c, a_rows
    free_gpu()
    times = []
    for _ in range(steady):
        gc.collect()
        t0 = time.perf_counter()
        c = distmm.matmul(a_h, b_h)
        times.append(time.perf_counter() - t0)
        del c
    a_d, b_d = cupy.asarray(a_h), cupy.asarray(b_h)
    c_d = cupy.empty((n, n), dt)
    sec_ref = event_seconds(lambda: cupy.matmul(a_d, b_d, out=c_d), repeat=3, warmup=1)
    ref = writer.add("cublas", dt, n, n, n, sec_ref, None, residency="device",
                     note="in-core cupy.matmul, same process, after the distmm calls")
    steady_s = float(np.median(times))
    first_name = "first-call" if warm is None else "first-call-warmup"
    for variant, sec, extra in ((first_name, first, {"pinned_peak_bytes": pinned, **first_extra}),
                                ("steady", steady_s, {"times": times})):
        rec = writer.add(variant, dt, n, n, n, sec, err, ratio_vs_cublas=sec_ref / sec,
                         api="distmm.matmul(numpy, numpy)", **extra)
        print(f"{dtype:8s} n={n} {variant:10s} {sec:7.3f} s  {100 * sec_ref / sec:5.1f}% of in-core "
              f"cuBLAS ({ref['seconds']:.3f} s)  relerr {err:.1e}", flush=True)


def first_call_main(args) -> int:
    """Each (size, dtype) in a fresh interpreter (``--child``)."""
    import subprocess

    rc = 0
    for dtype in args.dtypes:
        for n in args.sizes:
            for warm in ([False, True] if args.warmup else [False]):
                cmd = [sys.executable, "-m", "bench.pipeline", "--child", str(n), dtype,
                       "--steady", str(args.steady)] + (["--out-dir", args.out_dir] if args.out_dir
                                                        else []) + (["--warm-child"] if warm else [])
                rc = subprocess.call(cmd) or rc
    return rc


def main(argv=None) -> int:
    p = parser(__doc__, prog="python -m bench.pipeline")
    p.add_argument("--first-call", action="store_true",
                   help="first-call and steady variants, one fresh process per size and dtype")
    p.add_argument("--child", nargs=2, default=None, metavar=("N", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--steady", type=int, default=2, help="--first-call: calls after the first")
    p.add_argument("--warmup", action="store_true",
                   help="--first-call: also a process that starts distmm.warmup() before its operands")
    p.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--variants", nargs="+",
                   default=["cublas", "naive-host", "distmm-host", "distmm-host-capped"])
    p.add_argument("--timeline", default=None, help="PNG of one traced run")
    p.add_argument("--timeline-json", default=None)
    p.add_argument("--timeline-n", type=int, default=32768)
    p.add_argument("--timeline-dtype", default="float32")
    p.add_argument("--probe", action="store_true", help="print host/pinned copy bandwidths first")
    p.add_argument("--precision", choices=("bf16",), default=None,
                   help="host-resident bfloat16 against in-core cuBLAS bf16 instead (bench_bf16)")
    args = p.parse_args(argv)
    if args.child:
        first_call_child(int(args.child[0]), args.child[1], args.out_dir, args.steady,
                         warm=args.warm_child)
        return 0
    if args.first_call:
        return first_call_main(args)

    from distmm.executor.pipeline.run import host_threads

    device = gpu_name()
    writer = RecordWriter("pipeline", device, args.out_dir, gpus=1, workers=1, ranks=1,
                          host_threads=host_threads())
    print(f"pipeline benchmark on {device}; records -> {writer.path}", flush=True)
    if args.probe:
        try:
            print("probe:", probe(), flush=True)
        except Exception as exc:  # the probe only informs the notes
            print(f"probe failed: {exc!r}", flush=True)

    def log(rec):
        ratio = rec.get("ratio_vs_cublas")
        print(f"{rec['dtype']:8s} n={rec['m']:6d} {rec['variant']:20s} {rec['seconds']:8.4f} s "
              f"{rec['tflops']:7.2f} TFLOP/s relerr {rec['relerr']:.2e}"
              + (f"  {100 * ratio:5.1f}% of cuBLAS" if ratio else ""), flush=True)

    table = []
    if args.precision == "bf16":
        for n in args.sizes:
            trace_to = ((args.timeline, args.timeline_json)
                        if args.timeline and n == args.timeline_n else None)
            res = bench_bf16(writer, n, args.repeat, seed=n + 16, log=log, trace_to=trace_to)
            table.extend(res.values())
        for rec in table:
            ratio = rec.get("ratio_vs_cublas")
            print(f"  bf16 {rec['m']:6d} {rec['variant']:28s} {rec['tflops']:7.2f} TFLOP/s"
                  + (f"  {100 * ratio:5.1f}% of cuBLAS bf16" if ratio else ""))
        return 0
    for dtype in args.dtypes:
        for n in args.sizes:
            trace_to = ((args.timeline, args.timeline_json)
                        if args.timeline and (n, dtype) == (args.timeline_n, args.timeline_dtype)
                        else None)
            res = bench_one(writer, n, dtype, args.repeat, seed=n + len(dtype),
                            variants=set(args.variants), log=log, trace_to=trace_to)
            table.extend(res.values())
    print("\nsummary (ratio = cuBLAS in-core seconds / variant seconds, same run)")
    for rec in table:
        print(f"  {rec['dtype']:8s} {rec['m']:6d} {rec['variant']:20s} {rec['tflops']:7.2f} TFLOP/s"
              f"  {100 * table_ratio(table, rec):5.1f}%  relerr {rec['relerr']:.1e}")
    return 0


def table_ratio(table, rec) -> float:
    ref = [r for r in table if r["variant"] == "cublas" and r["dtype"] == rec["dtype"]
           and r["m"] == rec["m"]]
    return ref[0]["seconds"] / rec["seconds"] if ref else float("nan")


if __name__ == "__main__":
    sys.exit(main())
