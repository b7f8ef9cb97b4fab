"""distmm's configuration: one frozen object read through ``dask.config``.

This module covers: the defaults in ``distmm.yaml``, user overrides through
dask's config files and ``dask.config.set``, and ``DISTMM_*`` environment
variables. It does *not* cover: per-call keyword arguments, which win over it.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

import dask.config
import yaml
from dask.utils import parse_bytes

__all__ = ["Config", "get_config"]

_defaults = yaml.safe_load((Path(__file__).parent / "distmm.yaml").read_text())
dask.config.update_defaults(_defaults)


def _env_overrides() -> dict:
    out = {}
    for key, raw in os.environ.items():
        if not key.startswith("DISTMM_"):
            continue
        name = key[len("DISTMM_"):].lower().replace("_", "-")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[f"distmm.{name}"] = value
    return out


def _bytes(value) -> int | None:
    if value is None:
        return None
    return int(parse_bytes(value)) if isinstance(value, str) else int(value)


@dataclass(frozen=True)
class Config:
    engine: str
    backend: str
    tile: int | tuple[int, int, int] | None
    memory_budget: int
    device_memory_limit: int | None
    pinned_pool: int
    local_threads: int | None
    progress: bool | None = None
    performance_report: str | None = None


def get_config() -> Config:
    """Read the current configuration (environment variables win over files)."""
    with dask.config.set(_env_overrides()):
        c = dask.config.get("distmm")
    tile = c.get("tile")
    if isinstance(tile, list):
        tile = tuple(int(t) for t in tile)
    return Config(
        engine=str(c["engine"]),
        backend=str(c["backend"]),
        tile=tile,
        memory_budget=_bytes(c["memory-budget"]),
        device_memory_limit=_bytes(c.get("device-memory-limit")),
        pinned_pool=_bytes(c["pinned-pool"]),
        local_threads=c.get("local-threads"),
        progress=c.get("progress"),
        performance_report=c.get("performance-report"),
    )
