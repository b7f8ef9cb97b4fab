"""distmm's configuration: one frozen object read through ``dask.config``.

This module covers: the keys and their defaults (``distmm.yaml``), reading
them through ``dask.config.get("distmm.<key>")``, the ``DISTMM_<KEY>``
shorthand for ``DASK_DISTMM__<KEY>``, checking every value (one ``ValueError``
naming the key), and the memory budget a plan gets when none is configured
(``memory_budget``: a fraction of what the worker, the GPU or the machine has).

It does *not* cover: per-call keyword arguments (``tile=``, ``backend=``, ...),
which win over it, nor an engine's own hints (``distmm.api.plan_for`` takes
the lower of the configured and the hinted memory budget).

Where a value comes from, lowest precedence first:

1. ``distmm.yaml`` beside this file (the defaults);
2. YAML files in dask's config paths (``~/.config/dask/*.yaml``, ``$DASK_CONFIG``),
   under a ``distmm:`` key;
3. ``DISTMM_<KEY>`` environment variables (``DISTMM_MEMORY_BUDGET=4GiB``): when
   distmm is imported each one is copied to ``DASK_DISTMM__<KEY>`` unless that
   is set, so it then behaves as dask's own form (``dask.config.refresh()`` and
   worker processes see it); one spelt almost as a key (``DISTMM_PRECISON``) is
   copied too, and fails as an unknown key naming the variable. One set in ``os.environ``
   after the import is not read, not even by ``dask.config.refresh()`` (which reads
   ``DASK_DISTMM__<KEY>`` set since);
4. ``DASK_DISTMM__<KEY>`` environment variables, dask's convention (``_`` and
   ``-`` in a key are the same key);
5. ``dask.config.set({"distmm.<key>": value})``.

An empty value (``DISTMM_MEMORY_BUDGET=`` in a job script, ``""`` or blanks from any of these)
is no setting, for every key: the key takes what the sources before it give (dask reads
``DASK_X=`` as the string ``""``, which no key takes as a value).

``get_config`` reads the keys once per change of the ``distmm`` section, not
once per call. A bad value's ``ValueError`` names the variable or the YAML file it came from;
a YAML file in dask's config paths that cannot be opened, which dask skips without a word,
is named in a ``RuntimeWarning``.
"""
from __future__ import annotations

import copy
import difflib
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import dask.config
import numpy as np
import yaml
from dask.utils import parse_bytes, parse_timedelta

from distmm.errors import ConfigError
from distmm.plan import MAX_WORKERS, PRECISIONS

__all__ = ["Config", "get_config", "memory_budget", "available_cpus", "host_available",
           "address_space_left", "KEYS",
           "HOST_FRACTION", "WORKER_FRACTION", "GPU_FRACTION", "where_set", "yaml_file",
           "fallback"]

_defaults = yaml.safe_load((Path(__file__).parent / "distmm.yaml").read_text())
_given = dask.config.config.get("distmm")  # a YAML file's or DASK_DISTMM's, before the defaults
dask.config.update_defaults(_defaults)
if _given is not None and not isinstance(_given, dict):
    # update_defaults put the defaults in its place (a `distmm: [...]` file was ignored, where
    # after dask.config.refresh() it fails): kept, so that it fails from the first call
    dask.config.config["distmm"] = _given

#: every configuration key, as distmm.yaml spells it
KEYS: tuple[str, ...] = tuple(_defaults["distmm"])

#: the auto memory budget's share of what the process has (see ``memory_budget``)
WORKER_FRACTION = 0.5
HOST_FRACTION = 0.5
GPU_FRACTION = 0.5
_AUTO_QUANTUM = 64 * 2**20  # auto budgets are whole multiples of this, so plans stay cached
_AUTO_TTL = 1.0  # seconds an auto budget measured on the host or the GPU is reused


def _env_suffix(key: str) -> str:
    return key.upper().replace("-", "_")


def _blank(value) -> bool:
    """Whether a setting is empty (``DISTMM_X=``, ``""``): no setting."""
    return isinstance(value, str) and not value.strip()


