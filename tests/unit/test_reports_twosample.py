"""The two-sample tests (soak length bias, experiment drop bias) against hand-computed and scipy reference values."""

from __future__ import annotations

import random

import pytest

from tools.reports.twosample import TwoSampleResult, cluster_means, ks_statistic, mann_whitney


def test_mann_whitney_matches_the_reference_value_for_fully_separated_samples() -> None:
    # U = 0, mu = 12.5, sigma = sqrt(25 * 11 / 12) = 4.787, z = 12 / 4.787 = 2.507, p = erfc(z / sqrt 2)
    r = mann_whitney([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert r.statistic == 0 and r.p_value == pytest.approx(0.012185, abs=1e-5)


def test_mann_whitney_with_ties_matches_the_reference_value() -> None:
    # By hand: average ranks 1 | 3 3 (3) | 7 7 7 (7 7) | 10.5 10.5 | 12 -> R1 = 28, U1 = 28 - 21 = 7;
    # ties 1,3,5,2,1 -> sum(t^3 - t) = 150; var = 36/12 * (13 - 150/132) = 35.59; z = (11 - 0.5)/5.966 = 1.760
    r = mann_whitney([1, 2, 2, 3, 3, 3], [2, 3, 3, 4, 4, 5])
    assert r.statistic == 7 and r.p_value == pytest.approx(0.0784, abs=5e-4)


def test_same_distribution_is_not_significant_and_a_shift_is() -> None:
    rng = random.Random(7)
    a = [rng.randint(1, 24) for _ in range(400)]
    b = [rng.randint(1, 24) for _ in range(400)]
    shifted = [min(24, x + 3) for x in b]
    assert mann_whitney(a, b).p_value > 0.01
    assert mann_whitney(a, shifted).p_value < 1e-6
    assert ks_statistic(a, b) < 0.12 < ks_statistic(a, shifted)


def test_degenerate_samples() -> None:
    assert mann_whitney([3, 3], [3, 3, 3]) == TwoSampleResult(3.0, 1.0)
    assert ks_statistic([1, 2], [1, 2]) == 0.0 and ks_statistic([1], [2]) == 1.0
    with pytest.raises(ValueError):
        mann_whitney([], [1])


def test_cluster_means_give_one_value_per_group_and_skip_groups_without_values() -> None:
    values = {"g1": [2, 4], "g2": [10], "g3": []}
    assert cluster_means(["g1", "g2", "g3", "g4"], values) == [3.0, 10.0]


def test_copies_within_a_group_inflate_significance_and_the_group_mean_does_not() -> None:
    # 60 prompts a side, each answered 8 times at the prompt's length; the sides differ by 4 tokens on a
    # spread of 60. Counted per trajectory the 8 copies look like independent evidence (p < 0.001); per
    # group, 60 units a side, the same difference is within noise. A real shift still shows per group.
    a = {f"g{i}": [i] * 8 for i in range(60)}
    b = {f"g{i}": [i + 4] * 8 for i in range(60)}
    flat_a, flat_b = [x for v in a.values() for x in v], [x for v in b.values() for x in v]
    assert mann_whitney(flat_a, flat_b).p_value < 0.001
    assert mann_whitney(cluster_means(a, a), cluster_means(b, b)).p_value > 0.1
    far = {f"g{i}": [i + 30] * 8 for i in range(60)}
    assert mann_whitney(cluster_means(a, a), cluster_means(far, far)).p_value < 1e-6
