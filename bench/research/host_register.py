"""What does page-locking a caller's array in place cost, and what copy rates follow?

The stream pipeline stages host operands and results through a pinned ring (a host copy on
each side of every transfer). Copying straight between the device and the caller's arrays
needs them page-locked where they are (``cudaHostRegister``); whether that pays depends on
what locking and unlocking cost against the copies they save. For 1, 2 and 4 GiB numpy
arrays (random; ``empty`` with one byte a page written; ``huge``: distmm's result memory,
``hostmem.empty_host``'s transparent-huge-page mapping, its pages faulted in first):
``cudaHostRegister`` and
``cudaHostUnregister`` times, host-to-device and device-to-host rates from the locked array,
and both directions at once on two streams; then what ``cupyx.empty_pinned`` (``cudaHostAlloc``)
takes to make such an array and to write it once. Prints one line a size and kind; no record.

``python -m bench.research.host_register``
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.research.host_register",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="GiB")
    args = p.parse_args(argv)
    import cupy as cp

    rt = cp.cuda.runtime
    cp.zeros(1)
    cp.cuda.Device().synchronize()
    s, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for gib in args.sizes:
        n = gib << 30
        for kind in ("rng", "empty-touched", "huge"):
            if kind == "rng":
                x = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
            elif kind == "huge":
                from distmm.executor.hostmem import empty_host

                x = empty_host((n,), np.uint8)
                x[::4096] = 1  # every page in (the touch threads may still be running)
            else:
                x = np.empty(n, np.uint8)
                x[::4096] = 1
            d = cp.empty(n, cp.uint8)
            ptr = x.ctypes.data
            t = time.perf_counter()
            rt.hostRegister(ptr, n, 0)
            lock = time.perf_counter() - t
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record(s)
            rt.memcpyAsync(d.data.ptr, ptr, n, rt.memcpyHostToDevice, s.ptr)
            ev1.record(s)
            ev1.synchronize()
            h2d = n / cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / 1e9
            ev0.record(s)
            rt.memcpyAsync(ptr, d.data.ptr, n, rt.memcpyDeviceToHost, s.ptr)
            ev1.record(s)
            ev1.synchronize()
            d2h = n / cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / 1e9
            half = n // 2
            t = time.perf_counter()
            rt.memcpyAsync(d.data.ptr, ptr, half, rt.memcpyHostToDevice, s.ptr)
            rt.memcpyAsync(ptr + half, d.data.ptr + half, half, rt.memcpyDeviceToHost, s2.ptr)
            s.synchronize()
            s2.synchronize()
            both = n / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            rt.hostUnregister(ptr)
            unlock = time.perf_counter() - t
            print(f"{gib} GiB {kind}: register {lock * 1e3:.1f} ms ({gib / lock:.1f} GiB/s), "
                  f"unregister {unlock * 1e3:.1f} ms; h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s, "
                  f"both ways {both:.1f} GB/s together", flush=True)
            del x, d
            cp.get_default_memory_pool().free_all_blocks()
        import cupyx

        t = time.perf_counter()
        x = cupyx.empty_pinned((n,), np.uint8)
        made = time.perf_counter() - t
        x[...] = 1
        filled = time.perf_counter() - t - made
        print(f"{gib} GiB cupyx.empty_pinned: made in {made * 1e3:.1f} ms, written once in "
              f"{filled * 1e3:.1f} ms", flush=True)
        del x
        cp.get_default_pinned_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
