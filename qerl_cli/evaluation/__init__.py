"""``qerl eval``: Pass@1 (with standard errors) on GSM8K, MATH500, AIME24/25, AMC23."""

from qerl_cli.evaluation.metrics import benchmark_metrics, paired_difference, pass_at_k
from qerl_cli.evaluation.report import eval_table, results_markdown
from qerl_cli.evaluation.run import compare_with_baseline, rescore, run_eval

__all__ = [
    "benchmark_metrics",
    "compare_with_baseline",
    "eval_table",
    "paired_difference",
    "pass_at_k",
    "rescore",
    "results_markdown",
    "run_eval",
]
