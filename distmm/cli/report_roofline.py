"""``distmm report``'s roofline: measured ceilings per device, and where each run sits.

This module covers: the ceilings a device's records carry (``ceilings``), the arithmetic
intensity of a GEMM record against a bandwidth ceiling (``intensity``), the one-device runs
placed against their binding ceiling (``roofline_points``), the ceilings table and the
roofline PNG of one device.
It does *not* cover: reading records or writing the report's folder (``distmm.cli.report``),
or ceilings no record measures (nominal PCIe, NVLink or network rates are never drawn).

The rules, in one place:

- **compute ceilings**, per device and arithmetic (the dtype, or the reduced ``precision``
  tf32/bf16/fp16 a record carries): the best TFLOP/s of a ``cublas*`` reference record, or of
  a ``numpy*`` one on a CPU (the same-run references of the benchmarks), and the best of a
  ``ceiling-ffma`` / ``ceiling-dfma`` record (a register-only FMA probe of ``bench/kernels.py``).
  A device is a GPU when its records show one (``gpu_devices``: a ``cublas*`` reference or a
  record with ``gpus`` >= 1). numpy runs on the host's CPU, yet a GPU study's numpy reference
  names the GPU (``distmm bench`` names every record after the study's device): on a GPU it
  is no ceiling (``host_references``), and a run whose arithmetic has no cuBLAS or probe
  ceiling there has no roof (no nominal peak stands in for it).
- **bandwidth ceilings**, per device, the best of each kind, with the bytes a GEMM moves across
  it (``itemsize`` of the record's dtype; ``.npy`` headers are not counted):

  ======================  ===========================================  ===================
  record variant          GB/s                                         a GEMM's bytes
  ======================  ===========================================  ===================
  ``ceiling-copy``        its ``gbps`` (device copy, read + written)   A + B + C once
  ``read-cat``            (A + B) bytes / seconds (``cat A B``)        A + B
  ``write-dd*``           C bytes / seconds (``dd`` of C's size)       C
  ======================  ===========================================  ===================

  The device-memory ceiling applies to every run on the device; the file ceilings only to
  runs of the benchmark that measured them (``mpi-batch`` reads and writes files, the others
  keep their operands in memory).
- **points**: one-device runs (count 1, see ``distmm.cli.report_rules.count_of``) that are not a
  reference, a probe or a model record (``predicted_seconds``); per benchmark, variant and
  dtype the largest problem, its median TFLOP/s. Each sits at its intensity against the applicable bandwidth ceiling whose roof
  (GB/s x intensity) is lowest: the link that binds it.
- A device gets a roofline when it has at least one compute and one bandwidth ceiling; a point
  whose arithmetic has no compute ceiling there has no roof (``roof`` None).
"""
from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass

from distmm.cli.report_rules import arithmetic, count_of, is_reference

__all__ = ["Ceiling", "RoofPoint", "ceilings", "gpu_devices", "host_references", "intensity",
           "roofline_points", "roof", "ceiling_rows", "point_rows", "draw_roofline"]

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8,
            "complex128": 16, "int32": 4, "int64": 8,
            "tf32": 4, "bf16": 2, "fp16": 2}  # reduced precisions: their operands' bytes
COMPUTE_REFERENCES = ("cublas", "numpy")
PROBES = ("ceiling-ffma", "ceiling-dfma")
BYTES_RULE = {"memory": "A+B+C once", "file-read": "A+B", "file-write": "C"}


def _itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"no element size known for dtype {dtype!r}") from None


def _compute_reference(variant: str) -> str | None:
    """``"cublas"`` or ``"numpy"`` for a compute reference variant, else None."""
    return next((r for r in COMPUTE_REFERENCES
                 if variant == r or re.match(re.escape(r) + r"[-@.]", variant)), None)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def gpu_devices(records: list[dict]) -> set[str]:
    """The devices whose records show a GPU: a ``cublas*`` reference, or a record of one or
    more GPUs (``gpus`` >= 1: ``distmm bench``'s GPU runs, ``bench/kernels.py``'s probes).

    Examples
    --------
    >>> sorted(gpu_devices([dict(variant="numpy", device="c", gpus=0),
    ...                     dict(variant="numpy", device="g"),
    ...                     dict(variant="distmm-local", device="g", gpus=1)]))
    ['g']
    """
    return {r["device"] for r in records
            if _compute_reference(r["variant"]) == "cublas" or _positive(r.get("gpus"))}


