"""The CPU profile of docker-compose.yml under a real Docker engine, in the order a user meets it: up,
status, scale, redis-cli, crashes, down + up, down -v. One stack for the whole module (conftest.py:
``stack``); the tests run in file order and each leaves it running for the next."""

from __future__ import annotations

import json
import re
import time

import pytest
from compose_stack import FULL, POLL_S, PREFIX, REPO, TIER, Stack, doc_redis_commands
from waits import wait_for

from tools.monitor.status import SERVICES

pytestmark = pytest.mark.timeout(3600)
CONFIG = "configs/cpu-demo.yaml"  # docker-compose.yml's default DRESSAGE_CONFIG
# The checker and the chaos tests' history module it imports, side by side at / in the `status` container
CHECK = ["-v", f"{REPO / 'tests/compose/history_check.py'}:/history_check.py:ro",
         "-v", f"{REPO / 'tests/chaos/history.py'}:/history.py:ro", "--entrypoint", "python"]

# Both tiers: the trainer outlasts every check. The demo's config stops it at 60 steps, which a fast
# machine reaches before the redis-cli and no-restart checks run; a stopped trainer stops the pacing, the
# collector then trims the prompts stream to nothing and the trainer's container is no longer running.
OVERRIDE = """
services:
  trainer:
    environment:
      DRESSAGE_TRAIN_MAX_STEPS: "100000"
"""
# The full tier also keeps every stream entry, so that the history checker sees each group's whole life
# (a group here lives well under a second, the collector trims every 10 s: no recorder could be sure to
# see it first). The short preset runs the default, trimming; `make compose-test` runs both presets.
FULL_OVERRIDE = """
  group-collector:
    environment:
      DRESSAGE_COLLECTOR_TRIM_INTERVAL_S: "0"
"""


def test_up_builds_and_trains_to_a_published_version(stack: Stack) -> None:
    override = stack.workdir / "tier.yml"
    override.write_text(OVERRIDE + (FULL_OVERRIDE if TIER == "full" else ""))
    stack.files.append(str(override))
    stack.timed("up --build", "docker compose up --build", "-d")
    t0 = time.monotonic()
    version = stack.wait_version(above=0)
    stack.timings["first version"] = time.monotonic() - t0
    assert version >= 1


def test_status_as_the_ops_user_shows_every_service_alive(stack: Stack) -> None:
    def all_alive() -> str | None:
        screen = stack.status()
        alive = {line.split()[0] for line in screen.splitlines() if "alive (beat" in line}
        return screen if set(SERVICES) <= alive and "(no heartbeat key)" not in screen else None

    screen = wait_for(all_alive, 120, "every service alive in `docker compose run --rm status`", period=5)
    assert "VERSION     current" in screen


def test_status_watch_refreshes_until_interrupted(stack: Stack) -> None:
    screens = stack.watch(seconds=15).count("LIVENESS")
    assert screens >= 2, screens


def test_status_as_the_ops_user_shows_the_engine_alive(stack: Stack) -> None:
    screen = stack.status()  # `status` holds no engine key: the engine's /health needs none
    assert re.search(r"ENGINES\s+http://engine:30000\s+alive", screen), screen


def test_redis_cli_as_the_ops_user_as_the_doc_writes_it(stack: Stack) -> None:
    out = stack.documented("docker compose exec -e REDISCLI_AUTH redis redis-cli --user ops XLEN dressage:prompts",
                           extra_env={"REDISCLI_AUTH": stack.secrets["REDIS_PASSWORD_OPS"]}, timeout=60)
    # XLEN counts what is still in the stream, and the collector trims every prompt the rollout group has
    # delivered and acknowledged: a healthy stack with nothing undelivered reads 0 (a fast machine does,
    # between two admissions). That prompts flowed through it is the stream's entries-added counter.
    assert out.stdout.strip().isdigit(), out.stdout
    info = json.loads(stack.redis_cli("--json", "XINFO", "STREAM", f"{PREFIX}:prompts"))
    fields = info if isinstance(info, dict) else dict(zip(info[::2], info[1::2], strict=True))
    assert int(fields["entries-added"]) > 0, fields


