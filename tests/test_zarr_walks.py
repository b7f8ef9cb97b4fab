"""A zarr target replaced with --overwrite is walked (``distmm.staging.unremovable``: every
file and folder in it looked at) once before the run and once at the commit, and the folders
above it looked at once (``_check_zarr_path``)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from distmm.cli import main


def test_an_overwritten_zarr_target_is_walked_once_before_the_run_and_once_at_the_commit(
        tmp_path, monkeypatch):
    """The command line checked the target itself and again when it staged the output
    (``staged_output``), and ``put_in_place`` once more before it replaces the folder: three
    walks of the whole old array (0.3 s each for 20k chunks), and the folders above it looked
    at twice. Now ``staged_output`` is told the target was checked; the commit's walk stays
    (a chunk made immutable during the run is found there)."""
    zarr = pytest.importorskip("zarr")
    import distmm.staging as staging

    rng = np.random.default_rng()
    a, b = rng.random((13, 7)), rng.random((7, 11))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    c = tmp_path / "c.zarr"
    old = zarr.open_array(str(c), mode="w", shape=(13, 11), chunks=(2, 3), dtype="f8",
                          zarr_format=3)
    old[...] = rng.random((13, 11))  # 7 x 4 chunk files
    walks, looked = [], []
    walk, node = os.walk, staging.zarr_node

    def counted_walk(top, *args, **kw):
        if Path(top) == c:
            walks.append(top)
        return walk(top, *args, **kw)

    def counted_node(path):
        if Path(path) == tmp_path.resolve():
            looked.append(path)
        return node(path)

    monkeypatch.setattr(os, "walk", counted_walk)
    monkeypatch.setattr(staging, "zarr_node", counted_node)
    assert main(["matmul", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o", str(c),
                 "--engine", "local", "--overwrite"]) == 0
    np.testing.assert_allclose(zarr.open_array(str(c), mode="r")[...], a @ b, rtol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.zarr"]
    assert len(walks) == 2, walks
    assert len(looked) == 1, looked
