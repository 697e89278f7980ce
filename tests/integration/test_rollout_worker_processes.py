"""Rollout workers as real processes on a real redis-server, against the fake proxy served on loopback.

Kills, pauses and signals are real (SIGKILL, SIGSTOP/SIGCONT, SIGTERM); the proxy is the in-process
fake so the tests control how long a group takes and what fails (the real proxy: test_rollout_worker_e2e).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from paths import REPO
from waits import wait_for

from services.rollout_worker.fake_proxy import FakeProxy, serve
from shared.codec import decode_entry, encode_entry
from shared.keys import GROUP_ROLLOUT, Keys
from shared.redisproc import RedisProcess
from shared.schemas import PromptGroup, RolloutGroup
from shared.streams import ensure_group


def solve(sid: str, msgs: list[dict[str, str]]) -> str:
    return msgs[0]["content"].split()[1][::-1]


class Workers:
    """Starts ``dressage rollout-worker`` processes for one test and cleans up after it."""

    def __init__(self, server: RedisProcess, keys: Keys, proxy_url: str, logs: Path) -> None:
        self.server, self.keys, self.proxy_url, self.logs = server, keys, proxy_url, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, consumer: str, *args: str, **cfg: Any) -> subprocess.Popen[bytes]:
        env = {**os.environ, "REDIS_URL": self.server.url, "DRESSAGE_REDIS_PREFIX": self.keys.prefix,
               "DRESSAGE_ROLLOUT_PROXY_URL": self.proxy_url, "DRESSAGE_ROLLOUT_BLOCK_MS": "100",
               "DRESSAGE_OPS_HEARTBEAT_TTL_S": "3"}
        env.update({f"DRESSAGE_ROLLOUT_{k.upper()}": str(v) for k, v in cfg.items()})
        log = (self.logs / f"{consumer}.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "services.rollout_worker", "--consumer", consumer, *args],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[consumer] = proc
        return proc

    def log(self, consumer: str) -> str:
        return (self.logs / f"{consumer}.log").read_text()

    def wait_alive(self, r: redis.Redis, *consumers: str) -> None:
        wait_for(lambda: all(r.exists(self.keys.health("rollout-worker", c)) for c in consumers), 30,
                 "every worker's heartbeat", why=lambda: "\n".join(self.log(c) for c in consumers))

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)




@pytest.fixture
def fake() -> FakeProxy:
    return FakeProxy(reply=solve, version="1")


@pytest.fixture
def workers(redis_server: RedisProcess, keys: Keys, fake: FakeProxy, tmp_path: Path) -> Iterator[Workers]:
    with serve(fake) as url:
        w = Workers(redis_server, keys, url, tmp_path)
        try:
            yield w
        finally:
            w.cleanup()


def enqueue(r: redis.Redis, keys: Keys, n: int, **kw: Any) -> list[PromptGroup]:
    ensure_group(r, keys.prompts, GROUP_ROLLOUT)
    groups = []
    for i in range(n):
        digits = str(100 + i)
        g = PromptGroup(**{"group_id": f"g{i}", "prompt_id": f"p{i}", "task": "reverse", "prompt": f"reverse {digits}",
                           "reference": digits[::-1], "n_samples": 2, "enqueued_at": time.time(), **kw})
        r.xadd(keys.prompts, encode_entry(g))
        groups.append(g)
    return groups


def rollouts(r: redis.Redis, keys: Keys) -> list[RolloutGroup]:
    return [decode_entry(f, RolloutGroup) for _, f in r.xrange(keys.rollouts)]


def pending(r: redis.Redis, keys: Keys) -> int:
    return int(r.xpending(keys.prompts, GROUP_ROLLOUT)["pending"])


def wait_idle(r: redis.Redis, keys: Keys, ms: int) -> None:
    """Until the one pending prompt entry has been idle for ``ms`` (its owner is dead or frozen)."""
    wait_for(lambda: r.xpending_range(keys.prompts, GROUP_ROLLOUT, min="-", max="+", count=1)[0]
             ["time_since_delivered"] > ms, 30, "the pending prompt idle")


def in_flight(fake: FakeProxy) -> bool:
    """A model call is in progress (these tests have one group in the fake at a time)."""
    return fake.active > 0


def test_three_workers_share_the_load_and_each_group_is_handed_off_once(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.delay_s = 0.15
    names = ["w1", "w2", "w3"]
    for n in names:
        workers.start(n)
    ensure_group(redis_client, keys.prompts, GROUP_ROLLOUT)
    workers.wait_alive(redis_client, *names)
    enqueue(redis_client, keys, 12)
    wait_for(lambda: len(rollouts(redis_client, keys)) >= 12, 60,
             why=lambda: workers.log("w1"))
    for n in names:
        workers.procs[n].send_signal(signal.SIGTERM)
    assert [workers.procs[n].wait(30) for n in names] == [0, 0, 0]
    out = rollouts(redis_client, keys)
    assert sorted(g.group_id for g in out) == sorted(f"g{i}" for i in range(12))  # each exactly once
    assert all(g.status == "completed" and g.meta["rewards"] == [1.0, 1.0] for g in out)
    per_worker = {n: sum(g.meta["worker"] == n for g in out) for n in names}
    assert all(v >= 1 for v in per_worker.values()), per_worker
    assert pending(redis_client, keys) == 0


def test_group_of_a_sigkilled_worker_is_reclaimed_and_handed_off_once(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.delay_s = 1.0
    enqueue(redis_client, keys, 1)
    victim = workers.start("victim", claim_idle_ms=600_000)
    wait_for(lambda: in_flight(fake), 30,
             why=lambda: workers.log("victim"))
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert pending(redis_client, keys) == 1 and rollouts(redis_client, keys) == []
    wait_idle(redis_client, keys, 600)
    rescuer = workers.start("rescuer", "--burst", claim_idle_ms=500)
    assert rescuer.wait(60) == 0, workers.log("rescuer")
    out = rollouts(redis_client, keys)
    assert [(g.group_id, g.attempt, g.status, g.meta["worker"]) for g in out] == [("g0", 0, "completed", "rescuer")]
    assert pending(redis_client, keys) == 0
    assert "reclaimed 1 idle entries" in workers.log("rescuer")


def test_paused_worker_resumed_after_a_reclaim_does_not_hand_off_a_second_copy(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.delay_s = 1.0
    enqueue(redis_client, keys, 1)
    sleeper = workers.start("sleeper", claim_idle_ms=600_000)
    wait_for(lambda: in_flight(fake), 30,
             why=lambda: workers.log("sleeper"))
    sleeper.send_signal(signal.SIGSTOP)
    try:
        wait_idle(redis_client, keys, 600)
        rescuer = workers.start("rescuer", "--burst", claim_idle_ms=500)
        assert rescuer.wait(60) == 0, workers.log("rescuer")
        assert [g.meta["worker"] for g in rollouts(redis_client, keys)] == ["rescuer"]
    finally:
        sleeper.send_signal(signal.SIGCONT)
    wait_for(lambda: "already acknowledged by another worker" in workers.log("sleeper"), 30,
             why=lambda: workers.log("sleeper"))
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(30) == 0
    assert [g.meta["worker"] for g in rollouts(redis_client, keys)] == ["rescuer"]  # no late copy
    assert pending(redis_client, keys) == 0


def test_sigterm_lets_the_group_in_hand_finish_and_exits_0(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.delay_s = 1.0
    enqueue(redis_client, keys, 2)
    proc = workers.start("w1", grace_period_s=20)
    wait_for(lambda: in_flight(fake), 30,
             why=lambda: workers.log("w1"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, workers.log("w1")
    assert [g.group_id for g in rollouts(redis_client, keys)] == ["g0"]  # finished; g1 never started
    assert len(redis_client.xrange(keys.prompts)) == 2 and pending(redis_client, keys) == 0


def test_sigterm_past_the_grace_period_leaves_the_group_pending_and_exits_0(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.delay_s = 30.0
    enqueue(redis_client, keys, 1)
    proc = workers.start("w1", grace_period_s=0.5)
    wait_for(lambda: in_flight(fake), 30,
             why=lambda: workers.log("w1"))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, workers.log("w1")
    assert time.monotonic() - t0 < 15
    assert rollouts(redis_client, keys) == [] and pending(redis_client, keys) == 1  # left for a reclaim


def test_always_failing_group_is_handed_to_the_collector_not_retried_by_the_worker(
        workers: Workers, redis_client: redis.Redis, keys: Keys, fake: FakeProxy) -> None:
    fake.fail = lambda sid, i: "generation_preempted"
    enqueue(redis_client, keys, 1)
    proc = workers.start("w1", "--burst", max_retries=1)
    assert proc.wait(60) == 0, workers.log("w1")
    out = rollouts(redis_client, keys)
    assert [(g.attempt, g.status, g.error_code, g.retryable) for g in out] == [
        (0, "failed", "generation_preempted", True)]
    assert (out[0].error or "").startswith("generation_preempted") and out[0].prompt_group is not None
    assert redis_client.xlen(keys.dead) == 0 and len(redis_client.xrange(keys.prompts)) == 1  # the collector decides
    assert redis_client.hgetall(keys.stats) == {} and pending(redis_client, keys) == 0
