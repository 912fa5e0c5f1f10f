"""qerl_cli.stats: Student's t without scipy, Welch's interval, the permutation test and the seeds an
interval of a given width needs, against hand-worked cases and table values."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from qerl_cli import stats

# Two-sided 95% critical values (p = 0.975) and a few others, from printed t tables.
T_TABLE = [
    (1, 0.975, 12.7062), (2, 0.975, 4.3027), (3, 0.975, 3.1824), (4, 0.975, 2.7764), (6, 0.975, 2.4469),
    (10, 0.975, 2.2281), (16, 0.975, 2.1199), (30, 0.975, 2.0423), (100, 0.975, 1.9840), (2, 0.995, 9.9248),
    (1, 0.9995, 636.6192), (30, 0.9, 1.3104), (5, 0.6, 0.2672),
]  # fmt: skip


@pytest.mark.parametrize(("df", "p", "expected"), T_TABLE)
def test_t_quantile_matches_the_tables(df: float, p: float, expected: float) -> None:
    assert stats.t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert stats.t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-4)  # symmetric
    assert stats.t_cdf(expected, df) == pytest.approx(p, abs=1e-5)


def test_t_quantile_of_fractional_df_lies_between_its_neighbours_and_tends_to_the_normal() -> None:
    assert stats.t_quantile(0.975, 3) < stats.t_quantile(0.975, 2.5) < stats.t_quantile(0.975, 2)
    assert stats.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert stats.t_cdf(0.0, 3.7) == 0.5
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 3)


def test_welch_interval_of_a_hand_worked_example() -> None:
    """a = 1, 2, 3 and b = 2, 3, 4: means 2 and 3, variances 1 and 1, se = sqrt(1/3 + 1/3) = 0.8165;
    df = (2/3)^2 / ((1/3)^2 / 2 + (1/3)^2 / 2) = 4, t(0.975, 4) = 2.7764: -1 ± 2.2669."""
    interval = stats.welch_interval([1, 2, 3], [2, 3, 4])
    assert interval.difference == pytest.approx(-1.0)
    assert interval.se == pytest.approx(math.sqrt(2 / 3))
    assert interval.df == pytest.approx(4.0)
    assert interval.t == pytest.approx(2.7764, abs=1e-4)
    assert (interval.low, interval.high) == (
        pytest.approx(-3.2669, abs=1e-4),
        pytest.approx(1.2669, abs=1e-4),
    )


def test_welch_df_is_fractional_when_the_variances_differ() -> None:
    """a = 1, 2, 3 (variance 1), b = 4, 6, 8 (variance 4): v = 1/3 and 4/3, df = (5/3)^2 / ((1/9 + 16/9)
    / 2) = 50/17 = 2.941: between the t of df 2 and 3."""
    interval = stats.welch_interval([1, 2, 3], [4, 6, 8])
    assert interval.df == pytest.approx(50 / 17)
    assert interval.difference == -4.0 and interval.se == pytest.approx(math.sqrt(5 / 3))
    assert stats.t_quantile(0.975, 3) < interval.t < stats.t_quantile(0.975, 2)
    assert interval.high - interval.difference == pytest.approx(interval.t * interval.se)


def test_welch_interval_needs_two_values_a_side_and_zero_spread_gives_a_point() -> None:
    with pytest.raises(ValueError, match="2 values"):
        stats.welch_interval([0.5], [0.1, 0.2])
    same = stats.welch_interval([0.3, 0.3], [0.1, 0.1])
    assert (same.low, same.high) == (pytest.approx(0.2), pytest.approx(0.2)) and same.df == 2.0


def test_permutation_p_of_a_tiny_example_enumerated_by_hand() -> None:
    """a = 1, 2 vs b = 3, 4: |difference| 2. The C(4, 2) = 6 splits of the pooled values give
    {1,2}: 2, {1,3}: 1, {1,4}: 0, {2,3}: 0, {2,4}: 1, {3,4}: 2, so p = 2/6."""
    test = stats.permutation_test([1, 2], [3, 4])
    assert (test.p_value, test.exact, test.relabelings) == (pytest.approx(1 / 3), True, 6)
    assert stats.permutation_test([1, 1], [1, 1]).p_value == 1.0  # every split ties the observed 0


def test_permutation_p_is_a_seeded_monte_carlo_past_the_enumeration_limit() -> None:
    a, b = [0.1 * i for i in range(10)], [0.1 * i + 0.35 for i in range(10)]
    test = stats.permutation_test(a, b)
    assert math.comb(20, 10) > stats.PERMUTATION_DRAWS  # 184756 relabelings: drawn, not enumerated
    assert (test.exact, test.relabelings) == (False, stats.PERMUTATION_DRAWS)
    assert test == stats.permutation_test(a, b)  # seeded: the same p again
    assert 0.0 < test.p_value < 1.0
    apart = stats.permutation_test([0.0] * 10, [1.0] * 10)
    assert apart.p_value == pytest.approx(1 / (1 + stats.PERMUTATION_DRAWS), abs=3e-4)  # never 0


def test_seeds_for_half_width_of_a_hand_worked_case() -> None:
    """sd 1 both, ±1: the half-width t(df 2(n-1)) * sqrt(2 / n) reaches 1 first at n = 9
    (t(16) = 2.1199 x 0.4714 = 0.9993), not at n = 8 (t(14) = 2.1448 x 0.5 = 1.0724)."""
    assert stats.seeds_for_half_width(1.0, 1.0, 1.0) == 9
    assert stats.seeds_for_half_width(0.0, 0.0, 1.0) == 2  # no scatter: the least an interval needs
    assert stats.seeds_for_half_width(100.0, 100.0, 0.01, limit=50) is None


def test_seeds_for_half_width_strict_wants_an_interval_narrower_than_the_bound() -> None:
    """A half-width exactly that of n = 9 seeds (sd 1 both): no wider than it at 9, narrower only at 10,
    as an interval reaching a verdict's edge does not clear it."""
    at_nine = stats.t_quantile(0.975, stats.welch_df(1.0, 9, 1.0, 9)) * math.sqrt(2.0 / 9)
    assert stats.seeds_for_half_width(1.0, 1.0, at_nine) == 9
    assert stats.seeds_for_half_width(1.0, 1.0, at_nine, strict=True) == 10
    assert stats.seeds_for_half_width(0.0, 0.0, 1.0, strict=True) == 2  # a zero width is narrower


