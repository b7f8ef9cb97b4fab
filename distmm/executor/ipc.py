"""CUDA IPC: a cupy array handed to another process on the same host, device to device.

This module covers: ``export`` (a cupy array copied into a dedicated device
allocation and described by a small picklable ``Shared``: the allocation's
CUDA IPC handle, shape, dtype, the device's PCI bus id, the exporting
process and host), ``open_copy`` (in another process: the handle opened, the
bytes copied into a fresh array on this process's current device, the handle
closed), ``local_array`` (the exporting process's own view of a live export,
for a caller that fetches it some other way), ``map_export``/``unmap`` (a
mapping to copy pieces from, ended at once or on a closing thread:
``unmap_later``; both through the driver's entry points, which let other Python
threads run meanwhile, where a context is current), the probe helpers that check
the route between processes once (``probe_export``, ``probe_open``,
``probe_release``), and ``available``.
It does *not* cover: which arrays are exported, to whom, or what happens when
opening fails (``distmm.engine.dask`` decides and falls back to its own
transfers); it knows nothing of Dask. cupy is imported inside the functions,
so importing this module needs no GPU.

Where the exported bytes live
-----------------------------
``cudaIpcGetMemHandle`` describes the whole ``cudaMalloc`` allocation a
pointer lies in, and the opening process gets that allocation's base. A cupy
array from cupy's memory pool lies at some offset inside a pool chunk that
other arrays may share. So ``export`` finds the allocation's base
(``cuMemGetAddressRange``) and exports the array's own memory, with the
array's byte offset in ``Shared.offset`` (no copy, no new allocation). Where
that cannot be done (an array that is not C-contiguous, memory from a
``cudaMallocAsync`` pool, which the legacy IPC calls refuse, or no driver
entry point) it copies the array into a ``cupy.cuda.Memory`` of exactly its
size (offset 0). Either way the current stream is synchronised before the
handle is taken: the consumer, in another process, has no stream order with
this one. The direct form exists because the copy path's ``cudaMalloc``, copy
and synchronisation lie on the critical path of every product.

Lifetime
--------
The exported memory (the array itself, or its copy) lives exactly as long as
the exporting process holds
the ``Shared`` object ``export`` returned (it keeps the allocation; its
pickled form carries only the small fields, never the array, and an unpickled
``Shared`` keeps nothing alive). When ``distributed`` stores an export task's
result on the owner worker, the allocation therefore lives as long as dask
keeps that key: dask releases it once its dependents (the tasks that open it)
have run, and each of those has finished copying from it before it returns
and ends its mapping then or right after (``unmap_later``: a closing thread, since
ending a mapping waits for the device's queued work), so no consumer reads a
mapping when the allocation is freed. A ``Shared`` that
``distributed`` spilled to disk and read back in the exporting process has
lost its allocation: it is marked ``gone`` there, and opening it anywhere
raises ``IPCError``. Opening a handle whose allocation was freed after the
reader received it is undefined in CUDA; the lifetime above is what rules it
out (a spill of the exporter's object between a reader receiving it and
opening it would not be: ``distributed`` spills by host bytes, least recently
used first, and the object reports a few hundred).

A worker whose host buffer outgrows its limit (device chunks spilled to the
host land there) writes its export tasks' results to disk, least recently used
first, whatever their size; read back they have lost their allocations, and the
readers fail. So a caller that knows when an export's key is released may ``hold`` the
export beyond its ``Shared`` (``release`` ends it): ``distmm.engine.dask``
does, from a worker plugin that sees the key's release.

Same-process and same-host checks
---------------------------------
A CUDA IPC handle cannot be opened in the process that made it, and means
nothing on another host. ``Shared`` carries a random token of the exporting
process (pids repeat across containers) and the host's identity (host name
and boot id): the exporting process gets its own array back without any
CUDA call, another host gets ``IPCError`` before any CUDA call.
"""
from __future__ import annotations

import os
import socket
import threading
import uuid
import weakref

import numpy as np

