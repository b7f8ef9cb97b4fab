"""How fast does a column slice of page-locked host rows cross to the device?

The rate of host-to-device ``cudaMemcpy2DAsync`` from page-locked memory by row width (a
column slice of a C-contiguous host array, as the pipeline's straight copies of A's k blocks
are), beside one contiguous copy of the same bytes. No record; it informs bench/NOTES.md.

    python -m bench.research.copy2d [--rows 16384] [--pitch 65536]
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.copy2d",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--pitch", type=int, default=65536, help="bytes a host row")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    import cupy
    import cupyx
    rt = cupy.cuda.runtime
    host = cupyx.empty_pinned((args.rows, args.pitch), np.uint8)
    host[...] = 1
    dev = cupy.empty(args.rows * args.pitch, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def rate(issue, nbytes):
        times = []
        for _ in range(args.repeat + 1):
            start.record(stream)
            issue()
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return nbytes / float(np.median(times[1:])) / 1e9

    width = 2048
    while width <= args.pitch:
        nbytes = width * args.rows
        two_d = rate(lambda: rt.memcpy2DAsync(dev.data.ptr, width, host.ctypes.data, args.pitch,
                                              width, args.rows, rt.memcpyHostToDevice,
                                              stream.ptr), nbytes)
        flat = rate(lambda: rt.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,
                                           rt.memcpyHostToDevice, stream.ptr), nbytes)
        print(f"width {width:6d} B x {args.rows} rows ({nbytes / 2**20:6.0f} MiB): "
              f"2-D {two_d:5.1f} GB/s, contiguous {flat:5.1f} GB/s", flush=True)
        width *= 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
