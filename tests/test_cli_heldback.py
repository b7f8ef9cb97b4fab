"""``distmm matmul`` in one process (local and Dask engines), on cases the CLI suites do not
hold: an empty path for A, B or ``-o`` is refused by the parser in one line naming the
argument, before any file is opened, as ``--profile ''`` is; every command's output path
through a regular file is refused as not a folder, naming the file, and one in a missing
folder as no such folder."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli


@pytest.mark.parametrize("which", ["a", "b", "-o", "--output="])
@pytest.mark.slow
def test_an_empty_operand_or_output_path_is_refused_naming_its_argument(tmp_path, which):
    """It was refused only by the suffix check, as ``unsupported file type '(no suffix)'
    for : use ...``: the line named neither the argument nor a file."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((5, 3)))
    np.save(tmp_path / "b.npy", rng.standard_normal((3, 4)))
    argv = {"a": ["", "b.npy", "-o", "c.npy"], "b": ["a.npy", "", "-o", "c.npy"],
            "-o": ["a.npy", "b.npy", "-o", ""], "--output=": ["a.npy", "b.npy", "--output="]}
    r = run_cli("matmul", *argv[which], cwd=tmp_path, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    name = {"a": "argument a:", "b": "argument b:"}.get(which, "argument -o/--output:")
    assert lines[0] == f"distmm matmul: error: {name} an empty path (see distmm matmul --help)", \
        lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


#: every command's output path, as ``distmm ARGS`` with ``{p}`` the path; the files each
#: reads (a.npy, b.npy, r.jsonl, s.toml) are made by ``_output_case``. ``makes`` says the
#: command makes a missing folder itself (a missing one is then no refusal).
OUTPUTS = {
    "matmul-npy": (["matmul", "a.npy", "b.npy", "-o", "{p}/c.npy"], False),
    "matmul-zarr": (["matmul", "a.npy", "b.npy", "-o", "{p}/c.zarr"], False),
    "matmul-h5": (["matmul", "a.npy", "b.npy", "-o", "{p}/c.h5:x"], False),
    "profile": (["matmul", "a.npy", "b.npy", "-o", "c.npy", "--profile", "{p}/p.json"], False),
    "demo-report": (["demo", "-n", "9", "--report", "{p}/r.json"], False),
    "trace": (["trace", "-o", "{p}/t.png"], False),
    "model-validate": (["model", "--validate", "r.jsonl", "-o", "{p}/v.jsonl"], False),
    "calibrate": (["calibrate", "--quick", "-o", "{p}/cal.json"], True),
    "bench-records": (["bench", "s.toml", "-o", "{p}/rec.jsonl"], True),
    "report": (["report", "r.jsonl", "-o", "{p}/rep"], True),
    "cluster-scheduler-file": (["cluster", "--workers", "1", "--port", "0",
                                "--dashboard-address", ":0", "--scheduler-file", "{p}/s.json"],
                               False),
}


def _output_case(tmp_path, case: str, under: str):
    """Run ``OUTPUTS[case]`` in ``tmp_path`` with its output under ``under``; return the
    result, its stderr lines and the files before the run."""
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.standard_normal((5, 3)))
    np.save(tmp_path / "b.npy", rng.standard_normal((3, 4)))
    (tmp_path / "r.jsonl").write_text("")
    (tmp_path / "s.toml").write_text('repeats = 1\n[[series]]\nkind = "strong"\n'
                                     'engines = ["local"]\ncounts = [1]\nsizes = [9]\n')
    (tmp_path / "f").write_text("a file\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [a.replace("{p}", under) for a in OUTPUTS[case][0]]
    r = run_cli(*argv, cwd=tmp_path, timeout=120)
    return r, [x for x in r.stderr.splitlines() if x.strip()], before


@pytest.mark.parametrize("under", ["f/d", "f"], ids=["below-file", "in-file"])
@pytest.mark.parametrize("case", list(OUTPUTS))
@pytest.mark.slow
def test_an_output_through_a_file_is_not_a_folder(tmp_path, case, under):
    """An output path through a regular file (``f/d/c.npy``, ``f`` a file) was told as a
    missing folder ("no such folder for the output f/d/c.npy: f/d") by matmul's -o,
    --profile, demo --report, trace -o and model -o: one line naming the file that is in
    the way as not a folder (``NotADirectoryError``, as ``open`` meets it), status 2,
    nothing written."""
    r, lines, before = _output_case(tmp_path, case, under)
    assert r.returncode == 2 and len(lines) == 1 and r.stdout == "", (r.returncode, r.stderr)
    line = lines[0].lower()
    assert "no such" not in line and ("not a folder" in line or "not a directory" in line), line
    assert (" f is " in line or f"{tmp_path / 'f'} is" in line
            or line.endswith(f": {tmp_path / 'f'}")), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "f").read_text() == "a file\n"


@pytest.mark.parametrize("case", [c for c, (_, makes) in OUTPUTS.items() if not makes])
@pytest.mark.slow
def test_an_output_in_a_missing_folder_is_no_such_folder(tmp_path, case):
    """The other case, a folder that is not there (``no/d/c.npy``): still "no such folder"
    (or directory), not "not a folder"."""
    r, lines, before = _output_case(tmp_path, case, "no/d")
    assert r.returncode == 2 and len(lines) == 1 and r.stdout == "", (r.returncode, r.stderr)
    line = lines[0].lower()
    assert ("no such folder" in line or "no such directory" in line) \
        and "not a folder" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("under", ["f/d", "f"], ids=["below-file", "in-file"])
@pytest.mark.parametrize("name", ["c.npy", "c.zarr", "c.h5:x"])
def test_the_api_target_check_tells_a_file_in_the_way_from_a_missing_folder(tmp_path,
                                                                            monkeypatch, name,
                                                                            under):
    """``distmm.staging.check_target``, the check of ``DistArray.to_file`` and the command
    line: a path through a file is ``NotADirectoryError`` (errno ENOTDIR) naming the file,
    as numpy's own ``np.save`` meets it; a missing folder stays ``FileNotFoundError``."""
    import errno

    from distmm.staging import check_target
    from distmm.stripe_writer import output_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file\n")
    with pytest.raises(NotADirectoryError):
        np.save(f"{under}/c.npy", np.zeros(3))
    with pytest.raises(NotADirectoryError, match=r"cannot write .*: f is not a folder") as got:
        check_target(output_spec(f"{under}/{name}"), False)
    assert got.value.errno == errno.ENOTDIR
    with pytest.raises(FileNotFoundError, match="no such folder for the output") as got:
        check_target(output_spec(f"no/d/{name}"), False)
    assert got.value.errno == errno.ENOENT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
