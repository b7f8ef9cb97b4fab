"""What do the CUDA IPC primitives cost on this machine? Host seconds per call, two processes.

Prints, for ``--mib`` MiB exports on GPU 0 (``--peer-device`` for the reader): in the
exporter, ``cudaMalloc`` (a ``cupy.cuda.Memory``), the copy into it with its sync,
``cudaIpcGetMemHandle``, and ``cudaFree`` with the device idle and with a GEMM queued on
it; in the reader (another process), ``cudaIpcOpenMemHandle`` and ``cudaIpcCloseMemHandle``
of a handle never opened there before and of one it opened before. Medians of ``--reps``.
``python -m bench.research.ipc_costs --mib 256``
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _median_ms(xs) -> str:
    return f"{1e3 * statistics.median(xs):.3f} ms"


def _reader(q_in, q_out, device: int):
    import cupy

    cupy.cuda.Device(device).use()
    rt = cupy.cuda.runtime
    opens, closes, reopen = [], [], []
    while True:
        msg = q_in.get()
        if msg is None:
            break
        handle, again = msg
        t0 = time.perf_counter()
        ptr = rt.ipcOpenMemHandle(handle, 1)
        t1 = time.perf_counter()
        rt.ipcCloseMemHandle(ptr)
        t2 = time.perf_counter()
        (reopen if again else opens).append(t1 - t0)
        closes.append(t2 - t1)
        q_out.put(True)
    q_out.put({"open (new handle)": opens, "open (handle opened before)": reopen,
               "close": closes})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.ipc_costs",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--peer-device", type=int, default=0)
    args = p.parse_args(argv)

    import cupy

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(q_in, q_out, args.peer_device))
    proc.start()
    nbytes = args.mib << 20
    src = cupy.ones(nbytes // 4, cupy.float32)
    x = cupy.ones((8192, 8192), cupy.float32)
    rt = cupy.cuda.runtime
    res: dict = {"malloc": [], "copy+sync": [], "getMemHandle": [], "free (idle)": [],
                 "free (GEMM queued)": [], "GEMM alone": []}
    cupy.cuda.Device().synchronize()
    handles = []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        mem = cupy.cuda.Memory(nbytes)
        t1 = time.perf_counter()
        rt.memcpyAsync(mem.ptr, src.data.ptr, nbytes, 3, cupy.cuda.get_current_stream().ptr)
        cupy.cuda.get_current_stream().synchronize()
        t2 = time.perf_counter()
        h = bytes(rt.ipcGetMemHandle(mem.ptr))
        t3 = time.perf_counter()
        res["malloc"].append(t1 - t0)
        res["copy+sync"].append(t2 - t1)
        res["getMemHandle"].append(t3 - t2)
        q_in.put((h, False))
        q_out.get()
        q_in.put((h, True))
        q_out.get()
        handles.append(h)
        t0 = time.perf_counter()
        if rep % 2:
            del mem
            res["free (idle)"].append(time.perf_counter() - t0)
        else:
            y = x @ x
            t0 = time.perf_counter()
            del mem
            res["free (GEMM queued)"].append(time.perf_counter() - t0)
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            y = x @ x
            cupy.cuda.Device().synchronize()
            res["GEMM alone"].append(time.perf_counter() - t0)
            del y
    q_in.put(None)
    res.update(q_out.get())
    proc.join()
    print(f"{args.mib} MiB, GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"reader on device {args.peer_device}:")
    for k, v in res.items():
        if v:
            print(f"  {k:28s} {_median_ms(v)}  (n={len(v)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
