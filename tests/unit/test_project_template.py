"""The checkout is one ``alignflow init`` project: its shipped config files are the template's.

``alignflow init`` writes ``flows/project_template/``; the checkout's own ``params.yaml`` and
``prefect.yaml`` are byte for byte the same files, and its ``dvc.yaml`` is the template's plus
alignflow's own source files as stage deps (a user project depends on the installed alignflow
instead). So the two cannot drift, and every test of the checkout's files tests the template.

One exception, by decision: the embedded *tool* task (``rlhf_core/rollout/tool_task.py``) is this repository's
demonstration of multi-turn RL, not part of a user's project. Its ``tool_*`` sections close
``params.yaml`` (after the template's text) and its ``tool_*`` stages sit in ``dvc.yaml`` only, so
``alignflow init`` projects, and their ``dvc repro``, stay as they were. The real recipe (a pretrained model on a
reasoning-gym task, the real-model extra: :data:`REAL_RECIPE_SECTIONS`) is the same kind of exception: its ``real_*``
sections follow the tool task's and its ``real_*`` stages sit in ``dvc.yaml`` only.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import REPO
from rlhf_core.config import REAL_RECIPE_SECTIONS, SECTIONS, TOOL_TASK_SECTIONS, load_config, read_params

TEMPLATE = REPO / "flows" / "project_template"
# Where the repository's params.yaml continues past the template's text: the tool task's, then the real recipe's sections.
TOOL_BLOCK = "\n# ---- the embedded tool task"
REAL_BLOCK = "\n# ---- the real recipe"
REPOSITORY_STAGES = ("tool_", "real_")
"""Prefixes of dvc.yaml's stages that are the repository's own, not the template's."""


def _without_alignflow_sources(stage: dict) -> dict:
    """A dvc.yaml stage (or a foreach stage's ``do``) without deps on alignflow's own source files."""
    stage = dict(stage)
    if "do" in stage:
        stage["do"] = _without_alignflow_sources(stage["do"])
    deps = [d for d in stage.get("deps", []) if not str(d).startswith(("rlhf_core/", "flows/", "tasks/"))]
    if deps:
        stage["deps"] = deps
    else:
        stage.pop("deps", None)
    return stage


def test_params_and_prefect_yaml_are_the_template_files():
    for name in ("params.yaml", "prefect.yaml"):
        ours = (REPO / name).read_text()
        if name == "params.yaml":  # the template's text, then the tool task's and the real recipe's sections
            ours, sep, tool = ours.partition(TOOL_BLOCK)
            tool, sep_real, real = tool.partition(REAL_BLOCK)
            assert sep and set(yaml.safe_load(sep + tool)) == set(TOOL_TASK_SECTIONS)
            assert sep_real and set(yaml.safe_load(sep_real + real)) == set(REAL_RECIPE_SECTIONS)
        assert ours == (TEMPLATE / name).read_text(), f"{name} differs from flows/project_template/{name}: edit both"


def test_dvc_yaml_is_the_template_plus_alignflow_source_deps():
    ours = yaml.safe_load((REPO / "dvc.yaml").read_text())
    template = yaml.safe_load((TEMPLATE / "dvc.yaml").read_text())
    assert {name: _without_alignflow_sources(stage) for name, stage in ours["stages"].items()
            if not name.startswith(REPOSITORY_STAGES)} == template["stages"]
    assert not any(name.startswith(REPOSITORY_STAGES) for name in template["stages"])
    assert {name for name in ours["stages"] if name.startswith("tool_")}  # the repository's tool task stages
    assert "rlhf_core/" not in (TEMPLATE / "dvc.yaml").read_text().split("stages:", 1)[1]
    assert set(ours) == set(template) == {"stages"}


def test_template_params_load_every_section():
    raw = read_params(TEMPLATE / "params.yaml")
    assert set(raw) == set(SECTIONS) - set(TOOL_TASK_SECTIONS) - set(REAL_RECIPE_SECTIONS)
    for section, cls in SECTIONS.items():
        assert isinstance(load_config(cls, section, TEMPLATE / "params.yaml"), cls)
        assert isinstance(load_config(cls, section, REPO / "params.yaml"), cls)  # the tool sections too


def test_prefect_entrypoints_are_module_paths_of_flows():
    """Module paths resolve wherever alignflow is installed; a file path resolves only in its checkout."""
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((TEMPLATE / "prefect.yaml").read_text())
    names = {}
    for dep in spec["deployments"]:
        module, _, _ = dep["entrypoint"].partition(":")
        assert Path(module).suffix != ".py", dep["entrypoint"]
        names[dep["name"]] = load_flow_from_entrypoint(dep["entrypoint"]).name
    assert names == {"nightly-align": "align", "nightly-iterative-dpo": "iterative_dpo"}


def test_every_template_file_is_package_data():
    """pyproject's package-data glob carries the template into the wheel (no dotfiles: globs skip them)."""
    import tomllib

    from flows.scaffold import FILES

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flows"]
    shipped = {p.name for g in globs for p in (REPO / "flows").glob(g) if p.is_file()}
    assert set(FILES) <= shipped and not any(name.startswith(".") for name in FILES)
    assert {p.name for p in TEMPLATE.iterdir()} == {*FILES, "recipes"}


def test_tool_stage_commands_read_the_tool_tasks_guards_and_data_report():
    """``--section tool_rl`` reads ``tool_guards`` (its length and entropy guards advisory: a tool call lengthens
    the policy's answers by design), ``tool_sft`` ``tool_data_report``; every other section the shared one."""
    from flows.cli import _task_section

    params = str(REPO / "params.yaml")
    assert _task_section("tool_rl", "guards", params) == "tool_guards"
    assert _task_section("tool_sft", "data_report", params) == "tool_data_report"
    assert _task_section("rl", "guards", params) == "guards"
    assert _task_section("rl", "guards", str(TEMPLATE / "params.yaml")) == "guards"
    tool = load_config(SECTIONS["tool_guards"], "tool_guards", params)
    assert {"length", "entropy_collapse"} <= set(tool.advisory_guards)
    assert tool.max_kl == load_config(SECTIONS["guards"], "guards", params).max_kl  # the rest: the defaults


def test_a_recipes_template_files_are_the_checkouts():
    """``alignflow init --recipe real`` writes the checkout's recipe: its params block (params.yaml from
    REAL_BLOCK on) and its dvc.yaml without alignflow's source files as deps; both ship as package data."""
    import tomllib

    from rlhf_core.config.stage_registry import recipes

    assert recipes() == {"real": "recipes/real/dvc.yaml"}
    block = (REPO / "params.yaml").read_text().partition(REAL_BLOCK)[2]
    assert (TEMPLATE / "recipes" / "real" / "params.yaml").read_text() == REAL_BLOCK[1:] + block
    ours = yaml.safe_load((REPO / "recipes" / "real" / "dvc.yaml").read_text())["stages"]
    template = yaml.safe_load((TEMPLATE / "recipes" / "real" / "dvc.yaml").read_text())["stages"]
    assert {name: _without_alignflow_sources(stage) for name, stage in ours.items()} == template
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flows"]
    shipped = {p.relative_to(REPO / "flows") for g in globs for p in (REPO / "flows").glob(g) if p.is_file()}
    assert {Path("project_template/recipes/real/dvc.yaml"), Path("project_template/recipes/real/params.yaml")} <= shipped