__all__ = ["Shared", "IPCError", "export", "open_copy", "local_array", "available",
           "probe_export", "probe_open", "probe_release", "host_identity", "PROCESS",
           "LAZY_PEER_ACCESS", "hold", "release", "held", "map_export", "unmap", "copy_rect",
           "current_context", "unmap_later", "closing"]

#: this process's identity in ``Shared`` (random: pids repeat across containers)
PROCESS = uuid.uuid4().hex

#: ``cudaIpcMemLazyEnablePeerAccess``: a handle of another device maps through peer access
LAZY_PEER_ACCESS = 1

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified addresses

_LIVE: dict[str, weakref.ref] = {}  # token -> the live export's allocation (exporting process)
_LIVE_LOCK = threading.Lock()
_PROBES: dict[str, "Shared"] = {}  # exports made by probe_export, kept until probe_release


class IPCError(RuntimeError):
    """A device buffer could not be exported or opened through CUDA IPC (no
    cupy or device, another host, a device this process does not see, a
    handle the driver refused, or an export no longer alive). The message
    says which."""


def host_identity() -> str:
    """This host's identity: its name and the kernel's boot id (two
    containers of one host share the boot id; two hosts named alike do not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


_HOST = host_identity()


class _Allocation:
    """The exporting process's dedicated allocation and the array over it."""

    __slots__ = ("memory", "array", "__weakref__")  # memory: None when array is the export

    def __init__(self, memory, array):
        self.memory, self.array = memory, array


class Shared:
    """A device array exported through CUDA IPC: small and picklable.

    ``handle`` (64 bytes, None for an empty array), ``shape``, ``dtype``,
    ``pci_bus_id`` of the exporting device, ``pid`` and ``process`` (the
    exporting process's pid and random token), ``host`` (``host_identity()``),
    ``token`` (this export's id), ``nbytes``, and ``offset`` (bytes from the base of the
    allocation the handle maps to the array's first element). In the exporting process the
    object also holds the allocation (see the module docstring); pickling
    drops it.
    """

    __slots__ = ("handle", "shape", "dtype", "pci_bus_id", "pid", "process", "host", "token",
                 "nbytes", "gone", "offset", "_alloc")

    def __init__(self, handle, shape, dtype, pci_bus_id, pid, process, host, token,
                 alloc=None, gone=False, offset=0):
        self.handle = handle
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.pci_bus_id = pci_bus_id
        self.pid, self.process, self.host, self.token = int(pid), process, host, token
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.offset = int(offset)
        self._alloc = alloc
        # read back in the exporting process with its allocation freed (spilled and
        # unspilled): say so to every later reader instead of handing out a dead handle
        self.gone = bool(gone) or (alloc is None and handle is not None and self.local
                                   and _live(token) is None)

    def __reduce__(self):
        return (Shared, (self.handle, self.shape, self.dtype.str, self.pci_bus_id, self.pid,
                         self.process, self.host, self.token, None, self.gone, self.offset))

    def __sizeof__(self) -> int:  # the host bytes this object holds, not the device's
        return 256

    @property
    def local(self) -> bool:
        """Whether this is the exporting process."""
        return self.process == PROCESS and self.host == _HOST

    def __repr__(self):
        return (f"Shared({self.shape}, {self.dtype}, device {self.pci_bus_id}, pid {self.pid}, "
                f"{self.nbytes} bytes)")


def _cupy():
    try:
        import cupy
    except ImportError:
        raise IPCError("CUDA IPC needs cupy, which does not import here") from None
    return cupy


