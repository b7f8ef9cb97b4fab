"""A ``--resume`` run reads back the stripes it keeps (real files, real processes).

Covers: each logged stripe's checksum (``STAGED.sums-RANK``: the CRC-32 of its bytes as C's
dtype, taken from the stripe in memory as it was written); a kept stripe whose bytes changed
on disk since it was logged (a flipped byte in a ``.npy`` or HDF5 staged file or in a zarr chunk
file, a truncated zarr chunk file) found when read back, computed again and said in one
warning line naming its rows and the staged output, so that C is bitwise equal to an
uninterrupted run's (it committed the changed bytes, with status 0); a zarr chunk file that no
longer decodes removed, so that a stripe written into part of it can be; logs of a run from
before checksums (no sums, a manifest without ``checksums``) trusted as before, and a logged
stripe without a checksum under a manifest that has them computed again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from distmm.engine.mpi import resume as rs
from distmm.engine.mpi.io import StripeWriter, create_staged, parse_spec, staged_path
from conftest import stop_after_logged

SPECS = {"npy": "c.npy", "zarr": "c.zarr", "h5": "c.h5:C"}


def _staged(tmp_path: Path, fmt: str, stripes: int = 4, rows: int = 4, n: int = 6,
            chunks=True) -> tuple[Path, list, list]:
    """A staged output of ``stripes`` stripes of ``rows`` rows of C (float64, ``n`` columns),
    written through a ``DoneLog``'s summing writer and logged, with its manifest, as a
    ``--resume`` run leaves it; its path, the stripes' regions and blocks. ``chunks``: a zarr
    folder's chunks are the stripes (else zarr's own, compressed, shared by the stripes)."""
    spec, pid, shape = str(tmp_path / SPECS[fmt]), os.getpid(), (stripes * rows, n)
    header = create_staged(spec, shape, "float64", pid,
                           chunks=(rows, n) if fmt == "zarr" and chunks else None)
    staged = staged_path(parse_spec(spec).path, pid)
    rs.Manifest.make(a={}, b={}, output=spec, dtype="float64", backend="blas", ranks=1,
                     grid=(1, 1, 1), stripe_edges=[list(range(0, shape[0] + 1, rows))],
                     panels=[0, 3], pid=pid, header=header).save(staged)
    writer = StripeWriter(spec, pid, shape, "float64", header,
                          aligned=fmt == "zarr" and chunks)
    log = rs.DoneLog(staged, 0, fresh=True)
    sink = log.summed(writer)
    rng = np.random.default_rng()
    regions, blocks = [], []
    for s in range(stripes):
        regions.append((s * rows, (s + 1) * rows, 0, n))
        blocks.append(rng.standard_normal((rows, n)))
        sink.write(*regions[-1], blocks[-1])
        log.add(s, regions[-1])
    writer.finish()
    log.close()
    return staged, regions, blocks


def _flip(path: Path, offset: int) -> None:
    """Change one bit of the byte at ``offset`` of ``path``."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("fmt", ["npy", "zarr", "h5"])
def test_a_stripe_changed_on_disk_is_found_when_read_back(tmp_path, fmt):
    staged, regions, blocks = _staged(tmp_path, fmt)
    # each stripe's checksum logged, as its bytes: the stripe in memory, not read back
    assert rs.read_sums(staged, 0) == {s: zlib.crc32(b.tobytes()) for s, b in enumerate(blocks)}
    assert rs.read_done(staged, 0) == {0, 1, 2, 3}
    shape, header = (16, 6), rs.Manifest.load(staged)["header"]
    everything = dict(enumerate(regions))
    assert rs.damaged(staged, 0, everything, shape, "float64", header) == {}
    if fmt == "zarr":
        _flip(staged / "c" / "2" / "0", 5)
    else:
        _flip(staged, header + (8 * 6 + 1) * 8 + 3)  # C[8, 1]: stripe 2's
    found = rs.damaged(staged, 0, everything, shape, "float64", header)
    assert found == {2: f"warning: rows 8:12 of C kept in {staged.name} changed since they were "
                        f"written (their checksum differs from the one logged): computed again"}
    # a stripe of some columns names them
    part = rs.damaged(staged, 0, {2: (8, 12, 0, 3)}, shape, "float64", header)
    assert "rows 8:12, columns 0:3 of C" in part[2]


