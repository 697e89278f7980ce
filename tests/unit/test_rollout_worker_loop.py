"""The worker loop on fakeredis + the fake proxy: hand-off (completed and failed), poison, the retry path
through the collector, infrastructure failures held without spending attempts, reclaim, stop."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import fakeredis
import pytest
import redis
from waits import wait_for

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from services.rollout_worker import commit as commit_mod
from services.rollout_worker import metrics as prom
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient
from services.rollout_worker.runner import GroupRunner
from services.rollout_worker.worker import RolloutWorker
from shared.codec import decode_entry, encode_entry
from shared.codes import STALENESS_EXCEEDED
from shared.config import CollectorConfig, RolloutConfig, StalenessSection
from shared.keys import GROUP_ROLLOUT, Keys
from shared.lifecycle import StopFlag
from shared.schemas import DeadLetter, PromptGroup, RolloutGroup
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.streams import ensure_group, reclaim
from shared.telemetry import read_metrics


@pytest.fixture
def r() -> redis.Redis:
    return fakeredis.FakeRedis()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"u{uuid.uuid4().hex[:8]}")


def solve(sid: str, msgs: list[dict[str, str]]) -> str:
    return msgs[0]["content"].split()[1][::-1]


def enqueue(r: redis.Redis, keys: Keys, n: int = 1, **kw: Any) -> list[PromptGroup]:
    ensure_group(r, keys.prompts, GROUP_ROLLOUT)
    out = []
    for i in range(n):
        digits = f"{100 + i}"
        base: dict[str, Any] = {"group_id": f"g{i}", "prompt_id": f"p{i}", "task": "reverse",
                                "prompt": f"reverse {digits}", "reference": digits[::-1], "n_samples": 2,
                                "enqueued_at": 1.0}
        g = PromptGroup(**{**base, **kw})
        r.xadd(keys.prompts, encode_entry(g))
        out.append(g)
    return out


def worker(r: redis.Redis, keys: Keys, fake: FakeProxy, consumer: str = "w1", **cfg: Any) -> RolloutWorker:
    conf = RolloutConfig(**{"block_ms": 20, **cfg})
    return RolloutWorker(r, keys, conf, GroupRunner(FakeProxyClient(fake), conf, consumer), consumer,
                         stop=StopFlag(), backoff_max_s=0.05)


def rollouts(r: redis.Redis, keys: Keys) -> list[RolloutGroup]:
    return [decode_entry(f, RolloutGroup) for _, f in r.xrange(keys.rollouts)]


def pending(r: redis.Redis, keys: Keys) -> int:
    return int(r.xpending(keys.prompts, GROUP_ROLLOUT)["pending"])


def stats(r: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.stats).items()}


def test_burst_hands_every_group_off_with_its_prompt_acknowledged(r: redis.Redis, keys: Keys) -> None:
    groups = enqueue(r, keys, 3)
    fake = FakeProxy(reply=solve, version="4")
    assert worker(r, keys, fake).run(burst=True) == 0
    out = rollouts(r, keys)
    assert [g.group_id for g in out] == ["g0", "g1", "g2"] and pending(r, keys) == 0
    for g, rg in zip(groups, out, strict=True):
        assert rg.status == "completed" and rg.attempt == 0 and len(rg.samples) == 2
        assert rg.meta["worker"] == "w1" and rg.prompt_group == g
        assert rg.meta["rewards"] == [1.0, 1.0] and rg.end_versions == ["4", "4"]
    assert fake.sessions == {}  # every session deleted
    reports = read_metrics(r, keys, "rollout-worker")
    assert [m["group_id"] for m in reports] == ["g0", "g1", "g2"] and reports[0]["rollout/num_trajectories"] == 2
    assert r.exists(keys.health("rollout-worker", "w1"))


def test_poison_is_dead_lettered_with_its_bytes_and_the_loop_goes_on(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)
    r.xadd(keys.prompts, {"schema": "1", "kind": "prompt_group", "body": b"\xc1garbage"})
    r.xadd(keys.prompts, {"junk": b"\x00\x01"})
    enqueue(r, keys, 1, group_id="gz")
    w = worker(r, keys, FakeProxy(reply=solve))
    assert w.run(burst=True) == 0
    assert [g.group_id for g in rollouts(r, keys)] == ["g0", "gz"] and pending(r, keys) == 0
    dead = [decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead)]
    assert [d.reason for d in dead] == ["malformed", "malformed"]
    assert dead[0].fields["body"] == b"\xc1garbage" and "msgpack" in dead[0].error
    assert dead[1].fields == {"junk": b"\x00\x01"} and "schema" in dead[1].error
    assert stats(r, keys) == {"poison_dead_lettered": 2} and w.counts["poison"] == 2


def collector(r: redis.Redis, keys: Keys, retries: int) -> GroupCollector:
    ids = (f"b{i}" for i in itertools.count(1))
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(None))), 1, retries,
                         new_batch_id=lambda: next(ids))
    return GroupCollector(r, keys, core, CollectorConfig(trim_interval_s=0), StalenessSection(keep_versions=0), consumer="c1",
                          burst=True)


def pipeline(r: redis.Redis, keys: Keys, fake: FakeProxy, retries: int, rounds: int = 6) -> None:
    """Worker and collector in turns, each in burst mode, until nothing moves."""
    c = collector(r, keys, retries)
    for _ in range(rounds):
        worker(r, keys, fake, max_retries=retries).run(burst=True)
        c.run()


def test_a_failed_group_is_handed_to_the_collector_with_its_code_and_nothing_else(r: redis.Redis, keys: Keys) -> None:
    [g] = enqueue(r, keys, 1)
    fake = FakeProxy(reply=solve, fail=lambda sid, i: "trajectory_version_changed" if "-s1-" in sid else None)
    w = worker(r, keys, fake, max_retries=2)
    assert w.run(burst=True) == 0
    [out] = rollouts(r, keys)
    assert (out.attempt, out.status, out.error_code, out.retryable, out.samples) == (
        0, "failed", "trajectory_version_changed", True, [])
    assert out.prompt_group == g and (out.error or "").startswith("trajectory_version_changed")
    assert r.xlen(keys.prompts) == 1 and r.xlen(keys.dead) == 0 and pending(r, keys) == 0  # the collector decides
    assert stats(r, keys) == {} and w.counts["failed"] == 1


def test_failing_group_is_retried_by_the_collector_then_dead_lettered_at_the_last_attempt(
        r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)
    fake = FakeProxy(reply=solve, fail=lambda sid, i: "trajectory_version_changed" if "-s1-" in sid else None)
    pipeline(r, keys, fake, retries=2)
    out = rollouts(r, keys)
    assert [(g.attempt, g.status) for g in out] == [(0, "failed"), (1, "failed"), (2, "failed")]
    prompts = [decode_entry(f, PromptGroup) for _, f in r.xrange(keys.prompts)]
    assert [p.attempt for p in prompts] == [0, 1, 2] and pending(r, keys) == 0
    assert [(h.attempt, h.reason) for h in prompts[2].retry_history] == [(0, "failed"), (1, "failed")]
    assert prompts[2].enqueued_at > 1.0
    (dead,) = [decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead)]
    assert dead.reason == "retries_exhausted" and "trajectory_version_changed" in dead.error
    assert decode_entry(dead.fields, RolloutGroup).attempt == 2  # the original bytes of the last attempt
    assert {k: v for k, v in stats(r, keys).items() if k.startswith("groups_")} == {
        "groups_reenqueued": 2, "groups_dead_lettered": 1}
    assert len({sid for sid, _ in fake.calls}) == 6 and fake.sessions == {}


def test_invalid_prompt_group_is_dead_lettered_without_retries(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1, task="chess")
    pipeline(r, keys, FakeProxy(), retries=2, rounds=2)
    (dead,) = [decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead)]
    assert dead.reason == "invalid_prompt_group" and "chess" in dead.error
    assert [(g.status, g.retryable) for g in rollouts(r, keys)] == [("failed", False)]
    assert stats(r, keys)["groups_dead_lettered"] == 1 and r.xlen(keys.prompts) == 1


def test_staleness_rejections_count_once_per_event_and_never_stick(r: redis.Redis, keys: Keys) -> None:
    """attempt 0: every trajectory rejected for staleness; attempt 1: a group error; attempt 2: success."""
    enqueue(r, keys, 1, n_samples=3)

    def fail(sid: str, i: int) -> str | None:
        return {"-a0-": STALENESS_EXCEEDED, "-a1-": "generation_preempted"}.get(sid[sid.index("-a"):][:4])

    before = prom.REJECTED_GROUPS._value.get()
    pipeline(r, keys, FakeProxy(reply=solve, fail=fail), retries=2)
    out = rollouts(r, keys)
    assert [(g.attempt, g.status) for g in out] == [(0, "failed"), (1, "failed"), (2, "completed")]
    s = stats(r, keys)  # the failure of attempt 1 is not a staleness event, despite attempt 0's history
    assert (s["partial_rollout_rejected_groups"], s["partial_rollout_rejected_samples"]) == (1, 3)
    assert prom.REJECTED_GROUPS._value.get() - before == 1


def idle_ms(r: redis.Redis, keys: Keys) -> int:
    """How long the least idle pending prompt has gone undelivered (ms)."""
    entries = r.xpending_range(keys.prompts, GROUP_ROLLOUT, min="-", max="+", count=100)
    return min(int(e["time_since_delivered"]) for e in entries)


def test_entries_of_a_dead_worker_are_reclaimed_after_the_idle_time(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 2)
    r.xreadgroup(GROUP_ROLLOUT, "dead-worker", {keys.prompts: ">"}, count=2)  # read, then "crashed"
    w = worker(r, keys, FakeProxy(reply=solve), claim_idle_ms=100)
    w.run(burst=True)
    assert rollouts(r, keys) == [] and pending(r, keys) == 2  # not idle long enough yet: left alone
    wait_for(lambda: idle_ms(r, keys) >= 100, 5, "the dead worker's entries idle for claim_idle_ms")
    worker(r, keys, FakeProxy(reply=solve), consumer="w2", claim_idle_ms=100).run(burst=True)
    assert sorted(g.group_id for g in rollouts(r, keys)) == ["g0", "g1"] and pending(r, keys) == 0
    assert {g.meta["worker"] for g in rollouts(r, keys)} == {"w2"}


def test_a_worker_claims_only_as_many_idle_entries_as_it_can_start(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 3)
    r.xreadgroup(GROUP_ROLLOUT, "dead-worker", {keys.prompts: ">"}, count=3)
    wait_for(lambda: idle_ms(r, keys) >= 100, 5, "the dead worker's entries idle for claim_idle_ms")
    w = worker(r, keys, FakeProxy(reply=solve), claim_idle_ms=100)
    assert len(w._claim_idle(1)) == 1
    owners = [p["consumer"] for p in r.xpending_range(keys.prompts, GROUP_ROLLOUT, min="-", max="+", count=10)]
    assert sorted(owners) == [b"dead-worker", b"dead-worker", b"w1"]  # the rest stays claimable by peers
    w.run(burst=True)
    assert sorted(g.group_id for g in rollouts(r, keys)) == ["g0", "g1", "g2"] and pending(r, keys) == 0


def test_a_live_worker_keeps_its_long_group_from_being_reclaimed(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)
    w = worker(r, keys, FakeProxy(reply=solve, delay_s=1.0), claim_idle_ms=300)

    async def scenario() -> list[Any]:
        run = asyncio.create_task(w.run_async(burst=True))
        stolen = []
        for _ in range(8):  # another worker keeps trying to reclaim while the group runs (1 s > 300 ms)
            await asyncio.sleep(0.1)
            stolen += reclaim(r, keys.prompts, GROUP_ROLLOUT, "thief", 300)
        await run
        return stolen

    assert asyncio.run(scenario()) == []
    assert [g.meta["worker"] for g in rollouts(r, keys)] == ["w1"] and pending(r, keys) == 0


def test_result_is_dropped_when_another_worker_already_acknowledged_the_entry(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)

    def reply(sid: str, msgs: list[dict[str, str]]) -> str:
        entry_id = r.xrange(keys.prompts)[0][0]
        r.xack(keys.prompts, GROUP_ROLLOUT, entry_id)  # a reclaimer finished this group meanwhile
        return solve(sid, msgs)

    w = worker(r, keys, FakeProxy(reply=reply))
    w.run(burst=True)
    assert rollouts(r, keys) == [] and w.counts["skipped"] == 1


def test_a_crash_inside_the_rollout_fails_the_group_into_the_retry_path(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 2)

    def reply(sid: str, msgs: list[dict[str, str]]) -> str:
        if sid.startswith("g0-a0"):
            raise RuntimeError("plugin bug")
        return solve(sid, msgs)

    pipeline(r, keys, FakeProxy(reply=reply), retries=2, rounds=2)
    out = {(g.group_id, g.attempt): g for g in rollouts(r, keys)}
    assert out[("g0", 0)].status == "failed" and "internal_error: RuntimeError: plugin bug" in (out[("g0", 0)].error or "")
    assert out[("g0", 0)].error_code == "internal_error"
    assert out[("g0", 1)].status == "completed" and out[("g1", 0)].status == "completed"


def test_concurrency_runs_several_groups_at_once(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 4)
    fake = FakeProxy(reply=solve, delay_s=0.1)
    worker(r, keys, fake, concurrency=2).run(burst=True)
    assert fake.max_active == 4 and len(rollouts(r, keys)) == 4  # 2 groups x 2 trajectories


def test_redis_error_at_commit_leaves_the_entry_pending_and_it_is_redone(
        r: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    enqueue(r, keys, 1)
    real = commit_mod.commit_handoff
    calls = []

    def flaky(*args: Any) -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("connection reset")
        return real(*args)

    monkeypatch.setattr("services.rollout_worker.worker.commit_handoff", flaky)
    worker(r, keys, FakeProxy(reply=solve)).run(burst=True)
    assert len(calls) == 2 and [g.group_id for g in rollouts(r, keys)] == ["g0"] and pending(r, keys) == 0


def test_burst_does_not_mistake_a_redis_outage_for_an_empty_stream(
        r: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    enqueue(r, keys, 2)
    w = worker(r, keys, FakeProxy(reply=solve))
    real, failures = w._fetch, [2]

    def flaky(n: int, block_ms: int | None) -> list[Any]:
        if failures[0]:
            failures[0] -= 1
            raise redis.ConnectionError("redis restarting")
        return real(n, block_ms)

    monkeypatch.setattr(w, "_fetch", flaky)
    assert w.run(burst=True) == 0
    assert [g.group_id for g in rollouts(r, keys)] == ["g0", "g1"]


async def stop_after(w: RolloutWorker, delay: float) -> int:
    async def stopper() -> None:
        await asyncio.sleep(delay)
        w.stop.set()

    task = asyncio.create_task(stopper())
    code = await w.run_async(burst=False)
    await task
    return code


def test_stop_lets_the_group_in_hand_finish_within_the_grace_period(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)
    w = worker(r, keys, FakeProxy(reply=solve, delay_s=0.3), grace_period_s=5)
    assert asyncio.run(stop_after(w, 0.1)) == 0
    assert [g.group_id for g in rollouts(r, keys)] == ["g0"] and pending(r, keys) == 0


def test_stop_past_the_grace_period_leaves_the_entry_pending_for_reclaim(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 1)
    fake = FakeProxy(reply=solve, delay_s=30)
    w = worker(r, keys, fake, grace_period_s=0.2)
    t0 = time.monotonic()
    assert asyncio.run(stop_after(w, 0.1)) == 0
    assert time.monotonic() - t0 < 3
    assert rollouts(r, keys) == [] and pending(r, keys) == 1 and len(fake.deleted) == 2


def test_stopped_worker_reads_nothing_new(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 2)
    w = worker(r, keys, FakeProxy(reply=solve))
    w.stop.set()
    assert w.run(burst=False) == 0
    assert rollouts(r, keys) == [] and pending(r, keys) == 0


class _DownThenUp(FakeProxyClient):
    """An upstream that fails with ``code`` (infrastructure) for its first ``down`` calls, then answers."""

    def __init__(self, fake: FakeProxy, down: int, code: str = "proxy_unreachable") -> None:
        super().__init__(fake)
        self.down, self.code = down, code
        self.attempts_seen: list[str] = []

    def _gate(self, session_id: str) -> None:
        self.attempts_seen.append(session_id)
        if self.down > 0:
            self.down -= 1
            raise TrajectoryFailed(self.code, "upstream down", retryable=True)

    async def chat(self, session_id: str, messages: Any, max_tokens: int, temperature: float) -> str:
        self._gate(session_id)
        return await super().chat(session_id, messages, max_tokens, temperature)

    async def chat_many(self, session_ids: list[str], messages: Any, max_tokens: int, temperature: float) -> list[str]:
        self._gate(session_ids[0])
        return await super().chat_many(session_ids, messages, max_tokens, temperature)


def down_worker(r: redis.Redis, keys: Keys, proxy: FakeProxyClient, **cfg: Any) -> RolloutWorker:
    conf = RolloutConfig(**{"block_ms": 20, "max_retries": 0, "upstream_backoff_max_s": 0.2, **cfg})
    return RolloutWorker(r, keys, conf, GroupRunner(proxy, conf, "w1"), "w1", stop=StopFlag(), backoff_max_s=0.05)


async def run_until(w: RolloutWorker, done: Any, timeout_s: float = 20.0) -> None:
    task = asyncio.create_task(w.run_async())
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    w.stop.set()
    await task


@pytest.mark.parametrize("code", ["proxy_unreachable", "upstream_unavailable", "proxy_timeout"])
def test_upstream_outage_keeps_the_group_pending_without_spending_an_attempt(
        r: redis.Redis, keys: Keys, code: str) -> None:
    enqueue(r, keys, 1, n_samples=1)  # max_retries 0: a spent attempt would dead-letter at once
    w = down_worker(r, keys, _DownThenUp(FakeProxy(reply=solve), down=3, code=code))
    asyncio.run(run_until(w, lambda: r.xlen(keys.rollouts) > 0))
    [out] = rollouts(r, keys)
    assert out.status == "completed" and out.attempt == 0 and w.counts["held"] == 3
    assert r.xlen(keys.dead) == 0 and pending(r, keys) == 0 and not w.upstream.is_down
    assert not any(fields.get(b"attempt") == b"1" for _, fields in r.xrange(keys.prompts))


def test_while_the_upstream_is_down_the_worker_takes_no_new_group(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 5, n_samples=1)
    proxy = _DownThenUp(FakeProxy(reply=solve), down=10**6)
    w = down_worker(r, keys, proxy, concurrency=1, upstream_backoff_max_s=0.1)
    asyncio.run(run_until(w, lambda: w.counts["held"] >= 6))
    groups = {sid.split("-a")[0] for sid in proxy.attempts_seen}
    assert groups == {"g0"}  # only the held group probes the upstream; g1..g4 are never started
    delivered = r.xpending(keys.prompts, GROUP_ROLLOUT)["pending"]
    assert delivered == 1 and rollouts(r, keys) == [] and r.xlen(keys.dead) == 0
    # ... and when the upstream is back, everything goes through, no attempt spent.
    proxy.down = 0
    w2 = down_worker(r, keys, proxy, concurrency=2)
    asyncio.run(run_until(w2, lambda: r.xlen(keys.rollouts) >= 5))
    assert sorted((g.group_id, g.attempt, g.status) for g in rollouts(r, keys)) == [
        (f"g{i}", 0, "completed") for i in range(5)]


def test_burst_mode_leaves_an_upstream_outage_pending_and_ends(r: redis.Redis, keys: Keys) -> None:
    enqueue(r, keys, 2)
    w = down_worker(r, keys, _DownThenUp(FakeProxy(reply=solve), down=100))
    assert w.run(burst=True) == 0
    assert r.xlen(keys.dead) == 0 and rollouts(r, keys) == [] and w.counts["held"] == 1
    assert pending(r, keys) == 1 and r.xlen(keys.prompts) == 2  # g1 never taken, g0 held: no attempt spent
