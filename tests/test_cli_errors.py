"""The command line's failures: one line on stderr naming the file, dataset or
option; exit 2 for bad input, 1 for a failed run; no traceback without --debug.
Run as real subprocesses (and under a real mpiexec)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from conftest import run_cli


def one_line(r) -> str:
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


@pytest.fixture
def files(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.ones((6, 4)))
    np.save(tmp_path / "b.npy", np.ones((4, 3)))
    return tmp_path


def test_directory_as_input(files):
    (files / "d.npy").mkdir()
    r = run_cli("matmul", files / "d.npy", files / "b.npy", "-o", files / "c.npy")
    assert r.returncode == 2 and "d.npy is a directory" in one_line(r)


def test_missing_h5_dataset(files):
    with h5py.File(files / "in.h5", "w") as fh:
        fh["A"] = np.ones((6, 4))
    r = run_cli("matmul", f"{files}/in.h5:missing", files / "b.npy", "-o", files / "c.npy")
    assert r.returncode == 2
    assert "no dataset 'missing'" in one_line(r) and "in.h5" in r.stderr and "A" in r.stderr


def _damage(folder: Path, kind: str) -> str:
    """An operand whose file or metadata its library cannot read; returns its spec."""
    import json

    import zarr

    if kind == "empty-npy":
        (folder / "e.npy").touch()
        return str(folder / "e.npy")
    if kind == "truncated-h5":
        with h5py.File(folder / "t.h5", "w") as fh:
            fh["A"] = np.ones((6, 4))
        data = (folder / "t.h5").read_bytes()
        (folder / "t.h5").write_bytes(data[:len(data) // 2])
        return f"{folder / 't.h5'}:A"
    fmt = 2 if kind == "zarr2-no-dtype" else 3
    z = zarr.open_array(str(folder / "z.zarr"), mode="w", shape=(6, 4), dtype="f8", zarr_format=fmt)
    z[...] = 1.0
    meta = folder / "z.zarr" / (".zarray" if fmt == 2 else "zarr.json")
    doc = json.loads(meta.read_text())
    doc.pop("dtype" if fmt == 2 else "data_type")
    meta.write_text(json.dumps(doc))
    return str(folder / "z.zarr")


@pytest.mark.parametrize("kind", ["empty-npy", "truncated-h5", "zarr2-no-dtype", "zarr3-no-dtype"])
@pytest.mark.slow
def test_an_unreadable_operand_is_bad_input_naming_its_file(files, kind):
    """Found by a fuzz of the command line: these exited 1 with the library's words alone
    ("No data left in file", "dtype", HDF5's "truncated file")."""
    spec = _damage(files, kind)
    r = run_cli("matmul", spec, files / "b.npy", "-o", files / "c.npy")
    line = one_line(r)
    assert r.returncode == 2 and "is not a readable" in line
    assert spec.partition(":")[0].rsplit("/", 1)[-1] in line
    assert not (files / "c.npy").exists()


@pytest.mark.parametrize("where", [pytest.param("missing-folder", marks=pytest.mark.slow),
                                   pytest.param("directory", marks=pytest.mark.slow),
                                   pytest.param("operand", marks=pytest.mark.slow), "output"])
def test_profile_path_is_checked_before_any_work(files, where):
    """--profile was written after C: a bad path failed a finished run (exit 2, C left in
    place), and naming an input replaced it with JSON."""
    (files / "d").mkdir()
    prof = {"missing-folder": files / "none" / "p.json", "directory": files / "d",
            "operand": files / "a.npy", "output": files / "c.npy"}[where]
    before = (files / "a.npy").read_bytes()
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy",
                "--profile", prof)
    assert r.returncode == 2 and "--profile" in one_line(r)
    assert not (files / "c.npy").exists() and (files / "a.npy").read_bytes() == before
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "d"]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="writes under /proc")
def test_a_profile_that_cannot_be_made_is_named_as_given(files):
    """A --profile that could not be created (in /proc: a folder of files no process makes)
    was said as the temporary file beside it (/proc/p.json.tmp-PID), a name not given."""
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy",
                "--profile", "/proc/p.json")
    line = one_line(r)
    assert r.returncode == 2 and line.endswith(": /proc/p.json\n") and ".tmp-" not in line, line


def test_dot_dot_in_an_h5_output_path_is_refused_before_any_write(files):
    with h5py.File(files / "out.h5", "w") as fh:
        fh["X"] = np.arange(3.0)
    before = (files / "out.h5").read_bytes()
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", f"{files}/out.h5:grp/../C")
    assert r.returncode == 2 and "'.' and '..' are not dataset names" in one_line(r)
    assert (files / "out.h5").read_bytes() == before


def _refused_dtype(files, r):
    out = files / "c.zarr"
    assert r.returncode == 2, r.stderr
    line = next(x for x in r.stderr.splitlines() if "distmm matmul" in x)
    assert f"cannot write {out}" in line and "float128" in line, line
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "l.npy"]


def test_a_dtype_the_output_cannot_store_names_the_file(files):
    """A long double result for a zarr output (zarr has no such type): exit 2, one line
    naming the file, before the product, with nothing written (it named no file)."""
    np.save(files / "l.npy", np.ones((6, 4), dtype=np.longdouble))
    r = run_cli("matmul", files / "l.npy", files / "b.npy", "-o", files / "c.zarr")
    one_line(r)
    _refused_dtype(files, r)


@pytest.mark.mpi
def test_a_dtype_the_output_cannot_store_names_the_file_under_mpirun(files, mpirun):
    np.save(files / "l.npy", np.ones((6, 4), dtype=np.longdouble))
    r = mpirun(2, "-m", "distmm", "matmul", files / "l.npy", files / "b.npy", "-o",
               files / "c.zarr")
    _refused_dtype(files, r)


#: a real SWMR writer: makes the file, turns SWMR on, says "ready", then appends a row every
#: 20 ms until its stdin closes, and closes the file
SWMR_WRITER = """
import select, sys, h5py, numpy as np
f = h5py.File(sys.argv[1], "w", libver="latest")
d = f.create_dataset("A", data=np.ones((6, 4)), maxshape=(None, 4), chunks=(1, 4))
f.swmr_mode = True
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.02)[0]:
    d.resize((d.shape[0] + 1, 4)); d[-1] = 1.0; d.flush()
f.close()
"""


