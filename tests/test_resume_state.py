"""What a stopped ``--resume`` run keeps, and who may touch it (real files, real processes).

Covers: HDF5 inputs known by every file that holds their data (an external link's file, a
virtual dataset's sources), so a resume after such a file changed is refused; a kept staged
file shorter than it was made, refused; refusals that name what differs where the spellings
agree (a moved folder) and stripes said as counts; a ``--resume`` run's claim on the staged
output it works on (from its manifest's saving, or its taking over), which another run leaves
alone (a plain one) or refuses in one line (a second ``--resume``), and which a kill releases;
the space of leftovers counted as free by the space check (a resume, or a rerun after a full
disk, needs only what is missing); a damaged manifest named and refused, not removed; a dead
run's files under the new run's PID, or under the PID one of the new job's other ranks has
(PIDs come round again), resumed or cleared; chunk files lost from a kept zarr folder computed
again; a second ``--resume`` run in the gap between a run's staging and its manifest refused;
a dead run's staged output under the PID of a distmm process started after it last changed,
removed; a ``--resume`` run waiting for another one's preparing, saying so, and ended by a signal;
a resume under another memory-budget or batch-stripes, which takes the kept stripes on where they
fit the budget and refuses in one line naming the budget they need where they do not.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distmm.engine.mpi import resume as rs
from distmm.staging import claim, is_live, reclaimable, release, remove_if_left, staged_path
from conftest import pause_at, run_cli, stop_after_logged


def _manifest(a_spec, a, out_spec="c.npy", **extra):
    fields = dict(b=rs.input_facts(a_spec, a), output=out_spec, dtype="float64",
                  backend="blas", ranks=2, grid=(1, 2, 1), stripe_edges=[[0, 2, 3]],
                  panels=[0, 4], pid=0, header=128)
    fields.update(extra)
    return rs.Manifest.make(a=rs.input_facts(a_spec, a), **fields)


def _saved_operands(tmp_path: Path, m: int, k: int, n: int):
    """Fresh random float64 operands ``(m, k)`` and ``(k, n)``, saved as a.npy and b.npy."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return a, b


