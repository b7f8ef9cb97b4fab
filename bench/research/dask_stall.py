"""Where does a Dask-engine product on N GPU workers stall? Run it with a deadline and, when
the deadline passes, print what every worker is doing (its running tasks' stacks, the
offers its export tasks published, its task states) and the scheduler's view.

    python -m bench.research.dask_stall --gpus 4 --size 65536 --deadline 60
    python -m bench.research.dask_stall --gpus 4 --nodes 2 --size 3000 --chunk 700 --dtype float64

Seen on 4 x H100 (bench/NOTES.md, "Dask engine on 4 GPUs"): fp32 65536 with chunks of 8192
stalled (no call finished in 5 minutes), as did tests/test_emulate_gpu.py's 3000 x 2500
product with chunks of 700 on 2 emulated nodes; fp32 16384 with chunks of 8192 did not
(1.18 s, then 0.16 s).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter


def _worker_state(dask_worker):
    from distmm.engine.dask import pull

    with pull._LOCK:
        offers = sorted(map(str, pull._OFFERS))
    states = Counter(ts.state for ts in dask_worker.state.tasks.values())
    executing = [str(ts.key) for ts in dask_worker.state.tasks.values() if ts.state in
                 ("executing", "long-running")]
    waiting = [str(ts.key) for ts in dask_worker.state.tasks.values() if ts.state in
               ("waiting", "ready", "constrained", "fetch", "flight")][:12]
    import sys
    import traceback

    ex = dask_worker.executors.get("default")
    pool = {"threads": len(getattr(ex, "_threads", ())),
            "rejoining": len(getattr(ex, "_rejoin_list", ())),
            "queued": getattr(getattr(ex, "_work_queue", None), "qsize", lambda: -1)()}
    stacks = {}
    for tid, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame)[-8:])
        if "distmm" in text or ("threadpoolexecutor" in text and "work_queue.get" not in text):
            stacks[tid] = text
    return {"offers": offers[:20], "n_offers": len(offers), "states": dict(states),
            "executing": executing, "waiting": waiting, "status": str(dask_worker.status),
            "nthreads": dask_worker.state.nthreads, "pool": pool,
            "long_running": [str(ts.key) for ts in dask_worker.state.long_running][:12],
            "stacks": stacks}


def _scheduler_state(dask_scheduler):
    states = Counter(ts.state for ts in dask_scheduler.tasks.values())
    unrunnable = [str(k) for k, ts in dask_scheduler.tasks.items() if ts.state == "no-worker"]
    queued = [str(ts.key) for ts in list(dask_scheduler.queued)[:10]]
    return {"states": dict(states), "no-worker": unrunnable[:10], "queued": queued}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--deadline", type=float, default=45)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--nodes", type=int, default=1, help="the GPUs as that many emulated nodes")
    p.add_argument("--cpu", action="store_true", help="CPU workers (a check of this probe)")
    args = p.parse_args(argv)

    from distributed import Client, wait

    import distmm
    from distmm.cli.cluster import cpu_cluster, gpu_cluster, random_array, sync_workers

    gpu = not args.cpu
    cluster = (gpu_cluster(",".join(map(str, range(args.gpus))), nodes=args.nodes) if gpu
               else cpu_cluster(args.gpus, nodes=args.nodes))
    with cluster, Client(cluster) as client:
        client.wait_for_workers(args.gpus, timeout=120)
        n = args.size
        a = random_array((n, n), args.chunk, args.dtype, seed=1, gpu=gpu).persist()
        b = random_array((n, n), args.chunk, args.dtype, seed=2, gpu=gpu).persist()
        wait([a, b])
        for call in range(args.calls):
            t0 = time.perf_counter()
            out = distmm.matmul(a, b, engine="dask", client=client).persist()
            try:
                wait(out, timeout=args.deadline)
                if gpu:
                    sync_workers(client)
                print(f"call {call}: {time.perf_counter() - t0:.3f} s", flush=True)
                del out
                continue
            except Exception as exc:  # the deadline passed
                print(f"call {call}: STALLED after {args.deadline} s ({type(exc).__name__})")
            print("scheduler:", client.run_on_scheduler(_scheduler_state))
            for addr, state in client.run(_worker_state).items():
                stacks = state.pop("stacks", {})
                print("worker", addr, state)
                for tid, text in stacks.items():
                    print(f"  thread {tid}:\n{text}")
            stacks = client.call_stack()
            for addr, tasks in stacks.items():
                for key, frames in tasks.items():
                    print(f"--- {addr} running {key}")
                    print("".join(frames[-12:]) if isinstance(frames, list) else frames)
            print("distmm stats:", distmm.last_stats() if hasattr(distmm, "last_stats") else "")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
