"""The batch planner's memory: what one rank of ``mpirun -n P distmm matmul`` holds
(``held_bytes``), the stripes a ``distmm.memory-budget`` given as a size forces on CPU ranks,
and its refusal of a budget below the least a rank holds (``MemoryError``, before any work).
The runs themselves, under mpiexec: tests/test_batch_budget.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from distmm.plan_batch import MIN_STRIPE_ROWS, decide_batch, plan_batch


def _rows(plan) -> int:
    """The tallest stripe of the plan."""
    return max(b - a for e in plan.stripe_edges for a, b in zip(e, e[1:]))


def test_a_budget_cuts_cpu_ranks_stripes_until_they_fit():
    """A CPU rank's held bytes (B's column panel, two A stripes and two C stripes) fit the
    budget: more stripes, as few as fit; ``auto`` (None) keeps the plan made without it."""
    free = decide_batch(8192, 1024, 64, ranks=2, stripes=2)
    assert free.plan.grid.shape == (1, 2, 1) and free.plan.stripes == 2
    assert free == decide_batch(8192, 1024, 64, ranks=2, stripes=2, budget=None)
    b_panel = 64 * 1024 * 8
    for budget in (30 << 20, 20 << 20, 12 << 20, 6 << 20):
        s = decide_batch(8192, 1024, 64, ranks=2, stripes=2, budget=budget)
        assert s.plan.grid.shape == (1, 2, 1)
        assert max(s.plan.held_bytes) <= budget < max(free.plan.held_bytes)
        h = _rows(s.plan)
        assert max(s.plan.held_bytes) == b_panel + 2 * h * (64 + 1024) * 8
        # twice as tall a stripe would not have fitted
        assert b_panel + 2 * 2 * h * (64 + 1024) * 8 > budget
        assert s.plan.stripes > free.plan.stripes and h >= MIN_STRIPE_ROWS
    # a budget the plan fits changes nothing
    assert decide_batch(8192, 1024, 64, ranks=2, budget=1 << 40).plan == \
        decide_batch(8192, 1024, 64, ranks=2).plan


def test_a_budget_below_the_narrowest_stripes_is_refused_naming_both():
    """Below what a rank holds with stripes of ``MIN_STRIPE_ROWS`` rows: one MemoryError
    line naming the budget and that least, told from the sizes alone."""
    least = 128 * 128 * 8 + 2 * MIN_STRIPE_ROWS * (128 + 128) * 8
    ok = decide_batch(2048, 128, 128, ranks=2, stripes=2, budget=least)
    assert max(ok.plan.held_bytes) == least and _rows(ok.plan) == MIN_STRIPE_ROWS
    with pytest.raises(MemoryError) as info:
        decide_batch(2048, 128, 128, ranks=2, stripes=2, budget=least - 1)
    text = str(info.value)
    assert "\n" not in text
    assert re.search(r"holds at least 1\.12 MiB on rank 0 .* of 256 rows\), more than its "
                     r"distmm\.memory-budget of 1\.12 MiB", text), text
    with pytest.raises(MemoryError, match=r"holds at least 640\.00 KiB on rank 0 .* of 128 rows\), "
                                          r"more than its distmm\.memory-budget of 64\.00 KiB: "
                                          r"set a larger budget or use more ranks$"):
        plan_batch(2048, 128, 128, ranks=2, budget=64 << 10)  # 8 stripes: 128 rows already


def test_gpu_ranks_plan_with_their_device_memory_not_the_budget():
    """The budget is a CPU rank's host memory: GPU ranks keep their device's limit (and its
    ValueError)."""
    gpu = decide_batch(8192, 1024, 64, ranks=2, stripes=2, on_gpu=True, budget=1 << 20)
    assert gpu.plan == decide_batch(8192, 1024, 64, ranks=2, stripes=2, on_gpu=True).plan
    with pytest.raises(ValueError, match="use more ranks"):
        decide_batch(8192, 8192, 8192, ranks=2, on_gpu=True, memory=1 << 20)


def test_whole_rows_give_way_to_a_grid_that_fits_the_budget():
    """Whole rows make each rank hold all of B; where that does not fit the budget the ranks
    share B as make_grid's grid does (here 1 x 2: half of B each)."""
    free = decide_batch(1024, 4096, 4096, ranks=2)
    assert free.plan.grid.shape == (1, 2, 1)
    budget = 4096 * 4096 * 8 // 2 + (16 << 20)  # half of B and a few stripes
    s = decide_batch(1024, 4096, 4096, ranks=2, budget=budget)
    assert s.plan.grid.shape == (1, 1, 2) and max(s.plan.held_bytes) <= budget


