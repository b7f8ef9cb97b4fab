"""What every benchmark in ``bench/`` shares, in one place: import it from ``bench.common``.

- ``records``: the command line every benchmark has (``parser``), device naming and the commit
  measured, tidy records as /work/shared/BENCH_RECORDS.md defines them (``RecordWriter``,
  ``load``);
- ``timing``: wall-clock and CUDA-event medians, the sustained clock of a GPU loop;
- ``operands``: float64 error checks and fresh random GPU operands;
- ``clusters``: the embedded Dask clusters (``distmm.cli.cluster``'s, and what only the
  benchmarks add: CPU workers beside GPU workers, the GPU workers' addresses, a cluster
  emptied between measurements) and the operands made on their workers;
- ``peers``: what the MPI benchmark and its peers (heat, nvmath-python) share.

It does not cover any workload (one script per workload: ``bench/cpu.py``, ``dask_cpu.py``,
``kernels.py``, ``pipeline.py``, ...), plots (``plot_kernels.py``) or research probes
(``bench/research/``). Importing it needs neither cupy, mpi4py nor a GPU: they are imported
inside the functions that need them.
"""
from __future__ import annotations

from bench.common.clusters import (GPU_RESOURCE, add_cpu_workers, cpu_cluster, gpu_cluster,
                                   gpu_workers, local_gpus, random_array, release_cluster,
                                   share_workers, sync_workers, to_host)
from bench.common.operands import random_operands, raw_runner, relerr, relerr_gpu
from bench.common.peers import SAMPLE_ROWS, check_rows, peer_import, threads_per_rank
from bench.common.records import (RESULTS, RecordWriter, cpu_model, git_commit, gpu_name, load,
                                  parser, slug)
from bench.common.timing import (alternating_seconds, event_alternating, event_seconds, free_gpu,
                                 gpu_sync, median_seconds, sustained_clock, wall_times)

__all__ = ["GPU_RESOURCE", "add_cpu_workers", "cpu_cluster", "gpu_cluster", "gpu_workers",
           "local_gpus", "random_array", "release_cluster", "share_workers", "sync_workers",
           "to_host", "random_operands", "raw_runner", "relerr", "relerr_gpu", "SAMPLE_ROWS",
           "check_rows", "peer_import", "threads_per_rank", "RESULTS", "RecordWriter",
           "cpu_model", "git_commit", "gpu_name", "load", "parser", "slug", "alternating_seconds",
           "event_alternating", "event_seconds", "free_gpu", "gpu_sync", "median_seconds",
           "sustained_clock", "wall_times"]
