"""The command line starts light: ``--help`` and ``--version`` import none of the heavy frameworks.

A first ``alignflow --help`` used to import torch (through an error type) and parse every config class's
source (for the field docs), most of two seconds; ``bench/cli_startup.py`` measures the wall time. Here the
rule itself: after importing the CLI and running ``--help`` in a fresh interpreter, none of torch,
great_expectations, mlflow, prefect or ray is in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

HEAVY = ("torch", "great_expectations", "mlflow", "prefect", "ray", "deepspeed", "transformers")

_PROBE = """
import contextlib, io, json, sys
import flows.cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        flows.cli.main(ARGV)
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "out": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


def _probe(argv: list[str]) -> dict:
    code = _PROBE.replace("ARGV", repr(argv)).replace("HEAVY", repr(HEAVY))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_and_version_import_no_heavy_framework():
    for argv in (["--help"], ["--version"], ["sft", "--help"], ["flow", "--help"]):
        seen = _probe(argv)
        assert seen["code"] == 0 and seen["out"], (argv, seen)
        assert seen["heavy"] == [], f"alignflow {' '.join(argv)} imported {seen['heavy']}"


def test_version_names_the_package():
    import rlhf_core

    assert _probe(["--version"])["out"].strip() == f"alignflow {rlhf_core.__version__}"


def test_a_stage_help_lists_each_field_on_its_own_line():
    """``alignflow sft --help`` ends with the section's fields, one per line with its doc, not one paragraph."""
    from rlhf_core.config import SFTConfig, field_docs

    out = _probe(["sft", "--help"])["out"]
    listing = out.split("fields of 'sft'", 1)[1].splitlines()
    starts = [line.split()[0] for line in listing[1:] if line.startswith("  ") and not line.startswith("   ")]
    assert starts == list(field_docs(SFTConfig)), starts
    assert max(len(line) for line in listing) <= 130