def available() -> bool:
    """Whether this process could export: cupy imports, a device is visible,
    and its runtime has the IPC calls (not HIP)."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        return (rt.getDeviceCount() > 0 and not getattr(rt, "is_hip", False)
                and hasattr(rt, "ipcGetMemHandle"))
    except Exception:
        return False


def _allocate(cupy, nbytes: int):
    """A dedicated ``cudaMalloc`` of ``nbytes`` (cupy's pool freed once if full)."""
    try:
        return cupy.cuda.Memory(nbytes)
    except Exception:
        cupy.get_default_memory_pool().free_all_blocks()
        return cupy.cuda.Memory(nbytes)


_HANDLE_TYPE: list = []  # [ctypes' CUipcMemHandle structure], made on first use


def _handle_type():
    import ctypes

    if not _HANDLE_TYPE:
        _HANDLE_TYPE.append(type("CUipcMemHandle", (ctypes.Structure,),
                                 {"_fields_": [("reserved", ctypes.c_char * 64)]}))
    return _HANDLE_TYPE[0]


def _handle_struct(handle: bytes):
    """``handle`` (64 bytes) as a ``CUipcMemHandle``, passed by value."""
    import ctypes

    out = _handle_type()()
    ctypes.memmove(ctypes.addressof(out), handle, 64)
    return out


_DRIVER: list = []  # [a namespace of libcuda's entry points, or None], loaded once


def _driver():
    """The driver entry points this module calls through ``ctypes`` (which lets other
    Python threads run during each call, where cupy's IPC calls hold the interpreter
    lock): ``range`` (``cuMemGetAddressRange``), ``open``/``close``
    (``cuIpcOpenMemHandle``/``cuIpcCloseMemHandle``), ``current``/``set_current``
    (``cuCtxGetCurrent``/``cuCtxSetCurrent``); None without a driver library."""
    import ctypes

    from distmm.executor import driver

    if not _DRIVER:
        u64, ptr = ctypes.c_uint64, ctypes.POINTER
        fns = {"range": ("cuMemGetAddressRange_v2", [ptr(u64), ptr(ctypes.c_size_t), u64]),
               "open": ("cuIpcOpenMemHandle_v2", [ptr(u64), _handle_type(), ctypes.c_uint]),
               "close": ("cuIpcCloseMemHandle", [u64]),
               "current": ("cuCtxGetCurrent", [ptr(ctypes.c_void_p)]),
               "set_current": ("cuCtxSetCurrent", [ctypes.c_void_p])}
        _DRIVER.append(driver.entries(fns))
    return _DRIVER[0]


def current_context():
    """The CUDA context current on this thread (an int), or None (no driver, or none
    current)."""
    import ctypes

    drv = _driver()
    if drv is None:
        return None
    ctx = ctypes.c_void_p(0)
    if drv.current(ctypes.byref(ctx)) != 0 or not ctx.value:
        return None
    return int(ctx.value)


def _allocation_base(ptr: int):
    """``(base, size)`` of the ``cudaMalloc`` allocation holding device pointer ``ptr``
    (the driver's ``cuMemGetAddressRange``), or None where that cannot be told."""
    import ctypes

    drv = _driver()
    if drv is None:
        return None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if drv.range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value), int(size.value)


def _direct_handle(cupy, array):
    """``(handle, offset)`` exporting ``array``'s own memory, or None (not
    C-contiguous, no base found, or a pool the IPC calls refuse)."""
    if not array.flags.c_contiguous:
        return None
    found = _allocation_base(int(array.data.ptr))
    if found is None:
        return None
    base, size = found
    offset = int(array.data.ptr) - base
    if offset < 0 or offset + array.nbytes > size:
        return None
    try:
        return cupy.cuda.runtime.ipcGetMemHandle(base), offset
    except Exception:  # e.g. cudaMallocAsync memory: the copy path exports it
        return None


