"""``distmm cluster``: a local Dask cluster served until a signal stops it.

This module covers:

- the command's options (``add_parser``) and their checks, all made before anything starts:
  GPUs (``--gpus``: how many or which; 0 for CPU workers), workers (at most
  ``distmm.plan.MAX_WORKERS``, and no more than the machine's memory holds at
  ``MIN_WORKER_MEMORY`` each), threads and memory per worker (within the machine's memory),
  the scheduler's host, port and dashboard, the scheduler file;
- starting the workers: dask-cuda workers, one per GPU (``distmm.cli.cluster.gpu_cluster``;
  ``--workers W`` puts W workers on each GPU) where GPUs and dask-cuda are present, else
  CPU worker processes (``cpu_cluster``);
- the scheduler file, in distributed's format (the scheduler's identity as JSON), which
  ``distmm matmul --scheduler-file`` and ``distributed.Client(scheduler_file=...)`` read.
  It appears whole (written beside its target, then linked into place) once every worker
  is up, so a file that exists names a cluster ready to run products; an existing file is
  refused unless ``--overwrite``;
- serving until SIGINT, SIGTERM or SIGHUP (a terminal's hangup; left ignored under
  ``nohup``), then closing the workers and the scheduler, making sure no worker process
  outlives the command, and removing the scheduler file when it is still
  the one this command wrote. A second signal during that stops at once (worker processes
  are killed, the file still removed). A signal while CPU workers start ends the start at
  once (the worker processes starting are killed, no scheduler file is written); while GPU
  workers start, it is acted on once they are up (a second one once the cluster is in
  hand), or in the failure's place where the start fails; what distributed logs about the
  work a stop cuts short is not printed: the stop's one line says what was closed.

Exit status: 130 after SIGINT, 143 after SIGTERM, 129 after SIGHUP (128 + the signal, as
the rest of the command line and the shell report a process a signal ended), once the
cluster is closed; 2 for bad options; 1 when the cluster fails to start or to close.

Worker processes leave SIGINT, SIGTERM and SIGHUP alone (``distmm.cli.cluster``: blocked
from their start; SIGINT then ignored by the ``distmm.cli.worker_setup`` preload), so that
Ctrl-C at a terminal, which reaches every process of the foreground group, a terminal's
hangup, and a SIGTERM to the process group (``kill -- -PGID``, ``timeout``, a batch
system's time limit) stop them through
this command's orderly close rather than by ``KeyboardInterrupt`` inside each of them or
by ending each where it is (a worker ended while it started was restarted by its nanny,
whose start then never ended, under distributed 2024.12).

It does *not* cover: connecting to a cluster (``distmm.cli.connect``), clusters of
several machines or batch jobs (``deploy/``), or running products.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from distmm.cli.argtypes import integer_at_least
from distmm.cli.outputs import check_creatable, file_in_the_way
from distmm.deploy import MIN_WORKER_MEMORY  # the smallest --memory-limit
from distmm.plan import MAX_WORKERS
from distmm.staging import descriptors_short

__all__ = ["add_parser", "run_cluster", "MIN_WORKER_MEMORY"]

#: seconds ``cluster.close`` may take before the worker processes left are killed
CLOSE_TIMEOUT = 30.0
#: seconds the workers may take to start
START_TIMEOUT = 120.0
#: free file descriptors this process opens at once while it starts the scheduler, and more
#: for each worker (its nanny's pipes, queues, process spawn and connections): the most seen
#: at the smallest open-file limit (``ulimit -n``) at which 1, 2, 3, 4 and 6 CPU workers
#: started under distributed 2024.12, less the descriptors open before (a GPU worker takes
#: more)
START_DESCRIPTORS, WORKER_DESCRIPTORS = 17, 10


# ---------------------------------------------------------------- option types


def _gpus(text: str):
    """``all``, a count (``0``: CPU workers) or a list of GPU indices (``0,2``; ``3,`` for
    GPU 3 alone)."""
    text = text.strip()
    if text == "all":
        return "all"
    if "," not in text:
        return integer_at_least(0, most=MAX_WORKERS)(text)
    try:
        picked = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or a list of GPU indices "
                                         f"such as 0,2") from None
    if not picked or min(picked) < 0 or len(set(picked)) != len(picked):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices must be distinct and not "
                                         f"negative")
    return tuple(picked)


def _memory_limit(text: str) -> str:
    """dask's per-worker ``memory_limit``: ``auto``, ``0``/``none`` (no limit), a fraction
    of the machine's memory (``0.5``) or a size (``4GiB``, ``4e9``), at least
    ``MIN_WORKER_MEMORY`` and at most the machine's memory (distributed's
    ``system.MEMORY_LIMIT``, which it takes in place of a larger one, with a warning from
    every worker)."""
    from dask.utils import format_bytes, parse_bytes
    from distributed.system import MEMORY_LIMIT

    low = text.strip().lower()
    if low in ("auto", "none", "0"):
        return "auto" if low == "auto" else "0"
    try:
        value = float(low)
    except ValueError:
        value = None
    if value is not None:
        # inf and 1e400 are no whole number of bytes (int() of them raised OverflowError)
        if not (0 < value <= 1 or (1 < value < math.inf and value == int(value))):
            raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction of the memory "
                                             f"(0 to 1) nor a whole number of bytes")
        nbytes = int(value * MEMORY_LIMIT) if value <= 1 else int(value)
    else:
        try:
            # dask reads an empty or blank text as 1 byte
            nbytes = parse_bytes(low) if low else 0
            if nbytes <= 0:
                raise ValueError("not positive")
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a memory limit: auto, 0 (none), "
                                             f"a fraction such as 0.5 or a size such as "
                                             f"4GiB") from None
    if nbytes < MIN_WORKER_MEMORY:
        # a worker starts above such a limit and is restarted by its nanny without end
        what = (f"{format_bytes(nbytes)} of this machine's {format_bytes(MEMORY_LIMIT)}"
                if value is not None and value <= 1 else f"{nbytes} bytes")
        raise argparse.ArgumentTypeError(
            f"{text!r} is {what}: a worker needs more to start (at least "
            f"{MIN_WORKER_MEMORY // 2**20} MiB; sizes take units, such as 4GiB)")
    if nbytes > MEMORY_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is more than this machine's memory "
                                         f"({format_bytes(MEMORY_LIMIT)})")
    return text.strip()


def _port(text: str) -> int:
    value = integer_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return value


def _dashboard(text: str):
    """``:8787``, ``host:port``, a port, or ``none``."""
    text = text.strip()
    if text.lower() == "none":
        return None
    host, _, port = text.rpartition(":") if ":" in text else ("", "", text)
    try:
        _port(port)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dashboard address such as :8787, "
                                         f"host:8787 or none") from None
    return f"{host}:{int(port)}"


def add_parser(sub, common) -> None:
    """Register ``distmm cluster`` on the subparsers ``sub`` (``common``: the shared
    ``--debug``)."""
    c = sub.add_parser("cluster", parents=[common],
                       help="serve a local Dask cluster (GPU or CPU workers) until Ctrl-C",
                       description="start a Dask scheduler and workers on this machine: one "
                                   "dask-cuda worker per GPU where GPUs and dask-cuda are "
                                   "present, CPU worker processes otherwise; print where they "
                                   "are and serve until SIGINT or SIGTERM, then close them and "
                                   "remove the scheduler file written. Use it with distmm matmul "
                                   "--scheduler ADDRESS or --scheduler-file FILE, or "
                                   "distributed.Client(scheduler_file=FILE).",
                       epilog="exit status: 130 after SIGINT, 143 after SIGTERM, 129 after "
                              "SIGHUP once the cluster is closed; 2 bad arguments; 1 a cluster "
                              "that failed to start or to close")
    c.add_argument("--gpus", type=_gpus, default="all", metavar="N|LIST",
                   help="GPUs to start workers on: all (default: every GPU this process sees, "
                        "CPU workers if none or without dask-cuda), a count N (the first N), a "
                        "list of indices such as 0,2 (3, for GPU 3 alone), or 0 for CPU workers")
    c.add_argument("--workers", type=integer_at_least(1, most=MAX_WORKERS), default=None,
                   help="CPU worker processes (default: the usable cores divided by --threads); "
                        "on GPUs, workers per GPU (default 1); at most as many as the memory "
                        "holds at 256 MiB each")
    c.add_argument("--threads", type=integer_at_least(1, most=MAX_WORKERS), default=1,
                   help="threads per worker (default 1)")
    c.add_argument("--memory-limit", type=_memory_limit, default="auto", metavar="LIMIT",
                   help="host memory per worker, in dask's terms: auto (default: the machine's "
                        "memory split between the workers), 0 (no limit), a fraction such as "
                        "0.5, or a size such as 4GiB (at least 256 MiB)")
    c.add_argument("--scheduler-file", metavar="FILE", default=None,
                   help="write the scheduler's address here (distributed's JSON format) once "
                        "every worker is up; removed again at the stop")
    c.add_argument("--overwrite", action="store_true",
                   help="replace an existing --scheduler-file (by default it is refused)")
    c.add_argument("--host", default="127.0.0.1",
                   help="interface the scheduler and workers listen on (default 127.0.0.1: "
                        "this machine only; Dask has no authentication of its own)")
    c.add_argument("--port", type=_port, default=8786,
                   help="the scheduler's port (default 8786, dask's; 0: any free port)")
    c.add_argument("--dashboard-address", type=_dashboard, default=":8787", metavar="ADDRESS",
                   help="the dashboard's [host]:port (default :8787; another port if that one "
                        "is taken), or none")
    c.add_argument("--protocol", default="tcp", choices=["tcp", "ucx", "auto"],
                   help="GPU workers' comms: tcp (default), ucx (needs distributed-ucxx), auto "
                        "(ucx where installed); CPU workers use tcp")
    c.set_defaults(func=run_cluster)


# ---------------------------------------------------------------- checks before starting


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _choose_gpus(wanted) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries to start workers on, or None for CPU workers;
    ``ValueError``/``BackendUnavailable`` for GPUs asked for that are not there."""
    import importlib.util

    from distmm.cli.cluster import local_gpus
    from distmm.errors import BackendUnavailable

    if wanted == 0:
        return None
    seen = local_gpus()
    has_dask_cuda = importlib.util.find_spec("dask_cuda") is not None
    if wanted == "all":
        if seen == 0 or not has_dask_cuda:
            if seen:
                print(f"distmm cluster: {seen} GPU(s) seen but dask-cuda is not installed: CPU "
                      f"workers (pip install \"distmm[gpu]\" for GPU workers)", file=sys.stderr)
            return None
        picked = list(range(seen))
    else:
        picked = list(range(wanted)) if isinstance(wanted, int) else list(wanted)
        if not has_dask_cuda or seen == 0:
            raise BackendUnavailable(f"--gpus {_show(wanted)}: GPU workers need cupy, a CUDA "
                                     f"GPU and dask-cuda (pip install \"distmm[gpu]\"); this "
                                     f"machine has {seen} usable GPUs"
                                     f"{'' if has_dask_cuda else ' and no dask-cuda'}; "
                                     f"--gpus 0 starts CPU workers")
        if max(picked) >= seen:
            raise ValueError(f"--gpus {_show(wanted)}: this process sees {seen} GPU(s) "
                             f"(indices 0 to {seen - 1})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(seen)]
    return [names[i] for i in picked]


def _worker_count(args, devices) -> int:
    """The worker processes ``args`` ask for: ``--workers`` (default: the usable cores
    divided by ``--threads``) CPU workers, or ``--workers`` (default 1) on each GPU."""
    if devices is None:
        return args.workers or max(1, _usable_cores() // args.threads)
    return (args.workers or 1) * len(devices)


def _check_worker_count(count: int, args) -> None:
    """``ValueError`` when ``--workers`` asks for more worker processes (``count`` in all)
    than this machine's memory holds at ``MIN_WORKER_MEMORY`` each, before the cluster
    process spends its memory on their specs and nannies. The default, one per core, is
    left to distributed."""
    from dask.utils import format_bytes
    from distributed.system import MEMORY_LIMIT

    if args.workers and count * MIN_WORKER_MEMORY > MEMORY_LIMIT:
        raise ValueError(f"--workers {args.workers}: {count} worker processes need at least "
                         f"{format_bytes(count * MIN_WORKER_MEMORY)} of memory "
                         f"({MIN_WORKER_MEMORY // 2**20} MiB each), and this machine has "
                         f"{format_bytes(MEMORY_LIMIT)}")


def _check_descriptors(count: int) -> None:
    """``OSError`` (``EMFILE``; ``ENFILE``: the system's table) at once where this process
    cannot open the descriptors that starting ``count`` worker processes holds at once
    (``START_DESCRIPTORS``, ``WORKER_DESCRIPTORS``; each closed again): under a smaller limit
    the start failed with a traceback per nanny, or never ended."""
    need = START_DESCRIPTORS + WORKER_DESCRIPTORS * count
    short = descriptors_short(need)
    if short is not None:
        code, free = short
        why = ("this process's open-file limit leaves it" if code == errno.EMFILE
               else "the system's table of open files (ENFILE) leaves")
        raise OSError(code, f"cannot start {count} worker{'s' if count != 1 else ''}: "
                            f"the start holds about {need} files open at once "
                            f"({START_DESCRIPTORS} and {WORKER_DESCRIPTORS} a worker), "
                            f"and {why} {free}; raise the limit (ulimit -n) or "
                            f"start fewer workers (--workers)")


def _show(wanted) -> str:
    return ",".join(map(str, wanted)) if isinstance(wanted, tuple) else str(wanted)


def _check_port(host: str, port: int) -> None:
    """``ValueError`` when the scheduler could not listen on ``host:port``."""
    try:
        infos = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tornado's listener does
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port} on {host}: in use (another scheduler? --port 0 "
                                 f"takes a free port)") from None
            raise ValueError(f"--host {host}: cannot listen there "
                             f"({(exc.strerror or str(exc)).lower()})") from None


def _check_scheduler_file(path: str | None, overwrite: bool) -> Path | None:
    from distmm.errors import OutputExists

    if path is None:
        return None
    if not path:
        raise ValueError("--scheduler-file: an empty path")
    target = Path(path).absolute()
    if target.is_dir():
        raise IsADirectoryError(f"--scheduler-file {path} is a directory")
    if target.is_symlink() and not target.exists() and not overwrite:
        # a link to nothing: linking the file into place would fail once the workers are up
        raise OutputExists(f"--scheduler-file {path} is a link to {os.readlink(target)}, which "
                           f"does not exist: pass --overwrite to replace the link, or choose "
                           f"another file")
    if target.exists() and not overwrite:
        raise OutputExists(f"--scheduler-file {path} exists (a running cluster's, or one left by "
                           f"a killed one): pass --overwrite to replace it, or choose another file")
    if not target.parent.is_dir():
        blocking = file_in_the_way(target)
        if blocking is not None:
            raise NotADirectoryError(f"--scheduler-file {path}: {blocking} is not a directory")
        raise FileNotFoundError(f"--scheduler-file {path}: no such directory: {target.parent}")
    try:  # its staged name, as the file is written once the workers are up
        check_creatable(_staged(target))
    except OSError as exc:
        raise PermissionError(f"--scheduler-file {path}: cannot write in {target.parent}"
                              f"{f' ({exc.strerror.lower()})' if exc.strerror else ''}") from None
    return target


def _staged(target: Path) -> Path:
    """Where the scheduler file is written before it is linked into place."""
    return target.with_name(f".{target.name}.distmm-partial-{os.getpid()}")


# ---------------------------------------------------------------- the scheduler file


def _write_scheduler_file(target: Path, identity: dict, overwrite: bool) -> bytes:
    """Write ``identity`` as JSON to ``target``, whole or not at all; returns the bytes. The
    staged file is created exclusively, following no link there (``_make_staged``), and
    moved into place as it is (a link at its name is never followed)."""
    from distmm.errors import OutputExists

    data = json.dumps(identity, indent=2, default=str).encode()
    staged = _staged(target)
    fd = _make_staged(staged)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(staged, target)
        else:
            try:  # fails, rather than replaces, if one appeared meanwhile
                os.link(staged, target, follow_symlinks=False)
            except FileExistsError:
                raise OutputExists(f"--scheduler-file {target} appeared while the cluster "
                                   f"started: pass --overwrite to replace it") from None
    finally:
        staged.unlink(missing_ok=True)
    return data


def _make_staged(staged: Path) -> int:
    """Create ``staged`` for writing (``O_CREAT | O_EXCL | O_NOFOLLOW``) and return its
    descriptor. What is at its name (this PID's: a dead run's) is removed first where it is a
    file or a link, the link itself and never what it points to; anything else there, or a
    link planted since, fails the creation (``FileExistsError``) instead of being written
    through."""
    import stat

    try:
        mode = os.lstat(staged).st_mode
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            staged.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(staged, flags, 0o666)


def _remove_scheduler_file(target: Path | None, data: bytes | None) -> str:
    """Remove ``target`` if it still holds ``data``; a phrase saying what was done."""
    if target is None or data is None:
        return ""
    try:
        if target.read_bytes() != data:
            return f", {target} left as it is (rewritten by another program)"
        target.unlink()
    except FileNotFoundError:
        return f", {target} already gone"
    except OSError as exc:
        return f", {target} not removed ({exc.strerror or exc})"
    return f", {target} removed"


# ---------------------------------------------------------------- processes


def _kill_workers(cluster, most: float = 5.0) -> int:
    """Kill every worker process, and again until none has appeared for
    ``distmm.cli.cluster.QUIET`` seconds, ``most`` seconds at most (``kill_until_quiet``);
    returns how many. A nanny still running starts a new worker in place of one killed under
    it, again and again, and the command's exit would leave the last one starting (its
    traceback: "EOFError: Ran out of input"); so every nanny of ``cluster``
    (``SpecCluster.workers``; None: no cluster) is first set to the state its close sets
    first (``Status.closing``), in which it starts none, from outside its event loop, which
    a stop at once does not wait for."""
    from distmm.cli.cluster import kill_until_quiet

    nannies = list(cluster.workers.values()) if cluster is not None else []
    if nannies:
        from distributed.core import Status

        for nanny in nannies:
            nanny.status = Status.closing
    return kill_until_quiet(most=most, reap=True)


# ---------------------------------------------------------------- the command


class _Stop:
    """The signal that asked for the stop, set from the handler (main thread), and the
    cluster it stops once the start has returned it (``hold``). While CPU workers start
    (``starting``), the first signal also raises ``Signalled`` there, which ends the start
    at once (``distmm.cli.cluster.cpu_cluster`` kills the workers starting)."""

    def __init__(self):
        self.signum: int | None = None
        self.event = threading.Event()
        self.force = None  # called on a second signal, with the cluster in hand
        self.cluster = None
        self.second: int | None = None  # a second signal that came before the cluster
        self.starting = False

    def handler(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            self.event.set()
            if self.starting:
                from distmm.errors import Signalled

                # what distributed logs about the workers the stop kills is not printed
                logging.disable(logging.CRITICAL)
                raise Signalled(signum)
        elif self.cluster is None:
            # the start has not returned the cluster yet (its nannies would restart the
            # workers killed under them): the stop at once comes as soon as it has
            self.second = self.second or signum
        elif self.force is not None:
            self.force(signum)

    def hold(self, cluster) -> None:
        """The start has returned ``cluster``: a second signal noted meanwhile acts now."""
        self.cluster = cluster
        if self.second is not None and self.force is not None:
            self.force(self.second)


def _start(args, devices, stop: _Stop):
    """Start the cluster ``args`` describe, handing it to ``stop.hold`` as soon as it is
    made; ``(cluster, workers)``. A first signal while CPU workers start ends the start at
    once (``Signalled``); while GPU workers start, it is acted on once they are up."""
    from distmm.cli.cluster import cpu_cluster, gpu_cluster

    common = dict(host=args.host, scheduler_port=args.port,
                  dashboard_address=args.dashboard_address,
                  memory_limit=args.memory_limit)  # workers leave Ctrl-C to this process
    if args.dashboard_address is None:
        # distributed's None still serves its HTTP routes (health, metrics) on :8787: those
        # go to any free port, and the dashboard is off
        common.update(dashboard_address=f"{args.host}:0", scheduler_kwargs={"dashboard": False})
    workers = _worker_count(args, devices)
    if devices is None:
        stop.starting = True
        try:
            cluster = cpu_cluster(workers, threads_per_worker=args.threads, **common)
        finally:
            stop.starting = False
        try:
            stop.hold(cluster)
            cluster.wait_for_workers(workers, timeout=START_TIMEOUT)
        except BaseException:
            cluster.close()
            raise
        return cluster, workers
    cluster = gpu_cluster(",".join(devices), per_device=args.workers or 1,
                          protocol=args.protocol, threads_per_worker=args.threads,
                          timeout=START_TIMEOUT, **common)
    stop.hold(cluster)
    return cluster, workers


def _describe(cluster, devices, args, scheduler_file: Path | None) -> str:
    from dask.utils import format_bytes

    info = cluster.scheduler_info
    workers = info.get("workers", {})
    first = next(iter(workers.values()), {})
    limit = first.get("memory_limit")
    each = (f"{args.threads} thread{'s' if args.threads > 1 else ''}"
            + (f" and {format_bytes(limit)} of memory" if limit else " and no memory limit"))
    if devices is None:
        kind = f"{len(workers)} CPU worker{'s' if len(workers) != 1 else ''}"
    else:
        kind = (f"{len(workers)} GPU worker{'s' if len(workers) != 1 else ''} on GPU"
                f"{'s' if len(devices) > 1 else ''} {','.join(devices)}")
    lines = [f"distmm cluster: {kind}, {each} each",
             f"  scheduler       {cluster.scheduler_address}",
             f"  dashboard       {(args.dashboard_address and cluster.dashboard_link) or 'none'}",
             f"  workers         {', '.join(sorted(workers))}"]
    if scheduler_file is not None:
        lines.append(f"  scheduler file  {scheduler_file}")
        use = f"--scheduler-file {scheduler_file}"
    else:
        use = f"--scheduler {cluster.scheduler_address}"
    lines.append(f"  use it with     distmm matmul A B -o C {use}; stop it with Ctrl-C or SIGTERM")
    return "\n".join(lines)


def _identity(cluster) -> dict:
    async def ask():
        return cluster.scheduler.identity()

    return cluster.sync(ask)


def run_cluster(args) -> int:
    """Start the cluster ``args`` describe, serve until SIGINT/SIGTERM/SIGHUP, close it; the
    exit status."""
    devices = _choose_gpus(args.gpus)
    _check_worker_count(_worker_count(args, devices), args)
    _check_descriptors(_worker_count(args, devices))
    if devices is not None and args.protocol != "tcp":
        from distmm.cli.cluster import gpu_protocol

        gpu_protocol(args.protocol)  # ucx without distributed-ucxx fails here, before starting
    _check_port(args.host, args.port)
    target = _check_scheduler_file(args.scheduler_file, args.overwrite)

    stop = _Stop()
    # a hangup (the terminal closed) stops it too, unless it is ignored (nohup)
    stops = [signal.SIGINT, signal.SIGTERM] + (
        [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else [])
    previous = {s: signal.signal(s, stop.handler) for s in stops}
    written_box: list[bytes] = []  # the scheduler file's bytes, once written

    def force(signum):
        # a second signal: no more waiting for an orderly close. What distributed logs about
        # the processes killed under its nannies ("Restarting worker", "exit status was
        # already read") is not printed: the line below says what was done
        logging.disable(logging.CRITICAL)
        killed = _kill_workers(stop.cluster)
        note = _remove_scheduler_file(target, written_box[0] if written_box else None)
        print(f"distmm cluster: stopped at once by a second {signal.Signals(signum).name}: "
              f"{killed} worker process(es) killed{note}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # the nannies' semaphores, which the interpreter's exit would have removed: left,
        # the resource tracker removes them and warns of "leaked semaphore objects"
        import multiprocessing.util

        multiprocessing.util._run_finalizers(0)
        os._exit(128 + stop.signum)

    stop.force = force
    disabled = logging.root.manager.disable  # what the stop's close changes
    try:
        return _serve(args, devices, target, stop, lambda data: written_box.append(data))
    finally:
        for s, handler in previous.items():
            # once stopped by one, a later signal has nothing left to stop (the command's
            # own handler would add its line to the stop's); main() restores its own
            signal.signal(s, handler if stop.signum is None else signal.SIG_IGN)
        logging.disable(disabled)


def _serve(args, devices, target: Path | None, stop: _Stop, keep) -> int:
    cluster, written = None, None
    try:
        # a first signal while CPU workers start ends the start at once; while GPU workers
        # start, it is acted on once they are up: then they close in order (a second one
        # stops at once)
        from distmm.errors import Signalled

        try:
            cluster, _ = _start(args, devices, stop)
        except (Exception, Signalled):
            if stop.signum is None:
                raise
            return _stopped_starting(stop.signum)
        if stop.signum is None and target is not None:
            written = _write_scheduler_file(target, _identity(cluster), args.overwrite)
            keep(written)
        if stop.signum is None:
            print(_describe(cluster, devices, args, target), flush=True)
        while not stop.event.wait(1.0):
            pass
        # what this process's scheduler logs about the work the stop cuts short ("Removing
        # worker ... caused the cluster to lose already computed task(s)", "Couldn't gather
        # keys" of a product still running) is not printed: the line below says what closed
        logging.disable(logging.CRITICAL)
        name = signal.Signals(stop.signum).name
        n = len(cluster.scheduler_info.get("workers", {}))
        killed = _close(cluster)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # closed: nothing left to
            if signal.getsignal(s) == stop.handler:  # stop at once
                signal.signal(s, signal.SIG_IGN)
    except BaseException:
        try:
            _close(cluster)
        finally:
            _remove_scheduler_file(target, written)
        raise
    note = _remove_scheduler_file(target, written)
    if killed:
        note += f", {killed} worker process(es) killed after the close"
    print(f"distmm cluster: stopped by {name}: {n} worker{'s' if n != 1 else ''} and the "
          f"scheduler closed{note}", file=sys.stderr, flush=True)
    return 128 + stop.signum


def _stopped_starting(signum: int) -> int:
    """The start ended with a stop's signal noted: the signal ended it (CPU workers), or the
    start failed meanwhile (a worker process ended by another program, and its nanny's
    "Nanny failed to start"): the signal is acted on in the failure's place. The cluster
    closed itself; no worker process is left, and no scheduler file was written. Returns the
    exit status."""
    from distmm.cli.cluster import reap_processes

    killed = reap_processes(5.0)
    note = f", {killed} worker process(es) killed after the close" if killed else ""
    print(f"distmm cluster: stopped by {signal.Signals(signum).name} while the workers "
          f"started: the cluster closed{note}", file=sys.stderr, flush=True)
    return 128 + signum


def _close(cluster) -> int:
    """Close ``cluster``: the workers first (``scale(0)``: each retired and its process
    ended while the scheduler still answers, so that no worker reports a lost scheduler),
    then the scheduler; then make sure no worker process is left. Returns how many had to
    be killed."""
    import time

    from distmm.cli.cluster import reap_processes

    if cluster is None:
        return reap_processes(0)
    try:
        cluster.scale(0)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while cluster.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.close(timeout=CLOSE_TIMEOUT)
    finally:
        killed = reap_processes(5.0)
    return killed
