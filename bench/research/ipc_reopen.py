"""Does mapping a CUDA IPC export cost more the second time? A probe for a lead.

The lead (bench/NOTES.md, "Dask engine on 4 GPUs", "The client's plan and the IPC mappings"):
in the first call of a Dask product on 4 GPUs each block task mapped its 10-14 exports in
0.2-0.7 ms each, in the next call (fresh operands, so the holders' memory pool handed the same
allocations out again) in 3-5 ms each, and one worker's first GEMM waited 14 ms for one map.

Two processes of one host: a holder on GPU 0 exports ``--chunks`` arrays of ``--mib`` MiB
(``distmm.executor.ipc.export``, the engine's call); a reader on GPU 1 maps each
(``map_export``), copies it into its own buffer, and ends the mapping, in rounds:

- ``fresh``: the holder's arrays are new allocations (``cudaMalloc`` outside any pool);
- ``again``: the same allocations exported and mapped again after the reader ended the
  previous round's mappings (``unmap`` at once);
- ``again-later``: the same, the previous mappings ended on the closing thread
  (``unmap_later``, as block tasks do);
- ``kept``: the mappings of the first round kept open and mapped again (the driver counts
  references: the same pointer comes back);
- ``holder-busy``: as ``again``, while ``BUSY_GEMMS`` products run on the holder's GPU;
- ``reader-busy``: as ``again``, while they run on the reader's GPU (another stream).

Prints per round the median and largest host milliseconds of one map, and the copies' rate.
``python -m bench.research.ipc_reopen --chunks 8 --mib 256 --rounds 3``
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


BUSY_GEMMS = 20  # 8192^2 float32 products, ~20 ms each on an H100


def _holder(conn, chunks: int, mib: int) -> None:
    import cupy

    from distmm.executor import ipc

    cupy.cuda.Device(0).use()
    n = mib * 2**20 // 4
    keep: list = []
    arrays: list = []
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "fresh" or not keep:
            keep = [cupy.cuda.Memory(n * 4) for _ in range(chunks)]  # outside the pool
            arrays = [cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(m, 0))
                      for m in keep]
            for i, x in enumerate(arrays):
                x.fill(float(i + 1))
            cupy.cuda.runtime.deviceSynchronize()
        shared = [ipc.export(x) for x in arrays]
        if cmd == "holder-busy":  # GEMMs queued on the holder's GPU while the reader maps
            w = cupy.ones((8192, 8192), cupy.float32)
            for _ in range(BUSY_GEMMS):
                w @ w
        conn.send([s for s in shared])
        conn.recv()  # the reader is done with this round
        del shared


def _reader(conn, rounds: list[str], mib: int, out) -> None:
    import cupy

    from distmm.executor import ipc

    cupy.cuda.Device(1).use()
    n = mib * 2**20 // 4
    buf = cupy.empty((n,), cupy.float32)
    kept: list = []
    rows = []
    w = cupy.ones((8192, 8192), cupy.float32)
    for kind in rounds:
        if kind != "kept":  # kept mappings would make every later map a reference count
            for ptrs in kept:
                for ptr in ptrs:
                    ipc.unmap(ptr)
            kept.clear()
        conn.send(kind if kind in ("fresh", "holder-busy") else "again")
        shared = conn.recv()
        if kind == "reader-busy":  # GEMMs queued on the reader's own GPU, on another stream
            with cupy.cuda.Stream(non_blocking=True):
                for _ in range(BUSY_GEMMS):
                    w @ w
        maps, t_copy, ptrs = [], 0.0, []
        for i, s in enumerate(shared):
            t0 = time.perf_counter()
            ptr = ipc.map_export(s)
            t1 = time.perf_counter()
            cupy.cuda.runtime.memcpy(buf.data.ptr, ptr + s.offset, n * 4,
                                     cupy.cuda.runtime.memcpyDefault)
            cupy.cuda.Stream.null.synchronize()  # a device-to-device memcpy returns early
            t2 = time.perf_counter()
            assert float(buf[n // 2]) == float(i + 1), (kind, i)
            maps.append((t1 - t0) * 1e3)
            t_copy += t2 - t1
            ptrs.append(ptr)
        cupy.cuda.runtime.deviceSynchronize()
        if kind == "again-later":
            ipc.unmap_later(ptrs)
            ipc.closing(wait=30)
        elif kind == "kept":
            kept.append(ptrs)  # one reference more, held to the end
        else:
            for ptr in ptrs:
                ipc.unmap(ptr)
        conn.send("done")
        rows.append((kind, statistics.median(maps), max(maps),
                     len(shared) * n * 4 / t_copy / 1e9))
    for ptrs in kept:
        for ptr in ptrs:
            ipc.unmap(ptr)
    conn.send("stop")
    out.put(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.ipc_reopen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    args = p.parse_args(argv)
    order = (["fresh"] + ["again"] * args.rounds + ["fresh"] + ["again-later"] * args.rounds
             + ["fresh", "kept"] + ["kept"] * args.rounds + ["holder-busy"] * args.rounds
             + ["reader-busy"] * args.rounds)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    holder = ctx.Process(target=_holder, args=(a, args.chunks, args.mib))
    reader = ctx.Process(target=_reader, args=(b, order, args.mib, out))
    holder.start()
    reader.start()
    rows = out.get(timeout=300)
    reader.join(60)
    holder.join(60)
    print(f"== {args.chunks} exports of {args.mib} MiB, GPU 0 to GPU 1")
    for i, (kind, med, worst, rate) in enumerate(rows):
        print(f"  round {i:2d} {kind:12s} map median {med:7.3f} ms, largest {worst:7.3f} ms; "
              f"copies {rate:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
