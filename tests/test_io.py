"""distmm.cli.io on real files: the pwrite .npy writer and staged output."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import distmm
from distmm.cli.io import NpyWriter, parse_target, staged_output


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
