"""A file-to-file product over the ranks of a job: what ``mpirun -n P distmm matmul`` runs.

This module covers: ``run_batch``, called by every rank with the operands opened (memmaps,
zarr arrays, h5py datasets) and the output checked: it binds the rank's GPU, plans the
product (``distmm.plan_batch``, with the smallest device memory of any rank, or a CPU rank's
``distmm.memory-budget`` given as a size), prepares the staged output (rank 0: removes what
killed runs left beside the target, or with ``resume`` takes the staged output whose manifest
matches and refuses one that does not, naming what changed, or one that another run works
on), works out the stripes still missing, runs
``distmm.engine.mpi.stream.run_stripes`` and then lets the ranks agree on the outcome: on
success rank 0 moves the staged output into place; on a failure or a signal on any rank every
rank stops within milliseconds, and the staged output is removed, or kept with its manifest
and the ranks' logs when ``resume``. SIGINT and SIGTERM are turned into a flag the ranks' waits
poll (``StopWatch``), so they act on it wherever they are, whatever the backend.

It does *not* cover: opening operands and checking the target (the command line,
``distmm.cli``), the product itself (``stream``), the manifest's format (``resume``).
"""
from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from distmm.engine.mpi import resume as rs
from distmm.engine.mpi.io import (StripeWriter, create_staged, finish_staged, parse_spec,
                                  staged_path)
from distmm.engine.mpi.stop import PeerStopped, StopWatch
from distmm.engine.mpi.stream import PanelSource, device_memory, k_panels, run_stripes
from distmm.errors import STOP_SIGNALS, Signalled
from distmm.fpflags import report
from distmm.plan_batch import BatchPlan, decide_batch
from distmm.staging import (claim, is_live, leftovers, preparing, release, remove_leftover,
                            staged_pid)

__all__ = ["run_batch", "BatchOutcome", "close_sources"]

#: rank 0's claims (``distmm.staging.claim``) on the staged outputs it resumes, by the PID in
#: their names, held from ``_prepare`` to ``_finish``
_HELD: dict[int, int | None] = {}


@dataclass
class BatchOutcome:
    """What the ranks agreed on (the same on every rank).

    ``status``: 0, or the exit status of the failure that stopped the ranks (128 + the signal
    for a signal); ``message``: its one line (on rank 0 of a stopped ``resume`` run, with what
    was kept); ``error``: this rank's exception (its own, or a ``PeerStopped``); ``notes``: lines
    for the user (removed leftovers); ``panels``: ``"read"``, ``"share"`` or ``"broadcast"``
    (``batch-panels``, decided)."""

    status: int = 0
    message: str = ""
    error: BaseException | None = None
    plan: BatchPlan | None = None
    notes: list[str] = field(default_factory=list)
    panels: str | None = None  # how the ranks got their panels: "read", "share" or "broadcast"
    written_direct: int = 0  # this rank's bytes of C written past the page cache


@contextmanager
def _signals_to(watch: StopWatch):
    """SIGINT, SIGTERM and SIGXCPU (a soft CPU-time limit) set the watch's failure instead of
    unwinding the interpreter."""
    def handler(signum, frame):
        watch.fail(KeyboardInterrupt() if signum == signal.SIGINT else Signalled(signum))

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _judged(exc: BaseException, judge) -> tuple[int, str]:
    """(exit status, one line) of a failure; a peer's stop carries its own."""
    if isinstance(exc, PeerStopped):
        return exc.status, exc.reason
    return judge(exc)


def _manifest(args, a, b, dtype, backend, comm, plan, panels, pid, header, precision="highest",
              blas=None):
    return rs.Manifest.make(a=rs.input_facts(args.a, a), b=rs.input_facts(args.b, b),
                            output=args.output, dtype=dtype, backend=backend, ranks=comm.size,
                            grid=plan.grid.shape, stripe_edges=plan.stripe_edges, panels=panels,
                            pid=pid, header=header, precision=precision, blas=blas)


def _uses_blas(backend: str, on_gpu: bool, acc) -> bool:
    """Whether a rank's products go through numpy's BLAS (whose kernel and threads decide
    their bits: ``resume.blas_facts``): CPU ranks multiplying floating or complex panels
    other than on distmm's numba kernels."""
    from distmm.executor.cpu import NUMBA_DTYPES

    acc = np.dtype(acc)
    if on_gpu or acc.name not in ("float32", "float64", "complex64", "complex128"):
        return False
    return not (backend == "numba" and acc.name in NUMBA_DTYPES)