def host_references(records: list[dict]) -> dict[str, set[str]]:
    """The arithmetics of the numpy references recorded under a GPU's name, by device: numpy
    ran on the host's CPU, so they are no ceiling of that GPU (see the module docstring)."""
    gpus = gpu_devices(records)
    out: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r["device"] in gpus and _compute_reference(r["variant"]) == "numpy":
            out[r["device"]].add(arithmetic(r))
    return dict(out)


@dataclass(frozen=True)
class Ceiling:
    """One measured ceiling of ``device``: ``kind`` is ``"compute"`` (``value`` in TFLOP/s,
    for ``dtype``) or one of ``"memory"``, ``"file-read"``, ``"file-write"`` (``value`` in
    GB/s, ``dtype`` None); ``scope`` is the benchmark whose runs it bounds (None: every run of
    the device); ``variant`` and ``run`` name the record it comes from."""
    device: str
    kind: str
    name: str
    value: float
    dtype: str | None
    scope: str | None
    variant: str
    run: str

    @property
    def label(self) -> str:
        unit = "TFLOP/s" if self.kind == "compute" else "GB/s"
        return f"{self.name} {self.value:.4g} {unit}"


def _bandwidth(record: dict) -> tuple[str, float] | None:
    """``(kind, GB/s)`` of a bandwidth ceiling record, else None."""
    variant, seconds = record["variant"], record.get("seconds")
    if variant == "ceiling-copy" and _positive(record.get("gbps")):
        return "memory", float(record["gbps"])
    if not _positive(seconds) or record["dtype"] not in ITEMSIZE:
        return None
    m, n, k = int(record["m"]), int(record["n"]), int(record["k"])
    if variant == "read-cat" or variant.startswith("read-cat-"):
        return "file-read", (m * k + k * n) * _itemsize(record["dtype"]) / seconds / 1e9
    if variant == "write-dd" or variant.startswith("write-dd-"):
        return "file-write", m * n * _itemsize(record["dtype"]) / seconds / 1e9
    return None


def ceilings(records: list[dict]) -> dict[str, list[Ceiling]]:
    """The measured ceilings of every device in ``records``, by device: compute ceilings by
    dtype and name, then bandwidth ceilings by kind (see the module docstring).

    Examples
    --------
    >>> recs = [dict(run="r", benchmark="kernels", variant="cublas", device="g", dtype="float32",
    ...              m=8, n=8, k=8, seconds=1.0, tflops=50.0),
    ...         dict(run="r", benchmark="kernels", variant="ceiling-copy", device="g",
    ...              dtype="float32", m=8, n=1, k=1, seconds=1.0, tflops=None, gbps=3000.0)]
    >>> [c.label for c in ceilings(recs)["g"]]
    ['cuBLAS float32 50 TFLOP/s', 'device memory (copy) 3000 GB/s']
    """
    best: dict[tuple, tuple[float, dict, str]] = {}
    gpus = gpu_devices(records)

    def offer(key, value, record, name):
        if key not in best or value > best[key][0]:
            best[key] = (value, record, name)

    for r in records:
        variant, device = r["variant"], r["device"]
        reference = _compute_reference(variant)
        if reference == "numpy" and device in gpus:
            continue  # the host CPU's rate under the GPU's name: no ceiling of the GPU
        if reference is not None and _positive(r.get("tflops")):
            name = "cuBLAS" if reference == "cublas" else "numpy"
            offer((device, "compute", arithmetic(r), name), float(r["tflops"]), r,
                  f"{name} {arithmetic(r)}")
        elif variant in PROBES and _positive(r.get("tflops")):
            offer((device, "compute", r["dtype"], "probe"), float(r["tflops"]), r,
                  f"FMA probe {r['dtype']}")
        else:
            bandwidth = _bandwidth(r)
            if bandwidth is not None:
                kind, gbps = bandwidth
                scope = None if kind == "memory" else r["benchmark"]
                name = {"memory": "device memory (copy)", "file-read": "file read (cat A B)",
                        "file-write": "file write (dd, fsync)" if "fsync" in variant
                        else "file write (dd)"}[kind]
                offer((device, kind, None, scope), gbps, r, name)
    out: dict[str, list[Ceiling]] = defaultdict(list)
    order = {"compute": 0, "memory": 1, "file-read": 2, "file-write": 3}
    for key in sorted(best, key=lambda k: (k[0], order[k[1]], str(k[2]), str(k[3]))):
        device, kind, dtype, extra = key
        value, record, name = best[key]
        out[device].append(Ceiling(device, kind, name, value, dtype,
                                   extra if kind.startswith("file") else None,
                                   record["variant"], str(record["run"])))
    return dict(out)


