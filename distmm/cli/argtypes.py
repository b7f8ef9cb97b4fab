"""Option types shared by the ``distmm`` commands' parsers.

This module covers: ``integer_at_least``, an ``argparse`` type for an integer option with a
lower bound, whose message names the text given and what was wrong. It does *not* cover the
parsers themselves (``distmm.cli.commands``, ``distmm.cli.serve``, ...).
"""
from __future__ import annotations

import argparse

__all__ = ["integer_at_least"]


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
