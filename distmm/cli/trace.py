"""``distmm trace``: a Gantt chart of the stream pipeline's copy/compute overlap.

This module covers: running one pipelined product of random host-resident
matrices with timing events on (needs a GPU), saving the timeline as JSON, and
rendering a timeline (from that run or from a saved JSON file, no GPU needed)
as a PNG with one lane per stream and per group of host threads.
A saved timeline is checked before anything is drawn (``read_timeline``): a JSON file that
is no timeline (another JSON file, a list, a timeline without ops) is refused in one line
naming the file and what is wrong (a ``distmm matmul --profile`` file is named as one: ``distmm
report`` draws those), and nothing is written. The image (PNG, or the format
``-o``'s suffix names) is written whole, through a staged file renamed onto ``-o`` (a write
that fails names ``-o``, not the staged file); the options and outputs are checked before a
traced run starts.
It does *not* cover: recording (``distmm.executor.pipeline.Timeline``).

Examples
--------
    distmm trace --n 8192 --dtype float32 -o timeline.png --json timeline.json
    distmm trace --from-json timeline.json -o timeline.png
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from distmm.cli.argtypes import integer_at_least, positive_size
from distmm.cli.exits import BAD_INPUT, raise_if_signalled
from distmm.cli.outputs import check_writable
from distmm.errors import naming_target
from distmm.staging import put_in_place, staged_path

__all__ = ["main", "render", "read_timeline", "LANES"]

#: lanes from top to bottom, with their colours
LANES = (
    ("host-stage", "host: copy into pinned", "#9ecae1"),
    ("h2d", "stream h2d", "#2ca02c"),
    ("compute", "stream compute", "#1f77b4"),
    ("d2h", "stream d2h", "#ff7f0e"),
    ("host-unstage", "host: copy out of pinned", "#fdae6b"),
    ("host-wait", "host: issuing thread waits", "#bdbdbd"),
)


def _merged(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def render(timeline, path, *, title: str | None = None) -> None:
    """Draw ``timeline`` (a ``Timeline``) as a Gantt chart at ``path`` (PNG, or the image
    format its suffix names: ``image_format``), written whole or not at all: into a staged
    file beside it, then renamed onto it (a symbolic link is replaced, not followed).

    Host lanes show when at least one host thread was copying (overlapping
    copies merged); GPU lanes show each copy or kernel, separated by thin gaps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = timeline.ops
    meta = timeline.meta
    end = max((o["end_ms"] for o in ops), default=1.0) or 1.0  # ops all at 0: no scale
    present = [lane for lane in LANES if any(o["lane"] == lane[0] for o in ops)]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * max(len(present), 1)), dpi=120)
    for row, (lane, label, colour) in enumerate(reversed(present)):
        spans = [(o["start_ms"], o["end_ms"]) for o in ops if o["lane"] == lane]
        if lane.startswith("host"):
            bars = [(s, e - s) for s, e in _merged(spans)]
            ax.broken_barh(bars, (row + 0.15, 0.7), facecolors=colour, edgecolor="none")
        else:
            bars = [(s, max(e - s, end * 1e-4)) for s, e in spans]
            ax.broken_barh(bars, (row + 0.1, 0.8), facecolors=colour, edgecolor="white",
                           linewidth=0.3)
        busy = sum(e - s for s, e in _merged(spans))
        ax.text(end * 1.005, row + 0.5, f"{100 * busy / end:.0f}% busy", va="center", fontsize=8)
    ax.set_yticks([r + 0.5 for r in range(len(present))])
    ax.set_yticklabels([label for _, label, _ in reversed(present)])
    ax.set_xlim(0, end * 1.08)
    ax.set_xlabel("milliseconds since the first event")
    if title is None:
        parts = []
        if meta.get("m"):
            parts.append(f"C[{meta['m']},{meta.get('n')}] = A @ B, k={meta.get('k')}, "
                         f"{meta.get('dtype', '')}")
        if meta.get("device"):
            parts.append(str(meta["device"]))
        if meta.get("tflops"):
            parts.append(f"{meta['tflops']:.3g} TFLOP/s host to host")
        tiling = meta.get("tiling") or {}
        if tiling:
            parts.append(f"{tiling.get('mode')} units, k-block {tiling.get('tk_max')}")
        title = "  |  ".join(parts) or "distmm stream pipeline"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fmt = image_format(path)
    staged = staged_path(path)
    try:
        fig.savefig(staged, format=fmt)
        raise_if_signalled()  # a signal matplotlib swallowed: nothing in place
        put_in_place(staged, path)
    except OSError as exc:
        named = naming_target(exc, staged, path)
        if named is exc:
            raise
        raise named from exc
    finally:
        plt.close(fig)
        staged.unlink(missing_ok=True)


