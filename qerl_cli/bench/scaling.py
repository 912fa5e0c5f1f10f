"""``qerl bench scaling``: GRPO step time and rollout tokens/s per GPU of data-parallel training, and
the scaling efficiency against a run on fewer GPUs (``scaling.json``).

One invocation measures one world size, as ``qerl train`` runs: plain for one process, under torchrun
for N (``torchrun --nproc-per-node N -m qerl_cli bench scaling RECIPE --reference ONE/scaling.json``).
It trains ``steps`` steps of the recipe (no checkpoints), then rank 0 summarises ``metrics.jsonl``.
Step 1 is left out of the means (CUDA graphs, autotuning, vLLM's first sleep), unless it is the only
one. Throughput is generated rollout tokens (summed over ranks) per second of whole steps, so runs
that generate different amounts (weak scaling; completions ending at EOS) compare fairly.

Weak scaling (``prompts_per_gpu``): ``train.prompts_per_step`` is that many per process, so the global
batch grows with the GPUs; strong scaling (without it): the recipe's global batch on every count.
Efficiency of N GPUs against a reference run on M: ``(tokens/s_N / N) / (tokens/s_M / M)`` (1.0:
linear); with equal tokens per step (strong scaling, M = 1) that is ``step_s_1 / (N x step_s_N)``.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from qerl_cli import files
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError

SCHEMA = "qerl-bench-scaling/1"
REPORT_NAME = "scaling.json"
RUN_DIR = "run"  # the training run's folder inside the output folder


def run_summary(records: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    """Means over the timed steps of one run's metrics rows."""
    if not records:
        return {"gpus": gpus, "steps": 0}
    timed = records[1:] or records

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in timed)

    step_s, rollout_s, tokens = mean("time_step_s"), mean("time_rollout_s"), mean("rollout_tokens")
    return {
        "gpus": gpus,
        "steps": len(records),
        "steps_timed": len(timed),
        "world_size": records[-1].get("world_size"),
        "step_s": step_s,
        "rollout_s": rollout_s,
        "update_s": mean("time_update_s"),
        "rollout_tokens_per_step": tokens,
        "rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
        "rollout_tokens_per_s_per_gpu": tokens / max(rollout_s, 1e-9) / gpus,
        "step_tokens_per_s": tokens / max(step_s, 1e-9),
        "step_tokens_per_s_per_gpu": tokens / max(step_s, 1e-9) / gpus,
        "device_peak_used_gib": max(float(r.get("memory/device_peak_used_gib", 0.0)) for r in records),
    }


def scaling_efficiency(reference: dict[str, Any], run: dict[str, Any]) -> float | None:
    """Tokens/s per GPU of ``run`` over the ``reference`` run's (1.0: linear); None when either has no
    timed step."""
    if not reference.get("step_tokens_per_s") or not run.get("step_tokens_per_s"):
        return None
    return (run["step_tokens_per_s"] / run["gpus"]) / (reference["step_tokens_per_s"] / reference["gpus"])


def read_reference(path: str | Path) -> dict[str, Any]:
    """The run summary of an earlier ``scaling.json``."""
    data = files.read_json_report(path, REPORT_NAME, "the scaling.json of a `qerl bench scaling` run")
    if data.get("schema") != SCHEMA:
        raise QerlError(f"{path} is not a qerl bench scaling report (expected schema {SCHEMA!r})")
    return data["run"]


def scaled_config(
    cfg: TrainConfig, out_dir: Path, steps: int, prompts_per_gpu: int | None, world: int
) -> TrainConfig:
    cfg.train.max_steps = steps
    cfg.output.dir = str(out_dir / RUN_DIR)
    cfg.output.save_steps = 0  # checkpoints are not part of a step's time
    if prompts_per_gpu:
        cfg.train.prompts_per_step = prompts_per_gpu * world
    return cfg


def run_scaling(
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    command: str,
    steps: int,
    prompts_per_gpu: int | None = None,
    reference: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps on this world (every rank runs this), summarise; rank 0 writes
    ``scaling.json``. Every rank returns the same report."""
    from qerl_cli.rl.tracking import METRICS_FILE, read_metrics
    from qerl_cli.rl.trainer import train

    out = Path(out_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ref = read_reference(reference) if reference else None  # a bad file fails before any training
    cfg = scaled_config(cfg, out, steps, prompts_per_gpu, world)
    result = train(cfg, progress=False)
    run = run_summary(read_metrics(out / RUN_DIR / METRICS_FILE), result.world_size)
    report: dict[str, Any] = {
        **report_header(SCHEMA, command),
        "world_size": result.world_size,
        "scaling": "weak" if prompts_per_gpu else "strong",
        "settings": {
            "model": cfg.model.path,
            "engine": cfg.rollout.engine,
            "steps": steps,
            "prompts_per_step": cfg.train.prompts_per_step,
            "prompts_per_gpu": prompts_per_gpu,
            "generations": cfg.rollout.num_generations,
            "max_completion_length": cfg.rollout.max_completion_length,
        },
        "run": run,
        "reference": None if ref is None else {"path": str(reference), **ref},
        "scaling_efficiency": None if ref is None else scaling_efficiency(ref, run),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(out / REPORT_NAME, report)
    return report


def scaling_table(report: dict[str, Any]):  # -> rich.table.Table
    from rich.table import Table

    run = report["run"]
    table = Table(
        title=f"GRPO on {report['world_size']} process(es), {report['scaling']} scaling", show_header=False
    )
    table.add_column("what", style="bold")
    table.add_column("value")
    efficiency = report["scaling_efficiency"]
    rows = [
        ("device", report["device"]),
        ("steps timed", run.get("steps_timed", 0)),
        ("step s", run.get("step_s")),
        ("rollout tokens/s per process (GPU)", run.get("rollout_tokens_per_s_per_gpu")),
        ("step tokens/s per process (GPU)", run.get("step_tokens_per_s_per_gpu")),
        ("scaling efficiency", "-" if efficiency is None else f"{efficiency:.1%}"),
    ]
    for label, value in rows:
        table.add_row(
            label, f"{value:.3f}" if isinstance(value, float) else str(value if value is not None else "-")
        )
    return table
