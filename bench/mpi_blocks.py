"""Benchmark operands made block by block, the same matrix whatever the ranks: moved into the
package (``distmm.cli.blocks``, where ``distmm bench`` reaches it); this name stays for the
scripts under ``bench/``.

It covers nothing of its own.
"""
from __future__ import annotations

from distmm.cli.blocks import A, B, block, full, rows, sample_rows  # noqa: F401

__all__ = ["block", "full", "rows", "sample_rows", "A", "B"]
