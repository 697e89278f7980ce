"""Pacing arithmetic (pure): admission bounded by the published version, η, and the in-flight cap."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.prompt_buffer.pacing import PacingInputs, PacingPolicy, groups_per_version
from shared.versions import version_index


def state(v: int | None, produced: int = 0, trained: int = 0, dead: int = 0) -> PacingInputs:
    return PacingInputs(v, produced, trained, dead)


def test_nothing_is_released_before_the_first_version() -> None:
    assert PacingPolicy(None, 4, 64).capacity(state(None)) == 0
    assert PacingPolicy(3, 4, 64).capacity(state(None)) == 0


def test_eta_zero_releases_one_version_of_work_at_a_time() -> None:
    p = PacingPolicy(0, 4, 64)
    assert p.capacity(state(0)) == 4
    assert p.capacity(state(0, produced=4)) == 0
    assert p.capacity(state(0, produced=4, trained=4)) == 0  # trained but v1 not yet published
    assert p.capacity(state(1, produced=4, trained=4)) == 4


def test_eta_lets_the_buffer_run_eta_versions_ahead() -> None:
    p = PacingPolicy(2, 4, 64)
    assert p.capacity(state(0)) == 12
    assert p.capacity(state(5, produced=20, trained=16)) == 12  # (2 + 5 + 1) × 4 − 20
    assert PacingPolicy(2, 4, 6).capacity(state(5, produced=20, trained=16)) == 2  # 6 − 4 in flight


def test_dead_letters_free_their_slots() -> None:
    p = PacingPolicy(0, 4, 64)
    assert p.capacity(state(0, produced=4, dead=1)) == 1


def test_unbounded_eta_is_limited_by_max_in_flight_only() -> None:
    p = PacingPolicy(None, 4, 10)
    assert p.capacity(state(0)) == 10
    assert p.capacity(state(0, produced=100, trained=95)) == 5
    assert p.capacity(state(0, produced=100, trained=80, dead=10)) == 0


def test_max_in_flight_also_bounds_a_set_eta() -> None:
    assert PacingPolicy(100, 4, 6).capacity(state(0)) == 6


def test_a_trainer_restart_resumes_from_the_published_version_without_a_burst() -> None:
    p = PacingPolicy(1, 4, 64)
    assert p.capacity(state(7, produced=36, trained=28)) == 0  # (1 + 7 + 1) × 4 admitted
    # Trainer restarts: counters and the published log are persistent, so nothing changes...
    assert p.capacity(state(7, produced=36, trained=28)) == 0
    # ...until it publishes the next version, which releases exactly one version of work.
    assert p.capacity(state(8, produced=36, trained=32)) == 4


def test_groups_per_version_and_version_index() -> None:
    assert groups_per_version(4, 2) == 8
    assert version_index(None, 0) is None
    assert version_index("3", 10) == 3
    assert version_index("step-b", 4) == 3  # non-integer labels: position in the log
    assert version_index("x", 0) is None


def test_bad_policy_values_name_the_key() -> None:
    with pytest.raises(ValueError, match="pacing.max_versions_ahead"):
        PacingPolicy(-1, 4, 8)
    with pytest.raises(ValueError, match="pacing.max_in_flight_groups"):
        PacingPolicy(0, 4, 0)


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 3), gpv=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_simulated_pipeline_never_admits_beyond_eta_versions(eta: int, gpv: int, seed: int) -> None:
    """A random interleaving of emit / train / publish / dead-letter never breaks the bound."""
    rng = random.Random(seed)
    p = PacingPolicy(eta, gpv, 1000)
    v, produced, trained, dead = 0, 0, 0, 0
    for _ in range(200):
        op = rng.random()
        if op < 0.4:
            produced += rng.randint(0, p.capacity(state(v, produced, trained, dead)))
        elif op < 0.8 and produced - trained - dead > 0:
            trained += 1
        elif op < 0.9 and produced - trained - dead > 0 and rng.random() < 0.2:
            dead += 1
        elif trained >= (v + 1) * gpv:  # the trainer publishes once it consumed a version's groups
            v += 1
        # η = 0: nothing rolled out by version v+1 is admitted before v+1 is published.
        assert produced - dead <= (eta + v + 1) * gpv
