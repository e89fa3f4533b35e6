"""Every shell command of README.md, run as written.

The commands are read from the README's fenced ``bash``, ``sh`` and ``console`` blocks (a ``console``
block's commands are its ``$ `` lines; continuation lines are joined, trailing comments dropped). Blocks
under "Two commands" run in a copy of this checkout; the others form the tour and run in one temporary
folder, one after another, as a user types them (``cd`` moves the next commands).

Fast tier: every command that finishes within a minute on the embedded default — ``alignflow init``,
``--help``, ``validate`` on the user's four files, ``dvc add``, the commit. Slow tier (``@slow``):
everything, the commands marked ``slow`` included — a fence whose info string says ``slow``
(```` ```bash slow ````) or a line whose comment starts with ``# slow`` — with the project's
``params.yaml`` and the checkout copy's at micro sizes (``helpers.MICRO_PARAMS``): ``make demo``, the
own-data ``flow align``, fetching the registered model, ``alignflow diff`` and ``alignflow reproduce``.

What the test supplies, and nothing else: the user's four data files (micro datasets) in the project's
``data/``; for placeholders, ``/path/to/hf-model`` (a micro model folder) and ``<parent-run-id>`` (the
``parent run:`` id the flow printed); in the checkout copy, a ``.venv`` whose ``bin`` is the test's own
environment, with a fresh set-up stamp, so ``make`` goes straight to the work. :data:`NOT_RUN` lists the
commands never run here, each with the reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import cli_env, copy_project, write_micro_params

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(bash|sh|console)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CHECKOUT_SECTIONS = ("Two commands",)
FAST_LIMIT_S = 60

NOT_RUN = {
    "make test": "it runs the test suite, this test included",
    "pip wheel --no-deps -w dist /path/to/alignflow": "builds a wheel of a checkout with build isolation, which "
    "needs the network; tests/e2e/test_init_project_slow.py builds one offline and installs it",
    "pip install dist/alignflow-0.1.0-py3-none-any.whl": "installs into the environment that runs the tests; "
    "tests/e2e/test_init_project_slow.py installs the wheel into a venv of its own",
}


@dataclass
class Command:
    text: str
    section: str  # the README's "## " heading above the block
    slow: bool


def readme_commands(text: str | None = None) -> list[Command]:
    """The README's shell commands in order, each with its section and whether it is marked slow."""
    text = (REPO / "README.md").read_text(encoding="utf-8") if text is None else text
    commands = []
    for match in FENCE.finditer(text):
        lang, info, body = match.groups()
        headings = re.findall(r"^## (.+)$", text[:match.start()], re.MULTILINE)
        section = headings[-1].strip() if headings else ""
        block_slow = "slow" in info.split()
        joined = re.sub(r"\\\n\s*", "", body)
        for line in joined.splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            comment = re.search(r"(?:^|\s)#\s*(.*)$", line)
            command = line[:comment.start()].strip() if comment else line.strip()
            if command:
                slow = block_slow or bool(comment and comment.group(1).startswith("slow"))
                commands.append(Command(command, section, slow))
    return commands


def test_the_readme_parser_reads_blocks_comments_continuations_and_marks():
    text = ("## Two commands\n```bash\nmake demo   # slow: long\nmake test   # the suite\n```\n"
            "## Tour\n```bash slow\nalignflow flow align --a \\\n    --b  # a comment\n```\n"
            "```console\n$ alignflow --help\nusage: ...\n```\n```python\nprint(1)\n```\n")
    got = [(c.text, c.section, c.slow) for c in readme_commands(text)]
    assert got == [("make demo", "Two commands", True), ("make test", "Two commands", False),
                   ("alignflow flow align --a --b", "Tour", True), ("alignflow --help", "Tour", False)]


def test_every_command_not_run_is_still_in_the_readme_and_the_tour_is_there():
    texts = [c.text for c in readme_commands()]
    for command in NOT_RUN:
        assert command in texts, f"NOT_RUN names {command!r}, which README.md no longer has"
    assert "make demo" in texts and "alignflow init my-project" in texts, texts
    assert any(t.startswith("alignflow flow align --base-model /path/to/hf-model") for t in texts), texts


