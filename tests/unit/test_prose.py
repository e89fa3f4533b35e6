"""Code states what is true now (STYLE.md 15): no card names or dates in docstrings and comments.

A docstring that says "3.17 -> 2.92 s on an H200" is out of date the day after; measurements and
their history live in BENCHMARKS.md and commit messages. This reads every docstring (module, class,
function, field) and every comment of the source packages and names each line that mentions an
accelerator model or a calendar date. Code and messages are not read: a card's name in a string
the program compares against is a fact about the code, not prose.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "tasks")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATED = re.compile(
    r"\b(?:G?H[12]00|[AB]100|[AB]200|A10G?|V100|T4|L4|L40S?|RTX ?\d{3,4}|MI[23]\d\dX?)\b"  # accelerator models
    r"|\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"  # ISO dates
    rf"|\b(?:{_MONTHS}) (?:[0-3]?\d, )?(?:19|20)\d\d\b"  # "December 2026", "December 4, 2026"
)


def _docstrings(tree: ast.AST):
    """(first line, text) of every docstring: module, class and function ones, and the string under a field."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def _comments(source: str):
    """(line, text) of every ``#`` comment."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def dated_prose(root: Path = REPO) -> list[str]:
    """``file:line: text`` of each docstring or comment line that names a card or a date."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            pieces = list(_comments(source))
            for first, text in _docstrings(ast.parse(source, filename=str(path))):
                pieces += [(first + i, line) for i, line in enumerate(text.splitlines())]
            for line, text in pieces:
                if DATED.search(text):
                    found.append(f"{path.relative_to(root)}:{line}: {text.strip()}")
    return sorted(found)


def test_no_card_names_or_dates_in_docstrings_and_comments():
    found = dated_prose()
    assert not found, ("docstrings and comments state what is true now; a measurement on a named card or a "
                       "date belongs in BENCHMARKS.md or the commit message (STYLE.md 15):\n  " + "\n  ".join(found))


def test_the_check_sees_comments_and_docstrings_but_not_code(tmp_path):
    pkg = tmp_path / "rlhf_core"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        '"""Fast on an H200."""\n'
        "CARD = 'H100'  # the card the kernel table is keyed on\n"
        "def f():\n"
        "    '''Fixed on 2026-12-03.'''\n"
        "    return 1  # measured in December 2026\n"
        "x = 2  # an A100 or newer\n")
    assert [entry.split(": ", 1)[0] for entry in dated_prose(tmp_path)] == \
        ["rlhf_core/m.py:1", "rlhf_core/m.py:4", "rlhf_core/m.py:5", "rlhf_core/m.py:6"]
