"""Kept only so that ``distmm.tune --records`` (which imports ``bench.records``) works until
that import goes: the record writer now lives in ``bench.common``. Nothing in ``bench/``
imports this module."""
from bench.common import RecordWriter  # noqa: F401
