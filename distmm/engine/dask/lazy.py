"""Dask-array operands: the product as a lazy ``dask.array.Array``.

This module covers: a 1-D operand promoted under keys of distmm's own (``promoted``),
wrapping a ``ProductLayer`` over the operands' own chunks
into a dask array (no rechunk is inserted; the input layers stay as they
are), in block mode (``lazy_blocks``) the layout's block tasks with one small
task per output chunk slicing it out of its block (on the block's worker,
where the block lies) and, where device chunks go through CUDA IPC, one
export task per chunk and holder, pinned to the holder (``export_layer``),
that placement joined with an enclosing ``dask.annotate``'s annotations, an operand's
reads of an HDF5 file pinned to the workers that read it (``pin_reads``), the
array class whose optimisation keeps the placement annotations (``PinnedArray``), and the
optimisation that keeps the read pins in any dask array made from such a graph
(``KeepReadPins``, ``keep_read_pins``).
It does *not* cover: the tasks or their geometry (``graph``, ``chunks``), stacks of
small matrices in numpy chunks (``stacks``), or numpy operands
(``distmm.engine.dask.eager``).
"""
from __future__ import annotations

import threading

import numpy as np

from distmm.engine.base import Operands, replace_fast
from distmm.engine.dask.chunks import Geometry
from distmm.engine.dask.graph import OperandKeys, ProductLayer, names_of
from distmm.engine.dask.placement import Placement
from distmm.engine.dask.tasks import TaskPlan, as_column, as_row
from distmm.plan import Plan

__all__ = ["promoted", "lazy_product", "lazy_blocks", "export_layer", "PinnedArray",
           "ChunkHomes", "ExportHomes", "pin_reads", "pinned", "ReadPins", "has_read_pins",
           "KeepReadPins", "keep_read_pins"]


def promoted(ops: Operands) -> Operands:
    """``ops`` with a 1-D dask operand made 2-D as numpy's matmul promotes it (a leading 1
    for ``a``, a trailing 1 for ``b``) in a layer of distmm's own name, ``distmm-row-TOKEN``
    or ``distmm-column-TOKEN``; ``a_vector``/``b_vector`` are then False (``distmm.api``
    squeezes the result by its own operands). dask.array's ``v[None, :]`` (``v[:, None]``),
    also made by its own ``v @ b``, has the name ``ops.a2`` (``ops.b2``) would have: on one
    scheduler, that key could come with two different tasks (fused by dask's optimisation
    in one graph, not in the other)."""
    if not (ops.a_vector or ops.b_vector):
        return ops
    from dask.base import tokenize

    a, b = ops.a, ops.b
    if ops.a_vector:
        a = a.map_blocks(as_row, new_axis=0, chunks=((1,),) + a.chunks, dtype=a.dtype,
                         meta=as_row(a._meta), name="distmm-row-" + tokenize(a.name))
    if ops.b_vector:
        b = b.map_blocks(as_column, new_axis=1, chunks=b.chunks + ((1,),), dtype=b.dtype,
                         meta=as_column(b._meta), name="distmm-column-" + tokenize(b.name))
    return replace_fast(ops, a=a, b=b, a_vector=False, b_vector=False)


def output_chunks(geometry_chunks, batch) -> tuple:
    """Chunks of the result: one per element along batch axes (a stack of small matrices
    takes its operands' batch chunks instead: ``stacks.batch_chunks``)."""
    return tuple((1,) * b if b else (0,) for b in batch) + tuple(geometry_chunks)


def _with_user_annotations(own: dict, keep: tuple = ()) -> dict:
    """``own`` (distmm's placement of a layer's tasks) with the annotations of an enclosing
    ``dask.annotate`` (retries, priority, resources, ...), which dask's ``Layer`` takes only
    for a layer given none: the user's win, and the user's ``workers`` replaces distmm's
    placement (its ``allow_other_workers`` too). ``keep``: keys of ``own`` that stay (an
    export task runs on its chunk's holder)."""
    import dask

    user = dask.get_annotations()
    if not user:
        return own
    if "workers" in user:
        own = {k: v for k, v in own.items() if k in keep or k not in ("workers",
                                                                      "allow_other_workers")}
    return {**own, **{k: v for k, v in user.items() if k not in keep}}


