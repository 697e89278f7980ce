"""Pure cores of the rollout worker: failure classification, the upstream gate, group assembly."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.rollout_worker.assembly import (
    TrajectoryResult,
    completed_group,
    failed_group,
    finalize_samples,
    session_id,
)
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.upstream import UpstreamGate
from shared.codec import decode_entry, encode_entry
from shared.codes import STALENESS_EXCEEDED
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


@pytest.mark.parametrize("code", ["upstream_unavailable", "proxy_unreachable", "proxy_timeout", "proxy_http_502",
                                  "proxy_http_503", "proxy_http_504"])
def test_upstream_unavailable_is_infrastructure(code: str) -> None:
    assert TrajectoryFailed(code).infrastructure


@pytest.mark.parametrize("code", [STALENESS_EXCEEDED, "trajectory_version_changed", "generation_preempted",
                                  "trajectory_timeout", "agent_exit", "invalid_prompt_group", "internal_error",
                                  "proxy_http_500", "session_not_found", "upstream_error"])
def test_the_groups_own_failures_are_not_infrastructure(code: str) -> None:
    assert not TrajectoryFailed(code).infrastructure


def test_failed_group_carries_code_retryable_and_the_prompt_group() -> None:
    g = group(attempt=1)
    rg = failed_group(g, TrajectoryFailed("generation_preempted", "x"), "w1", 5.0, 6.0)
    assert (rg.status, rg.error, rg.error_code, rg.retryable) == ("failed", "generation_preempted: x",
                                                                  "generation_preempted", True)
    assert (rg.samples, rg.attempt, rg.meta["worker"], rg.prompt_group) == ([], 1, "w1", g)
    back = decode_entry(encode_entry(rg), RolloutGroup)
    assert back.prompt_group == g and back.error == rg.error and back.error_code == rg.error_code
    bad = failed_group(g, TrajectoryFailed("invalid_prompt_group", "y" * 5000, retryable=False), "w1", 5.0, 6.0)
    assert not bad.retryable and len(bad.error or "") == 1000


def test_the_gate_closed_lets_every_free_slot_start() -> None:
    gate = UpstreamGate(first_s=1.0, max_s=4.0, clock=lambda: 0.0)
    assert not gate.is_down and gate.slots(3, 1) == 3


def test_the_gate_opens_on_failure_with_capped_doubling_then_probes_one_group() -> None:
    now = [0.0]
    gate = UpstreamGate(first_s=1.0, max_s=4.0, clock=lambda: now[0])
    assert [gate.down() for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    assert gate.is_down and gate.slots(3, 0) == 0  # open: nothing starts, new or held
    now[0] = 4.5  # past the last delay
    assert gate.slots(3, 0) == 1 and gate.slots(3, 1) == 0  # half-open: one probe at a time
    gate.up()
    assert not gate.is_down and gate.slots(3, 0) == 3 and gate.down() == 1.0  # backoff reset


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
    assert back.prompt_group == g
