"""A GPU block task's k loop (``distmm.engine.dask.blocks._overlapped_block``) on a stand-in
device: cupy replaced by numpy-backed streams and events, the GEMMs by numpy, the copies of
another worker's export (``take_into``) by plain copies that note a mapping. Covers, without
a GPU: the block's k cut into pieces at the chunk edges (``device_pieces``), the first
piece run as one GEMM per chunk of C with the chunks at hand first, every later piece
adding into all of C, the result against float64, and the bits the same wherever the
chunks lie, and the limits on that split (``FIRST_PARTS``, ``FIRST_PART_SIDE``). The device
itself runs it in ``tests/test_dask_ipc_gpu.py``."""
from __future__ import annotations

import sys
import threading
import types

import dask
import numpy as np
import pytest

from distmm.engine.dask import blocks
from distmm.engine.dask.tasks import BlockSpec, TaskPlan
from distmm.engine.dask.transfer import Offer


class _Stream:
    def __init__(self, device, name):
        self.device, self.name = device, name

    def __enter__(self):
        self.device.current.append(self)
        return self

    def __exit__(self, *exc):
        self.device.current.pop()

    def record(self):
        return ("event", self.name)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _Device:
    """The parts of cupy the k loop calls, over numpy."""

    def __init__(self):
        self.current = [_Stream(self, "compute")]
        self.cuda = types.SimpleNamespace(get_current_stream=lambda: self.current[-1],
                                          Stream=lambda **kw: _Stream(self, "copy"))
        self.empty = np.empty


class _GEMMs:
    def __init__(self, log):
        self.log = log

    def device_gemm(self, a, b, out, *, beta=0):
        self.log.append(("gemm", out.shape, beta, out.__array_interface__["data"][0]))
        if beta == 0:
            out[...] = a @ b
        else:
            out += a @ b


@pytest.fixture
def device(monkeypatch):
    dev = _Device()
    log: list = []
    monkeypatch.setitem(sys.modules, "cupy", dev)
    monkeypatch.setattr(blocks, "_COPY_STREAMS", threading.local())
    monkeypatch.setattr(blocks, "_gpu_executor", lambda tp, backend: _GEMMs(log))
    monkeypatch.setattr(blocks, "FIRST_PART_SIDE", 1)  # small chunks split the first piece too

    def take_into(x, dst, lead, r0, c0, mapped):
        if isinstance(x, Offer):
            log.append(("map", x.label))
            x = x.data
        dst[...] = x[r0:r0 + dst.shape[0], c0:c0 + dst.shape[1]]

    monkeypatch.setattr(blocks, "take_into", take_into)

    return log


def _chunks(x, rows, cols, far, name):
    """``x`` cut into chunks; those in ``far`` as offers of another worker's export."""
    r, c = np.cumsum((0,) + rows), np.cumsum((0,) + cols)
    out = {}
    for i in range(len(rows)):
        for j in range(len(cols)):
            chunk = np.ascontiguousarray(x[r[i]:r[i + 1], c[j]:c[j + 1]])
            if (i, j) in far:
                shared = types.SimpleNamespace(local=False, dtype=chunk.dtype, token=f"{name}{i}{j}")
                chunk = Offer(shared, chunk, "tcp://elsewhere:1", f"{name}{i}{j}", chunk.nbytes)
            out[(i, j)] = chunk
    return out


def _run(a, b, rows, ks, cols, a_far, b_far):
    spec = BlockSpec((), (), tuple((i, 0, n) for i, n in enumerate(rows)),
                     tuple((j, 0, n) for j, n in enumerate(cols)),
                     ((tuple((k, 0, n) for k, n in enumerate(ks)),) * 2,),
                     (), (), finish=True)
    tp = TaskPlan("float64", "float64", (max(rows), max(cols), max(ks)))
    return blocks._overlapped_block(tp, "auto", spec, _chunks(a, rows, ks, a_far, "a"),
                                    _chunks(b, ks, cols, b_far, "b"))


def test_the_first_piece_runs_per_chunk_of_c_the_chunks_at_hand_first(device):
    rng = np.random.default_rng()
    rows, ks, cols = (5, 7), (4096, 4096, 4100), (6, 3)
    a = rng.standard_normal((sum(rows), sum(ks)))
    b = rng.standard_normal((sum(ks), sum(cols)))
    # row chunk 0's first k chunk and column chunk 0's are elsewhere: (1, 1) is at hand;
    # later pieces of one chunk (the debug setting, as the default), two after the first
    with dask.config.set({blocks.LATER_PIECE_KEY: 4096}):
        c = _run(a, b, rows, ks, cols, a_far={(0, 0), (0, 2)}, b_far={(0, 0)})
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12 * np.abs(a @ b).max())
    gemms = [e for e in device if e[0] == "gemm"]
    # piece 0: four GEMMs of one chunk of C each (beta 0): (1, 1) with nothing to map, then
    # (0, 1) and (1, 0) with one mapping each, (0, 0) last; pieces 1 and 2 over all of C
    assert [(e[1], e[2]) for e in gemms] == [((7, 3), 0), ((5, 3), 0), ((7, 6), 0), ((5, 6), 0),
                                            ((12, 9), 1), ((12, 9), 1)]
    first_map = next(i for i, e in enumerate(device) if e[0] == "map")
    assert device[first_map - 1][0] == "gemm"  # a GEMM was queued before any mapping
    assert [e[1] for e in device if e[0] == "map"] == ["a00", "b00", "a02"]