def intensity(record: dict, ceiling: Ceiling) -> float:
    """FLOP per byte of ``record``'s GEMM across ``ceiling``'s link: ``2 m n k`` over the
    bytes of the module docstring's table.

    Examples
    --------
    >>> c = Ceiling("g", "file-write", "w", 1.0, None, "mpi-batch", "write-dd", "r")
    >>> intensity(dict(m=4, n=4, k=4, dtype="float32"), c)
    2.0
    """
    m, n, k = int(record["m"]), int(record["n"]), int(record["k"])
    elements = {"memory": m * k + k * n + m * n, "file-read": m * k + k * n,
                "file-write": m * n}[ceiling.kind]
    return 2.0 * m * n * k / (elements * _itemsize(record["dtype"]))


@dataclass(frozen=True)
class RoofPoint:
    """One run on the roofline: ``tflops`` (median of its records) at ``intensity`` against
    the binding ceiling ``ceiling``."""
    benchmark: str
    variant: str
    dtype: str
    size: tuple[int, int, int]
    tflops: float
    intensity: float
    ceiling: Ceiling


#: benchmarks whose seconds time part of a product (a resumed run finishes what a stopped one
#: left), so their TFLOP/s is no throughput: never a roofline point
PARTIAL_BENCHMARKS = ("mpi-resume",)


