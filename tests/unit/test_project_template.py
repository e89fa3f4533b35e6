"""The checkout is one ``alignflow init`` project: its shipped config files are the template's.

``alignflow init`` writes ``flows/project_template/``; the checkout's own ``params.yaml`` and
``prefect.yaml`` are byte for byte the same files, and its ``dvc.yaml`` is the template's plus
alignflow's own source files as stage deps (a user project depends on the installed alignflow
instead). So the two cannot drift, and every test of the checkout's files tests the template.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import REPO
from rlhf_core.config import SECTIONS, load_config, read_params

TEMPLATE = REPO / "flows" / "project_template"


def _without_alignflow_sources(stage: dict) -> dict:
    """A dvc.yaml stage (or a foreach stage's ``do``) without deps on alignflow's own source files."""
    stage = dict(stage)
    if "do" in stage:
        stage["do"] = _without_alignflow_sources(stage["do"])
    deps = [d for d in stage.get("deps", []) if not str(d).startswith("rlhf_core/")]
    if deps:
        stage["deps"] = deps
    else:
        stage.pop("deps", None)
    return stage


def test_params_and_prefect_yaml_are_the_template_files():
    for name in ("params.yaml", "prefect.yaml"):
        assert (REPO / name).read_text() == (TEMPLATE / name).read_text(), \
            f"{name} differs from flows/project_template/{name}: edit both"


def test_dvc_yaml_is_the_template_plus_alignflow_source_deps():
    ours = yaml.safe_load((REPO / "dvc.yaml").read_text())
    template = yaml.safe_load((TEMPLATE / "dvc.yaml").read_text())
    assert {name: _without_alignflow_sources(stage) for name, stage in ours["stages"].items()} == template["stages"]
    assert "rlhf_core/" not in (TEMPLATE / "dvc.yaml").read_text().split("stages:", 1)[1]
    assert set(ours) == set(template) == {"stages"}


def test_template_params_load_every_section():
    raw = read_params(TEMPLATE / "params.yaml")
    assert set(raw) == set(SECTIONS)
    for section, cls in SECTIONS.items():
        assert isinstance(load_config(cls, section, TEMPLATE / "params.yaml"), cls)


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
    assert {p.name for p in TEMPLATE.iterdir()} == set(FILES)