def _dead_pid() -> int:
    """The PID of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def test_hdf5_inputs_are_known_by_the_files_that_hold_their_data(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng()
    with h5py.File("g.h5", "w") as g:
        g["A"] = rng.standard_normal((5, 4))
    with h5py.File("f.h5", "w") as f:
        f["A"] = h5py.ExternalLink("g.h5", "/A")
        layout = h5py.VirtualLayout(shape=(5, 4), dtype="float64")
        layout[...] = h5py.VirtualSource("g.h5", "A", shape=(5, 4))
        f.create_virtual_dataset("V", layout)

    def facts(spec):
        with h5py.File("f.h5", "r") as f:
            return _manifest(spec, f[spec.split(":")[1]])

    linked, virtual = facts("f.h5:A"), facts("f.h5:V")
    assert [s[0] for s in linked["a"]["sources"]] == [str(tmp_path / "g.h5")]
    assert [s[0] for s in virtual["a"]["sources"]] == [str(tmp_path / "g.h5")]
    assert rs.mismatch(linked, facts("f.h5:A")) is None
    with h5py.File("g.h5", "r+") as g:  # the data doubled in place; f.h5 untouched
        g["A"][...] = 2 * g["A"][...]
    st = os.stat("g.h5")  # and its time moved on (a coarse file-system clock may not tick)
    os.utime("g.h5", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for spec, before in (("f.h5:A", linked), ("f.h5:V", virtual)):
        why = rs.mismatch(before, facts(spec))
        assert why is not None and f"{tmp_path / 'g.h5'}, which holds its data, differs" in why
    # a plain dataset has no other file, and a .npy file none either
    with h5py.File("p.h5", "w") as p:
        p["A"] = np.ones((2, 2))
    with h5py.File("p.h5", "r") as p:
        assert rs.input_facts("p.h5:A", p["A"])["sources"] == []
    np.save("a.npy", np.ones((2, 2)))
    assert rs.input_facts("a.npy", np.load("a.npy"))["sources"] == []


def test_refusals_name_what_differs_where_the_spellings_agree(tmp_path, monkeypatch):
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        np.save(tmp_path / folder / "a.npy", np.ones((3, 4)))
    a = np.ones((3, 4))
    monkeypatch.chdir(tmp_path / "one")
    old = _manifest("a.npy", a)
    monkeypatch.chdir(tmp_path / "two")  # the same command from another folder
    why = rs.mismatch(old, _manifest("a.npy", a))
    assert why == f"input A was {tmp_path / 'one' / 'a.npy'}, now {tmp_path / 'two' / 'a.npy'}"
    why = rs.mismatch(_manifest("a.npy", a, out_spec="c.npy"), _manifest("a.npy", a, out_spec="d.npy"))
    assert why == "the output changed (c.npy then, d.npy now)"
    edges = [[0, *range(100, 1000, 100), 1000]]
    why = rs.mismatch(_manifest("a.npy", a, stripe_edges=edges),
                      _manifest("a.npy", a, stripe_edges=[[0, 500, 1000]]))
    assert why == "the stripes changed (10 then, 2 now)"
    why = rs.mismatch(_manifest("a.npy", a, panels=[0, 2, 4]), _manifest("a.npy", a, panels=[0, 3, 4]))
    assert why == "the k panels of a stripe's sum changed (as many, at other edges)"


def test_a_staged_file_shorter_than_it_was_made_is_refused(tmp_path):
    staged = tmp_path / ".c.npy.distmm-partial-1"
    staged.write_bytes(b"\0" * (128 + 6 * 8))
    made = {"header": 128}
    assert rs.short(staged, made, (2, 3), "float64") is None
    staged.write_bytes(b"\0" * 128)  # the data cut off
    assert rs.short(staged, made, (2, 3), "float64") == (
        "its staged output holds 128 of the 176 bytes it was made with")
    assert rs.short(tmp_path, {"header": None}, (2, 3), "float64") is None  # zarr: not checked


_HOLD = """
import sys
from pathlib import Path
from distmm.staging import claim
fd = claim(Path(sys.argv[1]))
print("held" if fd not in (None, -1) else "not held", flush=True)
sys.stdin.readline()
"""


def _leftover(folder: Path, manifest=True) -> Path:
    """A staged output as a stopped run leaves it: made by a process that has ended."""
    staged = staged_path(folder / "c.npy", _dead_pid())
    staged.write_bytes(b"\0" * 4096)
    if manifest:
        Path(f"{staged}.resume.json").write_text("{}")
        Path(f"{staged}.done-0").write_text("0\n")
    return staged


def test_a_claimed_staged_output_is_left_alone_until_its_claimant_ends(tmp_path):
    staged = _leftover(tmp_path)
    assert not is_live(staged)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(staged)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert is_live(staged)
        assert claim(staged) is None  # a second claimant (a second --resume) gets nothing
        assert not remove_if_left(staged)
        assert reclaimable(tmp_path / "c.npy") == 0
        assert staged.exists() and Path(f"{staged}.resume.json").exists()
    finally:
        holder.kill()  # a kill releases the claim
        holder.wait()
    assert not is_live(staged)
    assert reclaimable(tmp_path / "c.npy") >= 4096
    fd = claim(staged)
    assert fd not in (None, -1)
    release(fd)
    assert remove_if_left(staged)
    assert sorted(os.listdir(tmp_path)) == []
    # one without a manifest can be resumed by no one: nothing to claim, removed as before
    staged = _leftover(tmp_path, manifest=False)
    assert claim(staged) == -1 and remove_if_left(staged) and not staged.exists()



def _past(*paths, ago: float = 60) -> None:
    """Set the modification time of ``paths`` ``ago`` seconds back."""
    when = time.time() - ago
    for path in paths:
        os.utime(path, (when, when))


@pytest.mark.mpi
@pytest.mark.slow
def test_a_dead_runs_staged_output_under_a_later_distmm_processs_pid(tmp_path, mpi_env):
    """PIDs come round again: a killed run's staged output named with the PID of a distmm
    process started after it last changed is a dead run's. A plain run and a ``--resume`` run
    name and remove it (both took it for a live run's and left it beside C for as long as
    that process ran). Changed after that process started (it, or a file kept beside it), it
    may be that process's and stays live; claimed, it stays live whatever its time; a zarr
    folder goes by its own time."""
    a, b = _saved_operands(tmp_path, 30, 20, 10)
    # a process whose command line holds "distmm", as a distmm run's does
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "distmm"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while b"distmm" not in Path(f"/proc/{other.pid}/cmdline").read_bytes():
            assert time.time() < deadline
            time.sleep(0.01)
        staged = staged_path(tmp_path / "c.npy", other.pid)
        kept = [staged, Path(f"{staged}.resume.json"), Path(f"{staged}.done-0")]
        staged.write_bytes(bytes(4096))
        kept[1].write_text("{}")
        kept[2].write_text("0\n")
        _past(*kept)
        removed = (f"distmm matmul: removed {staged.name}, left beside c.npy by a run that was "
                   f"killed\n")
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.npy", cwd=tmp_path, env=mpi_env)
        assert r.returncode == 0, r.stderr
        assert r.stderr == removed
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
        assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]
        staged.write_bytes(bytes(4096))  # no manifest: a --resume run resumes none, removes it
        _past(staged)
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "c.npy", "--overwrite", "--resume",
                    cwd=tmp_path, env=mpi_env)
        assert r.returncode == 0, r.stderr
        assert r.stderr == removed
        assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]

        staged.write_bytes(bytes(4096))
        assert is_live(staged)  # made after the process started: it may be its maker
        kept[1].write_text("{}")
        kept[2].write_text("0\n")
        _past(*kept[:2])
        assert is_live(staged)  # a log beside it written since
        _past(kept[2])
        assert not is_live(staged) and reclaimable(tmp_path / "c.npy") >= 4096
        holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(staged)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert is_live(staged) and not remove_if_left(staged)
        finally:
            holder.kill()
            holder.wait()
        assert remove_if_left(staged)
        folder = staged_path(tmp_path / "c.zarr", other.pid)
        folder.mkdir()
        (folder / "zarr.json").write_text("{}")
        assert is_live(folder)
        _past(folder)
        (folder / "c").mkdir()  # chunks in a subfolder leave the folder's own time
        _past(folder)
        (folder / "c" / "0").write_bytes(bytes(64))
        assert not is_live(folder) and remove_if_left(folder) and not folder.exists()
    finally:
        other.kill()
        other.wait()

def test_removing_a_leftover_leaves_another_targets_files_alone(tmp_path):
    """A dead run's staged output ``.c.npy.distmm-partial-D`` went with every file named
    ``.c.npy.distmm-partial-D.*``: the staged output of the target ``c.npy.distmm-partial-D.npy``
    too, and a user's copy of the manifest; now only its manifest and logs go with it."""
    staged = _leftover(tmp_path)
    dead = staged.name.rsplit("-", 1)[1]
    other = staged_path(tmp_path / f"c.npy.distmm-partial-{dead}.npy", int(dead))
    other.write_bytes(b"\0" * 4096)
    user = tmp_path / f"{staged.name}.resume.json.bak"
    user.write_text("{}")
    assert remove_if_left(staged)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, user.name])


