"""Connecting the command line to a Dask scheduler, within the time it was given.

This module covers: ``connect_client``, the ``distributed.Client`` of ``distmm matmul
--scheduler ADDRESS`` or ``--scheduler-file FILE``, and the checks before it:

- the address is one distributed can dial (a known protocol, a port), else ``ValueError``;
- a scheduler file is JSON with an ``address``, else ``ValueError`` naming the file; a file
  whose TCP address refuses the connection is stale (a scheduler writes its file once it
  listens: this one has stopped, killed before it could remove the file), ``ConnectionError``
  at once rather than after distributed's retries until the timeout (``check_listening``);
- ``probe_scheduler``: one connection, distributed's handshake and an ``identity`` request,
  all inside one deadline, on an event loop of its own that is gone when it returns. Only
  when a Dask scheduler has answered is the ``Client`` made;
- ``check_descriptors``: a process at its open-file limit (``ulimit -n``: ``EMFILE``, or the
  system's, ``ENFILE``) is refused at once, naming the limit, before any connection:
  distributed's connect retries that error until the timeout, and it says nothing of the
  address.

Why the probe: ``distributed.Client(address, timeout=...)`` bounds the TCP connect, but
``distributed.comm.connect`` then waits for the peer's handshake with no deadline, so an
address where something else listens (the dashboard's HTTP port 8787, an ssh server, a
socket that accepts and never writes) holds the client for ever. Whatever answers there,
the probe ends by its deadline, with a ``ConnectionError`` that names the address, what
was seen, and what to check.

Once the client's scheduler is lost, distributed's client logs its failed reconnect and,
in some versions, its own close's traceback; the command says what happened in its one
line (the Dask engine's ``SchedulerLost``), so those records are left out
(``_LostSchedulerFilter``).

It does *not* cover: starting a cluster (``distmm.cli.serve``), or anything after the
connection (the Dask engine's retries: ``distmm.engine.dask``).
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import weakref
from pathlib import Path

from distmm.staging import descriptors_short

__all__ = ["connect_client", "probe_scheduler", "scheduler_address", "check_address",
           "check_listening", "check_descriptors"]

#: what to check when nothing answered as a scheduler at an address
_CHECK = ("check the address and port (a scheduler listens on 8786 unless told otherwise; "
          "8787 is its dashboard) and that the scheduler is running")


#: seconds past the timeout before an unanswered handshake is given up (see ``bounded``)
_MARGIN = 0.25

#: descriptors connecting holds at once: the probe's event loop (its selector and wake-up
#: pair) and socket, then the client's event loop thread and its connections
DESCRIPTORS = 5

#: errnos of an open-file limit, this process's (``ulimit -n``) or the system's
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


def _limit_refusal(where: str, err: int) -> str:
    """The one line refusing to connect to ``where`` for the open-file limit ``err``."""
    if err == errno.ENFILE:
        return (f"cannot connect to {where}: the system's table of open files is full "
                f"(ENFILE); close files or raise fs.file-max, and run again")
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    return (f"cannot connect to {where}: this process's open-file limit (ulimit -n is "
            f"{limit}) leaves it fewer descriptors than connecting takes ({DESCRIPTORS}); "
            f"raise the limit (ulimit -n) and run again")


def check_descriptors(where: str) -> None:
    """``ConnectionError`` at once (the limit named: ``ulimit -n`` and its value) where this
    process cannot open the ``DESCRIPTORS`` files that connecting holds at once (``EMFILE``,
    ``ENFILE``); each is closed again. Any other error is left to the connection."""
    try:
        short = descriptors_short(DESCRIPTORS)
    except OSError:
        return
    if short is not None:
        raise ConnectionError(_limit_refusal(where, short[0]))


def _limit_errno(exc: BaseException) -> int | None:
    """``EMFILE`` or ``ENFILE`` where one is in ``exc``'s chain (distributed's wrappers), else
    None."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        if isinstance(exc, OSError) and exc.errno in _NO_DESCRIPTOR:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def check_address(address: str, where: str) -> str:
    """``address`` when distributed can dial it (``tcp://host:port``, ``host:port``,
    ``tls://...``, ``ucx://...`` where installed); ``ValueError`` naming ``where`` otherwise."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, loc = parse_address(address)
        get_backend(scheme)
        if scheme in ("tcp", "tls"):
            port = parse_host_port(loc)[1]
            if not 0 < port <= 65535:
                raise ValueError(f"port {port} is not 1 to 65535")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {address!r} is not a scheduler address such as "
                         f"tcp://host:8786 ({' '.join(str(exc).split())})") from None
    return address


def scheduler_address(path: str) -> str:
    """The ``address`` a scheduler file holds (distributed's format: the scheduler's
    identity as JSON); ``FileNotFoundError``, ``IsADirectoryError``,
    ``NotADirectoryError`` (a path through a regular file) or ``ValueError`` naming the
    file."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"--scheduler-file {path} is a directory, not a scheduler file")
    if not p.is_file():
        from distmm.cli.outputs import file_in_the_way

        blocked = file_in_the_way(p)  # /etc/hostname/x.json: no folder could hold it
        if blocked is not None:
            raise NotADirectoryError(f"--scheduler-file {path}: {blocked} is not a directory")
        raise FileNotFoundError(f"no such file: {path} (--scheduler-file)")
    try:
        info = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--scheduler-file {path} is not a scheduler file (not JSON: {exc})") from None
    if not isinstance(info, dict) or not isinstance(info.get("address"), str):
        raise ValueError(f"--scheduler-file {path} is not a scheduler file (no \"address\")")
    return check_address(info["address"], f"--scheduler-file {path}")


