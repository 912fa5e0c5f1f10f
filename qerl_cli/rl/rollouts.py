"""One step's rollouts: sample completions, score them, and (DAPO) keep only informative groups.

:func:`collect` runs the rounds of a step: each round draws ``prompts_per_step`` prompts from the
stream, generates ``num_generations`` completions per prompt, and grades them (plus DAPO's overlong
shaping if on). Without dynamic sampling one round is the batch; with it, rounds repeat until
enough groups with differing rewards are kept, up to ``max_sampling_rounds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_cli.config import TrainConfig
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import get_template
from qerl_cli.rl.advantages import group_reward_stats
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.phase import ROLLOUT, in_phase
from qerl_cli.rl.sampling import DynamicSampler, overlong_penalty
from qerl_cli.rl.stream import PromptStream, derive_seed
from qerl_cli.rollout.base import (
    ADDITIVE_STATS,
    GENERATED_TOKENS,
    SECONDS,
    STATS_PREFIX,
    TOKENS_PER_S,
    Completion,
    RolloutEngine,
    SamplingSpec,
)
from qerl_cli.stats import mean


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


def sample_groups(rollouts: Rollouts, groups: int) -> list[dict[str, Any]]:
    """The first ``groups`` prompt groups as records for ``completions.jsonl``: the problem, its gold
    answer, and each completion's text, reward and finish reason (what the reward paid for)."""
    size = max(rollouts.group_size, 1)
    out = []
    for start in range(0, min(groups * size, len(rollouts)), size):
        rows = range(start, min(start + size, len(rollouts)))
        problem = rollouts.problems[start]
        out.append({
            "problem_id": problem.id, "question": problem.question, "gold": problem.answer,
            "completions": [rollouts.completions[i].text for i in rows],
            "rewards": [rollouts.rewards[i] for i in rows],
            "finish_reasons": [rollouts.completions[i].finish_reason for i in rows],
        })  # fmt: skip
    return out


def row_summary(rollouts: Rollouts) -> dict[str, list[float]]:
    """What the step's statistics and the dynamic sampler need of each row (small, to gather)."""
    return {
        "reward": list(rollouts.rewards),
        "length": [float(len(c.token_ids)) for c in rollouts.completions],
        "logprob_sum": [float(sum(c.logprobs)) for c in rollouts.completions],
        "truncated": [float(c.finish_reason == "length") for c in rollouts.completions],
    }


def completion_stats(rows: dict[str, list[float]], max_completion_length: int) -> dict[str, float]:
    lengths = rows["length"]
    tokens = sum(lengths)
    count = max(len(lengths), 1)
    return {
        # -E[log p] of sampled tokens: a Monte-Carlo estimate of the sampling policy's entropy.
        "entropy": -sum(rows["logprob_sum"]) / tokens if tokens else 0.0,
        "completion_length_mean": tokens / count,
        "completion_length_max": float(max(lengths, default=0)),
        "truncation_rate": sum(rows["truncated"]) / count,
        "max_completion_length": float(max_completion_length),
    }


