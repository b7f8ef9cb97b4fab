"""Where a run's time goes: per-process phase spans, their totals and the profile file.

This module covers: ``Phases``, a recorder of spans (phase name, start, end, bytes, lane)
on one process's clock, started at an instant the processes of a job agree on (the
engine takes it right after a barrier), so that the spans of several ranks share one
time axis; the busy time of each phase (overlapping spans of a phase merged); the
one-line summary the command line prints; and ``write_profile``, the JSON file
``distmm matmul --profile FILE`` writes (all ranks' spans, gathered on rank 0).

Phases are fixed names: ``startup`` (imports, the device, communicators), ``open``
(opening the operands and checking them), ``read`` (operand bytes from files into host
memory), ``h2d``, ``gemm``, ``comm`` (panel broadcasts), ``d2h``, ``release`` (a GPU
rank's device memory given back once its last copy out has ended), ``write`` (C bytes to
the staged output), ``sync`` (flushing it to disk), ``wait`` (barriers and agreement
between ranks) and ``commit`` (moving the output into place). Spans of GPU work come from
CUDA events, converted to this clock by the caller.

It does *not* cover: measuring GPU work (the engines record events) or drawing the
timeline (``distmm report`` reads the file).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

from distmm.errors import naming_target

__all__ = ["PHASES", "Phases", "merged_seconds", "summary_line", "write_profile"]

PHASES = ("startup", "open", "read", "h2d", "gemm", "comm", "d2h", "release", "write", "sync",
          "wait", "commit")


def merged_seconds(spans) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class Phases:
    """Spans of one process, in seconds since ``origin`` (``time.perf_counter`` values).

    Parameters
    ----------
    origin : float, optional
        The instant the spans count from (default: now). ``restart`` moves it.
    """

    def __init__(self, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else float(origin)
        self.spans: list[tuple[str, float, float, int, str]] = []

    def restart(self, origin: float | None = None) -> None:
        """Count from ``origin`` (default now), shifting the spans already recorded."""
        new = time.perf_counter() if origin is None else float(origin)
        shift = new - self.origin
        self.spans = [(p, s - shift, e - shift, b, lane) for p, s, e, b, lane in self.spans]
        self.origin = new

    def add(self, phase: str, start: float, end: float, nbytes: int = 0, lane: str = "") -> None:
        """Record a span given in ``perf_counter`` seconds."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        self.spans.append((phase, start - self.origin, end - self.origin, int(nbytes),
                           lane or phase))

    @contextmanager
    def phase(self, phase: str, nbytes: int = 0, lane: str = ""):
        """Time the block as one span of ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, start, time.perf_counter(), nbytes, lane)

    def totals(self) -> dict[str, float]:
        """Busy seconds per phase (overlapping spans of one phase counted once)."""
        out = {}
        for name in PHASES:
            spans = [(s, e) for p, s, e, _, _ in self.spans if p == name]
            if spans:
                out[name] = merged_seconds(spans)
        return out

    def bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p, _, _, b, _ in self.spans:
            if b:
                out[p] = out.get(p, 0) + b
        return out

    def record(self, **meta) -> dict:
        """This process's part of the profile file."""
        return {**meta, "totals": self.totals(), "bytes": self.bytes(),
                "spans": [{"phase": p, "lane": lane, "start": round(s, 6), "end": round(e, 6),
                           "bytes": b} for p, s, e, b, lane in self.spans]}


def summary_line(records: list[dict]) -> str:
    """``read 1.20 s, gemm 0.33 s, ...``: each phase's busy time on the rank where it was
    largest (phases overlap, so they do not add up to the wall time)."""
    parts = []
    for name in PHASES:
        values = [r["totals"].get(name, 0.0) for r in records]
        if any(values):
            parts.append(f"{name} {max(values):.2f}")
    return ", ".join(parts) + " s" if parts else ""


def write_profile(path, records: list[dict], meta: dict) -> None:
    """Write the profile file (JSON: ``meta``, ``ranks``: one record per rank in rank
    order) through a temporary name, so a reader never sees half a file. An ``OSError``
    names ``path``, the file asked for, not the temporary one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump({"format": "distmm-profile-1", "meta": meta, "ranks": records}, fh)
        os.replace(tmp, path)
    except OSError as exc:
        named = naming_target(exc, tmp, path)
        if named is exc:
            raise
        raise named from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
