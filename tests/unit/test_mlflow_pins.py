"""MLflow's server and client move together: constraints.txt pins mlflow, mlflow-skinny and mlflow-tracing to one
version, pyproject.toml asks for that version, and alembic (which migrates the tracking database) is pinned to a
release mlflow accepts. The installed packages are those pins."""

from __future__ import annotations

import re
from importlib.metadata import requires, version

from packaging.requirements import Requirement

from conftest import REPO

TOGETHER = ("mlflow", "mlflow-skinny", "mlflow-tracing")


def _pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a requirements-style file, names lower-cased, comments skipped."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            out[match.group(1).lower()] = match.group(2)
    return out


def test_mlflow_server_and_client_packages_are_pinned_to_one_version():
    pins = _pins((REPO / "constraints.txt").read_text())
    assert {name: pins.get(name) for name in TOGETHER} == {name: pins["mlflow"] for name in TOGETHER}
    assert f'"mlflow=={pins["mlflow"]}"' in (REPO / "pyproject.toml").read_text()


def test_mlflow_itself_requires_its_client_packages_at_its_own_version():
    pins = _pins((REPO / "constraints.txt").read_text())
    reqs = {r.name: r for r in map(Requirement, requires("mlflow") or []) if not r.marker}
    for name in ("mlflow-skinny", "mlflow-tracing"):
        assert reqs[name].specifier.contains(pins[name]), f"mlflow {pins['mlflow']} requires {reqs[name]}"


def test_alembic_is_pinned_to_a_release_mlflow_accepts():
    pins = _pins((REPO / "constraints.txt").read_text())
    alembic = next(r for r in map(Requirement, requires("mlflow") or []) if r.name == "alembic")
    assert "alembic" in pins and alembic.specifier.contains(pins["alembic"]), f"mlflow requires {alembic}"


def test_the_installed_packages_are_the_pins():
    pins = _pins((REPO / "constraints.txt").read_text())
    assert {name: version(name) for name in (*TOGETHER, "alembic")} == \
        {name: pins[name] for name in (*TOGETHER, "alembic")}