def export(array, *, token: str | None = None) -> Shared:
    """Export a cupy array of this process's device through CUDA IPC.

    The array's own memory is exported where it can be (the module docstring
    says when it cannot), else a C-contiguous copy in a dedicated allocation;
    the returned ``Shared`` keeps it alive in this process (module docstring:
    lifetime), so a direct export must not be written to while it is open
    elsewhere. ``token``: the export's id (default: a fresh
    random one). Raises ``IPCError`` for anything but a cupy array, or when the
    allocation or the handle fails.
    """
    cupy = _cupy()
    if not isinstance(array, cupy.ndarray):
        raise IPCError(f"only cupy arrays are exported through CUDA IPC, got "
                       f"{type(array).__module__}.{type(array).__name__}")
    rt = cupy.cuda.runtime
    token = token or uuid.uuid4().hex
    memory, offset = None, 0
    try:
        with array.device:
            device = int(array.device.id)
            bus = rt.deviceGetPCIBusId(device)
            if array.size == 0:
                return Shared(None, array.shape, array.dtype, bus, os.getpid(), PROCESS, _HOST,
                              token)
            direct = _direct_handle(cupy, array)
            if direct is not None:
                (handle, offset), dst = direct, array
            else:
                memory = _allocate(cupy, array.nbytes)
                dst = cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))
                dst[...] = array  # one copy kernel, any strides
                handle = rt.ipcGetMemHandle(memory.ptr)
            cupy.cuda.get_current_stream().synchronize()  # before anyone gets the handle
    except IPCError:
        raise
    except Exception as exc:
        raise IPCError(f"exporting a {array.shape} {array.dtype} array failed: "
                       f"{type(exc).__name__}: {exc}") from exc
    alloc = _Allocation(memory, dst)
    with _LIVE_LOCK:
        _LIVE[token] = weakref.ref(alloc, lambda _ref, t=token: _LIVE.pop(t, None))
    return Shared(bytes(handle), array.shape, array.dtype, bus, os.getpid(), PROCESS, _HOST,
                  token, alloc, offset=offset)


_HELD: dict = {}  # token -> an export's allocation kept alive beyond its Shared (hold/release)


def hold(shared: "Shared") -> None:
    """Keep ``shared``'s allocation alive (in the exporting process) until
    ``release(shared.token)``, whatever happens to the ``Shared`` object itself
    (a spill to disk drops it; read back, it finds the allocation by its token)."""
    alloc = shared._alloc
    if alloc is not None:
        with _LIVE_LOCK:
            _HELD[shared.token] = alloc


def release(token: str) -> bool:
    """End a ``hold``: True when one was held (the allocation is freed once no
    ``Shared`` holds it either)."""
    with _LIVE_LOCK:
        return _HELD.pop(token, None) is not None


def held() -> int:
    """How many exports ``hold`` keeps in this process."""
    with _LIVE_LOCK:
        return len(_HELD)


def _live(token: str):
    """This process's live allocation of export ``token``, or None."""
    with _LIVE_LOCK:
        ref = _LIVE.get(token)
    return ref() if ref is not None else None


def local_array(shared):
    """In the exporting process: the live export's array (no copy), by its
    ``Shared`` or its token; ``IPCError`` when it is no longer alive or was
    exported by another process."""
    if isinstance(shared, Shared):
        if not shared.local:
            raise IPCError(f"{shared!r} was exported by another process")
        if shared.handle is None:
            return _cupy().empty(shared.shape, shared.dtype)
        alloc, token = shared._alloc, shared.token
    else:
        alloc, token = None, str(shared)
    if alloc is None:
        alloc = _live(token)
    if alloc is None:
        raise IPCError(f"export {token}: no longer alive in this process (its allocation was "
                       "freed, e.g. after its holder spilled it)")
    return alloc.array