def test_no_service_restarted(stack: Stack) -> None:
    restarted = {}
    for service in ("redis", "engine", "proxy", "prompt-buffer", "rollout-worker", "group-collector", "trainer",
                    "eval-worker"):
        for container in stack.containers(service):
            state = stack.inspect(container)
            if state["RestartCount"] or not state["State"]["Running"]:
                restarted[state["Name"]] = (state["RestartCount"], state["State"]["Status"])
    assert not restarted, restarted  # e.g. a crash loop on a refused ACL command


@FULL
def test_scale_adds_consumers_to_the_rollout_group(stack: Stack) -> None:
    stack.timed("scale", "docker compose up -d --scale rollout-worker=3")
    assert len(stack.containers("rollout-worker")) == 3

    def active_consumers() -> int:
        text = stack.redis_cli("--json", "XINFO", "CONSUMERS", f"{PREFIX}:prompts", "rollout")
        return sum(c["idle"] < 30_000 for c in json.loads(text)) if text.strip() else 0

    wait_for(lambda: active_consumers() >= 3, 180, "3 rollout consumers active in the last 30 s", period=POLL_S)


# What each redis-cli command of docs/operations.md prints, by what the doc says of it. A command the
# doc gains without an entry here fails the test: the doc and this table cannot drift apart.
WRITES = ("HSET ", "XADD ")  # the doc says: the admin's; as `ops` they are refused
EXPECT: list[tuple[str, str]] = [  # (command prefix, regular expression its output must match)
    ("GET {p}:weights:latest", r'"version"'),
    ("XLEN {p}:weights:log", r"^[1-9]\d*$"),
    ("XLEN {p}:prompts", r"^\d+$"),
    ("XREVRANGE {p}:weights:log", r"version"),
    ("HGETALL {p}:collector:window", r"keep_versions"),
    ("HGETALL {p}:control", r"^.*$"),  # empty unless an operator or the window-controller set a knob
    ("HGETALL {p}:prompt_buffer:brake", r"^.*$"),  # written once the brake first acts
    ("HGETALL {p}:ops:degraded", r"^$"),  # `dressage up` only
    ("XINFO STREAM {p}:prompts", r"entries-added"),
    ("XINFO GROUPS {p}:prompts", r"rollout[\s\S]*lag"),
    ("XINFO CONSUMERS {p}:prompts rollout", r"idle"),
    ("XPENDING {p}:prompts rollout", r"^[\s\S]*$"),
    ("XRANGE {p}:prompts (", r"^[\s\S]*$"),
    ("XRANGE {p}:prompts - +", r"group_id[\s\S]*attempt"),  # in flight: never empty for long
    ("HGETALL {p}:stats", r"groups_produced"),
    ("HMGET {p}:stats", r"^\d+(\n\d*){0,4}$"),  # a counter not yet incremented prints an empty line
    ("XREVRANGE {p}:dead", r"^[\s\S]*$"),  # empty in a healthy run
    ("XRANGE {p}:metrics", r"service"),
    ("XREVRANGE {p}:metrics", r"time/wait_s"),
    ("KEYS {p}:health:*", r"health:trainer"),
    ("SCAN 0 MATCH {p}:health:*", r"health:trainer"),
    ("PTTL {p}:health:", r"^[1-9]\d*$"),
]


def _fill(command: str, stack: Stack) -> list[str]:
    """The doc's command with its placeholders filled from the running stack."""
    groups = json.loads(stack.redis_cli("--json", "XINFO", "GROUPS", f"{PREFIX}:prompts"))
    beat = stack.redis_cli("SCAN", "0", "MATCH", f"{PREFIX}:health:trainer:*", "COUNT", "10000").split()[-1]
    values = {"{p}": PREFIX, "<ms-60000>": str(int(time.time() * 1000) - 60_000),
              "<last-delivered-id>": groups[0]["last-delivered-id"],
              "<service>:<consumer>": beat.split(":health:", 1)[1], "<fields>": "kind prompt_group"}
    for key, value in values.items():
        command = command.replace(key, value)
    return command.split()