def _feed_distmm_env(environ=os.environ) -> dict:
    """Copy each ``DISTMM_<KEY>`` to ``DASK_DISTMM__<KEY>`` (unless that is set)
    and into the live configuration, as dask does with its own variables when
    it is imported. Other ``DISTMM_*`` variables (``DISTMM_CACHE_DIR``...) are
    not configuration keys and are left alone, except one spelt almost as a key
    (``DISTMM_MEMORY_BUDGTE``), fed as well so that it fails as an unknown key
    rather than being ignored. An empty one is no setting: not fed. Returns what was
    fed."""
    fed = {}
    keys = {_env_suffix(key) for key in KEYS}
    for name in list(environ):
        suffix = name[len("DISTMM_"):]
        if (not name.startswith("DISTMM_") or suffix in keys or "__" in suffix
                or not difflib.get_close_matches(suffix, keys, n=1, cutoff=0.85)):
            continue
        keys.add(suffix)
    for suffix in sorted(keys):
        short, full = "DISTMM_" + suffix, "DASK_DISTMM__" + suffix
        if short in environ and full not in environ and not _blank(environ[short]):
            environ[full] = environ[short]
            fed[full] = environ[short]
    if fed:
        dask.config.update(dask.config.config, dask.config.collect_env(fed))
    return fed


_feed_distmm_env()


@dataclass(frozen=True)
class Config:
    """The distmm configuration in force (see the module docstring for where
    each value comes from). ``memory_budget`` is ``None`` when the key is
    ``"auto"``: ``memory_budget()`` then measures the process's memory."""

    engine: str
    backend: str
    tile: int | tuple[int, int, int] | None
    memory_budget: int | None
    device_memory_limit: int | None
    pinned_pool: int
    local_threads: int | None
    progress: bool | None = None
    performance_report: str | None = None
    retry_timeout: float = 60.0
    memory_budget_from: str = "config"  # "config": bytes given; "auto": measured per call
    dask_layout: str = "auto"
    dask_worker_gflops: tuple | None = None  # ((gpu | cpu | address, GFLOP/s), ...)
    dask_device_transfer: str = "auto"  # auto (IPC, NCCL between hosts) | ipc | tcp
    batch_stripes: int = 8  # stripes per rank of a file-to-file MPI product
    batch_panels: str = "auto"  # auto | read | share | broadcast: how its ranks get their panels
    mpi_cpus: str = "auto"  # auto | keep: a GPU rank bound to one CPU takes its share of the node's
    mpi_join_warning: float = 60.0  # seconds a rank waits for the others to join a call, then warns
    mpi_join_timeout: float | None = None  # seconds after which that rank ends the job; None: never
    precision: str = "highest"  # highest | tf32 | bf16 | fp16 (distmm.precision)
    direct_writes: bool = True  # large spans of .npy/HDF5 outputs written with O_DIRECT
    device_keep: float = 2.0  # seconds the pipeline keeps its device pool for the next product


class _Bad(Exception):
    """A value that does not parse; ``_read`` turns it into one ValueError."""


def _plain(value):
    """numpy scalars (in a list or tuple too) and arrays as the Python scalars and lists they
    hold: a computed ``np.int64(64)`` is a tile as ``64`` is, as numpy's own functions take
    it."""
    if isinstance(value, (np.generic, np.ndarray)):  # an array as the list it holds
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _bytes(value, *, allow_none: bool, minimum: int = 1) -> int | None:
    if value is None:
        if allow_none:
            return None
        raise _Bad("a size is needed (bytes or a string such as '2GiB')")
    if isinstance(value, bool):
        raise _Bad("a size is needed, not a bool")
    try:
        out = value
        if isinstance(value, str):
            try:  # a bare number, as the environment gives it ('1.5' is no whole number of bytes:
                out = float(value)  # parse_bytes made it 1)
            except ValueError:
                out = parse_bytes(value)
        if isinstance(out, float) and not math.isfinite(out):
            raise OverflowError
        if isinstance(out, float) and not out.is_integer():
            raise _Bad("a whole number of bytes is needed")
        out = int(out)
    except (TypeError, ValueError) as e:
        raise _Bad(f"not a size ({e})") from None
    except OverflowError:  # parse_bytes('1e400'): int(inf)
        raise _Bad("not a finite size") from None
    if out < minimum:
        raise _Bad(f"must be at least {minimum} bytes")
    return out


