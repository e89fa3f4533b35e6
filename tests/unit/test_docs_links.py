"""Every relative link in README.md, BENCHMARKS.md and docs/*.md names a file that exists and, where it
has one, a heading anchor of that file (GitHub's rule: lower case, punctuation dropped, spaces to
hyphens). Moving a section between files breaks the links to it; this says which."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]*)\)")


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (fenced code left out: a shell comment is not a heading)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_the_anchor_rule_matches_githubs():
    assert anchor("What changed: `alignflow diff`") == "what-changed-alignflow-diff"
    assert anchor("Checkpoints, resume and failures") == "checkpoints-resume-and-failures"
    assert anchor("Tool use: multi-turn RL with an environment") == "tool-use-multi-turn-rl-with-an-environment"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not broken, f"{doc.name}: broken links:\n  " + "\n  ".join(broken)
