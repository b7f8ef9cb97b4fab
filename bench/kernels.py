"""Benchmark ``kernels``: every CUDA kernel step of distmm and cuBLAS, in one run.

For each dtype and shape: fresh random operands; cuBLAS (``cupy.matmul``, variant
``cublas``) and each kernel step (variant ``distmm-raw-<kernel>``) are first checked against
a float64 product (relative error recorded), then timed with CUDA events (median after a
warm-up). Also measured in the same run, for the roofline: the device-to-device copy
bandwidth and the FFMA/DFMA peak of a register-only probe kernel (variants ``ceiling-*``).
Records go to ``<out>/kernels-<device>-<date>.jsonl``; ``bench/plot_kernels.py`` makes the
table and the plots from them.

Usage (on a GPU machine, from the repository root; ``bench/device/run.sh kernels`` runs it
with the GPU tests' kernel cache)::

    python -m bench.kernels --out-dir bench/results        # full run
    python -m bench.kernels --sizes 1024 2048 --no-rect    # quick
    python -m bench.kernels --warm-only                    # compile everything in parallel
    python -m bench.kernels --precisions tf32 bf16 fp16 --sizes 8192   # tensor-core steps
    python -m bench.kernels --precisions tf32 bf16 fp16 --warm-only    # ... compiled first

With ``--precisions``, the reduced-precision steps 11-15 (``registry.TC_KERNELS``: each
kernel that runs on this device for each mode) are measured instead, beside cuBLAS at the
same precision (``cublasGemmEx``: float32 operands with ``CUBLAS_COMPUTE_32F_FAST_TF32`` for
tf32; bfloat16 / float16 operands with ``CUBLAS_COMPUTE_32F`` for bf16 / fp16, C float32),
both on operands already in the input format (the conversion is not timed); variants
``cublas-<precision>`` and ``distmm-raw-<kernel>``, records with ``precision``.
"""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

import distmm.executor.registry as registry
from bench.common import (RecordWriter, event_alternating, event_seconds, gpu_name, parser,
                          random_operands)

SQUARE = (1024, 2048, 4096, 8192, 16384)
RECT = ((4096, 4096, 16384), (16384, 16384, 1024), (8192, 2048, 8192))
TF32_NOTE = "cupy.matmul with CUPY_TF32 unset: IEEE fp32 SGEMM (no TF32)"

_PEAK_SRC = r"""
template <typename T>
__global__ void peak_fma(T* out, T x, T y, int iters) {
    T a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3,
      a4 = a0 + 4, a5 = a0 + 5, a6 = a0 + 6, a7 = a0 + 7;
#pragma unroll 4
    for (int i = 0; i < iters; ++i) {
        a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y;
        a4 = a4 * x + y; a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
"""


