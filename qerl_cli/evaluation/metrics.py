"""Benchmark statistics: Pass@1 with its standard error, unbiased pass@k, paired differences.

Pass@1 is the mean over problems of c_i / n_i (c correct out of n samples). Its standard error is
the sample standard deviation of the per-problem rates over sqrt(#problems): the problems are the
random draw that matters when comparing models, and this is the estimate to quote beside the mean
(it also includes the sampling noise of each c_i / n_i).

pass@k uses the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k), averaged over
problems, for every k <= n.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from qerl_cli.evaluation.results import BenchmarkMetrics, PairedDifference

Z_95 = 1.959963984540054


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct of ``n`` samples (k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): the product form avoids huge binomials
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if n >= 1 and ks[-1] != n:
        ks.append(n)
    return ks


def mean_and_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None with fewer than two values)."""
    m = len(values)
    if m == 0:
        return 0.0, None
    mean = sum(values) / m
    if m < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(variance / m)


def benchmark_metrics(records: Sequence[Mapping[str, Any]]) -> BenchmarkMetrics:
    """Metrics of one benchmark from its per-problem sample records.

    Each record holds per-sample lists ``correct``, ``finish_reasons``, ``num_tokens``,
    ``extraction_failed``, ``timed_out`` (the ``samples_<bench>.jsonl`` lines).
    """
    if not records:
        raise ValueError("no problems to score")
    counts = [(sum(bool(x) for x in r["correct"]), len(r["correct"])) for r in records]
    if any(n == 0 for _, n in counts):
        raise ValueError("a problem has no samples")
    rates = [c / n for c, n in counts]
    pass1, pass1_se = mean_and_se(rates)
    n_min = min(n for _, n in counts)
    pass_k = {str(k): sum(pass_at_k(n, c, k) for c, n in counts) / len(counts) for k in default_ks(n_min)}

    def flat(key: str) -> list[Any]:
        return [x for r in records for x in r[key]]

    samples = sum(n for _, n in counts)
    lengths = flat("num_tokens")
    timeouts = sum(bool(x) for x in flat("timed_out"))
    return BenchmarkMetrics(
        num_problems=len(records),
        samples_per_problem=n_min if n_min == max(n for _, n in counts) else None,
        num_samples=samples,
        pass_at_1=pass1,
        pass_at_1_se=pass1_se,
        pass_at_k=pass_k,
        truncation_rate=sum(f == "length" for f in flat("finish_reasons")) / samples,
        extraction_failure_rate=sum(bool(x) for x in flat("extraction_failed")) / samples,
        grader_timeouts=timeouts,
        grader_timeout_rate=timeouts / samples,
        mean_length=sum(lengths) / len(lengths) if lengths else 0.0,
        max_length=max(lengths) if lengths else 0,
    )


def per_problem_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, list[int]]:
    """``{problem id: [correct, samples]}``: what paired comparisons need."""
    return {str(r["id"]): [sum(bool(x) for x in r["correct"]), len(r["correct"])] for r in records}


def paired_difference(
    current: Mapping[str, Sequence[int]], baseline: Mapping[str, Sequence[int]]
) -> PairedDifference:
    """Mean per-problem difference in pass rate (current - baseline) over shared problems, with SE.

    Pairing removes the between-problem variance (both runs share each problem's difficulty), so
    the SE is usually far smaller than the two Pass@1 SEs combined.
    """
    shared = sorted(set(current) & set(baseline))
    diffs = [current[i][0] / current[i][1] - baseline[i][0] / baseline[i][1] for i in shared]
    mean, se = mean_and_se(diffs)
    low, high = (mean - Z_95 * se, mean + Z_95 * se) if se is not None else (None, None)
    return PairedDifference(
        num_paired=len(shared),
        only_current=len(set(current) - set(baseline)),
        only_baseline=len(set(baseline) - set(current)),
        diff=mean if shared else None,
        diff_se=se,
        ci95=[low, high],
        current_pass_at_1=sum(current[i][0] / current[i][1] for i in shared) / len(shared)
        if shared
        else None,
        baseline_pass_at_1=sum(baseline[i][0] / baseline[i][1] for i in shared) / len(shared)
        if shared
        else None,
    )
