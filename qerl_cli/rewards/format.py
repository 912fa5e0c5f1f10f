"""Format checks: does a completion end in the shape its prompt asked for?

Each prompt template names the format it asks for (:mod:`qerl_cli.data.prompts`); the format reward
and the ``format_rate`` metric check that one:

``think_answer``
    ``<think>...</think><answer>...</answer>`` and nothing else (the ``qerl`` template).
``boxed``
    a complete ``\\boxed{...}`` (the ``boxed`` template).
``answer_is``
    ends with "The answer is N" (the few-shot template, and a system prompt asking for it).
``any``
    any of these, or a bare short answer: the prompt asked for no particular shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from qerl_cli.rewards.extract import extract_last_boxed, looks_bare

AnswerFormat = Literal["think_answer", "boxed", "answer_is", "any"]

# One think block, then one answer block, nothing but whitespace around them. NVlabs/QeRL's
# ``soft_format_reward_func`` searched for the pattern anywhere, so text after </answer> (or a second
# answer) still earned the reward; anchoring both ends closes that gap.
_FORMAT = re.compile(r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# "... The answer is 72." as the last sentence: a short answer on the same line, then at most
# closing punctuation or markdown marks. "The answer is 72. Now, a harder one ..." does not end so.
_ANSWER_IS = re.compile(
    r"(?:^|[\s*_(])the[ \t]+(?:final[ \t]+)?answer[ \t]+is[ \t]*:?[ \t]*(?P<answer>[^\n]{1,40}?)[\s.!*_)]*$",
    re.IGNORECASE,
)


def has_think_answer_format(completion: str) -> bool:
    match = _FORMAT.fullmatch(completion)
    if match is None:
        return False
    # Exactly one of each tag, and a non-empty answer.
    return all(completion.count(tag) == 1 for tag in _TAGS) and bool(match.group("answer").strip())


def has_boxed_answer(completion: str) -> bool:
    return bool(extract_last_boxed(completion))


def ends_with_answer_is(completion: str) -> bool:
    match = _ANSWER_IS.search(completion.strip())
    return match is not None and bool(match.group("answer").strip(" .*_`$"))


def has_any_answer_format(completion: str) -> bool:
    return (
        has_think_answer_format(completion)
        or has_boxed_answer(completion)
        or ends_with_answer_is(completion)
        or looks_bare(completion)
    )


FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "think_answer": has_think_answer_format,
    "boxed": has_boxed_answer,
    "answer_is": ends_with_answer_is,
    "any": has_any_answer_format,
}


def has_answer_format(completion: str, answer_format: AnswerFormat = "think_answer") -> bool:
    return FORMAT_CHECKS[answer_format](completion)


def format_reward(completion: str, answer_format: AnswerFormat = "think_answer") -> float:
    """1.0 when the completion has the shape ``answer_format`` names (default: the QeRL tags), else 0.0."""
    return 1.0 if has_answer_format(completion, answer_format) else 0.0
