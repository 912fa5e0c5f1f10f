"""The training reward: correctness (graded in the worker pool) + format + named extra functions.

``build_reward_fn(cfg.reward, **reward_settings(cfg.data))`` (``qerl_cli.data.prompts``) returns a callable
``(completions, problems) -> (rewards, stats)`` with
``reward = correctness_weight * correct + format_weight * format + sum(weight * fn(completion, problem))``
where each extra ``fn`` is named by import path in ``reward.extra`` (``{"pkg.mod:fn": 0.5}``).
Extra functions run in the trainer process: they are the user's own code, trusted to be quick.

``format`` (and the ``format_rate`` metric) checks the answer shape the run's prompt asks for
(:func:`qerl_cli.data.prompts.expected_answer_format`): the QeRL tags for the ``qerl`` template,
"The answer is N" for the few-shot one or a system prompt asking for it. Completions are cut at the
template's stop strings first, which one engine keeps at the end of the text and another drops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from qerl_cli.config import RewardSection
from qerl_cli.errors import QerlError
from qerl_cli.rewards.extract import cut_at_stop
from qerl_cli.rewards.format import AnswerFormat, format_reward
from qerl_cli.rewards.grading import GradeResult
from qerl_cli.rewards.pool import Grader, resolve_callable
from qerl_cli.stats import mean


class Problem(Protocol):
    """What grading needs of a problem (``data.problem.Problem`` has it). Rewards sit below data in
    the layers (datasets read gold answers with :mod:`qerl_cli.rewards.extract`), so they name
    the fields they read rather than import the dataclass."""

    @property
    def id(self) -> str: ...

    @property
    def answer(self) -> str: ...


ExtraRewardFn = Callable[[str, Problem], float]


class RewardFunction:
    """Callable reward with a grader pool inside; close it (or use ``with``) when done."""

    def __init__(
        self,
        cfg: RewardSection,
        grader: Grader | None = None,
        *,
        answer_format: AnswerFormat = "think_answer",
        stop: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.answer_format = answer_format
        self.stop = stop
        self.extras: list[tuple[str, ExtraRewardFn, float]] = [
            (path, resolve_callable(path), float(weight)) for path, weight in cfg.extra.items()
        ]
        # A grader passed in is shared: its owner closes it, not this reward.
        self._owns_grader = grader is None
        self.grader = grader or Grader(workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s)
        # Per-completion grades of the last call, for sample logging.
        self.last_grades: list[GradeResult] = []

    def __enter__(self) -> RewardFunction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_grader:
            self.grader.close()

    def __call__(
        self, completions: Sequence[str], problems: Sequence[Problem]
    ) -> tuple[list[float], dict[str, float]]:
        if len(completions) != len(problems):
            raise ValueError(f"{len(completions)} completions but {len(problems)} problems")
        completions = [cut_at_stop(c, self.stop) for c in completions]
        grades = self.grader.grade_many(completions, [p.answer for p in problems])
        formats = [format_reward(c, self.answer_format) for c in completions]
        rewards = [
            self.cfg.correctness_weight * float(g.correct) + self.cfg.format_weight * f
            for g, f in zip(grades, formats, strict=True)
        ]
        extra_means: dict[str, float] = {}
        for path, fn, weight in self.extras:
            values = [_call_extra(path, fn, c, p) for c, p in zip(completions, problems, strict=True)]
            rewards = [r + weight * v for r, v in zip(rewards, values, strict=True)]
            extra_means[f"reward/{path}"] = mean(values, empty=0.0)
        self.last_grades = grades
        count = max(len(grades), 1)
        stats = {
            "accuracy": sum(g.correct for g in grades) / count,
            "format_rate": sum(formats) / count,
            "grader_timeouts": float(sum(g.timed_out for g in grades)),
            "extraction_failures": float(sum(g.extraction_failed for g in grades)),
            "extraction_failure_rate": sum(g.extraction_failed for g in grades) / count,
            "reward_mean": mean(rewards, empty=0.0),
            **extra_means,
        }
        return rewards, stats


def _call_extra(path: str, fn: ExtraRewardFn, completion: str, problem: Problem) -> float:
    try:
        value = float(fn(completion, problem))
    except Exception as exc:
        raise QerlError(f"reward function '{path}' failed on problem {problem.id}: {exc!r}") from exc
    if not math.isfinite(value):
        raise QerlError(f"reward function '{path}' returned {value} on problem {problem.id}")
    return value


def build_reward_fn(
    reward_cfg: RewardSection,
    grader: Grader | None = None,
    *,
    answer_format: AnswerFormat = "think_answer",
    stop: tuple[str, ...] = (),
) -> RewardFunction:
    """The reward for ``cfg.reward``; pass ``grader`` to share a pool (or to test with a fake one).

    ``answer_format`` and ``stop``: what the run's prompt asks for and where its completions end
    (``qerl_cli.data.prompts.reward_settings(cfg.data)``); by default the QeRL ``<think>/<answer>`` format.
    """
    if reward_cfg.correctness_weight == 0 and reward_cfg.format_weight == 0 and not reward_cfg.extra:
        raise QerlError("every reward weight is 0: set reward.correctness_weight or reward.format_weight")
    return RewardFunction(reward_cfg, grader, answer_format=answer_format, stop=stop)
