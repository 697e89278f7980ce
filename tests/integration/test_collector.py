"""group-collector on a real redis-server: a scripted run, duplicates, crashes and reclaim races."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
from rollout_factory import rollout_group
from waits import wait_for

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from shared.codec import decode_entry, encode_entry
from shared.config import CollectorConfig, StalenessSection
from shared.keys import GROUP_COLLECTOR, Keys
from shared.redisproc import RedisProcess
from shared.schemas import Batch, DeadLetter, PromptGroup, RolloutGroup, WeightVersion
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.versionbus import publish_version

ROOT = Path(__file__).resolve().parents[2]


def collector(r: redis.Redis, keys: Keys, keep: int = 2, per_batch: int = 2, retries: int = 2,
              max_ready: int = 1, consumer: str = "c1", claim_idle_ms: int = 30_000) -> GroupCollector:
    ids = (f"{consumer}-b{i}" for i in itertools.count(1))
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(keep))), per_batch, retries,
                         new_batch_id=lambda: next(ids))
    return GroupCollector(r, keys, core, CollectorConfig(max_ready_batches=max_ready, claim_idle_ms=claim_idle_ms,
                                                          trim_interval_s=0),
                          StalenessSection(keep_versions=keep), consumer=consumer, burst=True)


def put(r: redis.Redis, keys: Keys, group: RolloutGroup) -> bytes:
    return r.xadd(keys.rollouts, encode_entry(group))


def publish(r: redis.Redis, keys: Keys, *versions: int) -> None:
    for v in versions:
        publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))


def batches(r: redis.Redis, keys: Keys) -> list[list[str]]:
    return [[f"{g.group_id}:{g.attempt}" for g in decode_entry(f, Batch).groups] for _, f in r.xrange(keys.batches)]


def trainer_takes(r: redis.Redis, keys: Keys) -> None:
    try:
        r.xgroup_create(keys.batches, "trainer", id="0")
    except redis.ResponseError:
        pass
    r.xreadgroup("trainer", "t", {keys.batches: ">"}, count=1)


def stats(r: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.stats).items()}


def wait_idle(r: redis.Redis, keys: Keys, idle_ms: int, timeout_s: float = 10.0) -> None:
    """Until every pending rollout entry has been idle ``idle_ms`` (what a reclaim waits for)."""
    wait_for(lambda: all(p["time_since_delivered"] >= idle_ms
                         for p in r.xpending_range(keys.rollouts, GROUP_COLLECTOR, min="-", max="+", count=100)),
             timeout_s, "pending entries idle", period=0.01)


def pending(r: redis.Redis, keys: Keys) -> int:
    return int(r.xpending(keys.rollouts, "collector")["pending"])


def test_scripted_run_produces_exactly_the_expected_batches_drops_retries_and_dead_letters(
        redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client

    def run() -> None:
        assert collector(r, keys, keep=2, per_batch=2, retries=1).run() == 0

    publish(r, keys, 0)
    put(r, keys, rollout_group("A", ["0"]))
    put(r, keys, rollout_group("B", ["0", "0"]))
    run()
    publish(r, keys, 1, 2)  # window {1, 2}
    put(r, keys, rollout_group("C", ["0"]))  # stale → attempt 1
    put(r, keys, rollout_group("D", ["1"]))
    put(r, keys, rollout_group("E", ["2", "0"]))  # one stale trajectory → whole group, attempt 1
    put(r, keys, rollout_group("C", ["0"], attempt=1))  # stale again, no retries left
    put(r, keys, rollout_group("F", ["2"]))
    run()
    assert batches(r, keys) == [["A:0", "B:0"]]  # [D, F] waits: batch 1 not taken by the trainer yet
    trainer_takes(r, keys)
    run()
    publish(r, keys, 3)  # window {2, 3}
    put(r, keys, rollout_group("G", ["3"]))
    put(r, keys, rollout_group("E", ["3", "2"], attempt=1))
    put(r, keys, rollout_group("H", [], status="failed", error="partial_rollout_staleness_exceeded: 3 versions"))
    put(r, keys, rollout_group("H", [], attempt=1, status="failed", error="timeout"))
    trainer_takes(r, keys)
    run()

    assert batches(r, keys) == [["A:0", "B:0"], ["D:0", "F:0"], ["G:0", "E:1"]]
    retries = [(p.group_id, p.attempt) for p in (decode_entry(f, PromptGroup) for _, f in r.xrange(keys.prompts))]
    assert retries == [("C", 1), ("E", 1), ("H", 1)]
    dead = [(decode_entry(d.fields, RolloutGroup).group_id, d.reason)
            for d in (decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead))]
    assert dead == [("C", "stale_retries_exhausted"), ("H", "retries_exhausted")]
    s = stats(r, keys)
    assert (s["groups_batched"], s["batches_produced"], s["groups_reenqueued"], s["groups_dead_lettered"]) == (6, 3, 3, 2)
    assert s["groups_dropped_stale"] == 3
    assert (s["partial_rollout_rejected_groups"], s["partial_rollout_rejected_samples"]) == (1, 1)
    assert pending(r, keys) == 0


def test_late_copies_never_put_a_group_in_two_batches(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    for gid in ("g1", "g2", "g1", "g3"):  # g1 twice before its batch (reclaimed worker + original)
        put(r, keys, rollout_group(gid, ["0"]))
    collector(r, keys, per_batch=2, max_ready=10).run()
    put(r, keys, rollout_group("g1", ["0"]))  # a paused worker's copy arrives after the batch
    put(r, keys, rollout_group("g4", ["0"]))
    collector(r, keys, per_batch=2, max_ready=10).run()
    flat = [m for b in batches(r, keys) for m in b]
    assert sorted(flat) == ["g1:0", "g2:0", "g3:0", "g4:0"]
    assert stats(r, keys)["groups_duplicate_discarded"] == 2 and pending(r, keys) == 0


def test_collector_abandoned_between_consuming_and_acknowledging_loses_and_duplicates_nothing(
        redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    for i in range(5):
        put(r, keys, rollout_group(f"g{i}", ["0"]))
    crashed = collector(r, keys, per_batch=2, max_ready=10, consumer="same")
    crashed.setup()
    crashed.core.on_arrivals([])  # decided nothing yet...
    crashed.ingest(crashed.reader.read(10, None))  # ...read and decided, never committed: the "crash"
    assert pending(r, keys) == 5 and r.xlen(keys.batches) == 0
    collector(r, keys, per_batch=2, max_ready=10, consumer="same").run()  # restart, same name
    assert batches(r, keys) == [["g0:0", "g1:0"], ["g2:0", "g3:0"]]
    assert pending(r, keys) == 1  # g4 still waits, pending, for a partner
    put(r, keys, rollout_group("g5", ["0"]))
    collector(r, keys, per_batch=2, max_ready=10, consumer="same").run()
    assert batches(r, keys)[-1] == ["g4:0", "g5:0"] and pending(r, keys) == 0


def test_a_dead_collectors_entries_are_reclaimed_by_another(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    for i in range(3):
        put(r, keys, rollout_group(f"g{i}", ["0"]))
    dead = collector(r, keys, per_batch=4, consumer="dead")
    dead.run()  # holds g0..g2 waiting, then "dies"
    assert pending(r, keys) == 3
    wait_idle(r, keys, 200)
    put(r, keys, rollout_group("g3", ["0"]))
    collector(r, keys, per_batch=4, consumer="alive", claim_idle_ms=200).run()
    assert batches(r, keys) == [["g0:0", "g1:0", "g2:0", "g3:0"]]
    assert pending(r, keys) == 0


def test_two_collectors_holding_the_same_entries_commit_them_once(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    put(r, keys, rollout_group("g1", ["0"]))
    put(r, keys, rollout_group("g2", ["0"]))
    slow = collector(r, keys, per_batch=2, consumer="slow", max_ready=10)
    slow.setup()
    slow.execute(slow.ingest(slow.reader.read(10, None)))  # waiting, not yet assembled (paused)
    wait_idle(r, keys, 200)
    fast = collector(r, keys, per_batch=2, consumer="fast", claim_idle_ms=200, max_ready=10)
    fast.run()  # believes "slow" is dead, reclaims and batches g1, g2
    slow.execute(slow.assemble())  # resumes: its batch is refused, its copies discarded
    assert batches(r, keys) == [["g1:0", "g2:0"]]
    assert stats(r, keys)["groups_duplicate_discarded"] == 2 and slow.core.waiting == []


def test_poison_interleaved_with_valid_entries(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    good = [rollout_group(f"g{i}", ["0"]) for i in range(4)]
    junk = [{"body": os.urandom(64)}, {**encode_entry(good[0]), "body": encode_entry(good[0])["body"][:20]},
            {**encode_entry(good[0]), "kind": b"batch"}, {**encode_entry(good[1]), "group_id": b"other"}]
    for g, j in zip(good, junk, strict=True):
        r.xadd(keys.rollouts, j)
        put(r, keys, g)
    collector(r, keys, per_batch=2, max_ready=10).run()
    assert batches(r, keys) == [["g0:0", "g1:0"], ["g2:0", "g3:0"]]
    dead = [decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead)]
    assert [d.reason for d in dead] == ["malformed"] * 4
    assert [d.fields for d in dead] == [{k.decode(): v if isinstance(v, bytes) else v.encode()
                                         for k, v in ((k if isinstance(k, bytes) else k.encode(), v)
                                                      for k, v in j.items())} for j in junk]
    assert stats(r, keys)["poison_dead_lettered"] == 4 and pending(r, keys) == 0


def _config(tmp_path: Path, server: RedisProcess, keys: Keys) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"redis: {{url: '{server.url}', prefix: '{keys.prefix}'}}\n"
                   "train: {groups_per_batch: 4}\nstaleness: {keep_versions: 2}\n"
                   "collector: {block_ms: 50, claim_idle_ms: 200, trim_interval_s: 0}\n")
    return cfg


def test_collector_process_killed_with_sigkill_loses_nothing(tmp_path: Path, redis_server: RedisProcess,
                                                             redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    for i in range(3):
        put(r, keys, rollout_group(f"g{i}", ["0"]))
    env = {**os.environ, "DRESSAGE_CONSUMER": "killed"}
    cmd = [sys.executable, "-m", "services.group_collector", "--config", str(_config(tmp_path, redis_server, keys))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if pending(r, keys) == 3:
                    break
            except redis.ResponseError:
                pass  # the group does not exist until the process created it
            time.sleep(0.05)
        assert pending(r, keys) == 3, "the collector never read the groups"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    put(r, keys, rollout_group("g3", ["0"]))
    env["DRESSAGE_CONSUMER"] = "successor"  # a different collector reclaims the dead one's entries
    done = subprocess.run([*cmd, "--burst"], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert batches(r, keys) == [["g0:0", "g1:0", "g2:0", "g3:0"]]
    assert pending(r, keys) == 0


def test_sigterm_exits_0_and_leaves_waiting_groups_pending(tmp_path: Path, redis_server: RedisProcess,
                                                           redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    put(r, keys, rollout_group("g0", ["0"]))
    cmd = [sys.executable, "-m", "services.group_collector", "--config", str(_config(tmp_path, redis_server, keys))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "DRESSAGE_CONSUMER": "term"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not r.exists(keys.collector_window):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert pending(r, keys) == 1  # g0 waits for a partner: still owed a batch, not lost


def test_collector_rides_out_a_redis_crash_and_restart(tmp_path: Path) -> None:
    server = RedisProcess(directory=tmp_path / "redis", appendonly=True).start()
    keys = Keys("crash")
    try:
        r = redis.Redis(port=server.port, socket_timeout=2)
        publish(r, keys, 0)
        put(r, keys, rollout_group("g0", ["0"]))
        c = collector(r, keys, per_batch=2)
        c.burst, c.cfg = False, c.cfg.model_copy(update={"block_ms": 50})
        thread = threading.Thread(target=c.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(c.core.waiting) < 1:
            time.sleep(0.02)
        server.kill()  # SIGKILL: the waiting group is pending in the AOF
        server.start()
        put(r, keys, rollout_group("g1", ["0"]))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and r.xlen(keys.batches) == 0:
            time.sleep(0.05)
        c.stop.set()
        thread.join(10)
        assert batches(r, keys) == [["g0:0", "g1:0"]] and pending(r, keys) == 0
    finally:
        server.cleanup()