def test_the_space_of_leftovers_counts_as_free(tmp_path):
    """A rerun after a full disk, or a resume, needs room for what is missing only: the
    staged outputs it resumes or removes first count as free (real files, real free space)."""
    import shutil

    from distmm.cli.io import check_space, parse_target
    from distmm.errors import InsufficientSpace

    size = 64 << 20
    staged = _leftover(tmp_path)
    with open(staged, "wb") as fh:  # written, so its blocks are allocated
        for _ in range(size >> 20):
            fh.write(os.urandom(1 << 20))
        fh.flush()
        os.fsync(fh.fileno())
    target = parse_target(str(tmp_path / "c.npy"))
    assert reclaimable(target.path) >= size
    # more than is free now, less than is free once the leftover goes
    nbytes = shutil.disk_usage(tmp_path).free + size // 2
    check_space(target, nbytes)
    # the same leftover of a run still going (this process's PID) does not count
    live = staged_path(tmp_path / "c.npy", os.getpid())
    for path in tmp_path.iterdir():
        path.rename(str(path).replace(staged.name, live.name))
    assert reclaimable(target.path) == 0
    with pytest.raises(InsufficientSpace, match="needs"):
        check_space(target, nbytes)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_run_beside_a_resumed_one_leaves_its_staged_output_alone(tmp_path, mpi_env):
    """A stopped ``--resume`` run, resumed; while it runs, a plain run to the same target
    finishes on its own (neither removing nor taking the resumed run's staged output), a second
    ``--resume`` run refuses in one line (status 2; it computed all of C again beside it and
    raced it to the commit), and the resumed run finishes with numpy's product."""
    a, b = _saved_operands(tmp_path, 600, 700, 500)
    line = [sys.executable, "-m", "distmm", "matmul", str(tmp_path / "a.npy"),
            str(tmp_path / "b.npy"), "-o", str(tmp_path / "c.npy"), "--backend", "numba"]
    env = {**mpi_env, "NUMBA_NUM_THREADS": "1", "DISTMM_BATCH_STRIPES": "24"}

    def logged():
        return sum(len(p.read_text().split()) for p in tmp_path.glob(".c.npy.*.done-*"))

    def started(argv, until, pause):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": pause})
        deadline = time.time() + 120
        while not until():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        return proc

    # --overwrite: the resumed run commits after the other two wrote C (without it, a C
    # written while a run computes is kept and that run fails)
    first = started([*line, "--resume", "--overwrite"], lambda: logged() >= 3, "0.1")
    first.terminate()
    assert first.wait(60) == 143
    [staged] = [p for p in tmp_path.glob(".c.npy.distmm-partial-*")
                if re.fullmatch(r".*-partial-\d+", p.name)]
    done = logged()
    # the resumed run's stripes pause long enough (21 x 0.6 s) for both other runs to end
    resumed = started([*line, "--resume", "--overwrite"],
                      lambda: is_live(staged) and logged() > done, "0.6")
    r = subprocess.run([*line, "--overwrite"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert "removed" not in r.stderr, r.stderr
    assert staged.exists()
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    names = sorted(os.listdir(tmp_path))
    r = subprocess.run([*line, "--overwrite", "--resume"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"cannot resume {tmp_path / 'c.npy'}: another run works on {staged.name}" in r.stderr
    assert sorted(os.listdir(tmp_path)) == names
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]


@pytest.mark.slow  # ~2-3.5 s: the fast run keeps under 5 minutes on 2 cores
@pytest.mark.mpi
def test_a_second_resume_run_beside_a_running_one_refuses(tmp_path, mpi_env):
    """Two ``--resume`` runs to one target at once: the second refuses in one line (status 2),
    touching nothing, and the first finishes with numpy's product. The second computed all of
    C again beside the first and won the race to the commit; the first then failed (status 1)
    after all its work, its stripes left beside C."""
    a, b = _saved_operands(tmp_path, 300, 400, 200)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--resume"]
    env = {**mpi_env, "DISTMM_BATCH_STRIPES": "8"}
    first = subprocess.Popen(line, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": "0.1"})
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(".c.npy.distmm-partial-*.resume.json")):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.005)
        first.send_signal(signal.SIGSTOP)  # held while the second runs, however long it takes
        [manifest] = tmp_path.glob(".c.npy.distmm-partial-*.resume.json")
        staged = manifest.name[:-len(".resume.json")]
        names = sorted(os.listdir(tmp_path))
        r = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=env)
        first.send_signal(signal.SIGCONT)
        assert r.returncode == 2, r.stderr
        assert r.stderr == (f"distmm matmul: error: cannot resume c.npy: another run works on "
                            f"{staged}; run this command again once that run has ended\n")
        assert sorted(os.listdir(tmp_path)) == names
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]


