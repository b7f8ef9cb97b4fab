"""Fresh host memory for large GPU results (distmm.executor.hostmem): huge-page advice and
background first touch must never change what the caller writes."""
from __future__ import annotations

import numpy as np
import pytest

from distmm.executor import hostmem


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float64), ((4097, 4099), np.float32),
                                         ((2, 3000, 2900), np.float64)])
def test_empty_host_is_a_writable_c_array(shape, dtype):
    c = hostmem.empty_host(shape, dtype)
    assert c.shape == shape and c.dtype == dtype and c.flags.c_contiguous and c.flags.writeable
    assert (c.nbytes >= hostmem.HUGE_MIN_BYTES) == (not c.flags.owndata)  # large: a mapping
    rng = np.random.default_rng(5)
    ref = rng.standard_normal(shape).astype(dtype)
    c[...] = ref
    assert np.array_equal(c, ref)


def test_writes_racing_the_first_touch_survive():
    """Rows written while the toucher threads are still faulting pages in keep their
    values (MADV_POPULATE_WRITE leaves contents alone; a write of zeros would not)."""
    for _ in range(3):
        c = hostmem.empty_host((8192, 4096), np.float32, touch_threads=4)  # 128 MiB
        for r0 in range(0, 8192, 512):  # written at once, band by band, racing the touchers
            c[r0:r0 + 512] = r0 + 1
        expect = (np.arange(8192) // 512 * 512 + 1).astype(np.float32)
        assert np.array_equal(c[:, 0], expect) and np.array_equal(c[:, -1], expect)
        assert (c == expect[:, None]).all()


def test_populate_reports_what_it_did():
    buf = np.zeros(1 << 22, np.uint8)
    ok = hostmem.populate(buf.ctypes.data, buf.nbytes)
    assert isinstance(ok, bool)
    assert not buf.any()  # contents unchanged either way
    assert hostmem.thp_mode() in ("always", "madvise", "never", "?")


def test_a_dropped_result_is_reused_for_the_next_of_its_size():
    """Mappings of dropped results come back (pages already in) for the same size only,
    and a reused array is an independent, writable result."""
    import gc

    shape = (4096, 4100)
    c = hostmem.empty_host(shape, np.float32)
    addr = c.ctypes.data
    c[...] = 7
    del c
    gc.collect()
    d = hostmem.empty_host(shape, np.float32)
    assert d.ctypes.data == addr  # the same mapping
    other = hostmem.empty_host((4096, 4200), np.float32)
    assert other.ctypes.data != addr
    d[...] = 3
    e = hostmem.empty_host(shape, np.float32)  # d is alive: e is not its memory
    assert e.ctypes.data != addr
    e[...] = 5
    assert (d == 3).all() and (e == 5).all()
    assert sum(s for s, _ in hostmem._spare) <= hostmem.SPARE_MAX_BYTES
