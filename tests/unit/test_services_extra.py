"""``alignflow services up`` without the team extra: one ``error:`` line naming ``make setup-team``, no traceback.

The extra's modules are made unimportable in a child process (``sys.modules[name] = None`` makes ``import name``
raise ImportError, as an uninstalled package does), so the test holds whether or not this machine has the extra.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

CHILD = """
import sys
for name in ("psycopg", "boto3", "moto"):
    sys.modules[name] = None
from flows.cli import main
sys.exit(main(["services", "up"]))
"""


def test_services_up_without_the_team_extra_names_make_setup_team(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "ALIGNFLOW_HOME": str(tmp_path),
                               "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    assert "team extra is not installed" in out and "make setup-team" in out, out
    assert "psycopg" in out, out
