"""Option types shared by the ``distmm`` commands' parsers.

This module covers: ``integer_at_least``, an ``argparse`` type for an integer option with a
lower bound (and an upper one where given), whose message names the text given and what was
wrong; ``positive_size``, a positive number of bytes in dask's notation; ``nonempty``, a path or
address that is not empty text (an empty one would read as "not given"); ``matmul_dtype``, a
dtype numpy's matmul takes (``bfloat16`` through ``ml_dtypes``, imported for that name only). It does *not* cover the
parsers themselves (``distmm.cli.commands``, ``distmm.cli.serve``, ...).
"""
from __future__ import annotations

import argparse

__all__ = ["integer_at_least", "matmul_dtype", "nonempty", "positive_size"]


def integer_at_least(low: int, what: str | None = None, *, most: int | None = None):
    """An ``argparse`` type: an integer of at least ``low``; below it the message is
    ``"'TEXT' WHAT"`` (default ``"must be at least LOW"``), and above ``most``, where given,
    ``"'TEXT' must be at most MOST"``."""
    what = what or f"must be at least {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} {what}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {most}")
        return value
    return parse


def nonempty(what: str = "path"):
    """An ``argparse`` type: text that is not empty, as given; empty text is refused as
    ``"an empty WHAT"`` (an option's empty value read as false: ``--profile ''`` ran without
    a profile, ``--scheduler ''`` on no cluster)."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"an empty {what}")
        return text
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
