"""``distmm matmul --scheduler ADDRESS --connect-timeout T`` ends within T (and a small
margin) whatever listens at the address: an HTTP server (the dashboard's port), a service
that sends bytes that are not Dask's, a listener that accepts and never replies, one that
never accepts, nothing at all; with one line naming the address and what to check, exit
status 1, no traceback, and no output file. Every listener is the test's own, on 127.0.0.1.
Also the command line's advice for the Dask engine and for configuration errors."""
from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

TIMEOUT = 0.5
#: the interpreter's start and distmm's imports, on a busy 2-core machine, plus the probe's
#: margin (4.7 s was seen once in CI's floors run, 3.2 s here under load: a CI machine 3 times
#: slower takes ~10 s); still half of dask's own 30 s connect timeout (and --connect-timeout's
#: default), the hang these tests guard against
MARGIN = 15.0


@pytest.fixture
def files(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.ones((6, 4)))
    np.save(tmp_path / "b.npy", np.ones((4, 3)))
    return tmp_path


class _Listener:
    """A TCP listener on 127.0.0.1 that does ``serve(conn)`` with each connection, on a
    daemon thread; connections are held until the test ends."""

    def __init__(self, serve=None, accept=True):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0 if not accept else 8)
        self.port = self.sock.getsockname()[1]
        self.held = []
        if accept:
            threading.Thread(target=self._run, args=(serve,), daemon=True).start()

    def _run(self, serve):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if serve is not None:
                try:
                    serve(conn)
                except OSError:
                    pass

    def close(self):
        for c in self.held:
            c.close()
        self.sock.close()


@pytest.fixture
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _garbage(conn):
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + os.urandom(256))


@pytest.fixture(params=[pytest.param("http", marks=pytest.mark.slow), "garbage",
                        pytest.param("silent", marks=pytest.mark.slow), "never-accepts", "closed"])
def address(request, http_port):
    kind = request.param
    if kind == "http":
        yield f"tcp://127.0.0.1:{http_port}"
        return
    if kind == "closed":  # a port that was just free: nothing listens
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"tcp://127.0.0.1:{port}"
        return
    listener = _Listener(serve=_garbage if kind == "garbage" else None,
                         accept=kind != "never-accepts")
    yield f"tcp://127.0.0.1:{listener.port}"
    listener.close()


def _assert_bounded_failure(r, seconds, address, files):
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("distmm matmul: error: ") and address in r.stderr, r.stderr
    assert "check the address and port" in r.stderr, r.stderr
    assert seconds < TIMEOUT + MARGIN, seconds
    assert sorted(p.name for p in files.iterdir()) == ["a.npy", "b.npy"] + (
        ["s.json"] if (files / "s.json").exists() else [])


@pytest.mark.slow
def test_connect_timeout_bounds_whatever_answers(files, address):
    t0 = time.monotonic()
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy",
                "--scheduler", address, "--connect-timeout", TIMEOUT)
    _assert_bounded_failure(r, time.monotonic() - t0, address, files)


def test_connect_timeout_bounds_a_scheduler_file_too(files, http_port):
    address = f"tcp://127.0.0.1:{http_port}"
    (files / "s.json").write_text(json.dumps({"type": "Scheduler", "address": address}))
    t0 = time.monotonic()
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy",
                "--scheduler-file", files / "s.json", "--connect-timeout", TIMEOUT)
    _assert_bounded_failure(r, time.monotonic() - t0, address, files)
    assert "s.json" in r.stderr


def test_probe_ends_on_its_deadline_and_leaves_no_thread():
    import distributed.security  # noqa: F401 - imported before the clock starts (0.3 s here,
    # more on a slow machine): the bound is the probe's deadline, not an import

    from distmm.cli.connect import probe_scheduler

    listener = _Listener()  # accepts, never answers
    before = set(threading.enumerate())
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=f"no Dask scheduler answered at tcp://127.0.0.1:"
                                                  f"{listener.port} within 0.5 s"):
            probe_scheduler(f"tcp://127.0.0.1:{listener.port}", 0.5)
        assert time.monotonic() - t0 < 0.5 + 1.5  # the deadline plus room for a loaded 2-core CI machine
    finally:
        listener.close()
    assert set(threading.enumerate()) - before == set()


