"""Option types shared by the ``distmm`` commands' parsers.

This module covers: ``integer_at_least``, an ``argparse`` type for an integer option with a
lower bound, whose message names the text given and what was wrong; ``positive_size``, a
positive number of bytes in dask's notation. It does *not* cover the
parsers themselves (``distmm.cli.commands``, ``distmm.cli.serve``, ...).
"""
from __future__ import annotations

import argparse

__all__ = ["integer_at_least", "positive_size"]


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
