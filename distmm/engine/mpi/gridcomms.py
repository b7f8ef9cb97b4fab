"""The communicators of a process grid, made once per communicator and reused.

This module covers: ``GridComms`` (one communicator per process row and one per
process column, each with its panel broadcaster; a dimension of one rank gets
neither a communicator nor a broadcaster, so a 1 x 1 grid makes nothing), and
the cache that keeps them: ``grid_comms(comm, grid, ...)`` returns the
``GridComms`` for ``comm``, the grid's shape, the device and the broadcast
choice, making it on the first call only (making and destroying NCCL
communicators can cost more than a whole moderate product: ``bench/NOTES.md``,
communicators made once); ``local_gpu(comm)`` picks this rank's GPU once per
communicator.

The cache lives on the communicator itself (an MPI attribute), so it goes when
the communicator goes: ``comm.Free()`` runs the attribute's delete callback,
which closes every ``GridComms`` made for it. ``release_all()`` closes
everything; it runs at interpreter exit (``atexit``, before mpi4py finalizes
MPI) and inside ``MPI.Finalize()`` (an attribute on ``COMM_SELF``, whose delete
callback MPI runs first). ``cache_stats()`` counts creations, reuses and
releases for tests.

Every rank of ``comm`` must ask for the same grids in the same order (the
engine does: the grid is a pure function of the plan), because making a
``GridComms`` is collective (``Split``, NCCL's unique id).
It does *not* cover: moving panels (``distmm.engine.mpi.comm``) or the
algorithm (``distmm.engine.mpi.summa``).
"""
from __future__ import annotations

import atexit
import threading

from distmm.engine.mpi.comm import make_broadcaster, select_local_gpu
from distmm.grid import GridPlan

__all__ = ["GridComms", "grid_comms", "local_gpu", "cache_stats", "release", "release_all"]

_LOCK = threading.RLock()
_STATS = {"creations": 0, "reuses": 0, "releases": 0}
#: id(cache) -> (communicator, cache) for every communicator holding a cache
_LIVE: dict[int, tuple] = {}
_KEYVAL = None  # the attribute holding a communicator's cache
_FINAL_KEYVAL = None  # the attribute on COMM_SELF whose deletion (MPI_Finalize) releases all


class GridComms:
    """Row and column communicators of a grid with their broadcasters (close them).

    Parameters
    ----------
    comm : mpi4py communicator with ``grid.ranks`` ranks
    grid : GridPlan
        Only its shape matters: the same ``GridComms`` serves every product on it.
    on_gpu : bool
        Panels are cupy arrays (NCCL, CUDA-aware or staged MPI).
    prefer : str
        See ``distmm.engine.mpi.comm.make_broadcaster``.

    Attributes
    ----------
    row, col
        Broadcasters along the process row and column (``NullBroadcaster`` for one rank).
    bytes_received : int
        Bytes this rank received since the object was made (panels and layer partials).
    nccl_communicators : int
        NCCL communicators this object made (0 on one rank, 2 at most).
    hosts : int
        Hosts the communicator's ranks are on (``distmm.emulate.link_host``: an emulated
        node counts as a host).
    """

    def __init__(self, comm, grid: GridPlan, *, on_gpu: bool = False, prefer: str = "auto"):
        if comm.size != grid.ranks:
            raise ValueError(f"the grid is for {grid.ranks} ranks, the communicator has {comm.size}")
        self.comm, self.shape = comm, grid.shape
        self.row_comm = self.col_comm = None
        layer, i, j = grid.coords(comm.rank)
        if grid.cols > 1:
            self.row_comm = comm.Split(color=layer * grid.rows + i, key=j)
        if grid.rows > 1:
            self.col_comm = comm.Split(color=layer * grid.cols + j, key=i)
        self.row = make_broadcaster(self.row_comm, on_gpu=on_gpu, prefer=prefer)
        self.col = make_broadcaster(self.col_comm, on_gpu=on_gpu, prefer=prefer)
        self.hosts = host_count(comm)  # the panels' width follows it
        self.nccl_communicators = sum(getattr(b, "nccl", None) is not None
                                      for b in (self.row, self.col))
        self.reduce_bytes = 0

    @property
    def bytes_received(self) -> int:
        return self.row.bytes_received + self.col.bytes_received + self.reduce_bytes

    @property
    def closed(self) -> bool:
        return self.row is None

    def close(self) -> None:
        """Destroy the broadcasters (NCCL communicators, pinned buffers) and free the
        sub-communicators. Idempotent."""
        for b in (getattr(self, "row", None), getattr(self, "col", None)):
            if b is not None:
                b.close()
        for c in (getattr(self, "row_comm", None), getattr(self, "col_comm", None)):
            if c is not None:
                _free(c)
        self.row = self.col = self.row_comm = self.col_comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def host_count(comm) -> int:
    """Hosts ``comm``'s ranks are on (collective); an emulated node counts as a host of its
    own (``distmm.emulate.link_host``)."""
    from distmm.emulate import link_host

    return len(set(comm.allgather(link_host())))