def _product_facts(args, backend: str, on_gpu: bool, acc,
                   precision: str = "highest") -> dict | None:
    """With ``--resume``, what of this rank decides its products' bits besides the operands,
    kept in the manifest: its GPU and cuBLAS (``resume.gpu_facts``) with the kernel and
    parameters distmm's own kernels run with, which the tuning cache may choose
    (``GPUExecutor.kernel_facts``), or numpy's BLAS where its products go through it
    (``resume.blas_facts``); None otherwise."""
    if not args.resume:
        return None
    if on_gpu:
        from distmm.executor import get_executor

        executor = get_executor(backend, np.dtype(acc), on_gpu=True, precision=precision)
        return rs.gpu_facts(executor.kernel_facts(acc))
    return rs.blas_facts() if _uses_blas(backend, on_gpu, acc) else None


def _prepare(args, a, b, dtype, backend, comm, plan, panels, chunks, precision="highest",
             job=frozenset(), stop=None, blas=None, replan=None, refused=None):
    """Rank 0: leftovers, then the staged output (new, or the one to resume). Returns
    ``(pid, header, resumed, notes, kept)``, ``kept`` the plan with the resumed run's grid and
    stripes where they are not ``plan``'s, else None; raises ``ValueError`` for a manifest
    that does not match, or, with ``resume``, for a stopped run's staged output that another
    run works on. ``job``: the PIDs of this job's ranks on this host. A ``resume`` run does
    all this under ``preparing``'s lock: a second one waits until this one's manifest is saved
    and claimed, or until ``stop`` raises (``StopWatch.check``: a signal). ``blas``: each
    rank's ``_product_facts`` (its GPU's, or its BLAS's), kept in the manifest.
    ``replan(grid, stripe_edges, budget)``: the plan and k panels with a stopped run's grid
    and stripes (``budget``: instead, a ``MemoryError`` where they hold more than the
    memory-budget), which a resume takes on where they fit and nothing else changed (the
    budget or batch-stripes did); ``refused``: the budget's refusal of this run's own plan
    (then planned without it), said unless the kept stripes fit."""
    with preparing(parse_spec(args.output).path, stop) if args.resume else nullcontext():
        return _prepare_now(args, a, b, dtype, backend, comm, plan, panels, chunks, precision,
                            job, blas, replan, refused)