def roofline_points(records: list[dict], device_ceilings: list[Ceiling]) -> list[RoofPoint]:
    """The one-device runs of ``device_ceilings``' device, each against its binding ceiling
    (see the module docstring), sorted by benchmark, variant and dtype."""
    if not device_ceilings:
        return []
    device = device_ceilings[0].device
    bandwidths = [c for c in device_ceilings if c.kind != "compute"]
    groups: dict[tuple, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        variant = r["variant"]
        if (r["device"] != device or "predicted_seconds" in r or is_reference(variant)
                or r["benchmark"] in PARTIAL_BENCHMARKS
                or variant.startswith("ceiling-")
                or variant.startswith("tune-") or count_of(r)[1] != 1
                or not _positive(r.get("tflops")) or not _positive(r.get("seconds"))
                or arithmetic(r) not in ITEMSIZE):
            continue
        size = (int(r["m"]), int(r["n"]), int(r["k"]))
        if 0 in size:
            continue
        groups[(r["benchmark"], variant, arithmetic(r))][size].append(float(r["tflops"]))
    points = []
    for (bench, variant, dtype), by_size in sorted(groups.items()):
        size = max(by_size, key=lambda s: (s[0] * s[1] * s[2], s))
        sample = dict(m=size[0], n=size[1], k=size[2], dtype=dtype)
        usable = [c for c in bandwidths if c.scope in (None, bench)]
        if not usable:
            continue
        binding = min(usable, key=lambda c: (c.value * intensity(sample, c), c.kind))
        points.append(RoofPoint(bench, variant, dtype, size, statistics.median(by_size[size]),
                                intensity(sample, binding), binding))
    return points


def roof(point: RoofPoint, device_ceilings: list[Ceiling]) -> float | None:
    """The roof over ``point`` in TFLOP/s: the lower of its binding bandwidth x intensity and
    the highest compute ceiling of its dtype (None without one)."""
    tops = [c.value for c in device_ceilings if c.kind == "compute" and c.dtype == point.dtype]
    if not tops:
        return None
    return min(max(tops), point.ceiling.value * point.intensity / 1e3)


def point_rows(points: list[RoofPoint], device_ceilings: list[Ceiling]) -> list[list[str]]:
    """Rows of the points table: device, benchmark, variant, dtype, size, TFLOP/s, FLOP per
    byte, the binding ceiling, the roof and the share of it reached."""
    rows = []
    for p in points:
        top = roof(p, device_ceilings)
        rows.append([p.ceiling.device, p.benchmark, p.variant, p.dtype, "x".join(map(str, p.size)),
                     f"{p.tflops:.4g}", f"{p.intensity:.4g}", p.ceiling.name,
                     "-" if top is None else f"{top:.4g}",
                     "-" if top is None else f"{p.tflops / top:.0%}"])
    return rows


def ceiling_rows(device_ceilings: list[Ceiling]) -> list[list[str]]:
    """Rows of the ceilings table: device, ceiling, value, unit, a GEMM's bytes across it,
    which runs it bounds, and the record (variant, run) it comes from."""
    rows = []
    for c in device_ceilings:
        compute = c.kind == "compute"
        rows.append([c.device, c.name, f"{c.value:.4g}", "TFLOP/s" if compute else "GB/s",
                     "-" if compute else BYTES_RULE[c.kind],
                     "every run" if c.scope is None else f"{c.scope} runs",
                     f"{c.variant}, run {c.run}"])
    return rows


_DTYPE_COLOURS = {"float32": "tab:blue", "float64": "tab:red", "float16": "tab:green",
                  "bfloat16": "tab:olive", "complex64": "tab:purple", "complex128": "tab:brown",
                  "tf32": "tab:cyan", "bf16": "tab:orange", "fp16": "tab:pink"}
_BANDWIDTH_STYLES = {"memory": "-", "file-read": "--", "file-write": ":"}
_MARKERS = "osD^v<>pP*XhH8d"


def draw_roofline(plt, device: str, device_ceilings: list[Ceiling], points: list[RoofPoint],
                  path) -> None:
    """Draw ``device``'s roofline into ``path``: every ceiling as a named line (its name and
    value written on the figure), every point coloured by dtype, shaped by benchmark."""
    compute = [c for c in device_ceilings if c.kind == "compute"]
    bandwidths = [c for c in device_ceilings if c.kind != "compute"]
    top = max(c.value for c in compute)
    xs = [p.intensity for p in points] + [top * 1e3 / c.value for c in bandwidths]
    lo = 10 ** math.floor(math.log10(min(xs)) - 1)
    hi = 10 ** math.ceil(math.log10(max(xs)) + 0.5)
    lows = [p.tflops for p in points] + [c.value for c in compute]
    ymin, ymax = min(lows) / 3, top * 3
    fig, ax = plt.subplots(figsize=(9, 6), dpi=90)
    lines = []
    for i, c in enumerate(bandwidths):
        ridge = top * 1e3 / c.value  # GB/s * FLOP/B = GFLOP/s; TFLOP/s * 1e3 = GFLOP/s
        line, = ax.plot([lo, ridge], [c.value * lo / 1e3, top], color="0.3", lw=1.2,
                        ls=_BANDWIDTH_STYLES[c.kind], label=c.label)
        lines.append(line)
        y_text = ymin * 2 * 3 ** i  # where the line is inside the axes, staggered
        x_text = max(lo * 1.5, y_text * 1e3 / c.value)
        ax.annotate(c.label, (x_text, c.value * x_text / 1e3), fontsize=7, color="0.2",
                    xytext=(5, -3), textcoords="offset points")
    for c in sorted(compute, key=lambda c: -c.value):
        lines.append(ax.axhline(c.value, color=_DTYPE_COLOURS.get(c.dtype, "0.4"), lw=1.0,
                                ls="-." if c.name.startswith("FMA probe") else "-", alpha=0.8,
                                label=c.label))
    ceiling_legend = ax.legend(handles=lines, fontsize=7, loc="upper left", title="ceilings",
                               title_fontsize=7)
    ax.add_artist(ceiling_legend)
    benches = sorted({p.benchmark for p in points})
    for p in points:
        marker = _MARKERS[benches.index(p.benchmark) % len(_MARKERS)]
        ax.scatter([p.intensity], [p.tflops], marker=marker, s=28, zorder=3,
                   color=_DTYPE_COLOURS.get(p.dtype, "0.4"), edgecolor="black", linewidth=0.4)
    handles = [plt.Line2D([], [], ls="", marker=_MARKERS[i % len(_MARKERS)], color="0.5",
                          label=b) for i, b in enumerate(benches)]
    dtypes = {p.dtype for p in points}
    handles += [plt.Line2D([], [], ls="", marker="o", color=colour, label=dtype)
                for dtype, colour in _DTYPE_COLOURS.items() if dtype in dtypes]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="lower right", title="points", title_fontsize=7)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(ymin, ymax),
           xlabel="arithmetic intensity, FLOP per byte across the binding ceiling's link "
                  "(memory: A+B+C once; file read: A+B; file write: C)",
           ylabel="TFLOP/s", title=f"Roofline of {device}: measured ceilings, one-device runs "
                                   f"(largest size)")
    ax.xaxis.label.set_size(8)
    ax.grid(True, which="major", alpha=0.25)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
