"""The adaptive window's rule on scripted signal sequences and as properties (no Redis)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.window_controller.policy import (
    HOLD,
    TIGHTEN,
    WIDEN,
    Signals,
    State,
    decide,
    drift,
    initial_state,
    propose,
)
from shared.config import WindowControllerConfig

CFG = WindowControllerConfig(enabled=True, min_keep=1, max_keep=6, target_logprob_diff=0.1, deadband=0.3,
                             max_wait_fraction=0.2, max_drop_rate=0.4, patience=3, starve_patience=1,
                             stall_ticks=3, cooldown=2, max_step=2)
HIGH = Signals(logprob_diff=0.5, wait_fraction=0.02, drop_rate=0.05, steps=3)  # stale data, trainer fed
LOW = Signals(logprob_diff=0.01, wait_fraction=0.02, drop_rate=0.1, steps=3)  # fresh data, window costs groups
OK = Signals(logprob_diff=0.1, wait_fraction=0.02, drop_rate=0.1, steps=3)  # in the band
STARVING = Signals(logprob_diff=0.5, wait_fraction=0.6, drop_rate=0.5, steps=1)


def run(state: State, seq: list[Signals], cfg: WindowControllerConfig = CFG) -> list[int]:
    keeps = []
    for s in seq:
        d = decide(cfg, state, s)
        state = d.state
        keeps.append(d.after)
    return keeps


def test_high_logprob_diff_tightens_one_version_per_patience_plus_cooldown_down_to_min_keep() -> None:
    keeps = run(State(keep=4), [HIGH] * 20)
    assert keeps[:3] == [4, 4, 3]  # patience 3: the third agreeing tick acts, by one version
    assert keeps[3:6] == [3, 3, 2]  # cooldown 2 then ... the streak restarted at the change: 3 more ticks
    assert min(keeps) == 1 and keeps[-1] == 1  # never below min_keep
    assert all(b <= a for a, b in zip(keeps, keeps[1:], strict=False))  # monotone under a constant signal


def test_signal_flipping_every_tick_never_moves_the_window() -> None:
    assert set(run(State(keep=3), [HIGH, LOW] * 30)) == {3}
    assert set(run(State(keep=3), [HIGH, OK, HIGH, OK, HIGH] * 10)) == {3}


def test_in_band_holds_forever() -> None:
    assert set(run(State(keep=2), [OK] * 50)) == {2}


def test_starvation_widens_at_once_by_max_step_even_in_cooldown_and_that_window_is_never_used_again() -> None:
    state = State(keep=2, cooldown=2, last_change=TIGHTEN)
    d = decide(CFG, state, STARVING)
    assert (d.before, d.after, d.reason) == (2, 4, "trainer_waiting") and d.state.floor == 3
    keeps = run(d.state, [HIGH] * 60)  # the diff stays high: tighten again, but never to 2
    assert min(keeps) == 3 and keeps[-1] == 3


def test_tightening_is_refused_while_the_trainer_is_near_starving() -> None:
    near = Signals(logprob_diff=0.5, wait_fraction=0.15, drop_rate=0.05, steps=3)  # wait in the guard band
    assert propose(CFG, near, 0) == (HOLD, "logprob_diff_high_but_trainer_needs_data")
    assert set(run(State(keep=4), [near] * 30)) == {4}


def test_no_trainer_step_for_stall_ticks_while_dropping_widens() -> None:
    stalled = Signals(logprob_diff=None, wait_fraction=None, drop_rate=0.3, steps=0)
    keeps = run(State(keep=1), [stalled] * 4)
    assert keeps == [1, 1, 3, 3]  # third idle tick: urgent, +max_step; then the new window gets stall_ticks
    quiet = Signals(logprob_diff=None, wait_fraction=None, drop_rate=None, steps=0)  # nothing at all happens
    assert set(run(State(keep=1), [quiet] * 10)) == {1}


def test_reversing_the_last_change_needs_twice_the_patience() -> None:
    state = decide(CFG, State(keep=3), LOW).state
    keeps = run(State(keep=3), [LOW] * 3 + [HIGH] * 6)
    assert keeps[2] == 4  # widened after 3 ticks
    assert keeps[3:8] == [4] * 5 and keeps[8] == 3  # tightening back waited 6 ticks
    assert state.streak == 1


def test_ess_and_mismatch_kl_steer_when_chosen_and_are_ignored_otherwise() -> None:
    by_ess = CFG.model_copy(update={"signal": "ess", "target_ess": 0.8})  # deficit target 0.2, band [0.14, 0.26]
    by_kl = CFG.model_copy(update={"signal": "mismatch_kl", "target_mismatch_kl": 0.05})
    fed = Signals(logprob_diff=0.1, wait_fraction=0.02, drop_rate=0.1, steps=3)  # the diff in CFG's band
    assert propose(by_ess, dataclasses.replace(fed, ess=0.5), 0) == (TIGHTEN, "ess_deficit_high")
    assert propose(by_ess, dataclasses.replace(fed, ess=0.99), 0) == (WIDEN, "ess_deficit_low")
    assert propose(by_ess, dataclasses.replace(fed, ess=0.8), 0) == (HOLD, "in_band")
    assert propose(by_kl, dataclasses.replace(fed, mismatch_kl=0.6), 0) == (TIGHTEN, "mismatch_kl_high")
    assert propose(by_kl, dataclasses.replace(fed, mismatch_kl=0.001), 0) == (WIDEN, "mismatch_kl_low")
    assert propose(by_kl, fed, 0) == (HOLD, "no_trainer_step")  # the chosen measure missing: nothing to act on
    assert propose(CFG, dataclasses.replace(fed, ess=0.01, mismatch_kl=9.0), 0) == (HOLD, "in_band")
    # starvation still outranks whichever measure steers
    assert propose(by_ess, dataclasses.replace(STARVING, ess=0.1), 0) == (WIDEN, "trainer_waiting")


def test_initial_state_clips_into_bounds_and_starts_wide_when_the_window_is_off() -> None:
    assert initial_state(CFG, 0).keep == 6 and initial_state(CFG, 99).keep == 6 and initial_state(CFG, 2).keep == 2


signals = st.builds(
    Signals,
    logprob_diff=st.one_of(st.none(), st.floats(0, 5, allow_nan=False)),
    wait_fraction=st.one_of(st.none(), st.floats(0, 1, allow_nan=False)),
    drop_rate=st.one_of(st.none(), st.floats(0, 1, allow_nan=False)),
    steps=st.integers(0, 5),
    mismatch_kl=st.one_of(st.none(), st.floats(0, 5, allow_nan=False)),
    ess=st.one_of(st.none(), st.floats(0.01, 1, allow_nan=False)),
).map(lambda s: s if s.steps else dataclasses.replace(s, logprob_diff=None, mismatch_kl=None, ess=None))
# The loop's signals: a logprob diff is the mean over the new trainer steps, so no step means no diff
# (signals.py). Without this, hypothesis found "no step for ticks, yet a high diff": tighten on the
# diff, then widen when the stall guard fires, a pair of inputs the loop cannot produce.
configs = st.builds(
    WindowControllerConfig,
    min_keep=st.integers(1, 3), max_keep=st.integers(3, 10), patience=st.integers(1, 4),
    starve_patience=st.integers(1, 3), cooldown=st.integers(0, 3), max_step=st.integers(1, 3),
    deadband=st.floats(0, 1), target_logprob_diff=st.floats(0.01, 1),
    signal=st.sampled_from(["logprob_diff", "mismatch_kl", "ess"]), target_mismatch_kl=st.floats(0.01, 1),
    target_ess=st.floats(0.05, 0.99),
)


def with_drift(cfg: WindowControllerConfig, s: Signals, value: float) -> Signals:
    """``s`` with the measure ``cfg.signal`` steers by set so that its drift is ``value`` (a trainer step seen)."""
    field = {"logprob_diff": "logprob_diff", "mismatch_kl": "mismatch_kl", "ess": "ess"}[cfg.signal]
    raw = 1.0 - value if cfg.signal == "ess" else value
    return dataclasses.replace(s, steps=max(s.steps, 1), **{field: raw})


@settings(max_examples=300, deadline=None)
@given(configs, st.integers(0, 12), st.lists(signals, max_size=60))
def test_window_stays_in_bounds_and_moves_by_bounded_steps(cfg: WindowControllerConfig, start: int,
                                                           seq: list[Signals]) -> None:
    state = initial_state(cfg, start)
    for s in seq:
        d = decide(cfg, state, s)
        assert cfg.min_keep <= d.after <= cfg.max_keep and d.after >= 1
        assert abs(d.after - d.before) <= cfg.max_step
        if d.proposal == TIGHTEN and d.changed:
            assert (s.wait_fraction or 0) <= cfg.max_wait_fraction / 2 and (s.drop_rate or 0) <= cfg.max_drop_rate / 2
        assert d.state.floor >= state.floor  # a starving window is never allowed back
        state = d.state


@settings(max_examples=300, deadline=None)
@given(configs, signals, st.floats(0, 0.99), st.floats(0, 0.99), st.integers(0, 5))
def test_proposal_is_non_increasing_in_the_drift_whichever_measure_steers(
        cfg: WindowControllerConfig, s: Signals, a: float, b: float, idle: int) -> None:
    lo, hi = sorted((a, b))
    s_lo, s_hi = with_drift(cfg, s, lo), with_drift(cfg, s, hi)
    assert drift(cfg, s_lo) == pytest.approx(lo) and drift(cfg, s_hi) == pytest.approx(hi)
    assert propose(cfg, s_hi, idle)[0] <= propose(cfg, s_lo, idle)[0]


@settings(max_examples=300, deadline=None)
@given(configs, signals, st.floats(0, 1), st.floats(0, 1), st.integers(0, 5))
def test_proposal_is_non_decreasing_in_waiting_and_in_drops(cfg: WindowControllerConfig, s: Signals, a: float,
                                                            b: float, idle: int) -> None:
    lo, hi = sorted((a, b))
    assert propose(cfg, Signals(s.logprob_diff, lo, s.drop_rate, s.steps), idle)[0] <= \
        propose(cfg, Signals(s.logprob_diff, hi, s.drop_rate, s.steps), idle)[0]
    assert propose(cfg, Signals(s.logprob_diff, s.wait_fraction, lo, s.steps), idle)[0] <= \
        propose(cfg, Signals(s.logprob_diff, s.wait_fraction, hi, s.steps), idle)[0]


@settings(max_examples=200, deadline=None)
@given(configs, st.integers(1, 10), signals, st.integers(1, 80))
def test_constant_signals_move_the_window_one_way_only(cfg: WindowControllerConfig, start: int, s: Signals,
                                                       n: int) -> None:
    state = initial_state(cfg, start)
    directions = set()
    for _ in range(n):
        d = decide(cfg, state, s)
        if d.changed:
            directions.add(WIDEN if d.after > d.before else TIGHTEN)
        state = d.state
    assert len(directions) <= 1
