"""The collector's decision core (pure, no I/O): rollout events in, actions out (docs/architecture.md#collector-loop-order).

Loop order, an invariant carried over from the seed and tested:
1. every newly arrived, non-duplicate group is *observed* first (failed ones included);
2. if that advanced the window, the groups already waiting are re-checked and those now outside
   are dropped (whole GRPO groups);
3. each new group is then handled in arrival order: a failed group goes through the retry policy
   (``outcomes.retry_or_dead_letter``); a completed one is checked against the window and either
   dropped or appended to the waiting list.
A new published version or a new ``keep_versions`` re-checks the waiting list at once, and so
does every batch assembly, so a batch is always cut from the freshest window. In ``staleness.mode``
``wait`` the window is off (nothing is dropped for staleness) and a batch takes the waiting groups
oldest first (``StalenessGroupFilter.assembly_order``, the one place of that rule); in ``drop`` mode
it takes them in arrival order.

Effectively-once: an arrival whose ``group_id:attempt`` already has an outcome (reported by the
shell from ``{p}:collector:done``, or decided by this core), whose group is closed, or which is
already waiting, becomes a ``Discard``. Nothing here is acknowledged; the shell commits actions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from services.group_collector.outcomes import (
    Action,
    Arrival,
    BatchOut,
    Discard,
    retry_or_dead_letter,
)
from services.group_collector.timing import timing_metrics
from shared.schemas import Batch, Window
from shared.staleness import StalenessGroupFilter


class CollectorCore:
    def __init__(self, window: StalenessGroupFilter, groups_per_batch: int, max_retries: int,
                 clock: Callable[[], float] = time.time,
                 new_batch_id: Callable[[], str] = lambda: f"batch-{uuid.uuid4().hex[:16]}") -> None:
        if groups_per_batch < 1:
            raise ValueError(f"train.groups_per_batch must be >= 1, got {groups_per_batch}")
        self.window, self.tracker = window, window.tracker
        self.groups_per_batch, self.max_retries = groups_per_batch, max_retries
        self.clock, self.new_batch_id = clock, new_batch_id
        self.waiting: list[Arrival] = []  # completed groups in the window, oldest arrival first (batches: assembly_order)
        self._decided: set[str] = set()  # done keys of outcomes decided by this core
        self._closed: set[str] = set()  # group ids trained or dead-lettered by this core

    # --- window changes ------------------------------------------------------------------

    def recheck(self) -> list[Action]:
        """Drop every waiting group now outside the window (retry or dead-letter it)."""
        kept: list[Arrival] = []
        actions: list[Action] = []
        for arrival in self.waiting:
            if self.window.keep_group(arrival.group.group_id, arrival.group):
                kept.append(arrival)
            else:
                actions.append(self._decide(retry_or_dead_letter(arrival, "stale", self.max_retries, self.clock())))
        self.waiting = kept
        return actions

    def on_published(self, versions: Sequence[str]) -> list[Action]:
        """The trainer's publication log (oldest first) grew: order the window by it."""
        return self.recheck() if self.tracker.observe_published(versions) and self.waiting else []

    def on_keep_versions(self, raw: object) -> list[Action]:
        """A live ``keep_versions`` change; a bad value raises naming ``staleness.keep_versions``."""
        return self.recheck() if self.tracker.set_keep_versions(raw) and self.waiting else []

    # --- arrivals ----------------------------------------------------------------------------

    def _duplicate(self, arrival: Arrival, done: bool, closed: bool, fresh: set[str]) -> str | None:
        if done or arrival.key in self._decided:
            return "done"
        if closed or arrival.group.group_id in self._closed:
            return "closed"
        if arrival.key in fresh or any(w.key == arrival.key for w in self.waiting):
            return "waiting"
        return None

    def _holding(self, arrival: Arrival) -> bool:
        """The very entry is already waiting here (re-delivered pending entry): nothing to do."""
        return any(w.entry_id == arrival.entry_id for w in self.waiting)

    def on_arrivals(self, arrivals: Sequence[Arrival], done: Sequence[bool] | None = None,
                    closed: Sequence[bool] | None = None) -> list[Action]:
        """Handle newly read rollout entries; ``done``/``closed`` are the shell's Redis lookups."""
        done = done or [False] * len(arrivals)
        closed = closed or [False] * len(arrivals)
        actions: list[Action] = []
        new: list[Arrival] = []
        fresh: set[str] = set()
        seen_ids: set[bytes] = set()
        for arrival, is_done, is_closed in zip(arrivals, done, closed, strict=True):
            if arrival.entry_id in seen_ids or self._holding(arrival):
                continue  # the same entry twice (reclaimed + re-read): one decision, never an ack for it
            seen_ids.add(arrival.entry_id)
            why = self._duplicate(arrival, is_done, is_closed, fresh)
            if why is not None:
                actions.append(Discard({"groups_duplicate_discarded": 1}, arrival, why))
                continue
            fresh.add(arrival.key)
            new.append(arrival)
        advanced = self.window.observe_completed(a.group for a in new)  # 1. observe all (failed too)
        if advanced and self.waiting:
            actions.extend(self.recheck())  # 2. re-check what is already waiting
        for arrival in new:  # 3. each new group, in arrival order
            actions.extend(self._admit(arrival))
        return actions

    def _admit(self, arrival: Arrival) -> list[Action]:
        group = arrival.group
        now = self.clock()
        if group.status == "failed":
            return [self._decide(retry_or_dead_letter(arrival, "failed", self.max_retries, now))]
        if not self.window.keep_group(group.group_id, group):
            return [self._decide(retry_or_dead_letter(arrival, "stale", self.max_retries, now))]
        self.waiting.append(arrival)
        return []

    def _decide(self, action: Action) -> Action:
        self._decided.update(action.done_keys)
        self._closed.update(action.closed_ids)
        return action

    # --- batches ------------------------------------------------------------------------------

    def assemble(self, slots: int, trainer_version: str | None) -> list[Action]:
        """Re-check the waiting groups, then cut up to ``slots`` full batches, first groups first in
        the window's ``assembly_order`` (the rest keep waiting in arrival order)."""
        actions = self.recheck()
        while slots > 0 and len(self.waiting) >= self.groups_per_batch:
            order = self.window.assembly_order([a.group for a in self.waiting])[: self.groups_per_batch]
            members = [self.waiting[i] for i in order]
            taken = set(order)
            self.waiting = [a for i, a in enumerate(self.waiting) if i not in taken]
            actions.append(self._decide(self._batch(members, trainer_version)))
            slots -= 1
        return actions

    def _batch(self, members: list[Arrival], trainer_version: str | None) -> BatchOut:
        now = self.clock()
        groups = [a.group for a in members]
        t = self.tracker
        metrics = {**self.window.metrics_for_groups(groups), **timing_metrics(groups, now)}
        trained = [g.model_copy(update={"prompt_group": None}) for g in groups]  # the trainer never reads it
        window = Window(keep_versions=t.config.keep_versions or 0, current_version=t.current_version_label,
                        cutoff_version=t.cutoff_version_label)
        batch = Batch(batch_id=self.new_batch_id(), groups=trained, trainer_version=trainer_version,
                      window=window, meta={"assembled_at": now,
                                           "entry_ids": [a.entry_id.decode() for a in members]})
        return BatchOut({"groups_batched": len(members), "batches_produced": 1}, batch, members, metrics)

    def forget(self, action: Action) -> None:
        """Undo the decision of an action whose commit failed (its entries stay pending)."""
        self._decided.difference_update(action.done_keys)
        self._closed.difference_update(action.closed_ids)
        if isinstance(action, BatchOut):
            self.waiting = action.members + self.waiting

    def rejected(self, action: Action, already: set[str]) -> list[Action]:
        """The shell found some of ``action``'s keys already done or closed by another collector.

        Those arrivals become ``Discard``; the other members of a rejected batch wait again at the
        front of the line (in their order), to be cut into the next batch.
        """
        self.forget(action)
        self._decided.update(already)
        self.waiting = [a for a in self.waiting if a.key not in already]
        return [Discard({"groups_duplicate_discarded": 1}, a, "done") for a in action.arrivals if a.key in already]

    def window_state(self) -> dict[str, Any]:
        """The window for ``{p}:collector:window`` and ``dressage status``."""
        t = self.tracker
        return {"keep_versions": t.config.keep_versions or 0, "current_version": t.current_version_label,
                "cutoff_version": t.cutoff_version_label, "current_version_index": t.current_version_index,
                "cutoff_version_index": t.cutoff_version_index, "waiting_groups": len(self.waiting)}
