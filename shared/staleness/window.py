"""Batch-level staleness control: the version window and whole-group drops (pure, no I/O).

A trajectory's version is the end version of its last versioned segment
(:func:`trajectory_version_infos`). The tracker keeps an ordered list of known versions; with
``keep_versions = N`` the *window* is the newest N of them, and a GRPO group is dropped whole when
any of its trajectories ends on a version older than the window.

Invariants:
* every group passed to :meth:`StalenessGroupFilter.keep_group` / ``filter_pending`` is exactly
  kept or dropped, never both, never neither;
* no kept group has a trajectory whose version is outside the window at the time of the check;
* non-real versions (:func:`real_version`) never advance the window and never drop a group;
  a group with no versioned trajectory is always kept;
* ``keep_versions`` 0/None turns the filter off: nothing is observed, nothing dropped;
* the version list never shrinks, and a label's position only changes when it is published.

Two modes (``staleness.mode``), and the batch order of each (:meth:`StalenessGroupFilter.assembly_order`):
* ``drop`` (the default, the original's rule): the window above; batches take the waiting groups in
  arrival order;
* ``wait``: the collector drops nothing for staleness -- admission (the prompt-buffer's pacing η)
  alone bounds it -- and batches take the waiting groups oldest first: by the position of the group's
  oldest trajectory end version, then arrival. ``keep_versions`` must be 0 in this mode (a window
  would drop again): a non-zero value, from the config or live from ``{p}:control``, is refused
  naming the key.

Ordering (improvement over the original, which used first-observation order only):
published versions (the trainer's ``{p}:weights:log``, fed through ``observe_published``) are
ordered by the log. A version never published ranks *as if it had been published at the moment it
was first observed*: it sits after the last published version known then (and after unpublished
versions first observed earlier), and moves to its log position once it appears in the log. So
a newer version first seen before an older one cannot invert the window once both are published,
and published versions that no trajectory ended on still count as weight updates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.errors import ConfigError
from shared.schemas import RolloutGroup
from shared.staleness.versions import Samples, trajectory_version_infos, trajectory_version_span
from shared.versions import real_version
from shared.window_decisions import outside_window

log = logging.getLogger(__name__)
KEY = "staleness.keep_versions"
Mode = Literal["drop", "wait"]  # staleness.mode: drop stale groups (window) or wait (pacing bounds, oldest first)
MODES: tuple[Mode, ...] = ("drop", "wait")


class StalenessConfigError(ConfigError, ValueError):
    """A bad ``staleness.keep_versions`` value."""


def _keep_value(raw: object) -> int | None:
    """None/0 → None (off); a non-negative integer (int, integral float or digit string) → itself."""
    if raw is None:
        return None
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str) and raw.strip().lstrip("-").isdigit() and raw.isascii():  # "²".isdigit() is True
        value = int(raw.strip())
    if value is None or value < 0:
        raise StalenessConfigError(f"{KEY} must be an integer >= 0 (0 = off), got {raw!r}")
    return value or None


@dataclass(frozen=True)
class StalenessConfig:
    keep_versions: int | None = None  # window size in versions; None (or 0) = filter off
    mode: Mode = "drop"  # drop: the window drops stale groups; wait: nothing dropped, oldest first

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_versions", _keep_value(self.keep_versions))
        if self.mode not in MODES:
            raise StalenessConfigError(f"staleness.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "wait" and self.keep_versions is not None:
            raise StalenessConfigError(
                f"{KEY}={self.keep_versions} contradicts staleness.mode=wait (the collector drops nothing for "
                f"staleness; pacing.max_versions_ahead bounds it): set {KEY} to 0, or staleness.mode to drop")

    @property
    def enabled(self) -> bool:
        """The window is on (drop mode with ``keep_versions`` set)."""
        return self.keep_versions is not None

    @property
    def waits(self) -> bool:
        return self.mode == "wait"


def config_from_value(raw: object, mode: Mode = "drop") -> StalenessConfig:
    """Config from a raw setting (YAML, env, ``{p}:control``); raises naming ``staleness.keep_versions``
    (or ``staleness.mode``), also for a non-zero window in wait mode."""
    return StalenessConfig(_keep_value(raw), mode)


class StalenessTracker:
    """The ordered list of known versions and the window over it. Thread-safe."""

    def __init__(self, config: StalenessConfig | None = None) -> None:
        self.config = config or StalenessConfig()
        self._lock = threading.RLock()
        self._published: list[str] = []  # log order
        self._anchored: dict[str | None, list[str]] = {None: []}  # last published version → unpublished
        self._published_set: set[str] = set()
        self._known: set[str] = set()
        self._order: list[str] = []  # the merged order, oldest first
        self._pos: dict[str, int] = {}  # label → index in _order

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def versions(self) -> list[str]:
        """Known versions, oldest first."""
        with self._lock:
            return list(self._order)

    def _rebuild(self) -> bool:
        order = list(self._anchored[None])
        for p in self._published:
            order.append(p)
            order.extend(self._anchored.get(p, []))
        changed = order != self._order
        self._order = order
        self._pos = {v: i for i, v in enumerate(order)}
        return changed

    def _add_observed(self, v: str) -> bool:
        if v in self._known:
            return False
        self._known.add(v)
        anchor = self._published[-1] if self._published else None
        self._anchored.setdefault(anchor, []).append(v)
        return self._rebuild()

    def observe_published(self, versions: Sequence[object]) -> bool:
        """Merge the trainer's publication log (oldest first; already-known entries are skipped).

        Recorded even while the filter is off, so turning it on later orders correctly. Returns
        True iff the filter is on and the version order changed (re-check pending groups then).
        """
        with self._lock:
            for raw in versions:
                v = real_version(raw)
                if v is None or v in self._published_set:
                    continue
                for pending in self._anchored.values():
                    if v in pending:
                        pending.remove(v)
                self._known.add(v)
                self._published.append(v)
                self._published_set.add(v)
            return self._rebuild() and self.enabled

    def observe_group(self, group: Samples) -> bool:
        """Learn the trajectory versions of ``group``; True iff the filter is on and a version was new."""
        if not self.enabled:
            return False
        with self._lock:
            grew = False
            for info in trajectory_version_infos(group):
                grew = self._add_observed(info.version) or grew
            return grew

    def index(self, version: object) -> int:
        """Position of a real version (0 = oldest); a never-seen version is observed first."""
        v = real_version(version)
        if v is None:
            raise ValueError(f"version: {version!r} is not a real version")
        with self._lock:
            self._add_observed(v)
            return self._pos[v]

    @property
    def current_version_index(self) -> int | None:
        with self._lock:
            return len(self._order) - 1 if self._order else None

    @property
    def cutoff_version_index(self) -> int | None:
        """Index of the oldest version inside the window; None when off or nothing is known."""
        keep = self.config.keep_versions
        with self._lock:
            if keep is None or not self._order:
                return None
            return max(0, len(self._order) - keep)

    def _label(self, index: int | None) -> str | None:
        with self._lock:
            return None if index is None else self._order[index]

    @property
    def current_version_label(self) -> str | None:
        return self._label(self.current_version_index)

    @property
    def cutoff_version_label(self) -> str | None:
        return self._label(self.cutoff_version_index)

    def version_gap(self, version: object) -> int:
        """How many versions ``version`` is behind the newest known one (observes it if new)."""
        with self._lock:
            idx = self.index(version)
            return len(self._order) - 1 - idx

    def should_drop_group(self, group: Samples) -> bool:
        """True iff the filter is on and some trajectory of ``group`` ends before the window.

        Unknown versions are observed first (so the cutoff reflects them), but callers should
        observe completed groups beforehand so they can re-check pending groups when it advances.
        """
        if not self.enabled:
            return False
        with self._lock:
            infos = trajectory_version_infos(group)
            for info in infos:
                self._add_observed(info.version)
            newest = len(self._order) - 1  # the one window rule: shared.window_decisions.outside_window
            return outside_window([newest - self._pos[i.version] for i in infos], self.config.keep_versions)

    def set_keep_versions(self, keep_versions: object) -> bool:
        """Change the window size live (None/0 = off); a bad value raises naming the key, and so does
        a non-zero one in wait mode (the mode is the config's, never changed live).

        Returns True iff the filter is now on with a different size (re-check pending groups then).
        """
        config = config_from_value(keep_versions, self.config.mode)
        with self._lock:
            changed = config != self.config
            self.config = config
            return changed and config.enabled


def _stats(prefix: str, values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}_min": float(min(values)),
        f"{prefix}_max": float(max(values)),
        f"{prefix}_mean": sum(values) / len(values),
    }


class StalenessGroupFilter:
    """Applies the tracker's window to whole GRPO groups and counts drops (cumulatively).

    Loop order (docs/architecture.md#collector-loop-order): ``observe_completed`` on every newly completed group (failed
    ones too); if it returned True, ``filter_pending`` on the groups already waiting; then
    ``keep_group`` on each new group. Do the same after ``observe_published`` or
    ``tracker.set_keep_versions`` so the new window applies to pending groups at once.
    """

    def __init__(self, tracker: StalenessTracker, name: str = "collector") -> None:
        self.tracker = tracker
        self.name = name
        self.dropped_groups = 0  # cumulative over the filter's lifetime

    def observe_completed(self, groups: Iterable[Samples | None]) -> bool:
        """Observe every group (None entries skipped); True iff any of them advanced the window."""
        advanced = False
        for group in groups:
            if group is not None:
                advanced = self.tracker.observe_group(group) or advanced
        return advanced

    def keep_group(self, group_id: str, group: Samples) -> bool:
        """True to keep ``group``; False drops it (logged at INFO and counted)."""
        if not self.tracker.should_drop_group(group):
            return True
        self.dropped_groups += 1
        t = self.tracker
        log.info(
            "dropping stale %s group group_id=%s attempt=%s versions=%s cutoff_version_index=%s "
            "cutoff_version=%s current_version_index=%s current_version=%s dropped_groups=%d",
            self.name, group_id, group.attempt if isinstance(group, RolloutGroup) else None,
            ",".join(i.version for i in trajectory_version_infos(group)),
            t.cutoff_version_index, t.cutoff_version_label, t.current_version_index,
            t.current_version_label, self.dropped_groups,
        )  # fmt: skip
        return False

    def filter_pending(
        self, pending: list[tuple[str, RolloutGroup]]
    ) -> tuple[list[tuple[str, RolloutGroup]], list[tuple[str, RolloutGroup]]]:
        """Re-check waiting ``(group_id, group)`` pairs; returns ``(kept, dropped)``, order preserved."""
        kept: list[tuple[str, RolloutGroup]] = []
        dropped: list[tuple[str, RolloutGroup]] = []
        for item in pending:
            (kept if self.keep_group(item[0], item[1]) else dropped).append(item)
        return kept, dropped

    def assembly_order(self, groups: Sequence[Samples]) -> list[int]:
        """Positions of the waiting ``groups`` (given oldest arrival first) in the order batches take them.

        Drop mode: arrival order. Wait mode: oldest first, by the position of each group's oldest
        trajectory end version in the version order (unknown versions are observed), then arrival;
        a group with no real end version goes first (nothing can make it staler, nothing should
        leave it waiting).
        """
        if not self.tracker.config.waits:
            return list(range(len(groups)))

        def oldest(group: Samples) -> int:
            return min((self.tracker.index(i.version) for i in trajectory_version_infos(group)), default=-1)

        keys = [oldest(g) for g in groups]
        return sorted(range(len(groups)), key=lambda i: (keys[i], i))

    def metrics_for_groups(self, groups: Iterable[Samples | None]) -> dict[str, float]:
        """``staleness/*`` metrics for the groups being returned (gaps are per trajectory).

        Window metrics while the filter is on, the gaps also in wait mode (what pacing let through);
        ``version_span_*`` always (when any trajectory has a traj_id).
        """
        present = [g for g in groups if g is not None]
        out: dict[str, float] = {}
        t = self.tracker
        if t.enabled:
            out["staleness/dropped_groups"] = float(self.dropped_groups)
            cur, cut = t.current_version_index, t.cutoff_version_index
            if cur is not None and cut is not None:
                out["staleness/current_version_index"] = float(cur)
                out["staleness/cutoff_version_index"] = float(cut)
        if t.enabled or t.config.waits:
            infos = [i for g in present for i in trajectory_version_infos(g)]
            for i in infos:
                t.index(i.version)  # observe unknown versions before measuring any gap
            gaps = [t.version_gap(i.version) for i in infos]
            out.update(_stats("staleness/version_gap", gaps))
        spans = [n for g in present for n in trajectory_version_span(g).values()]
        out.update(_stats("staleness/version_span", spans))
        return out
