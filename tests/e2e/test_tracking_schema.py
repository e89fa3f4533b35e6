"""A tracking database at another schema revision than the installed MLflow's is refused with the fix named.

Real SQLite MLflow databases: one migrated by MLflow's own alembic scripts up to a revision before the client's head
(an older MLflow's database), and one whose recorded revision no installed script knows (a newer MLflow's). A stage
command and ``alignflow gc`` refuse both with one clear error (exit 2, no traceback) and leave the database as it was.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
import yaml

from helpers import one_error, run_cli


def _older_database(path: Path) -> str:
    """A database made the way MLflow makes one, but migrated only to the revision two before the head."""
    import sqlalchemy
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase  # the tables before migration 1

    uri = f"sqlite:///{path}"
    script = ScriptDirectory.from_config(_get_alembic_config(uri))
    head = script.get_revision(script.get_current_head())
    older = script.get_revision(head.down_revision).down_revision
    engine = sqlalchemy.create_engine(uri)
    InitialBase.metadata.create_all(engine)  # what MLflow's _initialize_tables does before migrating
    engine.dispose()
    command.upgrade(_get_alembic_config(uri), older)
    return older


def _newer_database(path: Path) -> str:
    """A database at the client's head whose recorded revision is then one this client has no script for."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # MLflow creates it at its head
    with sqlite3.connect(path) as db:
        db.execute("UPDATE alembic_version SET version_num = 'f00dfeed1234'")
    return "f00dfeed1234"


def _project(folder: Path, model: Path, data: dict[str, Path]) -> Path:
    """A project whose ``evaluate`` (a tracked stage command) reads the micro model and eval set."""
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "evaluate": {"model_path": str(model), "eval_file": str(data["eval"]), "max_items": 4,
                     "output_file": "metrics/eval.json"},
        "tracking": {"experiment": "schema-test"}}))
    return folder


@pytest.mark.parametrize("make, needles", [
    (_older_database, ("older than MLflow", "mlflow db upgrade sqlite:///")),
    (_newer_database, ("does not know", "a newer MLflow migrated it", "cannot bring it back")),
], ids=["older", "newer"])
def test_a_database_at_another_schema_revision_is_refused_naming_the_fix(tmp_path, micro_model, micro_data, make,
                                                                        needles):
    project = _project(tmp_path, micro_model, micro_data)
    revision = make(project / "mlflow.db")
    digest = hashlib.sha256((project / "mlflow.db").read_bytes()).hexdigest()

    stage = run_cli(["evaluate"], project, timeout=300)
    error = one_error(stage, 2, f"schema revision {revision}", *needles)
    assert "mlflow db upgrade" in error
    gc = run_cli(["gc"], project, timeout=300)
    one_error(gc, 2, f"schema revision {revision}", *needles)
    assert hashlib.sha256((project / "mlflow.db").read_bytes()).hexdigest() == digest  # not migrated, no run


def test_a_database_at_the_clients_revision_is_used(tmp_path):
    from mlflow import MlflowClient

    from rlhf_core.tracking.schema import check_schema, client_schema_revision, database_revision

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    check_schema(uri)  # none yet: MLflow makes it at its head
    MlflowClient(tracking_uri=uri).search_experiments()
    assert database_revision(uri) == client_schema_revision()
    check_schema(uri)
