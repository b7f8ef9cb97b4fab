"""The ``distmm`` command line and its file I/O.

This package covers: the commands (``distmm.cli.commands``: ``demo``,
``plan``, ``matmul``, ``info``; ``tune`` and ``trace`` for the GPU; ``cluster`` in
``distmm.cli.serve``), connecting to a scheduler (``distmm.cli.connect``), reading
operands and writing results without touching anything but the target
(``distmm.cli.io``), exit statuses and signals (``distmm.cli.exits``) and the
MPI launcher's environment (``distmm.cli.launch``). It uses only the public
API. It does *not* cover: computing products (``distmm.api``).
"""
from __future__ import annotations

from distmm.startup import guard

with guard():
    from distmm.cli.commands import main

__all__ = ["main"]
