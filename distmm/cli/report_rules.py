"""``distmm report``'s naming rules for records: how many took part, the series a variant
belongs to, and which variants are references.

This module covers: ``count_of``, ``family`` and ``is_reference`` (their rules are spelled out
in ``distmm.cli.report``'s docstring), shared by the report's sections.
It does *not* cover: reading records or drawing anything (``distmm.cli.report``,
``distmm.cli.report_roofline``, ``distmm.cli.report_model``).
"""
from __future__ import annotations

import re

__all__ = ["REFERENCES", "COUNT_KEYS", "arithmetic", "count_of", "emulated_label", "family",
           "is_reference"]

REFERENCES = ("cublas", "numpy", "dask.array", "read-cat", "write-dd")
COUNT_KEYS = ("ranks", "gpus", "workers")


def count_of(record: dict) -> tuple[str, int]:
    """The key and value of how many took part: the first of ``ranks``, ``gpus``,
    ``workers`` present and not null, else ``("ranks", 1)``."""
    for key in COUNT_KEYS:
        if record.get(key) is not None:
            return key, int(record[key])
    return "ranks", 1


def family(variant: str, count: int) -> str:
    """``variant`` without its count token: ``family("mpirun-4-h5", 4) == "mpirun-h5"``,
    ``family("distmm-dask@2gpu", 2) == "distmm-dask"``; unchanged without one."""
    token = rf"[-@]{count}(?:gpus?|ranks?|workers?)?(?=[-@.]|$)"
    return re.sub(token, "", variant, count=1) or variant


def emulated_label(record: dict) -> str:
    """``" [emulated nodes: N]"`` for a record measured on emulated nodes (its
    ``emulated_nodes``), else ``""``.

    >>> emulated_label({"emulated_nodes": 2}), emulated_label({})
    (' [emulated nodes: 2]', '')
    """
    nodes = record.get("emulated_nodes")
    return "" if nodes in (None, False) else f" [emulated nodes: {nodes}]"


def is_reference(variant: str) -> bool:
    """Whether ``variant`` is a reference: one of ``REFERENCES``, alone or followed by
    ``-``, ``@`` or ``.``."""
    return any(variant == r or re.match(re.escape(r) + r"[-@.]", variant) for r in REFERENCES)


def arithmetic(record: dict) -> str:
    """What a record computes in: its reduced ``precision`` (tf32, bf16, fp16) where it
    has one, else its dtype. Series, shares, curves, ceilings and points are grouped by it,
    so that a TF32 study is no float32 series and a bf16 cuBLAS no float32 ceiling."""
    from distmm.precision import REDUCED

    precision = record.get("precision")
    return precision if precision in REDUCED else record["dtype"]