def open_copy(shared: Shared, *, copy: bool = True):
    """The exported array as a fresh cupy array on this process's current device.

    In the exporting process: a copy of its own array (``copy=False``: the
    array itself, to be read only). In another process of the same host: the
    handle opened (peer access enabled lazily when the export is on another
    device), one device-to-device (or peer) copy, the handle closed before
    returning. Raises ``IPCError`` on another host, a device this process
    does not see, or any CUDA error.
    """
    if not isinstance(shared, Shared):
        raise IPCError(f"not an exported array: {type(shared).__name__}")
    if shared.local:
        arr = local_array(shared)
        return arr.copy() if copy else arr
    if shared.handle is None:
        return _cupy().empty(shared.shape, shared.dtype)
    ptr = map_export(shared)  # checks the host and the device before any CUDA call
    cupy = _cupy()
    try:
        out = cupy.empty(shared.shape, shared.dtype)
        stream = cupy.cuda.get_current_stream()
        kind = getattr(cupy.cuda.runtime, "memcpyDefault", _MEMCPY_DEFAULT)
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, ptr + shared.offset, shared.nbytes, kind,
                                      stream.ptr)
        stream.synchronize()  # the copy is done before the mapping goes
    except Exception as exc:
        raise IPCError(f"opening {shared!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        unmap(ptr)
    return out


def map_export(shared: Shared) -> int:
    """Map another process's export (same host) into this process: the device
    pointer of the allocation's base (the array starts ``shared.offset`` bytes
    in), valid until ``unmap``. A handle this process has mapped already is
    mapped again by reference count (the driver returns the same pointer). Peer
    access is enabled lazily when the export lives on another device. ``IPCError``
    on another host, an empty export, a device this process does not see, or a
    CUDA error."""
    if shared.local or shared.handle is None:
        raise IPCError(f"{shared!r}: only another process's non-empty export is mapped")
    if shared.gone:
        raise IPCError(f"{shared!r}: its exporting process freed the allocation (the "
                       "export was spilled and read back)")
    if shared.host != _HOST:
        raise IPCError(f"{shared!r} was exported on host {shared.host!r}, this is {_HOST!r}: "
                       "CUDA IPC works only between processes of one host")
    rt = _cupy().cuda.runtime
    try:
        rt.deviceGetByPCIBusId(shared.pci_bus_id)
    except Exception as exc:
        raise IPCError(f"{shared!r}: device {shared.pci_bus_id} is not visible in this process "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                       f"{exc}") from exc
    if current_context() is not None:  # the driver's call: other threads run meanwhile
        import ctypes

        out = ctypes.c_uint64(0)
        status = _driver().open(ctypes.byref(out), _handle_struct(shared.handle),
                                LAZY_PEER_ACCESS)
        if status != 0:
            raise IPCError(f"opening {shared!r} failed: CUDA driver error {status}")
        return int(out.value)
    try:
        return int(rt.ipcOpenMemHandle(shared.handle, LAZY_PEER_ACCESS))
    except Exception as exc:
        raise IPCError(f"opening {shared!r} failed: {type(exc).__name__}: {exc}") from exc


def unmap(ptr: int, context=None) -> None:
    """End a ``map_export`` (after every copy from it has finished). The driver may wait
    for the device to finish its queued work first; other Python threads run meanwhile
    where the driver's entry point is at hand. ``context``: the CUDA context the mapping
    was made in (``current_context()`` there), for a thread that did not make it."""
    drv = _driver()
    if drv is not None and (context is not None or current_context() is not None):
        if context is not None:
            drv.set_current(context)
        status = drv.close(ptr)
        if status != 0:
            raise IPCError(f"closing the mapping at {ptr:#x} failed: CUDA driver error {status}")
        return
    _cupy().cuda.runtime.ipcCloseMemHandle(ptr)


_CLOSER: list = []  # [the closing thread's queue], started on first use
_CLOSING = [0]  # mappings handed to the closing thread and not yet ended
_CLOSER_LOCK = threading.Condition()


def unmap_later(ptrs) -> None:
    """End ``map_export`` mappings on this process's closing thread, once the work queued on
    the current stream so far has finished (every copy from them must be queued there or
    have finished before the call): ending a mapping waits for the device's queued
    work, and other threads' CUDA calls wait meanwhile, so the closing thread first waits
    for that work on an event (which holds nothing) and the caller does not wait at all.
    Without the driver's entry points or a current context they end here."""
    ptrs = [int(p) for p in ptrs]
    if not ptrs:
        return
    ctx = current_context()
    if ctx is None:
        for ptr in ptrs:
            unmap(ptr)
        return
    import queue

    done = _cupy().cuda.get_current_stream().record()
    with _CLOSER_LOCK:
        if not _CLOSER:
            _CLOSER.append(queue.SimpleQueue())
            threading.Thread(target=_close_loop, args=(_CLOSER[0],), name="distmm-ipc-close",
                             daemon=True).start()
        _CLOSING[0] += len(ptrs)
    _CLOSER[0].put((ctx, done, ptrs))


def _close_loop(todo) -> None:
    import logging

    while True:
        ctx, done, ptrs = todo.get()
        try:
            done.synchronize()
        except Exception:  # noqa: BLE001 -- a failed device: the close below says so
            pass
        for ptr in ptrs:
            try:
                unmap(ptr, ctx)
            except Exception as exc:  # noqa: BLE001 -- a leaked mapping, not a wrong result
                logging.getLogger("distmm.executor.ipc").warning(
                    "distmm: ending a CUDA IPC mapping failed: %s", exc)
            with _CLOSER_LOCK:
                _CLOSING[0] -= 1
                _CLOSER_LOCK.notify_all()


def closing(wait: float = 0.0) -> int:
    """Mappings handed to ``unmap_later`` and not yet ended, after waiting up to ``wait``
    seconds for none to be left."""
    with _CLOSER_LOCK:
        _CLOSER_LOCK.wait_for(lambda: _CLOSING[0] == 0, timeout=wait)
        return _CLOSING[0]


def copy_rect(ptr: int, shared: Shared, dst, r0: int, c0: int, stream=None) -> int:
    """Queue the copy of rows ``r0:r0 + dst.shape[0]``, columns ``c0:c0 +
    dst.shape[1]`` of a mapped export (``map_export``'s ``ptr``; the export is
    C-ordered, ``shared.shape[1]`` elements a row) into ``dst``, a 2-D view whose
    rows are contiguous (any row pitch), on ``stream`` (default: cupy's current
    one), by the copy engines: one device-to-device or peer copy, no staging.
    Returns the bytes copied. The caller synchronises before ``unmap``."""
    cupy = _cupy()
    rows, cols = dst.shape
    isz = np.dtype(shared.dtype).itemsize
    if (np.dtype(dst.dtype) != np.dtype(shared.dtype) or dst.ndim != 2
            or (rows > 1 and dst.strides[0] % isz) or (cols > 1 and dst.strides[1] != isz)
            or r0 + rows > shared.shape[0] or c0 + cols > shared.shape[1]):
        raise IPCError(f"{shared!r}: cannot copy rows {r0}+{rows}, columns {c0}+{cols} into a "
                       f"{dst.dtype} array of strides {dst.strides}")
    if rows == 0 or cols == 0:
        return 0
    stream = stream or cupy.cuda.get_current_stream()
    pitch = shared.shape[1] * isz
    kind = getattr(cupy.cuda.runtime, "memcpyDefault", _MEMCPY_DEFAULT)
    cupy.cuda.runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0] if rows > 1 else cols * isz,
                                    ptr + shared.offset + r0 * pitch + c0 * isz, pitch,
                                    cols * isz, rows, kind,
                                    stream.ptr)
    return rows * cols * isz


