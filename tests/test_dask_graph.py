"""The Dask engine's graph stays lazy at scale and is exact on ragged chunks.

Covers: building the graph of a 10^6 x 10^6 product of lazy operands without
materialising tasks (bounded time and client memory, a length computed
without listing keys, culling to one output block), dask.array's output
chunks by default, and results equal to numpy's bit for bit (integers) on
ragged, misaligned chunks with and without a k split, and a name that is the
product's own (the same product's whatever memory the call found, never another's). No
cluster: dask's threaded scheduler runs the tasks.
"""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

da = pytest.importorskip("dask.array")

import dask  # noqa: E402

import distmm  # noqa: E402


def test_graph_of_a_huge_product_builds_lazily():
    n, c = 10**6, 8192
    A, B = da.ones((n, n), chunks=c), da.ones((n, n), chunks=c)
    distmm.matmul(da.ones((100, 100), chunks=50), da.ones((100, 100), chunks=50))  # imports
    t0 = time.perf_counter()
    C = distmm.matmul(A, B)
    graph = C.__dask_graph__()
    tasks = len(graph)
    seconds = time.perf_counter() - t0
    tracemalloc.start()  # a second build, for memory (tracing slows it down)
    len(distmm.matmul(A, B).__dask_graph__())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    blocks = -(-n // c)
    assert C.chunks == (A.chunks[0], B.chunks[1])  # dask.array's chunks of A @ B
    layer = graph.layers[C.name]
    assert not layer.is_materialized()
    groups = layer.geometry.groups
    assert groups > 1  # the default budget splits k here
    assert len(layer) == blocks * blocks * (2 * groups - 1)
    assert tasks >= len(layer) + blocks**2  # the product and the operands (A is B here)
    # dask.array's own A @ B takes seconds and hundreds of MiB here
    assert seconds < 2.0, seconds
    assert peak < 8 * 2**20, peak
    # one output block culls to its own tasks and the chunks they read
    culled = graph.cull({(C.name, 5, 7)})
    product = [lay for name, lay in culled.layers.items() if name.startswith(C.name)]
    assert len(product) == 1 and len(product[0]) == 2 * groups - 1
    deps = set().union(*(product[0].get_dependencies(k) for k in product[0]))
    want = {(A.name, 5, kb) for kb in range(blocks)} | {(B.name, kb, 7) for kb in range(blocks)}
    assert {k for k in deps if not str(k[0]).startswith("distmm-")} == want


RAGGED = [
    # (m, k, n), A chunks, B chunks; k spans several k-blocks so a budget can split it
    ((65, 700, 54), ((10, 40, 15), (230, 70, 400)), ((600, 100), (33, 1, 20))),
    ((33, 900, 17), ((1, 31, 1), (64, 64, 772)), ((3, 897), (5, 12))),
    ((7, 1200, 5), ((7,), (300,) * 4), ((250,) * 4 + (200,), (2, 3))),
]


@pytest.mark.parametrize("budget", [None, "16KiB"], ids=["one-group", "k-split"])
@pytest.mark.parametrize("dtype", ["int64", "int8", "float64"])
@pytest.mark.parametrize("case", range(len(RAGGED)), ids=["uneven", "slivers", "long-k"])
def test_ragged_chunks_match_numpy_exactly(case, dtype, budget):
    (m, k, n), a_chunks, b_chunks = RAGGED[case]
    rng = np.random.default_rng(case)
    if dtype == "float64":
        # small integers in floats: every partial sum is exact, so any order of
        # additions gives numpy's bits
        a = rng.integers(-8, 8, (m, k)).astype(dtype)
        b = rng.integers(-8, 8, (k, n)).astype(dtype)
    else:
        a = rng.integers(-100, 100, (m, k)).astype(dtype)
        b = rng.integers(-100, 100, (k, n)).astype(dtype)
    A, B = da.from_array(a, chunks=a_chunks), da.from_array(b, chunks=b_chunks)
    with dask.config.set({"distmm.memory-budget": budget} if budget else {}):
        C = distmm.matmul(A, B)
    assert C.chunks == (a_chunks[0], b_chunks[1])  # dask.array's A @ B chunks
    layer = C.dask.layers[C.name]
    assert (layer.geometry.groups > 1) == (budget is not None)
    got = C.compute(scheduler="threads")
    want = a @ b
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_k_groups_sit_on_chunk_edges():
    """A split product's k groups move onto the nearest chunk edges (a task
    receives whole chunks), keeping the plan's number of groups."""
    from distmm.engine.dask.chunks import Geometry
    from distmm.plan import make_plan

    plan = make_plan(64, 64, 1000, "float64", tile=(64, 64, 10), k_splits=3)
    assert plan.k_edges == (0, 330, 660, 1000)
    geo = Geometry.of(plan, ((64,), (300, 300, 400)), ((250, 250, 500), (64,)), follow_chunks=True)
    assert geo.k_groups == (0, 300, 600, 1000)
    # fewer chunk edges than groups: the plan's own edges, tasks slice the chunk
    geo = Geometry.of(plan, ((64,), (1000,)), ((1000,), (64,)), follow_chunks=True)
    assert geo.k_groups == plan.k_edges
    # crowded edges never merge two groups
    geo = Geometry.of(plan, ((64,), (1, 1, 998)), ((1000,), (64,)), follow_chunks=True)
    assert geo.k_groups == (0, 1, 2, 1000)


def test_a_dask_out_or_out_with_dask_operands_is_numpys_type_error():
    """numpy hands both calls to dask, whose matmul takes no ``out=``: TypeError. A dask
    ``out`` with numpy operands was ignored (the result went to ``np.copyto``, which dask
    does not implement: ``out`` stayed zeros)."""
    import dask.array as da

    a, b = np.ones((5, 4)), np.ones((4, 3))
    for x, y, out in ((a, b, da.zeros((5, 3))), (da.from_array(a), da.from_array(b),
                                                  np.zeros((5, 3)))):
        with pytest.raises(TypeError):
            np.matmul(x, y, out=out)
        with pytest.raises(TypeError, match="out"):
            distmm.matmul(x, y, out=out)


def test_the_name_is_the_products_own():
    """The name is dask's for one computation: the same product gets the same name (dask
    merges and reuses it, as it does ``x @ y``'s), whatever the memory the call found
    (the default budget is measured), and a different one never shares it (dask would hand
    one product's blocks for the other's). The name was the plan's token: a budget that
    changed no task still changed it."""
    rng = np.random.default_rng(7)
    a, a2 = rng.integers(-9, 9, (40, 600)), rng.integers(-9, 9, (40, 600))
    b = rng.integers(-9, 9, (600, 20))
    x, y = da.from_array(a, chunks=(10, 100)), da.from_array(b, chunks=(100, 10))
    same = []
    for budget in ("1GiB", "2GiB", "512MiB"):
        with dask.config.set({"distmm.memory-budget": budget}):
            same.append(distmm.matmul(x, y))
    assert len({c.name for c in same}) == 1
    with dask.config.set({"distmm.memory-budget": "16KiB"}):
        split = distmm.matmul(x, y)
    assert split.dask.layers[split.name].geometry.groups > 1
    others = {
        "other a": (distmm.matmul(da.from_array(a2, chunks=(10, 100)), y), a2 @ b),
        "other chunks": (distmm.matmul(x.rechunk(8), y), a @ b),
        "tile": (distmm.matmul(x, y, tile=8), a @ b),
        "backend": (distmm.matmul(x, y, backend="numba"), a @ b),
        "dtype": (distmm.matmul(x, y, dtype="float64"), (a @ b).astype("float64")),
        "k split": (split, a @ b),
        "transposed": (distmm.matmul(y.T, x.T), (a @ b).T),
    }
    names = [same[0].name] + [c.name for c, _ in others.values()]
    assert len(set(names)) == len(names)
    got = dask.compute(same[0], *(c for c, _ in others.values()), scheduler="threads")
    for (label, (_, want)), value in zip([("same", (None, a @ b))] + list(others.items()), got):
        assert value.dtype == want.dtype, label
        np.testing.assert_array_equal(value, want, err_msg=label)
