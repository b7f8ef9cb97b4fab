"""The tuning cache: kernel configurations and backend preferences ``distmm tune`` measured.

This module covers: where the cache lives (``cache_dir``, ``cache_path``), reading it
(``load_tuning``, ``load_tuning_for``: a missing, unreadable or other-version file reads as
empty; ``read_cache``: strictly, refusing a file that is not such a cache), writing one entry
atomically (``store_tuning``, which refuses, as ``read_cache`` does, to replace a file that is
not a cache of this version), ``tuning_for(gpu)``, the entries of one GPU model read once
per process (the GPU executor's hot path never reads the file; ``store_tuning`` in this
process refreshes it), and ``usable_entry``: one entry checked against this distmm's kernel
before anything is compiled or chosen with it (an entry that does not fit, hand-edited or
written by a distmm whose kernels have changed since, is ignored with one warning).

It does *not* cover: the kernels and their parameter constraints
(``distmm.executor.registry``), measuring (``distmm.cli.tune``), or choosing a backend
(``distmm.executor.gpu``). Pure Python and numpy.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np

from distmm.jsonfile import json_file

__all__ = ["cache_dir", "cache_path", "load_tuning", "load_tuning_for", "read_cache",
           "store_tuning", "tuning_for", "usable_entry", "entry_problem", "CACHE_VERSION",
           "SHAPE_CLASSES"]

log = logging.getLogger("distmm.executor.tuning")

CACHE_VERSION = 1

#: the size classes of an entry's ``prefer`` (``distmm.executor.gpu.shape_class``)
SHAPE_CLASSES = ("small", "medium", "large", "skinny")


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
            entry = _cached[key] = _entries_of(gpu, cache_path())
    return dict(entry)


def _entries_of(gpu: str, path: Path) -> dict:
    """``gpu``'s entries in the cache at ``path`` as ``read_cache`` checks it; a file there
    that is no cache of this version (broken JSON, another version, a folder) is named in one
    warning and read as empty: the kernels' defaults."""
    try:
        data = read_cache(path)
    except (OSError, ValueError) as exc:
        log.warning("distmm: the tuning cache is not used (%s); distmm's kernels run with "
                    "their defaults (`distmm tune` rewrites it)", exc)
        return {}
    return dict(data["gpus"].get(gpu, {}))


def entry_problem(entry, spec, dtype, cc: int = 90) -> str | None:
    """One phrase naming why ``entry`` (a cache entry: ``kernel``, ``params``, ``prefer``) is
    not one that ``distmm tune`` of this distmm stores for kernel ``spec`` (the registry's
    ``best_kernel()``), ``dtype`` and compute capability ``cc``, or None."""
    import distmm.executor.registry as registry

    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not an object"
    if entry.get("kernel") != spec.name:
        return f"kernel {entry.get('kernel')!r}, not this distmm's {spec.name!r}"
    problem = registry.config_problem(spec, dtype, entry.get("params"), cc)
    if problem is not None:
        return f"params: {problem}"
    prefer = entry.get("prefer", {})
    if not isinstance(prefer, dict):
        return f"prefer: a {type(prefer).__name__}, not an object"
    for cls, choice in prefer.items():
        if cls not in SHAPE_CLASSES or choice not in ("raw", "cublas"):
            return (f"prefer: {cls!r}: {choice!r} is not one of {', '.join(SHAPE_CLASSES)} "
                    f"mapped to 'raw' or 'cublas'")
    return None


_warned: set = set()


def usable_entry(entries, dtype, spec, cc: int = 90, *, gpu: str = "",
                 path: Path | None = None) -> dict:
    """The entry of ``entries`` (one GPU's, ``tuning_for``) for ``dtype``, when
    ``entry_problem`` finds none in it for ``spec`` on compute capability ``cc``; else
    ``{}``: the registry's defaults and, for ``backend="auto"``, the choice made before any
    tuning. An entry that is there but does not fit is named in one warning per process
    (the cache file, GPU and dtype, what is wrong, and what is used instead)."""
    dtype = np.dtype(dtype).name
    entry = entries.get(dtype) if isinstance(entries, dict) else None
    if entry is None:
        return {}
    problem = entry_problem(entry, spec, dtype, cc)
    if problem is None:
        return entry
    path = Path(path) if path else cache_path()
    key = (str(path), gpu, dtype, problem)
    with _lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        said = ", ".join(f"{k}={v}" for k, v in spec.params(dtype).items()) or "none"
        log.warning("%s: ignoring the %s entry of %s (%s); using %s's defaults (%s) and, for "
                    "backend 'auto', the choice made before tuning; run `distmm tune` again",
                    path, dtype, gpu or "this GPU", problem, spec.name, said)
    return {}
