"""Per-token version helpers: real versions, spans, masks, sample fields, span check, trajectory versions."""

from __future__ import annotations

import pytest

from shared.errors import InvalidSample
from shared.schemas import RolloutGroup, Sample
from shared.staleness import (
    SpanCheck,
    TrajectoryVersionInfo,
    check_version_span,
    mask_nonlast_version_tokens,
    normalize_token_versions,
    ordered_real_versions,
    sample_version_fields,
    trajectory_version_infos,
    trajectory_version_span,
    version_spans,
)
from shared.versions import real_version


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("-1", None),
        (" -1 ", None),
        (-1, None),
        ("unknown", None),
        ("UNKNOWN", None),
        ("NONE", None),
        ("none ", None),
        (0, "0"),
        ("0", "0"),
        (" weight-current ", "weight-current"),
        ("v1", "v1"),
        (-2, "-2"),
    ],
)
def test_real_version_rule(raw: object, expected: str | None) -> None:
    assert real_version(raw) == expected


def test_ordered_real_versions_unique_in_first_seen_order_and_stripped() -> None:
    assert ordered_real_versions(["-1", "v2", " v1", None, "v2", "v1 ", "unknown", 3]) == ["v2", "v1", "3"]


def test_normalize_token_versions_uses_one_sentinel() -> None:
    assert normalize_token_versions([" v1 ", None, "unknown", "-1", 0]) == ["v1", "-1", "-1", "-1", "0"]


def test_version_spans_reference_example() -> None:
    assert version_spans(["-1", "-1", "v1", "v1", "-1", "v2"]) == [
        {"start": 0, "end": 2, "version": "-1"},
        {"start": 2, "end": 4, "version": "v1"},
        {"start": 4, "end": 5, "version": "-1"},
        {"start": 5, "end": 6, "version": "v2"},
    ]


def test_version_spans_empty_and_single() -> None:
    assert version_spans([]) == []
    assert version_spans(["v1"]) == [{"start": 0, "end": 1, "version": "v1"}]


@pytest.mark.parametrize(
    ("mask", "versions", "expected"),
    [
        ([0, 1, 1, 0, 1], ["-1", "v0", "v1", "-1", "v1"], [0, 0, 1, 0, 1]),  # docs/architecture.md#loss-mask
        ([0, 1, 1, 1], ["-1", "v1", "unknown", "v2"], [0, 0, 0, 1]),  # docs/architecture.md#loss-mask
        ([0, 1, 1, 1], ["-1", "v1", "unknown", "v1"], [0, 1, 1, 1]),  # one real version: unchanged
        ([0, 1, 1], ["-1", "-1", "-1"], [0, 1, 1]),  # no real version: unchanged
        ([0, 1, 1], ["-1", " v1", "v1 "], [0, 1, 1]),  # same version once stripped
        ([1, 1, 0, 1], ["v2", "v1", "v3", "v1"], [0, 1, 0, 1]),  # last real loss version, not token order
        ([], [], []),
    ],
)
def test_mask_nonlast_version_tokens(mask: list[int], versions: list[str], expected: list[int]) -> None:
    assert mask_nonlast_version_tokens(mask, versions) == expected


def test_mask_rejects_misaligned_or_non_binary_input_naming_the_field() -> None:
    with pytest.raises(InvalidSample, match="token_versions"):
        mask_nonlast_version_tokens([0, 1], ["v1"])
    with pytest.raises(InvalidSample, match=r"loss_mask\[1\]"):
        mask_nonlast_version_tokens([0, 2], ["v1", "v1"])


def test_sample_version_fields_partial_rollout() -> None:
    fields = sample_version_fields([0, 1, 1, 0, 1], ["-1", "v0", " v1 ", "-1", "v1"])
    assert fields == {
        "version_spans": [
            {"start": 0, "end": 1, "version": "-1"},
            {"start": 1, "end": 2, "version": "v0"},
            {"start": 2, "end": 3, "version": "v1"},
            {"start": 3, "end": 4, "version": "-1"},
            {"start": 4, "end": 5, "version": "v1"},
        ],
        "start_version": "v0",
        "end_version": "v1",
        "partial_rollout": True,
    }


def test_sample_version_fields_only_counts_loss_tokens() -> None:
    fields = sample_version_fields([0, 0, 1, 1], ["v0", "unknown", "v1", "v1"])
    assert (fields["start_version"], fields["end_version"], fields["partial_rollout"]) == ("v1", "v1", False)
    none = sample_version_fields([0, 1], ["v0", "-1"])
    assert (none["start_version"], none["end_version"], none["partial_rollout"]) == (None, None, False)


