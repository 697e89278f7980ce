"""A run's summary row and the ratio table, from hand-made metric rows (no runs, no Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import REPO

from shared.window_decisions import DecisionRecord
from tools.experiments import summary as summ
from tools.experiments.report import add_time_to_baseline, age_table, drop_bias_table, headline, ratios
from tools.experiments.spec import SpecError, load_spec


def trainer(step: int, wall: float, reward: float, ts: float) -> dict[str, Any]:
    return {"service": "trainer", "ts": ts, "train/step": step, "train/version": step, "train/reward_mean": reward,
            "train/published_version": str(step), "train/train_rollout_logprob_abs_diff": 0.01 * step,
            "time/wait_s": wall / 2, "time/train_s": wall / 4, "time/checkpoint_s": wall / 8,
            "time/publish_s": wall / 16, "time/other_s": wall / 16, "time/wall_s": wall}


def run_rows(step_s: float, accs: dict[int, float]) -> list[dict[str, Any]]:
    t0 = 1000.0
    rows: list[dict[str, Any]] = [trainer(s, s * step_s, 0.1 * s, t0 + s * step_s) for s in range(1, 5)]
    rows += [{"service": "eval-worker", "ts": t0 + 50, "eval/version": str(v), "eval/accuracy": a}
             for v, a in accs.items()]
    rows.append({"service": "ops", "ts": t0 + 60, "stats/groups_produced": 20, "stats/groups_trained": 16,
                 "stats/groups_dropped_stale": 1, "stats/partial_rollout_rejected_groups": 3})
    return rows


def test_run_row_from_metric_rows() -> None:
    rows = run_rows(2.0, {0: 0.5, 2: 0.4, 4: 0.7})
    row = summ.run_row(rows, "sync", 3, [0.45, 0.9], k_steps=4, slots=4, started_at=990.0, run_dir="r")
    assert row["steps"] == 4 and row["wall_to_k_s"] == 8.0 and row["wall_clock_s"] == 8.0
    assert row["startup_s"] == pytest.approx(1002.0 - 2.0 - 990.0)  # first step's ts - its wall - run start
    assert row["time_to_acc_0.45"] == 8.0  # v0 (0.5) is the starting model: the first trained version is v4
    assert row["time_to_acc_0.9"] is None
    assert (row["initial_eval_acc"], row["final_eval_acc"], row["best_eval_acc"]) == (0.5, 0.7, 0.7)
    assert row["reward_auc"] == pytest.approx(0.1 + 0.2 + 0.3 + 0.4)
    assert row["logprob_abs_diff_mean"] == pytest.approx(0.025)
    assert (row["groups_produced"], row["groups_trained"], row["groups_dropped"], row["groups_reenqueued"]) == \
        (20, 16, 1, 0)
    assert row["groups_span_rejected"] == 3  # the span cap acting
    assert row["steps_to_acc_0.45"] == 4 and row["steps_to_acc_0.9"] is None  # the step that published v4
    assert row["window_drop_share"] == pytest.approx(1 / 20) and row["span_reject_share"] == pytest.approx(3 / 20)
    assert row["dead_letter_share"] == 0.0 and row["reenqueue_share"] == 0.0
    assert (row["reward_first"], row["reward_last"]) == (pytest.approx(0.1), pytest.approx(0.4))  # 4 steps: fifths of 1
    assert row["reward_gain"] == pytest.approx(0.3) and row["tool_calls_gain"] is None  # no tools in this run
    assert row["trainer_wait_frac"] == 0.5 and row["trainer_checkpoint_frac"] == 0.125
    assert list(row) == summ.columns([0.45, 0.9])


def test_window_history_counts_changes_of_the_collectors_window() -> None:
    def collector(k: int | None) -> dict[str, object]:
        return {"service": "group-collector", "staleness/keep_versions": k}

    rows = [collector(4), {"service": "trainer", "staleness/keep_versions": 9}, collector(4), collector(3),
            collector(None), collector(3), collector(4)]
    assert summ.window_history(rows) == {"window_changes": 2, "keep_versions_last": 4}
    assert summ.window_history([collector(2)] * 3) == {"window_changes": 0, "keep_versions_last": 2}
    assert summ.window_history([{"service": "trainer"}]) == {"window_changes": None, "keep_versions_last": None}


def test_first_last_takes_a_fifth_of_the_steps_at_each_end() -> None:
    assert summ.first_last([]) == (None, None, None)
    first, last, gain = summ.first_last([0.0] * 5 + [1.0] * 10 + [0.5] * 5 + [0.9] * 5)  # 25 values: fifths of 5
    assert (first, last) == (0.0, pytest.approx(0.9)) and gain == pytest.approx(0.9)


def test_speed_ups_and_the_headline(tmp_path: Path) -> None:
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "s", "base": str(REPO / "configs/test.yaml"), "baseline": "sync", "seeds": [0, 1],
        "stop": {"steps": 4}, "variants": {"sync": {}, "async": {}}}))
    spec = load_spec(spec_path)
    metrics = {"s0": run_rows(3.0, {0: 0.2, 4: 0.5}), "s1": run_rows(2.5, {0: 0.2, 4: 0.7}),
               "a0": run_rows(1.5, {0: 0.2, 2: 0.6, 4: 0.7}), "a1": run_rows(1.25, {0: 0.2, 2: 0.4, 4: 0.6})}
    rows = [summ.run_row(m, v, s, [], 4, None, None, key) for key, m, v, s in
            (("s0", metrics["s0"], "sync", 0), ("s1", metrics["s1"], "sync", 1),
             ("a0", metrics["a0"], "async", 0), ("a1", metrics["a1"], "async", 1))]
    add_time_to_baseline(spec, rows, metrics)
    # sync's mean final accuracy is 0.6: async seed 0 publishes v2 (0.6) at 3.0 s, seed 1 reaches it at v4, 5.0 s
    assert [r["time_to_baseline_acc_s"] for r in rows] == [None, 10.0, 3.0, 5.0]
    (r,) = ratios(spec, rows)
    assert r.to_k is not None and r.to_k.estimate == pytest.approx((12 + 10) / (6 + 5))
    assert r.to_acc is not None and r.to_acc.estimate == pytest.approx(11.0 / 4.0)
    assert r.reached == (2, 2)
    line = headline(spec, rows)
    assert line.startswith("async/sync wall-clock to 4 steps: 2.00× (seeds 2, 95% interval [")
    assert line.endswith("); to sync final accuracy: 2.75×")
    spec_path.write_text(yaml.safe_dump({
        "name": "s", "base": str(REPO / "configs/test.yaml"), "baseline": "off", "seeds": [0, 1],
        "stop": {"steps": 4}, "variants": {"off": {}, "keep2": {}}}))
    for row in rows:
        row["variant"] = {"sync": "off", "async": "keep2"}[row["variant"]]
    line = headline(load_spec(spec_path), rows)  # any other spec names its pair, never "async/sync"
    assert line.startswith("keep2/off wall-clock to 4 steps: 2.00×") and line.endswith("to off final accuracy: 2.75×")


def test_a_one_variant_spec_headlines_its_reward_gain(tmp_path: Path) -> None:
    spec_path = tmp_path / "one.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "one", "base": str(REPO / "configs/test.yaml"), "baseline": "habit", "seeds": [0, 1],
        "stop": {"steps": 4}, "variants": {"habit": {}}}))
    spec = load_spec(spec_path)
    rows = [summ.run_row(run_rows(1.0, {}), "habit", s, [], 4, None, None, f"h{s}") for s in (0, 1)]
    line = headline(spec, rows)
    assert line.startswith("habit: reward gain from the first to the last fifth of the steps 0.300")  # 0.1 -> 0.4
    assert "seeds 2" in line and "async" not in line


def test_whom_the_controls_drop_and_the_age_split_reach_the_row_and_the_report_tables(tmp_path: Path) -> None:
    spec_path = tmp_path / "w.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "w", "base": str(REPO / "configs/test.yaml"), "baseline": "off", "seeds": [0, 1],
        "stop": {"steps": 4}, "variants": {"off": {}, "keep1": {}}}, sort_keys=False))
    spec = load_spec(spec_path)

    def record(decision: str, tokens: int, passed: bool) -> DecisionRecord:
        dropped = decision == "dropped"
        gaps = [1, 0] if dropped else [0, 0]  # a dropped group: its first trajectory outside the window
        return DecisionRecord(group_id="g", attempt=0, versions=["0", "1"], gaps=gaps, keep_versions=1,
                              current_version=None,
                              cutoff_version=None, decision="dropped" if dropped else "trained",
                              outcome="reenqueued" if dropped else "batched", reason="stale" if dropped else "in_window",
                              window_decided=True, at=1.0, response_tokens=[tokens] * 2, rewards=[float(passed)] * 2)

    trained = [record("trained", n, n % 2 == 0) for n in range(10, 30)]
    decisions = {"o0": trained, "o1": trained, "k0": trained + [record("dropped", n, False) for n in range(40, 46)],
                 "k1": trained + [record("dropped", n, False) for n in range(46, 52)]}
    metrics = run_rows(2.0, {0: 0.2, 4: 0.5}) + [
        {"service": "group-collector", "ts": 1001.0, "collector/batch_id": "b1", "staleness/time_in_flight_s_mean": 3.0,
         "staleness/time_waiting_s_mean": 0.5}]
    metrics[0]["train/batch_id"] = "b1"  # the step at ts 1002 trained it
    rows = [summ.run_row(metrics, v, s, [], 4, None, None, key, decisions=decisions[key])
            for key, v, s in (("o0", "off", 0), ("o1", "off", 1), ("k0", "keep1", 0), ("k1", "keep1", 1))]
    assert (rows[2]["trained_n"], rows[2]["dropped_n"], rows[2]["dropped_len_mean"]) == (20, 6, 42.5)
    assert rows[2]["dropped_len_p"] < 0.01 and rows[0]["dropped_len_p"] is None
    assert (rows[0]["in_flight_s_mean"], rows[0]["queued_collector_s_mean"], rows[0]["queued_trainer_s_mean"]) == \
        (3.0, 0.5, 1.0)
    bias = drop_bias_table(spec, rows, decisions)
    assert bias[1] == ["off", "-", "0 / 40", "nothing measured was dropped or dead-lettered", "", "", "", "", "", ""]
    keep = bias[2]
    assert keep[:4] == ["keep1", "dropped by the window", "12 / 40", "45.5 vs 19.5"] and keep[5] == "2/2"
    assert keep[6] == "0.000 vs 0.500" and keep[8] == "2/2"  # none of the dropped passed, half the trained did
    assert keep[9] == "0.00 rewarded vs 0.00 in those groups; only rewarded ones outside in 0 of 12 drops"
    assert rows[2]["dropped_outside_pass"] == 0.0 and rows[2]["dropped_only_rewarded_share"] == 0.0
    age = age_table(spec, rows)
    assert age[0][1:4] == ["in flight (s)", "queued: finished -> cut (s)", "queued: cut -> trained (s)"]
    assert age[1][1].startswith("3.00") and age[1][4].startswith("1.50")


def test_a_spec_can_headline_a_learning_measure_instead_of_speed(tmp_path: Path) -> None:
    spec_path = tmp_path / "e.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "e", "base": str(REPO / "configs/test.yaml"), "baseline": "naive", "seeds": [0, 1],
        "stop": {"steps": 4}, "headline": "final_eval_acc",
        "variants": {"naive": {}, "clipped": {}, "decoupled": {}}}))
    spec = load_spec(spec_path)
    finals = {("naive", 0): 0.1, ("naive", 1): 0.1, ("clipped", 0): 0.4, ("clipped", 1): 0.5,
              ("decoupled", 0): 0.2, ("decoupled", 1): 0.3}
    rows = [summ.run_row(run_rows(1.0 + s, {0: 0.2, 4: acc}), v, s, [], 4, None, None, f"{v}{s}")
            for (v, s), acc in finals.items()]
    line = headline(spec, rows)
    # the highest ratio of means, clipped 0.45 over naive 0.1, however fast each variant ran
    assert line.startswith("clipped/naive final eval accuracy: 4.50× (seeds 2 against 2, 95% interval [")
    assert line.endswith("the highest of 2 variants") and "wall-clock" not in line
    assert headline(spec, [r for r in rows if r["variant"] == "naive"]).endswith("n/a (no finished runs to compare)")
    spec_path.write_text(spec_path.read_text().replace("final_eval_acc", "tokens_per_s"))
    with pytest.raises(SpecError, match="headline"):
        load_spec(spec_path)
