"""A symbolic link at ``distmm matmul``'s target, the same rule for every output kind.

The link itself is the target, never followed to write: without ``--overwrite`` it is an
existing name, refused in one line naming it, whatever it names (nothing, a file, a folder);
with ``--overwrite`` the new ``.npy`` file, zarr folder or HDF5 file replaces the link and
what the link named is left as it was. An HDF5 target whose file is a link to something
that exists is refused whatever ``--overwrite``: the dataset would go into a file the user
did not name, and a new file in the link's place would drop that file's other datasets.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from conftest import one_line, read_only_mount, run_cli

KINDS = {"npy": "c.npy", "zarr": "c.zarr", "h5": "c.h5:C"}




def snapshot(folder: Path) -> dict:
    """Every name under ``folder`` (links not followed): a link's destination, a file's
    bytes' digest, its mode and modification time; a folder's mode."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            p = Path(root) / name
            st = p.lstat()
            if p.is_symlink():
                seen[p] = ("link", os.readlink(p))
            elif p.is_file():
                seen[p] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode,
                           st.st_mtime_ns)
            else:
                seen[p] = ("dir", st.st_mode)
    return seen


def read_output(path: Path, kind: str):
    if kind == "npy":
        return np.load(path)
    if kind == "zarr":
        return zarr.open_array(str(path), mode="r")[...]
    with h5py.File(path, "r") as fh:
        return fh["C"][...]


def run(pa, pb, target, *flags):
    return run_cli("matmul", pa, pb, "-o", target, "--engine", "local", *flags)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow
def test_a_link_to_nothing_is_refused_then_replaced_for_every_kind(tmp_path, npy_operands, kind):
    """A link to nothing at the target: a ``.npy`` target's was refused without --overwrite
    and replaced with it, but a zarr or HDF5 target's was refused either way ('distmm writes
    a zarr output only into an existing file or folder'). Now every kind: refused without
    --overwrite in one line naming the link, nothing written; replaced with it, nothing
    created where the link pointed, no staged output left."""
    pa, pb, ref = npy_operands
    spec = KINDS[kind]
    link = tmp_path / spec.split(":")[0]
    link.symlink_to("nowhere")
    before = snapshot(tmp_path)
    r = run(pa, pb, tmp_path / spec)
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"{link} is a symbolic link to nowhere" in line and "--overwrite" in line
    assert snapshot(tmp_path) == before
    r = run(pa, pb, tmp_path / spec, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not link.is_symlink() and link.exists()
    np.testing.assert_allclose(read_output(link, kind), ref, rtol=1e-12, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", link.name]


SLOW = pytest.mark.slow  # ~2 s a case on 2 cores; the fast run keeps the cases that changed most


@pytest.mark.parametrize("kind, dest", [
    ("npy", "folder"), ("zarr", "file"), pytest.param("zarr", "folder", marks=SLOW),
    pytest.param("npy", "file", marks=SLOW), pytest.param("npy", "zarr array", marks=SLOW),
    pytest.param("zarr", "zarr array", marks=SLOW)])
@pytest.mark.slow
def test_a_link_to_something_is_replaced_never_followed(tmp_path, npy_operands, kind, dest):
    """A ``.npy`` or zarr target that is a link to a file, a folder or a zarr array: some
    were replaced with --overwrite (.npy to a file, zarr to a zarr array), the others
    refused as what the link named ('is a directory', 'is not a zarr array'). Now all are
    refused without --overwrite as a link, and replaced with it; what the link named is left
    byte for byte, and a file taking a folder's link gets no folder's permission bits."""
    pa, pb, ref = npy_operands
    real = tmp_path / "real"
    if dest == "file":
        real.write_bytes(b"kept")
    elif dest == "folder":
        real.mkdir()
        (real / "x.txt").write_text("kept")
        real.chmod(0o755)
    else:
        zarr.save_array(str(real), np.arange(6.0))
    link = tmp_path / KINDS[kind]
    link.symlink_to("real")
    before = snapshot(tmp_path)
    r = run(pa, pb, link)
    assert r.returncode == 2, r.stderr
    assert f"{link} is a symbolic link to real" in one_line(r.stderr)
    assert snapshot(tmp_path) == before
    r = run(pa, pb, link, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not link.is_symlink()
    np.testing.assert_allclose(read_output(link, kind), ref, rtol=1e-12, atol=1e-12)
    after = snapshot(tmp_path)
    assert {p: v for p, v in after.items() if link not in (p, *p.parents)} == \
        {p: v for p, v in before.items() if p != link}
    if kind == "npy" and dest == "folder":
        assert not link.stat().st_mode & 0o111
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", link.name, "real"]


@pytest.mark.parametrize("dataset, overwrite", [
    ("N", False), ("C", True), pytest.param("C", False, marks=SLOW),
    pytest.param("N", True, marks=SLOW)])
@pytest.mark.slow
def test_an_hdf5_link_to_an_hdf5_file_is_refused_not_written_through(tmp_path, npy_operands,
                                                                      overwrite, dataset):
    """``-o link.h5:N`` where link.h5 is a link to real.h5: N was added to real.h5 through
    the link (and with --overwrite an existing C of real.h5 replaced), a file the user did not
    name. Now refused in one line naming the link and the file to name instead, with or
    without --overwrite; real.h5 is left byte for byte, and naming it itself adds N."""
    pa, pb, ref = npy_operands
    real = tmp_path / "real.h5"
    with h5py.File(real, "w") as fh:
        fh["X"] = np.arange(3.0)
        fh["C"] = np.zeros(2)
    link = tmp_path / "link.h5"
    link.symlink_to("real.h5")
    before = snapshot(tmp_path)
    r = run(pa, pb, f"{link}:{dataset}", *(["--overwrite"] if overwrite else []))
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"{link} is a symbolic link to real.h5" in line and f"name {real}:{dataset}" in line
    assert snapshot(tmp_path) == before
    r = run(pa, pb, f"{real}:N")
    assert r.returncode == 0, r.stderr
    with h5py.File(real, "r") as fh:
        assert sorted(fh) == ["C", "N", "X"]
        np.testing.assert_allclose(fh["N"][...], ref, rtol=1e-12, atol=1e-12)
    assert link.is_symlink() and os.readlink(link) == "real.h5"


@pytest.mark.slow  # four runs of the command
@pytest.mark.parametrize("dest", ["file", "folder"])
def test_an_hdf5_link_to_another_thing_is_refused_as_a_link(tmp_path, npy_operands, dest):
    """An HDF5 target's link to a file that is no HDF5 file, or to a folder: refused as
    what it named ('is not an HDF5 file', 'is a directory'); now as a link, with or without
    --overwrite, in one line, nothing touched."""
    pa, pb, _ = npy_operands
    real = tmp_path / "real"
    if dest == "file":
        real.write_bytes(b"kept")
    else:
        real.mkdir()
    link = tmp_path / "link.h5"
    link.symlink_to("real")
    before = snapshot(tmp_path)
    for flags in ((), ("--overwrite",)):
        r = run(pa, pb, f"{link}:C", *flags)
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert f"{link} is a symbolic link to real" in line and "remove the link" in line
        assert snapshot(tmp_path) == before


def test_commit_into_an_hdf5_file_never_goes_through_a_link(tmp_path):
    """A link to an HDF5 file made at the target while the run computed (after the check):
    ``commit_h5`` copied the dataset into the file the link named. Now it refuses it
    (``ValueError``), the linked file untouched, the staged file removed."""
    from distmm.staging import BlockWriter, commit_h5, create_h5_stage, staged_path

    real = tmp_path / "real.h5"
    with h5py.File(real, "w") as fh:
        fh["X"] = np.arange(3.0)
    link = tmp_path / "c.h5"
    staged = staged_path(link)
    x = np.random.default_rng().standard_normal((7, 5))
    writer = BlockWriter(staged, x.shape, x.dtype, create_h5_stage(staged, "C", x.shape, x.dtype))
    writer[...] = x
    writer.finish()
    link.symlink_to("real.h5")
    before = snapshot(tmp_path)
    del before[staged]
    with pytest.raises(ValueError, match=r"c\.h5 is a symbolic link to real\.h5"):
        commit_h5(staged, link, "C", overwrite=True)
    assert snapshot(tmp_path) == before


def test_a_zarr_folder_replaces_a_link_to_nothing(tmp_path):
    """``put_in_place`` of a staged zarr folder onto a link to nothing: ``os.replace`` of a
    folder onto a link fails (NotADirectoryError) and left the staged folder; now the link is
    moved aside and removed once the folder is in its place."""
    from distmm.staging import put_in_place

    staged = tmp_path / ".c.zarr.distmm-partial-1"
    x = np.random.default_rng().standard_normal((3, 4))
    zarr.save_array(str(staged), x)
    link = tmp_path / "c.zarr"
    link.symlink_to("nowhere")
    put_in_place(staged, link, 1)
    assert not link.is_symlink()
    np.testing.assert_array_equal(zarr.open_array(str(link), mode="r")[...], x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr"]


@pytest.fixture
def read_only_with_links(tmp_path):
    """A read-only folder (a read-only bind mount: root ignores permission bits) holding
    a.npy, b.npy and a link to nothing for each kind's target; skipped where no mount."""
    rng = np.random.default_rng()
    src = tmp_path / "src"
    src.mkdir()
    a, b = rng.standard_normal((9, 7)), rng.standard_normal((7, 5))
    np.save(src / "a.npy", a)
    np.save(src / "b.npy", b)
    for spec in KINDS.values():
        (src / spec.split(":")[0]).symlink_to("nowhere")
    with read_only_mount(src, tmp_path / "ro") as mounted:
        yield mounted


@pytest.mark.slow  # six runs of the command
def test_a_link_in_a_read_only_folder_is_refused_in_one_line(read_only_with_links):
    """A link to nothing in a folder where nothing can be written: without --overwrite the
    link is refused (a zarr or HDF5 one was refused as a place 'distmm writes only into'),
    with it the folder, each in one line naming the target, status 2, nothing changed."""
    folder = read_only_with_links
    before = snapshot(folder)
    for spec in KINDS.values():
        name = folder / spec.split(":")[0]
        r = run(folder / "a.npy", folder / "b.npy", folder / spec)
        assert r.returncode == 2, r.stderr
        assert f"{name} is a symbolic link to nowhere" in one_line(r.stderr)
        r = run(folder / "a.npy", folder / "b.npy", folder / spec, "--overwrite")
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert f"cannot write {folder / spec}: its folder {folder}" in line, line
        assert "partial" not in line
    assert snapshot(folder) == before
