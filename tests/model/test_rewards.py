"""Reward sources: a function file, a micro reward model, and HTTP against the real serve-rm server."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import torch

from rlhf_core.data.tokenize import tokenize_prompt_completion
from rlhf_core.rewards.sources import (FunctionRewardSource, HttpRewardSource, RewardError, RewardKind, RewardModelSource,
                               RewardSource, build_reward_source)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["12+30=", "sort 321=", "7*8=", "sort 90817="]
COMPLETIONS = ["42", "321", "56", "01789"]
LABELS = ["42", "123", "56", "01789"]


# --------------------------------------------------------------------------------------
# Function files
# --------------------------------------------------------------------------------------


def reward_file(tmp_path: Path, body: str, name: str = "my_reward.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_embedded_reward_file():
    source = build_reward_source("function", path=str(REPO / "rlhf_core/embedded/reward.py") + ":reward")
    assert isinstance(source, RewardSource) and source.name.endswith("embedded/reward.py:reward")
    assert source(PROMPTS, COMPLETIONS, LABELS) == [1.0, 0.0, 1.0, 1.0]
    # sent to another process (a Ray actor) as its spec, re-imported there
    assert pickle.loads(pickle.dumps(source))(PROMPTS, COMPLETIONS, LABELS) == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(RewardError, match=r"reward\.py.*sample 2 .*no label"):
        source(PROMPTS, COMPLETIONS, ["42", "123", None, "01789"])


def test_the_embedded_reward_file_under_its_old_path():
    """A params file written before the core was arranged by concern names the shipped rule by its old path."""
    source = build_reward_source("function", path="rlhf_core/rewards_embedded.py:reward")
    assert source.name.endswith("embedded/reward.py:reward")
    assert source(PROMPTS, COMPLETIONS, LABELS) == [1.0, 0.0, 1.0, 1.0]


def test_function_file_happy_path(tmp_path):
    path = reward_file(tmp_path, "def length(prompts, completions, labels):\n"
                                 "    return [len(c) for c in completions]\n")
    assert FunctionRewardSource(f"{path}:length")(PROMPTS, COMPLETIONS, [None] * 4) == [2.0, 3.0, 2.0, 5.0]


def test_function_that_raises_names_file_function_and_sample(tmp_path):
    path = reward_file(tmp_path, "def picky(prompts, completions, labels):\n"
                                 "    return [1.0 / (len(c) - 2) for c in completions]\n")
    with pytest.raises(RewardError) as err:
        FunctionRewardSource(f"{path}:picky")(PROMPTS, COMPLETIONS, LABELS)
    msg = str(err.value)  # completions 0 and 2 have length 2; the first is reported
    assert str(path) in msg and "picky" in msg and "sample 0" in msg and "ZeroDivisionError" in msg


@pytest.mark.parametrize("returned,expect", [
    ("[1.0, 2.0]", r"returned 2 rewards for 4 samples"),
    ("[1.0, float('nan'), 0.0, 0.0]", r"sample 1: reward nan is not finite"),
    ("[0.0, 0.0, float('inf'), 0.0]", r"sample 2: reward inf is not finite"),
    ("[0.0, 0.0, 0.0, 'high']", r"sample 3: reward 'high' is not a number"),
    ("None", r"expected a list of 4 rewards, got NoneType"),
])
def test_function_bad_results(tmp_path, returned, expect):
    path = reward_file(tmp_path, f"def bad(prompts, completions, labels):\n    return {returned}\n")
    with pytest.raises(RewardError, match=expect) as err:
        FunctionRewardSource(f"{path}:bad")(PROMPTS, COMPLETIONS, LABELS)
    assert str(path) in str(err.value) and "bad" in str(err.value)


def test_function_tensor_result_accepted(tmp_path):
    path = reward_file(tmp_path, "import torch\n"
                                 "def t(prompts, completions, labels):\n"
                                 "    return torch.arange(len(prompts), dtype=torch.float32)\n")
    assert FunctionRewardSource(f"{path}:t")(PROMPTS, COMPLETIONS, LABELS) == [0.0, 1.0, 2.0, 3.0]


def test_function_spec_errors(tmp_path):
    path = reward_file(tmp_path, "def reward(p, c, l):\n    return [0.0] * len(p)\nNOT_A_FUNCTION = 3\n")
    with pytest.raises(RewardError, match=r"file .*missing\.py not found"):
        FunctionRewardSource(f"{tmp_path / 'missing.py'}:reward")
    with pytest.raises(RewardError, match=r"my_reward\.py defines no 'score'"):
        FunctionRewardSource(f"{path}:score")
    with pytest.raises(RewardError, match=r"'NOT_A_FUNCTION' in .*my_reward\.py is not callable"):
        FunctionRewardSource(f"{path}:NOT_A_FUNCTION")
    with pytest.raises(RewardError, match=r"expected 'path/to/file\.py:function_name'"):
        FunctionRewardSource(str(path))
    with pytest.raises(RewardError, match=r"is not a \.py file"):
        FunctionRewardSource("json:loads")  # a module name is never imported
    broken = reward_file(tmp_path, "import not_a_real_module_xyz\n", name="broken.py")
    with pytest.raises(RewardError, match=r"importing .*broken\.py failed: ModuleNotFoundError"):
        FunctionRewardSource(f"{broken}:reward")


def test_build_reward_source_validates_kind():
    assert RewardKind.MODEL.loads_model and not RewardKind.HTTP.loads_model
    with pytest.raises(ValueError, match=r"reward kind 'rule': expected one of \['model', 'function', 'http'\]"):
        build_reward_source("rule", path="x")
    with pytest.raises(ValueError, match="'http' needs a url"):
        build_reward_source(RewardKind.HTTP)
    with pytest.raises(ValueError, match="'model' needs a path"):
        build_reward_source("model")


# --------------------------------------------------------------------------------------
# A reward model, in process and behind the real serve-rm server
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro_rm(make_micro_rm) -> Path:
    """An (untrained) micro reward model directory with normalisation statistics."""
    return make_micro_rm(mean=0.25, std=2.0)


def _start_serve_rm(micro_rm: Path, run_dir: Path, extra: list[str], env: dict[str, str] | None = None):
    """``python -m rlhf_core.rewards.server`` on a free port: ``(process, base URL)`` once it answers /health."""
    port_file = run_dir / "port"
    with (run_dir / "serve-rm.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.rewards.server", "--model", str(micro_rm), "--port",
                                 "0", "--port-file", str(port_file), "--batch-size", "2", "--device", "cpu", *extra],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if proc.poll() is not None:
                pytest.fail(f"serve-rm exited with {proc.returncode}:\n{(run_dir / 'serve-rm.log').read_text()}")
            if time.monotonic() > deadline:
                pytest.fail("serve-rm wrote no port file within 120 s")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        assert requests.get(f"{url}/health", timeout=10).json() == {"status": "ok", "model": str(micro_rm)}
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, url


@pytest.fixture(scope="module")
def rm_server(micro_rm, tmp_path_factory):
    """serve-rm without flags on a free port; yields its base URL."""
    proc, url = _start_serve_rm(micro_rm, tmp_path_factory.mktemp("serve"), [])
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_reward_model_source(micro_rm):
    source = build_reward_source("model", path=micro_rm, device="cpu", batch_size=2)
    assert isinstance(source, RewardModelSource) and source.name == f"model:{micro_rm}"
    scores = source(PROMPTS, COMPLETIONS, [None] * 4)
    assert len(scores) == 4 and all(math.isfinite(s) for s in scores) and len(set(scores)) > 1
    ids = tokenize_prompt_completion(source.tokenizer, PROMPTS[0], COMPLETIONS[0], 256).input_ids
    with torch.no_grad():
        raw = source.model(input_ids=torch.tensor([ids])).logits.item()
    assert scores[0] == pytest.approx((raw - 0.25) / 2.0, abs=1e-5)  # normalised with the stored stats
    assert source([], [], []) == []
    with pytest.raises(RewardError, match="4 prompts, 3 completions"):
        source(PROMPTS, COMPLETIONS[:3], [None] * 4)


def test_http_source_against_serve_rm(rm_server, micro_rm):
    here = RewardModelSource(micro_rm, device="cpu", batch_size=2)(PROMPTS, COMPLETIONS, LABELS)
    remote = build_reward_source("http", url=f"{rm_server}/score", timeout_s=30, retries=0)
    assert remote.name == f"http:{rm_server}/score"
    assert remote(PROMPTS, COMPLETIONS, LABELS) == here  # same batches, same CPU kernels: same floats


@pytest.mark.parametrize("body,field", [
    (b"{not json", "body: malformed JSON"),
    (json.dumps({"completions": ["1"]}).encode(), "field 'prompts': missing"),
    (json.dumps({"prompts": ["1+1="]}).encode(), "field 'completions': missing"),
    (json.dumps({"prompts": ["1+1="], "completions": [2]}).encode(), "field 'completions': expected a list of str"),
    (json.dumps({"prompts": ["1+1=", "2+2="], "completions": ["2"]}).encode(),
     "field 'completions': 1 items, but 'prompts' has 2"),
    (json.dumps({"prompts": ["1+1="], "completions": ["2"], "labels": ["2", "4"]}).encode(),
     "field 'labels': 2 items, but 'prompts' has 1"),
])
def test_serve_rm_rejects_bad_requests(rm_server, body, field):
    reply = requests.post(f"{rm_server}/score", data=body, timeout=10,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and field in reply.json()["error"]


def test_serve_rm_4xx_is_not_retried(rm_server):
    source = HttpRewardSource(f"{rm_server}/nope", timeout_s=5, retries=3, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"HTTP 404 Not Found \(not retried\)") as err:
        source(PROMPTS, COMPLETIONS, LABELS)
    assert time.monotonic() - start < 5.0  # no backoff sleep happened
    assert "detail" not in str(err.value)  # FastAPI's 404 body ({"detail": "Not Found"}) is not quoted


def test_serve_rm_limits_apply_without_flags(rm_server):
    """No --max-items given: the default 4096 applies, so 4097 one-character samples get a 413."""
    body = {"prompts": ["1"] * 4097, "completions": ["2"] * 4097}
    reply = requests.post(f"{rm_server}/score", json=body, timeout=10)
    assert reply.status_code == 413
    assert reply.json()["error"] == ("field 'prompts': 4097 items, over this server's limit of 4096 per request "
                                     "(--max-items); send smaller batches")


TOKEN = "rm-token-5f0c2a9e"  # what the locked server reads from RM_TEST_TOKEN


@pytest.fixture(scope="module")
def locked_server(micro_rm, tmp_path_factory):
    """serve-rm with --token-env and small limits: 2000 bytes, 4 items per request."""
    run_dir = tmp_path_factory.mktemp("serve-locked")
    proc, url = _start_serve_rm(micro_rm, run_dir, ["--token-env", "RM_TEST_TOKEN", "--max-body-bytes", "2000",
                                                    "--max-items", "4"], {"RM_TEST_TOKEN": TOKEN})
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_rm_requires_its_token(locked_server, micro_rm, monkeypatch):
    body = {"prompts": PROMPTS, "completions": COMPLETIONS}
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        reply = requests.post(f"{locked_server}/score", json=body, headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer", headers
        assert "Authorization: Bearer <token>" in reply.json()["error"] and TOKEN not in reply.text
    assert requests.get(f"{locked_server}/health", timeout=10).status_code == 200  # probes need no token

    with pytest.raises(RewardError, match=r"HTTP 401 Unauthorized \(not retried\) \(check reward_token_env"):
        HttpRewardSource(f"{locked_server}/score", retries=3)(PROMPTS, COMPLETIONS, LABELS)
    monkeypatch.setenv("MY_RM_TOKEN", TOKEN)
    here = RewardModelSource(micro_rm, device="cpu", batch_size=2)(PROMPTS, COMPLETIONS, LABELS)
    remote = build_reward_source("http", url=f"{locked_server}/score", token_env="MY_RM_TOKEN", retries=0)
    assert remote(PROMPTS, COMPLETIONS, LABELS) == here
    shipped = pickle.dumps(remote)  # to another process: the token is re-read there from the env, never pickled
    assert TOKEN.encode() not in shipped and pickle.loads(shipped)(PROMPTS, COMPLETIONS, LABELS) == here
    monkeypatch.delenv("MY_RM_TOKEN")
    with pytest.raises(RewardError, match=r"environment variable MY_RM_TOKEN is not set"):
        HttpRewardSource(f"{locked_server}/score", token_env="MY_RM_TOKEN")


def test_serve_rm_rejects_oversized_bodies_and_batches(locked_server):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = json.dumps({"prompts": ["x" * 1000], "completions": ["y" * 1000]}).encode()
    assert len(big) == 14 + 1000 + 21 + 1000 + 3  # '{"prompts": ["', x..., '"], "completions": ["', y..., '"]}'
    reply = requests.post(f"{locked_server}/score", data=big, headers=auth, timeout=10)
    assert reply.status_code == 413
    assert reply.json()["error"] == "body: 2038 bytes, over this server's limit of 2000 (--max-body-bytes)"
    # no Content-Length (chunked): counted as it arrives
    reply = requests.post(f"{locked_server}/score", data=iter([big[:1500], big[1500:]]), headers=auth, timeout=10)
    assert reply.status_code == 413 and "over this server's limit of 2000 bytes" in reply.json()["error"]
    five = {"prompts": ["1+1="] * 5, "completions": ["2"] * 5}
    reply = requests.post(f"{locked_server}/score", json=five, headers=auth, timeout=10)
    assert reply.status_code == 413 and "'prompts': 5 items, over this server's limit of 4" in reply.json()["error"]
    four = {"prompts": ["1+1="] * 4, "completions": ["2"] * 4}
    assert len(requests.post(f"{locked_server}/score", json=four, headers=auth, timeout=10).json()["rewards"]) == 4


def test_serve_rm_refuses_to_start_without_its_token_variable(micro_rm):
    env = {k: v for k, v in os.environ.items() if k != "RM_UNSET_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "rlhf_core.rewards.server", "--model", str(micro_rm),
                          "--port", "0", "--token-env", "RM_UNSET_TOKEN"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--token-env RM_UNSET_TOKEN: environment variable RM_UNSET_TOKEN is not set" in out.stderr


# --------------------------------------------------------------------------------------
# HTTP failure modes against small stdlib servers
# --------------------------------------------------------------------------------------


class _Stub:
    """A local HTTP server whose handler is ``respond(call_number, n) -> (status, body_dict[, headers])``."""

    def __init__(self, respond, delay_s: float = 0.0):
        self.calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                stub.calls += 1
                n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"]
                time.sleep(delay_s)
                status, body, *headers = respond(stub.calls, len(n))
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    for name, value in (headers[0] if headers else {}).items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout) before we answered

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_http_server_down():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = HttpRewardSource(f"http://127.0.0.1:{port}/score", timeout_s=2, retries=2, backoff_s=0.01)
    with pytest.raises(RewardError) as err:
        source(PROMPTS, COMPLETIONS, LABELS)
    msg = str(err.value)
    assert f"127.0.0.1:{port}/score" in msg and "after 3 attempts" in msg and "connection failed" in msg


def test_http_timeout_is_honoured():
    """timeout 0.3 s x 2 attempts + 0.05 s backoff = 0.65 s; the server would take 2 s per call."""
    stub = _Stub(lambda call, n: (200, {"rewards": [0.0] * n}), delay_s=2.0)
    try:
        source = HttpRewardSource(stub.url, timeout_s=0.3, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"after 2 attempts; last error: timed out after 0\.3s"):
            source(PROMPTS, COMPLETIONS, LABELS)
        elapsed = time.monotonic() - start
        assert 0.6 <= elapsed < 0.3 * 2 + 0.05 + 0.8
        assert stub.calls == 2
    finally:
        stub.close()


def test_http_retries_503_then_succeeds():
    stub = _Stub(lambda call, n: (503, {"error": "warming up"}) if call <= 2 else (200, {"rewards": [0.5] * n}))
    try:
        source = HttpRewardSource(stub.url, timeout_s=5, retries=2, backoff_s=0.01)
        assert source(PROMPTS, COMPLETIONS, LABELS) == [0.5] * 4
        assert stub.calls == 3
    finally:
        stub.close()


def test_http_503_until_the_end_reports_the_last_error():
    stub = _Stub(lambda call, n: (503, {"error": "overloaded"}))
    try:
        with pytest.raises(RewardError, match=r"after 2 attempts; last error: HTTP 503: .*overloaded"):
            HttpRewardSource(stub.url, timeout_s=5, retries=1, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    finally:
        stub.close()


def test_http_429_waits_for_retry_after_then_succeeds():
    """429 + Retry-After: 1 on the first call: the client waits 1 s (not its 0.01 s backoff) and
    retries, though retries is 0 — a rate limit is not a failure."""
    stub = _Stub(lambda call, n: (429, {"error": "slow down"}, {"Retry-After": "1"}) if call == 1
                 else (200, {"rewards": [0.75] * n}))
    try:
        start = time.monotonic()
        assert HttpRewardSource(stub.url, timeout_s=5, retries=0, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS) \
            == [0.75] * 4
        elapsed = time.monotonic() - start
        assert stub.calls == 2 and 1.0 <= elapsed < 1.0 + 1.0, elapsed
    finally:
        stub.close()


def test_http_retry_after_past_the_deadline_fails_at_once():
    stub = _Stub(lambda call, n: (429, {"error": "come back in an hour"}, {"Retry-After": "3600"}))
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"gave up at the 5 s deadline \(reward_deadline_s\) after 1 attempts; "
                                              r"last error: HTTP 429 \(rate limited; Retry-After 3600\)"):
            HttpRewardSource(stub.url, timeout_s=5, deadline_s=5)(PROMPTS, COMPLETIONS, LABELS)
        assert time.monotonic() - start < 1.0 and stub.calls == 1
    finally:
        stub.close()


def test_http_deadline_bounds_a_server_that_always_503s():
    """retries=1000 would take minutes; the 1.5 s deadline ends the call: no wait is begun that
    would end past it, so the elapsed time is under the deadline plus one request's round trip."""
    stub = _Stub(lambda call, n: (503, {"error": "overloaded"}))
    try:
        source = HttpRewardSource(stub.url, timeout_s=5, retries=1000, backoff_s=0.05, backoff_cap_s=0.2,
                                  deadline_s=1.5)
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"gave up at the 1\.5 s deadline .*last error: HTTP 503: .*overloaded"):
            source(PROMPTS, COMPLETIONS, LABELS)
        elapsed = time.monotonic() - start
        assert elapsed < 1.5 + 0.5, elapsed  # slack: the last 503's round trip on a loaded machine
        assert stub.calls >= 5  # it did retry: the mean wait is at most 0.1 s
    finally:
        stub.close()