def _prepare_now(args, a, b, dtype, backend, comm, plan, panels, chunks, precision, job,
                 blas=None, replan=None, refused=None):
    """``_prepare``, its lock held."""
    spec = parse_spec(args.output)
    target = spec.path
    notes = []
    own = staged_path(target, os.getpid())
    job = {*job, os.getpid()}
    # each one this process takes over (``claim``); a run started beside it leaves it alone
    claims, busy = {}, []
    try:  # a --resume run that cannot look (its open-file limit) cannot tell what to resume
        left = leftovers(target, spec.dataset, strict=bool(args.resume))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot resume {args.output}: {exc.strerror}") from None
    for p in left:
        try:  # nor whether another run works on a stopped run's staged output
            fd = claim(p, strict=bool(args.resume))
        except OSError as exc:
            for held in claims.values():  # those taken before it
                release(held)
            raise OSError(exc.errno, f"cannot resume {args.output}: {exc.strerror}") from None
        if fd is None:  # held: a --resume run works on it (from its manifest's saving or its
            busy.append(p)  # taking over to its end), or another run removes it
        # a manifest no one holds: free to take. Without one only the PID in its name tells,
        # and one of this job's ranks' PIDs is a dead run's (PIDs come round again; in
        # containers every job's ranks may have the same ones), though ``is_live`` says not
        elif fd >= 0 or staged_pid(p) in job or not is_live(p):
            claims[p] = fd
    found = list(claims)
    reuse = kept = None
    try:
        if args.resume and busy:  # both would compute its missing stripes and race to commit
            raise ValueError(f"cannot resume {args.output}: another run works on "
                             f"{busy[0].name}; run this command again once that run has ended")
        if args.resume:
            want = _manifest(args, a, b, dtype, backend, comm, plan, panels, 0, None, precision,
                             blas)
            for staged in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
                try:
                    old = rs.Manifest.load(staged)
                except ValueError as exc:  # damaged: kept, as a run that does not match is
                    old, what = None, str(exc)
                except OSError as exc:  # this process's limit: kept, as it says nothing of it
                    raise OSError(exc.errno, f"cannot resume {args.output} from {staged.name}: "
                                             f"{(exc.strerror or str(exc)).lower()}, so its "
                                             f"manifest cannot be read") from None
                else:
                    if old is None:
                        continue
                    what = rs.mismatch(old, want)
                    # kept stripes of another plan: taken on where only they differ (the
                    # same grid and stripes as this run's plan: nothing to plan again)
                    other = [old.get("grid"), old.get("stripe_edges")] != [
                        want["grid"], want["stripe_edges"]]
                    if replan is not None and ((other and what is not None)
                                               or refused is not None):
                        what, kept = _kept_stripes(args, staged, old, what, replan,
                                                   lambda p, ks: _manifest(
                                                       args, a, b, dtype, backend, comm, p, ks,
                                                       0, None, precision, blas))
                    what = what or rs.short(staged, old, (plan.grid.m, plan.grid.n), dtype)
                if what is not None:
                    raise ValueError(f"cannot resume {args.output} from {staged.name}: {what}; "
                                     f"run without --resume to start over (that removes it)")
                reuse, old_manifest = staged, old
                break
        if refused is not None and reuse is None:  # no kept stripes to take: the budget's
            raise ValueError(refused)
        for staged in found:
            if staged != reuse:
                remove_leftover(staged)
                notes.append(f"removed {staged.name}, left beside {args.output} by a run that "
                             f"was killed")
    finally:
        for staged, fd in claims.items():
            if staged != reuse:
                release(fd)
    if reuse is not None:
        rs.drop_temporaries(reuse)  # a zarr chunk a killed run was writing
        pid = staged_pid(reuse)  # the staged output's own name, not the manifest's
        _HELD[pid] = claims[reuse]  # until _finish: this run works on it now
        return pid, old_manifest["header"], True, notes, kept if kept != plan else None
    pid = os.getpid()
    if own.exists():  # a stopped run's to another dataset of this HDF5 file, under this PID
        raise FileExistsError(f"{own.name} beside {args.output} holds a stopped run to another "
                              f"dataset of {target.name}: finish or remove that run first")
    # a dead run's manifest or logs under this PID whose staged output is gone: a fresh run
    # must not append to its logs (a resumed run would skip stripes never written)
    remove_leftover(own)
    header = create_staged(args.output, (plan.grid.m, plan.grid.n), dtype, pid, chunks=chunks)
    if args.resume:  # claimed from the moment it exists: a --resume run beside it refuses
        try:
            _HELD[pid] = _manifest(args, a, b, dtype, backend, comm, plan, panels, pid, header,
                                   precision, blas).save(staged_path(target, pid), hold=True)
        except BaseException:
            remove_leftover(staged_path(target, pid))
            raise
    return pid, header, False, notes, None


def _kept_stripes(args, staged, old: dict, what: str | None, replan, manifest):
    """``(what, kept)`` for a stopped run's manifest ``old`` that differs from this run's in
    ``what`` (or whose stripes this run's budget may not hold): a stopped run's grid and
    stripes, which another memory-budget or batch-stripes changes, are taken on
    (``replan``) where nothing else changed: ``what`` None and ``kept`` that plan; else
    ``what`` names what differs with them (``kept`` None). Raises ``ValueError`` in one line
    naming the budget they need where they hold more than a CPU rank's memory-budget."""
    grid, edges = old.get("grid"), old.get("stripe_edges")
    try:
        kept, panels = replan(tuple(grid[-2:]), edges, False)
    except (ValueError, TypeError, IndexError):  # not this run's rows, or a GPU's memory
        return what, None
    again = rs.mismatch(old, manifest(kept, panels))
    if again is not None:
        return again, None
    try:
        replan(tuple(grid[-2:]), edges, True)
    except MemoryError as exc:
        raise ValueError(f"cannot resume {args.output} from {staged.name}: {exc}, or run "
                         f"without --resume to start over (that removes it)") from None
    return None, kept


def _zarr_chunks(plan: BatchPlan):
    """Chunks every stripe of every rank covers whole (so zarr writers never share one),
    or None where the stripes are ragged."""
    g = plan.grid
    heights = {b - a for e in plan.stripe_edges for a, b in zip(e, e[1:])}
    widths = {b - a for a, b in zip(g.col_edges, g.col_edges[1:])}
    if len(heights) == 1 and len(widths) == 1 and min(heights) > 0 and min(widths) > 0:
        return (heights.pop(), widths.pop())
    return None


