"""A new user's first hour: in a project ``alignflow init`` made, every mistake ends in one clear error.

Each case runs the real ``alignflow`` in a fresh process and checks the error as the user reads it: printed
once, at most 5 lines and 400 characters, naming its source (the command line, the params file, or the
data file with line and field) and what to do, no traceback unless ``--debug``, a non-zero exit. The flow
cases check that a config mistake is caught before Prefect starts; bad data found inside a flow, reported
once and not again by Prefect's own failure logs, is test_flow.py's slow CLI test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, one_error, run_cli

GOOD_SFT = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(6) for b in range(5)]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project as ``alignflow init`` makes it (no data, no model), plus an SFT file of the user's own."""
    root = tmp_path_factory.mktemp("first-hour") / "my-project"
    env = cli_env(root.parent)
    env.pop("ALIGNFLOW_HOME")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "init", str(root)], cwd=root.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD_SFT))
    return root


def test_a_mistyped_stage_override_names_the_command_line_and_the_closest_field(project):
    proc = run_cli(["sft", "--set", "max_step=5"], project)
    block = one_error(proc, 2, "command line (--set)", "sft.max_step", "did you mean sft.max_steps?")
    assert "params.yaml" not in block and proc.stderr.strip() == block


def test_a_stage_takes_its_own_section_prefix_and_refuses_another(project):
    # sft.max_steps is sft's own field: the command gets past its config to the missing eval set
    proc = run_cli(["sft", "--set", "sft.max_steps=5", "--set", "train_file=data/sft.jsonl"], project)
    one_error(proc, 2, "sft.eval_file")
    proc = run_cli(["sft", "--set", "dpo.beta=0.2"], project)
    one_error(proc, 2, "command line (--set)", "dpo.beta", "alignflow flow align --set dpo.FIELD=VALUE")


def test_a_typo_in_a_params_file_names_that_file(project):
    params = project / "typo.yaml"
    params.write_text("sft:\n  max_step: 10\n")
    one_error(run_cli(["sft", "--params", "typo.yaml"], project), 2,
              "typo.yaml: sft.max_step: unknown field; did you mean sft.max_steps?")


def test_debug_adds_the_traceback(project):
    proc = run_cli(["sft", "--set", "max_step=5", "--debug"], project)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.rstrip().endswith("error: command line (--set): sft.max_step: unknown field; "
                                          "did you mean sft.max_steps?")


def test_a_fresh_project_names_each_missing_input_and_the_command_that_makes_it(project):
    one_error(run_cli(["sft", "--set", "train_file=data/sft.jsonl"], project), 2,
              "sft.eval_file: data/embedded/eval.jsonl: file not found", "(value from the default)",
              "`alignflow generate`", "--set eval_file=PATH")
    one_error(run_cli(["sft", "--set", "train_file=data/sft.jsonl", "--set", "eval_file=data/sft.jsonl"], project),
              2, "sft.model_path: models/base: folder not found", "`alignflow init-model`",
              "--set model_path=PATH names a Hugging Face model folder")
    one_error(run_cli(["init-model"], project), 2, "model.corpus_file: data/embedded/sft.jsonl: file not found",
              "`alignflow generate`", "--set corpus_file=PATH")


def test_a_flow_config_typo_is_caught_before_prefect_starts(project):
    proc = run_cli(["flow", "align", "--set", "sft.max_step=5"], project)
    block = one_error(proc, 2, "command line (--set)", "did you mean sft.max_steps?")
    assert proc.stderr.strip() == block  # no Prefect server started, no flow run, nothing else
    one_error(run_cli(["flow", "align", "--set", "sftt.max_steps=5"], project), 2, "did you mean sft?")
    one_error(run_cli(["flow", "align", "--sft-file", "data/nothere.jsonl"], project), 2,
              "--sft-file: data/nothere.jsonl: not found")
