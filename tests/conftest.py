"""Shared fixtures: a micro embedded world (datasets, tokenizer, tiny models) built once per session.

Everything is real: the tokenizer is trained (in a subprocess), the models are stock
transformers classes saved with ``save_pretrained``, MLflow writes to a sqlite file, Prefect
runs against a temporary server. Only sizes are micro, so the suite stays within minutes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

import rlhf_core  # noqa: F401  (offline switches)

# A Prefect home of the test session's own (results, local DB), set before Prefect is
# imported: cached task results of a user's runs must never leak into tests, or back.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="alignflow-prefect-")
# Prefect 3 keeps persisted task results under PREFECT_LOCAL_STORAGE_PATH (~/.prefect/storage),
# not under PREFECT_HOME: move them into the test session's home too.
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = os.path.join(os.environ["PREFECT_HOME"], "storage")

REPO = Path(__file__).resolve().parents[1]

# Property tests of the input boundaries (tests/unit/boundaries): a fixed seed and 200 examples a
# test in `make test`; the slow tier's long run (tests/e2e/test_boundaries_long_slow.py) picks the
# `long` profile. No deadline: a 2-core CI machine's timing noise must not fail an example; the
# bounds that matter (a template's time limit, a server's deadline) are asserted by the tests.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("default", max_examples=200, derandomize=True, deadline=None, print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", parent=settings.get_profile("default"), max_examples=2000, derandomize=False)
settings.load_profile(os.environ.get("ALIGNFLOW_HYPOTHESIS_PROFILE", "default"))

MICRO_GEN = dict(seed=7, n_sft=600, n_preference=100, n_prompts=100, n_eval=100, sft_noise=0.2)
MICRO_MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                   max_positions=64, seed=0)


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory) -> dict[str, Path]:
    """The embedded task's four datasets at micro size."""
    from rlhf_core.embedded.tasks import generate_datasets

    return generate_datasets(tmp_path_factory.mktemp("data"), **MICRO_GEN)


@pytest.fixture(scope="session")
def micro_tokenizer(tmp_path_factory, micro_data) -> Path:
    """A byte-level BPE tokenizer trained on the micro SFT corpus."""
    import json

    from rlhf_core.embedded.tiny_model import train_tokenizer

    texts = [json.loads(line)["prompt"] + json.loads(line)["completion"]
             for line in micro_data["sft"].read_text().splitlines()]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer", vocab_size=280)


@pytest.fixture(scope="session")
def length_reward(tmp_path_factory) -> str:
    """A dense reward file for RL tests on the untrained micro model: the answer's length / 10, so the samples of
    one prompt differ (the embedded rule reward is almost always 0 on it)."""
    path = tmp_path_factory.mktemp("rewards") / "length_reward.py"
    path.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    return f"{path}:reward"


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory, micro_tokenizer) -> Path:
    """A micro Qwen2 model directory (no chat template: the plain template is used)."""
    from rlhf_core.embedded.tiny_model import build_tiny_model

    return build_tiny_model(micro_tokenizer, tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2", **MICRO_MODEL)


def recomputed_logprobs(model, batch, temperature: float = 1.0):
    """The trainer's ``(B, R)`` log-probs of ``batch``'s response tokens (a :class:`rlhf_core.rollout.engine.RolloutBatch`),
    recomputed from its sequences as the learner scores them, to compare with the engine's sampling log-probs."""
    import torch

    from rlhf_core.trainers.rl_forward import token_logprobs

    exp = batch.learner_inputs()
    with torch.no_grad():
        return token_logprobs(model, exp, batch.prompt_ids.shape[1], temperature)[0]


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, micro_tokenizer) -> Path:
    """A micro Qwen2 with the tool task's tags as tokens; ``</calc>`` sampled about half the time at T = 1 and
    the greedy first token.

    Every embedding gets 4.0 in dimension 0 (``</calc>``'s 4.8), which dominates the residual stream, so
    the final hidden state points along dimension 0 and ``</calc>``'s logit leads every other by a margin
    of the order of log(vocab)."""
    import torch

    from rlhf_core.embedded.tiny_model import build_tiny_model
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rollout.tool_task import TAGS

    out = build_tiny_model(micro_tokenizer, tmp_path_factory.mktemp("tool") / "model", added_tokens=TAGS,
                           **MICRO_MODEL)
    model, tokenizer = load_causal_lm(out), load_tokenizer(out)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 4.0
        emb[tokenizer.convert_tokens_to_ids("</calc>"), 0] = 4.8
    model.save_pretrained(str(out), safe_serialization=True)
    return out


LLAMA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def llama_chat_model(tmp_path_factory, micro_tokenizer) -> Path:
    """A differently shaped model: Llama, 3 layers, its own chat template (a 'user' model)."""
    from rlhf_core.embedded.tiny_model import build_tiny_model

    return build_tiny_model(micro_tokenizer, tmp_path_factory.mktemp("models") / "llama", arch="llama",
                            hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=96,
                            max_positions=96, seed=1, chat_template=LLAMA_CHAT_TEMPLATE)


