"""Operands and results of more than 2^31 elements on one GPU: every element offset a kernel
computes (row * ld, a tile origin * ld, the split tail's workspace and fix-up, the tensor
maps' coordinates, the rounding and transposing passes before the tensor cores) must be
64-bit, and steps 1-6 must reach row tiles past the grid's y limit (65535).

Each case is cheap in flops but holds one operand, or C, of over 2^31 elements (float32:
past 2^33 bytes): A of 2,400,007 x 1000 with a thin C, C of 60,001 x 40,004 (k = 64), and
A stored transposed (1000 x 2,400,008; B stored transposed too). A's 2.4e6 rows are 300,001
row tiles of step 1 and 75,001 of step 3.

The operands hold small integers (-4 .. 4): every sum is an integer below 2^24, exact in
float32 in any order, and TF32 and bfloat16 hold the operands as they are, so C must equal
the exact product in every mode (stricter than the tolerances of test_gpu_kernels.py and
test_precision_gpu.py). The exact product is computed in float64 in slices of A and C of
under 2^31 elements, and again on the host for the first and last rows and those where
offsets pass 2^31; the test's own elementwise work on the large arrays goes in such slices
too. C is filled with NaN before each launch, so an element left unwritten fails.

Every test is ``gpu`` and ``slow``. The GPU holds at most about 40 GB at once (float64 A of
19 GB), and the pipeline case a 9.6 GB operand in host memory; each test frees the device's
pool when it ends. Each test compiles its kernels first, in parallel (``cuda_loader.warm``).
"""
from __future__ import annotations

import numpy as np
import pytest

import distmm
from distmm.executor import cuda_loader, registry

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RAW = registry.steps()
#: the tensor-core steps in the modes whose operands stay float32 until the device rounds
#: them (fp16 rounds the same integers the same way, through another cast)
TC_MODES = [(spec, prec) for spec in registry.tc_steps() for prec in ("bf16", "tf32")
            if prec in spec.precisions]

#: (m, n, k, A stored transposed, B stored transposed)
CASES = {
    # A 2.4e9 elements; m % 128 = 7: the last row tile, an edge tile, is at A's end
    "big-A": (2_400_007, 97, 1000, False, False),
    # C 2.4e9 elements; n % 128 = 68, rows of 16-byte multiples
    "big-C": (60_001, 40_004, 64, False, False),
    # A stored 1000 x 2,400,008 (rows of 16-byte multiples), B stored 97 x 1000
    "big-A-transposed": (2_400_008, 97, 1000, True, True),
}

#: elements of one slice of the test's own work on the large arrays
CHUNK = 2**27


@pytest.fixture
def cp():
    """cupy, and the device's memory pool emptied when the test ends."""
    import cupy

    yield cupy
    cupy.get_default_memory_pool().free_all_blocks()


