"""Property tests of the staleness core: exact partition, window bound, span round-trip, ordering."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.schemas import RolloutGroup, Sample
from shared.staleness import (
    StalenessConfig,
    StalenessGroupFilter,
    StalenessTracker,
    mask_nonlast_version_tokens,
    trajectory_version_infos,
    version_spans,
)
from shared.versions import real_version

LABELS = st.sampled_from(["0", "1", "2", "3", "4", "5", " 2 ", "-1", "unknown", "", None])
SAMPLE = st.builds(
    lambda traj, seg, end: Sample(traj_id=traj, segment_index=seg, token_ids=[], loss_mask=[], logprobs=[],
                                  token_versions=[], end_version=end),
    st.sampled_from(["a", "b", "c"]), st.integers(0, 3), LABELS,
)
GROUP = st.builds(lambda s: RolloutGroup(group_id="g", prompt_id="p", attempt=0, status="completed", samples=s),
                  st.lists(SAMPLE, max_size=5))
# An event is either a batch of completed groups or a longer prefix of the publication log.
EVENT = st.one_of(st.lists(GROUP, min_size=1, max_size=3), st.integers(0, 6))
PUBLISH_LOG = ["0", "1", "2", "3", "4", "5"]
FAST = settings(max_examples=150, deadline=None)


def _model_end_versions(group: RolloutGroup) -> set[str]:
    """Independent model: per traj_id, the stripped end version of its highest-segment sample (the later
    sample on a tie) among those whose label is a real version."""
    best: dict[str, tuple[int, int, str]] = {}
    for order, smp in enumerate(group.samples):
        label = None if smp.end_version is None else smp.end_version.strip()
        if label is None or label.lower() in ("", "-1", "unknown", "none"):
            continue
        key = (smp.segment_index, order, label)
        if smp.traj_id not in best or best[smp.traj_id] <= key:
            best[smp.traj_id] = key
    return {label for _, _, label in best.values()}


def _outside_window(t: StalenessTracker, keep: int, group: RolloutGroup) -> bool:
    """Independent model of the window: the newest ``keep`` known versions (all of them when keep is 0)."""
    window = set(t.versions[-keep:]) if keep else set(t.versions)
    return keep > 0 and bool(_model_end_versions(group) - window)


@FAST
@given(keep=st.integers(0, 3), events=st.lists(EVENT, max_size=12))
def test_every_group_is_kept_or_dropped_and_no_kept_group_is_outside_the_window(
    keep: int, events: list[Any]
) -> None:
    f = StalenessGroupFilter(StalenessTracker(StalenessConfig(keep)))
    pending: list[tuple[str, RolloutGroup]] = []
    seen = dropped_total = published = 0
    for event in events:
        if isinstance(event, int):
            published = max(published, event)
            advanced = f.tracker.observe_published(PUBLISH_LOG[:event])
        else:
            advanced = f.observe_completed(event)
        if advanced:
            kept, dropped = f.filter_pending(pending)
            assert sorted(map(id, kept + dropped)) == sorted(map(id, pending))  # an exact partition
            assert kept == [p for p in pending if p in kept]  # order preserved
            pending, dropped_total = kept, dropped_total + len(dropped)
        for g in event if isinstance(event, list) else []:
            seen += 1
            kept_now = f.keep_group(f"g{seen}", g)
            assert kept_now == (not _outside_window(f.tracker, keep, g))  # dropped iff outside, by the model
            if kept_now:
                pending.append((f"g{seen}", g))
            else:
                dropped_total += 1
        assert not any(_outside_window(f.tracker, keep, g) for _, g in pending)
    assert len(pending) + dropped_total == seen and f.dropped_groups == dropped_total
    if keep == 0:
        assert dropped_total == 0 and f.tracker.versions == PUBLISH_LOG[:published]  # no group observed


@FAST
@given(log=st.permutations(PUBLISH_LOG), groups=st.lists(GROUP, max_size=6))
def test_published_versions_are_ordered_by_the_log_whatever_the_observation_order(
    log: list[str], groups: list[RolloutGroup]
) -> None:
    t = StalenessTracker(StalenessConfig(2))
    for g in groups:
        t.observe_group(g)
    t.observe_published(log)
    assert t.versions == log  # every real label above is in the log
    for g in groups:
        assert t.should_drop_group(g) == any(
            log.index(i.version) < len(log) - 2 for i in trajectory_version_infos(g)
        )


@FAST
@given(st.lists(st.sampled_from(["-1", "v1", "v2", " v2", "unknown"]), max_size=30))
def test_version_spans_cover_contiguously_and_round_trip(versions: list[str]) -> None:
    spans = version_spans(versions)
    assert [s["start"] for s in spans[1:]] == [s["end"] for s in spans[:-1]]
    assert (spans[0]["start"], spans[-1]["end"]) == (0, len(versions)) if versions else spans == []
    assert all(s["end"] > s["start"] for s in spans)
    assert all(a["version"] != b["version"] for a, b in zip(spans, spans[1:], strict=False))
    assert [s["version"] for s in spans for _ in range(s["end"] - s["start"])] == versions


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["-1", "v1", "v2", "v3", "unknown"])), max_size=30)
)
def test_masked_tokens_are_a_subset_carrying_at_most_one_real_version(pairs: list[tuple[int, str]]) -> None:
    mask, versions = [m for m, _ in pairs], [v for _, v in pairs]
    out = mask_nonlast_version_tokens(mask, versions)
    assert all(o <= m for o, m in zip(out, mask, strict=True))
    assert len({real_version(v) for o, v in zip(out, versions, strict=True) if o and real_version(v)}) <= 1
    real_loss = [real_version(v) for m, v in pairs if m and real_version(v)]
    if real_loss:  # the last real loss version always keeps its loss
        assert any(o and real_version(v) == real_loss[-1] for o, v in zip(out, versions, strict=True))
