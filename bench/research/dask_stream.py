"""Where does a block-mode product's time go on a GPU cluster? The task stream, by prefix.

What it found is in bench/NOTES.md, "Dask engine on GPU workers" (the per-GPU block
budget, the pulled offers, the mixed cluster's client time).

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
its host seconds fetching pulled offers from their holders (``pull``), opening whole
offers (``take``), mapping exports (``map``) and ending mappings inside the task (``unmap``;
those ended on ``ipc``'s closing thread print as ``close``, outside the tasks), copying
pieces into panels (``take_into``) and making the panels (``_panel`` for host-side joins, ``_device_panels``
for GPU panels, their copies and one synchronisation included), when its GEMM was queued,
and from CUDA events when the GPU finished the work before the GEMM and the GEMM itself,
and, per k piece of an overlapped block, its panel copies and its GEMM (``piece_summary``).
Every call also prints when the scheduler received the graph (its update-graph metrics) and,
per task prefix, when the scheduler dispatched the first task and the workers received and
began it (``dispatch_lines``). Every call also prints the seconds of the engine's client-side steps (``install_client_phases``:
the cluster's state, the worker probe, the IPC probe, the plugin, the plan, the graph).
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


def stream_summary(data, t0: float | None = None) -> list[str]:
    """Lines: per (prefix, action, worker port) the count, summed seconds, and when the
    first began and the last ended, from ``t0`` (default: the first task's start)."""
    if not data:
        return []
    if t0 is None:
        t0 = min(x["startstops"][0]["start"] for x in data if x["startstops"])
    agg: dict = collections.defaultdict(lambda: [0, 0.0, float("inf"), 0.0])
    for x in data:
        for s in x["startstops"]:
            g = agg[(_prefix(x["key"]), s["action"], x["worker"].rsplit(":", 1)[-1])]
            g[0] += 1
            g[1] += s["stop"] - s["start"]
            g[2] = min(g[2], s["start"] - t0)
            g[3] = max(g[3], s["stop"] - t0)
    return [f"   {k}: n={n} total={tot:.3f}s first_start={first:.3f}s last_end={end:.3f}s"
            for k, (n, tot, first, end) in sorted(agg.items(), key=lambda kv: kv[1][3])]


def _install_trace(dask_worker=None):
    """On a worker: wrap ``blocks.block_product``, ``take``, ``take_into``, ``panel``,
    ``_device_panels`` and ``_gpu_block``
    to record host times and CUDA events into ``blocks._TRACE`` (a list per process)."""
    import time as _t

    import cupy

    from distmm.engine.dask import blocks

    if getattr(blocks, "_TRACE", None) is not None:
        return False
    blocks._TRACE = []
    timed_names = ("take", "take_into", "panel", "_device_panels", "_assemble")
    orig = {n: getattr(blocks, n) for n in ("block_product", "_gpu_block", "_overlapped_block")
            + timed_names}
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

    def gemm_of(name):  # the GEMM part: _gpu_block, or all of _overlapped_block (its copies too)
        def run(*args, **kwargs):
            cur.update(t_gemm=_t.time(), e_g0=cupy.cuda.get_current_stream().record())
            out = orig[name](*args, **kwargs)
            cur.update(t_gemm_queued=_t.time(), e_g1=cupy.cuda.get_current_stream().record())
            return out
        return run

    blocks.block_product = block_product
    for name in timed_names:
        setattr(blocks, name, timed(name))
    blocks._gpu_block = gemm_of("_gpu_block")
    blocks._overlapped_block = gemm_of("_overlapped_block")

    # per k piece inside _overlapped_block: CUDA events around each panel assembly (on the
    # copy stream, current while it runs) and each GEMM (on the compute stream)
    assemble = blocks._assemble

    def assemble_evented(*args, **kwargs):
        s = cupy.cuda.get_current_stream()
        e0 = s.record()
        out = assemble(*args, **kwargs)
        if cur:
            cur.setdefault("pieces", []).append(("copy", e0, s.record()))
        return out

    blocks._assemble = assemble_evented
    executor_of = blocks._gpu_executor

    class _Evented:
        def __init__(self, ex):
            self._ex = ex

        def __getattr__(self, name):
            return getattr(self._ex, name)

        def device_gemm(self, *args, **kwargs):
            s = cupy.cuda.get_current_stream()
            e0 = s.record()
            out = self._ex.device_gemm(*args, **kwargs)
            if cur:
                cur.setdefault("pieces", []).append(("gemm", e0, s.record()))
            return out

    blocks._gpu_executor = lambda *a, **k: _Evented(executor_of(*a, **k))

    from distmm.engine.dask import transfer
    from distmm.executor import ipc

    blocks._XTRACE = []  # (what, wall start, host seconds) outside block tasks

    def outside(what, fn):
        def run(*args, **kwargs):
            t0, p0 = _t.time(), _t.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                blocks._XTRACE.append((what, t0, _t.perf_counter() - p0))
        return run

    transfer.export_chunk = outside("export", transfer.export_chunk)
    ipc.release = outside("release", ipc.release)
    ipc.map_export = timed_into(cur, "map_export", ipc.map_export)
    in_task, closing = timed_into(cur, "unmap", ipc.unmap), outside("close", ipc.unmap)

    def unmap(*args, **kwargs):  # ended on ipc's closing thread: outside any block task
        import threading

        closer = threading.current_thread().name == "distmm-ipc-close"
        return (closing if closer else in_task)(*args, **kwargs)

    ipc.unmap = unmap
    from distmm.engine.dask import pull

    pull.resolve = timed_into(cur, "pull", pull.resolve)
    return True


def _scheduler_times(since: float, dask_scheduler=None) -> dict:
    """On the scheduler: per task prefix, when (seconds after ``since``) its first task
    entered the scheduler and its first went to ``processing`` (sent to a worker), from the
    transition log."""
    out: dict = {}
    for t in list(dask_scheduler.transition_log):
        key, start, finish, stamp = t[0], t[1], t[2], t[-1]
        if stamp < since:
            continue
        row = out.setdefault(_prefix(key), {})
        row.setdefault("seen", stamp - since)
        if finish == "processing":
            row.setdefault("processing", stamp - since)
    return out


def _worker_times(since: float, dask_worker=None) -> dict:
    """On a worker: per task prefix, when (seconds after ``since``) its first
    ``compute-task`` arrived and when its first task began to run, from the worker's log."""
    out: dict = {}
    for t in list(dask_worker.state.log):
        stamp = t[-1]
        if not isinstance(stamp, float) or stamp < since or not isinstance(t[0], (str, tuple)):
            continue
        row = out.setdefault(_prefix(t[0]), {})
        if t[1] == "compute-task":
            row.setdefault("received", stamp - since)
        elif len(t) > 3 and t[3] == "executing":
            row.setdefault("executing", stamp - since)
    return out


def dispatch_lines(client, since: float) -> list[str]:
    """The scheduler's update-graph metrics (materialisation, ordering, task states) and,
    per task prefix, when the scheduler saw and dispatched its first task and when the
    workers received and began it, in seconds after ``since``."""
    lines = []
    for stamp, ev in client.get_events("scheduler"):
        if stamp >= since and isinstance(ev, dict) and ev.get("action") == "update-graph":
            m = ev.get("metrics") or {}
            lines.append("   update-graph: start {:.4f}s, materialise {:.4f}s, order {:.4f}s, "
                         "states {:.4f}s, {} tasks".format(
                             m.get("start_timestamp_seconds", since) - since,
                             m.get("materialization_duration_seconds", float("nan")),
                             -m.get("ordering_duration_seconds", float("nan")),
                             -m.get("state_initialization_duration_seconds", float("nan")),
                             m.get("tasks", m.get("new_tasks", "?"))))
    sched = client.run_on_scheduler(_scheduler_times, since)
    workers = client.run(_worker_times, since)
    for prefix in sorted(sched, key=lambda p: sched[p].get("seen", 0)):
        if not prefix.startswith("distmm"):
            continue
        got = [w[prefix] for w in workers.values() if prefix in w]
        rec = [g["received"] for g in got if "received" in g]
        run = [g["executing"] for g in got if "executing" in g]
        lines.append(f"   dispatch {prefix}: scheduler saw {sched[prefix].get('seen', float('nan')):.4f}s"
                     f" sent {sched[prefix].get('processing', float('nan')):.4f}s; workers received "
                     f"{min(rec, default=float('nan')):.4f}-{max(rec, default=float('nan')):.4f}s"
                     f" began {min(run, default=float('nan')):.4f}-{max(run, default=float('nan')):.4f}s")
    return lines


def timed_into(cur: dict, name: str, fn):
    """``fn`` whose host seconds and calls add to ``cur[name]`` and ``cur[name + '_n']``
    while a block task is traced."""
    import time as _t

    def run(*args, **kwargs):
        t0 = _t.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if cur:
                cur[name] = cur.get(name, 0.0) + _t.perf_counter() - t0
                cur[name + "_n"] = cur.get(name + "_n", 0) + 1
    return run


def _collect_trace(dask_worker=None) -> list:
    """On a worker: the recorded block tasks since the last collection, as plain numbers."""
    import cupy

    from distmm.engine.dask import blocks

    out = []
    for r in getattr(blocks, "_TRACE", None) or []:
        r["e_end"].synchronize()
        ms = cupy.cuda.get_elapsed_time
        row = {k: r[k] for k in ("t_start", "t_end", "take", "take_into", "panel",
                                 "device_panels", "assemble", "map_export", "map_export_n", "unmap",
                                 "unmap_n", "pull") if k in r}
        if "e_g0" in r:
            row.update(t_gemm=r["t_gemm"], t_gemm_queued=r["t_gemm_queued"],
                       gpu_before_gemm=ms(r["e0"], r["e_g0"]) / 1e3,
                       gpu_gemm=ms(r["e_g0"], r["e_g1"]) / 1e3)
        if r.get("pieces"):  # (kind, start, end) in ms from the block task's first event
            row["pieces"] = [(kind, ms(r["e0"], a), ms(r["e0"], b)) for kind, a, b in r["pieces"]]
        out.append(row)
    if getattr(blocks, "_TRACE", None) is not None:
        blocks._TRACE.clear()
    for what, t, sec in getattr(blocks, "_XTRACE", None) or []:
        out.append({"what": what, "t": t, "seconds": sec})
    if getattr(blocks, "_XTRACE", None) is not None:
        blocks._XTRACE.clear()
    return out


def trace_lines(traces: dict, t0: float) -> list[str]:
    """One line per block task: times from the call's start ``t0`` (seconds)."""
    lines = []
    for worker, rows in sorted(traces.items()):
        port = worker.rsplit(":", 1)[-1]
        other = [r for r in rows if "what" in r]
        for what in sorted({r["what"] for r in other}):
            got = [r for r in other if r["what"] == what]
            lines.append(f"   trace {port}: {what} n={len(got)} host "
                         f"{sum(r['seconds'] for r in got):.4f}s, from "
                         f"{min(r['t'] for r in got) - t0:.3f} to "
                         f"{max(r['t'] + r['seconds'] for r in got) - t0:.3f}")
        for r in rows:
            if "what" in r:
                continue
            line = (f"   trace {worker.rsplit(':', 1)[-1]}: start {r['t_start'] - t0:.3f} "
                    f"pull {r.get('pull', 0):.4f}s "
                    f"take {r['take']:.3f}s take_into {r['take_into']:.3f}s panel "
                    f"{r['panel']:.3f}s device_panels {r['device_panels']:.3f}s assemble "
                    f"{r.get('assemble', 0):.3f}s map "
                    f"{r.get('map_export', 0):.4f}s/{r.get('map_export_n', 0)} unmap "
                    f"{r.get('unmap', 0):.4f}s/{r.get('unmap_n', 0)}")
            if "t_gemm" in r:
                line += (f" gemm queued at {r['t_gemm_queued'] - t0:.3f} (entered "
                         f"{r['t_gemm'] - t0:.3f}); GPU: before-gemm {r['gpu_before_gemm']:.3f}s "
                         f"gemm {r['gpu_gemm']:.3f}s, done ~{r['t_start'] - t0 + r['gpu_before_gemm'] + r['gpu_gemm']:.3f}")
            lines.append(line + f"; task returned {r['t_end'] - t0:.3f}")
            if r.get("pieces"):
                lines.append(f"   trace {port}: " + piece_summary(r["pieces"]))
    return lines


def piece_summary(pieces) -> str:
    """One line over a block's k pieces (GPU milliseconds from the task's first event):
    when the first GEMM started, the GEMMs' summed time, the compute stream's idle gaps
    between them, each piece's copy and GEMM spans."""
    gemms = [(a, b) for kind, a, b in pieces if kind == "gemm"]
    copies = [(a, b) for kind, a, b in pieces if kind == "copy"]
    if not gemms:
        return "pieces: no GEMM recorded"
    busy = sum(b - a for a, b in gemms)
    gaps = sum(max(0.0, a1 - b0) for (_, b0), (a1, _) in zip(gemms, gemms[1:]))
    spans = " ".join(f"[{kind} {a:.1f}-{b:.1f}]" for kind, a, b in pieces)
    return (f"pieces: first GEMM at {gemms[0][0]:.1f} ms, GEMMs {busy:.1f} ms, gaps "
            f"{gaps:.1f} ms, last GEMM end {gemms[-1][1]:.1f} ms, copies "
            f"{sum(b - a for a, b in copies):.1f} ms; {spans}")


_CLIENT_PHASES = (("distmm.engine.dask.placement", "cluster_state"),
                  ("distmm.engine.dask.workers", "_probes"),
                  ("distmm.engine.dask.transfer", "probe"),
                  ("distmm.engine.dask.transfer", "ensure_lifetime"),
                  ("distmm.engine.dask", "plan_blocks"),
                  ("distmm.engine.dask.lazy", "lazy_blocks"))


def install_client_phases() -> dict:
    """Wrap the engine's client-side steps (the cluster's state, the worker probe, the IPC
    probe, the exports' plugin, the block plan, the graph) so that each call's seconds in
    each add up in the returned dict (cleared by the caller between calls)."""
    import importlib

    spent: dict = {}
    for mod_name, name in _CLIENT_PHASES:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name)

        def run(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0

        setattr(mod, name, run)
    return spent


def profile_scheduler(top: int = 30) -> None:
    """Profile (cProfile) the first graph the in-process scheduler deserialises and
    materialises, and print its ``top`` functions by cumulative time."""
    import cProfile
    import io
    import pstats

    import distributed.scheduler as sched

    done = []

    def wrap(name):
        fn = getattr(sched, name)

        def run(*args, **kwargs):
            if done.count(name):
                return fn(*args, **kwargs)
            done.append(name)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            try:
                return prof.runcall(fn, *args, **kwargs)
            finally:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
                print(f"== scheduler {name}: {time.perf_counter() - t0:.4f} s\n"
                      + "\n".join(out.getvalue().splitlines()[:top + 12]), flush=True)
        setattr(sched, name, run)

    for name in ("deserialize", "_materialize_graph"):
        wrap(name)


#: innermost frames of a thread that waits for work (a pool's queue, a lock, the loop's poll)
_IDLE = frozenset({"wait", "_worker", "select", "poll", "get", "acquire", "sleep",
                   "_wait_for_tstate_lock", "run_forever", "_run_once", "_recv"})


class ThreadSampler:
    """Every ``interval`` seconds, the innermost frames of each thread of this process (the
    client, and the scheduler of a local cluster), while in a ``with`` block; ``lines`` gives,
    per thread, its most frequent stacks between two times (``time.time()``)."""

    def __init__(self, interval: float = 0.002, depth: int = 4):
        self.interval, self.depth, self.samples = interval, depth, []
        self._stop = None

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dask-stream-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        import sys
        import threading
        import traceback

        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.time()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-self.depth:]
                where = " < ".join(f"{f.name}({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                                   for f in reversed(stack))
                self.samples.append((now, names.get(ident, str(ident)), where))

    def lines(self, start: float, end: float, top: int = 4) -> list[str]:
        counts: dict = collections.defaultdict(collections.Counter)
        for t, name, where in self.samples:
            if start <= t <= end:
                counts[name][where] += 1
        out = [f"   sampled {start:.3f}-{end:.3f} every {self.interval * 1e3:.0f} ms:"]
        for name, c in sorted(counts.items()):
            for where, n in c.most_common(top):
                if where.split("(", 1)[0] in _IDLE:
                    continue  # a thread waiting for work
                out.append(f"     {name}: {n} x {where[:240]}")
        return out


#: the sampler a worker runs during a call (``--sample-workers``), set by ``_start_sampler``
_WORKER_SAMPLER: list = []


def _start_sampler(dask_worker=None):
    """On a worker: sample its threads (its event loop, the task threads, distmm's own) from
    now until ``_stop_sampler``."""
    sampler = ThreadSampler()
    sampler.__enter__()
    _WORKER_SAMPLER[:] = [sampler]


def _stop_sampler(start: float, end: float, dask_worker=None) -> list:
    """On a worker: stop its sampler and return what its threads did between two times."""
    if not _WORKER_SAMPLER:
        return []
    sampler = _WORKER_SAMPLER.pop()
    sampler.__exit__(None, None, None)
    return sampler.lines(start, end, top=6)


def worker_sample_lines(samples: dict) -> list:
    """``client.run(_stop_sampler, ...)``'s answers as lines, one block per worker."""
    out = []
    for address, lines in sorted(samples.items()):
        out.append(f"   worker {address}:")
        out += [f"  {line}" for line in lines[1:]] or ["     (nothing but waiting)"]
    return out


def phased_product(bench, a, b):
    """``bench.product("distmm-dask", a, b)`` with its client-side phases: building the
    lazy product (``distmm.matmul``), ``persist``, waiting for C, the device sync."""
    from distributed import wait

    import distmm
    from bench.common import sync_workers

    t0 = time.perf_counter()
    lazy = distmm.matmul(a, b, client=bench.client)
    t1 = time.perf_counter()
    c = lazy.persist()
    t2 = time.perf_counter()
    wait(c, timeout=bench.timeout)
    t3 = time.perf_counter()
    sync_workers(bench.client, bench.gpu_addrs)
    t4 = time.perf_counter()
    return t4 - t0, c, {"build": t1 - t0, "persist": t2 - t1, "wait": t3 - t2, "sync": t4 - t3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.dask_stream",
                                description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=["1gpu", "2gpu", "4gpu", "shared", "mixed"], default="2gpu")
    p.add_argument("--cpu-workers", type=int, default=15, help="CPU workers of the mixed setting")
    p.add_argument("--protocol", choices=["auto", "ucx", "tcp"], default="auto")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--sample", action="store_true",
                   help="sample this process's threads (client, local scheduler) every 2 ms "
                        "and print what they did until each call's first task began")
    p.add_argument("--sample-workers", action="store_true",
                   help="sample every worker's threads every 2 ms during each call and print "
                        "what they did (their event loops included: what holds a new "
                        "cluster's workers in its first call?)")
    p.add_argument("--profile-scheduler", action="store_true",
                   help="profile the scheduler's graph deserialisation and materialisation of "
                        "the first call (the scheduler runs in this process)")
    p.add_argument("--warm-first", type=float, default=0.0, metavar="SECONDS",
                   help="before the first call, start the workers' GPU warm-up (the engine's "
                        "worker probe) and wait this long: is the first call slow because the "
                        "warm-up runs beside it?")
    p.add_argument("--nodes", type=int, default=1,
                   help="the 2gpu/4gpu workers as that many emulated nodes (NCCL between them)")
    args = p.parse_args(argv)

    import distributed

    from bench.dask_gpu import Bench, start_cluster
    from distmm.engine.dask import last_stats, transfer_mark, transfer_report

    cluster, what, _gpus, _cpus = start_cluster(args.setting, rehearse=False,
                                                cpu_workers=args.cpu_workers,
                                                protocol=args.protocol, nodes=args.nodes)
    with cluster, distributed.Client(cluster) as client:
        print(what, client.scheduler.address, flush=True)
        bench = Bench(client, gpu=True, timeout=300)
        spent = install_client_phases()
        if args.profile_scheduler:
            profile_scheduler()
        if args.trace:
            client.run(_install_trace)
        if args.warm_first:
            from distmm.engine.dask import workers as _workers
            client.run(_workers.probe)
            time.sleep(args.warm_first)
        for n in args.sizes:
            for call in range(args.calls):
                a, b = bench.operands(n, args.chunk, args.dtype)
                if args.trace:
                    client.run(_collect_trace)  # drop what the operands' making left
                mark = transfer_mark(client)
                spent.clear()
                if args.sample_workers:
                    client.run(_start_sampler)
                since = time.time()
                with distributed.get_task_stream(client) as ts, ThreadSampler() as sampler:
                    sec, c, phases = phased_product(bench, a, b)
                worker_samples = (client.run(_stop_sampler, since, time.time())
                                  if args.sample_workers else {})
                traces = client.run(_collect_trace) if args.trace else {}
                st = last_stats()
                moved = transfer_report(client, since=mark)
                keep = {k: st.get(k) for k in ("mode", "tasks", "cells", "moved", "transfer",
                                               "estimated_bytes")}
                keep["units"] = [{k: u.get(k) for k in ("address", "block", "gpu", "share")}
                                 for u in st.get("units", [])]
                print(f"== {args.dtype} n={n} call {call}: {sec:.3f} s; client: " + ", ".join(
                    f"{k} {v:.4f}s" for k, v in phases.items()), flush=True)
                print("   client steps: " + ", ".join(f"{k} {v:.4f}s" for k, v in spent.items()),
                      flush=True)
                print(json.dumps(keep, default=str))
                print("routes", moved["device_routes"], "worker_to_worker",
                      moved["worker_to_worker"], "by_name",
                      {k[:40]: v for k, v in moved["by_name"].items()})
                print("\n".join(stream_summary(ts.data, since)), flush=True)
                if args.sample:  # what this process's threads did until the first task ran
                    first = min((x["startstops"][0]["start"] for x in ts.data
                                 if x["startstops"]), default=since + sec)
                    print("\n".join(sampler.lines(since, first)), flush=True)
                if worker_samples:
                    print("\n".join(worker_sample_lines(worker_samples)), flush=True)
                try:
                    print("\n".join(dispatch_lines(client, since)), flush=True)
                except Exception as exc:  # noqa: BLE001 -- a probe's own failure, reported
                    print(f"   dispatch: not read ({type(exc).__name__}: {exc})", flush=True)
                if traces:
                    print("\n".join(trace_lines(traces, since)), flush=True)
                del c, a, b
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
