"""``distmm trace --from-json`` renders a saved timeline without a GPU."""
from __future__ import annotations

import json

import pytest

from distmm.executor.pipeline import Timeline

pytest.importorskip("matplotlib")


def _timeline() -> Timeline:
    tl = Timeline(meta={"m": 4096, "n": 4096, "k": 4096, "dtype": "float32",
                        "device": "test", "tflops": 40.0,
                        "tiling": {"mode": "full-width", "tk_max": 2048}})
    t = 0.0
    for i in range(8):
        tl.add("host-stage", f"A[{i},0]", t, t + 1.0)
        tl.add("host-stage", f"B[0,{i}]", t + 0.2, t + 1.3)
        tl.add("h2d", f"A[{i},0]", t + 1.0, t + 1.5)
        tl.add("compute", f"C[{i},0] k0", t + 1.5, t + 3.0)
        tl.add("d2h", f"C[{i},0]", t + 3.0, t + 3.4)
        tl.add("host-unstage", f"C[{i},0]", t + 3.4, t + 3.9)
        t += 1.5
    return tl


def test_render_from_saved_json(tmp_path):
    from distmm.cli.trace import main

    src = tmp_path / "timeline.json"
    _timeline().to_json(src)
    png = tmp_path / "timeline.png"
    assert main(["--from-json", str(src), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_dispatches_trace(tmp_path):
    from distmm.cli import main

    src = tmp_path / "t.json"
    _timeline().to_json(src)
    png = tmp_path / "t.png"
    # "--" keeps the top-level parser from reading the sub-command's options
    assert main(["trace", "--", "--from-json", str(src), "-o", str(png)]) == 0
    assert png.exists()


def test_timeline_round_trip_and_busy_time(tmp_path):
    tl = _timeline()
    tl.to_json(tmp_path / "x.json")
    back = Timeline.from_json(tmp_path / "x.json")
    assert back.ops == tl.ops and back.meta == tl.meta
    assert json.loads((tmp_path / "x.json").read_text())["meta"]["m"] == 4096
    assert back.busy_ms("compute") == pytest.approx(8 * 1.5)
    # overlapping host copies are counted once
    assert back.busy_ms("host-stage") == pytest.approx(8 * 1.3)
