"""Does a 2-D copy (cudaMemcpy2DAsync) return to the host before its stream reaches it?

The stream pipeline's column halves (bench/NOTES.md, twentieth session) traced every unit's
A rows issued only once the unit before's 2-D copy of C out had started, as if the host's
call waited for the stream. This probe queues a GEMM of ~50 ms on a stream, then one copy on
the same stream between page-locked host memory and the device, and times how long the
copy's call takes to return on the host: a 1-D copy and a 2-D copy (rows of 64 KB out of
128 KB), each way. No record; it informs bench/NOTES.md.

    python -m bench.research.copy2d_async
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.copy2d_async",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096, help="rows of the copied rectangle")
    args = p.parse_args(argv)
    import cupy
    import cupyx

    rt = cupy.cuda.runtime
    rows, width, pitch = args.rows, 64 << 10, 128 << 10
    host = cupyx.empty_pinned((rows, pitch), np.uint8)
    host[...] = 1
    dev = cupy.empty((rows, width), np.uint8)
    a = cupy.ones((8192, 8192), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        a @ a  # cuBLAS's start-up, off the timing
    stream.synchronize()
    ways = {
        "1-D device to host": lambda: rt.memcpyAsync(host.ctypes.data, dev.data.ptr, rows * width,
                                                     rt.memcpyDeviceToHost, stream.ptr),
        "2-D device to host": lambda: rt.memcpy2DAsync(host.ctypes.data, pitch, dev.data.ptr, width,
                                                       width, rows, rt.memcpyDeviceToHost,
                                                       stream.ptr),
        "1-D host to device": lambda: rt.memcpyAsync(dev.data.ptr, host.ctypes.data, rows * width,
                                                     rt.memcpyHostToDevice, stream.ptr),
        "2-D host to device": lambda: rt.memcpy2DAsync(dev.data.ptr, width, host.ctypes.data, pitch,
                                                       width, rows, rt.memcpyHostToDevice,
                                                       stream.ptr),
    }
    for name, copy in ways.items():
        for _ in range(2):
            with stream:
                for _ in range(4):
                    a @ a  # ~40-50 ms of GEMMs ahead of the copy
            t0 = time.perf_counter()
            copy()
            returned = time.perf_counter() - t0
            stream.synchronize()
            queued = time.perf_counter() - t0
            print(f"{name}: the call returned after {returned * 1e3:7.2f} ms "
                  f"(the stream drained after {queued * 1e3:6.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
