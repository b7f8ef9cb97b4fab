"""Benchmark ``mpi-resume``: a batch job stopped by SIGTERM half way, then resumed.

    python -m bench.mpi_resume --n 32768 --ranks 4 --out-dir DIR

For each repeat, on ``.npy`` operands made once (page cache warm): a whole run of
``mpirun -n P distmm matmul A B -o C --resume`` (its time ``full``), then the same command
stopped by a SIGTERM to every rank at ``--at`` of ``full``, as Slurm's time limit sends it
(the command must fail and leave no output, keeping its staged state), then the rerun with
``--resume`` (its time ``resumed``): the record's ``seconds`` is the rerun's, its ``share_of_full`` the rerun over the
whole run. The resumed C is compared bitwise with the whole run's. ``--ranks 1`` runs one
process without ``mpiexec``. Extra arguments after ``--`` go to ``distmm matmul``.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _command(ranks: int, a: Path, b: Path, c: Path, extra) -> list[str]:
    cmd = [sys.executable, "-m", "distmm", "matmul", str(a), str(b), "-o", str(c), "--resume",
           *extra]
    if ranks > 1:
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
        if mpiexec is None:
            raise SystemExit("mpi_resume: no mpiexec on PATH")
        cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", "--bind-to", "none", *cmd]
    return cmd


def _run(cmd, stop_after: float | None = None) -> tuple[float, int, str]:
    """Run ``cmd``; with ``stop_after``, SIGTERM to its distmm processes (the ranks, or the one
    process, and ``mpiexec`` itself where it is named ``prterun``, as a scheduler's time limit
    signals the whole step) after that many seconds. Every run starts with no dirty page
    cache (``sync`` first): the operands just made, or the last run's output, being written
    back would slow the disk under one run and not the next. Returns (seconds, exit status,
    output)."""
    import psutil

    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if stop_after is not None:
        try:
            proc.wait(timeout=stop_after)
        except subprocess.TimeoutExpired:
            me = psutil.Process(proc.pid)
            for p in [me] + me.children(recursive=True):
                try:
                    if "distmm" in " ".join(p.cmdline()) and "mpiexec" not in p.name():
                        p.send_signal(signal.SIGTERM)
                except psutil.Error:
                    pass
    out, err = proc.communicate(timeout=600)
    return time.perf_counter() - t0, proc.returncode, (out + err).strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mpi_resume",
                                description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--at", type=float, default=0.5, help="the stop, as a share of a whole run")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work", default="/tmp/distmm-resume")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--profile-dir", default=None,
                   help="each run's distmm matmul --profile, as resume-<repeat>-<whole|stopped|"
                        "resumed>.json here (a stopped run writes its profile too)")
    p.add_argument("extra", nargs="*", help="arguments for distmm matmul (after --)")
    args = p.parse_args(argv)

    from bench.common.records import RecordWriter
    from bench.common.operands import write_operand
    from distmm.cli.records import cpu_model, gpu_name

    from bench.common import local_gpus

    gpu = local_gpus() > 0  # none: the CPU path, for a smoke run
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    n, dtype = args.n, np.dtype(args.dtype)
    a, b = work / f"a{n}.npy", work / f"b{n}.npy"
    for path, seed in ((a, 1), (b, 2)):
        if not path.exists():
            write_operand(path, n, n, dtype, seed, gpu)
    whole, c = work / f"whole{n}.npy", work / f"c{n}.npy"
    writer = RecordWriter("mpi-resume", gpu_name() if gpu else cpu_model(),
                          out_dir=args.out_dir, ranks=args.ranks,
                          ompi_mca_btl=os.environ.get("OMPI_MCA_btl", "default"))
    def extra(rep: int, which: str) -> list[str]:
        if args.profile_dir is None:
            return list(args.extra)
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        return [*args.extra, "--profile", str(Path(args.profile_dir) / f"resume-{rep}-{which}.json")]

    for rep in range(args.repeat):
        for path in (whole, c):
            path.unlink(missing_ok=True)
        full, rc, text = _run(_command(args.ranks, a, b, whole, extra(rep, "whole")))
        if rc:
            print(f"whole run failed (exit {rc}): {text[-800:]}", flush=True)
            return 1
        stopped, stop_rc, text = _run(_command(args.ranks, a, b, c, extra(rep, "stopped")),
                                      stop_after=args.at * full)
        if stop_rc == 0 or c.exists():
            print(f"the stop at {args.at * full:.2f} s did not leave a resumable run (exit {stop_rc}, "
                  f"output {'present' if c.exists() else 'absent'}): {text[-400:]}", flush=True)
            return 1
        resumed, rc, text = _run(_command(args.ranks, a, b, c, extra(rep, "resumed")))
        if rc:
            print(f"resumed run failed (exit {rc}): {text[-800:]}", flush=True)
            return 1
        same = filecmp.cmp(whole, c, shallow=False)
        rec = writer.add(f"resumed-{args.ranks}", dtype, n, n, n, resumed, None,
                         full_seconds=full, stopped_after=stopped, stop_at=args.at,
                         stop_to_exit=stopped - args.at * full,
                         share_of_full=resumed / full, bitwise_equal=same,
                         stopped_status=stop_rc,
                         note="a whole run, then one stopped by SIGTERM to its ranks and resumed")
        print(f"n={n} ranks={args.ranks}: whole {full:.2f} s; stopped at {stopped:.2f} s "
              f"({stopped - args.at * full:.2f} s after the signal); "
              f"resumed {resumed:.2f} s = {rec['share_of_full']:.2f} of whole; bitwise "
              f"{'equal' if same else 'DIFFERENT'}", flush=True)
        if not same:
            return 1
    for path in (whole, c):
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
