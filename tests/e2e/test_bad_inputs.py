"""A corpus of bad inputs at every entry point: each stops the command with one clear error naming
the source (file, line, field or sample; at most 5 lines and 400 characters, printed once), a non-zero
exit, and leaves nothing behind.

Entry points: data files (through the training commands, which run the GX gate first), params
and ``--set`` overrides, model directories, reward files and reward-server replies. Every case
runs the real ``alignflow`` command line in-process against a micro project and then checks
that no model directory, checkpoint, registered model or finished MLflow run exists.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.cli import main
from rlhf_core.data.validate import ValidationFailed

GOOD_PAIR = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
GOOD_SFT = {"prompt": "1+1=", "completion": "2"}


def _jsonl(*rows: dict | str) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


@dataclass
class Case:
    """argv template ({bad} is the bad file's path, {model}/{data:<name>} the micro fixtures), the
    bad file's content (or None), and a regex the error must match."""

    argv: list[str]
    content: bytes | None
    expect: str
    suffix: str = ".jsonl"


def dpo(content: bytes, expect: str) -> Case:
    return Case(["dpo", "--set", "train_file={bad}"], content, expect)


def rl_reward(code: str, expect: str) -> Case:
    return Case(["rl", "--set", "reward.function={bad}:reward"], code.encode(), expect, suffix=".py")


CASES: dict[str, Case] = {
    # ---- data files -----------------------------------------------------------------------
    "malformed_jsonl": dpo(_jsonl(GOOD_PAIR, '{"prompt": "2+2=", "chosen": "4"'), r"bad\.jsonl:2: not valid JSON"),
    "wrong_type": dpo(_jsonl(GOOD_PAIR, {**GOOD_PAIR, "prompt": "2+2=", "chosen": 4}),
                      r"bad\.jsonl:2: field 'chosen'"),
    "missing_field": dpo(_jsonl(GOOD_PAIR, {"prompt": "2+2=", "chosen": "4"}), r"bad\.jsonl:2: field 'rejected'"),
    "whitespace_text": dpo(_jsonl(GOOD_PAIR, {**GOOD_PAIR, "prompt": "2+2=", "chosen": "   "}),
                           r"bad\.jsonl:2: field 'chosen'"),
    "non_utf8": dpo(_jsonl(GOOD_PAIR) + b'{"prompt": "\xff\xfe", "chosen": "a", "rejected": "b"}\n',
                    r"bad\.jsonl:2: not UTF-8 text \(byte 0xff"),
    "nan_margin": dpo(_jsonl(GOOD_PAIR, '{"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": NaN}'),
                      r"bad\.jsonl:2: field 'margin'"),
    "inf_margin": dpo(_jsonl(GOOD_PAIR, '{"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": Infinity}'),
                      r"bad\.jsonl:2: field 'margin'"),
    "chosen_equals_rejected": dpo(_jsonl(GOOD_PAIR, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}),
                                  r"bad\.jsonl:2: field 'chosen': 'chosen' equals 'rejected'"),
    "over_long_record": dpo(_jsonl(GOOD_PAIR, {**GOOD_PAIR, "prompt": "2+2=", "chosen": "4" * 30000}),
                            r"bad\.jsonl:2: field 'chosen': length outside"),
    "empty_dataset": dpo(b"", r"bad\.jsonl: field '\*': dataset has no rows"),
    "blank_lines_only": dpo(b"\n  \n\n", r"bad\.jsonl: field '\*': dataset has no rows"),
    "not_an_object": Case(["sft", "--set", "train_file={bad}"], _jsonl(GOOD_SFT, "[1, 2]"),
                          r"bad\.jsonl:2: expected a JSON object, got list"),
    "sft_missing_completion": Case(["sft", "--set", "train_file={bad}"], _jsonl(GOOD_SFT, {"prompt": "2+2="}),
                                   r"bad\.jsonl:2: field 'completion'"),
    "prompts_nan_label": Case(["rl", "--set", "prompts_file={bad}"],
                              _jsonl({"prompt": "1+1=", "label": "2"}, '{"prompt": "2+2=", "label": NaN}'),
                              r"bad\.jsonl:2: field 'label'"),
    "unsupported_format": Case(["sft", "--set", "train_file={bad}"], b"prompt,completion\n1+1=,2\n",
                               r"bad\.csv: unsupported dataset format '\.csv'", suffix=".csv"),
    # ---- params and the command line -------------------------------------------------------
    "unknown_override": Case(["sft", "--set", "learning_rate=0.1"], None, r"sft\.learning_rate: unknown field"),
    "mistyped_override": Case(["sft", "--set", "max_steps=many"], None, r"sft\.max_steps"),
    "out_of_range_override": Case(["dpo", "--set", "beta=-1"], None, r"dpo\.beta: must be > 0"),
    "nan_override": Case(["sft", "--set", "lr=nan"], None, r"sft\.lr"),
    "broken_params_yaml": Case(["sft", "--params", "{bad}"], b"sft:\n  lr: [0.1\n", r"bad\.yaml: line \d+: not valid YAML",
                               suffix=".yaml"),
    "extra_params_field": Case(["sft", "--params", "{bad}"], b"sft:\n  max_step: 10\n", r"bad\.yaml: sft\.max_step: unknown field",
                               suffix=".yaml"),
    "resume_without_checkpoint": Case(["sft", "--resume"], None, r"sft: --resume: no checkpoint of this run"),
    # ---- model directories ----------------------------------------------------------------
    "model_dir_without_weights": Case(["sft", "--set", "model_path={nomodel}"], None, r"nomodel.*(weights|safetensors)"),
    "model_dir_missing": Case(["dpo", "--set", "model_path={missing}"], None, r"missing-model"),
    # ---- reward files -----------------------------------------------------------------------
    "reward_raises": rl_reward("def reward(prompts, completions, labels):\n    raise KeyError('answer')\n",
                               r"reward function reward in \S*bad\.py.*KeyError"),
    "reward_wrong_length": rl_reward("def reward(prompts, completions, labels):\n    return [0.0]\n",
                                     r"bad\.py.*returned 1 rewards? for \d+ samples"),
    "reward_nan": rl_reward("def reward(prompts, completions, labels):\n    return [float('nan')] * len(prompts)\n",
                            r"bad\.py.*sample 0: reward nan is not finite"),
    "reward_function_missing": Case(["rl", "--set", "reward.function={bad}:score"],
                                    b"def reward(p, c, l):\n    return []\n",
                                    r"bad\.py.*score", suffix=".py"),
    # ---- reward-server replies ----------------------------------------------------------------
    "server_wrong_length": Case(["rl", "--set", "reward.kind=http", "--set", "reward.url={url}"], None,
                                r"127\.0\.0\.1:\d+/score.*returned 1 rewards for \d+ samples"),
    "server_not_json": Case(["rl", "--set", "reward.kind=http", "--set", "reward.url={url_html}"], None,
                            r"127\.0\.0\.1:\d+/html.*not JSON"),
}


