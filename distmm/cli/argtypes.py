"""Option types shared by the ``distmm`` commands' parsers.

This module covers: ``integer_at_least``, an ``argparse`` type for an integer option with a
lower bound, whose message names the text given and what was wrong; ``positive_size``, a
positive number of bytes in dask's notation; ``matmul_dtype``, a dtype numpy's matmul takes
(``bfloat16`` through ``ml_dtypes``, imported for that name only). It does *not* cover the
parsers themselves (``distmm.cli.commands``, ``distmm.cli.serve``, ...).
"""
from __future__ import annotations

import argparse

__all__ = ["integer_at_least", "matmul_dtype", "positive_size"]


def integer_at_least(low: int, what: str | None = None):
    """An ``argparse`` type: an integer of at least ``low``; below it the message is
    ``"'TEXT' WHAT"`` (default ``"must be at least LOW"``)."""
    what = what or f"must be at least {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} {what}")
        return value
    return parse


def positive_size(example: str):
    """An ``argparse`` type: a positive number of bytes (``8GB``, ``8e9``: dask's
    ``parse_bytes``); anything else, blank text and ``1e400`` included, is refused as
    ``"'TEXT' is not a size such as EXAMPLE"``."""

    def parse(text: str) -> int:
        from dask.utils import parse_bytes

        try:
            value = parse_bytes(text) if text.strip() else 0
        except (ValueError, TypeError, OverflowError):  # OverflowError: '1e400', 'inf'
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a size such as {example}")
        return int(value)
    return parse


def matmul_dtype(text: str):
    """An ``argparse`` type: a dtype numpy's matmul takes, as the API checks it. numpy has no
    ``bfloat16`` of its own: that name is ``ml_dtypes.bfloat16``, imported only for it (distmm
    does not need ml_dtypes otherwise); without ml_dtypes the message says what to install."""
    import numpy as np

    from distmm.plan import result_dtype

    try:
        try:
            dt = np.dtype(text)
        except TypeError:
            if text != "bfloat16":
                raise
            try:
                import ml_dtypes  # registers the name with numpy
            except ImportError:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is ml_dtypes' bfloat16, and ml_dtypes is not installed "
                    f"(pip install ml_dtypes)") from None
            dt = np.dtype(ml_dtypes.bfloat16)
        result_dtype(dt, dt)
    except TypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype matmul takes ({exc})") from None
    return dt
