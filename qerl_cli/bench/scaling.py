"""``qerl bench scaling``: GRPO step time and rollout tokens/s per GPU of data-parallel training, and
the scaling efficiency against a run on fewer GPUs (``scaling.json``).

One invocation measures one world size, as ``qerl train`` runs: plain for one process, under torchrun
for N (``torchrun --nproc-per-node N -m qerl_cli bench scaling RECIPE --reference ONE/scaling.json``).
It trains ``steps`` steps of the recipe, then rank 0 summarises ``metrics.jsonl``.
Step 1 is left out of the means (CUDA graphs, autotuning, vLLM's first sleep), unless it is the only
one. Throughput is generated rollout tokens (summed over ranks) per second of whole steps, so runs
that generate different amounts (weak scaling; completions ending at EOS) compare fairly.

``synthetic``: the recipe's data and reward are replaced by ``qerl bench e2e``'s job (synthetic
prompts padded to about ``rollout.max_prompt_length`` tokens, seeded random rewards), for random-weight
checkpoints (``--model SHAPE``): grading their text measures nothing, and every completion of random
weights runs to the length limit, so ``algorithm.mask_truncated`` is turned off (masking them all
would leave no token to learn from). Each rank draws its own rewards (the seed and the rank).

The last step is checkpointed (after its timing, ``output.save_steps`` set to ``steps``) so a run can
go on, also on another number of GPUs: ``qerl train RUN/config.yaml --resume RUN --set
train.max_steps=MORE``. The resolved ``config.yaml`` holds the synthetic data but not the random
rewards, which are the benchmark's own: a resumed run grades with the recipe's reward.

Weak scaling (``prompts_per_gpu``): ``train.prompts_per_step`` is that many per process, so the global
batch grows with the GPUs (a tensor-parallel process spans ``rollout.tensor_parallel_size`` GPUs and
still takes that many: its report says ``tensor-parallel``, not ``weak``); strong scaling (without
it): the recipe's global batch on every count.
Efficiency of N GPUs against a reference run on M: ``(tokens/s_N / N) / (tokens/s_M / M)`` (1.0:
linear); with equal tokens per step (strong scaling, M = 1) that is ``step_s_1 / (N x step_s_N)``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from qerl_cli import files
from qerl_cli.bench.e2e import E2E_DATASET, PROMPT_SLACK, RandomReward, filler_system_prompt, folder_tokenizer
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.models import is_shape, shape_checkpoint, shape_checkpoint_path
from qerl_cli.bench.progress import Progress
from qerl_cli.config import DataSection, TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.files import is_complete_folder
from qerl_cli.modeling.run_layout import METRICS_FILE
from qerl_cli.rl.stream import derive_seed
from qerl_cli.rl.tracking import read_metrics, step_other_s
from qerl_cli.rl.trainer import train

SCHEMA = "qerl-bench-scaling/1"
REPORT_NAME = "scaling.json"
RUN_DIR = "run"  # the training run's folder inside the output folder

log = logging.getLogger(__name__)


def run_summary(records: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    """Means over the timed steps of one run's metrics rows."""
    if not records:
        return {"gpus": gpus, "steps": 0}
    timed = records[1:] or records

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in timed)

    def mean_if_logged(key: str) -> float | None:  # None for runs that predate the metric
        return mean(key) if any(key in r for r in timed) else None

    step_s, rollout_s, tokens = mean("time_step_s"), mean("time_rollout_s"), mean("rollout_tokens")
    # Runs that time every part of a step (rl.tracking.STEP_PARTS): the means of the parts and of the
    # rest add up to step_s. Older runs logged the engine's own sync seconds only, and no sleep or wake.
    parts = all("time_sync_s" in r for r in timed)
    return {
        "gpus": gpus,
        "steps": len(records),
        "steps_timed": len(timed),
        "world_size": records[-1].get("world_size"),
        "step_s": step_s,
        "rollout_s": rollout_s,
        "update_s": mean("time_update_s"),
        "reward_s": mean_if_logged("time_reward_s"),
        "logprobs_s": mean_if_logged("time_logprobs_s"),
        "aqn_s": mean_if_logged("time_aqn_s"),  # its once-a-stage probe included
        "sleep_s": mean("time_sleep_s") if parts else None,
        "wake_s": mean("time_wake_s") if parts else None,
        # the adapter sync and its staleness probe
        "sync_s": mean("time_sync_s") if parts else mean_if_logged("rollout/sync_seconds"),
        "other_s": statistics.mean(step_other_s(r) or 0.0 for r in timed) if parts else None,
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
    cfg: TrainConfig,
    out_dir: Path,
    steps: int,
    prompts_per_gpu: int | None,
    world: int,
    *,
    synthetic: bool = False,
) -> TrainConfig:
    cfg.train.max_steps = steps
    cfg.output.dir = str(out_dir / RUN_DIR)
    # One checkpoint, after the last step's timing (its own time_checkpoint_s): the run can be resumed.
    cfg.output.save_steps = steps
    if prompts_per_gpu:
        cfg.train.prompts_per_step = prompts_per_gpu * world
    if synthetic:
        synthetic_job(cfg)
    return cfg


def synthetic_job(cfg: TrainConfig) -> None:
    """``qerl bench e2e``'s prompts in place of the recipe's data (the reward: :func:`run_scaling`)."""

    prompt_len = cfg.rollout.max_prompt_length
    filler = filler_system_prompt(prompt_len, folder_tokenizer(cfg.model.path))
    cfg.data = DataSection(dataset=E2E_DATASET, shuffle=False, template="plain", system_prompt=filler)
    cfg.rollout.max_prompt_length = prompt_len + PROMPT_SLACK
    cfg.algorithm.mask_truncated = False


