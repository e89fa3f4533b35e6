"""The service boundary: replies of reward and environment servers to alignflow's HTTP clients
(:class:`rlhf_core.rewards.sources.HttpRewardSource`, the environment of :func:`rlhf_core.rollout.environments.environment_factory`),
and request bodies to ``serve-rm`` (:func:`rlhf_core.rewards.server.parse_score_request`).

One real server on 127.0.0.1 answers every request with the reply the current example sets: any status,
headers and body (arbitrary bytes, JSON of any shape, NaN and Infinity tokens, integers of hundreds or thousands
of digits, wrong counts, a secret echoed back). Each reply is either accepted (one finite float per sample, or
a well-formed step) or refused with the client's own error (:class:`rlhf_core.rewards.sources.RewardError`,
:class:`rlhf_core.rollout.environments.EnvironmentFailure`) whose message starts with the server's URL redacted and
holds no secret of the URL's. Any request body to ``serve-rm`` is parsed or refused with its
:class:`rlhf_core.rewards.server.BadRequest`. Nothing else is raised and no call outlives its deadline.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rlhf_core.rollout.environments import EnvironmentFailure, StepResult, environment_factory
from rlhf_core.common.redact import redact_secrets
from rlhf_core.rewards.server import BadRequest, parse_score_request
from rlhf_core.rewards.sources import HttpRewardSource, RewardError

SECRET = "tok-pconf-boundary-7c1d"
N = 3  # samples per reward call
DEADLINE_S = 0.2


class _Server(ThreadingHTTPServer):
    """Answers every POST with ``reply`` (status, headers, body); a client hanging up is not printed."""

    daemon_threads = True
    reply: tuple[int, dict[str, str], bytes] = (200, {}, b"{}")

    def handle_error(self, request, client_address):
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, headers, body = self.server.reply
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/score?token={SECRET}"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.just(SECRET)
    | st.sampled_from([10 ** 400, -10 ** 4000]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10)
rewards_like = st.lists(st.floats() | st.integers() | st.sampled_from([10 ** 400, True, None, "1", SECRET]),
                        min_size=N - 1, max_size=N + 1).map(lambda r: {"rewards": r})
step_like = st.fixed_dictionaries({}, optional={"observation": json_values, "done": json_values,
                                                "reward": json_values, "extra": json_values})
bodies = st.one_of(
    st.binary(max_size=100),
    st.one_of(json_values, rewards_like, step_like).map(lambda v: json.dumps(v).encode()),  # NaN, Infinity tokens
    st.sampled_from([b"[" + b"9" * 5000 + b"]", b'{"rewards": [' + b"1" * 5000 + b"]}", b"[" * 100_000,
                     b'{"rewards": [1e999, 1, 1]}', b"\xef\xbb\xbf{}", b'{"observation": "' + SECRET.encode() + b'"}']))
statuses = st.sampled_from([200] * 12 + [204, 301, 400, 401, 403, 404, 413, 429, 500, 503])
headers = st.sampled_from([{}, {"Content-Type": "text/html"}, {"Content-Encoding": "gzip"},
                           {"Retry-After": "0.01"}, {"Retry-After": "soon"}, {"Location": f"/x?token={SECRET}"}])


def _check_refusal(exc: Exception, kind: str, url: str) -> None:
    message = str(exc)
    assert message.startswith(f"{kind} server {redact_secrets(url)}"), message
    assert SECRET not in message and SECRET not in repr(exc)


@given(status=statuses, head=headers, body=bodies)
@example(status=200, head={}, body=b'{"rewards": [' + b"1" * 5000 + b", 1, 1]}").via("an int past str()'s limit")
@example(status=200, head={}, body=json.dumps({"rewards": [SECRET] * N}).encode()).via("a secret as a reward")
def test_a_reward_servers_reply_is_n_rewards_or_refused_naming_the_url(server, status, head, body):
    server.reply = (status, head, body)
    source = HttpRewardSource(_url(server), timeout_s=DEADLINE_S, retries=0, backoff_s=1.0, deadline_s=DEADLINE_S)
    start = time.monotonic()
    try:
        rewards = source(["p"] * N, ["c"] * N, [None] * N)
    except RewardError as exc:
        _check_refusal(exc, "reward", source.url)
    else:
        assert len(rewards) == N and all(type(r) is float and math.isfinite(r) for r in rewards)
    assert time.monotonic() - start < DEADLINE_S + 1.0


@given(status=statuses, head=headers, body=bodies)
@example(status=200, head={}, body=json.dumps({"observation": "x", "reward": SECRET}).encode())
@example(status=200, head={}, body=json.dumps({"observation": "x", "reward": 10 ** 400}).encode())
def test_an_environment_servers_reply_is_a_step_or_refused_naming_the_url(server, status, head, body):
    server.reply = (status, head, body)
    url = _url(server)
    env = environment_factory(url, stop_tokens=["</calc>"], timeout_s=DEADLINE_S, retries=0,
                              deadline_s=DEADLINE_S)()
    env.reset("1+2=", None)
    start = time.monotonic()
    try:
        step = env.step("<calc>1+2</calc>")
    except EnvironmentFailure as exc:
        _check_refusal(exc, "environment", url)
    else:
        assert isinstance(step, StepResult) and isinstance(step.observation, str) and isinstance(step.done, bool)
        assert step.reward is None or type(step.reward) in (int, float) and math.isfinite(step.reward)
    assert time.monotonic() - start < DEADLINE_S + 1.0


@given(raw=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                     st.fixed_dictionaries({}, optional={"prompts": json_values, "completions": json_values,
                                                         "labels": json_values}).map(lambda v: json.dumps(v).encode())))
@example(raw=b"[" * 100_000).via("deep nesting: RecursionError")
@example(raw=b'{"prompts": [' + b"1" * 5000 + b"]}").via("an int past str()'s digit limit: ValueError")
def test_a_score_request_body_is_parsed_or_refused_with_bad_request(raw):
    try:
        prompts, completions, labels = parse_score_request(raw)
    except BadRequest as exc:
        assert exc.status == 400 and str(exc).startswith(("body: ", "field '"))
        return
    assert len(prompts) == len(completions) == len(labels)
    assert all(isinstance(t, str) for t in prompts + completions)
