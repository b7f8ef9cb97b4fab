"""The current CUDA device's identity and properties, read once per device.

This module covers: ``device_properties(device)`` (cupy's
``getDeviceProperties`` dict, cached per device id: the driver call costs tens
of microseconds and the answer never changes in a process), ``gpu_name`` (the
name the driver reports, as ``str``), ``current_device()`` and ``device_count()``.

It does *not* cover: memory (``distmm.executor.pipeline.device``), kernels, or
choosing a backend. cupy is imported inside the functions, so importing this
module needs no GPU.
"""
from __future__ import annotations

import functools

__all__ = ["device_properties", "gpu_name", "current_device", "device_count"]


def current_device() -> int:
    """The id of cupy's current CUDA device."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=None)
def device_count() -> int:
    """CUDA devices visible to this process (0 without a driver)."""
    import cupy

    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver
        return 0


@functools.lru_cache(maxsize=None)
def device_properties(device: int) -> dict:
    """The driver's properties of ``device`` (``name`` as ``str``), cached per id."""
    import cupy

    props = dict(cupy.cuda.runtime.getDeviceProperties(int(device)))
    name = props.get("name", "")
    props["name"] = name.decode() if isinstance(name, bytes) else str(name)
    return props


def gpu_name(device: int | None = None) -> str:
    """The name of ``device`` (default: the current one), e.g. ``"NVIDIA H100 80GB HBM3"``."""
    return device_properties(current_device() if device is None else int(device))["name"]
