"""The collector's decision log on a real redis-server: recorded by the real collector, replayed offline."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import redis
from rollout_factory import rollout_group

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from shared.codec import encode_entry
from shared.config import CollectorConfig, StalenessSection
from shared.keys import Keys
from shared.schemas import RolloutGroup, WeightVersion
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.versionbus import publish_version
from shared.window_decisions import replay
from tools.reports import replay as replay_cli
from tools.reports.decisionlog import DecisionFile, load_records, read_stream


def run_collector(r: redis.Redis, keys: Keys, keep: int) -> None:
    ids = (f"b{i}" for i in itertools.count(1))
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(keep))), 2, 1,
                         new_batch_id=lambda: next(ids))
    GroupCollector(r, keys, core, CollectorConfig(max_ready_batches=10, trim_interval_s=0),
                   StalenessSection(keep_versions=keep), consumer="c1", burst=True).run()


def put(r: redis.Redis, keys: Keys, *groups: RolloutGroup) -> None:
    for g in groups:
        r.xadd(keys.rollouts, encode_entry(g))


def publish(r: redis.Redis, keys: Keys, *versions: int) -> None:
    for v in versions:
        publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))


def recorded_run(r: redis.Redis, keys: Keys) -> None:
    """A run with trained, stale-dropped, failed and dead-lettered groups and a live window change."""
    publish(r, keys, 0)
    put(r, keys, rollout_group("A", ["0"]), rollout_group("B", ["0", "0"]))
    run_collector(r, keys, keep=2)
    publish(r, keys, 1, 2)  # window {1, 2}
    put(r, keys, rollout_group("C", ["0"]), rollout_group("D", ["1"]), rollout_group("E", ["2", "0"]),
        rollout_group("C", ["0"], attempt=1), rollout_group("F", ["2"]),
        rollout_group("H", [], status="failed", error="timeout"))
    run_collector(r, keys, keep=2)
    r.hset(keys.control, "keep_versions", "3")  # the operator widens the window live
    publish(r, keys, 3)  # window {1, 2, 3}
    put(r, keys, rollout_group("G", ["1"]), rollout_group("E", ["3", "1"], attempt=1))
    run_collector(r, keys, keep=2)


def test_every_committed_outcome_is_recorded_with_its_window(redis_client: redis.Redis, keys: Keys) -> None:
    recorded_run(redis_client, keys)
    recs = [rec for _, rec in read_stream(redis_client, keys)]
    got = {(x.group_id, x.attempt): (x.decision, x.outcome, x.reason, x.keep_versions, tuple(x.gaps)) for x in recs}
    assert got == {
        ("A", 0): ("trained", "batched", "in_window", 2, (0,)),
        ("B", 0): ("trained", "batched", "in_window", 2, (0, 0)),
        ("C", 0): ("dropped", "reenqueued", "stale", 2, (2,)),
        ("E", 0): ("dropped", "reenqueued", "stale", 2, (0, 2)),
        ("C", 1): ("dropped", "dead_lettered", "stale_retries_exhausted", 2, (2,)),
        ("D", 0): ("trained", "batched", "in_window", 2, (1,)),
        ("F", 0): ("trained", "batched", "in_window", 2, (0,)),
        ("H", 0): ("dropped", "reenqueued", "failed", 2, ()),
        ("G", 0): ("trained", "batched", "in_window", 3, (2,)),
        ("E", 1): ("trained", "batched", "in_window", 3, (0, 2)),
    }
    assert len(recs) == 10  # one record per outcome, none for a duplicate
    assert [x.window_decided for x in recs if x.group_id == "H"] == [False]


def test_replay_with_the_runs_own_window_reproduces_every_decision(redis_client: redis.Redis, keys: Keys,
                                                                   tmp_path: Path) -> None:
    recorded_run(redis_client, keys)
    log = DecisionFile(tmp_path / "decisions.jsonl")
    assert log.pull(redis_client, keys) == 10 and log.pull(redis_client, keys) == 0  # incremental, never twice
    records = load_records(tmp_path / "decisions.jsonl")
    own = replay(records)
    assert own.changed == 0 and (own.recorded_trained, own.recorded_dropped) == (6, 3)
    assert replay_cli.main([str(tmp_path)]) == 0


def test_replay_under_other_windows_names_the_groups_that_flip(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recorded_run(redis_client, keys)
    records = [rec for _, rec in read_stream(redis_client, keys)]
    tight = replay(records, 1)  # only gap 0 survives
    assert sorted((x.group_id, x.attempt) for x in tight.would_drop) == [("D", 0), ("E", 1), ("G", 0)]
    assert tight.would_keep == []
    off = replay(records, 0)
    assert sorted((x.group_id, x.attempt) for x in off.would_keep) == [("C", 0), ("C", 1), ("E", 0)]
    assert off.would_drop == [] and off.replay_dropped == 0
    wide = replay(records, 3)
    assert sorted((x.group_id, x.attempt) for x in wide.would_keep) == [("C", 0), ("C", 1), ("E", 0)]
    DecisionFile(tmp_path / "decisions.jsonl").pull(redis_client, keys)
    assert replay_cli.main([str(tmp_path), "--keep-versions", "1", "0"]) == 0
    out = capsys.readouterr().out
    assert "group_id=D attempt=0" in out and "keep_versions=0" in out


def test_a_log_that_disagrees_with_the_rule_is_reported_not_reproduced(redis_client: redis.Redis, keys: Keys,
                                                                       tmp_path: Path) -> None:
    recorded_run(redis_client, keys)
    DecisionFile(tmp_path / "decisions.jsonl").pull(redis_client, keys)
    path = tmp_path / "decisions.jsonl"
    path.write_text(path.read_text().replace('"keep_versions": 3', '"keep_versions": 1'))  # a forged window
    assert replay_cli.main([str(tmp_path)]) == 1
