"""Loaded by every Python process of a test run that puts this folder on PYTHONPATH: an audit hook
appends each attempt to reach a host other than this machine's loopback (a connect, a DNS look-up,
a datagram) to the file named by ``ALIGNFLOW_TEST_NET_LOG``. Subprocesses inherit PYTHONPATH, so
stage workers, the Prefect server and DVC are watched too; with ``ALIGNFLOW_TEST_NET_PROCS`` set, each
watched process also appends its pid and command line there, so a test can show which ones were."""

import os
import sys

_LOG = os.environ.get("ALIGNFLOW_TEST_NET_LOG")
_PROCS = os.environ.get("ALIGNFLOW_TEST_NET_PROCS")
_LOOPBACK = ("localhost", "127.", "::1", "0.0.0.0", "::", "ip6-localhost")


def _host(event, args):
    if event in ("socket.connect", "socket.sendto"):
        address = args[1] if event == "socket.connect" else args[-1]
        return address[0] if isinstance(address, tuple) else None  # a Unix socket's path is local
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"):
        first = args[0]
        return first[0] if isinstance(first, tuple) else first
    return None


def _hook(event, args):
    if not event.startswith("socket."):
        return
    host = _host(event, args)
    if host is None:
        return
    host = host.decode() if isinstance(host, bytes) else str(host)
    if host.lower().startswith(_LOOPBACK) or host.lower().endswith(".localhost"):
        return
    with open(_LOG, "a", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()} {event} {host} :: {' '.join(sys.argv)[:160]}\n")


if _LOG:
    sys.addaudithook(_hook)
    if _PROCS:
        with open(_PROCS, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {sys.executable} {' '.join(sys.argv)[:200]}\n")
