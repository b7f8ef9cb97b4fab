"""``mpirun -n P distmm matmul A B -o C`` runs the MPI engine (real mpiexec, CPU).

Covers: .npy, zarr and HDF5 (same file in and out) inputs and outputs with
the result checked against numpy; bad input (shape mismatch, a missing file, a
non-numeric dtype) ending every rank with status 2 and one message; a failure
during the product (a GPU backend on a machine without one) aborting the job;
nothing under the final name after a failure; a --profile that cannot be created refused
before any work, and one lost after C is in place said as such. Every launch has a timeout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import assert_close, pause_at

pytestmark = pytest.mark.mpi

# prints each rank's exit status and stderr on one line (mpiexec reports only one), in one
# write: print() writes its pieces one by one when unbuffered, and two ranks' pieces interleaved
WRAPPER = ("import os, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'distmm'] + "
           "sys.argv[1:], capture_output=True, text=True); "
           "line = 'STATUS %d %s' % (r.returncode, r.stderr.strip().replace(chr(10), ' | ')); "
           "os.write(1, (line + chr(10)).encode()); "
           "sys.exit(0)")


@pytest.fixture
def launch(mpirun):
    """``launch(ranks, *argv, wrap=False, timeout=120)``: ``distmm *argv`` on every rank;
    with ``wrap``, each rank's exit status and stderr on a line of stdout (``WRAPPER``)."""

    def run(ranks, *argv, wrap=False, timeout=120, env=None):
        return mpirun(ranks, *(["-c", WRAPPER] if wrap else ["-m", "distmm"]), *argv,
                      timeout=timeout, env=env)

    return run