@pytest.fixture()
def isolated_project(tmp_path, monkeypatch) -> Path:
    """A fresh project root: MLflow sqlite store and artifacts under ``tmp_path``."""
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def prefect_server():
    """A real temporary Prefect server (SQLite) for flow tests."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium, installed (apt-get) when absent; fails, never skips, when it can't be."""
    import shutil
    import subprocess

    found = shutil.which("chromium")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, text=True, env=env)
    if install.returncode != 0:  # a fresh machine may need its package lists first
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
        install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, text=True,
                                 env=env)
    found = shutil.which("chromium")
    if not found:
        pytest.fail(f"chromium is needed for the MLflow UI test and could not be installed:\n{install.stderr[-2000:]}")
    return found


def stop_after(step: str, train, cfg, monkeypatch) -> None:
    """Run ``train(cfg)`` until the fault hook fires after ``step`` (``ALIGNFLOW_FAULT``, e.g. ``"sft:9"``),
    as a killed run would stop, leaving its checkpoints; the hook is unset again afterwards."""
    from rlhf_core.common.faults import InjectedFault

    monkeypatch.setenv("ALIGNFLOW_FAULT", step)
    with pytest.raises(InjectedFault):
        train(cfg, show_progress=False)
    monkeypatch.delenv("ALIGNFLOW_FAULT")


class Recorder:
    """A real MetricSink for tiny-model tests: keeps every metric row and rollout table, as MLflow would."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []
        self.tables: list[tuple[str, list]] = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def log_table(self, rows, name):
        self.tables.append((name, rows))

    def series(self, name):
        return [m[name] for _, m in self.rows if name in m]

    def steps(self, name):
        return [s for s, m in self.rows if name in m]


@pytest.fixture(scope="session")
def make_micro_rm(micro_model, tmp_path_factory):
    """Build an (untrained) micro reward model directory with the given normalisation statistics."""

    def make(mean: float, std: float) -> Path:
        import torch

        from rlhf_core.models.loading import load_tokenizer
        from rlhf_core.rewards.model import load_reward_model, set_normalisation

        torch.manual_seed(0)
        out = tmp_path_factory.mktemp("rm") / "rm"
        rm = load_reward_model(micro_model, torch.device("cpu"))
        set_normalisation(rm, mean=mean, std=std)
        rm.save_pretrained(out)
        load_tokenizer(micro_model).save_pretrained(out)
        return out

    return make


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _team_folder():
    """A folder in /tmp every user can search, for the team services' data: under root, PostgreSQL runs as user
    postgres, which must reach its data folder (pytest's own tmp_path is root's alone)."""
    import shutil

    base = Path(tempfile.mkdtemp(prefix="alignflow-team-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture()
def team_base():
    """:func:`_team_folder` for one test."""
    yield from _team_folder()


@pytest.fixture(scope="module")
def team_base_module():
    """:func:`_team_folder` for a test module whose tests share one set of team services."""
    yield from _team_folder()


@pytest.fixture()
def prefect_api(tmp_path):
    """A `prefect server start` of the test's own (its own PREFECT_HOME and SQLite database),
    for flows run as separate processes (a deployment's runs, two flows at once)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-server"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "true", "PREFECT_UI_ENABLED": "false"}
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"

    def healthy():
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        deadline = time.time() + 120
        while not healthy():
            assert time.time() < deadline and server.poll() is None, "prefect server start did not come up in 120 s"
            time.sleep(1.0)
        yield api
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for one test module (never a cluster a developer's RAY_ADDRESS names)."""
    import ray

    from rlhf_core.trainers.ray_launcher import connect

    saved = os.environ.pop("RAY_ADDRESS", None)
    connect(min_cpus=8)
    yield ray
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


@pytest.fixture(scope="module")
def bench():
    """``bench/side_by_side.py``'s modules (the package ``bench/side_by_side_parts``, importable with bench/ on
    ``sys.path``, as the script has it): ``bench.measure``, ``bench.results``."""
    import importlib
    import types

    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    return types.SimpleNamespace(**{name: importlib.import_module(f"side_by_side_parts.{name}")
                                    for name in ("measure", "results")})


# What the scripted tool environment (fixture ``scripted_env``) answers every call with.
TOOL_OBSERVATION = "<result>7</result>"


@pytest.fixture(scope="module")
def scripted_env(tmp_path_factory) -> str:
    """A tool environment (``file.py:make_env``) answering every call with ``TOOL_OBSERVATION``, counting its steps."""
    path = tmp_path_factory.mktemp("env") / "env.py"
    path.write_text("from rlhf_core.rollout.environments import StepResult\n\n"
                    "class Env:\n    stop_tokens = ('</calc>',)\n"
                    "    def reset(self, prompt, label):\n        self.steps = 0\n"
                    "    def step(self, action):\n        self.steps += 1\n"
                    f"        return StepResult({TOOL_OBSERVATION!r})\n\n"
                    "def make_env():\n    return Env()\n")
    return f"{path}:make_env"