def _swmr_writer(path: Path) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", SWMR_WRITER, str(path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdout.readline() == "ready\n"
    return writer


def _refused_swmr(files, r) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("distmm matmul: error:") == 1 and "Traceback" not in r.stderr, r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert f"{files / 'w.h5'} is held by an SWMR writer in another process" in line, line
    assert "run once the writer has closed the file" in line
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "w.h5"]


def test_an_h5_input_an_swmr_writer_holds_is_refused_naming_swmr(files):
    """A file another process appends to in SWMR mode was refused as "open for writing ... or
    a writer that stopped left it marked open (h5clear -s ...)": advice that, run on a live
    writer's file, damages it. Now one line names the SWMR writer and what to do, exit 2,
    nothing written; once the writer has closed the file the same command runs."""
    writer = _swmr_writer(files / "w.h5")
    try:
        r = run_cli("matmul", f"{files}/w.h5:A", files / "b.npy", "-o", files / "c.npy")
    finally:
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    _refused_swmr(files, r)
    r = run_cli("matmul", f"{files}/w.h5:A", files / "b.npy", "-o", files / "c.npy")
    assert r.returncode == 0, r.stderr
    with h5py.File(files / "w.h5", "r") as fh:
        rows = fh["A"].shape[0]
    assert rows > 6 and np.load(files / "c.npy").shape == (rows, 3)


@pytest.mark.slow
@pytest.mark.mpi
def test_an_h5_input_an_swmr_writer_holds_is_refused_under_mpirun(files, mpirun):
    writer = _swmr_writer(files / "w.h5")
    try:
        r = mpirun(2, "-m", "distmm", "matmul", f"{files}/w.h5:A", files / "b.npy", "-o",
                   files / "c.npy")
    finally:
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    _refused_swmr(files, r)


#: another process holding an output file (dataset X) until its stdin closes, then closing it:
#: "swmr" an SWMR writer, "stopped" one that ended without closing the file (its mark stays),
#: "writer" a plain writer (HDF5's exclusive file lock); it says "ready" once it holds it
OUTPUT_HOLDER = """
import os, sys, h5py, numpy as np
how = sys.argv[2]
f = h5py.File(sys.argv[1], "w", libver="earliest" if how == "writer" else "latest")
f.create_dataset("X", data=np.ones((3, 4)), maxshape=(None, 4), chunks=(1, 4))
if how != "writer":
    f.swmr_mode = True
f.flush()
print("ready", flush=True)
if how == "stopped":
    os._exit(0)
sys.stdin.read()
f.close()
"""

_OUTPUT_HELD = {"swmr": ("is held by an SWMR writer in another process",
                         "run once the writer has closed the file"),
                "stopped": ("is held by an SWMR writer in another process",
                            "h5clear -s "),
                "writer": ("is open for writing in another process (HDF5's file lock)",
                           "close it there first")}


def _output_held(files, how, command):
    """Run ``command`` (the product into out.h5:C) while a holder ``how`` has out.h5, and check
    the refusal: status 2, one line naming the file, the writer and what to do, before any
    work; out.h5 (bytes and mtime) and its folder as they were. Once a live holder has closed
    the file, the same command adds C."""
    out = files / "out.h5"
    holder = subprocess.Popen([sys.executable, "-c", OUTPUT_HOLDER, str(out), how], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "ready\n"
        if how == "stopped":
            assert holder.wait(timeout=60) == 0
        before, mtime = out.read_bytes(), out.stat().st_mtime_ns
        r = command()
        # compared while the holder has it: its close rewrites the superblock
        assert out.read_bytes() == before and out.stat().st_mtime_ns == mtime
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("distmm matmul: error:") == 1 and "Traceback" not in r.stderr, r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert f"cannot add 'C' to {out}: " in line and all(s in line for s in _OUTPUT_HELD[how]), line
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "out.h5"]
    if how == "stopped":
        return
    r = command()
    assert r.returncode == 0, r.stderr
    with h5py.File(out, "r") as fh:
        assert np.array_equal(fh["C"][...], np.full((6, 3), 4.0)) and fh["X"].shape == (3, 4)


@pytest.mark.parametrize("how", ["swmr", pytest.param("stopped", marks=pytest.mark.slow),
                                 pytest.param("writer", marks=pytest.mark.slow)])
def test_an_h5_output_another_process_writes_is_refused_naming_the_writer(files, how):
    """``-o out.h5:C`` where an SWMR writer holds out.h5 (or one that stopped left it marked
    open) ended with status 1 and HDF5's raw 'Unable to synchronously open file (file is
    already open for write ...)', naming no file; a plain writer's lock with 'unable to lock
    file, errno = 11'. Now one line names out.h5, the writer and what to do, status 2."""
    _output_held(files, how, lambda: run_cli("matmul", files / "a.npy", files / "b.npy",
                                             "-o", f"{files}/out.h5:C"))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("how", ["swmr", "stopped", "writer"])
def test_an_h5_output_another_process_writes_is_refused_under_mpirun(files, mpirun, how):
    _output_held(files, how, lambda: mpirun(2, "-m", "distmm", "matmul", files / "a.npy",
                                            files / "b.npy", "-o", f"{files}/out.h5:C"))


def test_missing_input_names_the_file(files):
    r = run_cli("matmul", files / "missing.npy", files / "b.npy", "-o", files / "c.npy")
    assert r.returncode == 2 and f"no such file: {files / 'missing.npy'}" in one_line(r)


