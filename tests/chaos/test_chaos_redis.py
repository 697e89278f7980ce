"""Redis SIGKILLed and restarted under the pipeline (issue 7, items 4–5).

* With AOF (``appendfsync always``) every acknowledged entry, consumer group and pending list
  survives a SIGKILL, and every service reconnects with bounded backoff and carries on.
* Negative control: the same crash with persistence off (``appendonly no``, no RDB) — the history
  recorded by the test shows the loss, so the check can see what it claims to prevent.
* Retry counts travel in the payload: across a Redis restart (and a worker SIGKILL) a group that
  always fails is attempted at most ``1 + max_retries`` times, then dead-lettered.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from harness import Cluster, wait_until
from history import stream_names

from services.rollout_worker.fake_proxy import FakeProxy, serve
from shared.schemas import WeightVersion
from shared.versionbus import publish_version

LIGHT = ("prompt-buffer", "collector", "w1")


def snapshot(c: Cluster) -> dict[str, Any]:
    """Streams, consumer groups, pending lists (entry and owner), counters and sets."""
    r, k = c.r, c.keys
    out: dict[str, Any] = {"stats": r.hgetall(k.stats), "latest": r.get(k.weights_latest),
                           "done": r.smembers(k.collector_done),
                           "cursor": r.hgetall(k.prompt_buffer_cursor)}
    for name, stream in {**stream_names(k), "weights_log": k.weights_log}.items():
        out[name] = r.xrange(stream)
        try:
            groups = r.xinfo_groups(stream)
        except redis.ResponseError:
            continue
        for g in groups:
            pend = r.xpending_range(stream, g["name"], min="-", max="+", count=10_000)
            # Delivery counters are left out: AOF replay of the collector's XCLAIM JUSTID touches can
            # bump them; nothing in the pipeline decides on them.
            out[f"{name}/{g['name'].decode()}"] = (g["last-delivered-id"], g["pending"],
                                                  [(p["message_id"], p["consumer"]) for p in pend])
    return out


def publish_initial(c: Cluster) -> None:
    publish_version(c.r, c.keys, WeightVersion(version="0", path="/nonexistent", step=0, published_at=0.0))


@pytest.mark.parametrize(("appendonly", "fsync"), [(True, "always"), (True, "everysec"), (False, "no")],
                         ids=["aof-always", "aof-everysec", "no-persistence-negative-control"])
def test_redis_sigkill_restart_keeps_acknowledged_entries_groups_and_pending_lists_only_with_aof(
        make_cluster: Callable[..., Cluster], appendonly: bool, fsync: str) -> None:
    # everysec is what docker-compose.yml runs: Redis write()s the AOF before it replies, so a process
    # crash loses nothing acknowledged (a power loss could lose the last second; "always" not even that).
    with serve(FakeProxy(reply=lambda sid, msgs: "21", version="0")) as proxy_url, \
            make_cluster(rows=6, appendonly=appendonly, redis_extra=["--appendfsync", fsync],
                         overrides={"rollout": {"proxy_url": proxy_url}, "train": {"groups_per_batch": 2},
                                    "collector": {"max_ready_batches": 10}}) as c:
        if appendonly:
            assert c.r.config_get("appendfsync")["appendfsync"] == fsync
        publish_initial(c)  # no trainer here: batches stay pending for it, groups stay in flight
        c.start("prompt-buffer")
        c.start("group-collector", "collector")
        c.start("rollout-worker", "w1")
        # Acknowledged work on every hop: prompts handed off, rollouts batched, batches waiting.
        wait_until(lambda: c.stats().get("groups_batched", 0) >= 6, 60, "three batches", c.explain)
        for n in LIGHT:
            c.signal(n, signal.SIGSTOP)  # freeze: the snapshot is exactly what Redis acknowledged
        before = snapshot(c)
        c.recorder.sync(c.r)  # the recorder has seen everything Redis acknowledged before the crash
        c.restart_redis()
        after = snapshot(c)
        h = c.verdict()
        if appendonly:
            assert after == before
            assert h.ok and h.summary()["produced"] == 6 and len(h.in_flight) == 6, h.render()
        else:  # the checker must report what a restart without persistence lost
            assert after["prompts"] == [] and h.summary()["missing"] >= 6 + 3 + 3, h.render()
            assert len(h.lost) == 6 and not h.ok, h.render()
        c.record_figures(f"redis::restart[{fsync if appendonly else 'no-aof'}]", **h.summary())


def test_pipeline_rides_out_redis_sigkill_restarts_and_every_service_reconnects(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=10, overrides={"pacing": {"max_in_flight_groups": 4}}) as c:
        c.start_pipeline(workers=2)
        wait_until(lambda: c.stats().get("groups_trained", 0) >= 2, 90, "two trained groups", c.explain)
        c.restart_redis()  # 1: while everything runs
        wait_until(lambda: c.stats().get("groups_trained", 0) >= 4, 90, "progress after restart 1", c.explain)
        for p in c.procs.values():  # 2: frozen, so the state before and after can be compared exactly
            p.send(signal.SIGSTOP)
        before = snapshot(c)
        c.restart_redis()
        assert snapshot(c) == before
        for p in c.procs.values():
            p.send(signal.SIGCONT)
        # Reconnects: every service writes its heartbeat again (backoff cap 1–5 s, heartbeat every 1 s).
        for key in c.r.scan_iter(match=c.keys.health("*", "*")):
            c.r.delete(key)
        services = ("proxy", "prompt-buffer", "rollout-worker", "group-collector", "trainer")
        wait_until(lambda: all(any(True for _ in c.r.scan_iter(match=c.keys.health(s, "*"))) for s in services),
                   30, "every service's heartbeat after the restart", c.explain)
        c.wait_settled(timeout=120)
        c.assert_alive()
        h = c.verdict()
        assert h.ok and h.summary()["trained"] == 10, c.explain()
        c.record_figures("redis::pipeline_restarts")


@contextmanager
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers: every call times out."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(512)
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


def test_retry_counts_survive_a_redis_restart_and_the_budget_holds(make_cluster: Callable[..., Cluster]) -> None:
    with blackhole() as url, make_cluster(rows=2, overrides={"rollout": {
            "proxy_url": url, "trajectory_timeout_s": 1.0, "session_cleanup_timeout_s": 0.3, "max_retries": 2,
            "claim_idle_ms": 1500}}) as c:
        publish_initial(c)
        c.start("prompt-buffer")
        c.start("group-collector", "collector")
        c.start("rollout-worker", "w1")
        # Attempt 0 failed and attempt 1 is enqueued: now crash the worker and Redis together.
        wait_until(lambda: any(1 in a for a in c.recorder.attempts().values()), 60, "a retry", c.explain)
        c.kill("w1")
        c.restart_redis()
        c.start("rollout-worker", "w2")
        c.wait_settled(expected=2, timeout=60)
        h = c.verdict()
        assert h.ok, c.explain()
        assert h.attempts == {g: {0, 1, 2} for g in h.produced} and len(h.produced) == 2
        assert h.dead == {g: ["retries_exhausted"] for g in h.produced}
        assert len(c.r.xrange(c.keys.prompts)) == 2 * 3  # 1 + max_retries attempts each, not one more
        c.record_figures("redis::retry_counts", **h.summary())
