"""The declared dependency floors are the ones CI tests.

Covers: every ``>=`` floor in pyproject.toml (runtime and the ``test`` and
``bench`` and ``deploy`` extras) equals its pin in ``.ci/floors.txt`` and the other way round;
and, in CI's second run (``DISTMM_EXPECT_FLOORS=1``, set by ``.ci/run``), that
the installed versions are exactly those floors. Not covered: the ``gpu``
extra (cupy, dask-cuda), which CI, having no GPU, cannot install.
"""
from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
FLOORS = ROOT / ".ci" / "floors.txt"
EXTRAS_CHECKED = ("test", "bench", "deploy")

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject_floors() -> dict[str, str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS_CHECKED:
        reqs += project["optional-dependencies"].get(extra, [])
    floors: dict[str, str] = {}
    for req in reqs:
        m = _REQ.match(req)
        assert m, f"cannot read requirement {req!r}"
        name, spec = _norm(m.group(1)), m.group(3)
        lower = re.findall(r">=\s*([0-9][^,\s]*)", spec)
        assert len(lower) == 1, f"{req!r}: every dependency needs exactly one '>=' floor"
        assert floors.get(name, lower[0]) == lower[0], f"{name}: two different floors"
        floors[name] = lower[0]
    return floors


def _pinned_floors() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in FLOORS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s]*)", line)
        assert m, f".ci/floors.txt: {line!r} is not NAME==VERSION"
        pins[_norm(m.group(1))] = m.group(2)
    return pins


pytestmark = pytest.mark.skipif(not PYPROJECT.is_file(), reason="no pyproject.toml beside tests/")


def test_pyproject_floors_equal_the_ci_floors_file():
    assert FLOORS.is_file(), f"{FLOORS} is missing (.ci/run copies it beside tests/)"
    declared, pinned = _pyproject_floors(), _pinned_floors()
    assert declared == pinned


@pytest.mark.skipif(os.environ.get("DISTMM_EXPECT_FLOORS") != "1",
                    reason="only in CI's floors run (DISTMM_EXPECT_FLOORS=1)")
def test_installed_versions_are_the_floors():
    wrong = {}
    for name, floor in _pinned_floors().items():
        installed = metadata.version(name)
        if installed != floor:
            wrong[name] = (installed, floor)
    assert not wrong, f"installed != floor: {wrong}"