def test_unsupported_suffix_and_shape_mismatch(files):
    r = run_cli("matmul", files / "a.csv", files / "b.npy", "-o", files / "c.npy")
    assert r.returncode == 2 and "unsupported file type '.csv'" in one_line(r)
    r = run_cli("matmul", files / "a.npy", files / "a.npy", "-o", files / "c.npy")
    assert r.returncode == 2 and "inner dimensions differ" in one_line(r)
    np.save(files / "s.npy", np.array(["x", "y", "z", "w"]))
    r = run_cli("matmul", files / "a.npy", files / "s.npy", "-o", files / "c.npy")
    assert r.returncode == 2 and "dtype" in one_line(r)
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "s.npy"]


def test_an_output_path_ending_in_a_separator_is_refused(files):
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", f"{files}/c.npy/")
    assert r.returncode == 2 and "ends with a path separator" in one_line(r)
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=[pytest.mark.mpi, pytest.mark.slow])])
def test_a_zarr_operand_named_with_a_trailing_separator_is_read(tmp_path, ranks, request):
    """A shell completes a zarr array's folder as ``a.zarr/``: such an operand was refused
    ("ends with a path separator: name a file"), a zarr array being a folder; it is read as
    ``a.zarr``, a zarr array in a group (``g.zarr/A/``) too, on one process and 2 ranks."""
    import zarr

    rng = np.random.default_rng()
    a, b = rng.standard_normal((13, 7)), rng.standard_normal((7, 5))
    zarr.create_array(str(tmp_path / "a.zarr"), shape=a.shape, chunks=(4, 3), dtype="f8")[...] = a
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    group.create_array("B", shape=b.shape, chunks=(3, 2), dtype="f8")[...] = b
    argv = ("matmul", f"{tmp_path}/a.zarr/", f"{tmp_path}/g.zarr/B//", "-o", tmp_path / "c.npy")
    if ranks == 1:
        r = run_cli(*argv)
    else:
        r = request.getfixturevalue("mpirun")(ranks, "-m", "distmm", *argv)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "c.npy", "g.zarr"]


def test_a_zarr_operand_whose_metadata_is_not_json_says_so(files):
    """A zarr array whose zarr.json does not parse was said to be "not a zarr array: name an
    array, e.g. z.zarr/NAME", advice for a group that it is not; it is named as unreadable."""
    import zarr

    zarr.create_array(str(files / "z.zarr"), shape=(6, 4), dtype="f8")[...] = 1.0
    (files / "z.zarr" / "zarr.json").write_text("{not json")
    r = run_cli("matmul", files / "z.zarr", files / "b.npy", "-o", files / "c.npy")
    line = one_line(r)
    assert r.returncode == 2 and "z.zarr is not a readable zarr array" in line, line
    assert "zarr.json" in line and "NAME" not in line
    assert not (files / "c.npy").exists()


def test_batches_that_do_not_broadcast_say_so_once(files):
    np.save(files / "x.npy", np.ones((2, 3, 4)))
    np.save(files / "y.npy", np.ones((3, 4, 2)))
    r = run_cli("matmul", files / "x.npy", files / "y.npy", "-o", files / "c.npy")
    line = one_line(r)
    assert r.returncode == 2 and "batch dimensions do not broadcast" in line
    assert line.count("matmul") == 1, line


def test_backend_raw_without_gpu(files):
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401

        pytest.skip("a GPU stack is present")
    except ImportError:
        pass
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy", "--backend", "raw")
    assert r.returncode == 2 and "backend 'raw' needs cupy" in one_line(r)
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"]
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy", "--backend", "raw",
                "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_unwritable_output_folder(files):
    # root writes through chmod, so also a folder that cannot exist: under a file
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "a.npy" / "c.npy")
    assert r.returncode == 2 and "is not a folder" in one_line(r)
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "nowhere" / "c.npy")
    assert r.returncode == 2 and "no such folder" in one_line(r)
    if os.geteuid() == 0:
        return  # chmod does not stop root
    ro = files / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", ro / "c.npy")
        assert r.returncode == 2 and "Permission denied" in one_line(r)
    finally:
        ro.chmod(0o755)


def _distmm(request, ranks: int, *argv):
    """``distmm *argv`` in one process (``run_cli``; its stderr must be one line) or under
    ``ranks`` ranks (the ``mpirun`` fixture): the result and its stderr."""
    if ranks == 1:
        r = run_cli(*argv)
        return r, one_line(r)
    r = request.getfixturevalue("mpirun")(ranks, "-m", "distmm", *argv)
    return r, r.stderr


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="writes under /proc")
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
@pytest.mark.parametrize("name", ["c.npy", "c.h5:C"])
@pytest.mark.slow
def test_an_output_folder_no_file_can_be_made_in_is_refused_naming_it(files, name, ranks,
                                                                      request):
    """os.access lets root write in /proc, where no file can be made: the output was refused
    by the free-space check instead ('/proc/c.npy needs 2.4 MiB but its file system has 0.0
    MiB free', status 1, a failed run). The staged output's creation is tried now: bad input,
    status 2, one line from rank 0, on one process and under mpirun."""
    argv = ("matmul", files / "a.npy", files / "b.npy", "-o", f"/proc/{name}")
    r, line = _distmm(request, ranks, *argv)
    assert r.returncode == 2, r.stderr
    assert (f"cannot write /proc/{name}: its folder /proc is not writable (distmm stages the "
            f"output beside its target)") in line and "free" not in line, line
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"]


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a tmpfs mounted read-only (root and a mount namespace that allows it)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_an_output_folder_on_a_read_only_file_system_says_so(files, read_only_folder):
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", read_only_folder / "c.npy")
    assert r.returncode == 2
    assert (f"cannot write {read_only_folder / 'c.npy'}: its folder {read_only_folder} is on a "
            f"read-only file system") in one_line(r)


