"""Acceptance (slow): a project of the user's own, with alignflow installed from a built wheel.

In a fresh temporary folder: the checkout's wheel is built and installed into a new venv, then
everything runs as a user would, from the project folder, with no alignflow checkout on the
path: ``alignflow init demo-project && cd demo-project && alignflow flow align`` on the
embedded default (micro sizes); the registered champion downloaded; a 2-cycle ``alignflow flow
iterative_dpo`` whose cycle commits land in demo-project's git; ``alignflow reproduce`` of the
align run, identical; ``dvc repro sft``; ``prefect deploy --all`` of the scaffolded
prefect.yaml; and the README's "Use it on your own model and data" commands on files of the
user's own. The checkout's ``git status`` is the same before and after.

The venv: ``python -m venv --system-site-packages`` from the checkout's ``.venv`` python gets
the *base* interpreter's site-packages (a venv's python makes venvs of its base), so a ``.pth``
file layers the ``.venv``'s site-packages (the pinned dependencies) under the new venv's own.
A plain path line in a ``.pth`` does not process the ``.pth`` files of that folder, so the
``.venv``'s editable-install finder for the checkout never loads: alignflow comes from the wheel
(asserted). ``pip install --no-deps`` of the wheel then leaves no console scripts of the
dependencies in the new venv, so ``dvc``, ``mlflow`` and ``prefect`` run as ``python -m``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import REPO
from helpers import MICRO_PARAMS

pytestmark = pytest.mark.slow

CYCLES = {"max_prompts": 24}  # micro cycles: 24 prompts x 4 samples each
GIT_ID = ["-c", "user.name=Test User", "-c", "user.email=test@example.com"]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"
    return proc


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def build_wheel(out: Path) -> Path:
    """The checkout's wheel, built from a copy of its files (an in-tree build writes build/ and
    *.egg-info into the checkout) without build isolation (no index needed)."""
    src = out / "src"
    files = _git(REPO, "ls-files", "-co", "--exclude-standard").splitlines()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out / "dist"),
          str(src)], out, dict(os.environ))
    (wheel,) = (out / "dist").glob("alignflow-*.whl")
    return wheel


def install_venv(venv: Path, wheel: Path) -> Path:
    """A new venv over the checkout's .venv's dependencies, alignflow installed from ``wheel``;
    returns its python."""
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], venv.parent, dict(os.environ))
    python = venv / "bin" / "python"
    own_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         venv.parent, dict(os.environ)).stdout.strip())
    (own_site / "alignflow-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], venv.parent, dict(os.environ))
    return python


def user_env(venv: Path, project: Path) -> dict[str, str]:
    """A user's shell in ``project``: the venv's scripts first, no checkout on PYTHONPATH, no
    ALIGNFLOW_HOME (the project is the working directory), Prefect's home in the project."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ALIGNFLOW_HOME", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_HOME"] = str(project / ".prefect")
    env["PREFECT_LOCAL_STORAGE_PATH"] = str(project / ".prefect" / "storage")
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def write_micro_params(project: Path, env: dict[str, str]) -> None:
    """The scaffolded params.yaml at micro sizes (stages in child processes, the default), committed."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in MICRO_PARAMS.items():
        params[section].update(values)
    params["flow"]["isolation"] = "process"
    params["cycles"].update(CYCLES)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _run(["git", *GIT_ID, "commit", "-q", "-am", "micro params"], project, env)


def check_wheel_install(python: Path, venv: Path, env: dict[str, str]) -> None:
    script = "import json, rlhf_core, flows, tasks; print(json.dumps([m.__file__ for m in (rlhf_core, flows, tasks)]))"
    where = json.loads(_run([str(python), "-c", script], venv.parent, env).stdout)
    for path in where:
        assert Path(path).resolve().is_relative_to(venv.resolve()), where
        assert not Path(path).resolve().is_relative_to(REPO.resolve()), where


def check_align(project: Path, env: dict[str, str], python: Path) -> str:
    """``alignflow flow align`` on the embedded default; returns its parent run id."""
    out = _run(["alignflow", "flow", "align"], project, env).stdout
    assert "=== alignflow: align flow finished ===" in out and "promoted to champion" in out
    summary = json.loads((project / "metrics" / "align_summary.json").read_text())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    tags = client.get_run(summary["parent_run_id"]).data.tags
    assert tags["git.commit"] == _git(project, "rev-parse", "HEAD")  # the project's commit, clean
    version = _run([str(python), "-c", "from importlib.metadata import version; print(version('alignflow'))"],
                   project, env).stdout.strip()
    assert tags["alignflow.version"] == version
    assert _git(project, "status", "--porcelain") == ""  # the flow leaves nothing git should see
    return summary["parent_run_id"]


def check_champion_download(project: Path, env: dict[str, str], python: Path, name: str, dest: str) -> None:
    _run([str(python), "-m", "mlflow", "artifacts", "download", "-u", f"models:/{name}@champion", "-d", dest],
         project, env)
    assert (project / dest / "model" / "config.json").exists() and (project / dest / "model" / "model.safetensors").exists()


def check_cycles(project: Path, env: dict[str, str]) -> None:
    """A 2-cycle iterative DPO: each cycle's data a commit of demo-project, pushed to its DVC remote."""
    before = _git(project, "rev-parse", "HEAD")
    out = _run(["alignflow", "flow", "iterative_dpo", "--cycles", "2"], project, env).stdout
    assert "=== alignflow: iterative_dpo flow finished ===" in out
    subjects = _git(project, "log", "--format=%s").splitlines()
    assert "cycle 2/2" in subjects[0] and "cycle 1/2" in subjects[1], subjects
    assert subjects[2:] == ["micro params", "alignflow init: project scaffold"], subjects
    assert _git(project, "rev-list", "--count", f"{before}..HEAD") == "2"
    assert any((project / ".dvc-remote").rglob("*")), "nothing pushed to the project's DVC remote"
    assert (project / "data" / "cycles" / "iterative_dpo" / "pairs.jsonl.dvc").exists()


