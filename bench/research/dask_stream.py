"""Where does a block-mode product's time go on a GPU cluster? The task stream, by prefix.

Found with it (bench/NOTES.md, IPC section): on two H100s at fp32 32768 each GPU's block
was cut into 8 cells and 2 k groups whose partials crossed TCP, because the block budget
came from the client's view of a device the workers' memory pools held.

Runs ``distmm.matmul(A, B, client).persist()`` on operands made on the workers (the
``dask-gpu`` benchmark's, chunks ``--chunk``), ``--calls`` times per size, on a fresh
``LocalCUDACluster`` of the setting (``2gpu``: one worker per GPU of ``0,1``; ``1gpu``;
``shared``: two workers on GPU 0). Prints per call: its seconds, the engine's stats (mode,
tasks, cells, units with their blocks, the route and estimated bytes), the bytes the
workers logged by route and by key name, and per (task prefix, action, worker) the count,
summed duration and when the last one ended after the first task started.
``DISTMM_DASK_DEVICE_TRANSFER`` picks the route as for any product.
``--trace`` wraps the block task's parts on the workers (``client.run``; the engine is not
changed) and prints, per worker and from the call's start: when the block task started,
its host seconds opening whole offers (``take``), copying pieces into panels
(``take_into``) and making the panels (``_panel`` for host-side joins, ``_device_panels``
for GPU panels, their copies and one synchronisation included), when its GEMM was queued,
and from CUDA events when the GPU finished the work before the GEMM and the GEMM itself.
``python -m bench.research.dask_stream --setting 2gpu --sizes 16384 32768``
"""
from __future__ import annotations

import argparse
import collections
import json
import time


def _prefix(key) -> str:
    name = key[0] if isinstance(key, tuple) else str(key)
    return name.rsplit("-", 1)[0]


def stream_summary(data) -> list[str]:
    """Lines: per (prefix, action, worker port) the count, summed and last-end seconds."""
    if not data:
        return []
    t0 = min(x["startstops"][0]["start"] for x in data if x["startstops"])
    agg: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for x in data:
        for s in x["startstops"]:
            g = agg[(_prefix(x["key"]), s["action"], x["worker"].rsplit(":", 1)[-1])]
            g[0] += 1
            g[1] += s["stop"] - s["start"]
            g[2] = max(g[2], s["stop"] - t0)
    return [f"   {k}: n={n} total={tot:.3f}s ends_at={end:.3f}s"
            for k, (n, tot, end) in sorted(agg.items(), key=lambda kv: kv[1][2])]


def _install_trace(dask_worker=None):
    """On a worker: wrap ``blocks.block_product``, ``take``, ``take_into``, ``_panel``,
    ``_device_panels`` and ``_gpu_block``
    to record host times and CUDA events into ``blocks._TRACE`` (a list per process)."""
    import time as _t

    import cupy

    from distmm.engine.dask import blocks

    if getattr(blocks, "_TRACE", None) is not None:
        return False
    blocks._TRACE = []
    timed_names = ("take", "take_into", "_panel", "_device_panels")
    orig = {n: getattr(blocks, n) for n in ("block_product", "_gpu_block") + timed_names}
    cur: dict = {}

    def block_product(*args, **kwargs):
        cur.clear()
        cur.update(t_start=_t.time(), **{n.strip("_"): 0.0 for n in timed_names},
                   e0=cupy.cuda.get_current_stream().record())
        out = orig["block_product"](*args, **kwargs)
        cur.update(t_end=_t.time(), e_end=cupy.cuda.get_current_stream().record())
        blocks._TRACE.append(dict(cur))
        return out

    def timed(name):
        def run(*args, **kwargs):
            t0 = _t.perf_counter()
            try:
                return orig[name](*args, **kwargs)
            finally:
                if cur:
                    cur[name.strip("_")] = cur.get(name.strip("_"), 0.0) + _t.perf_counter() - t0
        return run

    def gpu_block(*args, **kwargs):
        cur.update(t_gemm=_t.time(), e_g0=cupy.cuda.get_current_stream().record())
        out = orig["_gpu_block"](*args, **kwargs)
        cur.update(t_gemm_queued=_t.time(), e_g1=cupy.cuda.get_current_stream().record())
        return out

    blocks.block_product = block_product
    for name in timed_names:
        setattr(blocks, name, timed(name))
    blocks._gpu_block = gpu_block
    return True


