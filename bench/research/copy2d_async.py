"""Does a 2-D copy (cudaMemcpy2DAsync) return to the host before its stream reaches it?

The stream pipeline's column halves (bench/NOTES.md, "Host-resident bfloat16 in the stream
pipeline") traced every unit's A rows issued only once the unit before's 2-D copy of C out had
started, as if the host's call waited for the stream. This probe queues ~40-50 ms of GEMMs on a
stream, then one copy on the same stream between page-locked host memory and the device, and
times how long the copy's call takes to return on the host: a 1-D copy and a 2-D copy (rows of
64 KB out of 128 KB), each way, from ``cupyx.empty_pinned`` memory and from numpy memory
page-locked in place (``cudaHostRegister``, as the pipeline locks the caller's arrays). Then,
while one thread's copy waits behind the GEMMs, a second thread issues a 1-D copy on another
stream: does that call wait for the first? No record; it informs bench/NOTES.md.

    python -m bench.research.copy2d_async
"""
from __future__ import annotations

import argparse
import threading
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
    pinned = cupyx.empty_pinned((rows, pitch), np.uint8)
    registered = np.ones((rows, pitch), np.uint8)
    rt.hostRegister(registered.ctypes.data, registered.nbytes, 0)
    pinned[...] = 1
    dev = cupy.empty((rows, width), np.uint8)
    dev2 = cupy.empty((rows, width), np.uint8)
    a = cupy.ones((8192, 8192), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    other = cupy.cuda.Stream(non_blocking=True)
    with stream:
        a @ a  # cuBLAS's start-up, off the timing
    stream.synchronize()
    d2h, h2d = rt.memcpyDeviceToHost, rt.memcpyHostToDevice

    def ways(host):
        hp = host.ctypes.data
        return {
            "1-D device to host": lambda s: rt.memcpyAsync(hp, dev.data.ptr, rows * width, d2h, s),
            "2-D device to host": lambda s: rt.memcpy2DAsync(hp, pitch, dev.data.ptr, width,
                                                             width, rows, d2h, s),
            "1-D host to device": lambda s: rt.memcpyAsync(dev.data.ptr, hp, rows * width, h2d, s),
            "2-D host to device": lambda s: rt.memcpy2DAsync(dev.data.ptr, width, hp, pitch,
                                                             width, rows, h2d, s),
        }

    def behind_gemms():
        with stream:
            for _ in range(4):
                a @ a  # ~40-50 ms of GEMMs ahead of the copy

    for kind, host in (("empty_pinned", pinned), ("registered", registered)):
        for name, copy in ways(host).items():
            for _ in range(2):
                behind_gemms()
                t0 = time.perf_counter()
                copy(stream.ptr)
                returned = time.perf_counter() - t0
                stream.synchronize()
                queued = time.perf_counter() - t0
                print(f"{kind:12s} {name}: the call returned after {returned * 1e3:7.2f} ms "
                      f"(the stream drained after {queued * 1e3:6.1f} ms)", flush=True)
    # a second thread's independent 1-D copy while the first thread's copy waits
    for kind, host in (("empty_pinned", pinned), ("registered", registered)):
        for name, copy in ways(host).items():
            behind_gemms()
            out = {}

            def second():
                time.sleep(0.002)
                t0 = time.perf_counter()
                rt.memcpyAsync(dev2.data.ptr, pinned.ctypes.data, rows * width, h2d, other.ptr)
                out["returned"] = time.perf_counter() - t0

            th = threading.Thread(target=second)
            t0 = time.perf_counter()
            th.start()
            copy(stream.ptr)
            first = time.perf_counter() - t0
            th.join()
            stream.synchronize()
            other.synchronize()
            print(f"{kind:12s} {name} on thread 1 returned after {first * 1e3:7.2f} ms; "
                  f"thread 2's 1-D copy on another stream returned after "
                  f"{out['returned'] * 1e3:7.2f} ms", flush=True)
    rt.hostUnregister(registered.ctypes.data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