@FULL
def test_every_redis_cli_command_of_the_operations_doc_prints_what_it_says(stack: Stack) -> None:
    commands = doc_redis_commands((REPO / "docs/operations.md").read_text())
    assert len(commands) >= 20, commands
    wrong = {}
    for command in commands:
        if command.startswith(WRITES):
            out = stack.redis_cli(*_fill(command, stack))
            if "NOPERM" not in out:
                wrong[command] = f"a write as `ops` was not refused: {out[:200]}"
            if command.startswith("HSET "):  # the admin's knob: set, then removed again (config value)
                out = stack.redis_cli(*_fill(command, stack), user="default")
                stack.redis_cli("HDEL", f"{PREFIX}:control", "keep_versions", user="default")
                if not re.fullmatch(r"[01]", out.strip()):
                    wrong[command] = f"as admin: {out[:200]}"
            continue
        pattern = next((p for prefix, p in EXPECT if command.startswith(prefix)), None)
        if pattern is None:
            wrong[command] = "no expectation in tests/compose/test_stack.py EXPECT: add what the doc says it prints"
            continue
        for _ in range(3):  # a live pipeline: a stream may be empty for a moment
            out = stack.redis_cli(*_fill(command, stack)).strip()
            if "ERR" not in out and "NOPERM" not in out and re.search(pattern, out):
                break
            time.sleep(2)
        else:
            wrong[command] = out[:300]
    assert not wrong, json.dumps(wrong, indent=1)


@FULL
@pytest.mark.parametrize("service", ["trainer", "engine", "rollout-worker"])
def test_a_crashed_service_comes_back_and_training_resumes(stack: Stack, service: str) -> None:
    container = stack.containers(service)[0]
    before = stack.latest_version()
    t0 = time.monotonic()
    restarts = stack.crash(container)
    wait_for(lambda: stack.running_again(container, restarts), 120, f"{service} restarted by its restart policy",
             period=POLL_S)
    stack.wait_version(above=before + 2, timeout_s=600)
    stack.timings[f"{service} crash to +2 versions"] = time.monotonic() - t0


@FULL
def test_compose_kill_is_an_operator_stop_and_up_brings_the_service_back(stack: Stack) -> None:
    (container,) = stack.containers("eval-worker")
    stack.documented("docker compose kill", "eval-worker", timeout=60)
    time.sleep(10)
    assert not stack.inspect(container)["State"]["Running"]  # Docker restarts no container an operator killed
    stack.documented("docker compose up -d", "eval-worker", timeout=300)
    assert wait_for(lambda: stack.inspect(container)["State"]["Running"], 120, "eval-worker running again", period=POLL_S)


@FULL
def test_nothing_lost_or_trained_twice_and_no_prompt_skipped(stack: Stack) -> None:
    verdict = history_check(stack)
    assert verdict["ok"] and verdict["prompts_in_order"], verdict


def history_check(stack: Stack) -> dict[str, object]:
    out = stack.compose("run", "--rm", "-T", *CHECK, "status", "/history_check.py", CONFIG, timeout=300,
                        check=False)
    try:
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        return {"ok": False, "exit": out.returncode, "output": (out.stdout + out.stderr)[-3000:]}


@FULL
def test_down_then_up_resumes_from_the_volumes(stack: Stack) -> None:
    before = stack.latest_version()
    stack.timed("down", "docker compose down")
    assert not stack.containers("trainer", all_states=True)
    stack.timed("up again", "docker compose up -d")
    after = stack.wait_version(above=before + 1)
    versions = stack.published_versions()
    assert versions == sorted(set(versions)) and versions[-1] >= after > before, versions[-20:]
    verdict = history_check(stack)
    assert verdict["ok"] and verdict["prompts_in_order"], verdict


def test_down_v_leaves_nothing_behind(stack: Stack) -> None:
    stack.down()
    assert stack.leftovers() == []