@pytest.mark.parametrize(("sd_a", "sd_b", "width"), [(9.7, 9.7, 5.0), (3.0, 12.0, 5.0), (0.5, 0.2, 1.0)])
def test_seeds_for_half_width_is_the_least_n_whose_interval_is_as_narrow(
    sd_a: float, sd_b: float, width: float
) -> None:
    n = stats.seeds_for_half_width(sd_a, sd_b, width / 2)
    assert n is not None

    def half(k: int) -> float:
        df = stats.welch_df(sd_a**2, k, sd_b**2, k)
        return stats.t_quantile(0.975, df) * math.sqrt((sd_a**2 + sd_b**2) / k)

    assert half(n) <= width / 2 and (n == 2 or half(n - 1) > width / 2)


def test_sd_is_the_sample_standard_deviation() -> None:
    assert stats.sd([1.0, 2.0, 3.0]) == 1.0 and stats.sd([4.0]) is None


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        (0.2, 2.0, -2.0 * math.log(0.8)),  # df 2: the exponential distribution of mean 2
        (0.5, 1.0, NormalDist().inv_cdf(0.75) ** 2),  # df 1: a squared standard normal
        (0.2, 10.0, 6.1791),  # tables
        (0.05, 3.0, 0.3518),
        (0.95, 100.0, 124.3421),
    ],
)
def test_chi2_quantile_matches_closed_forms_and_the_tables(p: float, df: float, expected: float) -> None:
    assert stats.chi2_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert stats.chi2_cdf(stats.chi2_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_seeds_with_assurance_plan_on_the_scatters_upper_bound() -> None:
    """Gemma 3 270M's 18 + 18 seeds (SDs 9.9 and 5.5 points): 22 seeds per arm at the scatter seen, 28 at
    its 80% upper bound; with few seeds behind the SDs the bound is far above them, with many it meets them,
    and no scatter needs no more."""
    assert stats.seeds_for_half_width(9.9, 5.5, 5.0) == 22
    assert stats.seeds_with_assurance(9.9, 18, 5.5, 18, 5.0) == 28
    assert stats.seeds_with_assurance(9.9, 3, 5.5, 3, 5.0) > 2 * 22
    assert stats.seeds_with_assurance(9.9, 100000, 5.5, 100000, 5.0) == 22
    assert stats.seeds_with_assurance(0.0, 5, 0.0, 5, 5.0) == stats.seeds_for_half_width(0.0, 0.0, 5.0) == 2
    # By hand: one arm's variance alone, df 17, chi2(0.2, 17) = 12.002, so the SD grows by sqrt(17 / 12.002).
    scale = math.sqrt(17 / stats.chi2_quantile(0.2, 17))
    assert scale == pytest.approx(1.1901, abs=1e-3)
    assert stats.seeds_with_assurance(8.0, 18, 0.0, 18, 5.0) == stats.seeds_for_half_width(
        8.0 * scale, 0.0, 5.0
    )
