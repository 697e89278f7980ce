"""End to end through the REAL engine and proxy (subprocesses, tiny untrained model) on a real redis-server.

A burst worker turns prompt groups into rollout groups whose every token carries the version that
produced it; a black-box agent whose trajectory crosses a weight update is rejected by the proxy
(partial_rollout_staleness_exceeded, max_partial_rollout_preempts = 0), the collector's retry
policy (a real group-collector on the same Redis) re-enqueues it whole as attempt 1 on the new
version, and the rejection is counted once. A proxy whose engine is down holds the worker's group
pending — no attempt spent, no new group taken — until the engine comes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from paths import REPO

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from shared.codec import decode_entry, encode_entry
from shared.codes import STALENESS_EXCEEDED
from shared.config import CollectorConfig, StalenessSection
from shared.keys import GROUP_ROLLOUT, Keys
from shared.modeling import ensure_model
from shared.redisproc import RedisProcess, free_port
from shared.schemas import DeadLetter, PromptGroup, RolloutGroup, WeightVersion
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.streams import ensure_group
from shared.versionbus import publish_version
from shared.versions import real_version

ECHO_DIR = REPO / "examples" / "agents"

# A black-box agent that makes two model calls in one session and, between them, waits for the
# test's go-ahead file: the test publishes a new weight version in that gap.
TWO_CALL_AGENT = f"""
import json, os, sys, time, urllib.error
sys.path.insert(0, {str(ECHO_DIR)!r})
from echo_agent import chat, error_code
marks, go = sys.argv[1], sys.argv[2]
task = json.loads(sys.stdin.read())
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
try:
    first = chat(base, key, task["messages"], task["max_new_tokens"], task["temperature"])
    open(os.path.join(marks, os.environ["DRESSAGE_SESSION_ID"]), "w").close()
    deadline = time.time() + 60
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.05)
    msgs = task["messages"] + [{{"role": "assistant", "content": first}}, {{"role": "user", "content": "again"}}]
    reply = chat(base, key, msgs, task["max_new_tokens"], task["temperature"])
except urllib.error.HTTPError as exc:
    code, message = error_code(exc)
    print(json.dumps({{"error": code, "message": message}}))
    sys.exit(3)
