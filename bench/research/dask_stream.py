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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.dask_stream",
                                description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=["1gpu", "2gpu", "shared"], default="2gpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args(argv)

    import distributed

    from bench.dask_gpu import Bench, start_cluster
    from distmm.engine.dask import last_stats, transfer_report

    cluster, what, _gpus, _cpus = start_cluster(args.setting, rehearse=False, cpu_workers=0)
    with cluster, distributed.Client(cluster) as client:
        print(what, flush=True)
        bench = Bench(client, gpu=True, timeout=300)
        for n in args.sizes:
            for call in range(args.calls):
                a, b = bench.operands(n, args.chunk, args.dtype)
                since = time.time()
                with distributed.get_task_stream(client) as ts:
                    sec, c = bench.product("distmm-dask", a, b)
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
                del c, a, b
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
