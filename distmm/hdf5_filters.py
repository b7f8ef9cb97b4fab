"""HDF5 datasets whose data goes through a filter this process's HDF5 lacks.

This module covers: telling whether an h5py dataset needs a filter of its pipeline that
this HDF5 cannot apply (not built in, not registered, no plugin found: a compression
plugin not installed), and refusing such a dataset, before anything reads or writes it, in
one line naming it and the filter (``check_filters``). The command line's operands
(``distmm.cli.io``) and the API's operands and ``out=`` (``distmm.api``) are checked here;
the HDF5 of Dask workers that read an operand's file runs ``missing_filter`` there
(``distmm.engine.dask.files.visible``). A dask array over h5py datasets
(``dask.array.from_array``) reads them when computed: ``datasets_of`` finds them in its graph.
It does *not* cover: opening files, or a filter that fails on a chunk it has
(``distmm.errors.UnreadableInput``).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

__all__ = ["is_dataset", "dataset_name", "datasets_of", "missing_filter", "check_filters",
           "FILTER_NAMES"]

#: names of filters registered with The HDF Group that HDF5 itself lacks (their plugins are
#: separate), for a file whose pipeline names none
FILTER_NAMES = {307: "bzip2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle",
                32013: "zfp", 32015: "zstd", 32017: "sz", 32026: "blosc2"}


def is_dataset(x) -> bool:
    """Whether ``x`` is an h5py dataset (h5py is not imported: a dataset means it is)."""
    h5py = sys.modules.get("h5py")
    return h5py is not None and isinstance(x, h5py.Dataset)


def dataset_name(x) -> str:
    """An open h5py dataset as ``FILE:/PATH``."""
    return f"{x.file.filename}:{x.name}"


def datasets_of(x) -> list:
    """The open h5py datasets the dask array ``x`` reads when computed, as
    ``dask.array.from_array`` puts them in its graph: a value of a layer of its own (the
    graph's "original" array), with ``inline_array=True`` an argument of the layer that
    reads it, or, in an optimised graph (``dask.optimize``), an argument of the tasks it was
    inlined into (fused ones included); each once, [] for anything else. Only the arguments
    of tasks that read an array are walked (``_READERS``), never the data of an array."""
    h5py = sys.modules.get("h5py")
    if h5py is None or not hasattr(x, "__dask_graph__"):
        return []
    graph = x.__dask_graph__()  # None for a collection not backed by dask (xarray's)
    found: dict = {}
    for layer in getattr(graph, "layers", {"": graph}).values():
        if hasattr(layer, "indices"):  # Blockwise: its literal arguments (index None)
            values = [v for v, index in layer.indices if index is None]
        else:  # a MaterializedLayer (its mapping), or a plain dict graph
            values = getattr(layer, "mapping", layer)
            values = values.values() if isinstance(values, Mapping) else ()
        _find(values, h5py.Dataset, found)
    return [ds for ds in found.values() if ds.id.valid]


#: the functions of dask's tasks that read an array passed to them (``dask.array.core``'s
#: getters), or run a fused task's inner tasks on the data passed to it (``dask.optimize``)
_READERS = frozenset({"getter", "getter_nofancy", "getter_inline", "_execute_subgraph"})
_CONTAINERS = frozenset({"List", "Tuple", "Dict", "Set"})  # dask's task spec: data, not calls


def _find(values: list, dataset_type, found: dict) -> None:
    """Add to ``found`` (by id) the ``dataset_type`` objects in ``values``, bare or in a
    data node, and in the arguments of the tasks that read them (``_READERS``, old-style
    tuples too) and of the containers of dask's task spec there; any other task costs one
    look at its function. A fused task's inner tasks are not walked: the data they read
    comes as its arguments."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value).__name__
        if kind == "DataNode":
            value = value.value
        if isinstance(value, dataset_type):
            found[id(value)] = value
            continue
        func = getattr(value, "func", None)
        if func is not None:  # a task of dask's task spec
            if kind in _CONTAINERS or getattr(func, "__name__", "") in _READERS:
                stack.extend(value.args)
                stack.extend((getattr(value, "kwargs", None) or {}).values())
        elif kind == "tuple" and value and getattr(value[0], "__name__", "") in _READERS:
            stack.extend(value[1:])


def missing_filter(dataset) -> str | None:
    """The first filter of the h5py dataset's pipeline that this HDF5 cannot apply (not built
    in, registered, or found as a plugin: ``H5Zfilter_avail``) and that its data needs, as
    ``ID (name)``; None where it reads and writes. An optional filter is needed only where a
    stored chunk went through it (writers skip one they lack, and record that per chunk); a
    mandatory one always (HDF5 writes no chunk without it)."""
    import h5py

    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, flags, _, name = plist.get_filter(i)
        if h5py.h5z.filter_avail(code):
            continue
        if flags & h5py.h5z.FLAG_OPTIONAL and not _filtered_chunks(dataset, i):
            continue
        name = name.decode(errors="replace").strip() or FILTER_NAMES.get(code)
        return f"{code} ({name})" if name else str(code)
    return None


def _filtered_chunks(dataset, i: int) -> bool:
    """Whether a stored chunk of the dataset went through filter ``i`` of its pipeline (bit
    ``i`` of the chunk's filter mask clear)."""
    bit = 1 << i
    if hasattr(dataset.id, "chunk_iter"):  # one pass in HDF5, stopped at the first found
        found = []

        def through(info):
            if not info.filter_mask & bit:
                found.append(info)
                return True  # (stops the pass)
            return None

        dataset.id.chunk_iter(through)
        return bool(found)
    return any(not dataset.id.get_chunk_info(j).filter_mask & bit
               for j in range(dataset.id.get_num_chunks()))


def check_filters(x, name: str) -> None:
    """Refuse an h5py dataset ``x`` that needs a filter this HDF5 lacks (``missing_filter``),
    named ``name`` in the message; anything else (not a dataset, a closed one) passes.

    Raises
    ------
    ValueError
    """
    if not is_dataset(x) or not x.id.valid:
        return
    missing = missing_filter(x)
    if missing:
        raise ValueError(f"{name} needs HDF5 filter {missing}, which is not available here "
                         f"(not built into this HDF5, no plugin for it in HDF5_PLUGIN_PATH "
                         f"or HDF5's default plugin folder)")
