"""Direct (O_DIRECT) writes of staged outputs: the cut, the padded .npy header, the bytes."""
from __future__ import annotations

import mmap
import os

import dask
import numpy as np
import pytest

import distmm
from distmm import direct_io
from distmm.direct_io import ALIGN, SpanWriter, aligned_split, npy_header, preallocate
from distmm.staging import BlockWriter, pwrite_all

from conftest import takes_direct


@pytest.mark.parametrize("offset, nbytes, want", [
    (0, 3 * ALIGN, (0, 3 * ALIGN)),                 # aligned both ends
    (100, 3 * ALIGN, (ALIGN - 100, 2 * ALIGN)),     # head and tail
    (ALIGN, 2 * ALIGN + 7, (0, 2 * ALIGN)),         # tail only
    (5, ALIGN, (0, 0)),                             # no whole block inside
    (5, 0, (0, 0)),
])
def test_aligned_split(offset, nbytes, want):
    head, body = aligned_split(offset, nbytes)
    assert (head, body) == want
    if body:
        assert (offset + head) % ALIGN == 0 and body % ALIGN == 0
        assert head + body <= nbytes


def test_npy_header_of_a_large_matrix():
    import io

    header = npy_header((32768, 32768), "float32")
    fh = io.BytesIO(header)
    assert len(header) == ALIGN and np.lib.format.read_magic(fh) == (1, 0)
    assert np.lib.format.read_array_header_1_0(fh) == ((32768, 32768), False, np.dtype("float32"))
    assert fh.tell() == ALIGN


@pytest.mark.parametrize("shape, dtype", [((3, 5), ">f8"), ((7,), "complex64"), ((), "int8"),
                                          ((2, 3, 4), "bool")])
def test_npy_header_pads_to_a_block_and_numpy_reads_it(tmp_path, shape, dtype):
    header = npy_header(shape, dtype)
    assert len(header) == ALIGN
    data = np.random.default_rng(1).standard_normal(int(np.prod(shape))).astype(dtype).reshape(shape)
    path = tmp_path / "x.npy"
    path.write_bytes(header + data.tobytes())
    got = np.load(path)
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    np.testing.assert_array_equal(got, data)
    assert np.load(path, mmap_mode="r").offset == ALIGN


@pytest.mark.parametrize("aligned_memory", [True, False])
@pytest.mark.parametrize("offset, nbytes", [(0, 5 << 20), (777, (3 << 20) + 12345),
                                            (ALIGN, direct_io.CHUNK * 2 + ALIGN)])
@pytest.mark.slow
def test_span_writer_bytes(tmp_path, aligned_memory, offset, nbytes):
    """Every byte lands where an ordinary write would put it, with the aligned middle written
    directly where the file system takes O_DIRECT."""
    path = tmp_path / "out.bin"
    path.write_bytes(b"\xab" * (offset + nbytes + 100))  # poison around the span
    src = mmap.mmap(-1, nbytes + ALIGN)
    base = np.frombuffer(src, np.uint8)
    start = 0 if aligned_memory else 13
    base[start:start + nbytes] = np.random.default_rng(nbytes).integers(0, 256, nbytes)
    data = memoryview(src)[start:start + nbytes]
    fd = os.open(path, os.O_WRONLY)
    w = SpanWriter(path, fd)
    try:
        w.write(data, offset, pwrite_all)
    finally:
        w.close()
        os.close(fd)
    got = np.fromfile(path, np.uint8)
    assert (got[:offset] == 0xAB).all() and (got[offset + nbytes:] == 0xAB).all()
    np.testing.assert_array_equal(got[offset:offset + nbytes], base[start:start + nbytes])
    head, body = aligned_split(offset, nbytes)
    expect = body if takes_direct(tmp_path) else 0
    assert w.written_direct == expect