def test_a_report_folder_on_a_read_only_file_system_is_refused_before_any_work(
        tmp_path, read_only_folder, capsys):
    """distmm report -o a read-only file system's child read the records and drew before
    making its staging folder failed: 'Read-only file system', status 1, a failed run. The
    folder is tried before any input is read now: bad input, status 2, one line naming -o."""
    recs = tmp_path / "r.jsonl"
    recs.write_text('{"run": "r", "benchmark": "scaling", "variant": "numpy", "device": '
                    '"cpu", "dtype": "float64", "m": 64, "n": 64, "k": 64, "seconds": 1.0, '
                    '"tflops": 5.24288e-07}\n')
    from distmm.cli import main

    for out in (read_only_folder / "report", read_only_folder / "new" / "report"):
        assert main(["report", str(recs), "-o", str(out)]) == 2
        assert capsys.readouterr().err == (f"distmm report: error: cannot write in "
                                           f"{read_only_folder} (Read-only file system): "
                                           f"{out}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "ro"]


def test_version_and_plan_dtype():
    import distmm

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"distmm {distmm.__version__}"
    r = run_cli("plan", 10, 10, 10, "--dtype", "U5")
    assert r.returncode == 2 and "--dtype" in one_line(r) and "U5" in r.stderr
    r = run_cli("plan", 10, 10, 10, "--dtype", "nonsense")
    assert r.returncode == 2 and "--dtype" in one_line(r)
    r = run_cli("matmul", "x.npy")
    assert r.returncode == 2 and "--output" in one_line(r)


def _walk(parser: argparse.ArgumentParser, prog: str = "distmm"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{prog} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prog, action


def test_every_argument_has_help():
    from distmm.cli.commands import build_parser

    seen, missing = 0, []
    for prog, action in _walk(build_parser()):
        seen += 1
        if not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS:
            missing.append(f"{prog}: {action.option_strings or action.dest}")
    assert seen > 25
    assert not missing, missing


def test_matmul_progress_bar_for_the_local_engine(files):
    rng = np.random.default_rng()
    np.save(files / "a.npy", rng.standard_normal((300, 200)))
    np.save(files / "b.npy", rng.standard_normal((200, 100)))
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy", "--engine", "local",
                "--tile", 50, "--progress")
    assert r.returncode == 0, r.stderr
    import re

    assert "distmm matmul" in r.stderr and re.search(r"100%.*\b(\d+)/\1\b", r.stderr), r.stderr
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "d.npy", "--engine", "local",
                "--tile", 50, "--no-progress")
    assert r.returncode == 0 and r.stderr == ""


@pytest.mark.slow
def test_matmul_on_an_existing_cluster(files):
    from distributed import Client, LocalCluster

    rng = np.random.default_rng()
    a, b = rng.standard_normal((70, 50)), rng.standard_normal((50, 40))
    np.save(files / "a.npy", a)
    np.save(files / "b.npy", b)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.write_scheduler_file(str(files / "sched.json"))
        r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c1.npy",
                    "--scheduler", cluster.scheduler_address)
        assert r.returncode == 0, r.stderr
        r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c2.npy",
                    "--scheduler-file", files / "sched.json")
        assert r.returncode == 0, r.stderr
        # a product ran on the cluster's workers
        assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.transition_log)) > 0
    for name in ("c1.npy", "c2.npy"):
        np.testing.assert_allclose(np.load(files / name), a @ b, rtol=1e-12, atol=1e-12)
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c3.npy",
                "--scheduler", "tcp://127.0.0.1:1", "--connect-timeout", 2)
    assert r.returncode == 1 and "cannot connect to tcp://127.0.0.1:1 (--scheduler)" in one_line(r)
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c3.npy",
                "--scheduler-file", files / "none.json")
    assert r.returncode == 2 and "none.json" in one_line(r)


def test_launcher_ranks_from_the_environment():
    from distmm.cli.launch import launcher_ranks

    assert launcher_ranks({}) == (1, None)
    assert launcher_ranks({"OMPI_COMM_WORLD_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_SIZE")
    assert launcher_ranks({"PMI_SIZE": "2"}) == (2, "PMI_SIZE")
    # a batch script has SLURM_NTASKS but is no step of many ranks
    assert launcher_ranks({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) == (1, None)
    assert launcher_ranks({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}) == (8, "SLURM_STEP_NUM_TASKS")


# A real signal at a chosen point of the command's imports: a sitecustomize (found on
# PYTHONPATH at start-up) sends it to its own process when that module is first imported.
_SIGNAL_AT_IMPORT = """
import os, signal, sys

class SignalAt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} and os.environ.get("OMPI_COMM_WORLD_RANK", "0") in {ranks!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{signame})
        return None

sys.meta_path.insert(0, SignalAt())
"""


def _signal_at_import(tmp_path: Path, module: str, signame: str, env=os.environ,
                      ranks=("0", "1")) -> dict:
    (tmp_path / "sitecustomize.py").write_text(
        _SIGNAL_AT_IMPORT.format(module=module, signame=signame, ranks=ranks))
    return dict(env, PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("module, signame, status, line", [
    ("distmm.api", "SIGINT", 130, "distmm plan: error: interrupted (SIGINT)"),
    ("distmm.api", "SIGTERM", 143, "distmm plan: error: terminated by SIGTERM"),
    ("distmm.cli.commands", "SIGINT", 130, "distmm plan: error: interrupted (SIGINT)"),
])
def test_signal_while_the_command_imports_is_its_one_line(tmp_path, module, signame, status,
                                                          line):
    r = run_cli("plan", 64, 64, 64, env=_signal_at_import(tmp_path, module, signame))
    assert r.returncode == status, r.stderr
    assert one_line(r) == line + "\n" and r.stdout == ""


def test_a_second_signal_while_the_first_is_said_changes_nothing(tmp_path):
    """A rank other than 0 (it waits for rank 0's line first) gets SIGINT while it imports,
    then SIGTERM as its launcher ends it: still the first signal's one line and status (the
    second raised inside the guard: a traceback, seen once under a loaded mpirun)."""
    env = _signal_at_import(tmp_path, "distmm.api", "SIGINT", ranks=("1",))
    (tmp_path / "sitecustomize.py").write_text(
        (tmp_path / "sitecustomize.py").read_text().replace(
            "            os.kill(os.getpid(), signal.SIGINT)",
            "            import threading, time\n"
            "            threading.Thread(target=lambda: (time.sleep(0.3), os.kill(os.getpid(), "
            "signal.SIGTERM))).start()\n"
            "            os.kill(os.getpid(), signal.SIGINT)"))
    r = run_cli("plan", 64, 64, 64, env={**env, "OMPI_COMM_WORLD_RANK": "1"})
    assert r.returncode == 130, r.stderr
    assert one_line(r) == "distmm plan: error: interrupted (SIGINT)\n"


def test_a_program_importing_distmm_keeps_python_s_signal_handling(tmp_path):
    """Outside the command, importing distmm installs no handler: SIGTERM keeps its default
    action, and a Ctrl-C during the import is the caller's KeyboardInterrupt."""
    env = _signal_at_import(tmp_path, "distmm.api", "SIGINT")
    code = ("import signal\ntry:\n    import distmm\nexcept KeyboardInterrupt:\n"
            "    print('caught')\nimport distmm, signal\n"
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["caught", "True"], r.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_sigterm_while_the_ranks_import_is_one_line(tmp_path, mpirun, mpi_env):
    """Every rank gets the signal (as from Slurm); rank 0 alone says so."""
    env = _signal_at_import(tmp_path, "distmm.api", "SIGTERM", env=mpi_env)
    r = mpirun(2, "-m", "distmm", "plan", 64, 64, 64, env=env)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("distmm")]
    assert lines == ["distmm plan: error: terminated by SIGTERM"], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [("0", "1"), ("1",)], ids=["every rank", "rank 1 alone"])
def test_sigterm_before_the_product_is_one_line_for_all_ranks(tmp_path, mpirun, mpi_env,
                                                              ranks):
    """A SIGTERM after start-up, before the product's own handling (as the command imports
    the MPI path): one line, whether every rank got it (rank 0 says it) or only rank 1."""
    np.save(tmp_path / "a.npy", np.ones((50, 40)))
    np.save(tmp_path / "b.npy", np.ones((40, 30)))
    env = _signal_at_import(tmp_path, "distmm.cli.mpi_matmul", "SIGTERM", env=mpi_env,
                            ranks=ranks)
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
               tmp_path / "c.npy", env=env)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("distmm")]
    assert lines == ["distmm matmul: error: terminated by SIGTERM"], r.stderr
    assert not (tmp_path / "c.npy").exists()


