"""The tuning cache: kernel configurations and backend preferences ``distmm tune`` measured.

This module covers: where the cache lives (``cache_dir``, ``cache_path``), reading it
(``load_tuning``, ``load_tuning_for``; a missing, unreadable or other-version file reads as
empty), writing one entry atomically (``store_tuning``), and ``tuning_for(gpu)``, the
entries of one GPU model read once per process (the GPU executor's hot path never reads
the file; ``store_tuning`` in this process refreshes it).

It does *not* cover: the kernels and their parameter constraints
(``distmm.executor.registry``), measuring (``distmm.cli.tune``), or choosing a backend
(``distmm.executor.gpu``). Pure Python and numpy.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

__all__ = ["cache_dir", "cache_path", "load_tuning", "load_tuning_for", "store_tuning",
           "tuning_for", "CACHE_VERSION"]


CACHE_VERSION = 1


def cache_dir() -> Path:
    """``$DISTMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/distmm``, else ``~/.cache/distmm``."""
    if os.environ.get("DISTMM_CACHE_DIR"):
        return Path(os.environ["DISTMM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distmm"


def cache_path() -> Path:
    return cache_dir() / "tune.json"


def load_tuning(path: Path | None = None) -> dict:
    """The whole cache (``{"version": 1, "gpus": {name: {dtype: entry}}}``); empty when
    missing, unreadable or of another version."""
    path = Path(path) if path else cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": CACHE_VERSION, "gpus": {}}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {"version": CACHE_VERSION, "gpus": {}}
    data.setdefault("gpus", {})
    return data


def load_tuning_for(gpu: str, path: Path | None = None) -> dict:
    """Entries of one GPU model, keyed by dtype name."""
    return dict(load_tuning(path)["gpus"].get(gpu, {}))


def store_tuning(gpu: str, dtype: str, entry: dict, path: Path | None = None) -> Path:
    """Write one entry (atomically: a temporary file, then rename)."""
    path = Path(path) if path else cache_path()
    data = load_tuning(path)
    data["gpus"].setdefault(gpu, {})[np.dtype(dtype).name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    with _lock:
        _cached.clear()
    return path


_lock = threading.Lock()
_cached: dict = {}


def tuning_for(gpu: str) -> dict:
    """``load_tuning_for(gpu)`` from the default cache file, read once per process and
    cache location (a copy; ``store_tuning`` here refreshes it)."""
    key = (gpu, str(cache_path()))
    with _lock:
        entry = _cached.get(key)
        if entry is None:
            entry = _cached[key] = load_tuning_for(gpu)
    return dict(entry)
