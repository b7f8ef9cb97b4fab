"""The timeline of a pipelined run: when each copy and kernel started and ended.

This module covers: recording spans per lane, saving and loading them as JSON,
and the busy time of a lane. It does *not* cover: measuring (the run records
CUDA events and host clocks, ``distmm.executor.pipeline.run``) or drawing
(``distmm.cli.trace``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["Timeline"]


@dataclass
class Timeline:
    """When each copy and kernel of a pipelined run started and ended.

    ``ops`` holds dicts ``{"lane", "name", "start_ms", "end_ms"}``; GPU lanes
    (``h2d``, ``compute``, ``d2h``) come from CUDA events, host lanes
    (``host-stage``, ``host-unstage``, ``host-wait``: the issuing thread waiting for a
    staged chunk or a C buffer) from the host clock aligned to the
    first event. ``meta`` holds the problem, tiling, device and totals.
    """

    ops: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add(self, lane: str, name: str, start_ms: float, end_ms: float) -> None:
        self.ops.append({"lane": lane, "name": name, "start_ms": float(start_ms),
                         "end_ms": float(end_ms)})

    def to_json(self, path) -> None:
        with open(path, "w") as fh:
            json.dump({"meta": self.meta, "ops": self.ops}, fh)

    @classmethod
    def from_json(cls, path) -> "Timeline":
        with open(path) as fh:
            d = json.load(fh)
        return cls(ops=list(d.get("ops", [])), meta=dict(d.get("meta", {})))

    def busy_ms(self, lane: str) -> float:
        """Total time ``lane`` was busy (overlapping ops merged)."""
        from distmm.phases import merged_seconds

        return merged_seconds((o["start_ms"], o["end_ms"]) for o in self.ops if o["lane"] == lane)
