"""The training reward: correctness (graded in the worker pool) + format + named extra functions.

``build_reward_fn(cfg.reward, **reward_settings(cfg.data))`` (``qerl_cli.data.prompts``) returns a callable
``(completions, problems) -> (rewards, stats)`` with
``reward = correctness_weight * correct + format_weight * format + sum(weight * fn(completion, problem))``
where each extra ``fn`` is named by import path in ``reward.extra`` (``{"pkg.mod:fn": 0.5}``).
Extra functions run in the trainer process: they are the user's own code, trusted to be quick.
:func:`resolve_extra_reward` imports one and checks that it can be called so; ``qerl train``'s checks
before the model loads (``rl.preflight``) run it too, so that a wrong signature is not first met at step 1.

``format`` (and the ``format_rate`` metric) checks the answer shape the run's prompt asks for
(:func:`qerl_cli.data.prompts.expected_answer_format`): the QeRL tags for the ``qerl`` template,
"The answer is N" for the few-shot one or a system prompt asking for it. Completions are cut at the
template's stop strings first, which one engine keeps at the end of the text and another drops.
"""

from __future__ import annotations

import inspect
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
# How the reward calls a reward.extra function, once per completion: what an error about one names.
EXTRA_SIGNATURE = "fn(completion: str, problem) -> float"


def resolve_extra_reward(path: str) -> ExtraRewardFn:
    """The ``reward.extra`` function ``path`` names (``"pkg.mod:fn"``), imported and checked to accept
    the call the reward makes, ``fn(completion, problem)``. A QerlError says what is wrong: without this,
    a wrong signature surfaced as a TypeError at the first step, after the model load and a rollout."""
    fn = resolve_callable(path)
    why = _call_problem(fn)
    if why is not None:
        name = path.rpartition(":")[2].rpartition(".")[2]
        raise QerlError(
            f"'{path}' {why}; the reward calls each reward.extra function once per completion as "
            f"{EXTRA_SIGNATURE}: define it as `def {name}(completion: str, problem) -> float` (completion: "
            "the generated text; problem: the dataset's problem, with .id, .question and .answer, the "
            "gold answer)"
        )
    return fn


def _call_problem(fn: Callable[..., object]) -> str | None:
    """Why ``fn(completion, problem)`` cannot give a number, as far as its signature tells; None when it can
    (or when it has no signature to read: a C function, checked by its first call as before)."""
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        return "is an async or generator function, whose call returns a coroutine or generator, not a number"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        # Placeholders: binding checks the arguments' count and kinds (positional, keyword-only)
        # without calling the user's code.
        signature.bind("completion", "problem")
    except TypeError as exc:
        # Shown without annotations: they do not decide the call, and under `from __future__ import
        # annotations` they print as quoted strings.
        bare = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        return f"has the signature {bare}, which cannot take (completion, problem): {exc}"
    return None


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
            (path, resolve_extra_reward(path), float(weight)) for path, weight in cfg.extra.items()
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
