"""DVC sees a code change: editing a core module a trainer imports marks every stage that runs it as changed.

``dvc.yaml``'s source deps are derived by ``alignflow dvc-stages`` (flows/dvc_stages.py); this runs real DVC in a copy of the
project (the committed dvc.yaml and dvc.lock), without training anything: no ``dvc repro``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import cli_env, copy_project

# rlhf_core/models/lm_head.py: the fused LM head every trainer's loss runs through (via losses, logprobs, models),
# and one of the modules the hand-written deps had left out.
EDITED = "rlhf_core/models/lm_head.py"
SFT_AND_DOWNSTREAM = {"sft", "reward", "dpo", "kto", "rejection", "raft", "distill", "rl"}
# Not evaluate: its greedy answers come from transformers' generate and never import the LM head (its deps
# say so); it reruns when sft's model, one of its inputs, changes.


def _record_sources_as_built(project) -> None:
    """Record the copy's current source files in its dvc.lock, as a ``dvc repro`` would have, so that the
    baseline is clean whether or not the committed lock predates the derived deps. Data and models are
    absent from the copy; their entries keep the committed lock's hashes (``allow_missing``)."""
    from dvc.repo import Repo

    with Repo(str(project)) as repo, repo.lock:
        by_file: dict = {}  # the checkout's dvc.yaml and the real recipe's own (recipes/real/dvc.yaml)
        for stage in repo.index.stages:
            stage.save(allow_missing=True, run_cache=False)
            by_file.setdefault(stage.dvcfile.path, (stage.dvcfile, []))[1].append(stage)
        for dvcfile, stages in by_file.values():
            dvcfile.dump_stages(stages, update_pipeline=False)


def _stages_with_changed(project, path: str) -> set[str]:
    """Stages whose ``dvc status --json`` lists ``path`` among their changed deps."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=project, env=cli_env(project),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout)
    return {stage for stage, changes in status.items() for change in changes
            if isinstance(change, dict) and path in change.get("changed deps", {})}


def test_editing_a_core_module_marks_sft_and_its_downstream_stages_changed(tmp_path):
    project = copy_project(tmp_path / "project", lock=True, micro=False)
    _record_sources_as_built(project)
    assert _stages_with_changed(project, EDITED) == set()  # the baseline: nothing to rerun for this file

    with open(project / EDITED, "a", encoding="utf-8") as f:
        f.write("# an edit\n")
    changed = _stages_with_changed(project, EDITED)

    assert SFT_AND_DOWNSTREAM <= changed
    assert {"tool_sft", "tool_rl"} <= changed  # the tool task's trainers run the same core
    assert {"recipes/real/dvc.yaml:real_sft", "recipes/real/dvc.yaml:real_rl"} <= changed  # and the real recipe's