@pytest.mark.parametrize("dtype,panels,extra_c,extra_a", [
    ("float64", "read", 0, 0),
    ("float16", "read", 0.5, 0),         # the stripe being written, rounded to float16
    ("int8", "read", 0.125, 0),          # int64 sums written as int8
    ("float64", "broadcast", 1, 0),      # one k panel's product beside the stripe's sum
    ("float16", "broadcast", 0.5, 1),    # numpy's one sum over k: A's pieces joined
])
def test_cpu_ranks_held_bytes_count_their_host_products(dtype, panels, extra_c, extra_a):
    """On CPU ranks ``held_bytes`` counts what their host products add to the stripes:
    the result dtype's copy of a stripe being written, and where the pieces of A come by
    broadcast, the partial product being summed (or A's joined pieces); GPU ranks count the
    device's buffers only."""
    m, n, k = 1024, 1024, 1024
    s = decide_batch(m, n, k, dtype, ranks=4, hosts=2 if panels == "broadcast" else 1,
                     panels=panels)
    gpu = decide_batch(m, n, k, dtype, ranks=4, hosts=2 if panels == "broadcast" else 1,
                       panels=panels, on_gpu=True)
    g = s.plan.grid
    assert g.shape == gpu.plan.grid.shape and s.plan.stripe_edges == gpu.plan.stripe_edges
    assert (g.cols > 1) == (panels == "broadcast")
    h, nj = _rows(s.plan), n // g.cols
    acc = np.dtype(g.acc_dtype).itemsize
    assert max(gpu.plan.held_bytes) == (k * nj + 2 * h * (k + nj)) * acc
    assert max(s.plan.held_bytes) == max(gpu.plan.held_bytes) + int(
        (extra_c * h * nj + extra_a * h * k) * acc)


def test_cpu_ranks_held_bytes_count_the_direct_writers_buffers():
    """With ``direct_writes`` a CPU rank's writer copies C into aligned buffers
    (``distmm.direct_io``: one a thread, of up to 16 MiB, four threads at most): a stripe of
    whole rows is one span, in a grid of columns each row of it is; spans under 1 MiB go
    through the page cache. A budget makes more stripes where they do not fit; GPU ranks
    write from page-aligned memory."""
    m, n, k = 16384, 2048, 32
    for stripes, buffers in ((4, 32 << 20), (64, 2 << 20), (256, 0)):  # 32, 2, 0.5 MiB spans
        free = decide_batch(m, n, k, ranks=2, stripes=stripes)
        s = decide_batch(m, n, k, ranks=2, stripes=stripes, direct_writes=True)
        assert s.plan.stripe_edges == free.plan.stripe_edges and s.plan.grid.shape == (1, 2, 1)
        assert max(s.plan.held_bytes) - max(free.plan.held_bytes) == buffers
    for cols, buffers in ((262144, 1 << 20), (131072, 0)):  # rows of 1 MiB and 0.5 MiB a rank
        free = decide_batch(512, cols, 4, ranks=2, hosts=2)
        s = decide_batch(512, cols, 4, ranks=2, hosts=2, direct_writes=True)
        assert s.plan.grid.shape == (1, 1, 2)
        assert max(s.plan.held_bytes) - max(free.plan.held_bytes) == buffers
    budget = 160 << 20
    assert decide_batch(m, n, k, ranks=2, stripes=1, budget=budget).plan.stripes == 2
    s = decide_batch(m, n, k, ranks=2, stripes=1, budget=budget, direct_writes=True)
    assert s.plan.stripes == 4 and max(s.plan.held_bytes) == (65.5 + 32) * 2**20 <= budget
    gpu = decide_batch(m, n, k, ranks=2, on_gpu=True)
    assert decide_batch(m, n, k, ranks=2, on_gpu=True, direct_writes=True).plan == gpu.plan


