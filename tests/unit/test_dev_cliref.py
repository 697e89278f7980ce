"""The command-line reference (docs/cli.md) has a section for every ``dressage`` command."""

from __future__ import annotations

from pathlib import Path

from services.cli import COMMANDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_every_command_has_a_section_in_the_committed_reference() -> None:
    page = DOC.read_text()
    missing = [name for name in COMMANDS if f"## `dressage {name}`" not in page]
    assert not missing, (f"docs/cli.md lacks {missing}: run `python -m tools.dev.cliref > docs/cli.md`")
