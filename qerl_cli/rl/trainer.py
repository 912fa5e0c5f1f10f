"""``qerl train``: GRPO / DAPO on LoRA adapters over a frozen 4-bit (or BF16) base, with AQN.

One training step (:meth:`Trainer.train_step`):

1. **rollout**: AQN sigma for this step (``aqn`` schedule) goes to the engine, which samples
   ``num_generations`` completions for each of ``prompts_per_step`` prompts with the current adapter;
2. **reward**: correctness graded in killable worker processes (a hanging answer scores 0 after
   ``grader_timeout_s``), plus format and extra rewards, plus DAPO's overlong shaping if on. With
   dynamic sampling, groups whose rewards are all equal are dropped and more prompts are rolled
   out, up to ``max_sampling_rounds`` (``rl.rollouts``);
3. **advantages**: group-relative, std-scaled or not;
4. **logprobs**: the trainer's own logprobs before the update (only needed for several updates
   per batch) and the reference's (the step-0 policy, only with a KL term);
5. **update**: ``num_iterations`` optimizer steps on the batch, micro-batched, with the clipped
   surrogate, truncated importance sampling against the engine's logprobs when the rollout
   numerics differ from the trainer's, and gradient clipping (``rl.update``).

Every random choice is a function of ``train.seed`` and the step (data order, rollout sampling,
AQN noise), or lives in an RNG whose state is checkpointed (dropout), so ``--resume`` reproduces the
uninterrupted run's next batch exactly.

Where the rest lives: the data stream in ``rl.stream``, the engine / optimizer / schedule builders
in ``rl.setup``, checkpoints in ``rl.checkpoint``, metrics and the progress bar in ``rl.tracking``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qerl_cli import rewards as reward_functions
from qerl_cli.config import TrainConfig
from qerl_cli.data.prompts import reward_settings
from qerl_cli.files import ensure_output_dir, staged_folder
from qerl_cli.modeling.adapter import load_weights
from qerl_cli.modeling.prompt_tokens import encode_prompt
from qerl_cli.modeling.run_layout import ADAPTER_DIR, METRICS_FILE
from qerl_cli.rewards.grading import require_math_verify
from qerl_cli.rl import checkpoint as ckpt
from qerl_cli.rl import rollouts as rl_rollouts
from qerl_cli.rl import setup, step_loop
from qerl_cli.rl.aqn_calibration import (
    NoiseProbe,
    SigmaSearch,
    before_rollout,
    calibrate_once,
)
from qerl_cli.rl.device_memory import PeakTracker, release_cached_memory
from qerl_cli.rl.distributed import Distributed, init_distributed
from qerl_cli.rl.losses import NonFiniteLossError
from qerl_cli.rl.policy import Policy, batched_logprobs, build_policy, make_token_batch
from qerl_cli.rl.result import TrainResult, reward_window
from qerl_cli.rl.rollouts import Rollouts
from qerl_cli.rl.run_folder import run_folder
from qerl_cli.rl.step_loop import StepCallback
from qerl_cli.rl.stream import PromptStream, derive_seed, load_training_problems, render_prompts
from qerl_cli.rl.tracking import plot_training_curves, read_metrics
from qerl_cli.rl.update import update_policy
from qerl_cli.rollout.base import NOISE_SIGMA, PERTURBED_NORMS, RolloutEngine
from qerl_cli.stats import mean, present
from qerl_cli.torch_utils import resolve_device

log = logging.getLogger(__name__)


__all__ = ["PromptStream", "Rollouts", "TrainResult", "Trainer", "derive_seed", "train"]


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        reward_fn: Any = None,
        engine: RolloutEngine | None = None,
        dist: Distributed | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist or init_distributed(cfg.train.device)
        lent = {"engine": engine is not None, "reward_fn": reward_fn is not None}
        try:
            setup.check_parallel_settings(cfg, self.dist)
            if reward_fn is None:
                require_math_verify()  # before the model loads: the grader workers need it
            self.out_dir = ensure_output_dir(cfg.output.dir, "output.dir")
            setup.seed_everything(cfg.train.seed)  # the same on every rank: the same LoRA init
            device = self.dist.device(resolve_device(cfg.train.device, "train.device"))
            self.policy: Policy = build_policy(cfg, device)
            self.device = self.policy.device
            self.params = self.policy.named_trainable_parameters()
            self.dist.broadcast_parameters(self.params)  # every rank starts from rank 0's adapter
            self.optimizer, self.scheduler = setup.make_optimizer(cfg, self.params)
            setup.materialize_optimizer_state(self.optimizer)
            # Before vLLM starts: its "auto" share is what the loaded trainer (optimizer state
            # included) leaves free.
            self.memory = setup.plan_with_base_compute(cfg, self.policy)  # the FP8 base copies counted
            self.peaks = PeakTracker()
            self.last_samples: list[dict[str, Any]] = []  # the last step's completions.jsonl records
            problems = load_training_problems(cfg)
            self.problems, self.prompts = render_prompts(cfg, problems, self.policy.tokenizer)
            self.stream = PromptStream(self.problems, cfg.train.seed, cfg.data.shuffle)
            self.engine = engine or self._make_engine()
            self.schedule = setup.make_aqn_schedule(cfg)
            # Greedy decodes that size the noise (aqn.calibrate) and measure each noisy stage's effect.
            self.aqn_probe = NoiseProbe.for_run(cfg, self.problems, self.prompts) if self.schedule else None
            self.tis_on = setup.tis_enabled(cfg, self.policy, self.engine.linear_backend)
            if reward_fn is None:
                reward_fn = reward_functions.build_reward_fn(
                    cfg.reward, **reward_settings(cfg.data)
                )  # its prompt's format
            self.reward_fn = reward_fn
            self.step = 0
            # Steps in a row skipped for a NaN/inf loss or gradient norm (train.max_nonfinite_steps).
            self.nonfinite_streak = 0
            self._seed_rank_stream()
        except BaseException:
            # A failed start leaves no vLLM engine, grader pool or process group behind (what the
            # caller lent, it closes itself).
            if not lent["reward_fn"]:
                _close_reward(reward_fn)
            if not lent["engine"] and "engine" in vars(self):
                self.engine.close()
            if "policy" in vars(self):
                self.policy.close()  # Liger's RoPE patch (modeling.fused_kernels)
            self.dist.close()
            raise

    def _seed_rank_stream(self) -> None:
        """Ranks other than 0 get their own global torch stream (dropout), still a function of the
        seed and the step; rank 0 (and a single process) keeps the checkpointed one."""
        if self.dist.rank > 0:
            torch.manual_seed(derive_seed(self.cfg.train.seed, "rank-stream", self.step, self.dist.rank))

    # ---- the rollout engine ------------------------------------------------------------------
    def _make_engine(self) -> RolloutEngine:
        engine = setup.make_engine(
            self.cfg,
            self.policy,
            gpu_memory_utilization=self.memory.gpu_memory_utilization,
            distributed=self.dist.enabled,
            world_size=self.dist.world_size,
        )
        try:
            self._sync_engine(engine)
        except BaseException:
            engine.close()  # not yet the trainer's: nobody else would close it
            raise
        return engine

    def _sync_engine(self, engine: RolloutEngine | None = None) -> None:
        """Give the engine the current adapter (nothing to do for the HF engine, which shares the
        model), then let it prove that it samples from the policy being trained."""
        engine = engine or self.engine
        engine.sync_policy(self.policy.model)
        engine.check_staleness(self._probe_ids(), self._prompt_logprobs, self._reference_logprobs)

    def _probe_ids(self, max_tokens: int = 128) -> list[int]:
        text = self.prompts[self.problems[0].id]

        return encode_prompt(text, self.policy.tokenizer)[:max_tokens]  # as the engines tokenise it

    def _prompt_logprobs(self, probe: Sequence[int], *, adapter: bool = True) -> list[float]:
        """The trainer's log p(ids[i + 1] | ids[: i + 1]) at temperature 1, no noise, adapters on (or off)."""
        ids = list(probe)
        pad = int(self.policy.tokenizer.pad_token_id)
        batch = make_token_batch([ids[:1]], [ids[1:]], [[0.0] * (len(ids) - 1)], pad)
        if adapter:
            logprobs = batched_logprobs(self.policy.model, batch, 1.0, self.device, 1)
        else:  # the bare base, not the KL reference: vLLM's side of the probe is its adapter-free model
            with self.policy.bare_base():
                logprobs = batched_logprobs(self.policy.model, batch, 1.0, self.device, 1)
        return logprobs[0].tolist()

    def _reference_logprobs(self, probe: Sequence[int]) -> list[float]:
        return self._prompt_logprobs(probe, adapter=False)

    # ---- checkpoints --------------------------------------------------------------------------
    def resume_from(self, path: str | Path) -> Path:
        found = ckpt.find_last_checkpoint(path)
        state = ckpt.load_checkpoint(
            found,
            optimizer=self.optimizer,
            param_names=[n for n, _ in self.params],
            scheduler=self.scheduler,
            load_adapter=self._load_adapter,
        )
        ckpt.check_within_max_steps(found, state.step, self.cfg.train.max_steps)
        self.step = state.step
        self.stream.position = state.data_position
        # The divergence guard counts on across the resume, as if the run had not stopped.
        self.nonfinite_streak = state.nonfinite_streak
        if self.schedule is not None and state.aqn:
            self.schedule.load_state_dict(state.aqn)
        self._seed_rank_stream()  # the checkpoint holds rank 0's RNG states
        self._sync_engine()
        log.info("resumed from %s at step %d", found, self.step)
        return found

    def _load_adapter(self, folder: Path) -> None:
        load_weights(self.policy.model, folder)

    def save(self) -> Path:
        """Rank 0 writes ``checkpoint-N`` (every rank holds the same adapter and optimizer state);
        the others wait until it is complete, and all stop if it could not be written."""
        written = self.dist.on_main(self._write_checkpoint, f"write checkpoint-{self.step}")
        return written or self.out_dir / f"checkpoint-{self.step}"

    def _write_checkpoint(self) -> Path:
        state = ckpt.TrainingState(
            step=self.step,
            data_position=self.stream.position,
            aqn=self.schedule.state_dict() if self.schedule else None,
            nonfinite_streak=self.nonfinite_streak,
        )
        return ckpt.save_checkpoint(
            self.out_dir,
            state,
            save_adapter=self.policy.save_adapter,
            optimizer=self.optimizer,
            param_names=[n for n, _ in self.params],
            scheduler=self.scheduler,
            save_total_limit=self.cfg.output.save_total_limit,
        )

    # ---- one step -----------------------------------------------------------------------------
    def calibrate_aqn(self) -> SigmaSearch | None:
        """Size AQN's sigma to the model now (``aqn.calibrate``), unless done or restored by a resume."""
        return calibrate_once(self.aqn_probe, self.schedule, self.engine, self.cfg, self.dist)

    def prepare_aqn(self) -> dict[str, float]:
        """Before a step's rollout (engine awake): calibrate sigma if the run asks for it and has not yet
        (a resumed run has its calibrated sigma from the checkpoint), and measure the noise's effect at
        the first step of a noisy stage. The step's AQN metrics."""
        return before_rollout(
            self.aqn_probe, self.schedule, self.engine, self.cfg, self.dist, self.step, self._noise_seed()
        )

    def _noise_seed(self) -> int:
        return derive_seed(self.cfg.train.seed, "aqn", self.step)

    def collect(self) -> tuple[Rollouts, Rollouts, dict[str, float]]:
        """(generated, kept for training, stats) of one step, with dynamic sampling if on."""
        return rl_rollouts.collect(
            self.cfg, self.engine, self.reward_fn, self.prompts, self.stream, self.step, self.dist
        )

    def update(self, batch: Rollouts) -> dict[str, float]:
        return update_policy(
            self.cfg,
            self.policy,
            self.optimizer,
            self.params,
            batch,
            tis_on=self.tis_on,
            micro_batch_size=self.memory.micro_batch_size,
            logprob_chunk=self.memory.logprob_chunk,
            dist=self.dist,
        )

    def skip_nonfinite(self, exc: NonFiniteLossError) -> dict[str, float]:
        """A step whose loss or gradient norm came out NaN/inf (every rank agrees: the loss check and
        the norm follow a collective): skipped, with a warning naming what was bad, unless it is one more
        in a row than ``train.max_nonfinite_steps`` allows, which re-raises ``exc`` (the run ends). A
        rare bad batch then costs one step instead of the run. The update left the gradients zeroed and
        took no optimizer step; the record's flags for it."""
        self.nonfinite_streak += 1
        limit = self.cfg.train.max_nonfinite_steps
        if self.nonfinite_streak > limit:
            raise exc
        log.warning(
            "step %d: %s; the step is skipped (no optimizer step), %d in a row of "
            "train.max_nonfinite_steps=%d",
            self.step + 1, exc, self.nonfinite_streak, limit,
        )  # fmt: skip
        return {"skipped_update": 1.0, exc.metric: 1.0}

    def train_step(self) -> dict[str, Any]:
        step_start = time.perf_counter()
        self.peaks.start_step()
        # Each part of a step is timed once (time_*_s), so that with the rest (bookkeeping) they add up to
        # time_step_s: the wake-up is usually done at the end of the previous step, before its sync.
        wake_start = time.perf_counter()
        self.engine.wake_up()
        wake_s = time.perf_counter() - wake_start
        aqn_start = time.perf_counter()
        aqn_metrics = self.prepare_aqn()  # may calibrate the schedule: read sigma after it
        sigma = self.schedule.sigma(self.step) if self.schedule is not None else 0.0
        perturbed = self.engine.set_norm_noise(sigma, self._noise_seed())
        # A noisy stage's first step probes the noise's effect (greedy generations): seconds, not ms.
        aqn_metrics["time_aqn_s"] = time.perf_counter() - aqn_start
        generated, kept, stats = self.collect()
        self.last_samples = rl_rollouts.sample_groups(generated, self.cfg.output.log_completions)
        self.peaks.sample()  # the rollout phase: vLLM awake
        sleep_start = time.perf_counter()
        self.engine.sleep()
        sleep_s = time.perf_counter() - sleep_start
        record: dict[str, Any] = {
            "step": self.step + 1,
            "lr": self.scheduler.get_last_lr()[0],
            NOISE_SIGMA: sigma,  # the engine's stats() log it under this name too: one name, one value
            # Under the engines' name as the sigma (runs before this also wrote "aqn_perturbed_norms").
            PERTURBED_NORMS: float(perturbed),
            **aqn_metrics,
            "data_position": self.stream.position,
            "world_size": self.dist.world_size,
            **stats,
        }
        if self.dist.sum([float(len(kept))])[0] == 0:  # a rank may keep nothing while others do
            log.warning(
                "step %d: no group with differing rewards after %d sampling rounds; no update",
                self.step + 1,
                self.cfg.algorithm.max_sampling_rounds,
            )
            record["skipped_update"] = 1.0
        else:
            try:
                record.update(self.update(kept))
                record["skipped_update"] = 0.0
                self.nonfinite_streak = 0
            except NonFiniteLossError as exc:
                record.update(self.skip_nonfinite(exc))
        # The schedule steps on a skipped step too (as on one without signal): the learning rate stays a
        # function of the step, like the data, the noise and a resumed run's schedule.
        self.scheduler.step()
        self.step += 1
        self.peaks.sample()  # the update phase: activations still cached
        # The adapter sync wakes vLLM (staleness probe): hand the update's cached blocks back first.
        record.update(release_cached_memory())
        # Awake first, so the sync below loads the adapter at once and the wake-up is timed on its own.
        wake_start = time.perf_counter()
        self.engine.wake_up()
        wake_s += time.perf_counter() - wake_start
        sync_start = time.perf_counter()
        self._sync_engine()  # the adapter sync and the staleness probe
        record["time_sync_s"] = time.perf_counter() - sync_start
        record["time_sleep_s"] = sleep_s
        record["time_wake_s"] = wake_s
        record.update(self.engine.stats())  # the engine's state after the sync (staleness gap)
        record.update(self.peaks.metrics())
        record["time_step_s"] = time.perf_counter() - step_start
        return record


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def train(
    cfg: TrainConfig,
    resume: str | None = None,
    *,
    on_step: StepCallback | None = None,
    progress: bool = True,
    reward_fn: Any = None,
    overwrite: bool = False,
) -> TrainResult:
    """Run (or continue, with ``resume`` = a run dir or checkpoint dir) a training run.

    A fresh run (no ``resume``) refuses an ``output.dir`` that holds another run's results, unless
    ``overwrite``, which deletes them first (``rl.run_folder``); a start that fails leaves no empty
    output folder behind.

    Returns its summary: output dir, adapter path, steps, first/last-10-step reward means, the plot
    path and the last step's metrics. ``on_step(step, record)`` is called after each step's metrics
    (and checkpoint) are written; ``reward_fn`` overrides the recipe's reward (tests).

    Under torchrun every rank runs this function (see ``rl.distributed``); rank 0 alone writes the
    run's files, and every rank returns the same summary.
    """
    with run_folder(cfg.output.dir, resume=resume, overwrite=overwrite):
        return _train(cfg, resume, on_step=on_step, progress=progress, reward_fn=reward_fn)


