"""distmm's kernels: CUDA sources (``cuda/*.cu``) and numba CPU kernels.

Installed as the ``distmm.kernels`` package; in a source checkout the top-level
``kernels/`` folder stands in for it (see ``distmm/__init__.py``).
"""
from __future__ import annotations

from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
