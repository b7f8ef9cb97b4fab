"""Scaling studies as files: the schema of a ``distmm bench`` study (TOML), its validation,
and its expansion into the configurations to measure.

This module covers: reading a study file (``load_study``: ``tomllib``), refusing a bad one
with one line naming the key (``ValueError``, before anything runs), and the pure planning
of what a study measures (``Study.configurations``): every engine, backend, dtype, size and
device count of every series, the references of each problem, the variant names that make
``distmm report`` find the strong and weak series, and the order that starts each cluster
or ``mpiexec`` once per count. It imports nothing but the standard library.
It does *not* cover: measuring (``distmm.cli.bench``), the machine (whether it has the GPUs
or the ``mpiexec`` a study asks for: checked by the runner before it starts), or plots
(``distmm.cli.report``).

The file (every key but ``[[series]]``'s ``kind``, ``engines``, ``counts`` and sizes has a
default)::

    name = "cpu-scaling"        # the records' file name and "study" key (default: file stem;
                                #   at most 197 bytes)
    benchmark = "scaling"       # the records' "benchmark"
    device = "cpu"              # "cpu" or "gpu": what the engines run on
    dtypes = ["float64"]        # float32, float64
    precision = "highest"       # or "tf32", "bf16", "fp16" (float32, only the cublas reference):
                                #   every engine and cuBLAS compute in it (emulated on a CPU);
                                #   the records carry it
    repeats = 3                 # warm calls timed after the first; the record holds their median
                                #   (at most 1000)
    check_rows = 64             # rows of C checked against float64 (0: every row)
    seed = 0
    references = ["numpy"]      # numpy, dask.array, cublas: measured in the same run
    mpiexec = ["mpiexec"]       # the launcher, "-n P" and the rank program appended
    threads_per_rank = "share"  # BLAS threads of a CPU rank: "share" (cores // ranks) or a number
    oversubscribe = false       # true: a cpu study's local threads, Dask workers and MPI
                                #   threads_per_rank x ranks may outnumber this machine's
                                #   usable cores (refused otherwise, before anything runs);
                                #   MPI ranks alone: the launcher's --oversubscribe in mpiexec

    [[series]]
    kind = "strong"             # "strong": the same sizes at every count
    engines = ["dask", "mpi"]   # local, dask, mpi
    counts = [1, 2, 4]          # local threads / Dask workers / MPI ranks (GPUs on "gpu")
    sizes = [4096, [1000, 1100, 900]]   # n (m = n = k) or [m, n, k]
    backends = ["auto"]         # cpu: auto, blas, numba; gpu: auto, raw, cublas
    dtypes = ["float64"]        # the study's unless given
    references = ["numpy"]      # the study's unless given (a subset of them)
    chunk = 2048                # Dask operands' chunks (default: 2048 on cpu, 8192 on gpu)
    nodes = 2                   # dask and mpi only, with emulated = true: every count split
    emulated = true             #   into that many emulated nodes of one host (distmm.emulate);
                                #   emulated = "all-links": every link on the network path

    [[series]]
    kind = "weak"               # "weak": C grows with the count, a fixed size per device
    engines = ["mpi"]
    counts = [1, 2, 4]
    sizes_per_device = [2048]   # C's side per device: at P devices C is (r b) x (c b) with
    k = 2048                    #   r c = P, r >= c as square as P allows; k fixed (default b)
"""
from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ENGINES", "REFERENCES", "Config", "Series", "Study", "load_study", "parse_study",
           "weak_shape", "variant_name"]

