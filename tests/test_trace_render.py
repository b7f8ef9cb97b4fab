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


@pytest.mark.parametrize("content, expected", [
    ("{}", "not a timeline: it has no 'ops'"),
    ('{"format": "distmm-calibration-1", "gemm": {}}', "not a timeline: it has no 'ops'"),
    ("[1, 2]", "not a timeline (a JSON object with 'ops' and 'meta'), got a JSON list"),
    ('{"ops": [], "meta": {}}', "'ops' must be a non-empty list"),
    ('{"ops": [{"lane": "gpu", "name": "x", "start_ms": 0, "end_ms": 1}]}', "op 0 must have a 'lane' of"),
    ('{"ops": [{"lane": "h2d", "name": "x", "start_ms": 2, "end_ms": 1}]}', "op 0 must have"),
    ('{"ops": [{"lane": "h2d", "name": "x", "start_ms": 0, "end_ms": 1}], "meta": []}',
     "'meta' must be an object"),
    ('{"ops": [{"lane": "h2d", "name": "x", "start_ms": 0, "end_ms": 1}], '
     '"meta": {"tflops": "fast"}}', "meta 'tflops' must be a number"),
    ('{"ops": [', "t.json:1: not JSON"),
    ('{"format": "distmm-profile-1", "meta": {"ranks": 1}, "ranks": []}',
     "a distmm matmul --profile file, not a timeline of distmm trace (distmm report draws"),
], ids=["empty-object", "calibration", "list", "no-ops", "unknown-lane", "end-before-start",
        "meta-list", "tflops-text", "cut-short", "profile"])
def test_a_file_that_is_no_timeline_is_refused(tmp_path, capfd, content, expected):
    from distmm.cli import main

    src = tmp_path / "t.json"
    src.write_text(content)
    png = tmp_path / "t.png"
    assert main(["trace", "--", "--from-json", str(src), "-o", str(png)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"distmm trace: error: {src}") and err.count("\n") == 1, err
    assert expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_output_in_a_missing_folder_is_refused_before_reading(tmp_path, capfd):
    from distmm.cli import main

    src = tmp_path / "t.json"
    _timeline().to_json(src)
    png = tmp_path / "nowhere" / "t.png"
    assert main(["trace", "--", "--from-json", str(src), "-o", str(png)]) == 2
    assert capfd.readouterr().err == (f"distmm trace: error: No such folder for the output: "
                                      f"{png}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_output_is_written_at_the_path_given_and_a_link_is_replaced(tmp_path, capfd):
    """``-o t`` wrote ``t.png`` (matplotlib adds the suffix) while saying 'wrote t'; a symbolic
    link at -o had its target overwritten with the PNG; ops all at 0 ms divided by zero."""
    from distmm.cli import main

    src = tmp_path / "t.json"
    _timeline().to_json(src)
    assert main(["trace", "--from-json", str(src), "-o", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "keep.txt").write_text("keep")
    (tmp_path / "link.svg").symlink_to(tmp_path / "keep.txt")
    assert main(["trace", "--from-json", str(src), "-o", str(tmp_path / "link.svg")]) == 0
    assert (tmp_path / "keep.txt").read_text() == "keep"
    assert b"<svg" in (tmp_path / "link.svg").read_bytes()
    assert not (tmp_path / "link.svg").is_symlink()
    zero = tmp_path / "zero.json"
    zero.write_text('{"ops": [{"lane": "h2d", "name": "x", "start_ms": 0, "end_ms": 0}]}')
    assert main(["trace", "--from-json", str(zero), "-o", str(tmp_path / "z.png")]) == 0
    capfd.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "link.svg", "t", "t.json",
                                                          "z.png", "zero.json"]


def test_an_image_that_cannot_be_written_names_the_output(tmp_path):
    """A write of the image that failed (here past the file-size limit, ``ulimit -f``)
    named no file, or the staged file beside -o (``.t.png.distmm-partial-PID``): now -o."""
    import resource
    import subprocess
    import sys

    src = tmp_path / "t.json"
    _timeline().to_json(src)
    png = tmp_path / "t.png"
    r = subprocess.run([sys.executable, "-m", "distmm", "trace", "--from-json", str(src), "-o",
                        str(png)], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"distmm trace: error: File too large: {png} (the file-size "
                               f"limit, ulimit -f, is 4.0 KiB)"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_negative_times_are_refused(tmp_path, capfd):
    from distmm.cli import main

    src = tmp_path / "t.json"
    src.write_text('{"ops": [{"lane": "h2d", "name": "x", "start_ms": -5, "end_ms": -1}]}')
    assert main(["trace", "--from-json", str(src), "-o", str(tmp_path / "t.png")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "0 <= 'start_ms' <= 'end_ms'" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.slow
def test_sigterm_while_drawing_leaves_no_partial_image(tmp_path):
    """The SVG backend writes while it draws: SIGTERM then left a partial ``-o`` file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ops = [{"lane": lane, "name": "x", "start_ms": float(i), "end_ms": i + 0.5}
           for i in range(40000) for lane in ("h2d", "compute", "d2h")]
    src = tmp_path / "big.json"
    src.write_text(json.dumps({"ops": ops, "meta": {}}))
    out = tmp_path / "big.svg"
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "trace", "--from-json", str(src),
                             "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name != "big.json" for p in tmp_path.iterdir()):
            break  # the image file (or its staged file) is being written
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err == "distmm trace: error: terminated by SIGTERM\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json"]
    assert os.path.exists(src)
