"""group-collector Redis shell on fakeredis: atomic outcomes, poison, control, ready-batch limit, window."""

from __future__ import annotations

import itertools

import fakeredis
import pytest
from rollout_factory import rollout_group

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from shared.codec import decode_entry, encode_entry
from shared.config import CollectorConfig, StalenessSection
from shared.keys import Keys
from shared.schemas import Batch, DeadLetter, PromptGroup, RolloutGroup, WeightVersion
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.streams import next_id
from shared.telemetry import read_metrics
from shared.versionbus import publish_version, read_log

K = Keys("t")


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def collector(r: fakeredis.FakeRedis, keep: int = 2, per_batch: int = 2, retries: int = 2,
              max_ready: int = 1, consumer: str = "c1") -> GroupCollector:
    ids = (f"b{i}" for i in itertools.count(1))
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(keep))), per_batch, retries,
                         new_batch_id=lambda: next(ids))
    return GroupCollector(r, K, core, CollectorConfig(max_ready_batches=max_ready, trim_interval_s=0),
                          StalenessSection(keep_versions=keep), consumer=consumer, burst=True)


def put(r: fakeredis.FakeRedis, group: RolloutGroup) -> bytes:
    return r.xadd(K.rollouts, encode_entry(group))


def publish(r: fakeredis.FakeRedis, *versions: int) -> None:
    for v in versions:
        publish_version(r, K, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))


def batches(r: fakeredis.FakeRedis) -> list[Batch]:
    return [decode_entry(f, Batch) for _, f in r.xrange(K.batches)]


def stats(r: fakeredis.FakeRedis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall("t:stats").items()}


def pending(r: fakeredis.FakeRedis) -> int:
    return int(r.xpending(K.rollouts, "collector")["pending"])


