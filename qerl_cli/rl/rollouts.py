"""One step's rollouts: sample completions, score them, and (DAPO) keep only informative groups.

:func:`collect` runs the rounds of a step: each round draws ``prompts_per_step`` prompts from the
stream, generates ``num_generations`` completions per prompt, and grades them (plus DAPO's overlong
shaping if on). Without dynamic sampling one round is the batch; with it, rounds repeat until
enough groups with differing rewards are kept, up to ``max_sampling_rounds``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_cli.config import TrainConfig
from qerl_cli.data.problem import Problem
from qerl_cli.rl.advantages import group_reward_stats
from qerl_cli.rl.sampling import DynamicSampler, overlong_penalty
from qerl_cli.rl.stream import PromptStream, derive_seed
from qerl_cli.rollout.base import Completion, RolloutEngine, SamplingSpec


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


def sampling_spec(cfg: TrainConfig, step: int, round_index: int) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(
        max_new_tokens=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=-1,
        seed=derive_seed(cfg.train.seed, "rollout", step, round_index),
    )


def rollout_round(
    cfg: TrainConfig,
    engine: RolloutEngine,
    reward_fn: Any,
    prompts: dict[str, str],
    problems: list[Problem],
    spec: SamplingSpec,
) -> tuple[Rollouts, dict[str, float]]:
    """Generate and grade one round: ``num_generations`` completions for each of ``problems``."""
    n = cfg.rollout.num_generations
    t0 = time.perf_counter()
    result = engine.generate([prompts[p.id] for p in problems], n, spec)
    t1 = time.perf_counter()
    rollouts = Rollouts(group_size=n)
    for i, completion in result.flat():
        rollouts.problems.append(problems[i])
        rollouts.prompt_ids.append(result.prompt_token_ids[i])
        rollouts.completions.append(completion)
    rewards, reward_stats = reward_fn([c.text for c in rollouts.completions], rollouts.problems)
    if cfg.algorithm.overlong_penalty:
        a = cfg.algorithm
        lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions])
        cache = min(a.overlong_cache_length, cfg.rollout.max_completion_length)
        limit = cfg.rollout.max_completion_length
        shaping = overlong_penalty(lengths, limit, cache, a.overlong_penalty_factor)
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


def collect(
    cfg: TrainConfig,
    engine: RolloutEngine,
    reward_fn: Any,
    prompts: dict[str, str],
    stream: PromptStream,
    step: int,
) -> tuple[Rollouts, Rollouts, dict[str, float]]:
    """(generated, kept for training, stats) of one step, with dynamic sampling if on."""
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
        problems = stream.take(cfg.train.prompts_per_step)
        spec = sampling_spec(cfg, step, round_index)
        rollouts, stats = rollout_round(cfg, engine, reward_fn, prompts, problems, spec)
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


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
