"""``qerl train``: GRPO / DAPO on LoRA adapters over a frozen 4-bit (or BF16) base, with AQN.

One training step:

1. **rollout**: AQN sigma for this step (``aqn`` schedule) goes to the engine, which samples
   ``num_generations`` completions for each of ``prompts_per_step`` prompts with the current adapter;
2. **reward**: correctness graded in killable worker processes (a hanging answer scores 0 after
   ``grader_timeout_s``), plus format and extra rewards, plus DAPO's overlong shaping if on. With
   dynamic sampling, groups whose rewards are all equal are dropped and more prompts are rolled
   out, up to ``max_sampling_rounds``;
3. **advantages**: group-relative, std-scaled or not;
4. **logprobs**: the trainer's own logprobs before the update (only needed for several updates
   per batch) and the reference's (adapters off, only with a KL term);
5. **update**: ``num_iterations`` optimizer steps on the batch, micro-batched, with the clipped
   surrogate, truncated importance sampling against the engine's logprobs when the rollout
   numerics differ from the trainer's, and gradient clipping.

Every random choice is a function of ``train.seed`` and the step (data order, rollout sampling,
AQN noise), or lives in an RNG whose state is checkpointed (dropout), so ``--resume`` reproduces the
uninterrupted run's next batch exactly.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_cli.config import RESOLVED_CONFIG_NAME, TrainConfig, save_resolved_config, to_dict
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError
from qerl_cli.files import ensure_output_dir
from qerl_cli.modeling.aqn import AQNSchedule
from qerl_cli.rl import checkpoint as ckpt
from qerl_cli.rl.advantages import group_advantages, group_reward_stats
from qerl_cli.rl.losses import NonFiniteLossError, policy_loss
from qerl_cli.rl.policy import (
    Policy,
    TokenBatch,
    batched_logprobs,
    build_policy,
    completion_logprobs,
    make_token_batch,
)
from qerl_cli.rl.sampling import DynamicSampler, overlong_penalty, truncation_mask
from qerl_cli.rl.tracking import MetricsLogger, plot_training_curves, read_metrics
from qerl_cli.rollout.base import Completion, RolloutEngine, SamplingSpec

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
PROMPTS_FILE = "prompt.json"
StepCallback = Callable[[int, dict[str, Any]], None]


# --------------------------------------------------------------------------------------------
# Data: a seeded, resumable stream of problems
# --------------------------------------------------------------------------------------------
class PromptStream:
    """Problems in epochs; epoch e is a permutation seeded by (seed, e). ``position`` (prompts
    consumed) is the whole state, so a resumed run draws exactly the next prompts."""

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool = True) -> None:
        if not problems:
            raise QerlError("the training set is empty")
        self.problems = problems
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch_cache: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = list(range(len(self.problems)))
            if self.shuffle:
                random.Random(f"qerl-data:{self.seed}:{epoch}").shuffle(order)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def take(self, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.problems))
            out.append(self.problems[self._order(epoch)[index]])
            self.position += 1
        return out


def derive_seed(seed: int, *parts: object) -> int:
    """A 31-bit seed that depends only on ``seed`` and ``parts`` (stable across processes)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def load_training_problems(cfg: TrainConfig) -> list[Problem]:
    from qerl_cli.data.datasets import load_problems

    data = cfg.data
    # Shuffling here only picks which max_samples problems are used; the order comes from PromptStream.
    return load_problems(
        data.dataset,
        split=data.split,
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        levels=data.levels,
        max_samples=data.max_samples,
        seed=cfg.train.seed,
        shuffle=True,
    )


def render_prompts(
    cfg: TrainConfig, problems: list[Problem], tokenizer: Any
) -> tuple[list[Problem], dict[str, str]]:
    """Chat-formatted prompts by problem id; problems whose prompt exceeds ``max_prompt_length``
    tokens are left out (truncating would cut the question)."""
    from qerl_cli.data.prompts import render_prompt

    texts = [
        render_prompt(p.question, tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt)
        for p in problems
    ]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    limit = cfg.rollout.max_prompt_length
    prompts: dict[str, str] = {}
    kept: list[Problem] = []
    for problem, text, length in zip(problems, texts, lengths, strict=True):
        if length <= limit:
            prompts[problem.id] = text
            kept.append(problem)
    dropped = len(problems) - len(kept)
    if not kept:
        raise QerlError(f"every prompt is longer than rollout.max_prompt_length={limit} tokens; raise it")
    if dropped:
        log.warning(
            "left out %d of %d problems whose prompt exceeds rollout.max_prompt_length=%d tokens",
            dropped,
            len(problems),
            limit,
        )
    return kept, prompts


