"""Which way of writing one output from P processes is fastest on this machine's disk?

Each way writes ``--gib`` GiB of random bytes, made before the clock starts, in P equal row
ranges, and ends with an ``fsync`` of everything written (the time is the slowest process's,
from a common barrier to its fsync's end):

- ``pwrite``: every process ``os.pwrite``\\ s its range of one file (the batch path's `.npy`);
- ``pwrite-1``: one process writes the whole file (the others hand it nothing: a lower bound
  for one writer per node fed by the others);
- ``mmap``: every process copies its range into a shared mapping of one file, then
  ``msync``/``fsync``;
- ``direct``: ``O_DIRECT`` pwrites of page-aligned pieces into one preallocated file;
- ``direct-1``: one process writes the whole file that way;
- ``span`` / ``span-1``: distmm's own writer (``distmm.direct_io.SpanWriter``: ``O_DIRECT``
  chunks, several in flight) from P processes / from one;
- ``files``: every process writes its own file (what zarr's chunk files get).

``python -m bench.research.write_paths --gib 4 --procs 4 --dir /tmp``
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import time

STEP = 64 << 20


def _buffer(nbytes: int, seed: int):
    import numpy as np

    out = mmap.mmap(-1, nbytes)  # page aligned (O_DIRECT needs it)
    view = np.frombuffer(out, np.uint8)
    view[:] = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return out


def _one(way: str, path: str, i: int, procs: int, nbytes: int, barrier, times):
    part = nbytes // procs
    one = way.endswith("-1")
    buf = _buffer(part if not one else nbytes, i) if (not one or i == 0) else None
    barrier.wait()
    t0 = time.perf_counter()
    if way == "files":
        fd = os.open(f"{path}.{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for s in range(0, part, STEP):
            os.pwrite(fd, memoryview(buf)[s:s + STEP], s)
        os.fsync(fd)
        os.close(fd)
    elif way in ("pwrite", "pwrite-1", "direct", "direct-1"):
        if buf is not None:
            direct = getattr(os, "O_DIRECT", 0) if way.startswith("direct") else 0
            fd = os.open(path, os.O_WRONLY | direct)
            off = 0 if one else i * part
            for s in range(0, len(buf), STEP):
                os.pwrite(fd, memoryview(buf)[s:s + STEP], off + s)
            os.fsync(fd)
            os.close(fd)
    elif way in ("span", "span-1"):
        if buf is not None:
            from distmm.direct_io import SpanWriter
            from distmm.staging import pwrite_all

            fd = os.open(path, os.O_WRONLY)
            w = SpanWriter(path, fd)
            off = 0 if one else i * part
            for s in range(0, len(buf), 8 * STEP):  # 512 MiB spans, as a stripe of C
                w.write(memoryview(buf)[s:s + 8 * STEP], off + s, pwrite_all)
            w.close()
            os.fsync(fd)
            os.close(fd)
    elif way == "mmap":
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, nbytes)
        m[i * part:(i + 1) * part] = buf
        m.flush(i * part, part)
        m.close()
        os.fsync(fd)
        os.close(fd)
    times[i] = time.perf_counter() - t0


def run(way: str, folder: str, procs: int, nbytes: int) -> float:
    path = os.path.join(folder, "distmm-write-paths.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if way.startswith(("direct", "span")):
        os.posix_fallocate(fd, 0, nbytes)
    else:
        os.ftruncate(fd, nbytes)
    os.close(fd)
    ctx = mp.get_context("fork")
    barrier, times = ctx.Barrier(procs), ctx.Array("d", procs)
    ps = [ctx.Process(target=_one, args=(way, path, i, procs, nbytes, barrier, times))
          for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    for f in [path] + [f"{path}.{i}" for i in range(procs)]:
        if os.path.exists(f):
            os.remove(f)
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"{way}: a writer failed")
    return max(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--ways", nargs="+", default=["pwrite-1", "pwrite", "mmap", "direct", "direct-1", "span", "span-1",
                                        "files"])
    args = p.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // (args.procs * 4096) * args.procs * 4096
    for way in args.ways:
        got = []
        for _ in range(args.repeat):
            try:
                got.append(run(way, args.dir, args.procs, nbytes))
            except (OSError, RuntimeError) as exc:
                print(f"{way}: failed ({exc})", flush=True)
                break
        if got:
            print(f"{way:9s} P={args.procs} {nbytes / 2**30:.2f} GiB: "
                  + " ".join(f"{t:.2f}" for t in got) + " s "
                  + f"({nbytes / min(got) / 1e9:.2f} GB/s best)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
