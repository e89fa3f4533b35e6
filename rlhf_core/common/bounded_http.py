"""Bounded HTTP replies, for clients of servers alignflow does not control (reward and environment servers).

requests bounds the connect and each read of a reply (``timeout``), never the whole of it: a server that
trickles a byte per read, or streams gigabytes, holds its client as long as it likes. Here one request gets:

* a total deadline (:class:`Deadline`): a watchdog thread shuts the request's socket down when it passes, so a read
  blocked on a trickle ends at once, the status line and headers included (they are read before requests
  returns, where no loop of ours could look at a clock);
* a byte cap (:func:`read_capped`): the body is streamed and refused once past the cap, a declared
  ``Content-Length`` over it before any byte is read; decoded bytes are counted, so a compressed bomb is
  refused as well (urllib3 decompresses at most what each read asks for);
* strict JSON (:func:`loads_strict`): ``NaN`` and ``Infinity``, which Python's parser accepts and RFC 8259 does
  not, and nesting deep enough to exhaust the parser's recursion are errors, not values.

Use::

    session = deadline_session()
    with Deadline(seconds) as deadline:
        reply = session.post(url, json=body, timeout=seconds, stream=True)
        data = read_capped(reply, max_bytes, deadline)

The socket is found by the connection classes of :func:`deadline_session`'s pools, which report each socket
to the :class:`Deadline` open in the calling thread. Imports nothing from ``rlhf_core``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import socket
import threading
import time
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3 import ProxyManager
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

_current = threading.local()  # the Deadline open in this thread, if any


class ReplyTooLarge(ValueError):
    """A reply whose body is (or says it is) over the byte cap; the message says by how much."""


class Deadline:
    """A whole-request deadline for the calling thread: ``seconds`` after entry, every socket the request has
    opened or used is shut down, so whatever read is blocked on it fails at once.

    Leaving the block disarms it first (under a lock), so a connection handed back to the pool is never shut
    down by a deadline that passes later."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"Deadline: seconds must be > 0, got {seconds}")
        self.seconds = seconds
        self.expired = False
        self.disarmed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Deadline:
        self._previous = getattr(_current, "deadline", None)
        _current.deadline = self
        _WATCHDOG.add(time.monotonic() + self.seconds, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self.disarmed = True
        _current.deadline = self._previous

    def watch(self, sock: socket.socket | None) -> None:
        """Shut ``sock`` down when the deadline passes (at once, if it has)."""
        if sock is None:
            return
        with self._lock:
            if self.disarmed:
                return
            self._socks.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        """The deadline has passed: shut every watched socket down, unless the request is over."""
        with self._lock:
            if self.disarmed:
                return
            self.expired = True
            for sock in self._socks:
                _shut(sock)


class _Watchdog:
    """One daemon thread for every :class:`Deadline` of the process, sleeping until the earliest is due: a
    thread per request would cost more than a loopback round trip."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()  # ties broken by arrival, never by comparing Deadlines
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, end: float, deadline: Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (end, next(self._order), deadline))
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="alignflow-http-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].disarmed:  # finished requests leave from the front
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                due = self._heap[0][0] - time.monotonic()
                if due > 0:
                    self._cond.wait(due)
                    continue
                heapq.heappop(self._heap)[2].expire()


_WATCHDOG = _Watchdog()


def _shut(sock: socket.socket) -> None:
    """Shut both directions of ``sock``: a blocked ``recv`` returns at once. The plain socket's method even for
    a TLS socket, whose own ``shutdown`` would also drop its TLS state under a reader in another thread."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected: nothing left to interrupt


def _watch(sock: socket.socket | None) -> None:
    deadline = getattr(_current, "deadline", None)
    if deadline is not None:
        deadline.watch(sock)


class _WatchedHTTPConnection(HTTPConnection):
    """urllib3's connection, reporting its socket to the thread's :class:`Deadline`: a new one as soon as it
    is connected (a TLS handshake is then bounded too), a reused one before the reply is read."""

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        _watch(sock)
        return sock

    def getresponse(self) -> Any:  # type: ignore[override]
        _watch(self.sock)
        return super().getresponse()


class _WatchedHTTPSConnection(HTTPSConnection):
    """The TLS twin of :class:`_WatchedHTTPConnection`."""

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        _watch(sock)
        return sock

    def getresponse(self) -> Any:  # type: ignore[override]
        _watch(self.sock)
        return super().getresponse()


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


class _WatchedAdapter(HTTPAdapter):
    """requests' adapter with pools of watched connections, direct or through an HTTP proxy."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if type(manager) is ProxyManager:  # a SOCKS manager keeps its own pools (and per-read timeouts)
            manager.pool_classes_by_scheme = _POOLS
        return manager


def deadline_session() -> requests.Session:
    """A requests session whose requests a :class:`Deadline` can cut short."""
    session = requests.Session()
    adapter = _WatchedAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def read_capped(reply: requests.Response, max_bytes: int, deadline: Deadline | None = None) -> bytes:
    """``reply``'s body (sent with ``stream=True``), or :class:`ReplyTooLarge` once it passes ``max_bytes``: a
    declared ``Content-Length`` over the cap is refused before reading, anything else is counted as it
    arrives and never held past the cap plus one chunk."""
    declared = (reply.headers.get("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"declares {int(declared)} bytes (Content-Length), over the {max_bytes}-byte cap")
    chunks, size = [], 0
    for chunk in reply.iter_content(chunk_size=min(64 * 1024, max_bytes + 1)):
        size += len(chunk)
        if size > max_bytes:
            raise ReplyTooLarge(f"is over the {max_bytes}-byte cap (refused after {size} bytes)")
        if deadline is not None and deadline.expired:
            raise TimeoutError(f"the {deadline.seconds:g} s deadline passed after {size} bytes of the body")
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def loads_strict(data: bytes | str) -> Any:
    """``json.loads`` without ``NaN``/``Infinity`` tokens, with deep nesting a ValueError (not a RecursionError)."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
