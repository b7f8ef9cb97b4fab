"""``distmm matmul A B -o C`` on unusual operand files the CLI suites do not hold.

Refused in one line naming the file, status 2, nothing written: a named pipe, a socket or a
device where an operand's file (or a zarr array's metadata file) should be, at once (a named
pipe's open waited for a writer for ever); a ``.npy`` header whose shape numpy's own header
check lets through (a negative or boolean dimension, one larger than numpy addresses: numpy's
memory map failed with words that name no file, status 1); zarr metadata that is JSON but no
object (an ``AttributeError``, status 1), and a zarr output whose ``zarr.json`` is a named
pipe (the target check waited on it). Read as numpy and zarr read them, the product bit for
bit ``np.matmul``'s: Fortran-ordered and big-endian ``.npy`` files, format versions 1.0, 2.0
and 3.0, links and names with spaces, non-ASCII letters or a newline, zero-size dimensions,
chunked HDF5 datasets through gzip, shuffle and lzf, zarr arrays of format 2 and 3 with a
compressor, a fill value and chunks never written (read as the fill value).
"""
from __future__ import annotations

import os
import socket
import stat
import warnings

import numpy as np
import pytest

from conftest import identical, one_line, run_cli
from distmm.cli import main


def _refused(r, tmp_path, before, *named) -> str:
    """The one line of a refusal with status 2 that names each of ``named``, the folder as it
    was (``before``: no output, no staged file)."""
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    for name in named:
        assert str(name) in line, line
    assert sorted(os.listdir(tmp_path)) == before
    return line


