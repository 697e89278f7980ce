"""``staleness.mode: wait`` on a real redis-server: the real collector drops nothing for staleness, not even
under a live window from ``{p}:control``, cuts batches oldest first, and records every decision with lengths."""

from __future__ import annotations

import itertools

import redis
from rollout_factory import rollout_group

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from shared.codec import decode_entry, encode_entry
from shared.config import CollectorConfig, StalenessSection
from shared.keys import Keys
from shared.schemas import Batch, WeightVersion
from shared.staleness import StalenessGroupFilter, StalenessTracker, config_from_value
from shared.versionbus import publish_version
from tools.reports.decisionlog import read_stream

GROUPS: list[tuple[str, list[str | None]]] = [("A", ["4"]), ("B", ["0"]), ("C", ["1", "4"]), ("D", ["3"])]


def run_collector(r: redis.Redis, keys: Keys, section: StalenessSection) -> None:
    ids = (f"b{i}" for i in itertools.count(1))
    tracker = StalenessTracker(config_from_value(section.keep_versions, section.mode))  # as services/group_collector/main.py
    core = CollectorCore(StalenessGroupFilter(tracker), 2, 1, new_batch_id=lambda: next(ids))
    GroupCollector(r, keys, core, CollectorConfig(max_ready_batches=10, trim_interval_s=0), section,
                   consumer="c1", burst=True).run()


def test_wait_mode_trains_every_stale_group_oldest_first_and_ignores_a_live_window(
        redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    for v in range(5):
        publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))
    r.hset(keys.control, "keep_versions", "1")  # an operator's window: refused in wait mode (logged), no effect
    for gid, versions in GROUPS:
        r.xadd(keys.rollouts, encode_entry(rollout_group(gid, versions)))
    run_collector(r, keys, StalenessSection(mode="wait"))

    batches = [[g.group_id for g in decode_entry(f, Batch).groups] for _, f in r.xrange(keys.batches)]
    assert batches == [["B", "C"], ["D", "A"]]  # oldest end version first: 0, 1 | 3, 4
    assert r.xlen(keys.prompts) == 0 and r.xlen(keys.dead) == 0  # nothing re-enqueued, nothing dead-lettered
    assert b"groups_dropped_stale" not in r.hgetall(keys.stats)
    records = [rec for _, rec in read_stream(r, keys)]
    assert [(rec.group_id, rec.decision, rec.keep_versions) for rec in records] == [
        ("B", "trained", 0), ("C", "trained", 0), ("D", "trained", 0), ("A", "trained", 0)]
    assert records[1].gaps == [3, 0] and records[1].response_tokens == [2, 2] and records[1].rewards == [1.0, 1.0]


def test_the_same_input_in_drop_mode_drops_the_stale_groups(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    for v in range(5):
        publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))
    for gid, versions in GROUPS:
        r.xadd(keys.rollouts, encode_entry(rollout_group(gid, versions)))
    run_collector(r, keys, StalenessSection(mode="drop", keep_versions=2))
    batches = [[g.group_id for g in decode_entry(f, Batch).groups] for _, f in r.xrange(keys.batches)]
    assert batches == [["A", "D"]] and r.xlen(keys.prompts) == 2  # B and C re-enqueued
