"""Batch-job benchmark (``mpi-batch``): ``mpirun -n P distmm matmul A.npy B.npy -o C.npy``.

Times the command a batch user runs, file to file, against what plain tools take in the
same run on the same machine: reading both inputs (``cat A B > /dev/null``, page cache warm,
as the command finds them), writing an output of C's size with ``dd ... conv=fsync``, and
in-core cuBLAS (``cupy.matmul`` on device-resident operands of the same size, one GPU). The
target a run is judged by is ``read + write + gemm / P``.

For each size, the operands are written once as ``.npy`` files in ``--work`` (random values
made on the GPU, or with numpy without one); then for each rank count ``P`` the command runs
``--repeat`` times (``P = 1`` also without ``mpirun``: variant ``distmm-cli``, the plain
command without ``--profile``, which would run it through the MPI engine; ``batch-1`` is
that), every other run with ``--profile``, and its output is checked on sampled rows against
a float64 product before it is deleted. One record per (variant, size) with the median wall
time; the per-phase totals of the median run's profile go into the record (``phases``), and
every profile into one JSON file beside the records.

``python -m bench.mpi_batch --sizes 32768 --ranks 1 2 4 --repeat 1 --work /tmp/batch``
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import RecordWriter, cpu_model, gpu_name, local_gpus, parser
from bench.common.operands import write_operand
from bench.common.timing import incore_gemm_seconds


def sampled_relerr(a_path: Path, b_path: Path, c_spec: str, rows: int = 32, cols: int = 256,
                   seed: int = 0) -> float:
    """``norm(C[s, w] - A[s] @ B[:, w]) / norm(A[s] @ B[:, w])`` in float64, over ``rows`` random
    rows ``s`` and a random window ``w`` of ``cols`` columns (a fresh pick per call)."""
    from distmm.cli.io import open_operand

    a = np.load(a_path, mmap_mode="r")
    b = np.load(b_path, mmap_mode="r")
    c = open_operand(c_spec)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(a.shape[0], size=min(rows, a.shape[0]), replace=False))
    c0 = int(rng.integers(0, max(1, b.shape[1] - cols)))
    w = slice(c0, min(b.shape[1], c0 + cols))
    ref = np.asarray(a[pick], dtype=np.float64) @ np.asarray(b[:, w], dtype=np.float64)
    got = np.asarray(c[pick, w] if not hasattr(c, "file") else c[pick.tolist(), w],
                     dtype=np.float64)
    handle = getattr(c, "file", None)
    if handle is not None:
        handle.close()
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def remove_output(spec: str) -> None:
    path = Path(spec.split(":")[0])
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def timed(cmd: list[str], env=None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, proc


def read_seconds(paths) -> float:
    """``cat`` of the files to /dev/null (run twice, the second timed: the cache as warm as
    the command will find it)."""
    cmd = ["sh", "-c", "cat " + " ".join(map(str, paths)) + " > /dev/null"]
    timed(cmd)
    return timed(cmd)[0]


def write_seconds(folder: Path, nbytes: int) -> float:
    """``dd`` of ``nbytes`` zeros into a new file with ``conv=fsync``."""
    target = folder / "dd-probe.bin"
    mib = max(1, nbytes >> 20)
    try:
        sec, proc = timed(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}",
                           "conv=fsync", "status=none"])
        if proc.returncode:
            raise RuntimeError(f"dd failed: {proc.stderr.strip()}")
        return sec
    finally:
        target.unlink(missing_ok=True)


def main(argv=None) -> int:
    p = parser(__doc__, prog="python -m bench.mpi_batch")
    p.add_argument("--sizes", type=int, nargs="+", default=[32768])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--work", default="/tmp/distmm-batch", help="folder for the operand files")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more options for distmm matmul (e.g. --backend cublas)")
    p.add_argument("--no-cli", action="store_true", help="skip the single-process commands")
    p.add_argument("--label", default="",
                   help="appended to every variant's name (a setting compared in the same run)")
    p.add_argument("--gemm-repeat", type=int, default=3, help="timed in-core cuBLAS products")
    p.add_argument("--binding", choices=["none", "default"], default="none",
                   help="mpirun's CPU binding: none (--oversubscribe --bind-to none) or "
                        "default (mpirun's own: one core a rank for two ranks or fewer)")
    p.add_argument("--formats", nargs="*", default=[], choices=["zarr", "h5"],
                   help="also write C as these formats, at the largest rank count")
    args = p.parse_args(argv)
    gpu = local_gpus() > 0
    device = gpu_name() if gpu else cpu_model()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out_dir) if args.out_dir else None
    writer = RecordWriter("mpi-batch", device, out_dir=args.out_dir, inputs="npy",
                          gpus_visible=_gpus_visible() if gpu else 0,
                          # Open MPI's transports as the launcher passes them (the README's
                          # OMPI_MCA_btl=^ofi skips the libfabric probe in MPI_Init)
                          ompi_mca_btl=os.environ.get("OMPI_MCA_btl", "default"),
                          mpirun_binding=args.binding,
                          mpi_cpus=os.environ.get("DISTMM_MPI_CPUS", "auto"))
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    profiles = {}
    dtype = np.dtype(args.dtype)
    for n in args.sizes:
        a_path, b_path, c_path = work / f"a{n}.npy", work / f"b{n}.npy", work / f"c{n}.npy"
        t = time.perf_counter()
        for path, seed in ((a_path, 1), (b_path, 2)):
            if not path.exists():
                write_operand(path, n, n, dtype, seed, gpu)
        print(f"n={n}: operands ready ({time.perf_counter() - t:.1f} s)", flush=True)
        c_bytes = n * n * dtype.itemsize
        refs = {"read-cat": read_seconds([a_path, b_path]),
                "write-dd-fsync": write_seconds(work, c_bytes)}
        if gpu:
            refs["cublas-incore"] = incore_gemm_seconds(n, dtype, repeat=args.gemm_repeat)
        for name, sec in refs.items():
            writer.add(name, dtype, n, n, n, sec, None, ranks=1,
                       note="reference measured in the same run")
        print("  references: " + ", ".join(f"{k} {v:.2f} s" for k, v in refs.items()), flush=True)
        outputs = {"npy": str(c_path), "zarr": str(work / f"c{n}.zarr"),
                   "h5": f"{work / f'c{n}.h5'}:C"}
        # distmm-cli: one process, the local engine, without --profile; batch-1: one process,
        # the MPI engine's striped path (--engine mpi); mpirun-P: P ranks
        cases = [("distmm-cli", 1, "npy"), ("batch-1", 1, "npy")] if not args.no_cli else []
        cases += [(f"mpirun-{r}", r, "npy") for r in args.ranks]
        cases += [(f"mpirun-{max(args.ranks)}-{f}", max(args.ranks), f) for f in args.formats]
        cases = [(v + args.label, r, f) for v, r, f in cases]
        for variant, ranks, fmt in cases:
            if mpiexec is None and variant.startswith("mpirun"):
                print(f"  {variant}: no mpiexec", flush=True)
                continue
            out = outputs[fmt]
            base = [sys.executable, "-m", "distmm", "matmul", str(a_path), str(b_path), "-o",
                    out, "--overwrite"] + list(args.extra)
            if variant.startswith("batch-1"):
                base += ["--engine", "mpi"]
            if variant.startswith("mpirun"):
                base = [mpiexec, "-n", str(ranks)] + (
                    ["--oversubscribe", "--bind-to", "none"] if args.binding == "none" else []
                ) + base
            runs = []
            for rep in range(args.repeat):
                prof = work / f"profile-{variant}-{n}-{rep}.json"
                remove_output(out)
                launched = time.time()
                # the plain command as a user types it (--profile runs one process through
                # the MPI engine's striped path, as batch-1 does)
                plain = variant.startswith("distmm-cli")
                sec, proc = timed(base + ([] if plain else ["--profile", str(prof)]))
                ended = time.time()
                if proc.returncode:
                    print(f"  {variant}: failed rc={proc.returncode}: {proc.stderr.strip()[-800:]}",
                          flush=True)
                    break
                err = sampled_relerr(a_path, b_path, out, seed=rep)
                data = json.loads(prof.read_text()) if prof.exists() else None
                if data:  # the wall time outside the profile: launch and imports, then exit
                    data["meta"]["before"] = min(r["epoch"] for r in data["ranks"]) - launched
                    data["meta"]["after"] = ended - data["meta"]["written_epoch"]
                runs.append((sec, err, data, proc.stdout.strip().splitlines()[-2:]))
                remove_output(out)
            if not runs:
                continue
            runs.sort(key=lambda r: r[0])
            sec, err, data, lines = runs[len(runs) // 2]
            totals = {}
            if data:
                for rec in data["ranks"]:
                    for k, v in rec["totals"].items():
                        totals[k] = max(totals.get(k, 0.0), v)
                profiles[f"{variant}-{n}"] = data
            target = refs["read-cat"] + refs["write-dd-fsync"] + refs.get("cublas-incore", 0) / ranks
            writer.add(variant, dtype, n, n, n, sec, err, ranks=ranks, repeats=len(runs), output=fmt,
                       all_seconds=[r[0] for r in runs], phases=totals,
                       grid=(data or {}).get("meta", {}).get("grid"),
                       batch_panels=(data or {}).get("meta", {}).get("batch_panels"),
                       launch_seconds=(data or {}).get("meta", {}).get("before"),
                       exit_seconds=(data or {}).get("meta", {}).get("after"),
                       target_seconds=target, over_target=sec / target,
                       written_direct=sum(r.get("written_direct", 0)
                                          for r in (data or {}).get("ranks", [])),
                       direct_writes=os.environ.get("DISTMM_DIRECT_WRITES", "true"))
            meta = (data or {}).get("meta", {})
            print(f"  {variant}: {sec:.2f} s (target {target:.2f} s, x{sec / target:.2f}), "
                  f"relerr {err:.1e}; launch {meta.get('before', float('nan')):.2f} s, exit "
                  f"{meta.get('after', float('nan')):.2f} s; {lines[0] if lines else ''}", flush=True)
        for path in (a_path, b_path):
            if len(args.sizes) > 1:
                path.unlink(missing_ok=True)
    if profiles:
        dest = (out_dir or Path(writer.path).parent) / f"mpi-batch-profiles-{writer.run}.json"
        dest.write_text(json.dumps(profiles))
    return 0


def _gpus_visible() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


if __name__ == "__main__":
    raise SystemExit(main())