def grid_comms(comm, grid: GridPlan, *, on_gpu: bool = False, prefer: str = "auto",
               device: int | None = None) -> GridComms:
    """The ``GridComms`` of ``comm`` for ``grid``'s shape, made on the first call and
    reused after (do not close it: it belongs to ``comm``).

    Parameters
    ----------
    comm : mpi4py communicator
    grid : GridPlan
    on_gpu, prefer :
        As for ``GridComms``; part of the key.
    device : int, optional
        The GPU the broadcasters run on (part of the key; NCCL communicators and
        streams belong to one device).
    """
    key = ("grid", grid.shape, bool(on_gpu), device, prefer)
    if on_gpu:
        import cupy  # noqa: F401 - imported before the exit hook is registered, so it runs first
    cache = _cache(comm)
    with _LOCK:
        found = cache.get(key)
        if found is not None and not found.closed:
            _STATS["reuses"] += 1
            return found
    made = GridComms(comm, grid, on_gpu=on_gpu, prefer=prefer)
    with _LOCK:
        cache[key] = made
        _STATS["creations"] += 1
    return made


def local_gpu(comm) -> int:
    """Use (and return) this rank's GPU, chosen once per communicator.

    The first call asks ``distmm.engine.mpi.comm.select_local_gpu``, which takes
    ``distmm.engine.mpi.binding.bind_rank``'s choice (the node-local rank from the
    launcher's variables, else the MPI shared-memory split, over the devices
    ``CUDA_VISIBLE_DEVICES`` or Slurm leave this rank, round-robin where ranks outnumber
    them) and makes it current; later calls make the cached device current again. The
    first call is collective on ``comm``: every rank must make it.

    Raises
    ------
    BackendUnavailable
        A rank of ``comm`` sees no GPU (``select_local_gpu`` raises it on every rank).
    """
    import cupy  # before the cache's exit hook is registered: that hook then runs first

    cache = _cache(comm)
    device = cache.get("local_gpu")
    if device is None:
        device = cache["local_gpu"] = select_local_gpu(comm)
    else:
        cupy.cuda.Device(device).use()
    return device


def cache_stats() -> dict:
    """``{"creations", "reuses", "releases", "live", "nccl_communicators"}``: GridComms
    made, found again, and closed by this process; those open now, and the NCCL
    communicators they hold."""
    with _LOCK:
        live = [g for _, cache in _LIVE.values() for g in cache.values()
                if isinstance(g, GridComms) and not g.closed]
        return dict(_STATS, live=len(live), nccl_communicators=sum(g.nccl_communicators for g in live))


def release(comm) -> None:
    """Close every ``GridComms`` cached on ``comm`` now (the attribute is deleted; the
    next product makes them again). ``comm.Free()`` does this by itself."""
    from mpi4py import MPI

    if _KEYVAL is None or MPI.Is_finalized():
        return
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)  # runs _on_delete


def release_all() -> None:
    """Close every cached ``GridComms`` of every communicator (at exit and in Finalize)."""
    with _LOCK:
        entries = list(_LIVE.values())
    for comm, cache in entries:
        try:
            release(comm)
        except Exception:  # noqa: BLE001 - a communicator freed behind our back: close directly
            _close_cache(cache)


# -- the attribute ---------------------------------------------------------------------------

def _cache(comm) -> dict:
    """The dict cached on ``comm`` (made and attached on first use)."""
    global _KEYVAL, _FINAL_KEYVAL
    from mpi4py import MPI

    with _LOCK:
        if _KEYVAL is None:
            _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_on_delete)
            _FINAL_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_on_finalize)
            MPI.COMM_SELF.Set_attr(_FINAL_KEYVAL, True)
            atexit.register(_at_exit)  # after mpi4py's import: runs before its MPI_Finalize
        cache = comm.Get_attr(_KEYVAL)
        if cache is None:
            cache = {}
            comm.Set_attr(_KEYVAL, cache)
            _LIVE[id(cache)] = (comm, cache)
        return cache


def _close_cache(cache: dict) -> None:
    with _LOCK:
        _LIVE.pop(id(cache), None)
        grids = [g for g in cache.values() if isinstance(g, GridComms)]
        cache.clear()
    for g in grids:
        if not g.closed:
            g.close()
            with _LOCK:
                _STATS["releases"] += 1


def _on_delete(comm, keyval, cache) -> None:
    """MPI's delete callback: ``comm`` is being freed (or its attribute deleted)."""
    _close_cache(cache)


def _on_finalize(comm, keyval, value) -> None:
    """MPI_Finalize deletes COMM_SELF's attributes first, while MPI still works."""
    release_all()


def _at_exit() -> None:
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    release_all()
    if _FINAL_KEYVAL is not None and MPI.COMM_SELF.Get_attr(_FINAL_KEYVAL) is not None:
        MPI.COMM_SELF.Delete_attr(_FINAL_KEYVAL)


def _free(comm) -> None:
    from mpi4py import MPI

    if not MPI.Is_finalized():
        comm.Free()
