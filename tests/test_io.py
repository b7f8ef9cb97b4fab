"""distmm.cli.io on real files: the pwrite .npy writer and staged output, on disk (its
rename, a zarr folder's metadata, a dataset copied into an HDF5 file flushed) once a run ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import distmm
from distmm.cli.io import NpyWriter, parse_target, staged_output
from conftest import run_cli


def test_npy_writer_tiles_and_read_back(tmp_path):
    rng = np.random.default_rng()
    c = rng.standard_normal((37, 23)).astype(np.float32)
    w = NpyWriter(tmp_path / "c.npy", c.shape, c.dtype)
    assert (w.ndim, w.shape, w.dtype) == (2, (37, 23), np.float32)
    for r0 in range(0, 37, 10):
        for c0 in range(0, 23, 7):
            w[r0:r0 + 10, c0:c0 + 7] = c[r0:r0 + 10, c0:c0 + 7]
    np.testing.assert_array_equal(w[5:9, 3:20], c[5:9, 3:20])
    w.finish()
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), c)


def test_matmul_writes_tiles_into_the_writer(tmp_path):
    rng = np.random.default_rng()
    a, b = rng.standard_normal((131, 77)), rng.standard_normal((77, 59))
    w = NpyWriter(tmp_path / "c.npy", (131, 59), np.float64)
    assert distmm.matmul(a, b, out=w, engine="local", tile=32) is w  # written in place, tile by tile
    w.finish()
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
def test_whole_array_writes(tmp_path, shape):
    x = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    with staged_output(str(tmp_path / "x.npy"), shape, x.dtype) as out:
        out[...] = x
    got = np.load(tmp_path / "x.npy")
    assert got.shape == shape and got.dtype == x.dtype
    np.testing.assert_array_equal(got, x)


def test_file_size_limit_mid_write_is_an_oserror(tmp_path):
    """Set after the file is staged, the limit hits a tile write: OSError, not SIGBUS."""
    code = textwrap.dedent(f"""
        import errno, resource, numpy as np
        from distmm.cli.io import NpyWriter
        w = NpyWriter({str(tmp_path / 'c.npy')!r}, (1000, 1000), np.float64)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        try:
            for r in range(0, 1000, 100):
                w[r:r + 100, :] = 1.0
        except OSError as exc:
            print("OSError", exc.errno == errno.EFBIG)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OSError True"


def test_parse_target():
    assert parse_target("x.h5:grp/C").dataset == "grp/C"
    assert parse_target("x.h5").dataset == "data"
    assert parse_target("g.zarr/C").kind == "zarr"
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        parse_target("c.txt")
    for bad in ("x.h5:grp/../C", "x.h5:./C", "x.h5:C/.."):
        with pytest.raises(ValueError, match="are not dataset names"):
            parse_target(bad)


# ---------------------------------------------------------------- distmm.staging: HDF5


@pytest.mark.parametrize("dtype, shape", [("f8", (37, 23)), ("c16", (5, 9)), ("?", (7, 3)),
                                          (">f4", (11, 4)), ("i2", (6,)), ("f8", ())])
def test_h5_stage_written_with_pwrite_reads_back_in_h5py(tmp_path, dtype, shape):
    import h5py

    from distmm.staging import BlockWriter, create_h5_stage

    rng = np.random.default_rng()
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    if x.dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    staged = tmp_path / ".c.h5.distmm-partial-1"
    w = BlockWriter(staged, shape, x.dtype, create_h5_stage(staged, "g/C", shape, x.dtype))
    if x.ndim == 2:
        for r0 in range(0, shape[0], 4):
            for c0 in range(0, shape[1], 3):
                w[r0:r0 + 4, c0:c0 + 3] = x[r0:r0 + 4, c0:c0 + 3]
    else:
        w[...] = x
    w.finish()
    with h5py.File(staged, "r") as fh:
        assert list(fh) == ["g"] and list(fh["g"]) == ["C"]
        assert fh["g/C"].dtype == x.dtype and fh["g/C"].shape == shape
        assert fh["g/C"][...].tobytes() == x.tobytes()


