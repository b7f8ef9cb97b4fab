"""Edge cases of the lazy product of dask operands (``distmm.engine.dask.lazy``): odd
chunkings on a cluster (tile and block layouts), checked against numpy."""
from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

import distmm  # noqa: E402


@pytest.mark.parametrize("layout", ["tiles", "blocks"])
@pytest.mark.parametrize("side", ["rows", "cols"])
@pytest.mark.slow
def test_trailing_empty_chunk(client, side, layout):
    """An operand whose last output chunk is empty (rows (2, 2, 0)), on a cluster: the
    result keeps the operands' chunks and numpy's values. The empty chunk starts at m or
    n, and was looked up past the last plan tile (tiles: the placement raised IndexError
    in the scheduler when computed) or block (blocks: an IndexError at the call)."""
    a_np = np.arange(12.0).reshape(4, 3)
    b_np = np.arange(15.0).reshape(3, 5)
    a = da.from_array(a_np, chunks=((2, 2, 0) if side == "rows" else (4,), 3))
    b = da.from_array(b_np, chunks=(3, (3, 2, 0) if side == "cols" else (5,)))
    with dask.config.set({"distmm.dask-layout": layout,
                          "distmm.dask-worker-gflops": {"cpu": 10}}):  # no probe
        c = distmm.matmul(a, b, client=client)
    assert isinstance(c, da.Array)
    assert c.chunks == (a.chunks[0], b.chunks[1])
    got = c.compute()
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, a_np @ b_np)