def sampling_spec(
    cfg: TrainConfig, step: int, round_index: int, rank: int = 0, world_size: int = 1
) -> SamplingSpec:
    """Sampling of one round. The seed is a function of (seed, step, round) and, with several
    ranks, the rank, so ranks sample differently yet a run is reproducible; a single process keeps
    the seeds it always had."""
    r = cfg.rollout
    parts: tuple[object, ...] = (step, round_index)
    if world_size > 1:
        parts += ("rank", rank)
    return SamplingSpec(
        max_new_tokens=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=-1,
        seed=derive_seed(cfg.train.seed, "rollout", *parts),
        stop=get_template(cfg.data.template).stop,  # a few-shot prompt ends where the next example starts
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
    with in_phase(ROLLOUT):  # what a GPU watcher sees now is the rollout's work
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
    stats = {
        **reward_stats,
        **result.stats,  # every engine figure (rollout/...) reaches the step's metrics
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
    dist: Distributed | None = None,
) -> tuple[Rollouts, Rollouts, dict[str, float]]:
    """(generated, kept for training, stats) of one step, with dynamic sampling if on.

    With several ranks, ``generated`` and ``kept`` are this rank's rows; the stats and the dynamic
    sampler's choices are those of the whole step (every rank's rows, gathered in rank order).
    """
    dist = dist or Distributed()
    n = cfg.rollout.num_generations
    generated = Rollouts(group_size=n)
    kept = Rollouts(group_size=n)
    per_round: list[dict[str, float]] = []
    everything: dict[str, list[float]] = {}
    sampler = (
        DynamicSampler(cfg.train.prompts_per_step, n, cfg.algorithm.max_sampling_rounds)
        if cfg.algorithm.dynamic_sampling
        else None
    )
    round_index = 0
    while True:
        problems = stream.take(cfg.train.prompts_per_step)  # the same prompts on every rank
        mine = problems[dist.shard(len(problems))]  # whole prompts: every group lives on one rank
        spec = sampling_spec(cfg, step, round_index, dist.rank, dist.world_size)
        rollouts, stats = rollout_round(cfg, engine, reward_fn, prompts, mine, spec)
        gathered = dist.all_gather_object((row_summary(rollouts), stats))
        per_round.append(_merge_round([s for _, s in gathered], [len(r["reward"]) for r, _ in gathered]))
        rows_of_round = {k: [v for r, _ in gathered for v in r[k]] for k in gathered[0][0]}
        for key, values in rows_of_round.items():
            everything.setdefault(key, []).extend(values)
        generated.extend(rollouts)
        round_index += 1
        if sampler is None:
            kept.extend(rollouts)
            break
        chosen = sampler.add(torch.tensor(rows_of_round["reward"])).tolist()  # global row indices
        offset = sum(len(r["reward"]) for r, _ in gathered[: dist.rank])
        kept.extend(rollouts, [i - offset for i in chosen if offset <= i < offset + len(rollouts)])
        if not sampler.needs_more:
            break
    stats = {
        # Every round rolls out the same number of prompts: the mean over rounds is the row mean.
        "accuracy": mean([s.get("accuracy", 0.0) for s in per_round]),
        "format_rate": mean([s.get("format_rate", 0.0) for s in per_round]),
        **engine_stats(per_round, add=sum),
        "grader_timeouts": sum(s.get("grader_timeouts", 0.0) for s in per_round),
        "time_rollout_s": sum(s["time_rollout_s"] for s in per_round),
        "time_reward_s": sum(s["time_reward_s"] for s in per_round),
        "rollout_tokens": sum(s["rollout_tokens"] for s in per_round),
    }
    stats["rollout_tokens_per_s"] = stats["rollout_tokens"] / max(stats["time_rollout_s"], 1e-9)
    if dist.enabled:
        stats["rollout_tokens_per_s_per_rank"] = stats["rollout_tokens_per_s"] / dist.world_size
    stats.update(group_reward_stats(torch.tensor(everything["reward"]), n))
    stats.update(completion_stats(everything, cfg.rollout.max_completion_length))
    if sampler is not None:
        stats.update(sampler.stats())
    return generated, kept, stats


def _merge_round(stats: list[dict[str, float]], rows: list[int]) -> dict[str, float]:
    """One round's stats over ranks: row-weighted means of the reward function's rates, sums of
    counts, the slowest rank's seconds (the step waits for it), rank 0's AQN figures (same noise)."""
    if len(stats) == 1:
        return stats[0]
    total = sum(rows) or 1
    merged = {**stats[0], **engine_stats(stats, add=sum, seconds=max)}
    for key in ("accuracy", "format_rate"):
        if key in stats[0]:
            merged[key] = sum(s.get(key, 0.0) * r for s, r in zip(stats, rows, strict=True)) / total
    for key in ("grader_timeouts", "rollout_tokens"):
        merged[key] = sum(s.get(key, 0.0) for s in stats)
    for key in ("time_rollout_s", "time_reward_s"):
        merged[key] = max(s[key] for s in stats)
    return merged


def engine_stats(
    parts: list[dict[str, float]],
    *,
    add: Callable[[list[float]], float],
    seconds: Callable[[list[float]], float] | None = None,
) -> dict[str, float]:
    """The engine's figures (``rollout/...``) of several rounds or ranks as one: counts combined by
    ``add``, seconds by ``seconds`` (default ``add``), tokens/s recomputed from the two, and every
    other figure (noise sigma, changed fraction, LoRA id: the same everywhere) from the first part."""
    merged = {k: v for k, v in parts[0].items() if k.startswith(STATS_PREFIX)}
    for key in ADDITIVE_STATS:
        values = [p[key] for p in parts if key in p]
        if values:
            merged[key] = (seconds or add)(values) if key == SECONDS else add(values)
    if TOKENS_PER_S in merged and merged.get(SECONDS):
        merged[TOKENS_PER_S] = merged.get(GENERATED_TOKENS, 0.0) / merged[SECONDS]
    return merged