class Session:
    """Runs README commands the way a user's shell would: one after another, ``cd`` carried over."""

    def __init__(self, tmp_path: Path, micro_model: Path, micro_data: dict[str, Path], micro: bool):
        self.tmp, self.micro_model, self.micro_data, self.micro = tmp_path, micro_model, micro_data, micro
        self.tour_cwd = tmp_path / "tour"
        self.tour_cwd.mkdir()
        self.env = self._env(self.tour_cwd)
        self.checkout: Path | None = None
        self.outputs: list[str] = []
        self.timings: list[tuple[str, float]] = []

    @staticmethod
    def _env(home: Path) -> dict[str, str]:
        env = cli_env(home)
        env.pop("PREFECT_API_URL", None)
        env.update(GIT_AUTHOR_NAME="u", GIT_AUTHOR_EMAIL="u@u", GIT_COMMITTER_NAME="u", GIT_COMMITTER_EMAIL="u@u")
        return env

    def _checkout_copy(self) -> tuple[Path, dict[str, str]]:
        """A copy of the checkout (micro params) whose .venv is this environment, set up already."""
        if self.checkout is None:
            self.checkout = copy_project(self.tmp / "checkout", micro=True)
            venv = self.checkout / ".venv"
            venv.mkdir()
            (venv / "bin").symlink_to(Path(sys.executable).parent)
            (venv / ".alignflow-installed").touch()  # newer than pyproject.toml: make skips the install
        env = self._env(self.checkout)
        env["PYTHONPATH"] = str(self.checkout)  # the venv's alignflow runs the copy's code
        return self.checkout, env

    def _entered_project(self) -> None:
        """After ``cd`` into the project ``alignflow init`` made: its own stores, the user's four files."""
        self.env = self._env(self.tour_cwd)
        if self.micro:
            write_micro_params(self.tour_cwd)
            subprocess.run(["git", "commit", "-qam", "micro sizes"], cwd=self.tour_cwd, env=self.env, check=True)
        for name, mine in (("sft", "my_sft"), ("preferences", "my_prefs"), ("prompts", "my_prompts"),
                           ("eval", "my_eval")):
            (self.tour_cwd / "data" / f"{mine}.jsonl").write_bytes(self.micro_data[name].read_bytes())

    def _fill(self, command: str) -> str:
        command = command.replace("/path/to/hf-model", str(self.micro_model))
        if "<parent-run-id>" in command:
            ids = re.findall(r"^parent run:\s+([0-9a-f]{32})", "\n".join(self.outputs), re.MULTILINE)
            assert ids, "no command printed a 'parent run:' id before " + command
            command = command.replace("<parent-run-id>", ids[-1])
        return command

    def run(self, command: Command, timeout: int) -> None:
        if command.section in CHECKOUT_SECTIONS:
            cwd, env = self._checkout_copy()
        else:
            cwd, env = self.tour_cwd, self.env
        if command.text.startswith("cd "):
            self.tour_cwd = (cwd / command.text[3:].strip()).resolve()
            assert self.tour_cwd.is_dir(), command.text
            self._entered_project()
            return
        text = self._fill(command.text)
        start = time.monotonic()
        proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        self.timings.append((command.text, time.monotonic() - start))
        assert proc.returncode == 0, (text, proc.stdout[-2000:], proc.stderr[-3000:])
        self.outputs.append(proc.stdout)


def _report(timings: list[tuple[str, float]]) -> str:
    return "\n".join(f"{seconds:7.1f} s  {command}" for command, seconds in timings)


def test_readme_fast_commands_run_as_written(tmp_path, micro_model, micro_data):
    session = Session(tmp_path, micro_model, micro_data, micro=False)
    ran = []
    for command in readme_commands():
        if command.text in NOT_RUN or command.slow:
            continue
        session.run(command, timeout=3 * FAST_LIMIT_S)
        ran.append(command.text)
    print(_report(session.timings))
    assert any(c.startswith("alignflow validate") for c in ran) and "dvc add" in " ".join(ran), ran
    slow = [(c, s) for c, s in session.timings if s > FAST_LIMIT_S]
    assert not slow, f"README commands over {FAST_LIMIT_S} s must be marked slow:\n{_report(slow)}"


@pytest.mark.slow
def test_readme_every_command_runs_as_written(tmp_path, micro_model, micro_data):
    """Everything but NOT_RUN, in README order, at micro sizes: make demo, the tour, its flow, diff, reproduce."""
    session = Session(tmp_path, micro_model, micro_data, micro=True)
    for command in readme_commands():
        if command.text not in NOT_RUN:
            session.run(command, timeout=1200)
    print(_report(session.timings))
    joined = "\n".join(session.outputs)
    assert "=== alignflow: align flow finished ===" in joined
    assert "fetch it:" in joined and "registered SFT:  my-policy-sft" in joined
    assert "IDENTICAL" in session.outputs[-1].split(), session.outputs[-1][-2000:]  # reproduce's verdict
    assert any(p.name == "config.json" for p in (session.tour_cwd / "my-policy-candidate").rglob("*"))
