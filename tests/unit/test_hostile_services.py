"""The reward client and the environment client against a hostile server: slow, huge, malformed, non-finite.

One real HTTP server on 127.0.0.1 (:class:`HostileServer`) answers ``POST /<mode>`` with one fault per mode, as
a reward server (the body has ``prompts``) or as an environment server (it has ``actions``). Each test runs
one client against one mode and checks what issue 48 asks of a hostile service: the call ends within a
generous bound of its limits, holds at most a few times the byte cap in memory, and raises the client's own
error whose message names the server (its URL, secrets redacted) and the fault, with no secret in the
message, its repr, its traceback or anything printed. The URL carries a ``?token=`` and the client a bearer
token from an environment variable; the 5xx mode echoes both back, and user:pass@ credentials get a test
of their own.
"""

from __future__ import annotations

import base64
import gzip
import json
import sys
import threading
import time
import traceback
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from rlhf_core.rollout.environments import EnvironmentFailure, StepResult, environment_factory
from rlhf_core.rewards.sources import HttpRewardSource, RewardError

QUERY_TOKEN = "tok-hostile-query-5e2a9c"
ENV_NAME, BEARER_TOKEN = "ALIGNFLOW_TEST_HOSTILE_TOKEN", "tok-hostile-bearer-81f3d0"
USER_PASS = "pw-hostile-userinfo-4b7e"
SECRETS = (QUERY_TOKEN, BEARER_TOKEN, USER_PASS, base64.b64encode(f"bob:{USER_PASS}".encode()).decode())
CAP = 1024 * 1024  # the clients' max_response_bytes here
HUGE = 64 * CAP  # what the huge modes offer: the client must stop long before
TIMEOUT_S = 1.0  # each request's whole-reply deadline
TRICKLE_GAP_S = 0.1  # a byte per gap: far inside a per-read timeout, far past the deadline in total
PROMPTS, COMPLETIONS, LABELS = ["1+2=", "2+2=", "3+3=", "9*9="], ["3", "4", "6", "81"], ["3", "4", "6", "81"]


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


def _json_reply(kind: str, n: int, mode: str) -> bytes:
    """The body of a 200 in a simple mode, as a reward server (``kind`` "reward") or an environment server."""
    reward = {"ok": {"rewards": [0.5] * n}, "count": {"rewards": [0.5] * (n + 1)},
              "string": {"rewards": ["high"] * n}, "object": {"rewards": {"0": 0.5}},
              "bool": {"rewards": [True] * n}, "bigint": {"rewards": [10 ** 400] * n}}
    env = {"ok": {"observation": "<result>3</result>", "done": False, "reward": None},
           "count": [{"observation": "a", "done": False}, {"observation": "b", "done": True}],
           "string": {"observation": "x", "done": False, "reward": "high"},
           "object": {"observation": {"text": "x"}, "done": False, "reward": None},
           "bool": {"observation": "x", "done": False, "reward": True},
           "bigint": {"observation": "x", "done": False, "reward": 10 ** 400}}
    if mode in ("nan", "infinity"):  # Python's json writes these tokens; RFC 8259 has none
        value = float("nan") if mode == "nan" else float("-inf")
        return json.dumps({"rewards": [value] + [0.5] * (n - 1)} if kind == "reward"
                          else {"observation": "x", "done": False, "reward": value}).encode()
    if mode == "not_json":
        return b"<html><body>502 upstream exploded</body></html>"
    if mode == "deep":
        return b"[" * 200_000
    return json.dumps((reward if kind == "reward" else env)[mode]).encode()


