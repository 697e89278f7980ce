"""The rollout side of a user's own task and agent: a raising or NaN score dead-letters its group with
the reason and the worker goes on; an agent's reward (proxy report or last stdout line) reaches the task,
which accepts, combines or refuses it; components are logged; a plugin row travels whole."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from test_rollout_worker_loop import enqueue, pipeline, rollouts, stats, worker

from services.rollout_worker.agents import parse_agent_output, resolve_agent_command, stdout_reward
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient, serve
from services.rollout_worker.proxy_client import HttpProxyClient
from services.rollout_worker.runner import GroupFailed, GroupRunner
from services.rollout_worker.worker import reward_metrics
from shared.codec import decode_entry
from shared.codes import TASK_ERROR
from shared.config import RolloutConfig
from shared.keys import Keys
from shared.schemas import DeadLetter, PromptGroup, RolloutGroup
from shared.telemetry import read_metrics

HERE = Path(__file__).resolve().parent


@pytest.fixture
def rdb() -> redis.Redis:
    return fakeredis.FakeRedis()


@pytest.fixture
def k() -> Keys:
    return Keys(f"u{uuid.uuid4().hex[:8]}")


def group(task: str, row: dict[str, Any] | None = None, **kw: Any) -> PromptGroup:
    base: dict[str, Any] = {"group_id": "g1", "prompt_id": "p1", "task": task, "prompt": "q", "reference": "42",
                            "n_samples": 2, "enqueued_at": 1.0, "row": row}
    return PromptGroup(**{**base, **kw})


def run(fake: FakeProxy, g: PromptGroup, **cfg: Any) -> RolloutGroup:
    return asyncio.run(GroupRunner(FakeProxyClient(fake), RolloutConfig(**cfg), "w1").run(g))


def agent_script(tmp_path: Path, body: str) -> list[str]:
    """A black-box agent: one model call through its session URL (openai-free: plain httpx), then ``body``."""
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys, httpx\n"
        "task = json.loads(sys.stdin.read())\n"
        "base, key = os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY']\n"
        "h = {'Authorization': f'Bearer {key}'}\n"
        "r = httpx.post(base + '/chat/completions', json={'messages': task['messages']}, headers=h)\n"
        "reply = r.json()['choices'][0]['message']['content']\n" + body)
    return [sys.executable, str(script)]


def test_a_plugin_row_travels_whole_and_components_are_logged() -> None:
    row = {"prompt_id": "p1", "word": "cat"}
    rg = run(FakeProxy(reply=lambda sid, m: "cat" if "-s0-" in sid else "dog"), group("byo_tasks:EchoTask", row))
    assert rg.meta["rewards"] == [1.0, 0.2] and rg.meta["reward_components"] == {"exact": [1.0, 0.0],
                                                                                 "short": [1.0, 1.0]}
    assert reward_metrics(rg.meta) == {"rollout/reward/exact": 0.5, "rollout/reward/short": 1.0}


@pytest.mark.parametrize("task", ["byo_tasks:RaisingTask", "byo_tasks:NanTask"])
def test_a_raising_or_nan_score_fails_the_group_unretryable_naming_task_and_row(task: str) -> None:
    with pytest.raises(GroupFailed) as info:
        run(FakeProxy(), group(task, {"prompt_id": "row-3", "prompt": "q"}))
    f = info.value.failure
    assert f.code == TASK_ERROR and not f.retryable and not f.infrastructure
    assert task in f.message and "'row-3'" in f.message


def test_a_raising_score_dead_letters_its_group_with_the_reason_and_the_worker_goes_on(rdb: redis.Redis,
                                                                                        k: Keys) -> None:
    enqueue(rdb, k, 1, group_id="bad", task="byo_tasks:RaisingTask", row={"prompt_id": "p0", "prompt": "x"})
    enqueue(rdb, k, 1, group_id="good")  # a reverse group behind it
    pipeline(rdb, k, FakeProxy(reply=lambda sid, m: m[0]["content"].split()[-1][::-1]), retries=2, rounds=2)
    (dead,) = [decode_entry(f, DeadLetter) for _, f in rdb.xrange(k.dead)]
    assert dead.reason == TASK_ERROR and "KeyError" in dead.error and "byo_tasks:RaisingTask" in dead.error
    assert [(g.group_id, g.status) for g in rollouts(rdb, k)] == [("bad", "failed"), ("good", "completed")]
    assert stats(rdb, k)["groups_dead_lettered"] == 1


@pytest.mark.parametrize(("task", "rewards", "accepted", "refused"), [
    ("byo_tasks:AgentCombined", [0.9, 0.9], 2, 0),  # 0.5 * 0.8 + 0.5 * own
    ("byo_tasks:AgentAccepted", [0.8, 0.8], 2, 0),
    ("byo_tasks:AgentRefused", [0.5, 0.5], 0, 2),  # score alone; the report only counted
])
def test_an_agents_proxy_report_is_offered_to_the_task(tmp_path: Path, task: str, rewards: list[float],
                                                       accepted: int, refused: int) -> None:
    command = agent_script(tmp_path, "httpx.post(base + '/reward', json={'reward': 0.8, 'components': {'t': 1}}, "
                                     "headers=h).raise_for_status()\nprint(reply)\n")
    fake = FakeProxy(reply=lambda sid, m: "42", api_key="k1")
    with serve(fake) as url:
        rg = asyncio.run(GroupRunner(HttpProxyClient(url, "k1"), RolloutConfig(agent_command=command), "w1")
                         .run(group(task)))
    assert rg.meta["rewards"] == pytest.approx(rewards)
    assert rg.meta["agent_rewards"] == {"accepted": accepted, "refused": refused}
    assert reward_metrics(rg.meta)["rollout/agent_rewards_refused"] == refused


def test_a_stdout_reward_wins_over_the_proxy_report_and_a_report_for_another_session_is_refused(tmp_path: Path) -> None:
    body = ("other = httpx.post(base.replace(os.environ['DRESSAGE_SESSION_ID'], 'someone-else') + '/reward', "
            "json={'reward': 1.0}, headers=h)\n"
            "assert other.status_code == 401, other.status_code\n"  # the fake's rule: token of another session
            "httpx.post(base + '/reward', json={'reward': 0.1}, headers=h)\n"
            "print(reply)\nprint(json.dumps({'reward': 0.6}))\n")
    fake = FakeProxy(reply=lambda sid, m: "42", api_key="k1")
    with serve(fake) as url:
        rg = asyncio.run(GroupRunner(HttpProxyClient(url, "k1"), RolloutConfig(agent_command=agent_script(tmp_path, body)),
                                     "w1").run(group("byo_tasks:AgentAccepted")))
    assert rg.meta["rewards"] == [0.6, 0.6]


def test_stdout_reward_lines_are_parsed_and_bad_ones_fail_the_trajectory() -> None:
    assert parse_agent_output(b'4821\n{"reward": 1, "components": {"a": 0.5}}') == "4821"
    report = stdout_reward(b'4821\n{"reward": 1, "components": {"a": 0.5}}', "s")
    assert report is not None and (report.reward, report.components, report.source) == (1.0, {"a": 0.5}, "stdout")
    assert stdout_reward(b'{"reply": "x", "reward": 0.25}', "s").reward == 0.25  # type: ignore[union-attr]  # one object
    assert stdout_reward(b"plain text only", "s") is None
    with pytest.raises(TrajectoryFailed) as info:
        stdout_reward(b'x\n{"reward": "high"}', "s")
    assert info.value.code == "agent_reward_invalid" and not info.value.infrastructure


def test_infrastructure_failures_of_an_agent_stay_retryable_never_a_zero_reward(tmp_path: Path) -> None:
    command = agent_script(tmp_path, "print(json.dumps({'error': 'upstream_unavailable'}))\nsys.exit(3)\n")
    with serve(FakeProxy(reply=lambda sid, m: "42")) as url, pytest.raises(GroupFailed) as info:
        asyncio.run(GroupRunner(HttpProxyClient(url), RolloutConfig(agent_command=command), "w1")
                    .run(group("byo_tasks:AgentAccepted")))
    assert info.value.failure.infrastructure  # the worker keeps the entry pending: no sample, no attempt spent


def test_agent_commands_resolve_in_the_environment_and_the_project(tmp_path: Path) -> None:
    assert resolve_agent_command(["python", "a.py"]) == [sys.executable, "a.py"]
    assert resolve_agent_command(["bin/agent", "-v"], tmp_path) == [str(tmp_path / "bin/agent"), "-v"]
    assert resolve_agent_command(["node", "a.js"]) == ["node", "a.js"]


def test_reward_metrics_reach_the_metrics_stream(rdb: redis.Redis, k: Keys) -> None:
    enqueue(rdb, k, 1, task="byo_tasks:EchoTask", row={"prompt_id": "p0", "word": "cat"})
    worker(rdb, k, FakeProxy(reply=lambda sid, m: "cat")).run(burst=True)
    rows = [m for m in read_metrics(rdb, k) if m.get("service") == "rollout-worker"]
    assert rows and rows[-1]["rollout/reward/exact"] == 1.0
