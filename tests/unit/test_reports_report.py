"""Report generation from a synthetic metrics.jsonl: valid PNGs, self-contained HTML, right summary."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from PIL import Image

from tools.reports import report, series
from tools.reports.metricslog import load_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    t0 = 1_700_000_000.0
    for step in range(1, 21):
        rows.append({"id": f"{step}-0", "service": "trainer", "ts": t0 + 10 * step, "train/step": step,
                     "train/version": str(step), "train/reward_mean": 0.2 + 0.03 * step,
                     "train/train_rollout_logprob_abs_diff": 0.01 * (1 + step % 3)})
        rows.append({"id": f"{step}-1", "service": "group-collector", "ts": t0 + 10 * step + 1,
                     "staleness/version_gap_max": step % 2, "staleness/version_gap_mean": 0.5,
                     "staleness/version_span_max": 1 + (step % 5 == 0)})
        rows.append({"id": f"{step}-2", "service": "ops", "ts": t0 + 10 * step + 2,
                     "stats/groups_produced": 4 * step + 6, "stats/groups_trained": 4 * step,
                     "stats/groups_dropped_stale": step // 4, "stats/groups_reenqueued": step // 3,
                     "stats/groups_dead_lettered": step // 10})
    for v, acc in ((0, 0.25), (5, 0.4), (10, 0.5), (15, 0.55), (20, 0.7)):
        rows.append({"id": f"{100 + v}-0", "service": "eval-worker", "ts": t0 + 300 + v, "eval/version": str(v),
                     "eval/accuracy": acc, "eval/reward": acc})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')  # crash mid-line


def test_report_writes_valid_pngs_and_a_self_contained_page(tmp_path: Path, capsys: Any) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", synthetic_rows())
    assert report.main([str(tmp_path)]) == 0
    out = tmp_path / "report"
    pngs = sorted(out.glob("*.png"))
    assert [p.stem for p in pngs] == ["learning", "logprob_diff", "pipeline", "staleness"]
    page = (out / "report.html").read_text()
    for p in pngs:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC)
        with Image.open(p) as im:
            im.verify()
        assert base64.b64encode(data).decode() in page  # embedded, not linked
    assert "http" not in page.split("<body>")[1]  # no external assets
    printed = capsys.readouterr().out
    assert "eval accuracy, last" in printed and "0.700 (v20)" in printed
    assert (out / "summary.txt").read_text().strip() in printed


def test_summary_numbers_come_from_the_rows() -> None:
    table = dict(series.summary(synthetic_rows()))
    assert table["trainer steps"] == "20" and table["final version"] == "20"
    assert table["reward, first 4 steps"] == f"{0.2 + 0.03 * 2.5:.3f}"  # mean of steps 1..4
    assert table["reward, last 4 steps"] == f"{0.2 + 0.03 * 18.5:.3f}"  # mean of steps 17..20
    assert table["eval accuracy, first"] == "0.250 (v0)" and table["eval accuracy, best"] == "0.700"
    assert table["groups produced"] == "86" and table["groups dead lettered"] == "2"


def test_histogram_prefers_exact_counts_and_falls_back_to_per_batch_max() -> None:
    rows = synthetic_rows()
    coarse = series.histogram(rows, series.GAP)
    assert coarse == {0.0: 10, 1.0: 10}
    rows.append({"service": "group-collector", "staleness/version_gap_hist": {"0": 30, "2": 4}})
    assert series.histogram(rows, series.GAP) == {0.0: 30, 2.0: 4}


def test_report_of_a_run_without_data_still_renders(tmp_path: Path) -> None:
    files = report.build_report([], tmp_path / "r", title="empty")
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in files.pngs)
    assert "trainer steps" in files.table and "-" in files.table


def test_missing_run_dir_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_load_rows_skips_a_torn_last_line(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "m.jsonl", synthetic_rows()[:3])
    assert len(load_rows(tmp_path / "m.jsonl")) == 3


def test_counters_never_incremented_count_as_zero_once_snapshots_exist() -> None:
    rows = [{"service": "ops", "ts": 10.0, "stats/groups_produced": 4},
            {"service": "ops", "ts": 15.0, "stats/groups_produced": 8, "stats/groups_reenqueued": 1}]
    over = series.counters_over_time(rows)
    assert over["groups_reenqueued"].y == [0.0, 1.0] and over["groups_reenqueued"].x == [0.0, 5.0]
    assert over["groups_dead_lettered"].y == [0.0, 0.0]
    assert series.counters_over_time([{"service": "trainer", "ts": 1.0}]) == {}
    table = dict(series.summary(rows))
    assert table["groups dead lettered"] == "0" and table["groups reenqueued"] == "1"


def test_report_prints_whom_the_window_dropped_from_the_runs_decisions(tmp_path: Path, capsys: Any) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", synthetic_rows())
    base = dict(attempt=0, versions=["1"], gaps=[0], keep_versions=1, current_version="1", cutoff_version="1",
                window_decided=True, at=1.0)
    lines = [{"id": f"{i}-0", **base, "group_id": f"t{i}", "decision": "trained", "outcome": "batched",
              "reason": "in_window", "batch_id": "b", "response_tokens": [10 + 2 * i, 12], "rewards": [1.0, 0.0]}
             for i in range(6)]
    lines.append({"id": "9-0", **base, "group_id": "d", "decision": "dropped", "outcome": "reenqueued",
                  "reason": "stale", "response_tokens": [90, 70], "rewards": [0.0, 0.0]})
    (tmp_path / "decisions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert report.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "80.0 vs 13.5 (1 vs 6 groups), Mann-Whitney p=" in printed  # response tokens, dropped vs trained
    assert "0.000 vs 0.500 (1 vs 6 groups)" in printed  # pass rate
    assert "trained group's age: in flight / queued" in printed
