"""Every compose command of README.md, docs/operations.md and docs/gpu.md is run by a test, or its line in
the doc says it is not runnable here (tests/compose_docs.py)."""

from __future__ import annotations

import re

from compose_docs import doc_compose_commands, documented_commands
from paths import REPO

# Where a documented command is run: the compose tier and the config tests call it by its doc string
# (`Stack.documented("docker compose ...")`, a parametrised string); scripts/images.sh runs the build.
RUNNERS = [*sorted((REPO / "tests/compose").glob("*.py")), REPO / "tests/integration/test_compose.py"]
BY_SCRIPT = {"docker compose build": ("scripts/images.sh", r"\bbuild --quiet")}


def commands_run_by_tests() -> set[str]:
    return {m for path in RUNNERS for m in re.findall(r'"(docker compose [^"]+)"', path.read_text())}


def test_every_documented_compose_command_is_run_or_marked_not_runnable() -> None:
    ran = commands_run_by_tests()
    for command, (script, pattern) in BY_SCRIPT.items():
        assert re.search(pattern, (REPO / script).read_text()), f"{script} no longer runs {command!r}"
        ran.add(command)
    documented = documented_commands()
    assert len(documented) >= 12, documented  # the parser still finds the docs' commands
    missing = sorted(c for c, not_runnable in documented.items() if not not_runnable and c not in ran)
    assert not missing, f"documented compose commands no test runs (run them, or mark 'not runnable here'): {missing}"


def test_tests_run_only_commands_the_docs_hold() -> None:
    stale = sorted(commands_run_by_tests() - set(documented_commands()))
    assert not stale, f"tests run compose commands no doc shows any more: {stale}"


def test_the_gpu_profile_is_marked_not_runnable_here() -> None:
    documented = documented_commands()
    gpu_up = [c for c in documented if "--profile gpu" in c and " up" in c]
    assert gpu_up and all(documented[c] for c in gpu_up), gpu_up


def test_parser_reads_code_lines_and_inline_spans() -> None:
    text = "\n".join([
        "Run `docker compose up -d` to start; `docker compose --profile gpu` names the file.",
        "A span may wrap: `REDISCLI_AUTH=$X docker compose exec -e REDISCLI_AUTH",
        "redis redis-cli XLEN k`.",
        "```",
        "export COMPOSE_ENV_FILES=.env            # not a compose command",
        "docker compose  run --rm status      # `status` as ops",
        "docker compose -f a.yml --profile gpu up --build   # needs GPUs: not runnable here",
        "```",
    ])
    assert doc_compose_commands(text) == [
        ("docker compose run --rm status", False),
        ("docker compose -f a.yml --profile gpu up --build", True),
        ("docker compose up -d", False),
        ("docker compose exec -e REDISCLI_AUTH redis redis-cli XLEN k", False),
    ]