def lazy_product(ops, plan: Plan, a2, b2, geometry: Geometry, slots, backend: str):
    """The lazy ``A @ B`` of dask operands ``a2``, ``b2`` (1-D already
    promoted), with ``ops.out_shape`` and numpy's result dtype."""
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    dtype = np.dtype(ops.dtype)
    out_shape = ops.out_shape
    batch = tuple(ops.batch)
    chunks = output_chunks(geometry.chunks, batch)
    if 0 in out_shape or plan.k == 0:
        return da.zeros(out_shape, dtype=dtype, chunks=chunks)
    tp = TaskPlan.of(plan)
    # the token of what the tasks and their placement read, not of the whole plan: its
    # measured memory budget would give the same product another name
    owners = (plan.workers, plan.owners) if slots else ()
    name = "distmm-matmul-" + tokenize(a2.name, b2.name, tp, geometry, plan.reduction, backend,
                                       batch, slots, owners)
    annotations = None
    if slots:
        placement = Placement(plan, geometry, names_of(name), len(batch), plan.reduction, slots)
        annotations = _with_user_annotations({"workers": placement, "allow_other_workers": True})
    layer = ProductLayer(name, geometry,
                         OperandKeys(tuple(a2.shape), a2.chunks, a2.name),
                         OperandKeys(tuple(b2.shape), b2.chunks, b2.name),
                         tp, backend, batch, plan.reduction,
                         annotations=annotations)
    hlg = HighLevelGraph.from_collections(name, layer, dependencies=[a2, b2])
    meta = getattr(a2, "_meta", np.empty((0, 0)))
    out_meta = meta_from_array(meta, ndim=len(out_shape), dtype=dtype)
    cls = PinnedArray if annotations else da.Array
    return cls(hlg, name, chunks, dtype=dtype, meta=out_meta)


