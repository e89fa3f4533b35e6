"""Fixtures of the unit tier."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    """``bench/side_by_side.py`` as a module (it is a script, not a package member), loaded once per test module."""
    spec = importlib.util.spec_from_file_location("side_by_side_under_test", REPO / "bench" / "side_by_side.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
