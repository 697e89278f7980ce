"""The collector's pure decision core: window, whole-group drops, retries, dedup, batch assembly."""

from __future__ import annotations

import itertools

import pytest
from rollout_factory import rollout_group

from services.group_collector.core import CollectorCore
from services.group_collector.outcomes import (
    Arrival,
    BatchOut,
    DeadLetterOut,
    Discard,
    Reenqueue,
    done_key,
)
from shared.errors import ConfigError
from shared.schemas import RolloutGroup
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker

_ids = itertools.count(1)


def core(keep: int | None = 2, per_batch: int = 2, retries: int = 2, now: float = 500.0) -> CollectorCore:
    tracker = StalenessTracker(StalenessConfig(keep))
    batch_ids = (f"b{i}" for i in itertools.count(1))
    return CollectorCore(StalenessGroupFilter(tracker), per_batch, retries, clock=lambda: now,
                         new_batch_id=lambda: next(batch_ids))


def arrive(group: RolloutGroup, entry_id: bytes | None = None) -> Arrival:
    return Arrival(entry_id or f"1-{next(_ids)}".encode(), group, {b"group_id": group.group_id.encode()})


def kinds(actions: list) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_groups_inside_the_window_wait_and_are_cut_into_a_batch() -> None:
    c = core(keep=2)
    c.on_published(["0", "1"])
    assert c.on_arrivals([arrive(rollout_group("g1", ["1", "1"]))]) == []
    assert c.assemble(slots=1, trainer_version="1") == []  # one group is not a batch of two
    c.on_arrivals([arrive(rollout_group("g2", ["0", "1"]))])
    [out] = c.assemble(slots=1, trainer_version="1")
    assert isinstance(out, BatchOut)
    assert [g.group_id for g in out.batch.groups] == ["g1", "g2"]
    assert out.batch.trainer_version == "1"
    assert out.batch.window.model_dump() == {"keep_versions": 2, "current_version": "1", "cutoff_version": "0"}
    assert out.stats == {"groups_batched": 2, "batches_produced": 1}
    assert out.done_keys == ["g1:0", "g2:0"] and out.closed_ids == ["g1", "g2"]
    assert c.waiting == []


def test_a_group_with_one_stale_trajectory_is_dropped_whole_and_reenqueued_as_next_attempt() -> None:
    c = core(keep=2, now=777.0)
    c.on_published(["0", "1", "2"])
    [action] = c.on_arrivals([arrive(rollout_group("g1", ["2", "0", "2"]))])
    assert isinstance(action, Reenqueue) and action.why == "stale"
    assert action.prompt.group_id == "g1" and action.prompt.attempt == 1
    assert action.prompt.enqueued_at == 777.0  # fresh
    assert action.prompt.retry_history[-1].reason == "stale" and action.prompt.retry_history[-1].at == 777.0
    assert action.stats == {"groups_reenqueued": 1, "reenqueued:stale": 1, "groups_dropped_stale": 1}
    assert c.waiting == []


def test_the_last_attempt_of_a_stale_group_is_dead_lettered() -> None:
    c = core(keep=1, retries=2)
    c.on_published(["0", "1"])
    [retry] = c.on_arrivals([arrive(rollout_group("g1", ["0"], attempt=1))])
    assert isinstance(retry, Reenqueue) and retry.prompt.attempt == 2
    [dead] = c.on_arrivals([arrive(rollout_group("g1", ["0"], attempt=2))])
    assert isinstance(dead, DeadLetterOut)
    assert dead.reason == "stale_retries_exhausted"
    assert dead.stats["groups_dead_lettered"] == 1 and dead.stats["groups_dropped_stale"] == 1
    assert dead.closed_ids == ["g1"]


