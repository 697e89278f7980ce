"""The compose commands users read, and which of them a test runs: the one parser of them.

Each ``docker compose`` command of DOCS is run by the compose tier through ``Stack.documented``
(tests/compose/compose_stack.py), by tests/integration/test_compose.py (``config``) or by
scripts/images.sh (``build``), or its line in the doc says it is not runnable here (the GPU profile);
tests/unit/test_compose_docs.py holds the docs to that.
"""

from __future__ import annotations

import re

from paths import REPO

DOCS = ("README.md", "docs/operations.md", "docs/gpu.md")
NOT_RUNNABLE = re.compile(r"not runnable", re.IGNORECASE)
SUBCOMMANDS = frozenset({"up", "down", "run", "exec", "kill", "stop", "start", "restart", "build", "config",
                         "ps", "logs", "pull"})
_OPTION_WITH_VALUE = frozenset({"-f", "--file", "-p", "--project-name", "--profile", "--env-file"})


def subcommand(command: str) -> str | None:
    """The compose subcommand of ``docker compose [options] SUBCOMMAND ...``; None for a bare mention."""
    words = command.split()[2:]
    while words and words[0].startswith("-"):
        words = words[2:] if words[0] in _OPTION_WITH_VALUE else words[1:]
    return words[0] if words and words[0] in SUBCOMMANDS else None


def _command(raw: str) -> str | None:
    """``raw`` from ``docker compose`` on, comment cut and whitespace collapsed; None unless a command."""
    start = raw.find("docker compose")
    if start < 0:
        return None
    command = " ".join(raw[start:].split("#", 1)[0].split())
    return command if subcommand(command) else None


def doc_compose_commands(text: str) -> list[tuple[str, bool]]:
    """Every ``docker compose`` command of a markdown document, in order, as written (a leading
    ``VAR=value`` and a trailing comment cut, whitespace collapsed), each with whether its line says it is
    not runnable here. Code-block lines and inline code spans count; a mention without a subcommand
    (```docker compose --profile gpu```) names the file, not a command."""
    found: list[tuple[str, bool]] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            if (command := _command(line)) is not None:
                found.append((command, bool(NOT_RUNNABLE.search(line))))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    for span in re.finditer(r"`([^`]*docker compose[^`]*)`", prose):
        start = prose.rfind("\n", 0, span.start()) + 1
        end = prose.find("\n", span.end())
        if (command := _command(span.group(1))) is not None:
            found.append((command, bool(NOT_RUNNABLE.search(prose[start:end if end >= 0 else None]))))
    return found


def documented_commands() -> dict[str, bool]:
    """The compose commands of DOCS -> whether every mention of it is marked not runnable here."""
    commands: dict[str, bool] = {}
    for doc in DOCS:
        for command, not_runnable in doc_compose_commands((REPO / doc).read_text()):
            commands[command] = commands.get(command, True) and not_runnable
    return commands
