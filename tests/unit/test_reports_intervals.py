"""Interval and ratio arithmetic of the experiment runner, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from tools.reports.intervals import NoData, mean_interval, ratio_interval, t_quantile


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139),
                                              (30, 2.042272), (1000, 1.962339)])
def test_t_quantile_matches_the_table(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-5)


def test_t_quantile_is_symmetric_and_works_for_fractional_df() -> None:
    assert t_quantile(0.025, 3) == pytest.approx(-t_quantile(0.975, 3))
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-9)
    assert t_quantile(0.975, 2) < t_quantile(0.975, 1.5) < t_quantile(0.975, 1)


def test_mean_interval_of_one_two_three() -> None:
    # mean 2, s = 1, s/sqrt(3) = 0.577350, t(0.975, 2) = 4.302653 -> half width 2.484138
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.estimate == 2.0
    assert iv.low == pytest.approx(2 - 2.484138, abs=1e-5)
    assert iv.high == pytest.approx(2 + 2.484138, abs=1e-5)
    assert iv.n == 3


def test_one_value_has_no_interval_and_no_values_is_an_error() -> None:
    iv = mean_interval([5.0])
    assert (iv.estimate, iv.low, iv.high) == (5.0, None, None)
    assert "no interval" in iv.text()
    with pytest.raises(NoData):
        mean_interval([])


def test_ratio_of_means_with_log_delta_interval() -> None:
    # a = [2, 4]: mean 3, s^2 = 2 -> va = 2 / (2 * 9) = 1/9; b = [1, 1, 1]: s = 0 -> vb = 0.
    # Welch df = (1/9)^2 / ((1/9)^2 / 1) = 1 -> t = 12.706205; half = 12.706205 * (1/3) = 4.235402.
    iv = ratio_interval([2.0, 4.0], [1.0, 1.0, 1.0])
    assert iv.estimate == pytest.approx(3.0)
    assert iv.low == pytest.approx(3 * math.exp(-4.235402), rel=1e-5)
    assert iv.high == pytest.approx(3 * math.exp(4.235402), rel=1e-5)
    assert iv.n == 2


def test_ratio_interval_with_both_samples_noisy() -> None:
    # a = [10, 12, 14]: mean 12, s^2 = 4 -> va = 4 / (3 * 144) = 0.00925926
    # b = [5, 6, 7]: mean 6, s^2 = 1 -> vb = 1 / (3 * 36) = 0.00925926
    # df = (2 va)^2 / (va^2/2 + va^2/2) = 4; t(0.975, 4) = 2.776445; half = 2.776445 * sqrt(0.0185185) = 0.377822
    iv = ratio_interval([10.0, 12.0, 14.0], [5.0, 6.0, 7.0])
    assert iv.estimate == pytest.approx(2.0)
    assert iv.low == pytest.approx(2 * math.exp(-0.377822), rel=1e-5)
    assert iv.high == pytest.approx(2 * math.exp(0.377822), rel=1e-5)


def test_ratio_needs_positive_means_and_spread_for_an_interval() -> None:
    with pytest.raises(NoData):
        ratio_interval([1.0], [0.0])
    iv = ratio_interval([4.0], [2.0, 2.2])
    assert iv.estimate == pytest.approx(4 / 2.1) and iv.low is None
    exact = ratio_interval([4.0, 4.0], [2.0, 2.0])
    assert (exact.low, exact.high) == (2.0, 2.0)