def _positive_int(value, what: str = "a positive integer is", most: int | None = None) -> int:
    if isinstance(value, str) and value.strip().isdecimal():  # isdigit() took '²', int() did not
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(f"{what} needed")
    if most is not None and value > most:
        raise _Bad(f"must be at most {most}")
    return value


def _tile(value):
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != 3:
            raise _Bad("a tile is an int or three ints [tm, tn, tk]")
        return tuple(_positive_int(t, "three positive integers [tm, tn, tk] are") for t in value)
    return _positive_int(value, "a positive integer or [tm, tn, tk] is")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _required_bool(value) -> bool:
    try:
        got = _optional_bool(value)
    except _Bad:
        got = None
    if got is None:
        raise _Bad("true or false is needed")
    return got


def _optional_bool(value):
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        if low in ("null", "none", ""):
            return None
    raise _Bad("true, false or null is needed")


def _name(value, choices: tuple[str, ...] | None = None) -> str:
    if isinstance(value, str):  # blanks around a name, as every other key takes them
        value = value.strip()
    if choices and value not in choices:  # null (YAML's, and so 'none' in the environment) too
        raise _Bad(f"one of {', '.join(choices)} is needed")
    if not isinstance(value, str) or not value:
        raise _Bad("a name is needed")
    return value


def _optional_str(value):
    if value is None or (isinstance(value, str) and value):
        return value
    raise _Bad("a file name or null is needed")


def _seconds(value, *, allow_zero: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float, str))
            or (isinstance(value, str) and not value.strip())):
        # parse_timedelta failed on these with IndexError or AttributeError
        raise _Bad("a duration is needed (seconds or a string such as '60s')")
    if (isinstance(value, (int, float)) and value < 0) or (isinstance(value, str)
                                                         and value.strip().startswith("-")):
        # dask's parse_timedelta reads '-2s' as '1-2' and fails saying so
        raise _Bad("must be a duration of at least 0" if allow_zero
                   else "must be a positive, finite duration")
    try:
        out = float(parse_timedelta(value, default="seconds"))
    except (TypeError, ValueError, KeyError):
        # dask's own message lists its 60 spellings of the units
        try:
            out = float(value)  # 'inf', 'nan'
        except (TypeError, ValueError):
            raise _Bad("not a duration (seconds, or a number and a unit: ms, s, m, h, d, "
                       "w)") from None
    except OverflowError:  # parse_timedelta('1e400'): int(inf)
        out = math.inf
    if not ((out >= 0 if allow_zero else out > 0) and math.isfinite(out)):
        raise _Bad("must be a finite duration, at least 0" if allow_zero
                   else "must be a positive, finite duration")
    if out > threading.TIMEOUT_MAX:  # a threading.Timer or wait longer than this raises
        raise _Bad(f"must be at most {threading.TIMEOUT_MAX:g} s")
    return out


