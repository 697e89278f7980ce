"""The collector's replayable decision log: one record per committed outcome of a group attempt.

``records_for`` (pure) turns a committed action into ``shared.window_decisions.DecisionRecord``s,
reading the window exactly as the decision saw it: the core decides and the shell commits within
one step, with no version or control change in between, so the tracker's state here is the state
the decision used. ``DecisionLog.record`` appends them to the capped ``{p}:collector:decisions``
stream right after the action's MULTI/EXEC. The log is an observation, not part of the commit:
a Redis error while writing it is logged and the record is lost (never the decision), and a crash
between the commit and the append loses at most that action's records.

A ``Discard`` (a late copy of an attempt that already has an outcome) decides nothing: no record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from services.group_collector.outcomes import Action, BatchOut, DeadLetterOut, Discard, Reenqueue
from shared import stats
from shared.keys import Keys
from shared.schemas import RolloutGroup
from shared.staleness import StalenessTracker, trajectory_version_infos
from shared.window_decisions import UNKNOWN_GAP, DecisionRecord

log = logging.getLogger(__name__)
DECISIONS_MAXLEN = 100_000  # {p}:collector:decisions is capped (approximately), like {p}:dead


def trajectory_sizes(group: RolloutGroup) -> tuple[list[int], list[float]]:
    """Loss-mask tokens (over all segments) and reward (of the last segment) of each trajectory, in the
    order of each trajectory's first sample."""
    tokens: dict[str, int] = {}
    for s in group.samples:
        tokens[s.traj_id] = tokens.get(s.traj_id, 0) + sum(s.loss_mask)
    reward = {s.traj_id: s.reward for s in group.last_segments()}
    return list(tokens.values()), [reward[t] for t in tokens]


def _record(group: RolloutGroup, tracker: StalenessTracker, now: float, **outcome: object) -> DecisionRecord:
    order = tracker.versions  # read only: recording never observes a version
    pos = {v: i for i, v in enumerate(order)}
    versions = [info.version for info in trajectory_version_infos(group)]
    gaps = [len(order) - 1 - pos[v] if v in pos else UNKNOWN_GAP for v in versions]
    tokens, rewards = trajectory_sizes(group)
    return DecisionRecord.model_validate({
        "group_id": group.group_id, "attempt": group.attempt, "versions": versions, "gaps": gaps,
        "keep_versions": tracker.config.keep_versions or 0, "current_version": tracker.current_version_label,
        "cutoff_version": tracker.cutoff_version_label, "at": now, "response_tokens": tokens, "rewards": rewards,
        **outcome})


def records_for(action: Action, tracker: StalenessTracker, now: float) -> list[DecisionRecord]:
    """The decision records of one committed action (none for a ``Discard``)."""
    if isinstance(action, Discard):
        return []
    if isinstance(action, BatchOut):
        return [_record(a.group, tracker, now, decision="trained", outcome="batched", reason="in_window",
                        window_decided=True, batch_id=action.batch.batch_id) for a in action.members]
    stale = stats.GROUPS_DROPPED_STALE in action.stats  # dropped by the window (retried or given up)
    if isinstance(action, Reenqueue):
        return [_record(action.arrival.group, tracker, now, decision="dropped", outcome="reenqueued",
                        reason=action.why, window_decided=stale)]
    assert isinstance(action, DeadLetterOut)
    return [_record(action.arrival.group, tracker, now, decision="dropped", outcome="dead_lettered",
                    reason=action.reason, window_decided=stale)]


class DecisionLog:
    """Appends the records of committed actions to ``{p}:collector:decisions`` (best effort)."""

    def __init__(self, r: redis.Redis, keys: Keys, maxlen: int = DECISIONS_MAXLEN,
                 clock: Callable[[], float] = time.time) -> None:
        self.r, self.key, self.maxlen, self.clock = r, keys.collector_decisions, maxlen, clock

    def record(self, action: Action, tracker: StalenessTracker) -> None:
        records = records_for(action, tracker, self.clock())
        if not records:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for rec in records:
                pipe.xadd(self.key, rec.fields(), maxlen=self.maxlen, approximate=True)
            pipe.execute()
        except redis.RedisError as exc:  # the decision is committed; only its record is lost
            log.warning("decision log append failed group_ids=%s: %s",
                        ",".join(f"{r.group_id}:{r.attempt}" for r in records), exc)