# -- probes: does the route work between two processes? -----------------------------------

_PROBE_ELEMENTS = 4099  # odd, not a multiple of any tile


def _pattern(token: str, n: int = _PROBE_ELEMENTS) -> np.ndarray:
    """The probe's values, derived from its token: a mapping of anything else fails the check."""
    seed = int(token[:8], 16)
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) & 0xFFFFFFFF).astype(np.uint32)


def probe_export() -> Shared:
    """Export a small array of known values and keep it until ``probe_release``."""
    cupy = _cupy()
    token = uuid.uuid4().hex  # the pattern's seed travels as the export's token
    shared = export(cupy.asarray(_pattern(token)), token=token)
    _PROBES[token] = shared
    return shared


def probe_open(shareds) -> dict:
    """Open each of ``shareds`` (name -> ``Shared`` from ``probe_export``) and
    compare with the values it was made from: name -> ``True``, or the error
    as a string."""
    out = {}
    for name, shared in dict(shareds).items():
        try:
            got = open_copy(shared)
            ok = np.array_equal(got.get(), _pattern(shared.token))
            out[name] = True if ok else "the opened bytes differ from the exported ones"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def probe_release(tokens=None) -> int:
    """Free this process's probe exports (``tokens``: only those among them); returns how
    many were freed."""
    if tokens is None:
        n = len(_PROBES)
        _PROBES.clear()
        return n
    return sum(_PROBES.pop(t, None) is not None for t in tokens)
