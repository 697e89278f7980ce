"""Whom the controls drop (tools.reports.dropbias): the sets, the per-group measures and the tests (pure)."""

from __future__ import annotations

import pytest

from shared.window_decisions import DecisionRecord
from tools.reports import dropbias
from tools.reports.twosample import mann_whitney


def rec(decision: str = "trained", outcome: str = "batched", reason: str = "in_window", window_decided: bool = True,
        tokens: list[int] | None = None, rewards: list[float] | None = None, group_id: str = "g") -> DecisionRecord:
    tokens = [10, 20] if tokens is None else tokens
    return DecisionRecord.model_validate(dict(
        group_id=group_id, attempt=0, versions=[], gaps=[], keep_versions=2, current_version=None,
        cutoff_version=None, decision=decision, outcome=outcome, reason=reason, window_decided=window_decided,
        at=1.0, response_tokens=tokens, rewards=[1.0] * len(tokens) if rewards is None else rewards))


def stale(tokens: list[int], rewards: list[float] | None = None, dead: bool = False) -> DecisionRecord:
    return rec("dropped", "dead_lettered" if dead else "reenqueued", "stale_retries_exhausted" if dead else "stale",
               True, tokens, rewards)


def test_a_group_attempt_is_one_unit_measured_by_its_mean_length_and_its_share_of_rewards_above_zero() -> None:
    u = dropbias.unit(rec(tokens=[10, 30, 20, 40], rewards=[0.0, 0.2, 1.0, 0.0]))
    assert u == dropbias.Unit(length=25.0, passed=0.5)
    assert dropbias.unit(rec(tokens=[])) is None  # a failed attempt, or a record older than the fields


def test_sets_dropped_by_the_window_dead_lettered_and_trained() -> None:
    failed_dead = rec("dropped", "dead_lettered", "retries_exhausted", False, tokens=[])
    sets = dropbias.split([rec(), stale([5]), stale([7], dead=True), failed_dead,
                           rec("dropped", "dead_lettered", "task_error", False, tokens=[9])])
    assert [u.length for u in sets["trained"]] == [15.0]
    assert [u.length for u in sets["dropped"]] == [5.0, 7.0]  # both stale drops, the last one dead-lettered
    assert [u.length for u in sets["dead"]] == [7.0, 9.0]  # every dead letter with trajectories


def test_columns_hold_the_means_and_the_shared_mann_whitney_per_comparison() -> None:
    trained = [rec(tokens=[n, n], rewards=[1.0, 0.0]) for n in range(10, 30)]
    dropped = [stale([n, n], rewards=[0.0, 0.0]) for n in range(40, 50)]
    cols = dropbias.columns(trained + dropped)
    assert list(cols) == list(dropbias.COLUMNS)
    assert (cols["trained_n"], cols["dropped_n"], cols["dead_n"]) == (20, 10, 0)
    assert cols["trained_len_mean"] == 19.5 and cols["dropped_len_mean"] == 44.5
    assert cols["dropped_len_p"] == pytest.approx(mann_whitney([float(n) for n in range(40, 50)],
                                                               [float(n) for n in range(10, 30)]).p_value)
    assert (cols["dropped_len_p"] or 1.0) < 1e-3 and cols["dropped_len_ks"] == pytest.approx(1.0)  # longer, every one
    assert (cols["trained_pass_mean"], cols["dropped_pass_mean"]) == (0.5, 0.0)
    assert cols["dropped_pass_ks"] == pytest.approx(1.0)
    assert cols["dead_len_p"] is None and cols["dead_len_mean"] is None  # nothing dead-lettered: no test


def test_records_without_lengths_give_no_figures_and_the_report_says_why() -> None:
    old = [rec(tokens=[]), stale([])]
    assert dropbias.columns(old)["dropped_len_p"] is None and dropbias.columns(old)["trained_n"] == 0
    lines = dict(dropbias.summary_pairs([rec(), stale([400])]))
    assert lines["response tokens: dropped by the window vs trained (per group)"].startswith(
        "400.0 vs 15.0 (1 vs 1 groups), Mann-Whitney p=")
    assert lines["pass rate: dead-lettered vs trained (per group)"] == "- (0 dead-lettered, 1 trained groups with trajectories)"
    assert dropbias.summary_pairs([]) == [("whom the controls drop", "- (no decisions.jsonl)")]


def judged(gaps: list[int], rewards: list[float], keep: int = 2, decision: str = "dropped",
           window_decided: bool = True) -> DecisionRecord:
    r = rec(decision, "reenqueued" if decision == "dropped" else "batched", "stale" if decision == "dropped"
            else "in_window", window_decided, tokens=[10] * len(rewards), rewards=rewards)
    return r.model_copy(update={"gaps": gaps, "versions": [str(g) for g in gaps], "keep_versions": keep})


def test_deciders_count_the_trajectories_outside_the_window_in_its_drops_and_whether_they_were_rewarded() -> None:
    records = [
        judged([3, 1, 1, 1], [1.0, 0.0, 0.0, 0.0]),  # only the early winner outside
        judged([2, 2, 1, 0], [1.0, 0.0, 1.0, 0.0]),  # a winner and a loser outside
        judged([2, 2], [0.0, 0.0]),  # the whole group outside, nothing rewarded
        judged([5, 0], [1.0, 0.0], decision="trained"),  # trained: not a drop
        judged([5, 0], [1.0, 0.0], window_decided=False),  # failed and retried: not the window's call
        judged([5, 0, 0], [1.0, 0.0]),  # a trajectory without a version: gaps and rewards do not align
        judged([1, 0], [1.0, 0.0]),  # nothing outside the window of 2 (decided under another window): left out
    ]
    d = dropbias.deciders(records)
    assert (d.drops, d.only_rewarded, d.outside, d.outside_rewarded, d.trajectories, d.rewarded) == (3, 1, 5, 2, 10, 3)
    assert (d.outside_pass, d.groups_pass) == (0.4, 0.3) and d.only_rewarded_share == pytest.approx(1 / 3)
    assert dropbias.describe_deciders(d) == "0.40 rewarded vs 0.30 in those groups; only rewarded ones outside in 1 of 3 drops"
    cols = dropbias.columns(records)
    assert (cols["dropped_outside_pass"], cols["dropped_groups_pass"]) == (0.4, 0.3)
    assert dict(dropbias.summary_pairs(records))["trajectories outside the window in its drops"].startswith("0.40")


def test_deciders_say_nothing_without_window_drops() -> None:
    d = dropbias.deciders([rec(), stale([5])])  # the stale record has no gaps (an old record)
    assert d.drops == 0 and d.outside_pass is None and d.only_rewarded_share is None
    assert dropbias.describe_deciders(d) == "-"
    assert dropbias.columns([rec()])["dropped_outside_pass"] is None
