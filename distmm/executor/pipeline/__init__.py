"""The GPU stream pipeline: products of host-resident operands at in-core speed.

Modules, in the order a product passes them:

- ``product``: ``run_pipelined`` -- device budget, the planner's schedule
  (``distmm.plan_pipeline``), out-of-memory retries;
- ``run``: one attempt -- staging threads, three CUDA streams, output writer;
- ``device``: the cupy calls (streams, events, copies, a budgeted pool);
- ``timeline``: what ran when (``distmm trace`` draws it).

The staging buffers are ``distmm.executor.pinned``'s; cuBLAS is
``distmm.executor.cublas``. This package never imports ``distmm.executor.gpu``
(the GPU executor calls it, not the other way round).
"""
from __future__ import annotations

from distmm.executor.pipeline.product import run_pipelined
from distmm.executor.pipeline.timeline import Timeline
from distmm.plan_pipeline import FAST_DTYPES, PipelineTiling, choose_tiling, plan_block_loads

__all__ = ["run_pipelined", "Timeline", "PipelineTiling", "choose_tiling", "plan_block_loads",
           "FAST_DTYPES"]
