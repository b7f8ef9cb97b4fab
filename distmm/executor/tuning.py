"""The tuning cache: kernel configurations and backend preferences ``distmm tune`` measured.

This module covers: where the cache lives (``cache_dir``, ``cache_path``), reading it
(``load_tuning``, ``load_tuning_for``: a missing, unreadable or other-version file reads as
empty; ``read_cache``: strictly, refusing a file that is not such a cache), writing one entry
atomically (``store_tuning``, which refuses, as ``read_cache`` does, to replace a file that is
not a cache of this version), and ``tuning_for(gpu)``, the entries of one GPU model read once
per process (the GPU executor's hot path never reads the file; ``store_tuning`` in this
process refreshes it).

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

from distmm.jsonfile import json_file

__all__ = ["cache_dir", "cache_path", "load_tuning", "load_tuning_for", "read_cache",
           "store_tuning", "tuning_for", "CACHE_VERSION"]


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


def read_cache(path: Path | None = None, *, must_exist: bool = False) -> dict:
    """The cache at ``path`` (default ``cache_path()``), checked: ``{"version": CACHE_VERSION,
    "gpus": {name: {dtype: entry}}}`` with objects for the GPUs and entries. A missing file
    is an empty cache, or ``FileNotFoundError`` with ``must_exist``; anything else that is
    not such a cache raises ``ValueError`` naming the file and what is wrong."""
    path = Path(path) if path else cache_path()
    if not path.exists() and not must_exist:
        return {"version": CACHE_VERSION, "gpus": {}}
    if path.is_dir():
        raise IsADirectoryError(21, "a folder, not a tuning cache file", str(path))
    data = json_file(path)
    if not isinstance(data, dict) or "version" not in data:
        raise ValueError(f"{path}: not a distmm tuning cache (a JSON object with 'version' "
                         f"and 'gpus')")
    if data["version"] != CACHE_VERSION:
        raise ValueError(f"{path}: tuning cache version {data['version']!r}; this distmm "
                         f"reads version {CACHE_VERSION}")
    gpus = data.setdefault("gpus", {})
    if not isinstance(gpus, dict) or not all(
            isinstance(entries, dict) and all(isinstance(e, dict) for e in entries.values())
            for entries in gpus.values()):
        raise ValueError(f"{path}: the tuning cache's 'gpus' must map each GPU to an object "
                         f"of entries by dtype")
    return data


def store_tuning(gpu: str, dtype: str, entry: dict, path: Path | None = None) -> Path:
    """Write one entry (atomically: a temporary file, then rename) into the cache at ``path``
    as ``read_cache`` reads it: a file that is not a cache of this version raises its error
    and is left as it was."""
    path = Path(path) if path else cache_path()
    data = read_cache(path)
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