def run_batch(args, a, b, *, dtype, backend: str, on_gpu: bool, comm, phases, judge,
              progress=None, precision: str = "highest") -> BatchOutcome:
    """Every rank: the product of the opened operands ``a`` and ``b`` into ``args.output``.

    ``args`` carries ``a``, ``b``, ``output`` (specs), ``overwrite`` and ``resume``;
    ``judge(exc)`` gives a failure's ``(exit status, one line)``; ``progress(count)``, when
    given, makes a bar with ``update(1)`` and ``close()`` over this rank's stripes. Returns
    the agreed outcome. ``precision``: ``distmm.precision``'s mode (checked against
    ``dtype`` by the caller), applied by every rank's executor.
    """
    from distmm.config import get_config
    from distmm.engine.mpi.gridcomms import grid_comms, host_count, local_gpu
    from distmm.executor import get_executor

    outcome = BatchOutcome()
    watch = StopWatch(comm)
    writer = log = None
    error: BaseException | None = None
    flags: set = set()  # numpy's flags this rank's stripes raised
    pid = None
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    # rank 0: what identifies the inputs, compared again before C is moved into place
    try:
        inputs = rs.inputs_now(args.a, a, args.b, b) if comm.rank == 0 else None
    except OSError:  # not looked at again, then (the ranks' own reads will say what is wrong)
        inputs = None
    with _signals_to(watch):
        try:
            start = time.perf_counter()
            device = local_gpu(comm) if on_gpu else None
            if on_gpu:  # cuBLAS starts on a thread while the ranks plan and open the output
                from distmm.executor.cublas import start_cublas

                start_cublas(dtype)
            # how the ranks get their panels and the plan: what distmm plan --ranks prints
            # from the same facts (ranks that read their panels take whole rows of C when B
            # fits: each writes one contiguous range of the output, directly)
            # (CPU ranks: each holds at most a memory-budget given as a size, their writers'
            # aligned buffers counted where C goes past the page cache: StripeWriter's
            # BlockWriter, for .npy and HDF5 outputs)
            kind = parse_spec(args.output).kind
            facts = dict(ranks=comm.size, hosts=host_count(comm), on_gpu=on_gpu,
                         panels=get_config().batch_panels, memory=device_memory(on_gpu, comm),
                         host_memory=_host_available(comm), stripes=get_config().batch_stripes,
                         resume=bool(args.resume), budget=get_config().memory_budget,
                         direct_writes=get_config().direct_writes and kind != "zarr")
            refused = None
            try:
                setup = decide_batch(m, n, k, dtype, **facts)
            except MemoryError as exc:  # a budget too small for the product, told from the
                # sizes before any work: the command's bad configuration, as distmm plan's
                if not args.resume:
                    raise ValueError(str(exc)) from None
                # unless a stopped run's kept stripes fit it (``_prepare``): planned without
                # it until its manifest is read
                refused, setup = str(exc), decide_batch(m, n, k, dtype,
                                                        **{**facts, "budget": None})
            plan, outcome.panels = setup.plan, setup.panels
            direct, share = setup.direct, setup.panels == "share"
            outcome.plan = plan
            phases.add("startup", start, time.perf_counter())
            chunks = _zarr_chunks(plan) if kind == "zarr" else None
            panels = k_panels(plan, on_gpu=on_gpu, direct=direct)

            def replan(grid, edges, budget: bool):
                """The plan with a stopped run's grid and kept stripes, and its k panels;
                ``budget``: only whether they fit the budget (``MemoryError`` where they hold
                more), planned once more where one is given."""
                if budget:
                    if facts["budget"] is not None:
                        decide_batch(m, n, k, dtype, **facts, grid=grid, stripe_edges=edges)
                    return None
                kept = decide_batch(m, n, k, dtype, **{**facts, "budget": None}, grid=grid,
                                    stripe_edges=edges)
                return kept.plan, k_panels(kept.plan, on_gpu=on_gpu, direct=direct)
            with phases.phase("open"):
                setup, setup_error = None, None
                # the PIDs of this job's ranks on rank 0's host: no staged output named with
                # one of them belongs to a live run
                ranks = comm.gather((socket.gethostname(), os.getpid()), root=0)
                # each rank's GPU and cuBLAS, or BLAS where its products go through it: a
                # resumed run's kept stripes were summed in their order
                blas = comm.gather(_product_facts(args, backend, on_gpu, plan.grid.acc_dtype,
                                                  precision), root=0)
                stopped = None
                if comm.rank == 0:
                    try:
                        job = frozenset(p for host, p in ranks if host == ranks[0][0])
                        setup = _prepare(args, a, b, dtype, backend, comm, plan, panels, chunks,
                                         precision, job, watch.check, blas,
                                         replan if args.resume else None, refused)
                    except BaseException as exc:  # noqa: BLE001 - every rank raises it below
                        if isinstance(exc, Exception) and not isinstance(exc, PeerStopped):
                            setup_error = exc
                        else:  # a signal ended its wait for another run (``preparing``): the
                            stopped = exc  # other ranks, waiting here, stop with its status
                why = _judged(stopped, judge) if stopped is not None else None
                setup, setup_error, why = comm.bcast((setup, setup_error, why), root=0)
            if why is not None:
                raise stopped if comm.rank == 0 else PeerStopped(0, why[1], why[0])
            if setup_error is not None:
                raise setup_error
            pid, header, resumed, outcome.notes, kept = setup
            if kept is not None:  # a stopped run's grid and stripes, which fit this run
                plan = outcome.plan = kept
                chunks = _zarr_chunks(plan) if kind == "zarr" else None
            staged = staged_path(parse_spec(args.output).path, pid)
            _, i, j = plan.grid.coords(comm.rank)
            mine = rs.read_done(staged, comm.rank) if resumed else set()
            # a kept zarr folder's chunk files deleted since: their stripes computed again
            # (every rank looks before any writes: the allgather below waits for all)
            c0, c1 = plan.grid.col_edges[j], plan.grid.col_edges[j + 1]
            mine -= rs.unwritten(staged, {s: (*plan.stripe_rows(i, s), c0, c1) for s in mine})
            if resumed:  # and those whose bytes differ from their logged checksum, said once
                with phases.phase("open"):
                    bad = rs.damaged(staged, comm.rank, {s: (*plan.stripe_rows(i, s), c0, c1)
                                                         for s in mine}, (m, n), dtype, header)
                    mine -= set(bad)
                    said = comm.gather(list(bad.values()), root=0)
                outcome.notes += [line for lines in said or () for line in lines]
            with phases.phase("wait"):
                everyone = comm.allgather(mine)
            row = [everyone[plan.grid.rank_at(0, i, jj)] for jj in range(plan.grid.cols)]
            todo = [s for s in range(plan.stripe_count(i)) if not all(s in d for d in row)]
            log = rs.DoneLog(staged, comm.rank, fresh=not resumed) if args.resume else None
            writer = StripeWriter(args.output, pid, (m, n), dtype, header,
                                  aligned=chunks is not None)
            executor = get_executor(backend, np.dtype(plan.grid.acc_dtype), on_gpu=on_gpu,
                                    precision=precision)
            warm = []
            comms = None
            if not direct:
                with phases.phase("startup"):
                    comms = grid_comms(comm, plan.grid, on_gpu=on_gpu, device=device)
                    warm = _warm_links(comms, plan.grid.acc_dtype) if on_gpu else []
            bar = progress(len(todo)) if progress is not None else None

            def written(stripe):
                if log is not None:  # a zarr folder's chunk files of the stripe flushed first
                    log.add(stripe, (*plan.stripe_rows(i, stripe), c0, c1))
                if bar is not None:
                    bar.update(1)

            sources = (PanelSource(a, name=args.a), PanelSource(b, name=args.b))
            try:
                with executor:
                    flags = run_stripes(plan, comm.rank, *sources,
                                        writer if log is None else log.summed(writer), executor,
                                        comms, watch, phases, on_gpu=on_gpu, todo=todo,
                                        skip=mine, on_written=written, share_b=share)
            finally:
                for source in sources:
                    source.close()
            if bar is not None:
                bar.close()
            del warm
        except BaseException as exc:  # noqa: BLE001 - the ranks agree on it below
            error = exc
            if exc is not watch.held:  # a held error: every peer finishes its broadcasts
                watch.tell(*reversed(_judged(exc, judge)))
        finally:
            if writer is not None:
                writer.close()
                outcome.written_direct = writer.written_direct
            if log is not None:
                log.close()
        with phases.phase("wait"):
            mine_report = None if error is None else (*_judged(error, judge),
                                                      isinstance(error, PeerStopped))
            reports, raised = zip(*comm.allgather((mine_report, flags)))
        failures = [rep for rep in reports if rep is not None]
        if not failures:  # every rank's flags, reported alike on each, as numpy's product would
            try:  # (under the errstate and warning filters in force: raised on every rank)
                report(set().union(*raised))
            except Exception as exc:  # noqa: BLE001 - the same on every rank
                error = exc
                failures = [(*_judged(exc, judge), False)]
        changed = None
        if inputs and not failures:  # rank 0, once every rank has read all it reads: the
            try:  # inputs looked at again, while they are open
                changed = rs.mismatch(inputs, rs.inputs_now(args.a, a, args.b, b))
            except OSError as exc:  # deleted, say
                changed = f"an input can no longer be looked at ({exc})"
        close_sources(a, b)
        comm.Barrier()  # every rank's HDF5 inputs closed before rank 0 opens C's file, which
        # may be theirs, for writing (HDF5's lock refuses a file another process holds)
        if failures:
            origin = next((rep for rep in failures if not rep[2]), failures[0])
            outcome.status, outcome.message = origin[0], origin[1]
            outcome.error = error
        with phases.phase("commit"):
            commit_error = None
            if comm.rank == 0 and pid is not None:
                try:
                    if changed:  # C would mix old and new data: not moved into place
                        _finish(args, pid, ok=False, keep=False)
                    else:
                        commit_error = _finish(args, pid, ok=not failures,
                                               keep=bool(args.resume))
                except Exception as exc:  # noqa: BLE001
                    commit_error = f"{type(exc).__name__}: {exc}"
            commit_error, changed = comm.bcast((commit_error, changed), root=0)
        if changed:  # bad input, found while reading it: as the single-process command's
            outcome.status = 2
            outcome.message = f"{changed} while the product ran; {args.output} was not written"
        elif commit_error and not failures:
            outcome.status = 1
            outcome.message = f"writing {args.output} failed while moving it into place ({commit_error})"
        if outcome.status and args.resume and pid is not None and comm.rank == 0:
            staged = staged_path(parse_spec(args.output).path, pid)
            if staged.exists():
                try:
                    kept = sum(len(rs.read_done(staged, r)) for r in range(comm.size))
                    said = (f"{kept} of {_stripes(outcome.plan)} C stripes kept in "
                            f"{staged.name}")
                except OSError as exc:  # this process's limit: not "0 of N"
                    said = (f"C stripes kept in {staged.name} (how many cannot be told: "
                            f"{os.strerror(exc.errno).lower()}, so their logs cannot be "
                            f"read)")
                outcome.message += f"; {said}: run the same command with --resume to finish"
        watch.close()  # before the caller's handlers are back: a signal now changes nothing
    return outcome