def warm_items():
    """Everything the GPU tests and this benchmark compile: each kernel for each dtype and
    transpose layout, the tuner-space samples the tests use."""
    items = []
    for spec in registry.steps():
        for dt in spec.dtypes:
            layouts = [(a, b) for a in (0, 1) for b in (0, 1)] if spec.layout_template else [(0, 0)]
            items += [(spec.name, dt, None, bool(a), bool(b)) for a, b in layouts]
    spec = registry.best_kernel()
    for dt in ("float32", "float64"):
        cands = spec.candidates(dt)
        for p in cands[1:len(cands):max(1, len(cands) // 4)]:
            items += [(spec.name, dt, p, False, False), (spec.name, dt, p, True, True)]
    return items


def tc_warm_items(cc: int, variants=()):
    """What the tensor-core GPU tests and ``--precisions`` compile on compute capability
    ``cc``: each step that runs there, each input format and layout, the tuning-space
    samples the tests use, and the ``--tc-variant`` configurations (``variants``)."""
    items = []
    for spec in registry.tc_steps():
        if not spec.runs_on(cc):
            continue
        for fmt in spec.inputs:
            # TF32 on the TMA steps: one instantiation, the k-major copies launch_tc makes
            layouts = spec.layouts(fmt)
            items += [(spec.name, fmt, None, a, b) for a, b in layouts]
            cands = spec.candidates(fmt, cc)
            sampled = layouts if len(layouts) == 1 else [(False, False), (True, True)]
            for p in cands[1:len(cands):max(1, len(cands) // 4)]:
                items += [(spec.name, fmt, p, a, b) for a, b in sampled]
            for _, p in tc_variants(spec, fmt, variants, cc)[1:]:
                items.append((spec.name, fmt, p, *layouts[0]))
    return items


def ceilings(rec, log=print):
    """Measured memory bandwidth and FMA peaks (same run), as ``ceiling-*`` records."""
    import cupy

    n = 1 << 28  # 1 GiB of float32
    src = cupy.random.default_rng().standard_normal(n, dtype=np.float32)
    dst = cupy.empty_like(src)
    sec = event_seconds(lambda: cupy.copyto(dst, src), repeat=10)
    gbps = 2 * src.nbytes / sec / 1e9
    rec.add("ceiling-copy", "float32", n, 1, 1, sec, None, tflops=None, gbps=gbps,
            note="device-to-device copy, bytes read + written")
    log(f"copy: {gbps:.0f} GB/s")
    del src, dst
    mod = cupy.RawModule(code=_PEAK_SRC, options=("-std=c++17",),
                         name_expressions=["peak_fma<float>", "peak_fma<double>"])
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    threads, blocks = 256, sms * 8
    for dt, expr, iters in (("float32", "peak_fma<float>", 1 << 16), ("float64", "peak_fma<double>", 1 << 14)):
        k = mod.get_function(expr)
        out = cupy.empty(blocks * threads, dtype=dt)
        t = np.dtype(dt).type
        run = lambda: k((blocks,), (threads,), (out, t(0.999), t(0.001), np.int32(iters)))  # noqa: E731
        sec = event_seconds(run, repeat=5)
        tf = 2 * 8 * iters * threads * blocks / sec / 1e12
        rec.add(f"ceiling-{'ffma' if dt == 'float32' else 'dfma'}", dt, 0, 0, 0, sec, None,
                tflops=tf, note=f"register-only FMA probe, {blocks}x{threads} threads")
        log(f"{dt} FMA peak: {tf:.1f} TFLOP/s")


CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77


def cublas_precision_runner(a_in, b_in, c, m, n, k, precision):
    """cuBLAS at ``precision`` on operands already in its input format (float32 for tf32,
    float16, or bfloat16 bits as uint16): row-major C = A @ B as column-major C^T = B^T A^T."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    in_type = {"tf32": CUDA_R_32F, "bf16": CUDA_R_16BF, "fp16": CUDA_R_16F}[precision]
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if precision == "tf32" else CUBLAS_COMPUTE_32F
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    handle = cupy.cuda.device.get_cublas_handle()

    def run():
        cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.gemmEx(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k, one.ctypes.data,
                      b_in.data.ptr, in_type, n, a_in.data.ptr, in_type, k, zero.ctypes.data,
                      c.data.ptr, CUDA_R_32F, n, compute, -1)  # -1: CUBLAS_GEMM_DEFAULT
    return run


def _poisoned_check(c, ref, ref_norm):
    """``check(run)``: C filled with NaN, ``run()``, then C's relative error against ``ref``
    (a run that writes nothing gives NaN, never a pass)."""
    import cupy

    def check(run):
        c.fill(np.nan)
        run()
        cupy.cuda.get_current_stream().synchronize()
        return float(cupy.linalg.norm(c.astype(np.float64) - ref)) / ref_norm
    return check


def _repeats(m: int, n: int, k: int) -> int:
    """Timed repetitions per size: fewer for the large products."""
    return 10 if m * n * k <= 4096**3 else (5 if m * n * k <= 8192**3 else 3)


def parse_variant(text: str) -> dict[str, int]:
    """``"INFLIGHT=1,BM=256"`` -> ``{"INFLIGHT": 1, "BM": 256}``."""
    out = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--tc-variant {text!r}: KEY=INT[,KEY=INT...] expected")
        out[key.strip()] = int(value)
    return out


def tc_variants(spec, fmt: str, variants, cc: int) -> list[tuple[str, dict]]:
    """The defaults (suffix ``""``) and each ``--tc-variant`` that names only ``spec``'s
    parameters and is valid on ``cc`` (suffix ``+KEY=V,...``), for ``fmt``."""
    base = spec.params(fmt)
    out = [("", base)]
    for text in variants or ():
        change = parse_variant(text)
        if set(change) <= set(base):
            p = dict(base, **change)
            if not spec.violations(fmt, p, cc) and p not in [q for _, q in out]:
                out.append(("+" + text.replace(" ", ""), p))
    return out


def tensor_cores(args, rec) -> None:
    """The tensor-core steps against cuBLAS at each precision in ``args.precisions``."""
    import cupy

    from distmm.executor import cuda_loader

    cc = cuda_loader.compute_capability()
    shapes = [(s, s, s) for s in sorted(args.sizes)] + ([] if args.no_rect else list(RECT))
    for precision in args.precisions:
        specs = [s for s in registry.tc_steps() if precision in s.precisions and s.runs_on(cc)]
        fmt = registry.PRECISION_INPUT[precision]
        for m, n, k in shapes:
            flops = 2.0 * m * n * k
            a, b = random_operands(m, n, k, "float32")
            ref = cupy.matmul(a.astype(np.float64), b.astype(np.float64))
            ref_norm = float(cupy.linalg.norm(ref))
            a_in, b_in = cuda_loader.to_input_format(a, fmt), cuda_loader.to_input_format(b, fmt)
            c = cupy.empty((m, n), dtype=np.float32)

            check = _poisoned_check(c, ref, ref_norm)
            repeat = _repeats(m, n, k)
            blas = cublas_precision_runner(a_in, b_in, c, m, n, k, precision)
            runs = {f"cublas-{precision}": (blas, check(blas), None, None)}
            for spec in specs:
                for suffix, params in tc_variants(spec, fmt, args.tc_variant, cc):
                    run = (lambda spec=spec, params=params: cuda_loader.launch_tc(
                        spec.name, a_in, False, k, b_in, False, n, c, n, m, n, k,
                        precision=precision, params=params))
                    if run() != spec.name:  # step 14 hands what no tensor map fits to 13
                        raise RuntimeError(f"{spec.name} did not run the {m}x{n}x{k} product")
                    runs[f"distmm-raw-{spec.name}{suffix}"] = (run, check(run), spec, params)
            secs = event_alternating({name: r[0] for name, r in runs.items()},
                                     rounds=args.rounds, repeat=repeat)
            line = []
            for name, (run, err, spec, params) in runs.items():
                sec = secs[name]
                extra = {} if spec is None else {"kernel": spec.name, "params": params,
                                                 "backend": "raw"}
                rec.add(name, "float32", m, n, k, sec, err, step=spec.step if spec else 0,
                        precision=precision, input_format=fmt, rounds=args.rounds, **extra)
                line.append(f"{name} {flops / sec / 1e12:6.1f} ({err:.1e})")
            print(f"{precision} {m}x{n}x{k}: " + "; ".join(line), flush=True)
            del a, b, a_in, b_in, ref, c, check  # check holds C and the reference
            cupy.get_default_memory_pool().free_all_blocks()


def model_bytes(spec, params, m, n, k, itemsize):
    """DRAM bytes if each block reads its A and B panels once and C is written once (the
    tile model; L2 reuse between blocks makes real traffic lower)."""
    if spec is None:  # ideal: every operand once
        return itemsize * (m * k + k * n + m * n)
    bm, bn = spec.tile(params)
    return itemsize * (m * k * math.ceil(n / bn) + k * n * math.ceil(m / bm) + m * n)


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m bench.kernels")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SQUARE))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--kernels", nargs="+", default=[k.name for k in registry.steps()])
    ap.add_argument("--no-rect", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=0.6,
                    help="skip a kernel at sizes where one run would take longer")
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time cuBLAS and the kernels in alternation this many times; median")
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--precisions", nargs="+", choices=("tf32", "bf16", "fp16"), default=None,
                    help="measure the tensor-core steps (11-15) at these precisions instead")
    ap.add_argument("--tc-variant", action="append", default=[], metavar="KEY=INT[,KEY=INT]",
                    help="with --precisions: also time each tensor-core step whose parameters "
                         "these name, with them changed from its defaults (repeatable)")
    ap.add_argument("--profile", nargs=2, metavar=("DTYPE", "N"), default=None,
                    help="launch the tuned best kernel twice at n (for ncu --launch-skip 1)")
    args = ap.parse_args(argv)

    import cupy

    from distmm.executor import cuda_loader
    from distmm.executor.gpu import GPUExecutor

    if os.environ.get("CUPY_TF32", "0") != "0":
        print("CUPY_TF32 is set: the cuBLAS reference would use TF32; unset it", file=sys.stderr)
        return 2
    if args.profile:
        dt, size = args.profile[0], int(args.profile[1])
        spec = registry.best_kernel()
        params = GPUExecutor(backend="raw").kernel_params(dt)
        a, b = random_operands(size, size, size, dt)
        c = cupy.empty((size, size), dtype=dt)
        for _ in range(2):
            cuda_loader.launch(spec.name, a, False, size, b, False, size, c, size, size, size,
                               size, params=params, check=True)
        print(f"profiled {spec.name} {dt} n={size} {params}")
        return 0
    t0 = time.perf_counter()
    if args.precisions and args.warm_only:
        items = tc_warm_items(cuda_loader.compute_capability(), args.tc_variant)
        errors = cuda_loader.warm(items, processes=args.processes)
        print(f"compiled {len(items)} tensor-core kernels in {time.perf_counter() - t0:.1f} s; "
              f"{len(errors)} errors")
        for e in errors:
            print("  ", e)
        return 1 if errors else 0
    if args.precisions:
        device = gpu_name()
        rec = RecordWriter("kernels", device, args.out_dir, gpus=1)
        print(f"{device}: records -> {rec.path}")
        tensor_cores(args, rec)
        print(f"done in {time.perf_counter() - t0:.0f} s: {rec.path}")
        return 0
    items = warm_items() if args.warm_only else [
        (k, dt, GPUExecutor(backend="raw", kernel=k).kernel_params(dt), False, False)
        for k in args.kernels for dt in args.dtypes]
    errors = cuda_loader.warm(items, processes=args.processes)
    print(f"compiled {len(items)} kernels in {time.perf_counter() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  ", e)
    if args.warm_only:
        return 1 if errors else 0

    device = gpu_name()
    rec = RecordWriter("kernels", device, args.out_dir, gpus=1)
    print(f"{device}: records -> {rec.path}")
    ceilings(rec)
    shapes = [(s, s, s) for s in sorted(args.sizes)] + ([] if args.no_rect else list(RECT))
    for dt in args.dtypes:
        itemsize = np.dtype(dt).itemsize
        speed = {}  # kernel -> last TFLOP/s, to skip runs that would be too slow
        for m, n, k in shapes:
            flops = 2.0 * m * n * k
            a, b = random_operands(m, n, k, dt)
            ref = cupy.matmul(a.astype(np.float64), b.astype(np.float64))
            ref_norm = float(cupy.linalg.norm(ref))
            c = cupy.empty((m, n), dtype=dt)

            check = _poisoned_check(c, ref, ref_norm)
            repeat = _repeats(m, n, k)
            blas = lambda: cupy.matmul(a, b, out=c)  # noqa: E731
            runs = {"cublas": (blas, check(blas), None, None)}
            skipped = []
            for name in args.kernels:
                spec = registry.get(name)
                params = GPUExecutor(backend="raw", kernel=name).kernel_params(dt)
                if name in speed and flops / (speed[name] * 1e12) > args.max_seconds:
                    skipped.append(f"{name} skipped")
                    continue
                run = (lambda spec=spec, params=params: cuda_loader.launch(
                    spec.name, a, False, k, b, False, n, c, n, m, n, k, params=params))
                runs[name] = (run, check(run), spec, params)
            # cuBLAS and every kernel in alternation, --rounds times: a clock or power
            # change during the run hits all alike; each variant's record is the median
            secs = event_alternating({name: r[0] for name, r in runs.items()},
                                    rounds=args.rounds, repeat=repeat)
            line = []
            for name, (run, err, spec, params) in runs.items():
                sec = secs[name]
                tf = flops / sec / 1e12
                if spec is None:
                    rec.add("cublas", dt, m, n, k, sec, err, step=0, note=TF32_NOTE,
                            model_bytes=model_bytes(None, None, m, n, k, itemsize),
                            rounds=args.rounds)
                    line.append(f"cublas {tf:6.2f}")
                    continue
                speed[name] = tf
                mb = model_bytes(spec, params, m, n, k, itemsize)
                rec.add(f"distmm-raw-{name}", dt, m, n, k, sec, err, step=spec.step,
                        kernel=name, params=params, model_bytes=mb, backend="raw",
                        rounds=args.rounds)
                line.append(f"{name} {tf:6.2f} ({err:.1e})")
            print(f"{dt} {m}x{n}x{k}: " + "; ".join(line + skipped), flush=True)
            del a, b, ref, c, check  # check holds C and the reference
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"done in {time.perf_counter() - t0:.0f} s: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
