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

import sys

__all__ = ["main"]


def main(argv=None) -> int:
    """Run ``distmm`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    The commands' modules (numpy, dask) load here, after the entry point has started, so that
    a Ctrl-C during their import ends with the command's one line and 130, as later."""
    try:
        from distmm.cli.commands import main as run
    except KeyboardInterrupt:
        args = sys.argv[1:] if argv is None else list(argv)
        command = next((a for a in args if not a.startswith("-")), "")
        print(f"distmm{' ' + command if command else ''}: error: interrupted (SIGINT)",
              file=sys.stderr, flush=True)
        return 130
    return run(argv)