def test_first_parts_debug_setting_keeps_the_first_piece_whole(device):
    """``distmm-debug.first-parts`` 1: the first piece runs as one GEMM over all of C (as a
    benchmark compares), with the same bits as the split."""
    rng = np.random.default_rng()
    rows, ks, cols = (5, 7), (4096, 4096, 4100), (6, 3)
    a = rng.standard_normal((sum(rows), sum(ks)))
    b = rng.standard_normal((sum(ks), sum(cols)))
    with dask.config.set({blocks.LATER_PIECE_KEY: 4096}):
        split = _run(a, b, rows, ks, cols, a_far={(0, 0)}, b_far=set())
        device.clear()
        with dask.config.set({blocks.FIRST_PARTS_KEY: 1}):
            whole = _run(a, b, rows, ks, cols, a_far={(0, 0)}, b_far=set())
    assert [(e[1], e[2]) for e in device if e[0] == "gemm"] == [((12, 9), 0), ((12, 9), 1),
                                                                ((12, 9), 1)]
    np.testing.assert_allclose(whole, split, rtol=1e-12, atol=1e-12 * np.abs(split).max())


def test_piece_lengths_by_dtype_and_the_debug_settings():
    """float32 blocks (at the highest precision) as one piece of the whole k, float64 and
    the reduced precisions in pieces of one chunk (4096 the least); the debug settings
    replace either length, and a non-positive one is refused."""
    assert blocks.piece_lengths("float32") == (blocks.WHOLE_K, 16384)
    assert blocks.piece_lengths("float64") == (4096, 4096)
    assert blocks.piece_lengths("float32", "tf32") == (4096, 4096)
    with dask.config.set({blocks.FIRST_PIECE_KEY: "8192"}):
        assert blocks.piece_lengths("float32") == (8192, 16384)
    with dask.config.set({blocks.FIRST_PIECE_KEY: 4096, blocks.LATER_PIECE_KEY: 4096}):
        assert blocks.piece_lengths("float32") == (4096, 4096)
    with dask.config.set({blocks.FIRST_PIECE_KEY: 0}), pytest.raises(ValueError, match="positive"):
        blocks.piece_lengths("float64")
    # k = 32768 in chunks of 8192: float32 one piece, float64 four of 8192; the old float32
    # cut (first piece 16384) two pieces of 16384
    four = tuple((i, 0, 8192) for i in range(4))
    spans = [sum(k1 - k0 for _, k0, k1 in a) for a, _ in
             blocks.device_pieces([(four, four)], *blocks.piece_lengths("float32"))]
    assert spans == [32768]
    with dask.config.set({blocks.FIRST_PIECE_KEY: 16384}):
        spans = [sum(k1 - k0 for _, k0, k1 in a) for a, _ in
                 blocks.device_pieces([(four, four)], *blocks.piece_lengths("float32"))]
    assert spans == [16384, 16384]
    spans = [sum(k1 - k0 for _, k0, k1 in a) for a, _ in
             blocks.device_pieces([(four, four)], *blocks.piece_lengths("float64"))]
    assert spans == [8192] * 4


def test_the_bits_do_not_depend_on_where_the_chunks_lie(device):
    rng = np.random.default_rng()
    rows, ks, cols = (9, 4), (4097, 4099), (5, 8, 2)
    a = rng.standard_normal((sum(rows), sum(ks))).astype(np.float32).astype(np.float64)
    b = rng.standard_normal((sum(ks), sum(cols)))
    results = [_run(a, b, rows, ks, cols, a_far=af, b_far=bf)
               for af, bf in [(set(), set()), ({(0, 0), (1, 1)}, {(0, 2)}),
                              ({(0, 0), (0, 1), (1, 0), (1, 1)}, {(0, 0), (0, 1), (0, 2)})]]
    assert all(np.array_equal(results[0], r) for r in results[1:])
    np.testing.assert_allclose(results[0], a @ b, rtol=1e-12, atol=1e-12 * np.abs(a @ b).max())


def test_one_chunk_of_c_keeps_one_gemm_per_piece(device):
    rng = np.random.default_rng()
    a = rng.standard_normal((6, 8200))
    b = rng.standard_normal((8200, 5))
    c = _run(a, b, (6,), (4100, 4100), (5,), a_far={(0, 1)}, b_far=set())
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12 * np.abs(a @ b).max())
    assert [(e[1], e[2]) for e in device if e[0] == "gemm"] == [((6, 5), 0), ((6, 5), 1)]


def test_many_or_thin_chunks_of_c_keep_one_first_gemm(device, monkeypatch):
    """The first piece is split only into at most ``FIRST_PARTS`` GEMMs of at least
    ``FIRST_PART_SIDE`` rows and columns: a thinner part, or more parts, keep one GEMM."""
    rng = np.random.default_rng()
    a = rng.standard_normal((12, 4100))
    b = rng.standard_normal((4100, 9))
    monkeypatch.setattr(blocks, "FIRST_PART_SIDE", 6)  # the 5-row chunk is too thin
    c = _run(a, b, (5, 7), (4100,), (6, 3), a_far=set(), b_far=set())
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12 * np.abs(a @ b).max())
    assert [(e[1], e[2]) for e in device if e[0] == "gemm"] == [((12, 9), 0)]
    device.clear()
    monkeypatch.setattr(blocks, "FIRST_PART_SIDE", 1)
    monkeypatch.setattr(blocks, "FIRST_PARTS", 3)  # 2 x 2 parts: too many
    _run(a, b, (5, 7), (4100,), (6, 3), a_far=set(), b_far=set())
    assert [(e[1], e[2]) for e in device if e[0] == "gemm"] == [((12, 9), 0)]
