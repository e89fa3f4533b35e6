"""The training core's part of the Prefect cache key: a hash of its sources and the package version."""

from __future__ import annotations

import hashlib
import shutil
from importlib.metadata import version

from tasks.common import core_fingerprint, package_version, source_hash


def _tree(root):
    (root / "trainers").mkdir(parents=True)
    (root / "__init__.py").write_text('__version__ = "0.1.0"\n')
    (root / "trainers" / "sft.py").write_text("def train():\n    return 1\n")
    (root / "README.md").write_text("not code\n")
    return root


def test_source_hash_is_sha256_of_paths_and_bytes_in_path_order(tmp_path):
    """Worked out by hand: for each .py file in relative-path order, ``PATH\\0LEN\\0`` then its bytes."""
    root = _tree(tmp_path / "core")
    expected = hashlib.sha256(b'__init__.py\x0022\x00__version__ = "0.1.0"\n'
                              b"trainers/sft.py\x0026\x00def train():\n    return 1\n").hexdigest()
    assert source_hash(root) == expected


def test_source_hash_is_stable_and_changes_with_any_byte(tmp_path):
    root = _tree(tmp_path / "core")
    before = source_hash(root)
    assert source_hash(root) == before
    assert source_hash(shutil.copytree(root, tmp_path / "elsewhere")) == before  # paths are relative
    (root / "README.md").write_text("edited, but not code\n")
    assert source_hash(root) == before

    trainer = root / "trainers" / "sft.py"
    trainer.write_bytes(trainer.read_bytes() + b"# a comment\n")
    edited = source_hash(root)
    assert edited != before
    trainer.write_text("def train():\n    return 1\n")
    assert source_hash(root) == before  # the same bytes again: the same hash

    trainer.rename(root / "trainers" / "dpo.py")  # same bytes under another name
    assert source_hash(root) not in (before, edited)


def test_core_fingerprint_names_the_version_and_is_computed_once():
    assert package_version() == version("alignflow")
    fingerprint = core_fingerprint()
    installed, digest = fingerprint.split(":")
    assert installed == version("alignflow") and len(digest) == 64
    assert core_fingerprint() is fingerprint  # cached for the process