def _gpu_here() -> bool:
    from distmm.executor import gpu_available

    return gpu_available()


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
@pytest.mark.mpi
def test_argument_errors_under_mpirun_are_said_once(files, mpirun):
    """Every rank parses the same arguments: an argument error, or an --engine that would
    run the product once per rank, is one line from rank 0 (it was one per rank), exit 2,
    and no traceback from ranks the launcher stops meanwhile."""
    for extra in ([], ["-o", files / "c.npy", "--tile", "0"],
                  ["-o", files / "c.npy", "--engine", "local"],
                  ["-o", files / "c.npy", "--engine", "dask"]):
        r = mpirun(3, "-m", "distmm", "matmul", files / "a.npy", files / "b.npy", *extra)
        assert r.returncode == 2, (extra, r.stderr)
        assert r.stderr.count("distmm matmul: error:") == 1, (extra, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"]


@pytest.mark.mpi
@pytest.mark.slow
def test_stacks_under_mpirun_are_checked_before_any_work(files, mpirun):
    """Stacks and vectors take the checks matrices take, before the product: an existing
    target (it was found only after the product), a GPU backend on ranks without a GPU (it
    called MPI_Abort: a line per rank and the launcher's banner), and --tile, which the MPI
    engine does not take (it was ignored)."""
    np.save(files / "s.npy", np.ones((3, 6, 4)))
    (files / "c.npy").write_bytes(b"keep")
    cases = [(["-o", files / "c.npy"], "exists"),
             (["-o", files / "d.npy", "--tile", "4"], "--tile")]
    if not _gpu_here():
        cases.append((["-o", files / "d.npy", "--backend", "raw"], "needs a CUDA GPU"))
    for extra, said in cases:
        r = mpirun(2, "-m", "distmm", "matmul", files / "s.npy", files / "b.npy", *extra)
        assert r.returncode == 2, (extra, r.stderr)
        assert r.stderr.count("distmm matmul: error:") == 1 and said in r.stderr, r.stderr
        assert "MPI_ABORT" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (files / "c.npy").read_bytes() == b"keep"
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "c.npy", "s.npy"]


@pytest.mark.skipif(_gpu_here(), reason="on a GPU the product would run before the check")
def test_a_stack_is_checked_against_its_target_before_the_product(files):
    """An existing target is refused before a stack is multiplied (the product ran first: a
    GPU backend's error here, on a machine without one, came before "exists")."""
    np.save(files / "s.npy", np.ones((3, 6, 4)))
    (files / "c.npy").write_bytes(b"keep")
    r = run_cli("matmul", files / "s.npy", files / "b.npy", "-o", files / "c.npy",
                "--backend", "raw")
    assert r.returncode == 2 and "exists" in one_line(r)
    assert (files / "c.npy").read_bytes() == b"keep"


