"""Eval statistics against hand computations and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from qerl_cli.evaluation.metrics import (
    benchmark_metrics,
    default_ks,
    mean_and_se,
    paired_difference,
    pass_at_k,
    per_problem_counts,
)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of the n samples that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (6, 3, 4), (8, 1, 8), (5, 5, 2)]
)
def test_pass_at_k_matches_brute_force(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k))


def test_pass_at_1_is_the_sample_rate_and_bad_inputs_fail() -> None:
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_default_ks() -> None:
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(16) == [1, 2, 4, 8, 16]


def test_mean_and_se_by_hand() -> None:
    mean, se = mean_and_se([0.0, 0.5, 1.0])
    # sample variance = ((0.5)^2 + 0 + (0.5)^2) / 2 = 0.25; SE = sqrt(0.25 / 3)
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt(0.25 / 3))
    assert mean_and_se([0.3]) == (pytest.approx(0.3), None)


def record(pid: str, correct: list[bool], finish=None, tokens=None, failed=None, timed=None) -> dict:
    n = len(correct)
    return {
        "id": pid,
        "correct": correct,
        "finish_reasons": finish or ["stop"] * n,
        "num_tokens": tokens or [10] * n,
        "extraction_failed": failed or [False] * n,
        "timed_out": timed or [False] * n,
    }


def test_benchmark_metrics_by_hand() -> None:
    records = [
        record(
            "a",
            [True, True, False, False],
            finish=["stop", "stop", "length", "stop"],
            tokens=[10, 20, 30, 40],
        ),
        record(
            "b",
            [False, False, False, False],
            failed=[True, False, False, False],
            timed=[False, True, False, False],
        ),
        record("c", [True, True, True, True]),
    ]
    m = benchmark_metrics(records)
    rates = [0.5, 0.0, 1.0]
    assert m.pass_at_1 == pytest.approx(0.5)
    assert m.pass_at_1_se == pytest.approx(math.sqrt(sum((r - 0.5) ** 2 for r in rates) / 2 / 3))
    assert m.pass_at_k["1"] == pytest.approx(0.5)
    # pass@2: a: 1 - C(2,2)/C(4,2) = 5/6, b: 0, c: 1
    assert m.pass_at_k["2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert m.pass_at_k["4"] == pytest.approx(2 / 3)
    assert m.truncation_rate == pytest.approx(1 / 12)
    assert m.extraction_failure_rate == pytest.approx(1 / 12)
    assert m.grader_timeouts == 1
    assert m.mean_length == pytest.approx((10 + 20 + 30 + 40 + 8 * 10) / 12)
    assert m.max_length == 40
    assert m.samples_per_problem == 4 and m.num_problems == 3
    assert per_problem_counts(records) == {"a": [2, 4], "b": [0, 4], "c": [4, 4]}


def test_paired_difference_by_hand() -> None:
    current = {"a": [3, 4], "b": [1, 4], "c": [4, 4], "only_here": [0, 4]}
    baseline = {"a": [1, 4], "b": [1, 4], "c": [2, 4], "only_there": [4, 4]}
    d = paired_difference(current, baseline)
    diffs = [0.5, 0.0, 0.5]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2 / 3)
    assert d.num_paired == 3 and d.only_current == 1 and d.only_baseline == 1
    assert d.diff == pytest.approx(mean)
    assert d.diff_se == pytest.approx(se)
    assert d.ci95[0] == pytest.approx(mean - 1.959963984540054 * se)
    assert d.current_pass_at_1 - d.baseline_pass_at_1 == pytest.approx(mean)