def read_timeline(path):
    """The ``Timeline`` saved at ``path`` (``Timeline.to_json``), checked: a JSON object whose
    ``ops`` is a non-empty list of objects, each with a ``lane`` of ``LANES``, a ``name`` and
    numbers ``start_ms`` <= ``end_ms``, and whose ``meta``, where present, is an object
    (its ``tflops`` a number, its ``tiling`` an object). Anything else raises ``ValueError``
    naming ``path`` and what is wrong (``OSError`` for a file that cannot be read)."""
    from distmm.cli.records import json_file
    from distmm.executor.pipeline import Timeline

    data = json_file(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a timeline (a JSON object with 'ops' and 'meta'), "
                         f"got a JSON {type(data).__name__}")
    ops, meta = data.get("ops"), data.get("meta", {})
    if ops is None and data.get("format") == "distmm-profile-1":
        raise ValueError(f"{path}: a distmm matmul --profile file, not a timeline of distmm "
                         f"trace (distmm report draws a profile's timeline)")
    if ops is None:
        raise ValueError(f"{path}: not a timeline: it has no 'ops' (the run's copies and "
                         f"kernels)")
    if not isinstance(ops, list) or not ops:
        raise ValueError(f"{path}: not a timeline: 'ops' must be a non-empty list of the "
                         f"run's copies and kernels, got {repr(ops)[:40]}")
    lanes = [lane for lane, _, _ in LANES]
    for i, op in enumerate(ops):
        times = [op.get(key) for key in ("start_ms", "end_ms")] if isinstance(op, dict) else []
        if not (isinstance(op, dict) and op.get("lane") in lanes and "name" in op
                and all(isinstance(t, (int, float)) and not isinstance(t, bool)
                        and math.isfinite(t) for t in times) and 0 <= times[0] <= times[1]):
            raise ValueError(f"{path}: op {i} must have a 'lane' of {', '.join(lanes)}, a "
                             f"'name' and numbers 0 <= 'start_ms' <= 'end_ms' (milliseconds "
                             f"since the first event), got {repr(op)[:80]}")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the timeline's 'meta' must be an object, got {repr(meta)[:40]}")
    tflops, tiling = meta.get("tflops"), meta.get("tiling")
    if tflops is not None and (not isinstance(tflops, (int, float)) or isinstance(tflops, bool)):
        raise ValueError(f"{path}: the timeline's meta 'tflops' must be a number, got {tflops!r}")
    if tiling is not None and not isinstance(tiling, dict):
        raise ValueError(f"{path}: the timeline's meta 'tiling' must be an object, got {tiling!r}")
    return Timeline(ops=list(ops), meta=dict(meta))


def _check_output(path, flag: str = "-o") -> None:
    """Refuse an output path that cannot be written, before any work (its folder is not
    made: ``check_writable``)."""
    if not path:
        raise ValueError(f"{flag}: an empty path")
    check_writable(path, makes_folders=False, writes="replace")