def lazy_blocks(ops, plan: Plan, a2, b2, geometry: Geometry, layout, addresses, cells,
                backend: str, sources=None, pull: bool = False, nccl=frozenset()):
    """The lazy ``A @ B`` of 2-D dask operands in block mode: ``layout``'s
    cells (on ``geometry``'s output chunk edges) as tasks on ``addresses``
    (one per unit), the output chunks sliced out of them. ``sources``
    (``distmm.plan_blocks.ipc_sources``: ``(chunk key, reader) -> holder``): those
    chunks reach their reader's tasks through an export task on the holder
    (``export_layer``); ``cells.homes`` then says each task's worker.
    ``pull`` (the workers run ``transfer.ExportLifetime``): a block task gets
    a ``pull.Pull`` of each export and asks the holder for it, so it starts
    without waiting for the export tasks; the output chunks cut from a block
    depend on the exports its worker reads, which keeps them alive until the
    block is made. ``nccl``: the ``(holder, reader)`` pairs whose exports are sent through
    NCCL (pull mode only)."""
    import bisect

    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from distmm.engine.dask.graph import make_task, task_ref
    from distmm.engine.dask.placement import BlockPlacement
    from distmm.engine.dask.pull import Pull
    from distmm.engine.dask.blocks import cut

    dtype = np.dtype(ops.dtype)
    chunks = tuple(geometry.chunks)
    if 0 in ops.out_shape or plan.k == 0:
        return da.zeros(ops.out_shape, dtype=dtype, chunks=chunks)
    # tcp: the names of before; pull or not changes what the export keys hold
    extra = (sorted(sources.items()), bool(pull)) if sources else ()
    if nccl:
        extra += (sorted(nccl),)
    tp = TaskPlan.of(plan)  # as lazy_product: not the plan's measured budget
    token = tokenize(a2.name, b2.name, tp, geometry, layout, backend, addresses, cells, *extra)
    name = "distmm-matmul-" + token
    cell_geo = Geometry.of_cells(layout.row_edges, layout.col_edges, layout.k_edges,
                                 a2.chunks, b2.chunks)
    placement = BlockPlacement(layout, names_of(name), addresses)
    exports, routes = export_layer("distmm-export-" + token, sources or {}, pull=pull,
                                   nccl=nccl)
    if exports is not None and pull:  # block tasks let their worker's exports go first
        import dataclasses

        at: dict = {}
        for ex, holder in sorted(exports.holders.items()):
            at.setdefault(holder, []).append(Pull(ex, holder))
        cells = dataclasses.replace(cells, exports_at={h: tuple(v) for h, v in at.items()})
    layer = ProductLayer(name, cell_geo,
                         OperandKeys(tuple(a2.shape), a2.chunks, a2.name,
                                     routes=routes.get(a2.name)),
                         OperandKeys(tuple(b2.shape), b2.chunks, b2.name,
                                     routes=routes.get(b2.name)), tp,
                         backend, (), layout.reduction,
                         annotations=_with_user_annotations({"workers": placement,
                                                            "allow_other_workers": True}),
                         cells=cells)
    hlg = HighLevelGraph.from_collections(name, layer, dependencies=[a2, b2])
    out_name = "distmm-chunks-" + token
    rows, cols = geometry.row_edges, geometry.col_edges
    dsk, homes = {}, {}
    anchors: dict = {}  # reader -> the export keys its tasks pull (pull mode)
    if exports is not None and pull:
        for chunk, reader in sources:
            anchors.setdefault(reader, set()).add(exports.key_of[(chunk, reader)])
    readers_of = {}  # block -> the workers of its tasks (k groups may go round the units)
    if anchors and cells.homes:
        for (bi, bj, _g), home in cells.homes.items():
            readers_of.setdefault((bi, bj), set()).add(home)
    # the block holding a chunk's first element; an empty chunk at the end (which starts at
    # m or n) is an empty slice of the last block
    last_row, last_col = len(layout.row_edges) - 2, len(layout.col_edges) - 2
    for ci in range(len(rows) - 1):
        bi = min(bisect.bisect_right(layout.row_edges, rows[ci]) - 1, last_row)
        r0 = layout.row_edges[bi]
        for cj in range(len(cols) - 1):
            bj = min(bisect.bisect_right(layout.col_edges, cols[cj]) - 1, last_col)
            c0 = layout.col_edges[bj]
            key = (out_name, ci, cj)
            held = sorted({ex for r in readers_of.get((bi, bj), ()) for ex in anchors.get(r, ())})
            dsk[key] = make_task(key, cut, task_ref((name, bi, bj)), rows[ci] - r0, rows[ci + 1] - r0,
                             cols[cj] - c0, cols[cj + 1] - c0, *[task_ref(ex) for ex in held])
            homes[(ci, cj)] = placement((name, bi, bj))
    layers = dict(hlg.layers)
    deps = dict(hlg.dependencies)
    if exports is not None:
        layers[exports.name] = exports.layer
        deps[exports.name] = set(a2.__dask_layers__()) | set(b2.__dask_layers__())
        if pull:
            deps[out_name] = {name, exports.name}
        else:
            deps[name] = set(deps[name]) | {exports.name}
    # pinned to their block's worker: many small tasks over few blocks are
    # "root-ish" to the scheduler, which would place them ignoring where the block is
    layers[out_name] = MaterializedLayer(dsk, annotations=_with_user_annotations({
        "workers": ChunkHomes(out_name, homes), "allow_other_workers": True}))
    deps.setdefault(out_name, {name})
    graph = HighLevelGraph(layers, deps)
    meta = getattr(a2, "_meta", np.empty((0, 0)))
    out_meta = meta_from_array(meta, ndim=2, dtype=dtype)
    return PinnedArray(graph, out_name, chunks, dtype=dtype, meta=out_meta)


class ExportLayer:
    """The export tasks of a block-mode product (``export_layer``): ``name``,
    ``layer`` (a ``MaterializedLayer``), ``holders`` (export key -> worker),
    ``key_of`` ((chunk key, reader) -> the export key that reader reads it through)."""

    def __init__(self, name: str, layer, holders: dict, key_of: dict):
        self.name, self.layer, self.holders, self.key_of = name, layer, holders, key_of


