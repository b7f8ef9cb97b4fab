"""The stream pipeline on a real GPU: host, memmap and zarr operands against numpy,
products several times the device budget, the out-of-memory retry, pinned memory
returned on close, and the timeline."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from distmm.executor.pinned import PinnedPool  # noqa: E402
from distmm.executor.cublas import CublasGemm  # noqa: E402
from distmm.executor.gpu import matmul_to  # noqa: E402
from distmm.executor.pipeline import Timeline, run_pipelined  # noqa: E402
from distmm.plan import make_plan, result_dtype  # noqa: E402


def _executors():
    out = [pytest.param(CublasGemm, id="cublas-adapter")]
    try:
        from distmm.executor.gpu import GPUExecutor
    except ImportError:
        return out
    if hasattr(GPUExecutor, "device_gemm"):
        out.append(pytest.param(lambda: GPUExecutor(backend="cublas"), id="gpu-executor-cublas"))
        out.append(pytest.param(lambda: GPUExecutor(backend="raw"), id="gpu-executor-raw"))
    return out


@pytest.fixture(params=_executors())
def executor(request):
    ex = request.param()
    yield ex
    close = getattr(ex, "close", None)
    if close:
        close()


def rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def run(executor, a, b, out=None, **kw):
    m, k = a.shape
    n = b.shape[1]
    dtype = result_dtype(a.dtype, b.dtype)
    if out is None:
        out = np.full((m, n), np.nan, dtype=dtype)
    info = kw.pop("info", {})
    run_pipelined(executor, make_plan(m, n, k, dtype), a, b, out, info=info, **kw)
    return out, info


def check(c, a, b):
    c = np.asarray(c)
    assert np.isfinite(c).all(), "unwritten (NaN) elements in the output"
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    err = np.linalg.norm(c - ref) / np.linalg.norm(ref)
    # cuBLAS may use TF32-free FP32 or FP64 tensor cores; both stay far below these
    tol = 1e-5 if c.dtype == np.float32 else 1e-13
    assert err < tol, f"relative error {err:.3e}"


@pytest.mark.parametrize("m,n,k", [(1000, 1100, 900), (2049, 513, 1537), (1, 3000, 7), (4096, 4096, 4096)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_host_operands_match_numpy(executor, m, n, k, dtype):
    a, b = rand((m, k), dtype, m), rand((k, n), dtype, n)
    c, info = run(executor, a, b)
    check(c, a, b)
    assert info["retries"] == 0


def test_mixed_dtypes(executor):
    a = np.random.default_rng(0).integers(-9, 9, (700, 500)).astype(np.int32)
    b = rand((500, 300), "float32", 1)
    c, _ = run(executor, a, b)
    assert c.dtype == np.matmul(a[:1], b[:, :1]).dtype
    check(c, a, b)


def test_memmap_operands_and_output(executor, tmp_path):
    a, b = rand((1500, 1300), "float32", 2), rand((1300, 1700), "float32", 3)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    a_mm = np.load(tmp_path / "a.npy", mmap_mode="r")
    b_mm = np.load(tmp_path / "b.npy", mmap_mode="r")
    out = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.float32,
                                    shape=(1500, 1700))
    out[...] = np.nan
    run(executor, a_mm, b_mm, out, device_memory_limit=8 << 20)
    out.flush()
    del out
    check(np.load(tmp_path / "c.npy"), a, b)


def test_zarr_operands_and_output(executor, tmp_path):
    zarr = pytest.importorskip("zarr")
    a, b = rand((1200, 1000), "float64", 4), rand((1000, 900), "float64", 5)
    za = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=a.shape, dtype=a.dtype,
                         chunks=(300, 256))
    za[...] = a
    zb = zarr.open_array(str(tmp_path / "b.zarr"), mode="w", shape=b.shape, dtype=b.dtype,
                         chunks=(256, 300))
    zb[...] = b
    zc = zarr.open_array(str(tmp_path / "c.zarr"), mode="w", shape=(1200, 900), dtype=np.float64,
                         chunks=(256, 256), fill_value=np.nan)
    run(executor, za, zb, zc, device_memory_limit=6 << 20)
    check(zc[...], a, b)


def test_operands_several_times_the_device_budget(executor):
    n = 3000
    a, b = rand((n, n), "float64", 6), rand((n, n), "float64", 7)
    limit = 16 << 20  # A, B and C are 72 MB each: 13x the budget together
    c, info = run(executor, a, b, device_memory_limit=limit)
    check(c, a, b)
    assert info["tiling"]["device_bytes"] <= limit
    assert info["tiling"]["mode"] == "tiles"
    assert info["bytes_h2d"] > a.nbytes + b.nbytes


def test_out_of_memory_shrinks_tiles_and_retries(executor):
    a, b = rand((2500, 2300), "float32", 8), rand((2300, 2100), "float32", 9)
    # 2048-tiles need 2 x 16 MiB of C buffers alone: over a tiny 8 MiB device limit,
    # so the allocation fails for real and the pipeline must shrink and start over
    c, info = run(executor, a, b, device_memory_limit=8 << 20, tiles=(2048, 2048, 2048))
    check(c, a, b)
    assert info["retries"] >= 1
    assert info["tiling"]["tm_max"] < 2048


def test_pinned_memory_is_bounded_reused_and_returned(executor):
    pool = PinnedPool(48 << 20)
    a, b = rand((3000, 2000), "float32", 10), rand((2000, 2500), "float32", 11)
    for _ in range(2):
        c, _ = run(executor, a, b, pinned_pool=pool, device_memory_limit=32 << 20)
        check(c, a, b)
        held = pool.held_bytes
        assert 0 < held <= pool.limit and pool.peak_bytes <= pool.limit
    assert pool.in_use_bytes == 0
    pool.close()
    assert pool.held_bytes == 0


def test_matmul_to_allocates_and_traces():
    a, b = rand((4096, 3000), "float32", 12), rand((3000, 5000), "float32", 13)
    tl = Timeline()
    c = matmul_to(a, b, trace=tl, device_memory_limit=256 << 20)
    check(c, a, b)
    lanes = {o["lane"] for o in tl.ops}
    assert {"h2d", "compute", "d2h", "host-stage", "host-unstage"} <= lanes
    assert tl.meta["device"] and tl.meta["tflops"] > 0
    # copies overlap kernels: some h2d op runs while a kernel runs
    comp = [(o["start_ms"], o["end_ms"]) for o in tl.ops if o["lane"] == "compute"]
    h2d = [(o["start_ms"], o["end_ms"]) for o in tl.ops if o["lane"] == "h2d"]
    assert any(s < ce and e > cs for s, e in h2d for cs, ce in comp)


def test_unsupported_dtype(executor):
    a = np.ones((8, 8), np.int64)
    with pytest.raises(TypeError):
        run(executor, a, a)


@pytest.mark.parametrize("keep_s", [0, 30])
def test_consecutive_products_reuse_nothing_stale(keep_s):
    """Products back to back (the previous one's device pool kept and reused, or freed in
    the background) and with different shapes are each right."""
    import dask.config

    rng = np.random.default_rng(8)
    with dask.config.set({"distmm.device-keep": keep_s}):
        for m, n, k in ((3000, 2000, 2500), (2500, 3100, 1900), (3000, 2000, 2500)):
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((k, n)).astype(np.float32)
            c = matmul_to(a, b)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            assert np.linalg.norm(c - ref) / np.linalg.norm(ref) < 1e-5


def test_the_next_product_reuses_the_kept_device_pool():
    """With ``device-keep``, a product's pool is kept for the next one on the GPU, which
    allocates nothing new for the same shape; with 0 it is freed at once."""
    import dask.config

    from distmm.executor.pipeline import keep

    dev_id = cupy.cuda.Device().id
    a, b = rand((3000, 2500), "float32", 21), rand((2500, 2700), "float32", 22)
    with dask.config.set({"distmm.device-keep": 30}):
        check(matmul_to(a, b), a, b)
        kept = keep.take(dev_id)
        assert kept is not None
        held = kept.pool.total_bytes()
        assert held > 0 and kept.pool.used_bytes() == 0  # every buffer back in the pool
        keep.give(kept, 30)
        c = matmul_to(a, b)
        check(c, a, b)
        again = keep.take(dev_id)
        assert again is kept and kept.pool.total_bytes() == held
        keep.give(again, 30)
    with dask.config.set({"distmm.device-keep": 0}):
        check(matmul_to(a, b), a, b)  # takes the kept pool, then frees it
        keep.drain()
        assert keep.take(dev_id) is None and kept.pool.total_bytes() == 0


def test_warmup_pins_the_ring_and_the_next_product_reuses_it():
    import distmm
    from distmm.executor.pinned import default_pinned_pool
    from distmm.executor.warmup import RING_BUFFER_BYTES, RING_BUFFERS

    handle = distmm.warmup(background=False)
    assert handle.done and handle.error is None, handle.error
    assert set(handle.phases) >= {"context_s", "cublas_s", "device_alloc_s", "pinned_ring_s"}
    pool = default_pinned_pool()
    assert pool.held_bytes >= min(RING_BUFFERS, pool.limit // RING_BUFFER_BYTES) * RING_BUFFER_BYTES
    held = pool.held_bytes
    rng = np.random.default_rng()
    a = rng.standard_normal((3001, 2049)).astype(np.float32)
    b = rng.standard_normal((2049, 2500)).astype(np.float32)
    out = np.full((3001, 2500), np.nan, np.float32)
    plan = make_plan(3001, 2500, 2049, "float32", workers=1, tile=(3001, 2500, 2049))
    run_pipelined(CublasGemm(), plan, a, b, out)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    assert pool.held_bytes == held  # the ring the warm-up pinned was reused, not re-pinned
    second = distmm.warmup(background=True)
    second.wait(60)
    assert second.error is None


def test_registered_pinned_buffers_are_page_locked_and_copy_both_ways():
    """The default allocator's buffers (fresh huge-page memory, faulted in, then
    cudaHostRegister) are host memory the device sees as pinned; async copies through
    them round-trip the bytes; dropping the owner unregisters (the range can be
    registered again)."""
    import gc

    from distmm.executor.pinned import registered_allocator

    nbytes = (17 << 20) + 12345
    array, owner = registered_allocator(nbytes)
    assert array.nbytes == nbytes and not array.any()
    attrs = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost
    src = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)
    array[...] = src
    dev = cupy.empty(nbytes, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime
    rt.memcpyAsync(dev.data.ptr, array.ctypes.data, nbytes, rt.memcpyHostToDevice, stream.ptr)
    stream.synchronize()
    array[...] = 0
    rt.memcpyAsync(array.ctypes.data, dev.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
    stream.synchronize()
    assert np.array_equal(array, src)
    addr = array.ctypes.data
    keep = array  # the mapping stays while the array lives; only the owner goes
    del owner, array
    gc.collect()
    rt.hostRegister(addr, 2 << 20, 0)  # raises if the range were still registered
    rt.hostUnregister(addr)
    del keep


@pytest.mark.parametrize("shape,limit,bf16", [((3001, 2500, 2049), 64 << 20, False),
                                              ((5000, 777, 1500), 8 << 20, False),
                                              ((4097, 3000, 2500), 64 << 20, True)])
def test_direct_copies_between_the_device_and_the_callers_arrays(shape, limit, bf16):
    """With ``distmm-debug.pipeline-direct``: A and B copied straight from the caller's arrays
    (as their bits for bfloat16 under precision="bf16") and C straight into a plain numpy
    result and into ``empty_host``'s mapping, each page-locked in place block by block. The
    product is right, C passed through no ring, and afterwards no byte of A, B or C is still
    page-locked (a second product page-locks them again without error)."""
    import dask.config

    from distmm.executor.gpu import GPUExecutor
    from distmm.executor.hostmem import empty_host
    from distmm.executor.pipeline.product import DIRECT_KEY

    m, n, k = shape
    a, b = rand((m, k), "float32", 20), rand((k, n), "float32", 21)
    executor = CublasGemm()
    if bf16:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        a, b = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
        executor = GPUExecutor(backend="cublas", precision="bf16")
    rt = cupy.cuda.runtime
    unregistered = getattr(rt, "memoryTypeUnregistered", 0)
    for out in (np.full((m, n), np.nan, np.float32), empty_host((m, n), np.float32)):
        for _ in range(2):
            out[...] = np.nan
            tl = Timeline()
            with dask.config.set({DIRECT_KEY: True}):
                c, info = run(executor, a, b, out, trace=tl, device_memory_limit=limit)
            check(c, a, b)
            lanes = {o["lane"] for o in tl.ops}
            assert info["direct_in"] and info["direct_out"], info
            assert "d2h" in lanes and "host-unstage" not in lanes, lanes
            assert len(info["tiling"]["row_sizes"]) >= 2
            for x in (a, b, out):
                for ptr in (x.ctypes.data, x.ctypes.data + x.nbytes - 1):
                    assert rt.pointerGetAttributes(ptr).type == unregistered


@pytest.mark.parametrize("shape,limit,bf16", [((3001, 2500, 2049), 64 << 20, False),
                                              ((4097, 3000, 2500), 64 << 20, True),
                                              ((20000, 3000, 2500), 1 << 30, True),
                                              ((9001, 2000, 3001), 1 << 30, False)])
def test_arrays_page_locked_by_their_owner_cross_straight(shape, limit, bf16):
    """A, B and C made by ``cupyx.empty_pinned`` cross straight between the device and the
    arrays without being asked (no ring, no lock of distmm's own; A's whole rows through a
    device panel where it fits), the product is right, and the arrays are still page-locked
    afterwards; plain numpy operands still go through the ring beside a page-locked result."""
    from distmm.executor.pipeline.panel import panel_bytes
    from distmm.plan_pipeline import pipeline_tiling, spare_bytes
    import cupyx

    from distmm.executor.gpu import GPUExecutor

    m, n, k = shape
    executor = CublasGemm()
    dt = np.float32
    if bf16:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = ml_dtypes.bfloat16
        executor = GPUExecutor(backend="cublas", precision="bf16")
    a, b = cupyx.empty_pinned((m, k), dt), cupyx.empty_pinned((k, n), dt)
    a[...] = rand((m, k), "float32", 30).astype(dt)
    b[...] = rand((k, n), "float32", 31).astype(dt)
    out = cupyx.empty_pinned((m, n), np.float32)
    rt = cupy.cuda.runtime
    host = getattr(rt, "memoryTypeHost", 1)
    for x, y in ((a, b), (np.array(a), np.array(b))):
        out[...] = np.nan
        tl = Timeline()
        c, info = run(executor, x, y, out, trace=tl, device_memory_limit=limit)
        assert c is out
        check(c, x, y)
        lanes = {o["lane"] for o in tl.ops}
        assert info["direct_out"] and "host-unstage" not in lanes, (info, lanes)
        straight = x is a
        assert info["direct_in"] == (["A", "B"] if straight else []), info
        assert ("host-stage" in lanes) != straight, lanes
        assert len(info["tiling"]["row_sizes"]) >= 2
        t = pipeline_tiling(make_plan(m, n, k, np.float32), info["budget"],
                            precision="bf16" if bf16 else "highest")
        assert t.describe() == info["tiling"]
        panel = (bf16 and straight and len(t.col_edges) == 2 and len(t.k_edges) > 2
                 and panel_bytes(t, np.dtype(dt).itemsize) <= spare_bytes(t, info["budget"]))
        assert info["a_panel"] == panel, info  # beside tensor-core GEMMs only
        if limit == 1 << 30 and bf16:
            assert panel or not straight
    for arr in (a, b, out):
        for ptr in (arr.ctypes.data, arr.ctypes.data + arr.nbytes - 1):
            assert rt.pointerGetAttributes(ptr).type == host


def test_column_blocks_of_arrays_page_locked_by_their_owner():
    """bfloat16 A, B and a float32 C made by ``cupyx.empty_pinned``, wide enough for C's
    column blocks (``distmm-debug.pipeline-columns``): B's blocks cross as 2-D copies, A's
    rows once into panels kept for every block, C's blocks leave as 2-D copies into
    ``out``; the product is right, as with full-width units (unset)."""
    import cupyx
    import dask.config

    from distmm.executor.gpu import GPUExecutor

    ml_dtypes = pytest.importorskip("ml_dtypes")
    m, n, k = 3001, 16400, 2500
    a, b = cupyx.empty_pinned((m, k), ml_dtypes.bfloat16), cupyx.empty_pinned((k, n), ml_dtypes.bfloat16)
    a[...] = rand((m, k), "float32", 40).astype(ml_dtypes.bfloat16)
    b[...] = rand((k, n), "float32", 41).astype(ml_dtypes.bfloat16)
    out = cupyx.empty_pinned((m, n), np.float32)
    executor = GPUExecutor(backend="cublas", precision="bf16")
    for columns, sizes in ((2, [8192, n - 8192]), (4, [4096, 4096, 4096, n - 12288]),
                           (None, [n])):
        out[...] = np.nan
        tl = Timeline()
        with dask.config.set({"distmm-debug.pipeline-columns": columns}):
            c, info = run(executor, a, b, out, trace=tl, device_memory_limit=1 << 30)
        check(c, a, b)
        assert info["tiling"]["col_sizes"] == sizes, info["tiling"]
        assert info["a_panel"] and info["direct_out"] and info["direct_in"] == ["A", "B"]
        assert info["bytes_h2d"] == a.nbytes + b.nbytes and info["bytes_d2h"] == out.nbytes
        assert not {"host-stage", "host-unstage"} & {o["lane"] for o in tl.ops}


def test_cublas_start_up_runs_once_per_dtype_and_device():
    from distmm.executor.cublas import start_cublas

    first = start_cublas("float32")
    first.result(timeout=60)
    assert first.exception() is None
    assert start_cublas("float32") is first
    assert start_cublas(np.float32) is first
    assert start_cublas("float64") is not first