def test_backoff_is_full_jitter_under_the_cap():
    """backoff_s 1, cap 5: retry k waits uniform(0, min(5, 2**k)) — bounds 1, 2, 4, 5, 5. In 300
    draws the largest is above 0.9 x the bound unless chance is 0.9**300 ~ 2e-14."""
    source = HttpRewardSource("http://127.0.0.1:9/score", backoff_s=1.0, backoff_cap_s=5.0)
    state = random.getstate()
    for k, bound in enumerate([1.0, 2.0, 4.0, 5.0, 5.0]):
        draws = [source.backoff_s_before(k) for _ in range(300)]
        assert 0.0 <= min(draws) and max(draws) <= bound and max(draws) > 0.9 * bound, (k, max(draws))
    assert random.getstate() == state  # the global RNG, restored by checkpoints, is untouched


@pytest.mark.parametrize("body,expect", [({"rewards": [1.0, float("nan"), 0.0, 0.0]}, "NaN is not a JSON number"),
                                         ({"rewards": [1.0]}, "returned 1 rewards for 4 samples"),
                                         ({"scores": [1.0] * 4}, "reply has no 'rewards' field")])
def test_http_bad_replies(body, expect):
    stub = _Stub(lambda call, n: (200, body))
    try:
        with pytest.raises(RewardError, match=expect) as err:
            HttpRewardSource(stub.url, timeout_s=5, retries=2, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
        assert stub.url in str(err.value) and stub.calls == 1  # a malformed 200 is not retried
    finally:
        stub.close()


# --------------------------------------------------------------------------------------
# A whole RL stage against flaky and dead reward servers
# --------------------------------------------------------------------------------------


def _rl_cfg(micro_model, micro_data, tmp_path, url, **kw):
    from rlhf_core.config import RLConfig, build_config

    return build_config(RLConfig, "rl", {**{**{"model_path": str(micro_model),
                                               "prompts_file": str(micro_data["prompts"]),
                              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
                              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.kind": "http", "reward.url": url,
                              "max_steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 2,
                              "rollout.max_new_tokens": 4, "algorithm.mini_batch_size": 4,
                              "eval_items": 8, "eval_at_start": False, "num_threads": 1}, **kw}})


def test_rl_run_survives_a_server_that_fails_twice(micro_model, micro_data, tmp_path):
    """503, then a dropped connection, then answers: the RL stage finishes, scored by the server."""
    from rlhf_core.trainers.rl import train_rl

    def respond(call, n):
        if call == 1:
            return 503, {"error": "warming up"}
        if call == 2:
            return 500, {"error": "worker crashed"}
        return 200, {"rewards": [0.25] * n}

    stub = _Stub(respond)
    try:
        result = train_rl(_rl_cfg(micro_model, micro_data, tmp_path, stub.url, **{"reward.retries": 2},
                                  **{"reward.timeout_s": 5}), show_progress=False)
        assert stub.calls == 4  # 3 for iteration 1 (two failures, one answer) + 1 for iteration 2
        assert (result.output_dir / "model.safetensors").exists()
        assert result.metrics["rollout/reward_mean"] == pytest.approx(0.25)
    finally:
        stub.close()


def test_rl_run_against_a_dead_server_fails_within_timeout_times_attempts(micro_model, micro_data, tmp_path):
    """A server that never answers in time: the stage fails with the URL, the attempts and the
    timeout in the message, after about timeout x attempts, and writes no model."""
    from rlhf_core.trainers.rl import train_rl

    stub = _Stub(lambda call, n: (200, {"rewards": [0.0] * n}), delay_s=5.0)
    try:
        cfg = _rl_cfg(micro_model, micro_data, tmp_path, stub.url, **{"reward.retries": 1, "reward.timeout_s": 0.5})
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"127\.0\.0\.1:\d+/score.*after 2 attempts; last error: timed out "
                                              r"after 0\.5s"):
            train_rl(cfg, show_progress=False)
        elapsed_in_reward = time.monotonic() - start
        # 2 attempts x 0.5 s + 1 s backoff, plus model loading and one rollout (a few seconds at most)
        assert elapsed_in_reward < 0.5 * 2 + 1.0 + 15, elapsed_in_reward
        print(f"dead reward server: the stage failed after {elapsed_in_reward:.1f} s (2 attempts x 0.5 s + 1 s "
              f"backoff, plus model load and one rollout)")
        assert stub.calls == 2
        assert not (tmp_path / "rl").exists()
    finally:
        stub.close()