def test_block_writer_whole_rows_direct_equals_ordinary(tmp_path):
    """Whole-row writes of a padded .npy go past the page cache; the file equals the one
    written the ordinary way, and numpy reads it."""
    shape, dtype = (700, 1536), np.dtype("float64")  # a row is 12 KiB: 3 blocks
    c = np.random.default_rng(2).standard_normal(shape)
    files = {}
    for direct in (True, False):
        path = tmp_path / f"c{direct}.npy"
        header = npy_header(shape, dtype)
        path.write_bytes(header)
        w = BlockWriter(path, shape, dtype, len(header), direct=direct)
        for r0 in range(0, 700, 300):  # 300 rows: 3.5 MiB spans
            w[r0:r0 + 300, :] = c[r0:r0 + 300]
        w[:5, 7:9] = c[:5, 7:9]  # a small partial write: the ordinary way
        direct_bytes = w.written_direct
        w.finish()
        files[direct] = path.read_bytes()
        np.testing.assert_array_equal(np.load(path), c)
        if not direct:
            assert direct_bytes == 0
        elif takes_direct(tmp_path):
            assert direct_bytes >= 600 * 1536 * 8
    assert files[True] == files[False]


def test_direct_writes_setting(tmp_path):
    shape = (512, 1024)
    with dask.config.set({"distmm.direct-writes": False}):
        w = BlockWriter(tmp_path / "x", shape, "float32", 0, create=True)
        w[:, :] = np.ones(shape, np.float32)
        assert w.written_direct == 0
        w.close()
    with dask.config.set({"distmm.direct-writes": "maybe"}):
        with pytest.raises(ValueError, match="direct-writes"):
            distmm.matmul(np.ones((2, 2)), np.ones((2, 2)))


def test_preallocate_gives_blocks(tmp_path):
    path = tmp_path / "p.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        nbytes = 8 << 20
        if not preallocate(fd, ALIGN, nbytes):
            pytest.skip("this file system does not preallocate")
        st = os.fstat(fd)
        assert st.st_size == ALIGN + nbytes
        assert st.st_blocks * 512 >= nbytes
        assert os.pread(fd, 16, ALIGN) == b"\0" * 16
    finally:
        os.close(fd)


def test_output_files_start_data_on_a_block(tmp_path):
    """The staged .npy and HDF5 outputs of the command line put C's first byte on a block
    boundary (what lets whole rows be written directly), and hold the right product."""
    import h5py

    from distmm.cli.io import staged_output

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 1024))
    for spec in (str(tmp_path / "c.npy"), f"{tmp_path / 'c.h5'}:g/c"):
        with staged_output(spec, (300, 1024), "float64") as out:
            distmm.matmul(a, b, out=out)
    assert np.load(tmp_path / "c.npy", mmap_mode="r").offset % ALIGN == 0
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-12, atol=1e-12)
    with h5py.File(tmp_path / "c.h5") as fh:
        assert fh["g/c"].id.get_offset() % ALIGN == 0
        np.testing.assert_allclose(fh["g/c"][...], a @ b, rtol=1e-12, atol=1e-12)


def test_span_writer_from_several_threads(tmp_path):
    """The local engine writes tiles of C from several threads into one writer: every span
    lands, and the count of direct bytes adds up."""
    from concurrent.futures import ThreadPoolExecutor

    rows, width = 64, 1 << 18  # rows of 256 KiB, written 4 rows (1 MiB) at a time
    data = np.random.default_rng(5).integers(0, 256, (rows, width), dtype=np.uint8)
    path = tmp_path / "t.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_WRONLY)
    w = SpanWriter(path, fd)
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: w.write(data[r:r + 4], ALIGN + r * width, pwrite_all),
                          range(0, rows, 4)))
    finally:
        w.close()
        os.close(fd)
    got = np.fromfile(path, np.uint8)[ALIGN:].reshape(rows, width)
    np.testing.assert_array_equal(got, data)
    assert w.written_direct == (rows * width if takes_direct(tmp_path) else 0)