def _staged_h5(path, x, dataset="C"):
    from distmm.staging import BlockWriter, create_h5_stage

    w = BlockWriter(path, x.shape, x.dtype, create_h5_stage(path, dataset, x.shape, x.dtype))
    w[...] = x
    w.finish()


def test_commit_h5_refuses_before_touching_the_file(tmp_path):
    """Under a real file-size limit too small for the copy, and for an existing
    dataset without overwrite: the user's file stays byte-identical and the
    staged file is gone."""
    import hashlib

    import h5py

    rng = np.random.default_rng()
    f = tmp_path / "user.h5"
    with h5py.File(f, "w") as fh:
        fh["X"] = rng.standard_normal((300, 200))
        fh["C"] = np.zeros(3)
    before = hashlib.sha256(f.read_bytes()).hexdigest()
    staged = tmp_path / ".user.h5.distmm-partial-7"
    _staged_h5(staged, rng.standard_normal((200, 300)))
    code = textwrap.dedent(f"""
        import resource
        from distmm.staging import commit_h5
        limit = {f.stat().st_size + 100_000}
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            commit_h5({str(staged)!r}, {str(f)!r}, "C", overwrite=True)
        except OSError as exc:
            print(type(exc).__name__, exc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("InsufficientSpace") and "file-size limit" in r.stdout
    assert hashlib.sha256(f.read_bytes()).hexdigest() == before
    assert not staged.exists()

    from distmm.errors import OutputExists
    from distmm.staging import commit_h5

    _staged_h5(staged, rng.standard_normal((4, 4)))
    with pytest.raises(OutputExists, match="user.h5:C exists"):
        commit_h5(staged, f, "C", overwrite=False)
    _staged_h5(staged, rng.standard_normal((4, 4)), dataset="X/Z")
    with pytest.raises(OSError, match="copying .X/Z. into"):  # X is no group: nothing stays
        commit_h5(staged, f, "X/Z", overwrite=True)
    assert hashlib.sha256(f.read_bytes()).hexdigest() == before
    assert not staged.exists()


def test_a_new_zarr_array_takes_its_nearest_groups_format(tmp_path):
    """The group listing the array decides its format, however deep the group lies and
    whatever its folder is called; outside any group zarr's default (None) holds."""
    zarr = pytest.importorskip("zarr")
    from distmm.stripe_writer import zarr_format_for

    (tmp_path / "plain.zarr").mkdir()  # a folder named like a store, but no group
    zarr.open_group(str(tmp_path / "plain.zarr" / "sub"), mode="w", zarr_format=2)
    zarr.open_group(str(tmp_path / "g3"), mode="w", zarr_format=3)
    assert zarr_format_for(tmp_path / "plain.zarr" / "sub" / "C") == 2
    assert zarr_format_for(tmp_path / "plain.zarr" / "sub" / "new" / "C") == 2
    assert zarr_format_for(tmp_path / "g3" / "C") == 3
    assert zarr_format_for(tmp_path / "plain.zarr" / "C") is None
    assert zarr_format_for(tmp_path / "c.zarr") is None
    with staged_output(str(tmp_path / "plain.zarr" / "sub" / "C"), (2, 3), "f8") as out:
        out[...] = 1.0
    group = zarr.open_group(str(tmp_path / "plain.zarr" / "sub"), mode="r")
    assert list(group.array_keys()) == ["C"] and group["C"].metadata.zarr_format == 2


def _npy_header_only(path, descr, version):
    """A .npy file of ``version`` whose header says ``descr`` (no valid data after it)."""
    d = {"descr": descr, "fortran_order": False, "shape": (2, 2)}
    with open(path, "wb") as f:
        f.write(np.lib.format.magic(*version))
        text = repr(d).encode("latin1")
        text += b" " * (-(len(text) + 1 + 6 + 2 + (2 if version == (1, 0) else 4)) % 64) + b"\n"
        f.write(len(text).to_bytes(2 if version == (1, 0) else 4, "little") + text)
        f.write(b"\x80\x04junk")


def test_npy_operands_np_load_would_not_open_as_one_array_are_named(tmp_path):
    """A .npz archive under a .npy name (np.load gives a lazy dictionary: the command failed
    with 'AttributeError: NpzFile ...', status 1), a file without numpy's magic (np.load takes
    it for a pickle and advised allow_pickle), and pickled object arrays of every format
    version: each a ValueError or TypeError naming the file, before anything is read."""
    from distmm.cli.io import open_operand

    z = tmp_path / "z.npy"
    with open(z, "wb") as f:
        np.savez(f, first=np.ones(3), second=np.zeros(2))
    with pytest.raises(ValueError, match=r"z\.npy is a \.npz archive \(arrays: first, second\)"):
        open_operand(str(z))
    text = tmp_path / "t.npy"
    text.write_text("1 2\n3 4\n" * 20)
    with pytest.raises(ValueError, match=r"t\.npy is not a \.npy file: .*magic"):
        open_operand(str(text))
    for version in ((1, 0), (2, 0), (3, 0)):
        o = tmp_path / f"o{version[0]}.npy"
        _npy_header_only(o, "|O", version)
        with pytest.raises(TypeError, match=rf"o{version[0]}\.npy holds Python objects"):
            open_operand(str(o))
        f = tmp_path / f"f{version[0]}.npy"
        x = np.asfortranarray(np.arange(6.0).reshape(2, 3).astype(">f8"))
        with open(f, "wb") as fh:  # numeric arrays of every version still open
            np.lib.format.write_array(fh, x, version=version)
        np.testing.assert_array_equal(open_operand(str(f)), x)


def test_h5_links_that_do_not_resolve_are_named_as_links(tmp_path):
    """A soft or external link whose target is missing was reported as 'no dataset NAME',
    listing the file's datasets; it now says what the link points to."""
    h5py = pytest.importorskip("h5py")
    from distmm.cli.io import open_operand

    f = tmp_path / "f.h5"
    with h5py.File(tmp_path / "other.h5", "w") as fh:
        fh["X"] = np.ones((2, 2))
    with h5py.File(f, "w") as fh:
        fh["A"] = np.ones((2, 2))
        fh["soft"] = h5py.SoftLink("/gone")
        fh["ext"] = h5py.ExternalLink("missing.h5", "/X")
        fh["ext_obj"] = h5py.ExternalLink("other.h5", "/gone")
        fh["ext_ok"] = h5py.ExternalLink("other.h5", "/X")
    with pytest.raises(FileNotFoundError, match=r"'soft' in .*f\.h5 is a link to /gone, which"):
        open_operand(f"{f}:soft")
    with pytest.raises(FileNotFoundError, match=r"'ext' in .*f\.h5 is a link to missing\.h5:/X"):
        open_operand(f"{f}:ext")
    with pytest.raises(FileNotFoundError, match=r"is a link to other\.h5:/gone, which does not"):
        open_operand(f"{f}:ext_obj")
    with pytest.raises(FileNotFoundError, match=r"no dataset 'nope' in .*\(datasets: A\)"):
        open_operand(f"{f}:nope")
    np.testing.assert_array_equal(open_operand(f"{f}:ext_ok")[...], np.ones((2, 2)))


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_replaced_zarr_array_keeps_its_format(tmp_path, fmt):
    """--overwrite of a zarr v2 array wrote a v3 array in its place (zarr's default), which
    readers of the v2 store (zarr-python 2, other v2 readers) cannot open."""
    zarr = pytest.importorskip("zarr")
    from distmm.stripe_writer import zarr_format_for

    c = tmp_path / "c.zarr"
    zarr.open_array(str(c), mode="w", shape=(3, 3), chunks=(2, 2), dtype="f8",
                    zarr_format=fmt)[...] = 1.0
    assert zarr_format_for(c) == fmt
    with staged_output(str(c), (2, 3), "f8", overwrite=True) as out:
        out[...] = 2.0
    z = zarr.open_array(str(c), mode="r")
    assert z.metadata.zarr_format == fmt and z.shape == (2, 3) and (z[...] == 2.0).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr"]


def _held_elsewhere(path, mode):
    """A forked process holding the HDF5 file ``path`` open in ``mode`` (HDF5's file lock)
    until the returned pipe is closed; returns (pid, the pipe's write end)."""
    import h5py

    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: open, say so, wait for the parent to close its end
        try:
            os.close(ready_r)
            os.close(hold_w)
            fh = h5py.File(path, mode)
            os.write(ready_w, b"1")
            os.read(hold_r, 1)
            fh.close()
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    return pid, hold_w


def test_an_h5_file_another_process_holds_is_refused_before_any_work(tmp_path):
    """Another process reading f.h5 (HDF5 locks it) made 'a.npy b.npy -o f.h5:C' fail after
    the whole product, when copying C into the file; now the free-space check, before any
    work, refuses it naming the file. An operand of the same file, open in this very process,
    does not count; a file held for writing is named as such when read."""
    h5py = pytest.importorskip("h5py")
    from distmm.cli.io import check_space, open_operand

    f = tmp_path / "f.h5"
    with h5py.File(f, "w") as fh:
        fh["A"] = np.ones((3, 2))
    before = f.read_bytes()
    pid, hold = _held_elsewhere(f, "r")
    try:
        with pytest.raises(ValueError, match=r"cannot add 'C' to .*f\.h5: the file is open in "
                                             r"another process"):
            check_space(parse_target(f"{f}:C"), 48)
        with pytest.raises(ValueError, match=r"f\.h5 is open in another process"):
            open_operand(f"{f}:A", writable=True)  # -o f.h5:C from f.h5:A
    finally:
        os.close(hold)
        os.waitpid(pid, 0)
    a = open_operand(f"{f}:A", writable=True)  # this process's own hold
    check_space(parse_target(f"{f}:C"), 48)
    a.file.close()
    pid, hold = _held_elsewhere(f, "r+")
    try:
        with pytest.raises(ValueError, match=r"f\.h5 is open in another process"):
            open_operand(f"{f}:A")
    finally:
        os.close(hold)
        os.waitpid(pid, 0)
    assert f.read_bytes() == before


@pytest.mark.slow
def test_sigterm_while_c_is_copied_into_an_existing_h5_file_stops_the_copy(tmp_path):
    """``-o f.h5:C`` into a file holding another dataset, SIGTERM once the copy of C (2 GiB)
    into it has begun: the copy, one ``H5Ocopy`` call, ran to its end (seconds) before the
    signal was acted on, and the whole copy was then removed; now the run stops within a few
    blocks, and f.h5 holds what it held, in as many bytes, with nothing left beside it."""
    import signal
    import time

    h5py = pytest.importorskip("h5py")
    n = 16000  # an outer product: C of 2 GiB for almost no computing
    np.save(tmp_path / "a.npy", np.ones((n, 1)))
    np.save(tmp_path / "b.npy", np.ones((1, n)))
    f = tmp_path / "f.h5"
    with h5py.File(f, "w") as fh:
        fh["other"] = np.arange(10.0)
    start = f.stat().st_size
    proc = subprocess.Popen([sys.executable, "-m", "distmm", "matmul", str(tmp_path / "a.npy"),
                             str(tmp_path / "b.npy"), "-o", f"{f}:C", "--engine", "local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while f.stat().st_size < start + (64 << 20):  # the copy into f.h5 has begun
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    signalled, largest = time.perf_counter(), 0
    while proc.poll() is None:
        largest = max(largest, f.stat().st_size)
        time.sleep(0.002)
    stopped = time.perf_counter() - signalled
    out, err = proc.communicate()
    assert proc.returncode == 143, err
    assert err == "distmm matmul: error: terminated by SIGTERM\n"
    assert largest < n * n * 8 // 2, f"the copy went on to {largest} bytes after the signal"
    assert stopped < 2.0, f"stopped {stopped:.2f} s after SIGTERM"
    with h5py.File(f, "r") as fh:  # (HDF5 rewrites the root group's metadata: not its bytes)
        assert list(fh) == ["other"] and fh["other"][...].tolist() == list(range(10))
    assert f.stat().st_size == start  # the copy's space given back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "f.h5"]


def _h5_with_links(folder):
    """f.h5 with a dataset 'X' and 'ext', an external link to the group /G of other.h5."""
    import h5py

    with h5py.File(folder / "other.h5", "w") as fh:
        fh.create_group("G")
    with h5py.File(folder / "f.h5", "w") as fh:
        fh["X"] = np.arange(7.0)
        fh["ext"] = h5py.ExternalLink("other.h5", "/G")
    return folder / "f.h5", folder / "other.h5"


def test_write_atomic_refuses_an_h5_path_into_another_file(tmp_path):
    """write_atomic to f.h5:ext/C, ext an external link to a group of other.h5: C went into
    other.h5; now a ValueError naming the link and that file, both files as they were."""
    f, other = _h5_with_links(tmp_path)
    before = f.read_bytes(), other.read_bytes()
    with pytest.raises(ValueError, match=rf"'ext' in {f} is an external link to '/G' in "
                                         rf"{other}, another file"):
        from distmm.cli.io import write_atomic

        write_atomic(f"{f}:ext/C", np.ones((3, 2)))
    assert (f.read_bytes(), other.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.h5", "other.h5"]


@pytest.mark.mpi
@pytest.mark.slow
def test_to_file_refuses_an_h5_path_through_a_dataset_or_into_another_file(tmp_path, mpirun):
    """DistArray.to_file (2 ranks) to f.h5:X/C, X a dataset: every block was written and the
    copy into f.h5 failed at the end (OSError); to f.h5:ext/C, ext an external link to a
    group of other.h5: C went into other.h5. Now a ValueError on every rank before anything
    is written, naming X or the link and its file, as the command line's; both files as they
    were, nothing left beside them."""
    f, other = _h5_with_links(tmp_path)
    before = f.read_bytes(), other.read_bytes()
    script = tmp_path / "to_file.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from mpi4py import MPI
        from distmm import DistArray

        c = DistArray.from_array(np.ones((6, 4)), MPI.COMM_WORLD)
        lines = []  # printed by rank 0 alone: mpiexec may interleave the ranks' writes
        for dataset in ("X/C", "ext/C"):
            try:
                c.to_file({str(f)!r} + ":" + dataset, overwrite=True)
                lines.append(f"wrote {{dataset}}")
            except Exception as exc:
                lines.append(f"rank {{MPI.COMM_WORLD.rank}} {{type(exc).__name__}}: {{exc}}")
        for mine in MPI.COMM_WORLD.gather(lines) or []:
            print("\\n".join(mine), flush=True)
    """))
    r = mpirun(2, script)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and "wrote" not in r.stdout, r.stdout
    for rank in (0, 1):
        assert (f"rank {rank} ValueError: cannot write {f}:X/C: 'X' in {f} is a dataset, not a "
                f"group") in r.stdout, r.stdout
        assert (f"rank {rank} ValueError: cannot write {f}:ext/C: 'ext' in {f} is an external "
                f"link to '/G' in {other}, another file") in r.stdout, r.stdout
    assert (f.read_bytes(), other.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.h5", "other.h5", "to_file.py"]


#: a child's ``sitecustomize``: every ``os.fsync`` appended to the file LOG as a JSON line
#: ``[path, names]``, ``names`` a folder's entries at that moment (empty for a file)
_FSYNC_LOG = """
import json, os

LOG, _fsync = {log!r}, os.fsync


def fsync(fd):
    path = os.readlink(f"/proc/self/fd/{{fd if isinstance(fd, int) else fd.fileno()}}")
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    with open(LOG, "a") as fh:
        fh.write(json.dumps([path, names]) + "\\n")
    return _fsync(fd)


os.fsync = fsync
"""


@pytest.mark.parametrize("out", ["c.npy", "c.zarr", "c.h5:C", "f.h5:C"])
@pytest.mark.slow
def test_an_output_and_its_name_are_on_disk_when_the_run_ends(tmp_path, out):
    """After ``distmm matmul`` says it is done, a crash of the host (a power loss keeps no page
    cache) keeps C: the rename that puts it in place is flushed (``fsync`` of the folder, seen
    holding C's name and no staged one), and so are a zarr folder's metadata file and entries
    before its rename, and C's dataset copied into an existing HDF5 file (f.h5). Every
    ``fsync`` of the run is logged by a ``sitecustomize`` in the child."""
    if out.endswith(":C"):
        h5py = pytest.importorskip("h5py")
        if out.startswith("f.h5"):
            with h5py.File(tmp_path / "f.h5", "w") as fh:
                fh["X"] = np.ones(3)
    elif out == "c.zarr":
        pytest.importorskip("zarr")
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    site, log = tmp_path / "site", tmp_path / "fsyncs.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FSYNC_LOG.format(log=str(log)))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / out,
                env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    synced = [tuple(x) for x in map(json.loads, log.read_text().splitlines())]
    name = out.split(":")[0]
    folder = [names for p, names in synced if p == str(tmp_path)]
    if out == "f.h5:C":  # C copied into it: the file itself (its name was there before)
        assert (str(tmp_path / "f.h5"), []) in synced, synced
        with h5py.File(tmp_path / "f.h5", "r") as fh:
            np.testing.assert_allclose(fh["C"][()], a @ b, rtol=1e-12)
        return
    assert any(name in names and not any(".distmm-partial" in n for n in names)
               for names in folder), synced
    if out == "c.zarr":
        staged = [p for p, _ in synced if f".{name}.distmm-partial-" in p]
        assert any(p.endswith(("/zarr.json", "/.zarray")) for p in staged), synced
        assert any(p.rsplit("/", 1)[1].startswith(f".{name}.distmm-partial-")
                   for p in staged), synced


def test_check_target_refuses_a_zarr_target_inside_a_zarr_array(tmp_path):
    """``check_target`` (the command line's and ``DistArray.to_file``'s) refuses a zarr target
    in a zarr array's folder, v2 or v3, directly, deeper, or through a link to a folder in
    it, naming the array as given; one in a group or a plain folder is written."""
    zarr = pytest.importorskip("zarr")
    from distmm.staging import check_target

    for fmt in (2, 3):
        zarr.create_array(str(tmp_path / f"a{fmt}.zarr"), shape=(2,), dtype="f8", zarr_format=fmt)
        zarr.open_group(str(tmp_path / f"g{fmt}.zarr"), mode="w", zarr_format=fmt)
        (tmp_path / f"a{fmt}.zarr" / "sub").mkdir()
        (tmp_path / f"link{fmt}").symlink_to(tmp_path / f"a{fmt}.zarr" / "sub")
        for out in (f"a{fmt}.zarr/y", f"a{fmt}.zarr/sub/C.zarr", f"link{fmt}/C.zarr"):
            with pytest.raises(ValueError, match=rf"cannot write {tmp_path / out}: "
                                                 rf".*a{fmt}\.zarr is a zarr array, not a group"):
                check_target(parse_target(str(tmp_path / out)), True)
        for out in (f"g{fmt}.zarr/y", f"a{fmt}.zarr", f"plain{fmt}.zarr"):
            assert check_target(parse_target(str(tmp_path / out)), True) is (out == f"a{fmt}.zarr")


def _tree(path):
    """Every file under ``path`` by its name there, with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("inside, flag, fixed", [("c/0/0", "i", "immutable"),
                                                 ("c/0", "a", "append-only")])
@pytest.mark.slow
def test_a_zarr_target_holding_what_cannot_be_removed_is_refused_before_any_work(
        tmp_path, chattr, inside, flag, fixed):
    """--overwrite of a zarr array with an immutable chunk file (or an append-only chunk
    folder) in it: the new array took its place, the old one's removal failed and
    ``.c.zarr.distmm-old-PID`` was left beside it. Now refused before any work, in one line
    naming the target and what in it is fixed; the target as it was, nothing beside it."""
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng()
    np.save(tmp_path / "a.npy", rng.random((7, 5)))
    np.save(tmp_path / "b.npy", rng.random((5, 9)))
    c = tmp_path / "c.zarr"
    zarr.open_array(str(c), mode="w", shape=(3, 3), chunks=(3, 3), dtype="f8",
                    zarr_format=3)[...] = rng.random((3, 3))
    before = _tree(c)
    chattr(c / inside, flag)
    r = run_cli("matmul", tmp_path / "a.npy", tmp_path / "b.npy", "-o", c, "--engine", "local",
                "--overwrite")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (f"cannot replace {c}: {c / inside} in it is {fixed} (chattr), which keeps every "
            f"process, root's too, from removing it") in r.stderr
    assert _tree(c) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.zarr"]


def test_put_in_place_keeps_a_zarr_target_it_could_not_remove(tmp_path, chattr):
    """A chunk file made immutable while the run computed (after ``check_target``): the old
    folder was moved aside, the new one renamed in, and the old one left half removed as
    ``.c.zarr.distmm-old-PID``. Now ``put_in_place`` refuses before moving it
    (PermissionError), the target as it was, the staged folder left to its caller."""
    zarr = pytest.importorskip("zarr")
    from distmm.staging import put_in_place, staged_path

    c, staged = tmp_path / "c.zarr", staged_path(tmp_path / "c.zarr")
    x = np.random.default_rng().random((5, 3))
    zarr.save_array(str(c), x)
    zarr.save_array(str(staged), x[:2])
    before = _tree(c)
    chattr(next(p for p in c.rglob("*") if p.is_file() and p.name != "zarr.json"), "i")
    with pytest.raises(PermissionError, match=rf"cannot replace {c}: .* is immutable"):
        put_in_place(staged, c)
    assert _tree(c) == before and staged.is_dir()
    assert not [p for p in tmp_path.iterdir() if "distmm-old" in p.name]


def test_a_zarr_target_that_is_a_link_is_replaced_as_a_npy_files_link_is(tmp_path):
    """--overwrite of a zarr target that is a symbolic link to a zarr folder: the new array
    took the link's place and the link was left as ``.c.zarr.distmm-old-PID`` (``rmtree``
    refuses a link). Now the link is removed, as a ``.npy`` target's link is replaced; the
    folder it named is untouched, nothing is left beside the target."""
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng()
    real, c = tmp_path / "real.zarr", tmp_path / "c.zarr"
    zarr.save_array(str(real), rng.random((3, 4)))
    before = _tree(real)
    c.symlink_to(real)
    x = rng.random((5, 7))
    with staged_output(str(c), x.shape, x.dtype, overwrite=True) as out:
        out[...] = x
    assert not c.is_symlink() and (zarr.open_array(str(c), mode="r")[...] == x).all()
    assert _tree(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr", "real.zarr"]
