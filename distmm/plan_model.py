"""A calibrated performance model of distmm's plans: pure functions and frozen dataclasses.

This module covers: the machine's parameters as plain data (``Calibration``: the GEMM rate per
device kind and dtype with its size dependence, latency and bandwidth per link kind, device
memory bandwidth, file read and write bandwidth, the overlap each engine achieves and its fixed
costs, memory per device), and an alpha-beta-gamma estimate of one product under one engine
(``predict``): the MPI engine's SUMMA on a ``layers x rows x cols`` grid with its k panels
broadcast while the previous panel multiplies (``distmm.grid``), the batch path's stripes read,
multiplied and written as a three-stage pipeline on the plan its ranks decide
(``distmm.plan_batch.decide_batch``) between a launch and start-up and an exit that grow with
the ranks of a node (``batch_fixed_seconds``), and the
Dask engine's block layout, one block of C per GPU worker (``distmm.plan_blocks.worker_grid``
and ``shares``) or one task per C tile on CPU workers (``distmm.plan.make_plan``), and the
single-GPU stream pipeline on host-resident operands (``distmm.plan_pipeline``: its k-blocks'
copies in, GEMMs and units' copies out scheduled on their own lanes, ``pipeline_schedule``; a
long schedule summarised from shorter ones that repeat as it does). Per plan it
gives the time and its compute / communication / I/O / fixed parts, the efficiency against P
times one device, the words each rank touches against the lower bounds of Kwasniewski et al.
(SC19, COSMA): memory-dependent ``2mnk / (P sqrt(S))`` for 2D (``S`` one copy of the operands
over P) and 2.5D (``c`` copies) and memory-independent ``3 (mnk/P)^(2/3)`` (3D), and a memory
check per rank that says by how much a rank's memory will not suffice. ``best_plan`` tries
every grid.

It does *not* cover: measuring the parameters (``distmm.cli.calibrate``), reading records or
comparing with them (``distmm.cli.model``), or running anything. Pure: numpy and the other
planners only; no engines, no I/O.

Units: seconds, bytes, flop/s, bytes/s. Communication volumes are in words (elements of the
accumulation dtype) where they are compared with the bounds, as the bounds are.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import numpy as np

from distmm.grid import GridPlan, grid_shapes, gpu_panels, make_grid
from distmm.plan import accumulate_dtype, make_plan
from distmm.plan_batch import batch_panels as panels_mode, decide_batch, plan_batch
from distmm.plan_blocks import shares, worker_grid
from distmm.plan_pipeline import TK_MAX, PipelineTiling, choose_tiling, plan_block_loads

__all__ = ["GemmRate", "Link", "Calibration", "Prediction", "Bounds", "predict", "best_plan",
           "lower_bounds", "batch_fixed_seconds", "ENGINES", "LINKS", "DEVICE_KINDS",
           "default_calibration", "pipeline_schedule", "PipelineSchedule", "COPIES",
           "PIPELINE_RING_BYTES"]

ENGINES = ("mpi", "batch", "dask", "pipeline")
#: how the stream pipeline's operands and result cross: ``ring`` (plain numpy arrays: host
#: threads copy them into and out of page-locked ring buffers, then the copy engines move
#: them), ``direct`` (arrays their owner page-locked: the copy engines read and write them
#: straight), ``locked`` (plain arrays page-locked in place by each call, a debug setting:
#: copied as ``direct``, after and before the call's ``cudaHostRegister`` and
#: ``cudaHostUnregister`` of every operand and the result, ``host_register`` /
#: ``host_unregister``, which stall the product while they run)
COPIES = ("ring", "direct", "locked")
#: bytes/s of ``cudaHostRegister`` and ``cudaHostUnregister`` of a numpy array's memory, nominal:
#: the middle of a probe's ranges (bench/NOTES.md, "Host-resident bfloat16 in the stream
#: pipeline", page-locking: ``bench/research/host_register.py`` on an H200 host, registering at
#: 24-34 ms a GiB and unregistering at 18-21 ms a GiB; no record measures them)
HOST_REGISTER_NOMINAL = 2**30 / 0.029
HOST_UNREGISTER_NOMINAL = 2**30 / 0.0195
#: a 2-D copy's rate between page-locked host rows and the device, as a share of a contiguous
#: copy's, by the bytes of each row it copies (both directions alike; below the first row
#: width its share, above the last 1): the stream pipeline's column blocks of B and C, traced
#: on one H200 (bench/NOTES.md, "Host-resident bfloat16 in the stream pipeline": 8 and 16 KB
#: rows 30-31 GB/s, 32 KB rows 41-47 GB/s, 64 KB rows 54 GB/s, against 54-55 GB/s contiguous)
PINNED_2D_SHARE = ((8192, 0.57), (16384, 0.56), (32768, 0.80), (65536, 0.98), (131072, 1.0))
#: page-locked staging bytes the ring holds at most (``distmm.pinned-pool``'s default, the
#: records' ``pinned_limit``): how far the host threads stage ahead of the copies to the device
PIPELINE_RING_BYTES = 2 * 2**30
#: k extent of the A and B panels a Dask GPU worker holds at once, for the memory check
DASK_K_GROUP = 8192
#: the first k piece of a Dask GPU block (one chunk of the studies' 8192): what a block task
#: receiving the rest through NCCL waits for before its first GEMM
DASK_FIRST_PIECE = 8192
DEVICE_KINDS = ("gpu", "cpu")
#: link kinds: pinned PCIe both ways, NCCL over NVLink, NCCL over sockets, host-staged MPI
#: (shared memory on one host), TCP between Dask workers, CUDA IPC between GPU workers
LINKS = ("pcie-h2d", "pcie-d2h", "nvlink", "nccl-socket", "mpi-host", "tcp", "ipc")


def _frozen(mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


def _check_number(**fields) -> None:
    """Refuse a field that is no real number (a string; a bool, which Python counts as 1 or
    0): ``TypeError`` naming it."""
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {value!r}")


@dataclass(frozen=True)
class GemmRate:
    """One device's GEMM rate: ``peak`` flop/s, reached as the GEMM's size ``s`` grows, as
    ``peak / (1 + (half_size / s)**2)``; ``half_size`` is the ``s`` at which the rate is half
    of it. ``size_rule`` says what ``s`` is: ``"min"``, ``min(m, n, k)`` (a GPU: a thin
    dimension leaves too few tiles to fill it); ``"volume"``, the side of the cube of the same
    work, ``(m n k)**(1/3)``, but no more than 8 ``min(m, n, k)`` (a core: its BLAS blocks are
    small, so a panel of a few hundred columns runs near its peak, and only a very thin one,
    towards a matrix-vector product, is held back by memory).

    >>> GemmRate(50e12, 1000).rate(1000, 4096, 4096) / 50e12
    0.5
    >>> round(GemmRate(40e9, 500, "volume").rate(2048, 2048, 512) / 40e9, 2)
    0.87
    """

    peak: float
    half_size: float = 0.0
    size_rule: str = "min"

    def __post_init__(self):
        _check_number(peak=self.peak, half_size=self.half_size)
        if not (self.peak > 0 and math.isfinite(self.peak)):
            raise ValueError(f"a GEMM rate must be a positive flop/s, got {self.peak!r}")
        if not (self.half_size >= 0 and math.isfinite(self.half_size)):
            raise ValueError(f"half_size must be finite and not negative, got {self.half_size!r}")
        if self.size_rule not in ("min", "volume"):
            raise ValueError(f"size_rule must be 'min' or 'volume', got {self.size_rule!r}")

    def size(self, m: int, n: int, k: int) -> float:
        low = min(m, n, k)
        if self.size_rule == "volume" and low > 0:
            return min(float(m * n * k) ** (1.0 / 3.0), 8.0 * low)
        return float(low)

    def rate(self, m: int, n: int, k: int) -> float:
        s = self.size(m, n, k)
        return self.peak / (1.0 + (self.half_size / s) ** 2) if s > 0 else self.peak

    def seconds(self, m: int, n: int, k: int) -> float:
        if min(m, n, k) <= 0:
            return 0.0
        return 2.0 * m * n * k / self.rate(m, n, k)


@dataclass(frozen=True)
class Link:
    """A link kind: ``latency`` seconds per message (per hop) and ``bandwidth`` bytes/s."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        _check_number(latency=self.latency, bandwidth=self.bandwidth)
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"a link's bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"a link's latency must be finite, not negative, seconds, got "
                             f"{self.latency!r}")

    def seconds(self, nbytes: float, hops: int = 1) -> float:
        return hops * self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    """The machine's parameters. Every field is per machine and link, never per product.

    Attributes
    ----------
    machine : str
        What the parameters describe (a device name, or ``host`` for CPUs).
    gemm : mapping
        ``"gpu:float32"``-style keys (``gpu``: one GPU; ``cpu``: one core while every core of
        the node is busy) -> ``GemmRate``.
    core_boost : mapping
        dtype name -> how much faster one core runs while it is the only one busy (1 or
        more: its clock and memory bandwidth are not shared); the time per flop falls
        linearly from all ``cores`` busy to one (``core_rate``). Missing: 1.
    links : mapping
        Link kind (``LINKS``) -> ``Link``.
    memory_bandwidth : mapping
        ``gpu`` / ``cpu`` -> bytes/s of the device's memory (a pass over C costs this).
    file_read, file_write : float
        Bytes/s one process reads its files at (``cat`` from the page cache: the batch path's
        ranks each read at this rate, a memory copy in their own process) and a node writes
        them with fsync (distmm's direct writes where measured).
    file_write_shared : float
        Bytes/s of the node when several ranks write disjoint ranges of one file.
    file_write_buffered : float
        Bytes/s of the node writing through the page cache and then syncing (``dd
        conv=fsync``), as the batch path wrote before its direct writes and still writes
        where it writes nothing past the page cache; 0: ``file_write``.
    host_staging : float
        Bytes/s the stream pipeline's host threads copy between the caller's pageable arrays
        and its page-locked ring, operands in and C out together (they share the host's
        memory); 0: half of ``memory_bandwidth["cpu"]`` (a copy reads and writes each byte).
    host_register, host_unregister : float
        Bytes/s at which the host page-locks a pageable array in place (``cudaHostRegister``)
        and unlocks it (``cudaHostUnregister``); the stream pipeline's ``locked`` copies pay
        both for every operand and the result. Default: ``HOST_REGISTER_NOMINAL`` /
        ``HOST_UNREGISTER_NOMINAL``.
    device_memory, host_memory : int
        Bytes per GPU, and per node.
    cores, gpus_per_node : int
    overlap : mapping
        Engine -> fraction of its communication that compute hides (``mpi``: the next
        panel's broadcast behind this panel's GEMM on GPU ranks; ``mpi-cpu``: the same on CPU
        ranks, 0 where missing: host MPI's ``Ibcast`` progresses only inside MPI calls and a
        CPU rank's cores are inside BLAS meanwhile; ``dask``: panel assembly behind the
        block's GEMM; ``batch``: 1, its stages are a pipeline).
    overheads : mapping
        Fixed seconds: ``mpi-call`` (one in-core product on the MPI engine), ``mpi-launch``
        (``mpiexec`` and Python start and exit of a batch job of one rank; ``mpi-launch-ofi``
        the same where ``MPI_Init`` probes Open MPI's libfabric BTL), ``batch-startup`` (the
        batch job's set-up: devices, files opened), and what each further rank of a node adds
        to a batch job (``batch_fixed_seconds``): ``mpi-exit`` to its exit (the driver
        releases the ranks' processes one after another), ``mpi-launch-rank`` to its launch,
        ``batch-startup-rank`` to its slowest GPU rank's set-up (processes starting CUDA at
        once contend for the driver); ``pipeline-call`` (a stream-pipeline product's set-up
        before its first GEMM may start: threads, device buffers, ring), ``pipeline-first-call``
        (what a process's first product through ``distmm.matmul`` adds: CUDA, cuBLAS, the
        ring's and the result's first pages); ``dask-call`` (the client's planning and
        scheduling of one product), ``dask-worker`` (each worker taking part), ``dask-task``
        (each task, tile mode).
    sources : mapping
        Parameter -> where it came from (``measured``, ``records: FILE...``, ``default``).
    """

    machine: str
    gemm: Mapping[str, GemmRate]
    links: Mapping[str, Link]
    memory_bandwidth: Mapping[str, float]
    file_read: float
    file_write: float
    file_write_shared: float
    device_memory: int
    host_memory: int
    cores: int = 1
    gpus_per_node: int = 8
    overlap: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"mpi": 0.9, "dask": 0.0, "batch": 1.0}))
    overheads: Mapping[str, float] = field(default_factory=lambda: _frozen(
        {"mpi-call": 0.0, "mpi-launch": 2.0, "batch-startup": 1.0, "dask-call": 0.02,
         "dask-worker": 0.0, "dask-task": 0.002}))
    sources: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    core_boost: Mapping[str, float] = field(default_factory=lambda: _frozen({}))
    file_write_buffered: float = 0.0
    host_staging: float = 0.0
    host_register: float = HOST_REGISTER_NOMINAL
    host_unregister: float = HOST_UNREGISTER_NOMINAL

    def __post_init__(self):
        for name in ("gemm", "links", "memory_bandwidth", "overlap", "overheads", "sources",
                     "core_boost"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        unknown = sorted(set(self.links) - set(LINKS))
        if unknown:
            raise ValueError(f"unknown link kind(s) {unknown}; known: {', '.join(LINKS)}")
        for key in self.gemm:
            kind, _, dt = key.partition(":")
            if kind not in DEVICE_KINDS or not dt:
                raise ValueError(f"GEMM rate key {key!r} must be 'gpu:DTYPE' or 'cpu:DTYPE'")
        if not isinstance(self.machine, str) or not self.machine:
            raise ValueError(f"machine must name the machine, got {self.machine!r}")
        for name in ("file_read", "file_write", "file_write_shared"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be positive bytes/s, got {getattr(self, name)!r}")
        for kind, value in self.memory_bandwidth.items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"memory_bandwidth of {kind} must be positive bytes/s, got "
                                 f"{value!r}")
        for name, value in self.overheads.items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"overhead {name} must be seconds, not negative, got {value!r}")
        for name in ("cores", "gpus_per_node", "device_memory", "host_memory"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (self.file_write_buffered >= 0 and math.isfinite(self.file_write_buffered)):
            raise ValueError(f"file_write_buffered must not be negative bytes/s, got "
                             f"{self.file_write_buffered!r}")
        if not (self.host_staging >= 0 and math.isfinite(self.host_staging)):
            raise ValueError(f"host_staging must not be negative bytes/s, got "
                             f"{self.host_staging!r}")
        for name in ("host_register", "host_unregister"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive bytes/s, got {value!r}")
        for eng, frac in self.overlap.items():
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"overlap of {eng} must lie in [0, 1], got {frac!r}")
        for dt, boost in self.core_boost.items():
            if not (boost >= 1.0 and math.isfinite(boost)):
                raise ValueError(f"core_boost of {dt} must be 1 or more, got {boost!r}")

    # -- look-ups ----------------------------------------------------------------------
    def rate(self, kind: str, dtype) -> GemmRate:
        """The GEMM rate of one ``kind`` device (a core for ``cpu``) in ``dtype``."""
        name = np.dtype(dtype).name
        got = self.gemm.get(f"{kind}:{name}")
        if got is None:
            have = ", ".join(sorted(self.gemm)) or "none"
            raise ValueError(f"the calibration of {self.machine!r} has no {kind} GEMM rate for "
                             f"{name} (it has: {have}); run distmm calibrate on such a machine")
        return got

    def core_rate(self, dtype, busy: int) -> GemmRate:
        """One core's GEMM rate in ``dtype`` while ``busy`` cores of its node compute:
        ``gemm["cpu:DTYPE"]`` with every core busy, ``core_boost`` times faster with one, the
        time per flop linear in between."""
        gemm = self.rate("cpu", dtype)
        boost = float(self.core_boost.get(np.dtype(dtype).name, 1.0))
        if boost == 1.0 or self.cores <= 1:
            return gemm
        frac = (min(max(int(busy), 1), self.cores) - 1) / (self.cores - 1)
        return replace(gemm, peak=gemm.peak / (1.0 / boost + frac * (1.0 - 1.0 / boost)))

    def link(self, name: str) -> Link:
        got = self.links.get(name)
        if got is None:
            raise ValueError(f"the calibration of {self.machine!r} has no {name!r} link "
                             f"(it has: {', '.join(sorted(self.links)) or 'none'})")
        return got

    def device_kinds(self) -> tuple[str, ...]:
        return tuple(sorted({k.split(":")[0] for k in self.gemm}))

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "distmm-calibration-1", "machine": self.machine,
                "gemm": {k: {"peak": v.peak, "half_size": v.half_size, "size_rule": v.size_rule}
                         for k, v in sorted(self.gemm.items())},
                "core_boost": dict(self.core_boost),
                "links": {k: {"latency": v.latency, "bandwidth": v.bandwidth}
                          for k, v in sorted(self.links.items())},
                "memory_bandwidth": dict(self.memory_bandwidth),
                "file_read": self.file_read, "file_write": self.file_write,
                "file_write_shared": self.file_write_shared,
                "file_write_buffered": self.file_write_buffered,
                "host_staging": self.host_staging,
                "host_register": self.host_register, "host_unregister": self.host_unregister,
                "device_memory": self.device_memory, "host_memory": self.host_memory,
                "cores": self.cores, "gpus_per_node": self.gpus_per_node,
                "overlap": dict(self.overlap), "overheads": dict(self.overheads),
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Calibration":
        """The inverse of ``to_dict``; a wrong format or field is a ``ValueError`` naming it."""
        if not isinstance(d, Mapping) or "format" not in d:
            raise ValueError("not a distmm calibration (no 'format': 'distmm-calibration-1')")
        if d["format"] != "distmm-calibration-1":
            raise ValueError(f"not a distmm calibration this version reads: format "
                             f"{d['format']!r}, not 'distmm-calibration-1' (run distmm calibrate)")

        def whole(key, default=None):  # an integer field: 2.5 cores is no count
            value = d[key] if default is None else d.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not float(value).is_integer():
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
            return int(value)

        def number(value, where):  # a float field: a string or true is no rate
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where} must be a number, got {value!r}")
            return float(value)

        def scalar(key, default=None):
            return number(d[key] if default is None else d.get(key, default), key)

        def table(key, required=False):  # a mapping of names to float fields
            return {k: number(v, f"{key}[{k!r}]")
                    for k, v in (d[key] if required else d.get(key, {})).items()}

        def named(where, kind, *args):  # a GemmRate or Link, its errors naming it
            try:
                return kind(*args)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None

        def rate(k, v):
            where = f"gemm[{k!r}]"
            return named(where, GemmRate, number(v["peak"], f"{where}.peak"),
                         number(v.get("half_size", 0.0), f"{where}.half_size"),
                         str(v.get("size_rule", "min")))

        def link(k, v):
            where = f"links[{k!r}]"
            return named(where, Link, number(v["latency"], f"{where}.latency"),
                         number(v["bandwidth"], f"{where}.bandwidth"))

        try:
            return cls(machine=d["machine"],
                       gemm={k: rate(k, v) for k, v in d["gemm"].items()},
                       core_boost=table("core_boost"),
                       links={k: link(k, v) for k, v in d["links"].items()},
                       memory_bandwidth=table("memory_bandwidth", required=True),
                       file_read=scalar("file_read"), file_write=scalar("file_write"),
                       file_write_shared=scalar("file_write_shared"),
                       file_write_buffered=scalar("file_write_buffered", 0.0),
                       host_staging=scalar("host_staging", 0.0),
                       host_register=scalar("host_register", HOST_REGISTER_NOMINAL),
                       host_unregister=scalar("host_unregister", HOST_UNREGISTER_NOMINAL),
                       device_memory=whole("device_memory"), host_memory=whole("host_memory"),
                       cores=whole("cores", 1), gpus_per_node=whole("gpus_per_node", 8),
                       overlap=table("overlap") or {"mpi": 0.9, "dask": 0.0, "batch": 1.0},
                       overheads=table("overheads"),
                       sources={k: str(v) for k, v in d.get("sources", {}).items()})
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"calibration field missing or malformed: {exc}") from None

    def with_overheads(self, **values) -> "Calibration":
        o = dict(self.overheads)
        o.update({k.replace("_", "-"): float(v) for k, v in values.items()})
        return replace(self, overheads=o)

    def overhead(self, name: str) -> float:
        return float(self.overheads.get(name, 0.0))

    def staging_rate(self) -> float:
        """Bytes/s of the stream pipeline's host copies through its ring (``host_staging``,
        or half of the host's memory bandwidth where that is not known)."""
        if self.host_staging > 0:
            return float(self.host_staging)
        return float(self.memory_bandwidth.get("cpu", 20e9)) / 2.0


