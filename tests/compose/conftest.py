"""The compose tier: docker-compose.yml built and run under a real Docker engine, checked as a user would.

``DRESSAGE_COMPOSE_TIER`` picks the preset:
* ``short`` (the default, what `make test` runs): images, `up --build`, a published version, every
  service alive in `dressage status`, `down -v` leaving nothing behind;
* ``full``: the same plus `status --watch`, scaling, the redis-cli commands of docs/operations.md,
  crashes of the trainer, the engine and a worker, `docker compose kill`, `down` + `up` resuming from
  the volumes, and the history checker over everything the streams carried (the collector's trimming
  off, so that they carry everything). `make compose-test` runs the short preset, then the full one.
Where no Docker engine can run (no root, no cgroups: scripts/docker-engine.sh exits 77) every test of
the tier is skipped with that one-line reason; any other failure to get an engine fails. The engine is
started here when none runs (and stopped at the end, unless DRESSAGE_COMPOSE_KEEP_ENGINE=1).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from compose_stack import CANNOT_RUN, REPO, TIER, Stack, run
from summaries import write_summary

_started_at = time.monotonic()
_outcomes: dict[str, str] = {}  # test name -> passed / failed / skipped
_timings: list[dict[str, float]] = []  # the stack's phases


@pytest.fixture(scope="session")
def engine() -> Iterator[None]:
    """A Docker engine that answers; started (and later stopped) here when none runs."""
    was_running = subprocess.run(["docker", "info"], capture_output=True).returncode == 0 \
        if _has_docker_cli() else False
    out = subprocess.run([str(REPO / "scripts/docker-engine.sh")], capture_output=True, text=True, timeout=900)
    if out.returncode == CANNOT_RUN:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, f"scripts/docker-engine.sh exited {out.returncode}: {out.stderr[-2000:]}"
    yield
    pidfile = Path(os.environ.get("DOCKERD_PIDFILE", "/run/dressage-dockerd.pid"))
    if not was_running and os.environ.get("DRESSAGE_COMPOSE_KEEP_ENGINE") != "1" and pidfile.exists():
        subprocess.run(["kill", pidfile.read_text().strip()], check=False)


def _has_docker_cli() -> bool:
    return subprocess.run(["sh", "-c", "command -v docker"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def stack(engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The project's stack with generated secrets and the local images; `down -v` at the end, whatever happened."""
    workdir = tmp_path_factory.mktemp("compose")
    secrets_file, images_file = workdir / "secrets.env", workdir / "images.env"
    run([str(REPO / "scripts/compose-secrets.sh"), str(secrets_file)])
    secrets = dict(line.split("=", 1) for line in secrets_file.read_text().splitlines() if "=" in line
                   and not line.startswith("#"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DRESSAGE_", "REDIS_"))}
    env["COMPOSE_ENV_FILES"] = ",".join(str(p) for p in (REPO / ".env", secrets_file, images_file))
    s = Stack(workdir=workdir, env=env, secrets=secrets)
    t0 = time.monotonic()
    run([str(REPO / "scripts/images.sh"), str(images_file)], timeout=3600)
    s.timings["images"] = time.monotonic() - t0
    _timings.append(s.timings)
    try:
        yield s
    finally:
        if s.leftovers():
            s.down()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.nodeid.split("::")[-1]] = report.outcome


def summary_line() -> str | None:
    """One line: the preset, the checks that passed, how long, where the time went (None: no check ran)."""
    if not _outcomes:
        return None
    ran = {k: v for k, v in _outcomes.items() if v != "skipped"}
    failed = [k for k, v in ran.items() if v == "failed"]
    phases = ", ".join(f"{k} {v:.0f}s" for t in _timings for k, v in t.items())
    verdict = f"FAILED: {', '.join(failed)}" if failed else ("ok" if ran else "nothing ran")
    return (f"compose tier ({TIER}): {len(ran) - len(failed)}/{len(ran)} checks passed, "
            f"{len(_outcomes) - len(ran)} skipped, {time.monotonic() - _started_at:.0f}s: {verdict} [{phases}]")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Leave the line where tests/conftest.py prints it: the test process that ran the tier may be an xdist
    worker, whose terminal nobody sees."""
    line = summary_line()
    if line is not None:
        write_summary(session.config, "compose", line)
