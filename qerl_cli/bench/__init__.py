"""``qerl bench``: what each benchmark measures, one module each.

* ``rollout``, ``concurrency`` and ``e2e`` (rollout tokens/s and memory per weight format, the same per
  linear backend at RL concurrency, GRPO step time per format and linear backend) share one report,
  ``bench.json``: :func:`run_bench` measures, writes the outputs and returns it (a
  :class:`~qerl_cli.bench.result.BenchResult`),
  :func:`bench_table` renders it, :func:`gate_failures` lists what the ``--baseline`` gate found (the
  CLI exits 1 when it is not empty);
* ``kernels`` (:mod:`~qerl_cli.bench.kernels`), ``update`` (:mod:`~qerl_cli.bench.update`),
  ``scaling`` (:mod:`~qerl_cli.bench.scaling`), ``quality`` (:mod:`~qerl_cli.bench.quality`) and
  ``lora-tune`` (:mod:`~qerl_cli.bench.lora_tune`, its GPU side :mod:`~qerl_cli.bench.lora_tune_gpu`)
  each write their own JSON, which begins with :func:`~qerl_cli.bench.header.report_header`.

The package imports its modules when they are used (``qerl_cli.bench.run_bench`` imports the rollout
machinery then), so :mod:`~qerl_cli.bench.settings`, which the CLI reads at start-up, comes without
torch.
"""

from __future__ import annotations

from qerl_cli.lazy import lazy_attributes

__all__ = ["BenchResult", "bench_table", "failed_cases", "gate_failures", "run_bench", "wall_clock_line"]
_HOMES = {
    "BenchResult": "qerl_cli.bench.result",
    "bench_table": "qerl_cli.bench.report",
    "failed_cases": "qerl_cli.bench.report",
    "gate_failures": "qerl_cli.bench.gate",
    "run_bench": "qerl_cli.bench.run",
    "wall_clock_line": "qerl_cli.bench.report",
}


__getattr__ = lazy_attributes(__name__, _HOMES)