def export_layer(name: str, sources: dict, pull: bool = False, nccl=frozenset()):
    """The export tasks for ``sources`` (``(chunk key, reader) -> holder``),
    ``(name, i)``, pinned to their holder with ``allow_other_workers=False``
    (an export elsewhere would first fetch the chunk over TCP, the very
    transfer it replaces), ahead of other ready tasks (priority 1: a block task
    may be waiting for them). Without ``pull``: one per chunk and holder,
    running ``transfer.export_chunk``; the routes are ``{(chunk index,
    reader): export key}`` per operand name (``OperandKeys.routes``). With
    ``pull``: one per holder and reader, running ``transfer.export_chunks`` on
    the chunks that reader needs from that holder (the offers are published,
    the task returns a receipt); the routes are ``{(chunk index, reader):
    pull.Pull(key, holder, index)}``; a group whose ``(holder, reader)`` is in ``nccl``
    exports for NCCL (``export_chunks``' route). Returns the layer (None when there is
    nothing to export) and the routes."""
    from dask.highlevelgraph import MaterializedLayer

    from distmm.engine.dask.graph import make_task, task_list, task_ref
    from distmm.engine.dask.pull import Pull
    from distmm.engine.dask.transfer import export_chunk, export_chunks

    if not sources:
        return None, {}
    dsk, holders, routes, key_of = {}, {}, {}, {}
    if pull:
        groups: dict = {}
        for (chunk, reader), holder in sorted(sources.items()):
            groups.setdefault((holder, reader), []).append(chunk)
        for i, ((holder, reader), chunks) in enumerate(sorted(groups.items())):
            ex = (name, i)
            labels = [repr(c) for c in chunks]
            route = "nccl" if (holder, reader) in nccl else "ipc"
            dsk[ex] = make_task(ex, export_chunks, task_list(task_ref(c) for c in chunks), labels,
                                route)
            holders[ex] = holder
            for j, chunk in enumerate(chunks):
                key_of[(chunk, reader)] = ex
                routes.setdefault(chunk[0], {})[(tuple(chunk[1:]), reader)] = Pull(
                    ex, holder, labels[j], j)
    else:
        keys: dict = {}
        for (chunk, reader), holder in sorted(sources.items()):
            ex = keys.get((chunk, holder))
            if ex is None:
                ex = keys[(chunk, holder)] = (name, len(keys))
                dsk[ex] = make_task(ex, export_chunk, task_ref(chunk), repr(chunk))
                holders[ex] = holder
            key_of[(chunk, reader)] = ex
            routes.setdefault(chunk[0], {})[(tuple(chunk[1:]), reader)] = ex
    own = {"workers": ExportHomes(name, holders), "allow_other_workers": False, "priority": 1}
    layer = MaterializedLayer(dsk, annotations=_with_user_annotations(own, keep=tuple(own)))
    return ExportLayer(name, layer, holders, key_of), routes


class ExportHomes:
    """The ``workers=`` annotation of the export tasks: each on its chunk's holder."""

    def __init__(self, name: str, holders: dict):
        self.name, self.holders = name, dict(holders)

    def __call__(self, key):
        holder = self.holders.get(key)
        return None if holder is None else [holder]


class ChunkHomes:
    """The ``workers=`` annotation of block mode's output chunks: each on the
    worker of the block it is cut from."""

    def __init__(self, name: str, homes: dict):
        self.name, self.homes = name, dict(homes)

    def __call__(self, key):
        if isinstance(key, tuple) and len(key) == 3 and key[0] == self.name:
            return self.homes.get((key[1], key[2]))
        return None


def pin_reads(x, readers):
    """``x`` (a dask array) with its tasks that read an open HDF5 dataset pinned to the
    workers that read its file, ``allow_other_workers=False``: a worker that does not see
    the file fails the read, and one that fetches the dataset itself (the value of
    ``dask.array.from_array``'s ``original-array`` task) fails to unpickle it. The tasks
    pinned: each layer holding a dataset (``hdf5_filters.datasets_of``: as a value, or as an
    argument of the tasks reading it), and the layers taking the value of a layer that holds
    it as a value (``from_array``'s getters). ``readers(dataset)``: the workers that read it
    (None: not known, no pin from it); a layer reading several files goes to the workers that
    read them all, and stays as it was where none does (its reads fail wherever they run).
    These pins (a ``ReadPins`` list) replace a layer's own ``workers`` and
    ``allow_other_workers``; its other annotations stay. Where something is pinned, dask
    arrays made from the result keep the pins too (``keep_read_pins``). Returns ``(array,
    pinned)``: ``x`` itself and False where nothing is pinned, else a ``PinnedArray`` (same
    name and keys) and True."""
    import copy

    from dask.highlevelgraph import HighLevelGraph

    from distmm.hdf5_filters import datasets_of

    graph = x.__dask_graph__()
    layers = getattr(graph, "layers", None)
    if not layers:
        return x, False
    pins: dict = {}
    holders: set = set()  # layers with a task whose value is a dataset
    for name, layer in layers.items():
        found = datasets_of(_one_layer(name, layer))
        known = [frozenset(r) for r in map(readers, found) if r is not None]
        if known:
            pins[name] = frozenset.intersection(*known)
            if _holds_value(layer):
                holders.add(name)
    for name, deps in graph.dependencies.items():
        for dep in set(deps) & holders:
            pins[name] = pins[dep] if name not in pins else pins[name] & pins[dep]
    pins = {name: workers for name, workers in pins.items() if workers}
    if not pins:
        return x, False
    new = dict(layers)
    for name, workers in pins.items():
        new[name] = copy.copy(layers[name])  # dask's Layer.__copy__: shallow, its tasks shared
        new[name].annotations = {**(layers[name].annotations or {}),
                                 "workers": ReadPins(sorted(workers)),
                                 "allow_other_workers": False}
    keep_read_pins()
    return pinned(x, HighLevelGraph(new, graph.dependencies)), True