def test_a_truncated_zarr_chunk_is_found_and_removed(tmp_path):
    """A chunk file cut short no longer decodes: its stripe is computed again and the chunk
    removed; where the chunks are zarr's own, shared by the stripes, every stripe in it, and
    a stripe can then be written into part of it (zarr would read it first and fail)."""
    (tmp_path / "own").mkdir()
    staged, regions, _ = _staged(tmp_path / "own", "zarr")
    chunk = staged / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    found = rs.damaged(staged, 0, dict(enumerate(regions)), (16, 6), "float64", None)
    assert list(found) == [1] and "rows 4:8 of C" in found[1]
    assert "cannot be read back" in found[1] and "\n" not in found[1]
    assert not chunk.exists() and (staged / "c" / "2" / "0").exists()

    (tmp_path / "shared").mkdir()
    staged, regions, blocks = _staged(tmp_path / "shared", "zarr", chunks=False)
    [chunk] = [p for p in staged.rglob("*") if p.is_file() and "zarr" not in p.name]
    chunk.write_bytes(chunk.read_bytes()[:len(chunk.read_bytes()) // 2])
    found = rs.damaged(staged, 0, dict(enumerate(regions)), (16, 6), "float64", None)
    assert sorted(found) == [0, 1, 2, 3] and not chunk.exists()
    writer = StripeWriter(str(tmp_path / "shared" / "c.zarr"), os.getpid(), (16, 6), "float64",
                          None)
    for region, block in zip(regions, blocks):
        writer.write(*region, block)
    import zarr

    np.testing.assert_array_equal(zarr.open_array(str(staged), mode="r")[...],
                                  np.concatenate(blocks))


def test_logs_without_checksums(tmp_path):
    """A run's logs from before checksums (no sums; its manifest has no ``checksums``):
    its stripes are trusted unread, as before. Under a manifest that has them, a logged
    stripe without a checksum is computed again."""
    staged, regions, _ = _staged(tmp_path, "npy")
    header = rs.Manifest.load(staged)["header"]
    rs.sums_path(staged, 0).unlink()
    _flip(staged, header + 3)
    found = rs.damaged(staged, 0, dict(enumerate(regions)), (16, 6), "float64", header)
    assert found == {s: f"warning: rows {4 * s}:{4 * s + 4} of C kept in {staged.name} have "
                        f"no checksum logged: computed again" for s in range(4)}
    old = rs.Manifest.load(staged)
    del old["checksums"]
    old.save(staged)
    assert rs.damaged(staged, 0, dict(enumerate(regions)), (16, 6), "float64", header) == {}
    # a torn last line of the sums is no checksum
    rs.sums_path(staged, 0).write_text("0 0000abcd\n1 00")
    assert rs.read_sums(staged, 0) == {0: 0xabcd}


# -- the command line: a stopped run, a stripe changed on disk, resumed ----------------------

M, K, N, STRIPES = 600, 700, 500, 24


def _saved_operands(folder: Path) -> None:
    rng = np.random.default_rng()
    np.save(folder / "a.npy", rng.standard_normal((M, K)))
    np.save(folder / "b.npy", rng.standard_normal((K, N)))


def _read(folder: Path, spec: str) -> np.ndarray:
    f = parse_spec(spec)
    if f.kind == "npy":
        return np.load(folder / f.path)
    if f.kind == "zarr":
        import zarr

        return zarr.open_array(str(folder / f.path), mode="r")[...]
    import h5py

    with h5py.File(folder / f.path, "r") as fh:
        return fh[f.dataset][()]


def _stopped(line, folder: Path, env: dict, logged: int = 8) -> tuple[Path, dict]:
    """``line`` (a ``--resume`` run) stopped by SIGTERM to its ranks once ``logged`` stripes
    are logged; its staged output and manifest."""
    stop_after_logged(line, folder, env, logged)
    [manifest] = folder.glob(".c.*.resume.json")
    return Path(str(manifest)[:-len(".resume.json")]), json.loads(manifest.read_text())


def _damage(staged: Path, manifest: dict, how: str) -> list[tuple[int, int]]:
    """Change the bytes of rank 0's first logged stripe in place (``flip``: one bit of its first
    element; ``cut``: its zarr chunk file cut to half); the rows of the logged stripes that
    lost bytes (of every rank: a zarr chunk of zarr's own may hold several stripes)."""
    stripe = int(rs.done_log_path(staged, 0).read_text().split()[0])
    r0, r1 = manifest["stripe_edges"][0][stripe:stripe + 2]
    if not staged.is_dir():
        _flip(staged, manifest["header"] + r0 * N * 8 + 3)
        return [(r0, r1)]
    import zarr

    array = zarr.open_array(str(staged), mode="r")
    rows = array.chunks[0]
    chunk = staged / array.metadata.encode_chunk_key((r0 // rows, 0))
    if how == "flip":
        _flip(chunk, (r0 % rows) * array.chunks[1] * 8 + 3)
        return [(r0, r1)]
    chunk.write_bytes(chunk.read_bytes()[:chunk.stat().st_size // 2])
    lo, hi = r0 // rows * rows, (r0 // rows + 1) * rows
    edges = manifest["stripe_edges"]
    return sorted((edges[r][s], edges[r][s + 1]) for r in range(len(edges))
                  for s in rs.read_done(staged, r) if edges[r][s] < hi and edges[r][s + 1] > lo)


def _written(profile: Path) -> int:
    return sum(rec["bytes"].get("write", 0) for rec in json.loads(profile.read_text())["ranks"])


def _kept_bytes(staged: Path, manifest: dict, ranks: int) -> int:
    """Bytes of C the ranks' logs hold (the grid splits rows only)."""
    edges = manifest["stripe_edges"]
    return sum((edges[r][s + 1] - edges[r][s]) * N * 8
               for r in range(ranks) for s in rs.read_done(staged, r))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("fmt,how,ranks", [
    ("npy", "flip", 1), ("zarr", "flip", 1), ("zarr", "cut", 1), ("h5", "flip", 1),
    ("npy", "flip", 2), ("zarr", "cut", 2)])
def test_a_kept_stripe_changed_on_disk_is_computed_again(tmp_path, mpiexec, mpi_env, fmt, how,
                                                         ranks):
    """A stopped ``--resume`` run, then a byte of a stripe its log calls done changed in the
    kept staged output (or its zarr chunk file cut to half): the resumed run says so in one
    warning line naming the stripe's rows and the staged output, computes that stripe again
    with the missing ones (no other), and C is bitwise equal to the same command's run
    uninterrupted (it committed the changed bytes, with status 0). Two ranks split C's rows
    into ragged stripes: a zarr folder's chunks are zarr's own, compressed, shared by the
    stripes of both ranks."""
    _saved_operands(tmp_path)
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": str(STRIPES)}
    spec = SPECS[fmt]

    def line(out, *extra):
        cmd = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "-o", out,
               "--resume", *extra]
        return [mpiexec, "-n", str(ranks), "--oversubscribe", *cmd] if ranks > 1 else cmd

    whole = subprocess.run(line(spec.replace("c.", "whole.")), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=env)
    assert whole.returncode == 0, whole.stderr
    staged, manifest = _stopped(line(spec), tmp_path, env)
    kept = _kept_bytes(staged, manifest, ranks)
    lost = _damage(staged, manifest, how)
    assert len(lost) == 1 or (fmt, how, ranks) == ("zarr", "cut", 2), lost
    r = subprocess.run(line(spec, "--profile", "p.json"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    c = _read(tmp_path, spec)
    assert c.tobytes() == _read(tmp_path, spec.replace("c.", "whole.")).tobytes()
    warnings = [x for x in r.stderr.splitlines() if "warning" in x]
    assert [x.split(" of C kept in ")[0] for x in warnings] == [
        f"distmm matmul: warning: rows {r0}:{r1}" for r0, r1 in lost], r.stderr  # each once
    assert all(x.split(" of C kept in ")[1].startswith(f"{staged.name} ") for x in warnings)
    again = sum(r1 - r0 for r0, r1 in lost) * N * 8  # the stripes that lost bytes, again
    assert _written(tmp_path / "p.json") == M * N * 8 - kept + again
    assert not list(tmp_path.glob(".c.*"))


@pytest.mark.mpi
@pytest.mark.slow
def test_a_stopped_runs_logs_without_checksums_are_trusted(tmp_path, mpi_env):
    """A stopped run's logs as a run from before checksums left them (no sums, a manifest
    without ``checksums``): the resume keeps its logged stripes unread, as before, says
    nothing, and C is bitwise equal to the same command's run uninterrupted."""
    _saved_operands(tmp_path)
    env = {**mpi_env, "OMPI_MCA_btl": "^ofi", "DISTMM_BATCH_STRIPES": str(STRIPES)}
    line = [sys.executable, "-m", "distmm", "matmul", "a.npy", "b.npy", "--resume", "-o"]
    whole = subprocess.run([*line, "whole.npy"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=env)
    assert whole.returncode == 0, whole.stderr
    staged, manifest = _stopped([*line, "c.npy"], tmp_path, env)
    rs.sums_path(staged, 0).unlink()
    del manifest["checksums"]
    rs.manifest_path(staged).write_text(json.dumps(manifest))
    kept = _kept_bytes(staged, manifest, 1)
    r = subprocess.run([*line, "c.npy", "--profile", "p.json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    assert _written(tmp_path / "p.json") == M * N * 8 - kept
    assert np.load(tmp_path / "c.npy").tobytes() == np.load(tmp_path / "whole.npy").tobytes()