@pytest.fixture
def files(tmp_path):
    import h5py
    import zarr

    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((53, 41)), rng.standard_normal((41, 29))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "s.npy", np.array([["x"] * 29] * 41))
    with h5py.File(tmp_path / "x.h5", "w") as fh:
        fh["A"], fh["B"] = a, b
    for name, x in (("a.zarr", a), ("b.zarr", b)):
        z = zarr.open_array(str(tmp_path / name), mode="w", shape=x.shape, dtype=x.dtype, chunks=(10, 10))
        z[...] = x
    return tmp_path, a @ b


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npy", "zarr"])
def test_mpirun_overwrite_keeps_the_permissions(files, launch, kind):
    """Rank 0 renames the staged output onto the old one and gives it the old one's
    permission bits (``staging.put_in_place``, shared with the one-process command line)."""
    import zarr

    d, ref = files
    c = d / f"c.{kind}"
    r = launch(2, "matmul", d / "a.npy", d / "b.npy", "-o", c)
    assert r.returncode == 0, r.stderr
    mode = 0o750 if kind == "zarr" else 0o640
    c.chmod(mode)
    r = launch(2, "matmul", d / "a.npy", d / "b.npy", "-o", c, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert oct(c.stat().st_mode & 0o7777) == oct(mode)
    got = np.load(c) if kind == "npy" else zarr.open_array(str(c), mode="r")[...]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_mpirun_zarr_output_takes_its_groups_format(files, launch):
    """A zarr format 2 group lists only format 2 arrays: the MPI engine made a format 3
    array there (the one-process command line did not), which the group did not show."""
    import zarr

    d, ref = files
    zarr.open_group(str(d / "g2.zarr"), mode="w", zarr_format=2)
    r = launch(2, "matmul", d / "a.npy", d / "b.npy", "-o", d / "g2.zarr" / "C")
    assert r.returncode == 0, r.stderr
    group = zarr.open_group(str(d / "g2.zarr"), mode="r")
    assert list(group.array_keys()) == ["C"] and group["C"].metadata.zarr_format == 2
    np.testing.assert_allclose(group["C"][...], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_mpirun_matmul_formats(files, launch):
    import h5py
    import zarr

    d, ref = files
    r = launch(3, "matmul", d / "a.npy", d / "b.npy", "-o", d / "c.npy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("wrote") == 1 and "3 ranks" in r.stdout  # rank 0 reports, once
    np.testing.assert_allclose(np.load(d / "c.npy"), ref, rtol=1e-12, atol=1e-12)
    r = launch(2, "matmul", f"{d}/x.h5:A", f"{d}/x.h5:B", "-o", f"{d}/x.h5:C")
    assert r.returncode == 0, r.stderr
    with h5py.File(d / "x.h5") as fh:
        assert sorted(fh) == ["A", "B", "C"]  # nothing staged inside the file
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    r = launch(4, "matmul", d / "a.zarr", d / "b.zarr", "-o", d / "c.zarr")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(zarr.open_array(str(d / "c.zarr"))[...], ref, rtol=1e-12, atol=1e-12)
    assert not [p for p in d.iterdir() if "partial" in p.name]
    # a vector operand: numpy's promotion, computed by the engine and written by rank 0
    v = np.arange(29.0)
    np.save(d / "v.npy", v)
    r = launch(2, "matmul", d / "b.npy", d / "v.npy", "-o", d / "bv.npy")
    assert r.returncode == 0, r.stderr
    assert_close(np.load(d / "bv.npy"), np.load(d / "b.npy") @ v)


@pytest.mark.parametrize("bad", ["shape"] + [  # the rest with the slow ones
    pytest.param(bad, marks=pytest.mark.slow)
    for bad in ("missing", "exists", "vector", "stack", "dtype", "backend")])
def test_mpirun_bad_input_ends_every_rank(files, launch, bad):
    d, _ = files
    np.save(d / "v.npy", np.ones(7))
    np.save(d / "st.npy", np.ones((3, 53, 41)))
    np.save(d / "su.npy", np.ones((2, 41, 29)))
    a = d / ("st.npy" if bad == "stack" else "a.npy")
    b = {"shape": d / "a.npy", "missing": d / "none.npy", "dtype": d / "s.npy",
         "vector": d / "v.npy", "stack": d / "su.npy"}.get(bad, d / "b.npy")
    out = d / ("a.npy" if bad == "exists" else "c.npy")
    env = {"DISTMM_BACKEND": "magic"} if bad == "backend" else None
    r = launch(2, "matmul", a, b, "-o", out, wrap=True, timeout=60, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("STATUS")]
    assert len(lines) == 2, r.stdout + r.stderr
    assert all(ln.startswith("STATUS 2") for ln in lines), lines
    messages = [ln for ln in lines if "error" in ln]
    assert len(messages) == 1 and " | " not in messages[0], lines  # one message, from rank 0
    assert {"shape": "inner dimensions differ", "missing": "no such file", "dtype": "numeric",
            "exists": "--overwrite", "vector": "v.npy has shape (7,) (41 != 7)",
            "stack": "batch dimensions do not broadcast",
            "backend": "distmm.backend = 'magic' is not valid"}[bad] in messages[0]
    assert not (d / "c.npy").exists()
    assert not [p for p in d.iterdir() if "partial" in p.name]


@pytest.mark.slow
def test_mpirun_gpu_backend_without_a_gpu_is_refused(files, launch):
    d, _ = files
    r = launch(2, "matmul", d / "a.npy", d / "b.npy", "-o", d / "c.npy", "--backend", "raw",
               timeout=60)
    if "cupy" in sys.modules or shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a GPU")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("distmm matmul: error: backend 'raw' needs a CUDA GPU") == 1
    assert not (d / "c.npy").exists()


def test_engine_mpi_in_one_process(files, mpi_env):
    d, ref = files
    r = subprocess.run([sys.executable, "-m", "distmm", "matmul", d / "a.npy", d / "b.npy", "-o",
                        d / "c.npy", "--engine", "mpi"], capture_output=True, text=True,
                       timeout=60, env=mpi_env)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(d / "c.npy"), ref, rtol=1e-12, atol=1e-12)


def test_mpirun_h5_output_into_an_existing_file(files, launch):
    """Two ranks write their blocks of C into the hidden staged file; rank 0
    copies C into the user's file: an old C is replaced (--overwrite), X and
    grp/Y stay bitwise in place, and no staged file is left."""
    import h5py

    d, ref = files
    rng = np.random.default_rng()
    f = d / "user.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = rng.standard_normal((30, 20))
        fh["grp/Y"] = rng.integers(0, 99, (7, 3), dtype=np.int16)
        fh["C"] = np.zeros(4)

    def stored():
        raw = f.read_bytes()
        with h5py.File(f, "r") as fh:
            return {k: raw[fh[k].id.get_offset():][:fh[k].id.get_storage_size()] + fh[k][...].tobytes()
                    for k in ("X", "grp/Y")}

    before = stored()
    r = launch(2, "matmul", d / "a.npy", d / "b.npy", "-o", f"{f}:C", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert stored() == before
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["C", "X", "grp"]
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    assert not [p for p in d.iterdir() if "partial" in p.name]


LINES_SCRIPT = r"""
import sys
import time
from mpi4py import MPI
from distmm.cli.exits import whole_line_writes

whole_line_writes()
rank = MPI.COMM_WORLD.rank
MPI.COMM_WORLD.Barrier()
for i in range(3):
    print(f"rank {rank} line {i} " + "x" * 300, file=sys.stderr if i == 1 else sys.stdout)
"""


@pytest.mark.slow
def test_ranks_lines_reach_mpirun_whole(mpirun):
    """Unbuffered, print() writes a line's text and its newline apart and mpirun interleaves
    the ranks' writes (one run in three at 4 ranks ran two lines into one); the command
    line's streams keep each line in one write."""
    for _ in range(5):
        r = mpirun(4, "-c", LINES_SCRIPT, env={"PYTHONUNBUFFERED": "1"}, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "line" in ln]
        assert sorted(lines) == sorted(f"rank {p} line {i} " + "x" * 300
                                       for p in range(4) for i in range(3)), r.stdout + r.stderr


def test_the_command_line_writes_whole_lines(mpi_env):
    probe = ("import sys; from distmm.cli.commands import main; main(['plan', '64', '64', '64']); "
             "print(sys.stdout.line_buffering, sys.stdout.write_through, "
             "sys.stderr.line_buffering, sys.stderr.write_through)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**mpi_env, "PYTHONUNBUFFERED": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "True False True False"


@pytest.mark.parametrize("operands", ["A V", pytest.param("S A", marks=pytest.mark.slow)],
                         ids=["vector", "stack"])
def test_mpirun_vector_or_stack_into_the_operands_own_h5_file(files, launch, operands):
    """Vectors and stacks (``_stacked``): every rank held the operands' file open read-only
    while rank 0 copied C into it, which HDF5's lock refused (exit 1 after the product)."""
    import h5py

    d, _ = files
    f = d / "x.h5"
    with h5py.File(f, "a") as fh:
        fh["V"], fh["S"] = np.arange(41.0), np.ones((3, 29, 53))
        want = {"A V": fh["A"][...] @ fh["V"][...], "S A": fh["S"][...] @ fh["A"][...]}[operands]
    a, b = operands.split()
    r = launch(2, "matmul", f"{f}:{a}", f"{f}:{b}", "-o", f"{f}:C", timeout=60)
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["A", "B", "C", "S", "V"]
        assert_close(fh["C"][...], want)
    assert not [p for p in d.iterdir() if "partial" in p.name]


@pytest.mark.slow
def test_mpirun_c_into_the_operands_own_h5_file_waits_for_every_rank_to_close_it(files,
                                                                                 launch):
    """The batch path: rank 0 opened the operands' own file for writing C as soon as it had
    closed its own handles, while a slower rank still held the file, which HDF5's lock
    refused ('unable to lock file', exit 1 after the product; one run in ~14, every run with
    rank 1 a second late). Every rank closes its inputs before rank 0 commits."""
    import h5py

    d, _ = files
    site = d / "site"
    site.mkdir()
    pause_at(site, "distmm.engine.mpi.batch", "close_sources", seconds=1.0, rank=1)
    f = d / "x.h5"
    with h5py.File(f, "r") as fh:
        want = fh["A"][...] @ fh["B"][...]
    r = launch(2, "matmul", f"{f}:A", f"{f}:B", "-o", f"{f}:C", timeout=60,
               env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        assert sorted(fh) == ["A", "B", "C"]
        assert_close(fh["C"][...], want)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="creates a file under /proc")
@pytest.mark.parametrize("ranks,where", [(1, "proc"), (2, "proc"), (1, "long-name")])
@pytest.mark.slow
def test_a_profile_that_cannot_be_created_is_refused_before_any_work(files, launch, mpi_env,
                                                                     ranks, where):
    """A --profile in a folder where no file can be made (/proc; as root, permissions do not
    stop a write), or whose temporary name is too long for the file system, was found only
    once C was in place (status 2 or 1 after the whole product): it is bad input now, one
    line from rank 0, every rank ending with status 2 and nothing written."""
    d, _ = files
    prof = "/proc/p.json" if where == "proc" else str(d / ("p" * 245 + ".json"))
    argv = ["matmul", d / "a.npy", d / "b.npy", "-o", d / "c.npy", "--profile", prof]
    if ranks == 1:
        r = subprocess.run([sys.executable, "-m", "distmm", *map(str, argv)], text=True,
                           capture_output=True, timeout=60, env=mpi_env)
        lines = [f"STATUS {r.returncode} {r.stderr.strip()}"]
    else:
        r = launch(ranks, *argv, wrap=True, timeout=60)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("STATUS")]
    assert sorted(p.name for p in d.iterdir()) == sorted(  # no C, nothing staged
        ["a.npy", "b.npy", "s.npy", "x.h5", "a.zarr", "b.zarr"]), lines
    assert len(lines) == ranks and all(ln.startswith("STATUS 2") for ln in lines), lines
    said = [ln for ln in lines if "error" in ln]
    assert len(said) == 1 and " | " not in said[0], lines
    why = "No such file or directory" if where == "proc" else "File name too long"
    assert said[0].endswith(f"cannot create the --profile file ({why}): {prof}"), said


def test_a_profile_lost_after_c_is_in_place_says_so(files, mpi_env):
    """A profile that cannot be written once C is in place (its folder gone, a full disk)
    said only the write's error with status 2, the line of bad input, though C was written:
    it says C was written and the profile not, with status 1."""
    d, ref = files
    site, folder = d / "site", d / "profiles"
    site.mkdir()
    folder.mkdir()
    pause_at(site, "distmm.engine.mpi.batch", "run_batch", after=True)
    env = {**mpi_env, "PYTHONPATH": os.pathsep.join([str(site), mpi_env["PYTHONPATH"]])}
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", d / "a.npy", d / "b.npy",
                             "-o", d / "c.npy", "--profile", folder / "p.json"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.time() + 60
        while not (site / "paused").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        assert (d / "c.npy").exists()  # committed before the profile is written
        folder.rmdir()
        (site / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err == (f"distmm matmul: error: wrote {d / 'c.npy'}, but the profile "
                   f"{folder / 'p.json'} could not be written: No such file or directory: "
                   f"{folder / 'p.json'}\n"), err
    assert out == ""
    assert_close(np.load(d / "c.npy"), ref)


#: a rank's ``distmm`` whose address space is limited (RLIMIT_AS) to its size once MPI has
#: started and the command's modules are imported, plus HEADROOM_MIB
_LIMITED = """
import importlib, os, re, resource, sys
from mpi4py import MPI  # its start (shared memory, threads) before the limit
for name in ("dask", "distmm.cli.commands", "distmm.cli.mpi_matmul", "distmm.cli.io",
             "distmm.engine.mpi.batch", "distmm.engine.mpi.stream", "distmm.executor.cpu"):
    importlib.import_module(name)
from distmm.cli import main
size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) << 10
limit = size + (int(os.environ["HEADROOM_MIB"]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_openblas_out_of_address_space_leaves_no_staged_output_under_mpirun(tmp_path,
                                                                             mpirun):
    """OpenBLAS maps its buffer (32 MiB or more) at the first product above its small-matrix
    size and, where the address-space limit refuses it, calls exit(1) from C: the batch
    path's first stripe did that after rank 0 had staged the output, which was left ('OpenBLAS
    error: Memory allocation still failed after 10 retries'; the next run removed it). Every
    CPU rank has it mapped before the ranks agree to start now, and the GEMM thread takes it.
    The headroom above each rank's size once started grows in 8 MiB steps until a run
    succeeds; none before leaves anything (they fail for the memory their threads need)."""
    from distmm.engine.mpi.resume import blas_facts

    if not blas_facts()["blas"].startswith("OpenBLAS"):
        pytest.skip("numpy's BLAS is not OpenBLAS")
    np.save(tmp_path / "a.npy", np.ones((300, 300)))
    np.save(tmp_path / "b.npy", np.ones((300, 300)))
    (tmp_path / "limited.py").write_text(_LIMITED)
    argv = ("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy")
    failed = []
    for headroom in range(0, 129, 8):
        r = mpirun(2, tmp_path / "limited.py", *argv, env={"HEADROOM_MIB": str(headroom)},
                   timeout=60)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"] + \
            (["c.npy"] if r.returncode == 0 else []) + ["limited.py"], (headroom, r.stderr)
        if r.returncode == 0:
            break
        failed.append(headroom)
    assert r.returncode == 0 and failed, r.stderr  # the limit mattered, and was left behind
    assert (np.load(tmp_path / "c.npy") == 300).all()


@pytest.mark.parametrize("output", ["c.npy", pytest.param("c.zarr", marks=pytest.mark.slow),
                                    pytest.param("c.h5:C", marks=pytest.mark.slow)])
def test_a_configured_mpi_engine_runs_the_batch_path_in_one_process(files, mpi_env, output):
    """``DISTMM_ENGINE=mpi distmm matmul`` computed the whole product, then failed with
    status 2 ("copyto() argument 1 must be a numpy.ndarray, not NpyWriter"): the command read
    only --engine, and the configured engine reached distmm.matmul with the staged writer as
    out=. It takes the MPI engine's batch path, as --engine mpi does."""
    import h5py
    import zarr

    d, ref = files
    env = {**mpi_env, "DISTMM_ENGINE": "mpi"}
    env.pop("DASK_DISTMM__ENGINE", None)
    r = subprocess.run([sys.executable, "-m", "distmm", "matmul", d / "a.npy", d / "b.npy", "-o",
                        d / output], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert ", 1 rank, grid 1x1," in r.stdout, r.stdout  # the batch path's summary line
    if output.endswith(".npy"):
        c = np.load(d / output)
    elif output.endswith(".zarr"):
        c = zarr.open_array(str(d / output), mode="r")[...]
    else:
        with h5py.File(d / "c.h5", "r") as fh:
            c = fh["C"][...]
    np.testing.assert_allclose(c, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_plan_ranks_counts_the_direct_writers_buffers_as_the_run_does(tmp_path, mpirun):
    """``distmm plan --ranks P`` planned without the direct writer's aligned buffers, which
    the run counts against distmm.memory-budget for a .npy or HDF5 C: under a 3 MiB budget a
    rank's 1 MiB of C was one stripe in the plan and two in the run."""
    import json
    import re

    from conftest import run_cli

    rng = np.random.default_rng(5)
    np.save(tmp_path / "a.npy", rng.integers(-9, 9, size=(2048, 32)).astype(np.float64))
    np.save(tmp_path / "b.npy", rng.integers(-9, 9, size=(32, 128)).astype(np.float64))
    env = {"DISTMM_BATCH_STRIPES": "1", "DISTMM_MEMORY_BUDGET": "3MiB",
           "DISTMM_DIRECT_WRITES": "true"}
    plan = run_cli("plan", 2048, 128, 32, "--ranks", 2, env=env)
    assert plan.returncode == 0, plan.stderr
    planned = [int(re.search(r" in (\d+) stripe", line)[1])
               for line in plan.stdout.splitlines() if re.match(r"  rank \d", line)]
    r = mpirun(2, "-m", "distmm", "matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
               tmp_path / "c.npy", "--profile", tmp_path / "p.json", env=env)
    assert r.returncode == 0, r.stderr
    ranks = json.loads((tmp_path / "p.json").read_text())["ranks"]
    written = [sum(s["phase"] == "write" for s in rec["spans"]) for rec in ranks]
    assert planned == written == [2, 2], (plan.stdout, written)
