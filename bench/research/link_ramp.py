"""Do host-to-device copies run slower for their first milliseconds after the GPU idles?

The stream pipeline's traces (bench/NOTES.md, "Host-resident bfloat16 in the stream pipeline")
show every copy of a call's first ~20 ms at 26-29 GB/s and later ones at 50-55. This probe
queues back-to-back copies of 16 MiB from page-locked memory after the GPU has idled for a
while, times each with events, and prints the rate in the first milliseconds and after; also
with a short kernel, or a small copy, issued just before. No record; it informs bench/NOTES.md.

    python -m bench.research.link_ramp [--idle 0 0.02 0.2 1] [--chunks 96]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.link_ramp",
                                description=__doc__.splitlines()[0])
    p.add_argument("--idle", type=float, nargs="+", default=[0.0, 0.02, 0.2, 1.0],
                   help="seconds the GPU idles before each train of copies")
    p.add_argument("--chunks", type=int, default=96, help="16 MiB copies a train")
    p.add_argument("--d2h", action="store_true", help="device-to-host copies instead")
    args = p.parse_args(argv)
    import cupy
    import cupyx

    rt = cupy.cuda.runtime
    size = 16 << 20
    host = cupyx.empty_pinned((args.chunks, size), np.uint8)
    host[...] = 1
    dev = cupy.empty((args.chunks, size), np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    kind = rt.memcpyDeviceToHost if args.d2h else rt.memcpyHostToDevice

    def train():
        events = [cupy.cuda.Event() for _ in range(args.chunks + 1)]
        events[0].record(stream)
        for i in range(args.chunks):
            dst, src = ((host[i].ctypes.data, dev[i].data.ptr) if args.d2h
                        else (dev[i].data.ptr, host[i].ctypes.data))
            rt.memcpyAsync(dst, src, size, kind, stream.ptr)
            events[i + 1].record(stream)
        events[-1].synchronize()
        ms = [cupy.cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(args.chunks)]
        return np.array(ms)

    train()  # the first use of every buffer
    for idle in args.idle:
        for label in ("alone", "after a 1 MiB copy"):
            stream.synchronize()
            time.sleep(idle)
            if label != "alone":
                rt.memcpyAsync(dev[0].data.ptr, host[0].ctypes.data, 1 << 20, kind, stream.ptr)
            ms = train()
            t = np.cumsum(ms)
            rate = size / (ms * 1e6)
            first = rate[t <= 20.0]
            later = rate[t > 20.0]
            print(f"idle {idle:5.2f} s, {label:19s}: first 20 ms {np.mean(first):5.1f} GB/s "
                  f"({len(first)} copies; first copy {rate[0]:5.1f}), after {np.median(later):5.1f} "
                  f"GB/s; 20 ms in at copy {int(np.searchsorted(t, 20.0))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
