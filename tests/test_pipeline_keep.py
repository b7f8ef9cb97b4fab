"""The pipeline's device pool kept between products (distmm.executor.pipeline.keep): taken by
the next product within the window, freed once after it (on another thread), freed at once
with 0 or when a pool is kept already, and never read while being freed. Real threads and
timers; the pools are stand-ins that record how they are freed (no GPU here)."""
from __future__ import annotations

import threading
import time

import pytest

from distmm.executor.pipeline import keep


class Pool:
    """A device pool that records each free: the thread and the time it ended."""

    def __init__(self, device_id=0, free_seconds=0.0):
        self.device_id = device_id
        self.free_seconds = free_seconds
        self.freed: list = []
        self.bound: list = []

    def bind_thread(self):
        self.bound.append(threading.current_thread().name)

    def release(self):
        time.sleep(self.free_seconds)
        self.freed.append((threading.current_thread().name, time.monotonic()))


@pytest.fixture(autouse=True)
def empty_keep():
    yield
    for device_id in range(4):  # no pool or timer outlives its test
        pool = keep.take(device_id)
        if pool is not None:
            pool.release()
    keep.drain()


def test_the_next_product_takes_the_kept_pool_unfreed():
    pool = Pool()
    keep.give(pool, 5.0)
    assert keep.take(1) is None          # another GPU's product makes its own
    assert keep.take(0) is pool
    assert keep.take(0) is None          # taken once
    time.sleep(0.05)
    assert pool.freed == []              # its timer was cancelled


def test_a_pool_nobody_takes_is_freed_once_after_the_window_off_the_callers_thread():
    pool = Pool()
    given = time.monotonic()
    keep.give(pool, 0.1)
    deadline = time.monotonic() + 10  # the timer's thread, late on a loaded machine
    while not pool.freed and time.monotonic() < deadline:
        time.sleep(0.02)
    keep.drain()
    assert len(pool.freed) == 1
    thread, at = pool.freed[0]
    assert thread != threading.current_thread().name and pool.bound == [thread]
    assert at - given >= 0.1
    assert keep.take(0) is None


def test_zero_seconds_frees_at_once_and_keeps_nothing():
    pool = Pool()
    keep.give(pool, 0)
    keep.drain()
    assert len(pool.freed) == 1
    assert keep.take(0) is None


def test_one_pool_is_kept_a_gpu_and_a_second_is_freed():
    first, second, other = Pool(0), Pool(0), Pool(1)
    keep.give(first, 5.0)
    keep.give(second, 5.0)
    keep.give(other, 5.0)
    keep.drain()
    assert len(second.freed) == 1 and first.freed == [] and other.freed == []
    assert keep.take(0) is first and keep.take(1) is other


def test_take_waits_for_a_pool_being_freed():
    """A budget read after ``take`` must see the freed memory: ``take`` returns only once
    a pool being freed is free."""
    pool = Pool(free_seconds=0.3)
    keep.give(pool, 0)
    assert keep.take(0) is None
    assert len(pool.freed) == 1


def test_a_pool_taken_as_its_window_ends_is_not_freed_under_the_product():
    """The timer fires while a product takes the pool: one of the two wins, and a pool
    in a product's hands is never freed."""
    for _ in range(20):
        pool = Pool()
        keep.give(pool, 0.01)
        time.sleep(0.01)
        taken = keep.take(0)
        keep.drain()
        if taken is pool:
            time.sleep(0.02)
            assert pool.freed == []
        else:
            assert taken is None and len(pool.freed) == 1