class _QuietServer(ThreadingHTTPServer):
    """Clients that hang up are the point here, so their broken connections are not printed: a traceback
    formatted in a handler thread parses source with ``ast``, and CPython 3.11 keeps the AST converter's
    recursion count in state shared between threads, so a concurrent ``ast.parse`` elsewhere can fail."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HostileServer:
    """127.0.0.1 server with one fault per path (``/<mode>``); ``sent[mode]`` is how many body bytes the last
    request of that mode got onto the wire before the client hung up, set when its handler has ended."""

    SIMPLE = ("ok", "count", "string", "object", "bool", "bigint", "nan", "infinity", "not_json", "deep")

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.sent: dict[str, int] = {}
        self.done: dict[str, threading.Event] = {}
        self.connections = 0
        self.bomb = gzip.compress(b" " * (16 * CAP), compresslevel=9)  # about 16 KB that inflate to 16 MiB
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a client's pooled connection is reused

            def setup(self):
                super().setup()
                hostile.connections += 1

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind, n = ("reward", len(body["prompts"])) if "prompts" in body else ("env", 1)
                mode = self.path.split("?")[0].strip("/")
                echo = f"{self.command} {self.path} Authorization: {self.headers.get('Authorization')}"
                done = hostile.done.setdefault(mode, threading.Event())
                done.clear()
                sent = [0]
                try:
                    hostile.answer(self, mode, kind, n, echo, sent)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client hung up: what a capped or timed-out client does
                finally:
                    hostile.sent[mode] = sent[0]
                    done.set()

            def log_message(self, *args):
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}?token={QUERY_TOKEN}"

    def answer(self, h: BaseHTTPRequestHandler, mode: str, kind: str, n: int, echo: str, sent: list[int]) -> None:
        """Write mode ``mode``'s reply on ``h``'s connection, counting body bytes in ``sent[0]``."""
        sock = h.connection
        if mode in self.SIMPLE:
            data = _json_reply(kind, n, mode)
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            sent[0] = len(data)
        elif mode == "echo5xx":  # an error page that quotes the request line and its Authorization header
            data = json.dumps({"error": f"cannot serve {echo}"}).encode()
            sock.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            sent[0] = len(data)
        elif mode == "redirect":  # with a body requests would read whole before following
            sock.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /ok\r\n"
                         + f"Content-Length: {HUGE}\r\n\r\n".encode())
            h.close_connection = True
        elif mode in ("trickle_headers", "trickle_body"):
            self._trickle(h, mode, sent)
        else:
            self._flood(h, mode, sent)

    def _trickle(self, h: BaseHTTPRequestHandler, mode: str, sent: list[int]) -> None:
        """A byte per TRICKLE_GAP_S: of the status line and headers, or of a body that would take 60 s."""
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 600\r\n\r\n"
        if mode == "trickle_body":
            h.connection.sendall(head)
            head = b""
        for byte in (head + b" " * 600)[:600]:  # bounded: at most 60 s even against a client that never gives up
            if self.stop.wait(TRICKLE_GAP_S):
                break
            h.connection.sendall(bytes([byte]))
            sent[0] += 1
        h.close_connection = True

    def _flood(self, h: BaseHTTPRequestHandler, mode: str, sent: list[int]) -> None:
        """HUGE bytes of reply (``huge``: no length, to the close; ``huge_declared``: said up front;
        ``bomb``: a gzip body that inflates to 16 times the cap)."""
        sock = h.connection
        h.close_connection = True
        if mode == "bomb":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                         + f"Content-Length: {len(self.bomb)}\r\n\r\n".encode() + self.bomb)
            sent[0] = len(self.bomb)
            return
        length = f"Content-Length: {HUGE}\r\n" if mode == "huge_declared" else "Connection: close\r\n"
        sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
        chunk = b'{"rewards": [' + b"0.5, " * 13_000
        while sent[0] < HUGE and not self.stop.is_set():
            sock.sendall(chunk)
            sent[0] += len(chunk)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hostile():
    server = HostileServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def bearer_token(monkeypatch):
    monkeypatch.setenv(ENV_NAME, BEARER_TOKEN)


# --------------------------------------------------------------------------------------
# The two clients, one call each
# --------------------------------------------------------------------------------------


def _reward_call(url: str, **kw):
    source = HttpRewardSource(url, timeout_s=TIMEOUT_S, retries=kw.pop("retries", 0), backoff_s=0.01,
                              max_response_bytes=CAP, **{"token_env": ENV_NAME, **kw})
    return source(PROMPTS, COMPLETIONS, LABELS)


def _env_call(url: str, **kw):
    make = environment_factory(url, stop_tokens=["</calc>"], timeout_s=TIMEOUT_S, retries=kw.pop("retries", 0),
                               backoff_cap_s=0.01, max_response_bytes=CAP, **{"token_env": ENV_NAME, **kw})
    env = make()
    env.reset("1+2=", "3")
    return env.step("<calc>1+2</calc>")


CLIENTS = {"reward": (_reward_call, RewardError, "reward server"),
           "env": (_env_call, EnvironmentFailure, "environment server")}


def _refused(client: str, url: str, capfd, **kw) -> tuple[str, float]:
    """Run ``client`` against ``url``; the error's message and the seconds it took, after checking the error's
    type, that it names the server by its redacted URL, and that no secret is in it or in anything printed."""
    call, error, who = CLIENTS[client]
    start = time.monotonic()
    with pytest.raises(error) as err:
        call(url, **kw)
    elapsed = time.monotonic() - start
    printed = capfd.readouterr()
    msg = str(err.value)
    text = "\n".join([msg, repr(err.value), *traceback.format_exception(err.value), printed.out, printed.err])
    for secret in SECRETS:
        assert secret not in text, (secret, text)
    parts = urlsplit(url)
    assert f"{who} http://" in msg and f"{parts.hostname}:{parts.port}{parts.path}" in msg, msg
    if parts.query:
        assert f"{parts.path}?token=***" in msg, msg
    return msg, elapsed


# --------------------------------------------------------------------------------------
# The faults
# --------------------------------------------------------------------------------------

FAULTS = {  # mode: (what the reward client's message says, what the environment client's says)
    "not_json": ("reply is not JSON", "reply is not JSON"),
    "nan": ("NaN is not a JSON number", "NaN is not a JSON number"),
    "infinity": ("-Infinity is not a JSON number", "-Infinity is not a JSON number"),
    "deep": ("nested too deeply", "nested too deeply"),
    "count": ("returned 5 rewards for 4 samples", "expected a StepResult"),
    "string": ("sample 0: reward 'high' is not a number", "reward 'high'; expected a finite number"),
    "object": ("expected a list of 4 rewards, got dict", "expected a string and a boolean"),
    "bool": ("sample 0: reward True is not a number", "reward True; expected a finite number"),
    "bigint": ("sample 0: reward 1000", "expected a finite number"),
    "redirect": ("HTTP 307 Temporary Redirect (not retried) (redirects are not followed",) * 2,
}


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_malformed_reply_is_refused_at_once_naming_server_and_fault(hostile, client, mode, capfd):
    """A reply that parses as Python's JSON but is not RFC 8259's (NaN, -Infinity), is no JSON at all, nests
    past the parser's recursion, has the wrong count or type of values, a number past float's range, or is a
    redirect (with a 64 MiB body requests would read whole to follow it): refused on the first attempt."""
    msg, elapsed = _refused(client, hostile.url(mode), capfd, retries=3)
    expect = FAULTS[mode][0 if client == "reward" else 1]
    assert expect in msg, msg
    assert "attempts" not in msg  # not "failed after N attempts": a malformed reply is a bug, not a blip
    assert elapsed < 5.0, elapsed


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("mode", ["trickle_headers", "trickle_body"])
def test_a_trickling_server_is_cut_off_at_the_request_deadline(hostile, client, mode, capfd):
    """A byte every 0.1 s never trips a per-read timeout, and this reply would take 60 s: the request's
    1 s deadline ends it, in the status line or in the body alike."""
    msg, elapsed = _refused(client, hostile.url(mode), capfd)
    assert "failed after 1 attempts; last error: timed out after 1s (no complete reply by then)" in msg, msg
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 5.0, elapsed
    print(f"{client} client vs {mode}: refused after {elapsed:.2f} s (deadline {TIMEOUT_S} s)")


def test_the_call_deadline_bounds_retries_against_a_trickling_server(hostile, capfd):
    """retries 100 of 1 s each would take minutes; reward_deadline_s 2.5 ends the call, the last attempt's
    timeout cut to the time left."""
    msg, elapsed = _refused("reward", hostile.url("trickle_body"), capfd, retries=100, deadline_s=2.5)
    assert "timed out" in msg and ("2.5 s deadline" in msg or "failed after" in msg), msg
    assert elapsed < 2.5 + 5.0, elapsed


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("mode, expect", [("huge", "is over the 1048576-byte cap (refused after"),
                                          ("huge_declared", "declares 67108864 bytes (Content-Length), over the "
                                                            "1048576-byte cap"),
                                          ("bomb", "is over the 1048576-byte cap (refused after")])
def test_a_huge_reply_is_refused_at_the_cap_without_reading_it_all(hostile, client, mode, expect, capfd):
    """64 MiB of body (streamed to the close, or declared up front), or a 16 KB gzip body that inflates to
    16 MiB: refused at the 1 MiB cap, not retried; the client's Python allocations peak at a few times the
    cap and the server could not write the whole body before the client hung up."""
    tracemalloc.start()
    try:
        msg, elapsed = _refused(client, hostile.url(mode), capfd, retries=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert expect in msg and "reward.max_response_bytes" in msg, msg
    assert elapsed < 5.0, elapsed
    assert peak < 6 * CAP, peak
    assert hostile.done[mode].wait(5.0)
    assert hostile.sent[mode] < HUGE // 2, hostile.sent[mode]
    print(f"{client} client vs {mode}: refused after {elapsed:.2f} s; peak traced {peak / CAP:.2f} MiB; "
          f"server wrote {hostile.sent[mode] / CAP:.2f} MiB before the client hung up")


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_5xx_that_echoes_the_secrets_is_quoted_redacted(hostile, client, capfd):
    """The error page quotes the request line (?token=...) and the Authorization header: the message keeps
    the page's words, with each secret replaced."""
    msg, elapsed = _refused(client, hostile.url("echo5xx"), capfd)
    assert "failed after 1 attempts; last error: HTTP 500: " in msg and "cannot serve POST /echo5xx" in msg, msg
    assert "***" in msg and elapsed < 5.0


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_5xx_that_echoes_userinfo_credentials_is_quoted_redacted(hostile, client, capfd):
    """user:pass@ in the URL is sent as Basic auth; echoed back, both forms are scrubbed."""
    url = f"http://bob:{USER_PASS}@127.0.0.1:{hostile.port}/echo5xx"
    msg, _ = _refused(client, url, capfd, token_env="")
    assert "HTTP 500: " in msg and "Authorization: Basic ***" in msg, msg


# --------------------------------------------------------------------------------------
# The same server, well-behaved: the limits cost an honest server nothing
# --------------------------------------------------------------------------------------


def test_an_honest_reply_passes_and_its_connection_outlives_the_deadline(hostile):
    """The ok mode answers both clients; a connection kept alive past a request's deadline is reused, not
    shut down when that request's deadline passes later (one connection for three calls)."""
    source = HttpRewardSource(hostile.url("ok"), timeout_s=0.3, retries=0, max_response_bytes=CAP, token_env=ENV_NAME)
    before = hostile.connections
    assert source(PROMPTS, COMPLETIONS, LABELS) == [0.5] * 4
    time.sleep(0.5)  # past the 0.3 s deadline of the first request
    assert source(PROMPTS, COMPLETIONS, LABELS) == [0.5] * 4
    assert source(PROMPTS, COMPLETIONS, LABELS) == [0.5] * 4
    assert hostile.connections - before == 1
    assert _env_call(hostile.url("ok")) == StepResult("<result>3</result>")


def test_max_response_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_response_bytes must be > 0, got 0"):
        HttpRewardSource("http://127.0.0.1:9/score", max_response_bytes=0)
