"""Plain-Python statistics over lists of figures (no torch, no scipy), for every layer: the one mean
helper, the sample standard deviation, Student's t, and two-sample comparisons (Welch's interval, a
permutation test, the seeds an interval of a given width needs), one sample's mean with its t interval,
and the ratio of two paired samples' means (a seeded bootstrap interval and its verdict against a margin).

Callers differ in what the mean of nothing is (NaN in a step's metrics, 0.0 for a reward mean, None
for a missing figure of a report), so :func:`mean` takes it as ``empty``.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import TypeVar, overload

_Empty = TypeVar("_Empty")


@overload
def mean(values: Sequence[float]) -> float: ...
@overload
def mean(values: Sequence[float], *, empty: _Empty) -> float | _Empty: ...
def mean(values: Sequence[float], *, empty: object = math.nan) -> object:
    """The arithmetic mean of ``values``; ``empty`` (NaN unless given) when there are none."""
    return sum(values) / len(values) if values else empty


def present(values: Iterable[float | None]) -> list[float]:
    """The figures that were measured: None and NaN (a missing figure) left out."""
    return [v for v in values if v is not None and not math.isnan(v)]


def sd(values: Sequence[float]) -> float | None:
    """The sample standard deviation (n - 1 in the denominator); None under two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


# -- Student's t, without scipy (not a dependency) ------------------------------------------------


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz), which
    converges quickly for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction where it converges.
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = ``p`` (0 < p < 1) for Student's t with ``df`` degrees of freedom: the CDF
    inverted by bisection, to ~1e-12 (Welch's df is fractional, so no table would do)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    return _invert_cdf(lambda t: t_cdf(t, df), p, 1.0)  # df = 1, p = 0.9995: t = 636.6


def _invert_cdf(cdf: Callable[[float], float], p: float, high: float) -> float:
    """The x >= 0 with ``cdf(x)`` = ``p``, by bisection to ~1e-12 relative: ``high`` doubled until it
    brackets ``p``, from 0 (a quantile at or above the distribution's median, or of one on x >= 0)."""
    low = 0.0
    while cdf(high) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if cdf(mid) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


# -- the chi-square distribution: how uncertain a sample variance is -----------------------------


def _lower_gamma_regularized(a: float, x: float) -> float:
    """P(a, x) = gamma(a, x) / Gamma(a): its power series below x = a + 1, above it one minus the
    continued fraction of Q(a, x) (modified Lentz), each where it converges quickly."""
    if x <= 0.0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        for n in range(1, 100000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return math.exp(log_front) * total
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100000):
        step = -i * (i - a)
        b += 2.0
        d = step * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + step / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return 1.0 - math.exp(log_front) * h


def chi2_cdf(x: float, df: float) -> float:
    """P(X <= x) for the chi-square distribution with ``df`` (> 0, not necessarily whole) degrees of
    freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    return _lower_gamma_regularized(df / 2.0, x / 2.0)


def chi2_quantile(p: float, df: float) -> float:
    """The x with P(X <= x) = ``p`` (0 < p < 1) for the chi-square distribution with ``df`` degrees of
    freedom, by bisection to ~1e-12 (Satterthwaite's df is fractional)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    return _invert_cdf(lambda x: chi2_cdf(x, df), p, max(1.0, df))


# -- two independent samples ----------------------------------------------------------------------


@dataclass(frozen=True)
class WelchInterval:
    """The confidence interval of mean(a) - mean(b) by Welch's t (unequal variances)."""

    difference: float
    low: float
    high: float
    se: float  # sqrt(s_a^2 / n_a + s_b^2 / n_b)
    df: float  # Welch-Satterthwaite
    t: float  # the t quantile used
    confidence: float


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """The Welch-Satterthwaite degrees of freedom of two sample variances. Both zero (0 / 0): the pooled
    n_a + n_b - 2, which then scales a zero standard error anyway."""
    va, vb = var_a / n_a, var_b / n_b
    denominator = va * va / (n_a - 1) + vb * vb / (n_b - 1)
    return (va + vb) ** 2 / denominator if denominator > 0 else float(n_a + n_b - 2)


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> WelchInterval:
    """mean(a) - mean(b) with its two-sided ``confidence`` interval (Welch's t); two values each at least."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's interval needs 2 values a sample at least, got {len(a)} and {len(b)}")
    var_a, var_b = sd(a) ** 2, sd(b) ** 2  # type: ignore[operator]  # two values each: not None
    se = math.sqrt(var_a / len(a) + var_b / len(b))
    df = welch_df(var_a, len(a), var_b, len(b))
    t = t_quantile(0.5 + confidence / 2.0, df)
    difference = mean(a) - mean(b)
    return WelchInterval(difference, difference - t * se, difference + t * se, se, df, t, confidence)


@dataclass(frozen=True)
class PermutationTest:
    """A two-sided permutation test of mean(a) - mean(b): how often a relabeling of the pooled values
    gives a difference at least as far from 0 as the observed one."""

    p_value: float
    exact: bool  # every relabeling enumerated; else ``relabelings`` seeded random ones
    relabelings: int


# Relabelings enumerated at most; beyond, a seeded Monte Carlo of as many draws.
PERMUTATION_DRAWS = 20000


def permutation_test(
    a: Sequence[float], b: Sequence[float], *, draws: int = PERMUTATION_DRAWS, seed: int = 0
) -> PermutationTest:
    """Exact when the C(n_a + n_b, n_a) ways to split the pooled values are at most ``draws``: p is the
    share of them (the observed one included) whose |difference of means| reaches the observed one.
    Otherwise ``draws`` random splits (``seed``): p = (1 + hits) / (1 + draws), which never says 0."""

    pooled = [*a, *b]
    n_a, total = len(a), sum(pooled)
    n_b = len(pooled) - n_a
    if n_a == 0 or n_b == 0:
        raise ValueError("a permutation test needs values in both samples")

    def distance(sum_a: float) -> float:
        return abs(sum_a / n_a - (total - sum_a) / n_b)

    # A relabeling whose difference ties the observed one counts: the tolerance keeps float sums in
    # another order from missing it.
    observed = distance(sum(a)) * (1.0 - 1e-12) - 1e-12
    if math.comb(len(pooled), n_a) <= draws:
        splits = list(itertools.combinations(pooled, n_a))
        hits = sum(distance(sum(split)) >= observed for split in splits)
        return PermutationTest(hits / len(splits), True, len(splits))
    rng = random.Random(seed)
    hits = sum(distance(sum(rng.sample(pooled, n_a))) >= observed for _ in range(draws))
    return PermutationTest((1 + hits) / (1 + draws), False, draws)


def seeds_for_half_width(sd_a: float, sd_b: float, half_width: float, confidence: float = 0.95,
                         limit: int = 10000, *, strict: bool = False) -> int | None:  # fmt: skip
    """The least n (>= 2) seeds per arm at which Welch's ``confidence`` interval of the difference, at
    these standard deviations, is no wider than ± ``half_width``: t(df_n) * sqrt((sd_a^2 + sd_b^2) / n)
    <= half_width, with df_n Welch's for n a side. ``strict``: narrower than it (< half_width), for a
    bound the interval must stay inside of, such as a verdict's edge, which an interval reaching it
    does not clear. None: more than ``limit``."""

    var = sd_a * sd_a + sd_b * sd_b
    # t > z at every df, so no n below the normal approximation's z^2 * var / half_width^2 will do: the
    # search starts there and takes a few steps rather than thousands of t quantiles.
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    start = max(2, math.floor(z * z * var / half_width**2)) if half_width > 0 else limit + 1
    for n in range(start, limit + 1):
        df = welch_df(sd_a * sd_a, n, sd_b * sd_b, n)
        width = t_quantile(0.5 + confidence / 2.0, df) * math.sqrt(var / n)
        if width < half_width or (width == half_width and not strict):
            return n
    return None


def seeds_with_assurance(
    sd_a: float, n_a: int, sd_b: float, n_b: int, half_width: float, confidence: float = 0.95,
    assurance: float = 0.8, limit: int = 10000,
) -> int | None:  # fmt: skip
    """:func:`seeds_for_half_width` with the scatter's own uncertainty allowed for: the standard
    deviations are estimates from ``n_a`` and ``n_b`` seeds, so sd_a^2 + sd_b^2 is taken at its one-sided
    ``assurance`` upper confidence bound (chi-square, with Satterthwaite's df of the sum) before the
    seeds are counted. Planned so, the interval comes out no wider than ± ``half_width`` with about that
    probability, where the plain estimate does about half the time. Needs n_a, n_b >= 2."""
    var_a, var_b = sd_a * sd_a, sd_b * sd_b
    if var_a + var_b == 0.0:
        return seeds_for_half_width(sd_a, sd_b, half_width, confidence, limit)
    df = (var_a + var_b) ** 2 / (var_a * var_a / (n_a - 1) + var_b * var_b / (n_b - 1))
    scale = math.sqrt(df / chi2_quantile(1.0 - assurance, df))
    return seeds_for_half_width(sd_a * scale, sd_b * scale, half_width, confidence, limit)


# -- one sample's mean, and paired ratios of means ------------------------------------------------


@dataclass(frozen=True)
class MeanInterval:
    """The mean of one sample with its two-sided ``confidence`` interval (Student's t, n - 1 df)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> MeanInterval:
    """mean(values) ± t(n - 1) * sd / sqrt(n); two values at least."""
    if len(values) < 2:
        raise ValueError(f"a mean's interval needs 2 values at least, got {len(values)}")
    m = mean(values)
    half = t_quantile(0.5 + confidence / 2.0, len(values) - 1) * sd(values) / math.sqrt(len(values))  # type: ignore[operator]
    return MeanInterval(m, m - half, m + half, len(values), confidence)


# Resamples of the paired bootstrap of a ratio of means (the percentile interval's ends move by about a
# thousandth of the ratio between seeds at 2000).
RATIO_RESAMPLES = 2000


@dataclass(frozen=True)
class RatioInterval:
    """mean(numerator) / mean(denominator) of paired values, with a seeded percentile bootstrap
    interval over the pairs (each resample draws n pairs with replacement, both values together)."""

    ratio: float
    low: float
    high: float
    n: int
    resamples: int
    seed: int
    confidence: float


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated between ranks."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def paired_ratio_interval(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    resamples: int = RATIO_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> RatioInterval:
    """The ratio of two paired samples' means and its bootstrap interval (deterministic for a ``seed``).
    Pairing keeps what both share (one sequence easy for every backend) out of the interval's width.
    Resamples whose denominator sums to 0 are left out; ValueError when the denominator's mean is 0 or
    there are fewer than 2 pairs."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples of {len(numerator)} and {len(denominator)} values")
    n = len(numerator)
    if n < 2:
        raise ValueError(f"a ratio's interval needs 2 pairs at least, got {n}")
    if sum(denominator) == 0:
        raise ValueError("the denominator's mean is 0: the ratio is undefined")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        below = sum(denominator[i] for i in picks)
        if below != 0:
            ratios.append(sum(numerator[i] for i in picks) / below)
    ratios.sort()
    alpha = (1.0 - confidence) / 2.0
    ratio = sum(numerator) / sum(denominator)
    return RatioInterval(
        ratio, _percentile(ratios, alpha), _percentile(ratios, 1.0 - alpha), n, resamples, seed, confidence
    )


NEEDED_CAP = 100_000  # sequences: beyond it an unresolved verdict says only "more than" (a ratio just off
# the bound would otherwise ask for an astronomical count)


@dataclass(frozen=True)
class RatioVerdict:
    """A ratio's interval against 1 + ``margin``: ``within`` (its upper end at or below), ``outside`` (its
    lower end above) or ``unresolved`` (it straddles the bound), with the pairs that would resolve it
    (``needed``: the interval's side facing the bound shrunk as 1/sqrt(n) until it stops at the bound;
    None when the ratio sits on the bound; :data:`NEEDED_CAP` + 1 stands for "more than the cap", a
    ratio just off the bound asking for an astronomical count)."""

    verdict: str  # "within" | "outside" | "unresolved"
    bound: float  # 1 + margin
    n: int  # the pairs the interval is over
    needed: int | None = None

    @property
    def text(self) -> str:
        """``within``, ``outside`` or ``unresolved at N sequences; about M would resolve it``."""
        if self.verdict != "unresolved":
            return self.verdict
        if self.needed is None:
            return f"unresolved at {self.n} sequences (the ratio sits on the bound)"
        if self.needed > NEEDED_CAP:
            return f"unresolved at {self.n} sequences; more than {NEEDED_CAP} would resolve it"
        return f"unresolved at {self.n} sequences; about {self.needed} would resolve it"


def ratio_verdict(interval: RatioInterval, margin: float) -> RatioVerdict:
    """The verdict on "the ratio is within 1 + ``margin``" from its interval."""
    bound = 1.0 + margin
    if interval.high <= bound:
        return RatioVerdict("within", bound, interval.n)
    if interval.low > bound:
        return RatioVerdict("outside", bound, interval.n)
    distance = abs(interval.ratio - bound)
    side = interval.high - interval.ratio if interval.ratio <= bound else interval.ratio - interval.low
    if distance == 0.0:
        return RatioVerdict("unresolved", bound, interval.n)
    needed = min(max(interval.n + 1, math.ceil(interval.n * (side / distance) ** 2)), NEEDED_CAP + 1)
    return RatioVerdict("unresolved", bound, interval.n, needed)
