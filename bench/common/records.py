"""Benchmark records as the scripts under ``bench/`` write them: the command line every
benchmark has, and the results folder.

This module covers: ``parser`` (``--out-dir``, alias ``--out``) and ``RecordWriter`` writing
under ``bench/results`` unless told otherwise. The records themselves, device naming and the
commit measured live in the package (``distmm.cli.records``), where ``distmm bench`` reaches
them too; they are re-exported here.
It does not cover timing (``bench.common.timing``) or operands (``bench.common.operands``).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from distmm.cli.records import RecordWriter as _RecordWriter
from distmm.cli.records import cpu_model, git_commit, gpu_name, load, slug

__all__ = ["RESULTS", "parser", "RecordWriter", "cpu_model", "git_commit", "gpu_name", "load",
           "slug"]

#: where records go unless ``--out-dir`` says otherwise
RESULTS = Path(__file__).resolve().parent.parent / "results"


def parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is the first paragraph of ``doc`` (a module
    docstring), with the option every benchmark has: ``--out-dir`` (alias ``--out``), the
    folder the records go to (default ``bench/results``)."""
    desc = (doc or "").strip().split("\n\n")[0]
    p = argparse.ArgumentParser(prog=prog, description=desc)
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="records folder (default bench/results)")
    return p


class RecordWriter(_RecordWriter):
    """``distmm.cli.records.RecordWriter`` with ``bench/results`` as the default folder."""

    def __init__(self, benchmark: str, device: str, out_dir: str | os.PathLike | None = None,
                 **kwargs):
        super().__init__(benchmark, device, out_dir or RESULTS, **kwargs)
