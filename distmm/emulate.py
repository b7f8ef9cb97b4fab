"""Emulated nodes on one host: which node each rank or worker belongs to, and its environment.

This module covers: the layout of ``members`` ranks (or Dask workers) split into ``nodes``
emulated nodes of equal size (``layout``, ``Layout``: member ``i`` is on node
``i // per_node``); the environment each node's members get (``Layout.environment``:
``DISTMM_EMULATED_NODE``, and for NCCL a host ID of the node's own with its network
transport on loopback sockets) and the one every member of an MPI job gets
(``Layout.job_environment``: Open MPI's ob1 and TCP); the crude mode (``ALL_LINKS``: every
link between GPUs forced onto the network path, P2P and shared memory off for everyone);
and, inside a member, the host identity by which distmm decides about links
(``link_host``: the real host name, with ``/emulated-node-<i>`` appended where
``DISTMM_EMULATED_NODE`` is set). It is pure and imports nothing of the engines.
It does *not* cover: launching (``distmm.cli.emulated`` builds the ``mpiexec`` command;
``distmm.cli.cluster`` starts Dask workers with their node's environment), or binding a
rank to a GPU, which stays with the real host's node-local rank
(``distmm.engine.mpi.binding``) so that ranks of every emulated node bind distinct GPUs.

What is emulated, and what is not
---------------------------------
NCCL takes two ranks for one node when their host hashes agree; ``NCCL_HOSTID`` replaces
the hash's input, so ranks of different emulated nodes connect through NCCL's network
transport (``NCCL_NET=Socket``, ``NCCL_IB_DISABLE=1``, ``NCCL_SOCKET_IFNAME=lo``: TCP over
loopback; ``NCCL_MNNVL_ENABLE=0``: no multi-node NVLink fabric), while ranks of one node keep
P2P (NVLink) and SHM. Open MPI cannot choose its
transport per pair of ranks: the job's host traffic goes over ``pml ob1`` and ``btl
self,tcp`` on loopback for every pair, inside an emulated node too. A Dask cluster's
comms are TCP between all workers; CUDA IPC (``dask-device-transfer``) is used only
between workers of one emulated node. The link is loopback TCP on one host: bandwidth
and latency are those of the host's network stack, not of a real network.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ENV_NODE", "ENV_NODES", "ALL_LINKS", "Layout", "layout", "this_node", "link_host",
           "record_value"]

#: this process's emulated node (0-based), set by the launcher
ENV_NODE = "DISTMM_EMULATED_NODE"
#: how many emulated nodes the job has (``ALL_LINKS`` in the crude mode)
ENV_NODES = "DISTMM_EMULATED_NODES"
#: the crude mode: every member its own node, NCCL's P2P and SHM off for everyone
ALL_LINKS = "all-links"

# NCCL_MNNVL_ENABLE=0: where GPUs share an NVLink fabric across hosts (GB200 NVL72), NCCL
# would otherwise join "different hosts" through it again
_NETWORK = {"NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_MNNVL_ENABLE": "0"}
_OPEN_MPI = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
             "OMPI_MCA_btl_tcp_if_include": "lo"}


@dataclass(frozen=True)
class Layout:
    """``members`` ranks or workers as ``nodes`` emulated nodes of ``per_node`` each.

    ``all_links``: the crude mode (``ALL_LINKS``): every member is its own node and NCCL's
    P2P and SHM transports are off for everyone. ``nodes == 1`` (and not ``all_links``)
    emulates nothing: no environment, the plain launch."""

    members: int
    nodes: int
    all_links: bool = False

    @property
    def per_node(self) -> int:
        return self.members // self.nodes

    @property
    def active(self) -> bool:
        """Whether anything is emulated."""
        return self.all_links or self.nodes > 1

    @property
    def record_value(self) -> int | str | None:
        """The records' ``emulated_nodes``: the node count, ``"all-links"``, or None."""
        if self.all_links:
            return ALL_LINKS
        return self.nodes if self.nodes > 1 else None

    def node_of(self, member: int) -> int:
        """The node of member ``member`` (0-based; members of a node are consecutive)."""
        if not 0 <= member < self.members:
            raise IndexError(f"member {member} is not one of the layout's {self.members}")
        return member // self.per_node

    def members_of(self, node: int) -> range:
        if not 0 <= node < self.nodes:
            raise IndexError(f"node {node} is not one of the layout's {self.nodes}")
        return range(node * self.per_node, (node + 1) * self.per_node)

    def environment(self, node: int) -> dict[str, str]:
        """The variables node ``node``'s members get (empty when nothing is emulated).

        Examples
        --------
        >>> layout(4, 2).environment(1)["NCCL_HOSTID"]
        'distmm-emulated-node-1'
        >>> layout(4, 1).environment(0)
        {}
        """
        self.members_of(node)
        if not self.active:
            return {}
        env = {ENV_NODE: str(node), ENV_NODES: str(self.record_value), **_NETWORK}
        if self.all_links:
            env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
        else:
            env["NCCL_HOSTID"] = f"distmm-emulated-node-{node}"
        return env

    def job_environment(self) -> dict[str, str]:
        """The Open MPI variables every rank of the job gets (one transport for the whole
        job: Open MPI chooses it per job, not per pair of ranks). Empty when nothing is
        emulated."""
        return dict(_OPEN_MPI) if self.active else {}

    def describe(self) -> str:
        if self.all_links:
            return f"{self.members} members, every link on the network path (all-links)"
        if not self.active:
            return f"{self.members} members on one node (nothing emulated)"
        return f"{self.members} members as {self.nodes} emulated nodes of {self.per_node}"