def check_listening(address: str, timeout: float, where: str) -> None:
    """``ConnectionError`` when nothing listens at the TCP ``address`` (the connection is
    refused) or no reply to the connection request came within ``timeout``; anything else
    (another protocol, a name that does not resolve) is left to ``probe_scheduler``."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme != "tcp":
        return
    host, port = parse_host_port(loc)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        raise ConnectionError(f"nothing listens at {where}: the connection was refused, so "
                              f"the file is stale (its scheduler has stopped); start the "
                              f"cluster again, or name a running one") from None
    except socket.timeout:
        raise ConnectionError(f"cannot connect to {where} within {timeout:g} s (no reply to the "
                              f"connection request); {_CHECK}") from None
    except OSError:
        pass


async def _identity(address: str, timeout: float, connection_args: dict):
    from distributed.comm import connect

    comm = await connect(address, timeout=timeout, **connection_args)
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _root_cause(exc: BaseException) -> str:
    """The innermost error under distributed's wrappers (``Connection refused``, a name
    that does not resolve), as one short phrase. An attempt that the deadline cut short
    (a host that drops the connection request: a firewall, an address of another network)
    ends its chain in ``CancelledError``, which says nothing: that is "no reply"."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for inner in reversed(chain):
        if isinstance(inner, OSError) and inner.strerror:
            return inner.strerror.lower()
    inner = chain[-1]
    if isinstance(inner, (asyncio.CancelledError, asyncio.TimeoutError)):
        return "no reply to the connection request"
    return " ".join(f"{type(inner).__name__}: {inner}".split())


