"""dvc.yaml is the one ``alignflow dvc-stages`` (flows/dvc_stages.py) writes from the stage registry, the
project template's too, and the source deps it derives follow what a stage runs: lazy imports included,
other stages' code not.

``tests/e2e/test_dvc_code_deps.py`` shows the effect in real DVC: an edit to a core module marks the
stages that run it as changed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from flows import dvc_stages as dvc_deps
from rlhf_core.config import stage_registry as registry
from rlhf_core.config.stage_registry import DvcStage


def _derived(root=REPO) -> dict[str, list[str]]:
    return dvc_deps.stage_code_deps(dvc_deps.SourceIndex(root), registry.dvc_stages())


def test_committed_dvc_yaml_is_the_generated_one():
    diff = dvc_deps.check(REPO)
    assert not diff, f"dvc.yaml or the template's is stale: run `alignflow dvc-stages --write`\n{diff}"


def test_dvc_yaml_holds_every_registered_dvc_stage_in_order():
    files = {stage.file for stage in registry.dvc_stages()}
    assert "dvc.yaml" in files and len(files) > 1  # the checkout's and the real recipe's own
    for file in files:
        committed = yaml.safe_load((REPO / file).read_text())["stages"]
        assert list(committed) == [stage.name for stage in registry.dvc_stages() if stage.file == file], file
    template = yaml.safe_load((REPO / dvc_deps.TEMPLATE_DVC_YAML).read_text())["stages"]
    assert list(template) == [stage.name for stage in registry.dvc_stages() if stage.in_template]


def test_the_script_is_the_command():
    for argv in (["scripts/dvc_deps.py", "--check"], ["-m", "flows.cli", "dvc-stages", "--check"]):
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_derived_deps_hold_what_the_stages_run():
    derived = _derived()
    # the modules the hand-written list had left out of sft, its trainer, and config.py (its defaults)
    assert {"rlhf_core/models/lm_head.py", "rlhf_core/models/precision.py", "rlhf_core/models/loading.py", "rlhf_core/models/attention.py",
            "rlhf_core/config/training.py", "rlhf_core/trainers/sft.py", "flows/cli.py"} <= set(derived["sft"])
    # another stage's trainer and the Prefect flows: the dispatch modules are read by calls
    assert not {"rlhf_core/trainers/dpo.py", "rlhf_core/trainers/kto.py", "flows/align.py"} & set(derived["sft"])
    # code the params name by path: rl's default reward function, tool_rl's reward and environment
    assert "rlhf_core/embedded/reward.py" in derived["rl"]
    assert "rlhf_core/rollout/tool_task.py" in derived["tool_rl"]
    # every stage depends on every config file: the defaults DVC's params hash does not see
    config_files = {p.relative_to(REPO).as_posix() for p in (REPO / "rlhf_core" / "config").glob("*.py")}
    assert all(config_files <= set(files) for files in derived.values())


def test_an_import_added_without_regenerating_fails_the_check(tmp_path):
    for package in ("rlhf_core", "flows", "tasks"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(REPO / name, tmp_path / name)

    def generate_deps() -> list[str]:
        return yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]["generate"]["deps"]

    assert "rlhf_core/tracking/plots.py" not in generate_deps()
    with open(tmp_path / "rlhf_core" / "embedded" / "tasks.py", "a", encoding="utf-8") as f:  # a lazy import
        f.write("\n\ndef _lazy():\n    from rlhf_core.tracking import plots  # noqa: F401\n")

    assert "+      - rlhf_core/tracking/plots.py" in dvc_deps.check(tmp_path)
    assert dvc_deps.main(["--write", "--root", str(tmp_path)]) == 0
    assert "rlhf_core/tracking/plots.py" in generate_deps()
    assert dvc_deps.check(tmp_path) == ""


def _toy(root, files: dict[str, str]):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return dvc_deps.SourceIndex(root)


TOY = {
    "rlhf_core/__init__.py": "from rlhf_core.common import offline as env\n",
    "rlhf_core/common/__init__.py": "",
    "rlhf_core/common/offline.py": "",
    "rlhf_core/config/__init__.py": "from rlhf_core.config import sections\n",
    "rlhf_core/config/sections.py": "",
    "rlhf_core/config/rl.py": "",
    "rlhf_core/stages/__init__.py": "",
    "rlhf_core/lazy.py": "",
    "rlhf_core/deep.py": "",
    "rlhf_core/stages/wrappers.py": ("from rlhf_core import config\nfrom rlhf_core.trainers import dpo\n\n"
                            "def sft():\n    from rlhf_core.trainers import sft\n    config.sections\n"
                            "    return _helper()\n\n"
                            "def _helper():\n    from rlhf_core import lazy\n\n"
                            "def dpo_stage():\n    return dpo.train()\n"),
    "rlhf_core/trainers/__init__.py": "",
    "rlhf_core/trainers/sft.py": "def train():\n    from rlhf_core import deep\n",
    "rlhf_core/trainers/dpo.py": "",
    "flows/__init__.py": "",
    "flows/align.py": "",
    "flows/cli.py": ("import rlhf_core\n\n"
                     "def cmd_sft(args):\n    from rlhf_core.stages import wrappers as stages\n    return stages.sft()\n\n"
                     "def cmd_flow(args):\n    from flows import align\n\n"
                     "def main():\n    return {'sft': cmd_sft, 'flow': cmd_flow}\n"),
}


def test_closure_follows_lazy_imports_and_calls_not_other_handlers(tmp_path):
    """`alignflow sft` runs cli.main and cmd_sft, stages.sft and the _helper it calls; whole modules count
    with their function-local imports (trainers/sft.py's `deep`), packages with their __init__ (and env,
    which rlhf_core's imports); a dispatch module's top-level import where a reached function uses its name
    (`config`). Not cmd_flow's flows/align.py, nor the dpo trainer that only stages.dpo_stage uses."""
    index = _toy(tmp_path, TOY)
    files = dvc_deps.closure(index, dvc_deps.command_entries(index, "alignflow sft --metrics-file m.json"))
    assert files == {"flows/__init__.py", "flows/cli.py", "rlhf_core/__init__.py", "rlhf_core/common/__init__.py",
                     "rlhf_core/common/offline.py", "rlhf_core/config/__init__.py", "rlhf_core/config/sections.py",
                     "rlhf_core/stages/__init__.py", "rlhf_core/stages/wrappers.py", "rlhf_core/lazy.py",
                     "rlhf_core/trainers/__init__.py", "rlhf_core/trainers/sft.py", "rlhf_core/deep.py"}


def test_stages_whose_code_cannot_be_told_are_refused(tmp_path):
    index = _toy(tmp_path, TOY)
    with pytest.raises(dvc_deps.StageError, match="has no cmd_stage"):  # kto: the shared training handler
        dvc_deps.command_entries(index, "alignflow kto")
    with pytest.raises(dvc_deps.StageError, match="no command nope in the stage registry"):
        dvc_deps.command_entries(index, "alignflow nope")
    with pytest.raises(dvc_deps.StageError, match="cannot be derived"):
        dvc_deps.command_entries(index, "bash train.sh")
    # a stage function handing a helper on as a callback: its imports would escape the reading by calls
    (tmp_path / "rlhf_core" / "stages" / "wrappers.py").write_text(TOY["rlhf_core/stages/wrappers.py"].replace("return _helper()",
                                                                                          "return map(_helper, [])"))
    with pytest.raises(dvc_deps.StageError, match="uses _helper as a value"):
        dvc_deps.stage_code_deps(dvc_deps.SourceIndex(tmp_path), [DvcStage("sft", "alignflow sft")])


def test_every_stage_depends_on_the_whole_config_package(tmp_path):
    """The defaults live in rlhf_core/config, which DVC's params hash does not see: all of it is every stage's
    dep, a module no import reaches (the toy's config/rl.py) included, and so is it without the config import."""
    index = _toy(tmp_path, TOY)
    config = {"rlhf_core/config/__init__.py", "rlhf_core/config/sections.py", "rlhf_core/config/rl.py"}
    assert config <= set(dvc_deps.stage_code_deps(index, [DvcStage("sft", "alignflow sft")])["sft"])
    without_config = TOY["rlhf_core/stages/wrappers.py"].replace("from rlhf_core import config", "")
    (tmp_path / "rlhf_core" / "stages" / "wrappers.py").write_text(without_config)
    derived = dvc_deps.stage_code_deps(dvc_deps.SourceIndex(tmp_path), [DvcStage("sft", "alignflow sft")])
    assert config <= set(derived["sft"])
