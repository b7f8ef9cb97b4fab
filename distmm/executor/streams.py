"""Streams for work a GEMM waits on: at the device's greatest priority.

This module covers: ``urgent_stream()``, a non-blocking cupy stream created at the
current device's greatest stream priority, for the work that the next GEMM waits on
while the current one runs (NCCL's panel broadcasts, the copies that assemble a block
task's next panels). The block scheduler hands a freed SM to a waiting block of a
higher-priority stream before the next block of a running GEMM, so a broadcast's or a
copy's kernel starts as soon as one of the GEMM's blocks ends, instead of after the
GEMM's last block has been dispatched (the delay NCCL's own tracker describes, issue
1431). Whether it shortens a product is in ``bench/NOTES.md`` (priority streams).

``distmm-debug.stream-priority`` (dask configuration, outside the checked ``distmm``
section; ``DASK_DISTMM_DEBUG__STREAM_PRIORITY=false``) turns the priority off, so a
benchmark can compare both in one run.
It does *not* cover: the compute streams (the executors') or what runs on these.
"""
from __future__ import annotations

__all__ = ["urgent_stream", "PRIORITY_KEY", "priority_wanted"]

#: debug configuration: False creates the streams at the default priority
PRIORITY_KEY = "distmm-debug.stream-priority"
#: the priority asked for (lower is more urgent): far past any device's greatest, clamped to it
PRIORITY_ASKED = -(1 << 20)


def priority_wanted() -> bool:
    """Whether streams are made at the greatest priority (``PRIORITY_KEY``, default True)."""
    import dask.config

    value = dask.config.get(PRIORITY_KEY, True)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def urgent_stream():
    """A non-blocking stream of the current device at its greatest priority (the default
    priority where ``PRIORITY_KEY`` is off). The driver clamps a priority beyond the
    device's range to its end (``cudaStreamCreateWithPriority``), so ``PRIORITY_ASKED``
    gives the greatest whatever the range."""
    import cupy

    if priority_wanted():
        return cupy.cuda.Stream(non_blocking=True, priority=PRIORITY_ASKED)
    return cupy.cuda.Stream(non_blocking=True)