def probe_scheduler(address: str, timeout: float, *, connection_args: dict | None = None,
                    where: str = "") -> dict:
    """The identity of the Dask scheduler at ``address``, asked within ``timeout`` seconds.

    Parameters
    ----------
    address
        ``tcp://host:port`` (or any address ``check_address`` takes).
    timeout
        Seconds for everything: connecting, distributed's handshake and the reply.
    connection_args
        distributed's connection arguments (TLS); default: those of ``Security()``,
        as a ``Client`` would use.
    where
        How the command line named the address (``--scheduler ADDRESS``), for messages.

    Returns
    -------
    dict
        The scheduler's ``identity`` (``type``, ``address``, ``workers``, ...).

    Raises
    ------
    ConnectionError
        Nothing accepted a connection, or what answered did not answer as a Dask scheduler
        (another service, a Dask worker, silence) within ``timeout``; at once, where this
        process is at its open-file limit (``check_descriptors``).
    """
    where = where or address
    check_descriptors(where)
    if connection_args is None:
        from distributed.security import Security

        connection_args = Security().get_connection_args("client")

    async def bounded():
        # distributed's connect gives up on its own at ``timeout`` when nothing accepts (its
        # error says why: refused, unresolvable); the outer bound, a moment later, ends a
        # handshake or a reply that never comes
        return await asyncio.wait_for(_identity(address, timeout, connection_args),
                                      timeout + _MARGIN)

    try:
        reply = asyncio.run(bounded())
    except asyncio.TimeoutError:
        raise ConnectionError(f"no Dask scheduler answered at {where} within {timeout:g} s "
                              f"(something may listen there that is not a scheduler); "
                              f"{_CHECK}") from None
    except OSError as exc:
        # distributed's connect: refused, unreachable or unresolvable until the deadline
        if _limit_errno(exc) is not None:  # past check_descriptors: another thread's files
            raise ConnectionError(_limit_refusal(where, _limit_errno(exc))) from None
        seen = _root_cause(exc)
        raise ConnectionError(f"cannot connect to {where} within {timeout:g} s "
                              f"({seen}); {_CHECK}") from None
    except Exception as exc:  # noqa: BLE001 - bytes that are not distributed's protocol
        raise ConnectionError(f"{where} answered, but not as a Dask scheduler (its reply did not "
                              f"decode: {type(exc).__name__}); {_CHECK}") from None
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        kind = reply.get("type") if isinstance(reply, dict) else None
        what = f"a Dask {kind}" if isinstance(kind, str) else "something else"
        raise ConnectionError(f"{where} is {what}, not a Dask scheduler; {_CHECK}")
    return reply


def connect_client(*, scheduler: str | None = None, scheduler_file: str | None = None,
                   timeout: float = 30.0):
    """A ``distributed.Client`` of the scheduler at ``scheduler`` or in ``scheduler_file``,
    made only after ``probe_scheduler`` found a Dask scheduler there within ``timeout``.

    Raises ``ValueError`` for an address or scheduler file that cannot name a scheduler,
    ``FileNotFoundError`` for a missing file, ``ConnectionError`` (one line: the address,
    what answered, what to check) when no scheduler answered in time, or at once when
    nothing listens at a scheduler file's address (``check_listening``) or this process is
    at its open-file limit (``check_descriptors``).
    """
    from distributed import Client
    from distributed.security import Security

    if scheduler_file is not None:
        address = scheduler_address(scheduler_file)
        where = f"{address} (--scheduler-file {scheduler_file})"
        # written once its scheduler listened: a refusal now is a stopped scheduler's, which
        # distributed's connect would retry until the timeout
        check_listening(address, timeout, where)
    else:
        address = check_address(scheduler, "--scheduler")
        where = f"{address} (--scheduler)"
    security = Security()
    probe_scheduler(address, timeout, connection_args=security.get_connection_args("client"),
                    where=where)
    try:
        # A scheduler answered: registering is what is left, which it answers at once. The
        # client keeps ``timeout`` for its later calls too, as it did before the probe.
        client = Client(address, timeout=timeout, security=security)
    except (OSError, TimeoutError) as exc:
        if _limit_errno(exc) is not None:
            raise ConnectionError(_limit_refusal(where, _limit_errno(exc))) from None
        raise ConnectionError(f"the Dask scheduler at {where} answered, then the client could "
                              f"not register within {timeout:g} s "
                              f"({' '.join(str(exc).split())})") from None
    logging.getLogger("distributed.client").addFilter(_LostSchedulerFilter(client))
    return client


class _LostSchedulerFilter(logging.Filter):
    """Drops the records of distributed's client module once ``client`` no longer runs
    (reconnecting to a lost scheduler, or closing): the command's own line says so."""

    def __init__(self, client):
        super().__init__()
        self._client = weakref.ref(client)

    def filter(self, record: logging.LogRecord) -> bool:
        client = self._client()
        return client is None or client.status not in ("connecting", "closing", "closed")
