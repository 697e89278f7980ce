"""Staleness window: config, ordering (observed vs published), whole-group drops, filter flow, metrics."""

from __future__ import annotations

import logging
from typing import Any, Literal

import pytest

from shared.errors import ConfigError
from shared.schemas import RolloutGroup, Sample
from shared.staleness import (
    StalenessConfig,
    StalenessConfigError,
    StalenessGroupFilter,
    StalenessTracker,
    config_from_value,
)


def smp(traj_id: str, end_version: str | None, token_versions: list[str] | None = None) -> Sample:
    tv = token_versions or []
    return Sample(traj_id=traj_id, token_ids=[0] * len(tv), loss_mask=[0] * len(tv), logprobs=[0.0] * len(tv),
                  token_versions=tv, end_version=end_version)


def group(*trajs: Any, attempt: int = 0, status: Literal["completed", "failed"] = "completed",
          samples: list[Sample] | None = None) -> RolloutGroup:
    """A rollout group; each traj is a version label or a (traj_id, version) pair (or pass ``samples``)."""
    if samples is None:
        samples = []
        for i, t in enumerate(trajs):
            traj_id, version = t if isinstance(t, tuple) else (f"t{i}", t)
            samples.append(smp(traj_id, version))
    return RolloutGroup(group_id="g", prompt_id="p", attempt=attempt, status=status, samples=samples)


def tracker(keep: int | None, published: list[str] | None = None) -> StalenessTracker:
    t = StalenessTracker(StalenessConfig(keep))
    if published is not None:
        t.observe_published(published)
    return t


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "keep"), [(None, None), (0, None), ("0", None), (3, 3), ("3", 3), (" 2 ", 2), (2.0, 2)]
)
def test_config_from_value_accepts_non_negative_integers(raw: object, keep: int | None) -> None:
    cfg = config_from_value(raw)
    assert cfg.keep_versions == keep and cfg.enabled == (keep is not None)


@pytest.mark.parametrize("raw", [-1, "-1", 2.7, True, "abc", [2]])
def test_config_from_value_rejects_bad_values_naming_the_key(raw: object) -> None:
    with pytest.raises(
        StalenessConfigError, match=r"staleness\.keep_versions must be an integer >= 0"
    ) as info:
        config_from_value(raw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)


def test_config_zero_means_off_even_when_constructed_directly() -> None:
    assert not StalenessConfig(0).enabled and StalenessConfig(0).keep_versions is None
    with pytest.raises(StalenessConfigError):
        StalenessConfig(-2)


# --- ordering ------------------------------------------------------------------------------


def test_observation_order_without_published_log() -> None:
    t = tracker(2)
    assert t.observe_group(group("v2", "v1"))
    assert t.versions == ["v2", "v1"]
    assert not t.observe_group(group("v1", "v2"))  # nothing new


def test_published_log_fixes_an_inverted_first_sighting() -> None:
    t = tracker(1)
    t.observe_group(group("v2", "v1"))  # newer trajectory listed first
    assert t.should_drop_group(group("v2"))  # observation order alone inverts the window
    assert t.observe_published(["v1", "v2"])
    assert t.versions == ["v1", "v2"]
    assert not t.should_drop_group(group("v2")) and t.should_drop_group(group("v1"))


def test_published_versions_count_even_if_no_trajectory_ended_on_them() -> None:
    t = tracker(2, ["0", "1", "2", "3"])
    assert t.current_version_label == "3" and t.cutoff_version_label == "2"
    assert t.should_drop_group(group("1")) and not t.should_drop_group(group("2"))


def test_unpublished_version_ranks_as_if_published_when_first_observed() -> None:
    t = tracker(3, ["0", "1"])
    t.observe_group(group("x"))
    t.observe_published(["0", "1", "2"])
    assert t.versions == ["0", "1", "x", "2"]
    assert t.observe_published(["0", "1", "2", "x"])  # x published later: moves to its log position
    assert t.versions == ["0", "1", "2", "x"]


def test_unpublished_versions_seen_before_any_publication_come_first() -> None:
    t = tracker(2)
    t.observe_group(group("base", "warm"))
    t.observe_published(["0"])
    assert t.versions == ["base", "warm", "0"]


def test_version_seen_before_its_publication_stays_newest() -> None:
    t = tracker(1, ["3", "4"])
    t.observe_group(group("5"))  # the collector saw the trajectory before the version bus
    assert t.current_version_label == "5" and t.should_drop_group(group("4"))
    assert not t.observe_published(["3", "4", "5"])  # already in the right place: no change
    assert t.versions == ["3", "4", "5"]


