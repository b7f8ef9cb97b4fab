"""HDF5 operands whose dataset was written through a filter this HDF5 lacks (a plugin not
installed): refused when the operand is opened, in one line naming the filter."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli

h5py = pytest.importorskip("h5py")

#: HDF5's registered id of the blosc filter, a plugin HDF5 itself does not have
BLOSC = 32001


def _filtered(path, x, code, *, through: bool) -> None:
    """``x`` as dataset ``A`` of a new HDF5 file ``path``, chunked, with the optional filter
    ``code`` (h5py's ``allow_unknown_filter``): its chunks stored as filter ``code``'s output
    (``through``; here the raw bytes, as a writer with the plugin would store its own) or as
    having skipped it (filter mask bit set), as a writer without the plugin stores them."""
    with h5py.File(path, "w") as fh:
        ds = fh.create_dataset("A", shape=x.shape, dtype=x.dtype, chunks=(4, x.shape[1]),
                               compression=code, allow_unknown_filter=True)
        for r0 in range(0, x.shape[0], 4):
            chunk = np.zeros((4, x.shape[1]), x.dtype)
            chunk[:len(x[r0:r0 + 4])] = x[r0:r0 + 4]
            ds.id.write_direct_chunk((r0, 0), chunk.tobytes(), filter_mask=0 if through else 1)


@pytest.mark.parametrize("code, named", [(BLOSC, f"{BLOSC} (blosc)"), (32999, "32999")])
def test_an_operand_needing_a_missing_filter_is_refused_naming_it(tmp_path, code, named):
    """HDF5's own words came out once the run read the operand: "can't open directory
    (/usr/local/lib/plugin)", naming neither the filter nor what to install. Now the
    operand is refused before any work: the file, the dataset and the filter's id (with
    its name where known), no output left."""
    rng = np.random.default_rng()
    _filtered(tmp_path / "a.h5", rng.random((9, 5)), code, through=True)
    np.save(tmp_path / "b.npy", rng.random((5, 7)))
    plugins = tmp_path / "plugins"
    plugins.mkdir()  # an empty plugin folder: a blosc plugin installed here is not found
    r = run_cli("matmul", f"{tmp_path / 'a.h5'}:A", tmp_path / "b.npy", "-o",
                tmp_path / "c.npy", "--engine", "local", env={"HDF5_PLUGIN_PATH": str(plugins)})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (f"{tmp_path / 'a.h5'}:A needs HDF5 filter {named}, which is not available here"
            in r.stderr), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5", "b.npy", "plugins"]


def test_an_optional_missing_filter_that_no_chunk_went_through_is_read(tmp_path):
    """A writer without the plugin skips an optional filter and records that per chunk: such
    a dataset reads without it, and is multiplied as numpy would."""
    rng = np.random.default_rng()
    a, b = rng.random((9, 5)), rng.random((5, 7))
    _filtered(tmp_path / "a.h5", a, BLOSC, through=False)
    np.save(tmp_path / "b.npy", b)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    r = run_cli("matmul", f"{tmp_path / 'a.h5'}:A", tmp_path / "b.npy", "-o",
                tmp_path / "c.npy", "--engine", "local", env={"HDF5_PLUGIN_PATH": str(plugins)})
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12)
