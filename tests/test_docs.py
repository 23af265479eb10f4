"""Every `scalestudy` command shown in README.md and docs/ runs as shown: each one parses with
the CLI's own parser, the config and spec files it names exist, and the cheap ones (describe,
study --dry-run) run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from scalestudy.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # SPEC, DIR, RUN: a usage line's blanks


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """(where, argv after `scalestudy`) for each command line in the page's shell blocks."""
    out = []
    for match in FENCE.finditer(page.read_text()):
        if match.group(1) not in ("bash", "sh", "shell", ""):
            continue
        text = re.sub(r"\\\n\s*", " ", match.group(2))  # join continued lines
        for line in text.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]  # environment assignments before the command
            if words and Path(words[0]).name == "scalestudy":
                out.append((f"{page.relative_to(ROOT)}: {line.strip()}", words[1:]))
    return out


COMMANDS = [c for page in PAGES for c in _commands(page)]


def test_the_docs_show_commands():
    assert len(PAGES) > 5 and len(COMMANDS) > 20


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_parses_and_names_files_that_exist(where: str, argv: list[str]):
    try:
        args = cli.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: the CLI rejects it (exit {e.code})")
    for name in ("config", "spec"):
        value = getattr(args, name, None)
        if value and not PLACEHOLDER.match(value):
            assert (ROOT / value).is_file(), f"{where}: {value} does not exist"


CHEAP = [
    (w, a) for w, a in COMMANDS if a[0] == "describe" or (a[0] == "study" and "--dry-run" in a)
]


@pytest.mark.parametrize("where,argv", CHEAP, ids=[w for w, _ in CHEAP])
def test_cheap_command_runs(where: str, argv: list[str], monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 0, where
    assert capsys.readouterr().out.strip()
