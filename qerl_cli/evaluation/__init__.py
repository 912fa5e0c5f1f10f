"""``qerl eval``: Pass@1 (with standard errors) on GSM8K, MATH500, AIME24/25, AMC23."""

from qerl_cli.evaluation.metrics import benchmark_metrics, paired_difference, pass_at_k
from qerl_cli.evaluation.report import eval_table, results_markdown
from qerl_cli.evaluation.results import (
    BaselineComparison,
    BenchmarkMetrics,
    BenchmarkScore,
    EvalResult,
    GenerationTiming,
    PairedDifference,
    read_results,
)
from qerl_cli.evaluation.run import compare_with_baseline, rescore, run_eval

__all__ = [
    "BaselineComparison",
    "BenchmarkMetrics",
    "BenchmarkScore",
    "EvalResult",
    "GenerationTiming",
    "PairedDifference",
    "benchmark_metrics",
    "compare_with_baseline",
    "eval_table",
    "paired_difference",
    "pass_at_k",
    "read_results",
    "rescore",
    "results_markdown",
    "run_eval",
]
