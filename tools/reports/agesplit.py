"""Where a trained group's age comes from: time in flight against time queued (pure: metric rows in).

The trainer's version gap of a trajectory (``train/version_gap_*``: the versions published between
its last token and the step that trains it) grows while the group is *queued*; the versions published
while it was *in flight* show up as its version span instead. This module splits a trained group's
age in seconds (prime-rl #3313's split), from rows that already exist:

* in flight = rollout finished - enqueued (this attempt's prompt ``enqueued_at``: a re-enqueued
  attempt starts afresh): the collector's per-batch ``staleness/time_in_flight_s_mean``;
* queued at the collector = batch cut - rollout finished: ``staleness/time_waiting_s_mean`` (the
  window's or, in ``staleness.mode`` wait, pacing's queue);
* queued for the trainer = the trainer's report of the step that trained the batch - the cut: the
  collector's batch row (``collector/batch_id``, ``ts``) joined with the trainer's (``train/batch_id``,
  ``ts``; the newest one after a retrain). The batch's wait in ``{p}:batches`` plus the step itself
  (and its checkpoint and publication unless ``train.background_commit``): an upper bound of the wait.

Per run, each is the mean over the batches that have it (batches are equal in size, so it is the
mean over groups); ``queued`` is the sum of the two queues over the joined batches. Beside them:
the trainer's version gap (mean over steps) and the collector's gap at the cut (window on, or wait
mode), so the versions a group ages in ``{p}:batches`` read as their difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tools.reports.series import Row, number, trainer_rows

COLUMNS = ("in_flight_s_mean", "queued_s_mean", "queued_collector_s_mean", "queued_trainer_s_mean",
           "version_gap_mean", "gap_at_cut_mean")


@dataclass(frozen=True)
class AgeSplit:
    batches: int = 0  # collector batch rows
    joined: int = 0  # of them, with the trainer's row of the same batch
    in_flight_s: float | None = None
    queued_collector_s: float | None = None
    queued_trainer_s: float | None = None
    queued_s: float | None = None  # collector + trainer queue, over the joined batches
    version_gap: float | None = None  # the trainer's, at the step
    gap_at_cut: float | None = None  # the collector's, at the cut

    def columns(self) -> dict[str, float | None]:
        return dict(zip(COLUMNS, (self.in_flight_s, self.queued_s, self.queued_collector_s, self.queued_trainer_s,
                                  self.version_gap, self.gap_at_cut), strict=True))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _present(rows: Sequence[Row], name: str) -> list[float]:
    return [v for v in (number(r.get(name)) for r in rows) if v is not None]


def split(rows: Sequence[Row]) -> AgeSplit:
    cuts = [r for r in rows if r.get("service") == "group-collector" and r.get("collector/batch_id")]
    trainer = trainer_rows(rows)
    trained_at: dict[str, float] = {}
    for r in trainer:
        ts = number(r.get("ts"))
        if r.get("train/batch_id") and ts is not None:
            trained_at[str(r["train/batch_id"])] = ts  # the newest report wins (a batch retrained after a crash)
    queue_trainer, queued = [], []
    for r in cuts:
        cut, done = number(r.get("ts")), trained_at.get(str(r["collector/batch_id"]))
        if cut is None or done is None:
            continue
        queue_trainer.append(max(0.0, done - cut))
        waiting = number(r.get("staleness/time_waiting_s_mean"))
        if waiting is not None:
            queued.append(waiting + queue_trainer[-1])
    return AgeSplit(batches=len(cuts), joined=len(queue_trainer),
                    in_flight_s=_mean(_present(cuts, "staleness/time_in_flight_s_mean")),
                    queued_collector_s=_mean(_present(cuts, "staleness/time_waiting_s_mean")),
                    queued_trainer_s=_mean(queue_trainer), queued_s=_mean(queued),
                    version_gap=_mean(_present(trainer, "train/version_gap_mean")),
                    gap_at_cut=_mean(_present(cuts, "staleness/version_gap_mean")))


def summary_pairs(s: AgeSplit) -> list[tuple[str, str]]:
    """Lines for ``dressage report``."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    def ver(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    return [("trained group's age: in flight / queued (mean per group)",
             f"{sec(s.in_flight_s)} / {sec(s.queued_s)} ({s.joined} of {s.batches} batches joined with the trainer)"),
            ("queued: rollout finished -> batch cut / cut -> trained", f"{sec(s.queued_collector_s)} / "
             f"{sec(s.queued_trainer_s)}"),
            ("version gap: at the trainer's step / at the cut (mean per trajectory)",
             f"{ver(s.version_gap)} / {ver(s.gap_at_cut)}")]
