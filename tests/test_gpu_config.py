"""The automatic memory budget of a GPU product: a share of the device's free memory."""
from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")

import dask.config  # noqa: E402

from distmm import config as config_mod  # noqa: E402
from distmm.api import plan_for  # noqa: E402
from distmm.config import memory_budget  # noqa: E402

pytestmark = pytest.mark.gpu


def test_auto_budget_on_the_gpu_follows_free_device_memory():
    free, total = cupy.cuda.runtime.memGetInfo()
    config_mod._probes.clear()  # measure now, not a second-old value
    budget = memory_budget(on_gpu=True)
    assert budget % (64 * 2**20) == 0
    assert 64 * 2**20 <= budget <= max(total * config_mod.GPU_FRACTION, 64 * 2**20)
    # measured against what was free a moment ago, allowing for other processes
    assert budget <= free * config_mod.GPU_FRACTION + 2**30
    assert plan_for(4096, 4096, 4096, "float32", workers=1, on_gpu=True).memory_budget == budget
    with dask.config.set({"distmm.memory-budget": "3MiB"}):
        assert memory_budget(on_gpu=True) == 3 * 2**20