class ReadPins(list):
    """The ``workers`` annotation of tasks that read an HDF5 file (``pin_reads``): the
    workers that read it, a list to the scheduler and to dask's blockwise fusion; its type
    marks the layer for ``KeepReadPins``."""

    __slots__ = ()


def has_read_pins(graph) -> bool:
    """Whether a layer of ``graph`` (a ``HighLevelGraph``) has its tasks pinned by
    ``pin_reads``."""
    layers = getattr(graph, "layers", None) or {}
    return any(isinstance((layer.annotations or {}).get("workers"), ReadPins)
               for layer in layers.values())


class KeepReadPins:
    """dask.array's optimisation of a graph (``fallback``), except for a graph with reads
    pinned by ``pin_reads`` (``has_read_pins``): that one is only culled, its layers and
    their annotations kept (``fallback`` would fuse tasks into a plain dict, dropping the
    annotations and renaming the tasks). Values are the same either way."""

    def __init__(self, fallback):
        self.fallback = fallback

    def __call__(self, dsk, keys, **kwargs):
        if has_read_pins(dsk):
            return _cull_only(dsk, keys)
        return self.fallback(dsk, keys, **kwargs)


class _ArrayOptimize:
    """``dask.array.Array.__dask_optimize__`` as ``keep_read_pins`` sets it: dask's own
    (``own``, a descriptor reading dask's ``array_optimize`` setting), with dask's default
    optimisation in a ``KeepReadPins``; an ``array_optimize`` of the user's is theirs."""

    def __init__(self, own, default, keeping):
        self.own, self.default, self.keeping = own, default, keeping

    def __get__(self, instance, owner=None):
        optimize = self.own.__get__(instance, owner)
        if optimize is not self.default:
            return optimize
        # an array without read pins keeps dask's own function: a scheduler that runs the
        # optimisation (newer dask) needs no distmm for it
        if instance is not None and not has_read_pins(instance.__dask_graph__()):
            return optimize
        return self.keeping


_KEEP_LOCK = threading.Lock()


def keep_read_pins() -> bool:
    """Make the optimisation of every plain ``dask.array.Array`` (``r + 1``, ``r.sum()``,
    ``da.map_blocks``, ``da.concatenate`` ... of a lazy result) keep the read pins of
    ``pin_reads`` (``KeepReadPins``), where dask's default optimisation would drop them:
    dask.array's ``__dask_optimize__`` is the array class's own, with no per-array hook.
    Client-side in dask 2024.12 (``Client.compute``/``persist`` optimise, then send the
    layers' annotations), on the scheduler in newer dask (the client sends the optimisation
    function with the graph). Arrays without such pins, and an ``array_optimize`` set in
    ``dask.config`` (the user's optimisation), are as before. Returns whether it is in
    place (False: dask.array's class has no such descriptor, and is left alone)."""
    import dask.array as da
    from dask.array.optimization import optimize

    with _KEEP_LOCK:
        own = da.Array.__dict__.get("__dask_optimize__")
        if isinstance(own, _ArrayOptimize):
            return True
        if not hasattr(own, "__get__"):
            return False
        da.Array.__dask_optimize__ = _ArrayOptimize(own, optimize, KeepReadPins(optimize))
        return True


def _one_layer(name: str, layer):
    """A collection whose graph is ``layer`` alone (what ``datasets_of`` walks)."""
    from types import SimpleNamespace

    from dask.highlevelgraph import HighLevelGraph

    graph = HighLevelGraph({name: layer}, {name: set()})
    return SimpleNamespace(__dask_graph__=lambda: graph)


def _holds_value(layer) -> bool:
    """Whether a task of ``layer`` (a materialized one) is an h5py dataset itself, bare or in
    a data node of dask's task spec."""
    import sys

    from collections.abc import Mapping

    h5py = sys.modules.get("h5py")
    mapping = getattr(layer, "mapping", None)
    if h5py is None or not isinstance(mapping, Mapping):
        return False
    return any(isinstance(v.value if type(v).__name__ == "DataNode" else v, h5py.Dataset)
               for v in mapping.values())


