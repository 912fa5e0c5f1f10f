"""`qerl compare`: the paper's ablation in one command (arms x seeds of one recipe, one table, one plot).

>>> result = run_compare("recipes/smollm2_wordproblems.yaml", ["bf16-lora", "nvfp4-aqn"], seeds=3)

The package imports its modules when they are used (``qerl_cli.compare.run_compare`` imports the
trainer then), so :mod:`~qerl_cli.compare.settings` is read without torch: the CLI's options take their
help from it at start-up.
"""

from __future__ import annotations

from qerl_cli.lazy import lazy_attributes

__all__ = ["STOP_HINT", "CompareReport", "CompareResult", "check_compare", "compare_table", "run_compare"]
_HOMES = {
    "STOP_HINT": "qerl_cli.compare.runs",
    "CompareReport": "qerl_cli.compare.results",
    "CompareResult": "qerl_cli.compare.results",
    "check_compare": "qerl_cli.compare.runner",
    "compare_table": "qerl_cli.compare.summary",
    "run_compare": "qerl_cli.compare.runner",
}


__getattr__ = lazy_attributes(__name__, _HOMES)