def _train(
    cfg: TrainConfig, resume: str | None, *, on_step: StepCallback | None, progress: bool, reward_fn: Any
) -> TrainResult:
    out_dir = Path(cfg.output.dir)
    trainer = Trainer(cfg, reward_fn=reward_fn)
    dist = trainer.dist
    linear_backend = trainer.engine.linear_backend  # before close(): auto's choice, for the summary
    try:
        try:
            resumed_from = trainer.resume_from(resume) if resume else None
            trainer.calibrate_aqn()  # before the first step, with the initial adapter synced
            dist.on_main(lambda: step_loop.record_run(trainer, resumed_from), "record the run's settings")
            step_loop.run_steps(
                trainer,
                resume_step=trainer.step if resumed_from else None,
                on_step=on_step,
                progress=progress and dist.is_main,
            )
        finally:
            _close_reward(trainer.reward_fn)  # grader workers
            trainer.engine.close()  # a vLLM engine and its GPU memory
        adapter_dir = out_dir / ADAPTER_DIR
        plot = None
        if dist.is_main:
            # Staged and renamed whole: a run killed while writing it leaves no adapter/ without weights.
            with staged_folder(adapter_dir, existing="replace", staging=out_dir / ".adapter.tmp") as staging:
                trainer.policy.save_adapter(staging)
            records = read_metrics(out_dir / METRICS_FILE)
            plot = plot_training_curves(records, out_dir / "training_curves.png") if records else None
        dist.barrier()
        records = read_metrics(out_dir / METRICS_FILE)
    finally:
        # Whatever runs next in this process (qerl compare evaluates right here) builds its models
        # with transformers' own functions, not Liger's (modeling.fused_kernels).
        trainer.policy.close()
        dist.close()
    # A skipped step's batch may have had NaN rewards (read_metrics gives them back as floats): left out.
    rewards = present(r.get("reward_mean") for r in records)
    window = reward_window(len(rewards))
    return TrainResult(
        output_dir=str(out_dir),
        adapter=str(adapter_dir),
        steps=trainer.step,
        world_size=dist.world_size,
        resumed_from=str(resumed_from) if resumed_from else None,
        reward_first10=mean(rewards[:window]),
        reward_last10=mean(rewards[-window:]),
        reward_window=window,
        plot=str(plot) if plot else None,
        linear_backend=linear_backend,
        final=records[-1] if records else {},
        nonfinite_steps=sum(1 for r in records if r.get("nonfinite_loss") or r.get("nonfinite_grad")),
    )


def _close_reward(reward_fn: Any) -> None:
    """Stop a reward's grader workers; a plain function (or a test's stand-in) has none."""
    close = getattr(reward_fn, "close", None)
    if close is not None:
        close()