@pytest.mark.parametrize("args, says", [
    (["--scheduler", "foo://127.0.0.1:8786"], "--scheduler: 'foo://127.0.0.1:8786' is not a "
                                              "scheduler address"),
    (["--scheduler", "tcp://127.0.0.1"], "missing port"),
    (["--scheduler", "tcp://127.0.0.1:99999"], "port 99999 is not 1 to 65535"),
    (["--scheduler-file", "{tmp}/port0.json"], "port0.json: 'tcp://127.0.0.1:0' is not a "
                                               "scheduler address"),
    (["--scheduler", "127.0.0.1:1", "--connect-timeout", "0"], "--connect-timeout: '0' must be"),
    (["--scheduler", "127.0.0.1:1", "--connect-timeout", "nan"], "--connect-timeout: 'nan' must"),
    (["--scheduler-file", "{tmp}/bad.json"], "bad.json is not a scheduler file (not JSON"),
    (["--scheduler-file", "{tmp}/noaddr.json"], "noaddr.json is not a scheduler file (no \"address"),
], ids=["scheme", "no-port", "port-range", "file-port-0", "timeout-0", "timeout-nan", "file-not-json", "file-no-address"])
@pytest.mark.slow
def test_bad_addresses_are_bad_input(files, args, says):
    (files / "bad.json").write_text("{")
    (files / "noaddr.json").write_text("{}")
    (files / "port0.json").write_text('{"address": "tcp://127.0.0.1:0"}')
    t0 = time.monotonic()
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy",
                *[a.format(tmp=files) for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and says in r.stderr, r.stderr
    assert not (files / "c.npy").exists()
    assert time.monotonic() - t0 < MARGIN  # refused at once, not after a connect timeout


def test_a_host_that_drops_the_connection_request_is_named_as_such():
    """A listener whose backlog is full drops further connection requests, as a firewall
    or an address of another network does: the attempt the deadline cuts short ends in
    ``CancelledError``, which the message said ("(CancelledError:)") instead of what
    happened."""
    from distmm.cli.connect import probe_scheduler

    listener = _Listener(accept=False)
    queued = []
    try:
        for _ in range(4):  # fill the backlog (listen(0)): the kernel answers none after it
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", listener.port))
            queued.append(s)
        time.sleep(0.1)
        with pytest.raises(ConnectionError) as info:
            probe_scheduler(f"tcp://127.0.0.1:{listener.port}", TIMEOUT)
    finally:
        for s in queued:
            s.close()
        listener.close()
    message = str(info.value)
    assert "CancelledError" not in message, message
    assert (f"cannot connect to tcp://127.0.0.1:{listener.port} within {TIMEOUT:g} s (no reply "
            f"to the connection request)") in message, message


def test_engine_dask_without_a_scheduler_gives_command_line_advice(files):
    r = run_cli("matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy", "--engine", "dask")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--scheduler ADDRESS" in r.stderr and "--scheduler-file FILE" in r.stderr
    assert "distmm cluster --scheduler-file FILE" in r.stderr
    assert "client=" not in r.stderr and "distributed.Client" not in r.stderr
    assert not (files / "c.npy").exists()


def test_the_api_keeps_python_advice():
    import distmm

    code = ("import numpy as np, distmm\n"
            "try:\n"
            "    distmm.matmul(np.ones((2, 2)), np.ones((2, 2)), engine='dask')\n"
            "except ValueError as exc:\n"
            "    print(exc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pass client=" in r.stdout, (r.stdout, r.stderr)
    with pytest.raises(ValueError, match=r"dask.config.set\(\{'distmm.tile'"):
        import dask.config

        with dask.config.set({"distmm.tile": "big"}):
            distmm.matmul(np.ones((2, 2)), np.ones((2, 2)))


@pytest.mark.slow
def test_configuration_errors_give_command_line_advice(files):
    env = dict(os.environ, DISTMM_MEMORY_BUDGET="lots")
    for args in (["matmul", files / "a.npy", files / "b.npy", "-o", files / "c.npy"],
                 ["plan", 10, 10, 10]):
        r = run_cli(*args, env=env)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "distmm.memory-budget = 'lots' is not valid" in r.stderr
        assert "DISTMM_MEMORY_BUDGET" in r.stderr and "dask YAML file" in r.stderr
        assert "dask.config.set" not in r.stderr, r.stderr
    assert not (files / "c.npy").exists()
