"""The training data of a run: problems loaded once, rendered to prompts, and drawn in a seeded,
resumable order (:class:`PromptStream`), plus :func:`derive_seed`, the one way a run derives the
seed of any random choice from ``train.seed``.

The stream's ``position`` counts *global* prompts consumed: every data-parallel rank draws the same
prompts and keeps its own share, so a checkpoint's position means the same under any world size.
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

from qerl_cli.config import TrainConfig
from qerl_cli.data.datasets import load_problems
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import render_prompt
from qerl_cli.errors import QerlError
from qerl_cli.modeling.prompt_tokens import encode_prompts

log = logging.getLogger(__name__)


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

    texts = [
        render_prompt(p.question, tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt)
        for p in problems
    ]
    lengths = [len(ids) for ids in encode_prompts(texts, tokenizer)]  # as the engines tokenise them
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