def test_a_signal_while_the_arguments_are_parsed_is_one_line(files):
    """SIGTERM or SIGINT while the parser's modules import (a launcher stopping a rank
    early sends one there): the one line and 143 / 130, not a traceback and 1."""
    script = ("import os, signal, sys\n"
              "sys.argv[0] = 'distmm'\n"
              "from distmm.cli import commands\n"
              "build = commands.build_parser\n"
              "def signalled():\n"
              "    os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
              "    return build()\n"
              "commands.build_parser = signalled\n"
              "sys.exit(commands.main(sys.argv[2:]))\n")
    for name, status, said in (("SIGTERM", 143, "terminated by SIGTERM"),
                               ("SIGINT", 130, "interrupted (SIGINT)")):
        r = subprocess.run([sys.executable, "-c", script, name, "matmul", files / "a.npy",
                            files / "b.npy", "-o", files / "c.npy"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == status, r.stderr
        assert said in one_line(r)
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"]


def _corrupt_chunk(folder: Path, kind: str) -> str:
    """An operand (60 x 4, B of the ``files`` fixture fits it) whose header opens but one
    chunk of which does not decode; returns its spec."""
    rng = np.random.default_rng()
    if kind == "zarr":
        import zarr

        z = zarr.create_array(str(folder / "z.zarr"), shape=(60, 4), chunks=(10, 4), dtype="f8")
        z[...] = rng.random((60, 4))
        chunk = folder / "z.zarr" / "c" / "3" / "0"
        chunk.write_bytes(chunk.read_bytes()[:20])
        return str(folder / "z.zarr")
    with h5py.File(folder / "g.h5", "w") as fh:
        d = fh.create_dataset("A", data=rng.random((60, 4)), chunks=(10, 4), compression="gzip")
        offset = d.id.get_chunk_info(3).byte_offset
    with open(folder / "g.h5", "r+b") as fh:
        fh.seek(offset + 4)
        fh.write(b"\0" * 40)
    return f"{folder / 'g.h5'}:A"


@pytest.mark.parametrize("kind", ["zarr", "h5"])
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
@pytest.mark.slow
def test_a_chunk_that_does_not_decode_names_its_file(files, kind, ranks, request):
    """A corrupt chunk found while the product reads it: one line naming the operand, exit
    2 (an unreadable input), nothing left behind; it named no file, exited 1 and zarr's
    abandoned reads added asyncio's tracebacks at exit."""
    spec = _corrupt_chunk(files, kind)
    before = sorted(p.name for p in files.iterdir())
    argv = ("matmul", spec, files / "b.npy", "-o", files / "c.npy")
    r, _ = _distmm(request, ranks, *argv)
    assert r.returncode == 2, r.stderr
    line = r.stderr if ranks == 1 else r.stderr.splitlines()[0] + "\n"
    assert f"{spec} cannot be read" in one_line(SimpleNamespace(stderr=line)), r.stderr
    if ranks == 1:
        one_line(r)
    assert sorted(p.name for p in files.iterdir()) == before


@pytest.mark.parametrize("args", [["info", "extra"], ["demo", "--nope"],
                                  ["plan", "10", "10", "10", "junk"]])
def test_an_unknown_argument_is_named_by_its_command(args, capsys):
    from distmm.cli.commands import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"distmm {args[0]}: error: unrecognized arguments: "
                                       f"{args[-1]} (see distmm {args[0]} --help)\n")


def test_after_a_signal_no_ignored_exception_is_printed():
    """A finaliser's or gc callback's error ("Exception ignored in") goes to Python's hook
    as ever, until the command got a signal: then it ends with the signal's line alone."""
    import gc
    import signal

    from distmm.cli.exits import restore_signals, terminate_on_sigterm

    class Broken:
        def __del__(self):
            raise AssertionError("left broken")

    import logging

    records = []
    logger = logging.getLogger("distmm-test-after-a-signal")
    logger.addHandler(logging.Handler())
    logger.handlers[-1].emit = lambda record: records.append(record.getMessage())
    seen = []
    python_hook = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(str(info.exc_value))
    previous = terminate_on_sigterm()
    try:
        logger.warning("before the signal")
        Broken()
        gc.collect()
        assert seen == ["left broken"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the handler runs by here
        Broken()
        gc.collect()
        assert seen == ["left broken"]
        # nor a library's log record about the work the signal stops (distributed's
        # "Couldn't gather 1 keys, rescheduling" came before a SIGTERM's line)
        logger.warning("after the signal")
    finally:
        restore_signals(previous)
        sys.unraisablehook = python_hook
    logger.warning("after restore_signals")
    assert records == ["before the signal", "after restore_signals"]


def test_stdout_whose_reader_went_away_ends_quietly():
    """``distmm plan ... | head -0``: the pipe's reader is gone before the command writes;
    it ends as a tool that SIGPIPE ends (141), without an error line."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "distmm", "plan", "100", "100", "100"],
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_calibrate_to_an_empty_path_is_refused_not_the_default(tmp_path):
    """``distmm calibrate -o ''`` wrote the default calibration file (~/.cache/distmm/...)."""
    home = tmp_path / "home"
    r = run_cli("calibrate", "-o", "", "--quick",
                env={**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")})
    assert r.returncode == 2 and "an empty output path" in one_line(r)
    assert not home.exists()


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_an_h5_operand_with_an_empty_dataspace_holds_no_data(files, ranks, request):
    """An HDF5 dataset with a null dataspace (h5py.Empty) was said to 'hold a scalar'; it
    holds no data at all. Status 2, before any work, one process and 2 ranks."""
    with h5py.File(files / "in.h5", "w") as fh:
        fh.create_dataset("E", data=h5py.Empty("f8"))
    argv = ("matmul", f"{files / 'in.h5'}:E", files / "b.npy", "-o", files / "c.npy")
    r, line = _distmm(request, ranks, *argv)
    assert r.returncode == 2, r.stderr
    assert (f"{files / 'in.h5'}:E holds no data (an empty HDF5 dataspace); matmul needs arrays "
            f"of at least 1 dimension") in line and "scalar" not in line
    assert not (files / "c.npy").exists()


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_truncated_npy_operand_says_how_much_it_holds(files, ranks, request):
    """A .npy file cut short (a copy or a download that stopped) said numpy's memory map's
    words ("mmap length is greater than file size"); it says the file is truncated, with the
    bytes it holds and those its header describes: status 2, nothing written."""
    x = np.random.default_rng().standard_normal((13, 4))
    np.save(files / "t.npy", x)
    data = (files / "t.npy").read_bytes()
    (files / "t.npy").write_bytes(data[:-9])
    r, line = _distmm(request, ranks, "matmul", files / "t.npy", files / "b.npy", "-o",
                      files / "c.npy")
    assert r.returncode == 2, r.stderr
    assert (f"{files / 't.npy'} is truncated: it holds {x.nbytes - 9} of the {x.nbytes} bytes "
            f"of data its header describes (shape (13, 4), dtype float64)") in line, line
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy", "t.npy"]


def test_an_npy_header_numpy_will_not_read_says_so_without_numpys_advice(tmp_path):
    """A .npy file whose header is longer than numpy reads without trusting the file: one
    line that says so, without numpy's advice to code (it said 'adjust `max_header_size` or
    fully trust the `.npy` file using `allow_pickle=True`')."""
    a = np.random.default_rng().standard_normal((5, 4))
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (5, 4), }" + " " * 20000
    with open(tmp_path / "a.npy", "wb") as f:
        raw = header.encode("latin1")
        raw += b" " * (-(12 + len(raw) + 1) % 16) + b"\n"
        f.write(b"\x93NUMPY\x02\x00" + len(raw).to_bytes(4, "little") + raw + a.tobytes())
    np.save(tmp_path / "b.npy", np.ones((4, 3)))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy")
    assert r.returncode == 2, r.stderr
    line = one_line(r)
    assert "a.npy is not a readable .npy file: its header is longer than numpy reads" in line
    assert "allow_pickle" not in line and not (tmp_path / "c.npy").exists()


def _nofile(n: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


@pytest.mark.parametrize("name", ["c.npy", "c.h5:C"])
@pytest.mark.slow
def test_too_many_open_files_is_a_failed_run_naming_the_limit(tmp_path, name):
    """A zarr operand of many chunks under a small open-file limit (``ulimit -n``): the
    read's EMFILE was taken for an unreadable file (status 2, 'Az.zarr cannot be read');
    now one line that names the limit, status 1, and nothing written. How many chunk files
    zarr holds open at once varies with the machine's load (at 12, and once at 10, its reads
    stayed under the limit and the run was right), so the limit comes down from 10 until a
    run meets it; a run that does not is checked for numpy's product."""
    import zarr

    z = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=(400, 300), chunks=(20, 20),
                        dtype="f8")
    z[...] = 1.0
    np.save(tmp_path / "b.npy", np.ones((300, 50)))
    path, _, dset = str(tmp_path / name).partition(":")
    for limit in (10, 9, 8):
        r = run_cli("matmul", tmp_path / "a.zarr", tmp_path / "b.npy", "-o", tmp_path / name,
                    preexec_fn=_nofile(limit), timeout=60)
        if r.returncode != 0:
            break
        if dset:
            import h5py

            with h5py.File(path, "r") as f:
                got = f[dset][...]
        else:
            got = np.load(path)
        assert np.array_equal(got, np.full((400, 50), 300.0))
        os.unlink(path)
    assert r.returncode == 1, r.stderr
    line = one_line(r)
    assert "Too many open files" in line and f"(the open-file limit, ulimit -n, is {limit})" in line
    assert "cannot be read" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "b.npy"]