def check_reproduce(project: Path, env: dict[str, str], run_id: str) -> None:
    out = _run(["alignflow", "reproduce", run_id, "--report", "reproduce.json"], project, env).stdout
    report = json.loads((project / "reproduce.json").read_text())
    assert report["identical"] and not report["warnings"], out
    assert report["task_states"].get("Completed", 0) >= 10 and "Cached" not in report["task_states"]
    (project / "reproduce.json").unlink()


def check_dvc_repro(project: Path, env: dict[str, str], python: Path) -> None:
    _run([str(python), "-m", "dvc", "repro", "sft"], project, env)
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {"generate", "init_model", "sft"} <= set(lock)
    assert "models/sft" in [o["path"] for o in lock["sft"]["outs"]]


def check_prefect_deploy(project: Path, env: dict[str, str], python: Path, api: str) -> None:
    """prefect.yaml's module-path entrypoints resolve with the wheel; runs would start in the project."""
    env = {**env, "PREFECT_API_URL": api, "PREFECT_HOME": str(project / ".prefect-client")}
    _run([str(python), "-m", "prefect", "work-pool", "create", "alignflow", "--type", "process"], project, env)
    _run([str(python), "-m", "prefect", "--no-prompt", "deploy", "--all"], project, env)
    deployments = {d["name"]: d for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=30).json()}
    assert deployments["nightly-align"]["entrypoint"] == "flows.align:align"
    assert deployments["nightly-iterative-dpo"]["entrypoint"] == "flows.cycles:iterative_dpo"
    for dep in deployments.values():
        (step,) = dep["pull_steps"]
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        assert Path(directory).resolve() == project.resolve()


def check_own_model_and_data(project: Path, env: dict[str, str], python: Path) -> None:
    """The README's commands for a user's model and files: validate, dvc add + commit, flow align
    with the files and a registry name of their own, download its champion. The user's "model" is
    the tiny base model the first run built, their files copies of the embedded ones."""
    own = {"sft": "my_sft.jsonl", "preferences": "my_prefs.jsonl", "prompts": "my_prompts.jsonl",
           "eval": "my_eval.jsonl"}
    for name, file in own.items():
        shutil.copy(project / "data" / "embedded" / f"{name}.jsonl", project / "data" / file)
    for kind, file in (("sft", "my_sft.jsonl"), ("preference", "my_prefs.jsonl"), ("prompts", "my_prompts.jsonl"),
                       ("prompts", "my_eval.jsonl")):
        _run(["alignflow", "validate", "--kind", kind, f"data/{file}"], project, env)
    _run([str(python), "-m", "dvc", "add", *[f"data/{f}" for f in own.values()]], project, env)
    _run(["git", "add", "data"], project, env)
    _run(["git", *GIT_ID, "commit", "-q", "-m", "my data"], project, env)
    assert (project / "data" / "my_sft.jsonl.dvc").exists()
    shutil.copytree(project / "models" / "base", project.parent / "hf-model")
    out = _run(["alignflow", "flow", "align", "--base-model", str(project.parent / "hf-model"),
                "--sft-file", "data/my_sft.jsonl", "--preference-file", "data/my_prefs.jsonl",
                "--prompts-file", "data/my_prompts.jsonl", "--eval-file", "data/my_eval.jsonl",
                "--set", "flow.stages=[dpo]", "--set", "cycles.registered_model=my-policy"], project, env).stdout
    assert "dpo" in out and "promoted to champion" in out
    check_champion_download(project, env, python, "my-policy", "my-champion")


def test_a_project_of_your_own_with_alignflow_installed_from_a_wheel(tmp_path, prefect_api):
    checkout_status = _git(REPO, "status", "--porcelain")
    wheel = build_wheel(tmp_path / "build")
    venv = tmp_path / "venv"
    python = install_venv(venv, wheel)
    project = tmp_path / "demo-project"
    env = user_env(venv, project)
    check_wheel_install(python, venv, env)

    _run(["alignflow", "init", "demo-project"], tmp_path, env)
    write_micro_params(project, env)
    run_id = check_align(project, env, python)
    check_champion_download(project, env, python, "alignflow-policy", "champion")
    check_cycles(project, env)
    check_reproduce(project, env, run_id)
    check_dvc_repro(project, env, python)
    check_prefect_deploy(project, env, python, prefect_api)
    check_own_model_and_data(project, env, python)

    assert _git(REPO, "status", "--porcelain") == checkout_status  # the checkout is untouched
