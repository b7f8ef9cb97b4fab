"""``distmm matmul -o`` into a container that exists: an HDF5 file's names, a zarr group's
consolidated metadata.

- HDF5: the target's name is whatever link the file has under it, never followed into
  another file. A link to nothing (a dangling soft link, an external link to a missing file)
  is an existing name: refused without ``--overwrite`` in one line, the file as it was. With
  ``--overwrite`` an external link (or a soft link through one) is replaced by the new
  dataset and the file it names is never opened: its bytes and modification time stay.
  Another hard link to the old dataset keeps the old data; a group, or a soft link to one,
  is never replaced.
- zarr: an array written into groups with consolidated metadata (format 2's
  ``.zmetadata``, format 3's ``consolidated_metadata`` in ``zarr.json``) leaves that
  metadata describing the store as it is (``zarr.open_consolidated`` sees the new array,
  its shape and dtype); a group without consolidated metadata is left without.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from conftest import one_line, run_cli

#: a modification time far from now, so that any write to a file shows in its mtime
OLD = 1_500_000_000_000_000_000


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def untouched(path: Path) -> tuple:
    """A file's bytes' digest and modification time (set to ``OLD`` first)."""
    os.utime(path, ns=(OLD, OLD))
    return sha256(path), path.stat().st_mtime_ns


def untouched_now(path: Path) -> tuple:
    """A file's bytes' digest and modification time, as ``untouched`` gave them."""
    return sha256(path), path.stat().st_mtime_ns


def partials(folder: Path) -> list:
    return sorted(p.name for p in folder.rglob("*") if "distmm-" in p.name)


def _other(folder: Path) -> Path:
    """other.h5 in HDF5's newest format (a file opened for writing there gets its superblock
    rewritten), holding the dataset D and the group G/D."""
    other = folder / "other.h5"
    with h5py.File(other, "w", libver="latest") as fh:
        fh["D"] = np.arange(5.0)
        fh["G/D"] = np.arange(4.0)
    return other


def _linked(folder: Path, link: str) -> Path:
    """results.h5 with a dataset 'keep', a group 'ext' that is an external link to other.h5's
    G, and under the name C the link ``link``."""
    f = folder / "results.h5"
    with h5py.File(f, "w") as fh:
        fh["keep"] = np.arange(3.0)
        fh["ext"] = h5py.ExternalLink("other.h5", "/G")
        fh["C"] = {"dangling soft": h5py.SoftLink("/nothing"),
                   "external to a missing file": h5py.ExternalLink("missing.h5", "/D"),
                   "external to a missing dataset": h5py.ExternalLink("other.h5", "/nothing"),
                   "external": h5py.ExternalLink("other.h5", "/D"),
                   "soft through external": h5py.SoftLink("/ext/D")}[link]
    return f


LINKS = ["dangling soft", "external to a missing file", "external to a missing dataset",
         "external", "soft through external"]


@pytest.mark.parametrize("link", LINKS)
def test_h5_link_at_the_target_name_is_refused_without_overwrite(tmp_path, npy_operands, link):
    """-o f.h5:C where C is a link to nothing (a dangling soft link, an external link to a
    missing file or object): the link was replaced by the new C (status 0) without
    --overwrite. Now every link there is an existing name: status 2 in one line naming it,
    both files as they were, nothing left beside them."""
    pa, pb, _ = npy_operands
    other = _other(tmp_path)
    f = _linked(tmp_path, link)
    before = untouched(f), untouched(other)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local")
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"{f}:C exists" in line and "--overwrite" in line
    assert (untouched_now(f), untouched_now(other)) == before and not partials(tmp_path)


@pytest.mark.slow  # distmm subprocesses, ~1 s each
@pytest.mark.parametrize("link", LINKS)
def test_h5_overwrite_replaces_the_link_and_never_opens_its_file(tmp_path, npy_operands, link):
    """--overwrite -o f.h5:C where C is an external link (or a soft link through one) to a
    dataset of other.h5: other.h5 was opened for reading and writing to look at C (its
    modification time changed). Now the link in f.h5 is replaced by the new dataset; other.h5
    keeps its bytes and modification time; f.h5's other names stay."""
    pa, pb, ref = npy_operands
    other = _other(tmp_path)
    f = _linked(tmp_path, link)
    before = untouched(other)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert untouched_now(other) == before and not partials(tmp_path)
    with h5py.File(f, "r") as fh:
        assert isinstance(fh.get("C", getlink=True), h5py.HardLink)
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(fh["keep"][...], np.arange(3.0))
        assert fh.get("ext", getlink=True).filename == "other.h5"
    with h5py.File(other, "r") as fh:
        np.testing.assert_array_equal(fh["D"][...], np.arange(5.0))


