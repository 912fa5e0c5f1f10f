"""Format reward for the QeRL output shape ``<think>...</think><answer>...</answer>``."""

from __future__ import annotations

import re

# One think block, then one answer block, nothing but whitespace around them. NVlabs/QeRL's
# ``soft_format_reward_func`` searched for the pattern anywhere, so text after </answer> (or a second
# answer) still earned the reward; anchoring both ends closes that gap.
_FORMAT = re.compile(r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_think_answer_format(completion: str) -> bool:
    match = _FORMAT.fullmatch(completion)
    if match is None:
        return False
    # Exactly one of each tag, and a non-empty answer.
    return all(completion.count(tag) == 1 for tag in _TAGS) and bool(match.group("answer").strip())


def format_reward(completion: str) -> float:
    """1.0 for a well-formed ``<think>...</think><answer>...</answer>`` completion, else 0.0."""
    return 1.0 if has_think_answer_format(completion) else 0.0