#: ``python -c _AS_RANK_1 STATE_GLOB -- ARGV`` on every rank of a job: rank 1 gives the files
#: matching STATE_GLOB its own PID (``-``: makes an empty staged output of ARGV's ``-o`` under
#: it, as a killed run leaves one), then every rank becomes ``distmm ARGV`` (``exec`` keeps the
#: PID): a job one of whose ranks has the PID of the run that left them, as PIDs come round
#: again (rank 0 looks only after every rank has started MPI, so after the renaming)
_AS_RANK_1 = r"""
import glob, os, re, sys
state, argv = sys.argv[1], sys.argv[3:]
if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    for p in (glob.glob(state) if state != "-" else []):
        os.rename(p, re.sub(r"partial-\d+", f"partial-{os.getpid()}", p))
    if state == "-":
        folder, name = os.path.split(argv[argv.index("-o") + 1])
        with open(os.path.join(folder, f".{name}.distmm-partial-{os.getpid()}"), "wb") as fh:
            fh.write(bytes(4096))
os.execv(sys.executable, [sys.executable, "-m", "distmm", *argv])
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_a_leftover_under_a_pid_of_this_jobs_ranks_is_a_dead_runs(tmp_path, mpiexec, mpi_env):
    """A killed run's staged output named with the PID that rank 1 of the next job has: that
    job names and removes it (rank 0 took it for a live run's, as the PID runs distmm, and
    left it beside C for good)."""
    a, b = _saved_operands(tmp_path, 200, 300, 100)
    r = subprocess.run([mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-c", _AS_RANK_1,
                        "-", "--", "matmul", "a.npy", "b.npy", "-o", "c.npy"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**mpi_env, "OMPI_MCA_btl": "^ofi"})
    assert r.returncode == 0, r.stderr
    assert "distmm matmul: removed .c.npy.distmm-partial-" in r.stderr, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_stopped_run_under_a_pid_of_this_jobs_ranks_is_resumed(tmp_path, mpiexec, mpi_env):
    """A stopped ``--resume`` run's state named with the PID that rank 1 of the resuming job
    has: the job resumes it (rank 0 took it for a live run's, computed all of C again and
    left the stopped run's files beside C)."""
    a, b = _saved_operands(tmp_path, 600, 700, 500)
    import psutil

    argv = ["matmul", "a.npy", "b.npy", "-o", "c.npy", "--resume"]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "24"}
    proc = subprocess.Popen([mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-m",
                             "distmm", *argv], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": "0.1"})
    deadline = time.time() + 120
    while sum(len(p.read_text().split()) for p in tmp_path.glob(".c.npy.*.done-*")) < 12:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    for rank in psutil.Process(proc.pid).children(recursive=True):
        if "distmm" in " ".join(rank.cmdline()):
            rank.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "C stripes kept in" in err, err
    r = subprocess.run([mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-c", _AS_RANK_1,
                        str(tmp_path / ".c.npy.distmm-partial-*"), "--", *argv,
                        "--profile", "p.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    # the missing stripes written, not all of C again
    ranks = json.loads((tmp_path / "p.json").read_text())["ranks"]
    assert sum(rec["bytes"].get("write", 0) for rec in ranks) < 600 * 500 * 8
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy", "p.json"]


def test_a_damaged_manifest_is_named_not_taken_for_none(tmp_path):
    """A manifest that does not parse, or lacks a field the run needs, raises naming it (it
    was taken for none: a truncated one was removed as a killed run's with all its stripes,
    one without its header failed with 'error: header'); no manifest, or one of another
    format, is still None."""
    staged = tmp_path / ".c.npy.distmm-partial-1"
    np.save(tmp_path / "a.npy", np.ones((2, 2)))
    good = _manifest(str(tmp_path / "a.npy"), np.ones((2, 2)))
    assert rs.Manifest.load(staged) is None
    good.save(staged)
    assert rs.Manifest.load(staged) == good
    text = rs.manifest_path(staged).read_text()
    for damaged, named in ((text[:len(text) // 2], "damaged ("), ("[1, 2]", "'format'"),
                           ("null", "'format'"),
                           (json.dumps({k: v for k, v in good.items() if k != "header"}),
                            "'header'"),
                           (json.dumps({**good, "a": None}), "'a'")):
        rs.manifest_path(staged).write_text(damaged)
        with pytest.raises(ValueError,
                           match=re.escape(f"{staged.name}.resume.json is damaged")) as e:
            rs.Manifest.load(staged)
        assert named in str(e.value)
    rs.manifest_path(staged).write_text(json.dumps({**good, "format": "distmm-resume-0"}))
    assert rs.Manifest.load(staged) is None


@pytest.mark.mpi
@pytest.mark.slow
def test_a_resume_from_a_damaged_manifest_is_refused_in_one_line(tmp_path, mpi_env):
    """``--resume`` beside a stopped run whose manifest is damaged: status 2, one line naming
    the manifest, and the stopped run's files as they were (not removed as a killed run's)."""
    a = np.random.default_rng().standard_normal((30, 30))
    np.save(tmp_path / "a.npy", a)
    staged = _leftover(tmp_path)
    rs.manifest_path(staged).write_text('{"format": "distmm-resume-1", "a": {')
    before = sorted(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-m", "distmm", "matmul", str(tmp_path / "a.npy"),
                        str(tmp_path / "a.npy"), "-o", str(tmp_path / "c.npy"), "--resume"],
                       capture_output=True, text=True, timeout=120, env=mpi_env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"{staged.name}.resume.json is damaged" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before


#: ``python -c _AS_PID STATE_GLOB [LOGS] -- ARGV``: gives a dead run's resume files (those
#: matching STATE_GLOB, ``-`` for none) this process's PID, or writes logs of stripes 0..LOGS-1
#: under it, then becomes ``distmm ARGV`` (``exec`` keeps the PID): a run whose first rank's
#: PID is a dead run's, as in containers, where every job's first process has the same
_AS_PID = r"""
import glob, os, re, sys
state, logs, argv = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
for p in (glob.glob(state) if state != "-" else []):
    os.rename(p, re.sub(r"partial-\d+", f"partial-{os.getpid()}", p))
if logs:
    out = argv[argv.index("-o") + 1]
    folder, name = os.path.split(out)
    with open(os.path.join(folder, f".{name}.distmm-partial-{os.getpid()}.done-0"), "w") as fh:
        fh.write("".join(f"{s}\n" for s in range(logs)))
os.execv(sys.executable, [sys.executable, "-m", "distmm", *argv])
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_a_dead_runs_files_under_this_runs_pid(tmp_path, mpi_env):
    """PIDs come round again: a ``--resume`` run whose PID is that of a dead stopped run
    resumes that run's staged output (it failed with 'File exists' and removed it), and a
    dead run's logs under its PID whose staged output is gone are not appended to (a later
    resume skipped the stripes they listed, which this run never wrote: a wrong C, status 0)."""
    a, b = _saved_operands(tmp_path, 600, 1500, 500)
    argv = ["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
            str(tmp_path / "c.npy"), "--backend", "numba", "--resume"]
    env = {**mpi_env, "NUMBA_NUM_THREADS": "1", "DISTMM_BATCH_STRIPES": "24"}

    def stopped(line, until):
        """``line`` run with 24 stripes of at least 0.1 s each, SIGTERM once ``until()``."""
        proc = subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": "0.1"})
        deadline = time.time() + 120
        while not until():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.terminate()
        assert proc.wait(60) == 143, proc.communicate()

    def staged():
        return [p for p in tmp_path.glob(".c.npy.distmm-partial-*")
                if re.fullmatch(r".*-partial-\d+", p.name)]

    def logged():
        return sum(len(p.read_text().split()) for p in tmp_path.glob(".c.npy.*.done-*"))

    def finished(line):
        r = subprocess.run(line, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.npy"]
        (tmp_path / "c.npy").unlink()

    # a stopped run's files, taken up by a run of the same PID
    stopped([sys.executable, "-m", "distmm", *argv], lambda: logged() >= 3)
    finished([sys.executable, "-c", _AS_PID, str(tmp_path / ".c.npy.distmm-partial-*"), "0",
              "--", *argv])
    # logs of every stripe under this run's PID, their staged output gone: stopped, resumed
    stopped([sys.executable, "-c", _AS_PID, "-", "24", "--", *argv], lambda: bool(staged()))
    finished([sys.executable, "-m", "distmm", *argv])


def _kept_beside(staged: Path) -> list[str]:
    """The names of the files a run keeps beside ``staged`` (its manifest, logs)."""
    return sorted(p.name for p in staged.parent.iterdir()
                  if p.name.startswith(f"{staged.name}.") and re.fullmatch(
                      r"\.resume\.json|\.(?:done|sums)-\d+", p.name[len(staged.name):]))


@pytest.mark.mpi
@pytest.mark.slow
def test_the_files_of_a_deleted_staged_output_are_removed_by_a_later_run(tmp_path, mpiexec,
                                                                        mpi_env):
    """A ``--resume`` run stopped by SIGTERM (2 ranks, then 1), its hidden staged output then
    deleted by hand: its manifest and logs stayed for ever (``leftovers`` looked for staged
    outputs only); now the next run removes them, a plain one and a ``--resume`` one under
    mpiexec alike. Such files of a live distmm process, or of a dead one's whose claim a
    process holds, stay until that process ends, as do another target's whose name starts
    the same way and a user's file beside them."""
    import psutil

    a, b = _saved_operands(tmp_path, 600, 700, 500)
    target = tmp_path / "c.npy"
    line = [sys.executable, "-m", "distmm", "matmul", str(tmp_path / "a.npy"),
            str(tmp_path / "b.npy"), "-o", str(target)]
    under_mpi = [mpiexec, "-n", "2", "--oversubscribe"]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "24"}

    def stopped(argv) -> list[str]:
        """``argv`` (a ``--resume`` run) stopped by SIGTERM to its ranks once a stripe is
        logged, then its staged output deleted; the names of the files kept beside it."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**env, "DISTMM_BATCH_STRIPE_PAUSE": "0.1"})
        deadline = time.time() + 120
        while not any(p.stat().st_size for p in tmp_path.glob(".c.npy.*.done-*")
                      if p.name not in stay):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "distmm" in " ".join(p.cmdline())] or [proc]
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        [staged] = [p for p in tmp_path.glob(".c.npy.distmm-partial-*")
                    if re.fullmatch(r".c.npy.distmm-partial-\d+", p.name)]
        kept = _kept_beside(staged)
        assert f"{staged.name}.resume.json" in kept and f"{staged.name}.done-0" in kept, kept
        assert f"{staged.name}.sums-0" in kept, kept  # removed with them
        staged.unlink()  # by hand
        return kept

    def finished(argv) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        np.testing.assert_allclose(np.load(target), a @ b, rtol=1e-12, atol=1e-12)
        target.unlink()
        return r.stderr

    # files that must stay: a live distmm process's (the claimant's own PID), a dead run's
    # that the claimant holds, another target's (c.npy.distmm-partial-D.npy) and a user's
    claimed = staged_path(target, _dead_pid())
    rs.manifest_path(claimed).write_text("{}")
    rs.done_log_path(claimed, 0).write_text("0\n")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(claimed)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        live = staged_path(target, holder.pid)
        rs.manifest_path(live).write_text("{}")
        rs.done_log_path(live, 0).write_text("0\n")
        dead = _dead_pid()
        other = staged_path(tmp_path / f"c.npy.distmm-partial-{dead}.npy", dead)
        rs.manifest_path(other).write_text("{}")
        user = tmp_path / f".c.npy.distmm-partial-{dead}.resume.json.bak"
        user.write_text("{}")
        stay = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".c.npy."))
        assert len(stay) == 6

        for stop, run in (([*under_mpi, *line, "--resume"], line),
                          ([*line, "--resume"], [*under_mpi, *line, "--resume"])):
            kept = stopped(stop)
            finished(run)
            names = sorted(p.name for p in tmp_path.iterdir())
            assert not set(kept) & set(names), names
            assert names == sorted(["a.npy", "b.npy", *stay]), names
    finally:
        holder.kill()  # its claim and its process gone: its files and the claimed run's go
        holder.wait()
    finished(line)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a.npy", "b.npy", rs.manifest_path(other).name, user.name])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_chunk_files_lost_from_a_kept_zarr_folder_are_computed_again(tmp_path, mpiexec,
                                                                    mpi_env, ranks):
    """A stopped ``--resume`` run to a zarr array, chunk files of stripes its logs call done
    then deleted from its kept folder (a cleaner, a ``find -delete``): the resumed run computes
    those stripes again and C is numpy's product (it committed zeros, zarr's fill value, where
    the chunks were, with status 0)."""
    a, b = _saved_operands(tmp_path, 600, 700, 500)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.zarr",
            "--resume"]
    if ranks > 1:
        line = [mpiexec, "-n", str(ranks), "--oversubscribe", *line]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "24"}
    stop_after_logged(line, tmp_path, env, 8, ".c.zarr.*.done-*")
    [staged] = [p for p in tmp_path.glob(".c.zarr.distmm-partial-*") if p.is_dir()]
    chunks = sorted(p for p in staged.rglob("*") if p.is_file() and "zarr" not in p.name)
    assert len(chunks) >= 2, chunks
    for chunk in (chunks[0], chunks[-1]):
        chunk.unlink()
    r = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    import zarr

    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[...], a @ b,
                               rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.zarr"]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_second_resume_run_between_staging_and_manifest_refuses(tmp_path, mpi_env):
    """A ``--resume`` run paused after making its staged output, before its manifest is saved
    and claimed; a second ``--resume`` run started then waits for it and refuses in one line
    (status 2), and the first finishes with numpy's product; the second says why it waits, in
    one line (it said nothing). The second took the staged
    output, which had no manifest, for a live run's, computed C beside it and committed it;
    the first then failed (status 1) after all its work."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((300, 400)), rng.standard_normal((400, 200))
    work, site = tmp_path / "work", tmp_path / "site"
    work.mkdir()
    site.mkdir()
    np.save(work / "a.npy", a)
    np.save(work / "b.npy", b)
    pause_at(site, "distmm.engine.mpi.batch", "create_staged", after=True)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--resume"]
    env = {**mpi_env, "DISTMM_BATCH_STRIPES": "8"}
    first = subprocess.Popen(line, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, "PYTHONPATH": os.pathsep.join(
                                 [str(site), env["PYTHONPATH"]])})
    second = None
    try:
        deadline = time.time() + 120
        while not (site / "paused").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.01)
        assert not list(work.glob(".c.npy.distmm-partial-*.resume.json"))  # in the gap
        [staged] = [p.name for p in work.glob(".c.npy.distmm-partial-*")]
        with open(tmp_path / "second.err", "w+") as log:
            second = subprocess.Popen(line, cwd=work, stdout=subprocess.DEVNULL, stderr=log,
                                      text=True, env=env)
            waiting = f"distmm: waiting for another --resume run preparing in {work}\n"
            while log.seek(0) == 0 and log.read() != waiting:  # it waits for the first (it
                assert second.poll() is None and time.time() < deadline  # ran beside it)
                time.sleep(0.01)
            (site / "go").touch()
            second.wait(120)
            log.seek(0)
            err = log.read()
        assert second.returncode == 2, err
        assert err == (f"{waiting}distmm matmul: error: cannot resume c.npy: another run works "
                       f"on {staged}; run this command again once that run has ended\n")
        out, err = first.communicate(timeout=120)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert first.returncode == 0, err
    np.testing.assert_allclose(np.load(work / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(work)) == ["a.npy", "b.npy", "c.npy"]


#: ``python -c _HOLD_FOLDER FOLDER``: holds FOLDER's lock, as a ``--resume`` run preparing there
#: (``distmm.staging.preparing``) does, until a line comes on stdin
_HOLD_FOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "released", "SIGTERM, mpiexec -n 2"])
@pytest.mark.slow
def test_a_resume_run_waiting_for_another_ones_preparing(tmp_path, mpiexec, mpi_env, how):
    """A ``--resume`` run while another prepares in the same folder (holds its lock) says so in
    one line and waits (it said nothing); SIGTERM or SIGINT to it (under mpiexec, to its
    ranks) ends it at once with 143 / 130 and one line more, leaving nothing (it waited on,
    the signal recorded, until the other run was done); once the lock is free it runs to its
    end. Under mpiexec only rank 0, which prepares, says it waits."""
    import psutil

    work = tmp_path / "work"
    work.mkdir()
    a, b = _saved_operands(work, 30, 20, 10)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--resume"]
    if "mpiexec" in how:
        line = [mpiexec, "-n", "2", "--oversubscribe", *line]
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_FOLDER, str(work)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    run = None
    try:
        assert holder.stdout.readline().strip() == "held"
        waiting = f"distmm: waiting for another --resume run preparing in {work}\n"
        with open(tmp_path / "err", "w+") as log:
            run = subprocess.Popen(line, cwd=work, stdout=subprocess.DEVNULL, stderr=log,
                                   env={**mpi_env, "OMPI_MCA_btl": "^ofi"})
            deadline = time.time() + 120
            while log.seek(0) == 0 and log.read() != waiting:
                assert run.poll() is None and time.time() < deadline
                time.sleep(0.01)
            time.sleep(0.2)  # waiting still
            assert run.poll() is None
            if how == "released":
                holder.communicate("\n", timeout=60)
            else:
                ranks = [p for p in psutil.Process(run.pid).children(recursive=True)
                         if "distmm" in " ".join(p.cmdline())] or [psutil.Process(run.pid)]
                for rank in ranks:
                    rank.send_signal(getattr(signal, how.split(",")[0]))
            run.wait(30 if how == "released" else 10)
            log.seek(0)
            err = log.read()
    finally:
        for proc in (holder, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    if how == "released":
        assert run.returncode == 0, err
        assert err == waiting
        np.testing.assert_allclose(np.load(work / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
        assert sorted(os.listdir(work)) == ["a.npy", "b.npy", "c.npy"]
        return
    status, said = {"SIGTERM": (143, "terminated by SIGTERM"),
                    "SIGINT": (130, "interrupted (SIGINT)")}[how.split(",")[0]]
    assert run.returncode == status, err
    assert err.startswith(f"{waiting}distmm matmul: error: {said}\n"), err
    if "mpiexec" not in how:  # (Open MPI's mpirun adds its note of a rank's non-zero exit)
        assert err.count("\n") == 2, err
    assert sorted(os.listdir(work)) == ["a.npy", "b.npy"]


def test_a_gpu_kernel_chosen_otherwise_since_the_stop_is_refused(tmp_path, monkeypatch):
    """A GPU rank's facts keep what selects distmm's own kernels (``GPUExecutor.kernel_facts``:
    the kernel and parameters, the shape classes ``auto`` runs them for), which ``distmm tune``
    between the stop and the resume changes; the refusal names the rank and both configurations."""
    monkeypatch.chdir(tmp_path)
    np.save("a.npy", np.ones((3, 4)))
    a = np.ones((3, 4))
    gpu = {"gpu": "NVIDIA H100 80GB HBM3", "cc": "90", "cublas": 120804}
    raw = {"kernel": "dmma", "params": {"BM": 128, "BN": 256, "BK": 32, "STAGES": 2}}
    retuned = {"kernel": "dmma", "params": dict(raw["params"], BK=16)}

    def kept(*ranks):  # through the manifest's file, as a resume reads it
        _manifest("a.npy", a, backend="raw", blas=list(ranks)).save(tmp_path / "s")
        return rs.Manifest.load(tmp_path / "s")

    before = kept(dict(gpu, raw=raw), dict(gpu, raw=raw))
    assert rs.mismatch(before, _manifest("a.npy", a, backend="raw",
                                         blas=[dict(gpu, raw=raw), dict(gpu, raw=raw)])) is None
    why = rs.mismatch(before, _manifest("a.npy", a, backend="raw",
                                        blas=[dict(gpu, raw=raw), dict(gpu, raw=retuned)]))
    assert why == ("rank 1's GPU kernel changed (dmma (BM=128, BN=256, BK=32, STAGES=2) then, "
                   "dmma (BM=128, BN=256, BK=16, STAGES=2) now), which changes the order of its "
                   "sums (`distmm tune` rewrote the tuning cache, or this node's differs)")
    # backend auto: cuBLAS everywhere then; a cache written since sends the large products to
    # distmm's kernel
    auto = dict(gpu, prefer={"large": "raw", "small": "cublas"}, raw=raw)
    why = rs.mismatch(kept(gpu), _manifest("a.npy", a, backend="raw", blas=[auto]))
    assert why.startswith("the GPU kernel changed (none then, dmma (BM=128, "), why
    why = rs.mismatch(kept(auto), _manifest("a.npy", a, backend="raw",
                                            blas=[dict(auto, prefer={"large": "raw"})]))
    assert why.startswith("the GPU kernel's shape classes changed (large=raw, small=cublas then, "
                          "large=raw now)"), why


def _stopped_budget_run(tmp_path: Path, mpiexec, mpi_env, stripes: int, **env):
    """Integer-valued operands (C exact) of 2048 x 128 x 128, a ``--resume`` run of two ranks
    under ``env`` stopped once two stripes are logged, and ``(a, b, line, staged, done)``:
    the command, the kept staged output and each rank's logged stripes (``stripes`` each)."""
    rng = np.random.default_rng(5)
    a = rng.integers(-50, 50, size=(2048, 128)).astype(np.float64)
    b = rng.integers(-50, 50, size=(128, 128)).astype(np.float64)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    line = [mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-m", "distmm", "matmul",
            "a.npy", "b.npy", "-o", "c.npy", "--resume"]
    stop_after_logged(line, tmp_path, {**mpi_env, "OMPI_MCA_btl": "^ofi", **env}, 2)
    [staged] = [p for p in tmp_path.glob(".c.npy.distmm-partial-*")
                if re.fullmatch(r".*-partial-\d+", p.name)]
    assert json.loads(rs.manifest_path(staged).read_text())["stripe_edges"] == [
        list(range(0, 1025, 1024 // stripes)), list(range(1024, 2049, 1024 // stripes))]
    return a, b, line, staged, [rs.read_done(staged, rank) for rank in (0, 1)]


def _resumed_kept_stripes(tmp_path: Path, r, a, b, stripes: int, done) -> None:
    """The resume ``r`` (with ``--profile p.json``) wrote only the stripes missing of the
    kept ``stripes`` a rank, and C is numpy's, bit for bit."""
    assert r.returncode == 0, r.stderr
    ranks = json.loads((tmp_path / "p.json").read_text())["ranks"]
    assert [sum(s["phase"] == "write" for s in rec["spans"]) for rec in ranks] == [
        stripes - len(d) for d in done]
    assert np.load(tmp_path / "c.npy").tobytes() == (a @ b).tobytes()
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy", "p.json"]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_resume_under_another_budget_takes_the_kept_stripes_where_they_fit(tmp_path, mpiexec,
                                                                             mpi_env):
    """A run stopped under a memory-budget of 1.5 MiB (four stripes of 256 rows a rank,
    1.12 MiB held), resumed under another budget: one the kept stripes do not fit (1 MiB) is
    refused in one line naming the budget they need, its state kept; under none (which plans
    two stripes a rank) the run takes the kept stripes on, computes only the missing ones, and
    C is numpy's, bit for bit. Both were refused before, as 'the stripes changed'."""
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "2"}
    a, b, line, staged, done = _stopped_budget_run(tmp_path, mpiexec, mpi_env, 4,
                                                   DISTMM_BATCH_STRIPES="2",
                                                   DISTMM_MEMORY_BUDGET="1.5MiB")
    kept = sorted(os.listdir(tmp_path))
    r = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**env, "DISTMM_MEMORY_BUDGET": "1MiB"})
    assert r.returncode == 2, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("distmm")] == [
        f"distmm matmul: error: cannot resume c.npy from {staged.name}: its kept stripes (of "
        f"up to 256 rows, on 2 x 1 ranks) hold 1.12 MiB on rank 0, more than the "
        f"distmm.memory-budget of 1.00 MiB: resume with a budget of at least 1.13 MiB, or run "
        f"without --resume to start over (that removes it)"], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == kept
    r = subprocess.run([*line, "--profile", "p.json"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=env)
    _resumed_kept_stripes(tmp_path, r, a, b, 4, done)  # stripes of 256 rows, not 1024


@pytest.mark.mpi
@pytest.mark.slow
def test_a_resume_whose_own_plan_the_budget_refuses_takes_kept_stripes_that_fit(
        tmp_path, mpiexec, mpi_env):
    """A run stopped with 16 stripes of 64 rows a rank (384 KiB held), resumed with 2 asked
    for and a budget of 512 KiB, below what its own plan's narrowest stripes hold (256 rows,
    1.12 MiB): the kept stripes fit, and are taken on (the budget's refusal before)."""
    a, b, line, staged, done = _stopped_budget_run(tmp_path, mpiexec, mpi_env, 16,
                                                   DISTMM_BATCH_STRIPES="16")
    r = subprocess.run([*line, "--profile", "p.json"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300,
                       env={**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "2",
                            "DISTMM_MEMORY_BUDGET": "512KiB"})
    _resumed_kept_stripes(tmp_path, r, a, b, 16, done)


def test_an_integer_products_cpu_backend_is_compared_by_its_bits(tmp_path):
    """An integer product's CPU backends give C the same bits (wrapping sums, in any order):
    a stopped run's resolved backend (``numba``, or ``auto``: numpy's loop, then the kernels)
    and another now are no change; a floating product's, or a GPU's, still are."""
    np.save(tmp_path / "a.npy", np.ones((3, 4)))
    a = np.load(tmp_path / "a.npy")
    spec = str(tmp_path / "a.npy")
    for dtype in ("int64", "int32", "uint8", "bool"):
        for was, now in (("numba", "auto"), ("auto", "numba"), ("blas", "auto"),
                         ("numba", "blas")):
            assert rs.mismatch(_manifest(spec, a, dtype=dtype, backend=was),
                               _manifest(spec, a, dtype=dtype, backend=now)) is None
    for dtype, was, now in (("float64", "numba", "blas"), ("float32", "auto", "numba"),
                            ("complex128", "numba", "blas"), ("int64", "raw", "auto"),
                            ("int64", "numba", "cublas")):
        why = rs.mismatch(_manifest(spec, a, dtype=dtype, backend=was),
                          _manifest(spec, a, dtype=dtype, backend=now))
        assert why == f"the backend changed ({was} then, {now} now)", why
    # another result dtype is said as such, whatever the backends
    why = rs.mismatch(_manifest(spec, a, dtype="int64", backend="numba"),
                      _manifest(spec, a, dtype="int32", backend="auto"))
    assert why == "the result dtype changed (int64 then, int32 now)", why


@pytest.mark.mpi
@pytest.mark.slow  # ~6 s (one rank), ~8 s (two)
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_integer_run_stopped_under_numba_resumes_under_auto(tmp_path, mpiexec, mpi_env,
                                                              ranks):
    """A small int64 product (``auto`` resolves to numpy's loop, then the kernels), stopped
    under ``--backend numba`` and resumed without it: refused before ('the backend changed
    (numba then, auto now)'); now it computes the missing stripes and C is numpy's, bit for
    bit. The same float64 run resumed so is refused (BLAS sums in another order)."""
    rng = np.random.default_rng()
    a = rng.integers(-2**40, 2**40, size=(301, 67))
    b = rng.integers(-2**40, 2**40, size=(67, 53))  # products wrap: every bit counts
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--resume"]
    if ranks > 1:
        line = [mpiexec, "-n", str(ranks), "--oversubscribe", *line]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "6"}
    stop_after_logged([*line, "--backend", "numba"], tmp_path, env, 2 * ranks)
    [manifest] = tmp_path.glob(".c.npy.distmm-partial-*.resume.json")
    assert json.loads(manifest.read_text())["backend"] == "numba"
    r = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "c.npy").tobytes() == (a @ b).tobytes()
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]
    if ranks > 1:
        return
    np.save(tmp_path / "a.npy", a.astype(np.float64))
    np.save(tmp_path / "b.npy", b.astype(np.float64))
    stop_after_logged([*line, "--backend", "numba", "--overwrite"], tmp_path, env, 2)
    [staged] = [p for p in tmp_path.glob(".c.npy.distmm-partial-*")
                if re.fullmatch(r".*-partial-\d+", p.name)]
    r = subprocess.run([*line, "--overwrite"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"distmm matmul: error: cannot resume c.npy from {staged.name}: the backend changed "
        f"(numba then, blas now); run without --resume to start over (that removes it)"]


_COUNT_PLANS = """
import sys
import distmm.plan_batch as pb
plan = pb.plan_batch
def counted(*args, **kwargs):  # each plan of a stopped run's grid, one line
    if kwargs.get("grid") is not None:
        with open(sys.argv[1], "a") as fh:
            fh.write(f"{kwargs['grid']} {kwargs.get('budget')}\\n")
    return plan(*args, **kwargs)
pb.plan_batch = counted
from distmm.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.mpi
@pytest.mark.slow  # ~3 s
def test_a_resume_plans_the_kept_stripes_once(tmp_path, mpi_env):
    """A resume whose kept stripes are another plan's (batch-stripes changed) plans them once
    (three times before: to compare them, and twice more to check them against the budget),
    and one refused for another backend, whose kept stripes are this run's own, not at all
    (once before)."""
    a, b = _saved_operands(tmp_path, 301, 67, 53)
    line = ["matmul", "a.npy", "b.npy", "-o", "c.npy", "--resume"]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "8"}
    stop_after_logged([sys.executable, "-m", "distmm", *line, "--backend", "numba"], tmp_path,
                      env, 2)
    counts = tmp_path.parent / f"{tmp_path.name}-plans"

    def resumed(*extra, **more):
        counts.write_text("")
        r = subprocess.run([sys.executable, "-c", _COUNT_PLANS, str(counts), *line, *extra],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**env, **more})
        return r, counts.read_text().splitlines()

    r, plans = resumed()
    assert r.returncode == 2 and "the backend changed (numba then, blas now)" in r.stderr, \
        r.stderr
    assert plans == []
    r, plans = resumed("--backend", "numba", DISTMM_BATCH_STRIPES="4")
    assert r.returncode == 0, r.stderr
    assert plans == ["(1, 1) None"]
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]


@pytest.mark.mpi
@pytest.mark.slow  # ~7 s: numba's kernels load
def test_the_configured_backend_is_the_batch_runs(tmp_path, mpi_env):
    """``distmm.backend`` (``DISTMM_BACKEND``) decides the batch product's backend, as it
    does ``distmm.matmul``'s: it was ignored (a run under ``DISTMM_BACKEND=numba`` kept a
    manifest of ``blas``, and ``DISTMM_BACKEND=raw`` ran on the CPU where there is no GPU)."""
    from conftest import gpu_available

    a, b = _saved_operands(tmp_path, 301, 67, 53)
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", "c.npy",
            "--resume"]
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": "8",
           "DISTMM_BACKEND": "numba"}
    stop_after_logged(line, tmp_path, env, 2)
    [manifest] = tmp_path.glob(".c.npy.distmm-partial-*.resume.json")
    assert json.loads(manifest.read_text())["backend"] == "numba"
    r = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    if gpu_available():
        return
    r = subprocess.run([*line, "--overwrite"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**env, "DISTMM_BACKEND": "raw"})
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "distmm matmul: error: distmm.backend raw (DISTMM_BACKEND) needs a CUDA GPU and cupy "
        "on every rank; this rank has none (use --backend numba or blas)"], r.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]