@pytest.fixture
def operands(tmp_path, monkeypatch):
    """``a.npy`` (6 x 4) and ``b.npy`` (4 x 5) in ``tmp_path``, the working folder."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng()
    np.save("a.npy", rng.standard_normal((6, 4)))
    np.save("b.npy", rng.standard_normal((4, 5)))
    return tmp_path


def _special(case: str, tmp_path):
    """Make the special file of ``case``; return the command's operands and the path the
    refusal names with what it says that path is."""
    if case in ("fifo-a", "fifo-link-b", "fifo-h5"):
        name = {"fifo-a": "p.npy", "fifo-link-b": "pipe", "fifo-h5": "p.h5"}[case]
        os.mkfifo(name)
        if case == "fifo-link-b":
            os.symlink("pipe", "link.npy")
            return ["a.npy", "link.npy"], "link.npy is a named pipe (FIFO)"
        spec = "p.h5:x" if case == "fifo-h5" else name
        return [spec, "b.npy"], f"{name} is a named pipe (FIFO)"
    if case == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind("s.npy")  # relative: a socket's path is short
        return ["s.npy", "b.npy"], "s.npy is a socket"
    if case == "device":
        os.symlink("/dev/null", "null.npy")
        return ["a.npy", "null.npy"], "null.npy is a character device"
    zarr = pytest.importorskip("zarr")
    fmt = 2 if case == "fifo-zarray" else 3
    zarr.create_array("z.zarr", shape=(6, 4), chunks=(3, 4), dtype="f8", zarr_format=fmt)
    meta = tmp_path / "z.zarr" / (".zarray" if fmt == 2 else "zarr.json")
    meta.unlink()
    os.mkfifo(meta)
    return ["z.zarr", "b.npy"], f"its metadata file {meta.relative_to(tmp_path)} is a named pipe"


@pytest.mark.slow  # CLI launches, ~1-1.4 s each
@pytest.mark.parametrize("case", ["fifo-a", "fifo-link-b", "fifo-h5", "fifo-zarray",
                                  "fifo-zarr-json", "socket", "device"])
def test_an_operand_that_is_a_pipe_socket_or_device_is_refused_at_once(operands, case):
    """A named pipe as A (or, through a link, as B; an HDF5 file; a zarr array's ``.zarray``
    or ``zarr.json``) kept the command waiting for a writer for ever; a socket was a failed
    run ('No such device or address', status 1); ``/dev/null`` was 'No data left in file'.
    Now each is refused before it is opened, naming it and what it is; a pipe is left as it
    was, no one having opened it."""
    args, said = _special(case, operands)
    before = sorted(os.listdir(operands))
    r = run_cli("matmul", *args, "-o", "c.npy", cwd=operands, timeout=20)
    line = _refused(r, operands, before, said, "not a regular file")
    assert "Traceback" not in line
    for name in ("p.npy", "pipe", "p.h5"):
        if os.path.lexists(name):
            assert stat.S_ISFIFO(os.stat(name).st_mode)


@pytest.mark.parametrize("shape", ["(-6, 4)", "(True, 4)", "(1180591620717411303424, 0)"])
def test_an_npy_header_shape_numpy_lets_through_is_refused_naming_the_file(operands, shape):
    """numpy's header check takes any int in the shape: a negative dimension ended as
    'OverflowError: memory mapped length must be positive' (status 1), ``True`` as 'an
    integer is required' (no file named), a dimension past 2**63 as 'OverflowError: Python
    int too large to convert to C long' (status 1)."""
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': %s, }" % shape
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    with open("t.npy", "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
        f.write(np.arange(24.0).tobytes())
    before = sorted(os.listdir(operands))
    r = run_cli("matmul", "t.npy", "b.npy", "-o", "c.npy", cwd=operands, timeout=60)
    _refused(r, operands, before, f"t.npy is not a readable .npy file (its header's shape {shape}")


@pytest.mark.slow  # CLI launches, ~1.2-1.8 s each
@pytest.mark.parametrize("case", ["operand-list", "output-list", "output-fifo", "operand-file"])
def test_zarr_metadata_that_is_no_json_object_or_a_pipe_is_refused_in_one_line(operands, case):
    """A ``zarr.json`` holding a JSON list was 'AttributeError: 'list' object has no
    attribute 'get'' (status 1) as operand and as the output to replace; an output whose
    ``zarr.json`` is a named pipe kept the target check waiting for a writer; a regular file
    named as a zarr operand was told to 'name an array, e.g. x.zarr/NAME' in it."""
    os.mkdir("z.zarr")
    meta = operands / "z.zarr" / "zarr.json"
    if case == "output-fifo":
        os.mkfifo(meta)
    elif case == "operand-file":
        os.rmdir("z.zarr")
        (operands / "z.zarr").write_text("{}")
    else:
        meta.write_text("[]")
    before = sorted(os.listdir(operands))
    if case.startswith("operand"):
        r = run_cli("matmul", "z.zarr", "b.npy", "-o", "c.npy", cwd=operands, timeout=60)
        said = ("z.zarr is a file, not a zarr array" if case == "operand-file" else
                "z.zarr is not a readable zarr array (its metadata file z.zarr/zarr.json is "
                "not zarr metadata)")
    else:
        r = run_cli("matmul", "a.npy", "b.npy", "-o", "z.zarr", "--overwrite", cwd=operands,
                    timeout=20)
        said = "z.zarr exists and is not a zarr array; distmm never removes it"
    _refused(r, operands, before, said)
    if case == "output-fifo":
        assert stat.S_ISFIFO(os.stat(meta).st_mode)
    elif case != "operand-file":
        assert sorted(os.listdir(operands / "z.zarr")) == ["zarr.json"]
        assert meta.read_text() == "[]"


def test_zarr_metadata_is_one_reading_for_node_and_group_format(tmp_path):
    """``zarr_node`` and the groups' consolidated-metadata check read a folder's metadata
    through ``zarr_metadata``: node type, format and consolidation from one place."""
    zarr = pytest.importorskip("zarr")
    from distmm.staging import _group_format, zarr_metadata, zarr_node

    for fmt in (2, 3):
        g = zarr.open_group(str(tmp_path / f"g{fmt}.zarr"), mode="w", zarr_format=fmt)
        g.create_array("x", shape=(2,), dtype="f8")
        assert zarr_metadata(tmp_path / f"g{fmt}.zarr") == ("group", fmt, False)
        assert zarr_metadata(tmp_path / f"g{fmt}.zarr" / "x") == ("array", fmt, False)
        with warnings.catch_warnings():  # zarr's: format 3 has no such metadata yet
            warnings.simplefilter("ignore")
            zarr.consolidate_metadata(str(tmp_path / f"g{fmt}.zarr"), zarr_format=fmt)
        assert _group_format(tmp_path / f"g{fmt}.zarr") == (fmt, True)
        assert _group_format(tmp_path / f"g{fmt}.zarr" / "x") is None
        assert zarr_node(tmp_path / f"g{fmt}.zarr" / "x") == "array"
    assert zarr_metadata(tmp_path) is None and zarr_node(tmp_path) is None


def _npy_cases(tmp_path, rng):
    """``(name, A path, B path)`` of unusual ``.npy`` operands."""
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((4, 5))
    cases = []

    def save(name, x, version=None):
        with open(tmp_path / name, "wb") as f:
            np.lib.format.write_array(f, x, version=version, allow_pickle=False)
        return tmp_path / name

    np.save(tmp_path / "b.npy", b)
    bp = tmp_path / "b.npy"
    cases.append(("fortran", save("f.npy", np.asfortranarray(a)), bp))
    cases.append(("big-endian-f8", save("be.npy", a.astype(">f8")),
                  save("bbe.npy", np.asfortranarray(b).astype(">f8"))))
    cases.append(("big-endian-c8", save("c8.npy", (a + 1j * a[::-1]).astype(">c8")),
                  save("bc8.npy", (b - 2j * b).astype(">c8"))))
    for v in ((1, 0), (2, 0), (3, 0)):
        cases.append((f"version-{v[0]}", save(f"v{v[0]}.npy", a, v), bp))
    os.symlink("f.npy", tmp_path / "link.npy")
    cases.append(("link", tmp_path / "link.npy", bp))
    cases.append(("odd-name", save("a b\u00e9\nc.npy", a), bp))
    cases.append(("fortran-stack", save("s.npy", np.asfortranarray(rng.standard_normal(
        (3, 6, 4)))), save("sb.npy", rng.standard_normal((3, 4, 5)))))
    cases.append(("zero-k", save("zk.npy", np.zeros((6, 0), np.float32)),
                  save("zkb.npy", np.zeros((0, 5), np.float32))))
    cases.append(("int8-bool", save("i8.npy", (a * 9).astype(np.int8)),
                  save("bb.npy", b > 0)))
    return cases


def test_unusual_npy_files_multiply_bit_for_bit_as_numpy(tmp_path, capsys):
    """Fortran order, big-endian dtypes, each .npy format version, a link, a name with a
    space, a non-ASCII letter and a newline, a Fortran stack, an empty inner dimension, int8
    with bool: C is ``np.matmul(np.load(A), np.load(B))``."""
    rng = np.random.default_rng()
    for name, pa, pb in _npy_cases(tmp_path, rng):
        c = tmp_path / f"c-{name}.npy"
        assert main(["matmul", str(pa), str(pb), "-o", str(c), "--engine", "local"]) == 0, name
        want = np.matmul(np.load(pa), np.load(pb))
        assert identical(np.load(c), want), name
    assert capsys.readouterr().err == ""


def test_compressed_and_sparse_stores_multiply_as_numpy(tmp_path, capsys):
    """Chunked HDF5 datasets through gzip with shuffle, lzf, and big-endian; zarr arrays of
    format 2 and 3 with a compressor, a fill value and chunks never written (read as the
    fill value, as zarr reads them): C is numpy's product of what h5py and zarr read."""
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((9, 7)), rng.standard_normal((7, 5))
    np.save(tmp_path / "b.npy", b)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("gz", data=a, chunks=(2, 3), compression="gzip", shuffle=True)
        f.create_dataset("lzf", data=a, chunks=(4, 7), compression="lzf")
        f.create_dataset("g/be", data=a.astype(">f8"), chunks=(3, 3), fletcher32=True)
    specs = {f"{tmp_path / 'a.h5'}:{n}": None for n in ("gz", "lzf", "g/be")}
    for fmt, fill in ((2, 1.5), (3, -0.0), (3, np.nan)):
        path = tmp_path / f"z{fmt}-{fill}.zarr"
        z = zarr.create_array(str(path), shape=a.shape, chunks=(4, 3), dtype=">f8" if fmt == 3
                              else "<f8", fill_value=fill, zarr_format=fmt)
        z[:4, :3] = a[:4, :3]  # one chunk of nine written
        z[8:, 6:] = a[8:, 6:]
        specs[str(path)] = path
    for i, spec in enumerate(specs):
        c = tmp_path / f"c{i}.npy"
        assert main(["matmul", spec, str(tmp_path / "b.npy"), "-o", str(c),
                     "--engine", "local"]) == 0, spec
        if specs[spec] is None:
            file, name = spec.rsplit(":", 1)
            with h5py.File(file, "r") as f:
                x = f[name][...]
        else:
            x = zarr.open_array(spec, mode="r")[...]
        assert identical(np.load(c), np.matmul(x, b)), spec
    assert capsys.readouterr().err == ""
