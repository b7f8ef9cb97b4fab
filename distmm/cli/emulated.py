"""The ``mpiexec`` command line that runs P ranks of one host as N emulated nodes.

This module covers: ``mpiexec_command``, Open MPI's MPMD form of a launch (one app context
per emulated node, ``-n P/N -x VAR=value ... program`` joined by ``:``), each context with
its node's environment (``distmm.emulate.Layout.environment``) and the job's Open MPI
transport given once before the first context (``Layout.job_environment``); with one node
(nothing emulated) the plain ``mpiexec -n P program``. The study runner
(``distmm.cli.bench``) launches through it, and ``docs/performance.md`` shows it by hand.
It does *not* cover: the layout and its environment (``distmm.emulate``), or running the
command. ``-x VAR=value`` is Open MPI's (4 and 5); other launchers spell it otherwise.
"""
from __future__ import annotations

from typing import Sequence

from distmm.emulate import Layout, layout

__all__ = ["mpiexec_command"]


def _exports(env: dict[str, str]) -> list[str]:
    out = []
    for name, value in env.items():
        out += ["-x", f"{name}={value}"]
    return out


def mpiexec_command(mpiexec: Sequence[str], ranks: int, nodes: int | str | Layout,
                    program: Sequence[str]) -> list[str]:
    """The argv of ``ranks`` ranks of ``program`` as ``nodes`` emulated nodes.

    Parameters
    ----------
    mpiexec : sequence of str
        The launcher and its own options (``["mpiexec", "--bind-to", "core"]``).
    ranks : int
    nodes : int, ``"all-links"`` or Layout
        As ``distmm.emulate.layout`` takes it (a ``Layout`` must have ``ranks`` members).
    program : sequence of str
        What every rank runs (``[sys.executable, "-m", "distmm", "matmul", ...]``).

    Raises
    ------
    ValueError
        An uneven split (``distmm.emulate.layout``), or a ``Layout`` of another size.

    Examples
    --------
    >>> cmd = mpiexec_command(["mpiexec"], 4, 2, ["prog"])
    >>> cmd[:3], cmd.count(":"), cmd.count("prog"), "DISTMM_EMULATED_NODE=1" in cmd
    (['mpiexec', '-x', 'OMPI_MCA_pml=ob1'], 1, 2, True)
    >>> mpiexec_command(["mpiexec"], 4, 1, ["prog"])
    ['mpiexec', '-n', '4', 'prog']
    """
    lay = nodes if isinstance(nodes, Layout) else layout(ranks, nodes)
    if lay.members != ranks:
        raise ValueError(f"the layout has {lay.members} members, the launch {ranks} ranks")
    head = list(mpiexec)
    if not lay.active:
        return head + ["-n", str(ranks), *program]
    argv = head + _exports(lay.job_environment())
    for node in range(lay.nodes):
        if node:
            argv.append(":")
        argv += ["-n", str(lay.per_node), *_exports(lay.environment(node)), *program]
    return argv
