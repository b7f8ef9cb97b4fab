"""Streams made at the device's greatest priority (``distmm.executor.streams``): the
debug switch on the CPU; on a GPU, the streams of NCCL's broadcasts and of a block
task's copies."""
from __future__ import annotations

import dask.config
import pytest

from distmm.executor.streams import PRIORITY_KEY, priority_wanted


@pytest.mark.parametrize("value, wanted", [(None, True), (True, True), (False, False),
                                           ("false", False), ("off", False), ("0", False),
                                           ("true", True), ("yes", True)])
def test_the_debug_switch_reads_booleans_and_their_spellings(value, wanted):
    if value is None:
        assert priority_wanted() is True
        return
    with dask.config.set({PRIORITY_KEY: value}):
        assert priority_wanted() is wanted


def _priority(stream) -> int:
    import cupy

    return int(cupy.cuda.runtime.streamGetPriority(stream.ptr))


@pytest.mark.gpu
def test_urgent_streams_take_the_greatest_priority_unless_switched_off():
    import cupy

    from distmm.executor.streams import urgent_stream

    # the driver's range on every GPU distmm runs on has more than one level: the greatest
    # is below 0, the default; asking for one past it gives it
    greatest = _priority(urgent_stream())
    assert greatest < 0
    assert _priority(cupy.cuda.Stream(non_blocking=True, priority=greatest)) == greatest
    assert _priority(cupy.cuda.Stream(non_blocking=True, priority=greatest - 1)) == greatest
    with dask.config.set({PRIORITY_KEY: False}):
        assert _priority(urgent_stream()) == 0
    s = urgent_stream()
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    with s:  # an ordinary stream otherwise: work queued on it runs and is ordered
        y = x * 2
    s.synchronize()
    assert float(y[-1]) == 2.0 * ((1 << 20) - 1)


@pytest.mark.gpu
def test_a_block_tasks_copy_stream_and_nccls_broadcasts_are_urgent():
    from distmm.engine.dask import blocks
    from distmm.executor.streams import urgent_stream

    greatest = _priority(urgent_stream())
    assert _priority(blocks._copy_stream()) == greatest
    mpi = pytest.importorskip("mpi4py.MPI")
    from distmm.engine.mpi.comm import NcclBroadcaster

    b = NcclBroadcaster(mpi.COMM_SELF)
    try:
        assert _priority(b.stream) == greatest
    finally:
        b.close()