def _collect_trace(dask_worker=None) -> list:
    """On a worker: the recorded block tasks since the last collection, as plain numbers."""
    import cupy

    from distmm.engine.dask import blocks

    out = []
    for r in getattr(blocks, "_TRACE", None) or []:
        r["e_end"].synchronize()
        ms = cupy.cuda.get_elapsed_time
        row = {k: r[k] for k in ("t_start", "t_end", "take", "take_into", "panel",
                                 "device_panels") if k in r}
        if "e_g0" in r:
            row.update(t_gemm=r["t_gemm"], t_gemm_queued=r["t_gemm_queued"],
                       gpu_before_gemm=ms(r["e0"], r["e_g0"]) / 1e3,
                       gpu_gemm=ms(r["e_g0"], r["e_g1"]) / 1e3)
        out.append(row)
    if getattr(blocks, "_TRACE", None) is not None:
        blocks._TRACE.clear()
    return out


def trace_lines(traces: dict, t0: float) -> list[str]:
    """One line per block task: times from the call's start ``t0`` (seconds)."""
    lines = []
    for worker, rows in sorted(traces.items()):
        for r in rows:
            line = (f"   trace {worker.rsplit(':', 1)[-1]}: start {r['t_start'] - t0:.3f} "
                    f"take {r['take']:.3f}s take_into {r['take_into']:.3f}s panel "
                    f"{r['panel']:.3f}s device_panels {r['device_panels']:.3f}s")
            if "t_gemm" in r:
                line += (f" gemm queued at {r['t_gemm_queued'] - t0:.3f} (entered "
                         f"{r['t_gemm'] - t0:.3f}); GPU: before-gemm {r['gpu_before_gemm']:.3f}s "
                         f"gemm {r['gpu_gemm']:.3f}s, done ~{r['t_start'] - t0 + r['gpu_before_gemm'] + r['gpu_gemm']:.3f}")
            lines.append(line + f"; task returned {r['t_end'] - t0:.3f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.dask_stream",
                                description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=["1gpu", "2gpu", "shared"], default="2gpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--trace", action="store_true")
    args = p.parse_args(argv)

    import distributed

    from bench.dask_gpu import Bench, start_cluster
    from distmm.engine.dask import last_stats, transfer_report

    cluster, what, _gpus, _cpus = start_cluster(args.setting, rehearse=False, cpu_workers=0)
    with cluster, distributed.Client(cluster) as client:
        print(what, flush=True)
        bench = Bench(client, gpu=True, timeout=300)
        if args.trace:
            client.run(_install_trace)
        for n in args.sizes:
            for call in range(args.calls):
                a, b = bench.operands(n, args.chunk, args.dtype)
                if args.trace:
                    client.run(_collect_trace)  # drop what the operands' making left
                since = time.time()
                with distributed.get_task_stream(client) as ts:
                    sec, c = bench.product("distmm-dask", a, b)
                traces = client.run(_collect_trace) if args.trace else {}
                st = last_stats()
                moved = transfer_report(client, since=since)
                keep = {k: st.get(k) for k in ("mode", "tasks", "cells", "moved", "transfer",
                                               "estimated_bytes")}
                keep["units"] = [{k: u.get(k) for k in ("address", "block", "gpu", "share")}
                                 for u in st.get("units", [])]
                print(f"== {args.dtype} n={n} call {call}: {sec:.3f} s", flush=True)
                print(json.dumps(keep, default=str))
                print("routes", moved["device_routes"], "worker_to_worker",
                      moved["worker_to_worker"], "by_name",
                      {k[:40]: v for k, v in moved["by_name"].items()})
                print("\n".join(stream_summary(ts.data)), flush=True)
                if traces:
                    print("\n".join(trace_lines(traces, since)), flush=True)
                del c, a, b
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
