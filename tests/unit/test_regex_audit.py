"""Every regular expression in the source runs in time linear in its input.

A backtracking engine (Python's ``re``) is quadratic or worse on some patterns: one that can start
at every character of a long run and scan to its end, or nested quantifiers over the same text.
User text of any length reaches many of them (dataset rows, server replies, exception messages),
so one such pattern turns a 2 MB record into an hours-long hang. Static ReDoS analysers for
Python's dialect are not maintained, so this audit pumps each pattern instead: it finds every
``re`` call in the source packages with the syntax tree, requires a literal pattern (so no regex
escapes the audit), and times it on long strings built from the pattern's own characters and
words, alone, in pairs and after each marker. A string that costs more than a millisecond at 4k
characters is timed again at 16k and 32k: doubling must less than triple the time, unless the
longer string still takes under 50 ms (timer noise; a quadratic pattern takes seconds there).
"""

from __future__ import annotations

import ast
import itertools
import re
import statistics
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = ("rlhf_core", "flows", "tasks", "bench", "scripts")
FLAGS_POSITION = {"compile": 1, "search": 2, "match": 2, "fullmatch": 2, "findall": 2, "finditer": 2, "split": 3,
                  "sub": 4, "subn": 4}
"""Where each ``re`` function takes ``flags`` when it is passed by position."""
RE_CALLS = set(FLAGS_POSITION)


def _flags(node: ast.AST | None) -> int:
    """The value of a flags argument written as ``re.I | re.M`` (0 when absent)."""
    if node is None:
        return 0
    if isinstance(node, ast.BinOp):
        return _flags(node.left) | _flags(node.right)
    if isinstance(node, ast.Attribute):
        return int(getattr(re, node.attr))
    raise ValueError(ast.dump(node))


def _literal(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments (a pattern built once and named)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                out[node.targets[0].id] = node.value.value
    return out


def _calls() -> list[tuple[str, str, int]]:
    """``(place, pattern, flags)`` of every ``re.<call>(pattern, ...)`` in the source packages."""
    found = []
    for root in SOURCE:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            constants = _module_constants(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                        and node.func.attr in RE_CALLS and node.args):
                    continue
                place = f"{path.relative_to(REPO)}:{node.lineno}"
                pattern = _literal(node.args[0], constants)
                if pattern is None and isinstance(node.args[0], ast.Name) and node.func.attr != "compile":
                    continue  # a compiled pattern passed by name: audited where it is compiled
                flag_arg = next((k.value for k in node.keywords if k.arg == "flags"), None)
                position = FLAGS_POSITION[node.func.attr]
                if flag_arg is None and len(node.args) > position:
                    flag_arg = node.args[position]
                found.append((place, pattern, _flags(flag_arg) if pattern is not None else 0))
    return found


CALLS = _calls()


def test_every_pattern_is_a_literal():
    """A pattern assembled at run time (an f-string, a join) cannot be audited here: write it out."""
    assert len(CALLS) >= 20, "the audit found too few re calls: did the walk break?"
    assert [place for place, pattern, _ in CALLS if pattern is None] == []


def _pumps(pattern: str, n: int) -> list[str]:
    """Long strings made of the pattern's own characters and words: alone, alternating in pairs,
    each word repeated after each marker (``"?" + "token" * k``) and each marked word repeated
    (``"<img " * k``)."""
    marks = sorted({c for c in pattern if not c.isalnum() and c != "\\"} | {" ", "/", ".", "\n"})
    chars = marks + ["a", "Z", "0"]
    words = sorted(set(re.findall(r"[A-Za-z]{2,}", re.sub(r"\\.", " ", pattern))))[:12]
    out = [c * n for c in chars]
    out += [(x + y) * (n // 2) for x, y in itertools.combinations(chars, 2)]
    for word in words:
        out += [m + word * (n // len(word)) for m in [""] + marks]
        out += [(word + m) * (n // (len(word) + 1)) for m in marks + ["a", "0"]]
        out += [(m + word + " ") * (n // (len(word) + 2)) for m in marks]
    return out


def _cost(regex: re.Pattern, text: str, repeats: int = 3) -> float:
    """Median seconds of a full scan (what search, sub and findall do) plus match and fullmatch."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _m in regex.finditer(text):
            pass
        regex.match(text)
        regex.fullmatch(text)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.parametrize("place,pattern,flags", [c for c in CALLS if c[1] is not None], ids=[c[0] for c in CALLS if c[1]])
def test_pattern_time_is_linear(place, pattern, flags):
    regex = re.compile(pattern, flags)
    small = 4000
    for text in _pumps(pattern, small):
        if _cost(regex, text, repeats=1) < 1e-3:
            continue
        base, doubled = _cost(regex, text * 4), _cost(regex, text * 8)
        assert doubled < 3 * base or doubled < 0.05, (f"{place}: {pattern!r} on {text[:30]!r}... took {base:.4f} s at "
                                           f"{4 * len(text)} characters and {doubled:.4f} s at {8 * len(text)}")
