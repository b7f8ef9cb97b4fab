"""Fresh host memory for large GPU results (distmm.executor.hostmem): huge-page advice and
background first touch must never change what the caller writes."""
from __future__ import annotations

import numpy as np
import pytest

from distmm.executor import hostmem


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float64), ((4097, 4099), np.float32),
                                         ((2, 3000, 2900), np.float64)])
@pytest.mark.slow
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


@pytest.mark.slow
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


def _resident_pages(arr: np.ndarray) -> int:
    """Pages of ``arr``'s memory that are in RAM now (mincore)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = _mmap.PAGESIZE
    addr = arr.ctypes.data // page * page
    length = arr.ctypes.data + arr.nbytes - addr
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec)


def test_a_touch_hold_stops_the_first_touch_until_every_hold_is_released():
    """While a TouchHold is held the toucher threads wait (and fault nothing in);
    when the last hold is released they go on and finish, contents unchanged."""
    import threading
    import time

    probe = np.zeros(1 << 20, np.uint8)
    can_populate = hostmem.populate(probe.ctypes.data, probe.nbytes)
    before = set(threading.enumerate())
    first, second = hostmem.TouchHold(), hostmem.TouchHold()
    try:
        c = hostmem.empty_host((3001, 9001), np.float32, touch_threads=2)  # 103 MiB, a size no
        # other test uses (a dropped result of the same size would be reused, touched)
        touchers = [t for t in threading.enumerate()
                    if t not in before and t.name.startswith("distmm-touch")]
        assert len(touchers) == 2
        time.sleep(0.3)
        assert all(t.is_alive() for t in touchers)  # waiting: the work alone takes < 0.1 s
        if can_populate:
            assert _resident_pages(c) == 0
        first.release()
        first.release()  # idempotent: the other hold still stops them
        time.sleep(0.3)
        assert all(t.is_alive() for t in touchers)
    finally:
        first.release()
        second.release()
    for t in touchers:
        t.join(30)
    assert not any(t.is_alive() for t in touchers)
    if can_populate:
        assert _resident_pages(c) == -(-c.nbytes // 4096)
    assert not c.view(np.uint8).any()  # zeros: nothing was written


def test_hold_until_a_future_holds_the_first_touch_until_it_is_done():
    """``hold_until`` (the GPU executor's cuBLAS start-up): the toucher threads wait
    while the future runs and finish once it is done; a done future holds nothing."""
    import concurrent.futures as cf
    import threading
    import time

    hostmem.hold_until(None)
    done: cf.Future = cf.Future()
    done.set_result(None)
    hostmem.hold_until(done)
    assert hostmem._resume.is_set()
    running: cf.Future = cf.Future()
    hostmem.hold_until(running)
    try:
        assert not hostmem._resume.is_set()
        before = set(threading.enumerate())
        c = hostmem.empty_host((2001, 9001), np.float32, touch_threads=2)  # a size of its own
        touchers = [t for t in threading.enumerate()
                    if t not in before and t.name.startswith("distmm-touch")]
        time.sleep(0.3)
        assert touchers and all(t.is_alive() for t in touchers)
    finally:
        running.set_result(None)
    assert hostmem._resume.is_set()
    for t in touchers:
        t.join(30)
    assert not any(t.is_alive() for t in touchers)
    assert not c.view(np.uint8).any()