def layout(members: int, nodes: int | str = 1) -> Layout:
    """The layout of ``members`` ranks or workers as ``nodes`` emulated nodes.

    Parameters
    ----------
    members : int
        Ranks or workers, at least 1.
    nodes : int or ``"all-links"``
        Emulated nodes; they must divide ``members`` (every node the same size).
        ``"all-links"``: the crude mode, one node per member.

    Returns
    -------
    Layout

    Raises
    ------
    ValueError
        ``members`` or ``nodes`` below 1, ``nodes`` more than ``members``, or an uneven
        split.

    Examples
    --------
    >>> [layout(4, 2).node_of(i) for i in range(4)]
    [0, 0, 1, 1]
    >>> layout(6, 4)
    Traceback (most recent call last):
    ...
    ValueError: 6 members do not split evenly into 4 emulated nodes: use a node count that divides 6
    """
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"members must be a positive integer, got {members!r}")
    if nodes == ALL_LINKS:
        return Layout(members, members, all_links=True)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"emulated nodes must be a positive integer or {ALL_LINKS!r}, got "
                         f"{nodes!r}")
    if nodes > members:
        raise ValueError(f"{nodes} emulated nodes need at least {nodes} members, got {members}")
    if members % nodes:
        raise ValueError(f"{members} members do not split evenly into {nodes} emulated nodes: "
                         f"use a node count that divides {members}")
    return Layout(members, nodes)


def this_node(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's emulated node (``DISTMM_EMULATED_NODE``), or None where none is set.

    Raises ``ValueError`` for a value that is not a non-negative integer."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_NODE)
    if raw is None or not raw.strip():
        return None
    try:
        node = int(raw)
    except ValueError:
        node = -1
    if node < 0:
        raise ValueError(f"{ENV_NODE}={raw!r} is not a node number (0, 1, ...)")
    return node


def link_host(host: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The host as distmm's decisions about links see it: ``host`` (default
    ``socket.gethostname()``), with ``/emulated-node-<i>`` appended inside emulated node
    ``i``. Two processes share links (shared memory, a page cache, CUDA IPC) when their
    ``link_host`` agree. Not for binding devices: that stays the real host's.

    Examples
    --------
    >>> link_host("n1", {"DISTMM_EMULATED_NODE": "1"}), link_host("n1", {})
    ('n1/emulated-node-1', 'n1')
    """
    host = socket.gethostname() if host is None else host
    node = this_node(environ)
    return host if node is None else f"{host}/emulated-node-{node}"


def record_value(environ: Mapping[str, str] | None = None) -> int | str | None:
    """The ``emulated_nodes`` this process was launched with (``DISTMM_EMULATED_NODES``:
    a count, or ``"all-links"``), or None."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_NODES) or "").strip()
    if not raw or this_node(env) is None:
        return None
    return ALL_LINKS if raw == ALL_LINKS else int(raw) if raw.isdigit() else raw
