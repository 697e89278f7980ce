"""``staleness.mode: wait`` in the collector's pure core: nothing dropped for staleness, oldest group first."""

from __future__ import annotations

import itertools

import pytest
from rollout_factory import rollout_group

from services.group_collector.core import CollectorCore
from services.group_collector.outcomes import Arrival, BatchOut, Reenqueue
from shared.config import load_config
from shared.errors import ConfigError
from shared.schemas import RolloutGroup
from shared.staleness import StalenessConfig, StalenessConfigError, StalenessGroupFilter, StalenessTracker
from shared.staleness.window import Mode

_ids = itertools.count(1)


def core(mode: Mode = "wait", keep: int | None = None, per_batch: int = 2) -> CollectorCore:
    batch_ids = (f"b{i}" for i in itertools.count(1))
    return CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(keep, mode))), per_batch, 2,
                         clock=lambda: 500.0, new_batch_id=lambda: next(batch_ids))


def arrive(group: RolloutGroup) -> Arrival:
    return Arrival(f"1-{next(_ids)}".encode(), group)


def arrivals(*groups: tuple[str, list[str | None]]) -> list[Arrival]:
    """One arrival per ``(group_id, end versions)``, in this order."""
    return [arrive(rollout_group(gid, versions)) for gid, versions in groups]


def batch_members(actions: list) -> list[list[str]]:
    return [[g.group_id for g in a.batch.groups] for a in actions if isinstance(a, BatchOut)]


def test_wait_mode_never_drops_a_stale_group_and_trains_it() -> None:
    c = core(per_batch=1)
    c.on_published([str(v) for v in range(10)])
    assert c.on_arrivals([arrive(rollout_group("old", ["0", "9"]))]) == []  # gap 9: kept
    assert c.on_published(["10"]) == [] and c.on_keep_versions(0) == []
    assert batch_members(c.assemble(1, "10")) == [["old"]]


def test_the_same_groups_are_dropped_in_drop_mode() -> None:
    c = core(mode="drop", keep=2, per_batch=1)
    c.on_published([str(v) for v in range(10)])
    [action] = c.on_arrivals([arrive(rollout_group("old", ["0", "9"]))])
    assert isinstance(action, Reenqueue) and action.why == "stale"


def test_batches_take_the_oldest_end_version_first_then_arrival_and_the_rest_keep_arrival_order() -> None:
    c = core(per_batch=2)
    c.on_published(["0", "1", "2", "3"])
    c.on_arrivals(arrivals(("a", ["3"]), ("b", ["1", "3"]), ("c", ["2"]), ("d", ["3", "1"]), ("e", ["0"])))
    [first] = c.assemble(1, "3")
    assert batch_members([first]) == [["e", "b"]]  # oldest end version 0, then 1 (b arrived before d)
    assert [a.group.group_id for a in c.waiting] == ["a", "c", "d"]
    assert batch_members(c.assemble(1, "3")) == [["d", "c"]]


def test_drop_mode_keeps_arrival_order() -> None:
    c = core(mode="drop", keep=None, per_batch=2)
    c.on_published(["0", "1", "2", "3"])
    c.on_arrivals(arrivals(("a", ["3"]), ("b", ["0"]), ("c", ["1"])))
    assert batch_members(c.assemble(1, "3")) == [["a", "b"]]


def test_a_group_without_a_real_version_goes_first_and_unpublished_versions_rank_after_published_ones() -> None:
    c = core(per_batch=2)
    c.on_published(["0", "1"])
    c.on_arrivals(arrivals(("new", ["x-unpublished"]), ("v1", ["1"]), ("none", [None])))
    assert batch_members(c.assemble(1, "1")) == [["none", "v1"]]


def test_a_live_window_is_refused_in_wait_mode_naming_the_key_and_zero_is_accepted() -> None:
    c = core()
    with pytest.raises(StalenessConfigError, match=r"staleness\.keep_versions=2 contradicts staleness\.mode=wait"):
        c.on_keep_versions(2)
    assert c.on_keep_versions("0") == [] and c.tracker.config == StalenessConfig(None, "wait")


def test_wait_mode_batches_report_the_gap_at_the_cut() -> None:
    c = core(per_batch=1)
    c.on_published(["0", "1", "2"])
    c.on_arrivals([arrive(rollout_group("g", ["0", "2"]))])
    [out] = c.assemble(1, "2")
    assert isinstance(out, BatchOut)
    assert (out.metrics["staleness/version_gap_max"], out.metrics["staleness/version_gap_min"]) == (2.0, 0.0)
    assert "staleness/dropped_groups" not in out.metrics  # no window
    assert out.batch.window.keep_versions == 0


def test_config_wait_mode_defaults_its_window_to_0_and_refuses_an_explicit_one_or_the_adaptive_window() -> None:
    cfg = load_config(None, env={}, overrides={"staleness": {"mode": "wait"}})
    assert (cfg.staleness.mode, cfg.staleness.keep_versions) == ("wait", 0)
    with pytest.raises(ConfigError, match=r"staleness\.keep_versions=2 contradicts staleness\.mode=wait"):
        load_config(None, env={}, overrides={"staleness": {"mode": "wait", "keep_versions": 2}})
    with pytest.raises(ConfigError, match=r"window_controller\.enabled"):
        load_config(None, env={}, overrides={"staleness": {"mode": "wait"}, "window_controller": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"staleness\.mode"):
        load_config(None, env={"DRESSAGE_STALENESS_MODE": "pace"})
    with pytest.raises(StalenessConfigError, match=r"staleness\.mode must be one of drop, wait"):
        StalenessConfig(None, "pace")  # type: ignore[arg-type]  # what an untyped caller could pass
