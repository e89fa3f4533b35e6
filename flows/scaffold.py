"""``alignflow init PATH``: scaffold a project of the user's own, run by the installed alignflow.

A project is a folder with ``params.yaml`` (every stage's documented defaults), ``dvc.yaml``
(the pipeline as DVC stages), ``prefect.yaml`` (nightly deployments), ``data/``, a
``.gitignore`` for run state and outputs, a README stub, DVC initialised with a local default
remote (``.dvc-remote/`` inside the project, git-ignored, as in the alignflow checkout), and a
git repository: made here, with the scaffold as its first commit, unless the folder already
sits in one (then the files are left for the user to commit). Iterative cycles commit to that
repository, ``dvc repro`` and ``alignflow reproduce`` run there.

The files come from ``flows/project_template/`` (package data, so they ship in the wheel);
the alignflow checkout's own ``params.yaml``, ``dvc.yaml`` and ``prefect.yaml`` are the same
files (``dvc.yaml`` plus alignflow's source files as deps), kept equal by
``tests/unit/test_project_template.py``.

``--recipe NAME`` adds a recipe of its own beside the align pipeline (``real``: a pretrained model on a
reasoning-gym task, which needs the real-model extra): its dvc.yaml (``recipes/NAME/dvc.yaml``, the checkout's
without alignflow's source files as deps), its params sections appended to ``params.yaml``
(``recipes/NAME/params.yaml`` in the template, the checkout's params.yaml's closing block) and its outputs
git-ignored; ``dvc repro recipes/NAME/dvc.yaml`` runs it.

Run: ``alignflow init my-project [--recipe real]`` (``--force`` overwrites the scaffold's own files).
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rlhf_core.config import ConfigError
from rlhf_core.config.stage_registry import recipes
from tasks.versioning import commit_identity

# template file -> its path in the project. The dotfile ships without its dot: package-data
# globs do not match dotfiles, and a `.gitignore` inside the package would apply to the checkout.
FILES = {"params.yaml": "params.yaml", "dvc.yaml": "dvc.yaml", "prefect.yaml": "prefect.yaml",
         "gitignore": ".gitignore", "README.md": "README.md"}
DATA_KEEP = "data/.gitkeep"  # git keeps no empty folder
RECIPE_IGNORED = {"real": ("/data/real/", "/models/real_*/")}
"""Each recipe's outputs that its stages write beside the align pipeline's (git-ignored in the project)."""
DVC_REMOTE_NAME = "local"
DVC_REMOTE_DIR = ".dvc-remote"


@dataclass(frozen=True)
class Scaffolded:
    """What ``alignflow init`` made."""

    root: Path
    written: list[str]
    made_git_repo: bool
    initial_commit: str | None  # None when the folder was already in a git repository
    dvc_remote: Path


def template_text(name: str) -> str:
    """A template file's text, read from the installed package (wheel or checkout alike)."""
    return resources.files("flows").joinpath("project_template", name).read_text(encoding="utf-8")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)


def conflicts(root: Path, recipe: str | None = None) -> list[str]:
    """The scaffold's paths that already exist in ``root`` (``init`` refuses to overwrite them)."""
    own = [recipes()[recipe]] if recipe else []
    return [rel for rel in [*FILES.values(), *own, ".dvc"] if (root / rel).exists()]


def write_template(root: Path, recipe: str | None = None) -> list[str]:
    """Write the template files, ``data/`` and the recipe's files; returns the written paths, relative to ``root``."""
    texts = {rel: template_text(name) for name, rel in FILES.items()}
    written = [*FILES.values(), DATA_KEEP]
    if recipe:
        file = recipes()[recipe]
        texts[file] = template_text(file)
        texts["params.yaml"] += "\n" + template_text(str(Path(file).with_name("params.yaml")))
        texts[".gitignore"] += "".join(f"{line}\n" for line in RECIPE_IGNORED.get(recipe, ()))
        written.insert(len(FILES), file)
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / DATA_KEEP).parent.mkdir(exist_ok=True)
    (root / DATA_KEEP).touch()
    return written


def ensure_git_repo(root: Path) -> bool:
    """``git init`` unless ``root`` is already inside a work tree; True when it made the repository."""
    if _git(root, "rev-parse", "--is-inside-work-tree").returncode == 0:
        return False
    proc = _git(root, "init", "-q")
    if proc.returncode != 0:
        raise ConfigError(f"init: git init in {root} failed: {proc.stderr.strip()}")
    return True


def init_dvc(root: Path) -> Path:
    """``dvc init`` (``--subdir`` below a repository's top level), then the local default remote;
    returns the remote's folder. An existing ``.dvc`` (``--force``) is kept as it is."""
    from dvc.repo import Repo  # lazy: dvc (`alignflow init` without DVC skips it)

    remote = root / DVC_REMOTE_DIR
    if (root / ".dvc").exists():
        return remote
    top = Path(_git(root, "rev-parse", "--show-toplevel").stdout.strip()).resolve()
    # DVC's "You can now commit the changes to git" is wrong after init commits them itself;
    # `alignflow init` prints what it did.
    logging.getLogger("dvc.repo.init").setLevel(logging.WARNING)
    Repo.init(str(root), subdir=top != root.resolve()).close()
    with Repo(str(root)) as repo, repo.config.edit() as conf:
        # DVC stores a relative url relative to .dvc/ (so `../.dvc-remote`) and reads it back
        # from there: the project moves or is cloned with its remote path intact. It takes
        # the url relative to the working directory, hence relpath.
        conf["remote"][DVC_REMOTE_NAME] = {"url": os.path.relpath(remote, Path.cwd())}
        conf["core"]["remote"] = DVC_REMOTE_NAME
        conf["core"]["analytics"] = False
    return remote


def commit_scaffold(root: Path) -> str:
    """The repository's first commit, holding the scaffold (cycles and reproduce need a HEAD)."""
    for args in (["add", "-A"], [*commit_identity(root), "commit", "-q", "-m", "alignflow init: project scaffold"]):
        proc = _git(root, *args)
        if proc.returncode != 0:
            raise ConfigError(f"init: git {args[-1]} in {root} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return _git(root, "rev-parse", "HEAD").stdout.strip()


def init_project(path: str | Path, force: bool = False, recipe: str | None = None) -> Scaffolded:
    """Scaffold the project at ``path`` (made if missing), with ``recipe``'s files when given. Refuses, naming
    them, to overwrite existing scaffold files unless ``force``; then git (if needed), DVC and the first commit."""
    root = Path(path).expanduser().resolve()
    if recipe is not None and recipe not in recipes():
        raise ConfigError(f"init: --recipe {recipe!r}: no such recipe (one of {', '.join(sorted(recipes()))})")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"init: {root} exists and is not a folder")
    existing = conflicts(root, recipe) if root.exists() else []
    if existing and not force:
        raise ConfigError(f"init: {root} already has {', '.join(existing)}; nothing was written "
                          "(pick an empty folder, or pass --force to overwrite the scaffold's files)")
    root.mkdir(parents=True, exist_ok=True)
    written = write_template(root, recipe)
    made_repo = ensure_git_repo(root)
    remote = init_dvc(root)
    return Scaffolded(root, written, made_repo, commit_scaffold(root) if made_repo else None, remote)