def test_h5_overwrite_keeps_another_hard_link_to_the_old_dataset(tmp_path, npy_operands):
    """--overwrite -o f.h5:C where C and D name one dataset (hard links): C becomes the
    product, D keeps the old data, as a file's other hard link keeps its old content."""
    pa, pb, ref = npy_operands
    f = tmp_path / "results.h5"
    old = np.arange(6.0).reshape(2, 3)
    with h5py.File(f, "w") as fh:
        fh["C"] = old
        fh["D"] = fh["C"]
    r = run_cli("matmul", pa, pb, "-o", f"{f}:C", "--engine", "local", "--overwrite")
    assert r.returncode == 0, r.stderr
    with h5py.File(f, "r") as fh:
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(fh["D"][...], old)


@pytest.mark.parametrize("name", ["G", "soft"])
def test_h5_group_or_soft_link_to_one_is_never_replaced(tmp_path, npy_operands, name):
    """--overwrite -o f.h5:G where G is a group (or a soft link to one): status 2 in one
    line, the file as it was."""
    pa, pb, _ = npy_operands
    f = tmp_path / "results.h5"
    with h5py.File(f, "w") as fh:
        fh["G/X"] = np.arange(3.0)
        fh["soft"] = h5py.SoftLink("/G")
    before = untouched(f)
    r = run_cli("matmul", pa, pb, "-o", f"{f}:{name}", "--engine", "local", "--overwrite")
    assert r.returncode == 2, r.stderr
    assert f"{f}:{name} is an HDF5 group, which distmm never replaces" in one_line(r.stderr)
    assert untouched_now(f) == before and not partials(tmp_path)


# ---------------------------------------------------------------- zarr


def _group(path: Path, fmt: int, consolidated: bool) -> None:
    """A zarr group of format ``fmt``: an array X, an int32 array C of shape (5,), a group
    sub; consolidated (sub first, then the whole) where asked."""
    with warnings.catch_warnings():  # zarr's: format 3 consolidated metadata is no standard
        warnings.simplefilter("ignore")
        g = zarr.open_group(str(path), mode="w", zarr_format=fmt)
        g.create_array("X", shape=(2,), dtype="i4")[:] = 7
        g.create_array("C", shape=(5,), dtype="i4")
        g.create_group("sub")
        if consolidated:
            zarr.consolidate_metadata(str(path / "sub"), zarr_format=fmt)
            zarr.consolidate_metadata(str(path), zarr_format=fmt)


def _consolidated(path: Path, fmt: int) -> bool:
    if fmt == 2:
        return (path / ".zmetadata").exists()
    return json.loads((path / "zarr.json").read_text()).get("consolidated_metadata") is not None


