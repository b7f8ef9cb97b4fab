"""Tensor maps for the copy engine (TMA) and the launch of kernels that take them.

This module covers: describing a 2-D matrix of 16- or 32-bit elements to the driver
(``cuTensorMapEncodeTiled``: the 128 opaque bytes of a ``CUtensorMap``, 128-byte swizzle,
zero fill outside the matrix), whether an operand can be so described (``eligible``), the
box each operand of step 14 is copied in (``box_for``), and launching a kernel whose
parameters include such maps by value (``launch``: ``cuLaunchKernel`` with a parameter
array; cupy's kernel call passes arrays and scalars only).
It does *not* cover: choosing or compiling kernels (``distmm.executor.cuda_loader``).

The driver is reached through ``distmm.executor.driver`` (ctypes on ``libcuda.so.1``); cupy's
driver module has no binding for the tensor-map call.
"""
from __future__ import annotations

import ctypes

__all__ = ["eligible", "box_for", "encode_2d", "launch", "TMAP_BYTES"]

TMAP_BYTES = 128  # sizeof(CUtensorMap)
#: CU_TENSOR_MAP_DATA_TYPE_UINT16 / _UINT32 by element size: only the bits are copied
_DATA_TYPE = {2: 1, 4: 2}
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_OOB_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros outside the matrix
_ROW_BYTES = 128  # a box's inner dimension: the swizzle's row

_ENTRIES: list = []  # [the two entry points, or None], typed once


def _lib():
    """The driver's ``encode`` (``cuTensorMapEncodeTiled``) and ``launch``
    (``cuLaunchKernel``), or None where the driver library does not load."""
    from distmm.executor import driver

    if not _ENTRIES:
        u32, u64, vp, i = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        uint = ctypes.c_uint
        _ENTRIES.append(driver.entries({
            "encode": ("cuTensorMapEncodeTiled", [
                vp, i, u32, vp, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                ctypes.POINTER(u32), i, i, i, i]),
            "launch": ("cuLaunchKernel", [
                vp, uint, uint, uint, uint, uint, uint, uint, vp, ctypes.POINTER(vp),
                ctypes.POINTER(vp)])}))
    return _ENTRIES[0]


def eligible(ptr: int, rows: int, cols: int, ld: int, itemsize: int = 2) -> bool:
    """Whether a row-major ``rows x cols`` matrix at device address ``ptr`` with row stride
    ``ld`` elements can be described by a tensor map: a 16-byte aligned base, a row stride
    that is a multiple of 16 bytes and below 2^40, and no empty dimension.

    >>> eligible(4096, 100, 64, 64), eligible(4096, 100, 63, 63), eligible(4098, 8, 8, 8)
    (True, False, False)
    """
    return (rows > 0 and cols > 0 and ptr % 16 == 0 and (ld * itemsize) % 16 == 0
            and ld >= cols and ld * itemsize < 2**40 and max(rows, cols) < 2**31)


def box_for(kmajor: bool, tile_rows: int, itemsize: int = 2) -> tuple[int, int]:
    """The box (inner elements, rows) an operand is copied in by steps 14 and 15: a k-major
    operand (A stored M x K, B stored N x K) in one box of ``tile_rows`` rows (BM or BN) of
    a 128-byte row of k (64 16-bit elements, 32 of 32 bits); an mn-major one in boxes of 64 k
    rows of a 128-byte row of m or n.

    >>> box_for(True, 256), box_for(False, 128), box_for(True, 256, 4)
    ((64, 256), (64, 64), (32, 256))
    """
    inner = _ROW_BYTES // itemsize
    return (inner, tile_rows) if kmajor else (inner, 64)


def encode_2d(ptr: int, rows: int, cols: int, ld: int, box: tuple[int, int],
              itemsize: int = 2) -> bytes:
    """The ``CUtensorMap`` of a row-major ``rows x cols`` matrix of ``itemsize``-byte
    elements (2 or 4) at device address ``ptr`` (row stride ``ld`` elements), copied in
    boxes of ``box`` = (inner elements, rows), 128-byte swizzled, zeros outside the matrix.

    Raises
    ------
    ValueError
        The matrix is not ``eligible``.
    RuntimeError
        No driver library, or the driver refused the description (its error code).
    """
    if itemsize not in _DATA_TYPE:
        raise ValueError(f"tensor maps here take 2- or 4-byte elements, not {itemsize}")
    if not eligible(ptr, rows, cols, ld, itemsize):
        raise ValueError(f"a tensor map needs a 16-byte aligned base and row stride: got "
                         f"address {ptr:#x}, {rows}x{cols}, row stride {ld} elements")
    lib = _lib()
    if lib is None:
        raise RuntimeError("no CUDA driver library (libcuda.so.1) to encode a tensor map")
    out = (ctypes.c_uint8 * (TMAP_BYTES + 64))()  # aligned to 64 bytes below
    base = ctypes.addressof(out)
    aligned = (base + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(ld * itemsize)
    boxes = (ctypes.c_uint32 * 2)(*box)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    err = lib.encode(ctypes.c_void_p(aligned), _DATA_TYPE[itemsize], 2, ctypes.c_void_p(ptr), dims, strides,
                     boxes, steps, 0, _SWIZZLE_128B, _L2_256B, _OOB_ZERO)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for {rows}x{cols}, "
                           f"row stride {ld}, box {box}")
    return ctypes.string_at(aligned, TMAP_BYTES)


def launch(function_ptr: int, grid: tuple[int, int, int], block: tuple[int, int, int],
           shared_mem: int, stream_ptr: int, args) -> None:
    """``cuLaunchKernel`` of the loaded kernel ``function_ptr`` with ``args``: ctypes scalars
    (``c_int``, ``c_float``, ``c_longlong``, ``c_uint64`` for device pointers) or ``bytes``
    (a struct passed by value, such as a tensor map); the driver copies each into the
    kernel's parameter space, at the offset and alignment the kernel declares."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("no CUDA driver library (libcuda.so.1) to launch with")
    held = []  # keeps every argument's storage alive through the call
    for a in args:
        held.append(ctypes.create_string_buffer(a, len(a)) if isinstance(a, bytes) else a)
    params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                                             for h in held])
    err = lib.launch(ctypes.c_void_p(function_ptr), *grid, *block, shared_mem,
                     ctypes.c_void_p(stream_ptr), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel failed (CUresult {err})")