class _BadServer:
    """Answers /score with one reward whatever the batch, and /html with an HTML page."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/html":
                    body, ctype = b"<html>busy</html>", "text/html"
                else:
                    body, ctype = json.dumps({"rewards": [0.5]}).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def bad_server():
    server = _BadServer()
    yield server
    server.server.shutdown()


@pytest.fixture()
def project(isolated_project, micro_model, micro_data):
    """A project whose params point every stage at the micro model and data, sized to stop fast."""
    import yaml

    common = {"model_path": str(micro_model), "eval_file": str(micro_data["eval"]), "max_steps": 2,
              "eval_items": 8, "num_threads": 1}
    params = {
        "sft": {**common, "train_file": str(micro_data["sft"]), "batch_size": 8},
        "dpo": {**common, "train_file": str(micro_data["preferences"]), "batch_size": 8},
        "rl": {**common, "prompts_file": str(micro_data["prompts"]), "rollout.prompts_per_step": 2,
               "rollout.group_size": 2,
               "algorithm.mini_batch_size": 4, "rollout.max_new_tokens": 4, "eval_at_start": False},
        "tracking": {"experiment": "bad-inputs"},
    }
    (isolated_project / "params.yaml").write_text(yaml.safe_dump(params))
    return isolated_project


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_its_source(name, project, bad_server, micro_model, capsys):
    case = CASES[name]
    bad = project / f"bad{case.suffix}"
    if case.content is not None:
        bad.write_bytes(case.content)
    nomodel = project / "nomodel"  # config and tokenizer, but the weights file is gone
    shutil.copytree(micro_model, nomodel, ignore=shutil.ignore_patterns("*.safetensors"))
    subst = {"bad": bad, "nomodel": nomodel, "missing": project / "missing-model",
             "url": f"{bad_server.base}/score", "url_html": f"{bad_server.base}/html"}
    argv = [a.format(**subst) for a in case.argv]
    if argv[0] == "rl" and "reward.function" not in " ".join(argv):
        reward = project / "ok_reward.py"
        reward.write_text("def reward(prompts, completions, labels):\n    return [0.0] * len(prompts)\n")
        argv += ["--set", f"reward.function={reward}:reward"]
    if argv[0] == "rl" and "reward.kind=http" in argv:
        argv += ["--set", "reward.retries=0", "--set", "reward.timeout_s=5"]

    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0, err
    assert re.search(case.expect, err, flags=re.S), f"{name}: {err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    block = err[err.rindex("error: "):].strip()  # the one error: bounded, printed once
    assert len(block.splitlines()) <= 5 and len(block) <= 400 and err.count(block.splitlines()[0]) == 1, block

    # nothing behind: no model, no checkpoint, no registration, no finished run
    stage = argv[0]
    assert not (project / "models" / stage).exists()
    assert not list((project / "checkpoints").glob(f"{stage}/step-*"))
    if (project / "mlflow.db").exists():
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
        assert not client.search_registered_models()
        exp = client.get_experiment_by_name("bad-inputs")
        if exp is not None:
            assert all(r.info.status != "FINISHED" for r in client.search_runs([exp.experiment_id]))


def test_corpus_is_at_least_twenty_distinct_inputs():
    assert len(CASES) >= 20
    assert len({(tuple(c.argv), c.content, c.expect) for c in CASES.values()}) == len(CASES)


def test_gate_validates_a_file_once_per_content(isolated_project, micro_data, monkeypatch):
    """A passed file is remembered by content (+ kind, fields, validator code): the next stage that
    reads it does not run GX again; the same path with other content is validated afresh."""
    from rlhf_core.stages import gate
    from rlhf_core.config import DPOConfig
    from rlhf_core.data import validate as validator

    calls = []
    real = validator.validate_dataset
    monkeypatch.setattr(validator, "validate_dataset", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    data = isolated_project / "prefs.jsonl"
    data.write_bytes(micro_data["preferences"].read_bytes())
    cfg = DPOConfig(train_file=str(data))
    gate.gate_datasets(cfg, {"preferences": (str(data), "training")})
    gate.gate_datasets(cfg, {"preferences": (str(data), "training")})
    assert calls == [str(data)]
    data.write_bytes(data.read_bytes() + _jsonl({"prompt": "9+9=", "chosen": "18", "rejected": "18"}))
    with pytest.raises(ValidationFailed, match=r"prefs\.jsonl:\d+: field 'chosen': 'chosen' equals 'rejected'"):
        gate.gate_datasets(cfg, {"preferences": (str(data), "training")})
    assert len(calls) == 2