ENGINES = ("local", "dask", "mpi")
REFERENCES = ("numpy", "dask.array", "cublas")
DEVICES = ("cpu", "gpu")
BACKENDS = {"cpu": ("auto", "blas", "numba"), "gpu": ("auto", "raw", "cublas")}
DTYPES = ("float32", "float64")
KINDS = ("strong", "weak")
PRECISIONS = ("highest", "tf32", "bf16", "fp16")  # distmm.precision.PRECISIONS (stdlib only here)
ITEMSIZE = {"float32": 4, "float64": 8}
#: numpy's largest array in bytes (``np.iinfo(np.intp).max`` on 64-bit hosts)
MAX_BYTES = 2**63 - 1
#: the most devices (threads, workers, ranks, GPUs) a series' count may name: far beyond any
#: machine, and it keeps ``weak_shape``'s search for the grid short
MAX_COUNT = 2**20
#: the most warm calls a configuration takes: a median of more is no steadier than the
#: machine's own noise, and a larger number (a typo, most likely) makes a study that never ends
MAX_REPEATS = 1000
#: the longest study name in UTF-8 bytes: it keeps the records' default file name,
#: ``<name>-<device, at most 40>-<YYYY-MM-DD>.jsonl``, within a file name's 255 bytes
MAX_NAME_BYTES = 255 - 40 - len("--YYYY-MM-DD.jsonl")

TOP_KEYS = {"name", "benchmark", "device", "dtypes", "repeats", "check_rows", "seed",
            "references", "mpiexec", "threads_per_rank", "series", "note", "precision",
            "oversubscribe"}
SERIES_KEYS = {"kind", "engines", "counts", "sizes", "sizes_per_device", "k", "backends",
               "dtypes", "chunk", "nodes", "emulated", "references"}
#: ``emulated``'s crude mode (``distmm.emulate.ALL_LINKS``, repeated: this module imports
#: nothing but the standard library)
ALL_LINKS = "all-links"


@dataclass(frozen=True)
class Config:
    """One configuration to measure: a distmm engine (``reference`` None) or a reference."""
    engine: str              # local, dask, mpi, or "numpy"/"cublas" for in-process references
    backend: str
    dtype: str
    m: int
    n: int
    k: int
    count: int               # threads / workers / ranks (GPUs on a GPU study)
    series: str              # strong or weak
    variant: str
    reference: str | None = None
    per_device: int | None = None
    chunk: int | None = None
    nodes: int | str | None = None  # emulated nodes (a count or "all-links"); None: one host

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def describe(self) -> str:
        return f"{self.variant} {self.dtype} {self.m}x{self.n}x{self.k} ({self.series})"

    @property
    def place(self) -> tuple:
        """What one cluster or ``mpiexec`` launch serves: engine, count, emulated nodes."""
        return (self.engine, self.count, self.nodes)


@dataclass(frozen=True)
class Series:
    kind: str
    engines: tuple[str, ...]
    counts: tuple[int, ...]
    sizes: tuple[tuple[int, int, int], ...]   # strong: (m, n, k); weak: (b, b, k) per device
    backends: tuple[str, ...]
    dtypes: tuple[str, ...]
    chunk: int | None
    nodes: int | str | None = None  # emulated nodes (a count or "all-links"); None: one host
    references: tuple[str, ...] | None = None  # None: the study's


@dataclass(frozen=True)
class Study:
    name: str
    benchmark: str
    device: str
    repeats: int
    check_rows: int
    seed: int
    references: tuple[str, ...]
    mpiexec: tuple[str, ...]
    series: tuple[Series, ...]
    threads_per_rank: int | None = None   # None: the cores shared between the ranks
    note: str = ""
    path: str = ""
    precision: str = "highest"
    oversubscribe: bool = False  # local threads, Dask workers, MPI threads x ranks past the cores
    _configs: list = field(default_factory=list, compare=False, repr=False)

    def configurations(self) -> list[Config]:
        """Every configuration in the order the runner measures them: problem by problem
        (dtype, then size) the in-process references (numpy, cuBLAS) and the local engine at
        each count, on operands made once per problem; then each Dask cluster (by count:
        distmm, then dask.array on the same cluster, by dtype and size); then each
        ``mpiexec`` (by count). A configuration that two series ask for is measured once."""
        if not self._configs:
            self._configs.extend(_expand(self))
        return list(self._configs)

    @property
    def counts_key(self) -> str:
        return "gpus" if self.device == "gpu" else "workers"