#: a child's ``distmm matmul`` that prints its peak address space (VmPeak, bytes) as it ends
_PEAK = ("import re, sys\nfrom distmm.cli import main\nstatus = main(sys.argv[1:])\n"
         "print(int(re.search(r'VmPeak:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) << 10)\n"
         "sys.exit(status)\n")


def _address_space(limit: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


#: numpy 1.26's OpenBLAS (0.3.23, the floors') hangs, instead of exiting, in a run whose
#: buffer or thread the address-space limit refuses: such runs end only at the test's timeout
_HANGS_UNDER_LIMITS = pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.0.0",
    reason="numpy 1.x's OpenBLAS 0.3.23 hangs under a tight RLIMIT_AS (seen with the floors)")


@_HANGS_UNDER_LIMITS
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_openblas_out_of_address_space_leaves_no_staged_output(tmp_path):
    """OpenBLAS maps a calling thread's buffer (32 MiB or more) at its first product above its
    small-matrix size, and where the address-space limit (``ulimit -v``) refuses it, it calls
    exit(1) from C: Python's cleanup never ran and the staged output was left ('OpenBLAS
    error: Memory allocation still failed after 10 retries'; the next run removed it). The
    buffer is mapped before the output is staged now. The buffer is the last mapping of this
    small product, so a limit a little under the peak of a run without one meets it: the
    limit comes down in 4 MiB steps until a run does; none leaves anything."""
    from distmm.engine.mpi.resume import blas_facts

    if not blas_facts()["blas"].startswith("OpenBLAS"):
        pytest.skip("numpy's BLAS is not OpenBLAS")
    np.save(tmp_path / "a.npy", np.ones((300, 300)))
    np.save(tmp_path / "b.npy", np.ones((300, 300)))
    argv = ("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy")
    env = {"OPENBLAS_NUM_THREADS": "1"}  # its own threads' buffers at import: one, anywhere
    r = subprocess.run([sys.executable, "-c", _PEAK, *map(str, argv)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1])
    for step in range(1, 9):
        (tmp_path / "c.npy").unlink(missing_ok=True)
        r = run_cli(*argv, env=env, preexec_fn=_address_space(peak - (step << 22)), timeout=120)
        assert sorted(p.name for p in tmp_path.iterdir()) == \
            ["a.npy", "b.npy"] + (["c.npy"] if r.returncode == 0 else []), (step, r.stderr)
        if "OpenBLAS" in r.stderr:
            break
    assert r.returncode == 1 and "OpenBLAS error" in r.stderr, r.stderr


#: a bare interpreter's peak address space (VmPeak, bytes)
_BARE_PEAK = ("import re\nprint(int(re.search(r'VmPeak:\\s+(\\d+) kB', "
              "open('/proc/self/status').read())[1]) << 10)\n")