def test_a_batch_is_written_with_its_acks_done_keys_and_counters(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    put(r, rollout_group("g1", ["0"]))
    put(r, rollout_group("g2", ["0"]))
    assert collector(r).run() == 0
    [b] = batches(r)
    assert [g.group_id for g in b.groups] == ["g1", "g2"] and b.trainer_version == "0"
    assert pending(r) == 0
    assert r.smembers("t:collector:done") == {b"g1:0", b"g2:0"}
    assert r.smembers("t:collector:closed") == {b"g1", b"g2"}
    assert stats(r) == {"groups_batched": 2, "batches_produced": 1}


def test_waiting_groups_stay_pending_until_their_batch(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    put(r, rollout_group("g1", ["0"]))
    c = collector(r, per_batch=2)
    c.run()
    assert pending(r) == 1 and r.xlen(K.batches) == 0
    put(r, rollout_group("g2", ["0"]))
    c.run()
    assert pending(r) == 0 and len(batches(r)) == 1


def test_poison_entries_are_dead_lettered_once_and_valid_ones_processed_in_order(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    poison = [{"junk": b"\x00\xff"}, {**encode_entry(rollout_group("x", ["0"])), "body": b"\xc1trunc"},
              {**encode_entry(rollout_group("y", ["0"])), "schema": b"9"}]
    for i in range(3):
        put(r, rollout_group(f"g{i}", ["0"]))
        r.xadd(K.rollouts, poison[i])
    put(r, rollout_group("g3", ["0"]))
    collector(r, per_batch=2, max_ready=5).run()
    assert [[g.group_id for g in b.groups] for b in batches(r)] == [["g0", "g1"], ["g2", "g3"]]
    dead = [decode_entry(f, DeadLetter) for _, f in r.xrange(K.dead)]
    assert [d.reason for d in dead] == ["malformed"] * 3
    assert dead[0].fields == {"junk": b"\x00\xff"}  # original bytes intact
    assert stats(r)["poison_dead_lettered"] == 3 and pending(r) == 0


def test_stale_group_is_reenqueued_atomically_and_dead_lettered_at_the_last_attempt(r: fakeredis.FakeRedis) -> None:
    publish(r, 0, 1, 2)
    put(r, rollout_group("g1", ["0"], attempt=0))
    put(r, rollout_group("g2", ["0"], attempt=2))
    collector(r, keep=2, retries=2).run()
    [retry] = [decode_entry(f, PromptGroup) for _, f in r.xrange(K.prompts)]
    assert (retry.group_id, retry.attempt) == ("g1", 1)
    [dead] = [decode_entry(f, DeadLetter) for _, f in r.xrange(K.dead)]
    assert dead.reason == "stale_retries_exhausted" and decode_entry(dead.fields, RolloutGroup).group_id == "g2"
    s = stats(r)
    assert (s["groups_reenqueued"], s["groups_dead_lettered"], s["groups_dropped_stale"]) == (1, 1, 2)
    assert pending(r) == 0


def test_an_outcome_already_committed_elsewhere_is_discarded_not_repeated(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    r.sadd("t:collector:done", "g1:0")  # another collector already batched g1:0
    put(r, rollout_group("g1", ["0"]))
    put(r, rollout_group("g2", ["0"]))
    put(r, rollout_group("g3", ["0"]))
    collector(r).run()
    [b] = batches(r)
    assert [g.group_id for g in b.groups] == ["g2", "g3"]
    assert stats(r)["groups_duplicate_discarded"] == 1


def test_ledger_rejection_at_commit_time_requeues_the_other_members(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    for i in range(3):
        put(r, rollout_group(f"g{i}", ["0"]))
    c = collector(r, max_ready=5)
    c.setup()
    c.execute(c.ingest(c.reader.read(10, None)))
    r.sadd("t:collector:closed", "g0")  # a racing collector trained g0 meanwhile
    c.execute(c.assemble())
    assert batches(r) == [] and [a.group.group_id for a in c.core.waiting] == ["g1", "g2"]
    c.execute(c.assemble())  # the next step cuts the batch again without g0
    assert [[g.group_id for g in b.groups] for b in batches(r)] == [["g1", "g2"]]
    assert stats(r)["groups_duplicate_discarded"] == 1 and pending(r) == 0


def test_at_most_max_ready_batches_wait_for_the_trainer(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    for i in range(6):
        put(r, rollout_group(f"g{i}", ["0"]))
    c = collector(r, per_batch=2, max_ready=1)
    c.run()
    assert r.xlen(K.batches) == 1 and len(c.core.waiting) == 4
    c.run()
    assert r.xlen(K.batches) == 1  # no trainer group yet: every batch counts as not taken
    r.xgroup_create(K.batches, "trainer", id="0")
    r.xreadgroup("trainer", "t1", {K.batches: ">"}, count=1)  # the trainer takes one
    c.run()
    assert r.xlen(K.batches) == 2 and c.ready_batches() == 1


def test_keep_versions_from_control_applies_live_and_bad_values_are_ignored(r: fakeredis.FakeRedis) -> None:
    publish(r, 0, 1, 2)
    put(r, rollout_group("g1", ["1"]))
    c = collector(r, keep=3, per_batch=5)
    c.run()
    assert len(c.core.waiting) == 1
    r.hset(K.control, "keep_versions", "banana")
    c.execute(c.sync_control())
    assert c.core.tracker.config.keep_versions == 3
    r.hset(K.control, "keep_versions", "1")
    c.execute(c.sync_control())
    assert c.core.waiting == [] and stats(r)["groups_reenqueued"] == 1


def test_window_hash_and_cumulative_metrics_are_published(r: fakeredis.FakeRedis) -> None:
    publish(r, 0, 1, 2)
    put(r, rollout_group("old", ["0"]))
    put(r, rollout_group("a", ["2"]))
    put(r, rollout_group("b", ["1"]))
    collector(r, keep=2).run()
    window = {k.decode(): v.decode() for k, v in r.hgetall("t:collector:window").items()}
    assert (window["keep_versions"], window["current_version"], window["cutoff_version"]) == ("2", "2", "1")
    assert (window["current_version_index"], window["cutoff_version_index"]) == ("2", "1")
    [m] = [m for m in read_metrics(r, K, "group-collector") if "staleness/version_gap_max" in m]
    assert m["staleness/dropped_groups"] == 1 and m["staleness/version_gap_max"] == 1.0
    assert m["pipeline/groups_batched"] == 2
    collector(r, keep=2).report()  # a restarted collector still reports the cumulative count
    assert read_metrics(r, K, "group-collector")[-1]["staleness/dropped_groups"] == 1


@pytest.mark.parametrize("bad", ["\u00b2", "-1", "1.5", "", " ", "\u0663", "1e3", "9" * 5000])
def test_every_bad_control_value_is_logged_and_ignored_and_the_collector_keeps_running(
        r: fakeredis.FakeRedis, bad: str, caplog: pytest.LogCaptureFixture) -> None:
    """A Unicode digit ("²": str.isdigit() accepts it, int() refuses it) once crashed every restart."""
    publish(r, 0, 1)
    r.hset(K.control, "keep_versions", bad)
    c = collector(r, keep=3, per_batch=1)
    put(r, rollout_group("g1", ["1"]))
    with caplog.at_level("ERROR"):
        assert c.run() == 0  # burst run: reads the control, ignores it, still cuts the batch
    assert c.core.tracker.config.keep_versions == 3 and r.xlen(K.batches) == 1
    assert [rec for rec in caplog.records if "ignoring" in rec.getMessage()]


def test_a_batch_after_a_restart_reports_the_cumulative_dropped_count(r: fakeredis.FakeRedis) -> None:
    publish(r, 0, 1, 2)
    put(r, rollout_group("old", ["0"]))
    collector(r, keep=2, per_batch=1).run()  # drops "old" (re-enqueued: counted as dropped once)
    put(r, rollout_group("fresh", ["2"]))
    collector(r, keep=2, per_batch=1).run()  # a restarted collector: its in-process count starts at 0
    [m] = [m for m in read_metrics(r, K, "group-collector") if "staleness/version_gap_max" in m]
    assert m["staleness/dropped_groups"] == 1  # the series never goes back to 0


def test_next_id_is_the_smallest_following_id() -> None:
    assert next_id(b"5-0") == "5-1" and next_id("0-0") == "0-1"


def test_trimming_removes_acknowledged_rollouts_but_never_a_waiting_one(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    for i in range(5):
        put(r, rollout_group(f"g{i}", ["0"]))
    c = collector(r, per_batch=2, max_ready=10)
    c.run()
    assert pending(r) == 1  # g4 waits
    c.trim()
    [(entry_id, _)] = r.xrange(K.rollouts)
    assert decode_entry(r.xrange(K.rollouts)[0][1], RolloutGroup).group_id == "g4"
    assert r.xpending(K.rollouts, "collector")["min"] == entry_id


def test_the_publication_log_is_read_from_a_cursor_oldest_first(r: fakeredis.FakeRedis) -> None:
    assert read_log(r, K) == ("0-0", [])
    publish(r, 1, 2)
    cursor, versions = read_log(r, K)
    assert versions == ["1", "2"]
    publish(r, 3)
    assert read_log(r, K, cursor)[1] == ["3"] and read_log(r, K, read_log(r, K, cursor)[0])[1] == []
