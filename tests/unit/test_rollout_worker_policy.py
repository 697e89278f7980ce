"""Pure cores of the rollout worker: retry policy, staleness classification, group assembly."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.rollout_worker.assembly import TrajectoryResult, completed_group, finalize_samples, session_id
from services.rollout_worker.errors import STALENESS_EXCEEDED, TrajectoryFailed
from services.rollout_worker.retry import (
    REJECTED_GROUPS,
    REJECTED_SAMPLES,
    decide,
    failed_rollout_group,
    staleness_rejection,
)
from shared.codec import decode_entry, encode_entry
from shared.schemas import PromptGroup, RolloutGroup


def group(**kw: Any) -> PromptGroup:
    base: dict[str, Any] = {"group_id": "g1", "prompt_id": "p1", "task": "reverse", "prompt": "reverse 123",
                            "reference": "321", "n_samples": 4, "attempt": 0, "enqueued_at": 1.0,
                            "meta": {"epoch": 0}}
    return PromptGroup(**{**base, **kw})


def raw_sample(sid: str, index: int, n: int = 3, **kw: Any) -> dict[str, Any]:
    return {"traj_id": sid, "segment_index": index, "token_ids": list(range(n)), "loss_mask": [0] + [1] * (n - 1),
            "logprobs": [0.0] + [-0.5] * (n - 1), "token_versions": ["-1"] + ["3"] * (n - 1),
            "end_version": "3", "start_version": "3", "reward": 0.7, **kw}


def test_failure_below_budget_is_reenqueued_as_next_attempt_with_history() -> None:
    g = group(attempt=0, meta={"epoch": 2})
    d = decide(g, "trajectory_timeout: slow", max_retries=2, now=50.0)
    assert d.action == "reenqueue" and d.handled == "reenqueued" and d.reason is None
    nxt = d.next_group
    assert nxt is not None and nxt.attempt == 1 and nxt.enqueued_at == 50.0 and nxt.group_id == "g1"
    assert nxt.meta == {"epoch": 2, "retry_history": [{"attempt": 0, "error": "trajectory_timeout: slow"}]}
    assert g.attempt == 0 and "retry_history" not in g.meta  # the input is not mutated


def test_history_accumulates_across_attempts() -> None:
    g = decide(group(), "e0", 3, 1.0).next_group
    assert g is not None
    g2 = decide(g, "e1", 3, 2.0).next_group
    assert g2 is not None and g2.attempt == 2
    assert g2.meta["retry_history"] == [{"attempt": 0, "error": "e0"}, {"attempt": 1, "error": "e1"}]


def test_last_attempt_is_dead_lettered_retries_exhausted() -> None:
    d = decide(group(attempt=2), "boom", max_retries=2, now=1.0)
    assert (d.action, d.reason, d.next_group, d.handled) == ("dead_letter", "retries_exhausted", None, "dead_lettered")


def test_zero_retries_dead_letters_the_first_failure() -> None:
    assert decide(group(attempt=0), "boom", max_retries=0, now=1.0).action == "dead_letter"


def test_non_retryable_failure_is_dead_lettered_at_once() -> None:
    d = decide(group(attempt=0), "invalid_prompt_group: task", max_retries=5, now=1.0, retryable=False)
    assert (d.action, d.reason) == ("dead_letter", "invalid_prompt_group")


def test_error_text_is_truncated_on_the_wire() -> None:
    d = decide(group(), "x" * 5000, 2, 1.0)
    assert len(d.error) == 1000 and d.next_group is not None
    assert len(d.next_group.meta["retry_history"][0]["error"]) == 1000


def test_staleness_rejection_counts_the_whole_group_once() -> None:
    assert staleness_rejection(STALENESS_EXCEEDED, 8) == {REJECTED_GROUPS: 1, REJECTED_SAMPLES: 8}


@pytest.mark.parametrize("code", ["trajectory_version_changed", "generation_preempted", "trajectory_timeout",
                                  "agent_exit", "upstream_unavailable", ""])
def test_other_failures_are_not_staleness_rejections(code: str) -> None:
    assert staleness_rejection(code, 8) == {}


def test_failed_rollout_group_carries_handling_and_the_prompt_group() -> None:
    g = group(attempt=1)
    d = decide(g, "generation_preempted: x", 2, 9.0)
    rg = failed_rollout_group(g, d, "w1", 5.0, 6.0)
    assert (rg.status, rg.error, rg.samples, rg.attempt) == ("failed", "generation_preempted: x", [], 1)
    assert rg.meta["handled"] == "reenqueued" and rg.meta["worker"] == "w1"
    assert PromptGroup.model_validate(rg.meta["prompt_group"]) == g  # the collector can rebuild it
    back = decode_entry(encode_entry(rg), RolloutGroup)
    assert back.meta["prompt_group"]["group_id"] == "g1" and back.error == rg.error


def test_session_ids_name_group_attempt_and_index_and_are_unique() -> None:
    g = group(group_id="grp", attempt=2)
    ids = {session_id(g, i) for i in range(3)} | {session_id(g, 0)}
    assert len(ids) == 4
    assert session_id(g, 1, "abcd") == "grp-a2-s1-abcd"


def test_session_ids_only_use_characters_the_proxy_accepts() -> None:
    sid = session_id(group(group_id="_run/7 #x" + "y" * 240, attempt=1), 3, "ab12")
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,255}", sid) and sid.endswith("-a1-s3-ab12")
    assert sid.startswith("g_run_7__x")


def test_reward_goes_on_the_last_segment_only_in_segment_order() -> None:
    samples = finalize_samples("s", [raw_sample("s", 2), raw_sample("s", 0), raw_sample("s", 1)], 0.25)
    assert [s.segment_index for s in samples] == [0, 1, 2]
    assert [s.reward for s in samples] == [0.0, 0.0, 0.25]


def test_missing_traj_id_is_filled_with_the_session() -> None:
    raw = raw_sample("x", 0)
    del raw["traj_id"]
    assert finalize_samples("sess", [raw], 1.0)[0].traj_id == "sess"


@pytest.mark.parametrize("raw, code", [
    ([], "no_samples_recorded"),
    (None, "no_samples_recorded"),
    ([{"traj_id": "s", "token_ids": [1, 2], "loss_mask": [1], "logprobs": [0.0], "token_versions": ["1"]}],
     "invalid_samples"),
    (["not a dict"], "invalid_samples"),
])
def test_unusable_session_records_fail_the_trajectory(raw: Any, code: str) -> None:
    with pytest.raises(TrajectoryFailed) as info:
        finalize_samples("s", raw, 1.0)
    assert info.value.code == code and info.value.session_id == "s"


def test_duplicate_segment_indices_are_refused() -> None:
    with pytest.raises(TrajectoryFailed, match="duplicate segment_index"):
        finalize_samples("s", [raw_sample("s", 0), raw_sample("s", 0)], 1.0)


def test_completed_group_meta_and_wire_round_trip() -> None:
    g = group(n_samples=2)
    results = [TrajectoryResult(f"s{i}", r, r == 1.0, 1, finalize_samples(f"s{i}", [raw_sample(f"s{i}", 0)], r))
               for i, r in enumerate([1.0, 0.3])]
    rg = completed_group(g, results, "w9", 10.0, 12.5, "whitebox")
    assert rg.status == "completed" and rg.error is None and len(rg.samples) == 2
    m = rg.meta
    assert (m["task"], m["n_samples"], m["worker"], m["agent"]) == ("reverse", 2, "w9", "whitebox")
    assert (m["rewards"], m["correct"], m["sessions"]) == ([1.0, 0.3], [True, False], ["s0", "s1"])
    assert (m["rollout_started_at"], m["rollout_finished_at"]) == (10.0, 12.5)
    back = decode_entry(encode_entry(rg), RolloutGroup)
    assert back.reward_mean == pytest.approx(0.65) and back.end_versions == ["3", "3"]
    assert PromptGroup.model_validate(back.meta["prompt_group"]) == g