def test_failed_group_is_retried_then_dead_lettered_with_retries_exhausted() -> None:
    c = core(retries=1)
    [retry] = c.on_arrivals([arrive(rollout_group("g1", [], status="failed", error="timeout"))])
    assert isinstance(retry, Reenqueue) and retry.why == "failed" and retry.prompt.attempt == 1
    assert [(h.attempt, h.reason, h.error) for h in retry.prompt.retry_history] == [(0, "failed", "timeout")]
    [dead] = c.on_arrivals([arrive(rollout_group("g1", [], attempt=1, status="failed", error="timeout"))])
    assert isinstance(dead, DeadLetterOut) and dead.reason == "retries_exhausted"
    assert "timeout" in dead.error


def test_a_failed_group_that_cannot_be_retried_is_dead_lettered_at_once_and_closed() -> None:
    c = core(keep=1, retries=5)
    bad = rollout_group("g2", [], status="failed", error="invalid_prompt_group: unknown task", retryable=False)
    [dead] = c.on_arrivals([arrive(bad)])
    assert isinstance(dead, DeadLetterOut) and dead.reason == "invalid_prompt_group"
    assert dead.closed_ids == ["g2"] and dead.stats["dead_lettered:invalid_prompt_group"] == 1
    # A late copy of the dead-lettered group can no longer be trained.
    [late] = c.on_arrivals([arrive(rollout_group("g2", ["5"], attempt=1))])
    assert isinstance(late, Discard) and late.why == "closed"


def test_failed_groups_advance_the_window_too() -> None:
    c = core(keep=1)
    c.on_arrivals([arrive(rollout_group("g1", ["5"], status="failed", error="x"))])
    assert c.tracker.current_version_label == "5"


def test_retry_history_and_error_text_are_cut_to_one_limit() -> None:
    c = core(retries=3)
    [retry] = c.on_arrivals([arrive(rollout_group("g1", [], status="failed", error="x" * 5000))])
    assert isinstance(retry, Reenqueue) and len(retry.prompt.retry_history[0].error) == 1000
    [dead] = c.on_arrivals([arrive(rollout_group("g9", [], status="failed", error="y" * 5000, retryable=False))])
    assert isinstance(dead, DeadLetterOut) and len(dead.error) == 1000


def test_batches_carry_the_groups_without_their_prompt_groups() -> None:
    c = core(per_batch=1)
    c.on_arrivals([arrive(rollout_group("g1", ["0"]))])
    [out] = c.assemble(1, "0")
    assert isinstance(out, BatchOut) and [g.prompt_group for g in out.batch.groups] == [None]
    assert out.members[0].group.prompt_group is not None  # the waiting arrival keeps it (a failed commit)


def test_new_version_in_a_read_rechecks_waiting_groups_before_admitting_new_ones() -> None:
    c = core(keep=2, per_batch=10)
    c.on_arrivals([arrive(rollout_group("old", ["1"])), arrive(rollout_group("mid", ["2"]))])
    assert [a.group.group_id for a in c.waiting] == ["old", "mid"]
    actions = c.on_arrivals([arrive(rollout_group("new", ["3"]))])  # 3 advances the window to {2, 3}
    assert kinds(actions) == ["Reenqueue"] and actions[0].arrivals[0].group.group_id == "old"
    assert [a.group.group_id for a in c.waiting] == ["mid", "new"]


def test_a_new_group_is_checked_against_the_window_advanced_by_the_same_read() -> None:
    c = core(keep=1, per_batch=10)
    actions = c.on_arrivals([arrive(rollout_group("a", ["1"])), arrive(rollout_group("b", ["2"]))])
    assert kinds(actions) == ["Reenqueue"] and actions[0].arrivals[0].group.group_id == "a"
    assert [a.group.group_id for a in c.waiting] == ["b"]


def test_published_versions_advance_the_window_and_drop_waiting_groups_at_once() -> None:
    c = core(keep=2, per_batch=10)
    c.on_published(["0", "1"])
    c.on_arrivals([arrive(rollout_group("g0", ["0"])), arrive(rollout_group("g1", ["1"]))])
    actions = c.on_published(["0", "1", "2"])  # a version no trajectory ended on still counts
    assert [a.arrivals[0].group.group_id for a in actions] == ["g0"]
    assert c.tracker.cutoff_version_label == "1"