print(json.dumps({{"reply": reply}}))
"""


@dataclass
class Stack:
    server: RedisProcess
    keys: Keys
    model_dir: Path
    proxy_url: str
    root: Path
    procs: list[subprocess.Popen[bytes]]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "REDIS_URL": self.server.url, "DRESSAGE_REDIS_PREFIX": self.keys.prefix,
                "DRESSAGE_MODEL_PATH": str(self.model_dir), **extra}

    def worker(self, name: str, **cfg: str) -> subprocess.Popen[bytes]:
        env = self.env(DRESSAGE_ROLLOUT_PROXY_URL=self.proxy_url, DRESSAGE_ROLLOUT_BLOCK_MS="100",
                       **{f"DRESSAGE_ROLLOUT_{k.upper()}": v for k, v in cfg.items()})
        log = (self.root / f"{name}.log").open("ab")
        return subprocess.Popen([sys.executable, "-m", "services.rollout_worker", "--burst", "--consumer", name],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def proxy_version(self) -> str | None:
        return httpx.get(f"{self.proxy_url}/health", timeout=10).json().get("version")


def start(stack_root: Path, name: str, argv: list[str], env: dict[str, str], health: str) -> subprocess.Popen[bytes]:
    log = (stack_root / f"{name}.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (stack_root / f"{name}.log").read_text()
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{name} did not become healthy"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e")
    model_dir = root / "model"
    ensure_model(model_dir, "reverse")  # untrained tiny model: replies are noise, versions are real
    keys = Keys(f"e2e{uuid.uuid4().hex[:8]}")
    st = Stack(redis_server, keys, model_dir, "", root, [])
    engine_port, proxy_port = free_port(), free_port()
    try:
        st.procs.append(start(root, "engine", ["services.engine", "--port", str(engine_port), "--weight-version", "0"],
                              st.env(DRESSAGE_ENGINE_NUM_THREADS="1"), f"http://127.0.0.1:{engine_port}/health"))
        st.proxy_url = f"http://127.0.0.1:{proxy_port}"
        st.procs.append(start(root, "proxy", ["services.proxy", "--port", str(proxy_port)],
                              st.env(DRESSAGE_PROXY_ENGINES=f'["http://127.0.0.1:{engine_port}"]',
                                     DRESSAGE_PROXY_MAX_PARTIAL_ROLLOUT_PREEMPTS="0"),
                              f"{st.proxy_url}/health"))
        yield st
    finally:
        for p in reversed(st.procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def enqueue(r: redis.Redis, keys: Keys, groups: list[dict[str, Any]]) -> None:
    ensure_group(r, keys.prompts, GROUP_ROLLOUT)
    for g in groups:
        r.xadd(keys.prompts, encode_entry(PromptGroup(enqueued_at=time.time(), **g)))


def collect(r: redis.Redis, keys: Keys, max_retries: int) -> None:
    """One burst of the real group-collector (window off): the retry policy for failed groups."""
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(None))), 1000, max_retries)
    GroupCollector(r, keys, core, CollectorConfig(trim_interval_s=0), StalenessSection(keep_versions=0), consumer="c-e2e",
                   burst=True).run()


def rounds(stack: Stack, r: redis.Redis, name: str, max_retries: int, done: Any, limit: int = 6,
           **cfg: str) -> None:
    """Worker burst, collector burst, until ``done()`` (each failed attempt comes back once)."""
    for _ in range(limit):
        assert stack.worker(name, max_retries=str(max_retries), **cfg).wait(240) == 0, stack.log(name)
        collect(r, stack.keys, max_retries)
        if done():
            return
    raise AssertionError(f"not done after {limit} rounds: {stack.log(name)[-3000:]}")


def new_rollouts(r: redis.Redis, keys: Keys, after: str = "-") -> list[RolloutGroup]:
    return [decode_entry(f, RolloutGroup) for _, f in r.xrange(keys.rollouts, min=after)]


def test_worker_rolls_groups_out_through_the_real_proxy_with_per_token_versions(
        stack: Stack, redis_client: redis.Redis) -> None:
    version = stack.proxy_version() or "0"
    tail = f"({int(time.time() * 1000)}"  # only this test's entries
    enqueue(redis_client, stack.keys, [
        {"group_id": "rev-1", "prompt_id": "r1", "task": "reverse", "prompt": "reverse 4821", "reference": "1284",
         "n_samples": 3},
        {"group_id": "guess-1", "prompt_id": "q1", "task": "guess", "prompt": "guess 20-34",
         "reference": {"low": 20, "high": 34, "secret": 21}, "n_samples": 2}])
    proc = stack.worker("w-e2e")
    assert proc.wait(240) == 0, stack.log("w-e2e")
    out = {g.group_id: g for g in new_rollouts(redis_client, stack.keys, tail)}
    assert set(out) == {"rev-1", "guess-1"} and all(g.status == "completed" for g in out.values()), stack.log("w-e2e")
    for g in out.values():
        assert len(g.meta["sessions"]) == g.meta["n_samples"] and {s.traj_id for s in g.samples} == set(g.meta["sessions"])
        for sid in g.meta["sessions"]:
            segs = sorted((s for s in g.samples if s.traj_id == sid), key=lambda s: s.segment_index)
            assert all(s.reward == 0.0 for s in segs[:-1]) and 0.0 <= segs[-1].reward <= 1.0
            for s in segs:
                loss = [v for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m]
                context = [v for v, m in zip(s.token_versions, s.loss_mask, strict=True) if not m]
                assert loss and set(loss) == {version} and set(context) == {"-1"}
                assert s.end_version == version and not s.partial_rollout and len(s.logprobs) == len(s.token_ids)
            assert httpx.get(f"{stack.proxy_url}/v1/sessions/{sid}", timeout=10).status_code == 404  # deleted
    assert out["guess-1"].meta["turns"][0] >= 1
    assert redis_client.xpending(stack.keys.prompts, GROUP_ROLLOUT)["pending"] == 0


def test_trajectory_crossing_a_weight_update_is_rejected_retried_whole_and_counted_once(
        stack: Stack, redis_client: redis.Redis, tmp_path: Path) -> None:
    marks, go = tmp_path / "marks", tmp_path / "go"
    marks.mkdir()
    agent = tmp_path / "two_call_agent.py"
    agent.write_text(TWO_CALL_AGENT)
    before = stack.proxy_version() or "0"
    after = str(int(before) + 1)
    tail = f"({int(time.time() * 1000)}"
    enqueue(redis_client, stack.keys, [{"group_id": "span-1", "prompt_id": "s1", "task": "reverse",
                                        "prompt": "reverse 123", "reference": "321", "n_samples": 2}])
    proc = stack.worker("w-span", agent_command=f'["{sys.executable}", "{agent}", "{marks}", "{go}"]')
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < 2:  # both trajectories made their first call on `before`
        assert proc.poll() is None and time.monotonic() < deadline, stack.log("w-span")
        time.sleep(0.05)
    publish_version(redis_client, stack.keys, WeightVersion(version=after, path=str(stack.model_dir), step=1,
                                                            published_at=time.time()))
    while stack.proxy_version() != after:
        assert time.monotonic() < deadline, stack.log("proxy")
        time.sleep(0.05)
    go.touch()
    assert proc.wait(240) == 0, stack.log("w-span")
    stats_before = {k.decode(): int(v) for k, v in redis_client.hgetall(stack.keys.stats).items()}
    collect(redis_client, stack.keys, max_retries=2)  # the failed attempt 0 -> attempt 1
    assert stack.worker("w-span2", agent_command=f'["{sys.executable}", "{agent}", "{marks}", "{go}"]').wait(240) == 0
    out = new_rollouts(redis_client, stack.keys, tail)
    assert [(g.attempt, g.status) for g in out] == [(0, "failed"), (1, "completed")], stack.log("w-span2")
    assert out[0].error_code == STALENESS_EXCEEDED and out[0].retryable
    assert {real_version(v) for s in out[1].samples for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m} \
        == {after}  # attempt 1 ran entirely on the new weights
    prompt = [decode_entry(f, PromptGroup) for _, f in redis_client.xrange(stack.keys.prompts, min=tail)][-1]
    assert [(h.attempt, h.reason) for h in prompt.retry_history] == [(0, "failed")]
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(stack.keys.stats).items()}
    assert stats.get("partial_rollout_rejected_groups", 0) - stats_before.get("partial_rollout_rejected_groups", 0) == 1
    assert stats.get("partial_rollout_rejected_samples", 0) - stats_before.get("partial_rollout_rejected_samples", 0) == 2


def test_weight_updates_under_load_lose_and_double_nothing(stack: Stack, redis_client: redis.Redis) -> None:
    """Versions published while multi-turn groups run: each attempt ends once, completed ones within the span."""
    tail = f"({int(time.time() * 1000)}"
    ids = [f"load-{i}" for i in range(8)]
    enqueue(redis_client, stack.keys, [
        {"group_id": gid, "prompt_id": gid, "task": "guess", "prompt": f"guess {10 + i}-{20 + i}",
         "reference": {"low": 10 + i, "high": 20 + i, "secret": 15 + i}, "n_samples": 2} for i, gid in enumerate(ids)])
    proc = stack.worker("w-load", concurrency="3", max_retries="3")
    version = int(stack.proxy_version() or "0")
    for step in range(1, 4):  # three updates while the worker runs: at most 3 failed attempts per group
        time.sleep(0.4)
        publish_version(redis_client, stack.keys, WeightVersion(version=str(version + step), path=str(stack.model_dir),
                                                                step=version + step, published_at=time.time()))
    assert proc.wait(240) == 0, stack.log("w-load")
    collect(redis_client, stack.keys, max_retries=3)

    def settled() -> bool:
        last = {g.group_id: g for g in new_rollouts(redis_client, stack.keys, tail)}
        return set(last) == set(ids) and all(g.status == "completed" for g in last.values())

    if not settled():  # retries run with no update in flight: each completes
        rounds(stack, redis_client, "w-load2", 3, settled, concurrency="3")
    out = new_rollouts(redis_client, stack.keys, tail)
    for gid in ids:
        mine = [g for g in out if g.group_id == gid]
        assert [g.attempt for g in mine] == list(range(len(mine)))  # no attempt lost or doubled
        assert all(g.status == "failed" and g.retryable for g in mine[:-1])
        last = mine[-1]
        assert last.status == "completed", last  # never dead-lettered: three updates cost at most three attempts
        for s in last.samples:  # max_partial_rollout_preempts = 0: one real version per completed trajectory
            assert len({real_version(v) for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m}) == 1
    assert redis_client.xpending(stack.keys.prompts, GROUP_ROLLOUT)["pending"] == 0
    retried = sum(g.status == "failed" for g in out)
    print(f"weight updates under load: {len(ids)} groups, {retried} failed attempts retried")


def test_engine_down_holds_the_group_without_spending_an_attempt_until_it_comes_back(
        stack: Stack, redis_client: redis.Redis, tmp_path: Path) -> None:
    """A real proxy whose engine is down (connection refused -> 503): the worker keeps the group pending
    and takes no new group; when the engine starts, attempt 0 of every group completes, nothing dead."""
    engine_port, proxy_port = free_port(), free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    keys = Keys(f"down{uuid.uuid4().hex[:8]}")
    env = {**stack.env(), "DRESSAGE_REDIS_PREFIX": keys.prefix}
    procs = [start(tmp_path, "proxy", ["services.proxy", "--port", str(proxy_port)],
                   {**env, "DRESSAGE_PROXY_ENGINES": f'["http://127.0.0.1:{engine_port}"]'}, f"{proxy_url}/health")]
    try:
        enqueue(redis_client, keys, [{"group_id": f"down-{i}", "prompt_id": f"d{i}", "task": "reverse",
                                      "prompt": "reverse 12", "reference": "21", "n_samples": 1} for i in range(3)])
        log = (tmp_path / "worker.log").open("ab")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.rollout_worker", "--consumer", "w-down"], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env={**env, "DRESSAGE_ROLLOUT_PROXY_URL": proxy_url, "DRESSAGE_ROLLOUT_MAX_RETRIES": "0",
                                           "DRESSAGE_ROLLOUT_BLOCK_MS": "100", "DRESSAGE_ROLLOUT_UPSTREAM_BACKOFF_MAX_S": "1"}))
        worker_log = tmp_path / "worker.log"
        deadline = time.monotonic() + 120
        while worker_log.read_text().count("upstream down: group kept pending") < 3:  # held and probed again
            assert procs[-1].poll() is None and time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.1)
        assert redis_client.xlen(keys.rollouts) == 0 and redis_client.xlen(keys.dead) == 0
        assert redis_client.xpending(keys.prompts, GROUP_ROLLOUT)["pending"] == 1  # one held, no new one taken
        procs.insert(0, start(tmp_path, "engine", ["services.engine", "--port", str(engine_port), "--weight-version", "0"],
                              {**env, "DRESSAGE_ENGINE_NUM_THREADS": "1"}, f"http://127.0.0.1:{engine_port}/health"))
        while redis_client.xlen(keys.rollouts) < 3:
            assert procs[-1].poll() is None and time.monotonic() < deadline + 120, worker_log.read_text()
            time.sleep(0.1)
        out = new_rollouts(redis_client, keys)
        assert sorted((g.group_id, g.attempt, g.status) for g in out) == [
            (f"down-{i}", 0, "completed") for i in range(3)], worker_log.read_text()[-3000:]
        assert [decode_entry(f, DeadLetter) for _, f in redis_client.xrange(keys.dead)] == []
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
