"""The version window's rule, the collector's decision records, and their offline replay (pure).

The rule (one place): a GRPO group is outside a ``keep_versions = N`` window iff one of its
trajectories ends ``gap >= N`` versions behind the newest known version (``gap`` = position of the
newest known version minus the position of the trajectory's end version). ``N`` 0/None = off:
nothing is outside. ``shared.staleness.StalenessTracker.should_drop_group`` decides with
:func:`outside_window`; ``dressage replay`` recomputes recorded decisions with the same function.

A :class:`DecisionRecord` is what the collector appends to ``{p}:collector:decisions`` after each
committed outcome of a group attempt (docs/streams.md): the group's end versions, their gaps at the
moment of the decision, the window in force, the decision and its reason, and each trajectory's
response length and reward (whom a window drops: ``tools.reports.dropbias``). Fields added later have
defaults, so records written before them still load. Invariant checked by
:func:`replay`: for every record the window made (``window_decided``), ``outside_window(gaps,
keep_versions)`` is True exactly when the recorded decision is ``dropped`` -- so replaying a run
with its own window reproduces its decisions, and replaying it with another ``N`` says which
groups that window would have trained or dropped *at the same checks*. What would have happened
afterwards (a group kept longer ages further; a drop re-enqueues a new attempt) is not simulated:
the replay answers "which recorded decisions flip", not "how the run would have gone".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import MalformedEntry

UNKNOWN_GAP = -1  # a version the collector had never seen nor seen published (only while the window is off)
Decision = Literal["trained", "dropped"]
Outcome = Literal["batched", "reenqueued", "dead_lettered"]


def outside_window(gaps: Iterable[int], keep_versions: int | None) -> bool:
    """True iff the window of ``keep_versions`` (0/None = off) excludes a trajectory of these gaps."""
    if not keep_versions:
        return False
    return any(g >= keep_versions for g in gaps)


class DecisionRecord(BaseModel):
    """One committed outcome of one attempt of one group (a ``{p}:collector:decisions`` entry)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    attempt: int = Field(ge=0)
    versions: list[str]  # end version of each trajectory (order of first appearance); [] for a failed group
    gaps: list[int]  # versions behind the newest known one, per entry of versions; -1 = unknown version
    keep_versions: int = Field(ge=0)  # the window in force at the decision; 0 = off
    current_version: str | None  # newest known version then (None: none known)
    cutoff_version: str | None  # oldest version inside the window then (None: window off / none known)
    decision: Decision  # trained (cut into a batch) or dropped (re-enqueued / dead-lettered)
    outcome: Outcome
    reason: str  # in_window | stale | failed | a dead-letter reason (stale_retries_exhausted, ...)
    window_decided: bool  # True when the window made the call (trained, or dropped as stale)
    batch_id: str | None = None  # the batch of a trained group
    at: float  # unix seconds of the decision
    # Per trajectory, in the order of each trajectory's first sample (not that of versions: a trajectory
    # without a real version has no entry there); [] for a failed group, and in records older than the fields.
    response_tokens: list[int] = Field(default_factory=list)  # loss-mask tokens of the trajectory, all segments
    rewards: list[float] = Field(default_factory=list)  # the trajectory's reward (its last segment's)

    def fields(self) -> dict[str, str]:
        """Flat stream fields (text, JSON for lists; "" for None), readable with a plain XRANGE."""
        out: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if isinstance(value, list):
                out[name] = json.dumps(value)
            elif isinstance(value, bool):
                out[name] = "1" if value else "0"
            else:
                out[name] = "" if value is None else str(value)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> DecisionRecord:
        """Decode stream fields (bytes or text); raises ``MalformedEntry`` naming the field."""
        text = {(k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
                for k, v in raw.items()}
        data: dict[str, Any] = {}
        try:
            for name, value in text.items():
                if name in ("versions", "gaps", "response_tokens", "rewards"):
                    data[name] = json.loads(value)
                elif name == "window_decided":
                    data[name] = value == "1"
                elif name in ("current_version", "cutoff_version", "batch_id"):
                    data[name] = value or None
                else:
                    data[name] = value
            return cls.model_validate(data)
        except (ValueError, ValidationError) as exc:
            raise MalformedEntry(f"collector decision record: {exc}") from exc


def window_call(gaps: Sequence[int], keep_versions: int | None) -> Decision:
    """What the window decides for a completed group with these gaps."""
    return "dropped" if outside_window(gaps, keep_versions) else "trained"


@dataclass
class ReplayReport:
    """Recorded window decisions recomputed under one window (``keep_versions`` None = the run's own)."""

    keep_versions: int | None
    records: int = 0  # every record read
    window_records: int = 0  # records the window decided (trained, or dropped as stale)
    recorded_trained: int = 0
    recorded_dropped: int = 0
    replay_trained: int = 0
    replay_dropped: int = 0
    would_drop: list[DecisionRecord] = field(default_factory=list)  # trained in the run, dropped under N
    would_keep: list[DecisionRecord] = field(default_factory=list)  # dropped in the run, kept under N (at that check)
    unknown_gaps: int = 0  # window records with a version of unknown gap (counted as inside the window)

    @property
    def changed(self) -> int:
        return len(self.would_drop) + len(self.would_keep)

    def summary(self) -> str:
        window = "the run's own window" if self.keep_versions is None else f"keep_versions={self.keep_versions}"
        lines = [
            f"replay under {window}: {self.window_records} window decisions of {self.records} records",
            f"  recorded: trained {self.recorded_trained}, dropped {self.recorded_dropped}",
            f"  replayed: trained {self.replay_trained}, dropped {self.replay_dropped}",
            f"  would drop {len(self.would_drop)} group attempt(s) the run trained; "
            f"would keep {len(self.would_keep)} it dropped (at the same check)",
        ]
        if self.unknown_gaps:
            lines.append(f"  {self.unknown_gaps} record(s) had a version of unknown gap (counted inside the window)")
        return "\n".join(lines)


def replay(records: Iterable[DecisionRecord], keep_versions: int | None = None) -> ReplayReport:
    """Recompute every window decision with :func:`outside_window` (None = each record's own window)."""
    report = ReplayReport(keep_versions)
    for rec in records:
        report.records += 1
        if not rec.window_decided:
            continue
        report.window_records += 1
        if any(g == UNKNOWN_GAP for g in rec.gaps):
            report.unknown_gaps += 1
        keep = rec.keep_versions if keep_versions is None else keep_versions
        replayed = window_call([g for g in rec.gaps if g != UNKNOWN_GAP], keep)
        if rec.decision == "trained":
            report.recorded_trained += 1
        else:
            report.recorded_dropped += 1
        if replayed == "trained":
            report.replay_trained += 1
        else:
            report.replay_dropped += 1
        if replayed != rec.decision:
            (report.would_drop if rec.decision == "trained" else report.would_keep).append(rec)
    return report
