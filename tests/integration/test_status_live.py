"""``dressage status`` against a real redis-server seeded with a small, known deployment state."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
import redis
from proxy_support import AppThread
from sglang_emulator import SGLangEmulator

from shared.keys import GROUP_COLLECTOR, GROUP_ROLLOUT, Keys
from shared.redisproc import RedisProcess
from shared.streams import ensure_group
from shared.telemetry import heartbeat, report_metrics
from tools.monitor import snapshot, status


def seed(r: redis.Redis, keys: Keys) -> None:
    ensure_group(r, keys.prompts, GROUP_ROLLOUT)
    for i in range(5):
        r.xadd(keys.prompts, {"kind": "prompt_group", "group_id": f"g{i}", "attempt": "0"})
    r.xreadgroup(GROUP_ROLLOUT, "worker-a", {keys.prompts: ">"}, count=2)  # 2 pending, 3 undelivered
    ensure_group(r, keys.rollouts, GROUP_COLLECTOR)
    rid = r.xadd(keys.rollouts, {"kind": "rollout_group", "group_id": "g0"})
    r.xreadgroup(GROUP_COLLECTOR, "collector-1", {keys.rollouts: ">"}, count=1)
    r.xack(keys.rollouts, GROUP_COLLECTOR, rid)
    for reason in ("retries_exhausted", "malformed", "malformed"):
        r.xadd(keys.dead, {"kind": "dead_letter", "reason": reason, "source_stream": keys.prompts})
    r.hset(keys.stats, mapping={"groups_produced": 12, "groups_trained": 4, "groups_dead_lettered": 1,
                                           "groups_dropped_stale": 2, "groups_reenqueued": 3, "batches_trained": 1})
    wv = {"version": "3", "path": "/ckpt/v3", "step": 3, "published_at": time.time() - 5}
    r.set(keys.weights_latest, json.dumps(wv))
    for v in range(4):
        r.xadd(keys.weights_log, {"version": str(v)})
    r.set(keys.collector_window,
          json.dumps({"keep_versions": 2, "current_version": "3", "cutoff_version": "2", "waiting_groups": 1}))
    r.hset(keys.control, "keep_versions", "2")
    heartbeat(r, keys, "trainer", "trainer", ttl_s=15)
    heartbeat(r, keys, "rollout-worker", "host-1", ttl_s=15)
    now = time.time()
    for step in range(1, 4):
        r.xadd(keys.metrics, {"service": "trainer", "ts": f"{now - 30 + 10 * step:.3f}", "train/step": str(step),
                              "time/wait_s": str(step), "time/train_s": str(8 * step), "time/checkpoint_s": "0.5",
                              "time/publish_s": "0.25", "time/other_s": "0.25", "time/wall_s": str(10 * step)})
    report_metrics(r, keys, "group-collector", {"staleness/dropped_groups": 2})


def test_snapshot_reads_lengths_groups_lag_and_liveness(redis_client: redis.Redis, keys: Keys) -> None:
    seed(redis_client, keys)
    snap = snapshot.collect(redis_client, keys)
    assert snap.streams["prompts"] == 5 and snap.streams["dead"] == 3 and snap.published == 4
    prompts = next(g for g in snap.groups if g.stream == "prompts")
    assert (prompts.pending, prompts.lag) == (2, 3)
    assert [(c.name, c.pending) for c in prompts.consumers] == [("worker-a", 2)]
    rollouts = next(g for g in snap.groups if g.stream == "rollouts")
    assert (rollouts.pending, rollouts.lag) == (0, 0)
    assert snap.dead_by_reason == {"malformed": 2, "retries_exhausted": 1}
    assert {(b.service, b.consumer) for b in snap.beats} == {("trainer", "trainer"), ("rollout-worker", "host-1")}
    assert all(0 < b.ttl_ms <= 15_000 for b in snap.beats)
    assert snap.window and snap.window["cutoff_version"] == "2"


def test_lag_is_counted_when_redis_does_not_report_it(redis_client: redis.Redis, keys: Keys) -> None:
    seed(redis_client, keys)
    info = {"name": GROUP_ROLLOUT, "last-delivered-id": redis_client.xinfo_groups(keys.prompts)[0]["last-delivered-id"]}
    assert snapshot._lag(redis_client, keys.prompts, info) == (3, False)  # the Redis 6.2 path


def test_render_shows_every_section(redis_client: redis.Redis, keys: Keys) -> None:
    seed(redis_client, keys)
    snap = snapshot.collect(redis_client, keys)
    screen = status.render(snap, expected=status.SERVICES)
    lines = {line.split()[0]: line for line in screen.splitlines() if line and not line.startswith(" ")}
    assert "current 3 (step 3" in lines["VERSION"] and "published versions: 4" in lines["VERSION"]
    assert "keep_versions 2" in lines["WINDOW"] and "cutoff 2" in lines["WINDOW"]
    assert "prompts 5" in lines["STREAMS"]
    assert "in flight 7" in lines["PIPELINE"]  # 12 produced - 4 trained - 1 dead-lettered
    assert "stale dropped 2" in lines["DROPS"] and "re-enqueued 3" in lines["DROPS"]
    assert lines["DEAD"].split(None, 1)[1] == "malformed 2, retries_exhausted 1"
    assert "trainer 6.00 steps/min" in lines["THROUGHPUT"]  # 2 steps over 20 s
    assert "trainer wait 10%" in lines["TIME"] and "trainer train 80%" in lines["TIME"]  # newest step: 3 s, 24 s of 30
    assert "worker-a (2," in screen and "DOWN (no heartbeat key)" in screen
    assert re.search(r"proxy\s+-\s+DOWN", screen) and re.search(r"trainer\s+trainer\s+alive", screen)


def test_render_says_why_admissions_are_paused_and_which_optional_service_is_down(
        redis_client: redis.Redis, keys: Keys) -> None:
    redis_client.hset(keys.prompt_buffer_brake,
                      mapping={"engaged": 1, "why": "40 dead letters in the last 60s (brake at 30, ...)"})
    redis_client.hset(keys.ops_degraded, "eval-worker", "exited 11 times (last code 1)")
    screen = status.render(snapshot.collect(redis_client, keys))
    lines = {line.split()[0]: line for line in screen.splitlines() if line and not line.startswith(" ")}
    assert "dead-letter brake): 40 dead letters in the last 60s" in lines["PAUSED"]
    assert "eval-worker is down: exited 11 times" in lines["DEGRADED"]
    redis_client.hset(keys.prompt_buffer_brake, "engaged", 0)
    redis_client.delete(keys.ops_degraded)
    screen = status.render(snapshot.collect(redis_client, keys))
    assert "PAUSED" not in screen and "DEGRADED" not in screen


def test_engines_are_probed_over_http() -> None:
    class Engine(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            body = {"/health": b"{}", "/get_weight_version": b'{"weight_version": "7"}'}.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up = f"http://127.0.0.1:{server.server_port}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            down = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
            probed = status.probe_engines([up, down], timeout=2)
    finally:
        server.shutdown()
    # No server info route: spoken to as an SGLang of unknown release (each route tried in turn)
    assert probed == [(up, "alive (sglang (version unknown), weight_version 7)"), (down, "DOWN (/health unreachable)")]
    screen = status.render(snapshot.Snapshot("p", time.time(), {}, [], None, 0, None, {}, {}, Counter(), [], []),
                           engines=probed)
    assert f"ENGINES     {up}" in screen and "weight_version 7" in screen


def test_stats_delta_between_refreshes(redis_client: redis.Redis, keys: Keys) -> None:
    seed(redis_client, keys)
    first = snapshot.collect(redis_client, keys)
    redis_client.hincrby(keys.stats, "groups_trained", 8)
    second = snapshot.collect(redis_client, keys)
    second.taken_at = first.taken_at + 4.0
    assert "trained 2.00/s since last refresh" in status.render(second, first)


def test_cli_prints_one_screen(redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
                               capsys: Any) -> None:
    seed(redis_client, keys)
    assert status.main(["--redis-url", redis_server.url, "--prefix", keys.prefix]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dressage status") and f"prefix={keys.prefix}" in out and "GROUPS" in out


def test_empty_deployment_renders(redis_client: redis.Redis, keys: Keys) -> None:
    screen = status.render(snapshot.collect(redis_client, keys))
    assert "none published yet" in screen and "(no consumer groups yet)" in screen


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_status_speaks_each_sglang_release_as_the_proxy_does(version: str) -> None:
    """ENGINES: an SGLang release (its slow /health, its weight-version route) reads alive with its version."""
    emu = SGLangEmulator(version, weight_version="7")
    with AppThread(emu.app) as engine:
        (_, state), = status.probe_engines([engine.url], timeout=0.5, health_timeout_s=5.0)
        (_, impatient), = status.probe_engines([engine.url], timeout=0.5, health_timeout_s=0.5)
    assert state == f"alive (sglang {version}, weight_version 7)"
    assert impatient == "DOWN (/health unreachable)"  # SGLang's /health takes >= 1 s