@pytest.mark.slow
@_HANGS_UNDER_LIMITS
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_an_error_while_the_command_imports_is_one_line_naming_the_limit(tmp_path):
    """Under a tight address-space limit (``ulimit -v``) importing distmm's modules fails
    (numpy's libraries cannot be mapped, Python's objects cannot be made): the command
    printed the import's traceback (MemoryError, ImportError, status 1). It ends with one
    line naming the limit now, status 1, as a run that failed. The limit goes up in 8 MiB
    steps from the peak of a bare interpreter until a run succeeds; on the way OpenBLAS's
    own exit(1) while numpy imports (its buffer) is one line too."""
    np.save(tmp_path / "a.npy", np.ones((8, 8)))
    np.save(tmp_path / "b.npy", np.ones((8, 8)))
    bare = subprocess.run([sys.executable, "-c", _BARE_PEAK], capture_output=True, text=True,
                          timeout=60, check=True)
    start = int(bare.stdout)
    argv = ("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy")
    said = []
    for step in range(1, 41):
        limit = start + (step << 23)
        r = run_cli(*argv, env={"OPENBLAS_NUM_THREADS": "1"}, timeout=60,
                    preexec_fn=_address_space(limit))
        if r.returncode == 0:
            break
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (limit, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        said.append(r.stderr)
    assert r.returncode == 0, r.stderr
    # numpy's libraries refused, then Python's objects: both name the limit in force
    assert any(line.startswith("distmm matmul: error: ImportError: ") and
               "failed to map segment from shared object (the address-space limit, ulimit "
               "-v, is " in line for line in said), said
    assert any(line.startswith("distmm matmul: error: MemoryError (the address-space "
                               "limit, ulimit -v, is ") for line in said), said


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.slow
def test_sigxcpu_at_the_cpu_time_limit_is_handled_as_sigterm(tmp_path):
    """The kernel sends SIGXCPU at a soft CPU-time limit (``prlimit --cpu=SOFT:HARD``): its
    default action killed the command with a core and its staged output left behind; now
    the cleanup runs as for SIGTERM: one line, status 152 (128 + 24), nothing left."""
    import resource
    import time

    rng = np.random.default_rng(1)
    np.save(tmp_path / "a.npy", rng.standard_normal((3000, 2000)))
    np.save(tmp_path / "b.npy", rng.standard_normal((2000, 3000)))
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", tmp_path / "a.npy",
                             tmp_path / "b.npy", "-o", tmp_path / "c.npy", "--tile", "250"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staged = tmp_path / f".c.npy.distmm-partial-{proc.pid}"
    deadline = time.monotonic() + 60
    while not staged.exists():  # the product under way: the limit is reached within it
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    soft = int(_cpu_seconds(proc.pid)) + 1
    resource.prlimit(proc.pid, resource.RLIMIT_CPU, (soft, soft + 60))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 152, (proc.returncode, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "terminated by SIGXCPU (the CPU-time limit, ulimit -t, was reached)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


def _zarr_array(path: Path, fmt: int) -> None:
    import zarr

    zarr.create_array(str(path), shape=(2, 2), dtype="f8", zarr_format=fmt)[:] = 1.0


@pytest.mark.parametrize("fmt, out, ranks", [
    (2, "za.zarr/y", 1), (3, "za.zarr/y", 1), (3, "za.zarr/sub/C.zarr", 1),
    pytest.param(3, "za.zarr/y", 2, marks=[pytest.mark.mpi, pytest.mark.slow])])
@pytest.mark.slow
def test_a_zarr_output_inside_a_zarr_array_is_refused_naming_the_array(files, fmt, out, ranks,
                                                                       request):
    """``-o za.zarr/y`` with za.zarr a zarr array (v2 ``.zarray``, v3 ``zarr.json``), or a
    folder in one: it succeeded (status 0, one process and under mpirun) and wrote an array
    inside the array, which zarr then found through no group (za.zarr no longer opened as a
    group); as ``f.h5:A/x`` through a dataset is, it is refused before any work, one line
    naming the array, nothing written."""
    import zarr

    za = files / "za.zarr"
    _zarr_array(za, fmt)
    if "/sub/" in out:
        (za / "sub").mkdir()
    before = sorted(str(p.relative_to(files)) for p in files.rglob("*"))
    r, line = _distmm(request, ranks, "matmul", files / "a.npy", files / "b.npy", "-o",
                      files / out)
    assert r.returncode == 2, r.stderr
    assert f"cannot write {files / out}: {za} is a zarr array, not a group" in line, r.stderr
    assert sorted(str(p.relative_to(files)) for p in files.rglob("*")) == before
    np.testing.assert_array_equal(zarr.open_array(str(za), mode="r")[:], np.ones((2, 2)))


def _object_input(folder: Path, kind: str) -> tuple[str, str]:
    """An operand (4, 3) of object dtype and what the refusal says it holds."""
    import zarr

    if kind == "zarr-bytes":
        z = zarr.create_array(str(folder / "o.zarr"), shape=(4, 3), zarr_format=2,
                              dtype=zarr.dtype.VariableLengthBytes())
        z[:] = np.full((4, 3), b"x", dtype=object)
        return str(folder / "o.zarr"), "zarr's variable_length_bytes values"
    with h5py.File(folder / "g.h5", "w") as fh:
        if kind == "h5-vlen-str":
            fh.create_dataset("vlen", data=np.full((4, 3), "ab", dtype=object),
                              dtype=h5py.string_dtype())
            return f"{folder / 'g.h5'}:vlen", "variable-length strings"
        fh.create_dataset("ref", shape=(4, 3), dtype=h5py.ref_dtype)
        return f"{folder / 'g.h5'}:ref", "object references"


@pytest.mark.parametrize("kind, ranks", [
    ("h5-vlen-str", 1), ("h5-ref", 1), ("zarr-bytes", 1),
    pytest.param("h5-vlen-str", 2, marks=[pytest.mark.mpi, pytest.mark.slow])])
@pytest.mark.slow
def test_an_object_input_is_named_not_the_output(files, kind, ranks, request):
    """An HDF5 dataset of variable-length strings or object references, or a zarr array of
    variable-length bytes, comes as numpy's object dtype: it passed as an operand and the
    output took the blame ('cannot write c.npy: the result is an object array'). The input
    is named now, with what it holds and its dtype, as a .npy file of objects is."""
    spec, what = _object_input(files, kind)
    before = sorted(p.name for p in files.iterdir())
    r, line = _distmm(request, ranks, "matmul", files / "a.npy", spec, "-o", files / "c.npy")
    assert r.returncode == 2, r.stderr
    assert (f"{spec} holds {what} (dtype object): matmul needs boolean or numeric operands"
            in line), r.stderr
    assert "cannot write" not in r.stderr, r.stderr
    assert sorted(p.name for p in files.iterdir()) == before
