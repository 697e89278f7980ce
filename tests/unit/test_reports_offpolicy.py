"""The off-policy diagnostics of a run (tools.reports.offpolicy): per-step metrics in, summary columns out."""

from __future__ import annotations

import pytest

from tools.experiments import summary as summ
from tools.reports import offpolicy


def trainer_row(step: int, ess: float, truncated: float, clip_mean: float, clip_max: float, kl: float) -> dict[str, object]:
    return {"service": "trainer", "ts": 100.0 + step, "train/step": step, "train/ess": ess,
            "train/behaviour_weight_truncated_frac": truncated, "train/clip_frac_minibatch_mean": clip_mean,
            "train/clip_frac_minibatch_max": clip_max, "train/mismatch_kl": kl}


def test_columns_are_means_over_steps_and_the_lowest_ess() -> None:
    rows = [trainer_row(1, 0.9, 0.0, 0.1, 0.2, 0.01), trainer_row(2, 0.5, 0.1, 0.3, 0.6, 0.03),
            {"service": "eval", "eval/accuracy": 0.5}]
    rows[1]["train/proximal_approx_abs_err"] = 0.02  # reported by recompute runs only: a mean over the steps that have it
    cols = offpolicy.split(rows).columns()
    assert list(cols) == list(offpolicy.COLUMNS)
    assert cols == {"ess_mean": pytest.approx(0.7), "ess_min": 0.5, "truncated_frac_mean": pytest.approx(0.05),
                    "clip_frac_mb_mean": pytest.approx(0.2), "clip_frac_mb_max": pytest.approx(0.4),
                    "mismatch_kl_mean": pytest.approx(0.02), "prox_approx_err_mean": pytest.approx(0.02)}


def test_a_run_without_the_diagnostics_has_empty_columns_and_dashes() -> None:
    old = [{"service": "trainer", "train/step": 1, "train/loss": 0.1}]
    assert set(offpolicy.split(old).columns().values()) == {None}
    assert all(value.replace(" / ", "") in {"-", "--"} for _, value in offpolicy.summary_pairs(offpolicy.split(old)))


def test_summary_csv_carries_the_diagnostics() -> None:
    rows = [trainer_row(1, 0.8, 0.0, 0.1, 0.2, 0.01) | {"time/wall_s": 1.0}]
    row = summ.run_row(rows, "v", 0, [0.5], None, None, None, "run")
    assert set(offpolicy.COLUMNS) <= set(summ.columns([0.5])) and row["ess_min"] == 0.8