def test_observe_published_is_incremental_and_skips_non_real_labels() -> None:
    t = tracker(2)
    assert t.observe_published(["0", "1"])
    assert not t.observe_published(["0", "1"])
    assert t.observe_published(["1", "2", "-1", None, " 3 "])
    assert t.versions == ["0", "1", "2", "3"]


def test_published_log_is_recorded_while_off_and_used_once_turned_on() -> None:
    t = tracker(None)
    assert not t.observe_published(["0", "1", "2"])
    assert t.cutoff_version_index is None and not t.should_drop_group(group("0"))
    assert t.set_keep_versions(1)
    assert t.should_drop_group(group("1")) and not t.should_drop_group(group("2"))


# --- window --------------------------------------------------------------------------------


def test_keep_one_keeps_only_the_newest_version() -> None:
    t = tracker(1)
    t.observe_group(group("v0"))
    assert not t.should_drop_group(group("v0"))
    t.observe_group(group("v1"))
    assert t.should_drop_group(group("v0")) and not t.should_drop_group(group("v1"))


def test_keep_n_cutoff_stays_zero_until_more_than_n_versions() -> None:
    t = tracker(3)
    for i, v in enumerate(["a", "b", "c"]):
        t.observe_group(group(v))
        assert t.cutoff_version_index == 0 and t.current_version_index == i
    t.observe_group(group("d"))
    assert (t.cutoff_version_index, t.cutoff_version_label, t.current_version_label) == (1, "b", "d")
    assert t.should_drop_group(group("a")) and not t.should_drop_group(group("b"))


def test_one_stale_trajectory_drops_the_whole_group() -> None:
    t = tracker(1, ["0", "1"])
    assert t.should_drop_group(group("1", "1", "0", "1"))


def test_group_without_versioned_trajectories_is_never_dropped() -> None:
    t = tracker(1, ["0", "1", "2"])
    assert not t.should_drop_group(group(None, "-1", "unknown", ""))
    assert not t.should_drop_group(group())
    assert not t.observe_group(group(None, "-1", "unknown", ""))
    assert t.versions == ["0", "1", "2"]


def test_non_real_versions_never_advance_the_window() -> None:
    t = tracker(1, ["0"])
    for label in ["-1", "unknown", "NONE", " ", None]:
        assert not t.observe_group(group(label))
    assert t.versions == ["0"]


def test_labels_are_stripped_consistently() -> None:
    t = tracker(1, ["v1"])
    assert not t.observe_group(group(" v1 "))
    assert not t.should_drop_group(group("v1 "))


def test_disabled_tracker_observes_and_drops_nothing() -> None:
    for keep in (None, 0):
        t = tracker(keep)
        assert not t.enabled
        assert not t.observe_group(group("v0")) and not t.observe_group(group("v1"))
        assert t.versions == [] and not t.should_drop_group(group("v0"))
        assert t.cutoff_version_index is None and t.cutoff_version_label is None


def test_index_of_unknown_version_observes_it() -> None:
    t = tracker(2, ["0", "1"])
    assert t.index("1") == 1
    assert t.index("new") == 2 and t.versions == ["0", "1", "new"]
    assert t.version_gap("0") == 2 and t.version_gap("new") == 0
    with pytest.raises(ValueError, match="not a real version"):
        t.index("-1")


def test_should_drop_observes_unknown_versions_before_testing() -> None:
    t = tracker(1, ["0"])
    assert t.should_drop_group(group("0", "1"))  # "1" is newer: the window moved to it
    assert t.versions == ["0", "1"]


def test_live_change_of_keep_versions() -> None:
    t = tracker(3, ["0", "1", "2", "3"])
    assert not t.should_drop_group(group("1"))
    assert t.set_keep_versions(1)
    assert t.should_drop_group(group("2")) and not t.should_drop_group(group("3"))
    assert not t.set_keep_versions("1")  # same size: nothing to re-check
    with pytest.raises(StalenessConfigError, match=r"staleness\.keep_versions"):
        t.set_keep_versions(-1)
    assert t.config.keep_versions == 1  # a rejected change leaves the window alone
    assert not t.set_keep_versions(0)
    assert not t.should_drop_group(group("0"))


# --- filter --------------------------------------------------------------------------------


def test_window_advance_rechecks_pending_groups() -> None:
    f = StalenessGroupFilter(tracker(1))
    a, b = group("v0"), group("v1", "v1")
    assert f.observe_completed([a])
    pending = [("A", a)] if f.keep_group("A", a) else []
    assert f.observe_completed([b, None])  # advanced: re-check what is waiting
    pending, dropped = f.filter_pending(pending)
    assert pending == [] and dropped == [("A", a)]
    assert f.keep_group("B", b) and f.dropped_groups == 1


