"""Where does a Dask product stand still? Every thread's stack on every worker and the client.

A probe for a lead (bench/NOTES.md, eleventh session): the Dask engine on 4 GPUs as 2
emulated nodes (``gpu_cluster(nodes=2)``) completed no call in 5-8 minutes at fp32 32768 and
65536, with the GPUs idle. This starts that cluster, makes persisted device operands on the
workers, starts ``distmm.matmul`` on a thread, and if it has not finished after ``--wait``
seconds prints every worker's and the client's thread stacks and the scheduler's task states;
it then waits ``--grace`` seconds more and exits (a hang is left to the process's end).
``python -m bench.research.dask_hang --devices 0,1,2,3 --nodes 2 --size 16384``
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import traceback


def _stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)[-12:])
        if "distmm" in stack or "cupy" in stack or "transfer" in stack:
            out.append(f"--- thread {names.get(ident, ident)}\n{stack}")
    return "\n".join(out) or "(no thread in distmm or cupy)"


def _task_states(dask_scheduler=None) -> dict:
    counts = collections.Counter((ts.state, ts.key[0] if isinstance(ts.key, tuple) else
                                  str(ts.key).split("-")[0]) for ts in dask_scheduler.tasks.values())
    return {f"{state} {prefix}": n for (state, prefix), n in sorted(counts.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.dask_hang",
                                description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="0,1,2,3")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--wait", type=float, default=45.0)
    p.add_argument("--grace", type=float, default=5.0)
    args = p.parse_args(argv)
    import distributed

    import distmm
    from distmm.cli.cluster import gpu_cluster, random_array
    from distmm.engine.dask import last_stats

    with gpu_cluster(args.devices, nodes=args.nodes) as cluster, \
            distributed.Client(cluster) as client:
        n, c = args.size, args.chunk
        A = client.persist(random_array((n, n), c, args.dtype, seed=1, gpu=True))
        B = client.persist(random_array((n, n), c, args.dtype, seed=2, gpu=True))
        distributed.wait([A, B])
        print(f"operands ready: {n}^2 {args.dtype}, chunks {c}, {args.nodes} emulated nodes",
              flush=True)
        done = {}

        def call():
            t0 = time.perf_counter()
            try:
                C = client.persist(distmm.matmul(A, B, client=client))
                distributed.wait(C)
                done["seconds"] = time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - reported below
                done["error"] = repr(exc)

        for attempt in range(2):
            done.clear()
            th = threading.Thread(target=call, daemon=True)
            th.start()
            th.join(args.wait)
            if not th.is_alive():
                print(f"call {attempt}: {done}; stats mode {last_stats().get('mode')}, "
                      f"transfer {last_stats().get('transfer', {}).get('pairs')}", flush=True)
                continue
            print(f"call {attempt}: still running after {args.wait} s", flush=True)
            print("== scheduler task states", client.run_on_scheduler(_task_states), flush=True)
            for addr, text in sorted(client.run(_stacks).items()):
                print(f"== worker {addr}\n{text}", flush=True)
            print(f"== client\n{_stacks()}", flush=True)
            time.sleep(args.grace)
            os._exit(3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