def test_a_stopped_runs_stripes_are_planned_as_they_are():
    """``stripe_edges`` (a ``--resume`` run taking a stopped one's on, with its grid): planned
    as they are, whatever ``stripes`` asks, what they hold counted per grid row; refused in one
    MemoryError line naming the budget they need (rounded up) where they hold more, and with a
    ValueError where they do not cut the grid's rows."""
    edges = [[0, 100, 256, 512, 1024], [1024, 1536, 2048]]
    p = plan_batch(2048, 128, 128, ranks=2, grid=(2, 1), stripe_edges=edges, stripes=1)
    assert p.stripe_edges == tuple(map(tuple, edges)) and p.stripes == 4
    panel = 128 * 128 * 8
    assert p.held_bytes == (panel + 2 * 512 * 256 * 8, panel + 2 * 512 * 256 * 8)
    assert plan_batch(2048, 128, 128, ranks=2, grid=(2, 1), stripe_edges=edges,
                      budget=max(p.held_bytes)) == p
    with pytest.raises(MemoryError) as info:
        plan_batch(2048, 128, 128, ranks=2, grid=(2, 1), stripe_edges=edges, budget=2 << 20)
    assert str(info.value) == (
        "its kept stripes (of up to 512 rows, on 2 x 1 ranks) hold 2.12 MiB on rank 0, more "
        "than the distmm.memory-budget of 2.00 MiB: resume with a budget of at least 2.13 MiB")
    for bad in ([[0, 1024], [1024, 2000]], [[0, 600, 500, 1024], [1024, 2048]], [[0, 2048]]):
        with pytest.raises(ValueError, match="do not cut the 2 x 1 grid's rows"):
            plan_batch(2048, 128, 128, ranks=2, grid=(2, 1), stripe_edges=bad)
    with pytest.raises(ValueError, match="do not cut"):
        plan_batch(2048, 128, 128, ranks=2, stripe_edges=edges)  # no grid


def test_a_budget_refusal_names_the_least_of_the_grids_tried():
    """Whole rows tried first (2 x 1: 254 rows a rank, in one stripe) and then the grid
    make_grid picks (1 x 2): a budget below both names the smaller least, whole rows' here
    (it named the second grid's, more than a budget that runs needs), and a budget of that
    least runs whole rows."""
    m, n, k = 254, 485, 910
    rows = plan_batch(m, n, k, ranks=2, grid=(2, 1), stripes=1, host_panels="read")
    shared = plan_batch(m, n, k, ranks=2, stripes=1, host_panels="read")
    assert shared.grid.shape == (1, 1, 2) and max(rows.held_bytes) < max(shared.held_bytes)
    with pytest.raises(MemoryError) as info:
        decide_batch(m, n, k, ranks=2, stripes=1, budget=1 << 20)
    assert str(info.value) == (
        "a 254 x 485 x 910 float64 batch product on 2 x 1 ranks holds at least 6.07 MiB on "
        "rank 0 (B's column panel k x n/1 and stripes of A and C of 127 rows), more than its "
        "distmm.memory-budget of 1.00 MiB: set a larger budget or use more ranks")
    s = decide_batch(m, n, k, ranks=2, stripes=1, budget=max(rows.held_bytes))
    assert s.plan.grid.shape == (1, 2, 1)


def test_sizes_are_said_by_one_helper():
    """The planner's refusals (two decimals) and the process limits' notes
    (``distmm.startup.limit_note``, one decimal) say sizes through one helper; a size a
    budget must reach is rounded up (1.125 MiB: 1.12, and a budget of 1.13 MiB)."""
    from distmm import plan_batch as pb, startup

    assert pb.size_text is startup.size_text
    assert [startup.size_text(n) for n in (1023, 1024, 1179648, 3 << 30)] == [
        "1023 bytes", "1.0 KiB", "1.1 MiB", "3.0 GiB"]
    assert startup.size_text(1179648, 2) == "1.12 MiB"
    assert startup.size_text(1179648, 2, up=True) == "1.13 MiB"
    assert startup.size_text(1 << 20, 2, up=True) == "1.00 MiB"
