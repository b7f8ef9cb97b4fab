"""Reading one whole JSON file with errors a user can act on.

This module covers ``json_file``: the value of a file that must be UTF-8 JSON, a file that is
not raising ``ValueError`` naming it (``path:line`` where the JSON breaks). It is the bottom
layer's, so that the tuning cache (``distmm.executor.tuning``) and the commands that read
profiles, timelines and caches (``distmm.cli``) say the same. It does *not* cover what the
value must hold (each reader checks its own schema) or JSON-lines records
(``distmm.cli.records``).
"""
from __future__ import annotations

import json

__all__ = ["json_file"]


def json_file(path):
    """The value of a whole JSON file (a profile, a timeline, a cache); a file that is not
    UTF-8 JSON raises ``ValueError`` naming it (``path:line`` where the JSON breaks)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return json.loads(data.decode())
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