def test_published_order_beats_observation_order() -> None:
    c = core(keep=1, per_batch=10)
    c.on_published(["0", "1", "2"])
    c.on_arrivals([arrive(rollout_group("g", ["2", "1"]))])  # newer listed first: must not invert
    assert c.tracker.current_version_label == "2"


def test_live_keep_versions_change_applies_to_waiting_groups() -> None:
    c = core(keep=3, per_batch=10)
    c.on_published(["0", "1", "2"])
    c.on_arrivals([arrive(rollout_group(f"g{v}", [str(v)])) for v in range(3)])
    assert len(c.waiting) == 3
    actions = c.on_keep_versions("1")
    assert sorted(a.arrivals[0].group.group_id for a in actions) == ["g0", "g1"]
    assert [a.group.group_id for a in c.waiting] == ["g2"]
    with pytest.raises(ConfigError, match="staleness.keep_versions"):
        c.on_keep_versions("-1")


def test_keep_versions_zero_turns_the_filter_off() -> None:
    c = core(keep=None, per_batch=2)
    c.on_published(["0", "1", "2", "3"])
    assert c.on_arrivals([arrive(rollout_group("a", ["0"])), arrive(rollout_group("b", ["3"]))]) == []
    [batch] = c.assemble(1, "3")
    assert isinstance(batch, BatchOut) and batch.batch.window.keep_versions == 0


def test_duplicates_are_discarded_and_never_waited_on_twice() -> None:
    c = core(per_batch=10)
    g = rollout_group("g1", ["0"])
    first = arrive(g)
    assert c.on_arrivals([first]) == []
    # the very same pending entry re-delivered (restart / reconnect): no action, still waiting
    assert c.on_arrivals([first]) == []
    # another copy of g1:0 (a reclaimed duplicate) is discarded; so is a copy already done in Redis
    actions = c.on_arrivals([arrive(g), arrive(rollout_group("g2", ["0"]))], done=[False, True])
    assert [(type(a).__name__, getattr(a, "why", "")) for a in actions] == [("Discard", "waiting"), ("Discard", "done")]
    assert all(a.stats == {"groups_duplicate_discarded": 1} for a in actions)
    assert [a.group.group_id for a in c.waiting] == ["g1"]


def test_the_same_entry_twice_in_one_read_is_decided_once_and_never_discarded() -> None:
    c = core(per_batch=10)
    a = arrive(rollout_group("g1", ["0"]))
    assert c.on_arrivals([a, a]) == [] and len(c.waiting) == 1  # reclaimed and re-read in one step


def test_two_copies_in_one_read_yield_one_outcome() -> None:
    c = core(retries=3)
    g = rollout_group("g1", [], status="failed", error="boom")
    actions = c.on_arrivals([arrive(g), arrive(g)])
    assert kinds(actions) == ["Discard", "Reenqueue"]


def test_a_decided_outcome_discards_late_copies_of_the_same_attempt() -> None:
    c = core(keep=1)
    c.on_published(["0", "1"])
    c.on_arrivals([arrive(rollout_group("g1", ["0"]))])  # stale → re-enqueued as attempt 1
    [late] = c.on_arrivals([arrive(rollout_group("g1", ["1"]))])  # late copy of attempt 0
    assert isinstance(late, Discard) and late.why == "done"


def test_assemble_rechecks_and_respects_slots() -> None:
    c = core(keep=2, per_batch=1)
    c.on_arrivals([arrive(rollout_group(f"g{i}", ["0"])) for i in range(3)])
    assert kinds(c.assemble(slots=2, trainer_version="0")) == ["BatchOut", "BatchOut"]
    assert kinds(c.assemble(slots=0, trainer_version="0")) == []
    c.tracker.observe_published(["0", "1", "2"])  # the shell has not told the core yet
    assert kinds(c.assemble(slots=1, trainer_version="2")) == ["Reenqueue"]


