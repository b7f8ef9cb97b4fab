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
