"""README.md against the code: its Python examples run verbatim, its command-line synopsis
names every option (and every listed choice) each command's parser has and no other, and its
layout table names every top-level module of the package.

Real parts throughout: the README file of this checkout, ``distmm.cli``'s own parser and
the package folder; the examples run through ``doctest`` in this process.
"""
from __future__ import annotations

import argparse
import doctest
import re
from pathlib import Path

import pytest

import distmm
from distmm.cli.commands import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
PKG = Path(distmm.__file__).resolve().parent


def _text() -> str:
    if not README.is_file():  # an installed copy of the tests without the checkout
        pytest.skip("README.md is not beside tests/")
    return README.read_text(encoding="utf-8")


def _fenced(text: str, info: str) -> list[str]:
    """The bodies of the fenced blocks whose opening line is ```INFO."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?)^```$", text, flags=re.M | re.S)


def _synopsis() -> dict[str, str]:
    """Each command's synopsis in the "Command line" block: its ``distmm CMD`` line and the
    indented lines that continue it, comments dropped."""
    block = _fenced(_text().split("## Command line", 1)[1], "")[0]
    out: dict[str, str] = {}
    command = None
    for line in block.splitlines():
        code = line.split("#", 1)[0]
        m = re.match(r"distmm ([a-z]+)\b", code)
        if m:
            command = m.group(1)
            out[command] = out.get(command, "") + " " + code
        elif code.startswith(" ") and code.strip() and command is not None:
            out[command] += " " + code
        else:
            command = None
    return out


def _commands() -> dict[str, argparse.ArgumentParser]:
    return dict(build_parser().commands)


def _options(parser: argparse.ArgumentParser):
    """The parser's options but --help and --debug (``distmm --debug COMMAND`` covers it)."""
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "debug"):
            yield action


def test_readme_python_examples_print_what_they_show():
    text = _text()
    (block,) = _fenced(text, "python")
    line = text[:text.index(block)].count("\n")  # failures name README's own line numbers
    test = doctest.DocTestParser().get_doctest(block, {}, "README.md", str(README), line)
    runner = doctest.DocTestRunner()
    report: list[str] = []
    result = runner.run(test, out=report.append)
    assert result.attempted >= 7
    assert result.failed == 0, "".join(report)


@pytest.mark.parametrize("command", sorted(set(_commands()) - {"tune", "trace"}))
def test_readme_synopsis_names_every_option_of_the_command(command):
    parser = _commands()[command]
    synopsis = _synopsis().get(command)
    assert synopsis is not None, f"README's Command line block has no 'distmm {command}' line"
    named = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", synopsis))
    known = {o for a in parser._actions for o in a.option_strings}
    assert named <= known, f"distmm {command}: README names {sorted(named - known)}, unknown"
    for action in _options(parser):
        assert named & set(action.option_strings), (
            f"distmm {command}: README's synopsis lacks {'/'.join(action.option_strings)}")
        if not action.choices:
            continue
        for opt in action.option_strings:  # a listed a|b|c is every choice the parser takes
            listed = re.search(rf"(?<![\w-]){re.escape(opt)} ([\w|]+\|[\w|]+)", synopsis)
            if listed:
                assert set(listed.group(1).split("|")) == {str(c) for c in action.choices}, (
                    f"distmm {command} {opt}: README lists {listed.group(1)}, the parser takes "
                    f"{'|'.join(map(str, action.choices))}")


def test_readme_layout_table_names_every_module():
    layout = _text().split("## Layout", 1)[1]
    missing = [p.name for p in sorted(PKG.glob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and f"`{p.name}`" not in layout
               and f"`distmm/{p.name}`" not in layout]
    missing += [f"{p.name}/" for p in sorted(PKG.iterdir()) if p.is_dir()
                and (p / "__init__.py").is_file() and f"`distmm/{p.name}/`" not in layout
                and f"`{p.name}/`" not in layout]  # kernels/: a top-level folder, installed in it
    assert not missing, f"README's layout table does not name {missing}"
