"""README's "Use it on your own model and data" block, run as written in a project of a user's own.

The own-data bash blocks of that section (validate four files, ``dvc add``, commit, ``flow align`` with a
base model and a registry name of one's own, fetch the registered model) run line by line through a
shell in an ``alignflow init`` project whose ``params.yaml`` is set to micro sizes; the only words
replaced are the placeholder ``/path/to/hf-model`` (a micro model folder). Then: the flow's summary
prints the fetch command (``fetch it:``) with the alias the registry holds, the fetched folder is a
model, and the SFT model is registered under the user's name (``my-policy-sft``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, write_micro_params

pytestmark = pytest.mark.slow  # one micro flow (SFT, evaluations, DPO) and its fetch: about 2 minutes

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The commands of the own-data blocks (validate and version, then the flow and the fetch: the README
    splits them in two, the second marked ``slow``), continuation lines joined."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("Then swap in your own model and data"):]
    section = section[:section.index("```", section.index("mlflow artifacts download"))]
    blocks = re.findall(r"```bash[^\n]*\n(.*?)(?:```|\Z)", section, re.DOTALL)
    joined = re.sub(r"\\\n\s*", "", "".join(blocks))
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def test_readme_block_names_what_this_test_replaces():
    commands = readme_commands()
    assert any(c.startswith("alignflow flow align --base-model /path/to/hf-model") for c in commands), commands
    assert commands[-1].startswith("mlflow artifacts download"), commands


def test_readme_own_data_block_runs_as_written(tmp_path, micro_model, micro_data):
    env = cli_env(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("PREFECT_API_URL", None)
    env.update(GIT_AUTHOR_NAME="u", GIT_AUTHOR_EMAIL="u@u", GIT_COMMITTER_NAME="u", GIT_COMMITTER_EMAIL="u@u")
    init = subprocess.run(["alignflow", "init", "my-project"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr[-2000:]
    project = tmp_path / "my-project"
    env.update(ALIGNFLOW_HOME=str(project), MLFLOW_TRACKING_URI=f"sqlite:///{project / 'mlflow.db'}",
               PREFECT_HOME=str(project / ".prefect"))
    write_micro_params(project)
    subprocess.run(["git", "commit", "-qam", "micro sizes"], cwd=project, env=env, check=True)
    for name, mine in (("sft", "my_sft"), ("preferences", "my_prefs"), ("prompts", "my_prompts"), ("eval", "my_eval")):
        shutil.copy(micro_data[name], project / "data" / f"{mine}.jsonl")
    outputs = []
    for command in readme_commands():
        command = command.replace("/path/to/hf-model", str(micro_model))
        proc = subprocess.run(["bash", "-c", command], cwd=project, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])
        outputs.append(proc.stdout)
    summary = next(out for out in outputs if "fetch it:" in out)
    fetch = next(line for line in summary.splitlines() if line.startswith("fetch it:"))
    assert "models:/my-policy@candidate" in fetch or "models:/my-policy@champion" in fetch, fetch
    assert "registered SFT:  my-policy-sft" in summary, summary
    fetched = project / "my-policy-candidate"
    assert any(p.name == "config.json" for p in fetched.rglob("*")), sorted(map(str, fetched.rglob("*")))[:20]