def default_calibration() -> Calibration:
    """Nominal parameters of an 8-GPU H100 node (datasheet-order values, not measured:
    every source says ``default``); ``distmm calibrate`` replaces them with measured ones."""
    gib = 2**30
    links = {"pcie-h2d": Link(10e-6, 25e9), "pcie-d2h": Link(10e-6, 25e9),
             "nvlink": Link(20e-6, 150e9), "nccl-socket": Link(50e-6, 10e9),
             "mpi-host": Link(5e-6, 8e9), "tcp": Link(100e-6, 1e9), "ipc": Link(50e-6, 150e9)}
    gemm = {"gpu:float32": GemmRate(53e12, 1000.0), "gpu:float64": GemmRate(50e12, 1000.0),
            "gpu:float16": GemmRate(600e12, 2000.0),
            "cpu:float32": GemmRate(60e9, 64.0, "volume"),
            "cpu:float64": GemmRate(30e9, 64.0, "volume")}
    params = list(gemm) + list(links) + ["files", "memory", "overlap", "overheads",
                                         "host_register", "host_unregister"]
    return Calibration(machine="nominal H100 node", gemm=gemm, links=links,
                       memory_bandwidth={"gpu": 3.0e12, "cpu": 20e9},
                       file_read=5e9, file_write=1.5e9, file_write_shared=1.5e9,
                       device_memory=80 * gib, host_memory=1024 * gib, cores=64,
                       gpus_per_node=8, sources={p: "default" for p in params})


