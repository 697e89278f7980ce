"""The window rule, decision records and replay arithmetic (pure, no Redis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout_factory import rollout_group, sample

from services.group_collector.decisions import records_for
from services.group_collector.outcomes import Arrival, retry_or_dead_letter
from shared.errors import MalformedEntry
from shared.staleness import StalenessConfig, StalenessTracker
from shared.window_decisions import DecisionRecord, outside_window, replay


def test_outside_window_on_hand_computed_cases() -> None:
    assert outside_window([0, 1], 2) is False and outside_window([0, 2], 2) is True
    assert outside_window([5], 0) is False and outside_window([5], None) is False  # off
    assert outside_window([], 1) is False  # no versioned trajectory: always kept
    assert outside_window([1], 1) is True


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8), st.integers(0, 8), st.integers(0, 6))
def test_the_tracker_decides_with_the_rule_on_its_own_gaps(ends: list[int], keep: int, extra: int) -> None:
    tracker = StalenessTracker(StalenessConfig(keep))
    tracker.observe_published([str(v) for v in range(max(ends) + extra + 1)])
    group = rollout_group("g", [str(v) for v in ends])
    newest = max(ends) + extra
    assert tracker.should_drop_group(group) == outside_window([newest - v for v in ends], keep)


def record(**kw: object) -> DecisionRecord:
    base: dict[str, object] = dict(group_id="g", attempt=0, versions=["1", "3"], gaps=[2, 0], keep_versions=2,
                                   current_version="3", cutoff_version="2", decision="dropped",
                                   outcome="reenqueued", reason="stale", window_decided=True, at=1.5)
    base.update(kw)
    return DecisionRecord.model_validate(base)


def test_a_record_round_trips_through_stream_fields_and_bad_fields_are_named() -> None:
    rec = record(batch_id=None)
    fields = {k.encode(): v.encode() for k, v in rec.fields().items()}
    assert DecisionRecord.from_fields(fields) == rec
    assert fields[b"gaps"] == b"[2, 0]" and fields[b"batch_id"] == b"" and fields[b"window_decided"] == b"1"
    with pytest.raises(MalformedEntry, match="attempt"):
        DecisionRecord.from_fields({**fields, b"attempt": b"-1"})


def test_replay_counts_flips_and_leaves_failures_alone() -> None:
    recs = [record(), record(group_id="t", decision="trained", outcome="batched", reason="in_window", gaps=[1, 0]),
            record(group_id="f", decision="dropped", reason="failed", window_decided=False, gaps=[])]
    own = replay(recs)
    assert own.changed == 0 and own.window_records == 2 and own.records == 3
    tight = replay(recs, 1)
    assert [r.group_id for r in tight.would_drop] == ["t"] and tight.would_keep == []
    wide = replay(recs, 3)
    assert [r.group_id for r in wide.would_keep] == ["g"] and (wide.replay_trained, wide.replay_dropped) == (2, 0)


def test_records_carry_the_gaps_the_decision_saw_without_observing_anything() -> None:
    tracker = StalenessTracker(StalenessConfig(2))
    tracker.observe_published(["0", "1", "2"])
    arrival = Arrival(b"1-0", rollout_group("g", ["0", "2"]))
    (rec,) = records_for(retry_or_dead_letter(arrival, "stale", 2, 10.0), tracker, 11.0)
    assert (rec.gaps, rec.keep_versions, rec.decision, rec.reason, rec.window_decided) == ([2, 0], 2, "dropped",
                                                                                             "stale", True)
    off = StalenessTracker(StalenessConfig(0))  # off: versions are not observed; unknown ones get -1
    (rec,) = records_for(retry_or_dead_letter(arrival, "stale", 2, 10.0), off, 11.0)
    assert rec.gaps == [-1, -1] and off.versions == []


def test_a_record_written_before_lengths_and_rewards_still_loads_with_none_of_them() -> None:
    old = {k.encode(): v.encode() for k, v in record().fields().items() if k not in ("response_tokens", "rewards")}
    rec = DecisionRecord.from_fields(old)
    assert (rec.response_tokens, rec.rewards) == ([], [])
    assert DecisionRecord.model_validate_json(record().model_dump_json(exclude={"response_tokens", "rewards"})) == rec


def test_records_carry_each_trajectorys_response_tokens_over_its_segments_and_its_last_reward() -> None:
    group = rollout_group("g", [])
    group.samples = [sample("t0", "1", 0, reward=0.0, n_response=3), sample("t1", "1", 0, reward=0.0, n_response=5),
                     sample("t0", "2", 1, reward=0.5, n_response=4)]
    (rec,) = records_for(retry_or_dead_letter(Arrival(b"1-0", group), "stale", 2, 10.0),
                         StalenessTracker(StalenessConfig(2)), 11.0)
    assert (rec.response_tokens, rec.rewards) == ([7, 5], [0.5, 0.0])
    assert DecisionRecord.from_fields(rec.fields()) == rec
    failed = rollout_group("f", [], status="failed", error="timeout")
    (none,) = records_for(retry_or_dead_letter(Arrival(b"1-1", failed), "failed", 2, 10.0),
                          StalenessTracker(StalenessConfig(2)), 11.0)
    assert (none.response_tokens, none.rewards) == ([], [])