def test_failed_groups_are_observed_too() -> None:
    f = StalenessGroupFilter(tracker(1))
    failed = group(status="failed", samples=[smp("t", "v5")])
    f.observe_completed([group("v4"), failed])
    assert not f.keep_group("old", group("v4"))


def test_filter_pending_partitions_in_order() -> None:
    f = StalenessGroupFilter(tracker(2, ["0", "1", "2"]))
    pending = [("a", group("2")), ("b", group("0")), ("c", group("1")), ("d", group("1", "0"))]
    kept, dropped = f.filter_pending(pending)
    assert [k for k, _ in kept] == ["a", "c"] and [k for k, _ in dropped] == ["b", "d"]


def test_dropped_groups_is_cumulative_across_calls() -> None:
    f = StalenessGroupFilter(tracker(1, ["0", "1"]))
    for i in range(3):
        f.filter_pending([(f"g{i}", group("0"))])
    assert f.dropped_groups == 3
    assert f.metrics_for_groups([])["staleness/dropped_groups"] == 3.0


def test_drop_is_logged_with_ids_and_window(caplog: pytest.LogCaptureFixture) -> None:
    f = StalenessGroupFilter(tracker(1, ["0", "1"]), name="collector")
    with caplog.at_level(logging.INFO, logger="shared.staleness"):
        assert not f.keep_group("grp-7", group("0", attempt=2))
    msg = caplog.records[-1].getMessage()
    for part in (
        "grp-7",
        "attempt=2",
        "cutoff_version_index=1",
        "cutoff_version=1",
        "current_version_index=1",
    ):
        assert part in msg
    assert "dropped_groups=1" in msg


def test_disabled_filter_keeps_everything() -> None:
    f = StalenessGroupFilter(tracker(None))
    assert not f.observe_completed([group("0"), group("1")])
    assert f.filter_pending([("a", group("0"))]) == ([("a", group("0"))], [])
    assert f.dropped_groups == 0


def test_metrics_are_trajectory_weighted() -> None:
    f = StalenessGroupFilter(tracker(3, ["0", "1", "2"]))
    g1 = group("2", "1", "1")
    g2 = group(samples=[smp("x", "0", ["-1", "0", "1"])])
    m = f.metrics_for_groups([g1, g2])
    assert m["staleness/current_version_index"] == 2.0 and m["staleness/cutoff_version_index"] == 0.0
    assert (m["staleness/version_gap_min"], m["staleness/version_gap_max"]) == (0.0, 2.0)
    assert m["staleness/version_gap_mean"] == pytest.approx((0 + 1 + 1 + 2) / 4)
    assert (m["staleness/version_span_min"], m["staleness/version_span_max"]) == (0.0, 2.0)
    assert m["staleness/version_span_mean"] == pytest.approx(2 / 4)


def test_metrics_when_off_carry_only_version_spans() -> None:
    f = StalenessGroupFilter(tracker(0))
    g = group(samples=[smp("x", "1", ["0", "1"])])
    assert f.metrics_for_groups([g]) == {
        "staleness/version_span_min": 2.0,
        "staleness/version_span_max": 2.0,
        "staleness/version_span_mean": 2.0,
    }
    assert f.tracker.versions == []


def test_metrics_without_groups_or_versions() -> None:
    assert StalenessGroupFilter(tracker(2)).metrics_for_groups([]) == {"staleness/dropped_groups": 0.0}


def test_groups_of_real_samples_with_segments() -> None:
    def sample(traj: str, seg: int, versions: list[str]) -> Sample:
        mask = [0] + [1] * (len(versions) - 1)
        from shared.staleness import sample_version_fields

        return Sample(
            traj_id=traj,
            segment_index=seg,
            token_ids=list(range(len(versions))),
            loss_mask=mask,
            logprobs=[0.0] * len(versions),
            token_versions=versions,
            **sample_version_fields(mask, versions),
        )

    rg = RolloutGroup(
        group_id="g",
        prompt_id="p",
        attempt=1,
        status="completed",
        samples=[sample("a", 1, ["-1", "1", "2"]), sample("a", 0, ["-1", "0"]), sample("b", 0, ["-1", "1"])],
    )
    assert rg.samples[0].partial_rollout and rg.samples[0].end_version == "2"
    f = StalenessGroupFilter(tracker(1, ["0", "1", "2"]))
    assert not f.keep_group("g", rg)  # trajectory b ends on "1", outside a 1-version window
    assert f.tracker.set_keep_versions(2) and f.keep_group("g", rg.samples)
    m = f.metrics_for_groups([rg])
    assert m["staleness/version_gap_max"] == 1.0 and m["staleness/version_span_max"] == 3.0  # a: 0, 1, 2
