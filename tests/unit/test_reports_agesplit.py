"""A trained group's age split into in flight and queued, from metric rows (tools.reports.agesplit, pure)."""

from __future__ import annotations

import pytest

from tools.reports import agesplit


def cut(batch_id: str, ts: float, in_flight: float, waiting: float, gap: float | None = None) -> dict[str, object]:
    row: dict[str, object] = {"service": "group-collector", "ts": ts, "collector/batch_id": batch_id,
                              "staleness/time_in_flight_s_mean": in_flight, "staleness/time_waiting_s_mean": waiting}
    if gap is not None:
        row["staleness/version_gap_mean"] = gap
    return row


def step(batch_id: str, ts: float, n: int, gap: float) -> dict[str, object]:
    return {"service": "trainer", "ts": ts, "train/step": n, "train/batch_id": batch_id, "train/version_gap_mean": gap}


def test_the_split_joins_each_cut_with_the_trainers_step_of_the_same_batch() -> None:
    rows = [cut("b1", 100.0, 4.0, 1.0, gap=0.0), cut("b2", 101.0, 6.0, 3.0, gap=1.0),
            {"service": "group-collector", "ts": 102.0, "collector/waiting_groups": 3},  # a periodic report
            step("b1", 103.0, 1, 1.0), step("b2", 105.0, 2, 2.0), step("b2", 108.0, 2, 2.0)]  # b2 retrained
    s = agesplit.split(rows)
    assert (s.batches, s.joined) == (2, 2)
    assert (s.in_flight_s, s.queued_collector_s) == (5.0, 2.0)
    assert s.queued_trainer_s == pytest.approx((3.0 + 7.0) / 2)  # the newest report of b2 wins
    assert s.queued_s == pytest.approx(((1.0 + 3.0) + (3.0 + 7.0)) / 2)
    assert (s.version_gap, s.gap_at_cut) == (pytest.approx(5 / 3), 0.5)
    assert list(s.columns()) == list(agesplit.COLUMNS)


def test_a_batch_not_trained_yet_has_no_queue_for_the_trainer_and_no_rows_give_nothing() -> None:
    s = agesplit.split([cut("b1", 100.0, 4.0, 1.0)])
    assert (s.joined, s.in_flight_s, s.queued_trainer_s, s.queued_s) == (0, 4.0, None, None)
    empty = agesplit.split([])
    assert empty.columns() == dict.fromkeys(agesplit.COLUMNS)
    assert agesplit.summary_pairs(empty)[0][1] == "- / - (0 of 0 batches joined with the trainer)"