# --------------------------------------------------------------------------------------------
# One step's rollouts
# --------------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """Completions of a step in group layout (``group_size`` consecutive rows per prompt)."""

    group_size: int
    problems: list[Problem] = field(default_factory=list)  # one per row
    prompt_ids: list[list[int]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def extend(self, other: Rollouts, rows: list[int] | None = None) -> None:
        rows = list(range(len(other.completions))) if rows is None else rows
        self.problems += [other.problems[i] for i in rows]
        self.prompt_ids += [other.prompt_ids[i] for i in rows]
        self.completions += [other.completions[i] for i in rows]
        self.rewards += [other.rewards[i] for i in rows]

    def __len__(self) -> int:
        return len(self.completions)


def rollout_stats(rollouts: Rollouts, max_completion_length: int) -> dict[str, float]:
    """Policy-side figures of every completion generated in a step."""
    lengths = [len(c.token_ids) for c in rollouts.completions]
    tokens = sum(lengths)
    logprob_sum = sum(sum(c.logprobs) for c in rollouts.completions)
    count = max(len(lengths), 1)
    return {
        # -E[log p] of sampled tokens: a Monte-Carlo estimate of the sampling policy's entropy.
        "entropy": -logprob_sum / tokens if tokens else 0.0,
        "completion_length_mean": tokens / count,
        "completion_length_max": float(max(lengths, default=0)),
        "truncation_rate": sum(c.finish_reason == "length" for c in rollouts.completions) / count,
        "max_completion_length": float(max_completion_length),
    }


def _weighted(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge per-micro-batch loss stats: sums for the loss, extremes for max/min, else weighted mean."""
    total = sum(w for w, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [(w, s[key]) for w, s in parts if key in s]
        if key in ("loss", "policy_loss"):
            merged[key] = sum(v for _, v in values)
        elif key.endswith("_max"):
            merged[key] = max(v for _, v in values)
        elif key.endswith("_min"):
            merged[key] = min(v for _, v in values)
        elif key == "num_tokens":
            merged[key] = sum(v for _, v in values)
        else:
            merged[key] = sum(w * v for w, v in values) / total
    return merged


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------
class Trainer:
    def __init__(
        self, cfg: TrainConfig, *, reward_fn: Any = None, engine: RolloutEngine | None = None
    ) -> None:
        self.cfg = cfg
        self.out_dir = ensure_output_dir(cfg.output.dir, "output.dir")
        _seed_everything(cfg.train.seed)
        self.policy: Policy = build_policy(cfg)
        self.device = self.policy.device
        problems = load_training_problems(cfg)
        self.problems, self.prompts = render_prompts(cfg, problems, self.policy.tokenizer)
        self.stream = PromptStream(self.problems, cfg.train.seed, cfg.data.shuffle)
        self.engine = engine or self._make_engine()
        self.params = self.policy.named_trainable_parameters()
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.params],
            lr=cfg.train.learning_rate,
            weight_decay=cfg.train.weight_decay,
            betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.schedule = self._make_aqn_schedule()
        self.tis_on = self._tis_enabled()
        if reward_fn is None:
            from qerl_cli.rewards import build_reward_fn

            reward_fn = build_reward_fn(cfg.reward)
        self.reward_fn = reward_fn
        self.step = 0

    # ---- construction helpers ----------------------------------------------------------------
    def _make_engine(self) -> RolloutEngine:
        from qerl_cli.rollout.factory import make_engine

        cfg = self.cfg
        if cfg.rollout.engine == "hf":
            return make_engine(
                "hf",
                cfg.model.path,
                model=self.policy.model,
                tokenizer=self.policy.tokenizer,
                device=self.device,
                generation_batch_size=cfg.rollout.generation_batch_size,
            )
        engine = make_engine(
            "vllm",
            cfg.model.path,
            dtype=cfg.model.dtype,
            model_format=cfg.model.format,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enable_sleep_mode=cfg.rollout.enable_sleep_mode,
            max_lora_rank=cfg.rollout.max_lora_rank,
            max_model_len=cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length,
            staleness_tolerance=cfg.rollout.staleness_tolerance,
            seed=cfg.train.seed,
            trust_remote_code=cfg.model.trust_remote_code,
            revision=cfg.model.revision,
            vllm_kwargs=dict(cfg.rollout.vllm_kwargs),
        )
        self._sync_engine(engine)
        return engine

    def _make_aqn_schedule(self) -> AQNSchedule | None:
        aqn = self.cfg.aqn
        if not aqn.enabled:
            return None
        return AQNSchedule(
            total_steps=self.cfg.train.max_steps,
            sigma_start=aqn.sigma_start,
            sigma_end=aqn.sigma_end,
            num_stages=aqn.num_stages,
            kind=aqn.schedule,
            first_stage_noise_free=aqn.first_stage_noise_free,
        )

    def _tis_enabled(self) -> bool:
        mode = self.cfg.algorithm.tis
        if mode != "auto":
            return mode == "on"
        # Rollout numerics differ from the trainer's forward: 4-bit base, AQN noise, or another engine.
        return self.policy.is_quantized or self.cfg.aqn.enabled or self.cfg.rollout.engine != "hf"

    def _sync_engine(self, engine: RolloutEngine | None = None) -> None:
        """Give a separate engine (vLLM) the current adapter; the HF engine shares the model."""
        engine = engine or self.engine
        from qerl_cli.rollout.hf import HFEngine

        if isinstance(engine, HFEngine):
            return
        sync = getattr(engine, "sync_peft_model", None)
        if sync is not None:
            sync(self.policy.model)
        else:
            path = self.out_dir / ".rollout_adapter"
            self.policy.save_adapter(path)
            engine.sync_adapter(str(path))
        check = getattr(engine, "check_staleness", None)
        if check is not None:  # prove the engine now samples from the policy being trained
            probe = self._probe_ids()
            check(probe, self._prompt_logprobs(probe))

    def _probe_ids(self, max_tokens: int = 128) -> list[int]:
        text = self.prompts[self.problems[0].id]
        return list(self.policy.tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]

    def _prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The trainer's log p(ids[i + 1] | ids[: i + 1]) at temperature 1, adapters on, no noise."""
        pad = int(self.policy.tokenizer.pad_token_id)
        batch = make_token_batch([ids[:1]], [ids[1:]], [[0.0] * (len(ids) - 1)], pad)
        return batched_logprobs(self.policy.model, batch, 1.0, self.device, 1)[0].tolist()

    # ---- resume -------------------------------------------------------------------------------
    def resume_from(self, path: str | Path) -> Path:
        found = ckpt.find_last_checkpoint(path)
        state = ckpt.load_checkpoint(
            found,
            optimizer=self.optimizer,
            param_names=[n for n, _ in self.params],
            scheduler=self.scheduler,
            load_adapter=self._load_adapter,
        )
        if state.step > self.cfg.train.max_steps:
            raise QerlError(
                f"{found} is at step {state.step}, beyond train.max_steps={self.cfg.train.max_steps}"
            )
        self.step = state.step
        self.stream.position = state.data_position
        if self.schedule is not None and state.aqn:
            self.schedule.load_state_dict(state.aqn)
        self._sync_engine()
        log.info("resumed from %s at step %d", found, self.step)
        return found

    def _load_adapter(self, folder: Path) -> None:
        from qerl_cli.rollout.hf import load_adapter_weights

        load_adapter_weights(self.policy.model, folder)

    def save(self) -> Path:
        state = ckpt.TrainingState(
            step=self.step,
            data_position=self.stream.position,
            aqn=self.schedule.state_dict() if self.schedule else None,
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
    def sampling_spec(self, round_index: int) -> SamplingSpec:
        r = self.cfg.rollout
        return SamplingSpec(
            max_new_tokens=r.max_completion_length,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=-1,
            seed=derive_seed(self.cfg.train.seed, "rollout", self.step, round_index),
        )

    def rollout_round(self, problems: list[Problem], round_index: int) -> tuple[Rollouts, dict[str, float]]:
        n = self.cfg.rollout.num_generations
        t0 = time.perf_counter()
        result = self.engine.generate(
            [self.prompts[p.id] for p in problems], n, self.sampling_spec(round_index)
        )
        t1 = time.perf_counter()
        rollouts = Rollouts(group_size=n)
        for i, completion in result.flat():
            rollouts.problems.append(problems[i])
            rollouts.prompt_ids.append(result.prompt_token_ids[i])
            rollouts.completions.append(completion)
        rewards, reward_stats = self.reward_fn([c.text for c in rollouts.completions], rollouts.problems)
        if self.cfg.algorithm.overlong_penalty:
            a = self.cfg.algorithm
            lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions])
            cache = min(a.overlong_cache_length, self.cfg.rollout.max_completion_length)
            shaping = overlong_penalty(
                lengths, self.cfg.rollout.max_completion_length, cache, a.overlong_penalty_factor
            )
            rewards = [r + float(s) for r, s in zip(rewards, shaping, strict=True)]
        rollouts.rewards = [float(r) for r in rewards]
        t2 = time.perf_counter()
        engine_stats = {k: v for k, v in result.stats.items() if k.startswith("aqn_") and k != "aqn_sigma"}
        stats = {
            **reward_stats,
            **engine_stats,
            "time_rollout_s": t1 - t0,
            "time_reward_s": t2 - t1,
            "rollout_tokens": float(result.num_generated_tokens),
        }
        return rollouts, stats

    def collect(self) -> tuple[Rollouts, Rollouts, dict[str, float]]:
        """(generated, kept for training, stats) of one step, with dynamic sampling if on."""
        cfg = self.cfg
        n = cfg.rollout.num_generations
        generated = Rollouts(group_size=n)
        kept = Rollouts(group_size=n)
        per_round: list[dict[str, float]] = []
        sampler = (
            DynamicSampler(cfg.train.prompts_per_step, n, cfg.algorithm.max_sampling_rounds)
            if cfg.algorithm.dynamic_sampling
            else None
        )
        round_index = 0
        while True:
            problems = self.stream.take(cfg.train.prompts_per_step)
            rollouts, stats = self.rollout_round(problems, round_index)
            per_round.append(stats)
            generated.extend(rollouts)
            round_index += 1
            if sampler is None:
                kept.extend(rollouts)
                break
            rows = sampler.add(torch.tensor(rollouts.rewards))
            kept.extend(rollouts, rows.tolist())
            if not sampler.needs_more:
                break
        stats = {
            # Every round rolls out the same number of prompts: the mean over rounds is the row mean.
            "accuracy": _mean([s.get("accuracy", 0.0) for s in per_round]),
            "format_rate": _mean([s.get("format_rate", 0.0) for s in per_round]),
            **{k: v for k, v in per_round[0].items() if k.startswith("aqn_")},
            "grader_timeouts": sum(s.get("grader_timeouts", 0.0) for s in per_round),
            "time_rollout_s": sum(s["time_rollout_s"] for s in per_round),
            "time_reward_s": sum(s["time_reward_s"] for s in per_round),
            "rollout_tokens": sum(s["rollout_tokens"] for s in per_round),
        }
        stats["rollout_tokens_per_s"] = stats["rollout_tokens"] / max(stats["time_rollout_s"], 1e-9)
        stats.update(group_reward_stats(torch.tensor(generated.rewards), n))
        stats.update(rollout_stats(generated, cfg.rollout.max_completion_length))
        if sampler is not None:
            stats.update(sampler.stats())
        return generated, kept, stats

    def update(self, batch: Rollouts) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        model, device = self.policy.model, self.device
        temperature = cfg.rollout.temperature
        micro = cfg.train.micro_batch_size
        pad = int(self.policy.tokenizer.pad_token_id)
        tokens = make_token_batch(
            batch.prompt_ids,
            [c.token_ids for c in batch.completions],
            [c.logprobs for c in batch.completions],
            pad,
        )
        advantages = group_advantages(
            torch.tensor(batch.rewards), batch.group_size, scale_by_std=cfg.algorithm.scale_rewards_by_std
        )
        mask = tokens.completion_mask
        if a.mask_truncated:
            mask = truncation_mask([c.finish_reason for c in batch.completions], mask)
        t0 = time.perf_counter()
        old_lp = batched_logprobs(model, tokens, temperature, device, micro) if a.num_iterations > 1 else None
        ref_lp = (
            batched_logprobs(model, tokens, temperature, device, micro, reference=self.policy)
            if a.beta > 0
            else None
        )
        t1 = time.perf_counter()
        normalizer = _normalizer(a.loss_type, mask, cfg.rollout.max_completion_length)
        model.train()
        parts: list[tuple[float, dict[str, float]]] = []
        grad_norms = []
        for _ in range(a.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for begin in range(0, tokens.size, micro):
                rows = slice(begin, begin + micro)
                part: TokenBatch = tokens.rows(rows)
                lp = completion_logprobs(model, part, temperature, device)
                old = old_lp[rows].to(device) if old_lp is not None else lp.detach()
                loss, stats = policy_loss(
                    lp,
                    old,
                    advantages[rows].to(device),
                    mask[rows].to(device),
                    loss_type=a.loss_type,
                    eps_low=a.eps_low,
                    eps_high=a.eps_high,
                    beta=a.beta,
                    ref_logprobs=ref_lp[rows].to(device) if ref_lp is not None else None,
                    rollout_logprobs=part.rollout_logprobs.to(device),
                    tis_cap=a.tis_cap if self.tis_on else None,
                    max_completion_length=cfg.rollout.max_completion_length,
                    normalizer=normalizer,
                )
                loss.backward()
                parts.append((stats.get("num_tokens", 0.0), stats))
            grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], cfg.train.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise NonFiniteLossError(f"the gradient norm is {grad_norm.item()}")
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
        t2 = time.perf_counter()
        merged = _weighted(parts) if parts else {}
        merged["grad_norm"] = sum(grad_norms) / len(grad_norms)
        merged["num_sequences"] = float(tokens.size)
        merged["time_logprobs_s"] = t1 - t0
        merged["time_update_s"] = t2 - t1
        if a.beta == 0:
            merged.pop("kl", None)  # no reference pass was run: there is no KL figure
        return merged

    def train_step(self) -> dict[str, Any]:
        step_start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sigma = self.schedule.sigma(self.step) if self.schedule is not None else 0.0
        self.engine.wake_up()
        perturbed = self.engine.set_norm_noise(sigma, derive_seed(self.cfg.train.seed, "aqn", self.step))
        generated, kept, stats = self.collect()
        self.engine.sleep()
        record: dict[str, Any] = {
            "step": self.step + 1,
            "lr": self.scheduler.get_last_lr()[0],
            "aqn_sigma": sigma,
            "aqn_perturbed_norms": float(perturbed),
            "data_position": self.stream.position,
            **stats,
        }
        if len(kept) == 0:
            log.warning(
                "step %d: no group with differing rewards after %d sampling rounds; no update",
                self.step + 1,
                self.cfg.algorithm.max_sampling_rounds,
            )
            record["skipped_update"] = 1.0
        else:
            record.update(self.update(kept))
            record["skipped_update"] = 0.0
        self.scheduler.step()
        self.step += 1
        self._sync_engine()
        if torch.cuda.is_available():
            record["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
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
) -> dict[str, Any]:
    """Run (or continue, with ``resume`` = a run dir or checkpoint dir) a training run.

    Returns a summary: output dir, adapter path, steps, first/last-10-step reward means, the plot
    path and the last step's metrics. ``on_step(step, record)`` is called after each step's metrics
    (and checkpoint) are written; ``reward_fn`` overrides the recipe's reward (tests).
    """
    out_dir = Path(cfg.output.dir)
    trainer = Trainer(cfg, reward_fn=reward_fn)
    try:
        resumed_from = trainer.resume_from(resume) if resume else None
        if resumed_from is not None:
            _warn_on_config_change(cfg, resumed_from.parent / RESOLVED_CONFIG_NAME)
        save_resolved_config(cfg, out_dir)
        _record_prompts(cfg, trainer, out_dir / PROMPTS_FILE)
        log.info(
            "policy: %s base, %d trainable tensors, TIS %s, AQN %s",
            trainer.policy.base_format,
            len(trainer.params),
            "on" if trainer.tis_on else "off",
            trainer.schedule.stage_sigmas() if trainer.schedule else "off",
        )
        _run_steps(
            trainer, resume_step=trainer.step if resumed_from else None, on_step=on_step, progress=progress
        )
    finally:
        for resource in (trainer.reward_fn, trainer.engine):  # grader workers, a vLLM engine
            close = getattr(resource, "close", None)
            if close is not None:
                close()
    adapter_dir = trainer.policy.save_adapter(out_dir / ADAPTER_DIR)
    records = read_metrics(out_dir / "metrics.jsonl")
    plot = plot_training_curves(records, out_dir / "training_curves.png") if records else None
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    return {
        "output_dir": str(out_dir),
        "adapter": str(adapter_dir),
        "steps": trainer.step,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "reward_first10": _mean(rewards[:10]),
        "reward_last10": _mean(rewards[-10:]),
        "plot": str(plot) if plot else None,
        "final": records[-1] if records else {},
    }


def _run_steps(
    trainer: Trainer, *, resume_step: int | None, on_step: StepCallback | None, progress: bool
) -> None:
    """The step loop: train, checkpoint every ``save_steps``, log, report."""
    cfg, out_dir = trainer.cfg, trainer.out_dir
    metrics = MetricsLogger(
        out_dir,
        resume_step=resume_step,
        tensorboard=cfg.output.tensorboard,
        wandb=cfg.output.wandb,
        wandb_project=cfg.output.wandb_project,
        run_config=to_dict(cfg),
    )
    try:
        with _progress(progress, cfg.train.max_steps, trainer.step) as bar:
            while trainer.step < cfg.train.max_steps:
                try:
                    record = trainer.train_step()
                except NonFiniteLossError as exc:
                    last = ckpt.list_checkpoints(out_dir)
                    raise QerlError(
                        f"training diverged at step {trainer.step + 1}: {exc}. Nothing was saved for this "
                        "step; "
                        + (f"the last good checkpoint is {last[-1][1]}. " if last else "")
                        + "Lower train.learning_rate or train.max_grad_norm, or check the data."
                    ) from exc
                if cfg.output.save_steps > 0 and trainer.step % cfg.output.save_steps == 0:
                    t0 = time.perf_counter()
                    trainer.save()
                    record["time_checkpoint_s"] = time.perf_counter() - t0
                metrics.log(record)
                bar(record)
                if on_step is not None:
                    on_step(trainer.step, record)
    finally:
        metrics.close()


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def _record_prompts(cfg: TrainConfig, trainer: Trainer, path: Path) -> None:
    """The prompt template of the run (shared with ``qerl eval``) and its first prompt, verbatim."""
    import json

    from qerl_cli.data.prompts import prompt_record

    record = prompt_record(cfg.data.template, cfg.data.system_prompt, trainer.policy.tokenizer)
    record["example"] = trainer.prompts[trainer.problems[0].id]
    path.write_text(json.dumps(record, indent=2))


def _warn_on_config_change(cfg: TrainConfig, saved: Path) -> None:
    """A resumed run continues exactly only with the settings it started with; say what changed."""
    if not saved.is_file():
        return
    import yaml

    before = yaml.safe_load(saved.read_text()) or {}
    now = to_dict(cfg)
    changed = [
        f"{section}.{key}: {before[section].get(key)!r} -> {value!r}"
        for section, values in now.items()
        if section != "output" and isinstance(values, dict) and isinstance(before.get(section), dict)
        for key, value in values.items()
        if before[section].get(key) != value
    ]
    if changed:
        log.warning("resuming with settings that differ from the run's %s: %s", saved, "; ".join(changed))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    warmup, total, kind = cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.lr_scheduler

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def _normalizer(loss_type: str, mask: torch.Tensor, max_completion_length: int) -> float:
    """The whole batch's denominator, so micro-batches add up to the full-batch loss."""
    if loss_type == "grpo":
        return float(max(1, int((mask.sum(dim=1) > 0).sum())))
    if loss_type == "dapo":
        return float(max(1.0, float(mask.sum())))
    return float(mask.shape[0] * max_completion_length)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _progress(enabled: bool, total: int, done: int) -> Any:
    """A context manager yielding ``update(record)``: a rich bar with ETA, or a no-op."""
    if not enabled:
        return nullcontext(lambda record: None)
    from contextlib import contextmanager

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    @contextmanager
    def bar():
        with Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
        ) as prog:
            task = prog.add_task("", total=total, completed=done)

            def update(record: dict[str, Any]) -> None:
                prog.update(
                    task,
                    advance=1,
                    description=(
                        f"reward {record.get('reward_mean', 0):.3f} acc {record.get('accuracy', 0):.3f} "
                        f"sigma {record.get('aqn_sigma', 0):.1e}"
                    ),
                )

            yield update

    return bar()