def weak_shape(count: int, side: int, k: int) -> tuple[int, int, int]:
    """``(m, n, k)`` of a weak-scaling problem at ``count`` devices with ``side x side`` of C
    per device: ``m = r side``, ``n = c side``, ``r c = count``, ``r >= c``, as square as
    ``count`` allows.

    Examples
    --------
    >>> weak_shape(1, 100, 50), weak_shape(2, 100, 50), weak_shape(16, 100, 50)
    ((100, 100, 50), (200, 100, 50), (400, 400, 50))
    """
    cols = max(c for c in range(1, math.isqrt(count) + 1) if count % c == 0)
    return (count // cols) * side, cols * side, k


def variant_name(engine: str, backend: str, series: str, count: int, device: str,
                 nodes: int | str | None = None) -> str:
    """A distmm configuration's variant:
    ``distmm-<engine>[-<backend>][-weak][-emulated-<N>nodes]@<count><unit>``, the unit
    ``workers`` (local threads, Dask workers) or ``ranks``, or ``gpu`` on a GPU study.
    ``distmm report`` strips the ``@<count><unit>`` token to find one series over the
    counts; ``-weak`` keeps a weak series apart from a strong one of the same engine, and
    ``-emulated-<N>nodes`` (``-emulated-all-links``) one on emulated nodes from one on a
    single host.

    Examples
    --------
    >>> variant_name("mpi", "auto", "strong", 4, "cpu"), variant_name("dask", "numba", "weak", 2, "cpu")
    ('distmm-mpi@4ranks', 'distmm-dask-numba-weak@2workers')
    >>> variant_name("mpi", "auto", "strong", 4, "gpu", nodes=2)
    'distmm-mpi-emulated-2nodes@4gpu'
    """
    name = f"distmm-{engine}" + ("" if backend == "auto" else f"-{backend}")
    name += "-weak" if series == "weak" else ""
    return name + _nodes_token(nodes) + "@" + _count_token(engine, count, device)


def _nodes_token(nodes: int | str | None) -> str:
    if nodes is None:
        return ""
    return f"-emulated-{nodes}" if nodes == ALL_LINKS else f"-emulated-{nodes}nodes"


def _count_token(engine: str, count: int, device: str) -> str:
    if device == "gpu":
        return f"{count}gpu"
    return f"{count}ranks" if engine == "mpi" else f"{count}workers"


def _expand(study: Study) -> list[Config]:
    seen: dict[tuple, Config] = {}
    # (dtype, m, n, k) -> (series kind (the first one), the references its series take)
    problems: dict[tuple, tuple[str, set]] = {}
    for s in study.series:
        for engine in s.engines:
            for count in s.counts:
                for size in s.sizes:
                    m, n, k = weak_shape(count, size[0], size[2]) if s.kind == "weak" else size
                    for dtype in s.dtypes:
                        refs_here = study.references if s.references is None else s.references
                        problems.setdefault((dtype, m, n, k), (s.kind, set()))[1].update(refs_here)
                        for backend in s.backends:
                            cfg = Config(engine, backend, dtype, m, n, k, count, s.kind,
                                         variant_name(engine, backend, s.kind, count,
                                                      study.device, s.nodes),
                                         per_device=size[0] if s.kind == "weak" else None,
                                         chunk=_chunk(s, study.device, m, n, k)
                                         if engine == "dask" else None, nodes=s.nodes)
                            seen.setdefault((engine, backend, dtype, m, n, k, count, s.kind,
                                             s.nodes), cfg)
                        if engine == "dask" and "dask.array" in refs_here:
                            suffix = ("-weak" if s.kind == "weak" else "") + _nodes_token(s.nodes)
                            ref = Config("dask", "auto", dtype, m, n, k, count, s.kind,
                                         f"dask.array{suffix}@{_count_token('dask', count, study.device)}",
                                         reference="dask.array",
                                         per_device=size[0] if s.kind == "weak" else None,
                                         chunk=_chunk(s, study.device, m, n, k), nodes=s.nodes)
                            seen.setdefault(("dask.array", dtype, m, n, k, count, s.kind,
                                             s.nodes), ref)
    refs = [Config(ref, "auto", dtype, m, n, k, 1, kind, ref, reference=ref)
            for ref in ("numpy", "cublas")
            for (dtype, m, n, k), (kind, wanted) in problems.items() if ref in wanted]
    order = {"numpy": 0, "cublas": 0, "local": 0, "dask": 2, "mpi": 3}

    def key(c: Config):
        problem = (c.dtype, c.flops, c.m, c.n, c.k)
        if c.engine in ("numpy", "cublas", "local"):  # one process, operands made per problem
            return (0, 0) + problem + (c.engine != "numpy", c.engine != "cublas", c.count,
                                       c.backend, c.series)
        return (order[c.engine], c.count, str(c.nodes)) + problem + (
            c.reference is not None, c.backend, c.series)
    return sorted(refs + list(seen.values()), key=key)


def _chunk(s: Series, device: str, m: int, n: int, k: int) -> int:
    if s.chunk:
        return s.chunk
    return min(8192 if device == "gpu" else 2048, max(m, n, k))


# ---------------------------------------------------------------- reading and validation


def load_study(path: str | Path) -> Study:
    """Read and validate the study file ``path``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        The file is not TOML, or a key is unknown, missing or bad: one line naming the file
        and the key (``study.toml: series[1].counts: ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "No such file or directory" if not path.exists()
                                else "Not a file", str(path))
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not a TOML file ({exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a TOML file (not UTF-8 text)") from None
    return parse_study(data, default_name=path.stem, where=str(path))


def parse_study(data: dict, *, default_name: str = "study", where: str = "study") -> Study:
    """Validate a study's parsed TOML ``data`` (see ``load_study``)."""
    def bad(key: str, why: str):
        raise ValueError(f"{where}: {key}: {why}")

    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        bad(unknown[0], _unknown(unknown[0], TOP_KEYS | SERIES_KEYS, TOP_KEYS))
    name = _string(data, "name", default_name, bad)
    if (not name or any(ch in name for ch in "/\\") or name.startswith(".")
            or not name.isprintable()):  # a control character: no file name takes a NUL
        bad("name", f"{name!r} is not a file-name stem")
    if len(name.encode()) > MAX_NAME_BYTES:
        bad("name", f"{len(name.encode())} bytes is longer than a study name takes (at most "
                    f"{MAX_NAME_BYTES}: the records' file name adds the device and the date)"
                    + ("" if "name" in data else "; it is the file's stem unless name = "
                                                 "\"...\" is given"))
    benchmark = _string(data, "benchmark", "scaling", bad)
    if not benchmark or not benchmark.isprintable():
        bad("benchmark", f"{benchmark!r} is not a name (the records' benchmark)")
    device = _choice(data, "device", "cpu", DEVICES, bad)
    dtypes = _choices(data, "dtypes", ["float64"], DTYPES, bad)
    repeats = _integer(data, "repeats", 3, 1, bad)
    if repeats > MAX_REPEATS:
        bad("repeats", f"{repeats} warm calls of every configuration is more than a study runs "
                       f"(at most {MAX_REPEATS})")
    check_rows = _integer(data, "check_rows", 64, 0, bad)
    seed = _integer(data, "seed", 0, 0, bad)
    references = _choices(data, "references", [], REFERENCES, bad, empty_ok=True)
    if "cublas" in references and device != "gpu":
        bad("references", "cublas is a GPU reference: set device = \"gpu\"")
    mpiexec = data.get("mpiexec", ["mpiexec"])
    if (not isinstance(mpiexec, list) or not mpiexec
            or not all(isinstance(x, str) and x for x in mpiexec)):
        bad("mpiexec", f"a non-empty list of strings (the launcher's argv), got {mpiexec!r}")
    threads = data.get("threads_per_rank", "share")
    if threads != "share" and (type(threads) is not int or threads < 1):
        bad("threads_per_rank", f"\"share\" or a positive integer, got {threads!r}")
    note = _string(data, "note", "", bad)
    oversubscribe = data.get("oversubscribe", False)
    if not isinstance(oversubscribe, bool):
        bad("oversubscribe", f"true or false, got {oversubscribe!r}")
    if oversubscribe and device != "cpu":
        bad("oversubscribe", "a cpu study's key: a gpu study's counts are its GPUs")
    precision = _choice(data, "precision", "highest", PRECISIONS, bad)
    if precision != "highest":
        if dtypes != ["float32"]:
            bad("dtypes", f"precision {precision} takes float32 operands: dtypes = "
                          f"[\"float32\"], got {dtypes!r}")
        others = [r for r in references if r != "cublas"]
        if others:
            bad("references", f"{others[0]} has no {precision} mode: only cublas is measured "
                              f"at a reduced precision")
    raw = data.get("series")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        bad("series", "at least one [[series]] table is needed")
    series = tuple(_series(s, f"series[{i}]", device, dtypes, references, bad)
                   for i, s in enumerate(raw))
    if "dask.array" in references and not any("dask" in s.engines for s in series):
        bad("references", "dask.array is measured on the Dask clusters: add a series with "
                          "engine \"dask\"")
    if precision != "highest" and any(s.dtypes != ("float32",) for s in series):
        bad("series", f"precision {precision} takes float32 operands: a series lists "
                      f"other dtypes")
    _one_chunk(series, device, references, bad)
    study = Study(name, benchmark, device, repeats, check_rows, seed, tuple(references),
                  tuple(mpiexec), series, None if threads == "share" else threads, note, where,
                  precision=precision, oversubscribe=oversubscribe)
    study.configurations()
    return study


def _series(s: dict, where: str, device: str, dtypes, references, bad) -> Series:
    def sbad(key, why):
        bad(f"{where}.{key}", why)

    unknown = sorted(set(s) - SERIES_KEYS)
    if unknown:
        sbad(unknown[0], _unknown(unknown[0], SERIES_KEYS | TOP_KEYS, SERIES_KEYS))
    if "kind" not in s:
        sbad("kind", "missing (\"strong\" or \"weak\")")
    kind = _choice(s, "kind", None, KINDS, sbad)
    if "engines" not in s:
        sbad("engines", f"missing (a list of {', '.join(ENGINES)})")
    engines = _choices(s, "engines", None, ENGINES, sbad)
    if "counts" not in s:
        sbad("counts", "missing (a list of device counts)")
    counts = s["counts"]
    if not _positive_ints(counts):
        sbad("counts", f"a non-empty list of integers of at least 1, got {counts!r}")
    if len(set(counts)) != len(counts):
        sbad("counts", f"{counts!r} repeats a count")
    if max(counts) > MAX_COUNT:
        sbad("counts", f"{max(counts)} is more than a study runs (at most {MAX_COUNT})")
    if device == "gpu" and "local" in engines and counts != [1]:
        sbad("counts", "the local engine runs on one GPU: its series takes counts = [1]")
    backends = _choices(s, "backends", ["auto"], BACKENDS[device], sbad)
    series_dtypes = _choices(s, "dtypes", list(dtypes), DTYPES, sbad)
    chunk = s.get("chunk")
    if chunk is not None and (type(chunk) is not int or chunk < 1):
        sbad("chunk", f"a positive integer, got {chunk!r}")
    if chunk is not None and "dask" not in engines:
        sbad("chunk", "only the Dask engine has chunks")
    nodes = _nodes(s, engines, counts, sbad)
    refs = None
    if "references" in s:
        refs = tuple(_choices(s, "references", [], REFERENCES, sbad, empty_ok=True))
        extra = sorted(set(refs) - set(references))
        if extra:
            sbad("references", f"{extra[0]} is not among the study's references "
                               f"({', '.join(references) or 'none'}): a series measures a subset")
    if kind == "strong":
        for key in ("sizes_per_device", "k"):
            if key in s:
                sbad(key, "belongs to a weak series (a strong one has sizes)")
        if "sizes" not in s:
            sbad("sizes", "missing (a list of n or [m, n, k])")
        sizes = _sizes(s["sizes"], sbad)
    else:
        if "sizes" in s:
            sbad("sizes", "belongs to a strong series (a weak one has sizes_per_device)")
        if "sizes_per_device" not in s:
            sbad("sizes_per_device", "missing (a list of C's side per device)")
        sides = s["sizes_per_device"]
        if not _positive_ints(sides):
            sbad("sizes_per_device", f"a non-empty list of positive integers, got {sides!r}")
        _once(sides, [(b, b, b) for b in sides], "sizes_per_device", sbad)
        k = s.get("k")
        if k is not None and (type(k) is not int or k < 1):
            sbad("k", f"a positive integer, got {k!r}")
        if len(counts) < 2:
            sbad("counts", "a weak series needs two counts or more")
        sizes = tuple((b, b, k or b) for b in sides)
    _fits(kind, counts, sizes, series_dtypes, sbad)
    return Series(kind, tuple(engines), tuple(counts), sizes, tuple(backends),
                  tuple(series_dtypes), chunk, nodes, refs)


def _one_chunk(series, device: str, references, bad) -> None:
    """Refuse two series that ask for one Dask configuration (engine or dask.array, backend,
    dtype, size, count, kind, emulated nodes) at different chunks: it is measured once
    (``Study.configurations``), at the first series' chunk, and a record does not say which
    series' chunk it ran (a variant names no chunk)."""
    seen: dict[tuple, tuple[int, int]] = {}
    for i, s in enumerate(series):
        if "dask" not in s.engines:
            continue
        refs = references if s.references is None else s.references
        names = s.backends + (("dask.array",) if "dask.array" in refs else ())
        for count in s.counts:
            for size in s.sizes:
                m, n, k = weak_shape(count, size[0], size[2]) if s.kind == "weak" else size
                chunk = _chunk(s, device, m, n, k)
                for key in ((name, dtype, m, n, k, count, s.kind, s.nodes)
                            for name in names for dtype in s.dtypes):
                    first, other = seen.setdefault(key, (i, chunk))
                    if other != chunk:
                        what = (variant_name("dask", key[0], s.kind, count, device, s.nodes)
                                if key[0] != "dask.array" else "dask.array"
                                + ("-weak" if s.kind == "weak" else "") + _nodes_token(s.nodes)
                                + "@" + _count_token("dask", count, device))
                        bad(f"series[{i}].chunk", f"{chunk}, but series[{first}] measures {what} "
                                                  f"{key[1]} {m}x{n}x{k} at chunk {other} (a "
                                                  f"configuration is measured once, and its "
                                                  f"variant names no chunk): give chunk {chunk} "
                                                  f"a study of its own")


def _fits(kind, counts, sizes, dtypes, sbad) -> None:
    """Every problem's A, B and C at its largest dtype within numpy's largest array (a size
    that overflows is refused here, not after the configurations before it ran)."""
    itemsize = max(ITEMSIZE[d] for d in dtypes)
    for size in sizes:
        for count in counts if kind == "weak" else (1,):
            m, n, k = weak_shape(count, size[0], size[2]) if kind == "weak" else size
            biggest = max(m * k, k * n, m * n) * itemsize
            if biggest > MAX_BYTES:
                key = "sizes_per_device" if kind == "weak" else "sizes"
                at = f" at count {count}" if kind == "weak" else ""
                sbad(key, f"{m} x {n} x {k}{at} overflows: an operand or C of {biggest:.3g} "
                          f"bytes, numpy's largest array is 2**63 - 1 bytes")


def _unknown(key: str, near: set, known: set) -> str:
    """What is wrong with the unknown key ``key`` of a table whose keys are ``known``: the
    closest key of ``near`` (this table's or the other table's, where the key belongs there)
    as a "did you mean", then the known keys."""
    close = difflib.get_close_matches(key, sorted(near), n=1, cutoff=0.75)
    hint = ""
    if close and close[0] in known:
        hint = f"; did you mean {close[0]!r}?"
    elif close:
        hint = (f"; {close[0]!r} belongs to the " + ("[[series]] tables" if close[0] in SERIES_KEYS
                                                      else "study's top level"))
    return f"unknown key{hint} (known: {', '.join(sorted(known))})"


def _positive_ints(value) -> bool:
    """Whether ``value`` is a non-empty list of integers of at least 1 (not bools)."""
    return (isinstance(value, list) and bool(value)
            and all(type(x) is int and x >= 1 for x in value))


def _nodes(s: dict, engines, counts, sbad) -> int | str | None:
    """A series' emulated nodes (``nodes`` and ``emulated``), or None for one host."""
    emulated = s.get("emulated", False)
    if not (isinstance(emulated, bool) or emulated == ALL_LINKS):  # 1 == True: not a bool
        sbad("emulated", f"true, false or \"{ALL_LINKS}\", got {emulated!r}")
    nodes = s.get("nodes")
    if nodes is not None and (type(nodes) is not int or nodes < 1):
        sbad("nodes", f"a positive integer, got {nodes!r}")
    if emulated is False:
        if nodes not in (None, 1):
            sbad("nodes", "the runner runs on one host: set emulated = true to run the "
                          "counts as emulated nodes of it")
        return None
    if "local" in engines:
        sbad("emulated", "the local engine runs in one process: emulated nodes take the dask "
                         "and mpi engines")
    if emulated == ALL_LINKS:
        if nodes is not None:
            sbad("nodes", f"emulated = \"{ALL_LINKS}\" makes every device its own node: "
                          f"leave nodes out")
        return ALL_LINKS
    if nodes is None or nodes < 2:
        sbad("nodes", "emulated = true needs nodes = 2 or more")
    uneven = [c for c in counts if c % nodes]
    if uneven:
        sbad("counts", f"{uneven[0]} does not split evenly into {nodes} emulated nodes")
    return nodes


def _sizes(raw, sbad) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(raw, list) or not raw:
        sbad("sizes", f"a non-empty list of n or [m, n, k], got {raw!r}")
    out = []
    for x in raw:
        if type(x) is int and x >= 1:
            out.append((x, x, x))
        elif (isinstance(x, list) and len(x) == 3
              and all(type(v) is int and v >= 1 for v in x)):
            out.append(tuple(x))
        else:
            sbad("sizes", f"{x!r} is neither a positive n nor [m, n, k] of positive integers")
    _once(raw, out, "sizes", sbad)
    return tuple(out)


def _once(raw: list, shapes: list, key: str, sbad) -> None:
    """Refuse a size that a series lists twice (``n`` and ``[n, n, n]`` are one size): a
    typo, most likely, that would otherwise be measured once."""
    seen: dict[tuple, int] = {}
    for i, shape in enumerate(shapes):
        if shape in seen:
            first = raw[seen[shape]]
            also = "" if raw[i] == first else f" and {raw[i]!r}"
            sbad(key, f"{raw!r} repeats a size ({first!r}{also}, entries {seen[shape]} and {i})")
        seen[shape] = i


def _string(d, key, default, bad) -> str:
    value = d.get(key, default)
    if not isinstance(value, str):
        bad(key, f"a string, got {value!r}")
    return value


def _integer(d, key, default, low, bad) -> int:
    value = d.get(key, default)
    if type(value) is not int or value < low:
        bad(key, f"an integer of at least {low}, got {value!r}")
    return value


def _choice(d, key, default, allowed, bad) -> str:
    value = d.get(key, default)
    if value not in allowed:
        bad(key, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _choices(d, key, default, allowed, bad, empty_ok: bool = False) -> list[str]:
    value = d.get(key, default)
    if not isinstance(value, list) or (not value and not empty_ok):
        bad(key, f"a {'' if empty_ok else 'non-empty '}list of {', '.join(allowed)}, got {value!r}")
    for v in value:
        if v not in allowed:
            bad(key, f"{v!r} is not one of {', '.join(allowed)}")
    if len(set(value)) != len(value):
        bad(key, f"{value!r} names one twice")
    return list(value)