def image_format(path) -> str:
    """The image format ``path``'s suffix names (``png`` without a suffix), refused before any
    work where matplotlib does not write it (it appended ``.png`` to a name without a suffix,
    writing a file not asked for, and failed on others only after the traced run)."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = os.path.splitext(str(path))[1].lower().lstrip(".")
    if not suffix:
        return "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"-o {path}: '.{suffix}' is no image format distmm trace writes "
                         f"(use {', '.join(sorted(formats))})")
    return suffix


def _missing_gpu() -> str | None:
    """What a traced run lacks here (cupy, or a device cupy sees), or None."""
    try:
        import cupy
    except ImportError as exc:
        return f'{exc} (pip install "distmm[gpu]")'
    from distmm.executor import gpu_available

    if not gpu_available():
        return f"cupy {cupy.__version__} sees no CUDA device"
    return None


def _run_traced(n: int, dtype: str, device_memory_limit, backend: str):
    import numpy as np

    import cupy
    from distmm.executor.gpu import matmul_to
    from distmm.executor.pipeline import Timeline

    rng = cupy.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float64).astype(dtype).get()
    b = rng.standard_normal((n, n), dtype=np.float64).astype(dtype).get()
    out = np.full((n, n), np.nan, dtype=dtype)
    matmul_to(a, b, out, backend=backend, device_memory_limit=device_memory_limit)  # warm-up
    out[...] = np.nan
    tl = Timeline()
    matmul_to(a, b, out, backend=backend, device_memory_limit=device_memory_limit, trace=tl)
    if not np.isfinite(out).all():
        raise RuntimeError("the traced product left unwritten elements")
    return tl


def _save_json(tl, path) -> None:
    """``tl.to_json(path)`` whole or not at all (a staged file, then renamed onto ``path``)."""
    staged = staged_path(path)
    try:
        tl.to_json(staged)
        put_in_place(staged, path)
    except OSError as exc:
        named = naming_target(exc, staged, path)
        if named is exc:
            raise
        raise named from exc
    finally:
        staged.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    from distmm.cli.commands import _Parser  # its errors as one line, status 2

    p = _Parser(prog="distmm trace",
                description="render the stream pipeline's copy/compute timeline")
    p.add_argument("--n", type=integer_at_least(1), default=8192,
                   help="matrix size of the traced run")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--device-memory-limit", default=None, type=positive_size("8GB"),
                   help="device budget, e.g. 8GB (default: distmm.device-memory-limit)")
    p.add_argument("--backend", default="cublas", choices=["cublas", "raw", "auto"])
    p.add_argument("-o", "--output", default="timeline.png",
                   help="PNG to write (or the image format its suffix names: .svg, .pdf...)")
    p.add_argument("--json", default=None, help="also save the traced run's timeline as JSON here")
    p.add_argument("--from-json", default=None, help="render a saved timeline (no GPU needed)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # ``distmm trace -- --from-json ...`` passes the separator on
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_json is not None and args.json is not None:
        parser.error("--json saves a traced run's timeline; --from-json renders a saved one")
    _check_output(args.output)
    image_format(args.output)
    if args.json is not None:
        _check_output(args.json, "--json")
    if args.from_json is not None:
        if not args.from_json:
            raise ValueError("--from-json: an empty path")
        tl = read_timeline(args.from_json)
    else:
        missing = _missing_gpu()
        if missing is not None:
            print(f"distmm trace: error: a traced run needs cupy and a GPU: {missing}; "
                  f"use --from-json to render a saved timeline", file=sys.stderr)
            return BAD_INPUT
        tl = _run_traced(args.n, args.dtype, args.device_memory_limit, args.backend)
        if args.json:
            _save_json(tl, args.json)
    render(tl, args.output)
    meta = tl.meta
    print(f"wrote {args.output}: {len(tl.ops)} ops"
          + (f", {meta['tflops']:.1f} TFLOP/s" if meta.get("tflops") else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
