"""Do copies into device memory just allocated run slower than into memory used before?

The stream pipeline's traces (bench/NOTES.md, "Host-resident bfloat16 in the stream pipeline")
show every copy of a call's first ~20 ms at 26-29 GB/s and later ones at 50-55, while trains of
copies into buffers used before run at 54 GB/s from their start (``link_ramp``). Each pipeline
call allocates its device buffers (~7 GiB at 32768 bf16) from a fresh pool and frees them at
its end. This probe copies 16 MiB pieces from page-locked memory over the whole of a new
allocation and times each with events: into memory just allocated, into the same memory again,
after freeing and allocating again, after a device memset of the new memory, and after the GPU
idles a while; device-to-host too. No record; it informs bench/NOTES.md.

    python -m bench.research.fresh_memory [--gib 7] [--idle 0.05 0.2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

PIECE = 16 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.fresh_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=7.0, help="GiB a new allocation")
    p.add_argument("--idle", type=float, nargs="*", default=[0.05, 0.2],
                   help="seconds the GPU idles after an allocation before its copies")
    args = p.parse_args(argv)
    import cupy
    import cupyx

    rt = cupy.cuda.runtime
    nbytes = int(args.gib * (1 << 30)) // PIECE * PIECE
    pieces = nbytes // PIECE
    host = cupyx.empty_pinned((64, PIECE), np.uint8)  # 1 GiB of sources, cycled
    host[...] = 1
    stream = cupy.cuda.Stream(non_blocking=True)

    def train(ptr: int, d2h: bool = False) -> np.ndarray:
        events = [cupy.cuda.Event() for _ in range(pieces + 1)]
        events[0].record(stream)
        kind = rt.memcpyDeviceToHost if d2h else rt.memcpyHostToDevice
        for i in range(pieces):
            h, d = host[i % 64].ctypes.data, ptr + i * PIECE
            rt.memcpyAsync(h if d2h else d, d if d2h else h, PIECE, kind, stream.ptr)
            events[i + 1].record(stream)
        events[-1].synchronize()
        return np.array([cupy.cuda.get_elapsed_time(events[i], events[i + 1])
                         for i in range(pieces)])

    def report(label: str, ms: np.ndarray) -> None:
        t = np.cumsum(ms)
        rate = PIECE / (ms * 1e6)
        first = rate[t <= 20.0]
        print(f"{label:34s}: first 20 ms {np.mean(first):5.1f} GB/s ({len(first)} copies), "
              f"after {np.median(rate[t > 20.0]):5.1f}, whole {nbytes / t[-1] / 1e6:5.1f} GB/s "
              f"({t[-1]:6.1f} ms); slow copies (< 40 GB/s) {int(np.sum(rate < 40))} of {pieces}",
              flush=True)

    def fresh(pool):
        t0 = time.perf_counter()
        mem = pool.malloc(nbytes)
        return mem, (time.perf_counter() - t0) * 1e3

    train_warm = cupy.empty(PIECE * 2, np.uint8)  # the stream's and the copy path's first use
    rt.memcpyAsync(train_warm.data.ptr, host[0].ctypes.data, PIECE, rt.memcpyHostToDevice,
                   stream.ptr)
    stream.synchronize()

    pool = cupy.cuda.MemoryPool()
    mem, t_alloc = fresh(pool)
    report(f"fresh (malloc {t_alloc:.1f} ms)", train(mem.ptr))
    report("same memory again", train(mem.ptr))
    report("same memory, device to host", train(mem.ptr, d2h=True))
    t0 = time.perf_counter()
    del mem
    pool.free_all_blocks()
    t_free = (time.perf_counter() - t0) * 1e3
    mem, t_alloc = fresh(pool)
    report(f"freed ({t_free:.1f} ms), fresh again ({t_alloc:.1f})", train(mem.ptr))
    del mem
    pool.free_all_blocks()
    mem, t_alloc = fresh(pool)
    report(f"fresh ({t_alloc:.1f} ms), device to host", train(mem.ptr, d2h=True))
    del mem
    pool.free_all_blocks()
    mem, t_alloc = fresh(pool)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(stream)
    rt.memsetAsync(mem.ptr, 0, nbytes, stream.ptr)
    e1.record(stream)
    e1.synchronize()
    report(f"fresh, memset first ({cupy.cuda.get_elapsed_time(e0, e1):.1f} ms)", train(mem.ptr))
    for idle in args.idle:
        del mem
        pool.free_all_blocks()
        mem, t_alloc = fresh(pool)
        time.sleep(idle)
        report(f"fresh, {idle * 1e3:.0f} ms idle first", train(mem.ptr))
    del mem
    pool.free_all_blocks()
    # a pool kept across calls: blocks freed to the pool, not the driver, then taken again
    mem = pool.malloc(nbytes)
    del mem
    mem, t_alloc = fresh(pool)
    report(f"from the pool cache, untouched ({t_alloc:.2f} ms)", train(mem.ptr))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