def test_a_rejected_batch_discards_the_done_member_and_requeues_the_rest_in_front() -> None:
    c = core(per_batch=2)
    arrivals = [arrive(rollout_group(f"g{i}", ["0"])) for i in range(3)]
    c.on_arrivals(arrivals)
    [batch] = c.assemble(1, "0")
    actions = c.rejected(batch, {"g0:0"})
    assert [(type(a).__name__, a.arrivals[0].group.group_id) for a in actions] == [("Discard", "g0")]
    assert [a.group.group_id for a in c.waiting] == ["g1", "g2"]
    [again] = c.assemble(1, "0")
    assert isinstance(again, BatchOut) and [g.group_id for g in again.batch.groups] == ["g1", "g2"]


def test_forget_returns_batch_members_to_the_front() -> None:
    c = core(per_batch=2)
    c.on_arrivals([arrive(rollout_group(f"g{i}", ["0"])) for i in range(3)])
    [batch] = c.assemble(1, "0")
    assert isinstance(batch, BatchOut)
    c.forget(batch)
    assert [a.group.group_id for a in c.waiting] == ["g0", "g1", "g2"]
    assert c.on_arrivals([batch.members[0]]) == []  # re-delivery of a forgotten member is not a duplicate


def test_partial_rollout_rejections_counted_once_per_event_without_sticky_markers() -> None:
    c = core(retries=5)
    stale = rollout_group("g1", [], status="failed", error="partial_rollout_staleness_exceeded: span 3 > 2")
    [a] = c.on_arrivals([arrive(stale)])
    assert a.stats["partial_rollout_rejected_groups"] == 1 and a.stats["partial_rollout_rejected_samples"] == 1
    later = rollout_group("g1", [], attempt=1, status="failed", error="timeout")  # unrelated failure
    [b] = c.on_arrivals([arrive(later)])
    assert "partial_rollout_rejected_groups" not in b.stats
    text_only = rollout_group("g2", ["0", "0"], status="failed", error="proxy_http_500: partial_rollout_staleness_exceeded",
                              error_code="proxy_http_500")  # the code decides, not a mention in the text
    [t] = c.on_arrivals([arrive(text_only)])
    assert "partial_rollout_rejected_groups" not in t.stats


def test_a_group_without_its_prompt_group_is_dead_lettered_not_lost() -> None:
    c = core(keep=1)
    c.on_published(["0", "1"])
    [dead] = c.on_arrivals([arrive(rollout_group("g1", ["0"], with_prompt=False))])
    assert isinstance(dead, DeadLetterOut) and dead.reason == "missing_prompt_group"


def test_batch_metrics_report_gaps_spans_and_time_split() -> None:
    c = core(keep=3, per_batch=2, now=110.0)
    c.on_published(["0", "1", "2"])
    c.on_arrivals([arrive(rollout_group("a", ["0", "2"])), arrive(rollout_group("b", ["1"]))])
    [batch] = c.assemble(1, "2")
    assert isinstance(batch, BatchOut)
    m = batch.metrics
    assert (m["staleness/version_gap_min"], m["staleness/version_gap_max"]) == (0.0, 2.0)
    assert m["staleness/version_gap_mean"] == 1.0
    assert m["staleness/current_version_index"] == 2.0 and m["staleness/cutoff_version_index"] == 0.0
    assert m["staleness/version_span_max"] == 1.0
    # enqueued 100, started 101, finished 103, batched 110
    assert m["staleness/time_in_flight_s_mean"] == 3.0
    assert m["staleness/time_prompt_queue_s_mean"] == 1.0
    assert m["staleness/time_waiting_s_mean"] == 7.0


def test_done_key_format() -> None:
    assert done_key("e0-i3-p", 2) == "e0-i3-p:2"
