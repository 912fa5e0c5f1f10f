"""A run's step loop (:func:`run_steps`): train a step, checkpoint every ``output.save_steps``, log the
record and the graded completions (rank 0), warn when the first steps carry too little reward signal, report
progress; and what a run writes beside its outputs before the first step (:func:`record_run`).
:class:`~qerl_cli.rl.trainer.Trainer` does the steps themselves."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from qerl_cli.config import RESOLVED_CONFIG_NAME, TrainConfig, save_resolved_config, to_dict
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import quantized_with
from qerl_cli.modeling.run_layout import PROMPTS_FILE
from qerl_cli.rl import checkpoint as ckpt
from qerl_cli.rl import setup
from qerl_cli.rl.aqn_calibration import raw_sigma_warning
from qerl_cli.rl.aqn_schedule import AQNSchedule
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.losses import NonFiniteLossError
from qerl_cli.rl.policy import Policy
from qerl_cli.rl.signal import StartSignal
from qerl_cli.rl.tracking import MetricsLogger, progress_bar

log = logging.getLogger(__name__)
StepCallback = Callable[[int, dict[str, Any]], None]  # (step, its record), after each step


class SteppingTrainer(Protocol):
    """What the loop reads of :class:`~qerl_cli.rl.trainer.Trainer` (which drives it: a Protocol rather
    than an import keeps the two modules from importing each other)."""

    cfg: TrainConfig
    out_dir: Path
    step: int
    dist: Distributed
    policy: Policy
    params: list[Any]
    tis_on: bool
    schedule: AQNSchedule | None
    problems: list[Problem]
    prompts: dict[str, str]
    last_samples: list[dict[str, Any]]
    nonfinite_streak: int

    def train_step(self) -> dict[str, Any]: ...

    def save(self) -> Path: ...


def record_run(trainer: SteppingTrainer, resumed_from: Path | None) -> None:
    """The run's settings and prompt template beside its outputs (rank 0)."""
    cfg, out_dir = trainer.cfg, trainer.out_dir
    if resumed_from is not None:
        setup.warn_on_config_change(cfg, resumed_from.parent / RESOLVED_CONFIG_NAME)
    save_resolved_config(cfg, out_dir)
    example = trainer.prompts[trainer.problems[0].id]
    setup.record_prompts(cfg, trainer.policy.tokenizer, example, out_dir / PROMPTS_FILE)
    log.info(
        "policy: %s base, %d trainable tensors, TIS %s, AQN %s, %d process(es)",
        trainer.policy.base_format,
        len(trainer.params),
        "on" if trainer.tis_on else "off",
        trainer.schedule.stage_sigmas() if trainer.schedule else "off",
        trainer.dist.world_size,
    )


def run_steps(
    trainer: SteppingTrainer, *, resume_step: int | None, on_step: StepCallback | None, progress: bool
) -> None:
    """The step loop: train, checkpoint every ``save_steps``, log (rank 0), report."""
    cfg, out_dir = trainer.cfg, trainer.out_dir
    metrics = (
        MetricsLogger(
            out_dir,
            resume_step=resume_step,
            tensorboard=cfg.output.tensorboard,
            wandb=cfg.output.wandb,
            wandb_project=cfg.output.wandb_project,
            run_config=to_dict(cfg),
        )
        if trainer.dist.is_main
        else None
    )
    signal = start_signal(trainer) if resume_step is None else None  # a resumed run warned already
    if resume_step is None and (warning := raw_sigma_warning(cfg, quantized_with(cfg.model.path))):
        log.warning("%s", warning)
    try:
        with progress_bar(progress, cfg.train.max_steps, trainer.step) as bar:
            while trainer.step < cfg.train.max_steps:
                try:
                    record = trainer.train_step()
                except NonFiniteLossError as exc:
                    raise QerlError(diverged_message(trainer, str(exc))) from exc
                if cfg.output.save_steps > 0 and trainer.step % cfg.output.save_steps == 0:
                    t0 = time.perf_counter()
                    trainer.save()
                    record["time_checkpoint_s"] = time.perf_counter() - t0
                if metrics is not None:
                    metrics.log(record)
                    metrics.log_completions(trainer.step, trainer.last_samples)
                    warning = signal.observe(record) if signal is not None else None
                    if warning:
                        log.warning("%s", warning)
                bar(record)
                if on_step is not None:
                    on_step(trainer.step, record)
    finally:
        if metrics is not None:
            metrics.close()


def diverged_message(trainer: SteppingTrainer, why: str) -> str:
    """What a run stopped by non-finite steps says: which checkpoint to go back to. The skipped steps took
    no update, so after several in a row (other batches, the same weights) a checkpoint written at or after
    the step before the first of them holds the weights that diverged: only an earlier one is named good."""
    streak = trainer.nonfinite_streak
    step = trainer.step + 1
    in_a_row = f" ({streak} steps in a row, train.max_nonfinite_steps={streak - 1})" if streak > 1 else ""
    newest = ckpt.newest_good_checkpoint(trainer.out_dir)
    first = step - streak + 1  # the first non-finite step of this run of them
    good = ckpt.newest_good_checkpoint(trainer.out_dir, before=first - 1) if streak > 1 else newest
    held = ""
    if newest is not None and newest != good:
        since = "every checkpoint" if first <= 1 else f"the checkpoints from step {first - 1} on"
        held = (
            f"{since} (newest {newest}) hold the weights that gave these "
            f"{streak} steps (a skipped step takes no update), so resumed they would diverge again; "
        )
    before = f"the last good checkpoint is {good}. " if good else ""
    if held and good is None:
        before = "no checkpoint comes before them: start over (--overwrite). "
    return (
        f"training diverged at step {step}: {why}{in_a_row}. Nothing was saved for this step; {held}{before}"
        "Lower train.learning_rate or train.max_grad_norm, or check the data."
    )


def start_signal(trainer: SteppingTrainer) -> StartSignal:
    """The first steps' reward-spread check, told what this run's base and LoRA start already are."""
    cfg = trainer.cfg
    return StartSignal(
        cfg.train.max_steps,
        quantized=trainer.policy.is_quantized,
        gptq=quantized_with(cfg.model.path) == "gptq",
        error_start=cfg.lora.init != "zeros",
        num_generations=cfg.rollout.num_generations,
    )