def _row_slices(rows: int, cols: int):
    step = max(1, CHUNK // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(r0 + step, rows)


def _ints(cp, shape, dtype, seed: int):
    """A C-contiguous device array of integers -4 .. 4 in ``dtype``, made slice by slice."""
    x = cp.empty(shape, dtype=dtype)
    rs = cp.random.RandomState(seed)
    for r0, r1 in _row_slices(*shape):
        x[r0:r1] = rs.randint(-4, 5, size=(r1 - r0, shape[1]), dtype=np.int32)
    return x


def _nan_filled(cp, shape, dtype):
    c = cp.empty(shape, dtype=dtype)
    for r0, r1 in _row_slices(*shape):
        c[r0:r1].fill(np.nan)
    return c


def _checksum(x) -> float:
    """The sum of an integer-valued device matrix (exact in float64), slice by slice."""
    return sum(float(x[r0:r1].sum(dtype=np.float64)) for r0, r1 in _row_slices(*x.shape))


def _warm(items) -> None:
    errors = cuda_loader.warm(items)
    assert not errors, "\n".join(errors)


class Product:
    """``op(A) @ op(B)`` of one case on the device: integer-valued operands as stored, and
    the exact product to compare C with."""

    def __init__(self, cp, case, dtype, seed: int = 1):
        self.cp = cp
        self.m, self.n, self.k, self.ta, self.tb = case
        m, n, k = self.m, self.n, self.k
        self.dtype = np.dtype(dtype)
        self.a = _ints(cp, (k, m) if self.ta else (m, k), dtype, seed)
        self.b = _ints(cp, (n, k) if self.tb else (k, n), dtype, seed + 1)
        self.lda, self.ldb = self.a.shape[1], self.b.shape[1]
        self.op_a = self.a.T if self.ta else self.a
        self.op_b = self.b.T if self.tb else self.b
        self.b64 = cp.ascontiguousarray(self.op_b, dtype=np.float64)  # at most 2.6e6 elements
        self.sums = (_checksum(self.a), _checksum(self.b))
        self.ref = None
        if m * n <= 2**28:  # a thin C: its exact product kept whole (2 GB at most)
            if self.ta:  # A's stored rows are op(A)'s columns: slices of k
                self.ref = cp.zeros((m, n), dtype=np.float64)
                for k0, k1 in _row_slices(k, m):
                    self.ref += self.a[k0:k1].astype(np.float64).T @ self.b64[k0:k1]
            else:
                self.ref = cp.empty((m, n), dtype=np.float64)
                for r0, r1 in _row_slices(m, k):
                    self.ref[r0:r1] = self.a[r0:r1].astype(np.float64) @ self.b64
        else:  # C's rows made when compared, from slices of a small A
            assert not self.ta and m * k <= 2**28, "a large C needs a small A stored as op(A)"

    def c(self):
        """A fresh C filled with NaN."""
        return _nan_filled(self.cp, (self.m, self.n), self.dtype)

    def _want(self, r0: int, r1: int):
        if self.ref is not None:
            return self.ref[r0:r1]
        return self.a[r0:r1].astype(np.float64) @ self.b64

    def spot_rows(self) -> list[int]:
        """The first and last rows, and those around the first row with an element past
        2^31 in the operand over it (A stored transposed: every row, through k)."""
        m, n, k = self.m, self.n, self.k
        if self.ta:
            wrap = m // 2
        elif m * k >= 2**31:
            wrap = -(-2**31 // k)
        else:
            wrap = -(-2**31 // n)
        return sorted({0, 1, wrap - 1, wrap, wrap + 1, m - 2, m - 1} & set(range(m)))

    def _host_row_of_op_a(self, r: int) -> np.ndarray:
        cp = self.cp
        if not self.ta:
            return cp.asnumpy(self.a[r])
        # column r of A as stored: one 2-D copy of k rows of one element (pitches in size_t)
        col = np.empty(self.k, dtype=self.dtype)
        size = self.dtype.itemsize
        cp.cuda.runtime.memcpy2D(col.ctypes.data, size, self.a.data.ptr + r * size,
                                 self.a.strides[0], size, self.k,
                                 cp.cuda.runtime.memcpyDeviceToHost)
        return col

    def mismatch(self, c, what: str) -> str | None:
        """Why ``c`` is not the exact product, or None: compared whole against the exact
        product in row slices, then its spot rows against a product computed on the host."""
        cp = self.cp
        cp.cuda.get_current_stream().synchronize()
        for r0, r1 in _row_slices(self.m, self.n):
            bad = c[r0:r1] != self._want(r0, r1)  # NaN (unwritten) differs from everything
            count = int(bad.sum())
            if count:
                first = r0 + int(cp.argmax(bad.any(axis=1)))
                return (f"{what}: {count} elements of rows {r0}..{r1 - 1} are not the exact "
                        f"product (NaN: never written), the first in row {first} of {self.m}")
        rows = self.spot_rows()
        a_rows = np.stack([self._host_row_of_op_a(r) for r in rows]).astype(np.float64)
        want = a_rows @ cp.asnumpy(self.b64)
        got = np.stack([cp.asnumpy(c[r]) for r in rows])
        if not np.array_equal(got, want):
            bad = [r for r, g, w in zip(rows, got, want) if not np.array_equal(g, w)]
            return f"{what}: rows {bad} differ from the host's product of those rows"
        return None

    def untouched(self) -> str | None:
        if (_checksum(self.a), _checksum(self.b)) != self.sums:
            return "an operand was modified"
        return None


def _cc() -> int:
    return cuda_loader.compute_capability()


def _run_all(product: Product, launches) -> list[str]:
    """Each ``(what, launch(c))`` into a fresh NaN-filled C, checked against the exact
    product; the failures, each in one line (a launch that raised, too)."""
    failures = []
    for what, launch in launches:
        try:
            c = product.c()
            launch(c)
            problem = product.mismatch(c, what)
        except Exception as exc:  # noqa: BLE001 - every kernel is tried and reported
            problem = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if problem:
            failures.append(problem)
        c = None
    problem = product.untouched()
    return failures + ([problem] if problem else [])


def _raw_launches(product: Product, dtype: str):
    p = product
    cc = _cc()
    specs = [s for s in RAW if s.min_cc <= cc and dtype in s.dtypes]
    _warm([(s.name, dtype, None, p.ta, p.tb) for s in specs])
    for spec in specs:
        def launch(c, spec=spec):
            cuda_loader.launch(spec.name, p.a, p.ta, p.lda, p.b, p.tb, p.ldb, c, p.n,
                               p.m, p.n, p.k, check=True)
        yield f"step {spec.step} ({spec.name}, {dtype})", launch


@pytest.mark.parametrize("case", ["big-A", "big-C", "big-A-transposed"])
def test_raw_steps_float32(cp, case):
    """Every SIMT step (1-10; 9 runs step 8's body for float32) on float32."""
    product = Product(cp, CASES[case], np.float32)
    failures = _run_all(product, list(_raw_launches(product, "float32")))
    product = None
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", ["big-A", "big-C"])
def test_raw_steps_float64(cp, case):
    """Every step on float64 (9: the FP64 tensor cores; 10: its split tail at A's end)."""
    product = Product(cp, CASES[case], np.float64)
    failures = _run_all(product, list(_raw_launches(product, "float64")))
    product = None
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", ["big-A", "big-C", "big-A-transposed"])
def test_tensor_core_steps(cp, case):
    """Steps 11-15 in bf16 and TF32 on float32 operands: the device's rounding into copies
    (TF32 on steps 14 and 15: into k-major, so transposed, copies), the tensor maps, the
    epilogues."""
    product = Product(cp, CASES[case], np.float32)
    p = product
    cc = _cc()
    modes = [(s, prec) for s, prec in TC_MODES if s.runs_on(cc)]
    assert modes, f"no tensor-core step runs on compute capability {cc}"
    items = []
    for spec, prec in modes:
        fmt = spec.precisions[prec]
        flags = (False, True) if spec.kmajor_only(fmt) else (p.ta, p.tb)
        items.append((spec.name, fmt, None, *flags))
    _warm(items)
    launches = []
    for spec, prec in modes:
        def launch(c, spec=spec, prec=prec):
            ran = cuda_loader.launch_tc(spec.name, p.a, p.ta, p.lda, p.b, p.tb, p.ldb, c, p.n,
                                        p.m, p.n, p.k, precision=prec, check=True)
            assert ran == spec.name, f"handed to {ran}"
        launches.append((f"tc step {spec.step} ({spec.name}, {prec})", launch))
    failures = _run_all(product, launches)
    product = p = None
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", ["big-A", "big-C", "big-A-transposed"])
def test_cublas_through_matmul(cp, case):
    """``distmm.matmul`` of cupy operands (transposed views as they are) into a cupy out=."""
    product = Product(cp, CASES[case], np.float32)
    p = product

    def launch(c):
        assert distmm.matmul(p.op_a, p.op_b, out=c, backend="cublas") is c

    failures = _run_all(product, [("cuBLAS through distmm.matmul", launch)])
    product = p = None
    assert not failures, "\n".join(failures)


def test_pipeline_from_host_memory(cp):
    """numpy operands (A: 9.6 GB of host memory) through the stream pipeline in pieces of a
    4 GB device budget, distmm's kernels multiplying each block."""
    from distmm.executor.gpu import GPUExecutor
    from distmm.executor.pipeline import run_pipelined
    from distmm.plan import make_plan

    product = Product(cp, CASES["big-A"], np.float32)
    m, n, k = product.m, product.n, product.k
    a, b = cp.asnumpy(product.a), cp.asnumpy(product.b)
    product.a = product.op_a = None  # only A's host copy from here on
    cp.get_default_memory_pool().free_all_blocks()
    out = np.full((m, n), np.nan, dtype=np.float32)
    info: dict = {}
    run_pipelined(GPUExecutor(backend="raw"), make_plan(m, n, k, np.float32), a, b, out,
                  device_memory_limit="4GB", info=info)
    assert info["bytes_h2d"] >= a.nbytes
    bad = np.argwhere(out != cp.asnumpy(product.ref))
    assert bad.size == 0, (f"{len(bad)} elements are not the exact product (NaN: never "
                           f"written), the first at {tuple(bad[0])}")
    rows = product.spot_rows()
    want = a[rows].astype(np.float64) @ b.astype(np.float64)
    assert np.array_equal(out[rows], want), f"rows {rows} differ from the host's product"


def test_bfloat16_conversion_needs_no_temporaries(cp):
    """A float32 operand of 9.6 GB into bfloat16 bits for steps 12-15 (``launch_tc``'s
    conversion): one pass into the 4.8 GB result; the pool grows by that alone, not by
    temporaries of x's size (cupy's array operators make several, 36 GB together)."""
    m, k = CASES["big-A"][0], CASES["big-A"][2]
    a = _ints(cp, (m, k), np.float32, 3)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    held = pool.total_bytes()
    bits = cuda_loader.to_input_format(a, "bfloat16")
    grown = pool.total_bytes() - held
    assert bits.dtype == np.uint16 and bits.shape == (m, k) and bits.flags.c_contiguous
    assert grown <= bits.nbytes + 2**26, f"the pool grew by {grown / 2**30:.1f} GiB"
    # the integers are exact in bfloat16: their bits are float32's upper halves
    wrong = sum(int(((bits[r0:r1].astype(np.uint32) << 16).view(np.float32) != a[r0:r1]).sum())
                for r0, r1 in _row_slices(m, k))
    assert wrong == 0, f"{wrong} elements are not their bfloat16 bits"


def test_dimensions_within_a_tile_of_2_31_are_refused_and_the_largest_allowed_runs(cp):
    """The kernels' tile counts and bounds are 32-bit ((K + BK - 1) / BK, m0 + BM <= M): at
    k = 2^31 - 1 they wrap. m, n and k above ``cuda_loader.MAX_DIM`` are refused before
    anything runs; m = MAX_DIM runs (step 1 looping over 65535 x 4096 row tiles)."""
    big = 2**31 - 1
    a = cp.empty((1, big), np.float32)
    b = cp.empty((big, 1), np.float32)
    c = cp.full((1, 1), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"at most 2\^31 - 2\^16"):
        cuda_loader.launch("dmma", a, False, big, b, False, 1, c, 1, 1, 1, big, check=True)
    with pytest.raises(ValueError, match=r"at most 2\^31 - 2\^16"):
        cuda_loader.launch_tc("mma_bf16", a, False, big, b, False, 1, c, 1, 1, 1, big,
                              precision="bf16", check=True)
    a = b = c = None
    cp.get_default_memory_pool().free_all_blocks()
    m = cuda_loader.MAX_DIM
    assert m == 2**31 - 2**16
    a = _ints(cp, (m, 1), np.float32, 7)
    b = cp.full((1, 1), 2, np.float32)
    _warm([("naive", "float32", None, False, False), ("dmma", "float32", None, False, False)])
    for name in ("naive", "dmma"):
        c = _nan_filled(cp, (m, 1), np.float32)
        cuda_loader.launch(name, a, False, 1, b, False, 1, c, 1, m, 1, 1, check=True)
        wrong = sum(int((c[r0:r1] != 2 * a[r0:r1]).sum()) for r0, r1 in _row_slices(m, 1))
        assert wrong == 0, f"{name}: {wrong} of {m} elements are not 2 a"
        c = None