def test_span_check_within_limit() -> None:
    check = check_version_span(["-1", "v1", "v1"], ["v1", " v2"], max_preempts=1)
    assert check == SpanCheck(["v1", "v2"], 2, 1, 1, 2, exceeded=False)


def test_span_check_exceeded_and_detail_body() -> None:
    check = check_version_span(["v1", "v2"], ["unknown", "v3"], max_preempts=1)
    assert check.exceeded and check.version_switches == 2
    assert check.detail("sess-1") == {
        "error": "partial_rollout_staleness_exceeded",
        "message": "Partial rollout model version span exceeded limit; rejecting the trajectory instead of continuing it.",
        "versions": ["v1", "v2", "v3"],
        "version_span": 3,
        "version_switches": 2,
        "max_preempts": 1,
        "max_version_span": 2,
        "session_id": "sess-1",
    }


def test_span_check_zero_preempts_rejects_any_switch_and_none_never_rejects() -> None:
    assert check_version_span(["v1"], ["v2"], max_preempts=0).exceeded
    assert not check_version_span(["v1"], ["v1", "-1"], max_preempts=0).exceeded
    unlimited = check_version_span(["v1", "v2"], ["v3", "v4"], max_preempts=None)
    assert not unlimited.exceeded and unlimited.max_version_span is None and unlimited.version_span == 4
    empty = check_version_span([], [], max_preempts=0)
    assert (empty.version_span, empty.version_switches, empty.exceeded) == (0, 0, False)
    with pytest.raises(ValueError, match="max_preempts"):
        check_version_span([], [], max_preempts=-1)


def _s(traj: str, end: str | None, seg: int = 0, token_versions: list[str] | None = None) -> Sample:
    tv = token_versions or []
    return Sample(traj_id=traj, segment_index=seg, token_ids=[0] * len(tv), loss_mask=[0] * len(tv),
                  logprobs=[0.0] * len(tv), token_versions=tv, end_version=end)


def test_trajectory_version_is_the_highest_segment_regardless_of_order() -> None:
    group = [_s("a", "v2", seg=1), _s("a", "v1", seg=0), _s("b", "v0", seg=0)]
    assert trajectory_version_infos(group) == [
        TrajectoryVersionInfo("a", "v2"),
        TrajectoryVersionInfo("b", "v0"),
    ]


def test_trajectory_version_tie_goes_to_the_later_sample() -> None:
    assert trajectory_version_infos([_s("a", "v1", 2), _s("a", "v3", 2)]) == [("a", "v3")]
    assert trajectory_version_infos([_s("a", "v3", 2), _s("a", "v1", 2)]) == [("a", "v1")]


def test_trajectory_order_is_first_insertion_order() -> None:
    group = [_s("b", "v1"), _s("a", "v2"), _s("b", "v3", 1)]
    assert [i.key for i in trajectory_version_infos(group)] == ["b", "a"]
    assert trajectory_version_infos(group)[0].version == "v3"


def test_non_real_end_versions_are_skipped() -> None:
    group = [_s("a", None), _s("b", "-1"), _s("c", " unknown "), _s("d", " v4 ")]
    assert trajectory_version_infos(group) == [("d", "v4")]


def test_last_versioned_segment_wins_when_the_last_segment_has_no_version() -> None:
    assert trajectory_version_infos([_s("a", "v1", 0), _s("a", None, 1)]) == [("a", "v1")]


def test_a_rollout_group_or_its_samples_are_accepted() -> None:
    rg = RolloutGroup(group_id="g", prompt_id="p", attempt=0, status="completed", samples=[_s("a", "v1")])
    assert trajectory_version_infos(rg) == trajectory_version_infos(rg.samples) == [("a", "v1")]
    assert trajectory_version_infos(None) == []


def test_trajectory_version_span_unions_segments() -> None:
    samples = [
        _s("a", "v1", 0, token_versions=["-1", "v0", "v1"]),
        _s("a", "v2", 1, token_versions=["-1", " v1", "v2"]),
        _s("b", "v2", 0, token_versions=["-1", "v2"]),
        _s("c", None, 0, token_versions=["-1"]),
    ]
    assert trajectory_version_span(samples) == {"a": 3, "b": 1, "c": 0}
