"""The pipeline's device glue: streams, events, copies and a budgeted memory pool (cupy).

This module covers: the few device operations the pipeline's run uses, behind
one small class so that tests substitute a simulated device with the same
methods. It does *not* cover: the schedule (``distmm.plan_pipeline``), the run
(``distmm.executor.pipeline.run``), or kernels (``device_gemm`` of an executor).
cupy is imported when a ``CupyDevice`` is made, not when this module is.
"""
from __future__ import annotations

import numpy as np

from distmm.executor.device import gpu_name

__all__ = ["CupyDevice", "current_device_id"]


def current_device_id() -> int:
    """The calling thread's CUDA device (cupy's current device)."""
    import cupy

    return cupy.cuda.Device().id


class CupyDevice:
    """Streams, events, copies and a memory pool limited to the budget."""

    def __init__(self, limit_bytes: int):
        import cupy

        self.cp = cupy
        self.device_id = cupy.cuda.Device().id
        self.pool = cupy.cuda.MemoryPool()
        self.pool.set_limit(size=int(limit_bytes))
        self.oom_errors = (cupy.cuda.memory.OutOfMemoryError,)
        self._rt = cupy.cuda.runtime

    @property
    def name(self) -> str:
        return gpu_name(self.device_id)

    def bind_thread(self) -> None:
        self._rt.setDevice(self.device_id)

    def alloc(self, nbytes: int):
        """Device bytes from the pool; where the device is full, cupy's default pool gives
        back its idle blocks (counted as available by ``available_bytes``) and the allocation
        is tried once more."""
        try:
            return self.pool.malloc(int(nbytes))
        except self.oom_errors:
            default = self.cp.get_default_memory_pool()
            if default.free_bytes() == 0:
                raise
            default.free_all_blocks()
            return self.pool.malloc(int(nbytes))

    def array(self, mem, shape, dtype):
        return self.cp.ndarray(shape, dtype, memptr=mem)

    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def event(self, timing: bool = False):
        # Blocking sync: host threads that wait on events sleep instead of spinning,
        # leaving the cores to the staging copies.
        return self.cp.cuda.Event(block=True, disable_timing=not timing)

    def record(self, ev, stream) -> None:
        ev.record(stream)

    def wait(self, stream, ev) -> None:
        stream.wait_event(ev)

    def sync_event(self, ev) -> None:
        ev.synchronize()

    def elapsed_ms(self, start, end) -> float:
        return self.cp.cuda.get_elapsed_time(start, end)

    def h2d(self, dst, src: np.ndarray, stream) -> None:
        self._rt.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                             self._rt.memcpyHostToDevice, stream.ptr)

    def _copy_2d(self, dst_ptr: int, dst, src_ptr: int, src, kind, stream) -> None:
        """A rectangle of rows, ``src`` and ``dst`` each with contiguous rows, any pitch."""
        self._rt.memcpy2DAsync(dst_ptr, dst.strides[0], src_ptr, src.strides[0],
                               src.shape[1] * src.itemsize, src.shape[0], kind, stream.ptr)

    def h2d_2d(self, dst, src: np.ndarray, stream) -> None:
        """A rectangle of host rows to the device."""
        self._copy_2d(dst.data.ptr, dst, src.ctypes.data, src, self._rt.memcpyHostToDevice,
                      stream)

    def d2h_2d(self, dst: np.ndarray, src, stream) -> None:
        """A rectangle of device rows to host rows (a column range of ``out``)."""
        self._copy_2d(dst.ctypes.data, dst, src.data.ptr, src, self._rt.memcpyDeviceToHost,
                      stream)

    def d2h(self, dst: np.ndarray, src, stream) -> None:
        self._rt.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                             self._rt.memcpyDeviceToHost, stream.ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Page-lock host memory in place (``cudaHostRegister``) for copies to and from it."""
        self._rt.hostRegister(ptr, nbytes, 0)

    def host_unregister(self, ptr: int) -> None:
        self._rt.hostUnregister(ptr)

    def host_is_locked(self, ptr: int, nbytes: int) -> bool:
        """Whether host bytes ``[ptr, ptr + nbytes)`` are page-locked already (their first and
        last byte known to CUDA as host memory: ``cudaHostAlloc``'s or registered)."""
        host = getattr(self._rt, "memoryTypeHost", 1)
        try:
            return all(self._rt.pointerGetAttributes(p).type == host
                       for p in (ptr, ptr + nbytes - 1))
        except self._rt.CUDARuntimeError:
            return False

    def synchronize(self) -> None:
        self.cp.cuda.Device(self.device_id).synchronize()

    def available_bytes(self) -> int:
        """Free device bytes, with the idle blocks of cupy's default pool and of this pool
        (kept from an earlier product): ``alloc`` frees the former only if it must. Freeing
        them up front made each product's first ~20 ms of copies run at half rate (the
        driver's work on freed memory; bench/research/fresh_memory.py)."""
        free, _total = self._rt.memGetInfo()
        return (int(free) + int(self.cp.get_default_memory_pool().free_bytes())
                + int(self.pool.free_bytes()))

    def release(self) -> None:
        self.pool.free_all_blocks()