def pinned(x, graph=None):
    """``x`` as a ``PinnedArray`` (over ``graph`` instead of its own where given): its name,
    chunks, dtype and meta; ``x`` itself where it is one already and no graph is given."""
    if graph is None and isinstance(x, PinnedArray):
        return x
    return PinnedArray(x.dask if graph is None else graph, x.name, x.chunks, x.dtype, x._meta)


def _cull_only(dsk, keys, **kwargs):
    from dask.core import flatten
    from dask.highlevelgraph import HighLevelGraph

    if not isinstance(dsk, HighLevelGraph):
        dsk = HighLevelGraph.from_collections(str(id(dsk)), dsk, dependencies=())
    return dsk.cull(set(flatten(keys)))


#: numpy functions whose result over a ``PinnedArray`` is one too (``PinnedArray``)
_KEPT_FUNCTIONS = frozenset({"squeeze", "transpose", "permute_dims", "matrix_transpose",
                             "reshape", "ravel", "swapaxes", "moveaxis", "expand_dims",
                             "astype"})

#: dask.array.Array's methods whose result over a ``PinnedArray`` is one too (``.T`` calls
#: ``transpose``, ``flatten`` is ``ravel``)
_KEPT_METHODS = ("__getitem__", "squeeze", "transpose", "reshape", "ravel", "swapaxes",
                 "astype", "rechunk")


def _pinned_array_class():
    import functools

    import dask.array as da

    def kept(x):
        """``x`` a ``PinnedArray`` where it is a plain ``dask.array.Array``."""
        return PinnedArray(x.dask, x.name, x.chunks, x.dtype, x._meta) if type(x) is da.Array \
            else x

    def keeping(method):
        """dask.array.Array's ``method``, its result made a ``PinnedArray`` (``kept``)."""
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            return kept(method(self, *args, **kwargs))
        return wrapper

    class PinnedArray(da.Array):
        """A ``dask.array.Array`` whose own optimisation only culls.

        dask.array's default optimisation fuses tasks into a plain dict and so drops the
        layers' annotations: the plan's worker pins (loose) and the pins of reads of a file
        that only some workers see (``pin_reads``). Computing or persisting the result
        itself keeps them all, and so do its copies (pickled, ``copy``, ``copy.deepcopy``)
        and the arrays made from it by indexing, ``squeeze``, ``transpose`` (``.T``),
        ``reshape``, ``ravel`` (``flatten``), ``swapaxes``, ``astype`` and ``rechunk`` (as
        methods, or numpy's functions of those names and ``moveaxis``, ``expand_dims``,
        ``permute_dims``, ``matrix_transpose``), which are ``PinnedArray`` objects too.
        Any other array derived from it (arithmetic, ufuncs, reductions, ``map_blocks``,
        ``da.concatenate`` or ``da.stack`` with other arrays, ...) is a plain
        ``dask.array.Array``: where its graph reads such a file, dask.array's optimisation
        only culls it too and every pin stays (``keep_read_pins``; unless ``dask.config``'s
        ``array_optimize`` names another optimisation); otherwise its tasks are fused and
        placed by the scheduler's own heuristics. What flattens the graph into one layer
        without annotations drops the pins: ``dask.optimize`` of it, ``da.store``,
        ``to_zarr``, ``to_hdf5``, ``to_delayed``.
        """

        __slots__ = ()
        __dask_optimize__ = staticmethod(_cull_only)

        # dask.array.Array's own copies are plain Arrays, whose optimisation drops the pins
        def __reduce__(self):
            return (PinnedArray, (self.dask, self.name, self.chunks, self.dtype, self._meta))

        def copy(self):  # copy.deepcopy's too
            return PinnedArray(self.dask, self.name, self.chunks, self.dtype, self._meta)

        def __array_function__(self, func, types, args, kwargs):
            out = super().__array_function__(func, types, args, kwargs)
            return kept(out) if getattr(func, "__name__", None) in _KEPT_FUNCTIONS else out

    for name in _KEPT_METHODS:
        setattr(PinnedArray, name, keeping(getattr(da.Array, name)))
    PinnedArray.flatten = PinnedArray.ravel
    PinnedArray.__module__ = __name__
    PinnedArray.__qualname__ = "PinnedArray"  # pickled by reference as lazy.PinnedArray
    return PinnedArray


PinnedArray = _pinned_array_class()