def _stripes(plan: BatchPlan | None) -> int:
    """Stripes of all ranks together."""
    if plan is None:
        return 0
    g = plan.grid
    return sum(plan.stripe_count(g.coords(r)[1]) for r in range(g.ranks))


def _host_available(comm) -> int:
    """The available host memory of the rank with the least (``plan_batch.b_fits_host``:
    whether CPU ranks may each hold all of B); the same on every rank."""
    from distmm.config import host_available

    return int(comm.allreduce(host_available(), op=_min()))


def _min():
    from mpi4py import MPI

    return MPI.MIN


def _warm_links(comms, dtype) -> list:
    """Queue a one-element broadcast on each NCCL communicator: NCCL connects its peers on
    first use, and this way that happens while the ranks read B, not in the first panel's
    broadcast."""
    import cupy

    buffers = []
    for broadcaster in (comms.row, comms.col):
        if getattr(broadcaster, "nccl", None) is not None:
            buffers.append(cupy.zeros(1, dtype=dtype))
            broadcaster.ibcast(buffers[-1], 0)
    return buffers  # the caller keeps them until the product ends (NCCL writes into them)


def _finish(args, pid: int, *, ok: bool, keep: bool):
    """Rank 0: commit (and drop the manifest and logs), or remove, or keep for ``--resume``."""
    staged = staged_path(parse_spec(args.output).path, pid)
    try:
        if ok:
            try:
                finish_staged(args.output, pid, True, overwrite=args.overwrite)
            except BaseException:
                if not keep:  # (C written while this run computed, a failed copy): gone
                    remove_leftover(staged)
                raise
            remove_leftover(staged)  # its manifest, logs and lock (C is in place)
            return None
        if keep and staged.exists():
            lock = Path(f"{staged}.lock")
            lock.unlink(missing_ok=True)
            return None
        remove_leftover(staged)
        return None
    finally:
        release(_HELD.pop(pid, None))


def close_sources(*arrays) -> None:
    """Close HDF5 inputs (rank 0 may open the target file for writing next)."""
    for x in arrays:
        handle = getattr(x, "file", None)
        if handle is not None:
            try:
                handle.close()
            except Exception:  # noqa: BLE001 - already closed
                pass