def _open_consolidated(path: Path, fmt: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_consolidated(str(path), zarr_format=fmt)


@pytest.mark.slow  # distmm subprocesses, ~1 s each
@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("name, overwrite", [("C", True), ("N", False), ("sub/N", False)])
def test_zarr_consolidated_metadata_lists_the_new_array(tmp_path, npy_operands, fmt, name,
                                                         overwrite):
    """-o g.zarr/NAME in a group with consolidated metadata: the array was written but the
    consolidated metadata still listed the old C (int32, shape (5,)) or no N at all, so
    zarr.open_consolidated did not see the product. Now it (and an inner group's, for
    sub/N) describes the store as it is: NAME with the product's shape, dtype and values."""
    pa, pb, ref = npy_operands
    g = tmp_path / "g.zarr"
    _group(g, fmt, consolidated=True)
    r = run_cli("matmul", pa, pb, "-o", g / name, "--engine", "local",
                *(["--overwrite"] if overwrite else []))
    assert r.returncode == 0, r.stderr
    meta = _open_consolidated(g, fmt).metadata.consolidated_metadata.flattened_metadata
    assert tuple(meta[name].shape) == ref.shape
    got = _open_consolidated(g, fmt)[name]  # (built from the consolidated metadata)
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    np.testing.assert_allclose(got[...], ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(_open_consolidated(g, fmt)["X"][...], [7, 7])
    if name.startswith("sub/"):
        inner = _open_consolidated(g / "sub", fmt)
        assert [k for k, _ in inner.members()] == ["N"]
    assert not partials(g)


@pytest.mark.slow  # distmm subprocesses, ~1 s each
@pytest.mark.parametrize("fmt", [2, 3])
def test_zarr_group_without_consolidated_metadata_stays_without(tmp_path, npy_operands, fmt):
    """-o g.zarr/N in a group that has no consolidated metadata: none is added."""
    pa, pb, ref = npy_operands
    g = tmp_path / "g.zarr"
    _group(g, fmt, consolidated=False)
    r = run_cli("matmul", pa, pb, "-o", g / "N", "--engine", "local")
    assert r.returncode == 0, r.stderr
    assert not _consolidated(g, fmt) and not _consolidated(g / "sub", fmt)
    np.testing.assert_allclose(zarr.open_array(str(g / "N"), mode="r")[...], ref,
                               rtol=1e-12, atol=1e-12)


def test_zarr_consolidated_metadata_that_cannot_be_written_is_a_warning(tmp_path, npy_operands,
                                                                        chattr):
    """-o g.zarr/N where g.zarr's zarr.json (holding its consolidated metadata) is immutable:
    N is in place (status 0) and one warning names the group and how to consolidate it by
    hand; nothing of zarr's left behind."""
    pa, pb, ref = npy_operands
    g = tmp_path / "g.zarr"
    _group(g, 3, consolidated=True)
    chattr(g / "zarr.json", "i")
    r = run_cli("matmul", pa, pb, "-o", g / "N", "--engine", "local")
    assert r.returncode == 0, r.stderr
    line = one_line(r.stderr)
    assert "warning:" in line and f"consolidated metadata of the zarr group {g}" in line
    assert f"zarr.consolidate_metadata({str(g)!r})" in line
    np.testing.assert_allclose(zarr.open_array(str(g / "N"), mode="r")[...], ref,
                               rtol=1e-12, atol=1e-12)
    assert not partials(g) and not [p for p in g.iterdir() if p.name.endswith(".partial")]


@pytest.mark.mpi
@pytest.mark.slow
def test_mpirun_commits_into_containers_as_the_command_line_does(tmp_path, npy_operands, mpirun):
    """The batch path (2 ranks) commits with the same code: --overwrite -o f.h5:C where C is
    an external link to other.h5 leaves other.h5's bytes and modification time; -o g.zarr/N
    in a consolidated group leaves the consolidated metadata listing N."""
    pa, pb, ref = npy_operands
    other = _other(tmp_path)
    f = _linked(tmp_path, "external")
    before = untouched(other)
    r = mpirun(2, "-m", "distmm", "matmul", pa, pb, "-o", f"{f}:C", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert untouched_now(other) == before
    with h5py.File(f, "r") as fh:
        assert isinstance(fh.get("C", getlink=True), h5py.HardLink)
        np.testing.assert_allclose(fh["C"][...], ref, rtol=1e-12, atol=1e-12)
    g = tmp_path / "g.zarr"
    _group(g, 3, consolidated=True)
    r = mpirun(2, "-m", "distmm", "matmul", pa, pb, "-o", g / "N")
    assert r.returncode == 0, r.stderr
    got = _open_consolidated(g, 3)["N"]
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    np.testing.assert_allclose(got[...], ref, rtol=1e-12, atol=1e-12)
    assert not partials(tmp_path)
