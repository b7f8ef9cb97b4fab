"""A Dask preload that imports the Dask engine's task modules as a scheduler or worker starts.

A scheduler reads a graph, and a worker runs its tasks, only once the modules that hold
the task bodies are imported; without this, a new cluster's first distmm product waits for
those imports on the scheduler and on every worker (about 0.1 s of a 0.3 s first call on a
2-core VM: ``bench/research/scheduler_imports.py``). distmm's own clusters (``distmm
cluster``, ``demo``, ``bench``: ``distmm.cli.cluster``) load it; name it to a scheduler or
worker started otherwise, ``dask scheduler --preload distmm.engine.dask.preload``.
It does *not* cover: importing anything a product does not need (cupy and numba are
imported by the tasks that use them).
"""
from __future__ import annotations

import distmm.engine.dask.blocks  # noqa: F401 - block mode's task bodies
import distmm.engine.dask.files  # noqa: F401 - workers reading operand files
import distmm.engine.dask.graph  # noqa: F401 - the graph's layer and its task specs
import distmm.engine.dask.pull  # noqa: F401 - chunks fetched from their holders
import distmm.engine.dask.sink  # noqa: F401 - workers writing C into a staged file
import distmm.engine.dask.tasks  # noqa: F401 - tile tasks, panels, the reduction tree
import distmm.engine.dask.transfer  # noqa: F401 - CUDA IPC exports

__all__: list[str] = []
