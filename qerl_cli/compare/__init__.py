"""`qerl compare`: the paper's ablation in one command (arms x seeds of one recipe, one table, one plot).

>>> result = run_compare("recipes/smollm2_wordproblems.yaml", ["bf16-lora", "nvfp4-aqn"], seeds=3)
"""

from __future__ import annotations

from qerl_cli.compare.results import CompareReport, CompareResult
from qerl_cli.compare.runner import run_compare
from qerl_cli.compare.summary import compare_table

__all__ = ["CompareReport", "CompareResult", "compare_table", "run_compare"]
