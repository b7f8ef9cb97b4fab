"""The batch path's operand reader: rectangles of a ``.npy`` file read with ``preadv`` equal
numpy's slices, and what it cannot read that way (a cast, a slice of a mapping, narrow
pieces, zarr) goes through the array."""
from __future__ import annotations

import numpy as np
import pytest

from distmm.engine.mpi.stream import PanelSource


@pytest.fixture
def operand(tmp_path):
    a = np.random.default_rng(4).standard_normal((301, 2050)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    return a, np.load(tmp_path / "a.npy", mmap_mode="r")


@pytest.mark.parametrize("r0, r1, c0, c1", [(0, 301, 0, 2050), (17, 200, 0, 2050),
                                            (5, 9, 1024, 2050), (3, 40, 7, 20), (300, 301, 0, 5)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rectangles_equal_numpy(operand, r0, r1, c0, c1, dtype):
    a, mm = operand
    src = PanelSource(mm)
    out = np.full((r1 - r0, c1 - c0), np.nan, dtype=dtype)  # poisoned
    src.read_into(out, r0, r1, c0, c1)
    np.testing.assert_array_equal(out, a[r0:r1, c0:c1].astype(dtype))
    used_file = src._fd is not None
    assert used_file == (dtype == "float32" and (c1 - c0 == 2050 or (c1 - c0) * 4 >= 4096))
    src.close()


def test_a_slice_of_the_mapping_is_read_through_it(operand):
    a, mm = operand
    part = mm[100:200]  # carries the file's offset, not its own: must not be preadv'd
    src = PanelSource(part, origin=(100, 0))
    out = np.empty((50, 2050), np.float32)
    src.read_into(out, 120, 170, 0, 2050)
    np.testing.assert_array_equal(out, a[120:170])
    assert src._fd is None


def test_a_truncated_file_fails_with_a_clear_error(tmp_path, operand):
    a, _ = operand
    np.save(tmp_path / "t.npy", a)
    mm = np.load(tmp_path / "t.npy", mmap_mode="r")
    with open(tmp_path / "t.npy", "r+b") as fh:
        fh.truncate(4096)
    out = np.empty((301, 2050), np.float32)
    with pytest.raises(OSError, match="ended .* early"):
        PanelSource(mm).read_into(out, 0, 301, 0, 2050)


def test_hdf5_zarr_and_plain_arrays_are_read_through_the_array(tmp_path, operand):
    """What is not a ``.npy`` mapping (an h5py dataset, a zarr array, an ndarray) is sliced."""
    import h5py
    import zarr

    a, _ = operand
    with h5py.File(tmp_path / "a.h5", "w") as fh:
        fh["A"] = a
    z = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=a.shape, dtype=a.dtype,
                        chunks=(64, 512))
    z[...] = a
    with h5py.File(tmp_path / "a.h5", "r") as fh:
        for array in (fh["A"], z, np.ascontiguousarray(a)):
            src = PanelSource(array)
            for r0, r1, c0, c1 in [(0, 301, 0, 2050), (5, 77, 1024, 2050), (3, 40, 7, 20)]:
                out = np.full((r1 - r0, c1 - c0), np.nan, np.float32)
                src.read_into(out, r0, r1, c0, c1)
                np.testing.assert_array_equal(out, a[r0:r1, c0:c1])
            assert src._fd is None