# ------------------------------------------------------------------------- lower bounds

@dataclass(frozen=True)
class Bounds:
    """Lower bounds on the words one rank must touch (load or hold: its inputs and the
    partial sums of its C), after Kwasniewski et al., SC19. ``memory`` uses the words a
    rank may hold (``S``), ``two_d`` one copy of the operands over P, ``two_and_half_d``
    ``replication`` copies, ``three_d`` none (memory-independent)."""

    two_d: float
    two_and_half_d: float
    replication: int
    three_d: float
    memory: float

    @property
    def lower(self) -> float:
        """The bound every plan obeys: the larger of the 3D and the memory bound."""
        return max(self.three_d, self.memory)


def lower_bounds(m: int, n: int, k: int, ranks: int, memory_words: float | None = None) -> Bounds:
    """The COSMA bounds for ``C[m, n] = A[m, k] @ B[k, n]`` on ``ranks`` ranks.

    >>> b = lower_bounds(1024, 1024, 1024, 8)
    >>> round(b.three_d) == round(3 * (1024**3 / 8) ** (2 / 3))
    True
    """
    p = max(int(ranks), 1)
    mnk = float(m) * n * k
    if mnk == 0:
        return Bounds(0.0, 0.0, 1, 0.0, 0.0)
    s_min = (float(m) * k + float(k) * n + float(m) * n) / p
    two_d = 2.0 * mnk / (p * math.sqrt(s_min))
    c = max(1, int(round(p ** (1 / 3))))
    if memory_words is not None:
        c = max(1, min(c, int(memory_words // s_min)))
    two_half = 2.0 * mnk / (p * math.sqrt(c * s_min))
    three_d = 3.0 * (mnk / p) ** (2.0 / 3.0)
    mem = 2.0 * mnk / (p * math.sqrt(memory_words)) if memory_words else 0.0
    return Bounds(two_d, two_half, c, three_d, mem)


# ------------------------------------------------------------------------- predictions

@dataclass(frozen=True)
class Prediction:
    """The model's estimate of one product on ``devices`` devices under ``engine``.

    ``seconds = compute + communication + io + overhead`` (each the part that is not hidden
    behind another). ``efficiency``: one device's time for the whole product at its full rate
    over ``devices x seconds``. ``words_touched``: the most words one rank loads or holds
    (its A and B panels and C partials), compared with ``bounds``. ``memory_needed``: the most
    bytes one rank holds at once; ``memory_available`` what it has; ``shortfall`` the bytes
    missing (0: it fits).
    """

    engine: str
    devices: int
    device: str
    link: str
    m: int
    n: int
    k: int
    dtype: str
    grid: tuple[int, ...]
    seconds: float
    compute: float
    communication: float
    io: float
    overhead: float
    efficiency: float
    bytes_received: int
    words_touched: float
    bounds: Bounds
    memory_needed: int
    memory_available: int
    note: str = ""

    @property
    def replication(self) -> int:
        return self.grid[0] if len(self.grid) == 3 else 1

    @property
    def shortfall(self) -> int:
        return max(0, self.memory_needed - self.memory_available)

    @property
    def fits(self) -> bool:
        return self.shortfall == 0

    def memory_warning(self) -> str:
        """One line when a rank's memory will not suffice, else ''."""
        if self.fits:
            return ""
        gib = 2**30
        return (f"warning: on {self.devices} {self.device}(s) a rank needs "
                f"{self.memory_needed / gib:.1f} GiB but has {self.memory_available / gib:.1f} "
                f"GiB: {self.shortfall / gib:.1f} GiB "
                f"({self.shortfall / self.memory_available:.0%}) "
                f"short")

    def to_dict(self) -> dict:
        b = self.bounds
        return {"engine": self.engine, "devices": self.devices, "device": self.device,
                "link": self.link, "m": self.m, "n": self.n, "k": self.k, "dtype": self.dtype,
                "grid": list(self.grid), "predicted_seconds": self.seconds,
                "compute_seconds": self.compute, "communication_seconds": self.communication,
                "io_seconds": self.io, "overhead_seconds": self.overhead,
                "efficiency": self.efficiency, "bytes_received": self.bytes_received,
                "words_touched": self.words_touched,
                "bounds": {"2d": b.two_d, "2.5d": b.two_and_half_d, "replication": b.replication,
                           "3d": b.three_d, "memory": b.memory},
                "memory_needed": self.memory_needed, "memory_available": self.memory_available,
                "shortfall": self.shortfall, "note": self.note}


def _check(m, n, k, devices, engine, device):
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if isinstance(devices, bool) or int(devices) != devices or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if device not in DEVICE_KINDS:
        raise ValueError(f"device must be one of {', '.join(DEVICE_KINDS)}, got {device!r}")


def _broadcast_seconds(link: Link, nbytes: float, group: int) -> float:
    """A pipelined broadcast to ``group`` ranks: the bytes once at the link's rate, a
    latency per tree level."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return link.seconds(nbytes, hops=max(1, math.ceil(math.log2(group))))


def _mpi_rank(grid: GridPlan, rank: int, gemm: GemmRate, share: float, link_name: str, cal,
              kind: str, overlap: float):
    """(compute, exposed communication) of one rank of SUMMA on ``grid``."""
    layer, i, j = grid.coords(rank)
    size = grid.itemsize
    link = cal.link(link_name)
    mi = grid.row_edges[i + 1] - grid.row_edges[i]
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    if grid.ranks == 1:
        return gemm.seconds(mi, nj, grid.k) * share, 0.0
    pe = grid.panel_edges[layer]
    widths = [b - a for a, b in zip(pe, pe[1:])]
    mem_bw = cal.memory_bandwidth.get(kind, 0.0)
    staged = kind == "gpu" and link_name not in ("nvlink", "nccl-socket")
    # ranks on several hosts (or emulated nodes: ``gpus_per_node`` consecutive ranks a node)
    # through NCCL: a process row's or column's broadcast whose ranks share one node stays on
    # NVLink, one that spans nodes takes the socket link (the SUMMA traces: row broadcasts
    # inside an emulated node at NVLink rates while the column broadcasts between nodes ran at
    # 3-6 GB/s); on one host every broadcast takes the link named
    per_node = max(1, cal.gpus_per_node)
    hosts = (kind == "gpu" and link_name == "nccl-socket" and grid.ranks > per_node
             and "nvlink" in cal.links)
    row_link = col_link = link
    if hosts:
        row = {grid.rank_at(layer, i, jj) // per_node for jj in range(grid.cols)}
        col = {grid.rank_at(layer, ii, j) // per_node for ii in range(grid.rows)}
        row_link = link if len(row) > 1 else cal.link("nvlink")
        col_link = link if len(col) > 1 else cal.link("nvlink")
    comp, comm, serial = [], [], []
    for p, w in enumerate(widths):
        g = gemm.seconds(mi, nj, w) * share
        if p and kind == "gpu" and mem_bw > 0:  # beta = 1: the GEMM rereads and rewrites C
            g += 2.0 * mi * nj * size * share / mem_bw
        comp.append(g)
        c = (_broadcast_seconds(row_link, mi * w * size, grid.cols)
             + _broadcast_seconds(col_link, w * nj * size, grid.rows))
        s = 0.0
        if staged and c:  # host-staged: each panel leaves one device and enters another
            nbytes = (mi * w if grid.cols > 1 else 0) + (w * nj if grid.rows > 1 else 0)
            s = share * (cal.link("pcie-d2h").seconds(nbytes * size)
                         + cal.link("pcie-h2d").seconds(nbytes * size))
        comm.append(c)
        serial.append(s)
    # panel 0's broadcast is exposed; panel p+1's moves while panel p multiplies, but where
    # nothing moves it then (``overlap`` 0: CPU ranks, whose host Ibcast progresses only
    # inside MPI calls) every broadcast comes between two GEMMs. A host-staged panel's copies
    # off and onto the device run on the rank's compute stream (``HostStagedBroadcaster``:
    # the root's synchronous copy out before the next GEMM is queued, the receivers' copy in
    # queued behind the GEMM before): they come between two GEMMs, only the host MPI hides
    exposed = comm[0] + serial[0] if comm else 0.0
    for p in range(len(widths) - 1):
        # what outlasts the GEMM, and the share of the rest that ``overlap`` leaves exposed
        exposed += (serial[p + 1] + max(0.0, comm[p + 1] - comp[p])
                    + (1 - overlap) * min(comm[p + 1], comp[p]))
    red = sum(1 for dst, _ in grid.reduction if dst == layer)
    if red:
        nbytes = mi * nj * size
        host = cal.link("mpi-host") if "mpi-host" in cal.links else link
        each = host.seconds(nbytes)
        if kind == "gpu":
            each += cal.link("pcie-d2h").seconds(nbytes) + cal.link("pcie-h2d").seconds(nbytes)
        exposed += red * each
    return sum(comp), exposed


def _grid_touched(grid: GridPlan, rank: int) -> float:
    layer, i, j = grid.coords(rank)
    mi = grid.row_edges[i + 1] - grid.row_edges[i]
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    kl = grid.layer_edges[layer + 1] - grid.layer_edges[layer]
    red = sum(1 for dst, _ in grid.reduction if dst == layer)
    return float(mi * kl + kl * nj + mi * nj * (1 + red))


def _grid_held(grid: GridPlan, rank: int, kind: str) -> int:
    """Bytes a SUMMA rank holds: its A, B and C blocks, two A and two B panel buffers
    (the one multiplying and the one arriving) and, with layers, a partial to add."""
    layer, i, j = grid.coords(rank)
    size = grid.itemsize
    mi = grid.row_edges[i + 1] - grid.row_edges[i]
    nj = grid.col_edges[j + 1] - grid.col_edges[j]
    own_a = grid.a_k_edges[layer][j + 1] - grid.a_k_edges[layer][j]
    own_b = grid.b_k_edges[layer][i + 1] - grid.b_k_edges[layer][i]
    pe = grid.panel_edges[layer]
    w = max((b - a for a, b in zip(pe, pe[1:])), default=0) if grid.ranks > 1 else 0
    held = mi * own_a + own_b * nj + mi * nj + 2 * (mi * w + w * nj)
    if grid.layers > 1 and kind == "cpu":
        held += mi * nj
    return int(held * size)


def _representatives(grid: GridPlan) -> list[int]:
    """Ranks whose blocks are largest or whose owned parts are smallest (even edges put the
    larger blocks first): the corners of the grid, on the first and last layer."""
    out = set()
    for layer in {0, grid.layers - 1}:
        for i in {0, grid.rows - 1}:
            for j in {0, grid.cols - 1}:
                out.add(grid.rank_at(layer, i, j))
    return sorted(out)


def _devices_info(cal: Calibration, device: str, devices: int, ranks_per_device: int,
                  memory: int | None):
    if device == "gpu":
        avail = int(memory) if memory is not None else int(cal.device_memory)
    else:
        per_node = max(1, min(devices, cal.cores))
        avail = int(memory) if memory is not None else int(cal.host_memory // per_node)
    return avail // max(1, ranks_per_device)


def _one_device_seconds(m, n, k, gemm: GemmRate) -> float:
    return 2.0 * m * n * k / gemm.peak if m and n and k else 0.0


def _rank_rate(cal, device, acc, ranks_per_device, threads_per_rank, ranks=1):
    """One rank's GEMM rate and the factor its device is shared by: a GPU shared by
    ``ranks_per_device`` ranks, or a CPU rank of ``threads_per_rank`` cores whose cores
    ``ranks_per_device`` ranks share (more ranks than cores), ``ranks`` of them at once."""
    if device == "cpu":
        gemm = cal.core_rate(acc, ranks * max(1, threads_per_rank))
        gemm = replace(gemm, peak=gemm.peak * max(1, threads_per_rank))
    else:
        gemm = cal.rate(device, acc)
    return gemm, float(max(1, ranks_per_device))


def _mpi(m, n, k, dt, devices, cal, device, link_name, grid, memory, ranks_per_device,
         threads_per_rank):
    acc = accumulate_dtype(np.dtype(dt))
    gemm, share = _rank_rate(cal, device, acc, ranks_per_device, threads_per_rank, devices)
    cal.link(link_name)
    g = grid if isinstance(grid, GridPlan) else make_grid(m, n, k, dt, ranks=devices, grid=grid)
    if device == "gpu":  # the engine's panels: narrow ones where ranks are across a network
        g = gpu_panels(g, across_hosts=link_name == "nccl-socket")
    # a CPU rank's panel broadcasts (host MPI's Ibcast) progress only inside MPI calls, and its
    # cores are inside BLAS while a panel multiplies: nothing hides them unless a calibration
    # says so (``mpi-cpu``); GPU ranks' broadcasts run on their own streams (``mpi``)
    overlap = (cal.overlap.get("mpi", 0.9) if device == "gpu"
               else cal.overlap.get("mpi-cpu", 0.0))
    worst = (0.0, 0.0, 0.0)
    for r in _representatives(g):
        c, x = _mpi_rank(g, r, gemm, share, link_name, cal, device, overlap)
        if c + x > worst[0] + worst[1]:
            worst = (c, x, 0.0)
    reps = _representatives(g)
    received = max(g.bytes_received(r) for r in reps)
    touched = max(_grid_touched(g, r) for r in reps)
    held = max(_grid_held(g, r, device) for r in reps)
    return g.shape, worst[0], worst[1], 0.0, cal.overhead("mpi-call"), received, touched, held, ""


def batch_fixed_seconds(cal: Calibration, ranks_per_node: int, *, device: str = "gpu",
                        mpi_ofi: bool = False) -> float:
    """The fixed seconds of a batch job (``mpirun -n P distmm matmul``) whose nodes run
    ``ranks_per_node`` ranks each: one rank's launch, start-up and exit (``mpi-launch``, or
    ``mpi-launch-ofi`` where ``mpi_ofi`` and the calibration has it; ``batch-startup``), and
    for each further rank of a node ``mpi-exit`` + ``mpi-launch-rank``, plus
    ``batch-startup-rank`` where the ranks are GPU ranks (their CUDA start-up contends).

    >>> cal = default_calibration().with_overheads(mpi_launch=1.25, batch_startup=0.75,
    ...     mpi_exit=0.125, mpi_launch_rank=0.0625, batch_startup_rank=0.0625)
    >>> batch_fixed_seconds(cal, 1), batch_fixed_seconds(cal, 4)
    (2.0, 2.75)
    """
    launch = cal.overheads.get("mpi-launch-ofi") if mpi_ofi else None
    one = ((cal.overhead("mpi-launch") if launch is None else float(launch))
           + cal.overhead("batch-startup"))
    each = cal.overhead("mpi-exit") + cal.overhead("mpi-launch-rank")
    if device == "gpu":
        each += cal.overhead("batch-startup-rank")
    return one + each * (max(1, int(ranks_per_node)) - 1)


def _batch_setup(m, n, k, dt, devices, cal, device, grid, memory, avail, per_node, panels):
    """What ``mpirun -n devices distmm matmul`` runs, as ``distmm.plan_batch.decide_batch``
    decides it, on the hosts the model assumes (``per_node`` ranks a node, each node a host):
    ``(plan, panels mode, note)``. A GPU rank may hold ``avail``; CPU ranks share the node's
    memory (``host_memory``, or ``memory`` a rank), without a limit on one rank's, as the batch
    path plans them. A forced ``grid`` (a record's) keeps decide_batch's panels mode. Where B's
    column panel does not fit a GPU rank, planned without the limit and said in the note."""
    on_gpu = device == "gpu"
    hosts = -(-devices // per_node)
    host = None if on_gpu else (int(cal.host_memory) if memory is None
                                else int(memory) * per_node)
    forced = None if grid is None else tuple(grid)[-2:]

    def decide(limit):
        if forced is None:
            setup = decide_batch(m, n, k, dt, ranks=devices, hosts=hosts, on_gpu=on_gpu,
                                 panels=panels, memory=limit, host_memory=host)
            return setup.plan, setup.panels
        return (plan_batch(m, n, k, dt, ranks=devices, memory=limit, grid=forced),
                panels_mode(panels, hosts=hosts, on_gpu=on_gpu))

    limit = avail if on_gpu else None
    try:
        return (*decide(limit), "")
    except ValueError:
        if limit is None:
            raise
        return (*decide(None),
                "the batch planner refuses this: B's column panel does not fit a rank")


def _batch(m, n, k, dt, devices, cal, device, link_name, grid, memory, ranks_per_device,
           panels="auto", direct_writes=True, mpi_ofi=False):
    acc = accumulate_dtype(np.dtype(dt))
    size = np.dtype(acc).itemsize
    gemm = cal.core_rate(acc, devices) if device == "cpu" else cal.rate(device, acc)
    share = max(1, ranks_per_device)
    avail = _devices_info(cal, device, devices, ranks_per_device, memory)
    per_node = max(1, min(devices, cal.gpus_per_node if device == "gpu" else cal.cores))
    bp, mode, note = _batch_setup(m, n, k, dt, devices, cal, device, grid, memory, avail,
                                  per_node, panels)
    g = bp.grid
    # the operands are read from the page cache, a memory copy in each rank's own process: a
    # rank reads at cat's single-reader rate whatever the others do (4 ranks of one host read
    # at 4.3-7.0 GB/s each against cat's 7-8 GB/s: bench/NOTES.md, "Batch jobs", `preadv`)
    read_bw = cal.file_read
    if direct_writes:  # C's rows past the page cache (distmm.direct_io)
        write_bw = (cal.file_write if per_node == 1 else cal.file_write_shared) / per_node
    else:  # through the page cache, then synced: the disk's buffered rate
        write_bw = (cal.file_write_buffered or cal.file_write) / per_node
    worst = None
    for r in _representatives(g):
        _, i, j = g.coords(r)
        mi = g.row_edges[i + 1] - g.row_edges[i]
        nj = g.col_edges[j + 1] - g.col_edges[j]
        stripes = max(1, bp.stripe_count(i))
        h = math.ceil(mi / stripes) if mi else 0
        # GPU ranks sharing B (batch-panels share, auto's choice on one host) read a share
        # of its rows each and copy the others' from their GPUs
        split = g.rows if mode == "share" and g.rows > 1 else 1
        panel_read = k * nj * size / split / read_bw
        if device == "gpu":
            panel_read += cal.link("pcie-h2d").seconds(k * nj * size / split)
        if split > 1:
            panel_read += cal.link(link_name).seconds(k * nj * size * (split - 1) / split)
        r_s = h * k * size / read_bw
        c_s = gemm.seconds(h, nj, k) * share
        if device == "gpu":
            c_s += cal.link("pcie-h2d").seconds(h * k * size) + cal.link("pcie-d2h").seconds(
                h * nj * size)
        w_s = h * nj * size / write_bw
        pipe = panel_read + r_s + c_s + w_s + (stripes - 1) * max(r_s, c_s, w_s)
        comp = stripes * c_s
        io = pipe - comp if pipe > comp else 0.0
        if worst is None or pipe > worst[0]:
            worst = (pipe, comp, io, mi, nj)
    pipe, comp, io, mi, nj = worst
    overhead = batch_fixed_seconds(cal, per_node, device=device, mpi_ofi=mpi_ofi)
    received = (mi * k + k * nj) * size  # read from the files (k never split)
    touched = float(mi * k + k * nj + mi * nj)
    held = max(bp.held_bytes)
    return g.shape, comp, 0.0, io, overhead, received, touched, held, note


def _dask(m, n, k, dt, devices, cal, device, link_name, grid, memory, ranks_per_device,
          extra_cpu_workers):
    acc = accumulate_dtype(np.dtype(dt))
    size = np.dtype(acc).itemsize
    link = cal.link(link_name)
    overlap = cal.overlap.get("dask", 0.0)
    if device == "gpu":
        gemm = cal.rate("gpu", acc)
        share = max(1, ranks_per_device)
        rates = [gemm.peak / share / 1e9] * devices
        if extra_cpu_workers:
            core = (cal.core_rate(acc, extra_cpu_workers)
                    if f"cpu:{np.dtype(acc).name}" in cal.gemm else None)
            rates += [core.peak / 1e9 if core else 0.0] * extra_cpu_workers
        sh = shares(rates, m, n, k, size)
        working = [i for i, s in enumerate(sh) if s > 0]
        units = len(working)
        pr, pc = worker_grid(units, m, n) if units else (1, 1)
        # workers on more than one host (or emulated node): the remote chunks of a worker's own
        # host come through CUDA IPC, those of other hosts over ``link`` (TCP's bandwidth the
        # node's workers share, NCCL's each pair's own); through NCCL they arrive while the
        # block's k pieces multiply
        # (only the first piece's wait is exposed), over TCP before the block task starts
        per_node = max(1, min(devices, cal.gpus_per_node))
        hosts = devices > per_node and link_name in ("nccl-socket", "tcp")
        near_link = cal.links.get("ipc", link)
        # the slowest of the working units: its share of C, its A row and B column panels
        worst = (0.0, 0.0)
        for u in working:
            area = sh[u] * m * n
            mi = m / pr
            nj = area / mi if mi else 0
            rate = rates[u] * 1e9 * (gemm.rate(int(mi), int(nj), k) / gemm.peak)
            comp = 2.0 * mi * nj * k / rate if rate else 0.0
            panels = (mi * k + k * nj) * size
            if hosts:
                near = near_link.seconds((per_node - 1) / devices * panels)
                # TCP: the node's workers share the link; NCCL's socket transport connects
                # each pair of GPUs on its own (the SUMMA traces: two broadcasts between the
                # same two emulated nodes at once, each at the link's rate)
                sharing = 1 if link_name == "nccl-socket" else per_node
                far = link.seconds((devices - per_node) / devices * panels * sharing)
                exposed = max(0.0, near - overlap * comp)
                if link_name == "nccl-socket":
                    first = far * min(k, DASK_FIRST_PIECE) / k if k else 0.0
                    exposed += first + max(0.0, far - first - comp)
                else:
                    exposed += far
            else:
                remote = (1.0 - 1.0 / devices) * panels if devices > 1 else 0.0
                comm = link.seconds(remote) if remote else 0.0
                exposed = max(0.0, comm - overlap * comp)
            if comp + exposed > sum(worst):
                worst = (comp, exposed)
        comp, exposed = worst
        overhead = cal.overhead("dask-call") + cal.overhead("dask-worker") * units
        mi, nj = m / pr, n / pc
        received = int((1.0 - 1.0 / devices) * (mi * k + k * nj) * size)
        touched = mi * k + k * nj + mi * nj
        # block mode cuts a block into cells that fit the device (distmm.plan_blocks): the
        # block of C stays, panels of A and B pass through, two k groups at a time
        kg = min(k, DASK_K_GROUP)
        held = int((mi * nj + 2 * (mi * kg + kg * nj)) * size)
        return (pr, pc), comp, exposed, 0.0, overhead, received, touched, held, ""
    # CPU workers: one task per C tile, tiles spread over the workers' threads
    core = cal.core_rate(acc, devices)
    plan = make_plan(m, n, k, dt, workers=devices)
    gm, gn = plan.grid
    tiles = gm * gn * plan.k_splits
    tm, tn, _ = plan.tile
    per_worker = math.ceil(tiles / devices)
    share = max(1.0, devices / max(cal.cores, 1))
    comp = per_worker * core.seconds(tm, tn, math.ceil(k / plan.k_splits)) * share
    moved = (1.0 - 1.0 / devices) * plan.bytes_moved / devices if devices > 1 else 0.0
    comm = link.seconds(moved) if moved else 0.0
    if per_worker > 1 and moved:
        # a worker fetches the operands of its queued tiles while it multiplies the running
        # one: only the first tile's wait is exposed, and what the tiles' compute cannot hide
        first = link.seconds(min(moved, (tm + tn) * math.ceil(k / plan.k_splits) * size))
        exposed = first + max(0.0, comm - first - comp)
    else:
        exposed = max(0.0, comm - overlap * comp)
    overhead = (cal.overhead("dask-call") + cal.overhead("dask-worker") * devices
                + cal.overhead("dask-task") * per_worker)
    touched = float(per_worker * (tm * k + k * tn + tm * tn))
    return ((gm, gn), comp, exposed, 0.0, overhead, int(moved), touched,
            int(plan.peak_memory_per_worker), "")


# ------------------------------------------------------------------------- stream pipeline

@dataclass(frozen=True)
class PipelineSchedule:
    """The stream pipeline's schedule as the model runs it: ``seconds`` from the call's start
    to the last byte of C back in host memory (the set-up ``latency`` before the first GEMM
    included), each lane's busy seconds (``gemm``, ``h2d``, ``d2h``, ``host``: the host
    threads' copies into and out of the ring), the bytes each way and the tiling."""

    seconds: float
    gemm: float
    h2d: float
    d2h: float
    host: float
    latency: float
    bytes_in: int
    bytes_out: int
    tiling: PipelineTiling


def tiling_from_sizes(d: Mapping) -> PipelineTiling:
    """A ``PipelineTiling`` from its ``describe()`` form (what a pipeline record's ``tiling``
    holds: ``row_sizes``, ``col_sizes``, ``k_sizes``, slot counts, ``itemsize``, ``mode``, and
    ``lead`` where the schedule had leading k-outer units: 1 in records without it)."""
    return PipelineTiling(_edges_of(d["row_sizes"]), _edges_of(d["col_sizes"]),
                          _edges_of(d["k_sizes"]), int(d["a_slots"]), int(d["b_slots"]),
                          int(d["c_buffers"]), int(d["itemsize"]), str(d.get("mode", "tiles")),
                          int(d.get("lead", 1)))


def _edges_of(sizes) -> tuple[int, ...]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + int(size))
    return tuple(out)


def _list_schedule(jobs) -> list[float]:
    """End times of ``jobs`` (``(lane, seconds, deps)``, deps indices of other jobs), each lane
    one job at a time: the job that can start earliest goes first (a lane's queue in the
    order its jobs became ready; the streams' order is in the deps)."""
    import heapq

    n = len(jobs)
    waiting = [0] * n
    dependents: dict = {}
    ready = [0.0] * n
    end = [0.0] * n
    lanes: dict = {}          # lane -> its index, in the order lanes first appear
    heaps: list = []
    free: list = []
    lane_of = [0] * n
    for j, (lane, _, deps) in enumerate(jobs):
        at = lanes.get(lane)
        if at is None:
            at = lanes[lane] = len(heaps)
            heaps.append([])
            free.append(0.0)
        lane_of[j] = at
        uniq = set(deps)
        waiting[j] = len(uniq)
        for d in uniq:
            dependents.setdefault(d, []).append(j)
        if not uniq:
            heapq.heappush(heaps[at], (0.0, j))
    order = range(len(heaps))
    for _ in range(n):
        best_j = -1
        best_start = best_lane = 0
        for lane in order:
            heap = heaps[lane]
            if heap:
                at, j = heap[0]
                start = at if at > free[lane] else free[lane]
                if best_j < 0 or start < best_start or (start == best_start and j < best_j):
                    best_start, best_j, best_lane = start, j, lane
        if best_j < 0:
            raise ValueError("the pipeline's schedule has a cycle")
        heapq.heappop(heaps[best_lane])
        done = end[best_j] = free[best_lane] = best_start + jobs[best_j][1]
        for d in dependents.pop(best_j, ()):
            if done > ready[d]:
                ready[d] = done
            waiting[d] -= 1
            if waiting[d] == 0:
                heapq.heappush(heaps[lane_of[d]], (ready[d], d))
    return end


#: through the ring, operand blocks and a unit's C cross in pieces of at most this many bytes
#: (the ring's buffers), so that the host threads' copies and the copy engines' overlap
_RING_PIECE = 32 * 2**20


def pinned_2d_share(row_bytes: float) -> float:
    """``PINNED_2D_SHARE`` at ``row_bytes``, interpolated in the logarithm of the width.

    >>> pinned_2d_share(4096), pinned_2d_share(1 << 20)
    (0.57, 1.0)
    """
    pts = PINNED_2D_SHARE
    if row_bytes <= pts[0][0]:
        return pts[0][1]
    for (w0, s0), (w1, s1) in zip(pts, pts[1:]):
        if row_bytes <= w1:
            f = math.log(row_bytes / w0) / math.log(w1 / w0)
            return s0 + f * (s1 - s0)
    return pts[-1][1]


#: the stream pipeline's schedules the model simulates kernel by kernel whole (a record's lists
#: a few hundred kernels); a longer one is summarised from shorter ones (``_summarised``)
SIMULATED_STEPS = 2**14
#: kernels the shorter schedules of a summary may list in all (a second or two of simulation):
#: a schedule whose rows of units are too long for that (very many k-blocks) is refused
SUMMARY_STEPS = 2**16
#: the lanes a schedule's jobs run on, one job at a time each (besides the call's set-up)
_LANES = ("gemm", "h2d", "d2h", "host")


def _widest_run(edges):
    """An axis's sizes as ``(head, width, count, tail)``: its widest entries, which must run
    together, the first of them ending ``head`` and ``count`` more after it; None otherwise."""
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    width = max(sizes)
    first, last = sizes.index(width), len(sizes) - 1 - sizes[::-1].index(width)
    if any(size != width for size in sizes[first:last + 1]):
        return None
    return sizes[:first + 1], width, last - first, sizes[last + 1:]


def _fewest_units(t: PipelineTiling) -> tuple:
    """The fewest rows and columns of units a shorter schedule keeps so that its blocks are
    cached as in ``t``'s (None: all of them)."""
    gm, gn, gk = (len(e) - 1 for e in (t.row_edges, t.col_edges, t.k_edges))
    if t.b_resident:  # units of whole columns (the leading ones k outer, C's buffers filling)
        # or, in column blocks, in the growing order, which interleaves new rows and columns
        run = _widest_run(t.row_edges)
        return (None if gn > 1 or run is None else t.lead + t.c_buffers + len(run[3])), None
    if gm > 1 and t.b_slots < gk * gn:  # B partly cached from one sweep to the next: two
        # columns more than its slots hold
        return 2, -(-t.b_slots // gk) + 2
    return 2, 2


def _summarised(tiling: PipelineTiling, simulate, mnk) -> tuple:
    """The time, each lane's busy seconds (``_LANES``) and the bytes in and out of
    ``tiling``'s schedule: ``simulate(tiling)``, or where that lists more than
    ``SIMULATED_STEPS`` kernels, extrapolated from shorter schedules.

    Rows of units alike and the units of a row alike repeat: units sweep rows in serpentine
    order and k-blocks alternate direction from unit to unit, so once its caches and buffers
    have filled the schedule repeats every two rows, and every two units of a row. The shorter
    schedules keep all k-blocks, each axis's first widest row (column) of units and the
    narrower ones after it, and ``x`` or ``x + 2`` more of the widest (``x`` of the parity of
    the whole count); the time, each lane's busy seconds and the bytes then grow by a fixed
    amount per two more along each axis, and are extrapolated from the shorter schedules'
    (bilinearly, from the corners ``x`` and ``x + 2`` of both axes). ``x`` doubles, while the
    shorter schedules list at most ``SUMMARY_STEPS`` kernels in all, where that does not yet
    hold: where the time grows less than some lane's busy seconds (a lane that got ahead, the
    host threads staging into the ring, has not yet used up its lead); where one row of units
    is busiest on another lane than the rows together and the time grows only as fast as they
    (the last row, of fewer rows of C, bound by its copies, its stalls not yet begun); and
    where the busiest lane per two more units of a row changes as the rows grow to their whole
    length (a row's own costs, A's panel, outweigh its units' only in short rows). Where it
    stops short of that, or the lanes settle into a pattern longer than two rows, the time is
    off by up to a stalled row's or a lane's lead's worth: a fraction of a percent of a
    schedule this long.

    Raises
    ------
    ValueError
        The fewest shorter schedules would list more than ``SUMMARY_STEPS`` kernels in all
        (or no fewer than the whole schedule, itself longer).
    """
    t = tiling
    names = ("row_edges", "col_edges")
    counts = [len(t.row_edges) - 1, len(t.col_edges) - 1]
    gk = len(t.k_edges) - 1
    steps = counts[0] * counts[1] * gk
    if steps <= SIMULATED_STEPS:
        return simulate(t)[0]
    runs = [_widest_run(getattr(t, name)) for name in names]

    def least(axis, fewest):  # the x of at least ``fewest`` units, or None: the axis whole
        if fewest is None or runs[axis] is None:
            return None
        head, _, count, tail = runs[axis]
        x = max(1, fewest - len(head) - len(tail))
        x += (count - x) % 2
        return x if x + 2 < count else None

    def corners(xs):  # the corners' x per axis: x or x + 2 where shortened
        return list(itertools.product(*((x,) if x is None else (x, x + 2) for x in xs)))

    def units(corner):
        total = 1
        for axis, x in enumerate(corner):
            total *= counts[axis] if x is None else len(runs[axis][0]) + x + len(runs[axis][3])
        return total

    done: dict = {}

    def run(corner):
        if corner not in done:
            shorter = {}
            for name, run_, x in zip(names, runs, corner):
                if x is not None:
                    head, width, _, tail = run_
                    shorter[name] = _edges_of(head + [width] * x + tail)
            done[corner] = simulate(replace(t, **shorter))
        return done[corner]

    def spent(xs):  # kernels simulated, with the corners of ``xs``
        return sum(units(c) * gk for c in set(done) | set(corners(xs)))

    def along(corner, axis):  # per two more along the axis: the time's growth, each lane's,
        # and the least the time's may be once every lane has used up its lead (along a row:
        # each row of units as long as its busiest lane; C's last row, of fewer rows, may be
        # bound by its copies where the others are bound by their GEMMs)
        (lo, lo_rows), (hi, hi_rows) = run(corner), run(
            corner[:axis] + (corner[axis] + 2,) + corner[axis + 1:])
        grew = [b - a for a, b in zip(lo[1:5], hi[1:5])]
        least_time = max(grew) if axis == 0 else sum(
            max(b - a for a, b in zip(r0, r1)) for r0, r1 in zip(lo_rows, hi_rows))
        return hi[0] - lo[0], grew, least_time

    def unsettled(xs):  # the axes to keep longer
        slow = set()
        for corner in corners(xs):
            for axis in (0, 1):
                if xs[axis] is None or corner[axis] != xs[axis]:
                    continue
                time, grew, least_time = along(corner, axis)
                if time < least_time * (1 - 1e-9):
                    slow.add(axis)
                other = 1 - axis
                if xs[other] is not None and corner[other] == xs[other]:
                    # the busiest lane per two more along the axis with the other axis whole
                    far = corner[:other] + (corner[other] + 2,) + corner[other + 1:]
                    grew_far = along(far, axis)[1]
                    share = (runs[other][2] - xs[other]) / 2
                    whole = [g + share * (f - g) for g, f in zip(grew, grew_far)]
                    if len({max(range(4), key=v.__getitem__) for v in (grew, grew_far, whole)}) > 1:
                        slow.add(other)
        return slow

    xs = [least(axis, fewest) for axis, fewest in enumerate(_fewest_units(t))]
    if spent(xs) >= steps:  # nothing saved: the whole schedule, if short enough
        if steps <= SUMMARY_STEPS:
            return simulate(t)[0]
        xs = [None, None]
    if spent(xs) > SUMMARY_STEPS:
        m, n, k = mnk
        raise ValueError(f"a {m} x {n} x {k} product's stream-pipeline schedule of {steps} GEMMs "
                         f"({counts[0]} x {counts[1]} units of {gk} k-blocks) is too long to "
                         f"model: the rows of units it repeats take more than the "
                         f"{SUMMARY_STEPS} GEMMs the model simulates")
    while True:
        slow = unsettled(xs)
        grown = [least(axis, len(runs[axis][0]) + 2 * x + 1 + len(runs[axis][3]))
                 if axis in slow else x for axis, x in enumerate(xs)]
        if not slow or spent(grown) > SUMMARY_STEPS:
            break
        xs = grown

    out = [0.0] * 7
    for corner in corners(xs):
        weight = 1.0
        for axis, x in enumerate(xs):
            if x is not None:
                share = (runs[axis][2] - x) / 2
                weight *= share if corner[axis] > x else 1.0 - share
        out = [o + weight * v for o, v in zip(out, run(corner)[0])]
    return tuple(out)


def pipeline_schedule(m: int, n: int, k: int, dtype="float32", *, calibration: Calibration,
                      precision: str = "highest", copies: str = "ring",
                      operand_itemsize: int | None = None, tiling=None,
                      memory: int | None = None, latency: float | None = None
                      ) -> PipelineSchedule:
    """The stream pipeline's schedule for ``C[m, n] = A[m, k] @ B[k, n]`` on one GPU from
    host-resident operands (``distmm.executor.pipeline``), per k-block of its tiling
    (``distmm.plan_pipeline``: ``plan_block_loads``' kernels and loads, in order).

    Four lanes, each one job at a time: the host threads' copies (``copies="ring"``: each
    operand block from the caller's pageable array into the page-locked ring before it
    crosses, each piece of C out of it after; operands and C share the host's
    ``staging_rate``), the copy engine to the device (``pcie-h2d``), the GEMMs (the
    precision's rate, ``gpu:float32`` / ``gpu:float64`` or ``gpu:bf16``-style keys; a k-block
    after a unit's first reads and writes C's unit once more at the device's memory
    bandwidth, and float32 operands under a reduced precision are converted there) and the
    copy engine back (``pcie-d2h``, a unit once its last GEMM is done). A block's copy to the
    device waits for its staging and for the GEMM that last used its device slot; the host
    stages at most ``PIPELINE_RING_BYTES`` ahead of the copies; a unit's first GEMM waits
    for a free C buffer (the copy out of the unit ``c_buffers`` before); the first GEMM
    waits ``latency`` (the call's set-up, ``pipeline-call``, by default). So the time is
    the start-up (the first blocks in), then whichever lane is busiest over the steady state
    (copies in, GEMMs, copies out, host copies), then the last unit's drain. A schedule of
    more than ``SIMULATED_STEPS`` kernels is summarised from shorter ones (``_summarised``).

    Parameters
    ----------
    precision : str
        ``highest`` (the dtype's own arithmetic) or a reduced precision (``bf16`` ...), whose
        GEMM rate is ``gpu:PRECISION``.
    copies : ``"ring"``, ``"direct"`` or ``"locked"`` (``COPIES``)
    operand_itemsize : int, optional
        Bytes per operand element crossing (2 for bfloat16 bits; default the dtype's).
    tiling : PipelineTiling or its ``describe()`` mapping, optional
        Default: ``choose_tiling`` for the device's memory (``memory`` or the calibration's).

    Raises
    ------
    ValueError
        An unknown ``copies`` or precision, more kernels than ``MAX_STEPS``, or rows of
        units too long to summarise (``SUMMARY_STEPS``).

    >>> s = pipeline_schedule(16384, 16384, 16384, calibration=default_calibration())
    >>> s.seconds >= max(s.gemm, s.h2d, s.d2h, s.host) * (1 - 1e-9)  # host-bound here
    True
    """
    cal = calibration
    if copies not in COPIES:
        raise ValueError(f"copies must be one of {', '.join(COPIES)}, got {copies!r}")
    dt = np.dtype(dtype)
    acc = np.dtype(accumulate_dtype(dt))
    out_size = acc.itemsize
    in_size = int(operand_itemsize or out_size)
    if precision in (None, "", "highest"):
        precision = "highest"
        gemm = cal.rate("gpu", acc)
    else:
        gemm = cal.gemm.get(f"gpu:{precision}")
        if gemm is None:
            have = ", ".join(sorted(cal.gemm)) or "none"
            raise ValueError(f"the calibration of {cal.machine!r} has no gpu GEMM rate for "
                             f"{precision} (it has: {have})")
    if not (m and n and k):  # nothing to multiply, nothing to copy
        empty = PipelineTiling((0, m), (0, n), (0, k), 1, 1, 1, out_size)
        return PipelineSchedule(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, empty)
    if tiling is None:
        budget = int(memory) if memory is not None else int(cal.device_memory)
        try:
            tiling = choose_tiling(m, n, k, out_size, budget,
                                   tk_max=TK_MAX.get(precision, TK_MAX["highest"]),
                                   narrow=precision != "highest" and precision in TK_MAX)
        except MemoryError as exc:  # a bare one (the host's own memory) has no message
            raise ValueError(str(exc) or f"a {m} x {n} x {k} product is too large to plan for "
                                         f"the stream pipeline") from None
    elif not isinstance(tiling, PipelineTiling):
        tiling = tiling_from_sizes(tiling)
    h2d, d2h = cal.link("pcie-h2d"), cal.link("pcie-d2h")
    ring = copies == "ring"
    stage_rate = cal.staging_rate()
    mem_bw = float(cal.memory_bandwidth.get("gpu", 0.0))
    convert = precision != "highest" and in_size > 2 and mem_bw > 0  # float32 in, bf16 GEMMs
    latency = cal.overhead("pipeline-call") if latency is None else float(latency)
    blocks = tiling.b_resident and len(tiling.col_edges) > 2 and not ring
    if blocks:
        # C's column blocks: A's rows stay on the device for all (``APanels``), so each of
        # A's blocks crosses once, as if every one had a slot; B's blocks cross and C's
        # leave as 2-D copies of their rows (``pinned_2d_share``)
        tiling = replace(
            tiling, a_slots=(len(tiling.row_edges) - 1) * (len(tiling.k_edges) - 1))

    def simulate(tiling):
        """(seconds, each lane's busy seconds (``_LANES``), bytes in, bytes out, and per row of
        units each lane's busy seconds for its units) of ``tiling``'s schedule, kernel by
        kernel."""
        re, ce, ke = tiling.row_edges, tiling.col_edges, tiling.k_edges
        steps = plan_block_loads(tiling)
        jobs: list = []
        last = {"h2d": None, "gemm": None, "d2h": None}
        slot_user: dict = {}      # device slot -> the GEMM job that last read it
        loads: list = []          # the copy to the device of every piece loaded, in order
        unit_out: dict = {}       # unit -> its last copy-out job that frees its C buffer
        busy = {"gemm": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0, "start": 0.0}
        depth = max(1, PIPELINE_RING_BYTES // _RING_PIECE)  # pieces staged ahead at most
        bytes_in = bytes_out = 0
        per_row = [dict.fromkeys(_LANES, 0.0) for _ in range(len(re) - 1)]
        row = per_row[0]

        def add(lane, seconds, deps):
            jobs.append((lane, seconds, tuple([d for d in deps if d is not None])))
            busy[lane] += seconds
            if lane in row:
                row[lane] += seconds
            return len(jobs) - 1

        for step in steps:
            row = per_row[step.i]
            rows = re[step.i + 1] - re[step.i]
            cols = ce[step.j + 1] - ce[step.j]
            kb = ke[step.kb + 1] - ke[step.kb]
            wait = []
            converted = 0
            for kind, needed, slot, nbytes in (
                    ("a", step.load_a, step.a_slot, rows * kb * in_size),
                    ("b", step.load_b, step.b_slot, kb * cols * in_size)):
                if not needed or nbytes <= 0:
                    continue
                bytes_in += nbytes
                converted += nbytes // in_size
                user = None if kind == "b" and tiling.b_resident else slot_user.get((kind, slot))
                # through the ring a block crosses in pieces, each staged and then copied
                pieces = max(1, math.ceil(nbytes / _RING_PIECE)) if ring else 1
                share = pinned_2d_share(cols * in_size) if blocks and kind == "b" else 1.0
                part = nbytes / pieces
                staged, copied = part / stage_rate, h2d.seconds(part / share)
                for _ in range(pieces):
                    deps = [last["h2d"], user]
                    if ring:
                        behind = loads[-depth] if len(loads) >= depth else None
                        deps.append(add("host", staged, [behind]))
                    job = add("h2d", copied, deps)
                    last["h2d"] = job
                    loads.append(job)
                wait.append(job)
            # cuBLAS tiles C: the unit's side, not the k-block's depth, decides how well the GPU
            # is filled (a 256-deep block of a 16384 x 32768 unit still gives every SM its tiles;
            # the depth only shortens each tile's loop, and C's extra pass is counted below)
            seconds = 2.0 * rows * cols * kb / gemm.rate(rows, cols, min(rows, cols))
            if not step.first and mem_bw > 0:  # beta = 1: C's unit read and written once more
                seconds += 2.0 * rows * cols * out_size / mem_bw
            if convert and converted:
                seconds += converted * (in_size + 2) / mem_bw
            deps = [last["gemm"]] + wait
            if step.first and step.unit >= tiling.c_buffers:
                deps.append(unit_out.get(step.unit - tiling.c_buffers))
            if last["gemm"] is None and latency > 0:
                deps.append(add("start", latency, []))
            job = add("gemm", seconds, deps)
            last["gemm"] = job
            slot_user[("a", step.a_slot)] = job
            slot_user[("b", step.b_slot)] = job
            if step.last:
                nbytes = rows * cols * out_size
                bytes_out += nbytes
                pieces = max(1, math.ceil(nbytes / _RING_PIECE)) if ring else 1
                share = pinned_2d_share(cols * out_size) if blocks else 1.0
                part = nbytes / pieces
                copied, staged = d2h.seconds(part / share), part / stage_rate
                for _ in range(pieces):
                    out = add("d2h", copied, [job, last["d2h"]])
                    last["d2h"] = out
                    if ring:
                        add("host", staged, [out])
                # the device buffer is free once its bytes left it (the ring's own copy follows)
                unit_out[step.unit] = last["d2h"]
        end = _list_schedule(jobs)
        return ((max(end), *(busy[lane] for lane in _LANES), bytes_in, bytes_out),
                [[r[lane] for lane in _LANES] for r in per_row])

    seconds, gemm_s, h2d_s, d2h_s, host_s, bytes_in, bytes_out = _summarised(
        tiling, simulate, (m, n, k))
    return PipelineSchedule(seconds=seconds, gemm=gemm_s, h2d=h2d_s, d2h=d2h_s, host=host_s,
                            latency=latency, bytes_in=int(round(bytes_in)),
                            bytes_out=int(round(bytes_out)), tiling=tiling)


def _pipeline(m, n, k, dt, devices, cal, device, memory, precision, copies, operand_itemsize,
              tiling, first_call):
    if device != "gpu" or devices != 1:
        raise ValueError(f"the stream pipeline runs on one GPU, not {devices} {device}(s)")
    sched = pipeline_schedule(m, n, k, dt, calibration=cal, precision=precision,
                              copies=copies, operand_itemsize=operand_itemsize, tiling=tiling,
                              memory=memory)
    comp = sched.gemm
    # the set-up before the first GEMM is exposed only where the copies do not outlast it
    fixed = min(sched.latency, max(0.0, sched.seconds - comp))
    io = max(0.0, sched.seconds - comp - fixed)
    if copies == "locked":
        # the caller's arrays page-locked in place and unlocked again, A, B and C whole: the
        # driver serialises cudaHostRegister / cudaHostUnregister with the other threads'
        # CUDA calls (the "First call" section's driver lock), so the copies and the GEMMs
        # wait for them rather than run beside them
        out = np.dtype(accumulate_dtype(dt)).itemsize
        locked = float(m * k + k * n) * int(operand_itemsize or out) + float(m * n) * out
        io += locked / cal.host_register + locked / cal.host_unregister
    overhead = fixed + (cal.overhead("pipeline-first-call") if first_call else 0.0)
    t = sched.tiling
    shape = (len(t.row_edges) - 1, len(t.col_edges) - 1)
    touched = float(m * k + k * n + m * n)
    return shape, comp, 0.0, io, overhead, sched.bytes_in, touched, t.device_bytes, ""


def predict(m: int, n: int, k: int, dtype="float32", *, devices: int, calibration: Calibration,
            engine: str = "mpi", device: str = "gpu", link: str | None = None,
            grid=None, memory: int | None = None, ranks_per_device: int = 1,
            threads_per_rank: int = 1, extra_cpu_workers: int = 0,
            batch_panels: str = "auto", direct_writes: bool = True,
            mpi_ofi: bool = False, precision: str = "highest", copies: str = "ring",
            operand_itemsize: int | None = None, tiling=None,
            first_call: bool = False) -> Prediction:
    """The model's estimate of ``C[m, n] = A[m, k] @ B[k, n]`` on ``devices`` devices.

    Parameters
    ----------
    m, n, k : int
    dtype : dtype
        numpy's result dtype; rates are those of its accumulation dtype.
    devices : int
        MPI ranks (``mpi``, ``batch``) or Dask workers (``dask``; GPU workers, or CPU
        workers of one thread).
    calibration : Calibration
    engine : ``"mpi"``, ``"batch"``, ``"dask"`` or ``"pipeline"``
        (``pipeline``: one GPU streaming host-resident operands, ``pipeline_schedule``)
    device : ``"gpu"`` or ``"cpu"``
        What each rank or worker computes on (a ``cpu`` rank: ``threads_per_rank`` cores).
    link : str, optional
        The link kind between ranks (``LINKS``); default: ``nvlink`` for GPU ranks, ``ipc``
        for GPU workers, ``mpi-host`` for CPU ranks, ``tcp`` for CPU workers.
    grid : tuple or GridPlan, optional
        Force the MPI grid ``(layers, rows, cols)`` (batch: ``(rows, cols)``); default: the
        grid the engine itself chooses (``distmm.grid.make_grid``).
    memory : int, optional
        Bytes one device has (default: the calibration's device memory; a CPU rank: the
        node's memory over its ranks).
    ranks_per_device : int
        Ranks or workers sharing one GPU (they share its rate and memory).
    extra_cpu_workers : int
        Dask: CPU workers of one thread beside the GPU workers (they get a share only where
        it shortens the run, as ``distmm.plan_blocks.shares`` decides).
    batch_panels : str
        The batch path's ``batch-panels`` setting, which with the nodes the ranks fill
        (``gpus_per_node`` GPU ranks or ``cores`` CPU ranks a node, each node a host) and
        their memory decides its plan and how its ranks get their panels as
        ``distmm.plan_batch.decide_batch`` does: ``share`` (``auto``'s choice for GPU ranks
        of one host) has GPU ranks read a share of B each and copy the rest from each other;
        ``read`` and ``broadcast`` are modelled alike, each rank reading all of its column
        panel.
    direct_writes : bool
        The batch path: whether C's rows are written past the page cache (``distmm.direct_io``,
        the file rate ``file_write``) or through it and synced (``file_write_buffered``: an
        output format without direct writes, the ``direct-writes`` setting off, and the code
        before direct writes existed).
    mpi_ofi : bool
        The batch path: whether Open MPI's ``MPI_Init`` probed its libfabric BTL (``OMPI_MCA_btl``
        not excluding ``ofi``); its launch then costs ``mpi-launch-ofi`` where the calibration
        has it.
    precision, copies, operand_itemsize, tiling : see ``pipeline_schedule``
        The stream pipeline: its GEMMs' precision, how its operands cross (the ring, or
        straight from page-locked arrays), the bytes of an operand element and its tiling.
    first_call : bool
        The stream pipeline: the process's first product through ``distmm.matmul``
        (``pipeline-first-call`` added).

    Raises
    ------
    ValueError
        Negative sizes, no devices, an unknown engine, device or link, a calibration
        without the rate or link the product needs, or a product too large for its engine's
        planner to list (``distmm.plan_batch.MAX_BATCH_EDGES``,
        ``distmm.plan_pipeline.MAX_STEPS``) or the model to summarise (``SUMMARY_STEPS``).
    """
    _check(m, n, k, devices, engine, device)
    m, n, k, devices = int(m), int(n), int(k), int(devices)
    dt = np.dtype(dtype)
    if link is None:
        link = {("mpi", "gpu"): "nvlink", ("batch", "gpu"): "nvlink", ("dask", "gpu"): "ipc",
                ("mpi", "cpu"): "mpi-host", ("batch", "cpu"): "mpi-host",
                ("dask", "cpu"): "tcp", ("pipeline", "gpu"): "pcie-h2d",
                ("pipeline", "cpu"): "pcie-h2d"}[(engine, device)]
        if engine == "mpi" and device == "gpu" and ranks_per_device > 1:
            link = "mpi-host"  # NCCL refuses two ranks on one GPU: host-staged broadcasts
    if link not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")
    if ranks_per_device < 1:
        raise ValueError(f"ranks_per_device must be at least 1, got {ranks_per_device!r}")
    if engine == "mpi":
        out = _mpi(m, n, k, dt, devices, calibration, device, link, grid, memory,
                   ranks_per_device, threads_per_rank)
    elif engine == "batch":
        out = _batch(m, n, k, dt, devices, calibration, device, link, grid, memory,
                     ranks_per_device, batch_panels, direct_writes, mpi_ofi)
    elif engine == "pipeline":
        out = _pipeline(m, n, k, dt, devices, calibration, device, memory, precision, copies,
                        operand_itemsize, tiling, first_call)
    else:
        out = _dask(m, n, k, dt, devices, calibration, device, link, grid, memory,
                    ranks_per_device, extra_cpu_workers)
    shape, comp, comm, io, overhead, received, touched, held, note = out
    seconds = comp + comm + io + overhead
    acc = accumulate_dtype(dt)
    size = np.dtype(acc).itemsize
    avail = _devices_info(calibration, device, devices, ranks_per_device, memory)
    one = calibration.rate(device, acc)
    if engine == "pipeline" and precision not in (None, "", "highest"):
        one = calibration.gemm[f"gpu:{precision}"]
    if device == "cpu":  # one device: one rank's cores
        one = replace(one, peak=one.peak * max(1, threads_per_rank))
    ideal = _one_device_seconds(m, n, k, one)
    eff = ideal / (devices * seconds) if seconds > 0 else 1.0
    bounds = lower_bounds(m, n, k, devices, avail / size if avail else None)
    return Prediction(engine=engine, devices=devices, device=device, link=link, m=m, n=n, k=k,
                      dtype=dt.name, grid=tuple(int(x) for x in shape), seconds=seconds,
                      compute=comp, communication=comm, io=io, overhead=overhead,
                      efficiency=eff, bytes_received=int(received), words_touched=float(touched),
                      bounds=bounds, memory_needed=int(held), memory_available=int(avail),
                      note=note)


def best_plan(m: int, n: int, k: int, dtype="float32", *, devices: int,
              calibration: Calibration, engine: str = "mpi", device: str = "gpu",
              link: str | None = None, memory: int | None = None,
              ranks_per_device: int = 1, limit: int = 64) -> Prediction:
    """The fastest grid the model finds for the MPI engine (every ``layers x rows x cols``
    factorisation of ``devices``, the engine's own choice first, at most ``limit`` of them in
    ``distmm.grid``'s order; a grid whose ranks do not fit their memory loses to one that
    fits); other engines: ``predict`` with their own layout.

    >>> cal = default_calibration()
    >>> best_plan(65536, 65536, 65536, devices=8, calibration=cal).grid[0] >= 1
    True
    """
    if engine != "mpi":
        return predict(m, n, k, dtype, devices=devices, calibration=calibration, engine=engine,
                       device=device, link=link, memory=memory,
                       ranks_per_device=ranks_per_device)
    _check(m, n, k, devices, engine, device)
    first = predict(m, n, k, dtype, devices=devices, calibration=calibration, engine=engine,
                    device=device, link=link, memory=memory, ranks_per_device=ranks_per_device)
    best = first
    for shape in grid_shapes(int(devices))[:limit]:
        if shape == first.grid:
            continue
        p = predict(m, n, k, dtype, devices=devices, calibration=calibration, engine=engine,
                    device=device, link=link, memory=memory, ranks_per_device=ranks_per_device,
                    grid=shape)
        if (not p.fits, p.seconds) < (not best.fits, best.seconds * (1 - 1e-9)):
            best = p
    return best