def _gflops(value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Bad("a mapping of gpu, cpu or a worker address to GFLOP/s is needed")
    out = {}
    for key, v in value.items():
        if isinstance(v, bool):
            raise _Bad(f"{key}: a number of GFLOP/s is needed")
        try:
            out[str(key)] = float(v)
        except (TypeError, ValueError):
            raise _Bad(f"{key}: a number of GFLOP/s is needed") from None
        if not (out[str(key)] >= 0 and math.isfinite(out[str(key)])):
            raise _Bad(f"{key}: GFLOP/s must be a finite number, at least 0")
    return tuple(sorted(out.items()))  # hashable, as the rest of Config


def _budget(value):
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return _bytes(value, allow_none=False)


#: distmm.executor.BACKENDS (a layer above), repeated so that a bad value fails here naming
#: its key and where it was set, before any work (an MPI job ignored it; tests compare them)
BACKEND_NAMES = ("auto", "numba", "blas", "raw", "cublas")

# key -> (Config field, parser); the engine names live in distmm.engine (a
# layer above), repeated here so a bad value fails naming its key.
_PARSERS = {
    "engine": ("engine", lambda v: _name(v, ("auto", "local", "dask", "mpi"))),
    "backend": ("backend", lambda v: _name(v, BACKEND_NAMES)),
    "tile": ("tile", _tile),
    "memory-budget": ("memory_budget", _budget),
    "device-memory-limit": ("device_memory_limit", lambda v: _bytes(v, allow_none=True)),
    "device-keep": ("device_keep", lambda v: _seconds(v, allow_zero=True)),
    "pinned-pool": ("pinned_pool", lambda v: _bytes(v, allow_none=False, minimum=0)),
    "local-threads": ("local_threads",
                      lambda v: None if v is None else _positive_int(v, most=MAX_WORKERS)),
    "progress": ("progress", _optional_bool),
    "performance-report": ("performance_report", _optional_str),
    "retry-timeout": ("retry_timeout", _seconds),
    "dask-layout": ("dask_layout", lambda v: _name(v, ("auto", "tiles", "blocks"))),
    "dask-worker-gflops": ("dask_worker_gflops", _gflops),
    "dask-device-transfer": ("dask_device_transfer",
                             lambda v: _name(v.strip().lower() if isinstance(v, str) else v,
                                             ("auto", "ipc", "tcp"))),
    "batch-stripes": ("batch_stripes", _positive_int),
    "batch-panels": ("batch_panels", lambda v: _name(v, ("auto", "read", "share", "broadcast"))),
    "mpi-cpus": ("mpi_cpus", lambda v: _name(v, ("auto", "keep"))),
    "mpi-join-warning": ("mpi_join_warning", _seconds),
    "mpi-join-timeout": ("mpi_join_timeout", lambda v: None if v is None else _seconds(v)),
    "direct-writes": ("direct_writes", _required_bool),
    "precision": ("precision", lambda v: _name(v.strip().lower() if isinstance(v, str) else v,
                                               PRECISIONS)),
}


def _where(key: str) -> str:
    suffix = _env_suffix(key)
    return (f"set with dask.config.set({{'distmm.{key}': ...}}), a dask YAML file, "
            f"DASK_DISTMM__{suffix} or DISTMM_{suffix}")


#: ``yaml_file``'s value for "whatever the file sets"
_ANY = object()


def yaml_file(key: str | None, value=_ANY, files=None) -> str | None:
    """The last of dask's YAML files (``files``: ``dask.config.collect_yaml``'s, with their
    paths; None: read now) that sets ``distmm.<key>`` (the ``distmm`` section itself for
    None) to ``value`` (by default to anything), or None: where a setting came from, when a
    file gave it."""
    if files is None:
        try:
            files = list(dask.config.collect_yaml(dask.config.paths, return_paths=True))
        except Exception:  # noqa: BLE001 - only a better message was at stake; dask read them
            return None
    for path, conf in reversed(files):
        section = conf.get("distmm") if isinstance(conf, dict) else None
        if key is None:
            if section is not None and (value is _ANY or section == value):
                return str(path)
        elif isinstance(section, dict):
            for k in (key, key.replace("-", "_"), key.replace("_", "-")):
                if k in section:
                    if value is _ANY or section[k] == value:
                        return str(path)
                    break
    return None


def where_set(key: str, files=None) -> str | None:
    """Where the configuration key ``key`` in force was set, where that can be told: a
    ``DISTMM_``/``DASK_DISTMM__`` variable, which wins, else the last YAML file of dask's
    config paths that sets it (``yaml_file``); None otherwise (the defaults,
    ``dask.config.set``)."""
    suffix = _env_suffix(key)
    short, full = "DISTMM_" + suffix, "DASK_DISTMM__" + suffix
    if not _blank(os.environ.get(full, "")):  # distmm copies DISTMM_X to DASK_DISTMM__X
        return short if os.environ.get(short) == os.environ[full] else full  # unless set
    if not _blank(os.environ.get(short, "")):  # beneath an empty DASK_DISTMM__X
        return short
    return yaml_file(key, files=files)


def _variable_giving(key: str, value) -> str | None:
    """The ``DISTMM_``/``DASK_DISTMM__`` variable whose setting of ``key`` is ``value`` (as
    dask reads it), or None: where a bad value came from, when the environment gave it."""
    suffix = _env_suffix(key)
    short, full = "DISTMM_" + suffix, "DASK_DISTMM__" + suffix
    name = where_set(key, files=())
    if name is None:
        return None
    text = os.environ[full] if not _blank(os.environ.get(full, "")) else os.environ[short]
    given = next(iter(dask.config.collect_env({full: text})["distmm"].values()))
    return name if _same(given, value) or repr(given) == repr(value) else None


def fallback(key: str):
    """The value of ``key`` where the one in force is empty (no setting): the first of a
    ``DASK_DISTMM__``/``DISTMM_`` variable, the last of dask's YAML files and distmm.yaml's
    default that sets it to something."""
    suffix = _env_suffix(key)
    for name in ("DASK_DISTMM__" + suffix, "DISTMM_" + suffix):
        if not _blank(os.environ.get(name, "")):  # as dask reads it
            section = dask.config.collect_env({"DASK_DISTMM__" + suffix: os.environ[name]})
            return next(iter(section["distmm"].values()))
    try:
        files = list(dask.config.collect_yaml(dask.config.paths))
    except Exception:  # noqa: BLE001 - dask read them when it loaded the configuration
        files = []
    for conf in reversed(files):
        section = conf.get("distmm") if isinstance(conf, dict) else None
        if isinstance(section, dict):
            for k in (key, key.replace("-", "_")):
                if k in section and not _blank(section[k]):
                    return section[k]
    return _defaults["distmm"][key]


def _read(section) -> Config:
    """Parse the ``distmm`` section of dask's configuration into a ``Config``."""
    if not isinstance(section, dict):
        path = None if "DASK_DISTMM" in os.environ else yaml_file(None, section)
        where = ("the environment variable DASK_DISTMM" if "DASK_DISTMM" in os.environ
                 else path and f"the dask YAML file {path}")
        raise ValueError(f"distmm configuration: 'distmm' must be a mapping of keys "
                         f"(distmm: {{memory-budget: 4GiB}}), got {section!r}"
                         + (f" (from {where})" if where else ""))
    for k in section:
        if str(k).replace("_", "-") not in _PARSERS:
            suffix = _env_suffix(str(k))
            named = [v for v in ("DISTMM_" + suffix, "DASK_DISTMM__" + suffix) if v in os.environ]
            near = difflib.get_close_matches(str(k).replace("_", "-"), _PARSERS, n=1)
            path = None if named else yaml_file(str(k), section[k])
            notes = ([f"the environment variable {named[0]}"] if named else []) + \
                ([f"the dask YAML file {path}"] if path else []) + \
                ([f"did you mean distmm.{near[0]}?"] if near else [])
            raise ValueError(f"distmm configuration: unknown key 'distmm.{k}'"
                             + (f" ({'; '.join(notes)})" if notes else "")
                             + f"; the keys are {', '.join(_PARSERS)}")
    values = {}
    for key, (field, parse) in _PARSERS.items():
        # either spelling, as dask.config.get finds it ('-' first, then '_')
        raw = section.get(key, section.get(key.replace("-", "_")))
        if _blank(raw):  # no setting: what the sources before it give
            raw = fallback(key)
        try:
            values[field] = parse(_plain(raw))
        except _Bad as e:
            shown = "null" if raw is None else repr(raw)  # as YAML and dask's parser read it
            suffix = _env_suffix(key)
            variable = _variable_giving(key, raw)
            path = (None if any(not _blank(os.environ.get(v, ""))
                                for v in ("DISTMM_" + suffix, "DASK_DISTMM__" + suffix))
                    else yaml_file(key, raw))
            what = f"distmm configuration: distmm.{key} = {shown} is not valid: {e}"
            came = (f"from the environment variable {variable}; " if variable
                    else f"from the dask YAML file {path}; " if path else "")
            raise ConfigError(f"{what} ({came}{_where(key)})",
                              cli_message=f"{what} ({came}set DISTMM_{suffix} or "
                                          f"DASK_DISTMM__{suffix} "
                                          f"in the environment, or distmm.{key} in a dask YAML "
                                          f"file)") from None
    values["memory_budget_from"] = "config" if values["memory_budget"] is not None else "auto"
    return Config(**values)


_cache: tuple[dict, Config] | None = None


def _same(old, section) -> bool:
    """Whether the section last read is ``section``, value by value and each key's of the
    same type: a numpy value compares element by element (``np.int64(64) == [64, 64, 64]``
    is an array, ``np.int64(64) == np.array([64])`` true), which a dict comparison takes."""
    try:
        if not old == section:
            return False
    except (ValueError, TypeError):
        return False
    return not isinstance(old, dict) or (list(map(type, old.values()))
                                         == list(map(type, section.values())))


_unreadable_warned: set[str] = set()


def _warn_unreadable_files(paths=None) -> None:
    """One ``RuntimeWarning`` per process for each YAML/JSON file in dask's config paths
    (``paths``; None: ``dask.config.paths``) that cannot be opened: dask skips such a file
    (an ``OSError``) without a word, so none of its settings is in force."""
    found = []
    for path in dask.config.paths if paths is None else paths:
        if os.path.isdir(path):
            try:
                found.extend(os.path.join(path, p) for p in sorted(os.listdir(path))
                             if os.path.splitext(p)[1].lower() in (".json", ".yaml", ".yml"))
            except OSError:  # a folder that cannot be listed: dask's as well
                continue
        elif os.path.exists(path):
            found.append(path)
    for path in found:
        if path in _unreadable_warned:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            _unreadable_warned.add(path)
            warnings.warn(f"distmm configuration: the dask config file {path} cannot be read "
                          f"({e.strerror or type(e).__name__}); dask skips it, so none of its "
                          f"settings is in force", RuntimeWarning, stacklevel=3)


def get_config() -> Config:
    """The configuration in force now.

    The ``distmm`` section of ``dask.config`` is compared by value with a copy
    of the one last read, so a call costs a dict comparison unless the
    configuration changed (``dask.config.set`` entering or leaving, a refresh).

    Raises
    ------
    ValueError
        An unknown key, or a value that does not parse; the message names the
        key and where it can be set.
    """
    global _cache
    # The dict dask.config.get reads (dask.config.set and refresh change it in
    # place), looked up directly: dask.config.get("distmm") splits and
    # canonicalises the key on every call, and "distmm" has no '-'/'_' variant.
    section = dask.config.global_config.get("distmm")
    hit = _cache
    if hit is not None and _same(hit[0], section):
        return hit[1]
    _warn_unreadable_files()
    # Parsed from a copy, which is also the cache key: a dask.config.set block that another
    # thread leaves meanwhile changes the section, not the copy, so the next call re-reads.
    snapshot = copy.deepcopy(dict(section)) if isinstance(section, dict) else section
    # None: an empty section (`distmm:` with every key commented out) after a refresh: the
    # defaults, as when distmm is imported (it read as {}: "distmm.engine = null is not valid")
    cfg = _read(snapshot if snapshot is not None else _defaults["distmm"])
    _cache = (snapshot, cfg)
    return cfg


def _current_worker():
    """The ``distributed`` worker running this code, or None (without importing
    distributed when nothing has)."""
    if "distributed" not in sys.modules:
        return None
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def _worker_limit(worker) -> tuple[int | None, int]:
    """A worker's memory limit in bytes (None: unlimited) and its thread count."""
    manager = getattr(worker, "memory_manager", None)
    limit = getattr(manager, "memory_limit", None)
    if limit is None:
        limit = getattr(worker, "memory_limit", None)
    state = getattr(worker, "state", None)
    threads = getattr(state, "nthreads", None) or getattr(worker, "nthreads", 1) or 1
    return (int(limit) if limit else None), int(threads)


def host_available() -> int:
    """This host's available memory in bytes (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``,
    ``RLIMIT_AS``: the limit less what it has mapped, memory-mapped operands included), or
    None where there is no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    import psutil

    return max(0, int(soft) - int(psutil.Process().memory_info().vms))


def _device_free() -> int | None:
    """Free bytes on the current GPU, or None without cupy or a usable device
    (the executor then reports that, with its install hint)."""
    try:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
    except (ImportError, RuntimeError):  # cupy's CUDARuntimeError is a RuntimeError
        return None
    return int(free)


_cpu_probe: tuple[float, int] | None = None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), read at most once
    per ``_AUTO_TTL`` seconds: building the mask's set costs more than a small
    product on a machine with many cores. The local engine's default thread
    count and the host's auto memory budget split."""
    global _cpu_probe
    now = time.monotonic()
    hit = _cpu_probe
    if hit is None or now - hit[0] > _AUTO_TTL:
        try:
            count = len(os.sched_getaffinity(0)) or 1
        except AttributeError:  # pragma: no cover - not Linux
            count = os.cpu_count() or 1
        hit = _cpu_probe = (now, count)
    return hit[1]


_probe_lock = threading.Lock()
_probes: dict[tuple[bool, int | None], tuple[float, int]] = {}


def _quantised(nbytes: float) -> int:
    return max(_AUTO_QUANTUM, int(nbytes) // _AUTO_QUANTUM * _AUTO_QUANTUM)


def _measured(on_gpu: bool, local_threads: int | None) -> int:
    """The GPU's or the host's share (see ``memory_budget``), measured at most
    once per ``_AUTO_TTL`` seconds: the measurement costs more than a small
    product."""
    key = (on_gpu, local_threads)
    now = time.monotonic()
    hit = _probes.get(key)
    if hit is None or now - hit[0] > _AUTO_TTL:
        with _probe_lock:
            free = _device_free() if on_gpu else None
            if free is not None:
                value = _quantised(free * GPU_FRACTION)
            else:
                threads = local_threads or available_cpus()
                value = _quantised(host_available() * HOST_FRACTION / threads)
                room = address_space_left()
                if room is not None:  # the same share of what the limit leaves, unquantised
                    value = min(value, max(1, int(room * HOST_FRACTION / threads)))
            hit = (now, value)
            _probes[key] = hit
    return hit[1]


def memory_budget(on_gpu: bool = False, *, config: Config | None = None) -> int:
    """Bytes one task of a product may hold (operand panels and partials).

    The configured ``distmm.memory-budget`` when it is a size. When it is
    ``"auto"`` (the default), a share of what this process has:

    - on a Dask worker (``distributed.get_worker()`` succeeds) with a memory
      limit: ``WORKER_FRACTION`` (0.5) of the limit, split between the
      worker's threads (each may run a task at once);
    - for a GPU product (``on_gpu``): ``GPU_FRACTION`` (0.5) of the device's
      free memory (cupy is imported only then; without cupy or a device, the
      host's share below);
    - otherwise: ``HOST_FRACTION`` (0.5) of the machine's available memory
      (psutil), split between the threads the local engine runs, and no more
      than the same share of what an address-space limit (``ulimit -v``) leaves
      this process (``address_space_left``).

    The rest is left for the operands, the result and everything else the
    process holds. The host and GPU budgets are rounded down to a multiple of
    64 MiB (at least 64 MiB; one capped by an address-space limit is not) and
    their measurements reused for a second, so
    back-to-back products get the same (cached) plan.

    Parameters
    ----------
    on_gpu : bool
        Whether the product's tiles are multiplied on a GPU.
    config : Config, optional
        Default: ``get_config()``.

    Returns
    -------
    int
        Bytes, positive.
    """
    cfg = config if config is not None else get_config()
    if cfg.memory_budget is not None:
        return cfg.memory_budget
    worker = _current_worker()
    if worker is not None:
        limit, threads = _worker_limit(worker)
        if limit:
            return max(1, int(limit * WORKER_FRACTION / threads))
    return _measured(bool(on_gpu), cfg.local_threads)
