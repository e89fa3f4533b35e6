"""Environments without a model: the calculator, the tool task's data and reward, the masks' math, HTTP failures.

The tiny-model tests (trajectories are the sampled ids plus observations, observation tokens carry no
loss and no advantage, a trainer step) are in tests/model/test_tool_rollout.py.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time
from typing import ClassVar

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config, ToolGenerateConfig
from rlhf_core.rollout.environments import EnvironmentFailure, StepResult, environment_factory
from rlhf_core.algorithms.rl_math import compute_advantages, gae, policy_loss
from rlhf_core.embedded.tasks import Problem
from rlhf_core.rollout.tool_task import (
    CalculatorEnv,
    final_answer,
    generate_tool_datasets,
    reward,
    tool_completion,
)


def test_calculator_answers_a_call_and_flags_one_it_cannot_read():
    env = CalculatorEnv()
    env.reset("47*8=", "376")
    assert env.step("<calc>47*8</calc>") == StepResult("<result>376</result>")
    assert env.step("<calc>26-90</calc>").observation == "<result>-64</result>"
    assert env.step("<calc>4/2</calc>").observation == "<result>error</result>"


def test_tool_reward_reads_the_answer_after_the_last_observation():
    """The tool earns nothing by itself: 1 only where the text after the last </result> is the label."""
    done = tool_completion(Problem(47, "*", 8))
    assert done == "<calc>47*8</calc><result>376</result>376"
    assert final_answer(done) == "376"
    assert reward(["47*8="] * 4, [done, "376", "<calc>47*8</calc><result>376</result>", "375"], ["376"] * 4) \
        == [1.0, 1.0, 0.0, 0.0]


def test_tool_datasets_are_disjoint_deterministic_and_mix_tool_calls_with_guesses(tmp_path):
    cfg = ToolGenerateConfig(out_dir=str(tmp_path / "a"), n_sft=400, n_prompts=50, n_eval=50, skip_tool=0.5)
    paths = generate_tool_datasets(cfg)
    again = generate_tool_datasets(ToolGenerateConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "b")}))
    assert all(paths[k].read_bytes() == again[k].read_bytes() for k in paths)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    prompts = {k: {r["prompt"] for r in v} for k, v in rows.items()}
    assert not prompts["eval"] & (prompts["sft"] | prompts["prompts"])
    calls = [r["completion"].startswith("<calc>") for r in rows["sft"]]
    assert 0.4 < sum(calls) / len(calls) < 0.6  # skip_tool 0.5: about half the demonstrations guess
    with pytest.raises(ConfigError, match="skip_tool"):
        ToolGenerateConfig(skip_tool=1.5)


# ---- the masks' math: observation tokens carry zero advantage and zero loss gradient ---------------------


def test_gae_skips_observation_tokens_as_if_they_were_not_there():
    """Row 1 is row 0 with two observation tokens (mask 0) inserted after its second token. With
    gamma = lam = 1 and the score 1 at the last token, every valid token's advantage is 1 - V(s_t):
    rewards [0, 0, 1], values [.5, .25, .75] -> [.5, .75, .25]; the inserted columns get exactly 0,
    and the valid ones the same numbers as without them."""
    plain = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.25, 0.75]]), torch.ones(1, 3), 1.0, 1.0)[0]
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(torch.tensor([[0.0, 0.0, 9.0, 9.0, 1.0]]) * mask, torch.tensor([[0.5, 0.25, 3.0, 3.0, 0.75]]),
                   mask, 1.0, 1.0)
    assert torch.allclose(plain, torch.tensor([[0.5, 0.75, 0.25]]))
    assert torch.allclose(adv[:, [0, 1, 4]], plain) and torch.equal(adv[:, 2:4], torch.zeros(1, 2))
    assert torch.equal(ret[:, 2:4], torch.zeros(1, 2))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr-grpo", "reinforce++"])
def test_sequence_estimators_give_observation_tokens_zero_advantage(estimator):
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv, _ = compute_advantages(estimator, scores=torch.tensor([1.0, 0.0]), mask=mask, group_size=2)
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv)) and bool((adv * mask).abs().sum() > 0)


def test_policy_loss_has_no_gradient_on_observation_tokens():
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], requires_grad=True)
    loss, _ = policy_loss("ppo_clip", logp, logp.detach(), torch.tensor([[1.0, 5.0, 5.0, 1.0]]), mask,
                          clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert torch.equal(logp.grad[:, 1:3], torch.zeros(1, 2)) and bool(logp.grad[:, [0, 3]].abs().sum() > 0)


# ---- config -------------------------------------------------------------------------------------------


def test_rl_config_rejects_bad_environment_settings():
    with pytest.raises(ConfigError, match="environment.spec: must be path/to/env.py:function"):
        build_config(RLConfig, "rl", {"environment.spec": "env.py"})
    with pytest.raises(ConfigError, match="environment.stop_tokens"):
        build_config(RLConfig, "rl", {"environment.spec": "http://127.0.0.1:9/step"})
    with pytest.raises(ConfigError, match="max_turns"):
        build_config(RLConfig, "rl", {"environment.spec": "env.py:make_env", "environment.max_turns": 0})
    # multi-turn rollouts run under Ray placement too (the environment stays in the controller)
    assert build_config(RLConfig, "rl", {"environment.spec": "env.py:make_env",
                                         "distribution.placement": "colocated"}).distribution.placement == "colocated"
    with pytest.raises(ConfigError, match="environment.stop_tokens"):
        build_config(RLConfig, "rl", {"environment.stop_tokens": ["</calc>"]})
    assert build_config(RLConfig, "rl", {"environment.spec": "env.py:make_env"}).environment.max_turns == 2


# ---- an HTTP environment that is down, slow or returns garbage -----------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"
    seen: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({**body, "auth": self.headers.get("Authorization")})
        if self.mode == "slow":
            time.sleep(0.5)
        payload = {"ok": json.dumps({"observation": "<result>3</result>", "done": False, "reward": None}),
                   "garbage": "<html>not json</html>", "slow": "{}",
                   "wrong": json.dumps({"observation": 3, "done": "no"})}[self.mode]
        data = payload.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    """A client that hung up (the slow mode's timeout) is expected, so its broken pipe is not printed: a
    traceback formatted in a handler thread parses source with ``ast``, and CPython 3.11 keeps the AST
    converter's recursion count in state shared between threads, so a concurrent ``ast.parse`` in another
    test can fail with a SystemError."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture()
def env_server():
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    _Handler.seen = []
    yield server, f"http://127.0.0.1:{server.server_address[1]}/step"
    server.shutdown()
    server.server_close()


def _http_env(url, **kw):
    make = environment_factory(url, stop_tokens=["</calc>"], retries=kw.pop("retries", 1), backoff_cap_s=0.01,
                               **kw)
    env = make()
    env.reset("1+2=", "3")
    return env


def test_http_environment_sends_the_episode_and_the_token(env_server, monkeypatch):
    _, url = env_server
    monkeypatch.setenv("ALIGNFLOW_TEST_ENV_TOKEN", "s3cret-token")
    _Handler.mode = "ok"
    env = _http_env(url, token_env="ALIGNFLOW_TEST_ENV_TOKEN")
    assert env.step("<calc>1+2</calc>") == StepResult("<result>3</result>")
    env.step("<calc>2+2</calc>")
    assert _Handler.seen[-1]["actions"] == ["<calc>1+2</calc>", "<calc>2+2</calc>"]
    assert _Handler.seen[-1]["prompt"] == "1+2=" and _Handler.seen[-1]["auth"] == "Bearer s3cret-token"


@pytest.mark.parametrize("mode, message", [("garbage", "not JSON"), ("wrong", "expected a string and a boolean")])
def test_http_environment_that_returns_garbage_fails_at_once(env_server, mode, message):
    _, url = env_server
    _Handler.mode = mode
    with pytest.raises(EnvironmentFailure, match=message):
        _http_env(url).step("<calc>1+2</calc>")
    assert len(_Handler.seen) == 1  # a malformed 200 is a bug, not a blip: not retried


def test_http_environment_that_is_slow_or_down_fails_after_its_retries(env_server):
    server, url = env_server
    _Handler.mode = "slow"
    with pytest.raises(EnvironmentFailure, match="failed after 2 attempts; last error: timed out"):
        _http_env(url, timeout_s=0.1).step("<calc>1+2</calc>")
    server.shutdown()
    server.server_close()
    with pytest.raises(EnvironmentFailure, match="failed after 2 attempts; last error: connection failed"):
        _http_env(url).step("<calc>1+2</calc>")
