"""The scheduler of a ``distributed.Client``, as the Dask engine's modules name it.

This module covers: ``scheduler_address``, the address of a client's scheduler (None where
there is none to read: no client, or one that no longer knows it), which keys what is kept
per cluster (``transfer``'s IPC probe and export plugin, ``nccl_route``'s communicators and
send handler) and names the scheduler in a ``distmm.errors.SchedulerLost``.
It does *not* cover: whether a scheduler was lost, or the words that say so (the package's
``DaskEngine``, ``eager.client_gone``).
"""
from __future__ import annotations

__all__ = ["scheduler_address"]


def scheduler_address(client) -> str | None:
    """The address of ``client``'s scheduler (``client.scheduler.address``), or None."""
    return getattr(getattr(client, "scheduler", None), "address", None)