def model_folder(
    model: str, fmt: str | None, *, write: bool, synthetic: bool = True, wait_s: float = 1800.0
) -> Path:
    """``--model``: a folder as given, or the random-weight checkpoint of a shape in ``fmt`` (NVFP4 by
    default).

    Under torchrun only local rank 0 writes a shape's checkpoint; the other ranks wait for it (a
    7B is a minute's work on a GPU, which four ranks would otherwise each do). ``write=False`` (a dry
    run) only names the folder.
    """

    if not is_shape(model):
        if fmt is not None:
            raise QerlError(f"--format {fmt} applies to a --model SHAPE; {model} has its own format")
        return Path(model).expanduser()
    fmt = (fmt or "nvfp4").lower()
    if not synthetic:
        log.warning(
            "--model %s has random weights and the recipe's data and grader: rewards stay near 0 and most "
            "completions run to the length limit (masked with algorithm.mask_truncated). Add --synthetic "
            "for bench e2e's prompts and random rewards",
            model,
        )
    if not write:
        return shape_checkpoint_path(model, fmt)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        return shape_checkpoint(model, fmt)
    target = shape_checkpoint_path(model, fmt)
    deadline = time.monotonic() + wait_s
    while not is_complete_folder(target):
        if time.monotonic() > deadline:
            raise QerlError(
                f"local rank 0 did not write {target} within {wait_s:.0f} s; see its log, or write the "
                "checkpoint first with a one-process run of the same --model"
            )
        time.sleep(2.0)
    return target


def gpus_in_use(world_size: int, tensor_parallel_size: int) -> int:
    """One GPU per process, times the rollout's tensor-parallel ranks (they share the first)."""
    return world_size * tensor_parallel_size


def scaling_kind(prompts_per_gpu: int | None, tensor_parallel_size: int) -> str:
    if tensor_parallel_size > 1:
        return "tensor-parallel"
    return "weak" if prompts_per_gpu else "strong"


def run_scaling(
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    command: str,
    steps: int,
    prompts_per_gpu: int | None = None,
    reference: str | None = None,
    synthetic: bool = False,
) -> dict[str, Any]:
    """Train the :func:`scaled_config` ``cfg`` on this world (every rank runs this), summarise; rank 0
    writes ``scaling.json``. Every rank returns the same report."""

    out = Path(out_dir)
    ref = read_reference(reference) if reference else None  # a bad file fails before any training
    rank = int(os.environ.get("RANK", "0"))
    reward = RandomReward(derive_seed(cfg.train.seed, "bench-reward", rank)) if synthetic else None
    progress = Progress("bench scaling", steps)
    # Begun before the first step, as every benchmark's report: the host load's start is the run's.
    header = report_header(SCHEMA, command)
    host = header["host_load"]

    def on_step(step: int, record: dict[str, Any]) -> None:  # one line a step (rank 0), for the logs
        if rank == 0:
            # After every step, as the others after every case: a load that came and went mid-run is
            # the peak that makes the run busy (write_report takes the end).
            host.sample()
            progress.finish(f"step {step}", seconds=float(record.get("time_step_s", 0.0)))

    result = train(cfg, progress=False, reward_fn=reward, on_step=on_step)
    tp = cfg.rollout.tensor_parallel_size
    run = run_summary(read_metrics(out / RUN_DIR / METRICS_FILE), gpus_in_use(result.world_size, tp))
    report: dict[str, Any] = {
        **header,
        "world_size": result.world_size,
        "scaling": scaling_kind(prompts_per_gpu, tp),
        "settings": {
            "model": cfg.model.path,
            "job": "synthetic prompts, random rewards" if synthetic else "the recipe's data and reward",
            "tensor_parallel_size": tp,
            "linear_backend": result.linear_backend,  # what the engine ran (auto resolved)
            "linear_backend_requested": cfg.rollout.linear_backend,
            "engine": cfg.rollout.engine,
            "steps": steps,
            "prompts_per_step": cfg.train.prompts_per_step,
            "prompts_per_gpu": prompts_per_gpu,
            "generations": cfg.rollout.num_generations,
            "max_prompt_length": cfg.rollout.max_prompt_length,
            "max_completion_length": cfg.rollout.max_completion_length,
        },
        "run": run,
        "reference": None if ref is None else {"path": str(reference), **ref},
        "scaling_efficiency": None if ref is None else scaling_efficiency(ref, run),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(out / REPORT_NAME, report)
    return report


# The table's two rows of a step's parts (run_summary's names): with "other_s" they add up to step_s.
ROLLOUT_UPDATE_PARTS = ("rollout_s", "reward_s", "logprobs_s", "update_s")
ENGINE_PARTS = ("aqn_s", "sleep_s", "wake_s", "sync_s", "other_s")


def _seconds(run: dict[str, Any], keys: tuple[str, ...]) -> str:
    return " / ".join("-" if run.get(k) is None else f"{run[k]:.1f}" for k in keys)


def scaling_table(report: dict[str, Any]):  # -> rich.table.Table
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
        ("rollout / reward / logprobs / update s", _seconds(run, ROLLOUT_UPDATE_PARTS)),
        ("AQN / sleep / wake / sync / other s", _seconds(run, ENGINE_PARTS)),
        ("GPUs", run.get("gpus")),
        ("rollout tokens/s per GPU", run.get("rollout_tokens_per_s_per_gpu")),
        ("step tokens/s per GPU", run.get("step_tokens_per_s_per_gpu")),
        ("scaling efficiency", "-" if efficiency is None else f"{efficiency:.1%}"),
    ]
    for label, value in rows:
        table.add_row(
            label, f"{value:.3f}" if isinstance(value, float) else str(value if value is not None else "-")
        )
    return table
