"""Prometheus names and kinds of reported metrics (shared.telemetry), by the naming conventions."""

from __future__ import annotations

import pytest

from shared.telemetry import is_cumulative, prom_name


@pytest.mark.parametrize(("metric", "name", "cumulative"), [
    ("train/train_rollout_logprob_abs_diff", "dressage_train_rollout_logprob_abs_diff", False),  # area said once
    ("time/wait_s", "dressage_time_wait_seconds", True),  # the trainer's cumulative seconds: a counter
    ("time/wall_s", "dressage_time_wall_seconds", True),
    ("stats/groups_trained", "dressage_stats_groups_trained", True),
    ("rollout/tokens_per_s", "dressage_rollout_tokens_per_second", False),
    ("eval/accuracy", "dressage_eval_accuracy", False),
])
def test_names_spell_units_out_and_cumulative_values_are_counters(metric: str, name: str, cumulative: bool) -> None:
    assert prom_name(metric) == name and not prom_name(metric).endswith("_s")
    assert is_cumulative(metric) is cumulative
