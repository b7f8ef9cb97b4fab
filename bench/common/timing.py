"""Timing of the benchmarks: wall-clock medians with an optional device synchronisation
(``median_seconds``, ``wall_times``, ``alternating_seconds``), CUDA-event medians on the
current stream (``event_seconds``, ``event_alternating``), the sustained clock of a GPU loop
(``sustained_clock``), in-core cupy GEMM seconds (``incore_gemm_seconds``), and freeing
cupy's pools between configurations (``free_gpu``).

It does not cover what is timed. Importing it needs neither cupy nor a GPU.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import numpy as np


def gpu_sync() -> None:
    """Wait for all work on the current GPU."""
    import cupy

    cupy.cuda.Device().synchronize()


def free_gpu() -> None:
    """Return cupy's pooled device and pinned memory (between configurations)."""
    import gc

    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def wall_times(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
               sync: Callable[[], Any] | None = None) -> list[float]:
    """Wall seconds of each of ``repeat`` calls of ``fn()`` after ``warmup`` calls;
    ``sync()`` (a device synchronisation for GPU work) runs before each clock read."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median of ``wall_times``."""
    return float(np.median(wall_times(fn, repeat=repeat, warmup=warmup, sync=sync)))


def alternating_seconds(fns: Mapping[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall seconds of each callable, timed in turn ``repeat`` times (no warm-up: the
    caller's checked run is the warm-up), so that load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def event_seconds(fn: Callable[[], Any], *, repeat: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` between CUDA events on the current stream, after warm-up
    (``distmm.cli.tune.time_gpu``, the one implementation)."""
    from distmm.cli.tune import time_gpu

    return time_gpu(fn, repeat=repeat, warmup=warmup)


def event_alternating(runs: Mapping[str, Callable[[], Any]], *, rounds: int, repeat: int,
                      warmup: int = 1) -> dict[str, float]:
    """Median seconds of each of ``runs`` timed in alternation (``rounds`` rounds, each
    timing every run once with CUDA events): ``distmm.cli.tune.time_alternating``."""
    from distmm.cli.tune import time_alternating

    return time_alternating(runs, rounds=rounds, repeat=repeat, warmup=warmup)


def sustained_clock(fn: Callable[[], Any], seconds: float = 2.0) -> tuple[float, float, float]:
    """(median SM MHz, median board W, calls per second) of ``fn`` run back to back: the one
    implementation, ``distmm.cli.tune.sustained_clock`` (NOTES.md: the GEMMs run at the power cap)."""
    from distmm.cli.tune import sustained_clock as measure

    return measure(fn, seconds)


def incore_gemm_seconds(n: int, dtype, repeat: int = 3) -> float:
    """Median seconds of ``cupy.matmul`` on device-resident random operands (TF32 off)."""
    import cupy

    rng = cupy.random.default_rng(7)
    a = rng.standard_normal((n, n), dtype=dtype)
    b = rng.standard_normal((n, n), dtype=dtype)
    c = cupy.matmul(a, b)
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        cupy.matmul(a, b, out=c)
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    del a, b, c
    cupy.get_default_memory_pool().free_all_blocks()
    return statistics.median(times)
